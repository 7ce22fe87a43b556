// Device-side building blocks of the row-wise CUDA kernels (token_logprobs_cuda.cu, full_kl_cuda.cu): one
// block of kRowThreads threads per row of the vocabulary, rows taken in a grid-stride loop (int64 rows, any
// count: no grid-dimension limit), and block-wide reductions in a fixed order (deterministic: no atomics, the
// same bits on every run). Header-only and internal to the .cu files (an anonymous namespace per unit).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/row_math.h"  // with_logits_dtype
#include "cuda/launch.cuh"

namespace kl {
namespace {

constexpr int kRowThreads = 256;
constexpr int kRowWarps = kRowThreads / 32;
// Entries a thread adds in float before its float64 sums (per pass: kRowChunk strides of kRowThreads):
// the float partial sums stay short, as the CPU kernels' 256-entry spans do.
constexpr int kRowChunk = 8;
// Blocks of a row launch: each loops over rows r = blockIdx.x, + gridDim.x, ... Far above the blocks an
// H100 keeps resident (132 SMs x 8), far below grid x's 2^31 - 1. Under the host emulation 3, so that the
// tests' small batches already take the loop: a block's later rows reuse its shared memory after the
// barriers of the earlier ones, which a missing barrier would corrupt (the code is the same; only the count).
#if defined(KL_CUDA_EMULATED)
constexpr int64_t kMaxRowBlocks = 3;
#else
constexpr int64_t kMaxRowBlocks = 65536;
#endif

inline unsigned row_blocks(int64_t rows) { return static_cast<unsigned>(rows < kMaxRowBlocks ? rows : kMaxRowBlocks); }

// Launch kernel_of(dt), the row kernel instantiated for the logits dtype (dt: a std::integral_constant of
// its code), over a.rows rows on `stream`: 0 (nothing to launch without rows), 1 for an unsupported dtype,
// else the launch's status (launch.cuh).
template <class Args, class KernelOf>
int launch_rows(const Args& a, uintptr_t stream, KernelOf kernel_of) {
  if (a.rows <= 0) return 0;
  int status = 0;
  const int bad = with_logits_dtype(a.dtype, [&](auto dt) {
    status = launch_status(launch(kernel_of(dt), row_blocks(a.rows), kRowThreads, 0,
                                  reinterpret_cast<cudaStream_t>(stream), a));
  });
  return bad ? 1 : status;
}

// The block-wide max of each of v[0..K) (NaN never enters: a comparison with NaN keeps the old value),
// returned to every thread. `sm` is shared [K][kRowWarps]; ends with a barrier, so it can be reused.
template <int K>
__device__ __forceinline__ void block_max(float (&v)[K], float (&sm)[K][kRowWarps]) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int k = 0; k < K; ++k) {
    for (int d = 16; d > 0; d >>= 1) {
      const float o = __shfl_xor_sync(0xffffffffu, v[k], d);
      v[k] = o > v[k] ? o : v[k];
    }
    if (lane == 0) sm[k][warp] = v[k];
  }
  __syncthreads();
#pragma unroll
  for (int k = 0; k < K; ++k) {
    float m = sm[k][0];
    for (int w = 1; w < kRowWarps; ++w) m = sm[k][w] > m ? sm[k][w] : m;
    v[k] = m;
  }
  __syncthreads();
}

// The block-wide sums of v[0..K) (float64), in one fixed order (a butterfly within each warp, then the
// warps' sums in warp order), returned to every thread. `sm` is shared [K][kRowWarps]; ends with a barrier.
template <int K>
__device__ __forceinline__ void block_sum(double (&v)[K], double (&sm)[K][kRowWarps]) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int k = 0; k < K; ++k) {
    for (int d = 16; d > 0; d >>= 1) v[k] += __shfl_xor_sync(0xffffffffu, v[k], d);
    if (lane == 0) sm[k][warp] = v[k];
  }
  __syncthreads();
#pragma unroll
  for (int k = 0; k < K; ++k) {
    double s = sm[k][0];
    for (int w = 1; w < kRowWarps; ++w) s += sm[k][w];
    v[k] = s;
  }
  __syncthreads();
}

}  // namespace
}  // namespace kl
