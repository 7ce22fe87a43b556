"""The public ``token_logprobs`` function: validate, dispatch."""

from __future__ import annotations

from typing import NamedTuple

import torch

from .. import backends as _dispatch
from .backends import REGISTRY
from .problem import build_problem


class TokenLogprobsOutput(NamedTuple):
    """Result of :func:`kl_kernels.token_logprobs`: ``log_probs [*S]`` and ``entropy [*S]`` (None
    unless ``return_entropy``), float32 (float64 for float64 logits), 0 at non-counted tokens."""

    log_probs: torch.Tensor
    entropy: torch.Tensor | None


class LinearTokenLogprobsOutput(NamedTuple):
    """Result of :func:`kl_kernels.linear_token_logprobs` given a reference model: the policy's
    ``log_probs`` and ``entropy`` as in :class:`TokenLogprobsOutput`, and the reference's
    ``ref_log_probs [*S]`` (same dtype, 0 at non-counted tokens, no gradient)."""

    log_probs: torch.Tensor
    entropy: torch.Tensor | None
    ref_log_probs: torch.Tensor


def token_logprobs(logits, labels, *, temperature=1.0, return_entropy=False, mask=None, ignore_index=-100,
                   inplace_backward=False, backend="auto", process_group=None, logit_scale=1.0,
                   softcap=None) -> TokenLogprobsOutput:
    r"""Per-token ``log softmax(logits / T)[label]`` (and the entropy of ``softmax(logits / T)``),
    without an ``[N, V]`` float32 copy of the logits, forward or backward.

    Per counted token (``labels != ignore_index`` and ``mask``), with ``z = logits / T`` (with
    ``logit_scale`` ``s`` and ``softcap`` ``c``: ``z = c tanh(s logits / c) / T``, or ``s logits / T``
    without a cap: TRL's fused LM head and Gemma's ``final_logit_softcapping``, in that order)::

        log_probs = z[label] - logsumexp(z)
        entropy   = sum_j p_j (logsumexp(z) - z_j),   p = softmax(z)

    Gradients flow to ``logits``: ``(onehot(label) - p) / T`` times the log-probs' gradient, plus
    ``p_j (logsumexp(z) - z_j - entropy) / T`` times the entropy's. Rows are processed a chunk at a
    time (about 1M logits), so the extra memory is a few float32 chunks, not ``[N, V]``: this is what
    ``log_softmax(logits.float()).gather(...)`` costs (one or two ``[N, V]`` float32 tensors, and its
    backward saves one), which is what limits RL batch sizes at V = 32k-152k.

    Args:
        logits: ``[*S, V]`` (e.g. packed ``[N, V]`` or padded ``[B, T, V]``; a slice such as
            ``logits[:, :-1]`` is read in place), float32, bfloat16, float16 or float64.
        labels: ``[*S]`` integer token ids, in ``[0, V)`` where counted (checked: a ``ValueError``
            on the CPU; on a GPU a device-side assertion, no host sync; ``KL_KERNELS_SYNC_CHECKS=1``
            makes it a ``ValueError`` there too).
        temperature: ``T > 0`` (default 1.0): the sampling temperature the logits are divided by.
        logit_scale: ``s``, finite ``> 0`` (default 1.0): the logits' multiplier before soft-capping and
            temperature (a model config's ``logit_scale``, ``1 / logits_scaling``, ...). Folded into the
            temperature (and the cap) on the host: every backend computes it.
        softcap: ``c``, ``None`` (default: no soft-capping) or finite ``> 0``: the logits become
            ``c tanh(s logits / c)`` before the temperature (Gemma's ``final_logit_softcapping``); the
            gradient gets the factor ``1 - tanh^2(s logits / c)``. Every rule below applies to the capped
            logits ``z`` (a capped ``+-inf`` logit is ``+-c / T``: finite). Every backend implements it (a
            compile-time specialization of the kernels: the default path is unchanged).
        return_entropy: also return the per-token entropy (differentiable).
        mask: optional bool ``[*S]``: which tokens count (e.g. assistant tokens); the others give 0.
        ignore_index: labels equal to it do not count (default -100, as ``cross_entropy``).
        inplace_backward: write the logits' gradient into the logits' own storage during
            backward, saving the ``[*S, V]`` gradient allocation. **Hazards**: the logits are
            overwritten (any later use of them reads gradients; autograd raises if another node
            saved them); if ``logits`` is a leaf its ``.grad`` aliases it; eager calls only.
        backend: ``"auto"`` (default; ``KL_KERNELS_BACKEND`` overrides): the fused ``"cpu"`` kernel
            for CPU tensors; on a GPU the fused ``"cuda"`` kernel, else ``"triton"``, each once it has
            passed its first-use self-check there; else ``"torch"`` (the chunked math).
            ``"cuda-emulated"`` runs the CUDA kernel on CPU tensors (tests).
        process_group: a ``torch.distributed`` group over which the vocabulary is split (tensor
            parallelism): ``logits`` are this rank's ``[*S, V_r]`` columns, a contiguous shard, the shards
            in rank order (sizes may differ); ``labels`` global ids. The ranks' statistics are merged with
            all-reduces of ``[N]`` vectors (no ``[N, V]`` gather) and every rank returns the full
            log-probs and entropy; each rank's logits get their own shard's gradient
            (:mod:`kl_kernels.token_logprobs.sharded`). Every rank makes the same call. Eager calls;
            not with ``inplace_backward``.

    Returns:
        :class:`TokenLogprobsOutput` ``(log_probs, entropy)``: ``[*S]`` float32 (float64 for
        float64 logits); 0 at non-counted tokens; NaN for a counted row whose logits hold NaN or
        ``+inf`` or are all ``-inf`` (``-inf`` entries otherwise are a masked vocabulary: fine).
        Gradients to ``logits``: the ones below times ``d z / d logits``, ``s / T`` (with a cap
        ``s (1 - tanh^2(s logits / c)) / T``) in place of ``1 / T``.

    Example::

        >>> import torch
        >>> from kl_kernels import token_logprobs
        >>> logits = torch.tensor([[2.0, 0.0, 0.0], [0.0, 0.0, 0.0]], requires_grad=True)
        >>> out = token_logprobs(logits, torch.tensor([0, -100]), return_entropy=True)
        >>> out.log_probs.detach()
        tensor([-0.2395,  0.0000])
        >>> round(float(out.entropy[0]), 4)
        0.6656
        >>> out.log_probs.sum().backward()
        >>> logits.grad[0]
        tensor([ 0.2130, -0.1065, -0.1065])
        >>> capped = token_logprobs(torch.tensor([[40.0, 0.0]]), torch.tensor([1]), softcap=30.0,
        ...                         logit_scale=0.5)  # z = (30 tanh(0.5 * 40 / 30), 0) = (17.48, 0)
        >>> capped.log_probs
        tensor([-17.4835])
    """
    if process_group is not None:
        return _sharded(logits, labels, temperature=temperature, return_entropy=return_entropy, mask=mask,
                        ignore_index=ignore_index, inplace_backward=inplace_backward, backend=backend,
                        process_group=process_group, logit_scale=logit_scale, softcap=softcap)
    problem = build_problem(logits, labels, temperature=temperature, return_entropy=return_entropy, mask=mask,
                            ignore_index=ignore_index, inplace_backward=inplace_backward, logit_scale=logit_scale,
                            softcap=softcap)
    impl = _dispatch.select(REGISTRY, backend, op="token_logprobs", problem=problem)
    return TokenLogprobsOutput(*impl.run(problem))


