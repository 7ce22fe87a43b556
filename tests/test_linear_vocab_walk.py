"""The hidden-state path's backward walking the vocabulary (the default, ``kl_kernels.lm_head``) against the
token walk (``KL_KERNELS_HEAD_SCHEDULE=tokens``, the one-pass loss's) and the float64 formulas:
``linear_token_logprobs``, ``linear_full_kl`` and ``linear_kl_penalty_loss`` (two passes), every row backend,
slices of 1 entry to the whole vocabulary, labels in other slices, masks and ignore_index, and the device
defaults."""

from __future__ import annotations

import os
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import CUDA_EMULATED
from kl_kernels import linear_full_kl, linear_kl_penalty_loss, linear_token_logprobs
from kl_kernels import lm_head
from test_linear_token_logprobs import _want


def _walk(name):
    return mock.patch.dict(os.environ, {"KL_KERNELS_HEAD_SCHEDULE": name})


@pytest.mark.parametrize("backend", ["torch", "cpu", pytest.param("triton", marks=pytest.mark.triton), CUDA_EMULATED])
@given(n=st.integers(0, 13), hid=st.sampled_from([1, 8, 33]), vocab=st.sampled_from([1, 7, 50, 300]),
       chunk=st.sampled_from([1, 3, 100, None]), with_bias=st.booleans(), entropy=st.booleans(),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float64]),
       temperature=st.sampled_from([1.0, 0.6]), seed=st.integers(0, 2**31 - 1))
@settings(max_examples=25, deadline=None)
def test_token_logprobs_vocab_walk_matches_float64(backend, n, hid, vocab, chunk, with_bias, entropy, dtype,
                                                   temperature, seed):
    if dtype == torch.float64 and backend != "torch":
        return  # the fused kernels read fp32/bf16/fp16
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, hid, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(vocab, hid, generator=g) * 0.5).to(dtype).requires_grad_()
    b = torch.randn(vocab, generator=g).to(dtype).requires_grad_() if with_bias else None
    y = torch.randint(0, vocab, (n,), generator=g)
    y[torch.rand(n, generator=g) < 0.2] = -100
    mask = torch.rand(n, generator=g) < 0.8
    counted = (y != -100) & mask
    with _walk("vocab"):
        out = linear_token_logprobs(h, w, y, bias=b, temperature=temperature, return_entropy=entropy, mask=mask,
                                    chunk_size=chunk, backend=backend)
        up = torch.randn(n, generator=g, dtype=torch.float64)
        total = (out.log_probs.double() * up).sum() + ((out.entropy.double() * up).sum() if entropy else 0.0)
        leaves = [h, w] + ([b] if b is not None else [])
        got = torch.autograd.grad(total, leaves) if total.requires_grad else None
    doubles = [t.detach().double().requires_grad_() for t in leaves]
    lp64, ent64 = _want(*doubles[:2], doubles[2] if b is not None else None, y, counted, temperature, entropy)
    low = dtype == torch.bfloat16
    tol = dict(rtol=3e-2, atol=3e-2) if low else dict(rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out.log_probs.double(), lp64.detach(), **tol)
    if entropy:
        torch.testing.assert_close(out.entropy.double(), ent64.detach(), **tol)
    if got is None:
        return
    want = torch.autograd.grad((lp64 * up).sum() + ((ent64 * up).sum() if entropy else 0.0), doubles)
    for name, a, e in zip(("hidden", "weight", "bias"), got, want):
        gtol = dict(rtol=5e-2, atol=5e-2 * (1 + n)) if low else dict(rtol=1e-4, atol=1e-4)
        assert a.dtype == dtype, name
        torch.testing.assert_close(a.double(), e, **gtol, msg=lambda m, name=name: f"d {name}: {m}")


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_vocab_walk_equals_token_walk_float32(backend):
    """Both walks on one problem: the same log-probs (forward is shared) and gradients to float32 rounding;
    only the hidden/weight/bias the caller asked for get one."""
    g = torch.Generator().manual_seed(3)
    h = torch.randn(37, 16, generator=g)
    w = torch.randn(203, 16, generator=g) * 0.3
    b = torch.randn(203, generator=g)
    y = torch.randint(0, 203, (37,), generator=g)
    y[::5] = -100
    res = {}
    for walk in ("tokens", "vocab"):
        hh, ww, bb = (t.clone().requires_grad_() for t in (h, w, b))
        with _walk(walk):
            out = linear_token_logprobs(hh, ww, y, bias=bb, temperature=0.7, return_entropy=True, chunk_size=5,
                                        backend=backend)
            (out.log_probs.sum() + 0.3 * out.entropy.sum()).backward()
        res[walk] = (out.log_probs, out.entropy, hh.grad, ww.grad, bb.grad)
    for a, e in zip(res["vocab"], res["tokens"]):
        torch.testing.assert_close(a, e, rtol=2e-5, atol=2e-5)
    # only the weight wants a gradient (a frozen trunk): the walk skips d hidden, same d weight
    grads = {}
    for walk in ("tokens", "vocab"):
        ww = w.clone().requires_grad_()
        with _walk(walk):
            linear_token_logprobs(h, ww, y, chunk_size=5, backend=backend).log_probs.sum().backward()
        grads[walk] = ww.grad
    torch.testing.assert_close(grads["vocab"], grads["tokens"], rtol=2e-5, atol=2e-5)


