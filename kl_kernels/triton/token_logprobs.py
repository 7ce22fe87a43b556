"""Triton kernels of ``token_logprobs``: one program per row of the logits, the algorithm of
``csrc/cpu/token_logprobs_cpu.cpp`` (the formulas of ``kl_kernels/token_logprobs/reference.py``)::

    forward:  m = max z;  S = sum_j e^(z_j - m);  W = sum_j e^(z_j - m) min(m - z_j, 88)
              lse = m + log S;  log_prob = z_y - lse;  entropy = W / S + log S
              one pass over the row: m is a running max, S and W moved onto it as it rises (row_math.py)
    backward: p_j = e^(z_j - lse);  dx_j = (g_lp (1[j = y] - p_j) + g_H p_j (min(lse - z_j, 88) - H)) / T

with z = x / T (as x * (1 / T)), each lane's sums in float32 over up to FOLD steps, then in float64, the lanes
added in float64 at the end, in a fixed order: deterministic. A counted row with a NaN or +inf logit, or only -inf
ones, gives NaN. Row r starts at (r // inner) * stride_outer + (r % inner) * stride_inner elements (an [N, V] view
or [B, T, V] slabs), the vocabulary contiguous. Compiled for sm_80/sm_90 and run under the interpreter in CI; run
on H200s (bench/results/gpu-h200-2026-11-27, -28): "auto" takes them on a GPU after the CUDA kernels, once the
self-check passed.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .. import codes
from .kl_math import exp_row as _exp
from .row_math import FAR, FOLD, fold, logprob_rebase, row_floor, step_max


@triton.jit(do_not_specialize=("rows", "vocab", "inner", "stride_outer", "stride_inner"))
def token_logprobs_fwd_kernel(logits_ptr, labels_ptr, counted_ptr, lp_ptr, lse_ptr, ent_ptr, rows, vocab, inner,
                              stride_outer, stride_inner, inv_t, WANT_ENTROPY: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    base = logits_ptr + (r // inner) * stride_outer + (r % inner) * stride_inner
    cnt = tl.load(counted_ptr + r).to(tl.int32)  # (a uint8 view of the bool mask)
    counted = cnt != 0
    lanes = tl.arange(0, BLOCK)
    counted_v = (tl.zeros([BLOCK], tl.int32) + cnt) != 0  # as a block: a scalar mask would not broadcast
    # one pass (row_math.py): per step the entries' max (NaN skipped, flagged; the step's one block-wide
    # reduction), the lanes' sums moved onto the running max where it rises (a branch the whole program
    # takes or skips), then each lane adds its entries' terms: float32 lane sums, added into float64 ones
    # every FOLD steps and before each move; one block-wide sum at the end (float64, a fixed order)
    m = tl.full([], float("-inf"), tl.float32)
    s64 = tl.zeros([BLOCK], tl.float64)
    w64 = tl.zeros([BLOCK], tl.float64)
    s32 = tl.zeros([BLOCK], tl.float32)
    w32 = tl.zeros([BLOCK], tl.float32)
    nan = tl.zeros([BLOCK], tl.int32)
    steps = tl.zeros([], tl.int32)  # since the last fold
    for j0 in range(0, vocab, BLOCK):
        offs = j0 + lanes
        z = tl.load(base + offs, mask=(offs < vocab) & counted_v, other=float("-inf")).to(tl.float32) * inv_t
        nan = tl.where(z != z, 1, nan)
        run_max = step_max(z)
        if run_max > m:
            s64, w64, s32, w32 = fold(s64, w64, s32, w32)
            m, s64, w64, _ = logprob_rebase(m, s64, w64, run_max)
        d = row_floor(m) - z
        e = _exp(-d)
        s32 += e
        w32 += e * tl.where(d <= FAR, d, FAR)
        steps += 1
        if steps == FOLD:
            steps = tl.zeros([], tl.int32)
            s64, w64, s32, w32 = fold(s64, w64, s32, w32)
    s_total = tl.sum(s64 + s32.to(tl.float64), 0)
    w_total = tl.sum(w64 + w32.to(tl.float64), 0)
    bad = (tl.max(nan, 0) > 0) | (m == float("inf")) | (m == float("-inf"))
    m_safe = tl.where(bad, 0.0, m)
    y = tl.load(labels_ptr + r)
    in_vocab = (y >= 0) & (y < vocab)
    zy = tl.load(base + tl.where(in_vocab, y, 0)).to(tl.float32) * inv_t  # every row exists: no mask needed
    log_s = tl.log(s_total.to(tl.float32))
    lse = m_safe + log_s
    undefined = bad | (~in_vocab)
    nan_value = float("nan")
    lp = tl.where(counted, tl.where(undefined, nan_value, zy - lse), 0.0)
    tl.store(lp_ptr + r, lp)
    tl.store(lse_ptr + r, tl.where(counted, tl.where(undefined, nan_value, lse), 0.0))
    if WANT_ENTROPY:
        h = (w_total / s_total).to(tl.float32) + log_s
        tl.store(ent_ptr + r, tl.where(counted, tl.where(undefined, nan_value, h), 0.0))


@triton.jit(do_not_specialize=("rows", "vocab", "inner", "stride_outer", "stride_inner", "g_stride_outer",
                               "g_stride_inner"))
def token_logprobs_bwd_kernel(logits_ptr, labels_ptr, counted_ptr, lse_ptr, ent_ptr, g_lp_ptr, g_ent_ptr, out_ptr,
                              rows, vocab, inner, stride_outer, stride_inner, g_stride_outer, g_stride_inner, inv_t,
                              HAS_G_LP: tl.constexpr, HAS_G_ENT: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    base = logits_ptr + (r // inner) * stride_outer + (r % inner) * stride_inner
    out = out_ptr + (r // inner) * g_stride_outer + (r % inner) * g_stride_inner
    cnt = tl.load(counted_ptr + r).to(tl.int32)  # (a uint8 view of the bool mask)
    counted = cnt != 0
    lanes = tl.arange(0, BLOCK)
    counted_v = (tl.zeros([BLOCK], tl.int32) + cnt) != 0
    # (absent gradients come with a valid stand-in pointer: always loaded, then zeroed)
    gl = tl.where(counted & HAS_G_LP, tl.load(g_lp_ptr + r), 0.0)
    gh = tl.where(counted & HAS_G_ENT, tl.load(g_ent_ptr + r), 0.0)
    h = tl.where(HAS_G_ENT, tl.load(ent_ptr + r), 0.0)
    lse = tl.load(lse_ptr + r)
    y = tl.load(labels_ptr + r)
    for j0 in range(0, vocab, BLOCK):
        offs = j0 + lanes
        ok = offs < vocab
        x = tl.load(base + offs, mask=ok & counted_v, other=0.0).to(tl.float32)
        d = lse - x * inv_t
        p = _exp(-d)
        g = tl.where(offs == y, gl * (1.0 - p), -gl * p) + gh * (p * (tl.where(d <= FAR, d, FAR) - h))
        # an undefined row (the forward stored a NaN lse: NaN or +inf logits, all -inf, a label outside [0, V)) has
        # a NaN gradient whatever the upstream terms: exp_row gives 0 for NaN, so without the entropy term nothing
        # else would carry it
        g = tl.where(lse == lse, g, float("nan"))
        g = tl.where(counted, g * inv_t, 0.0)
        tl.store(out + offs, g.to(out_ptr.dtype.element_ty), mask=ok)
