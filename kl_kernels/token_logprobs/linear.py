r"""``linear_token_logprobs``: :func:`token_logprobs` from hidden states and the LM head, a chunk of tokens at
a time, so the logits ``[N, V]`` never exist whole: peak extra memory O(chunk x V), not O(N x V).

Forward, per chunk of ``C`` tokens: ``logits_c = hidden_c @ weight.T (+ bias)`` (torch's matmul: MKL/oneDNN
on the CPU, cuBLAS on a GPU) and the row pass of :mod:`~kl_kernels.token_logprobs` on it (the fused CPU
kernel, or the chunked torch math); only ``lse`` and the entropy per token are kept. Backward walks the
vocabulary (per slice of the head: the logits of all tokens recomputed, the row pass writes their gradient
over them, then ``d weight[v0:v1]`` in one GEMM over all tokens, written once in the parameter's dtype,
and ``d hidden`` accumulated in float32), or on request the tokens (per chunk: the logits recomputed, the
row pass, ``d hidden_c = d logits_c @ weight`` and ``d weight += d logits_c.T @ hidden_c`` into float32
accumulators): :mod:`kl_kernels.lm_head` says why. Both deterministic (a fixed order).

With a reference model (``ref_hidden``, ``ref_weight``): each chunk's reference logits are formed right
after the policy's and go through the same row pass, so one loop over the tokens gives both models'
log-probs (the reference's without gradients: a frozen model), and a KL to the reference needs no second
call over the tokens.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch

from . import linear_fused, reference, sharded
from .row_pass import row_pass
from .api import LinearTokenLogprobsOutput, TokenLogprobsOutput
from .backends import REGISTRY
from ..lm_head import (add_chunk_grads, check_lm_head, check_ref_head, chunk_tokens, head_grad_buffers,
                       head_grads_out, row_pass_backend, schedule, slice_width, vocab_walk_grads)
from .problem import build_problem


class _LinearTokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, counted, temperature, softcap, want_entropy, chunk, backend, walk,
                shard, ref_hidden=None, ref_weight=None, ref_bias=None):
        # (the reference's tensors come detached: its log-probs get no gradient)
        fwd, _ = row_pass(backend)
        if shard:  # a vocabulary shard (process_group): its statistics per token, merged after the loop
            group, start = shard

            def fwd(logits, labels_c, counted_c, temperature, want_entropy, softcap=0.0, _rows=fwd):
                lse_r, ent_r, zy = sharded.shard_forward(_rows, logits, labels_c, counted_c, start, temperature,
                                                         want_entropy, softcap)
                return zy, ent_r, lse_r
        n = labels.numel()
        md = reference.math_dtype(hidden) if backend == "torch" else torch.float32
        lp = torch.empty(n, dtype=md, device=hidden.device)
        ent = torch.empty(n if want_entropy else 0, dtype=md, device=hidden.device)
        lse = torch.empty(n, dtype=md, device=hidden.device)
        ref_lp = torch.empty(n if ref_hidden is not None else 0, dtype=md, device=hidden.device)
        ref_lse = torch.empty(n if ref_hidden is not None and shard else 0, dtype=md, device=hidden.device)
        for c0 in range(0, n, chunk):
            c1 = min(c0 + chunk, n)
            logits = torch.nn.functional.linear(hidden[c0:c1], weight, bias)
            lp_c, ent_c, lse_c = fwd(logits, labels[c0:c1], counted[c0:c1], temperature, want_entropy,
                                     softcap=softcap)
            lp[c0:c1], lse[c0:c1] = lp_c, lse_c
            if want_entropy:
                ent[c0:c1] = ent_c
            if ref_hidden is not None:  # the same chunk of tokens under the reference, while it is at hand
                del logits
                ref_logits = torch.nn.functional.linear(ref_hidden[c0:c1], ref_weight, ref_bias)
                ref_c = fwd(ref_logits, labels[c0:c1], counted[c0:c1], temperature, False, softcap=softcap)
                ref_lp[c0:c1] = ref_c[0]
                if shard:
                    ref_lse[c0:c1] = ref_c[2]
                del ref_logits
        if shard:
            lp, ent, lse = sharded.merge(group, counted, lse, ent, lp, want_entropy)
            if ref_hidden is not None:
                ref_lp = sharded.merge(group, counted, ref_lse, ref_lse[:0], ref_lp, False)[0]
        ctx.shard = shard
        ctx.save_for_backward(hidden, weight, bias, labels, counted, lse, ent)
        ctx.temperature, ctx.want_entropy, ctx.chunk, ctx.backend = temperature, want_entropy, chunk, backend
        ctx.softcap = softcap
        ctx.walk = walk
        ctx.mark_non_differentiable(lse, ref_lp)
        return lp, ent, lse, ref_lp

    @staticmethod
    def backward(ctx, grad_lp, grad_ent, _grad_lse, _grad_ref_lp):
        hidden, weight, bias, labels, counted, lse, ent = ctx.saved_tensors
        _, bwd = row_pass(ctx.backend)
        if ctx.shard:  # the shard's own ids: a label outside it is no entry of it
            labels = labels - ctx.shard[1]
        n = labels.numel()
        grad_ent = grad_ent if ctx.want_entropy else None
        tail = (None,) * 12
        if ctx.walk == "vocab":
            def slice_grad(v0, v1, logits):  # labels outside [v0, v1) are "not here" to the row pass
                return bwd(grad_lp, grad_ent, logits, labels - v0, counted, ctx.temperature, lse,
                           ent if grad_ent is not None else lse[:0], logits, softcap=ctx.softcap)

            width = slice_width(ctx.chunk, n, weight.shape[0], hidden.device)
            return (*vocab_walk_grads(ctx.needs_input_grad, hidden, weight, bias, width, slice_grad), *tail)
        grads = head_grad_buffers(ctx.needs_input_grad, hidden, weight, bias)
        for c0 in range(0, n, ctx.chunk):
            c1 = min(c0 + ctx.chunk, n)
            logits = torch.nn.functional.linear(hidden[c0:c1], weight, bias)
            # the logits' gradient over the logits themselves (no second [C, V] buffer)
            d = bwd(None if grad_lp is None else grad_lp[c0:c1], None if grad_ent is None else grad_ent[c0:c1],
                    logits, labels[c0:c1], counted[c0:c1], ctx.temperature, lse[c0:c1],
                    ent[c0:c1] if grad_ent is not None else ent, logits, softcap=ctx.softcap)
            add_chunk_grads(c0, c1, d, hidden, weight, grads)
        return (*head_grads_out(grads, weight, bias), *tail)


def linear_token_logprobs(hidden, weight, labels, *, bias=None, temperature=1.0, return_entropy=False, mask=None,
                          ignore_index=-100, chunk_size=None, backend="auto", ref_hidden=None, ref_weight=None,
                          ref_bias=None, process_group=None, fused=False, logit_scale=1.0, softcap=None):
    r"""Per-token log-probs (and entropy) of ``softmax((hidden @ weight.T + bias) / T)`` at ``labels``
    (with ``logit_scale`` ``s`` and ``softcap`` ``c``: of ``softmax(c tanh(s (hidden @ weight.T + bias) / c)
    / T)``, TRL's fused LM head's order),
    without materializing the ``[N, V]`` logits: tokens go ``chunk_size`` at a time (default: about
    16M logits a chunk), forward and backward (recomputed), so the extra memory is O(chunk x V).

    Args:
        hidden: ``[*S, H]`` hidden states (float32, bfloat16, float16, float64); gradients flow to it.
        weight: ``[V, H]`` the LM head (``lm_head.weight``), hidden's dtype and device; gradients flow.
        labels: ``[*S]`` token ids in ``[0, V)`` where counted.
        bias: optional ``[V]`` (gradients flow).
        temperature, return_entropy, mask, ignore_index: as :func:`kl_kernels.token_logprobs`.
        logit_scale, softcap: as :func:`kl_kernels.token_logprobs` (default 1.0 and None: the plain
            logits), applied to the policy's logits and the reference's alike; gradients to ``hidden``,
            ``weight`` and ``bias`` through ``d z / d logits`` (``s (1 - tanh^2(s logits / c)) / T``).
            Every row-pass backend and ``fused=True`` take them.
        chunk_size: tokens per forward chunk (an int >= 1); default ``max(1, 2**24 // V)`` on the CPU,
            ``max(1, 2**27 // V)`` on a GPU, rounded down to whole 128s there (1,024 at V = 128k). On a
            GPU's vocabulary walk backward's slices hold as many logits (by default at most ``2**25``:
            :mod:`kl_kernels.lm_head`).
        backend: the row pass's, chosen as :func:`kl_kernels.token_logprobs` chooses for a chunk's
            logits: ``"auto"`` (the fused CPU row kernel for CPU tensors of fp32/bf16/fp16; on a GPU the
            CUDA C++ row kernel where ``_cuda`` is built, else Triton, each after its self-check; else the
            chunked torch math), ``"cpu"``, ``"cuda"``, ``"triton"`` or ``"torch"``.
        ref_hidden, ref_weight, ref_bias: optional, the reference model's hidden states ``[*S, H_ref]``
            (its own width), LM head ``[V, H_ref]`` (the same vocabulary) and bias ``[V]``, hidden's dtype
            and device: its log-probs of the same labels, temperature and mask come out of the same chunk
            loop (each chunk's reference logits right after the policy's), without gradients (a frozen
            reference: its tensors get none, whatever they require).
        process_group: a ``torch.distributed`` group over which the vocabulary is split (tensor
            parallelism): ``weight``/``bias`` (and ``ref_weight``/``ref_bias``) are this rank's rows
            ``[V_r, H]``, a contiguous shard, the shards in rank order (sizes may differ); ``labels``
            global ids. Every rank returns the full log-probs and entropy (three all-reduces of ``[N]``
            vectors after the chunk loop, no ``[N, V]`` gather); ``weight`` gets its shard's gradient and
            ``hidden`` **this rank's share** ``d logits_r @ W_r``, as Megatron's vocab-parallel
            cross-entropy leaves it: all-reduce ``hidden``'s gradient over the group (Megatron's
            ``ColumnParallelLinear`` does). :mod:`kl_kernels.token_logprobs.sharded`.
        fused: ``True`` runs the fused Triton kernels (:mod:`kl_kernels.token_logprobs.linear_fused`):
            the logits tiles are formed on chip from ``hidden`` and ``weight`` tiles and folded into
            per-token online sums, so no chunk of logits reaches memory in forward; backward walks the
            vocabulary (a recomputed ``d logits`` slice, cuBLAS GEMMs writing ``d weight`` once). CUDA
            tensors of float32/bfloat16/float16, no ``process_group``; otherwise a ``ValueError`` with the
            reason. ``chunk_size`` and ``backend`` (the row pass's) do not apply to it. Default ``False``:
            it has not yet been timed on a GPU against the default route (the next GPU run's
            ``python -m kl_kernels.bench.linear_fused_ab`` decides).

    Returns:
        :class:`~kl_kernels.token_logprobs.TokenLogprobsOutput` ``(log_probs, entropy)``, ``[*S]``,
        float32 (float64 with the torch backend on float64 inputs), 0 at non-counted tokens; with a
        reference, :class:`~kl_kernels.token_logprobs.LinearTokenLogprobsOutput` ``(log_probs, entropy,
        ref_log_probs)``, the reference's as a separate call would give them, bit for bit.

    Example::

        >>> import torch
        >>> from kl_kernels import linear_token_logprobs
        >>> h, w = torch.randn(4, 8, requires_grad=True), torch.randn(10, 8, requires_grad=True)
        >>> out = linear_token_logprobs(h, w, torch.tensor([1, 2, 3, -100]), chunk_size=2)
        >>> out.log_probs.shape, bool(out.log_probs[3] == 0)
        (torch.Size([4]), True)
        >>> out.log_probs.sum().backward()
        >>> h.grad.shape, w.grad.shape
        (torch.Size([4, 8]), torch.Size([10, 8]))
        >>> both = linear_token_logprobs(h, w, torch.tensor([1, 2, 3, -100]), ref_hidden=h.detach(),
        ...                              ref_weight=w.detach() * 0.9)  # a KL to the reference: k1 here
        >>> (both.log_probs - both.ref_log_probs).shape, both.ref_log_probs.requires_grad
        (torch.Size([4]), False)
    """
    r = prepare(hidden, weight, labels, bias=bias, temperature=temperature, return_entropy=return_entropy, mask=mask,
                ignore_index=ignore_index, chunk_size=chunk_size, backend=backend, ref_hidden=ref_hidden,
                ref_weight=ref_weight, ref_bias=ref_bias, caller="linear_token_logprobs", process_group=process_group,
                logit_scale=logit_scale, softcap=softcap)
    if fused not in (True, False):
        raise TypeError(f"fused must be True or False, got {fused!r}")
    if fused:
        why = "process_group is not supported" if r.shard else linear_fused.fused_reason(r.hidden, r.weight, r.bias,
                                                                                          *r.ref)
        if why is not None:
            raise ValueError(f"linear_token_logprobs(fused=True) cannot run: {why}")
        lp, ent, _, ref_lp = linear_fused.FusedLinearTokenLogprobs.apply(
            r.hidden, r.weight, r.bias, r.labels, r.counted, r.temperature, return_entropy,
            *(r.ref or (None, None, None)), r.softcap)
    else:
        lp, ent, _, ref_lp = _LinearTokenLogprobs.apply(r.hidden, r.weight, r.bias, r.labels, r.counted,
                                                        r.temperature, r.softcap, return_entropy, r.chunk, r.backend,
                                                        r.walk, r.shard, *r.ref)
    ent = ent.reshape(r.shape) if return_entropy else None
    if r.ref:
        return LinearTokenLogprobsOutput(lp.reshape(r.shape), ent, ref_lp.reshape(r.shape))
    return TokenLogprobsOutput(lp.reshape(r.shape), ent)


class LinearRows(NamedTuple):
    """A chunk loop's checked inputs: ``hidden [N, H]`` (flattened), the head, ``labels``/``counted`` ``[N]``,
    the temperature and soft-cap in kernel units (``kl_kernels.vocab_rows.logit_transform``: the logit scale
    folded into both; soft-cap 0.0: none), tokens per chunk, the row pass's backend name, the reference ``(ref_hidden [N, H_ref],
    ref_weight, ref_bias)`` detached (or ``()``), the token shape ``S``, backward's walk (``"tokens"`` or
    ``"vocab"``, :func:`kl_kernels.lm_head.schedule`) and the vocabulary shard ``(process_group, start)``
    (or ``()``: the whole vocabulary here)."""

    hidden: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None
    labels: torch.Tensor
    counted: torch.Tensor
    temperature: float
    chunk: int
    backend: str
    ref: tuple
    shape: torch.Size
    walk: str = "tokens"
    shard: tuple = ()
    softcap: float = 0.0


def prepare(hidden, weight, labels, *, bias, temperature, return_entropy, mask, ignore_index, chunk_size, backend,
            ref_hidden, ref_weight, ref_bias, caller: str, process_group=None,
            group_name="process_group", logit_scale=1.0, softcap=None) -> LinearRows:
    """Every check of :func:`linear_token_logprobs`' arguments, and the row pass's backend."""
    local_vocab = check_lm_head(hidden, weight, bias)
    with_ref = check_ref_head(hidden, local_vocab, ref_hidden, ref_weight, ref_bias, required=False)
    chunk_size = chunk_tokens(chunk_size, local_vocab, hidden.device)
    sharded.check_group(process_group, hidden.device, group_name)
    shard, vocab = (), local_vocab
    if process_group is not None:  # labels are checked against the whole vocabulary
        start, vocab = sharded.vocab_range(process_group, local_vocab, hidden.device)
        shard = (process_group, start)
    # labels, mask, temperature, ignore_index: token_logprobs' own checks, on a zero-stride stand-in for
    # the logits (no [N, V] memory)
    p = build_problem(hidden.new_zeros(()).expand(*hidden.shape[:-1], vocab), labels, temperature=temperature,
                      return_entropy=return_entropy, mask=mask, ignore_index=ignore_index, inplace_backward=False,
                      logit_scale=logit_scale, softcap=softcap)
    # The backend: token_logprobs' own dispatch, asked about what the row pass will get, a chunk's fresh
    # contiguous logits [C, V] (one row stands in)
    chunk_rows = dataclasses.replace(p, logits=hidden.new_empty((1, local_vocab)), labels=p.labels[:0],
                                     counted=p.counted[:0])
    name = row_pass_backend(REGISTRY, backend, "token_logprobs", chunk_rows, caller)
    ref = (ref_hidden.detach().reshape(-1, ref_hidden.shape[-1]), ref_weight.detach(),
           None if ref_bias is None else ref_bias.detach()) if with_ref else ()
    return LinearRows(hidden.reshape(-1, hidden.shape[-1]), weight, bias, p.labels.reshape(-1), p.counted.reshape(-1),
                      p.temperature, int(chunk_size), name, ref, p.labels.shape, schedule(hidden.device), shard,
                      p.softcap)


def linear_loss_one_pass(rows: LinearRows, want_entropy: bool, chunk_loss):
    """A scalar loss of the per-token log-probs (and entropy) of ``rows`` whose gradient to them is known
    chunk by chunk, in **one** pass over the tokens (Liger-Kernel's scheme): per chunk, the logits are
    formed once (and the reference's, before them), the row pass gives the log-probs, ``chunk_loss(c0, c1,
    log_probs_c, entropy_c, ref_log_probs_c, extras)`` the chunk's share of the loss (a 0-d tensor
    differentiable in ``log_probs_c`` and ``entropy_c``, leaves handed to it; ``entropy_c`` is None without
    ``want_entropy``, ``ref_log_probs_c`` without a reference; ``extras`` a list it may append its
    diagnostics to), its gradient goes into the logits in place
    and from there into ``d hidden``, ``d weight`` and ``d bias`` right away. Three matmuls of the policy's
    head per chunk (forward, ``d hidden``, ``d weight``) where the two-pass route takes four (the logits
    again in backward); the gradients wait in memory (``d hidden`` ``[N, H]``, the head's in float32) for
    backward, which scales them by the incoming gradient.

    Returns ``(loss, extras)``: the loss (the chunks' shares summed in float64, cast to float32, with
    autograd to ``hidden``, ``weight`` and ``bias``) and what the ``chunk_loss`` calls appended to
    ``extras``."""
    extras = []
    loss = _OnePass.apply(rows.hidden, rows.weight, rows.bias, rows, want_entropy, chunk_loss, extras)
    return loss, extras


class _OnePass(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, rows, want_entropy, chunk_loss, extras):
        fwd, bwd = row_pass(rows.backend)
        needs = ctx.needs_input_grad[:3]
        grads = head_grad_buffers(needs, hidden, weight, bias)
        differentiate = any(needs)
        n, total = rows.labels.numel(), torch.zeros((), dtype=torch.float64, device=hidden.device)
        no_entropy = torch.empty(0, dtype=torch.float32, device=hidden.device)
        for c0 in range(0, n, rows.chunk):
            c1 = min(c0 + rows.chunk, n)
            labels, counted = rows.labels[c0:c1], rows.counted[c0:c1]
            ref_lp = None
            if rows.ref:
                ref_hidden, ref_weight, ref_bias = rows.ref
                ref_logits = torch.nn.functional.linear(ref_hidden[c0:c1], ref_weight, ref_bias)
                ref_lp = fwd(ref_logits, labels, counted, rows.temperature, False, softcap=rows.softcap)[0]
                del ref_logits
            logits = torch.nn.functional.linear(hidden[c0:c1], weight, bias)
            lp, ent, lse = fwd(logits, labels, counted, rows.temperature, want_entropy, softcap=rows.softcap)
            leaves = [lp.detach().requires_grad_(differentiate)]
            if want_entropy:
                leaves.append(ent.detach().requires_grad_(differentiate))
            with torch.enable_grad():
                share = chunk_loss(c0, c1, leaves[0], leaves[1] if want_entropy else None, ref_lp, extras)
                if differentiate and share.requires_grad:
                    g = torch.autograd.grad(share, leaves, allow_unused=True)
                else:
                    g = (None, None)
            total += share.detach().to(torch.float64)
            if differentiate and any(x is not None for x in g):
                g_lp, g_ent = g[0], (g[1] if want_entropy else None)
                d = bwd(g_lp, g_ent, logits, labels, counted, rows.temperature, lse,
                        ent if g_ent is not None else no_entropy, logits, softcap=rows.softcap)
                add_chunk_grads(c0, c1, d, hidden, weight, grads)
            elif differentiate:  # this chunk's loss does not depend on its tokens (all masked out)
                if grads[0] is not None:
                    grads[0][c0:c1] = 0
            del logits
        ctx.grads = head_grads_out(grads, weight, bias)
        return total.to(torch.float32)

    @staticmethod
    def backward(ctx, grad):
        out = tuple(None if g is None else g * grad.to(g.dtype) for g in ctx.grads)
        ctx.grads = None
        return (*out, None, None, None, None)
