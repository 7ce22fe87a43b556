// Math of the row-wise ops over a vocabulary (token_logprobs, full_kl), shared verbatim by the CPU kernels
// (cpu/token_logprobs_cpu.cpp, cpu/full_kl_cpu.cpp) and the CUDA ones (cuda/token_logprobs_cuda.cu,
// cuda/full_kl_cuda.cu): where a row starts, each entry's terms of the row sums, how the sums follow a
// running max (one pass), how a row's sums become its outputs, and each entry's gradient. The backends differ
// only in how they walk a row and in the order they add its terms (each in a fixed order: deterministic).
// The formulas are those of kl_kernels/token_logprobs/reference.py and kl_kernels/full_kl/reference.py
// (tests hold every backend to a float64 oracle). The formulas that take an exponential take it from an `Exp`
// policy: the CPU kernels the polynomial exp_vec (ExpPoly: the same float32 bits on every x86 machine, and
// vectorized by GCC), the CUDA kernels the hardware's ex2 (cuda/rows.cuh: 2 instructions instead of ~20 per
// exponential, relative error below 2^-22, which the oracle's float32 tolerance covers).
//
// token_logprobs, z = x / T (or the soft-capped c tanh(x / c) / T: NoCap / SoftCap below), m = max z, d_j = m - z_j >= 0 (inf at a -inf logit):
//   S = sum_j e^-d_j;  W = sum_j e^-d_j min(d_j, far)       lse = m + log S;  log_prob = z_y - lse
//   entropy = W / S + log S  (= sum_j p_j (lse - z_j));      d x_j = (g_lp (1[j = y] - p_j) + g_H p_j (min(lse - z_j, far) - entropy)) / T
// full_kl, w = r / T, n = max w, u_j = m - z_j, v_j = n - w_j:
//   S = sum_j e^-u_j;  R = sum_j e^-v_j;  A = sum_j e^-u_j (v_j - u_j)  (0 where e^-u_j is; +inf where
//   e^-u_j > 0 and w_j = -inf)
//   KL = A / S + log R - log S;  lse = m + log S;  ref_lse = n + log R
//   d x_j = g p_j ((ref_lse - w_j) - (lse - z_j) - KL) / T  (0 where p_j is);  d r_j = g (q_j - p_j) / T
// A counted row with a NaN or +inf logit, or only -inf ones (in either tensor for full_kl), gives NaN.
//
// One pass (online max and sums): the forward reads each row once. Its entries come in runs (a CPU kernel's
// 1024-entry run, a CUDA thread's step of one or two 8-entry vectors (cuda/rows.cuh), a Triton token_logprobs program's BLOCK-wide step,
// kl_kernels/triton/row_math.py; Triton's full_kl forward is two-pass, by measurement): a run's max is merged into
// the running max first, the sums so far are moved onto the new max (*_rebase: a sum against m becomes one against
// m' = m + delta by S' = e^-delta S, W' = e^-delta (W + delta S), A' = e^-delta_m (A + (delta_n - delta_m) F), F
// the part of S whose reference is finite), then the run's terms are taken against it. A CUDA block's threads each
// keep such a running state and rebase it onto the block's max before the block sums. The factor is float64 and 0
// beyond kRowFar, where every moved term is below float32's exp flush (as a term d > 87.3 is 0 in the two-pass
// sum), which also keeps inf * 0 out.
#pragma once

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "common/codes.h"
#include "common/kl_math.h"  // KL_HD, exp_vec, BitsOf
#include "common/row_args.h"

