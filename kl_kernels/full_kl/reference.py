r"""The math of ``full_kl``, chunked over rows: the torch backend and the tests' reference.

For a counted token with the policy's logits row ``x``, the reference's ``r`` (``V`` entries each),
temperature ``T`` and soft-cap ``c`` (kernel units: ``kl_kernels.vocab_rows.logit_transform`` folds the logit
scale into both; with a soft-cap ``x`` and ``r`` below read ``c tanh(x / c)``, ``c tanh(r / c)``, and each
gradient is multiplied by ``1 - tanh^2`` of its own entry over ``c``)::

    a    = log_softmax(x / T),  b = log_softmax(r / T),  p = e^a,  q = e^b
    KL   = sum_j p_j (a_j - b_j)                       (a term is 0 where p_j = 0, whatever b_j)
    d KL / d x_j = p_j ((a_j - b_j) - KL) / T
    d KL / d r_j = (q_j - p_j) / T

Non-counted tokens give 0 and no gradient. A counted row holding NaN or ``+inf`` in either tensor, or only
``-inf`` in either, gives NaN (a softmax is undefined there); the policy putting mass where the reference
has none (``r_j = -inf`` where ``p_j > 0``) gives ``+inf``; a row whose KL is not finite has NaN
gradients (both sides). Rows are processed a chunk at a time (``kl_kernels.vocab_rows``), so the float32
temporaries are a few ``[rows, V]`` chunks, never ``[N, V]``; forward keeps ``KL``, ``lse`` and the
reference's ``lse`` per token, backward recomputes ``p`` and ``q`` per chunk. Math in float32 (float64
for float64 logits).
"""

from __future__ import annotations

import torch

from ..vocab_rows import capped, capped_slope, row_blocks, rows_of, rows_per_chunk


def math_dtype(logits: torch.Tensor) -> torch.dtype:
    return torch.float64 if logits.dtype == torch.float64 else torch.float32


def forward(logits: torch.Tensor, ref_logits: torch.Tensor, counted: torch.Tensor, temperature: float,
            softcap: float = 0.0):
    """``(kl [*S], lse [N], ref_lse [N])`` in the math dtype (module doc); ``softcap`` 0.0: none."""
    md = math_dtype(logits)
    n = counted.numel()
    cnt = counted.reshape(-1)
    kl = torch.empty(n, dtype=md, device=logits.device)
    lse = torch.empty(n, dtype=md, device=logits.device)
    ref_lse = torch.empty(n, dtype=md, device=logits.device)
    x_rows, r_rows = rows_of(logits), rows_of(ref_logits)
    for r0, r1, xb, rb in row_blocks(x_rows, rows_per_chunk(logits), r_rows):  # same shape: same row structure
        z, w = capped(xb.to(md), softcap) / temperature, capped(rb.to(md), softcap) / temperature
        mz, mw = z.amax(-1, keepdim=True), w.amax(-1, keepdim=True)
        # NaN, +inf, or every entry -inf in either row (amax propagates NaN); such rows' a, b are NaN, unused
        undefined = (mz.isnan() | mz.isinf() | mw.isnan() | mw.isinf()).squeeze(1)
        # a, b as log_softmax takes them, (z - max) - log s: the large terms cancel exactly. z - lse with lse
        # rounded at the logits' magnitude moves a by up to half an ulp of it, and the KL by that times a - b
        # (1.7 at logits of ~10^4: tests/test_full_kl.py, the thousands). One max and one sum per row give
        # both a and lse = max + log s (logsumexp beside log_softmax took each twice).
        a, b = z - mz, w - mw
        log_sz, log_sw = a.exp().sum(-1, keepdim=True).log(), b.exp().sum(-1, keepdim=True).log()
        a, b = a - log_sz, b - log_sw
        lz, lw = (mz + log_sz).squeeze(1), (mw + log_sw).squeeze(1)
        p = torch.exp(a)
        k = torch.where(p > 0, p * (a - b), 0.0).sum(-1)
        c = cnt[r0:r1]
        nan = torch.full((), float("nan"), dtype=md, device=logits.device)
        kl[r0:r1] = torch.where(c, torch.where(undefined, nan, k), 0.0)
        lse[r0:r1] = torch.where(c, torch.where(undefined, nan, lz), 0.0)
        ref_lse[r0:r1] = torch.where(c, torch.where(undefined, nan, lw), 0.0)
    return kl.reshape(counted.shape), lse, ref_lse


def backward(grad_kl: torch.Tensor, logits: torch.Tensor, ref_logits: torch.Tensor, counted: torch.Tensor,
             temperature: float, kl: torch.Tensor, lse: torch.Tensor, ref_lse: torch.Tensor,
             grad_logits: torch.Tensor | None, grad_ref: torch.Tensor | None, softcap: float = 0.0) -> None:
    """Write the gradients into ``grad_logits`` / ``grad_ref`` (the logits' shape and dtype; None: not
    wanted)."""
    md = math_dtype(logits)
    cnt = counted.reshape(-1)
    g_all = torch.where(cnt, grad_kl.reshape(-1).to(md), 0.0)
    k_all = kl.reshape(-1)
    x_rows, r_rows = rows_of(logits), rows_of(ref_logits)
    # the outputs (contiguous, the logits' shape) walked in the same row blocks as the logits' rows
    dest = [None if t is None else t.view(x_rows.shape) for t in (grad_logits, grad_ref)]
    present = [d for d in dest if d is not None]
    for r0, r1, xb, rb, *targets in row_blocks(x_rows, rows_per_chunk(logits), r_rows, *present):
        x, r = xb.to(md), rb.to(md)
        z, w = capped(x, softcap) / temperature, capped(r, softcap) / temperature
        a = z - lse[r0:r1].unsqueeze(1)
        b = w - ref_lse[r0:r1].unsqueeze(1)
        p, q = torch.exp(a), torch.exp(b)
        g = (g_all[r0:r1] / temperature).unsqueeze(1)
        k = k_all[r0:r1].unsqueeze(1)
        c = cnt[r0:r1].unsqueeze(1)
        finite = k.isfinite()
        nan = torch.full((), float("nan"), dtype=md, device=logits.device)
        results = []
        if dest[0] is not None:
            d = torch.where(p > 0, g * (p * ((a - b) - k)), 0.0)
            slope = capped_slope(x, softcap)
            results.append(d if slope is None else d * slope)
        if dest[1] is not None:
            d = g * (q - p)
            slope = capped_slope(r, softcap)
            results.append(d if slope is None else d * slope)
        for target, d in zip(targets, results):
            target.copy_(torch.where(c, torch.where(finite, d, nan), 0.0))
