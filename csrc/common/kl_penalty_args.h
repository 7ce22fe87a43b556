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

  // forward outputs (contiguous); the CPU forward skips seq_loss, stats and count when they are 0
  // (a caller of the totals), the CUDA forward writes them always
  uintptr_t seq_loss = 0;   // float32 [B]
  uintptr_t stats = 0;      // float32 [B, 5]: objective, kl, entropy, ratio, clipped sums
  uintptr_t count = 0;      // int64 [B]
  uintptr_t token_out = 0;  // float32 [4, total] (aggregation "none") or 0
  uintptr_t grad = 0;       // float32 [total]: d loss_t / d lp_t (0 where not counted)
  uintptr_t totals = 0;     // float64 [kTotals] or 0: batch totals, summed over b in order (CPU forward only)

  // backward: incoming gradients (each may be 0 = zero) and outputs
  uintptr_t g_seq = 0;      // float32 [B]
  float g_uniform = 0.0f;   // the incoming gradient of every sequence's loss where g_seq is 0
  uintptr_t g_tok = 0;      // float32 [total]
  uintptr_t g_lp = 0;       // lp dtype [total]
  uintptr_t g_ent = 0;      // aux dtype [total], or 0
};

constexpr int kStatColumns = 5;
// totals: loss, objective, kl, entropy, ratio and clipped sums, then the token count. They spare
// the caller of a one-weight aggregation (token-mean, sum, ...) its own pass over [B] outputs.
constexpr int kTotals = 7;

// beta of sequence b.
KL_HD float beta_of(const KLPenaltyArgs& a, int64_t b) {
  if (a.beta_mode == kCoefScalar) return a.beta_scalar;
  const float* c = reinterpret_cast<const float*>(a.beta);
  return a.beta_mode == kCoefPerSeq ? c[b] : c[0];
}

}  // namespace kl
