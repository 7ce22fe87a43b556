// Arguments of the fused kl_penalty_loss kernels, shared by the CPU and CUDA implementations.
//
// The geometry (layout, sizes, offsets / lengths, padding side), the mask, the log-probs and their
// dtype live in a KLRewardArgs `g`, read with kl_reward's helpers (seq_geom, seq_of, the CPU tile
// runs); kl_reward's reward/coef/output fields are unused. Inputs are read at
// X[row * X_s0 + col * X_s1] (packed: row = 0); outputs are contiguous in the layout's shape.
// Validation happens in Python before a kernel ever sees these.
#pragma once

#include <cstdint>

#include "common/kl_reward_args.h"

namespace kl {

struct KLPenaltyArgs {
  KLRewardArgs g;  // geometry, mask, lp (+ strides), dtype (of lp, old and ref); est.estimator/straight_through

  // inputs besides lp and the mask
  uintptr_t old = 0, ref = 0, adv = 0, ent = 0, wt = 0;  // ref, ent, wt: 0 when absent
  int64_t old_s0 = 0, old_s1 = 1, ref_s0 = 0, ref_s1 = 1, adv_s0 = 0, adv_s1 = 1, ent_s0 = 0, ent_s1 = 1;
  int64_t wt_s0 = 0, wt_s1 = 1;
  int32_t aux_dtype = kFloat32;  // advantages, entropy and weights: lp's dtype or float32
  int32_t weight_kl = 0;         // the weights multiply the KL term too (else the policy term only)
  int32_t adv_per_seq = 0;       // advantages [B] read at adv[b * adv_s0]
  int32_t beta_mode = kCoefScalar;
  float beta_scalar = 1.0f;
  uintptr_t beta = 0;            // float32 [1] (0-d) or [B]
  float clip_lo = -INFINITY, clip_hi = INFINITY;  // ratio clip bounds (infinite: no clip)
  float clip_c = INFINITY;       // dual clip: for A < 0 the objective is at most -A * clip_c (infinite: none)
  float entropy_coef = 0.0f;
  // importance_sampling_level "sequence" (GSPO): float32 [B], sequence b's log-ratio (the mean of lp - old
  // over its counted tokens, computed before the kernel), used as every counted token's lp - old; 0: per token.
  uintptr_t seq_lr = 0;
  int32_t kl_ratio = 0;          // kl_times_ratio: the KL term times the (differentiable) ratio

  // forward outputs (contiguous); the CPU forward skips each of seq_loss, stats and count that is 0
  // (a caller of the totals), the CUDA forward writes them always
  uintptr_t seq_loss = 0;   // float32 [B]
  uintptr_t stats = 0;      // float32 [B, kStatColumns]: the sums of kStatColumns' columns
  uintptr_t count = 0;      // int64 [B]
  uintptr_t token_out = 0;  // float32 [4, total] (aggregation "none") or 0
  uintptr_t grad = 0;       // float32 [total]: d loss_t / d lp_t (0 where not counted)
  uintptr_t totals = 0;     // float64 [kTotals] or 0: batch totals, summed over b in order (CPU forward only)

  // The aggregations folded into the CUDA forward, so an eager call on a GPU gets its outputs from the
  // kernels instead of a torch launch per part (the H200 run of 2026-11-26: ~38 small launches per
  // forward, more time than eager autograd). Sequence b's loss weighs w * u_b with
  // w = agg_scale / (agg_per_token ? max(N, 1) : 1), N the token count of all ranks (agg_tokens) or
  // of this batch, and u_b = 1 / max(n_b, 1) with agg_seq_mean (seq-mean-token-mean), else 1.
  // See finalize_aggregation below.
  uintptr_t result = 0;          // float32 [kResults], or 0: the parts and means (see kResults)
  uintptr_t result_loss = 0;     // float32 [1]: the loss (with result; its own tensor, the differentiable one)
  uintptr_t result_count = 0;    // int64 [1]: the counted tokens (with result)
  uintptr_t result_weight = 0;   // float64 [1]: w (with result), read by the backward through g_loss
  double agg_scale = 1.0;
  int32_t agg_per_token = 0;
  int32_t agg_seq_mean = 0;
  uintptr_t agg_tokens = 0;      // float64 [1] or 0 (this batch's count)
  double agg_beta = 0.0;         // beta of the kl part, in float64 (beta_mode scalar; else beta[0] is read)
  double agg_entropy_coef = 0.0; // entropy_coef of the entropy part, in float64

