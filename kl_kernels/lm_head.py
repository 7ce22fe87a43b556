"""Hidden states and an LM head, shared by the ops that compute logits chunk by chunk instead of whole
(``linear_token_logprobs``, ``linear_full_kl``): the argument rules and the default chunk size.

A chunk of ``C`` tokens has logits ``hidden_c @ weight.T (+ bias)`` (torch's matmul: MKL/oneDNN on the CPU,
cuBLAS on a GPU), ``C x V`` of them, which a row pass consumes before the next chunk is formed: the extra
memory is O(C x V), not O(N x V).
"""

from __future__ import annotations

import numbers

import torch

from .vocab_rows import LOGIT_DTYPES

# Tokens per chunk by default: about 2^24 logits (64 MiB in float32), whatever V.
CHUNK_LOGITS = 1 << 24


def check_lm_head(hidden, weight, bias, *, names=("hidden", "weight", "bias")) -> int:
    """``hidden [*S, H]``, ``weight [V, H]`` and ``bias [V]`` or None of one float dtype and device, or a
    ``TypeError``/``ValueError`` naming the argument; returns ``V``."""
    h_name, w_name, b_name = names
    for name, t in ((h_name, hidden), (w_name, weight)):
        if not isinstance(t, torch.Tensor) or t.is_nested or t.layout != torch.strided:
            raise TypeError(f"{name} must be a dense tensor, got {type(t).__name__}")
        if t.dtype not in LOGIT_DTYPES:
            raise TypeError(f"{name} must be float32, bfloat16, float16 or float64, got {t.dtype}")
    if hidden.dim() < 1:
        raise ValueError(f"{h_name} must be [*S, H], got shape {list(hidden.shape)}")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1] or weight.shape[0] == 0:
        raise ValueError(f"{w_name} must be [V, H] with V >= 1 and H = {h_name}.shape[-1] = {hidden.shape[-1]}, "
                         f"got {list(weight.shape)}")
    if weight.dtype != hidden.dtype or weight.device != hidden.device:
        raise ValueError(f"{w_name} must have {h_name}'s dtype and device ({hidden.dtype}, {hidden.device}), got "
                         f"{weight.dtype}, {weight.device}")
    vocab = weight.shape[0]
    if bias is not None and (not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (vocab,)
                             or bias.dtype != hidden.dtype or bias.device != hidden.device):
        raise ValueError(f"{b_name} must be None or a [{vocab}] tensor of {h_name}'s dtype and device, got "
                         f"{getattr(bias, 'dtype', type(bias).__name__)} {list(getattr(bias, 'shape', []))}")
    return vocab


def chunk_tokens(chunk_size, vocab: int) -> int:
    """Tokens per chunk: ``chunk_size`` (an int >= 1) or, for None, about ``CHUNK_LOGITS`` logits."""
    if chunk_size is None:
        return max(1, CHUNK_LOGITS // vocab)
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, numbers.Integral) or chunk_size < 1:
        raise ValueError(f"chunk_size must be None or an int >= 1 (tokens per chunk), got {chunk_size!r}")
    return int(chunk_size)
