"""The exact KL as a per-token estimator: ``estimator="full"`` of :func:`kl_kernels.kl_reward` and
:func:`kl_kernels.kl_penalty_loss`.

The sampled estimators (k1, k2, k3, ...) see one log-prob per token; ``"full"`` sees both models'
logits over the vocabulary and takes, per counted token, ``KL(pi || pi_ref)`` from :func:`full_kl`
(fused, no ``[N, V]`` float32 copy, gradients to the logits). The ops then treat that value as they
treat a sampled estimate: masked, clamped by ``clamp_output``, times ``coef`` / ``beta``, aggregated.

A shared module (it belongs to neither op; both call it; it imports no op: each op computes the values
with the ``full_kl`` op's public function, which it imports itself, a dependency downwards that
tests/test_structure.py keeps acyclic). The rules that belong to ``"full"`` alone are written here,
once, for both ops: which layouts take
logits (dense ones: packed ``[N, V]`` with ``offsets``, padded ``[B, T, V]``; a list or nested batch
of ``[n_b, V]`` rows would need an ``[N, V]`` copy to pack, which is what this path avoids), which
options have no meaning for it (``clamp_input``: there is no log-ratio to clamp), and the
temperature.
"""

from __future__ import annotations

import torch

FULL = "full"


def check_temperature(temperature, estimator: str, logit_scale=1.0, softcap=None) -> float:
    """``temperature``, ``logit_scale`` and ``softcap``: the exact KL's logit transform, ``x -> c tanh(s x / c) / T``
    (:func:`full_kl`'s; its rules, once: ``vocab_rows.logit_transform``), each other than its default (1.0, 1.0,
    None) only with ``estimator="full"`` (the sampled estimators read log-probs the caller already computed with
    its own). Returns the temperature as a float."""
    from .vocab_rows import logit_transform

    logit_transform(temperature, logit_scale, softcap)  # (a ValueError naming the argument)
    if estimator != FULL:
        for name, value, default in (("temperature", temperature, 1.0), ("logit_scale", logit_scale, 1.0),
                                     ("softcap", softcap, None)):
            if value != default:
                raise ValueError(f"{name} applies to estimator='full' (it transforms the logits); got {name}="
                                 f"{value} with estimator={estimator!r}, whose log-probs carry their own")
    return float(temperature)


def check_logits(name: str, x, token_shape: tuple | None = None, device: torch.device | None = None) -> torch.Tensor:
    """``x`` is a dense floating tensor ``[*token_shape, V]`` (``token_shape`` the log-probs' shape
    when known) on ``device`` (theirs, when known)."""
    if isinstance(x, (list, tuple)) or (isinstance(x, torch.Tensor) and x.is_nested):
        raise TypeError(f"{name}: estimator='full' takes dense logits, packed [N, V] with offsets or padded "
                        f"[B, T, V] (a list or nested batch would be copied into [N, V] to pack it), got "
                        f"{'a nested tensor' if isinstance(x, torch.Tensor) else type(x).__name__}")
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a tensor of logits [..., V] for estimator='full', got {type(x).__name__}")
    if x.dim() < 2:
        raise ValueError(f"{name} must be logits [N, V] (packed) or [B, T, V] (padded) for estimator='full', got "
                         f"shape {list(x.shape)}")
    if token_shape is not None and tuple(x.shape[:-1]) != tuple(token_shape):
        raise ValueError(f"{name} must have the log-probs' shape {list(token_shape)} plus the vocabulary, "
                         f"[{', '.join(map(str, token_shape))}, V], got {list(x.shape)}")
    if device is not None and x.device != device:
        raise ValueError(f"{name} must be on the log-probs' device {device}, got {x.device}")
    return x


def check_unused(estimator: str, **given) -> None:
    """Options that have no meaning for ``estimator``: ``full``'s logits with another estimator, a
    log-ratio clamp (or the like) with ``"full"``."""
    for name, value in given.items():
        if value is not None and value is not False:
            if estimator == FULL:
                raise ValueError(f"{name} has no meaning for estimator='full' (the exact KL reads logits, not a "
                                 f"log-ratio): leave it unset")
            raise ValueError(f"{name} is read by estimator='full' only, got estimator={estimator!r}")
