// Device-side building blocks of the row-wise CUDA kernels (token_logprobs_cuda.cu, full_kl_cuda.cu): one
// block of kRowThreads threads per row of the vocabulary, rows taken in a grid-stride loop (int64 rows, any
// count: no grid-dimension limit), and block-wide reductions in a fixed order (deterministic: no atomics, the
// same bits on every run). Header-only and internal to the .cu files (an anonymous namespace per unit).
//
// How a kernel walks a row (RowSplit): the entries before the row's first 16-byte boundary (the head, < 8),
// then whole 8-entry vectors, each read (and written) with 128-bit accesses (one for 16-bit logits, two for
// fp32), then the rest (the tail, < 8). Thread t takes vectors t, t + kRowThreads, ... (each warp a contiguous
// 512-byte run per access: coalesced), kRowVecs of them per step, all loaded before any is used; head entry t
// and tail entry t (at most two scalar entries a thread). The kernels are bound by instructions, not bytes
// (H200, bench/results/gpu-h200-2026-11-28: 50 instructions per bf16 entry predicted the measured 1.77 ms
// forward): per entry the walk costs no index arithmetic and no bound check, only the vector's.
#pragma once

#include <cuda_runtime.h>

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "common/kl_math.h"   // BitsOf, from_bits, to_bits
#include "common/row_math.h"  // with_logits_dtype
#include "cuda/launch.cuh"

