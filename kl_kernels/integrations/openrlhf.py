"""OpenRLHF 0.11.2 drop-ins: ``compute_approx_kl``, ``compute_reward``, ``masked_mean``, the KL
controllers, ``PolicyLoss`` (``policy_loss_type="ppo"`` and ``"gspo"``), and the actor's ``log_probs_from_logits`` /
``compute_entropy``, with OpenRLHF's names, signatures and defaults, computed by kl_kernels' fused ops where there
is KL, log-prob or loss math to fuse. :func:`patch` is the one switch that puts them where OpenRLHF's actor,
experience maker and PPO trainer look them up.

OpenRLHF is not needed to import this module. Tensors are OpenRLHF's ``[B, T]`` action-aligned
ones with an ``action_mask`` (bool or 0/1; read as bool). Deviations, all deliberate
(``python_api/integrations.md``): an all-masked batch gives a loss of 0 where OpenRLHF divides 0 by
0 (NaN); ``PolicyLoss``'s GSPO log-ratio is clamped to +-20.

Example::

    >>> import torch
    >>> from kl_kernels.integrations import openrlhf as ko
    >>> ko.compute_approx_kl(torch.tensor([[-1.0, -30.0]]), torch.tensor([[-1.5, -2.0]]), kl_estimator="k1")
    tensor([[  0.5000, -10.0000]])
"""

from __future__ import annotations

import importlib
import importlib.metadata
import sys

import torch

from ..kl_penalty import kl_penalty_loss
from ..kl_reward import kl_reward
from ..token_logprobs import token_logprobs
from ._common import (FixedValue, ProportionalValue, Switch, Switches, at_least_one, gradient_through_sequence_mean,
                      rewrite_gradient)

KL_IS_WEIGHT_CLIP = 10.0  # OpenRLHF's cap on exp(lp - old) in the unbiased KL gradient
# OpenRLHF's estimators -> (ours, clamp_input, clamp_output): every estimate is clamped to [-10, 10],
# and k3 clamps its log-ratio from below at -10 first.
KL_ESTIMATORS = {"k1": ("k1", None, (-10.0, 10.0)), "k2": ("k2", None, (-10.0, 10.0)),
                 "k3": ("k3", (-10.0, None), (-10.0, 10.0))}


def compute_approx_kl(log_probs: torch.Tensor, log_probs_base: torch.Tensor, log_probs_old: torch.Tensor | None = None,
                      kl_estimator: str = "k1", unbiased_gradient: bool = False) -> torch.Tensor:
    """OpenRLHF's ``compute_approx_kl``: the per-token KL estimate of ``log_probs`` against
    ``log_probs_base`` in float32 (inputs upcast, as OpenRLHF), clamped to [-10, 10] (k3 also clamps
    the log-ratio at -10 first). ``unbiased_gradient``: same value, gradient ``w * (lp - base)`` with
    ``w = min(exp(lp - old), 10)`` (1 without ``log_probs_old``). One fused kl_reward call."""
    if kl_estimator not in KL_ESTIMATORS:
        raise ValueError(f"Invalid kl_estimator: {kl_estimator} (one of {', '.join(KL_ESTIMATORS)})")
    est, clamp_in, clamp_out = KL_ESTIMATORS[kl_estimator]
    if unbiased_gradient:
        est += "+"  # straight-through: the value of est, the gradient of k2 on the unclamped log-ratio
    lp, base = log_probs.float(), log_probs_base.float()
    if lp.shape != base.shape:
        raise ValueError(f"log_probs and log_probs_base must have the same shape, got {list(lp.shape)} and "
                         f"{list(base.shape)}")
    shape = lp.shape
    lp2, base2 = (lp, base) if lp.dim() == 2 else (lp.reshape(1, -1), base.reshape(1, -1))
    kl = kl_reward(lp2, base2, coef=0.0, estimator=est, clamp_input=clamp_in, clamp_output=clamp_out,
                   detach=False).kl.reshape(shape)
    if unbiased_gradient and log_probs_old is not None:
        w = torch.exp(log_probs.float().detach() - log_probs_old.float()).clamp(max=KL_IS_WEIGHT_CLIP)
        kl = rewrite_gradient(kl, torch.mul, w)  # the gradient times w (data)
    return kl


