"""The switch: TRL's ``GRPOTrainer`` whose micro-batch loss is one fused :func:`kl_kernels.kl_penalty_loss` call.

``patch(trainer)`` reads the trainer's options once (:func:`kl_kernels.integrations.trl.options.plan`); when
they are all fused it sets the instance's ``_compute_loss`` to :func:`_fused_compute_loss`, which

1. gets the policy's log-probs, entropies and MoE auxiliary loss from TRL's own
   ``_get_per_token_logps_and_entropies`` (TRL's model call and LM head, unchanged);
2. forms the policy term's weights from TRL's own ``get_high_entropy_mask`` / ``get_off_policy_mask`` and the
   vLLM importance-sampling ratio of ``inputs``;
3. makes the one fused call (:func:`kl_kernels.integrations.trl.loss.fused_grpo_loss`);
4. logs TRL's metrics (``kl``, ``entropy``, ``clip_ratio/*``, ``policy_loss``, ``entropy_coef``,
   ``aux_loss``) from the call's by-products, reduced and gathered across processes as TRL does, and
   steps TRL's adaptive entropy controller (its own state attributes) as TRL does.

Otherwise it leaves TRL's ``_compute_loss`` in place and warns once (:class:`TRLFallbackWarning`), naming
the options.
"""

from __future__ import annotations

import types
import warnings

import torch

from .loss import fused_grpo_loss
from .options import Plan, TRLFallbackWarning, plan

LM_HEADS = ("trl", "kl_kernels")
# The per-sample model inputs TRL's _compute_loss hands to _get_per_token_logps_and_entropies (multimodal models)
_MODEL_INPUTS = ("pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask", "spatial_shapes",
                 "num_tiles", "image_sizes", "token_type_ids", "mm_token_type_ids", "image_position_ids")


def patch(trainer, *, lm_head: str = "trl"):
    """Give a constructed TRL ``GRPOTrainer`` (or an instance of a subclass) kl_kernels' fused loss.

    Args:
        trainer: the trainer; its options are read now, once.
        lm_head: ``"trl"`` (default: TRL's fused LM head computes the log-probs) or ``"kl_kernels"``
            (:func:`kl_kernels.integrations.trl_lm_head.patch_lm_head`: ``linear_token_logprobs`` under TRL's head).

    Returns:
        the trainer. Its ``_kl_kernels_plan`` is the fused loss's :class:`~kl_kernels.integrations.trl.options.Plan`,
        or None where TRL's own loss is kept (then one :class:`TRLFallbackWarning` named the options).

    Example (needs TRL, transformers, accelerate, datasets)::

        trainer = patch(trl.GRPOTrainer(model=..., reward_funcs=..., args=GRPOConfig(...), train_dataset=...))
        trainer.train()
    """
    if lm_head not in LM_HEADS:
        raise ValueError(f"lm_head must be one of {LM_HEADS}, got {lm_head!r}")
    if not getattr(trainer, "_kl_kernels_patched", False):  # (a second patch: the loss is decided already)
        fused, reasons = plan(trainer)
        if fused is None:
            warnings.warn("kl_kernels: this GRPOTrainer keeps TRL's own loss (not fused by kl_kernels): "
                          + "; ".join(reasons), TRLFallbackWarning, stacklevel=2)
        else:
            trainer._compute_loss = types.MethodType(_fused_compute_loss, trainer)
        trainer._kl_kernels_plan = fused
        trainer._kl_kernels_patched = True
    if lm_head == "kl_kernels":
        from ..trl_lm_head import patch_lm_head

        patch_lm_head(trainer)
    return trainer


