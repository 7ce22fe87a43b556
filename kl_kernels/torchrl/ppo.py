"""``KLPENPPOLoss``: TorchRL 0.14's KL-penalty PPO loss with a correct beta gradient and a fused
token path for language models.

Two paths, chosen per call from the data:

* **Generic** (any actor, e.g. continuous control): TorchRL's computation, line for line, with
  one fix. TorchRL multiplies the KL by its ``beta`` buffer and then rescales that buffer in
  place (``beta.data *= increment``) before ``backward`` runs; autograd saved the buffer, not its
  value, so the gradient of the KL term uses the *updated* beta while the loss value used the old
  one. Here the forward uses a snapshot of ``beta`` and the buffer is updated afterwards, so the
  gradient is the gradient of the value returned. The update itself is TorchRL's rule, computed on
  the buffer's device (no host synchronization).
* **Token** (language models): when the data carry a per-token mask under
  ``tensor_keys.token_mask`` (default ``("masks", "all_assistant_mask")``, TorchRL's LLM key) with
  the same shape as the stored per-token log-probs, the objective and the KL go through one
  :func:`kl_kernels.kl_penalty_loss` call: ``-ratio * A + beta * est(old - new)`` per counted
  token, reduced over counted tokens only (``reduction="mean"`` is a token mean). The KL is the
  sample estimate of KL(old || new) on the sampled tokens (``kl_estimator``, default ``"k1"``),
  not an analytic KL from stored logits, which an LM rollout does not keep.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from tensordict import TensorDict, TensorDictBase, is_tensor_collection
from tensordict.nn import CompositeDistribution, dispatch, set_composite_lp_aggregate
from tensordict.utils import NestedKey
from torchrl.modules.distributions.utils import has_analytic_kl, sample_and_log_prob
from torchrl.objectives import ppo as _ppo

from .._compat import torchrl as trl_compat

_missing = trl_compat.missing_base_methods(_ppo.KLPENPPOLoss)
if _missing:
    raise ImportError(f"kl_kernels.torchrl.KLPENPPOLoss builds on private methods of TorchRL's KLPENPPOLoss that "
                      f"this TorchRL lacks: {', '.join(_missing)} (checked on TorchRL "
                      f"{', '.join(trl_compat.CHECKED_ON)}; the `torchrl` extra pins 0.14.x)")

from ..kl_penalty.api import kl_penalty_loss
from ..kl_penalty.controllers import adaptive_beta
from ..kl_reward.problem import ESTIMATORS

_REDUCTION_TO_AGGREGATION = {"mean": "token-mean", "sum": "sum", "none": "none"}


class KLPENPPOLoss(_ppo.KLPENPPOLoss):
    """TorchRL's ``KLPENPPOLoss`` (same constructor, keys, outputs, reductions, value clipping,
    advantage normalization, ``state_dict`` and ``reset``), with the beta gradient fixed and a
    fused path for per-token (language-model) data. See the module docstring for both.

    Extra keyword arguments:
        kl_estimator: KL estimator of the token path (:data:`kl_kernels.ESTIMATORS`), default ``"k1"``.
        backend: :func:`kl_kernels.kl_penalty_loss` backend of the token path, default ``"auto"``.

    Extra key (``set_keys(token_mask=...)``): ``token_mask``, default ``("masks",
    "all_assistant_mask")``: a bool ``[*B, T]`` entry that switches a call to the token path.

    Token path outputs (``[*B]`` batch, ``T`` tokens): ``loss_objective`` (objective + KL penalty,
    reduced over counted tokens; ``reduction="none"`` gives ``[*B, T]`` with 0 at other tokens),
    ``kl`` and ``kl_approx`` (token means of the estimator and of k1), ``entropy`` and
    ``loss_entropy`` (token means), ``loss_critic`` as TorchRL computes it. The log-ratio is
    clamped to [-20, 20] before ``exp`` (TorchRL's generic path does not clamp).

    Example (a continuous-control actor and critic, as TorchRL's PPO tutorial)::

        >>> import torch
        >>> from tensordict import TensorDict
        >>> from tensordict.nn import NormalParamExtractor, TensorDictModule
        >>> from torchrl.modules import IndependentNormal, ProbabilisticActor, ValueOperator
        >>> net = torch.nn.Sequential(torch.nn.Linear(3, 4), NormalParamExtractor())
        >>> actor = ProbabilisticActor(TensorDictModule(net, in_keys=["observation"], out_keys=["loc", "scale"]),
        ...                            in_keys=["loc", "scale"], distribution_class=IndependentNormal,
        ...                            return_log_prob=True)
        >>> critic = ValueOperator(torch.nn.Linear(3, 1), in_keys=["observation"])
        >>> data = actor(TensorDict({"observation": torch.randn(8, 3)}, [8])).detach()
        >>> data.update({"advantage": torch.randn(8, 1), "value_target": torch.randn(8, 1)})  # doctest: +ELLIPSIS
        TensorDict(...)
        >>> loss = KLPENPPOLoss(actor, critic, beta=1.0, dtarg=0.01)
        >>> out = loss(data)
        >>> sorted(out.keys())
        ['entropy', 'explained_variance', 'kl', 'kl_approx', 'loss_critic', 'loss_entropy', 'loss_objective']
        >>> (out["loss_objective"] + out["loss_critic"] + out["loss_entropy"]).backward()
        >>> float(loss.beta)  # same policy: KL 0 < dtarg / 1.5, halved after the loss was built
        0.5
    """

    @dataclass
    class _AcceptedKeys(_ppo.KLPENPPOLoss._AcceptedKeys):
        """TorchRL's keys plus ``token_mask`` (the per-token mask that selects the token path)."""

        token_mask: NestedKey = ("masks", "all_assistant_mask")

    default_keys = _AcceptedKeys

    def __init__(self, actor_network=None, critic_network=None, *, kl_estimator: str = "k1", backend: str = "auto",
                 **kwargs):
        super().__init__(actor_network, critic_network, **kwargs)
        if kl_estimator not in ESTIMATORS:
            raise ValueError(f"kl_estimator must be one of {ESTIMATORS}, got {kl_estimator!r}")
        self.kl_estimator = kl_estimator
        self.backend = backend

    @torch.no_grad()
    def _update_beta(self, kl_mean: torch.Tensor) -> None:
        """TorchRL's adaptive rule, applied after the loss is built (on device, no host sync)."""
        kl_mean = kl_mean.detach().to(self.beta.device)
        self.beta.copy_(adaptive_beta(self.beta, kl_mean, self.dtarg, self.increment, self.decrement))

    def _beta_snapshot(self) -> torch.Tensor:
        # The value this forward uses, kept apart from the buffer the update rescales in place.
        return self.beta.detach().clone()

    @dispatch
    def forward(self, tensordict: TensorDictBase) -> TensorDict:
        mask = tensordict.get(self.tensor_keys.token_mask, None)
        if mask is not None:
            return self._token_forward(tensordict, mask)
        return self._generic_forward(tensordict)

    # ----------------------------------------------------------------- generic (TorchRL's) path
    def _generic_forward(self, tensordict: TensorDictBase) -> TensorDict:
        # TorchRL 0.14.1's KLPENPPOLoss.forward, except the beta snapshot and the update order.
        tensordict_copy = tensordict.copy()
        if self.delay_actor:
            with torch.no_grad(), self.target_actor_network_params.to_module(
                    self.actor_network, preserve_module_state=False):
                previous_dist = self.actor_network.get_dist(tensordict_copy)
        else:
            try:
                previous_dist = self.actor_network.build_dist_from_params(tensordict)
            except KeyError as err:
                raise KeyError("The parameters of the distribution were not found. "
                               f"Make sure they are provided to {type(self).__name__}.") from err
        advantage, update_norm = self._advantage(tensordict_copy)
        advantage = self._maybe_normalize_advantage(advantage, tensordict_copy, update_norm=update_norm)
        log_weight, dist, kl_approx, log_is_weight = self._log_weight(tensordict_copy, adv_shape=advantage.shape[:-1])
        advantage = trl_compat.broadcast_advantage_to_log_weight(advantage, log_weight)
        trl_compat.check_advantage_broadcast(advantage, log_weight)
        if log_is_weight is not None:
            log_weight = log_weight + log_is_weight
        neg_loss = log_weight.exp() * advantage

        with (self.actor_network_params.to_module(self.actor_network, preserve_module_state=False)
              if self.functional else contextlib.nullcontext()):
            current_dist = self.actor_network.get_dist(tensordict_copy)
        kl = self._dist_kl(previous_dist, current_dist, advantage).unsqueeze(-1)
        neg_loss = neg_loss - self._beta_snapshot() * kl
        self._update_beta(kl.mean())
        td_out = TensorDict({"loss_objective": -neg_loss, "kl": kl.detach(), "kl_approx": kl_approx.detach().mean()})
        if self.entropy_bonus:
            self._set_entropy(td_out, self._get_entropy(dist, adv_shape=advantage.shape[:-1]))
        self._set_critic(td_out, tensordict_copy)
        td_out = td_out.named_apply(
            lambda name, value: self._reduce_loss(value, tensordict_copy).squeeze(-1)
            if name.startswith("loss_") else value)
        self._clear_refs(tensordict, td_out)
        return td_out

    def _dist_kl(self, previous_dist, current_dist, advantage) -> torch.Tensor:
        """KL(previous || current): analytic when torch knows it, else TorchRL's Monte-Carlo estimate."""
        if has_analytic_kl(previous_dist, current_dist):
            return torch.distributions.kl.kl_divergence(previous_dist, current_dist)
        trl_compat.warn_mc_kl(previous_dist, current_dist)
        is_composite = isinstance(current_dist, CompositeDistribution)
        with set_composite_lp_aggregate(False) if is_composite else contextlib.nullcontext():
            x, previous_log_prob = sample_and_log_prob(previous_dist, (self.samples_mc_kl,))
            current_log_prob = current_dist.log_prob(x)
        if is_tensor_collection(previous_log_prob):
            if previous_log_prob.batch_size != advantage.shape[:-1]:
                previous_log_prob.batch_size = (self.samples_mc_kl,) + advantage.shape[:-1]
                current_log_prob.batch_size = (self.samples_mc_kl,) + advantage.shape[:-1]
            previous_log_prob = trl_compat.sum_td_features(previous_log_prob)
            current_log_prob = trl_compat.sum_td_features(current_log_prob)
        return (previous_log_prob - current_log_prob).mean(0)

    # ------------------------------------------------------------------ shared pieces
    def _advantage(self, tensordict_copy: TensorDictBase) -> tuple[torch.Tensor, bool]:
        advantage = tensordict_copy.get(self.tensor_keys.advantage, None)
        if advantage is not None:
            return advantage, False
        self.value_estimator(tensordict_copy, params=self._cached_critic_network_params_detached,
                             target_params=self.target_critic_network_params)
        return tensordict_copy.get(self.tensor_keys.advantage), True

    def _set_entropy(self, td_out: TensorDict, entropy) -> None:
        if is_tensor_collection(entropy):  # one entropy per action head
            td_out.set("composite_entropy", entropy.detach())
            td_out.set("entropy", trl_compat.sum_td_features(entropy).detach().mean())
        else:
            td_out.set("entropy", entropy.detach().mean())
        td_out.set("loss_entropy", self._weighted_loss_entropy(entropy))

    def _set_critic(self, td_out: TensorDict, tensordict_copy: TensorDictBase) -> None:
        if not self._has_critic:
            return
        loss_critic, value_clip_fraction, explained_variance = self.loss_critic(tensordict_copy)
        td_out.set("loss_critic", loss_critic)
        if value_clip_fraction is not None:
            td_out.set("value_clip_fraction", value_clip_fraction)
        if explained_variance is not None:
            td_out.set("explained_variance", explained_variance)

    def _clear_refs(self, *tds) -> None:
        self._clear_weakrefs(*tds, "actor_network_params", "critic_network_params", "target_actor_network_params",
                             "target_critic_network_params")

    # -------------------------------------------------------------------- token path
    def _token_forward(self, tensordict: TensorDictBase, mask: torch.Tensor) -> TensorDict:
        if self.delay_actor or self.max_importance_ratio is not None:
            raise ValueError("the token path (data with a per-token mask under tensor_keys.token_mask) does not "
                             "support delay_actor=True or max_importance_ratio; set_keys(token_mask=...) to a key "
                             "absent from the data to use the generic path")
        tensordict_copy = tensordict.copy()
        old = trl_compat.maybe_get_or_select(tensordict_copy, self.tensor_keys.sample_log_prob)
        if old is None:
            raise KeyError(f"Couldn't find the log-prob {self.tensor_keys.sample_log_prob} in the input data.")
        if old.requires_grad:
            raise RuntimeError(f"tensordict stored {self.tensor_keys.sample_log_prob} requires grad.")
        if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
            raise TypeError(f"the token mask {self.tensor_keys.token_mask} must be a bool tensor, got "
                            f"{getattr(mask, 'dtype', type(mask).__name__)}")
        if mask.dim() < 1 or old.shape != mask.shape:
            raise ValueError(f"the token mask {self.tensor_keys.token_mask} has shape {tuple(mask.shape)} but the "
                             f"stored log-probs {self.tensor_keys.sample_log_prob} have shape {tuple(old.shape)}: the "
                             "token path needs one log-prob per token, [*B, T], with the mask's shape")
        for key in self._loss_mask_keys():  # TorchRL's validity masks ("shifted_valid", ...) also apply
            valid = tensordict_copy.get(key, None)
            if valid is not None:
                mask = mask & self._expand_loss_mask(valid.to(torch.bool), mask)
        advantage, update_norm = self._advantage(tensordict_copy)
        log_prob, dist, _ = self._get_cur_log_prob(tensordict_copy)
        if log_prob.shape != old.shape:
            raise ValueError(f"the actor's log-probs have shape {tuple(log_prob.shape)}, the stored ones "
                             f"{tuple(old.shape)}")
        flat = (-1, old.shape[-1])  # [*B, T] -> [B', T]: one sequence per row
        count = mask.sum()
        advantage = self._token_advantage(advantage, mask, count, tensordict_copy, update_norm)
        adv = advantage.reshape(flat) if advantage.shape == old.shape else advantage.reshape(-1, 1)
        aggregation = _REDUCTION_TO_AGGREGATION[self.reduction]
        out = kl_penalty_loss(log_prob.reshape(flat), old.reshape(flat), adv, beta=self._beta_snapshot(),
                              estimator=self.kl_estimator, mask=mask.reshape(flat), aggregation=aggregation,
                              backend=self.backend)
        self._update_beta(out.kl_mean)
        loss_objective = out.loss if aggregation != "none" else out.loss.reshape(old.shape)
        counted = mask.to(log_prob.dtype)
        kl_approx = ((old - log_prob.detach()) * counted).sum() / count.clamp_min(1)
        td_out = TensorDict({"loss_objective": loss_objective, "kl": out.kl_mean.to(log_prob.dtype),
                             "kl_approx": kl_approx})
        if self.entropy_bonus:
            entropy = self._get_entropy(dist, adv_shape=old.shape)
            if is_tensor_collection(entropy):
                entropy = trl_compat.sum_td_features(entropy)
            entropy = entropy.reshape(old.shape)
            td_out.set("entropy", ((entropy.detach() * counted).sum() / count.clamp_min(1)))
            loss_entropy = self._weighted_loss_entropy(torch.where(mask, entropy, 0.0))
            td_out.set("loss_entropy", loss_entropy if aggregation == "none" else
                       (loss_entropy.sum() / (count.clamp_min(1) if aggregation == "token-mean" else 1)))
        self._set_critic(td_out, tensordict_copy)
        if "loss_critic" in td_out.keys():  # the one loss not reduced by the fused op
            td_out.set("loss_critic", self._reduce_loss(td_out.get("loss_critic"), tensordict_copy).squeeze(-1))
        self._clear_refs(tensordict, td_out)
        return td_out

    def _token_advantage(self, advantage, mask, count, tensordict_copy, update_norm) -> torch.Tensor:
        """The advantage of the token path: per sequence ``[*B, 1]`` or per token ``[*B, T]`` /
        ``[*B, T, 1]``; normalized (if asked) over counted tokens only for per-token advantages."""
        if advantage.shape == mask.shape + (1,):
            advantage = advantage.squeeze(-1)
        elif advantage.shape != mask.shape and advantage.shape != mask.shape[:-1] + (1,):
            raise ValueError(f"the advantage {self.tensor_keys.advantage} has shape {tuple(advantage.shape)}; the "
                             f"token path takes one per token {tuple(mask.shape)} (or with a trailing 1) or one per "
                             f"sequence {tuple(mask.shape[:-1]) + (1,)}")
        if advantage.shape != mask.shape or self.advantage_norm is not None:
            return self._maybe_normalize_advantage(advantage, tensordict_copy, update_norm=update_norm)
        if self.normalize_advantage:
            # TorchRL's standardization (population std, clamped at 1e-4), over counted tokens;
            # one counted token or none: left as is, as TorchRL leaves a single element.
            w = mask.to(advantage.dtype)
            n = count.to(advantage.dtype).clamp_min(1)
            loc = (advantage * w).sum() / n
            scale = (((advantage - loc) ** 2 * w).sum() / n).sqrt().clamp_min(1e-4)
            advantage = torch.where(count > 1, (advantage - loc) / scale, advantage)
        return advantage
