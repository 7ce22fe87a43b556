// Value checks of the ragged geometry on the device (see ragged_checks.h). One block of kThreads:
// thread i looks at b = i, i + kThreads, ..., keeps its first finding in the host checks' order (offsets:
// start, then a decrease, then the end; lengths: below 0, then above the bound), then a fixed tree takes
// the block's first, which thread 0 records in the device error word (cuda/errors.cuh): no assert, the
// CUDA context survives, the host raises the ValueError at its next call. Reads only [0, B] of offsets and
// [0, B) of lengths, whatever their values. One launch where torch operations took six per check.
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "common/codes.h"
#include "cuda/errors.cuh"
#include "cuda/launch.cuh"
#include "cuda/ragged_checks.h"
#include "cuda/tiles.cuh"

namespace kl {
namespace {

// A finding as a key, rank * (batch + 2) + index (earlier rank first, then lower index): the smaller of it and `key`.
__device__ __forceinline__ int64_t first_key(int64_t key, int64_t rank, int64_t index, int64_t batch) {
  const int64_t k = rank * (batch + 2) + index;
  return k < key ? k : key;
}

__global__ void __launch_bounds__(kThreads) offsets_valid(const int64_t* off, int64_t batch, int64_t total,
                                                          uintptr_t errors, int32_t arg) {
  __shared__ int64_t keys[kThreads];
  int64_t key = kNoCheckFinding;
  if (threadIdx.x == 0 && off[0] != 0) key = first_key(key, 0, 0, batch);
  for (int64_t b = threadIdx.x; b < batch; b += kThreads)
    if (off[b + 1] < off[b]) key = first_key(key, 1, b + 1, batch);
  if (threadIdx.x == 0 && off[batch] != total) key = first_key(key, 2, batch, batch);
  key = block_first(key, keys);
  if (threadIdx.x != 0 || key == kNoCheckFinding) return;
  const int64_t rank = key / (batch + 2), index = key % (batch + 2);
  const int32_t kind = rank == 0 ? kErrOffsetsStart : rank == 1 ? kErrOffsetsDecreasing : kErrOffsetsEnd;
  record_value_error(errors, kind, arg, index, off[index], total);
}

__global__ void __launch_bounds__(kThreads) lengths_valid(const int64_t* len, int64_t batch, int64_t width,
                                                          const int64_t* off, const int64_t* seq_len,
                                                          uintptr_t errors, int32_t arg, int32_t bound_kind) {
  __shared__ int64_t keys[kThreads];
  int64_t key = kNoCheckFinding;
  for (int64_t b = threadIdx.x; b < batch; b += kThreads) {
    const int64_t hi = off ? off[b + 1] - off[b] : seq_len ? seq_len[b] : width;
    if (len[b] < 0) key = first_key(key, 0, b, batch);
    if (len[b] > hi) key = first_key(key, 1, b, batch);
  }
  key = block_first(key, keys);
  if (threadIdx.x != 0 || key == kNoCheckFinding) return;
  const int64_t rank = key / (batch + 2), b = key % (batch + 2);
  const int64_t hi = off ? off[b + 1] - off[b] : seq_len ? seq_len[b] : width;
  // lengths against the width; prompt_lens against their sequence (bound_kind >= 0: SEQUENCE_BOUNDS' index)
  const int32_t above = bound_kind < 0 ? kErrAboveBound : kErrAboveSequence;
  record_value_error(errors, rank == 0 ? kErrBelowZero : above, arg, b, len[b], hi, bound_kind < 0 ? 0 : bound_kind);
}

}  // namespace

int kl_offsets_valid_cuda(uintptr_t offsets, int64_t batch, int64_t total, uintptr_t errors, int32_t arg,
                          uintptr_t stream) {
  return launch_status(launch(offsets_valid, 1, kThreads, 0, reinterpret_cast<cudaStream_t>(stream),
                              reinterpret_cast<const int64_t*>(offsets), batch, total, errors, arg));
}

int kl_lengths_valid_cuda(uintptr_t lengths, int64_t batch, int64_t width, uintptr_t offsets, uintptr_t seq_lengths,
                          uintptr_t errors, int32_t arg, int32_t bound_kind, uintptr_t stream) {
  return launch_status(launch(lengths_valid, 1, kThreads, 0, reinterpret_cast<cudaStream_t>(stream),
                              reinterpret_cast<const int64_t*>(lengths), batch, width,
                              reinterpret_cast<const int64_t*>(offsets), reinterpret_cast<const int64_t*>(seq_lengths),
                              errors, arg, bound_kind));
}

void kl_error_word_alloc(int device, uintptr_t* host, uintptr_t* dev) {
  *host = 0;
  *dev = 0;
  const size_t bytes = sizeof(int64_t) * kErrorWordSlots;
#if defined(KL_CUDA_EMULATED)
  (void)device;  // device memory is host memory
  void* p = std::calloc(1, bytes);
  *host = *dev = reinterpret_cast<uintptr_t>(p);
#else
  int previous = 0;
  if (cudaGetDevice(&previous) != cudaSuccess || cudaSetDevice(device) != cudaSuccess) {
    (void)cudaGetLastError();
    return;
  }
  void* p = nullptr;
  void* d = nullptr;
  // mapped: kernels write it through the device pointer; portable: every context sees it
  if (cudaHostAlloc(&p, bytes, cudaHostAllocMapped | cudaHostAllocPortable) == cudaSuccess) {
    std::memset(p, 0, bytes);
    if (cudaHostGetDevicePointer(&d, p, 0) == cudaSuccess) {
      *host = reinterpret_cast<uintptr_t>(p);
      *dev = reinterpret_cast<uintptr_t>(d);
    } else {
      (void)cudaFreeHost(p);
    }
  }
  (void)cudaGetLastError();  // a failure is reported by the (0, 0) result, not left for a later launch
  (void)cudaSetDevice(previous);
#endif
}

}  // namespace kl