def grpo_trainer_class():
    """``GRPOTrainer``: TRL's, whose constructor ends with :func:`patch` (made when first asked for)."""
    import trl

    class GRPOTrainer(trl.GRPOTrainer):
        __doc__ = ("TRL's GRPOTrainer with kl_kernels' fused loss (kl_kernels.integrations.trl): the same "
                   "arguments, plus lm_head='trl' | 'kl_kernels'.\n\n" + (trl.GRPOTrainer.__doc__ or ""))

        def __init__(self, *args, lm_head: str = "trl", **kwargs):
            if lm_head not in LM_HEADS:  # before TRL builds the models
                raise ValueError(f"lm_head must be one of {LM_HEADS}, got {lm_head!r}")
            super().__init__(*args, **kwargs)
            patch(self, lm_head=lm_head)

    GRPOTrainer.__module__ = __name__.rsplit(".", 1)[0]
    return GRPOTrainer


def _fused_compute_loss(self, model, inputs):
    """TRL's ``_compute_loss(model, inputs)`` for the options of ``self._kl_kernels_plan``, fused."""
    p: Plan = self._kl_kernels_plan
    prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
    completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
    logits_to_keep = completion_ids.size(1)
    mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]
    per_token_logps, entropies, aux_loss = self._get_per_token_logps_and_entropies(
        model, input_ids, attention_mask, logits_to_keep, compute_entropy=True, compute_aux_loss=p.aux_loss,
        **{k: inputs.get(k) for k in _MODEL_INPUTS})
    mode = "train" if self.model.training else "eval"
    advantages = inputs["advantages"]
    old = inputs.get("old_per_token_logps")

    weights = None
    if p.top_entropy_quantile < 1.0:  # TRL's mask of the high-entropy tokens (gathered over processes by TRL)
        weights = self.get_high_entropy_mask(entropies, mask, 1 - p.top_entropy_quantile).to(per_token_logps.dtype)
    if p.off_policy_mask_threshold is not None:  # TRL's sequence mask [B, 1]
        adv2 = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
        old_or_lp = per_token_logps.detach() if old is None else old
        keep = self.get_off_policy_mask(advantages=adv2, per_token_logps=per_token_logps,
                                        sampling_per_token_logps=inputs.get("sampling_per_token_logps", old_or_lp),
                                        mask=mask, off_policy_threshold=p.off_policy_mask_threshold)
        keep = keep.to(per_token_logps.dtype)
        weights = keep if weights is None else weights * keep

    apply_coef = 0.0
    if p.entropy_bonus:  # the coefficient of the previous optimizer step's end, as TRL applies it
        apply_coef = self.entropy_coef
        if p.adaptive_entropy and not self._last_world_entropy <= self.args.entropy_target:
            apply_coef = 0.0
    training = mode == "train"
    loss, out, policy_scale = fused_grpo_loss(
        per_token_logps, advantages, mask, old_per_token_logps=old,
        ref_per_token_logps=inputs.get("ref_per_token_logps"), loss_type=p.loss_type, beta=p.beta,
        epsilon_low=p.epsilon_low, epsilon_high=p.epsilon_high, delta=p.delta,
        importance_sampling_ratio=inputs["importance_sampling_ratio"] if p.vllm_ratio else None,
        importance_sampling_level=p.importance_sampling_level, use_bias_correction_kl=p.use_bias_correction_kl,
        max_completion_length=p.max_completion_length, num_items_in_batch=inputs.get("num_items_in_batch"),
        num_processes=self.accelerator.num_processes,
        gradient_accumulation_steps=self.current_gradient_accumulation_steps,
        steps_per_generation=p.steps_per_generation, training=training, token_weights=weights,
        entropy=entropies, entropy_coef=apply_coef)
    _entropy_bonus_bookkeeping(self, p, out, policy_scale, mode)
    if p.aux_loss:  # the policy loss is scaled for gradient accumulation: so is the auxiliary loss, as TRL does
        loss = loss + p.router_aux_loss_coef * aux_loss / (self.current_gradient_accumulation_steps if training else 1.0)
        self._metrics[mode]["aux_loss"].append(self.accelerator.gather_for_metrics(aux_loss).mean().item())
    _log_metrics(self, p, out, mode, sequences=per_token_logps.shape[0])
    return loss


_fused_compute_loss._kl_kernels = True