def compute_reward(r, kl_coef: float, kl, action_mask=None, reward_clip_range=None) -> torch.Tensor:
    """OpenRLHF's ``compute_reward``: ``-kl_coef * kl`` at every position (``kl`` as given, e.g. from
    :func:`compute_approx_kl`) plus the sequence reward ``r`` (clipped to ``reward_clip_range``) at
    the last position where ``action_mask`` is non-zero (the last column for an all-zero row).
    Plain torch ops: ``kl`` is already computed, so there is nothing to fuse."""
    if action_mask is None:
        raise ValueError("compute_reward needs action_mask (OpenRLHF places the reward at its last non-zero entry)")
    kl_coef = max(float(kl_coef), 0.0)
    if reward_clip_range:
        r = r.clamp(min=reward_clip_range[0], max=reward_clip_range[1])
    kl_reward_ = -kl_coef * kl
    width = action_mask.size(1)
    eos = width - 1 - action_mask.long().fliplr().argmax(dim=1, keepdim=True)
    return torch.zeros_like(kl).scatter_(dim=1, index=eos, src=r.unsqueeze(1).to(kl.dtype)) + kl_reward_


def masked_mean(tensor: torch.Tensor, mask: torch.Tensor | None, dim: int = None) -> torch.Tensor:
    """OpenRLHF's ``masked_mean``: ``(tensor * mask).sum(dim) / mask.sum(dim)`` (plain mean without
    a mask), except that an empty mask gives 0 instead of 0 / 0."""
    if mask is None:
        return tensor.mean(dim) if dim is not None else tensor.mean()
    num = (tensor * mask).sum(dim) if dim is not None else (tensor * mask).sum()
    den = mask.sum(dim) if dim is not None else mask.sum()
    return num / den.clamp_min(1)


class AdaptiveKLController(ProportionalValue):
    """OpenRLHF's adaptive controller: ``value *= 1 + clip(current / target - 1, -0.2, 0.2) *
    n_steps / horizon`` (:class:`kl_kernels.ZieglerKLController`)."""

    def update(self, current, n_steps):
        self._update(current, n_steps)


class FixedKLController(FixedValue):
    """OpenRLHF's fixed controller."""

    def update(self, current, n_steps):
        pass


