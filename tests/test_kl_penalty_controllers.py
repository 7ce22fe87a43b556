"""KL coefficient controllers: the rules (against plain-Python restatements of TorchRL's and
Ziegler's), state on device, state_dict round trips, bad arguments."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kl_kernels import AdaptiveKLController, FixedKLController, ZieglerKLController

kl_values = st.lists(st.floats(0.0, 0.1, allow_nan=False), min_size=1, max_size=30)


def torchrl_rule(beta, kls, dtarg=0.01, increment=2.0, decrement=0.5):
    """TorchRL 0.14's KLPENPPOLoss beta update, restated."""
    out = []
    for kl in kls:
        if kl > dtarg * 1.5:
            beta *= increment
        elif kl < dtarg / 1.5:
            beta *= decrement
        out.append(beta)
    return out


def ziegler_rule(beta, kls, target, horizon, n_steps):
    out = []
    for kl in kls:
        err = min(max(kl / target - 1.0, -0.2), 0.2)
        beta *= 1.0 + err * n_steps / horizon
        out.append(beta)
    return out


@given(kls=kl_values, beta=st.floats(0.01, 10.0))
def test_adaptive_follows_torchrl(kls, beta):
    ctl = AdaptiveKLController(beta=beta)
    got = [float(ctl.update(torch.tensor([kl, kl]))) for kl in kls]
    want = torchrl_rule(beta, kls)
    assert got == pytest.approx(want, rel=1e-6)


@given(kls=st.lists(st.floats(0.0, 20.0, allow_nan=False), min_size=1, max_size=30),
       n_steps=st.integers(1, 4096))
def test_ziegler_follows_the_paper(kls, n_steps):
    ctl = ZieglerKLController(beta=0.1, target=6.0, horizon=10000)
    got = [float(ctl.update(kl, n_steps=n_steps)) for kl in kls]
    assert got == pytest.approx(ziegler_rule(0.1, kls, 6.0, 10000, n_steps), rel=1e-5)


def test_fixed_never_moves_and_kl_is_a_mean():
    ctl = FixedKLController(0.3)
    for kl in (0.0, 1.0, torch.tensor([5.0, 7.0])):
        assert float(ctl.update(kl)) == pytest.approx(0.3)
    ada = AdaptiveKLController(dtarg=0.01)
    ada.update(torch.tensor([0.0, 0.04]))  # mean 0.02 > 0.015: doubled, although one element is 0
    assert float(ada.beta) == 2.0


def test_non_finite_kl_leaves_beta_unchanged():
    for ctl in (AdaptiveKLController(), ZieglerKLController()):
        before = float(ctl.beta)
        for bad in (math.nan, math.inf, torch.tensor([1.0, math.nan])):
            ctl.update(bad)
            assert float(ctl.beta) == before


def test_state_dict_round_trip_and_reset():
    a = AdaptiveKLController(beta=1.0)
    for kl in (0.05, 0.05, 0.0):
        a.update(kl)
    b = AdaptiveKLController(beta=1.0)
    b.load_state_dict(a.state_dict())
    assert float(b.beta) == float(a.beta) == 2.0
    b.reset()
    assert float(b.beta) == 1.0
    assert set(a.state_dict()) == {"beta", "beta_init"}


def test_update_returns_the_buffer_and_keeps_dtype():
    ctl = AdaptiveKLController()
    out = ctl.update(torch.tensor(0.5, dtype=torch.float64))
    assert out is ctl.beta and out.dtype == torch.float32 and out.dim() == 0


@pytest.mark.parametrize("make, match", [
    (lambda: AdaptiveKLController(increment=0.5), "increment must be >= 1.0"),
    (lambda: AdaptiveKLController(decrement=1.5), "decrement must be <= 1.0"),
    (lambda: AdaptiveKLController(dtarg=0.0), "dtarg must be a finite number > 0"),
    (lambda: ZieglerKLController(horizon=0), "horizon must be a finite number > 0"),
    (lambda: FixedKLController(-1.0), "beta must be a finite number >= 0"),
    (lambda: AdaptiveKLController(dtarg=float("nan")), "dtarg must be a finite number > 0"),
])
def test_bad_arguments(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_bad_update_inputs():
    ctl = AdaptiveKLController()
    with pytest.raises(TypeError, match="kl must be a floating-point tensor"):
        ctl.update(torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="kl must not be empty"):
        ctl.update(torch.zeros(0))
    with pytest.raises(TypeError, match="kl must be a tensor or a real number"):
        ctl.update("0.1")
    with pytest.raises(ValueError, match="n_steps must be an integer >= 0"):
        ctl.update(0.1, n_steps=-1)
    with pytest.raises(TypeError, match="beta must be a real number"):
        FixedKLController("1")


@pytest.mark.cuda
def test_state_stays_on_the_gpu_without_host_sync():
    ctl = AdaptiveKLController(device="cuda")
    kl = torch.full((1024,), 0.05, device="cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            ctl.update(kl)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert ctl.beta.device.type == "cuda" and float(ctl.beta) == 8.0
