"""TRL 1.16.0: the per-micro-batch GRPO loss of ``GRPOTrainer._compute_loss``, in one fused call.

:func:`grpo_loss` takes the tensors that TRL's method has and returns the same loss (the trainer switch,
:mod:`kl_kernels.integrations.trl.trainer`, calls it once per micro-batch). Fused: loss types ``grpo``,
``bnpo``, ``dr_grpo``, ``dapo`` (TRL's default) and ``luspo``; ``epsilon_low``/``epsilon_high``; ``beta`` with
TRL's k3 KL to the reference; the vLLM importance-sampling ratio and any other per-token or per-sequence weight
of the policy term (TRL's high-entropy mask, its off-policy sequence mask: ``token_weights``); TRL's
normalisers; ``delta`` (two-sided clipping: TRL caps the unclipped ratio at ``delta`` before the min, which for
``delta >= 1 + epsilon_high``, TRL's recommendation, is exactly the dual clip ``dual_clip=delta``);
``importance_sampling_level="sequence"`` (GSPO: the sequence's mean log-ratio for every token; TRL's gradient
through that mean is the fused one, as every loss type weighs a sequence's tokens alike: a weight that varies
inside a sequence is replaced by its mean over the sequence's counted tokens, which gives TRL's loss and
gradient); the entropy bonus (``entropy``, ``entropy_coef``: TRL's token mean, scaled for gradient
accumulation only). Not fused, and refused with ``NotImplementedError``: ``delta`` below ``1 + epsilon_high``,
per-token advantages with ``importance_sampling_level="sequence"``, ``use_bias_correction_kl`` with
``beta != 0`` at sequence level, and the ``cispo``/``sapo``/``vespo`` losses. ``use_bias_correction_kl``
(TRL's default) with ``beta != 0`` at token level is fused: the KL term times the differentiable ratio
(``kl_times_ratio``). Deviation: the log-ratio ``lp - old`` is clamped to +-20 before ``exp`` (TRL leaves it
unclamped; ``exp(20)`` is already 4.9e8). TRL is not needed to import this module.
"""

from __future__ import annotations

import torch

from ...kl_penalty import KLPenaltyLossOutput, kl_penalty_loss
from .._common import at_least_one

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")


def grpo_loss(per_token_logps: torch.Tensor, advantages: torch.Tensor, completion_mask: torch.Tensor, *,
              old_per_token_logps: torch.Tensor | None = None, ref_per_token_logps: torch.Tensor | None = None,
              loss_type: str = "dapo", beta: float = 0.0, epsilon_low: float = 0.2, epsilon_high: float | None = None,
              delta: float | None = None, importance_sampling_ratio: torch.Tensor | None = None,
              importance_sampling_level: str = "token", use_bias_correction_kl: bool = True,
              max_completion_length: int | None = None, num_items_in_batch=None, num_processes: int = 1,
              gradient_accumulation_steps: int = 1, steps_per_generation: int = 1, training: bool = True,
              token_weights: torch.Tensor | None = None, entropy: torch.Tensor | None = None,
              entropy_coef: float = 0.0, return_output: bool = False):
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
        token_weights: more weights of the policy term, ``[B, T]`` or ``[B, 1]`` (data; TRL's high-entropy
            mask, its off-policy sequence mask); the normalisers do not change.
        entropy, entropy_coef: TRL's entropy bonus: ``loss -= entropy_coef * (masked token mean of entropy)``
            divided by ``gradient_accumulation_steps`` in training (``entropy``: ``[B, T]``, gradients flow).
            With ``entropy_coef=0`` the entropy only feeds the diagnostics (``entropy_mean``).
        return_output: also return the :class:`~kl_kernels.KLPenaltyLossOutput` (diagnostics).

    Returns:
        the loss (0-d), or ``(loss, output)`` with ``return_output``.
    """
    loss, out, _ = fused_grpo_loss(
        per_token_logps, advantages, completion_mask, old_per_token_logps=old_per_token_logps,
        ref_per_token_logps=ref_per_token_logps, loss_type=loss_type, beta=beta, epsilon_low=epsilon_low,
        epsilon_high=epsilon_high, delta=delta, importance_sampling_ratio=importance_sampling_ratio,
        importance_sampling_level=importance_sampling_level, use_bias_correction_kl=use_bias_correction_kl,
        max_completion_length=max_completion_length, num_items_in_batch=num_items_in_batch,
        num_processes=num_processes, gradient_accumulation_steps=gradient_accumulation_steps,
        steps_per_generation=steps_per_generation, training=training, token_weights=token_weights, entropy=entropy,
        entropy_coef=entropy_coef)
    return (loss, out) if return_output else loss


def check_options(loss_type, beta, epsilon_low, epsilon_high, delta, importance_sampling_level,
                  use_bias_correction_kl) -> str | None:
    """Why these ``GRPOConfig`` options are not fused (the option named), or None when they are."""
    if loss_type not in LOSS_TYPES:
        return f"loss_type={loss_type!r} is not fused in kl_kernels (fused: {', '.join(LOSS_TYPES)})"
    if importance_sampling_level not in ("token", "sequence"):
        return f"importance_sampling_level={importance_sampling_level!r} is not one of 'token', 'sequence'"
    eps_high = epsilon_low if epsilon_high is None else epsilon_high
    if delta is not None and not delta >= 1.0 + eps_high:
        # TRL caps the unclipped ratio at delta before the min: for delta >= 1 + epsilon_high (TRL's
        # recommendation) that is exactly the dual clip (the loss of a negative advantage capped at
        # -A * delta, no gradient there); below it the cap would cut into the positive side too
        return (f"delta={delta} below 1 + epsilon_high = {1.0 + eps_high} is not fused (TRL recommends delta > "
                "1 + epsilon_high, where it is the dual clip)")
    if beta != 0.0 and use_bias_correction_kl and importance_sampling_level == "sequence":
        # TRL broadcasts the sequence's ratio onto the per-token KL and differentiates it through the sequence
        # mean, which spreads each token's KL over the whole sequence's gradient: not the fused per-token rule
        return ("use_bias_correction_kl=True with beta != 0 and importance_sampling_level='sequence' is not fused: "
                "set use_bias_correction_kl=False or use token level")
    return None


def _per_sequence(w: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` weights -> ``[B, 1]``: their mean over each sequence's counted tokens (0 for an empty one)."""
    m = mask.to(torch.float32 if w.dtype in (torch.bfloat16, torch.float16) else w.dtype)
    return (w.to(m.dtype) * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1.0)


