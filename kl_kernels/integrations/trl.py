"""TRL 1.16.0: the per-token GRPO loss of ``GRPOTrainer._compute_loss``, fused.

TRL computes its loss inside a trainer method, so there is no function to import in its place:
:func:`grpo_loss` takes the tensors that method has and returns the same loss. Use it from a
``GRPOTrainer`` subclass (``python_api/integrations.md`` has the few lines)::

    from kl_kernels.integrations.trl import grpo_loss

    class FusedGRPOTrainer(GRPOTrainer):
        def _compute_loss(self, model, inputs):
            ...  # per_token_logps from the model, as TRL's own method does
            return grpo_loss(per_token_logps, inputs["advantages"], mask, **trl_args_of(self, inputs))

TRL is not needed to import this module. Supported: loss types ``grpo``, ``bnpo``, ``dr_grpo``,
``dapo`` (TRL's default) and ``luspo``; ``epsilon_low``/``epsilon_high``; ``beta`` with TRL's k3 KL
to the reference; the vLLM importance-sampling ratio on the policy term (token or sequence shaped);
TRL's normalisers; ``delta`` (two-sided clipping: TRL caps the unclipped ratio at ``delta`` before
the min, which for ``delta >= 1 + epsilon_high``, TRL's recommendation, is exactly the dual clip
``dual_clip=delta``); ``importance_sampling_level="sequence"`` (GSPO: the sequence's mean log-ratio
for every token; TRL's gradient through that mean is the fused one, as every loss type weighs a
sequence's tokens alike). Not fused, and refused with ``NotImplementedError``: ``delta`` below
``1 + epsilon_high``, a token-shaped vLLM ratio or per-token advantages with
``importance_sampling_level="sequence"``, ``use_bias_correction_kl`` with ``beta != 0`` at sequence level,
and the ``cispo``/``sapo``/``vespo`` losses. ``use_bias_correction_kl`` (TRL's default) with ``beta != 0``
at token level is fused: the KL term times the differentiable ratio (``kl_times_ratio``).
Deviation: the log-ratio ``lp - old`` is clamped to +-20 before ``exp`` (TRL leaves it unclamped;
``exp(20)`` is already 4.9e8).
"""

from __future__ import annotations

import torch

from ..kl_penalty import KLPenaltyLossOutput, kl_penalty_loss
from ._common import at_least_one

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")


