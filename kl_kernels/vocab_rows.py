"""Rows of a ``[*S, V]`` tensor (logits over a vocabulary), shared by the ops that read logits row by
row (``token_logprobs``, ``full_kl``): how their torch math walks rows in chunks and how their kernels
find row ``r`` without a copy.

A row-wise kernel takes ``(inner, stride_outer, stride_inner)`` (:func:`row_map`): row ``r`` starts at
element ``(r // inner) * stride_outer + (r % inner) * stride_inner``, the vocabulary contiguous. That
covers an ``[N, V]`` view (``inner = N``) and ``[B, T, V]`` slabs such as ``logits[:, :-1]``
(``inner = T``), the shapes RL trainers slice logits into, without copying them.
"""

from __future__ import annotations

import math
import numbers
from typing import Iterator

import torch

class RowsProblem:
    """What the dispatcher reads of a problem over the rows of ``logits [*S, V]`` with a ``counted [*S]``
    mask (``token_logprobs``', ``full_kl``'s dataclasses derive from it): its device, dtypes, token count,
    vocabulary, and the one layout the row backends declare."""

    device_free = False
    layout = "packed"  # the backends' layout field: rows of a [*S, V] tensor

    @property
    def device(self) -> torch.device:
        return self.logits.device

    @property
    def dtypes(self) -> set:
        return {self.logits.dtype}

    @property
    def num_tokens(self) -> int:
        return self.counted.numel()

    @property
    def vocab(self) -> int:
        return self.logits.shape[-1]


LOGIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def check_logits(name: str, x) -> None:
    """``x`` is a dense ``[*S, V]`` float tensor with ``V >= 1``, or a ``TypeError``/``ValueError`` naming
    ``name`` and what was expected."""
    if not isinstance(x, torch.Tensor) or x.is_nested or x.layout != torch.strided:
        raise TypeError(f"{name} must be a dense tensor [*S, V], got {type(x).__name__}"
                        + (" (nested)" if isinstance(x, torch.Tensor) and x.is_nested else ""))
    if x.dtype not in LOGIT_DTYPES:
        raise TypeError(f"{name} must be float32, bfloat16, float16 or float64, got {x.dtype}")
    if x.dim() < 1 or x.shape[-1] == 0:
        raise ValueError(f"{name} must be [*S, V] with a vocabulary V >= 1, got shape {list(x.shape)}")


