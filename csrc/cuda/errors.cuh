// The device error word (kl_kernels/device_errors.py): a kernel that finds a bad value records it here,
// never asserts, so the CUDA context survives and the host raises the ValueError at its next call.
// kErrorWordSlots int64 in host-mapped memory (cudaHostAlloc, mapped: every write goes to the host).
// First error wins: an integer atomicCAS claims the word; the winner writes its findings, fences them
// system-wide, and writes the kind last, which is what the host polls. Deterministic results are not
// at stake: no float is accumulated, and which of several bad values is reported is all that varies.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/codes.h"

namespace kl {
namespace {

__device__ __forceinline__ void record_value_error(uintptr_t word, int32_t kind, int32_t arg, int64_t index,
                                                   int64_t value, int64_t bound, int64_t extra = 0) {
  if (!word) return;
  unsigned long long* w = reinterpret_cast<unsigned long long*>(word);
  if (atomicCAS(w + kSlotClaim, 0ull, 1ull) != 0ull) return;  // an earlier error holds it
  volatile int64_t* v = reinterpret_cast<volatile int64_t*>(word);
  v[kSlotArg] = arg;
  v[kSlotIndex] = index;
  v[kSlotValue] = value;
  v[kSlotBound] = bound;
  v[kSlotExtra] = extra;
  __threadfence_system();  // the findings reach the host before the kind that announces them
  v[kSlotKind] = kind;
}

// Index values clamped into [lo, hi]: what every read of offsets / lengths derives indices from, so that
// the kernels stay memory-safe under any value (the value itself is checked and reported separately).
__device__ __forceinline__ int64_t clamp_index(int64_t v, int64_t lo, int64_t hi) {
  return v < lo ? lo : (v > hi ? hi : v);
}

}  // namespace
}  // namespace kl
