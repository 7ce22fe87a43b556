// Value checks of the ragged geometry on the device (see ragged_checks.h). One block of kThreads:
// thread i looks at b = i, i + kThreads, ..., then a fixed tree ORs the threads' findings; ok is an
// int32 (1: valid). Reads only [0, B] of offsets and [0, B) of lengths, whatever their values.
// Replaces torch's six small launches (two compares, two ands, a compare over the row, an all) per
// check of an eager call: the H200 runs measured every GPU call host-bound.
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/launch.cuh"
#include "cuda/ragged_checks.h"
#include "cuda/tiles.cuh"

namespace kl {
namespace {

__device__ __forceinline__ void write_ok(int bad, int* any_bad, int32_t* ok) {
  any_bad[threadIdx.x] = bad;
  __syncthreads();
  for (int half = kThreads / 2; half > 0; half >>= 1) {
    if (static_cast<int>(threadIdx.x) < half) any_bad[threadIdx.x] |= any_bad[threadIdx.x + half];
    __syncthreads();
  }
  if (threadIdx.x == 0) *ok = any_bad[0] ? 0 : 1;
}

__global__ void __launch_bounds__(kThreads) offsets_valid(const int64_t* off, int64_t batch, int64_t total,
                                                          int32_t* ok) {
  __shared__ int any_bad[kThreads];
  int bad = 0;
  for (int64_t b = threadIdx.x; b < batch; b += kThreads) bad |= off[b + 1] < off[b] ? 1 : 0;
  if (threadIdx.x == 0) bad |= (off[0] != 0 || off[batch] != total) ? 1 : 0;
  write_ok(bad, any_bad, ok);
}

__global__ void __launch_bounds__(kThreads) lengths_valid(const int64_t* len, int64_t batch, int64_t width,
                                                          const int64_t* off, const int64_t* seq_len, int32_t* ok) {
  __shared__ int any_bad[kThreads];
  int bad = 0;
  for (int64_t b = threadIdx.x; b < batch; b += kThreads) {
    const int64_t hi = off ? off[b + 1] - off[b] : seq_len ? seq_len[b] : width;
    bad |= (len[b] < 0 || len[b] > hi) ? 1 : 0;
  }
  write_ok(bad, any_bad, ok);
}

}  // namespace

int kl_offsets_valid_cuda(uintptr_t offsets, int64_t batch, int64_t total, uintptr_t ok, uintptr_t stream) {
  return launch_status(launch(offsets_valid, 1, kThreads, 0, reinterpret_cast<cudaStream_t>(stream),
                              reinterpret_cast<const int64_t*>(offsets), batch, total, reinterpret_cast<int32_t*>(ok)));
}

int kl_lengths_valid_cuda(uintptr_t lengths, int64_t batch, int64_t width, uintptr_t offsets, uintptr_t seq_lengths,
                          uintptr_t ok, uintptr_t stream) {
  return launch_status(launch(lengths_valid, 1, kThreads, 0, reinterpret_cast<cudaStream_t>(stream),
                              reinterpret_cast<const int64_t*>(lengths), batch, width,
                              reinterpret_cast<const int64_t*>(offsets), reinterpret_cast<const int64_t*>(seq_lengths),
                              reinterpret_cast<int32_t*>(ok)));
}

}  // namespace kl
