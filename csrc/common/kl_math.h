// Per-token KL math of both ops (kl_reward; kl_penalty_loss through kl_penalty_math.h), shared verbatim by the
// CPU (_C) and CUDA (_cuda) kernels.
//
// Everything here is a pure function of one token: the estimators and their derivatives, the
// clamps, the straight-through rule, and the fp16/bf16 <-> fp32 conversions (round to nearest
// even, as torch). The semantics are those of kl_kernels/kl_reward/reference.py:
//
//   x   = clamp(d, clamp_input)            d = log_prob - ref_log_prob (fp32)
//   e   = clamp(est(x), clamp_output)      k1: x  abs: |x|  k2: x^2/2  k3: expm1(-x) + x
//   de/dd = [lo_out <= est(x) <= hi_out] * est'(x) * [lo_in <= d <= hi_in]
//   straight-through variants (k1+, abs+, k2+, k3+): value e, derivative d (k2's, unclamped)
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "common/codes.h"

#if defined(__CUDACC__)
#define KL_HD __host__ __device__ __forceinline__
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#else
#define KL_HD inline
#endif

namespace kl {

// Estimator and DType (the codes used across the Python/C++ boundary) are in common/codes.h,
// generated from kl_kernels/codes.py.

struct EstimatorParams {
  int32_t estimator;         // Estimator
  int32_t straight_through;  // 1 for k1+, abs+, k3+
  // Clamps: a bound is active when its flag is set (NaN-free by validation).
  int32_t in_lo_set, in_hi_set, out_lo_set, out_hi_set;
  float in_lo, in_hi, out_lo, out_hi;
};

// ------------------------------------------------------------------------------ conversions

KL_HD uint32_t f32_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof(u));
  return u;
}

KL_HD float bits_f32(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof(f));
  return f;
}

KL_HD float bf16_to_f32(uint16_t h) { return bits_f32(static_cast<uint32_t>(h) << 16); }

KL_HD uint16_t f32_to_bf16(float f) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  // sm_80+: one F2FP (round to nearest even, as below; a NaN comes out as the canonical quiet NaN) instead of
  // the ~7 integer instructions below, which a row kernel's backward paid per entry.
  return __bfloat16_as_ushort(__float2bfloat16_rn(f));
#else
  uint32_t u = f32_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);                                                     // round to nearest even
  return static_cast<uint16_t>(u >> 16);
#endif
}

KL_HD float f16_to_f32(uint16_t h) {
#if defined(__CUDA_ARCH__)
  __half_raw raw;
  raw.x = h;
  return __half2float(__half(raw));
#else
  // IEEE half -> float, exact (normal, subnormal, inf, NaN).
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t man = h & 0x3ffu;
  if (exp == 0x1fu) return bits_f32(sign | 0x7f800000u | (man << 13));
  if (exp == 0) {
    if (man == 0) return bits_f32(sign);
    exp = 127 - 15 + 1;
    while ((man & 0x400u) == 0) {
      man <<= 1;
      --exp;
    }
    man &= 0x3ffu;
    return bits_f32(sign | (exp << 23) | (man << 13));
  }
  return bits_f32(sign | ((exp + 127 - 15) << 23) | (man << 13));
#endif
}

