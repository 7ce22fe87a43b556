"""Validate ``full_kl``'s arguments into one :class:`FullKLProblem`.

Every check happens here, before any backend runs; bad input raises ``TypeError``/``ValueError``
naming the argument and what was expected. Inputs are never modified.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..vocab_rows import RowsProblem, check_logits, logit_transform


@dataclass
class FullKLProblem(RowsProblem):
    """``logits [*S, V]`` and ``ref_logits [*S, V]`` (same dtype and device), ``counted [*S]`` (bool), and
    the logit transform of both in kernel units (``kl_kernels.vocab_rows.logit_transform``): ``temperature``
    the user's over ``logit_scale``, ``softcap`` the user's over ``logit_scale`` (0.0: none)."""

    logits: torch.Tensor
    ref_logits: torch.Tensor
    counted: torch.Tensor
    temperature: float
    softcap: float = 0.0


def build_problem(logits, ref_logits, *, temperature, mask, logit_scale=1.0, softcap=None) -> FullKLProblem:
    check_logits("logits", logits)
    check_logits("ref_logits", ref_logits)
    if tuple(ref_logits.shape) != tuple(logits.shape):
        raise ValueError(f"ref_logits must have the logits' shape {list(logits.shape)}, got {list(ref_logits.shape)}")
    if ref_logits.dtype != logits.dtype:
        raise TypeError(f"ref_logits must have the logits' dtype {logits.dtype}, got {ref_logits.dtype} (cast one: "
                        "ref_logits.to(logits.dtype))")
    if ref_logits.device != logits.device:
        raise ValueError(f"ref_logits must be on the logits' device {logits.device}, got {ref_logits.device}")
    shape = tuple(logits.shape[:-1])
    if mask is not None:
        if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
            raise TypeError(f"mask must be a bool tensor {list(shape)}, got {getattr(mask, 'dtype', type(mask).__name__)}")
        if tuple(mask.shape) != shape:
            raise ValueError(f"mask must have the logits' shape without the vocabulary, {list(shape)}, got "
                             f"{list(mask.shape)}")
        if mask.device != logits.device:
            raise ValueError(f"mask must be on the logits' device {logits.device}, got {mask.device}")
    temperature, softcap = logit_transform(temperature, logit_scale, softcap)
    counted = mask if mask is not None else torch.ones(shape, dtype=torch.bool, device=logits.device)
    return FullKLProblem(logits=logits, ref_logits=ref_logits, counted=counted, temperature=temperature,
                         softcap=softcap)
