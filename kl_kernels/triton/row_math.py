"""The one-pass (online) row sums of the Triton ``token_logprobs`` forward (``token_logprobs.py``): the twin of
the running-max part of ``csrc/common/row_math.h`` (same rules, same constants). Triton's ``full_kl`` forward
stays two-pass, by measurement (``full_kl.py``).

A program reads its row once, BLOCK entries per step: the step's max is merged into the running max m, the
sums so far (each lane's: no block-wide sum before the end) are moved onto the new max when it rises, then the
step's terms are taken against it. Moving a sum from m to m' = m + delta: ``S' = e^-delta S``, ``W' =
e^-delta (W + delta S)``, the factor in float64 and 0 beyond ``ROW_FAR`` (every moved term is then below
float32's exp flush, as in a two-pass sum). While m is -inf, terms are taken against -FLT_MAX (``row_floor``),
so that a -inf entry's term is 0, not NaN. On an H200 (bench/results/gpu-h200-2026-11-28/triton_ab.log) this
forward took 2.36 ms (bf16) / 2.39 ms (fp32) for N = 8192, V = 131,072, against 2.70 / 2.95 ms two-pass and
3.12 / 3.15 ms one-pass with a block-wide sum per step.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .. import codes

# lse - z beyond this has e^(z - lse) == 0 in float32: keeps 0 * inf out (the one table: kl_kernels/codes.py,
# which csrc/common/codes.h's kRowFar is generated from)
FAR = tl.constexpr(codes.ROW_FAR)
LOWEST = tl.constexpr(-3.4028234663852886e38)  # -FLT_MAX
# steps a lane adds in float32 before its sums go into float64 ones (also before every move onto a new max)
FOLD = tl.constexpr(16)


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
def fold(a64, b64, a32, b32):
    """Two float32 lane sums added into their float64 ones, and zeroed."""
    return a64 + a32.to(tl.float64), b64 + b32.to(tl.float64), tl.zeros_like(a32), tl.zeros_like(b32)


@triton.jit
def logprob_rebase(m, s, w, run_max):
    """``kl::logprob_rebase``: (m, S, W) moved onto max(m, run_max), and the value to take the step's
    terms against. Where the max does not rise, delta is 0 and the factor 1: S and W stay as they are."""
    new_m = tl.where(run_max > m, run_max, m)
    delta, factor = row_shift(m, new_m)
    w = tl.where(factor == 0.0, 0.0, factor * (w + delta * s))
    s = factor * s
    return new_m, s, w, row_floor(new_m)
