"""Per-token math of ``kl_reward`` in Triton: the twin of ``csrc/common/kl_math.h``.

Same formulas, same order of operations, same expm1/exp algorithms and constants (so the Triton
interpreter gives the CPU kernel's float32 bits, tests/test_triton_math_parity.py; compiled for a GPU,
Triton contracts a*b+c into FMAs, so there a result may differ from the CPU's by an ulp or so)::

    x   = clamp(d, in_lo, in_hi)              d = log_prob - ref_log_prob (fp32)
    e   = clamp(est(x), out_lo, out_hi)       k1: x  abs: |x|  k2: x^2/2  k3: expm1(-x) + x
    de/dd = [out_lo <= est(x) <= out_hi] * est'(x) * [in_lo <= d <= in_hi]
    straight-through (k1+, abs+, k2+, k3+): value e, derivative d (k2's, unclamped)

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


# expm1 and exp: the algorithms and constants of csrc/common/kl_math.h, operation for operation
# (tests/test_triton_math_parity.py holds the interpreter to the CPU kernel's float32 bits).


@triton.jit
def expm1_poly(y):
    """sum_{k=1..8} y^k / k! for |y| <= ln2/2 (truncation < 3e-9 relative), Estrin's scheme as
    ``kl::expm1_poly``."""
    y2 = y * y
    y4 = y2 * y2
    a = 0.5 * y + 1.0                    # 1 + y/2
    b = (1.0 / 24.0) * y + 1.0 / 6.0     # 1/6 + y/24
    c = (1.0 / 720.0) * y + 1.0 / 120.0  # 1/120 + y/720
    d = (1.0 / 40320.0) * y + 1.0 / 5040.0
    return y * ((b * y2 + a) + (d * y2 + c) * y4)


@triton.jit
def _exp_reduce_in_range(y):
    """``kl::exp_reduce_in_range``: y = n ln2 + r (n rounded by the 1.5 * 2^23 trick, read back from
    the sum's bits), returns (e^r - 1, 2^(n-1), n). Valid for y in [-87.3, 89] or NaN."""
    s = y * 1.44269504088896341 + 12582912.0
    n = s - 12582912.0
    r = (y - n * 0.693145751953125) - n * 1.42860682030941723212e-6  # ln2 = hi + lo
    nb = s.to(tl.uint32, bitcast=True) - 0x4B400000
    half = ((nb + 126) << 23).to(tl.float32, bitcast=True)
    return expm1_poly(r), half, nb.to(tl.int32, bitcast=True)


@triton.jit
def _exp_reduce(y):
    """Any y: clamped to [-87.3, 89] by selects first (a NaN maps to -87.3; callers put it back)."""
    return _exp_reduce_in_range(tl.where(y >= -87.3, tl.where(y <= 89.0, y, 89.0), -87.3))


@triton.jit
def exp_bounded(y):
    """e^y for y in [-87, 88] or NaN (a clamped log-ratio), as ``kl::exp_bounded``."""
    p, half, _ = _exp_reduce_in_range(y)
    return (half * p + half) * 2.0


@triton.jit
def exp_row(y):
    """e^y for any y <= 89 (-inf gives 0), the C++ exp_vec without its NaN select: the row-wise softmax
    kernels' exp (token_logprobs, full_kl), where y = z - max <= 0."""
    p, half, _ = _exp_reduce(y)
    return (half * p + half) * 2.0


@triton.jit
def expm1(y):
    """expm1 in fp32, as ``kl::expm1_vec``: the polynomial itself where n = 0 (|y| < ln2/2, where
    e^y - 1 would cancel), e^y - 1 elsewhere; overflow gives +inf, NaN stays NaN."""
    p, half, n = _exp_reduce(y)
    out = tl.where(n == 0, p, (half * p + half) * 2.0 - 1.0)
    return tl.where(y != y, y, out)


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
