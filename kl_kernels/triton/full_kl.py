"""Triton kernels of ``full_kl``: one program per row, the formulas of ``kl_kernels/full_kl/reference.py``
(those of ``csrc/common/row_math.h``, which the CPU and CUDA kernels share)::

    forward:  m = max z, n = max w;  u_j = m - z_j, v_j = n - w_j
              S = sum_j e^-u_j;  R = sum_j e^-v_j;  A = sum_j e^-u_j (v_j - u_j)  (0 where e^-u_j is)
              KL = A / S + log R - log S;  lse = m + log S;  ref_lse = n + log R
    backward: p_j = e^(z_j - lse), q_j = e^(w_j - ref_lse)
              dx_j = g p_j ((ref_lse - w_j) - (lse - z_j) - KL) / T;  dr_j = g (q_j - p_j) / T

with z = x / T and w = r / T (as x * (1 / T)), the sums per BLOCK-wide step in float32 and across steps in
float64, in a fixed order: deterministic. NaN/+inf in either row, or a row of only -inf, gives NaN; a row
whose KL is not finite has NaN gradients. Row r of each tensor starts at (r // inner) * stride_outer +
(r % inner) * stride_inner elements with that tensor's strides.

The forward reads both rows twice (a max pass, then a sums pass), unlike the CPU and CUDA forwards (one pass,
online maxima, row_math.h): on an H200, side by side (bench/results/gpu-h200-2026-11-28/triton_ab.log, N =
8192, V = 131,072), this two-pass forward took 4.90 ms (bf16) / 5.32 ms (fp32), a one-pass one with per-step
block sums 6.50 / 6.46 ms and one with per-lane sums 5.89 / 5.85 ms: two block-wide max reductions per step
cost more here than the second read saves. Run on an H200: "auto" takes these kernels on a GPU after the
fused CUDA ones, once the first-use self-check (``kl_kernels/selfcheck.py``) passed.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .kl_math import exp_row


@triton.jit(do_not_specialize=("rows", "vocab", "inner", "stride_outer", "stride_inner", "ref_stride_outer",
                               "ref_stride_inner"))
def full_kl_fwd_kernel(x_ptr, r_ptr, counted_ptr, kl_ptr, lse_ptr, ref_lse_ptr, rows, vocab, inner, stride_outer,
                       stride_inner, ref_stride_outer, ref_stride_inner, inv_t, BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    xb = x_ptr + (r // inner) * stride_outer + (r % inner) * stride_inner
    rb = r_ptr + (r // inner) * ref_stride_outer + (r % inner) * ref_stride_inner
    cnt = tl.load(counted_ptr + r).to(tl.int32)  # (a uint8 view of the bool mask)
    counted = cnt != 0
    lanes = tl.arange(0, BLOCK)
    counted_v = (tl.zeros([BLOCK], tl.int32) + cnt) != 0
    # pass 1: both maxima (a +inf shows there) and whether a NaN is in either row
    mz = tl.full([BLOCK], float("-inf"), tl.float32)
    mw = tl.full([BLOCK], float("-inf"), tl.float32)
    nan = tl.zeros([BLOCK], tl.int32)
    for j0 in range(0, vocab, BLOCK):
        offs = j0 + lanes
        ok = (offs < vocab) & counted_v
        z = tl.load(xb + offs, mask=ok, other=float("-inf")).to(tl.float32) * inv_t
        w = tl.load(rb + offs, mask=ok, other=float("-inf")).to(tl.float32) * inv_t
        mz = tl.where(z > mz, z, mz)
        mw = tl.where(w > mw, w, mw)
        nan = tl.where((z != z) | (w != w), 1, nan)
    m = tl.max(mz, 0)
    n = tl.max(mw, 0)
    bad = (tl.max(nan, 0) > 0) | (m == float("inf")) | (m == float("-inf")) | (n == float("inf")) \
        | (n == float("-inf"))
    # pass 2: S, R and A against the final maxima (so a -inf reference entry makes the KL +inf only where the
    # policy's probability is positive against the final max: the two-pass rule row_math.h's one pass keeps),
    # float32 per step, float64 across steps
    s_total = tl.zeros([1], tl.float64)
    r_total = tl.zeros([1], tl.float64)
    a_total = tl.zeros([1], tl.float64)
    m_safe = tl.where(bad, 0.0, m)
    n_safe = tl.where(bad, 0.0, n)
    live_v = counted_v & ((tl.zeros([BLOCK], tl.int32) + bad.to(tl.int32)) == 0)
    for j0 in range(0, vocab, BLOCK):
        offs = j0 + lanes
        ok = (offs < vocab) & live_v
        u = m_safe - tl.load(xb + offs, mask=ok, other=float("-inf")).to(tl.float32) * inv_t
        v = n_safe - tl.load(rb + offs, mask=ok, other=float("-inf")).to(tl.float32) * inv_t
        e = exp_row(-u)
        s_total += tl.sum(e, 0).to(tl.float64)
        r_total += tl.sum(exp_row(-v), 0).to(tl.float64)
        a_total += tl.sum(tl.where(e > 0.0, e * (v - u), 0.0), 0).to(tl.float64)
    s = tl.max(s_total, 0)
    rr = tl.max(r_total, 0)
    log_s = tl.log(s.to(tl.float32))
    log_r = tl.log(rr.to(tl.float32))
    kl = (tl.max(a_total, 0) / s).to(tl.float32) + (log_r - log_s)
    nan_value = float("nan")
    tl.store(kl_ptr + r, tl.where(counted, tl.where(bad, nan_value, kl), 0.0))
    tl.store(lse_ptr + r, tl.where(counted, tl.where(bad, nan_value, m_safe + log_s), 0.0))
    tl.store(ref_lse_ptr + r, tl.where(counted, tl.where(bad, nan_value, n_safe + log_r), 0.0))


@triton.jit(do_not_specialize=("rows", "vocab", "inner", "stride_outer", "stride_inner", "ref_stride_outer",
                               "ref_stride_inner", "g_stride_outer", "g_stride_inner", "gr_stride_outer",
                               "gr_stride_inner"))
def full_kl_bwd_kernel(x_ptr, r_ptr, counted_ptr, kl_ptr, lse_ptr, ref_lse_ptr, g_ptr, gx_ptr, gr_ptr, rows, vocab,
                       inner, stride_outer, stride_inner, ref_stride_outer, ref_stride_inner, g_stride_outer,
                       g_stride_inner, gr_stride_outer, gr_stride_inner, inv_t, WANT_X: tl.constexpr,
                       WANT_R: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    xb = x_ptr + (r // inner) * stride_outer + (r % inner) * stride_inner
    rb = r_ptr + (r // inner) * ref_stride_outer + (r % inner) * ref_stride_inner
    gxb = gx_ptr + (r // inner) * g_stride_outer + (r % inner) * g_stride_inner
    grb = gr_ptr + (r // inner) * gr_stride_outer + (r % inner) * gr_stride_inner
    cnt = tl.load(counted_ptr + r).to(tl.int32)
    counted = cnt != 0
    lanes = tl.arange(0, BLOCK)
    counted_v = (tl.zeros([BLOCK], tl.int32) + cnt) != 0
    kl = tl.load(kl_ptr + r)
    finite = (kl == kl) & (kl != float("inf")) & (kl != float("-inf"))
    g = tl.where(counted, tl.load(g_ptr + r), 0.0) * inv_t
    lse = tl.load(lse_ptr + r)
    ref_lse = tl.load(ref_lse_ptr + r)
    for j0 in range(0, vocab, BLOCK):
        offs = j0 + lanes
        ok = offs < vocab
        u = lse - tl.load(xb + offs, mask=ok & counted_v, other=0.0).to(tl.float32) * inv_t
        v = ref_lse - tl.load(rb + offs, mask=ok & counted_v, other=0.0).to(tl.float32) * inv_t
        p = exp_row(-u)
        if WANT_X:
            gx = tl.where(p > 0.0, g * (p * ((v - u) - kl)), 0.0)
            gx = tl.where(counted, tl.where(finite, gx, float("nan")), 0.0)
            tl.store(gxb + offs, gx.to(gx_ptr.dtype.element_ty), mask=ok)
        if WANT_R:
            gr = g * (exp_row(-v) - p)
            gr = tl.where(counted, tl.where(finite, gr, float("nan")), 0.0)
            tl.store(grb + offs, gr.to(gr_ptr.dtype.element_ty), mask=ok)