def _sharded(logits, labels, *, temperature, return_entropy, mask, ignore_index, inplace_backward, backend,
             process_group, logit_scale, softcap) -> TokenLogprobsOutput:
    """``token_logprobs`` of a vocabulary shard (``process_group``): the checks against the whole
    vocabulary, the row pass's backend by the op's own dispatch, then ``sharded.ShardedRows``."""
    import dataclasses

    from . import sharded
    from .row_pass import row_pass

    from ..vocab_rows import check_logits

    check_logits("logits", logits)
    sharded.check_group(process_group, logits.device)
    if inplace_backward is not False:
        raise ValueError("inplace_backward=True is not supported with process_group (each rank's shard gets a "
                         "fresh gradient)")
    start, total = sharded.vocab_range(process_group, logits.shape[-1], logits.device)
    # every check against the whole vocabulary, on a zero-stride stand-in (no [N, V] memory)
    stand_in = logits.new_zeros(()).expand(*logits.shape[:-1], total)
    p = build_problem(stand_in, labels, temperature=temperature, return_entropy=return_entropy, mask=mask,
                      ignore_index=ignore_index, inplace_backward=False, logit_scale=logit_scale, softcap=softcap)
    impl = _dispatch.select(REGISTRY, backend, op="token_logprobs", problem=dataclasses.replace(p, logits=logits))
    fwd, bwd = row_pass(impl.name)
    lp, ent = sharded.ShardedRows.apply(logits, p.labels, p.counted, p.temperature, p.softcap, return_entropy, fwd,
                                        bwd, process_group, start)
    return TokenLogprobsOutput(lp, ent if return_entropy else None)