def test_vocab_walk_full_kl_and_reference_grad():
    g = torch.Generator().manual_seed(5)
    h, rh = torch.randn(23, 8, generator=g), torch.randn(23, 6, generator=g)
    w, rw = torch.randn(90, 8, generator=g) * 0.4, torch.randn(90, 6, generator=g) * 0.4
    mask = torch.rand(23, generator=g) < 0.7
    up = torch.randn(23, generator=g)
    res = {}
    for walk in ("tokens", "vocab"):
        for ref_grad in (False, True):  # with the reference's gradients the GPU takes the token walk
            hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
            rr = rw.clone().requires_grad_(ref_grad)
            with _walk(walk):
                kl = linear_full_kl(hh, ww, rh, rr, mask=mask, temperature=0.8, chunk_size=4)
                (kl * up).sum().backward()
            res[walk, ref_grad] = (kl, hh.grad, ww.grad) + ((rr.grad,) if ref_grad else ())
    h64, w64 = h.double().requires_grad_(), w.double().requires_grad_()
    lp = torch.log_softmax(h64 @ w64.t() / 0.8, -1)
    lq = torch.log_softmax(rh.double() @ rw.double().t() / 0.8, -1)
    want_kl = torch.where(mask, (lp.exp() * (lp - lq)).sum(-1), 0.0)
    want = torch.autograd.grad((want_kl * up.double()).sum(), [h64, w64])
    for key, got in res.items():
        torch.testing.assert_close(got[0].double(), want_kl.detach(), rtol=1e-4, atol=1e-5, msg=str(key))
        for a, e in zip(got[1:3], want):
            torch.testing.assert_close(a.double(), e, rtol=1e-4, atol=1e-5, msg=str(key))
    torch.testing.assert_close(res["vocab", True][3], res["tokens", True][3])


def test_vocab_walk_loss_two_passes_match_one_pass():
    g = torch.Generator().manual_seed(7)
    b, t, hid, vocab = 3, 6, 8, 70
    h, w = torch.randn(b, t, hid, generator=g), torch.randn(vocab, hid, generator=g) * 0.4
    rh, rw = torch.randn(b, t, hid, generator=g), torch.randn(vocab, hid, generator=g) * 0.4
    labels = torch.randint(0, vocab, (b, t), generator=g)
    old, adv = -torch.rand(b, t, generator=g) * 3 - 2, torch.randn(b, generator=g)
    mask = torch.rand(b, t, generator=g) < 0.8
    res = {}
    for walk, one_pass in (("tokens", True), ("vocab", None), ("vocab", False), ("tokens", False)):
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        with _walk(walk):
            out = linear_kl_penalty_loss(hh, ww, labels, old, adv, ref_hidden=rh, ref_weight=rw, mask=mask,
                                         beta=0.05, estimator="k3", clip_epsilon=0.2, chunk_size=4,
                                         one_pass=one_pass, entropy_coef=0.01)
            out.loss.backward()
        res[walk, one_pass] = (out.loss, hh.grad, ww.grad)
    for key in (("vocab", None), ("vocab", False), ("tokens", False)):
        for a, e in zip(res[key], res["tokens", True]):
            torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-6, msg=str(key))


