"""The KL controllers' interface that verl and OpenRLHF share: a float ``value`` and ``update(kl, n_steps)``.

Both peers use Ziegler et al.'s proportional rule; it is written once, in
:class:`kl_kernels.ZieglerKLController` (float32 on a device), and these classes only adapt its
interface. The peers' shims subclass them to give ``update`` their own argument names.
"""

from __future__ import annotations

from ..kl_penalty.controllers import ZieglerKLController


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
