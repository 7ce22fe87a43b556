// Reading a Python list of per-sequence torch tensors for the CPU kl_reward kernel, which reads
// them in place (one address per sequence) instead of packing them with torch.cat.
#pragma once

#include <pybind11/pybind11.h>

namespace kl {

// See tensor_lists.cpp.
pybind11::object sequence_facts(pybind11::handle tensors, pybind11::handle tensor_type, bool trailing_one,
                                pybind11::handle like, bool reject_grad, bool exchange);

// (major, minor) of the DLPack exchange table sequence_facts uses for `tensor_type`, or None when
// the type has no usable one (then every tensor is read through its Python attributes).
pybind11::object exchange_api_version(pybind11::handle tensor_type);

}  // namespace kl
