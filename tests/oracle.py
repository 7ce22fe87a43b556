"""Independent float64 oracle for kl_reward: one sequence at a time, one token at a time.

Written from the specification (issue text and the peers' formulas), not from the package: it
shares no code with kl_kernels and uses Python floats (IEEE float64) and the math module.
Each sequence is given by its *valid* tokens only; layouts are the test harness's business.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


def _clamp(v, bounds):
    if bounds is None:
        return v
    lo, hi = bounds
    if math.isnan(v):
        return v
    if lo is not None and v < lo:
        return lo
    if hi is not None and v > hi:
        return hi
    return v


def _inside(v, bounds):
    """torch.clamp's gradient mask: 1 where lo <= v <= hi (boundaries included)."""
    if bounds is None:
        return 1.0
    lo, hi = bounds
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        return 0.0
    return 1.0


def _est(x, base):
    if base == "k1":
        return x
    if base == "abs":
        return abs(x)
    if base == "k2":
        return 0.5 * x * x
    if base == "k3":
        return math.expm1(-x) + x
    raise AssertionError(base)


def _est_grad(x, base):
    if base == "k1":
        return 1.0
    if base == "abs":
        return 0.0 if x == 0 else math.copysign(1.0, x)
    if base == "k2":
        return x
    if base == "k3":
        return -math.expm1(-x)
    raise AssertionError(base)


@dataclass
class SeqResult:
    kl: list          # per valid token
    reward: list      # per valid token (reward output)
    ref_out: list     # masked reference log-probs
    counted: list     # bool per token
    dkl_dd: list      # derivative of kl_t w.r.t. d_t (0 where not counted)
    kl_sum: float
    count: int


def oracle_sequence(lp, ref, *, estimator="k1", mask=None, prompt_len=0, clamp_input=None, clamp_output=None,
                    coef=1.0, placement=None, reward=None) -> SeqResult:
    """kl_reward for one sequence of valid tokens.

    ``reward``: per-token list (placement "token"), a float ("sequence"/"last"/"last_valid") or None.
    """
    n = len(lp)
    base = estimator.rstrip("+")
    straight_through = estimator.endswith("+")
    kl, deriv, counted = [], [], []
    for t in range(n):
        m = (mask is None or bool(mask[t])) and t >= prompt_len
        counted.append(m)
        if not m:
            kl.append(0.0)
            deriv.append(0.0)
            continue
        d = float(lp[t]) - float(ref[t])
        x = _clamp(d, clamp_input)
        e_raw = _est(x, base)
        e = _clamp(e_raw, clamp_output)
        kl.append(e)
        if straight_through:
            deriv.append(d)
        else:
            deriv.append(_inside(e_raw, clamp_output) * _est_grad(x, base) * _inside(d, clamp_input))

    if placement is None:
        r = [-coef * k for k in kl]
    elif placement == "token":
        r = [float(reward[t]) - coef * kl[t] for t in range(n)]
    elif placement == "sequence":
        r = [float(reward) - coef * kl[t] for t in range(n)]
    elif placement in ("last", "last_valid"):
        r = [-coef * k for k in kl]
        # "last": the last counted token, else the last valid one; "last_valid": the last valid one
        where = max((t for t in range(n) if counted[t]), default=n - 1) if placement == "last" else n - 1
        if n:
            r[where] += float(reward)
    else:
        raise AssertionError(placement)
    ref_out = [float(ref[t]) if counted[t] else 0.0 for t in range(n)]
    kl_sum = math.fsum(kl) if all(map(math.isfinite, kl)) else sum(kl)  # fsum rejects inf - inf
    return SeqResult(kl, r, ref_out, counted, deriv, kl_sum, sum(counted))
