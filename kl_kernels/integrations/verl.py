"""verl 0.9.1 drop-ins: the KL functions, the vanilla and GSPO policy losses and the KL controllers.

Same names, signatures and defaults as ``verl.trainer.ppo.core_algos`` (and ``apply_kl_penalty`` of
``verl.trainer.ppo.ray_trainer``), computed by kl_kernels' fused ops. verl is not needed to import
this module; :func:`register` puts the fused loss into verl's own policy-loss registry, so a verl
config selects it with ``actor_rollout_ref.actor.policy_loss.loss_mode=kl_kernels``. The switches put kl_kernels
where verl's own code looks its functions up: :func:`patch_fused_kernels` (``use_fused_kernels=True``: log-probs and
entropy from the hidden states by :func:`kl_kernels.linear_token_logprobs`), :func:`patch_kl_loss` (the actor's KL
loss), :func:`patch_kl_reward` (the KL in the reward), and :func:`patch` (all, with :func:`register`).

Tensors are verl's: ``[B, T]`` response-aligned, with a ``response_mask`` (bool or 0/1; read as
bool). Deviations from verl, all deliberate (``python_api/integrations.md``):

* an all-masked batch gives a loss of 0 where verl's ``agg_loss`` divides 0 by 0 (NaN);
* ``ppo_kl`` (a metric) is the mean of ``old - lp`` without verl's +-20 clamp of the log-ratio;
* a fractional ``response_mask`` counts where it is non-zero (verl weights tokens by it).

Example::

    >>> import torch
    >>> from kl_kernels.integrations import verl as kv
    >>> lp, ref = torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.5, -2.0]])
    >>> kv.kl_penalty(lp, ref, "kl")
    tensor([[0.5000, 0.0000]])
"""

from __future__ import annotations

import importlib
import sys
import warnings
from typing import Any, Optional

import torch

from ..full_kl import full_kl
from ..kl_penalty import kl_penalty_loss
from ..kl_reward import kl_reward
from ..token_logprobs import linear_token_logprobs, token_logprobs
from ._common import FixedValue, ProportionalValue, Switch, Switches, at_least_one

# verl's kl_penalty modes -> (our estimator, clamp_input, clamp_output). verl's low_var_kl / k3
# clamps the log-ratio to +-20 before exp and the estimate to [-10, 10]; k1 and k2 are unclamped.
KL_MODES = {
    "kl": ("k1", None, None), "k1": ("k1", None, None),
    "abs": ("abs", None, None),
    "mse": ("k2", None, None), "k2": ("k2", None, None),
    "low_var_kl": ("k3", (-20.0, 20.0), (-10.0, 10.0)), "k3": ("k3", (-20.0, 20.0), (-10.0, 10.0)),
}
AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-sum-norm", "seq-mean-token-mean")


def kl_mode(name) -> tuple[str, Optional[tuple], Optional[tuple]]:
    """verl's ``kl_penalty`` mode name -> ``(estimator, clamp_input, clamp_output)`` for kl_kernels.
    A trailing ``"+"`` (verl's straight-through: same value, k2's gradient) maps to our ``"+"``
    estimators. ``"full"`` (the exact KL needs the logits, which the loss and ``apply_kl_penalty`` do not
    get: :func:`kl_penalty` computes it from logits) and unknown names raise ``NotImplementedError``, as in
    verl."""
    if not isinstance(name, str):
        raise TypeError(f"kl_penalty must be a mode name (str), got {type(name).__name__}")
    base, plus = (name[:-1], True) if name.endswith("+") else (name, False)
    if base == "full":
        raise NotImplementedError("kl_penalty='full' (the exact KL over the vocabulary) needs the logits, not "
                                  "per-token log-probs: call kl_kernels.integrations.verl.kl_penalty(logits, "
                                  "ref_logits, 'full') or kl_kernels.full_kl on the [..., V] logits")
    if base not in KL_MODES:
        raise NotImplementedError(f"kl_penalty mode {name!r} is not one of verl's: {', '.join(KL_MODES)} "
                                  "(each optionally with a trailing '+')")
    est, cin, cout = KL_MODES[base]
    if plus:
        est += "+"
    return est, cin, cout


def kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, kl_penalty) -> torch.Tensor:
    """verl's ``kl_penalty``: the per-token KL estimate for every element (no mask), in the inputs'
    dtype, differentiable w.r.t. both inputs. Computed by :func:`kl_kernels.kl_reward`.

    ``kl_penalty="full"``, which verl leaves unimplemented (its code notes that the inputs would then hold
    "the logits for every token in vocabulary"), is implemented: ``logprob`` and ``ref_logprob`` are the
    policy's and the reference's ``[..., V]`` logits (or log-probs: the softmax is the same), and the
    result, ``[...]``, is the exact ``KL(pi || pi_ref)`` over the vocabulary per token
    (:func:`kl_kernels.full_kl`, chunked: no ``[N, V]`` float32 copy), gradients to both."""
    if isinstance(kl_penalty, str) and kl_penalty == "full":
        for name, t in (("logprob", logprob), ("ref_logprob", ref_logprob)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a tensor of logits [..., V] for kl_penalty='full'")
        return full_kl(logprob, ref_logprob).to(logprob.dtype)
    est, clamp_in, clamp_out = kl_mode(kl_penalty)
    if not isinstance(logprob, torch.Tensor) or not isinstance(ref_logprob, torch.Tensor):
        raise TypeError("logprob and ref_logprob must be tensors")
    if logprob.shape != ref_logprob.shape:
        raise ValueError(f"logprob and ref_logprob must have the same shape, got {list(logprob.shape)} and "
                         f"{list(ref_logprob.shape)}")
    shape = logprob.shape
    # any shape: as one padded row of every element (every element counts)
    lp, ref = (logprob, ref_logprob) if logprob.dim() == 2 else (logprob.reshape(1, -1), ref_logprob.reshape(1, -1))
    out = kl_reward(lp, ref, coef=0.0, estimator=est, clamp_input=clamp_in, clamp_output=clamp_out, detach=False)
    return out.kl.reshape(shape)


def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor, inplace_backward: bool = True) -> torch.Tensor:
    """verl's ``verl.utils.torch_functional.logprobs_from_logits``: ``log_softmax(logits)[labels]``
    over the last dimension, float32, without an ``[N, V]`` float32 copy (:func:`kl_kernels.token_logprobs`,
    chunked). ``inplace_backward`` as verl's flash-attention path: the logits' gradient is written
    into the logits' storage (they are overwritten during backward; eager calls only); verl's torch
    fallback ignores the flag. Labels equal to -100 give 0 (verl's gather would fail on them)."""
    return token_logprobs(logits, labels, inplace_backward=bool(inplace_backward) and logits.requires_grad
                          and not torch.compiler.is_compiling()).log_probs


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """verl's ``entropy_from_logits``: the entropy of ``softmax(logits)`` over the last dimension,
    float32, chunked (:func:`kl_kernels.token_logprobs` with ``return_entropy=True``): every term
    ``p_j (logsumexp - z_j)`` is >= 0, where verl's ``logsumexp - sum(p * z)`` cancels at large logits."""
    labels = torch.zeros(logits.shape[:-1], dtype=torch.int64, device=logits.device)
    return token_logprobs(logits, labels, return_entropy=True).entropy


def _scale_of(loss_mask: torch.Tensor, loss_agg_mode: str, dp_size, batch_num_tokens, global_batch_size,
              loss_scale_factor):
    """verl 0.9.1's ``agg_loss`` as ``(our aggregation, factor)``: verl's loss is ours times the factor.
    Every denominator is at least 1 (an all-masked batch gives 0, not verl's 0/0)."""
    if loss_agg_mode not in AGG_MODES:
        raise ValueError(f"Invalid loss_agg_mode: {loss_agg_mode} (one of {', '.join(AGG_MODES)})")
    m = loss_mask.bool()
    if loss_agg_mode == "token-mean":
        if batch_num_tokens is None:
            if dp_size > 1:
                raise ValueError("(global) batch_num_tokens is required when dp_size > 1")
            batch_num_tokens = m.sum()
        return "sum", dp_size / at_least_one(batch_num_tokens)
    if loss_agg_mode == "token-sum":
        return "sum", dp_size
    if global_batch_size is None:
        if dp_size > 1:
            raise ValueError("global_batch_size is required when dp_size > 1")
        global_batch_size = (m.sum(-1) > 0).sum()
    seqs = at_least_one(global_batch_size)
    if loss_agg_mode == "seq-mean-token-mean":  # ours: sum_b S_b / (max(n_b, 1) * B)
        return "seq-mean-token-mean", m.shape[0] * dp_size / seqs
    factor = dp_size / seqs
    if loss_agg_mode == "seq-mean-token-sum-norm":
        factor = factor / (loss_scale_factor if loss_scale_factor is not None else m.shape[-1])
    return "sum", factor


