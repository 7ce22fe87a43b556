"""The classic-control ``KLRewardTransform(actor, ...)`` (TorchRL <= 0.10, removed in 0.11), on ``kl_reward``.

Each env step, with ``a`` the action taken at that step::

    kl         = log pi(a | s) - log pi_0(a | s)     (summed over the action dims)
    reward_out = reward - coef * kl

``pi`` is the actor as it is now and ``pi_0`` the actor with a copy of the parameters it had when
the transform was built. The difference and the subtraction are one fused ``kl_reward`` call
(the k1 estimate), packed with one token per env step.
"""

from __future__ import annotations

import copy

import torch
from tensordict import TensorDict, TensorDictParams
from tensordict.nn import ProbabilisticTensorDictModule, ProbabilisticTensorDictSequential
from torchrl.envs.transforms import Transform

from ..kl_reward import kl_reward


def is_probabilistic_actor(obj) -> bool:
    """What the actor-based transform accepts: a probabilistic TensorDict module with ``get_dist``."""
    return isinstance(obj, (ProbabilisticTensorDictModule, ProbabilisticTensorDictSequential)) or (
        isinstance(obj, torch.nn.Module) and callable(getattr(obj, "get_dist", None))
        and hasattr(obj, "in_keys") and hasattr(obj, "out_keys"))


def _keys(keys, name):
    if keys is None:
        return ["reward"]
    if isinstance(keys, (str, tuple)):
        return [keys]
    if isinstance(keys, list) and all(isinstance(k, (str, tuple)) for k in keys):
        return list(keys)
    raise TypeError(f"{name} must be a str, a tuple of str or a list of those, got {keys!r}")


class ActorKLRewardTransform(Transform):
    """``reward - coef * (log pi(a|s) - log pi_0(a|s))`` with ``pi_0`` the actor frozen at construction.

    Args:
        actor: a probabilistic actor (``ProbabilisticActor`` / ``ProbabilisticTensorDictModule``
            / ``...Sequential``) with ``get_dist``; the action is read at its ``"action"`` key.
        coef: KL coefficient (float). Defaults to 1.0.
        in_keys: reward key(s) read; str, tuple or list. Defaults to ``"reward"``.
        out_keys: key(s) written; defaults to ``in_keys``. Must have as many entries as ``in_keys``.
        requires_grad: ``False`` (default): the frozen parameters are plain detached copies, kept
            outside the module (they do not follow ``.to()``/``.cuda()``). ``True``: differentiable
            clones registered as module parameters, which do follow casts.
    """

    def __init__(self, actor, coef=1.0, in_keys=None, out_keys=None, requires_grad=False, *, action_key="action",
                 backend: str = "auto"):
        if not is_probabilistic_actor(actor):
            raise TypeError(f"actor must be a probabilistic actor with get_dist, got {type(actor).__name__}")
        if isinstance(coef, bool) or not isinstance(coef, (int, float)):
            raise TypeError(f"coef must be a float, got {type(coef).__name__}")
        if not isinstance(requires_grad, bool):
            raise TypeError(f"requires_grad must be a bool, got {type(requires_grad).__name__}")
        in_keys = _keys(in_keys, "in_keys")
        out_keys = in_keys if out_keys is None else _keys(out_keys, "out_keys")
        if len(in_keys) != len(out_keys):
            raise ValueError(f"in_keys and out_keys must have the same length, got {in_keys} and {out_keys}")
        super().__init__(in_keys=in_keys, out_keys=out_keys)
        self.__dict__["actor"] = actor  # the live actor: not a submodule of the transform
        params = TensorDict.from_module(actor)
        with params.apply(lambda p: torch.empty_like(p, device="meta"), filter_empty=False).to_module(actor):
            self.__dict__["functional_actor"] = copy.deepcopy(actor)

        def frozen(x):
            if isinstance(x, torch.nn.Parameter):
                return torch.nn.Parameter(x.data.clone(), requires_grad=requires_grad)
            return x.detach().clone()

        frozen_params = params.apply(frozen, filter_empty=False)
        if requires_grad:
            self.frozen_params = TensorDictParams(frozen_params, no_convert=True)
        else:
            self.__dict__["frozen_params"] = frozen_params
        self.coef = float(coef)
        self.requires_grad = requires_grad
        self.action_key = action_key
        self.backend = backend

    def _log_probs(self, tensordict):
        action = tensordict.get(self.action_key, None)
        if action is None:
            raise KeyError(f"ActorKLRewardTransform needs the action at {self.action_key!r} in the step's input")
        cur = self.actor.get_dist(tensordict.copy()).log_prob(action)
        with self.frozen_params.to_module(self.functional_actor):
            ref = self.functional_actor.get_dist(tensordict.copy()).log_prob(action)
        batch = tensordict.batch_dims
        cur = cur.reshape(*cur.shape[:batch], -1).sum(-1) if cur.dim() > batch else cur
        ref = ref.reshape(*ref.shape[:batch], -1).sum(-1) if ref.dim() > batch else ref
        return cur, ref

    def _step(self, tensordict, next_tensordict):
        cur, ref = self._log_probs(tensordict)
        n = cur.numel()
        offsets = torch.arange(n + 1, device=cur.device)
        ctx = torch.no_grad() if not torch.is_grad_enabled() else torch.enable_grad()
        with ctx:
            for in_key, out_key in zip(self.in_keys, self.out_keys):
                reward = next_tensordict.get(in_key)
                dtype = torch.promote_types(cur.dtype, reward.dtype)
                out = kl_reward(cur.reshape(-1).to(dtype), ref.reshape(-1).to(dtype),
                                reward.reshape(n, -1).to(dtype).sum(-1) if reward.numel() == n else None,
                                coef=self.coef, offsets=offsets, reward_placement="last",
                                detach=not torch.is_grad_enabled(),
                                backend="torch" if dtype == torch.float64 else self.backend)
                if reward.numel() != n:
                    raise ValueError(f"reward at {in_key!r} must have one value per env step, got shape "
                                     f"{tuple(reward.shape)} for batch {tuple(tensordict.batch_size)}")
                next_tensordict.set(out_key, out.reward.reshape(reward.shape).to(reward.dtype))
        return next_tensordict

    def _reset(self, tensordict, tensordict_reset):
        return tensordict_reset

    def forward(self, tensordict):
        """Offline use: ``tensordict`` holds the action and a ``"next"`` sub-TensorDict with the reward."""
        self._step(tensordict, tensordict.get("next"))
        return tensordict

    def transform_reward_spec(self, reward_spec):
        """Each out key gets a copy of its in key's reward spec."""
        for in_key, out_key in zip(self.in_keys, self.out_keys):
            if out_key != in_key:
                reward_spec[out_key] = reward_spec[in_key].clone()
        return reward_spec
