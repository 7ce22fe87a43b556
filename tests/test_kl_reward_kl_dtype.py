"""``kl_reward(kl_dtype=...)``: float32 per-token results from bfloat16/float16 log-probs (issue 27:
OpenRLHF returns float32 KL), on every backend and layout.

The contract: the results are those of the same call on the inputs widened to ``kl_dtype`` (exact:
every half value is a float32 value, and the kernels' math is float32 either way), so nothing is
rounded to the narrow dtype; gradients come back in the inputs' own dtypes. The widened call itself
is held to the float64 oracle here and by the oracle matrix (tests/test_kl_reward_oracle.py).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import assume, given, settings

from batches import LAYOUTS, build, check, to_device
from conftest import CUDA_EMULATED, backend_device
from kl_kernels import kl_reward
from strategies import cases
from test_kl_reward_oracle import _auto_is_ambiguous

BACKENDS = ["torch", "cpu", CUDA_EMULATED, pytest.param("triton", marks=pytest.mark.triton)]


def _widened(case):
    wide = lambda ts: None if ts is None else [t.float() for t in ts]  # noqa: E731
    return dataclasses.replace(case, lp=wide(case.lp), ref=wide(case.ref))


def _same(got, want, what):
    if want is None:
        assert got is None, what
        return
    if isinstance(want, (list, tuple)):
        assert len(got) == len(want), what
        for i, (g, w) in enumerate(zip(got, want)):
            _same(g, w, f"{what}[{i}]")
        return
    if want.is_nested:
        got, want = got.unbind(), want.unbind()
        return _same(list(got), list(want), what)
    assert got.dtype == want.dtype and got.shape == want.shape, (what, got.dtype, want.dtype, got.shape, want.shape)
    assert torch.equal(got.nan_to_num(7.0), want.nan_to_num(7.0)), what


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", LAYOUTS)
@given(case=cases(dtypes=(torch.bfloat16, torch.float16)))
@settings(max_examples=12, deadline=None)
def test_half_inputs_give_the_widened_calls_results(backend, layout, case):
    """Equal, bitwise and in dtype, to the call on float32 inputs; that call matches the oracle.
    Mixed bf16/fp16 log-probs, which the fused kernels decline, run there once widened."""
    assume(not (layout == "nested_strided" and case.batch == 0))  # torch has no empty strided nested tensor
    assume(not _auto_is_ambiguous(case, layout))  # raises, asking for a placement (tested in the oracle)
    dev = backend_device(backend)
    wide = _widened(case)
    got = kl_reward(**to_device(build(case, layout).kwargs, dev), kl_dtype=torch.float32, backend=backend)
    want, _, _ = check(wide, layout, device=dev, backend=backend)
    assert got.kl.dtype == torch.float32 if not isinstance(got.kl, list) else all(
        t.dtype == torch.float32 for t in got.kl)
    _same(to_device(got, "cpu"), want, layout)


@pytest.mark.parametrize("backend", ["torch", "cpu", CUDA_EMULATED])
@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_gradients_flow_back_in_the_inputs_dtype(backend, layout):
    g = torch.Generator().manual_seed(0)
    shape = (11,) if layout == "packed" else (3, 5)
    geo = dict(offsets=torch.tensor([0, 4, 4, 11])) if layout == "packed" else dict(lengths=torch.tensor([5, 0, 3]))
    lp = (-3 * torch.rand(shape, generator=g)).to(torch.bfloat16)
    ref = (-3 * torch.rand(shape, generator=g)).to(torch.bfloat16)
    grads = {}
    for name, dtype in (("kl_dtype", torch.float32), ("widened", None)):
        a, b = lp.clone().requires_grad_(True), ref.clone().requires_grad_(True)
        x, y = (a, b) if dtype else (a.float(), b.float())
        out = kl_reward(x, y, torch.ones(3), coef=0.3, estimator="k3", reward_placement="last", detach=False,
                        kl_dtype=dtype, backend=backend, **geo)
        assert out.kl.dtype == out.reward.dtype == torch.float32
        (out.kl * 0.5 + out.reward * 0.25).sum().backward()
        grads[name] = (a.grad, b.grad)
    for got, want in zip(grads["kl_dtype"], grads["widened"]):
        assert got.dtype == torch.bfloat16 and torch.equal(got, want)


def test_out_buffers_and_float64():
    lp = torch.tensor([-1.0, -2.0, -0.5], dtype=torch.bfloat16)
    ref = torch.tensor([-1.5, -2.0, -0.25], dtype=torch.bfloat16)
    kl = torch.full((3,), float("nan"))
    out = kl_reward(lp, ref, offsets=torch.tensor([0, 3]), kl_dtype=torch.float32, out=(kl, None, None, None, None))
    assert out.kl is kl and torch.equal(kl, (lp.float() - ref.float()))
    with pytest.raises(ValueError, match="out"):  # a bfloat16 buffer for float32 results
        kl_reward(lp, ref, offsets=torch.tensor([0, 3]), kl_dtype=torch.float32,
                  out=(torch.empty(3, dtype=torch.bfloat16), None, None, None, None))
    # float64 results: the torch backend (the fused kernels decline float64, and auto picks torch)
    out = kl_reward(lp.float(), ref.float(), offsets=torch.tensor([0, 3]), kl_dtype=torch.float64)
    assert out.kl.dtype == torch.float64 and out.kl_sum.dtype == torch.float64


def test_kl_dtype_is_checked():
    lp = torch.zeros(3)
    kw = dict(offsets=torch.tensor([0, 3]))
    with pytest.raises(TypeError, match="kl_dtype must be None or a torch floating dtype"):
        kl_reward(lp, lp, kl_dtype="float32", **kw)
    with pytest.raises(ValueError, match="kl_dtype must be one of"):
        kl_reward(lp, lp, kl_dtype=torch.int32, **kw)
    with pytest.raises(ValueError, match=r"kl_dtype \(torch.bfloat16\) must be log_probs's dtype \(torch.float32\)"):
        kl_reward(lp, lp, kl_dtype=torch.bfloat16, **kw)
    with pytest.raises(ValueError, match=r"ref_log_probs\[1\]'s dtype"):  # neither is wider than the other
        half = [torch.zeros(2, dtype=torch.bfloat16), torch.zeros(1, dtype=torch.bfloat16)]
        kl_reward(half, [half[0], torch.zeros(1, dtype=torch.float16)], kl_dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="log_probs"):  # an integer tensor is not widened into an accepted one
        kl_reward(torch.zeros(3, dtype=torch.int64), lp, kl_dtype=torch.float32, **kw)
    same = kl_reward(lp, lp, kl_dtype=torch.float32, **kw)  # the inputs' own dtype: nothing changes
    assert same.kl.dtype == torch.float32