def agg_loss(loss_mat: torch.Tensor, loss_mask: torch.Tensor, loss_agg_mode: str, dp_size: int = 1,
             batch_num_tokens: Optional[int] = None, global_batch_size: Optional[int] = None,
             loss_scale_factor: Optional[int] = None) -> torch.Tensor:
    """verl's ``agg_loss`` for any ``[B, T]`` loss matrix (torch ops: there is nothing to fuse in a
    masked sum). Modes: ``token-mean``, ``token-sum``, ``seq-mean-token-sum``,
    ``seq-mean-token-sum-norm``, ``seq-mean-token-mean``; ``dp_size``, ``batch_num_tokens``,
    ``global_batch_size`` and ``loss_scale_factor`` as verl's."""
    agg, factor = _scale_of(loss_mask, loss_agg_mode, dp_size, batch_num_tokens, global_batch_size,
                            loss_scale_factor)
    m = loss_mask.bool()
    masked = torch.where(m, loss_mat, torch.zeros((), dtype=loss_mat.dtype, device=loss_mat.device))
    if agg == "sum":
        return masked.sum() * factor
    per_seq = masked.sum(-1) / m.sum(-1).clamp_min(1)  # verl: / (count + 1e-8); empty rows add 0 either way
    return per_seq.sum() / m.shape[0] * factor


class ConfigTypeError(TypeError, AttributeError):
    """A plain ``dict`` where verl reads a config by attribute (``ActorConfig``, ``KLControlConfig``, an OmegaConf
    ``DictConfig``). verl's own function raises ``AttributeError`` there; this error is one too (what verl's
    callers catch) and a ``TypeError`` (a wrong argument type), so the same call fails the same way with either."""


def _config(config, name: str):
    """``config``, unless it is a plain dict (refused as verl refuses it: :class:`ConfigTypeError`)."""
    if isinstance(config, dict):
        raise ConfigTypeError(f"{name} must be verl's config object (e.g. verl.workers.config.ActorConfig, "
                              "verl.trainer.config.KLControlConfig, or an OmegaConf DictConfig), read by attribute "
                              f"as verl reads it; got a plain dict, which verl's own function refuses too "
                              "('dict' object has no attribute ...): wrap it, e.g. OmegaConf.create(d)")
    return config


def _get(config, key, default=None):
    if config is None:
        return default
    getter = getattr(config, "get", None)
    if callable(getter):
        try:
            return getter(key, default)
        except (TypeError, KeyError):
            pass
    return getattr(config, key, default)


def compute_policy_loss_vanilla(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
                                response_mask: torch.Tensor, loss_agg_mode: str = "token-mean", config=None,
                                rollout_is_weights: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, Any]]:
    """verl's registered ``"vanilla"`` PPO policy loss, fused: clipped objective (``clip_ratio``,
    ``clip_ratio_low``/``high``), dual clip (``clip_ratio_c``, default 3.0), ``rollout_is_weights``
    on the objective, aggregated as ``agg_loss`` with ``config.global_batch_info``. Returns
    ``(pg_loss, {"actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower"})`` (floats)."""
    loss, _, metrics = _policy_loss(old_log_prob, log_prob, None, advantages, response_mask, loss_agg_mode, config,
                                    rollout_is_weights)
    return loss, metrics


def compute_policy_loss_gspo(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
                             response_mask: torch.Tensor, loss_agg_mode: str = "seq-mean-token-mean", config=None,
                             rollout_is_weights: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, Any]]:
    """verl's registered ``"gspo"`` policy loss, fused (``importance_sampling_level="sequence"``): every
    token of a response takes its sequence's ratio ``exp(mean(log_prob - old_log_prob))`` over the
    response mask, clipped with ``clip_ratio_low``/``high`` (no dual clip, as verl), with verl's
    GSPO-token gradient; ``rollout_is_weights`` on the objective; ``agg_loss`` with
    ``config.global_batch_info`` (default ``"seq-mean-token-mean"``, as verl). Returns ``(pg_loss,
    {"actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower"})``, the last 0 as in verl.
    Deviation: verl clamps the sequence log-ratio at 10 from above (ours: +-20, as every ratio here),
    so a response whose mean log-ratio exceeds 10 differs."""
    loss, _, metrics = _policy_loss(old_log_prob, log_prob, None, advantages, response_mask, loss_agg_mode, config,
                                    rollout_is_weights, gspo=True)
    return loss, metrics


