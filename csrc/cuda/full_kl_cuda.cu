// Fused CUDA full_kl: per counted row, the policy's logits x and the reference's r, the formulas of
// common/row_math.h (shared with the CPU kernel, cpu/full_kl_cpu.cpp). One block of kRowThreads threads per
// row, walking the policy's row as cuda/rows.cuh says (the head's and tail's scalar entries, then 8-entry
// vectors, kRowVecs<Bits, 2> a step, 128-bit accesses); the reference's row and the gradients' rows are read and
// written the same way where they have the policy row's phase (kAligned, the common case), else entry by
// entry at the same indices. The exponentials come from the SFU (RowExp).
//   forward:  one pass (row_math.h): each thread keeps running maxima and its S, F, R and A against them; per
//             step the step's maxima, the sums moved onto them, the entries' terms added in float, then into
//             float64; the block's maxima (block max), every thread's sums moved onto them and summed in a
//             fixed order, then thread 0 writes the row's KL, lse and ref_lse. A NaN entry needs no flag of its
//             own: its term makes S or R NaN, which leaves the row undefined (row_undefined). Each entry is
//             read once; no [N, V] temporary.
//   backward: every entry's gradients to both logits (those wanted); a row whose KL is not finite gets NaN.
// Deterministic (no atomics), no host synchronization, int64 indexing, any number of rows.
#include "cuda/full_kl_cuda.h"

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

// One step of the forward: K vectors' entries of both rows (z the policy's, w the reference's; -inf where
// there is none: terms of 0) merged into s.
template <int K>
__device__ __forceinline__ void full_kl_step(FullKLSums& s, const float (&z)[K][kRowVec], const float (&w)[K][kRowVec]) {
  float step_m = -INFINITY, step_n = -INFINITY, step_lost = -INFINITY;
#pragma unroll
  for (int k = 0; k < K; ++k)
#pragma unroll
    for (int c = 0; c < kRowVec; ++c) {  // NaN skipped (fmaxf: one FMNMX each)
      step_m = fmaxf(step_m, z[k][c]);
      step_n = fmaxf(step_n, w[k][c]);
      step_lost = fmaxf(step_lost, full_kl_lost(z[k][c], w[k][c]));
    }
  float m, n;
  full_kl_rebase(s, step_m, step_n, step_lost, m, n);
  // S's, F's and R's terms are at most 1 each (against the running maxima): float sums, then float64. A's reach
  // float32's max (e ~ 1 where the reference is -FLT_MAX): two of them overflow a float sum, so float64 each.
  float se = 0.0f, sf = 0.0f, sr = 0.0f;
  double sa = 0.0;
#pragma unroll
  for (int k = 0; k < K; ++k)
#pragma unroll
    for (int c = 0; c < kRowVec; ++c) {
      float e, f, q, d;
      full_kl_terms(m - z[k][c], n - w[k][c], e, f, q, d, RowExp{});
      se += e;
      sf += f;
      sr += q;
      sa += d;
    }
  s.S += se;
  s.F += sf;
  s.R += sr;
  s.A += sa;
}

// Vectors [v0, v0 + kVecs x kRowThreads) of both rows into z and w (-inf past `vecs` unless kFull).
template <int32_t DT, bool kAligned, bool kFull, class Cap>
__device__ __forceinline__ void full_kl_load_step(const BitsOf<DT>* vx, const BitsOf<DT>* vy, int64_t v0, int64_t vecs,
                                                  const Cap& cap, float (&z)[kRowVecs<BitsOf<DT>, 2>][kRowVec],
                                                  float (&w)[kRowVecs<BitsOf<DT>, 2>][kRowVec]) {
#pragma unroll
  for (int k = 0; k < kRowVecs<BitsOf<DT>, 2>; ++k) {  // 2 x kVecs loads in flight
    const int64_t vi = v0 + int64_t{k} * kRowThreads;
    if (kFull || vi < vecs) {
      row_load8_z<DT>(vx + vi * kRowVec, true, cap, z[k]);
      row_load8_z<DT>(vy + vi * kRowVec, kAligned, cap, w[k]);
    } else {
#pragma unroll
      for (int c = 0; c < kRowVec; ++c) z[k][c] = w[k][c] = -INFINITY;  // past the row: terms of 0
    }
  }
}

