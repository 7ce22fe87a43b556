"""Host launcher of the Triton ``full_kl`` kernels (``kl_kernels/triton/full_kl.py``): the launcher of
``launch.py`` for Triton, one program per row, the same row maps."""

from __future__ import annotations

import torch

from ..launching import resolved
from ..vocab_rows import row_map, rows_of, triton_cap as _cap, triton_cap_flag as _softcap_flag


def _kernels():
    from ..triton import full_kl as k  # imported on first use: triton is optional

    return k.full_kl_fwd_kernel, k.full_kl_bwd_kernel


def _steps(logits, *rows) -> tuple[int, int, int, bool]:
    """(threads, entries a thread reads per step, warps, whether each ``(tensor, stride_outer, stride_inner)`` of
    ``rows`` has 16-byte aligned rows) of a row's program (``triton/row_math.py``)."""
    from ..triton.row_math import ROW_WARPS, row_chunk, rows_aligned

    return 32 * ROW_WARPS, row_chunk(logits.element_size()), ROW_WARPS, rows_aligned(*rows)


def forward(logits, ref_logits, counted, temperature: float, softcap: float = 0.0):
    fwd, _ = _kernels()
    logits, ref_logits = resolved(logits, ref_logits)
    x, r = rows_of(logits), rows_of(ref_logits)
    n, dev = counted.numel(), logits.device
    kl = torch.empty(counted.shape, dtype=torch.float32, device=dev)
    lse = torch.empty(n, dtype=torch.float32, device=dev)
    ref_lse = torch.empty(n, dtype=torch.float32, device=dev)
    if n:
        inner, so, si = row_map(x)
        _, rso, rsi = row_map(r)
        flags = counted.contiguous().view(torch.uint8)  # the kernels read the bool mask as bytes
        lanes, chunk, warps, aligned = _steps(x, (x, so, si), (r, rso, rsi))
        fwd[(n,)](x, r, flags, kl, lse, ref_lse, n, x.shape[-1], inner, so, si, rso, rsi, 1.0 / temperature,
                  *_cap(temperature, softcap), LANES=lanes, CHUNK=chunk, ALIGNED=aligned, BLOCK=lanes * chunk,
                  **_softcap_flag(softcap), num_warps=warps)
    return kl, lse, ref_lse


def backward(grad_kl, logits, ref_logits, counted, temperature: float, kl, lse, ref_lse, grad_logits, grad_ref,
             softcap: float = 0.0):
    _, bwd = _kernels()
    logits, ref_logits = resolved(logits, ref_logits)
    x, r = rows_of(logits), rows_of(ref_logits)
    n = counted.numel()
    if not n or (grad_logits is None and grad_ref is None):
        return
    inner, so, si = row_map(x)
    _, rso, rsi = row_map(r)
    gx = None if grad_logits is None else (grad_logits if grad_logits.dim() <= 3 else grad_logits.view(-1, x.shape[-1]))
    gr = None if grad_ref is None else (grad_ref if grad_ref.dim() <= 3 else grad_ref.view(-1, x.shape[-1]))
    _, gso, gsi = row_map(gx) if gx is not None else (0, 0, 0)
    _, grso, grsi = row_map(gr) if gr is not None else (0, 0, 0)
    g = grad_kl.reshape(-1).to(torch.float32).contiguous()
    flags = counted.contiguous().view(torch.uint8)
    stand_in = gx if gx is not None else gr  # an absent output's pointer: never written (WANT_* off)
    lanes, chunk, warps, _ = _steps(x)
    bwd[(n,)](x, r, flags, kl.reshape(-1), lse, ref_lse, g, gx if gx is not None else stand_in,
              gr if gr is not None else stand_in, n, x.shape[-1], inner, so, si, rso, rsi, gso, gsi, grso, grsi,
              1.0 / temperature, *_cap(temperature, softcap), WANT_X=gx is not None, WANT_R=gr is not None,
              BLOCK=lanes * chunk, **_softcap_flag(softcap), num_warps=warps)