KL_HD uint16_t f32_to_f16(float f) {
#if defined(__CUDA_ARCH__)
  return __half_raw(__float2half_rn(f)).x;
#else
  // float -> IEEE half, round to nearest even, with overflow to inf and subnormals.
  const uint32_t u = f32_bits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t au = u & 0x7fffffffu;
  if (au > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);  // NaN
  if (au >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // >= 65520: inf (incl. inf)
  if (au < 0x38800000u) {                                                 // below the smallest normal half
    if (au < 0x33000000u) return sign;                                    // rounds to +-0
    // value = man * 2^(exp - 150) and a subnormal half holds m * 2^-24, so m = man >> (126 - exp).
    const uint32_t exp = au >> 23;
    const uint32_t man = (au & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126 - exp;  // 14..24 here
    uint32_t half_man = man >> shift;
    const uint32_t rem = man & ((1u << shift) - 1u);
    const uint32_t halfway = 1u << (shift - 1);
    if (rem > halfway || (rem == halfway && (half_man & 1u))) ++half_man;
    return static_cast<uint16_t>(sign | half_man);
  }
  uint32_t v = au + 0xc8000000u;                 // rebias exponent: (127 - 15) << 23
  v += 0x0fffu + ((v >> 13) & 1u);               // round to nearest even on the 13 dropped bits
  return static_cast<uint16_t>(sign | (v >> 13));
#endif
}

// The storage of one element of dtype DT, and the conversions between it and fp32.
template <int32_t DT>
using BitsOf = std::conditional_t<DT == kFloat32, uint32_t, uint16_t>;

template <int32_t DT>
KL_HD float from_bits(BitsOf<DT> b) {
  if constexpr (DT == kFloat32) return bits_f32(b);
  else if constexpr (DT == kBFloat16) return bf16_to_f32(b);
  else return f16_to_f32(b);
}

template <int32_t DT>
KL_HD BitsOf<DT> to_bits(float v) {
  if constexpr (DT == kFloat32) return f32_bits(v);
  else if constexpr (DT == kBFloat16) return f32_to_bf16(v);
  else return f32_to_f16(v);
}

template <int32_t DT>
KL_HD float load(const void* p, int64_t i) {
  if constexpr (DT == kFloat32) return static_cast<const float*>(p)[i];
  else if constexpr (DT == kBFloat16) return bf16_to_f32(static_cast<const uint16_t*>(p)[i]);
  else return f16_to_f32(static_cast<const uint16_t*>(p)[i]);
}

template <int32_t DT>
KL_HD void store(void* p, int64_t i, float v) {
  if constexpr (DT == kFloat32) static_cast<float*>(p)[i] = v;
  else if constexpr (DT == kBFloat16) static_cast<uint16_t*>(p)[i] = f32_to_bf16(v);
  else static_cast<uint16_t*>(p)[i] = f32_to_f16(v);
}

// Copy a log-prob of dtype DT unchanged (the masked ref output keeps the input's bits).
template <int32_t DT>
KL_HD void copy_elem(void* dst, int64_t i, const void* src, int64_t j) {
  if constexpr (DT == kFloat32) static_cast<float*>(dst)[i] = static_cast<const float*>(src)[j];
  else static_cast<uint16_t*>(dst)[i] = static_cast<const uint16_t*>(src)[j];
}

template <int32_t DT>
KL_HD void store_zero(void* p, int64_t i) {
  if constexpr (DT == kFloat32) static_cast<float*>(p)[i] = 0.0f;
  else static_cast<uint16_t*>(p)[i] = 0;
}

// ------------------------------------------------------------------------------ expm1

// expm1 and exp in float32, branch-free so that loops calling them vectorize (libm's expm1f and
// expf are scalar calls). |y| < ln2/2: Taylor series to y^8 (truncation < 3e-9 relative): accurate
// near 0, where k3 = expm1(-x) + x lives. Estrin's scheme, not Horner's: 4 dependent steps instead
// of 9, so that the long per-token chains of the kernels' vector loops (two exps per token in the
// PPO loss) overlap instead of stalling on FMA latency.
KL_HD float expm1_poly(float y) {  // sum_{k=1..8} y^k / k!
  const float y2 = y * y;
  const float y4 = y2 * y2;
  const float a = 0.5f * y + 1.0f;                       // 1 + y/2
  const float b = (1.0f / 24.0f) * y + 1.0f / 6.0f;      // 1/6 + y/24
  const float c = (1.0f / 720.0f) * y + 1.0f / 120.0f;   // 1/120 + y/720
  const float d = (1.0f / 40320.0f) * y + 1.0f / 5040.0f;  // 1/5040 + y/40320
  return y * ((b * y2 + a) + (d * y2 + c) * y4);
}

// exp and expm1 share one reduction: y = n ln2 + r with n = round(y / ln2) (Cody-Waite split of ln2),
// |r| <= ln2/2, and e^y = 2^n (1 + p(r)) with p = expm1_poly: one polynomial per call, no branch.
//
// n is rounded by the 1.5 * 2^23 trick (a plain add, which vectorizes; rintf needs SSE4.1) and read
// back from the bits of that sum (unsigned arithmetic: no float->int conversion, so nothing is
// undefined for a NaN, which makes p, hence every result, NaN). 2^n is applied as 2 * 2^(n-1), so
// that n = 128 (y just below the float32 overflow at 88.72) stays representable and larger y overflow
// to +inf; y <= -87 (n = -126) gives 2^(n-1) = 0, so exp flushes to 0 where the true value is below
// 2e-38. Valid for y in [-87.3, 89] or NaN.
struct ExpReduced {
  float p;     // e^r - 1
  float half;  // 2^(n-1)
  int32_t n;
};

KL_HD ExpReduced exp_reduce_in_range(float y) {
  const float s = y * 1.44269504088896341f + 12582912.0f;
  const float n = s - 12582912.0f;
  const float r = (y - n * 0.693145751953125f) - n * 1.42860682030941723212e-6f;  // ln2 = hi + lo
  const uint32_t nb = f32_bits(s) - 0x4B400000u;                                   // n, two's complement
  ExpReduced e;
  e.n = static_cast<int32_t>(nb);
  e.half = bits_f32((nb + 126u) << 23);
  e.p = expm1_poly(r);
  return e;
}

// Any y: clamped to [-87.3, 89] first with selects (not fminf/fmaxf, whose NaN rules keep GCC from
// vectorizing). A NaN maps to -87.3 there; the callers put it back.
KL_HD ExpReduced exp_reduce(float y) {
  return exp_reduce_in_range(y >= -87.3f ? (y <= 89.0f ? y : 89.0f) : -87.3f);
}

KL_HD float exp_vec(float y) {
  const ExpReduced e = exp_reduce(y);
  const float out = (e.half * e.p + e.half) * 2.0f;
  return y != y ? y : out;  // NaN in, NaN out
}

// e^y for y in [-87, 88] or NaN (a clamped log-ratio): exp_vec without the input clamp and the NaN
// select (a NaN y gives NaN through p). Bitwise equal to exp_vec on that range.
KL_HD float exp_bounded(float y) {
  const ExpReduced e = exp_reduce_in_range(y);
  return (e.half * e.p + e.half) * 2.0f;
}

// expm1(y): p itself for |y| < ln2/2 (n = 0: r = y exactly), where e^y - 1 would cancel; e^y - 1
// elsewhere, where |expm1(y)| >= 0.29 so the subtraction loses nothing.
KL_HD float expm1_vec(float y) {
  const ExpReduced e = exp_reduce(y);
  const float out = e.n == 0 ? e.p : (e.half * e.p + e.half) * 2.0f - 1.0f;
  return y != y ? y : out;
}

// ------------------------------------------------------------------------------ estimators

// Branch-free (bitwise & and |, not && and ||) so that loops using them vectorize.
KL_HD float clamp_lo_hi(float v, int32_t lo_set, float lo, int32_t hi_set, float hi) {
  // NaN stays NaN, as torch.clamp: NaN < lo and NaN > hi are false.
  v = ((lo_set != 0) & (v < lo)) ? lo : v;
  v = ((hi_set != 0) & (v > hi)) ? hi : v;
  return v;
}

KL_HD float inside(float v, int32_t lo_set, float lo, int32_t hi_set, float hi) {
  // torch.clamp's gradient mask: passes where lo <= v <= hi for the bounds that are set
  // (boundaries included), so a NaN fails any set bound; with no bound set there is no clamp.
  return (((lo_set == 0) | (v >= lo)) & ((hi_set == 0) | (v <= hi))) ? 1.0f : 0.0f;
}

// The estimators, written once: a compile-time estimator (kernels specialized on it, the loss's) and
// a runtime one (kl_reward's kernels) run the same expressions.
template <int32_t EST>
KL_HD float est_value(float x) {
  if constexpr (EST == kK1) return x;
  else if constexpr (EST == kAbs) return fabsf(x);
  else if constexpr (EST == kK2) return 0.5f * x * x;
  else return expm1_vec(-x) + x;  // expm1 keeps k3 accurate near 0
}

template <int32_t EST>
KL_HD float est_derivative(float x) {
  if constexpr (EST == kK1) return 1.0f;
  else if constexpr (EST == kAbs) return x > 0.0f ? 1.0f : (x < 0.0f ? -1.0f : 0.0f);
  else if constexpr (EST == kK2) return x;
  else return -expm1_vec(-x);  // d/dx (expm1(-x) + x) = 1 - exp(-x)
}

// Value of the estimate EST for log-ratio d (both clamps applied; unset bounds are exact no-ops).
template <int32_t EST>
KL_HD float kl_value_of(float d, const EstimatorParams& p) {
  const float x = clamp_lo_hi(d, p.in_lo_set, p.in_lo, p.in_hi_set, p.in_hi);
  return clamp_lo_hi(est_value<EST>(x), p.out_lo_set, p.out_lo, p.out_hi_set, p.out_hi);
}

// d(kl)/d(d) for log-ratio d, as autograd computes it through the reference (ST: straight-through,
// the derivative of k2 at the unclamped d).
template <int32_t EST, bool ST>
KL_HD float kl_grad_of(float d, const EstimatorParams& p) {
  if constexpr (ST) {
    return d;
  } else {
    const float x = clamp_lo_hi(d, p.in_lo_set, p.in_lo, p.in_hi_set, p.in_hi);
    // As autograd through the reference: the output clamp's mask multiplies est' (0 * NaN is NaN),
    // the input clamp's selects (its backward is a where(): an exact 0 outside, NaN d included).
    const float g = inside(est_value<EST>(x), p.out_lo_set, p.out_lo, p.out_hi_set, p.out_hi) * est_derivative<EST>(x);
    return inside(d, p.in_lo_set, p.in_lo, p.in_hi_set, p.in_hi) != 0.0f ? g : 0.0f;
  }
}

// The same with the estimator (and straight-through flag) read at run time (kl_reward's kernels).
KL_HD float kl_value(float d, const EstimatorParams& p) {
  switch (p.estimator) {
    case kK1: return kl_value_of<kK1>(d, p);
    case kAbs: return kl_value_of<kAbs>(d, p);
    case kK2: return kl_value_of<kK2>(d, p);
    default: return kl_value_of<kK3>(d, p);
  }
}

KL_HD float kl_grad(float d, const EstimatorParams& p) {
  if (p.straight_through) return d;
  switch (p.estimator) {
    case kK1: return kl_grad_of<kK1, false>(d, p);
    case kAbs: return kl_grad_of<kAbs, false>(d, p);
    case kK2: return kl_grad_of<kK2, false>(d, p);
    default: return kl_grad_of<kK3, false>(d, p);
  }
}

}  // namespace kl