def _entropy_bonus_bookkeeping(self, p: Plan, out, policy_scale, mode):
    """TRL's ``policy_loss`` and ``entropy_coef`` metrics and its adaptive controller's step, from the fused
    call's sums (TRL's own state attributes: ``entropy_coef``, ``_entropy_window_stats``, ``_last_world_entropy``)."""
    if not p.entropy_bonus:
        return
    policy_loss = ((out.loss_objective + out.loss_kl) * policy_scale).detach()
    self._metrics[mode]["policy_loss"].append(self.accelerator.gather(policy_loss).nanmean().item())
    if p.adaptive_entropy and mode == "train":
        n = out.num_tokens.to(torch.float32)
        stats = torch.stack([_total(out.entropy_mean, n), n]).detach()
        self._entropy_window_stats = stats if self._entropy_window_stats is None else self._entropy_window_stats + stats
        if self.accelerator.sync_gradients:
            window = self.accelerator.reduce(self._entropy_window_stats, reduction="sum")
            world_entropy = (window[0] / window[1].clamp(min=1.0)).item()
            a = self.args
            if world_entropy <= a.entropy_target:
                self.entropy_coef = min(self.entropy_coef + a.entropy_coef_delta, a.entropy_coef_max)
            else:
                self.entropy_coef = max(self.entropy_coef - a.entropy_coef_delta, a.entropy_coef_min)
            self._last_world_entropy = world_entropy
            self._entropy_window_stats = None
    if mode == "train" and self.accelerator.sync_gradients:
        self._metrics[mode]["entropy_coef"].append(self.entropy_coef)


def _total(mean: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """A masked sum from its mean and count (0 for no tokens, whatever the mean is then)."""
    return torch.where(n > 0, mean.to(torch.float32) * n, torch.zeros_like(n))


def _log_metrics(self, p: Plan, out, mode, sequences):
    """TRL's ``kl``, ``entropy`` and ``clip_ratio/*`` metrics: token sums reduced over processes, per-sequence
    fractions gathered (TRL's ``global_masked_mean`` / ``masked_seq_mean``, its ``nanmin`` / ``nanmax``)."""
    from trl.trainer.utils import nanmax, nanmin

    metrics = self._metrics[mode]
    n = out.num_tokens.to(torch.float32)

    def global_mean(local_sum, local_count):
        totals = self.accelerator.reduce(torch.stack([local_sum.to(torch.float32), local_count]), reduction="sum")
        return (totals[0] / totals[1].clamp(min=1.0)).item()

    if p.beta != 0.0:
        metrics["kl"].append(global_mean(_total(out.kl_mean, n), n))
    metrics["entropy"].append(global_mean(_total(out.entropy_mean, n), n))
    low, high, counts = out.seq_clipped_low, out.seq_clipped_high, out.seq_num_tokens
    if p.importance_sampling_level == "sequence":  # TRL counts sequences (all of them, empty ones not clipped)
        low, high = (low > 0).to(torch.float32), (high > 0).to(torch.float32)
        region = torch.maximum(low, high)
        count = torch.tensor(float(sequences), device=low.device)
        low_seq, high_seq = low, high
        metrics["clip_ratio/low_mean"].append(global_mean(low.sum(), count))
        metrics["clip_ratio/high_mean"].append(global_mean(high.sum(), count))
        metrics["clip_ratio/region_mean"].append(global_mean(region.sum(), count))
    else:
        metrics["clip_ratio/low_mean"].append(global_mean(low.sum(), n))
        metrics["clip_ratio/high_mean"].append(global_mean(high.sum(), n))
        # a token is clipped low (A < 0) or high (A > 0), never both
        metrics["clip_ratio/region_mean"].append(global_mean(low.sum() + high.sum(), n))
        low_seq, high_seq = low / counts, high / counts  # 0 / 0 = NaN for an empty sequence, as TRL's
    metrics["clip_ratio/low_min"].append(nanmin(self.accelerator.gather(low_seq)).item())
    metrics["clip_ratio/high_max"].append(nanmax(self.accelerator.gather(high_seq)).item())
