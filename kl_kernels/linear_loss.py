r"""``linear_kl_penalty_loss``: :func:`kl_penalty_loss` from the policy's hidden states and LM head (and the
reference's) instead of per-token log-probs, without either model's ``[N, V]`` logits (issue 28 item 4, the
front end of Liger-Kernel's ``LigerFusedLinearGRPOLoss``). A composition of two ops (``token_logprobs`` and
``kl_penalty``), so it belongs to neither: ops are siblings that never import each other.

One chunked pass over the tokens: :func:`kl_kernels.linear_token_logprobs` gives the policy's log-probs (and
its entropy when the loss has an entropy term) a chunk of tokens at a time, and the reference's (without
gradients) from the same chunks;
the fused loss runs on those ``[*S]`` tensors; in backward the loss's gradient to the log-probs flows into
``linear_token_logprobs``' chunked backward (logits recomputed per chunk, their gradient written over
them, then ``d hidden`` and ``d weight``). Peak extra memory: one chunk of logits, O(chunk x V).
"""

from __future__ import annotations

from .kl_penalty import KLPenaltyLossOutput, kl_penalty_loss
from .token_logprobs import linear_token_logprobs


def linear_kl_penalty_loss(hidden, weight, labels, old_log_probs, advantages, *, bias=None, ref_hidden=None,
                           ref_weight=None, ref_bias=None, temperature=1.0, mask=None, ignore_index=-100,
                           chunk_size=None, logprobs_backend="auto", **loss_kwargs) -> KLPenaltyLossOutput:
    r"""The PPO/GRPO policy loss with a KL penalty, :func:`kl_kernels.kl_penalty_loss`, from hidden states:
    the log-probs of ``labels`` under ``softmax((hidden @ weight.T + bias) / T)`` are computed chunk by
    chunk (:func:`kl_kernels.linear_token_logprobs`), so the ``[N, V]`` logits never exist.

    Args:
        hidden: ``[*S, H]`` the policy's final hidden states (``[B, T, H]`` padded or ``[N, H]`` packed: the
            layout of ``kl_penalty_loss``' log-probs); gradients flow to it.
        weight: ``[V, H]`` the policy's LM head; gradients flow. ``bias``: optional ``[V]``.
        labels: ``[*S]`` the sampled token ids (``ignore_index`` where there is none: they do not count).
        old_log_probs, advantages: as :func:`kl_kernels.kl_penalty_loss`.
        ref_hidden, ref_weight, ref_bias: the reference model's hidden states ``[*S, H_ref]`` and LM head
            ``[V, H_ref]`` (``ref_bias`` optional): its log-probs are computed the same way, without
            gradients, for the KL term. Or pass ``ref_log_probs=`` (per token) among the loss' arguments.
        temperature: applied to both models' logits (default 1.0).
        mask: ``[*S]`` bool, the counted (assistant) tokens, for both the log-probs and the loss.
        ignore_index: labels that do not count (default -100).
        chunk_size: tokens per chunk of logits (default about 16M logits a chunk).
        logprobs_backend: the row pass's backend (``linear_token_logprobs``' ``backend``).
        **loss_kwargs: every other argument of :func:`kl_kernels.kl_penalty_loss` (``beta``, ``estimator``,
            ``clip_epsilon``, ``aggregation``, ``offsets``/``lengths``, ``entropy_coef``, ``backend``, ...).
            With ``entropy_coef != 0`` and no ``entropy=``, the policy's entropy comes from the same pass.

    Returns:
        :class:`~kl_kernels.KLPenaltyLossOutput`, as :func:`kl_kernels.kl_penalty_loss`.

    Example::

        >>> import torch
        >>> from kl_kernels import linear_kl_penalty_loss
        >>> h, head = torch.randn(2, 5, 16, requires_grad=True), torch.randn(40, 16, requires_grad=True)
        >>> labels = torch.randint(0, 40, (2, 5))
        >>> out = linear_kl_penalty_loss(h, head, labels, torch.full((2, 5), -3.7), torch.tensor([1.0, -1.0]),
        ...                              ref_hidden=h.detach(), ref_weight=head.detach() * 0.9, beta=0.05,
        ...                              estimator="k3", clip_epsilon=0.2)
        >>> out.loss.backward()
        >>> h.grad.shape, head.grad.shape
        (torch.Size([2, 5, 16]), torch.Size([40, 16]))
    """
    if ref_hidden is not None and loss_kwargs.get("ref_log_probs") is not None:
        raise ValueError("pass the reference either as ref_hidden/ref_weight or as ref_log_probs, not both")
    want_entropy = loss_kwargs.get("entropy_coef", 0.0) not in (0, 0.0) and loss_kwargs.get("entropy") is None
    common = dict(temperature=temperature, mask=mask, ignore_index=ignore_index, chunk_size=chunk_size,
                  backend=logprobs_backend)
    # (the reference pair's rules, lm_head.check_ref_head, are linear_token_logprobs' own)
    policy = linear_token_logprobs(hidden, weight, labels, bias=bias, return_entropy=want_entropy,
                                   ref_hidden=ref_hidden, ref_weight=ref_weight, ref_bias=ref_bias, **common)
    if ref_hidden is not None:
        loss_kwargs["ref_log_probs"] = policy.ref_log_probs
    if want_entropy:
        loss_kwargs["entropy"] = policy.entropy
    counted = labels != ignore_index
    if mask is not None:
        counted = counted & mask
    return kl_penalty_loss(policy.log_probs, old_log_probs, advantages, mask=counted, **loss_kwargs)
