"""Regression tests for the defects an adversarial sweep found (hostile containers, negative bits,
non-finite coefficients, straight-through estimators at infinite log-ratios, unclear errors).

Each test failed before its fix. A crash is run in a subprocess so that it fails this test
instead of ending the whole run.
"""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap

import pytest
import torch

from kl_kernels import kl_penalty_loss, kl_reward

# ---------------------------------------------------------------- hostile containers

_SHORT_ITER = """
import torch
from kl_kernels import kl_reward

class ShortIter(list):
    # __len__ says 3, __iter__ yields 2: a container that lies about its size
    def __iter__(self):
        return iter(list.__getitem__(self, slice(0, 2)))

lp = ShortIter([torch.randn(3), torch.randn(2), torch.randn(4)])
ref = ShortIter([torch.randn(3), torch.randn(2), torch.randn(4)])
try:
    kl_reward(lp, ref, coef=0.1, {extra})
except (ValueError, TypeError) as e:
    assert "log_probs" in str(e) or "ref_log_probs" in str(e), e
    print("RAISED", type(e).__name__, e)
else:
    print("RETURNED")
"""


@pytest.mark.parametrize("extra", ["", "clamp_input=(-5, 5)", "backend='torch'"],
                         ids=["plain", "clamped", "torch"])
def test_list_subclass_shorter_iteration_does_not_crash(extra):
    """tensor_lists.cpp reads the snapshot tuple up to __len__ items (SIGSEGV)."""
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(_SHORT_ITER).replace("{extra}", extra)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"exit {proc.returncode}: {proc.stderr[-2000:]}"
    # Every backend reads such a container one way and names the argument
    assert "RAISED ValueError" in proc.stdout, proc.stdout


class _Lying(list):
    """__len__, __getitem__ and __iter__ disagree: what a C reader and a Python reader see differ."""

    def __len__(self):
        return 1

    def __getitem__(self, i):
        return list.__getitem__(self, 0) if not isinstance(i, slice) else list.__getitem__(self, i)


@pytest.mark.parametrize("backend", ["auto", "torch", "cpu"])
def test_hostile_container_read_one_way(backend):
    lp = _Lying([torch.randn(3), torch.randn(2)])
    ref = _Lying([torch.randn(3), torch.randn(2)])
    with pytest.raises(ValueError, match="log_probs"):
        kl_reward(lp, ref, coef=0.1, backend=backend)


def test_list_subclass_that_is_consistent_is_read():
    class Tagged(list):
        pass

    lp, ref = [torch.randn(3), torch.randn(2)], [torch.randn(3), torch.randn(2)]
    got = kl_reward(Tagged(lp), Tagged(ref), coef=0.1)
    want = kl_reward(lp, ref, coef=0.1, backend="torch")
    for g, w in zip(got.kl, want.kl):
        torch.testing.assert_close(g, w)


# ---------------------------------------------------------------- negative bits


def _neg(values):
    """A tensor whose logical values are ``values`` but whose memory holds their negation."""
    return torch._neg_view(-torch.tensor(values))


def test_negative_bit_offsets_are_read_as_their_values():
    lp, ref = torch.randn(6), torch.randn(6)
    bad = _neg([0, -2, -4, -6])  # memory [0, 2, 4, 6]: looks valid to a raw read
    assert bad.is_neg() and bad.tolist() == [0, -2, -4, -6]
    for backend in ("auto", "cpu", "torch"):
        with pytest.raises(ValueError, match="offsets"):
            kl_reward(lp, ref, offsets=bad, coef=0.1, backend=backend)
    good = _neg([0, 2, 4, 6])
    out = kl_reward(lp, ref, offsets=good, coef=0.1)
    torch.testing.assert_close(out.kl, lp - ref)


def test_negative_bit_lengths_and_prompt_lens():
    lp, ref = torch.randn(2, 4), torch.randn(2, 4)
    with pytest.raises(ValueError, match="lengths"):
        kl_reward(lp, ref, lengths=_neg([-2, 3]), coef=0.1)
    with pytest.raises(ValueError, match="prompt_lens"):
        kl_reward(lp, ref, lengths=torch.tensor([2, 3]), prompt_lens=_neg([-1, 0]), coef=0.1)
    with pytest.raises(ValueError, match="offsets"):
        kl_penalty_loss(torch.randn(6), torch.randn(6), torch.randn(6), offsets=_neg([0, -2, -6]))


# ---------------------------------------------------------------- non-finite coefficients


@pytest.mark.parametrize("coef", [math.nan, math.inf, -math.inf, 2.0 ** 200])
def test_non_finite_coef_is_rejected(coef):
    lp, ref = torch.randn(2, 4), torch.randn(2, 4)
    for backend in ("auto", "cpu", "torch"):
        with pytest.raises(ValueError, match="coef"):
            kl_reward(lp, ref, torch.ones(2, 4), lengths=torch.tensor([2, 4]), coef=coef, backend=backend)


@pytest.mark.parametrize("value", [math.nan, math.inf, 1e39])
def test_non_finite_coef_tensor_is_rejected_on_cpu(value):
    lp, ref = torch.randn(2, 4), torch.randn(2, 4)
    for coef in (torch.tensor(value), torch.tensor([0.1, value])):
        with pytest.raises(ValueError, match="coef"):
            kl_reward(lp, ref, lengths=torch.tensor([2, 4]), coef=coef)
    with pytest.raises(ValueError, match="beta"):
        kl_penalty_loss(torch.randn(2, 4), torch.randn(2, 4), torch.randn(2), beta=torch.tensor([0.1, value]))


