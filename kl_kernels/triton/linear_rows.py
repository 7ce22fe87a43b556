"""Triton kernels of the fused hidden-state path (``kl_kernels/token_logprobs/linear_fused.py`` launches them):
log-probs, entropy and ``lse`` of ``softmax((hidden @ weight.T + bias) / T)`` with the logits formed tile by tile
on chip, never as an ``[N, V]`` (or ``[C, V]``) tensor in HBM.

* ``linear_rows_fwd_kernel``: one program per (block of ``BLOCK_N`` tokens, share of the vocabulary). It walks
  its share ``BLOCK_V`` columns at a time; each logits tile is ``tl.dot`` of a ``[BLOCK_N, BLOCK_K]`` hidden tile
  and a ``[BLOCK_V, BLOCK_K]`` weight tile over H (float32 accumulation), ``+ bias``, ``* (1 / T)``. Per token it
  keeps the online max m, ``S = sum e^(z - m)`` and ``W = sum e^(z - m) min(m - z, FAR)`` moved onto each new max
  by ``row_math.logprob_rebase`` (the rules of ``csrc/common/row_math.h``; S and W in float64 across tiles, a
  tile's terms summed in float32), the label's logit picked from the tile that holds it, and a NaN flag. It
  writes these five numbers per (share, token): the partials.
* ``linear_rows_combine_kernel``: per token, the shares' partials merged in share order (deterministic) with
  the same rebase, then ``lse = m + log S``, ``log_prob = z_y - lse``, ``entropy = W / S + log S``, 0 at tokens
  not counted, NaN at a counted token with a NaN or +inf logit, only -inf ones, or a label outside [0, V).
* ``linear_rows_dlogits_kernel``: one program per ``[BLOCK_N, BLOCK_V]`` tile of a vocabulary chunk's logits
  gradient, the tile recomputed as in the forward, then ``d z_j = (g_lp (1[j = y] - p_j) + g_H p_j (min(lse -
  z_j, FAR) - H)) / T`` with ``p_j = e^(z_j - lse)`` (token_logprobs' backward), written in the parameters'
  dtype into a bounded ``[N, V_c]`` buffer that cuBLAS GEMMs turn into ``d weight`` and ``d hidden``
  (``linear_fused.py`` says why and what it costs). With ``FROM_BUFFER`` the tile's logits are read from that
  buffer instead (cuBLAS wrote them there: the ``"cublas"`` recompute) and the gradient written over them.

fp32 inputs: ``tl.dot``'s ``input_precision`` is the launcher's ``PRECISION`` ("tf32" where
``torch.backends.cuda.matmul.allow_tf32`` is set, else "ieee"); 16-bit inputs multiply exactly into float32.
``UPCAST`` (the launcher sets it for bf16 under Triton's interpreter only, whose bf16 ``tl.dot`` returns garbage in
triton 3.x) converts the tiles to float32 first: the same products, exact in float32.
Every index is int64 (a 152k x 8k head has 1.2e9 entries). ``hid`` and the row strides stay specialized (Triton
marks ints divisible by 16): with H a multiple of 16 the tiles' H masks are uniform over 16 entries, which the
16-bit tiles' asynchronous copies need (4+ bytes each); with ``hid`` unspecialized the H loop was not pipelined.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .kl_math import exp_row as _exp
from .row_math import FAR, logprob_rebase, row_shift, soft_tanh


@triton.jit
def _logits_tile(h_ptr, w_ptr, b_ptr, offs_n, in_n, offs_v, in_v, hid, stride_h, stride_w, inv_t, inv_c, c_inv_t,
                 HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr, SOFTCAP: tl.constexpr):
    """z = (hidden[offs_n] @ weight[offs_v].T + bias[offs_v]) * inv_t (SOFTCAP: c tanh(x / c) / T of that x, with
    inv_c = 1 / c, c_inv_t = c / T, row_math.soft_tanh), [BLOCK_N, BLOCK_V] float32; columns outside the
    vocabulary (or its share) -inf; rows outside [0, N) read as 0 (their values are never kept)."""
    acc = tl.zeros([BLOCK_N, BLOCK_V], dtype=tl.float32)
    lanes_k = tl.arange(0, BLOCK_K)
    h_rows = h_ptr + offs_n[:, None] * stride_h
    w_rows = w_ptr + offs_v[:, None] * stride_w
    for k0 in range(0, hid, BLOCK_K):
        offs_k = k0 + lanes_k
        in_k = offs_k < hid
        a = tl.load(h_rows + offs_k[None, :], mask=in_n[:, None] & in_k[None, :], other=0.0)
        b = tl.load(w_rows + offs_k[None, :], mask=in_v[:, None] & in_k[None, :], other=0.0)
        if UPCAST:  # (the interpreter's bf16 tl.dot is wrong; bf16 products are exact in float32)
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, tl.trans(b), acc, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_v, mask=in_v, other=0.0).to(tl.float32)[None, :]
    if SOFTCAP:
        z = soft_tanh(acc, inv_c) * c_inv_t
    else:
        z = acc * inv_t
    return tl.where(in_v[None, :], z, float("-inf"))


@triton.jit(do_not_specialize=("rows", "vocab", "v_per_split"))
def linear_rows_fwd_kernel(h_ptr, w_ptr, b_ptr, labels_ptr, part_m_ptr, part_s_ptr, part_w_ptr, part_zy_ptr,
                           part_nan_ptr, rows, vocab, hid, stride_h, stride_w, v_per_split, inv_t, inv_c, c_inv_t,
                           HAS_BIAS: tl.constexpr, WANT_ENTROPY: tl.constexpr, PRECISION: tl.constexpr,
                           UPCAST: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
                           SOFTCAP: tl.constexpr = False):
    # the token block varies fastest: programs running together share a share of the weight (L2 reuse)
    pid_n = tl.program_id(0).to(tl.int64)
    share = tl.program_id(1).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
    in_n = offs_n < rows
    y = tl.load(labels_ptr + offs_n, mask=in_n, other=-1)
    m = tl.full([BLOCK_N], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK_N], tl.float64)
    w = tl.zeros([BLOCK_N], tl.float64)
    zy = tl.zeros([BLOCK_N], tl.float32)
    nan = tl.zeros([BLOCK_N], tl.int32)
    v_lo = share * v_per_split
    v_hi = tl.minimum(v_lo + v_per_split, vocab)
    lanes_v = tl.arange(0, BLOCK_V).to(tl.int64)
    for v0 in range(v_lo, v_hi, BLOCK_V):
        offs_v = v0 + lanes_v
        in_v = offs_v < v_hi
        z = _logits_tile(h_ptr, w_ptr, b_ptr, offs_n, in_n, offs_v, in_v, hid, stride_h, stride_w, inv_t, inv_c,
                         c_inv_t, HAS_BIAS, PRECISION, UPCAST, BLOCK_N, BLOCK_V, BLOCK_K, SOFTCAP)
        nan = tl.maximum(nan, tl.max((z != z).to(tl.int32), 1))
        zy += tl.sum(tl.where(offs_v[None, :] == y[:, None], z, 0.0), 1)  # one tile of all holds the label
        run_max = tl.max(tl.where(z == z, z, float("-inf")), 1)  # NaN skipped (flagged above)
        # S and W moved onto the new max where it rises (delta 0, factor 1 where it does not)
        m, s, w, floor = logprob_rebase(m, s, w, run_max)
        d = floor[:, None] - z
        e = _exp(-d)
        s += tl.sum(e, 1).to(tl.float64)
        if WANT_ENTROPY:
            w += tl.sum(e * tl.where(d <= FAR, d, FAR), 1).to(tl.float64)
    at = share * rows + offs_n
    tl.store(part_m_ptr + at, m, mask=in_n)
    tl.store(part_s_ptr + at, s, mask=in_n)
    tl.store(part_w_ptr + at, w, mask=in_n)
    tl.store(part_zy_ptr + at, zy, mask=in_n)
    tl.store(part_nan_ptr + at, nan, mask=in_n)


@triton.jit(do_not_specialize=("rows", "vocab", "shares"))
def linear_rows_combine_kernel(part_m_ptr, part_s_ptr, part_w_ptr, part_zy_ptr, part_nan_ptr, labels_ptr,
                               counted_ptr, lp_ptr, lse_ptr, ent_ptr, rows, vocab, shares,
                               WANT_ENTROPY: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    inb = offs < rows
    m = tl.full([BLOCK], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK], tl.float64)
    w = tl.zeros([BLOCK], tl.float64)
    zy = tl.zeros([BLOCK], tl.float32)
    nan = tl.zeros([BLOCK], tl.int32)
    for i in range(0, shares):  # in share order: deterministic
        at = i * rows + offs
        m_i = tl.load(part_m_ptr + at, mask=inb, other=float("-inf"))
        s_i = tl.load(part_s_ptr + at, mask=inb, other=0.0)
        w_i = tl.load(part_w_ptr + at, mask=inb, other=0.0)
        zy += tl.load(part_zy_ptr + at, mask=inb, other=0.0)
        nan = tl.maximum(nan, tl.load(part_nan_ptr + at, mask=inb, other=0))
        m, s, w, _ = logprob_rebase(m, s, w, m_i)  # the sums so far onto max(m, m_i) ...
        delta, factor = row_shift(m_i, m)  # ... and the share's
        s += factor * s_i
        w += tl.where(factor == 0.0, 0.0, factor * (w_i + delta * s_i))
    y = tl.load(labels_ptr + offs, mask=inb, other=0)
    counted = tl.load(counted_ptr + offs, mask=inb, other=0).to(tl.int32) != 0  # (a uint8 view of the mask)
    bad = (nan > 0) | (m == float("inf")) | (m == float("-inf"))
    m_safe = tl.where(bad, 0.0, m)
    log_s = tl.log(s.to(tl.float32))
    lse = m_safe + log_s
    undefined = bad | (y < 0) | (y >= vocab)
    nan_value = float("nan")
    tl.store(lp_ptr + offs, tl.where(counted, tl.where(undefined, nan_value, zy - lse), 0.0), mask=inb)
    tl.store(lse_ptr + offs, tl.where(counted, tl.where(undefined, nan_value, lse), 0.0), mask=inb)
    if WANT_ENTROPY:
        h = (w / s).to(tl.float32) + log_s
        tl.store(ent_ptr + offs, tl.where(counted, tl.where(undefined, nan_value, h), 0.0), mask=inb)


@triton.jit(do_not_specialize=("rows", "v_lo", "v_hi"))
def linear_rows_dlogits_kernel(h_ptr, w_ptr, b_ptr, labels_ptr, counted_ptr, lse_ptr, ent_ptr, g_lp_ptr, g_ent_ptr,
                               out_ptr, rows, hid, v_lo, v_hi, stride_h, stride_w, stride_o, inv_t, inv_c, c_inv_t,
                               HAS_BIAS: tl.constexpr, HAS_G_LP: tl.constexpr, HAS_G_ENT: tl.constexpr,
                               PRECISION: tl.constexpr, UPCAST: tl.constexpr, FROM_BUFFER: tl.constexpr,
                               BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
                               SOFTCAP: tl.constexpr = False):
    # SOFTCAP: z = c tanh(x / c) / T, d z / d x = (1 - tanh^2) / T: the gradient times 1 - t^2, t = z / (c / T)
    pid_n = tl.program_id(0).to(tl.int64)
    pid_v = tl.program_id(1).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
    in_n = offs_n < rows
    offs_v = v_lo + pid_v * BLOCK_V + tl.arange(0, BLOCK_V).to(tl.int64)
    in_v = offs_v < v_hi
    out = out_ptr + offs_n[:, None] * stride_o + (offs_v - v_lo)[None, :]
    if FROM_BUFFER:  # the chunk's logits (bias included) are in the buffer already (cuBLAS): read, not formed
        if SOFTCAP:
            z = soft_tanh(tl.load(out, mask=in_n[:, None] & in_v[None, :], other=0.0).to(tl.float32),
                          inv_c) * c_inv_t
        else:
            z = tl.load(out, mask=in_n[:, None] & in_v[None, :], other=0.0).to(tl.float32) * inv_t
    else:
        z = _logits_tile(h_ptr, w_ptr, b_ptr, offs_n, in_n, offs_v, in_v, hid, stride_h, stride_w, inv_t, inv_c,
                         c_inv_t, HAS_BIAS, PRECISION, UPCAST, BLOCK_N, BLOCK_V, BLOCK_K, SOFTCAP)
    counted = tl.load(counted_ptr + offs_n, mask=in_n, other=0).to(tl.int32) != 0
    y = tl.load(labels_ptr + offs_n, mask=in_n, other=-1)
    lse = tl.load(lse_ptr + offs_n, mask=in_n, other=0.0)
    # (absent gradients come with a valid stand-in pointer: loaded, then zeroed)
    gl = tl.where(counted & HAS_G_LP, tl.load(g_lp_ptr + offs_n, mask=in_n, other=0.0), 0.0)
    gh = tl.where(counted & HAS_G_ENT, tl.load(g_ent_ptr + offs_n, mask=in_n, other=0.0), 0.0)
    h = tl.where(HAS_G_ENT, tl.load(ent_ptr + offs_n, mask=in_n, other=0.0), 0.0)
    d = lse[:, None] - z
    p = _exp(-d)
    g = tl.where(offs_v[None, :] == y[:, None], gl[:, None] * (1.0 - p), -gl[:, None] * p) \
        + gh[:, None] * (p * (tl.where(d <= FAR, d, FAR) - h[:, None]))
    # a counted row without a log-prob (lse NaN: NaN/+inf logits, only -inf ones, a label out of range) gets
    # NaN throughout (exp_row does not carry a NaN argument through)
    g = tl.where((lse != lse)[:, None], float("nan"), g)
    if SOFTCAP:
        t = z * (1.0 / c_inv_t)
        g = g * ((1.0 - t) * (1.0 + t))
    g = tl.where(counted[:, None], g * inv_t, 0.0)
    tl.store(out, g.to(out_ptr.dtype.element_ty), mask=in_n[:, None] & in_v[None, :])
