"""Triton kernels of ``full_kl``: one program per row, the formulas of ``kl_kernels/full_kl/reference.py``
(those of ``csrc/common/row_math.h``, which the CPU and CUDA kernels share)::

    forward:  m = max z, n = max w;  u_j = m - z_j, v_j = n - w_j
              S = sum_j e^-u_j;  R = sum_j e^-v_j;  A = sum_j e^-u_j (v_j - u_j)  (0 where e^-u_j is)
              KL = A / S + log R - log S;  lse = m + log S;  ref_lse = n + log R
    backward: p_j = e^(z_j - lse), q_j = e^(w_j - ref_lse)
              dx_j = g p_j ((ref_lse - w_j) - (lse - z_j) - KL) / T;  dr_j = g (q_j - p_j) / T

with z = x / T and w = r / T (as x * (1 / T)), e^-y as 2^(y (-log2 e)) (row_math.exp_neg_ftz), each lane's sums in
float32 over up to FOLD steps of its CHUNK entries and in float64 across them, the lanes added at the end in a
fixed order: deterministic. NaN/+inf in either row, or a row of only -inf, gives NaN (a NaN entry found from the
sums, no per-entry flag); a row whose KL is not finite has NaN gradients (through g, no per-entry select). Row r
of each tensor starts at (r // inner) * stride_outer + (r % inner) * stride_inner elements with that tensor's
strides. Each thread reads 16 bytes of each row a step (128-bit loads where every row is 16-byte aligned:
row_math.lane_tile); full steps unmasked, one masked tail step; a row not counted is not read.

The forward reads both rows twice (a max pass, then a sums pass), unlike the CPU and CUDA forwards (one pass,
online maxima, row_math.h): on an H200, side by side (bench/results/gpu-h200-2026-11-28/triton_ab.log, N =
8192, V = 131,072), the two-pass forward of then took 4.90 ms (bf16) / 5.32 ms (fp32), a one-pass one with
per-step block sums 6.50 / 6.46 ms and one with per-lane sums 5.89 / 5.85 ms: two block-wide max reductions per
step cost more there than the second read saves. Since issue 48 each pass is per lane (no block-wide reduction
in either loop): ~23 instructions per bf16 position on sm_90 (pass 1 ~6, pass 2 ~17), 0.73 ms of issue at that
size against 2.04 ms for its two reads of both rows at copy speed, so by the paper model
(kl_kernels/triton/aot.py) it is bound by its bytes, and a per-lane one-pass forward (est. ~28 instructions: the
running maxima, F and the lost max of row_math.h on top of pass 2's) would take about half (~1.02 ms): an A/B
for a GPU session. Run on an H200: "auto" takes these kernels on a GPU after the fused CUDA ones, once the
first-use self-check (``kl_kernels/selfcheck.py``) passed.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .row_math import FAR, FOLD, exp_neg_ftz, lane_tile, soft_tanh

FLT_MAX = tl.constexpr(3.4028234663852886e38)


@triton.jit
def _sum_terms(x, w, m, n, inv_t, s32, r32, a32):
    """One step's terms [LANES, CHUNK] added to the lanes' float32 sums [LANES]: u = m - z, v = n - w (z = x / T,
    w = r / T), S += e^-u, R += e^-v, A += e^-u (v - u) (0 where e^-u is: no 0 * inf at a -inf reference entry)."""
    u = m - x.to(tl.float32) * inv_t
    v = n - w.to(tl.float32) * inv_t
    e = exp_neg_ftz(u)
    return (s32 + tl.sum(e, 1), r32 + tl.sum(exp_neg_ftz(v), 1),
            a32 + tl.sum(e * tl.where(e > 0.0, v - u, 0.0), 1))


@triton.jit(do_not_specialize=("rows",))
def full_kl_fwd_kernel(x_ptr, r_ptr, counted_ptr, kl_ptr, lse_ptr, ref_lse_ptr, rows, vocab, inner, stride_outer,
                       stride_inner, ref_stride_outer, ref_stride_inner, inv_t, inv_c, c_inv_t, LANES: tl.constexpr,
                       CHUNK: tl.constexpr, ALIGNED: tl.constexpr, BLOCK: tl.constexpr, SOFTCAP: tl.constexpr = False):
    # (BLOCK = LANES * CHUNK, the entries of a step: the launcher passes the product. SOFTCAP: both rows' z =
    # c tanh(x / c) / T, inv_c = 1 / c, c_inv_t = c / T (row_math.soft_tanh): the maxima capped once (the cap is
    # monotone), pass 2's entries capped as read and taken at scale 1; without it the code is that of z = x / T)
    r = tl.program_id(0).to(tl.int64)
    xb = x_ptr + (r // inner) * stride_outer + (r % inner) * stride_inner  # the rows (int64), then int32 offsets
    rb = r_ptr + (r // inner) * ref_stride_outer + (r % inner) * ref_stride_inner
    counted = tl.load(counted_ptr + r) != 0  # (a uint8 view of the bool mask)
    # each lane (thread) reads CHUNK entries of each row a step (row_math.lane_tile: 128-bit loads on aligned
    # rows); full steps unmasked, one masked step for the tail; a row not counted is not read (n = 0)
    offs = lane_tile(LANES, CHUNK, ALIGNED)
    n_row = tl.where(counted, vocab, 0)
    full = n_row - n_row % BLOCK
    tail = offs < n_row - full
    # pass 1: both maxima, of the logits as read (x / T is monotone in x: the max of z is max x / T, bit for bit),
    # per entry of each lane, NaN skipped (maxnum; a NaN makes pass 2's sums NaN); a +inf shows in the max
    # (in float32: a 16-bit maximum would be one packed instruction per two entries, but Triton's interpreter
    # takes the max of bf16 bit patterns)
    mx = tl.full([LANES, CHUNK], float("-inf"), tl.float32)
    mr = tl.full([LANES, CHUNK], float("-inf"), tl.float32)
    for j0 in range(0, full, BLOCK):
        mx = tl.maximum(mx, tl.load(xb + j0 + offs).to(tl.float32))
        mr = tl.maximum(mr, tl.load(rb + j0 + offs).to(tl.float32))
    mx = tl.maximum(mx, tl.load(xb + full + offs, mask=tail, other=float("-inf")).to(tl.float32))
    mr = tl.maximum(mr, tl.load(rb + full + offs, mask=tail, other=float("-inf")).to(tl.float32))
    if SOFTCAP:
        m = soft_tanh(tl.max(tl.max(mx, 1), 0), inv_c) * c_inv_t
        n = soft_tanh(tl.max(tl.max(mr, 1), 0), inv_c) * c_inv_t
    else:
        m = tl.max(tl.max(mx, 1), 0) * inv_t
        n = tl.max(tl.max(mr, 1), 0) * inv_t
    bad = (m == float("inf")) | (m == float("-inf")) | (n == float("inf")) | (n == float("-inf"))
    # pass 2: S, R and A against the final maxima (so a -inf reference entry makes the KL +inf only where the
    # policy's probability is positive against the final max: the two-pass rule row_math.h's one pass keeps),
    # each lane's float32 sums over FOLD steps, then float64; a row with an infinite max is not read again
    m_safe = tl.where(bad, 0.0, m)
    n_safe = tl.where(bad, 0.0, n)
    n_row = tl.where(bad, 0, n_row)
    full = n_row - n_row % BLOCK
    tail = offs < n_row - full
    s64 = tl.zeros([LANES], tl.float64)
    r64 = tl.zeros([LANES], tl.float64)
    a64 = tl.zeros([LANES], tl.float64)
    for g0 in range(0, full, FOLD * BLOCK):
        s32 = tl.zeros([LANES], tl.float32)
        r32 = tl.zeros([LANES], tl.float32)
        a32 = tl.zeros([LANES], tl.float32)
        # unrolled twice in Triton's IR on aligned rows (~1 instruction an entry fewer; Triton 3.6 left it rolled;
        # 4 times gave 3.6 an 8-byte stack frame in fp32 on sm_90), not on unaligned ones, whose scalar loads
        # then took 170 registers instead of 72
        for j0 in tl.range(g0, tl.minimum(g0 + FOLD * BLOCK, full), BLOCK, loop_unroll_factor=2 if ALIGNED else 1):
            if SOFTCAP:
                xs = soft_tanh(tl.load(xb + j0 + offs).to(tl.float32), inv_c) * c_inv_t
                ws = soft_tanh(tl.load(rb + j0 + offs).to(tl.float32), inv_c) * c_inv_t
                s32, r32, a32 = _sum_terms(xs, ws, m_safe, n_safe, 1.0, s32, r32, a32)
            else:
                s32, r32, a32 = _sum_terms(tl.load(xb + j0 + offs), tl.load(rb + j0 + offs), m_safe, n_safe, inv_t,
                                           s32, r32, a32)
        s64, r64, a64 = s64 + s32.to(tl.float64), r64 + r32.to(tl.float64), a64 + a32.to(tl.float64)
    zero = tl.zeros([LANES], tl.float32)
    if SOFTCAP:  # (masked entries stay -inf: a capped -inf would be -c / T)
        xs = tl.where(tail, soft_tanh(tl.load(xb + full + offs, mask=tail, other=0.0).to(tl.float32), inv_c) * c_inv_t,
                      float("-inf"))
        ws = tl.where(tail, soft_tanh(tl.load(rb + full + offs, mask=tail, other=0.0).to(tl.float32), inv_c) * c_inv_t,
                      float("-inf"))
        s32, r32, a32 = _sum_terms(xs, ws, m_safe, n_safe, 1.0, zero, zero, zero)
    else:
        s32, r32, a32 = _sum_terms(tl.load(xb + full + offs, mask=tail, other=float("-inf")),
                                   tl.load(rb + full + offs, mask=tail, other=float("-inf")), m_safe, n_safe, inv_t,
                                   zero, zero, zero)
    s64, r64, a64 = s64 + s32.to(tl.float64), r64 + r32.to(tl.float64), a64 + a32.to(tl.float64)
    s = tl.sum(s64, 0)
    rr = tl.sum(r64, 0)
    bad = bad | (s != s) | (rr != rr)  # a NaN entry: its terms are NaN
    log_s = tl.log(s.to(tl.float32))
    log_r = tl.log(rr.to(tl.float32))
    kl = (tl.sum(a64, 0) / s).to(tl.float32) + (log_r - log_s)
    nan_value = float("nan")
    tl.store(kl_ptr + r, tl.where(counted, tl.where(bad, nan_value, kl), 0.0))
    tl.store(lse_ptr + r, tl.where(counted, tl.where(bad, nan_value, m_safe + log_s), 0.0))
    tl.store(ref_lse_ptr + r, tl.where(counted, tl.where(bad, nan_value, n_safe + log_r), 0.0))


@triton.jit
def _grads(x, w, lse, ref_lse, kl, gx_row, gr_row, inv_t, WANT_X: tl.constexpr, WANT_R: tl.constexpr):
    """dx_j and dr_j of entries x, w (as read): u = lse - z, v = ref_lse - w, p = e^-u, q = e^-v,
    dx = (p g / T) ((v - u) - KL), dr = g (q - p) / T, with gx_row = g / T, gr_row = g / T (NaN where the KL
    is not finite). v and u are clamped to FLT_MAX and FAR: where p > 0 (u < FAR) and the KL is finite, v is
    finite too, so the clamps change nothing there, and where p = 0 they keep 0 * inf out of dx (the second
    factor stays finite: KL is finite where gx_row is)."""
    u = lse - x.to(tl.float32) * inv_t
    v = ref_lse - w.to(tl.float32) * inv_t
    p = exp_neg_ftz(u)
    gx = p
    gr = p
    if WANT_X:
        gx = (p * gx_row) * ((tl.minimum(v, FLT_MAX) - tl.minimum(u, FAR)) - kl)
    if WANT_R:
        gr = gr_row * (exp_neg_ftz(v) - p)
    return gx, gr


@triton.jit
def _capped_grads(x, w, lse, ref_lse, kl, g_row, inv_c, c_inv_t, WANT_X: tl.constexpr, WANT_R: tl.constexpr):
    """_grads of the capped entries z = c tanh(x / c) / T (w likewise), each times its entry's 1 - tanh^2 (d z / d x
    = (1 - tanh^2) / T, the 1 / T in g_row)."""
    tx = soft_tanh(x.to(tl.float32), inv_c)
    tw = soft_tanh(w.to(tl.float32), inv_c)
    gx, gr = _grads(tx * c_inv_t, tw * c_inv_t, lse, ref_lse, kl, g_row, g_row, 1.0, WANT_X, WANT_R)
    return gx * ((1.0 - tx) * (1.0 + tx)), gr * ((1.0 - tw) * (1.0 + tw))


@triton.jit(do_not_specialize=("rows",))
def full_kl_bwd_kernel(x_ptr, r_ptr, counted_ptr, kl_ptr, lse_ptr, ref_lse_ptr, g_ptr, gx_ptr, gr_ptr, rows, vocab,
                       inner, stride_outer, stride_inner, ref_stride_outer, ref_stride_inner, g_stride_outer,
                       g_stride_inner, gr_stride_outer, gr_stride_inner, inv_t, inv_c, c_inv_t, WANT_X: tl.constexpr,
                       WANT_R: tl.constexpr, BLOCK: tl.constexpr, SOFTCAP: tl.constexpr = False):
    # SOFTCAP: both rows capped (the forward's z), each gradient times its own entry's 1 - tanh^2 (_capped_grads)
    r = tl.program_id(0).to(tl.int64)
    xb = x_ptr + (r // inner) * stride_outer + (r % inner) * stride_inner  # the rows (int64), then int32 offsets
    rb = r_ptr + (r // inner) * ref_stride_outer + (r % inner) * ref_stride_inner
    gxb = gx_ptr + (r // inner) * g_stride_outer + (r % inner) * g_stride_inner
    grb = gr_ptr + (r // inner) * gr_stride_outer + (r % inner) * gr_stride_inner
    counted = tl.load(counted_ptr + r) != 0
    lanes = tl.arange(0, BLOCK)
    full = vocab - vocab % BLOCK
    tail = lanes < vocab - full
    if counted:
        kl = tl.load(kl_ptr + r)
        finite = (kl == kl) & (kl != float("inf")) & (kl != float("-inf"))
        # g / T for the row, NaN where the KL is not finite (so every entry's gradient is: 0 * NaN is NaN)
        g_row = tl.where(finite, tl.load(g_ptr + r) * inv_t, float("nan"))
        lse = tl.load(lse_ptr + r)
        ref_lse = tl.load(ref_lse_ptr + r)
        for j0 in range(0, full, BLOCK):
            if SOFTCAP:
                gx, gr = _capped_grads(tl.load(xb + j0 + lanes), tl.load(rb + j0 + lanes), lse, ref_lse, kl, g_row,
                                       inv_c, c_inv_t, WANT_X, WANT_R)
            else:
                gx, gr = _grads(tl.load(xb + j0 + lanes), tl.load(rb + j0 + lanes), lse, ref_lse, kl, g_row, g_row,
                                inv_t, WANT_X, WANT_R)
            if WANT_X:
                tl.store(gxb + j0 + lanes, gx.to(gx_ptr.dtype.element_ty))
            if WANT_R:
                tl.store(grb + j0 + lanes, gr.to(gr_ptr.dtype.element_ty))
        if SOFTCAP:
            gx, gr = _capped_grads(tl.load(xb + full + lanes, mask=tail, other=0.0),
                                   tl.load(rb + full + lanes, mask=tail, other=0.0), lse, ref_lse, kl, g_row, inv_c,
                                   c_inv_t, WANT_X, WANT_R)
        else:
            gx, gr = _grads(tl.load(xb + full + lanes, mask=tail, other=0.0), tl.load(rb + full + lanes, mask=tail,
                            other=0.0), lse, ref_lse, kl, g_row, g_row, inv_t, WANT_X, WANT_R)
        if WANT_X:
            tl.store(gxb + full + lanes, gx.to(gx_ptr.dtype.element_ty), mask=tail)
        if WANT_R:
            tl.store(grb + full + lanes, gr.to(gr_ptr.dtype.element_ty), mask=tail)
    else:
        for j0 in range(0, vocab, BLOCK):
            if WANT_X:
                tl.store(gxb + j0 + lanes, tl.zeros([BLOCK], gx_ptr.dtype.element_ty), mask=j0 + lanes < vocab)
            if WANT_R:
                tl.store(grb + j0 + lanes, tl.zeros([BLOCK], gr_ptr.dtype.element_ty), mask=j0 + lanes < vocab)
