r"""``linear_full_kl``: :func:`full_kl` from both models' hidden states and LM heads, a chunk of tokens at a
time, so neither model's logits ``[N, V]`` exist whole: peak extra memory O(chunk x V), not O(N x V).

Forward, per chunk of ``C`` tokens: ``logits_c = hidden_c @ weight.T (+ bias)`` and ``ref_c = ref_hidden_c @
ref_weight.T (+ ref_bias)`` (torch's matmul), then the row pass of :mod:`~kl_kernels.full_kl` on both; only
``KL``, ``lse`` and the reference's ``lse`` per token are kept. Backward walks the vocabulary (per slice of
both heads: the slice's logits of all tokens recomputed, the row pass, ``d weight[v0:v1]`` in one GEMM
written once, ``d hidden`` accumulated in float32: :mod:`kl_kernels.lm_head`), unless the reference wants
gradients too (or ``KL_KERNELS_HEAD_SCHEDULE=tokens``); then it walks the tokens, per chunk: both logits
recomputed,
the policy's gradient written over the policy's logits in place by the row pass (the reference's over its
own, when it wants one), then ``d hidden_c = d logits_c @ weight``, ``d weight += d logits_c.T @ hidden_c``
(float32 accumulators, chunks in a fixed order: deterministic), ``d bias += d logits_c.sum(0)``; the same
for the reference's tensors that require a gradient (usually none: a frozen reference).
"""

from __future__ import annotations

import dataclasses

import torch

from .. import vocab_rows
from ..lm_head import (add_chunk_grads, check_lm_head, check_ref_head, chunk_tokens, head_grad_buffers,
                       head_grads_out, row_pass_backend, schedule, slice_width, vocab_walk_grads)
from . import launch, launch_triton, reference
from .backends import REGISTRY
from .problem import build_problem


def _rows(backend: str):
    """(forward, backward) of the row pass for a chunk's logits [C, V]."""
    return vocab_rows.row_pass(backend, launch, launch_triton, reference)


class _LinearFullKL(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, ref_hidden, ref_weight, ref_bias, counted, temperature, softcap, chunk,
                backend, walk):
        fwd, _ = _rows(backend)
        n = counted.numel()
        md = reference.math_dtype(hidden) if backend == "torch" else torch.float32
        kl, lse, ref_lse = (torch.empty(n, dtype=md, device=hidden.device) for _ in range(3))
        for c0 in range(0, n, chunk):
            c1 = min(c0 + chunk, n)
            logits = torch.nn.functional.linear(hidden[c0:c1], weight, bias)
            ref = torch.nn.functional.linear(ref_hidden[c0:c1], ref_weight, ref_bias)
            kl[c0:c1], lse[c0:c1], ref_lse[c0:c1] = fwd(logits, ref, counted[c0:c1], temperature, softcap=softcap)
        ctx.save_for_backward(hidden, weight, bias, ref_hidden, ref_weight, ref_bias, counted, kl, lse, ref_lse)
        ctx.temperature, ctx.chunk, ctx.backend, ctx.walk = temperature, chunk, backend, walk
        ctx.softcap = softcap
        return kl

    @staticmethod
    def backward(ctx, grad_kl):
        hidden, weight, bias, ref_hidden, ref_weight, ref_bias, counted, kl, lse, ref_lse = ctx.saved_tensors
        _, bwd = _rows(ctx.backend)
        n = counted.numel()
        tail = (None,) * 6
        if ctx.walk == "vocab" and not any(ctx.needs_input_grad[3:6]):
            def slice_grad(v0, v1, logits):
                ref = torch.nn.functional.linear(ref_hidden, ref_weight[v0:v1],
                                                 None if ref_bias is None else ref_bias[v0:v1])
                bwd(grad_kl, logits, ref, counted, ctx.temperature, kl, lse, ref_lse, logits, None, softcap=ctx.softcap)
                return logits

            width = slice_width(ctx.chunk, n, weight.shape[0], hidden.device)
            grads = vocab_walk_grads(ctx.needs_input_grad[0:3], hidden, weight, bias, width, slice_grad)
            return (*grads, None, None, None, *tail)
        policy = head_grad_buffers(ctx.needs_input_grad[0:3], hidden, weight, bias)
        ref_side = head_grad_buffers(ctx.needs_input_grad[3:6], ref_hidden, ref_weight, ref_bias)
        want_policy, want_ref = any(g is not None for g in policy), any(g is not None for g in ref_side)
        for c0 in range(0, n, ctx.chunk):
            c1 = min(c0 + ctx.chunk, n)
            logits = torch.nn.functional.linear(hidden[c0:c1], weight, bias)
            ref = torch.nn.functional.linear(ref_hidden[c0:c1], ref_weight, ref_bias)
            # the gradients over the logits themselves (no second [C, V] buffer): the row pass reads each
            # entry of both before it writes that entry
            bwd(grad_kl[c0:c1], logits, ref, counted[c0:c1], ctx.temperature, kl[c0:c1], lse[c0:c1],
                ref_lse[c0:c1], logits if want_policy else None, ref if want_ref else None, softcap=ctx.softcap)
            if want_policy:
                add_chunk_grads(c0, c1, logits, hidden, weight, policy)
            if want_ref:
                add_chunk_grads(c0, c1, ref, ref_hidden, ref_weight, ref_side)
        return (*head_grads_out(policy, weight, bias), *head_grads_out(ref_side, ref_weight, ref_bias), *tail)