def compute_policy_loss_with_kl(old_log_prob: torch.Tensor, log_prob: torch.Tensor, ref_log_prob: torch.Tensor,
                                advantages: torch.Tensor, response_mask: torch.Tensor,
                                loss_agg_mode: str = "token-mean", config=None,
                                rollout_is_weights: torch.Tensor | None = None):
    """verl's actor loss with ``use_kl_loss`` in one fused pass: ``pg_loss + kl_loss * kl_loss_coef``
    where ``pg_loss`` is :func:`compute_policy_loss_vanilla`'s and ``kl_loss = agg_loss(kl_penalty(
    log_prob, ref_log_prob, config.kl_loss_type), response_mask, loss_agg_mode, **global_batch_info)``
    (verl's ``ppo_loss``; defaults ``kl_loss_coef=0.001``, ``kl_loss_type="low_var_kl"``). Returns
    ``(loss, metrics)`` with verl's policy metrics plus ``"actor/pg_loss"``, ``"actor/kl_loss"`` and
    ``"actor/kl_coef"`` (floats; the KL term is not weighted by ``rollout_is_weights``, as in verl)."""
    return _policy_loss(old_log_prob, log_prob, ref_log_prob, advantages, response_mask, loss_agg_mode, config,
                        rollout_is_weights)[::2]


def _policy_loss(old_log_prob, log_prob, ref_log_prob, advantages, response_mask, loss_agg_mode, config,
                 rollout_is_weights, gspo=False):
    """(loss, fused output, metrics) of verl's vanilla (or ``gspo``) policy loss, plus its KL loss with a
    reference."""
    if config is None:
        raise ValueError(f"compute_policy_loss_{'gspo' if gspo else 'vanilla'} needs the actor config (clip_ratio, "
                         "clip_ratio_c, ...)")
    _config(config, "config")
    clip_ratio = _get(config, "clip_ratio")
    low = _get(config, "clip_ratio_low")
    high = _get(config, "clip_ratio_high")
    low = clip_ratio if low is None else low
    high = clip_ratio if high is None else high
    if low is None or high is None:
        raise ValueError("config.clip_ratio (or clip_ratio_low and clip_ratio_high) must be set")
    clip_c = None if gspo else _get(config, "clip_ratio_c", 3.0)  # verl's GSPO has no dual clip
    if clip_c is not None and not clip_c > 1.0:
        raise ValueError("The lower bound of the clip_ratio_c for dual-clip PPO should be greater than 1.0, but get "
                         f"the value: {clip_c}.")
    info = dict(_get(config, "global_batch_info", None) or {})
    agg, factor = _scale_of(response_mask, loss_agg_mode, **{k: info.get(k, d) for k, d in (
        ("dp_size", 1), ("batch_num_tokens", None), ("global_batch_size", None), ("loss_scale_factor", None))})
    mask = response_mask.bool()
    kl = dict(beta=0.0, estimator="k1")  # no KL term: k1 to the old policy gives ppo_kl as kl_mean
    if ref_log_prob is not None:
        coef = _get(config, "kl_loss_coef", 0.001)
        est, clamp_in, clamp_out = kl_mode(_get(config, "kl_loss_type", "low_var_kl"))
        kl = dict(ref_log_probs=ref_log_prob, beta=float(coef), estimator=est, clamp_input=clamp_in,
                  clamp_output=clamp_out)
    out = kl_penalty_loss(log_prob, old_log_prob, advantages, mask=mask, clip_epsilon=(float(low), float(high)),
                          dual_clip=None if clip_c is None else float(clip_c), weights=rollout_is_weights,
                          aggregation=agg, importance_sampling_level="sequence" if gspo else "token", **kl)
    with torch.no_grad():  # the one metric the fused pass does not count: the dual clip's share
        if clip_c is None:
            lower = torch.zeros((), device=log_prob.device)
        else:
            # in float32, as the kernels decide it (in bf16 a tie by rounding would hide a cap the loss took)
            ratio = torch.exp(torch.clamp(log_prob.detach().float() - old_log_prob.float(), -20.0, 20.0))
            adv = advantages.float()
            c1 = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1 - low, 1 + high))
            lower = ((c1 > -adv * clip_c) & (adv < 0) & mask).sum() / mask.sum().clamp_min(1)
        ppo_kl = out.kl_mean if ref_log_prob is None else (-torch.clamp(log_prob.detach() - old_log_prob, -20.0, 20.0)
                                                            ).where(mask, 0).sum() / mask.sum().clamp_min(1)
    metrics = {"actor/pg_clipfrac": out.clip_fraction.item(), "actor/ppo_kl": ppo_kl.item(),
               "actor/pg_clipfrac_lower": lower.item()}
    if ref_log_prob is not None:
        metrics.update({"actor/pg_loss": float(out.loss_objective * factor), "actor/kl_loss": float(
            out.loss_kl * factor / kl["beta"]) if kl["beta"] else 0.0, "actor/kl_coef": kl["beta"]})
    return out.loss * factor, out, metrics


