"""kl_reward(out=...): caller-provided result buffers, written in place by the fused kernels (copied
by the other backends), checked before any kernel runs."""

from __future__ import annotations

import pytest
import torch

from batches import to_device
from conftest import backend_device
from kl_kernels import KLRewardOutput, kl_reward

BACKENDS = ["cpu", "torch", pytest.param("triton", marks=pytest.mark.triton)]


def _call(layout, dtype=torch.float32, trailing=False):
    g = torch.Generator().manual_seed(0)
    if layout == "packed":
        lp, ref = -torch.rand(40, generator=g).to(dtype), -torch.rand(40, generator=g).to(dtype)
        reward = torch.randn(40, generator=g)
        kw = dict(offsets=torch.tensor([0, 0, 1, 17, 40]))
    else:
        lp, ref = -torch.rand(4, 12, generator=g).to(dtype), -torch.rand(4, 12, generator=g).to(dtype)
        reward = torch.randn(4, 12, generator=g)
        kw = dict(lengths=torch.tensor([0, 1, 12, 7]), padding_side="right")
    if trailing:
        reward = reward.unsqueeze(-1)
    return (lp, ref, reward), dict(kw, coef=0.1, estimator="k3", mask=torch.rand(lp.shape, generator=g) < 0.8)


def _buffers(want: KLRewardOutput):
    return KLRewardOutput(*(None if t is None else torch.full_like(t, float("nan")) if t.is_floating_point()
                            else torch.full_like(t, -7) for t in want))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", ["packed", "padded"])
@pytest.mark.parametrize("trailing", [False, True])
def test_out_holds_the_results(backend, layout, trailing):
    args, kw = to_device(_call(layout, trailing=trailing), backend_device(backend))
    want = kl_reward(*args, **kw, return_ref=True, backend=backend)
    out = _buffers(want)
    addresses = [t.data_ptr() for t in out]
    got = kl_reward(*args, **kw, return_ref=True, backend=backend, out=out)
    for name, g, o, w in zip(KLRewardOutput._fields, got, out, want):
        assert g is o, name  # the caller's own tensors come back
        torch.testing.assert_close(g, w, msg=name)
    assert [t.data_ptr() for t in got] == addresses
    again = kl_reward(*args, **kw, return_ref=True, backend=backend, out=out)  # a loop reusing its buffers
    assert all(a is b for a, b in zip(again, out))


def test_fused_kernel_writes_in_place_without_allocating():
    """The cpu backend must not compute into fresh tensors and copy: its launcher gets the buffers (the
    results are the buffers, and the call allocates nothing of the batch's size: test_out_allocation_free)."""
    from test_out_allocation_free import _Allocations

    for extra in ({}, {"clamp_input": (-20, 20)}):
        args, kw = _call("padded", trailing=True)
        want = kl_reward(*args, **kw, **extra, backend="torch")
        for _ in range(2):  # first sight (validated in full) and the signature's plan
            out = _buffers(want)
            with _Allocations() as seen:
                got = kl_reward(*args, **kw, **extra, backend="cpu", out=out)
            assert got.kl is out.kl and got.reward is out.reward and got.kl_sum is out.kl_sum
            assert got.count is out.count
            assert not [n for _, n in seen.sizes if n > 4], seen.sizes
            torch.testing.assert_close(got.kl, want.kl)
            torch.testing.assert_close(got.reward, want.reward)


def test_entries_may_be_none():
    args, kw = _call("packed")
    want = kl_reward(*args, **kw)
    kl = torch.empty_like(want.kl)
    got = kl_reward(*args, **kw, out=(kl, None, None, None, None))
    assert got.kl is kl
    torch.testing.assert_close(got.reward, want.reward)


@pytest.mark.parametrize("case,error,match", [
    ("not a tuple", TypeError, "out must be"),
    ("wrong shape", ValueError, r"out.kl must be torch.float32 of shape \[40\]"),
    ("wrong dtype", ValueError, r"out.count must be torch.int64"),
    ("strided", ValueError, "out.kl must be contiguous"),
    ("ref without return_ref", ValueError, "out.ref_log_probs must be None"),
    ("overlapping outs", ValueError, "out.kl overlaps out.reward"),
    ("overlapping input", ValueError, "out.kl overlaps log_probs"),
    ("list layout", TypeError, "out= takes the packed or padded layout"),
    ("autograd", ValueError, "out= does not record autograd"),
])
def test_bad_out_is_rejected_before_any_kernel(case, error, match):
    args, kw = _call("packed")
    want = kl_reward(*args, **kw)
    out = list(_buffers(want))
    extra = {}
    if case == "not a tuple":
        out = out[0]
    elif case == "wrong shape":
        out[0] = torch.empty(41)
    elif case == "wrong dtype":
        out[4] = torch.empty(4, dtype=torch.int32)
    elif case == "strided":
        out[0] = torch.empty(80)[::2]
    elif case == "ref without return_ref":
        out[2] = torch.empty(40)
    elif case == "overlapping outs":
        both = torch.empty(60)
        out[0], out[1] = both[:40], both[20:]
    elif case == "overlapping input":
        out[0] = args[0]
    elif case == "list layout":
        args = ([args[0][:1], args[0][1:]], [args[1][:1], args[1][1:]], None)
        kw = dict(coef=0.1)
    elif case == "autograd":
        args = (args[0].clone().requires_grad_(), *args[1:])
        extra = dict(detach=False)
    snapshot = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    with pytest.raises(error, match=match):
        kl_reward(*args, **kw, **extra, out=tuple(out) if isinstance(out, list) else out)
    for a, b in zip(args, snapshot):
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b)  # nothing ran
