// tensordict's private attributes, read by the C walk over a lazy stack's samples
// (cpu/tensordict_samples.cpp): a TensorDict's own entry dict (`_tensordict`) and its lock flag
// (`_is_locked`, behind the `is_locked` property). The version gate is Python's:
// kl_kernels/_compat/tensordict.py probes them once at import (SUPPORTED, checked on tensordict
// 0.14.x) and kl_kernels/torchrl/_io.py calls the walk only when they hold; without them it takes
// tensordict's public API (tests/test_compat.py runs that fallback).
#pragma once

namespace kl {
namespace compat {

constexpr const char* kTensorDictEntries = "_tensordict";
constexpr const char* kTensorDictLocked = "_is_locked";

}  // namespace compat
}  // namespace kl
