"""Triton kernels of ``token_logprobs``: one program per row of the logits, the algorithm of
``csrc/cpu/token_logprobs_cpu.cpp`` (the formulas of ``kl_kernels/token_logprobs/reference.py``)::

    forward:  m = max z;  S = sum_j e^(z_j - m);  W = sum_j e^(z_j - m) min(m - z_j, 88)
              lse = m + log S;  log_prob = z_y - lse;  entropy = W / S + log S
              one pass over the row: each lane's m a running max, its S and W moved onto it as it rises
              (row_math.py), the lanes merged at the end
    backward: p_j = e^(z_j - lse);  dx_j = (g_lp (1[j = y] - p_j) + g_H p_j (min(lse - z_j, 88) - H)) / T

with z = x / T (as x * (1 / T)), e^-y as 2^(y (-log2 e)) (row_math.exp_neg_ftz: MUFU.EX2, 0 below FLT_MIN), each lane's
sums in float32 over up to FOLD steps, then in float64, the lanes added in float64 at the end, in a fixed order:
deterministic. A counted row with a NaN or +inf logit, or only -inf ones, gives NaN (found from the sums: a NaN
or +inf entry makes S NaN, no per-entry flag). Each thread reads 16 bytes of a row a step (128-bit loads on rows
16 bytes aligned: any V % 16 == 0); full steps unmasked, one masked step for the tail; a row not counted is not
read. Main-loop cost per bf16 entry on sm_90 (tests/test_triton_static.py holds it): forward ~9 (~12 with the
entropy), backward ~9. Row r starts at (r // inner) * stride_outer + (r % inner) * stride_inner elements (an [N, V] view
or [B, T, V] slabs), the vocabulary contiguous. Compiled for sm_80/sm_90 and run under the interpreter in CI; run
on H200s (bench/results/gpu-h200-2026-11-27, -28): "auto" takes them on a GPU after the CUDA kernels, once the
self-check passed.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .row_math import FAR, FOLD, exp_neg_ftz, lane_fold, lane_step, lane_tile, soft_tanh


@triton.jit(do_not_specialize=("rows",))
def token_logprobs_fwd_kernel(logits_ptr, labels_ptr, counted_ptr, lp_ptr, lse_ptr, ent_ptr, rows, vocab, inner,
                              stride_outer, stride_inner, inv_t, inv_c, c_inv_t, WANT_ENTROPY: tl.constexpr,
                              LANES: tl.constexpr, CHUNK: tl.constexpr, ALIGNED: tl.constexpr,
                              BLOCK: tl.constexpr, SOFTCAP: tl.constexpr = False):
    # (BLOCK = LANES * CHUNK, the entries of a step: the launcher passes the product. SOFTCAP: z = c tanh(x / c) / T
    # with inv_c = 1 / c, c_inv_t = c / T, row_math.soft_tanh; the entries are capped as read and the steps take
    # them at scale 1; without it inv_c and c_inv_t are unused and the code is that of z = x / T)
    step_t = inv_t
    if SOFTCAP:
        step_t = 1.0
    r = tl.program_id(0).to(tl.int64)
    base = logits_ptr + (r // inner) * stride_outer + (r % inner) * stride_inner  # the row (int64), then int32
    counted = tl.load(counted_ptr + r) != 0  # (a uint8 view of the bool mask)
    # each lane (thread) reads CHUNK entries a step (row_math.lane_tile: one 128-bit load on aligned rows) and
    # keeps its own running max and sums (row_math.lane_step): no block-wide reduction until the row's end. Full
    # steps unmasked, FOLD at a time (then the lanes' float32 sums go into float64 ones), one masked step for the
    # tail; a row not counted is not read (n = 0)
    offs = lane_tile(LANES, CHUNK, ALIGNED)
    n = tl.where(counted, vocab, 0)
    full = n - n % BLOCK
    m = tl.full([LANES], float("-inf"), tl.float32)
    s32 = tl.zeros([LANES], tl.float32)
    w32 = tl.zeros([LANES], tl.float32)
    m64 = tl.full([LANES], float("-inf"), tl.float32)
    s64 = tl.zeros([LANES], tl.float64)
    w64 = tl.zeros([LANES], tl.float64)
    for g0 in range(0, full, FOLD * BLOCK):
        # unrolled 4 times in Triton's IR: Triton 3.6 (torch 2.11's) left this loop rolled, ~3 instructions an
        # entry more than 3.9, which unrolls it itself (tests/test_triton_static.py ROW_ENTRY_BUDGET)
        for j0 in tl.range(g0, tl.minimum(g0 + FOLD * BLOCK, full), BLOCK, loop_unroll_factor=4):
            x = tl.load(base + j0 + offs).to(tl.float32)
            if SOFTCAP:
                x = soft_tanh(x, inv_c) * c_inv_t
            m, s32, w32 = lane_step(m, s32, w32, x, step_t)
        m64, s64, w64, s32, w32 = lane_fold(m64, s64, w64, m, s32, w32)
    if full < n:
        x = tl.load(base + full + offs, mask=offs < n - full, other=float("-inf")).to(tl.float32)
        if SOFTCAP:  # (masked entries stay -inf: a capped -inf would be -c / T)
            x = tl.where(offs < n - full, soft_tanh(x, inv_c) * c_inv_t, float("-inf"))
        m, s32, w32 = lane_step(m, s32, w32, x, step_t)
        m64, s64, w64, s32, w32 = lane_fold(m64, s64, w64, m, s32, w32)
    # the lanes merged: each lane's sums moved onto the row's max, added in a fixed order (float64)
    m = tl.max(m64, 0)
    _, s64, w64, _, _ = lane_fold(m64, s64, w64, m, s32, w32)
    s_total = tl.sum(s64, 0)
    w_total = tl.sum(w64, 0)
    bad = (s_total != s_total) | (m == float("inf")) | (m == float("-inf"))
    # the label's logit (after the loop: a value live across it was spilled to the stack)
    y = tl.load(labels_ptr + r)
    in_vocab = (y >= 0) & (y < vocab)
    zy = tl.load(base + tl.where(in_vocab, y, 0)).to(tl.float32) * step_t  # every row exists: no mask needed
    if SOFTCAP:
        zy = soft_tanh(zy, inv_c) * c_inv_t
    m_safe = tl.where(bad, 0.0, m)
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


@triton.jit(do_not_specialize=("rows",))
def token_logprobs_bwd_kernel(logits_ptr, labels_ptr, counted_ptr, lse_ptr, ent_ptr, g_lp_ptr, g_ent_ptr, out_ptr,
                              rows, vocab, inner, stride_outer, stride_inner, g_stride_outer, g_stride_inner, inv_t,
                              inv_c, c_inv_t, HAS_G_LP: tl.constexpr, HAS_G_ENT: tl.constexpr, BLOCK: tl.constexpr,
                              SOFTCAP: tl.constexpr = False):
    # SOFTCAP: z = c tanh(x / c) / T (the forward's), d z / d x = (1 - tanh^2) / T: each entry's gradient times
    # 1 - t^2 (the 1 / T is the row's constants')
    r = tl.program_id(0).to(tl.int64)
    base = logits_ptr + (r // inner) * stride_outer + (r % inner) * stride_inner  # the row (int64), then int32
    out = out_ptr + (r // inner) * g_stride_outer + (r % inner) * g_stride_inner
    counted = tl.load(counted_ptr + r) != 0  # (a uint8 view of the bool mask)
    lanes = tl.arange(0, BLOCK)
    if counted:
        # (absent gradients come with a valid stand-in pointer: always loaded, then zeroed)
        gl = tl.where(HAS_G_LP, tl.load(g_lp_ptr + r), 0.0)
        gh = tl.where(HAS_G_ENT, tl.load(g_ent_ptr + r), 0.0)
        h = tl.where(HAS_G_ENT, tl.load(ent_ptr + r), 0.0)
        lse = tl.load(lse_ptr + r)
        y = tl.load(labels_ptr + r)
        # the label's entry, read before the loop overwrites it (an in-place backward writes over the logits)
        label = (y >= 0) & (y < vocab) & (lse == lse)
        x_y = tl.load(base + tl.where(label, y, 0)).to(tl.float32)
        if SOFTCAP:
            t_y = soft_tanh(x_y, inv_c)
            d_y = lse - t_y * c_inv_t
        else:
            d_y = lse - x_y * inv_t
        # dx_j = p_j (g_H (min(d_j, FAR) - H) - g_lp) / T for every entry, the label's g_lp / T added after the
        # loop: the row's constants folded once (a = g_H / T, b = (g_H H + g_lp) / T). An undefined row (the
        # forward stored a NaN lse: NaN or +inf logits, all -inf, a label outside [0, V)) has d_j and p_j NaN, so a
        # NaN gradient whatever the upstream terms (0 * NaN is NaN)
        a = gh * inv_t
        b = (gh * h + gl) * inv_t
        full = vocab - vocab % BLOCK
        for j0 in range(0, full, BLOCK):
            if SOFTCAP:
                t = soft_tanh(tl.load(base + j0 + lanes).to(tl.float32), inv_c)
                d = lse - t * c_inv_t
                p = exp_neg_ftz(d)
                g = (p * (a * tl.minimum(d, FAR) - b)) * ((1.0 - t) * (1.0 + t))
            else:
                d = lse - tl.load(base + j0 + lanes).to(tl.float32) * inv_t
                p = exp_neg_ftz(d)
                g = p * (a * tl.minimum(d, FAR) - b)
            tl.store(out + j0 + lanes, g.to(out_ptr.dtype.element_ty))
        tail = lanes < vocab - full
        if SOFTCAP:
            t = soft_tanh(tl.load(base + full + lanes, mask=tail, other=0.0).to(tl.float32), inv_c)
            d = lse - t * c_inv_t
            p = exp_neg_ftz(d)
            g = (p * (a * tl.minimum(d, FAR) - b)) * ((1.0 - t) * (1.0 + t))
        else:
            d = lse - tl.load(base + full + lanes, mask=tail, other=0.0).to(tl.float32) * inv_t
            p = exp_neg_ftz(d)
            g = p * (a * tl.minimum(d, FAR) - b)
        tl.store(out + full + lanes, g.to(out_ptr.dtype.element_ty), mask=tail)
        if label:
            p_y = exp_neg_ftz(d_y)
            g_y = (gl * (1.0 - p_y) + gh * (p_y * (tl.minimum(d_y, FAR) - h))) * inv_t
            if SOFTCAP:
                g_y = g_y * ((1.0 - t_y) * (1.0 + t_y))
            tl.debug_barrier()  # the loop's store of the label's entry (another thread's) comes first
            tl.store(out + y, g_y.to(out_ptr.dtype.element_ty))
    else:
        zero = tl.zeros([BLOCK], tl.float32).to(out_ptr.dtype.element_ty)
        for j0 in range(0, vocab, BLOCK):
            tl.store(out + j0 + lanes, zero, mask=j0 + lanes < vocab)
