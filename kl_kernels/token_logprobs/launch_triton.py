"""Host launcher of the Triton ``token_logprobs`` kernels (``kl_kernels/triton/token_logprobs.py``): the
launcher of ``launch.py`` for Triton, one program per row, the same row map."""

from __future__ import annotations

import torch

from ..launching import resolved
from ..vocab_rows import row_map, rows_of, triton_cap as _cap, triton_cap_flag as _softcap_flag


def _kernels():
    from ..triton import token_logprobs as k  # imported on first use: triton is optional

    return k.token_logprobs_fwd_kernel, k.token_logprobs_bwd_kernel


def _steps(logits, *rows) -> tuple[int, int, int, bool]:
    """(threads, entries a thread reads per step, warps, whether each ``(tensor, stride_outer, stride_inner)`` of
    ``rows`` has 16-byte aligned rows) of a row's program (``triton/row_math.py``)."""
    from ..triton.row_math import ROW_WARPS, row_chunk, rows_aligned

    return 32 * ROW_WARPS, row_chunk(logits.element_size()), ROW_WARPS, rows_aligned(*rows)


def forward(logits, labels, counted, temperature: float, want_entropy: bool, softcap: float = 0.0):
    fwd, _ = _kernels()
    logits, = resolved(logits)
    rows = rows_of(logits)
    n, dev = labels.numel(), logits.device
    lp = torch.empty(labels.shape, dtype=torch.float32, device=dev)
    ent = torch.empty(labels.shape if want_entropy else (0,), dtype=torch.float32, device=dev)
    lse = torch.empty(n, dtype=torch.float32, device=dev)
    if n:
        inner, so, si = row_map(rows)
        flags = counted.contiguous().view(torch.uint8)  # the kernels read the bool mask as bytes
        lanes, chunk, warps, aligned = _steps(rows, (rows, so, si))
        fwd[(n,)](rows, labels.contiguous(), flags, lp, lse, ent if want_entropy else lp, n, rows.shape[-1], inner, so,
                  si, 1.0 / temperature, *_cap(temperature, softcap), WANT_ENTROPY=want_entropy, LANES=lanes,
                  CHUNK=chunk, ALIGNED=aligned, BLOCK=lanes * chunk, **_softcap_flag(softcap), num_warps=warps)
    return lp, ent, lse


def backward(grad_lp, grad_entropy, logits, labels, counted, temperature: float, lse, entropy, out,
             softcap: float = 0.0):
    _, bwd = _kernels()
    logits, = resolved(logits)
    rows = rows_of(logits)
    n = labels.numel()
    if n:
        target = out if out.dim() <= 3 else out.view(-1, out.shape[-1])
        inner, so, si = row_map(rows)
        _, gso, gsi = row_map(target)
        g_lp = None if grad_lp is None else grad_lp.reshape(-1).to(torch.float32).contiguous()
        g_ent = None if grad_entropy is None else grad_entropy.reshape(-1).to(torch.float32).contiguous()
        flags = counted.contiguous().view(torch.uint8)
        lanes, chunk, warps, _ = _steps(rows)
        bwd[(n,)](rows, labels.contiguous(), flags, lse, entropy if g_ent is not None else lse,
                  g_lp if g_lp is not None else lse, g_ent if g_ent is not None else lse, target, n,
                  rows.shape[-1], inner, so, si, gso, gsi, 1.0 / temperature, *_cap(temperature, softcap),
                  HAS_G_LP=g_lp is not None, HAS_G_ENT=g_ent is not None, BLOCK=lanes * chunk,
                  **_softcap_flag(softcap), num_warps=warps)
    return out
