"""Which of TRL 1.16's ``GRPOConfig`` options the switch fuses, and which it leaves to TRL's own loss.

Every field that ``GRPOConfig`` adds to ``transformers.TrainingArguments`` (TrainingArguments' own fields are
the ``Trainer``'s: the switch does not replace it) is in exactly one of the tables below. :func:`plan` reads a
trainer's options once and returns either the fused loss's :class:`Plan` or the reasons it is not fused; a
field outside the tables (an option of a later TRL, or of a user's ``GRPOConfig`` subclass) whose value is
not its default is such a reason, as is a TRL other than 1.16 and a trainer class with its own
``_compute_loss``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from .loss import check_options

TESTED_TRL = "1.16."


class TRLFallbackWarning(UserWarning):
    """A TRL trainer keeps TRL's own loss for an option kl_kernels does not fuse (the message names it)."""


# Read by the fused loss (kl_kernels/integrations/trl/trainer.py); conditions in plan() below
FUSED = {
    "loss_type": "grpo, bnpo, dr_grpo, dapo, luspo fused (kernel aggregations); cispo, sapo, vespo: TRL's path",
    "beta": "k3 KL to the reference, TRL's `exp(ref - lp) - (ref - lp) - 1`",
    "epsilon": "clip low", "epsilon_high": "clip high",
    "delta": "two-sided clip = dual clip for delta > 1 + epsilon_high; TRL's path below or at it",
    "importance_sampling_level": "token, sequence (GSPO through the sequence mean)",
    "use_bias_correction_kl": "KL times the differentiable ratio (token level; TRL's path at sequence level "
                              "with beta != 0)",
    "top_entropy_quantile": "TRL's get_high_entropy_mask as a weight of the policy term",
    "off_policy_mask_threshold": "TRL's get_off_policy_mask as a weight of the policy term",
    "entropy_coef": "entropy bonus in the fused call (TRL's path with top_entropy_quantile < 1)",
    "use_adaptive_entropy": "TRL's controller, its state updated from the fused call's entropy sums",
    "entropy_coef_min": "adaptive entropy", "entropy_coef_max": "adaptive entropy",
    "entropy_coef_delta": "adaptive entropy", "entropy_target": "adaptive entropy",
    "router_aux_loss_coef": "MoE load-balancing loss added as TRL does (a scalar)",
    "max_completion_length": "dr_grpo's normaliser (and generation)",
    "steps_per_generation": "dapo's normaliser (and generation)",
    "use_vllm": "with vllm_importance_sampling_correction: the ratio weights the policy term",
    "vllm_importance_sampling_correction": "the ratio weights the policy term",
}
# Read only by a loss type that is TRL's path: no effect otherwise
TRL_LOSS_ONLY = {
    "sapo_temperature_neg": "sapo", "sapo_temperature_pos": "sapo", "vespo_k_pos": "vespo",
    "vespo_lambda_pos": "vespo", "vespo_k_neg": "vespo", "vespo_lambda_neg": "vespo",
}
# TRL computes the loss's inputs with these (the importance-sampling ratio, advantages, masks, log-probs,
# reference): its own code, before the loss, unchanged by the switch
INPUTS = (
    "vllm_importance_sampling_mode", "vllm_importance_sampling_clip_max", "vllm_importance_sampling_clip_min",
    "vllm_importance_sampling_cap", "num_iterations", "scale_rewards", "reward_weights",
    "multi_objective_aggregation", "mask_truncated_completions", "sync_ref_model", "ref_model_mixup_alpha",
    "ref_model_sync_steps", "num_generations", "num_generations_eval", "generation_batch_size", "temperature",
    "top_p", "top_k", "min_p", "generation_kwargs", "repetition_penalty", "cache_implementation",
    "chat_template_kwargs", "max_tool_calling_iterations", "cast_lm_head_to_fp32", "model_init_kwargs",
    "trust_remote_code", "disable_dropout", "pad_to_multiple_of", "shuffle_dataset", "ds3_gather_for_generation",
    "vllm_mode", "vllm_model_impl", "vllm_enable_sleep_mode", "vllm_structured_outputs_regex",
    "vllm_server_base_url", "vllm_server_host", "vllm_server_port", "vllm_server_timeout", "vllm_group_port",
    "vllm_gpu_memory_utilization", "vllm_max_model_length", "vllm_tensor_parallel_size",
    "use_transformers_continuous_batching", "transformers_continuous_batching_config", "use_transformers_paged",
)
LOGGING = ("log_completions", "log_multimodal", "num_completions_to_print", "log_unique_prompts",
           "log_completions_hub_repo")