class AdaptiveKLController(ProportionalValue):
    """verl's adaptive controller (Ziegler et al.): ``value *= 1 + clip(current_kl / target_kl - 1,
    -0.2, 0.2) * n_steps / horizon``, through :class:`kl_kernels.ZieglerKLController` (float32)."""

    def __init__(self, init_kl_coef, target_kl, horizon):
        super().__init__(init_kl_coef, target_kl, horizon)

    def update(self, current_kl, n_steps):
        self._update(current_kl, n_steps)


class FixedKLController(FixedValue):
    """verl's fixed controller: ``value`` never changes."""

    def update(self, current_kl, n_steps):
        pass


def get_kl_controller(kl_ctrl):
    """verl's factory: ``kl_ctrl.type`` ``"fixed"`` or ``"adaptive"`` (``kl_coef``, ``target_kl``, ``horizon``)."""
    kind = _get(_config(kl_ctrl, "kl_ctrl"), "type")
    if kind == "fixed":
        return FixedKLController(kl_coef=_get(kl_ctrl, "kl_coef"))
    if kind == "adaptive":
        horizon = _get(kl_ctrl, "horizon")
        if not horizon > 0:
            raise ValueError(f"horizon must be larger than 0. Got {horizon}")
        return AdaptiveKLController(init_kl_coef=_get(kl_ctrl, "kl_coef"), target_kl=_get(kl_ctrl, "target_kl"),
                                    horizon=horizon)
    raise NotImplementedError(f"kl_ctrl.type must be 'fixed' or 'adaptive', got {kind!r}")


def apply_kl_penalty(data, kl_ctrl, kl_penalty="kl"):
    """verl's ``apply_kl_penalty``: ``token_level_rewards = token_level_scores - beta * kl`` at the
    response tokens (``beta = kl_ctrl.value`` before the update), then ``kl_ctrl.update`` with the
    batch's mean per-sequence KL. ``data.batch`` (a verl ``DataProto``'s, or any dict-like) holds
    ``response_mask``, ``token_level_scores``, ``old_log_probs`` and ``ref_log_prob``; returns
    ``(data, metrics)`` as verl does. One fused :func:`kl_kernels.kl_reward` call."""
    batch = data.batch
    mask = batch["response_mask"]
    est, clamp_in, clamp_out = kl_mode(kl_penalty)
    beta = kl_ctrl.value
    out = kl_reward(batch["old_log_probs"], batch["ref_log_prob"], batch["token_level_scores"], coef=float(beta),
                    estimator=est.rstrip("+"), mask=mask.bool(), clamp_input=clamp_in, clamp_output=clamp_out,
                    reward_placement="token")
    batch["token_level_rewards"] = out.reward
    current_kl = (out.kl_sum / (out.count + 1e-8)).mean().item()
    kl_ctrl.update(current_kl=current_kl, n_steps=mask.shape[0])
    return data, {"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": beta}


def register(name: str = "kl_kernels", *, override_vanilla: bool = False, override_gspo: bool = False) -> list[str]:
    """Register :func:`compute_policy_loss_vanilla` in verl's policy-loss registry under ``name`` and
    :func:`compute_policy_loss_gspo` under ``name + "_gspo"`` (and under verl's own ``"vanilla"`` /
    ``"gspo"`` with ``override_vanilla`` / ``override_gspo``), so that a verl config selects them with
    ``actor_rollout_ref.actor.policy_loss.loss_mode=<name>``. Needs verl; returns the names."""
    try:
        from verl.trainer.ppo import core_algos
    except ImportError as exc:
        raise ImportError(f"kl_kernels.integrations.verl.register needs verl installed ({exc})") from exc
    plan = [(name, compute_policy_loss_vanilla), (f"{name}_gspo", compute_policy_loss_gspo)]
    if override_vanilla and name != "vanilla":
        plan.append(("vanilla", compute_policy_loss_vanilla))
    if override_gspo:
        plan.append(("gspo", compute_policy_loss_gspo))
    for n, fn in plan:
        core_algos.register_policy_loss(n)(fn)
    return [n for n, _ in plan]