class PolicyLoss(torch.nn.Module):
    """OpenRLHF's ``PolicyLoss`` for ``policy_loss_type="ppo"`` and ``"gspo"``, fused
    (:func:`kl_kernels.kl_penalty_loss`): clipped objective with ``clip_eps_low``/``clip_eps_high``,
    optional dual clip, token-level (``token_level_loss=True``) or sequence-level mean, OpenRLHF's
    ``dp_size`` / ``batch_num_tokens`` / ``global_batch_size`` normalisers. ``"gspo"``: every token
    takes its sequence's ratio ``exp(mean log-ratio)`` over the action mask
    (``importance_sampling_level="sequence"``) and the loss is the sequence-level mean, as OpenRLHF
    forces; the gradient is OpenRLHF's, through the sequence mean, per-token advantages included
    (:func:`~kl_kernels.integrations._common.gradient_through_sequence_mean`). Deviation: the
    log-ratio is clamped to +-20 (OpenRLHF's GSPO ratio is not). The importance-sampling correction
    (``is_correction_level`` ``"token"``/``"seq"``, ``is_correction_mode``, ``is_correction_gating``,
    ``is_correction_threshold``; ``forward(..., rollout_log_probs=...)``): for ``"ppo"``, OpenRLHF's
    per-token weight computed with its formulas (torch ops on data: no gradient) and applied by the
    fused loss as ``weights``; for ``"gspo"``, the ratio to the rollout policy, as OpenRLHF.
    ``forward`` returns OpenRLHF's 5-tuple ``(loss, clip_ratio, ppo_kl, vllm_kl, is_filter_ratio)``
    (the last two ``None`` without a PPO correction)."""

    def __init__(self, clip_eps_low: float = 0.2, clip_eps_high: float = 0.2, dual_clip: float = None,
                 token_level_loss: bool = True, policy_loss_type: str = "ppo", is_correction_level: str = "off",
                 is_correction_mode: str = "mask", is_correction_gating: str = "ratio",
                 is_correction_threshold=(0.5, 5.0)) -> None:
        super().__init__()
        if policy_loss_type not in ("ppo", "gspo"):
            raise ValueError(f"Invalid policy loss type: {policy_loss_type}")
        if policy_loss_type == "gspo":
            token_level_loss = False  # as OpenRLHF: GSPO's loss is a mean per sequence
        if dual_clip is not None and not dual_clip > 1.0:
            raise ValueError(f"dual_clip must be > 1.0, got {dual_clip}")
        # OpenRLHF's checks of the importance-sampling correction's options, in its words
        if is_correction_level not in {"off", "token", "seq"}:
            raise ValueError(f"is_correction_level must be off/token/seq, got {is_correction_level}")
        if is_correction_mode not in {"mask", "clip"}:
            raise ValueError(f"is_correction_mode must be mask/clip, got {is_correction_mode}")
        if is_correction_gating not in {"ratio", "binary_kl", "tv"}:
            raise ValueError(f"is_correction_gating must be ratio/binary_kl/tv, got {is_correction_gating}")
        if is_correction_mode == "clip" and (is_correction_level == "seq" or is_correction_gating != "ratio"):
            raise ValueError("is_correction_mode=clip requires is_correction_level=token and is_correction_gating=ratio")
        if is_correction_gating != "ratio" and is_correction_level != "off" and is_correction_threshold[0] > 0:
            raise ValueError(f"is_correction_gating={is_correction_gating} takes an upper bound only (a single delta)")
        self.clip_eps_low, self.clip_eps_high = clip_eps_low, clip_eps_high
        self.dual_clip = dual_clip
        self.token_level_loss = token_level_loss
        self.policy_loss_type = policy_loss_type
        self.is_correction_level = is_correction_level
        self.is_correction_mode = is_correction_mode
        self.is_correction_gating = is_correction_gating
        self.is_correction_threshold = is_correction_threshold

    def _correction(self, old_log_probs, rollout_log_probs, mask):
        """OpenRLHF's importance-sampling correction of the PPO loss (its formulas): the per-token weight
        ``coef`` (data: from the detached old and rollout log-probs), ``vllm_kl`` and ``is_filter_ratio``."""
        def mean(x, dim=None):  # OpenRLHF's masked_mean (0 / 0 on an empty row, as there)
            m = mask.to(x.dtype)
            return (x * m).sum(dim) / m.sum(dim) if dim is not None else (x * m).sum() / m.sum()

        low, high = self.is_correction_threshold
        seq_level = self.is_correction_level == "seq"
        with torch.no_grad():  # in float32 at least (OpenRLHF: the inputs' dtype; bf16 gates would flip early)
            old_log_probs = old_log_probs.detach().to(torch.promote_types(old_log_probs.dtype, torch.float32))
            rollout_log_probs = rollout_log_probs.detach().to(old_log_probs.dtype)
            is_log_ratio = old_log_probs - rollout_log_probs
            token_is = is_log_ratio.exp()
            if self.is_correction_gating == "ratio":
                stat = (mean(is_log_ratio, -1).unsqueeze(-1) if seq_level else is_log_ratio).exp()
            else:
                p = rollout_log_probs.exp().clamp(1e-6, 1 - 1e-6)
                q = old_log_probs.exp().clamp(1e-6, 1 - 1e-6)
                if self.is_correction_gating == "binary_kl":
                    stat = p * (p / q).log() + (1 - p) * ((1 - p) / (1 - q)).log()
                else:  # tv
                    stat = (p - q).abs()
                if seq_level:
                    stat = mean(stat, -1).unsqueeze(-1)
            if self.is_correction_mode == "clip":
                coef = stat.clamp(min=low, max=high)
                filtered = (stat < low) | (stat > high)
            else:
                keep = (stat >= low) & (stat <= high)
                coef = torch.where(keep, token_is, 0.0)
                filtered = ~keep
            is_filter_ratio = filtered.float().mean() if seq_level else mean(filtered.float())
            vllm_kl = mean(rollout_log_probs - old_log_probs)
        return coef.expand(old_log_probs.shape), vllm_kl, is_filter_ratio

    def forward(self, log_probs, old_log_probs, advantages, action_mask=None, rollout_log_probs=None, dp_size=1,
                batch_num_tokens=None, global_batch_size=None):
        mask = torch.ones(log_probs.shape, dtype=torch.bool, device=log_probs.device) if action_mask is None \
            else action_mask.bool()
        if self.token_level_loss:
            if batch_num_tokens is None:
                agg, factor = "token-mean", 1.0
            else:
                agg, factor = "sum", dp_size / at_least_one(batch_num_tokens)
        else:  # ours: sum_b S_b / (max(n_b, 1) * B); OpenRLHF: over the non-empty rows (or global_batch_size)
            agg = "seq-mean-token-mean"
            if global_batch_size is None:
                factor = mask.shape[0] / at_least_one((mask.sum(-1) > 0).sum())
            else:
                factor = mask.shape[0] * dp_size / at_least_one(global_batch_size)
        correcting = self.is_correction_level != "off"
        if correcting and rollout_log_probs is None:
            raise ValueError(f"is_correction_level={self.is_correction_level!r} needs rollout_log_probs")
        weights = vllm_kl = is_filter_ratio = None
        base = old_log_probs
        if self.policy_loss_type == "gspo":  # OpenRLHF differentiates through the sequence mean (no KL term here)
            if correcting:  # its GSPO ratio is then to the rollout policy, without a weight
                base = rollout_log_probs
            if log_probs.dtype in (torch.bfloat16, torch.float16):  # average float32 gradients, not bf16-rounded ones
                log_probs, base = log_probs.float(), base.float()
            log_probs = gradient_through_sequence_mean(log_probs, mask)
        elif correcting:
            weights, vllm_kl, is_filter_ratio = self._correction(old_log_probs, rollout_log_probs, mask)
        out = kl_penalty_loss(log_probs, base, advantages, beta=0.0, estimator="k1", mask=mask,
                              clip_epsilon=(self.clip_eps_low, self.clip_eps_high), dual_clip=self.dual_clip,
                              aggregation=agg, weights=weights,
                              importance_sampling_level="sequence" if self.policy_loss_type == "gspo" else "token")
        if base is old_log_probs:  # ppo_kl = mean of old - lp over the mask: the fused k1 diagnostic
            ppo_kl = out.kl_mean
        else:
            ppo_kl = (old_log_probs - log_probs.detach()).where(mask, 0).sum() / mask.sum().clamp_min(1)
        return out.loss * factor, out.clip_fraction, ppo_kl, vllm_kl, is_filter_ratio


