"""The one-pass (online) row sums of the row-wise Triton kernels (``token_logprobs.py``, ``full_kl.py``):
the twin of the running-max part of ``csrc/common/row_math.h`` (same rules, same constants).

A program reads its row once, BLOCK entries per step: the step's max is merged into the running max m, the
sums so far are moved onto the new max, then the step's terms are taken against it. Moving a sum from m to
m' = m + delta: ``S' = e^-delta S``, ``W' = e^-delta (W + delta S)`` (token_logprobs), ``A' = e^-delta_m (A +
(delta_n - delta_m) F)`` (full_kl; F the part of S whose reference is finite; ``lost``, the policy's largest
logit where the reference is -inf, decides +inf at the end), the factor in float64 and 0 beyond ``ROW_FAR``
(every moved term is then below float32's exp flush, as in a two-pass sum). While m is -inf, terms are taken
against -FLT_MAX (``row_floor``), so that a -inf entry's term is 0, not NaN.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .. import codes

# lse - z beyond this has e^(z - lse) == 0 in float32: keeps 0 * inf out (the one table: kl_kernels/codes.py,
# which csrc/common/codes.h's kRowFar is generated from)
FAR = tl.constexpr(codes.ROW_FAR)
LOWEST = tl.constexpr(-3.4028234663852886e38)  # -FLT_MAX


@triton.jit
def row_floor(m):
    """``kl::row_floor``: the value terms are taken against for a running max m (-FLT_MAX while m is -inf)."""
    return tl.where(m >= LOWEST, m, LOWEST)


@triton.jit
def row_shift(frm, to):
    """``kl::row_shift``: (delta, e^-delta) in float64 moving a sum from running max ``frm`` onto ``to``."""
    delta = row_floor(to).to(tl.float64) - row_floor(frm).to(tl.float64)
    return delta, tl.where(delta > FAR, 0.0, tl.exp(-delta))


@triton.jit
def step_max(z):
    """The max of a step's entries, NaN skipped (the caller flags it); -inf for a step of only -inf/NaN."""
    return tl.max(tl.where(z == z, z, float("-inf")), 0)


@triton.jit
def logprob_rebase(m, s, w, run_max):
    """``kl::logprob_rebase``: (m, S, W) moved onto max(m, run_max), and the value to take the step's
    terms against. Where the max does not rise, delta is 0 and the factor 1: S and W stay as they are."""
    new_m = tl.where(run_max > m, run_max, m)
    delta, factor = row_shift(m, new_m)
    w = tl.where(factor == 0.0, 0.0, factor * (w + delta * s))
    s = factor * s
    return new_m, s, w, row_floor(new_m)


@triton.jit
def full_kl_lost(z, w):
    """``kl::full_kl_lost``: z where the reference is -inf (the step's max of it is ``lost``), else -inf."""
    return tl.where(w == float("-inf"), z, float("-inf"))


@triton.jit
def full_kl_rebase(m, n, s, f, r, a, lost, run_m, run_n, run_lost):
    """``kl::full_kl_rebase``: (m, n, S, F, R, A, lost) moved onto the maxima with (run_m, run_n, run_lost),
    and the values to take the step's terms against (a max that does not rise: delta 0, factor 1)."""
    new_m = tl.where(run_m > m, run_m, m)
    new_n = tl.where(run_n > n, run_n, n)
    dm, cm = row_shift(m, new_m)
    dn, cn = row_shift(n, new_n)
    a = tl.where(cm == 0.0, 0.0, cm * (a + (dn - dm) * f))
    s = cm * s
    f = cm * f
    r = cn * r
    lost = tl.where(run_lost > lost, run_lost, lost)
    return new_m, new_n, s, f, r, a, lost, row_floor(new_m), row_floor(new_n)