def test_device_defaults_and_override(monkeypatch):
    monkeypatch.delenv("KL_KERNELS_HEAD_SCHEDULE", raising=False)
    assert lm_head.schedule(torch.device("cpu")) == "vocab"
    assert lm_head.schedule(torch.device("meta")) == "vocab"  # any accelerator
    assert lm_head.chunk_tokens(None, 128256, torch.device("cpu")) == (1 << 24) // 128256
    # on a GPU whole tensor-core tiles of tokens (128 rows): 1046 -> 1024 at V = 128k, N = 8192 in 8 equal chunks
    assert lm_head.chunk_tokens(None, 128256, torch.device("meta")) == 1024
    assert lm_head.chunk_tokens(None, 151936, torch.device("meta")) == 768
    assert lm_head.chunk_tokens(None, 32000, torch.device("meta")) == 4096
    assert lm_head.chunk_tokens(None, 1 << 21, torch.device("meta")) == 64  # under one tile: as it comes
    assert lm_head.chunk_tokens(7, 128256, torch.device("meta")) == 7
    # the GPU case: 4096 columns a slice, whole tensor-core tiles; small problems one slice
    assert lm_head.slice_width(1046, 8192, 128256, torch.device("meta")) == 4096
    assert lm_head.slice_width(1046, 16384, 151936, torch.device("meta")) % 128 == 0
    assert lm_head.slice_width(2, 4, 10, torch.device("cpu")) == 5
    assert lm_head.slice_width(100, 3, 10, torch.device("cpu")) == 10
    monkeypatch.setenv("KL_KERNELS_HEAD_SCHEDULE", "tokens")
    assert lm_head.schedule(torch.device("cpu")) == "tokens"
    monkeypatch.setenv("KL_KERNELS_HEAD_SCHEDULE", "diagonal")
    with pytest.raises(ValueError, match="KL_KERNELS_HEAD_SCHEDULE"):
        lm_head.schedule(torch.device("cpu"))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_default_walks_the_vocabulary_and_matches(dtype, monkeypatch):
    """On a GPU the default call takes the vocabulary walk (several slices here: a small chunk_size) and
    agrees with the token walk and with float64; the head's gradient comes in its own dtype."""
    monkeypatch.delenv("KL_KERNELS_HEAD_SCHEDULE", raising=False)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    g = torch.Generator().manual_seed(11)
    n, hid, vocab = 300, 64, 1000
    h = torch.randn(n, hid, generator=g).to(dtype)
    w = (torch.randn(vocab, hid, generator=g) * 0.2).to(dtype)
    y = torch.randint(0, vocab, (n,), generator=g)
    y[::7] = -100
    up = torch.randn(n, generator=g, dtype=torch.float64)
    assert lm_head.schedule(torch.device("cuda")) == "vocab"
    res = {}
    for walk in ("vocab", "tokens"):
        monkeypatch.setenv("KL_KERNELS_HEAD_SCHEDULE", walk)
        hh, ww = h.cuda().requires_grad_(), w.cuda().requires_grad_()
        out = linear_token_logprobs(hh, ww, y.cuda(), return_entropy=True, chunk_size=64)
        ((out.log_probs.double().cpu() * up).sum() + (out.entropy.double().cpu() * up).sum()).backward()
        assert ww.grad.dtype == dtype
        res[walk] = (out.log_probs.cpu(), out.entropy.cpu(), hh.grad.cpu(), ww.grad.cpu())
    doubles = [h.double().requires_grad_(), w.double().requires_grad_()]
    counted = y != -100
    lp64, ent64 = _want(*doubles, None, y, counted, 1.0, True)
    want = torch.autograd.grad((lp64 * up).sum() + (ent64 * up).sum(), doubles)
    low = dtype == torch.bfloat16
    for walk, (lp, ent, gh, gw) in res.items():
        torch.testing.assert_close(lp.double(), lp64.detach(), rtol=3e-2 if low else 1e-4, atol=3e-2 if low else 1e-4)
        torch.testing.assert_close(ent.double(), ent64.detach(), rtol=3e-2 if low else 1e-4,
                                   atol=3e-2 if low else 1e-4)
        for a, e in ((gh, want[0]), (gw, want[1])):
            rel = float((a.double() - e).norm() / e.norm())
            assert rel < (1e-2 if low else 1e-5), (walk, rel)