# ----------------------------------------------------------------------------------- verl's fused kernels
# verl 0.9.1's patched forwards (verl/models/transformers/dense_common.py and the VLM modules: qwen2_vl, qwen3_vl,
# glm4v, qwen3_5) look both functions up at call time, in these two modules: replacing the names there reroutes
# every forward that apply_monkey_patch installed, before or after this patch.
VERL_FUSED_VERSIONS = ("0.9.1",)  # the verl versions whose lookups the patch_* switches were checked against
_TORCH_MODULE = "verl.utils.experimental.torch_functional"
_TRITON_MODULE = "verl.utils.kernel.linear_cross_entropy"
_SWITCHES = Switches()
_WARNED: set = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(message, stacklevel=3)


def _head_inputs(hidden, weight):
    """``(hidden, weight)`` as verl's ``hidden @ weight.T`` sees them: under autocast (verl's FSDP engine runs
    the forward in ``torch.autocast``), both in the autocast dtype, as the matmul would cast them."""
    dev = hidden.device.type
    if torch.is_autocast_enabled(dev):
        dtype = torch.get_autocast_dtype(dev)
        return hidden.to(dtype), weight.to(dtype)
    return hidden, weight


class FusedLinearForPPO(torch.nn.Module):
    """verl's ``FusedLinearForPPO`` (``fused_kernels_backend="torch"``) computed by
    :func:`kl_kernels.linear_token_logprobs`: ``forward(hidden_states [*S, H], vocab_weights [V, H], input_ids
    [*S], temperature=1.0) -> (log_probs [*S] float32, entropy [*S] in hidden_states' dtype)`` of
    ``softmax(hidden_states @ vocab_weights.T / temperature)``, gradients to both, as verl's. ``chunk_size`` is
    verl's argument, kept for its signature (ours chooses its own chunks). ``impl_backend="liger"`` (verl's
    Liger route) is handed to verl's own class, with one warning.

    Example (verl not needed)::

        >>> import torch
        >>> from kl_kernels.integrations.verl import FusedLinearForPPO
        >>> h, w = torch.randn(2, 3, 8, requires_grad=True), torch.randn(10, 8, requires_grad=True)
        >>> lp, ent = FusedLinearForPPO()(h, w, torch.randint(0, 10, (2, 3)), temperature=0.7)
        >>> lp.shape, lp.dtype, ent.dtype
        (torch.Size([2, 3]), torch.float32, torch.float32)
        >>> (lp.sum() + ent.sum()).backward()
    """

    def __init__(self, chunk_size: int = 512, impl_backend: str = "torch"):
        super().__init__()
        if impl_backend not in ("torch", "liger"):
            raise ValueError(f"Unsupported FusedLinearForPPO backend: {impl_backend}. Choose 'torch' or 'liger'.")
        self.chunk_size = chunk_size
        self.impl_backend = impl_backend

    def forward(self, hidden_states, vocab_weights, input_ids, temperature=1.0):
        if self.impl_backend == "liger":
            original = _SWITCHES.original("fused_kernels", _TORCH_MODULE, "FusedLinearForPPO")
            if original is None:
                raise RuntimeError("impl_backend='liger' is verl's Liger route: it runs verl's own class, which "
                                   "patch_fused_kernels keeps only while verl is patched")
            _warn_once("liger", "kl_kernels.integrations.verl: fused_kernels_backend='liger' is left to verl's own "
                                "FusedLinearForPPO (Liger-Kernel); 'torch' and 'triton' run kl_kernels")
            return original(chunk_size=self.chunk_size, impl_backend="liger").forward(
                hidden_states, vocab_weights, input_ids, temperature)
        h, w = _head_inputs(hidden_states, vocab_weights)
        out = linear_token_logprobs(h, w, input_ids.to(torch.int64), temperature=temperature, return_entropy=True)
        return out.log_probs, out.entropy.to(hidden_states.dtype)


