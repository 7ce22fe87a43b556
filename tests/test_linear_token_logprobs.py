"""linear_token_logprobs (hidden states x LM head, chunked) against the float64 formula
``log_softmax((h @ W.T + b) / T)[y]`` and its autograd gradients, on both row backends, several
chunk sizes (1 token, a ragged last chunk, one chunk), masks and ignore_index; gradcheck in float64;
argument checks."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import CUDA_EMULATED, backend_device
from kl_kernels import BackendUnavailableError, linear_token_logprobs
from row_batches import SOFTCAP_BACKENDS

# (logit_scale, softcap): TRL's fused LM head's transform c tanh(s x / c) / T
TRANSFORMS = st.sampled_from([(1.0, None), (1.0, None), (0.25, None), (1.0, 1.5), (2.0, 3.0), (0.5, 30.0)])


def _want(h, w, b, y, counted, temperature, entropy, logit_scale=1.0, softcap=None):
    x = (h.double() @ w.double().t() + (0 if b is None else b.double())) * logit_scale
    logits = (x if softcap is None else softcap * torch.tanh(x / softcap)) / temperature
    logp = torch.log_softmax(logits, -1)
    lp = torch.where(counted, logp.gather(-1, torch.where(counted, y, 0).unsqueeze(-1)).squeeze(-1), 0.0)
    ent = torch.where(counted, -(logp.exp() * logp).sum(-1), 0.0)
    return lp, ent


@pytest.mark.parametrize("backend", ["torch", "cpu", pytest.param("triton", marks=pytest.mark.triton), CUDA_EMULATED])
@given(n=st.integers(0, 13), hid=st.sampled_from([1, 8, 33]), vocab=st.sampled_from([1, 7, 50]),
       chunk=st.sampled_from([1, 4, 100, None]), with_bias=st.booleans(), entropy=st.booleans(),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), temperature=st.sampled_from([1.0, 0.6]),
       seed=st.integers(0, 2**31 - 1), transform=TRANSFORMS)
@settings(max_examples=30)
def test_matches_the_float64_formula(backend, n, hid, vocab, chunk, with_bias, entropy, dtype, temperature, seed,
                                     transform):
    g = torch.Generator().manual_seed(seed)
    dev = backend_device(backend)  # Triton on the GPU where there is one
    h = torch.randn(n, hid, generator=g).to(dtype).to(dev).requires_grad_()
    w = (torch.randn(vocab, hid, generator=g) * 0.5).to(dtype).to(dev).requires_grad_()
    b = torch.randn(vocab, generator=g).to(dtype).to(dev).requires_grad_() if with_bias else None
    y = torch.randint(0, vocab, (n,), generator=g)
    y[torch.rand(n, generator=g) < 0.2] = -100
    mask = torch.rand(n, generator=g) < 0.8
    y, mask = y.to(dev), mask.to(dev)
    counted = (y != -100) & mask
    logit_scale, softcap = transform
    if softcap is not None and backend not in SOFTCAP_BACKENDS:
        with pytest.raises(BackendUnavailableError, match="softcap is not implemented"):
            linear_token_logprobs(h, w, y, softcap=softcap, backend=backend)
        return
    out = linear_token_logprobs(h, w, y, bias=b, temperature=temperature, return_entropy=entropy, mask=mask,
                                chunk_size=chunk, backend=backend, logit_scale=logit_scale, softcap=softcap)
    lp_want, ent_want = _want(h, w, b, y, counted, temperature, entropy, logit_scale, softcap)
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(out.log_probs.double(), lp_want, **tol)
    leaves = [h, w] + ([b] if b is not None else [])
    up = torch.randn(n, generator=g, dtype=torch.float64).to(dev)
    total = (out.log_probs.double() * up).sum() + ((out.entropy.double() * up).sum() if entropy else 0.0)
    want_total = (lp_want * up).sum() + ((ent_want * up).sum() if entropy else 0.0)
    if entropy:
        torch.testing.assert_close(out.entropy.double(), ent_want, **tol)
    if not total.requires_grad:
        return
    got = torch.autograd.grad(total, leaves, allow_unused=True)
    doubles = [t.detach().double().requires_grad_() for t in leaves]
    lp64, ent64 = _want(*doubles[:2], doubles[2] if b is not None else None, y, counted, temperature, entropy,
                        logit_scale, softcap)
    want = torch.autograd.grad((lp64 * up).sum() + ((ent64 * up).sum() if entropy else 0.0), doubles,
                               allow_unused=True)
    del want_total
    for name, a, e in zip(("hidden", "weight", "bias"), got, want):
        if e is None:
            continue
        gtol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=5e-2, atol=5e-2 * (1 + n))
        assert a.dtype == dtype, name
        torch.testing.assert_close(a.double(), e, **gtol, msg=lambda m, name=name: f"d {name}: {m}")


def test_gradcheck_float64():
    g = torch.Generator().manual_seed(1)
    h = torch.randn(5, 4, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(6, 4, generator=g, dtype=torch.float64, requires_grad=True)
    b = torch.randn(6, generator=g, dtype=torch.float64, requires_grad=True)
    y = torch.tensor([0, 5, -100, 2, 3])

    def f(h, w, b):
        out = linear_token_logprobs(h, w, y, bias=b, temperature=1.4, return_entropy=True, chunk_size=2)
        return out.log_probs, out.entropy

    assert torch.autograd.gradcheck(f, (h, w, b))


@pytest.mark.parametrize("schedule", ["tokens", "vocab"])
@pytest.mark.parametrize("transform", [(0.3, None), (1.0, 0.8), (2.5, 1.7)])
def test_gradcheck_float64_logit_scale_and_softcap(schedule, transform, monkeypatch):
    """Gradients to hidden, the head and the bias through c tanh(s x / c) / T, both backward walks."""
    monkeypatch.setenv("KL_KERNELS_HEAD_SCHEDULE", schedule)
    g = torch.Generator().manual_seed(5)
    h = torch.randn(5, 4, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(6, 4, generator=g, dtype=torch.float64, requires_grad=True)
    b = torch.randn(6, generator=g, dtype=torch.float64, requires_grad=True)
    y = torch.tensor([0, 5, -100, 2, 3])
    logit_scale, softcap = transform

    def f(h, w, b):
        out = linear_token_logprobs(h, w, y, bias=b, temperature=1.4, return_entropy=True, chunk_size=2,
                                    logit_scale=logit_scale, softcap=softcap)
        return out.log_probs, out.entropy

    assert torch.autograd.gradcheck(f, (h, w, b))


def test_the_scale_and_cap_reach_the_reference_too():
    """ref_hidden/ref_weight: the reference's log-probs take the same logit_scale and softcap (TRL's policy and
    reference share one config), as a separate call gives them."""
    g = torch.Generator().manual_seed(8)
    h, rh = torch.randn(7, 8, generator=g) * 3, torch.randn(7, 6, generator=g) * 3
    w, rw = torch.randn(30, 8, generator=g), torch.randn(30, 6, generator=g)
    y = torch.randint(0, 30, (7,), generator=g)
    kw = dict(logit_scale=0.7, softcap=4.0, temperature=0.9, chunk_size=3)
    both = linear_token_logprobs(h, w, y, ref_hidden=rh, ref_weight=rw, **kw)
    assert torch.equal(both.ref_log_probs, linear_token_logprobs(rh, rw, y, **kw).log_probs)
    assert not torch.equal(both.ref_log_probs, linear_token_logprobs(rh, rw, y, chunk_size=3,
                                                                     temperature=0.9).log_probs)


@pytest.mark.triton
def test_fused_takes_the_scale_and_cap():
    """fused=True hands logit_scale and softcap to the fused kernels (tests/test_linear_fused.py holds them to the
    oracle): the same log-probs, entropy and gradients as the chunked path's, to float32 rounding."""
    g = torch.Generator().manual_seed(9)
    dev = backend_device("triton")
    h = (torch.randn(11, 16, generator=g) * 3).to(dev).requires_grad_()
    w = torch.randn(40, 16, generator=g).to(dev).requires_grad_()
    y = torch.randint(0, 40, (11,), generator=g).to(dev)
    kw = dict(logit_scale=0.6, softcap=5.0, temperature=0.9, return_entropy=True)
    outs = [linear_token_logprobs(h, w, y, fused=fused, **kw) for fused in (True, False)]
    grads = [torch.autograd.grad(o.log_probs.sum() + o.entropy.sum(), [h, w]) for o in outs]
    for a, b in zip((outs[0].log_probs, outs[0].entropy, *grads[0]), (outs[1].log_probs, outs[1].entropy, *grads[1])):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_padded_shape_and_chunks_agree():
    g = torch.Generator().manual_seed(2)
    h = torch.randn(2, 5, 8, generator=g)
    w = torch.randn(30, 8, generator=g)
    y = torch.randint(0, 30, (2, 5), generator=g)
    one = linear_token_logprobs(h, w, y, chunk_size=10)
    many = linear_token_logprobs(h, w, y, chunk_size=3)
    assert one.log_probs.shape == (2, 5)
    torch.testing.assert_close(one.log_probs, many.log_probs)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(weight=torch.zeros(10, 7)), ValueError, r"weight must be \[V, H\]"),
    (dict(weight=torch.zeros(10, 8, dtype=torch.float64)), ValueError, "weight must have hidden's dtype"),
    (dict(bias=torch.zeros(9)), ValueError, "bias must be None or a"),
    (dict(chunk_size=0), ValueError, "chunk_size must be None or an int >= 1"),
    (dict(labels=torch.tensor([0, 10, 1])), ValueError, r"labels must be in \[0, 10\)"),
    (dict(hidden=torch.zeros(3, 8, dtype=torch.int32)), TypeError, "hidden must be float32"),
    # the reference model's pair (lm_head.check_ref_head)
    (dict(ref_hidden=torch.zeros(3, 5)), ValueError, "ref_hidden and ref_weight come together"),
    (dict(ref_weight=torch.zeros(10, 5)), ValueError, "ref_hidden and ref_weight come together"),
    (dict(ref_bias=torch.zeros(10)), ValueError, "ref_bias needs ref_hidden and ref_weight"),
    (dict(ref_hidden=torch.zeros(3, 5), ref_weight=torch.zeros(9, 5)), ValueError,
     "ref_weight must cover weight's vocabulary V = 10"),
    (dict(ref_hidden=torch.zeros(4, 5), ref_weight=torch.zeros(10, 5)), ValueError,
     r"ref_hidden must have hidden's token shape \[3\]"),
    (dict(ref_hidden=torch.zeros(3, 5), ref_weight=torch.zeros(10, 4)), ValueError,
     r"ref_weight must be \[V, H\] .* ref_hidden.shape\[-1\] = 5"),
    (dict(ref_hidden=torch.zeros(3, 5, dtype=torch.float64), ref_weight=torch.zeros(10, 5, dtype=torch.float64)),
     ValueError, "ref_hidden must have hidden's dtype and device"),
    (dict(ref_hidden=torch.zeros(3, 5), ref_weight=torch.zeros(10, 5), ref_bias=torch.zeros(9)), ValueError,
     "ref_bias must be None or a"),
    (dict(logit_scale=0.0), ValueError, "logit_scale must be a finite number > 0"),
    (dict(softcap=0.0), ValueError, "softcap must be None"),
    (dict(softcap=float("inf")), ValueError, "softcap must be None"),
])
def test_bad_arguments_name_themselves(kwargs, error, match):
    args = dict(hidden=torch.zeros(3, 8), weight=torch.zeros(10, 8), labels=torch.tensor([0, 1, 9]))
    args.update(kwargs)
    with pytest.raises(error, match=match):
        linear_token_logprobs(args.pop("hidden"), args.pop("weight"), args.pop("labels"), **args)


