"""torch.compile(fullgraph=True) traces through kl_reward (no graph break) and matches eager."""

from __future__ import annotations

import pytest
import torch

from kl_kernels import kl_reward


def _packed(lp, ref, mask, offsets, score, coef, backend):
    out = kl_reward(lp, ref, score, coef=coef, mask=mask, offsets=offsets, estimator="k3", reward_placement="last",
                    clamp_input=(-20.0, 20.0), clamp_output=(-10.0, 10.0), backend=backend)
    return out.kl, out.reward, out.kl_sum, out.count


def _padded(lp, ref, mask, lengths, reward, backend):
    out = kl_reward(lp, ref, reward, mask=mask, lengths=lengths, padding_side="left", return_ref=True, backend=backend)
    return out.kl, out.reward, out.ref_log_probs, out.kl_sum, out.count


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_fullgraph_compile_matches_eager(layout, backend):
    g = torch.Generator().manual_seed(0)
    lp, ref = -torch.rand(60, generator=g), -torch.rand(60, generator=g)
    mask = torch.rand(60, generator=g) < 0.7
    if layout == "packed":
        fn, args = _packed, (lp, ref, mask, torch.tensor([0, 7, 7, 60]), torch.ones(3), torch.tensor([0.1, 0.2, 0.3]),
                             backend)
    else:
        fn, args = _padded, (lp.view(6, 10), ref.view(6, 10), mask.view(6, 10), torch.tensor([0, 1, 5, 10, 3, 9]),
                             torch.randn(6, 10, 1, generator=g), backend)
    compiled = torch.compile(fn, fullgraph=True)
    for got, want in zip(compiled(*args), fn(*args)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_fused_backward_under_compile():
    """The fused op's autograd (kl_reward_bwd) is traced by torch.compile too."""
    g = torch.Generator().manual_seed(1)
    lp = (-torch.rand(40, generator=g)).requires_grad_()
    ref = -torch.rand(40, generator=g)
    offsets = torch.tensor([0, 15, 40])

    def loss(a):
        return kl_reward(a, ref, offsets=offsets, estimator="k3", detach=False, backend="cpu").kl.sum()

    (eager,) = torch.autograd.grad(loss(lp), lp)
    (compiled,) = torch.autograd.grad(torch.compile(loss, fullgraph=True)(lp), lp)
    torch.testing.assert_close(compiled, eager)