// Every vector of a row's walk into s (row_steps).
template <int32_t DT, bool kAligned, class Cap>
__device__ __forceinline__ void full_kl_vectors(FullKLSums& s, const BitsOf<DT>* vx, const BitsOf<DT>* vy, int64_t vecs,
                                                const Cap& cap) {
  constexpr int kVecs = kRowVecs<BitsOf<DT>, 2>;
  row_steps<kVecs>(vecs, [&](auto full, int64_t v0) {
    float z[kVecs][kRowVec], w[kVecs][kRowVec];
    full_kl_load_step<DT, kAligned, decltype(full)::value>(vx, vy, v0, vecs, cap, z, w);
    full_kl_step(s, z, w);
  });
}

// The forward of every row of the block's grid stride, both rows through `cap` (NoCap: x / T; SoftCap: capped,
// common/row_math.h): the body of the two kernels below.
template <int32_t DT, class Cap>
__device__ __forceinline__ void full_kl_forward_rows(const FullKLArgs& a, const Cap cap) {
  __shared__ float max_sm[3][kRowWarps];
  __shared__ double sum_sm[3][kRowWarps];
  using Bits = BitsOf<DT>;
  const int64_t V = a.vocab;
  for (int64_t r = blockIdx.x; r < a.rows; r += gridDim.x) {  // the same r for the whole block
    if (!row_counted(a, r)) {
      if (threadIdx.x == 0) row_store_all(a, r, 0.0f);
      continue;
    }
    const Bits* x = logits_row<DT>(a, r);
    const Bits* y = ref_logits_row<DT>(a, r);
    const RowSplit sp = row_split(x, V);
    FullKLSums sums = full_kl_sums_start();
    {  // this thread's scalar entries (head and tail), one step
      float z[1][kRowVec], w[1][kRowVec];
#pragma unroll
      for (int c = 0; c < kRowVec; ++c) {
        const int64_t j = c < 2 ? row_scalar_entry(sp, c) : -1;
        z[0][c] = j >= 0 ? cap.z(from_bits<DT>(x[j])) : -INFINITY;
        w[0][c] = j >= 0 ? cap.z(from_bits<DT>(y[j])) : -INFINITY;
      }
      full_kl_step(sums, z, w);
    }
    if (row_split(y, V).phase == sp.phase) {
      full_kl_vectors<DT, true>(sums, x + sp.head, y + sp.head, sp.vecs, cap);
    } else {
      full_kl_vectors<DT, false>(sums, x + sp.head, y + sp.head, sp.vecs, cap);
    }
    // the block's maxima and lost; every thread's sums moved onto them, then summed in a fixed order
    float mx[3] = {sums.m, sums.n, sums.lost};
    block_max(mx, max_sm);
    float m, n;
    full_kl_rebase(sums, mx[0], mx[1], mx[2], m, n);
    double total[3] = {sums.S, sums.R, sums.A};
    block_sum(total, sum_sm);
    if (threadIdx.x == 0) {
      if (row_undefined(total[0] != total[0] || total[1] != total[1], mx[0]) || row_undefined(false, mx[1])) {
        row_store_all(a, r, NAN);  // a softmax is undefined
      } else {
        const double log_s = log(total[0]), log_r = log(total[1]);
        full_kl_store(a, r, full_kl_value(total[0], total[2], log_s, log_r, mx[0], mx[2], RowExp{}), logprob_lse(mx[0], log_s),
                      logprob_lse(mx[1], log_r));
      }
    }
  }
}

template <int32_t DT>
__global__ void __launch_bounds__(kRowThreads) full_kl_forward_kernel(FullKLArgs a) {
  full_kl_forward_rows<DT>(a, NoCap{a.inv_temperature});
}