# ---------------------------------------------------------------- straight-through at infinity


@pytest.mark.parametrize("estimator,lp,ref", [
    *[(e, lp, ref) for e in ("k1+", "abs+") for lp, ref in ((0.0, -math.inf), (-math.inf, 0.0), (math.inf, 0.0))],
    ("k3+", 0.0, -math.inf),  # (k3 itself is NaN at d = -inf, expm1(inf) - inf, in every backend)
])
def test_straight_through_infinite_difference_matches_kernel(estimator, lp, ref):
    """Under autograd the torch backend formed ``v.detach() + (k2 - k2.detach())``: inf - inf = NaN."""
    outs, grads = {}, {}
    for backend in ("torch", "cpu"):
        x = torch.tensor([lp, -0.5], requires_grad=True)
        r = torch.tensor([ref, -0.25])
        out = kl_reward(x, r, offsets=torch.tensor([0, 2]), coef=0.1, estimator=estimator, backend=backend,
                        detach=False)
        out.kl.sum().backward()
        outs[backend], grads[backend] = out.kl.detach(), x.grad
    assert not torch.isnan(outs["torch"]).any(), outs["torch"]
    torch.testing.assert_close(outs["torch"], outs["cpu"])
    torch.testing.assert_close(grads["torch"], grads["cpu"])


# ---------------------------------------------------------------- clear errors


def test_sparse_inputs_name_the_argument():
    lp, ref = torch.randn(2, 4), torch.randn(2, 4)
    with pytest.raises(TypeError, match="log_probs.*strided"):
        kl_reward(lp.to_sparse(), ref, coef=0.1)
    with pytest.raises(TypeError, match="ref_log_probs.*strided"):
        kl_reward(lp, ref.to_sparse(), coef=0.1)
    with pytest.raises(TypeError, match="mask.*strided"):
        kl_reward(lp, ref, mask=(lp > 0).to_sparse(), coef=0.1)
    with pytest.raises(TypeError, match="reward.*strided"):
        kl_reward(lp, ref, torch.ones(2, 4).to_sparse(), coef=0.1)
    with pytest.raises(TypeError, match="advantages.*strided"):
        kl_penalty_loss(lp, ref, torch.randn(2, 4).to_sparse())


def test_process_group_of_wrong_type_is_a_type_error():
    with pytest.raises(TypeError, match="process_group"):
        kl_penalty_loss(torch.randn(2, 4), torch.randn(2, 4), torch.randn(2), process_group="world")


def test_mixed_list_dtypes_name_the_element():
    with pytest.raises(TypeError, match=r"log_probs\[1\].*float64.*log_probs\[0\].*float32"):
        kl_reward([torch.randn(3), torch.randn(2, dtype=torch.float64)], [torch.randn(3), torch.randn(2)], coef=0.1)


_C_READERS = """
import torch
from kl_kernels import ragged

class ShortIter(list):
    def __iter__(self):
        return iter(list.__getitem__(self, slice(0, 1)))

lp = ShortIter([torch.randn(3), torch.randn(2), torch.randn(4)])
ref = ShortIter([torch.randn(3), torch.randn(2), torch.randn(4)])
assert ragged.SequenceList.of(lp, {torch.float32}) is None  # tensor_lists.cpp declines a subclass
print("DECLINED")
"""


def test_c_list_readers_decline_subclasses():
    """The C readers themselves (not only api.py's plain_sequence) refuse list subclasses."""
    proc = subprocess.run([sys.executable, "-c", _C_READERS], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "DECLINED" in proc.stdout, f"exit {proc.returncode}: {proc.stderr[-2000:]}"


# ---------------------------------------------------------------- found by the fuzzer (tests/fuzz)


@pytest.mark.parametrize("bounds", [(None, 2.0 ** 200), (-1e39, None), (-math.inf, math.inf)])
def test_clamp_bounds_beyond_float32(bounds):
    """torch.clamp raised RuntimeError ('cannot be converted to type float without overflow') for a
    bound beyond float32's range on float32 values; such a bound is as good as infinite there."""
    lp, ref = torch.tensor([-1.0, -50.0, 3e38]), torch.tensor([-2.0, 0.0, -3e38])
    outs = [kl_reward(lp, ref, offsets=torch.tensor([0, 3]), coef=0.1, estimator="k2", clamp_output=bounds,
                      clamp_input=bounds, backend=b).kl for b in ("torch", "cpu")]
    torch.testing.assert_close(outs[0], outs[1])


@pytest.mark.parametrize("bounds", [(-1.09e308, -1.79e308), (math.inf, math.inf), (-math.inf, -math.inf),
                                    (None, -1e39), (4e38, None)])
def test_degenerate_clamp_bounds_are_rejected(bounds):
    """(-1.09e308, -1.79e308) is reversed but both saturate to -inf; an all-infinite pin made the
    torch reference return inf where the CPU kernel read 'no bound'."""
    lp, ref = torch.tensor([-3.0, 1.0]), torch.zeros(2)
    for backend in ("auto", "torch", "cpu"):
        with pytest.raises(ValueError, match="clamp_input"):
            kl_reward(lp, ref, offsets=torch.tensor([0, 2]), clamp_input=bounds, backend=backend)
