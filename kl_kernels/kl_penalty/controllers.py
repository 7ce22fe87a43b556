"""KL coefficient controllers: the ``beta`` of a KL penalty, fixed or adapted to a target KL.

Each controller is a ``torch.nn.Module`` whose state (``beta``, a 0-d float32 buffer) can live on
the GPU next to the loss: :meth:`KLController.update` takes the measured KL as a tensor and
changes ``beta`` with tensor ops only, so a training step never waits on the host. ``state_dict``,
``load_state_dict`` and ``.to(device)`` work as for any module.

Rules (``kl`` is the mean of the tensor passed to ``update``):

* :class:`FixedKLController`: ``beta`` never changes.
* :class:`AdaptiveKLController` (TorchRL's ``KLPENPPOLoss``): ``beta *= increment`` if
  ``kl > 1.5 * dtarg``; ``beta *= decrement`` if ``kl < dtarg / 1.5``; else unchanged.
* :class:`ZieglerKLController` (Ziegler et al. 2019, as verl and OpenRLHF): ``err = clip(kl /
  target - 1, -0.2, 0.2)``; ``beta *= 1 + err * n_steps / horizon``.

A NaN or infinite ``kl`` leaves ``beta`` unchanged (a diverged batch should not poison the
coefficient of the following ones).

Example::

    >>> ctl = AdaptiveKLController(beta=1.0, dtarg=0.01)
    >>> ctl.update(torch.tensor([0.05, 0.03]))  # mean 0.04 > 1.5 * dtarg: doubled
    tensor(2.)
    >>> ctl.update(0.001)                       # < dtarg / 1.5: halved
    tensor(1.)
"""

from __future__ import annotations

import numbers

import torch


def _positive(name: str, value, *, allow_zero: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    value = float(value)
    if not (value > 0 or (allow_zero and value == 0)) or value != value or value == float("inf"):
        raise ValueError(f"{name} must be a finite number {'>= 0' if allow_zero else '> 0'}, got {value}")
    return value


def adaptive_beta(beta: torch.Tensor, kl: torch.Tensor, dtarg: float, increment: float,
                  decrement: float) -> torch.Tensor:
    """TorchRL's rule, as tensor ops (no host sync): ``beta * increment`` if ``kl > 1.5 * dtarg``,
    ``beta * decrement`` if ``kl < dtarg / 1.5``, else ``beta`` (also for a NaN ``kl``)."""
    return torch.where(kl > 1.5 * dtarg, beta * increment, torch.where(kl < dtarg / 1.5, beta * decrement, beta))


class KLController(torch.nn.Module):
    """Base class: holds ``beta`` (0-d float32 buffer) and its initial value for :meth:`reset`."""

    def __init__(self, beta: float = 1.0, *, device=None):
        super().__init__()
        beta = _positive("beta", beta, allow_zero=True)
        self.register_buffer("beta", torch.tensor(beta, dtype=torch.float32, device=device))
        self.register_buffer("beta_init", torch.tensor(beta, dtype=torch.float32, device=device))

    def _measured(self, kl) -> torch.Tensor:
        if isinstance(kl, torch.Tensor):
            if not (kl.is_floating_point() or kl.is_complex()):
                raise TypeError(f"kl must be a floating-point tensor, got {kl.dtype}")
            if kl.numel() == 0:
                raise ValueError("kl must not be empty (its mean is the measured KL)")
            return kl.detach().to(device=self.beta.device, dtype=torch.float32).mean()
        if isinstance(kl, bool) or not isinstance(kl, numbers.Real):
            raise TypeError(f"kl must be a tensor or a real number, got {type(kl).__name__}")
        return torch.tensor(float(kl), dtype=torch.float32, device=self.beta.device)

    def _next(self, kl: torch.Tensor, n_steps) -> torch.Tensor:
        return self.beta

    @torch.no_grad()
    def update(self, kl, n_steps: int = 1) -> torch.Tensor:
        """Adapt ``beta`` to the measured ``kl`` (a tensor, averaged, or a number); returns the new
        ``beta`` (the buffer itself, 0-d). ``n_steps`` is the number of samples or steps the
        measurement covers (used by :class:`ZieglerKLController`)."""
        if isinstance(n_steps, bool) or not isinstance(n_steps, numbers.Integral) or n_steps < 0:
            raise ValueError(f"n_steps must be an integer >= 0, got {n_steps!r}")
        measured = self._measured(kl)
        new = self._next(measured, int(n_steps))
        self.beta.copy_(torch.where(torch.isfinite(measured), new, self.beta))
        return self.beta

    @torch.no_grad()
    def reset(self) -> None:
        """Back to the initial ``beta``."""
        self.beta.copy_(self.beta_init)

    def extra_repr(self) -> str:
        return f"beta={float(self.beta):.6g}"


class FixedKLController(KLController):
    """A constant ``beta`` (``update`` validates its input and changes nothing)."""


class AdaptiveKLController(KLController):
    """TorchRL's ``KLPENPPOLoss`` rule: double (``increment``) above ``1.5 * dtarg``, halve
    (``decrement``) below ``dtarg / 1.5``. Defaults: ``beta=1.0``, ``dtarg=0.01``,
    ``increment=2.0``, ``decrement=0.5``."""

    def __init__(self, beta: float = 1.0, dtarg: float = 0.01, increment: float = 2.0, decrement: float = 0.5, *,
                 device=None):
        super().__init__(beta, device=device)
        self.dtarg = _positive("dtarg", dtarg)
        self.increment = _positive("increment", increment)
        self.decrement = _positive("decrement", decrement)
        if self.increment < 1.0:
            raise ValueError(f"increment must be >= 1.0, got {self.increment}")
        if self.decrement > 1.0:
            raise ValueError(f"decrement must be <= 1.0, got {self.decrement}")

    def _next(self, kl, n_steps):
        return adaptive_beta(self.beta, kl, self.dtarg, self.increment, self.decrement)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, dtarg={self.dtarg}, increment={self.increment}, decrement={self.decrement}"


class ZieglerKLController(KLController):
    """The proportional controller of Ziegler et al. (verl, OpenRLHF):
    ``beta *= 1 + clip(kl / target - 1, -0.2, 0.2) * n_steps / horizon``."""

    def __init__(self, beta: float = 0.1, target: float = 6.0, horizon: int = 10000, *, device=None):
        super().__init__(beta, device=device)
        self.target = _positive("target", target)
        self.horizon = _positive("horizon", horizon)

    def _next(self, kl, n_steps):
        err = torch.clamp(kl / self.target - 1.0, -0.2, 0.2)
        return self.beta * (1.0 + err * (n_steps / self.horizon))

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, target={self.target}, horizon={self.horizon:g}"
