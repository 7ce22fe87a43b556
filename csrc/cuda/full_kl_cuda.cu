// Fused CUDA full_kl: per counted row, the policy's logits x and the reference's r, the formulas of
// common/row_math.h (shared with the CPU kernel, cpu/full_kl_cpu.cpp). One block of kRowThreads threads per
// row (cuda/rows.cuh), thread t reading entries t, t + 256, ... of both rows (coalesced), kRowChunk of each
// per step, loaded before they are used (that many loads in flight per thread and row):
//   forward:  one pass (row_math.h): each thread keeps running maxima and its S, R and A against them, per
//             step the kRowChunk entries' maxima, the sums moved onto them, the entries' terms added in
//             float, then into float64; the block's maxima and NaN flag (block max), every thread's sums
//             moved onto them and summed in a fixed order, then thread 0 writes the row's KL, lse and
//             ref_lse. Each entry is read once; no [N, V] temporary.
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

template <int32_t DT>
__global__ void __launch_bounds__(kRowThreads) full_kl_forward_kernel(FullKLArgs a) {
  __shared__ float max_sm[4][kRowWarps];
  __shared__ double sum_sm[3][kRowWarps];
  using Bits = BitsOf<DT>;
  const int64_t V = a.vocab;
  const float inv_t = a.inv_temperature;
  const int64_t t = threadIdx.x;
  for (int64_t r = blockIdx.x; r < a.rows; r += gridDim.x) {  // the same r for the whole block
    if (!row_counted(a, r)) {
      if (t == 0) row_store_all(a, r, 0.0f);
      continue;
    }
    const Bits* x = logits_row<DT>(a, r);
    const Bits* y = ref_logits_row<DT>(a, r);
    // one pass: per step kRowChunk entries of each row into registers, their maxima (NaN skipped, flagged),
    // this thread's sums moved onto its running maxima (row_math.h), then the step's terms in float, added
    // in float64
    FullKLSums sums = full_kl_sums_start();
    float nan_seen = 0.0f;
    for (int64_t j0 = t; j0 < V; j0 += int64_t{kRowThreads} * kRowChunk) {
      float z[kRowChunk], w[kRowChunk];
      float step_m = -INFINITY, step_n = -INFINITY, step_lost = -INFINITY;
#pragma unroll
      for (int c = 0; c < kRowChunk; ++c) {  // 2 x kRowChunk independent loads in flight
        const int64_t j = j0 + int64_t{c} * kRowThreads;
        z[c] = j < V ? from_bits<DT>(x[j]) * inv_t : -INFINITY;  // past the row: terms of 0
        w[c] = j < V ? from_bits<DT>(y[j]) * inv_t : -INFINITY;
        step_m = z[c] > step_m ? z[c] : step_m;
        step_n = w[c] > step_n ? w[c] : step_n;
        const float lost = full_kl_lost(z[c], w[c]);
        step_lost = lost > step_lost ? lost : step_lost;
        nan_seen = (z[c] != z[c]) | (w[c] != w[c]) ? 1.0f : nan_seen;
      }
      float m, n;
      full_kl_rebase(sums, step_m, step_n, step_lost, m, n);
      float se = 0.0f, sf = 0.0f, sr = 0.0f, sa = 0.0f;
#pragma unroll
      for (int c = 0; c < kRowChunk; ++c) {
        float e, f, q, d;
        full_kl_terms(m - z[c], n - w[c], e, f, q, d);
        se += e;
        sf += f;
        sr += q;
        sa += d;
      }
      sums.S += se;
      sums.F += sf;
      sums.R += sr;
      sums.A += sa;
    }
    // the block's maxima, lost and NaN flag; every thread's sums moved onto them, then summed in a fixed order
    float mx[4] = {sums.m, sums.n, nan_seen, sums.lost};
    block_max(mx, max_sm);
    float m, n;
    full_kl_rebase(sums, mx[0], mx[1], mx[3], m, n);
    if (row_undefined(mx[2] != 0.0f, mx[0]) || row_undefined(false, mx[1])) {  // a softmax is undefined
      if (t == 0) row_store_all(a, r, NAN);
      continue;
    }
    double total[3] = {sums.S, sums.R, sums.A};
    block_sum(total, sum_sm);
    if (t == 0) {
      const double log_s = log(total[0]), log_r = log(total[1]);
      full_kl_store(a, r, full_kl_value(total[0], total[2], log_s, log_r, mx[0], mx[3]), logprob_lse(mx[0], log_s),
                    logprob_lse(mx[1], log_r));
    }
  }
}

template <int32_t DT>
__global__ void __launch_bounds__(kRowThreads) full_kl_backward_kernel(FullKLArgs a) {
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
      const Bits fill = to_bits<DT>(counted ? NAN : 0.0f);
      for (int64_t j = threadIdx.x; j < V; j += kRowThreads) {
        if (gx) gx[j] = fill;
        if (gr) gr[j] = fill;
      }
      continue;
    }
    const float g = in.g, kl = in.kl, lse = in.lse, ref_lse = in.ref_lse;
    for (int64_t j0 = threadIdx.x; j0 < V; j0 += int64_t{kRowThreads} * kRowChunk) {
      float u[kRowChunk], v[kRowChunk];
#pragma unroll
      for (int c = 0; c < kRowChunk; ++c) {  // all loads first: 2 x kRowChunk in flight
        const int64_t j = j0 + int64_t{c} * kRowThreads;
        u[c] = j < V ? lse - from_bits<DT>(x[j]) * inv_t : 0.0f;
        v[c] = j < V ? ref_lse - from_bits<DT>(y[j]) * inv_t : 0.0f;
      }
#pragma unroll
      for (int c = 0; c < kRowChunk; ++c) {
        const int64_t j = j0 + int64_t{c} * kRowThreads;
        if (j < V) {
          if (gx) gx[j] = to_bits<DT>(full_kl_grad_policy(g, u[c], v[c], kl));
          if (gr) gr[j] = to_bits<DT>(full_kl_grad_ref(g, u[c], v[c]));
        }
      }
    }
  }
}

}  // namespace

int full_kl_forward_cuda(const FullKLArgs& a, uintptr_t stream) {
  return launch_rows(a, stream, [](auto dt) { return full_kl_forward_kernel<decltype(dt)::value>; });
}

int full_kl_backward_cuda(const FullKLArgs& a, uintptr_t stream) {
  return launch_rows(a, stream, [](auto dt) { return full_kl_backward_kernel<decltype(dt)::value>; });
}

}  // namespace kl
