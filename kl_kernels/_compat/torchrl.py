"""TorchRL's private internals that kl_kernels.torchrl uses, each with a fallback.

Checked on TorchRL 0.14.1 (the `torchrl` extra pins 0.14.x). Module-level helpers are looked up
once, at import; a TorchRL without one gets our own implementation of what 0.14.1's does:

* ``warn_mc_kl(p, q)``: the note that a KL falls back to Monte Carlo (TorchRL's logger, once per
  pair of distribution types). Fallback: the same note through ``warnings``, once per pair.
* ``maybe_get_or_select(td, key)``: an entry, padded when the samples are ragged, or a sub-
  TensorDict of several keys. Fallback: the public ``td.get(key, as_padded_tensor=True)`` /
  ``td.select``.
* ``sum_td_features(td)``: a composite distribution's per-feature log-probs summed into one tensor.
  Fallback: the public ``td.sum(dim="feature", reduce=True)``.
* ``broadcast_advantage_to_log_weight(adv, lw)`` and ``check_advantage_broadcast(adv, lw)``: a
  per-decision advantage ``[*B, 1]`` spread over per-token log-weights ``[*B, *tokens, 1]``, and the
  error for a ``[B]`` advantage that would broadcast against ``[B, 1]`` into an outer product.
  Fallbacks: our own, same rules.

``KLPENPPOLoss`` subclasses TorchRL's and calls private methods of that base (``BASE_METHODS``).
There is no safe stand-in for a base class's internals, so the gate is an error:
``missing_base_methods()`` names those a TorchRL lacks, and ``kl_kernels.torchrl.ppo`` refuses to
import with that list rather than fail later inside a training step. ``tests/test_compat.py`` runs
every fallback and the gate.
"""

from __future__ import annotations

import warnings

import torch

CHECKED_ON = ("0.14.1",)


def _lookup(module: str, name: str):
    try:
        return getattr(__import__(module, fromlist=[name]), name)
    except (ImportError, AttributeError):
        return None


_WARN_MC_KL = _lookup("torchrl.modules.distributions.utils", "_warn_mc_kl")
_MAYBE_GET_OR_SELECT = _lookup("torchrl.objectives.utils", "_maybe_get_or_select")
_SUM_TD_FEATURES = _lookup("torchrl.objectives.utils", "_sum_td_features")
_BROADCAST_ADVANTAGE = _lookup("torchrl.objectives.ppo", "_broadcast_advantage_to_log_weight")
_CHECK_ADVANTAGE = _lookup("torchrl.objectives.ppo", "_check_advantage_broadcast")

_warned: set = set()


def warn_mc_kl(p, q) -> None:
    if _WARN_MC_KL is not None:
        return _WARN_MC_KL(p, q)
    key = (type(p), type(q))
    if key not in _warned:
        _warned.add(key)
        warnings.warn(f"no analytic KL divergence for {key[0].__name__} and {key[1].__name__}: "
                      "estimating it by Monte Carlo sampling", stacklevel=2)


def maybe_get_or_select(td, key):
    if _MAYBE_GET_OR_SELECT is not None:
        return _MAYBE_GET_OR_SELECT(td, key)
    if isinstance(key, (str, tuple)):
        return td.get(key, as_padded_tensor=True, padding_side="left", padding_value=0)
    return td.select(*key)


def sum_td_features(td) -> torch.Tensor:
    if _SUM_TD_FEATURES is not None:
        return _SUM_TD_FEATURES(td)
    return td.sum(dim="feature", reduce=True)


def broadcast_advantage_to_log_weight(advantage, log_weight):
    if _BROADCAST_ADVANTAGE is not None:
        return _BROADCAST_ADVANTAGE(advantage, log_weight)
    if not (isinstance(advantage, torch.Tensor) and isinstance(log_weight, torch.Tensor)):
        return advantage
    batch = advantage.shape[:-1]
    spreads = (advantage.shape != log_weight.shape and advantage.ndim >= 2 and advantage.shape[-1] == 1
               and log_weight.shape[-1] == 1 and log_weight.ndim > advantage.ndim
               and log_weight.shape[:len(batch)] == batch)
    if not spreads:
        return advantage
    tokens = log_weight.shape[len(batch):-1]
    return advantage.reshape(*batch, *([1] * len(tokens)), 1).expand(*batch, *tokens, 1)


def check_advantage_broadcast(advantage, log_weight) -> None:
    if _CHECK_ADVANTAGE is not None:
        return _CHECK_ADVANTAGE(advantage, log_weight)
    if not (isinstance(advantage, torch.Tensor) and isinstance(log_weight, torch.Tensor)):
        return
    try:
        shape = torch.broadcast_shapes(advantage.shape, log_weight.shape)
    except RuntimeError:
        return  # incompatible: the objective's own arithmetic reports it
    if shape.numel() > max(advantage.numel(), log_weight.numel()):
        raise ValueError(f"advantage {tuple(advantage.shape)} and log-weight {tuple(log_weight.shape)} broadcast to "
                         f"{tuple(shape)}, an outer product over samples: give the advantage its trailing "
                         "dimension of 1 (advantage.unsqueeze(-1))")


# The private methods of torchrl.objectives.KLPENPPOLoss (and its PPOLoss base) that
# kl_kernels.torchrl.KLPENPPOLoss calls, and the keys class it extends.
BASE_METHODS = ("_AcceptedKeys", "_clear_weakrefs", "_expand_loss_mask", "_get_cur_log_prob", "_get_entropy",
                "_log_weight", "_loss_mask_keys", "_maybe_normalize_advantage", "_reduce_loss", "_weighted_loss_entropy")


def missing_base_methods(base: type) -> list[str]:
    return [name for name in BASE_METHODS if not callable(getattr(base, name, None))]
