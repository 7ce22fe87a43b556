"""Per-token math of ``kl_reward`` in Triton: the twin of ``csrc/common/kl_math.h``.

Same formulas, same order of operations, same expm1 (so the Triton, CPU and CUDA kernels agree
closely with each other, not only with the reference)::

    x   = clamp(d, in_lo, in_hi)              d = log_prob - ref_log_prob (fp32)
    e   = clamp(est(x), out_lo, out_hi)       k1: x  abs: |x|  k2: x^2/2  k3: expm1(-x) + x
    de/dd = [out_lo <= est(x) <= out_hi] * est'(x) * [in_lo <= d <= in_hi]
    straight-through (k1+, abs+, k3+): value e, derivative d (k2's, unclamped)

Missing clamp bounds are passed as -inf/+inf, so the clamps are plain runtime values and never
part of a kernel's specialization. The estimator is a ``tl.constexpr`` (codes below).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .. import codes

# The estimator codes, from the one table (kl_kernels/codes.py; csrc/common/codes.h is generated from it).
K1 = tl.constexpr(codes.ESTIMATOR_CODES["k1"])
ABS = tl.constexpr(codes.ESTIMATOR_CODES["abs"])
K2 = tl.constexpr(codes.ESTIMATOR_CODES["k2"])
K3 = tl.constexpr(codes.ESTIMATOR_CODES["k3"])


@triton.jit
def _expm1_poly(y):
    """sum_{k=1..8} y^k / k! (Horner): expm1 for |y| < ln2/2 to < 3e-9 relative."""
    p = y * 0.0 + 2.48015873015873e-05  # 1/40320
    p = p * y + 1.984126984126984e-04   # 1/5040
    p = p * y + 1.388888888888889e-03   # 1/720
    p = p * y + 8.333333333333333e-03   # 1/120
    p = p * y + 4.166666666666667e-02   # 1/24
    p = p * y + 1.666666666666667e-01   # 1/6
    p = p * y + 0.5
    p = p * y + 1.0
    return p * y


@triton.jit
def expm1(y):
    """expm1 in fp32, accurate near 0 (where k3 lives) and over the whole range.

    |y| < ln2/2: the Taylor series. Otherwise 2^n * exp(r) - 1 with n = round(y / ln2) and
    r = y - n ln2 (Cody-Waite split), 2^n built exactly from bits as two factors. Overflow
    gives +inf, underflow -1, NaN stays NaN. tl.exp alone is not enough: exp(y) - 1 cancels
    near 0, and the hardware exp's error grows with |y|.
    """
    small = _expm1_poly(y)
    yc = tl.minimum(tl.maximum(y, -104.0), 89.0)
    n = tl.floor(yc * 1.4426950408889634 + 0.5)
    r = (yc - n * 0.693145751953125) - n * 1.4286068203094172e-06
    er = _expm1_poly(r) + 1.0
    ni = n.to(tl.int32)
    n1 = ni >> 1  # arithmetic shift: floor(ni / 2); both halves stay in the normal exponent range
    n2 = ni - n1
    s1 = ((n1 + 127) << 23).to(tl.float32, bitcast=True)
    s2 = ((n2 + 127) << 23).to(tl.float32, bitcast=True)
    big = er * s1 * s2 - 1.0
    out = tl.where(tl.abs(y) < 0.34657359, small, tl.where(y > 88.7228394, float("inf"), big))
    return tl.where(y != y, y, out)  # NaN in, NaN out (the clamps above would drop it)


@triton.jit
def clamp(v, lo, hi):
    """torch.clamp with runtime bounds (+-inf = none); NaN stays NaN."""
    v = tl.where(v < lo, lo, v)
    return tl.where(v > hi, hi, v)


@triton.jit
def inside(v, lo, hi):
    """torch.clamp's gradient mask: 1 inside [lo, hi] (boundaries included), 0 outside, where a NaN
    is outside; with both bounds infinite there is no clamp and everything passes."""
    unbounded = (lo == float("-inf")) & (hi == float("inf"))
    return tl.where(((v >= lo) & (v <= hi)) | unbounded, 1.0, 0.0)


@triton.jit
def estimate_raw(x, EST: tl.constexpr):
    if EST == K1:
        return x
    elif EST == ABS:
        return tl.abs(x)
    elif EST == K2:
        return 0.5 * x * x
    else:
        return expm1(-x) + x


@triton.jit
def estimate_grad_raw(x, EST: tl.constexpr):
    if EST == K1:
        return tl.zeros_like(x) + 1.0  # not x * 0 + 1: a NaN x would give NaN
    elif EST == ABS:
        return tl.where(x > 0.0, 1.0, tl.where(x < 0.0, -1.0, 0.0))
    elif EST == K2:
        return x
    else:
        return -expm1(-x)  # d/dx (expm1(-x) + x) = 1 - exp(-x)


@triton.jit
def kl_value(d, in_lo, in_hi, out_lo, out_hi, EST: tl.constexpr):
    """The estimate for log-ratio d, both clamps applied."""
    return clamp(estimate_raw(clamp(d, in_lo, in_hi), EST), out_lo, out_hi)


@triton.jit
def kl_grad(d, in_lo, in_hi, out_lo, out_hi, EST: tl.constexpr, STRAIGHT_THROUGH: tl.constexpr):
    """d(kl)/d(d), as autograd computes it through the reference."""
    if STRAIGHT_THROUGH:
        return d
    else:
        x = clamp(d, in_lo, in_hi)
        raw = estimate_raw(x, EST)
        # as autograd through the reference: the output clamp's mask multiplies est' (0 * NaN is NaN),
        # the input clamp's selects (its backward is a where(): an exact 0 outside, NaN d included)
        g = inside(raw, out_lo, out_hi) * estimate_grad_raw(x, EST)
        return tl.where(inside(d, in_lo, in_hi) > 0.0, g, 0.0)


@triton.jit
def _segment_combine(a_val, a_flag, b_val, b_flag):
    """(value, starts-a-segment) pairs: a segment start on the right discards what came before."""
    return tl.where(b_flag != 0, b_val, a_val + b_val), a_flag | b_flag


@triton.jit
def segment_sum(v, first):
    """Per lane: the sum of ``v`` (fp64) from its segment's first lane (``first``) to itself.

    A segmented inclusive scan, not a difference of tile-wide prefix sums: a NaN or inf in one
    segment never reaches another. Deterministic (a fixed combine tree), no atomics.
    """
    v64 = v.to(tl.float64)
    start = (tl.arange(0, v.shape[0]) == first).to(tl.int32)
    s, _ = tl.associative_scan((v64, start), 0, _segment_combine)
    return s