def log_probs_from_logits(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """OpenRLHF's ``log_probs_from_logits``: ``log_softmax(logits / temperature)`` at ``labels`` over the last
    dimension, in the logits' dtype (OpenRLHF's ``Actor`` casts them to float32 first), by
    :func:`kl_kernels.token_logprobs` (no ``[N, V]`` copy; gradients to the logits). Deviation: OpenRLHF divides
    ``logits`` in place by a ``temperature`` other than 1; ours never modifies its input (the ``Actor`` passes none:
    it scales its logits itself).

    Example::

        >>> import torch
        >>> from kl_kernels.integrations.openrlhf import compute_entropy, log_probs_from_logits
        >>> logits = torch.tensor([[[2.0, 0.0, 0.0], [0.0, 0.0, 0.0]]])
        >>> log_probs_from_logits(logits, torch.tensor([[0, 2]]))
        tensor([[-0.2395, -1.0986]])
        >>> compute_entropy(logits)
        tensor([[0.6656, 1.0986]])
    """
    return token_logprobs(logits, labels, temperature=temperature).log_probs.to(logits.dtype)


def compute_entropy(logits: torch.Tensor) -> torch.Tensor:
    """OpenRLHF's ``compute_entropy``: the entropy of ``softmax(logits)`` over the last dimension, in the logits'
    dtype, by :func:`kl_kernels.token_logprobs` (``return_entropy=True``: each term ``p_j (lse - z_j) >= 0``,
    no ``[N, V]`` softmax kept)."""
    labels = torch.zeros(logits.shape[:-1], dtype=torch.int64, device=logits.device)
    return token_logprobs(logits, labels, return_entropy=True).entropy.to(logits.dtype)


OPENRLHF_VERSIONS = ("0.11.2",)  # the OpenRLHF versions whose lookups patch() was checked against
# Where OpenRLHF 0.11.2 defines or binds each name: the defining modules (set always: a module imported later binds
# ours) and the trainer's modules that bound them at their import (set when already imported).
_DEFINED = {"openrlhf.models.utils": ("compute_approx_kl", "compute_reward", "log_probs_from_logits",
                                     "compute_entropy"),
            "openrlhf.models.actor": ("log_probs_from_logits", "compute_entropy"),
            "openrlhf.models.loss": ("PolicyLoss",), "openrlhf.models": ("PolicyLoss",)}
_BOUND = {"openrlhf.trainer.ppo_utils.experience_maker": ("compute_approx_kl", "compute_reward"),
          "openrlhf.trainer.ray.ppo_actor": ("compute_approx_kl", "PolicyLoss")}
_SWITCHES = Switches()


def patch() -> Switch:
    """One switch for OpenRLHF 0.11.2: its ``Actor``'s log-probs and entropy (``openrlhf/models/actor.py``:
    :func:`log_probs_from_logits`, :func:`compute_entropy` of the float32, temperature-scaled logits) go through
    :func:`kl_kernels.token_logprobs`, and the experience maker's and the PPO actor's ``compute_approx_kl``,
    ``compute_reward`` and ``PolicyLoss`` are this module's (fused). Sets those names in the modules OpenRLHF
    defines them in and, where already imported, in the trainer modules that bound them
    (``trainer/ppo_utils/experience_maker.py``, ``trainer/ray/ppo_actor.py``). OpenRLHF's Ray workers are separate
    processes: run it in each, e.g. ``ray.init(runtime_env={"worker_process_setup_hook":
    "kl_kernels.integrations.openrlhf.patch"})``. Idempotent; :func:`unpatch` or leaving ``with patch():``
    restores OpenRLHF's. Checked for OpenRLHF 0.11.2 (another version raises ``RuntimeError``)."""
    try:
        version = importlib.metadata.version("openrlhf")
        defined = {name: importlib.import_module(name) for name in _DEFINED}
    except (ImportError, importlib.metadata.PackageNotFoundError) as exc:
        raise ImportError(f"kl_kernels.integrations.openrlhf.patch needs OpenRLHF installed with what its model "
                          f"modules import ({exc})") from exc
    if version not in OPENRLHF_VERSIONS:
        raise RuntimeError(f"patch() is checked against OpenRLHF {', '.join(OPENRLHF_VERSIONS)}, found {version}: "
                           "its code may look these functions up elsewhere")
    ours = {"compute_approx_kl": compute_approx_kl, "compute_reward": compute_reward, "PolicyLoss": PolicyLoss,
            "log_probs_from_logits": log_probs_from_logits, "compute_entropy": compute_entropy}
    targets = [(defined[m], n, ours[n]) for m, names in _DEFINED.items() for n in names]
    targets += [(sys.modules[m], n, ours[n]) for m, names in _BOUND.items() if m in sys.modules for n in names]
    return _SWITCHES.apply("openrlhf", targets)


def unpatch() -> None:
    """Undo :func:`patch` (nothing when it is off)."""
    _SWITCHES.undo("openrlhf")


__all__ = ["KL_ESTIMATORS", "compute_approx_kl", "compute_reward", "masked_mean", "AdaptiveKLController",
           "FixedKLController", "PolicyLoss", "log_probs_from_logits", "compute_entropy", "patch", "unpatch"]
