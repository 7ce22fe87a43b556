// Fused CUDA token_logprobs: per counted row of the logits, the formulas of common/row_math.h (shared with
// the CPU kernel, cpu/token_logprobs_cpu.cpp). One block of kRowThreads threads per row (cuda/rows.cuh),
// thread t reading entries t, t + 256, ... (each warp a contiguous 32-entry run: coalesced), kRowChunk of
// them per step, loaded before they are used (that many loads in flight per thread):
//   forward:  one pass (row_math.h): each thread keeps a running max and its S and W against it, per step
//             the kRowChunk entries' max, the sums moved onto it, the entries' terms added in float, then
//             into float64; the block's max and NaN flag (block max), every thread's sums moved onto it and
//             summed in a fixed order, then thread 0 writes the row's log-prob, lse and entropy. Each entry
//             is read once (the label's once more); no [N, V] temporary.
//   backward: every entry's gradient, each written by the thread that read it: with inplace_backward the
//             gradient overwrites the logits, and the label's entry is read before it is written.
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

template <int32_t DT>
__global__ void __launch_bounds__(kRowThreads) token_logprobs_forward_kernel(TokenLogprobsArgs a) {
  __shared__ float max_sm[2][kRowWarps];
  __shared__ double sum_sm[2][kRowWarps];
  using Bits = BitsOf<DT>;
  const int64_t V = a.vocab;
  const float inv_t = a.inv_temperature;
  const int64_t t = threadIdx.x;
  for (int64_t r = blockIdx.x; r < a.rows; r += gridDim.x) {  // the same r for the whole block
    if (!row_counted(a, r)) {
      if (t == 0) row_store_all(a, r, 0.0f);
      continue;
    }
    const Bits* row = logits_row<DT>(a, r);
    // one pass: per step kRowChunk entries into registers, their max (NaN skipped, flagged), this thread's
    // sums moved onto its running max (row_math.h), then the step's terms in float, added in float64
    LogprobSums sums = logprob_sums_start();
    float nan_seen = 0.0f;
    for (int64_t j0 = t; j0 < V; j0 += int64_t{kRowThreads} * kRowChunk) {
      float z[kRowChunk];
      float step_max = -INFINITY;
#pragma unroll
      for (int c = 0; c < kRowChunk; ++c) {  // kRowChunk independent loads in flight
        const int64_t j = j0 + int64_t{c} * kRowThreads;
        z[c] = j < V ? from_bits<DT>(row[j]) * inv_t : -INFINITY;  // past the row: a term of 0
        step_max = z[c] > step_max ? z[c] : step_max;
        nan_seen = z[c] != z[c] ? 1.0f : nan_seen;
      }
      const float m = logprob_rebase(sums, step_max);
      float se = 0.0f, sw = 0.0f;
#pragma unroll
      for (int c = 0; c < kRowChunk; ++c) {
        float e, w;
        logprob_terms(m - z[c], e, w);
        se += e;
        sw += w;
      }
      sums.S += se;
      sums.W += sw;
    }
    // the block's max and NaN flag; every thread's sums moved onto that max, then summed in a fixed order
    float mx[2] = {sums.m, nan_seen};
    block_max(mx, max_sm);
    logprob_rebase(sums, mx[0]);
    const int64_t y = row_label(a, r);
    if (row_undefined(mx[1] != 0.0f, mx[0]) || y < 0 || y >= V) {  // undefined softmax (or a label Python refused)
      if (t == 0) row_store_all(a, r, NAN);
      continue;
    }
    double total[2] = {sums.S, sums.W};
    block_sum(total, sum_sm);
    if (t == 0) {
      const double log_s = log(total[0]);
      const float lse = logprob_lse(mx[0], log_s);
      logprob_store(a, r, from_bits<DT>(row[y]) * inv_t - lse, lse, logprob_entropy(total[0], total[1], log_s));
    }
  }
}

template <int32_t DT>
__global__ void __launch_bounds__(kRowThreads) token_logprobs_backward_kernel(TokenLogprobsArgs a) {
  using Bits = BitsOf<DT>;
  const int64_t V = a.vocab;
  const float inv_t = a.inv_temperature;
  for (int64_t r = blockIdx.x; r < a.rows; r += gridDim.x) {
    const Bits* row = logits_row<DT>(a, r);
    Bits* out = grad_logits_row<DT>(a, r);
    if (!row_counted(a, r)) {
      for (int64_t j = threadIdx.x; j < V; j += kRowThreads) out[j] = to_bits<DT>(0.0f);
      continue;
    }
    const LogprobGradRow in = logprob_grad_row(a, r);
    const float gl = in.g_lp, gh = in.g_h, lse = in.lse, h = in.h;
    const int64_t y = row_label(a, r);  // out of [0, V) (never, past Python's checks): no entry is the label
    for (int64_t j0 = threadIdx.x; j0 < V; j0 += int64_t{kRowThreads} * kRowChunk) {
      float z[kRowChunk];
#pragma unroll
      for (int c = 0; c < kRowChunk; ++c) {  // all loads first: kRowChunk in flight (and read before written)
        const int64_t j = j0 + int64_t{c} * kRowThreads;
        z[c] = j < V ? from_bits<DT>(row[j]) * inv_t : 0.0f;
      }
#pragma unroll
      for (int c = 0; c < kRowChunk; ++c) {
        const int64_t j = j0 + int64_t{c} * kRowThreads;
        if (j < V) {
          const float d = lse - z[c];  // lse - z_j
          out[j] = to_bits<DT>((j == y ? logprob_grad_label(d, gl, gh, h) : logprob_grad(d, gl, gh, h)) * inv_t);
        }
      }
    }
  }
}

}  // namespace

int token_logprobs_forward_cuda(const TokenLogprobsArgs& a, uintptr_t stream) {
  return launch_rows(a, stream, [](auto dt) { return token_logprobs_forward_kernel<decltype(dt)::value>; });
}

int token_logprobs_backward_cuda(const TokenLogprobsArgs& a, uintptr_t stream) {
  return launch_rows(a, stream, [](auto dt) { return token_logprobs_backward_kernel<decltype(dt)::value>; });
}

}  // namespace kl