def fused_grpo_loss(per_token_logps, advantages, completion_mask, *, old_per_token_logps, ref_per_token_logps,
                    loss_type, beta, epsilon_low, epsilon_high, delta, importance_sampling_ratio,
                    importance_sampling_level, use_bias_correction_kl, max_completion_length, num_items_in_batch,
                    num_processes, gradient_accumulation_steps, steps_per_generation, training, token_weights,
                    entropy, entropy_coef):
    """:func:`grpo_loss`'s work: ``(loss, output, policy_scale)``, where ``policy_scale`` times
    ``output.loss_objective + output.loss_kl`` is TRL's ``policy_loss`` metric (the loss type's normalised
    loss before the gradient-accumulation divisor; dapo's after it, as TRL logs it)."""
    why = check_options(loss_type, beta, epsilon_low, epsilon_high, delta, importance_sampling_level,
                        use_bias_correction_kl)
    if why is not None:
        if why.startswith("importance_sampling_level="):
            raise ValueError(f"Unknown importance sampling level: {importance_sampling_level}. Possible values are "
                             "'token' and 'sequence'.")
        raise NotImplementedError(why)
    sequence = importance_sampling_level == "sequence"
    if sequence and advantages.dim() == 2 and advantages.shape[-1] != 1:
        raise NotImplementedError("importance_sampling_level='sequence' with per-token advantages [B, T] is not fused "
                                  "(TRL's advantages are per sequence, [B])")
    if beta != 0.0 and ref_per_token_logps is None:
        raise ValueError("beta != 0 needs ref_per_token_logps")
    eps_high = epsilon_low if epsilon_high is None else epsilon_high
    old = per_token_logps.detach() if old_per_token_logps is None else old_per_token_logps
    mask = completion_mask.bool()
    weights = None
    for w in (importance_sampling_ratio, token_weights):  # both multiply TRL's policy term only
        if w is not None:
            if w.dim() == 1:
                w = w.unsqueeze(-1)
            if sequence and w.shape[-1] != 1:
                # TRL's per-token loss at sequence level is w_t * pg(s_b): its loss and its gradient through the
                # mean s_b are those of the sequence's mean weight (every loss type weighs b's tokens alike)
                w = _per_sequence(w, completion_mask)
            weights = w if weights is None else weights * w
    if weights is not None:
        weights = weights.expand(per_token_logps.shape)
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
    coef = 0.0
    if entropy is not None and entropy_coef != 0.0:
        # TRL subtracts entropy_coef * token_mean(entropy) / g from the normalised loss; ours is out.loss * factor
        coef = float(entropy_coef / (g * factor))
    elif entropy is not None:
        entropy = entropy.detach()  # diagnostics only
    out: KLPenaltyLossOutput = kl_penalty_loss(
        per_token_logps, old, advantages, ref_log_probs=ref_per_token_logps if beta != 0.0 else None, beta=float(beta),
        estimator="k3" if beta != 0.0 else "k1", mask=mask, clip_epsilon=(epsilon_low, eps_high), weights=weights,
        aggregation=agg, dual_clip=delta, importance_sampling_level=importance_sampling_level,
        kl_times_ratio=beta != 0.0 and use_bias_correction_kl, entropy=entropy, entropy_coef=coef,
        entropy_aggregation="token-mean" if coef != 0.0 else None)
    loss = out.loss * factor
    return loss, out, factor if loss_type == "dapo" else factor * g


__all__ = ["LOSS_TYPES", "check_options", "fused_grpo_loss", "grpo_loss"]