def logit_transform(temperature, logit_scale, softcap) -> tuple[float, float]:
    r"""The checked logit transform of the row ops, as the kernels take it: ``(T_k, c_k)``.

    The user's effective logit of entry ``v`` (TRL's fused LM head and Gemma's ``final_logit_softcapping``
    order: scale, then soft-cap, then temperature)::

        z'_v = c tanh(s x_v / c) / T        (softcap c; without it: z'_v = s x_v / T)

    equals ``c_k tanh(x_v / c_k) / T_k`` with ``c_k = c / s`` and ``T_k = T / s``: the scale ``s`` folds into
    the temperature and the cap (each one float64 rounding on the host; the kernels then round ``1 / T_k`` to
    float32 once, as they always did ``1 / T``), so no kernel multiplies by ``s``. ``c_k = 0.0`` means no
    soft-capping (the kernels' compile-time default path). ``temperature`` finite > 0, ``logit_scale``
    finite > 0 (TRL keeps a 0.0 scale, which makes every logit 0: refused here), ``softcap`` None or finite
    > 0; else a ``ValueError`` naming the argument."""
    if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real) or not (
            math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
    if isinstance(logit_scale, bool) or not isinstance(logit_scale, numbers.Real) or not (
            math.isfinite(logit_scale) and logit_scale > 0):
        raise ValueError(f"logit_scale must be a finite number > 0 (the logits' multiplier before soft-capping and "
                         f"temperature), got {logit_scale!r}")
    if softcap is not None and (isinstance(softcap, bool) or not isinstance(softcap, numbers.Real) or not (
            math.isfinite(softcap) and softcap > 0)):
        raise ValueError(f"softcap must be None (no soft-capping) or a finite number > 0 (logits become "
                         f"softcap * tanh(logits / softcap)), got {softcap!r}")
    t_k = float(temperature) / float(logit_scale)
    c_k = 0.0 if softcap is None else float(softcap) / float(logit_scale)
    if not (math.isfinite(t_k) and t_k > 0 and math.isfinite(c_k) and (softcap is None or c_k > 0)):
        raise ValueError(f"logit_scale={logit_scale!r} with temperature={temperature!r} and softcap={softcap!r} "
                         "leaves the float64 range (temperature / logit_scale, softcap / logit_scale)")
    return t_k, c_k


def capped(x: torch.Tensor, softcap: float) -> torch.Tensor:
    """``softcap * tanh(x / softcap)`` (``x`` itself for ``softcap == 0.0``): the torch math's soft-cap in
    kernel units (:func:`logit_transform`'s ``c_k``), in ``x``'s dtype."""
    return x if not softcap else torch.tanh(x / softcap) * softcap


def capped_slope(x: torch.Tensor, softcap: float):
    """``d capped(x) / d x = 1 - tanh^2(x / softcap)`` (as ``(1 - t)(1 + t)``: no cancellation near
    saturation), or None for ``softcap == 0.0`` (slope 1)."""
    if not softcap:
        return None
    t = torch.tanh(x / softcap)
    return (1 - t) * (1 + t)


def triton_cap(temperature: float, softcap: float) -> tuple[float, float]:
    """The Triton row kernels' soft-cap arguments ``(inv_c, c_inv_t)`` = ``(1 / c, c / T)`` in kernel units (both
    0.0 without a cap: unused there)."""
    return (1.0 / softcap, softcap / temperature) if softcap else (0.0, 0.0)


def triton_cap_flag(softcap: float) -> dict:
    """``{"SOFTCAP": True}`` with a cap, else ``{}``: the kernels' default (False) stays the launch's own, so
    the default path's compiled kernel is the one it was without the argument."""
    return {"SOFTCAP": True} if softcap else {}


# Elements per chunk of the float32 temporaries of the torch math (z, p, ...), whatever V. On the CPU 1M
# (4 MiB each, near the cache); on a GPU 64M (256 MiB each): a chunk's ~30 small launches cost ~0.3 ms of
# host time, so 1M chunks made N = 8192, V = 128k take ~1,000 of them, 794 ms where eager took 63 (H200,
# 2026-11-27).
CHUNK_ELEMENTS = 1 << 20
GPU_CHUNK_ELEMENTS = 1 << 26


def rows_per_chunk(logits: torch.Tensor) -> int:
    """Rows of ``logits`` per chunk of the torch math on its device."""
    elements = CHUNK_ELEMENTS if logits.device.type == "cpu" else GPU_CHUNK_ELEMENTS
    return max(1, elements // logits.shape[-1])


def rows_of(logits: torch.Tensor) -> torch.Tensor:
    """``logits`` as something :func:`row_blocks` walks without a copy: itself when its rows form an
    ``[N, V]`` view or ``[B, T, V]`` slabs (e.g. ``logits[:, :-1]``), else one contiguous copy."""
    if logits.dim() <= 3:
        return logits
    try:
        return logits.view(-1, logits.shape[-1])
    except RuntimeError:
        return logits.reshape(-1, logits.shape[-1])  # a copy: no view reaches these rows


def row_blocks(x: torch.Tensor, rows: int, *others: torch.Tensor) -> Iterator[tuple]:
    """``(r0, r1, x_block, *other_blocks)``: consecutive row ranges ``[r0, r1)`` of the flattened
    ``[*S, V]`` tensor ``x`` as ``[r1 - r0, V]`` views, at most ``rows`` rows each, and the same rows
    of each tensor of ``others`` (same shape as ``x``)."""
    vocab = x.shape[-1]
    if x.dim() == 1:
        x, others = x.unsqueeze(0), tuple(o.unsqueeze(0) for o in others)
    if x.dim() == 3:
        try:
            x, others = x.view(-1, vocab), tuple(o.view(-1, vocab) for o in others)
        except RuntimeError:  # [B, T, V] slabs, e.g. logits[:, :-1]: row blocks within each slab
            width = x.shape[1]
            for b in range(x.shape[0]):
                for t0 in range(0, width, rows):
                    t1 = min(t0 + rows, width)
                    yield (b * width + t0, b * width + t1, x[b, t0:t1], *(o[b, t0:t1] for o in others))
            return
    for r0 in range(0, x.shape[0], rows):
        r1 = min(r0 + rows, x.shape[0])
        yield (r0, r1, x[r0:r1], *(o[r0:r1] for o in others))


def row_map(x: torch.Tensor) -> tuple[int, int, int]:
    """``(inner, stride_outer, stride_inner)`` of ``x`` as :func:`rows_of` returns it (1-D: one row)."""
    if x.dim() == 1:
        return 1, 0, 0
    if x.dim() == 2:
        return max(x.shape[0], 1), 0, x.stride(0)
    return max(x.shape[1], 1), x.stride(0), x.stride(1)


def row_pass(backend: str, launch, launch_triton, reference) -> tuple:
    """(forward, backward) of a row op's row pass by backend name, for logits the caller forms or holds itself
    (the hidden-state and vocabulary-parallel paths): of the op's C++ launcher ``launch`` for ``cpu`` and
    ``cuda`` (it picks ``_C`` or ``_cuda`` by the logits' device), of its emulated one for ``cuda-emulated``, of
    ``launch_triton`` for ``triton``, else of its torch ``reference``. The op passes its own modules."""
    if backend in ("cpu", "cuda"):
        return launch.forward, launch.backward
    if backend == "cuda-emulated":
        return launch.emulated.forward, launch.emulated.backward
    if backend == "triton":
        return launch_triton.forward, launch_triton.backward
    return reference.forward, reference.backward