// The soft-capped forward: a kernel of its own name (the static gates' budgets are the default path's).
template <int32_t DT>
__global__ void __launch_bounds__(kRowThreads) full_kl_softcap_forward_kernel(FullKLArgs a) {
  full_kl_forward_rows<DT>(a, soft_cap(a));
}

// The gradients of vectors [v0, v0 + kVecs x kRowThreads) (those past `vecs` skipped unless kFull).
template <int32_t DT, bool kAligned, bool kFull, class Cap>
__device__ __forceinline__ void full_kl_grad_step(const BitsOf<DT>* vx, const BitsOf<DT>* vy, BitsOf<DT>* gx,
                                                  BitsOf<DT>* gr, int64_t v0, int64_t vecs, const Cap& cap,
                                                  const FullKLGradRow& in) {
  const float inv_t = Cap::kOn ? 1.0f : cap.inv_t;  // SoftCap: the entries as read (capped below)
  constexpr int kVecs = kRowVecs<BitsOf<DT>, 2>;
  float u[kVecs][kRowVec], v[kVecs][kRowVec];
#pragma unroll
  for (int k = 0; k < kVecs; ++k) {  // all loads first: 2 x kVecs in flight (each read before it is written)
    const int64_t vi = v0 + int64_t{k} * kRowThreads;
    if (kFull || vi < vecs) {
      row_load8<DT>(vx + vi * kRowVec, true, inv_t, u[k]);
      row_load8<DT>(vy + vi * kRowVec, kAligned, inv_t, v[k]);
    }
  }
#pragma unroll
  for (int k = 0; k < kVecs; ++k) {
    const int64_t vi = v0 + int64_t{k} * kRowThreads;
    if (!kFull && vi >= vecs) continue;
    float px[kRowVec], pr[kRowVec];
#pragma unroll
    for (int c = 0; c < kRowVec; ++c) {
      if constexpr (Cap::kOn) {
        const float uc = in.lse - cap.z(u[k][c]), vc = in.ref_lse - cap.z(v[k][c]);
        px[c] = full_kl_grad_policy(in.g, uc, vc, in.kl, RowExp{}) * cap.slope(u[k][c]);
        pr[c] = full_kl_grad_ref(in.g, uc, vc, RowExp{}) * cap.slope(v[k][c]);
      } else {
        const float uc = in.lse - u[k][c], vc = in.ref_lse - v[k][c];
        px[c] = full_kl_grad_policy(in.g, uc, vc, in.kl, RowExp{});
        pr[c] = full_kl_grad_ref(in.g, uc, vc, RowExp{});
      }
    }
    if (gx) row_store8<DT>(gx + vi * kRowVec, kAligned, px);
    if (gr) row_store8<DT>(gr + vi * kRowVec, kAligned, pr);
  }
}

template <int32_t DT, bool kAligned, class Cap>
__device__ __forceinline__ void full_kl_grad_vectors(const BitsOf<DT>* vx, const BitsOf<DT>* vy, BitsOf<DT>* gx,
                                                     BitsOf<DT>* gr, int64_t vecs, const Cap& cap,
                                                     const FullKLGradRow& in) {
  row_steps<kRowVecs<BitsOf<DT>, 2>>(vecs, [&](auto full, int64_t v0) {
    full_kl_grad_step<DT, kAligned, decltype(full)::value>(vx, vy, gx, gr, v0, vecs, cap, in);
  });
}

