r"""The math of ``token_logprobs``, chunked over rows: the torch backend and the tests' reference.

For a counted token with logits row ``x`` (``V`` entries), label ``y``, temperature ``T`` and soft-cap ``c``
(kernel units: ``kl_kernels.vocab_rows.logit_transform`` folds the logit scale into both)::

    z      = x / T                 (with a soft-cap: z = c tanh(x / c) / T, and every d / d x_j below
                                    is multiplied by 1 - tanh^2(x_j / c))
    lse    = log sum_j exp(z_j)
    lp     = z_y - lse                                   (log softmax(z)[y])
    p_j    = exp(z_j - lse)                              (softmax)
    H      = sum_j p_j (lse - z_j)                       (entropy; every term >= 0: no cancellation,
                                                          unlike lse - sum_j p_j z_j at large |z|)
    d lp / d x_j = (1[j = y] - p_j) / T
    d H  / d x_j = p_j ((lse - z_j) - H) / T            (= -p_j (z_j - E_p[z]) / T)

Non-counted tokens give 0 and no gradient, whatever their logits hold. A counted row holding NaN or
``+inf``, or only ``-inf``, gives NaN (the softmax is undefined there); ``-inf`` entries elsewhere
are fine (masked vocabulary: probability 0, no gradient).

Rows are processed a chunk at a time (``kl_kernels.vocab_rows``: 1M logits on the CPU, 64M on a GPU), so the float32 temporaries are a few chunks
of ``[rows, V]``, never ``[N, V]``: forward keeps only ``lse`` and ``H`` per token (float32), and
backward recomputes ``p`` per chunk from the logits. Math in float32 (float64 for float64 logits).
"""

from __future__ import annotations

import torch

from ..vocab_rows import capped, capped_slope, row_blocks, rows_of, rows_per_chunk


def math_dtype(logits: torch.Tensor) -> torch.dtype:
    return torch.float64 if logits.dtype == torch.float64 else torch.float32


def forward(logits: torch.Tensor, labels: torch.Tensor, counted: torch.Tensor, temperature: float,
            want_entropy: bool, softcap: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(lp [*S], H [*S] or [0], lse [N])`` in the math dtype (module doc). ``labels`` int64 and
    ``counted`` bool, both ``[*S]``; ``softcap`` 0.0: none."""
    md = math_dtype(logits)
    n = labels.numel()
    lab, cnt = labels.reshape(-1), counted.reshape(-1)
    lp = torch.zeros(n, dtype=md, device=logits.device)
    ent = torch.zeros(n if want_entropy else 0, dtype=md, device=logits.device)
    lse = torch.zeros(n, dtype=md, device=logits.device)
    nan = torch.full((), float("nan"), dtype=md, device=logits.device)
    for r0, r1, block in row_blocks(rows_of(logits), rows_per_chunk(logits)):
        z = capped(block.to(md), softcap) / temperature
        top = z.amax(-1)
        undefined = torch.isnan(top) | torch.isinf(top)  # NaN, +inf, or every entry -inf
        l = torch.where(undefined, nan, torch.logsumexp(z, -1))
        c = cnt[r0:r1]
        # A counted label outside [0, V) was refused by problem.py, except under torch.compile (no host
        # read there): never read out of bounds, give NaN.
        in_vocab = (lab[r0:r1] >= 0) & (lab[r0:r1] < z.shape[1])
        y = torch.where(c & in_vocab, lab[r0:r1], 0).unsqueeze(1)
        l = torch.where(in_vocab, l, nan)
        lp[r0:r1] = torch.where(c, z.gather(1, y).squeeze(1) - l, 0.0)
        lse[r0:r1] = l
        if want_entropy:
            u = l.unsqueeze(1) - z  # lse - z >= 0 (inf at -inf logits)
            p = torch.exp(-u)
            h = torch.where(p > 0, p * u, 0.0).sum(-1)
            ent[r0:r1] = torch.where(c, torch.where(undefined, nan, h), 0.0)
    return lp.reshape(labels.shape), (ent.reshape(labels.shape) if want_entropy else ent), lse


def backward(grad_lp: torch.Tensor | None, grad_entropy: torch.Tensor | None, logits: torch.Tensor,
             labels: torch.Tensor, counted: torch.Tensor, temperature: float, lse: torch.Tensor,
             entropy: torch.Tensor, out: torch.Tensor, softcap: float = 0.0) -> torch.Tensor:
    """Write ``d loss / d logits`` into ``out`` (logits' shape and dtype; the logits themselves
    for ``inplace_backward``: each chunk is read before it is overwritten) and return it."""
    md = math_dtype(logits)
    lab, cnt = labels.reshape(-1), counted.reshape(-1)
    zero = torch.zeros((), dtype=md, device=logits.device)
    gl = torch.where(cnt, grad_lp.reshape(-1).to(md), zero) if grad_lp is not None else None
    gh = torch.where(cnt, grad_entropy.reshape(-1).to(md), zero) if grad_entropy is not None else None
    h_all = entropy.reshape(-1) if gh is not None else None
    source = rows_of(logits)
    dest = out if source is logits else out.view(source.shape)
    for r0, r1, block, target in row_blocks(source, rows_per_chunk(logits), dest):
        x = block.to(md)
        z = capped(x, softcap) / temperature
        u = lse[r0:r1].unsqueeze(1) - z
        p = torch.exp(-u)
        d = torch.zeros_like(z)
        if gl is not None:
            g = gl[r0:r1].unsqueeze(1)
            d = d - g * p
            y = lab[r0:r1]
            # a label outside [0, V) is no entry of this row (as in the kernels): a vocabulary slice's or
            # shard's rows whose label lies elsewhere (the hidden-state path's vocabulary walk, process_group)
            here = (cnt[r0:r1] & (y >= 0) & (y < z.shape[1])).unsqueeze(1)
            d.scatter_add_(1, torch.where(here.squeeze(1), y, 0).unsqueeze(1), torch.where(here, g, 0.0))
        if gh is not None:
            d = d + gh[r0:r1].unsqueeze(1) * torch.where(p > 0, p * (u - h_all[r0:r1].unsqueeze(1)), 0.0)
        slope = capped_slope(x, softcap)
        d = d / temperature if slope is None else d * slope / temperature
        d = torch.where(cnt[r0:r1].unsqueeze(1), d, 0.0)
        target.copy_(d)
    return out