namespace kl {
namespace {

constexpr int kRowThreads = 256;
constexpr int kRowWarps = kRowThreads / 32;
// Entries of a vector: 16 bytes of bf16/fp16 (LDG.E.128), 32 of fp32 (two).
constexpr int kRowVec = 8;
// Vectors a thread loads per step from each of `Streams` rows, before it uses them: 32 bytes in flight per
// thread (with 4 or more blocks of 256 threads per SM, ~32 KB an SM, above the ~22 KB that keep an H100's HBM
// busy; more would cost registers: occupancy). A step's terms are added in float before the float64 sums, so
// the float partial sums stay short (16 entries at most).
template <class Bits, int Streams = 1>
constexpr int kRowVecs = Streams == 1 && sizeof(Bits) == 2 ? 2 : 1;

template <class Bits>
struct alignas(16) RowPack {
  Bits v[kRowVec];
};

// The walk of a row of V entries starting at `row` (see the top of this file).
struct RowSplit {
  int64_t vecs;     // whole vectors, the first at entry `head`
  int head, tail;   // scalar entries before them and after them
  int phase;        // the row's address mod 16: a second row with the same phase has the same split
};
template <class Bits>
__device__ __forceinline__ RowSplit row_split(const Bits* row, int64_t V) {
  const int phase = static_cast<int>(reinterpret_cast<uintptr_t>(row) & 15u);
  const int64_t h = ((16 - phase) & 15) / static_cast<int>(sizeof(Bits));  // a Bits-aligned row: exact
  const int64_t head = h < V ? h : V;
  const int64_t vecs = (V - head) / kRowVec;
  return {vecs, static_cast<int>(head), static_cast<int>(V - head - vecs * kRowVec), phase};
}

// The row's entry of this thread's scalar entry k (0: the head's entry t, 1: the tail's entry t), or -1.
__device__ __forceinline__ int64_t row_scalar_entry(const RowSplit& s, int k) {
  const int t = static_cast<int>(threadIdx.x);
  if (k == 0) return t < s.head ? t : -1;
  return t < s.tail ? s.head + s.vecs * kRowVec + t : -1;
}

// The 8 entries of vector `vi` of a row (p: its first entry, the split's head) as floats times `scale`:
// 128-bit loads where `aligned` (p 16-byte aligned: the row's own split, or a row of the same phase), else
// 8 scalar ones (a second row of another phase).
template <int32_t DT>
__device__ __forceinline__ void row_load8(const BitsOf<DT>* p, bool aligned, float scale, float (&z)[kRowVec]) {
  if (aligned && DT == kBFloat16) {  // a pair per 32-bit word: each entry one shift or mask (from_bits' value)
    struct alignas(16) Words {
      uint32_t w[kRowVec / 2];
    };
    const Words v = *reinterpret_cast<const Words*>(p);  // little-endian: entry 2c in the low half of word c
#pragma unroll
    for (int c = 0; c < kRowVec / 2; ++c) {
      z[2 * c] = bits_f32(v.w[c] << 16) * scale;
      z[2 * c + 1] = bits_f32(v.w[c] & 0xffff0000u) * scale;
    }
  } else if (aligned) {
    const RowPack<BitsOf<DT>> v = *reinterpret_cast<const RowPack<BitsOf<DT>>*>(p);
#pragma unroll
    for (int c = 0; c < kRowVec; ++c) z[c] = from_bits<DT>(v.v[c]) * scale;
  } else {
#pragma unroll
    for (int c = 0; c < kRowVec; ++c) z[c] = from_bits<DT>(p[c]) * scale;
  }
}

// 8 entries at p as row_load8 reads them, each through the logits' transform (common/row_math.h: NoCap, x / T, is
// row_load8's scale itself, the code it always was; SoftCap reads them as they are, then caps).
template <int32_t DT, class Cap>
__device__ __forceinline__ void row_load8_z(const BitsOf<DT>* p, bool aligned, const Cap& cap, float (&z)[kRowVec]) {
  if constexpr (Cap::kOn) {
    row_load8<DT>(p, aligned, 1.0f, z);
#pragma unroll
    for (int c = 0; c < kRowVec; ++c) z[c] = cap.z(z[c]);
  } else {
    row_load8<DT>(p, aligned, cap.inv_t, z);
  }
}

// Store 8 values at p (as row_load8: 128-bit stores where `aligned`).
template <int32_t DT>
__device__ __forceinline__ void row_store8(BitsOf<DT>* p, bool aligned, const float (&g)[kRowVec]) {
  if (aligned) {
    RowPack<BitsOf<DT>> v;
#pragma unroll
    for (int c = 0; c < kRowVec; ++c) v.v[c] = to_bits<DT>(g[c]);
    *reinterpret_cast<RowPack<BitsOf<DT>>*>(p) = v;
  } else {
#pragma unroll
    for (int c = 0; c < kRowVec; ++c) p[c] = to_bits<DT>(g[c]);
  }
}

// Every step of a row's walk over `vecs` vectors, kVecs vectors a thread and step: step(std::true_type, v0) for
// each whole step (all kVecs vectors in the row: no check per vector in the main loop), then step(std::false_type,
// v0) for this thread's partial last one, if any (vectors past `vecs` skipped). v0: the step's first vector.
template <int kVecs, class Step>
__device__ __forceinline__ void row_steps(int64_t vecs, Step&& step) {
  int64_t v0 = threadIdx.x;
  for (; v0 + int64_t{kVecs - 1} * kRowThreads < vecs; v0 += int64_t{kRowThreads} * kVecs) step(std::true_type{}, v0);
  if (v0 < vecs) step(std::false_type{}, v0);
}

// Every entry of a row of V set to `value` by the block (a row not counted, or a gradient that is NaN).
template <int32_t DT>
__device__ __forceinline__ void row_fill(BitsOf<DT>* row, int64_t V, float value) {
  const RowSplit s = row_split(row, V);
  float g[kRowVec];
#pragma unroll
  for (int c = 0; c < kRowVec; ++c) g[c] = value;
  for (int64_t vi = threadIdx.x; vi < s.vecs; vi += kRowThreads) row_store8<DT>(row + s.head + vi * kRowVec, true, g);
  for (int k = 0; k < 2; ++k) {
    const int64_t j = row_scalar_entry(s, k);
    if (j >= 0) row[j] = to_bits<DT>(value);
  }
}

// The CUDA kernels' exponential (the Exp policy of common/row_math.h): e^y as 2^(y log2 e) by the SFU's
// ex2.approx.ftz (relative error below 2^-22; results below FLT_MIN flush to 0, as exp_vec's do below
// e^-87.3; NaN stays NaN, -inf gives 0). Under the host emulation exp2f with the same flush, so that the CI
// tests take the device's formula, if not its last bits.
struct RowExp {
  __device__ __forceinline__ float operator()(float y) const {
    const float x = y * 1.44269504088896341f;
#if defined(KL_CUDA_EMULATED)
    const float r = exp2f(x);
    return r < FLT_MIN ? 0.0f : r;
#else
    float r;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
    return r;
#endif
  }
};
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
