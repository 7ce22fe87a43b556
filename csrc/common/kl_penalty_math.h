// Per-token math of kl_penalty_loss, shared by the CPU (_C) and CUDA (_cuda) kernels.
//
// The semantics are those of kl_kernels/kl_penalty/reference.py, for one counted token:
//
//   r     = clamp(lr, -20, 20)                  ratio = exp(r)
//           lr = lp - old, or (importance_sampling_level "sequence", GSPO) the sequence's mean of lp - old
//           over its counted tokens, computed before the kernel; either way d lr / d lp = 1
//   gain  = ratio * A      gain_c = clamp(ratio, clip_lo, clip_hi) * A   (bounds +-inf: no clip)
//   pg    = -(gain <= gain_c ? gain : gain_c)   clipped = !(gain <= gain_c)
//   low   = ratio < clip_lo && A < 0            high = ratio > clip_hi && A > 0   (TRL's clip metrics' flags)
//   dual  = A < 0 && -A * clip_c < pg           (dual clip; clip_c = +inf: never)
//   obj   = w_obj * (dual ? -A * clip_c : pg)
//   d     = sign * (lp - other)                 other = ref (sign +1) or old (sign -1)
//   kl    = w_kl * clamp(est(clamp(d, clamp_input)), clamp_output)    (kl_math.h's kl_value; bounds optional)
//           (times ratio with kl_times_ratio, and its gradient then the product's: see ppo_token)
//   loss  = obj + beta * kl - entropy_coef * entropy
//   dloss/dlp = w_obj * (dual ? 0 : -A * ratio * [|lr| <= 20] * (gain <= gain_c ? 1 : [clip_lo <= ratio <= clip_hi]))
//               (the first term is exactly 0 where lr is outside, NaN included)
//               + beta * sign * w_kl * est'(d)   (est' through both clamps as kl_math.h's kl_grad;
//                                                 straight-through estimators: est'(d) = d, unclamped)
// w_obj, w_kl: the token's weights (1 without weights; x * 1 is exact, so unweighted calls keep their bits).
//
// Branch-free selects only, so that the CPU loops calling it vectorize.
#pragma once

#include "common/kl_math.h"

namespace kl {

// kLogRatioBound (exp(20) ~ 4.9e8: ratio * A stays finite in float32): common/codes.h.

struct PPOToken {
  float obj, kl, ratio, clipped, grad;  // grad: d(obj + beta * kl) / d lp
  float low, high;                      // TRL's clip flags, 1 or 0 (unused by a caller: compiled out)
};

// est_value / est_derivative: the estimators of common/kl_math.h (written once for both ops).

// One counted token. ST (straight-through): value of EST, derivative of k2 (d). CL: the KL's clamps
// (p, read at run time) apply; without, the estimator is used bare. Template parameters, not runtime
// flags: a loop-invariant select keeps GCC from vectorizing the CPU loops (the clamps read from p made
// the CPU loss 6-7x slower even with no bound set, so the unclamped loop is compiled with CL = false).
// lr_raw: the log-ratio before its clamp, lp - old per token (or the sequence's, GSPO): the caller's.
// kl_ratio (0 or all bits set; kl_times_ratio): the KL term times the ratio, differentiated through both (TRL's
// use_bias_correction_kl): kl = w_kl * ratio * est(d), d/dlp = w_kl * (ratio * sign * est'(d) + [|lr| <= 20]
// ratio * est(d)). Bit masks, not selects (see above); with kl_ratio = 0 the plain term's exact bits. KR = false
// compiles it out (the CPU's common loop: with it, read at run time, GCC no longer vectorized the loop, 5x slower).
// EST = kEstimatorAtRunTime: the estimator and straight-through flag are read from p at run time (kl_value /
// kl_grad of kl_math.h, the same expressions; ST and CL are then ignored): the CUDA loss forward, where
// specializing on them made 8x the kernels (160 instantiations of the tile kernel; nvcc ~4 minutes of CI).
constexpr int32_t kEstimatorAtRunTime = -1;

template <int32_t EST, bool ST, bool CL = true, bool KR = true>
KL_HD PPOToken ppo_token(float lp, float lr_raw, float other, float sign, float adv, float beta, float clip_lo,
                         float clip_hi, float clip_c, float w_obj, float w_kl, const EstimatorParams& p,
                         uint32_t kl_ratio = 0u) {
  const float lr = clamp_lo_hi(lr_raw, 1, -kLogRatioBound, 1, kLogRatioBound);
  // The clamp's gradient mask (a NaN is outside); autograd passes an exact 0 outside, so a select,
  // not a product (NaN * 0 is NaN).
  const bool in_lr = inside(lr_raw, 1, -kLogRatioBound, 1, kLogRatioBound) != 0.0f;
  const float ratio = exp_bounded(lr);  // |lr| <= 20
  const float gain = ratio * adv;
  const float gain_c = clamp_lo_hi(ratio, 1, clip_lo, 1, clip_hi) * adv;
  const bool take = gain <= gain_c;  // NaN: false, as torch.where in the reference
  const float w = take ? 1.0f : inside(ratio, 1, clip_lo, 1, clip_hi);
  const float d = sign * (lp - other);
  float dk, kl;
  if constexpr (EST == kEstimatorAtRunTime) {
    dk = kl_grad(d, p);
    kl = kl_value(d, p);
  } else if constexpr (CL) {  // the KL with its clamps (kl_math.h)
    dk = kl_grad_of<EST, ST>(d, p);
    kl = kl_value_of<EST>(d, p);
  } else {
    dk = ST ? d : est_derivative<EST>(d);
    kl = est_value<EST>(d);
  }
  const float pg = -(take ? gain : gain_c);
  const float cap = -adv * clip_c;
  const bool dual = adv < 0.0f && cap < pg;  // NaN pg: false (NaN stays)
  PPOToken t;
  t.obj = w_obj * (dual ? cap : pg);
  t.ratio = ratio;
  t.clipped = take ? 0.0f : 1.0f;
  t.low = (ratio < clip_lo && adv < 0.0f) ? 1.0f : 0.0f;
  t.high = (ratio > clip_hi && adv > 0.0f) ? 1.0f : 0.0f;
  const float g_obj = dual ? 0.0f : -adv * ratio * w;
  if constexpr (KR) {
    const float kr = bits_f32((f32_bits(ratio) & kl_ratio) | (0x3f800000u & ~kl_ratio));  // ratio, or 1
    const float dr = in_lr ? ratio * kl : 0.0f;  // the ratio's derivative times the KL (read with kl_ratio only)
    t.kl = w_kl * (kr * kl);
    const float g_base = w_obj * (in_lr ? g_obj : 0.0f) + beta * sign * (w_kl * (kr * dk));
    const float g_with = g_base + beta * (w_kl * dr);
    t.grad = bits_f32((f32_bits(g_with) & kl_ratio) | (f32_bits(g_base) & ~kl_ratio));
  } else {
    t.kl = w_kl * kl;
    t.grad = w_obj * (in_lr ? g_obj : 0.0f) + beta * sign * (w_kl * dk);
  }
  return t;
}

}  // namespace kl
