"""Hidden states and an LM head, shared by the ops that compute logits chunk by chunk instead of whole
(``linear_token_logprobs``, ``linear_full_kl``, ``linear_kl_penalty_loss``): the argument rules (the
policy's head, the reference's next to it) and the default chunk size.

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


def check_ref_head(hidden, vocab: int, ref_hidden, ref_weight, ref_bias, *, required: bool) -> bool:
    """The reference model's ``ref_hidden [*S, H_ref]``, ``ref_weight [V, H_ref]`` and optional ``ref_bias
    [V]`` next to the policy's ``hidden`` (vocabulary ``vocab``): they come together (``ref_bias`` only with
    them), with hidden's token shape, dtype and device and the same vocabulary (their own width ``H_ref``).
    Returns whether a reference is given (``required``: it must be), or raises a ``TypeError``/``ValueError``
    naming the argument."""
    if (ref_hidden is None) != (ref_weight is None):
        raise ValueError("ref_hidden and ref_weight come together (the reference's hidden states and LM head), got "
                         + ("ref_hidden only" if ref_weight is None else "ref_weight only"))
    if ref_hidden is None:
        if required:
            raise TypeError("ref_hidden and ref_weight are required (the reference's hidden states and LM head)")
        if ref_bias is not None:
            raise ValueError("ref_bias needs ref_hidden and ref_weight")
        return False
    ref_vocab = check_lm_head(ref_hidden, ref_weight, ref_bias, names=("ref_hidden", "ref_weight", "ref_bias"))
    if ref_vocab != vocab:
        raise ValueError(f"ref_weight must cover weight's vocabulary V = {vocab}, got {ref_vocab} rows")
    if tuple(ref_hidden.shape[:-1]) != tuple(hidden.shape[:-1]):
        raise ValueError(f"ref_hidden must have hidden's token shape {list(hidden.shape[:-1])} (its own width), got "
                         f"{list(ref_hidden.shape)}")
    if ref_hidden.dtype != hidden.dtype or ref_hidden.device != hidden.device:
        raise ValueError(f"ref_hidden must have hidden's dtype and device ({hidden.dtype}, {hidden.device}), got "
                         f"{ref_hidden.dtype}, {ref_hidden.device}")
    return True


def chunk_tokens(chunk_size, vocab: int) -> int:
    """Tokens per chunk: ``chunk_size`` (an int >= 1) or, for None, about ``CHUNK_LOGITS`` logits."""
    if chunk_size is None:
        return max(1, CHUNK_LOGITS // vocab)
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, numbers.Integral) or chunk_size < 1:
        raise ValueError(f"chunk_size must be None or an int >= 1 (tokens per chunk), got {chunk_size!r}")
    return int(chunk_size)


def head_grad_buffers(needs, hidden, weight, bias) -> tuple:
    """``(d hidden, d weight, d bias)`` buffers for the flags ``needs`` (three bools): ``d hidden`` in
    hidden's dtype, the head's in float32 accumulators (chunks add into them in a fixed order); None where
    no gradient is wanted."""
    return (torch.empty_like(hidden) if needs[0] else None,
            torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if needs[1] else None,
            torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if bias is not None and needs[2]
            else None)


def add_chunk_grads(c0, c1, d_logits, hidden, weight, buffers) -> None:
    """A chunk's share of the gradients from its logits' gradient ``d_logits [C, V]``: ``d hidden_c =
    d_logits @ weight``, ``d weight += d_logits.T @ hidden_c``, ``d bias += sum_c d_logits``."""
    g_hidden, g_weight, g_bias = buffers
    if g_hidden is not None:
        g_hidden[c0:c1] = d_logits @ weight
    if g_weight is not None:
        g_weight += (d_logits.t() @ hidden[c0:c1]).float()
    if g_bias is not None:
        g_bias += d_logits.float().sum(0)


def head_grads_out(buffers, weight, bias) -> tuple:
    """The buffers as autograd returns them: the head's accumulators cast to their parameters' dtypes."""
    g_hidden, g_weight, g_bias = buffers
    return (g_hidden, None if g_weight is None else g_weight.to(weight.dtype),
            None if g_bias is None else g_bias.to(bias.dtype))


def row_pass_backend(registry, backend: str, op: str, chunk_problem, caller: str) -> str:
    """The name of the backend that runs a chunk's row pass: ``op``'s own dispatch asked about
    ``chunk_problem`` (a chunk's fresh contiguous logits, one row standing in); a refusal names ``caller``."""
    from . import backends as _dispatch

    try:
        return _dispatch.select(registry, backend, op=op, problem=chunk_problem).name
    except _dispatch.BackendUnavailableError as exc:
        raise _dispatch.BackendUnavailableError(f"{caller} (its row pass): {exc}") from None
