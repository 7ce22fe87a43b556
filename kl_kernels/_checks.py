"""Argument checks that every op shares (no op owns them).

Coefficients (``kl_reward``'s ``coef``, ``kl_penalty_loss``'s ``beta``) reach the kernels as float32:
a value that is not finite in float32 (NaN, +-inf, or a finite float beyond float32's range, e.g.
``2**200``) is rejected here, so that no backend is asked to compute with it (before this check
the CPU kernel and the torch reference disagreed on padding tokens for such a coefficient).
"""

from __future__ import annotations

import math
import numbers

import torch

from .layouts import check_device

FLOAT32_MAX = float(torch.finfo(torch.float32).max)


def finite_scalar(name: str, value: float) -> float:
    """``value`` (a float) if it is finite in float32, else a ValueError naming ``name``."""
    if not -FLOAT32_MAX <= value <= FLOAT32_MAX:  # (NaN compares false: caught too)
        raise ValueError(f"{name} must be finite and within float32's range (|{name}| <= {FLOAT32_MAX:.4g}), "
                         f"got {value}")
    return value


def finite_coefficient_tensor(name: str, value: torch.Tensor) -> torch.Tensor:
    """Check a coefficient tensor's values on the CPU (one pass over <= B values, no sync there).

    On an accelerator the values are not read: that would synchronize the host with the device on
    every call. A non-finite coefficient there gives non-finite rewards / losses on the counted
    tokens, as the arithmetic says; it is the caller's to avoid (documented in the ops)."""
    if value.device.type == "cpu" and value.numel() and not torch.compiler.is_compiling():
        bad = ~(value.abs() <= FLOAT32_MAX)  # NaN compares false: caught too
        if bool(bad.any()):
            first = value.reshape(-1)[bad.reshape(-1).nonzero()[0, 0]].item()
            raise ValueError(f"{name} must be finite and within float32's range (|{name}| <= {FLOAT32_MAX:.4g}), "
                             f"got a value of {first}")
    return value


_DENSE_LAYOUTS = (torch.strided, torch.jagged)  # a strided nested tensor reports torch.strided


def dense_layouts(**arguments) -> None:
    """A TypeError naming the first tensor argument (or list element) stored sparse (COO, CSR, CSC,
    BSR, BSC) or in another non-strided layout: the kernels and the reference read strided memory,
    and torch's own message ("Cannot access data pointer of Tensor that doesn't have storage") names
    no argument. Non-tensor arguments are left to the ops' own checks."""
    for name, value in arguments.items():
        items = enumerate(value) if type(value) in (list, tuple) else ((None, value),)
        for i, t in items:
            if isinstance(t, torch.Tensor) and t.layout not in _DENSE_LAYOUTS:
                where = name if i is None else f"{name}[{i}]"
                raise TypeError(f"{where} must be a strided (dense) tensor, got layout {t.layout} "
                                f"(convert it with .to_dense())")


def device_of(log_probs, **others) -> torch.device | None:
    """The device of the log-probs argument (a tensor, or a list or tuple of them: its first
    element's). Any other first element is a TypeError naming it.

    An empty list carries no device: it takes the device of the first tensor among ``others`` (the
    call's other arguments: a ``[0]`` reward, a coefficient tensor...), so that an empty batch on a
    GPU stays there; ``None`` when there is none (the batch has no device at all: see
    :func:`~kl_kernels.backends.select`)."""
    if isinstance(log_probs, (list, tuple)):
        if not log_probs:
            return next((t.device for t in others.values() if isinstance(t, torch.Tensor)), None)
        first = log_probs[0]
        if not isinstance(first, torch.Tensor):
            raise TypeError(f"log_probs[0] must be a tensor, got {type(first).__name__}")
        return first.device
    return log_probs.device if isinstance(log_probs, torch.Tensor) else torch.device("cpu")


def result_buffer(name: str, t, shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A caller's ``out=`` buffer, checked: a strided tensor of exactly ``shape`` and ``dtype`` on
    ``device``, contiguous (the kernels write it flat), not requiring grad, with no negative or
    conjugate bit (a lazy view that a raw-pointer write would not honour)."""
    if not isinstance(t, torch.Tensor) or t.is_nested or t.layout != torch.strided:
        raise TypeError(f"{name} must be a strided tensor or None, got {type(t).__name__}")
    if tuple(t.shape) != tuple(shape) or t.dtype != dtype:
        raise ValueError(f"{name} must be {dtype} of shape {list(shape)}, got {t.dtype} {list(t.shape)}")
    check_device(name, t.device, device)
    if not t.is_contiguous() or t.requires_grad or t.is_neg() or t.is_conj():
        raise ValueError(f"{name} must be contiguous, not require grad and carry no negative or conjugate bit")
    return t


def _extent(t: torch.Tensor) -> tuple[int, int]:
    """The byte range ``t``'s strides can touch."""
    start = t.data_ptr()
    if t.is_contiguous():
        return start, start + t.nbytes
    return start, start + t.element_size() * (1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride())))


def no_overlap(outputs, inputs) -> None:
    """A ValueError when a result buffer shares memory with another one or with an input.

    ``outputs`` and ``inputs`` are ``(name, tensor or None)`` pairs; empty and nested tensors are
    skipped. Each tensor's byte extent is taken once, then the pairs are compared (this runs on every
    call given ``out=``)."""
    spans = [(n, *_extent(t)) for n, t in outputs if t is not None and t.numel()]
    n_out = len(spans)
    spans += [(n, *_extent(t)) for n, t in inputs if isinstance(t, torch.Tensor) and t.numel() and not t.is_nested]
    for i in range(n_out):
        name, a0, a1 = spans[i]
        for other, b0, b1 in spans[i + 1:]:
            if a0 < b1 and b0 < a1:
                raise ValueError(f"{name} overlaps {other}: the result buffers must share no memory with each other "
                                 "or with the inputs")


def clamp_bounds(name: str, bounds):
    """A KL clamp argument (``clamp_input`` / ``clamp_output`` of either op): ``None`` or a pair
    ``(lo, hi)`` of reals or ``None``s, checked; returns ``None`` or the normalized pair."""
    if bounds is None:
        return None
    if not isinstance(bounds, (tuple, list)) or len(bounds) != 2:
        raise ValueError(f"{name} must be None or a pair (lo, hi) of floats (either may be None), got {bounds!r}")
    out = []
    for b in bounds:
        if b is None:
            out.append(None)
            continue
        if isinstance(b, bool) or not isinstance(b, numbers.Real) or math.isnan(float(b)):
            raise ValueError(f"{name} bounds must be real numbers or None, got {bounds!r}")
        out.append(float(b))
    lo, hi = out
    if lo is None and hi is None:
        return None
    if lo is not None and hi is not None and lo > hi:
        raise ValueError(f"{name} must satisfy lo <= hi, got {bounds!r}")
    # A bound beyond float32's range is +-inf to the float32 kernels, which read an infinite bound as
    # no bound: saturate it for every backend (torch.clamp refuses such a bound on a float32 tensor),
    # and refuse the two that would pin every value to an infinity (a lower bound of +inf, an upper
    # bound of -inf), where "no bound" and "clamp" disagree.
    lo, hi = (None if v is None else v if abs(v) <= FLOAT32_MAX else math.copysign(math.inf, v)
              for v in (lo, hi))
    if lo == math.inf or hi == -math.inf:
        raise ValueError(f"{name} must have a lower bound < +inf and an upper bound > -inf (after rounding to "
                         f"float32's range, |bound| <= {FLOAT32_MAX:.4g}), got {bounds!r}")
    return lo, hi