// The backward of every row of the block's grid stride, both rows through `cap`: the body of the two kernels below.
template <int32_t DT, class Cap>
__device__ __forceinline__ void full_kl_backward_rows(const FullKLArgs& a, const Cap cap) {
  using Bits = BitsOf<DT>;
  const int64_t V = a.vocab;
  const float inv_t = a.inv_temperature;
  for (int64_t r = blockIdx.x; r < a.rows; r += gridDim.x) {
    const Bits* x = logits_row<DT>(a, r);
    const Bits* y = ref_logits_row<DT>(a, r);
    Bits* gx = grad_logits_row<DT>(a, r);
    Bits* gr = grad_ref_row<DT>(a, r);
    const bool counted = row_counted(a, r);
    const FullKLGradRow in = full_kl_grad_row(a, r);
    if (!counted || !full_kl_grad_defined(in.kl)) {  // 0, or NaN: the gradient of an infinite or undefined KL
      const float fill = counted ? NAN : 0.0f;
      if (gx) row_fill<DT>(gx, V, fill);
      if (gr) row_fill<DT>(gr, V, fill);
      continue;
    }
    const RowSplit sp = row_split(x, V);
#pragma unroll
    for (int k = 0; k < 2; ++k) {  // the scalar entries
      const int64_t j = row_scalar_entry(sp, k);
      if (j >= 0) {
        if constexpr (Cap::kOn) {
          const float xj = from_bits<DT>(x[j]), yj = from_bits<DT>(y[j]);
          const float u = in.lse - cap.z(xj), v = in.ref_lse - cap.z(yj);
          const float px = full_kl_grad_policy(in.g, u, v, in.kl, RowExp{}) * cap.slope(xj);
          const float pr = full_kl_grad_ref(in.g, u, v, RowExp{}) * cap.slope(yj);
          if (gx) gx[j] = to_bits<DT>(px);
          if (gr) gr[j] = to_bits<DT>(pr);
        } else {
          const float u = in.lse - from_bits<DT>(x[j]) * inv_t, v = in.ref_lse - from_bits<DT>(y[j]) * inv_t;
          const float px = full_kl_grad_policy(in.g, u, v, in.kl, RowExp{}), pr = full_kl_grad_ref(in.g, u, v, RowExp{});
          if (gx) gx[j] = to_bits<DT>(px);
          if (gr) gr[j] = to_bits<DT>(pr);
        }
      }
    }
    // the common case: the reference and both gradient rows (those wanted) aligned as the policy's row
    const bool aligned = row_split(y, V).phase == sp.phase && (!gx || row_split(gx, V).phase == sp.phase) &&
                         (!gr || row_split(gr, V).phase == sp.phase);
    Bits* vgx = gx ? gx + sp.head : nullptr;
    Bits* vgr = gr ? gr + sp.head : nullptr;
    if (aligned) {
      full_kl_grad_vectors<DT, true>(x + sp.head, y + sp.head, vgx, vgr, sp.vecs, cap, in);
    } else {
      full_kl_grad_vectors<DT, false>(x + sp.head, y + sp.head, vgx, vgr, sp.vecs, cap, in);
    }
  }
}

template <int32_t DT>
__global__ void __launch_bounds__(kRowThreads) full_kl_backward_kernel(FullKLArgs a) {
  full_kl_backward_rows<DT>(a, NoCap{a.inv_temperature});
}

template <int32_t DT>
__global__ void __launch_bounds__(kRowThreads) full_kl_softcap_backward_kernel(FullKLArgs a) {
  full_kl_backward_rows<DT>(a, soft_cap(a));
}

}  // namespace

int full_kl_forward_cuda(const FullKLArgs& a, uintptr_t stream) {
  if (a.softcap > 0.0f) {
    return launch_rows(a, stream, [](auto dt) { return full_kl_softcap_forward_kernel<decltype(dt)::value>; });
  }
  return launch_rows(a, stream, [](auto dt) { return full_kl_forward_kernel<decltype(dt)::value>; });
}

int full_kl_backward_cuda(const FullKLArgs& a, uintptr_t stream) {
  if (a.softcap > 0.0f) {
    return launch_rows(a, stream, [](auto dt) { return full_kl_softcap_backward_kernel<decltype(dt)::value>; });
  }
  return launch_rows(a, stream, [](auto dt) { return full_kl_backward_kernel<decltype(dt)::value>; });
}

}  // namespace kl