namespace kl {

// kRowFar (common/codes.h, from kl_kernels/codes.py): lse - z beyond it has e^(z - lse) == 0 in float32
// (exp_vec flushes below e^-87.3); clamping there keeps 0 * inf (a -inf logit) out of the terms weighted by a
// probability.
KL_HD float row_far(float d) { return d <= kRowFar ? d : kRowFar; }

// Element where row r starts (common/row_args.h).
KL_HD int64_t row_start(int64_t r, int64_t inner, int64_t so, int64_t si) { return (r / inner) * so + (r % inner) * si; }

// Row r of each tensor of the row kernels' arguments, as elements of logits dtype DT (nullptr for a
// gradient that is not wanted).
template <int32_t DT, class Args>
KL_HD const BitsOf<DT>* logits_row(const Args& a, int64_t r) {
  return reinterpret_cast<const BitsOf<DT>*>(a.logits) + row_start(r, a.inner, a.stride_outer, a.stride_inner);
}
template <int32_t DT>
KL_HD const BitsOf<DT>* ref_logits_row(const FullKLArgs& a, int64_t r) {
  return reinterpret_cast<const BitsOf<DT>*>(a.ref_logits) + row_start(r, a.inner, a.ref_stride_outer, a.ref_stride_inner);
}
template <int32_t DT, class Args>
KL_HD BitsOf<DT>* grad_logits_row(const Args& a, int64_t r) {
  return a.grad_logits ? reinterpret_cast<BitsOf<DT>*>(a.grad_logits) + row_start(r, a.inner, a.g_stride_outer, a.g_stride_inner)
                       : nullptr;
}
template <int32_t DT>
KL_HD BitsOf<DT>* grad_ref_row(const FullKLArgs& a, int64_t r) {
  return a.grad_ref ? reinterpret_cast<BitsOf<DT>*>(a.grad_ref) + row_start(r, a.inner, a.gr_stride_outer, a.gr_stride_inner)
                    : nullptr;
}

template <class Args>
KL_HD bool row_counted(const Args& a, int64_t r) { return reinterpret_cast<const bool*>(a.counted)[r]; }

// Whether a counted row's softmax is undefined: a NaN seen, or the max +inf or -inf (only -inf logits).
KL_HD bool row_undefined(bool nan_seen, float m) { return nan_seen || !(m > -INFINITY && m < INFINITY); }

// ---------------------------------------------------------------------------------- the logits' transform

// z_j of a logit x_j: x / T (NoCap), or with a soft-cap c, z = c tanh(x / c) / T (SoftCap), whose
// d z / d x = (1 - tanh^2(x / c)) / T: TRL's fused LM head and Gemma's final_logit_softcapping, in kernel units
// (kl_kernels/vocab_rows.py logit_transform folds the logit scale s into T and c: T/s, c/s). The kernels take the
// transform as a template argument (with_logit_cap), so the default path compiles as it did without one; every
// formula below then reads z. A capped +-inf logit is +-c/T, finite; NaN stays NaN.
struct NoCap {
  static constexpr bool kOn = false;
  float inv_t;
  KL_HD float z(float x) const { return x * inv_t; }
};
struct SoftCap {
  static constexpr bool kOn = true;
  float inv_t, inv_c, c_inv_t;  // 1 / T, 1 / c, c / T
  KL_HD float z(float x) const { return tanhf(x * inv_c) * c_inv_t; }
  // d z / d x * T: 1 - tanh^2, as (1 - t)(1 + t) (no cancellation near saturation)
  KL_HD float slope(float x) const {
    const float t = tanhf(x * inv_c);
    return (1.0f - t) * (1.0f + t);
  }
};

// The SoftCap of a row kernel's arguments (softcap > 0).
template <class Args>
KL_HD SoftCap soft_cap(const Args& a) {
  return SoftCap{a.inv_temperature, 1.0f / a.softcap, a.softcap * a.inv_temperature};
}

// fn(NoCap{...}) or fn(SoftCap{...}) for a row kernel's arguments (their inv_temperature and softcap). Host code.
template <class Args, class Fn>
inline void with_logit_cap(const Args& a, Fn&& fn) {
  if (a.softcap > 0.0f) {
    fn(soft_cap(a));
  } else {
    fn(NoCap{a.inv_temperature});
  }
}

// ---------------------------------------------------------------------------------- one pass

// The value terms are taken against for a running max m: m itself, or -FLT_MAX while m is -inf (no entry
// above -inf yet), so that a -inf entry's term is e^-inf = 0, not e^-(-inf - -inf) = NaN; the rebase onto
// the first finite max then multiplies those zero sums by e^-(m + FLT_MAX) = 0.
KL_HD float row_floor(float m) { return m >= -FLT_MAX ? m : -FLT_MAX; }

// Moving a sum taken against running max `from` onto `to` >= from: the shift delta = floor(to) - floor(from)
// (float64: exact, and finite even from -FLT_MAX to FLT_MAX) and the factor e^-delta (0 beyond kRowFar).
struct RowShift {
  double delta, factor;
};
KL_HD RowShift row_shift(float from, float to) {
  const double delta = static_cast<double>(row_floor(to)) - static_cast<double>(row_floor(from));
  return {delta, delta > kRowFar ? 0.0 : exp(-delta)};
}

// ---------------------------------------------------------------------------------- token_logprobs

// token_logprobs' running state: the max so far m (-inf before any entry above -inf), S and W against
// row_floor(m).
struct LogprobSums {
  float m;
  double S, W;
};
KL_HD LogprobSums logprob_sums_start() { return {-INFINITY, 0.0, 0.0}; }

// Merge a run's max into s (moving S and W onto the new max); returns the value to take the run's terms
// against (d = returned - z_j >= 0). A NaN run_max (never: the runs' maxima skip NaN) changes nothing.
KL_HD float logprob_rebase(LogprobSums& s, float run_max) {
  if (run_max > s.m) {
    const RowShift k = row_shift(s.m, run_max);
    s.W = k.factor == 0.0 ? 0.0 : k.factor * (s.W + k.delta * s.S);
    s.S = k.factor * s.S;
    s.m = run_max;
  }
  return row_floor(s.m);
}

// The CPU kernels' exponential (see the top of this file).
struct ExpPoly {
  KL_HD float operator()(float y) const { return exp_vec(y); }
};

// One entry's terms of S and W, d = m - z_j.
template <class Exp = ExpPoly>
KL_HD void logprob_terms(float d, float& e, float& w, Exp exp = {}) {
  e = exp(-d);
  w = e * row_far(d);
}

// The row's lse and entropy from m, S, W (float64 sums).
KL_HD float logprob_lse(float m, double log_s) { return static_cast<float>(static_cast<double>(m) + log_s); }
KL_HD float logprob_entropy(double S, double W, double log_s) { return static_cast<float>(W / S + log_s); }

// A row's forward outputs (entropy where wanted). A row that is not counted gives 0 everywhere, an undefined
// one NaN (row_store_all).
KL_HD void logprob_store(const TokenLogprobsArgs& a, int64_t r, float lp, float lse, float entropy) {
  reinterpret_cast<float*>(a.log_probs)[r] = lp;
  reinterpret_cast<float*>(a.lse)[r] = lse;
  if (a.entropy) reinterpret_cast<float*>(a.entropy)[r] = entropy;
}
KL_HD void row_store_all(const TokenLogprobsArgs& a, int64_t r, float v) { logprob_store(a, r, v, v, v); }
KL_HD int64_t row_label(const TokenLogprobsArgs& a, int64_t r) { return reinterpret_cast<const int64_t*>(a.labels)[r]; }

// What the backward reads of a row besides its logits: the incoming gradients (0 where none reaches that
// output), the forward's lse, and its entropy (read only when a gradient reaches it, else 0).
struct LogprobGradRow {
  float g_lp, g_h, lse, h;
};
KL_HD LogprobGradRow logprob_grad_row(const TokenLogprobsArgs& a, int64_t r) {
  const float* g_lp = reinterpret_cast<const float*>(a.grad_lp);
  const float* g_h = reinterpret_cast<const float*>(a.grad_entropy);
  return {g_lp ? g_lp[r] : 0.0f, g_h ? g_h[r] : 0.0f, reinterpret_cast<const float*>(a.lse)[r],
          g_h ? reinterpret_cast<const float*>(a.entropy)[r] : 0.0f};
}

// d x_j * T for an entry j that is not the label, d = lse - z_j; h the row's entropy (0 when g_H is).
template <class Exp = ExpPoly>
KL_HD float logprob_grad(float d, float g_lp, float g_h, float h, Exp exp = {}) {
  const float p = exp(-d);
  return -g_lp * p + g_h * (p * (row_far(d) - h));
}

// d x_y * T for the label's entry.
template <class Exp = ExpPoly>
KL_HD float logprob_grad_label(float d, float g_lp, float g_h, float h, Exp exp = {}) {
  const float p = exp(-d);
  return g_lp * (1.0f - p) + g_h * (p * (row_far(d) - h));
}

// ---------------------------------------------------------------------------------- full_kl

// full_kl's running state: both maxima so far (m the policy's, n the reference's), S, R and A against
// row_floor(m) and row_floor(n), F (S over the entries whose reference is finite: A's terms, which the
// reference's shift moves), and `lost`, the policy's largest z_j where the reference is -inf (w_j = -inf,
// v_j = inf). Those entries stay out of A: a term e * inf against a running max could not be moved off inf
// when the max later rises past it (its probability then 0); whether the KL is +inf is decided at the end,
// against the final max, by the two-pass rule (full_kl_value).
struct FullKLSums {
  float m, n, lost;
  double S, F, R, A;
};
KL_HD FullKLSums full_kl_sums_start() { return {-INFINITY, -INFINITY, -INFINITY, 0.0, 0.0, 0.0, 0.0}; }

// An entry's contribution to a run's `lost` (the caller takes the max): z_j where w_j = -inf, else -inf.
KL_HD float full_kl_lost(float z, float w) { return w == -INFINITY ? z : -INFINITY; }

// Merge a run's maxima and lost into s (moving S, F, R and A onto the new maxima); the values to take the
// run's terms against come back in fm, fn (u = fm - z_j, v = fn - w_j).
KL_HD void full_kl_rebase(FullKLSums& s, float run_m, float run_n, float run_lost, float& fm, float& fn) {
  const bool up_m = run_m > s.m, up_n = run_n > s.n;
  if (up_m || up_n) {
    const RowShift km = up_m ? row_shift(s.m, run_m) : RowShift{0.0, 1.0};
    const RowShift kn = up_n ? row_shift(s.n, run_n) : RowShift{0.0, 1.0};
    s.A = km.factor == 0.0 ? 0.0 : km.factor * (s.A + (kn.delta - km.delta) * s.F);
    s.S = km.factor * s.S;
    s.F = km.factor * s.F;
    s.R = kn.factor * s.R;
    s.m = up_m ? run_m : s.m;
    s.n = up_n ? run_n : s.n;
  }
  s.lost = run_lost > s.lost ? run_lost : s.lost;
  fm = row_floor(s.m);
  fn = row_floor(s.n);
}

// One entry's terms of S, F, R and A, u = m - z_j, v = n - w_j (v = inf: the reference is -inf there).
template <class Exp = ExpPoly>
KL_HD void full_kl_terms(float u, float v, float& e, float& f, float& q, float& a, Exp exp = {}) {
  e = exp(-u);
  q = exp(-v);
  const bool finite_ref = v < INFINITY;
  f = finite_ref ? e : 0.0f;
  a = e > 0.0f && finite_ref ? e * (v - u) : 0.0f;
}

// The row's KL from S, R, A (float64 sums) and their logs: +inf where an entry whose reference is -inf has
// a probability above float32's exp flush against the final max m (e^-(m - lost) > 0: what a two-pass
// forward's term e * inf gives; one below it is 0, as p_j * (v_j - u_j) is taken as 0 where p_j is).
// `exp` the terms' own, so that the flush that decides here is the one that zeroed the terms (and the backward's p).
template <class Exp = ExpPoly>
KL_HD float full_kl_value(double S, double A, double log_s, double log_r, float m, float lost, Exp exp = {}) {
  if (exp(lost - m) > 0.0f) return INFINITY;
  return static_cast<float>(A / S + (log_r - log_s));
}

// A row's forward outputs; not counted: 0 everywhere, undefined: NaN (row_store_all).
KL_HD void full_kl_store(const FullKLArgs& a, int64_t r, float kl, float lse, float ref_lse) {
  reinterpret_cast<float*>(a.kl)[r] = kl;
  reinterpret_cast<float*>(a.lse)[r] = lse;
  reinterpret_cast<float*>(a.ref_lse)[r] = ref_lse;
}
KL_HD void row_store_all(const FullKLArgs& a, int64_t r, float v) { full_kl_store(a, r, v, v, v); }

// What the backward reads of a row besides its logits: g = d loss / d KL over T, the forward's KL and lse's.
// A counted row whose KL is not finite has NaN gradients (full_kl_grad_defined false), a row not counted 0.
struct FullKLGradRow {
  float g, kl, lse, ref_lse;
};
KL_HD FullKLGradRow full_kl_grad_row(const FullKLArgs& a, int64_t r) {
  return {reinterpret_cast<const float*>(a.grad_kl)[r] * a.inv_temperature, reinterpret_cast<const float*>(a.kl)[r],
          reinterpret_cast<const float*>(a.lse)[r], reinterpret_cast<const float*>(a.ref_lse)[r]};
}
KL_HD bool full_kl_grad_defined(float kl) { return kl > -INFINITY && kl < INFINITY; }

// d x_j and d r_j of one entry, g = g_KL / T, u = lse - z_j, v = ref_lse - w_j.
template <class Exp = ExpPoly>
KL_HD float full_kl_grad_policy(float g, float u, float v, float kl, Exp exp = {}) {
  const float p = exp(-u);
  return p > 0.0f ? g * (p * ((v - u) - kl)) : 0.0f;
}
template <class Exp = ExpPoly>
KL_HD float full_kl_grad_ref(float g, float u, float v, Exp exp = {}) { return g * (exp(-v) - exp(-u)); }

// fn(std::integral_constant<int32_t, DT>{}) for a logits dtype code DT of kFloat32, kBFloat16, kFloat16;
// 0, or 1 for any other code (the kernels' "unsupported dtype"). Host code.
template <class Fn>
inline int with_logits_dtype(int32_t dtype, Fn&& fn) {
  switch (dtype) {
    case kFloat32: fn(std::integral_constant<int32_t, kFloat32>{}); return 0;
    case kBFloat16: fn(std::integral_constant<int32_t, kBFloat16>{}); return 0;
    case kFloat16: fn(std::integral_constant<int32_t, kFloat16>{}); return 0;
    default: return 1;
  }
}

}  // namespace kl
