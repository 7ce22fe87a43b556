"""What the peers' shims share: a count used as a denominator, GSPO's gradient through the sequence mean,
the KL controllers' interface, and the switches (names set in a peer's modules, put back on request).

The controllers: verl and OpenRLHF share a float ``value`` and ``update(kl, n_steps)``.

Both peers use Ziegler et al.'s proportional rule; it is written once, in
:class:`kl_kernels.ZieglerKLController` (float32 on a device), and these classes only adapt its
interface. The peers' shims subclass them to give ``update`` their own argument names.
"""

from __future__ import annotations

import sys

import torch

from ..kl_penalty.controllers import ZieglerKLController


def at_least_one(count):
    """A token or sequence count (an int, a float or a 0-d tensor, e.g. a global count from the
    trainer) as a denominator: at least 1, so an empty batch gives a loss of 0, not the peers' 0 / 0.
    A tensor stays one (no host sync)."""
    return count.clamp_min(1) if isinstance(count, torch.Tensor) else max(count, 1)


class _RewriteGradient(torch.autograd.Function):
    """Identity forward; the backward hands the incoming gradient to ``rewrite(g, *data)`` (``data``: tensors
    without gradient). What the shims use to give a fused op's input a peer's gradient."""

    @staticmethod
    def forward(ctx, x, rewrite, *data):
        ctx.rewrite = rewrite
        ctx.save_for_backward(*data)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return (ctx.rewrite(g, *ctx.saved_tensors), None) + (None,) * len(ctx.saved_tensors)


def rewrite_gradient(x: torch.Tensor, rewrite, *data: torch.Tensor) -> torch.Tensor:
    """``x``, whose gradient is ``rewrite(incoming gradient, *data)``."""
    return _RewriteGradient.apply(x, rewrite, *data)


def _sequence_mean(g, mask):
    g = torch.where(mask, g, 0.0)
    mean = g.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp_min(1)
    return torch.where(mask, mean, 0.0).to(g.dtype)


def gradient_through_sequence_mean(log_probs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``log_probs`` ``[B, T]`` for a GSPO policy loss without a KL term, so that its gradient is the
    one of a ratio built from the sequence's *mean* log-ratio (TRL, OpenRLHF): the fused GSPO gradient
    of token ``t`` (GSPO-token's, ``d r_t / d lp_t = 1``) replaced by the mean of the row's over its
    counted tokens. The same thing when advantages and weights are constant within each sequence;
    exact also when they vary (per-token advantages), where GSPO-token's differs."""
    return rewrite_gradient(log_probs, _sequence_mean, mask)


class ProportionalValue:
    """``value *= 1 + clip(kl / target - 1, -0.2, 0.2) * n_steps / horizon`` as a float ``value``."""

    def __init__(self, init_kl_coef, target, horizon):
        self._ctl = ZieglerKLController(beta=init_kl_coef, target=target, horizon=horizon)
        self.target, self.horizon = target, horizon

    @property
    def value(self) -> float:
        return float(self._ctl.beta)

    @value.setter
    def value(self, v) -> None:
        self._ctl.beta.fill_(float(v))

    def _update(self, kl, n_steps) -> None:
        self._ctl.update(kl, n_steps)


class FixedValue:
    """A ``value`` that ``update`` never changes."""

    def __init__(self, kl_coef):
        self.value = kl_coef


class Switch:
    """What a peer's ``patch*`` function returns: a context manager that turns the switch off at exit, if this call
    turned it on (``made``; a second call while it is on changes nothing and undoes nothing)."""

    def __init__(self, table: "Switches", name: str, made: bool):
        self.table, self.name, self.made = table, name, made

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.made:
            self.table.undo(self.name)
        return False


class Switches:
    """A peer's switches: each sets names in the peer's modules, where the peer's code looks them up, to ours, and
    keeps the peer's objects to put back. One table per peer shim."""

    def __init__(self):
        self.on: dict = {}  # switch -> {(module name, attribute): the peer's object}

    def apply(self, name: str, targets) -> Switch:
        """Set each ``(module, attribute, ours)``; nothing when the switch is already on."""
        if name in self.on:
            return Switch(self, name, False)
        saved = {}
        for module, attribute, ours in targets:
            saved[(module.__name__, attribute)] = getattr(module, attribute)
            setattr(module, attribute, ours)
        self.on[name] = saved
        return Switch(self, name, True)

    def undo(self, name: str) -> None:
        """Put the peer's objects back (nothing when the switch is off)."""
        for (module, attribute), original in self.on.pop(name, {}).items():
            setattr(sys.modules[module], attribute, original)

    def original(self, name: str, module: str, attribute: str):
        """The peer's own object behind a switched name, or None when that switch is off."""
        return self.on.get(name, {}).get((module, attribute))
