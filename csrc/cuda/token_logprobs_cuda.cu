// Fused CUDA token_logprobs: per counted row of the logits, the formulas of common/row_math.h (shared with
// the CPU kernel, cpu/token_logprobs_cpu.cpp). One block of kRowThreads threads per row, walking it as
// cuda/rows.cuh says (the head's and tail's scalar entries, then 8-entry vectors, kRowVecs a step, 128-bit
// accesses), the exponentials from the SFU (RowExp):
//   forward:  one pass (row_math.h): each thread keeps a running max and its S and W against it; per step
//             the step's max, the sums moved onto it, the entries' terms added in float, then into float64;
//             the block's max (block max), every thread's sums moved onto it and summed in a fixed order,
//             then thread 0 writes the row's log-prob, lse and entropy. A NaN entry needs no flag of its
//             own: its term is NaN, so S is (and a +inf one makes the max +inf); either leaves the row
//             undefined (row_undefined). Each entry is read once (the label's once more); no [N, V] temporary.
//   backward: every entry's gradient, each written by the thread that read it (with inplace_backward the
//             gradient overwrites the logits, each vector read before it is written); the label's entry
//             takes logprob_grad_label, in the one vector (or scalar entry) that holds it.
// Deterministic (no atomics), no host synchronization, int64 indexing, any number of rows.
#include "cuda/token_logprobs_cuda.h"

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "common/codes.h"
#include "common/kl_math.h"
#include "common/row_math.h"
#include "cuda/launch.cuh"
#include "cuda/rows.cuh"