  // backward: incoming gradients (each may be 0 = zero) and outputs
  uintptr_t g_seq = 0;      // float32 [B]
  float g_uniform = 0.0f;   // the incoming gradient of every sequence's loss where g_seq is 0
  uintptr_t g_loss = 0;     // float32 [1] or 0: the aggregated loss's gradient; sequence b's is g_loss * w * u_b
                            // (w at result_weight, n_b at count with agg_seq_mean; CUDA backward only)
  uintptr_t g_tok = 0;      // float32 [total]
  uintptr_t g_lp = 0;       // lp dtype [total]
  uintptr_t g_ent = 0;      // aux dtype [total], or 0
};

// The per-sequence stats, [B, kStatColumns] float32 (kl_kernels/kl_penalty/reference.py's STAT_COLUMNS, the one
// table; the extensions export these constants and tests/test_kl_penalty_diagnostics.py compares): the sums over
// counted tokens of the objective, the KL term, the entropy, the ratio, the clipped flag (the clipped branch
// taken) and TRL's low / high clip flags (ratio < clip_lo and A < 0; ratio > clip_hi and A > 0).
constexpr int kStatObjective = 0, kStatKL = 1, kStatEntropy = 2, kStatRatio = 3, kStatClipped = 4;
constexpr int kStatClippedLow = 5, kStatClippedHigh = 6;
constexpr int kStatColumns = 7;
// totals: the loss, the sums of the stat columns, then the token count. They spare the caller of a
// one-weight aggregation (token-mean, sum, ...) its own pass over [B] outputs.
constexpr int kTotals = 1 + kStatColumns + 1;
// result: loss_objective, loss_kl, loss_entropy, kl_mean, ratio_mean, clip_fraction, clip_low_fraction,
// clip_high_fraction, entropy_mean (kl_kernels/kl_penalty/aggregate.py's RESULT_FIELDS).
constexpr int kResults = 9;

// beta of sequence b.
KL_HD float beta_of(const KLPenaltyArgs& a, int64_t b) {
  if (a.beta_mode == kCoefScalar) return a.beta_scalar;
  const float* c = reinterpret_cast<const float*>(a.beta);
  return a.beta_mode == kCoefPerSeq ? c[b] : c[0];
}

// Sums of the aggregation on the device (CUDA totals kernel), over b in [0, B): u_b * S_b,
// u_b * objective_b, u_b * beta_b * kl_b, u_b * entropy_b, then kl_b, ratio_b, clipped_b, n_b,
// clipped_low_b, clipped_high_b and entropy_b.
constexpr int kAggSums = 11;

// 1 / max(n_b, 1) with agg_seq_mean, else 1: u_b of sequence b with n_b counted tokens.
KL_HD double seq_weight(const KLPenaltyArgs& a, int64_t n_b) {
  return a.agg_seq_mean ? 1.0 / static_cast<double>(n_b > 1 ? n_b : 1) : 1.0;
}

// Sequence b's terms of the sums above, added to s.
KL_HD void add_agg_terms(const KLPenaltyArgs& a, int64_t b, double loss, const float* st, int64_t n_b, double* s) {
  const double u = seq_weight(a, n_b);
  const double beta = a.beta_mode == kCoefScalar ? a.agg_beta : static_cast<double>(beta_of(a, b));
  s[0] += u * loss;
  s[1] += u * static_cast<double>(st[kStatObjective]);
  s[2] += u * beta * static_cast<double>(st[kStatKL]);
  s[3] += u * static_cast<double>(st[kStatEntropy]);
  s[4] += static_cast<double>(st[kStatKL]);
  s[5] += static_cast<double>(st[kStatRatio]);
  s[6] += static_cast<double>(st[kStatClipped]);
  s[7] += static_cast<double>(n_b);
  s[8] += static_cast<double>(st[kStatClippedLow]);
  s[9] += static_cast<double>(st[kStatClippedHigh]);
  s[10] += static_cast<double>(st[kStatEntropy]);
}

// The outputs from the sums s [kAggSums]: loss = w * sum_b u_b S_b, the parts likewise (the entropy
// part times -entropy_coef), the means over this batch's counted tokens, the count and w. The
// formulas of kl_kernels/kl_penalty/aggregate.py (aggregate, uniform_parts), which
// tests/test_kl_penalty_on_device.py checks this against.
KL_HD void finalize_aggregation(const KLPenaltyArgs& a, const double* s) {
  const double n = s[7];
  const double big_n = a.agg_tokens ? *reinterpret_cast<const double*>(a.agg_tokens) : n;
  const double w = a.agg_per_token ? a.agg_scale / (big_n > 1.0 ? big_n : 1.0) : a.agg_scale;
  const double denom = n > 1.0 ? n : 1.0;
  *reinterpret_cast<float*>(a.result_loss) = static_cast<float>(s[0] * w);
  float* r = reinterpret_cast<float*>(a.result);
  r[0] = static_cast<float>(s[1] * w);
  r[1] = static_cast<float>(s[2] * w);
  r[2] = static_cast<float>(s[3] * w * -a.agg_entropy_coef + 0.0);  // + 0.0: no -0.0
  r[3] = static_cast<float>(s[4] / denom);
  r[4] = static_cast<float>(s[5] / denom);
  r[5] = static_cast<float>(s[6] / denom);
  r[6] = static_cast<float>(s[8] / denom);
  r[7] = static_cast<float>(s[9] / denom);
  r[8] = static_cast<float>(s[10] / denom);  // (0 without an entropy input: its column is 0)
  *reinterpret_cast<int64_t*>(a.result_count) = static_cast<int64_t>(n);
  *reinterpret_cast<double*>(a.result_weight) = w;
}

}  // namespace kl