def test_cpu_backend_refuses_float64_by_name():
    h, w = torch.zeros(2, 3, dtype=torch.float64), torch.zeros(4, 3, dtype=torch.float64)
    with pytest.raises(BackendUnavailableError, match="(?s)linear_token_logprobs .*backend 'cpu' cannot run.*float64"):
        linear_token_logprobs(h, w, torch.tensor([0, 1]), backend="cpu")


@pytest.mark.parametrize("backend", ["torch", "cpu", pytest.param("triton", marks=pytest.mark.triton), CUDA_EMULATED])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_reference_in_the_same_loop_is_a_separate_calls(backend, dtype):
    """ref_hidden/ref_weight: the reference's log-probs come out of the policy's chunk loop exactly as a
    separate call gives them (bit for bit), without gradients (to its tensors either, though they require
    them), and the policy's outputs and gradients are those of a call without a reference."""
    g = torch.Generator().manual_seed(11)
    dev = backend_device(backend)
    n, hid, ref_hid, vocab = 13, 8, 5, 37
    h = torch.randn(n, hid, generator=g).to(dtype).to(dev).requires_grad_()
    w = (torch.randn(vocab, hid, generator=g) * 0.5).to(dtype).to(dev).requires_grad_()
    b = torch.randn(vocab, generator=g).to(dtype).to(dev).requires_grad_()
    rh = torch.randn(n, ref_hid, generator=g).to(dtype).to(dev).requires_grad_()
    rw = (torch.randn(vocab, ref_hid, generator=g) * 0.5).to(dtype).to(dev).requires_grad_()
    rb = torch.randn(vocab, generator=g).to(dtype).to(dev)
    y = torch.randint(0, vocab, (n,), generator=g)
    y[3] = -100
    y, mask = y.to(dev), (torch.rand(n, generator=g) < 0.8).to(dev)
    common = dict(temperature=0.7, mask=mask, chunk_size=4, backend=backend)
    both = linear_token_logprobs(h, w, y, bias=b, return_entropy=True, ref_hidden=rh, ref_weight=rw, ref_bias=rb,
                                 **common)
    assert type(both).__name__ == "LinearTokenLogprobsOutput" and both._fields[-1] == "ref_log_probs"
    alone = linear_token_logprobs(h, w, y, bias=b, return_entropy=True, **common)
    with torch.no_grad():
        ref = linear_token_logprobs(rh, rw, y, bias=rb, **common)
    assert torch.equal(both.ref_log_probs, ref.log_probs) and not both.ref_log_probs.requires_grad
    assert torch.equal(both.log_probs, alone.log_probs) and torch.equal(both.entropy, alone.entropy)
    assert both.ref_log_probs.abs().sum() > 0 and not torch.equal(both.ref_log_probs, both.log_probs)
    up = torch.randn(n, generator=g).to(dev)
    got = torch.autograd.grad((both.log_probs * up).sum() + both.entropy.sum(), [h, w, b], retain_graph=True)
    want = torch.autograd.grad((alone.log_probs * up).sum() + alone.entropy.sum(), [h, w, b])
    for a, e in zip(got, want):
        assert torch.equal(a, e)
    ((both.log_probs - both.ref_log_probs).sum()).backward()
    assert rh.grad is None and rw.grad is None  # a frozen reference: nothing flows to it


def test_the_reference_keeps_the_padded_shape():
    g = torch.Generator().manual_seed(3)
    h, rh = torch.randn(2, 5, 8, generator=g), torch.randn(2, 5, 6, generator=g)
    w, rw = torch.randn(30, 8, generator=g), torch.randn(30, 6, generator=g)
    y = torch.randint(0, 30, (2, 5), generator=g)
    out = linear_token_logprobs(h, w, y, ref_hidden=rh, ref_weight=rw, chunk_size=3)
    assert out.ref_log_probs.shape == (2, 5) and out.entropy is None
    torch.testing.assert_close(out.ref_log_probs, linear_token_logprobs(rh, rw, y).log_probs)
