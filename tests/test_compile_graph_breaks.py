"""The ops are captured by ``torch.compile`` without graph breaks (issue 49 item 3), in the default mode and
in ``mode="reduce-overhead"`` (CUDA graphs on a GPU; on the CPU the same capture), counted with dynamo's
own counters (``torch._dynamo.utils.counters["graph_break"]``), not with ``fullgraph=True`` alone: a break
anywhere (the loss's backward included) shows up here. Padded and packed, ``kl_reward`` and
``kl_penalty_loss`` forward + backward, on the fused CPU kernels' ops."""

from __future__ import annotations

import pytest
import torch

from kl_kernels import kl_penalty_loss, kl_reward


def _inputs(layout):
    g = torch.Generator().manual_seed(0)
    b, t = 4, 9
    lp, ref, old = (-torch.rand(b, t, generator=g) for _ in range(3))
    mask = torch.rand(b, t, generator=g) < 0.8
    adv, score = torch.randn(b, t, generator=g), torch.randn(b, generator=g)
    if layout == "packed":
        geo = dict(offsets=torch.arange(b + 1) * t)
        lp, ref, old, mask, adv = (x.reshape(-1) for x in (lp, ref, old, mask, adv))
    else:
        geo = dict(lengths=torch.tensor([9, 3, 0, 7]), padding_side="left")
    return lp, ref, old, mask, adv, score, geo


def _reward(layout):
    lp, ref, _, mask, _, score, geo = _inputs(layout)

    def fn(lp, ref, score):
        out = kl_reward(lp, ref, score, coef=0.05, mask=mask, reward_placement="last", backend="cpu", **geo)
        return out.kl, out.reward, out.kl_sum, out.count
    return fn, (lp, ref, score)


def _loss(layout):
    lp, ref, old, mask, adv, _, geo = _inputs(layout)

    def fn(leaf, old, adv, ref):
        out = kl_penalty_loss(leaf, old, adv, ref_log_probs=ref, beta=0.05, estimator="k3", mask=mask,
                              clip_epsilon=0.2, dual_clip=3.0, backend="cpu", **geo)
        return out.loss
    return fn, (lp.requires_grad_(), old, adv, ref)


def _results(op, fn, args):
    """The outputs (the loss's: the loss and its gradient, backward run by AOTAutograd's compiled graph)."""
    got = fn(*args)
    if op == "kl_reward":
        return got
    (grad,) = torch.autograd.grad(got, args[0])
    return got.detach(), grad


@pytest.mark.slow
@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("op", ["kl_reward", "kl_penalty_loss"])
def test_captured_without_graph_breaks(op, layout, mode):
    from torch._dynamo.utils import counters

    fn, args = (_reward if op == "kl_reward" else _loss)(layout)
    torch._dynamo.reset()
    counters.clear()
    got = _results(op, torch.compile(fn, mode=mode), args)
    breaks = dict(counters["graph_break"])
    assert not breaks, f"{op} {layout} mode={mode}: graph breaks {breaks}"
    assert counters["stats"]["unique_graphs"] >= 1
    for g, w in zip(got, _results(op, fn, args)):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_the_counter_sees_a_graph_break():
    """Negative control: a break in the compiled function is counted (the test above can fail)."""
    from torch._dynamo.utils import counters

    fn, args = _reward("padded")

    def broken(lp, ref, score):
        kl, *_ = fn(lp, ref, score)
        torch._dynamo.graph_break()
        return kl + 1

    torch._dynamo.reset()
    counters.clear()
    torch.compile(broken)(*args)
    assert counters["graph_break"]
