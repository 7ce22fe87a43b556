"""Row math of the Triton row kernels (``token_logprobs.py``, ``full_kl.py``; ``linear_rows.py`` uses the
rebase): the twin of the running-max part of ``csrc/common/row_math.h`` (same rules, same constants), the
exp they take their terms with, and how a program lays a row's steps over its threads. Triton's ``full_kl``
forward stays two-pass, by measurement (``full_kl.py``).

The ``token_logprobs`` forward reads its row once, a step of LANES x CHUNK entries at a time: each lane (a
thread; 256 at 8 warps) takes CHUNK entries of the step (16 bytes: one 128-bit load on aligned rows,
``lane_tile``) and keeps its own running max m and sums (``lane_step``): the max of its entries is merged
into m, the sums so far are moved onto the new max where it rose, then the entries' terms are taken against
it. No block-wide reduction until the row's end, where the lanes' states are merged in a fixed order. Moving a
sum from m to m' = m + delta: ``S' = e^-delta S``, ``W' = e^-delta (W + delta S)``, 0 beyond ``ROW_FAR``
(every moved term is then below float32's exp flush, as in a two-pass sum): in float32 each step (the lanes'
float32 sums), in float64 with a float64 factor every FOLD steps (``lane_fold``: the float64 sums, against the
max they were last folded at). While m is -inf, terms are taken against -FLT_MAX (``row_floor``), so that a
-inf entry's term is 0, not NaN.

Cost (issue 48; ``python -m kl_kernels.triton.aot --ops token_logprobs,full_kl --rows``): the forward's main
loop takes ~9-12 instructions per bf16 entry on sm_90 (a block-wide max per step, scalar loads, a software
exp and a NaN flag per entry took ~68-79), under the ~15 at which an H200 streams the row at copy speed.
Measured before (bench/results/gpu-h200-2026-11-28/triton_ab.log, N = 8192, V = 131,072): the block-wide-max
one-pass forward 2.36 ms (bf16) / 2.39 ms (fp32), two-pass 2.70 / 2.95 ms, one-pass with a block-wide sum per
step 3.12 / 3.15 ms; this one is not yet timed on a GPU.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .. import codes

# lse - z beyond this has e^(z - lse) == 0 in float32: keeps 0 * inf out (the one table: kl_kernels/codes.py,
# which csrc/common/codes.h's kRowFar is generated from)
FAR = tl.constexpr(codes.ROW_FAR)
LOWEST = tl.constexpr(-3.4028234663852886e38)  # -FLT_MAX
NEG_LOG2E = tl.constexpr(-1.4426950408889634)
# steps a lane adds in float32 before its sums go into float64 ones
FOLD = tl.constexpr(16)


# The row kernels' programs (one per row; token_logprobs.py, full_kl.py): warps, and the entries of a row each
# thread reads per step, 16 bytes (one 128-bit load: 8 bf16/fp16, 4 fp32)
ROW_WARPS = 8


def row_chunk(element_size: int) -> int:
    """Entries of a row a thread reads per step for logits of ``element_size`` bytes (the launchers' CHUNK)."""
    return 16 // element_size


def rows_aligned(*rows) -> bool:
    """Whether every row of each ``(tensor, stride_outer, stride_inner)`` starts 16 elements from the last:
    Triton's own test (it specializes a pointer on 16-byte alignment and an int on divisibility by 16), so the
    kernels' ALIGNED (the forward's lane tiles, ``lane_tile``) agrees with what the compiler knows."""
    return all(t.data_ptr() % 16 == 0 and so % 16 == 0 and si % 16 == 0 for t, so, si in rows)


@triton.jit
def lane_tile(LANES: tl.constexpr, CHUNK: tl.constexpr, ALIGNED: tl.constexpr):
    """Offsets [LANES, CHUNK] of a step's entries, a lane (thread) holding a row of it. ALIGNED (16-byte
    aligned rows): lane i reads entries i * CHUNK .. + CHUNK - 1, one 128-bit load. Else entries i, i + LANES, ...:
    scalar loads, coalesced across the lanes. The compiler lays a tile out by the contiguity and alignment it can
    prove, and the lane's CHUNK entries stay in its thread only when they are contiguous and aligned, or strided
    and the lanes contiguous: contiguous but unaligned, they would spread over 8 threads (shuffles in each
    step's max and sums, 8 lanes' float64 state per thread, ~150 registers)."""
    lanes = tl.arange(0, LANES)[:, None]
    cols = tl.arange(0, CHUNK)[None, :]
    if ALIGNED:
        return lanes * CHUNK + cols
    else:
        return lanes + cols * LANES


@triton.jit
def exp_neg_ftz(y):
    """e^-y in float32 as 2^(y (-log2 e)): one FMUL and one MUFU.EX2 (``tl.exp2`` of float32 lowers to libdevice's
    exp2f, ``ex2.approx.ftz``: results below FLT_MIN flush to 0, as kl_math.exp_row's do; ``tl.exp`` lowers to
    the non-ftz ``ex2.approx``, three more instructions for subnormal results). +inf gives 0, NaN NaN. The sign
    goes on the constant, not on y: y (-c) is (-y) c bit for bit, but Triton 3.6 (torch 2.11's, the GPU image's)
    lowers ``-y`` to ``0 - y`` (not a negation for y = 0), an FADD an entry that ptxas cannot fold away."""
    return tl.exp2(y * NEG_LOG2E)


@triton.jit
def soft_tanh(x, inv_c):
    """``tanh(x / c)`` in float32 (the soft-cap of the row kernels' ``SOFTCAP`` specialization: ``z = c tanh(x / c)
    / T``, kernel units, ``kl_kernels/vocab_rows.py`` logit_transform): ``(1 - e) / (1 + e)`` with ``e = e^-2|u|``
    (exp2), signed, and below ``|u| = 1/4``, where ``1 - e`` would cancel, the odd series to ``u^9`` (truncation
    < 1e-8 relative). +-inf gives +-1, NaN NaN. (Triton's interpreter has no libdevice tanh.)"""
    u = x * inv_c
    a = tl.abs(u)
    e = tl.exp2(a * -2.8853900817779268)  # e^(-2 |u|): 0 beyond |u| ~ 44 (t = 1)
    t = (1.0 - e) / (1.0 + e)
    u2 = u * u
    series = u * (1.0 + u2 * (-0.3333333333333333 + u2 * (0.13333333333333333 + u2 * (-0.05396825396825397
                                                                                       + u2 * 0.021869488536155203))))
    return tl.where(a < 0.25, series, tl.where(u < 0.0, -t, t))


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
def logprob_rebase(m, s, w, run_max):
    """``kl::logprob_rebase``: (m, S, W) moved onto max(m, run_max), and the value to take the step's
    terms against. Where the max does not rise, delta is 0 and the factor 1: S and W stay as they are."""
    new_m = tl.where(run_max > m, run_max, m)
    delta, factor = row_shift(m, new_m)
    w = tl.where(factor == 0.0, 0.0, factor * (w + delta * s))
    s = factor * s
    return new_m, s, w, row_floor(new_m)


# ---------------------------------------------------------------------------------- per-lane running state
# The token_logprobs forward keeps one running state per lane (a thread's CHUNK contiguous entries of each step,
# a [LANES, CHUNK] tile): the lane's max m (float32), its sums S and W against row_floor(m) in float32 over up to
# FOLD steps (a float32 move onto a risen max, exp2-based), then folded into float64 sums against the max they
# were last folded at (the float64 move of row_shift: exact delta, float64 factor). No per-entry flag: a NaN
# entry's term is NaN (so is a +inf entry's, whose row max is +inf anyway), and S keeps it (nothing selects S
# away; W may lose it: the row is undefined by S alone). The lanes' states are merged at the end of the row.


@triton.jit
def lane_step(m, s32, w32, x, inv_t):
    """One step of each lane: its entries x [LANES, CHUNK] (as read, in float32; -inf where masked), z = x / T
    (as x * inv_t), merged into the lanes' running max m [LANES] and float32 sums s32, w32 (moved onto the risen
    max first: S' = e^-delta S, W' = e^-delta (W + delta S), 0 beyond FAR; delta 0 where the max did not rise).
    The max is taken of x, then scaled: x * inv_t is monotone in x (inv_t > 0), so that is max z bit for bit, one
    multiply a lane instead of one an entry. Returns (m, s32, w32)."""
    new_m = tl.maximum(m, tl.max(x, 1) * inv_t)  # NaN skipped (maxnum): its term below makes S NaN
    delta = row_floor(new_m) - row_floor(m)
    far = delta > FAR
    factor = tl.where(far, 0.0, exp_neg_ftz(delta))
    w32 = tl.where(far, 0.0, factor * (w32 + delta * s32))
    s32 = factor * s32  # (never selected: keeps a NaN)
    d = row_floor(new_m)[:, None] - x * inv_t
    e = exp_neg_ftz(d)
    s32 += tl.sum(e, 1)
    w32 += tl.sum(e * tl.minimum(d, FAR), 1)
    return new_m, s32, w32


@triton.jit
def lane_fold(m64, s64, w64, m, s32, w32):
    """The lanes' float64 sums (against their max m64) moved onto their current max m and the float32 sums
    (against m) added in. Returns (m, s64, w64, 0, 0): the float32 sums start again."""
    delta, factor = row_shift(m64, m)
    w64 = tl.where(factor == 0.0, 0.0, factor * (w64 + delta * s64)) + w32.to(tl.float64)
    s64 = factor * s64 + s32.to(tl.float64)
    return m, s64, w64, tl.zeros_like(s32), tl.zeros_like(w32)