def linear_full_kl(hidden, weight, ref_hidden, ref_weight, *, bias=None, ref_bias=None, temperature=1.0,
                   mask=None, chunk_size=None, backend="auto", logit_scale=1.0, softcap=None) -> torch.Tensor:
    r"""Per token, the exact ``KL(pi || pi_ref)`` over the vocabulary (:func:`kl_kernels.full_kl`) of
    ``pi = softmax((hidden @ weight.T + bias) / T)`` and ``pi_ref = softmax((ref_hidden @ ref_weight.T +
    ref_bias) / T)``, both models evaluated in one pass over the tokens without materializing either's
    ``[N, V]`` logits: tokens go ``chunk_size`` at a time (default: about 16M logits a chunk), forward and
    backward (recomputed), so the extra memory is O(chunk x V).

    Args:
        hidden: ``[*S, H]`` the policy's final hidden states; gradients flow to it.
        weight: ``[V, H]`` the policy's LM head, hidden's dtype and device; gradients flow.
        ref_hidden: ``[*S, H_ref]`` the reference model's hidden states (its own width).
        ref_weight: ``[V, H_ref]`` the reference's LM head, ref_hidden's dtype and device, hidden's dtype and
            device too; the same vocabulary ``V``. The reference's tensors get gradients only when they
            require them.
        bias, ref_bias: optional ``[V]`` biases.
        temperature, mask, logit_scale, softcap: as :func:`kl_kernels.full_kl` (both models' logits become
            ``c tanh(s logits / c) / T``; default 1.0 and None: ``logits / T``).
        chunk_size: tokens per forward chunk (an int >= 1); default ``max(1, 2**24 // V)`` on the CPU,
            ``max(1, 2**27 // V)`` on a GPU. On a GPU's vocabulary walk backward's slices hold as many
            logits (by default at most ``2**25``: :mod:`kl_kernels.lm_head`).
        backend: the row pass's, chosen as :func:`kl_kernels.full_kl` chooses for a chunk's logits.

    Returns:
        ``[*S]`` float32 (float64 with the torch backend on float64 inputs), 0 where ``mask`` is False.

    Example::

        >>> import torch
        >>> from kl_kernels import linear_full_kl
        >>> h, w = torch.randn(4, 8, requires_grad=True), torch.randn(10, 8, requires_grad=True)
        >>> kl = linear_full_kl(h, w, h.detach(), w.detach(), chunk_size=3)  # the reference is the policy
        >>> bool(kl.abs().max() < 1e-5)
        True
        >>> kl.sum().backward()
        >>> h.grad.shape, w.grad.shape
        (torch.Size([4, 8]), torch.Size([10, 8]))
    """
    vocab = check_lm_head(hidden, weight, bias)
    check_ref_head(hidden, vocab, ref_hidden, ref_weight, ref_bias, required=True)
    chunk = chunk_tokens(chunk_size, vocab, hidden.device)
    # mask and temperature: full_kl's own checks, on zero-stride stand-ins for the logits (no [N, V] memory)
    stand_in = hidden.new_zeros(()).expand(*hidden.shape[:-1], vocab)
    p = build_problem(stand_in, stand_in, temperature=temperature, mask=mask, logit_scale=logit_scale, softcap=softcap)
    # the backend: full_kl's own dispatch, asked about what the row pass will get, a chunk's fresh
    # contiguous logits [C, V] (one row stands in)
    row = hidden.new_empty((1, vocab))
    chunk_rows = dataclasses.replace(p, logits=row, ref_logits=row, counted=p.counted.reshape(-1)[:0])
    name = row_pass_backend(REGISTRY, backend, "full_kl", chunk_rows, "linear_full_kl")
    kl = _LinearFullKL.apply(hidden.reshape(-1, hidden.shape[-1]), weight, bias,
                             ref_hidden.reshape(-1, ref_hidden.shape[-1]), ref_weight, ref_bias,
                             p.counted.reshape(-1), p.temperature, p.softcap, chunk, name, schedule(hidden.device))
    return kl.reshape(p.counted.shape)
