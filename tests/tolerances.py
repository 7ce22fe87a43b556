"""The one tolerance table, per output dtype, for comparisons with the float64 oracle.

The oracle's float64 value is first rounded to the output dtype (as any correct implementation
must round it, overflow to inf included); what is left is the math dtype's error (float32
math for half/single inputs) plus at most one rounding step of the output dtype.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch


class Tol(NamedTuple):
    rtol: float
    atol: float


TOLERANCES = {
    torch.float64: Tol(rtol=1e-12, atol=1e-12),
    torch.float32: Tol(rtol=2e-6, atol=1e-6),
    torch.bfloat16: Tol(rtol=1.6e-2, atol=1e-5),  # one bf16 ulp is 2^-8..2^-7 relative
    torch.float16: Tol(rtol=2e-3, atol=1e-5),     # one fp16 ulp is 2^-11..2^-10 relative
}


def assert_close_to_oracle(actual: torch.Tensor, expected: list, what: str, scale: list | None = None) -> None:
    """``actual`` (any float dtype) against oracle floats rounded to ``actual``'s dtype.

    ``scale`` (per element) is for values that are sums of separately rounded terms, such as
    a gradient reaching one input through two paths: the error is then relative to the terms'
    magnitudes, not to their (possibly cancelling) sum.
    """
    tol = TOLERANCES[actual.dtype]
    want = torch.tensor(expected, dtype=torch.float64).to(actual.dtype).double()
    got = actual.double()
    if scale is None:
        torch.testing.assert_close(got, want, rtol=tol.rtol, atol=tol.atol, equal_nan=True,
                                   msg=lambda m: f"{what} ({actual.dtype}) differs from the oracle:\n{m}")
        return
    bound = tol.atol + tol.rtol * (want.abs() + torch.tensor(scale, dtype=torch.float64))
    bad = ~((got - want).abs() <= bound) & ~(got.isnan() & want.isnan()) & ~(got == want)
    assert not bad.any(), f"{what} ({actual.dtype}) differs from the oracle at {bad.nonzero().flatten().tolist()}: " \
                          f"{got[bad].tolist()} vs {want[bad].tolist()}"


def assert_sum_close(actual: torch.Tensor, expected: float, terms: list, math_dtype: torch.dtype, what: str) -> None:
    """A per-sequence sum: the error bound grows with the sum of |terms| (accumulation in math_dtype)."""
    tol = TOLERANCES[math_dtype]
    got = float(actual)
    if math.isnan(expected) or math.isinf(expected):
        assert (math.isnan(expected) and math.isnan(got)) or got == expected, f"{what}: {got} != {expected}"
        return
    scale = math.fsum(abs(t) for t in terms)
    bound = tol.atol + tol.rtol * 8 * scale  # fp32 accumulation order differs from fsum
    assert abs(got - expected) <= bound, f"{what}: {got} vs oracle {expected} (bound {bound})"