def linear_cross_entropy(hidden, weight, labels, temperature: float = 1.0, reduction: str = "none",
                         dist_process_group=None):
    """verl's ``linear_cross_entropy`` (``fused_kernels_backend="triton"``: NVIDIA's Triton kernel, CUDA only,
    ``H % 128 == 0``) computed by :func:`kl_kernels.linear_token_logprobs`, on any device and width: ``hidden
    [*S, H]``, ``weight [V, H]``, ``labels [*S]`` -> ``(log_probs [N], entropy [N])``, float32, flattened as
    verl's. ``reduction`` other than ``"none"`` and a ``dist_process_group`` (Megatron's vocabulary split) are
    handed to verl's own function, with one warning.

    Example (verl not needed)::

        >>> import torch
        >>> from kl_kernels.integrations.verl import linear_cross_entropy
        >>> lp, ent = linear_cross_entropy(torch.randn(1, 5, 8), torch.randn(10, 8), torch.randint(0, 10, (1, 5)), 0.7)
        >>> lp.shape, ent.shape
        (torch.Size([5]), torch.Size([5]))
    """
    if reduction != "none" or dist_process_group is not None:
        what = f"reduction={reduction!r}" if reduction != "none" else "dist_process_group"
        original = _SWITCHES.original("fused_kernels", _TRITON_MODULE, "linear_cross_entropy")
        if original is None:
            raise NotImplementedError(f"linear_cross_entropy: {what} is verl's own kernel's (not patched now)")
        _warn_once(f"lce-{what}", f"kl_kernels.integrations.verl.linear_cross_entropy: {what} is left to verl's own "
                                  "Triton kernel")
        return original(hidden, weight, labels, temperature, reduction, dist_process_group)
    h, w = _head_inputs(hidden, weight)
    out = linear_token_logprobs(h.reshape(-1, h.shape[-1]), w, labels.reshape(-1).to(torch.int64),
                                temperature=temperature, return_entropy=True)
    return out.log_probs, out.entropy


def _verl_modules(switch: str, *names: str):
    """The modules a switch patches, imported, after the version check."""
    try:
        import verl
        modules = [importlib.import_module(n) for n in names]
    except ImportError as exc:
        raise ImportError(f"kl_kernels.integrations.verl.{switch} needs verl installed with what these modules "
                          f"import ({exc})") from exc
    version = getattr(verl, "__version__", None)
    if version not in VERL_FUSED_VERSIONS:
        raise RuntimeError(f"{switch} is checked against verl {', '.join(VERL_FUSED_VERSIONS)}, found verl "
                           f"{version}: its code may look these functions up elsewhere")
    return modules



def patch_fused_kernels() -> Switch:
    """Route verl's ``use_fused_kernels=True`` through kl_kernels: verl's ``FusedLinearForPPO``
    (``fused_kernels_backend="torch"``) and ``linear_cross_entropy`` (``"triton"``, which then also runs without
    a GPU and at any hidden width) are replaced, in the modules verl's patched forwards look them up in, by
    :class:`FusedLinearForPPO` and :func:`linear_cross_entropy` of this module (one
    :func:`kl_kernels.linear_token_logprobs` call each). Call it before or after verl's ``apply_monkey_patch``,
    in every process that runs the model (verl's workers: e.g. at the top of a custom worker or ``main``).
    Idempotent; :func:`unpatch_fused_kernels` restores verl's, and so does leaving ``with
    patch_fused_kernels():``. Checked for verl 0.9.1 (another version raises ``RuntimeError``). Megatron's
    forwards (``verl.models.mcore``, which bind ``linear_cross_entropy`` at import and pass a tensor-parallel
    group) are not rerouted."""
    torch_functional, lce = _verl_modules("patch_fused_kernels", _TORCH_MODULE, _TRITON_MODULE)
    return _SWITCHES.apply("fused_kernels", [(torch_functional, "FusedLinearForPPO", FusedLinearForPPO),
                                    (lce, "linear_cross_entropy", linear_cross_entropy)])


def unpatch_fused_kernels() -> None:
    """Undo :func:`patch_fused_kernels` (nothing when not patched)."""
    _SWITCHES.undo("fused_kernels")


_LOSSES_MODULE = "verl.workers.utils.losses"
_REWARD_MODULES = ("verl.trainer.ppo.ray_trainer", "verl.trainer.ppo.v1.trainer_base",
                   "verl.experimental.separation.ray_trainer")


