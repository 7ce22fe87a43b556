"""Validate ``token_logprobs``' arguments into one :class:`TokenLogprobsProblem`.

Every check happens here, before any backend runs; bad input raises ``TypeError``/``ValueError``
naming the argument and what was expected. Inputs are never modified (``inplace_backward``
overwrites the logits during the backward pass, on request, see the API).
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

import torch

from .. import device_errors, value_checks
from ..vocab_rows import LOGIT_DTYPES, RowsProblem, check_logits, logit_transform

__all__ = ["LOGIT_DTYPES", "TokenLogprobsProblem", "build_problem"]


@dataclass
class TokenLogprobsProblem(RowsProblem):
    """``logits [*S, V]``, ``labels [*S]`` (int64), ``counted [*S]`` (bool: mask and not
    ``ignore_index``), and the logit transform in kernel units (``kl_kernels.vocab_rows.logit_transform``):
    ``temperature`` the user's over ``logit_scale`` (> 0), ``softcap`` the user's over ``logit_scale``
    (0.0: no soft-capping)."""

    logits: torch.Tensor
    labels: torch.Tensor
    counted: torch.Tensor
    temperature: float
    return_entropy: bool
    inplace_backward: bool
    softcap: float = 0.0


def build_problem(logits, labels, *, temperature, return_entropy, mask, ignore_index,
                  inplace_backward, logit_scale=1.0, softcap=None) -> TokenLogprobsProblem:
    check_logits("logits", logits)
    if not isinstance(labels, torch.Tensor) or labels.is_nested or labels.layout != torch.strided:
        raise TypeError(f"labels must be a dense integer tensor [*S], got {type(labels).__name__}")
    if labels.dtype.is_floating_point or labels.dtype.is_complex or labels.dtype == torch.bool:
        raise TypeError(f"labels must be an integer tensor (token ids), got {labels.dtype}")
    if tuple(labels.shape) != tuple(logits.shape[:-1]):
        raise ValueError(f"labels must have the logits' shape without the vocabulary, {list(logits.shape[:-1])}, "
                         f"got {list(labels.shape)}")
    if labels.device != logits.device:
        raise ValueError(f"labels must be on the logits' device {logits.device}, got {labels.device}")
    if mask is not None:
        if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
            raise TypeError(f"mask must be a bool tensor [*S], got {getattr(mask, 'dtype', type(mask).__name__)}")
        if tuple(mask.shape) != tuple(labels.shape):
            raise ValueError(f"mask must have the labels' shape {list(labels.shape)}, got {list(mask.shape)}")
        if mask.device != logits.device:
            raise ValueError(f"mask must be on the logits' device {logits.device}, got {mask.device}")
    temperature, softcap = logit_transform(temperature, logit_scale, softcap)
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, numbers.Integral):
        raise TypeError(f"ignore_index must be an int, got {type(ignore_index).__name__}")
    for name, value in (("return_entropy", return_entropy), ("inplace_backward", inplace_backward)):
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    if inplace_backward and torch.compiler.is_compiling():
        raise ValueError("inplace_backward=True is for eager calls (it overwrites the logits in the backward pass); "
                         "under torch.compile call without it")

    if inplace_backward and logits.dim() > 3:
        try:
            logits.view(-1, logits.shape[-1])
        except RuntimeError:
            raise ValueError("inplace_backward=True needs logits whose rows form an [N, V] view (or [B, T, V] "
                             f"slabs); got shape {list(logits.shape)} with strides {list(logits.stride())}") from None

    labels = labels.to(torch.int64)
    counted = labels != int(ignore_index)
    if mask is not None:
        counted = counted & mask
    vocab = logits.shape[-1]
    bad = counted & ((labels < 0) | (labels >= vocab))
    if not value_checks.values_checkable(labels):  # traced by torch.compile (no host read there), or meta
        pass
    elif value_checks.checks_on_host(labels):
        if labels.numel() and bool(bad.any()):
            first = labels[bad].reshape(-1)[0].item()
            raise ValueError(device_errors.value_error_message("label_range", "labels", first, vocab,
                                                               int(ignore_index)))
    else:
        # no assert: recorded in the device's error word, raised at the next call or check_errors(); the
        # kernels give NaN for such a row and never read outside it
        device_errors.raise_pending(labels.device)
        device_errors.record_where(bad, labels, "label_range", "labels", vocab, int(ignore_index))
    return TokenLogprobsProblem(logits=logits, labels=labels, counted=counted, temperature=temperature,
                                return_entropy=return_entropy, inplace_backward=inplace_backward, softcap=softcap)