namespace kl {
namespace {

// One step of the forward: K vectors' entries z (-inf where there is none: a term of 0) merged into s.
template <int K>
__device__ __forceinline__ void logprob_step(LogprobSums& s, const float (&z)[K][kRowVec]) {
  float step_max = -INFINITY;
#pragma unroll
  for (int k = 0; k < K; ++k)
#pragma unroll
    for (int c = 0; c < kRowVec; ++c) step_max = fmaxf(step_max, z[k][c]);  // NaN skipped (one FMNMX)
  const float m = logprob_rebase(s, step_max);
  float se = 0.0f, sw = 0.0f;
#pragma unroll
  for (int k = 0; k < K; ++k)
#pragma unroll
    for (int c = 0; c < kRowVec; ++c) {
      float e, w;
      logprob_terms(m - z[k][c], e, w, RowExp{});
      se += e;
      sw += w;
    }
  s.S += se;
  s.W += sw;
}

// Vectors [v0, v0 + kVecs x kRowThreads) of a row's walk (vrow: its first vector) into z, through the transform
// (x / T, or capped: row_load8_z) (-inf past `vecs` unless kFull: terms of 0).
template <int32_t DT, bool kFull, class Cap>
__device__ __forceinline__ void logprob_load_step(const BitsOf<DT>* vrow, int64_t v0, int64_t vecs, const Cap& cap,
                                                  float (&z)[kRowVecs<BitsOf<DT>>][kRowVec]) {
#pragma unroll
  for (int k = 0; k < kRowVecs<BitsOf<DT>>; ++k) {
    const int64_t vi = v0 + int64_t{k} * kRowThreads;
    if (kFull || vi < vecs) {
      row_load8_z<DT>(vrow + vi * kRowVec, true, cap, z[k]);
    } else {
#pragma unroll
      for (int c = 0; c < kRowVec; ++c) z[k][c] = -INFINITY;
    }
  }
}

// The forward of every row of the block's grid stride, logits through `cap` (NoCap: z = x / T; SoftCap: the
// capped z, common/row_math.h): the body of the two kernels below.
template <int32_t DT, class Cap>
__device__ __forceinline__ void token_logprobs_forward_rows(const TokenLogprobsArgs& a, const Cap cap) {
  __shared__ float max_sm[1][kRowWarps];
  __shared__ double sum_sm[2][kRowWarps];
  using Bits = BitsOf<DT>;
  constexpr int kVecs = kRowVecs<Bits>;
  const int64_t V = a.vocab;
  for (int64_t r = blockIdx.x; r < a.rows; r += gridDim.x) {  // the same r for the whole block
    if (!row_counted(a, r)) {
      if (threadIdx.x == 0) row_store_all(a, r, 0.0f);
      continue;
    }
    const Bits* row = logits_row<DT>(a, r);
    const RowSplit sp = row_split(row, V);
    LogprobSums sums = logprob_sums_start();
    {  // this thread's scalar entries (head and tail), one step
      float z[1][kRowVec];
#pragma unroll
      for (int c = 0; c < kRowVec; ++c) {
        const int64_t j = c < 2 ? row_scalar_entry(sp, c) : -1;
        z[0][c] = j >= 0 ? cap.z(from_bits<DT>(row[j])) : -INFINITY;
      }
      logprob_step(sums, z);
    }
    row_steps<kVecs>(sp.vecs, [&](auto full, int64_t v0) {  // kVecs 128-bit loads in flight, then their terms
      float z[kVecs][kRowVec];
      logprob_load_step<DT, decltype(full)::value>(row + sp.head, v0, sp.vecs, cap, z);
      logprob_step(sums, z);
    });
    // the block's max; every thread's sums moved onto it, then summed in a fixed order
    float mx[1] = {sums.m};
    block_max(mx, max_sm);
    logprob_rebase(sums, mx[0]);
    double total[2] = {sums.S, sums.W};
    block_sum(total, sum_sm);
    if (threadIdx.x == 0) {
      const int64_t y = row_label(a, r);
      if (row_undefined(total[0] != total[0], mx[0]) || y < 0 || y >= V) {  // undefined (or a label Python refused)
        row_store_all(a, r, NAN);
      } else {
        const double log_s = log(total[0]);
        const float lse = logprob_lse(mx[0], log_s);
        logprob_store(a, r, cap.z(from_bits<DT>(row[y])) - lse, lse, logprob_entropy(total[0], total[1], log_s));
      }
    }
  }
}

template <int32_t DT>
__global__ void __launch_bounds__(kRowThreads) token_logprobs_forward_kernel(TokenLogprobsArgs a) {
  token_logprobs_forward_rows<DT>(a, NoCap{a.inv_temperature});
}

// The soft-capped forward: a kernel of its own name (the static gates' budgets are the default path's).
template <int32_t DT>
__global__ void __launch_bounds__(kRowThreads) token_logprobs_softcap_forward_kernel(TokenLogprobsArgs a) {
  token_logprobs_forward_rows<DT>(a, soft_cap(a));
}

// The gradients of vectors [v0, v0 + kVecs x kRowThreads) of a row's walk (the step's vectors past `vecs`
// skipped): d = lse - z, then logprob_grad, or logprob_grad_label at the label's entry (yv: counted from the
// first vector's; in one vector of the row at most). kAligned: the gradient row has the logits row's phase.
template <int32_t DT, bool kAligned, bool kFull, class Cap>
__device__ __forceinline__ void logprob_grad_step(const BitsOf<DT>* vrow, BitsOf<DT>* vout, int64_t v0, int64_t vecs,
                                                  int64_t yv, const Cap& cap, const LogprobGradRow& in) {
  const float inv_t = cap.inv_t;
  constexpr int kVecs = kRowVecs<BitsOf<DT>>;
  float d[kVecs][kRowVec];
#pragma unroll
  for (int k = 0; k < kVecs; ++k) {  // all loads first: kVecs in flight (and each read before it is written)
    const int64_t vi = v0 + int64_t{k} * kRowThreads;
    if (kFull || vi < vecs) row_load8<DT>(vrow + vi * kRowVec, true, Cap::kOn ? 1.0f : inv_t, d[k]);
  }
#pragma unroll
  for (int k = 0; k < kVecs; ++k) {
    const int64_t vi = v0 + int64_t{k} * kRowThreads;
    if (!kFull && vi >= vecs) continue;
    float g[kRowVec];
    float sl[Cap::kOn ? kRowVec : 1];  // the cap's slopes 1 - tanh^2 (SoftCap: d holds the logits as read)
#pragma unroll
    for (int c = 0; c < kRowVec; ++c) {
      if constexpr (Cap::kOn) {
        sl[c] = cap.slope(d[k][c]);
        d[k][c] = in.lse - cap.z(d[k][c]);
        g[c] = logprob_grad(d[k][c], in.g_lp, in.g_h, in.h, RowExp{}) * inv_t * sl[c];
      } else {
        d[k][c] = in.lse - d[k][c];
        g[c] = logprob_grad(d[k][c], in.g_lp, in.g_h, in.h, RowExp{}) * inv_t;
      }
    }
    const uint64_t yl = static_cast<uint64_t>(yv - vi * kRowVec);
    if (yl < kRowVec) {  // the label's vector: its entry's d picked out, its gradient put in (no local memory)
      float dy = d[k][0];
#pragma unroll
      for (int c = 1; c < kRowVec; ++c) dy = static_cast<uint64_t>(c) == yl ? d[k][c] : dy;
      float gy = logprob_grad_label(dy, in.g_lp, in.g_h, in.h, RowExp{}) * inv_t;
      if constexpr (Cap::kOn) {
        float sy = sl[0];
#pragma unroll
        for (int c = 1; c < kRowVec; ++c) sy = static_cast<uint64_t>(c) == yl ? sl[c] : sy;
        gy *= sy;
      }
#pragma unroll
      for (int c = 0; c < kRowVec; ++c) g[c] = static_cast<uint64_t>(c) == yl ? gy : g[c];
    }
    row_store8<DT>(vout + vi * kRowVec, kAligned, g);
  }
}

// Every vector of a row's walk (row_steps).
template <int32_t DT, bool kAligned, class Cap>
__device__ __forceinline__ void logprob_grad_vectors(const BitsOf<DT>* vrow, BitsOf<DT>* vout, int64_t vecs, int64_t yv,
                                                     const Cap& cap, const LogprobGradRow& in) {
  row_steps<kRowVecs<BitsOf<DT>>>(vecs, [&](auto full, int64_t v0) {
    logprob_grad_step<DT, kAligned, decltype(full)::value>(vrow, vout, v0, vecs, yv, cap, in);
  });
}

// The backward of every row of the block's grid stride, logits through `cap`: the body of the two kernels below.
template <int32_t DT, class Cap>
__device__ __forceinline__ void token_logprobs_backward_rows(const TokenLogprobsArgs& a, const Cap cap) {
  using Bits = BitsOf<DT>;
  const int64_t V = a.vocab;
  const float inv_t = a.inv_temperature;
  for (int64_t r = blockIdx.x; r < a.rows; r += gridDim.x) {
    const Bits* row = logits_row<DT>(a, r);
    Bits* out = grad_logits_row<DT>(a, r);
    if (!row_counted(a, r)) {
      row_fill<DT>(out, V, 0.0f);
      continue;
    }
    const LogprobGradRow in = logprob_grad_row(a, r);
    const int64_t y = row_label(a, r);  // out of [0, V) (never, past Python's checks): no entry is the label
    const RowSplit sp = row_split(row, V);
#pragma unroll
    for (int k = 0; k < 2; ++k) {  // the scalar entries
      const int64_t j = row_scalar_entry(sp, k);
      if (j >= 0) {
        const float x = from_bits<DT>(row[j]);
        const float d = in.lse - cap.z(x);
        const float g = j == y ? logprob_grad_label(d, in.g_lp, in.g_h, in.h, RowExp{})
                               : logprob_grad(d, in.g_lp, in.g_h, in.h, RowExp{});
        if constexpr (Cap::kOn) {
          out[j] = to_bits<DT>(g * inv_t * cap.slope(x));
        } else {
          out[j] = to_bits<DT>(g * inv_t);
        }
      }
    }
    if (row_split(out, V).phase == sp.phase) {  // in place (the same row), or a gradient row aligned alike
      logprob_grad_vectors<DT, true>(row + sp.head, out + sp.head, sp.vecs, y - sp.head, cap, in);
    } else {
      logprob_grad_vectors<DT, false>(row + sp.head, out + sp.head, sp.vecs, y - sp.head, cap, in);
    }
  }
}

template <int32_t DT>
__global__ void __launch_bounds__(kRowThreads) token_logprobs_backward_kernel(TokenLogprobsArgs a) {
  token_logprobs_backward_rows<DT>(a, NoCap{a.inv_temperature});
}

template <int32_t DT>
__global__ void __launch_bounds__(kRowThreads) token_logprobs_softcap_backward_kernel(TokenLogprobsArgs a) {
  token_logprobs_backward_rows<DT>(a, soft_cap(a));
}

}  // namespace

int token_logprobs_forward_cuda(const TokenLogprobsArgs& a, uintptr_t stream) {
  if (a.softcap > 0.0f) {
    return launch_rows(a, stream, [](auto dt) { return token_logprobs_softcap_forward_kernel<decltype(dt)::value>; });
  }
  return launch_rows(a, stream, [](auto dt) { return token_logprobs_forward_kernel<decltype(dt)::value>; });
}

int token_logprobs_backward_cuda(const TokenLogprobsArgs& a, uintptr_t stream) {
  if (a.softcap > 0.0f) {
    return launch_rows(a, stream, [](auto dt) { return token_logprobs_softcap_backward_kernel<decltype(dt)::value>; });
  }
  return launch_rows(a, stream, [](auto dt) { return token_logprobs_backward_kernel<decltype(dt)::value>; });
}

}  // namespace kl