def patch_kl_loss() -> Switch:
    """The actor's KL loss (``actor.use_kl_loss=True``, every ``kl_loss_type``) through kl_kernels: verl 0.9.1's
    ``ppo_loss`` (``verl/workers/utils/losses.py``) computes ``kl_penalty(log_prob, ref_log_prob,
    config.kl_loss_type)`` with the name it imported from ``core_algos``; that name is set to :func:`kl_penalty`
    (one :func:`kl_kernels.kl_reward` pass, values and gradients as verl's). The aggregation and the policy loss
    are verl's (the policy loss: :func:`register`). Call it in every process that computes the actor's loss.
    Idempotent; :func:`unpatch_kl_loss` or leaving ``with patch_kl_loss():`` restores verl's."""
    (losses,) = _verl_modules("patch_kl_loss", _LOSSES_MODULE)
    return _SWITCHES.apply("kl_loss", [(losses, "kl_penalty", kl_penalty)])


def unpatch_kl_loss() -> None:
    """Undo :func:`patch_kl_loss`."""
    _SWITCHES.undo("kl_loss")


def patch_kl_reward() -> Switch:
    """The KL in the reward (``algorithm.use_kl_in_reward=True``) through kl_kernels: verl 0.9.1's trainers call
    ``apply_kl_penalty(data, kl_ctrl, kl_penalty)`` from ``verl.trainer.ppo.ray_trainer`` (``RayPPOTrainer``,
    which this imports) and from the modules that imported it from there (``v1.trainer_base``,
    ``experimental.separation.ray_trainer``, set where already imported; imported later, they take this one);
    each is set to :func:`apply_kl_penalty` (one fused :func:`kl_kernels.kl_reward` pass; verl's controllers and
    ``DataProto`` as they are). Call it in the driver before the trainer starts. Idempotent;
    :func:`unpatch_kl_reward` or leaving ``with patch_kl_reward():`` restores verl's."""
    (trainer,) = _verl_modules("patch_kl_reward", _REWARD_MODULES[0])
    modules = [trainer] + [sys.modules[n] for n in _REWARD_MODULES[1:] if n in sys.modules]
    return _SWITCHES.apply("kl_reward", [(m, "apply_kl_penalty", apply_kl_penalty) for m in modules])


def unpatch_kl_reward() -> None:
    """Undo :func:`patch_kl_reward`."""
    _SWITCHES.undo("kl_reward")


def patch() -> None:
    """Every verl switch at once, for a process of verl's: :func:`patch_fused_kernels`, :func:`patch_kl_loss`,
    :func:`patch_kl_reward` and :func:`register` (the policy loss under ``"kl_kernels"``, chosen by
    ``actor_rollout_ref.actor.policy_loss.loss_mode=kl_kernels``). verl's workers and its trainer's ``TaskRunner``
    are Ray actors: run it in each through Ray's setup hook, from verl's own config,
    ``+ray_kwargs.ray_init.runtime_env.worker_process_setup_hook=kl_kernels.integrations.verl.patch``.
    :func:`unpatch` turns the three switches off (the registered name stays). All or nothing: when one switch
    cannot be turned on, those this call turned on are turned off again before the error propagates."""
    made = []
    try:
        for switch in (patch_fused_kernels, patch_kl_loss, patch_kl_reward):
            handle = switch()
            if handle.made:
                made.append(handle.name)
        register()
    except BaseException:
        for name in made:
            _SWITCHES.undo(name)
        raise


def unpatch() -> None:
    """Turn off what :func:`patch` turned on (verl's registry keeps the added ``"kl_kernels"`` names)."""
    for name in ("fused_kernels", "kl_loss", "kl_reward"):
        _SWITCHES.undo(name)


__all__ = ["KL_MODES", "AGG_MODES", "ConfigTypeError", "kl_mode", "kl_penalty", "agg_loss", "compute_policy_loss_vanilla",
           "compute_policy_loss_gspo", "compute_policy_loss_with_kl",
           "AdaptiveKLController", "FixedKLController", "get_kl_controller", "apply_kl_penalty", "register",
           "FusedLinearForPPO", "linear_cross_entropy", "patch_fused_kernels", "unpatch_fused_kernels",
           "patch_kl_loss", "unpatch_kl_loss", "patch_kl_reward", "unpatch_kl_reward", "patch", "unpatch"]