KNOWN = frozenset(FUSED) | frozenset(TRL_LOSS_ONLY) | frozenset(INPUTS) | frozenset(LOGGING)


@dataclass(frozen=True)
class Plan:
    """The fused loss's options, read once from the trainer."""

    loss_type: str
    beta: float
    epsilon_low: float
    epsilon_high: float
    delta: float | None
    importance_sampling_level: str
    use_bias_correction_kl: bool
    vllm_ratio: bool            # use_vllm and vllm_importance_sampling_correction
    top_entropy_quantile: float
    off_policy_mask_threshold: float | None
    entropy_bonus: bool         # TRL's _entropy_bonus_enabled
    adaptive_entropy: bool
    aux_loss: bool              # TRL's aux_loss_enabled
    router_aux_loss_coef: float
    max_completion_length: int | None
    steps_per_generation: int


def _default(f):
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def _differs(value, default) -> bool:
    try:
        if isinstance(value, float) and isinstance(default, float) and math.isnan(value) and math.isnan(default):
            return False
        return bool(value != default)
    except Exception:  # (a value that does not compare: count it as set)
        return True


def unknown_options(args) -> list[str]:
    """``GRPOConfig`` fields outside the tables (not TrainingArguments') set to a value other than their default."""
    from transformers import TrainingArguments

    base = {f.name for f in dataclasses.fields(TrainingArguments)}
    return [f"{f.name}={getattr(args, f.name)!r}" for f in dataclasses.fields(args)
            if f.name not in base and f.name not in KNOWN and _default(f) is not dataclasses.MISSING
            and _differs(getattr(args, f.name), _default(f))]


def plan(trainer) -> tuple[Plan | None, list[str]]:
    """``(Plan, [])`` when the trainer's loss is fused, else ``(None, reasons)`` naming each option left to TRL."""
    import trl
    from trl import GRPOTrainer as TRLGRPOTrainer

    reasons = []
    if not trl.__version__.startswith(TESTED_TRL):
        reasons.append(f"TRL {trl.__version__} (kl_kernels' option table is TRL {TESTED_TRL}x's)")
    own = type(trainer)._compute_loss
    if own is not TRLGRPOTrainer._compute_loss and not getattr(own, "_kl_kernels", False):
        reasons.append(f"{type(trainer).__name__}._compute_loss (the trainer class's own loss)")
    args = trainer.args
    why = check_options(trainer.loss_type, trainer.beta, trainer.epsilon_low, trainer.epsilon_high, args.delta,
                        trainer.importance_sampling_level, args.use_bias_correction_kl)
    if why is not None:
        reasons.append(why)
    eps_high = trainer.epsilon_high
    if args.delta is not None and not torch.tensor(args.delta, dtype=torch.float32) > torch.tensor(
            1.0 + eps_high, dtype=torch.float32):
        # TRL's clip_ratio/high counts the ratio after its cap at delta: always 0 when delta = 1 + epsilon_high
        if why is None:
            reasons.append(f"delta={args.delta} equal to 1 + epsilon_high (in float32)")
    entropy_bonus = bool(trainer._entropy_bonus_enabled)
    if entropy_bonus and trainer.top_entropy_quantile < 1.0:
        reasons.append(f"entropy_coef={args.entropy_coef} / use_adaptive_entropy={args.use_adaptive_entropy} with "
                       f"top_entropy_quantile={trainer.top_entropy_quantile} (the bonus's own token mask)")
    reasons += [f"{o} (an option kl_kernels does not know)" for o in unknown_options(args)]
    if reasons:
        return None, reasons
    return Plan(
        loss_type=trainer.loss_type, beta=float(trainer.beta), epsilon_low=float(trainer.epsilon_low),
        epsilon_high=float(eps_high), delta=args.delta, importance_sampling_level=trainer.importance_sampling_level,
        use_bias_correction_kl=bool(args.use_bias_correction_kl),
        vllm_ratio=bool(trainer.use_vllm and trainer.vllm_importance_sampling_correction),
        top_entropy_quantile=float(trainer.top_entropy_quantile),
        off_policy_mask_threshold=trainer.off_policy_mask_threshold, entropy_bonus=entropy_bonus,
        adaptive_entropy=bool(trainer.use_adaptive_entropy), aux_loss=bool(trainer.aux_loss_enabled),
        router_aux_loss_coef=float(trainer.router_aux_loss_coef), max_completion_length=trainer.max_completion_length,
        steps_per_generation=args.steps_per_generation), []