def grpo_loss(per_token_logps: torch.Tensor, advantages: torch.Tensor, completion_mask: torch.Tensor, *,
              old_per_token_logps: torch.Tensor | None = None, ref_per_token_logps: torch.Tensor | None = None,
              loss_type: str = "dapo", beta: float = 0.0, epsilon_low: float = 0.2, epsilon_high: float | None = None,
              delta: float | None = None, importance_sampling_ratio: torch.Tensor | None = None,
              importance_sampling_level: str = "token", use_bias_correction_kl: bool = True,
              max_completion_length: int | None = None, num_items_in_batch=None, num_processes: int = 1,
              gradient_accumulation_steps: int = 1, steps_per_generation: int = 1, training: bool = True,
              return_output: bool = False):
    """TRL's GRPO loss of one micro-batch, in one fused pass (:func:`kl_kernels.kl_penalty_loss`).

    Args (TRL's names; ``[B, T]`` completion-aligned tensors):
        per_token_logps: the policy's log-probs (gradients flow to it).
        advantages: ``[B]`` or ``[B, T]``.
        completion_mask: which tokens count (TRL's ``completion_mask``, times ``tool_mask`` if any).
        old_per_token_logps: the behaviour policy's (``None``: ``per_token_logps`` detached, ratio 1).
        ref_per_token_logps: the reference model's; needed when ``beta != 0``.
        loss_type, beta, epsilon_low, epsilon_high (``None``: ``epsilon_low``), delta (at least
        ``1 + epsilon_high``), importance_sampling_level, use_bias_correction_kl: TRL's ``GRPOConfig`` fields.
        importance_sampling_ratio: the vLLM correction ``[B, T]`` or ``[B, 1]`` (``inputs``), or None.
        max_completion_length: ``dr_grpo``'s constant length.
        num_items_in_batch: ``dapo``'s token count of the whole generation batch, all processes.
        num_processes, gradient_accumulation_steps, steps_per_generation, training: the normalisers'
            inputs (TRL's ``accelerator.num_processes``, ``current_gradient_accumulation_steps``,
            ``args.steps_per_generation``, ``model.training``).
        return_output: also return the :class:`~kl_kernels.KLPenaltyLossOutput` (diagnostics).

    Returns:
        the loss (0-d), or ``(loss, output)`` with ``return_output``.
    """
    if loss_type not in LOSS_TYPES:
        raise NotImplementedError(f"loss_type={loss_type!r} is not fused in kl_kernels "
                                  f"(fused: {', '.join(LOSS_TYPES)})")
    if importance_sampling_level not in ("token", "sequence"):
        raise ValueError(f"Unknown importance sampling level: {importance_sampling_level}. Possible values are "
                         "'token' and 'sequence'.")
    if (importance_sampling_level == "sequence" and importance_sampling_ratio is not None
            and importance_sampling_ratio.dim() == 2 and importance_sampling_ratio.shape[-1] != 1):
        # TRL differentiates through the sequence's mean log-ratio: each token's gradient then carries the
        # sequence's mean weight, where the fused GSPO gradient carries the token's own
        raise NotImplementedError("importance_sampling_level='sequence' with a token-shaped importance_sampling_ratio "
                                  "[B, T] is not fused: use a sequence-level vLLM correction ([B, 1])")
    if importance_sampling_level == "sequence" and advantages.dim() == 2 and advantages.shape[-1] != 1:
        raise NotImplementedError("importance_sampling_level='sequence' with per-token advantages [B, T] is not fused "
                                  "(TRL's advantages are per sequence, [B])")
    bias_correction = beta != 0.0 and use_bias_correction_kl
    if bias_correction and importance_sampling_level == "sequence":
        # TRL broadcasts the sequence's ratio onto the per-token KL and differentiates it through the sequence
        # mean, which spreads each token's KL over the whole sequence's gradient: not the fused per-token rule
        raise NotImplementedError("use_bias_correction_kl=True with beta != 0 and importance_sampling_level="
                                  "'sequence' is not fused: set use_bias_correction_kl=False or use token level")
    if beta != 0.0 and ref_per_token_logps is None:
        raise ValueError("beta != 0 needs ref_per_token_logps")
    eps_high = epsilon_low if epsilon_high is None else epsilon_high
    if delta is not None and not delta >= 1.0 + eps_high:
        # TRL caps the unclipped ratio at delta before the min: for delta >= 1 + epsilon_high (TRL's
        # recommendation) that is exactly the dual clip (the loss of a negative advantage capped at
        # -A * delta, no gradient there); below it the cap would cut into the positive side too
        raise NotImplementedError(f"delta={delta} below 1 + epsilon_high = {1.0 + eps_high} is not fused (TRL "
                                  "recommends delta > 1 + epsilon_high, where it is the dual clip)")
    old = per_token_logps.detach() if old_per_token_logps is None else old_per_token_logps
    mask = completion_mask.bool()
    weights = None
    if importance_sampling_ratio is not None:
        weights = importance_sampling_ratio.expand(per_token_logps.shape)
    g = gradient_accumulation_steps if training else 1
    if loss_type == "grpo":
        agg, factor = "seq-mean-token-mean", 1.0 / g  # mean over rows of each row's token mean
    elif loss_type == "bnpo":
        agg, factor = "token-mean", 1.0 / g
    elif loss_type == "dr_grpo":
        if max_completion_length is None:
            raise ValueError("loss_type='dr_grpo' needs max_completion_length")
        agg, factor = "sum", 1.0 / (per_token_logps.shape[0] * max_completion_length * g)
    elif loss_type == "luspo":
        agg, factor = "seq-mean-token-sum", 1.0 / g
    else:  # dapo
        if num_items_in_batch is None:
            raise ValueError("loss_type='dapo' needs num_items_in_batch (the generation batch's token count)")
        n = at_least_one(num_items_in_batch) / num_processes
        if training:
            n = n * gradient_accumulation_steps / steps_per_generation
        agg, factor = "sum", 1.0 / n
    out: KLPenaltyLossOutput = kl_penalty_loss(
        per_token_logps, old, advantages, ref_log_probs=ref_per_token_logps if beta != 0.0 else None, beta=float(beta),
        estimator="k3" if beta != 0.0 else "k1", mask=mask, clip_epsilon=(epsilon_low, eps_high), weights=weights,
        aggregation=agg, dual_clip=delta, importance_sampling_level=importance_sampling_level,
        kl_times_ratio=bias_correction)
    loss = out.loss * factor
    return (loss, out) if return_output else loss


__all__ = ["LOSS_TYPES", "grpo_loss"]
