"""Triton kernels of ``full_kl``: one program per row, the algorithm of ``csrc/cpu/full_kl_cpu.cpp`` (the
formulas of ``kl_kernels/full_kl/reference.py``)::

    forward:  m = max z, n = max w;  u_j = m - z_j, v_j = n - w_j
              S = sum_j e^-u_j;  R = sum_j e^-v_j;  A = sum_j e^-u_j (v_j - u_j)  (0 where e^-u_j is; +inf
              where e^-u_j > 0 and w_j = -inf, decided against the final m)
              KL = A / S + log R - log S;  lse = m + log S;  ref_lse = n + log R
              one pass over both rows: m, n running maxima, S, R, A moved onto them as they rise (row_math.py)
    backward: p_j = e^(z_j - lse), q_j = e^(w_j - ref_lse)
              dx_j = g p_j ((ref_lse - w_j) - (lse - z_j) - KL) / T;  dr_j = g (q_j - p_j) / T

with z = x / T and w = r / T (as x * (1 / T)), the sums per BLOCK-wide step in float32 and across steps in
float64, in a fixed order: deterministic. NaN/+inf in either row, or a row of only -inf, gives NaN; a row
whose KL is not finite has NaN gradients. Row r of each tensor starts at (r // inner) * stride_outer +
(r % inner) * stride_inner elements with that tensor's strides. Compiled for sm_80/sm_90 and run under the
interpreter in CI; not yet run on a GPU: "auto" takes them on a GPU only after the first-use self-check
(``kl_kernels/selfcheck.py``), after the fused CUDA kernel.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .kl_math import exp_row
from .row_math import full_kl_lost, full_kl_rebase, step_max


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
    # one pass (row_math.py): per step both rows' maxima (NaN skipped, flagged), the sums moved onto the
    # running maxima, then the step's terms, float32 per step, float64 across steps
    m = tl.full([], float("-inf"), tl.float32)
    n = tl.full([], float("-inf"), tl.float32)
    lost = tl.full([], float("-inf"), tl.float32)
    s = tl.zeros([], tl.float64)
    f = tl.zeros([], tl.float64)
    rr = tl.zeros([], tl.float64)
    a = tl.zeros([], tl.float64)
    nan = tl.zeros([BLOCK], tl.int32)
    for j0 in range(0, vocab, BLOCK):
        offs = j0 + lanes
        ok = (offs < vocab) & counted_v
        z = tl.load(xb + offs, mask=ok, other=float("-inf")).to(tl.float32) * inv_t
        w = tl.load(rb + offs, mask=ok, other=float("-inf")).to(tl.float32) * inv_t
        nan = tl.where((z != z) | (w != w), 1, nan)
        m, n, s, f, rr, a, lost, fm, fn = full_kl_rebase(m, n, s, f, rr, a, lost, step_max(z), step_max(w),
                                                         tl.max(full_kl_lost(z, w), 0))
        u = fm - z
        v = fn - w
        e = exp_row(-u)
        finite_ref = v < float("inf")
        s += tl.sum(e, 0).to(tl.float64)
        f += tl.sum(tl.where(finite_ref, e, 0.0), 0).to(tl.float64)
        rr += tl.sum(exp_row(-v), 0).to(tl.float64)
        a += tl.sum(tl.where((e > 0.0) & finite_ref, e * (v - u), 0.0), 0).to(tl.float64)
    bad = (tl.max(nan, 0) > 0) | (m == float("inf")) | (m == float("-inf")) | (n == float("inf")) \
        | (n == float("-inf"))
    m_safe = tl.where(bad, 0.0, m)
    n_safe = tl.where(bad, 0.0, n)
    log_s = tl.log(s.to(tl.float32))
    log_r = tl.log(rr.to(tl.float32))
    kl = (a / s).to(tl.float32) + (log_r - log_s)
    kl = tl.where(exp_row(lost - m_safe) > 0.0, float("inf"), kl)  # kl::full_kl_value's +inf rule
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
