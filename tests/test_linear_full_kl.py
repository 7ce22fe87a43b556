"""linear_full_kl against the float64 formula on materialized logits: values and the gradients to both
models' hidden states, LM heads and biases (the reference's only where they require one), chunk sizes
from one token to all, every row backend, argument checks."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import CUDA_EMULATED, backend_device
from kl_kernels import BackendUnavailableError, linear_full_kl
from row_batches import SOFTCAP_BACKENDS


def _want(h, w, b, rh, rw, rb, counted, temperature, logit_scale=1.0, softcap=None):
    def z(x):  # TRL's fused LM head: scale, cap, temperature
        x = x.double() * logit_scale
        return (x if softcap is None else softcap * torch.tanh(x / softcap)) / temperature

    a = torch.log_softmax(z(torch.nn.functional.linear(h, w, b)), -1)
    c = torch.log_softmax(z(torch.nn.functional.linear(rh, rw, rb)), -1)
    return torch.where(counted, (a.exp() * (a - c)).sum(-1), 0.0)


@pytest.mark.parametrize("backend", ["torch", "cpu", pytest.param("triton", marks=pytest.mark.triton), CUDA_EMULATED])
@given(n=st.integers(0, 11), hid=st.sampled_from([1, 8, 33]), ref_hid=st.sampled_from([4, 8]),
       vocab=st.sampled_from([1, 7, 50, 300]), chunk=st.sampled_from([1, 4, 100, None]), with_bias=st.booleans(),
       ref_grad=st.booleans(), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       temperature=st.sampled_from([1.0, 0.6]), seed=st.integers(0, 2**31 - 1),
       transform=st.sampled_from([(1.0, None), (1.0, None), (0.25, None), (1.0, 1.5), (2.0, 3.0)]))
@settings(max_examples=30)
def test_matches_the_float64_formula(backend, n, hid, ref_hid, vocab, chunk, with_bias, ref_grad, dtype,
                                     temperature, seed, transform):
    g = torch.Generator().manual_seed(seed)
    dev = backend_device(backend)

    def t(*shape, scale=1.0, grad=True):
        return (torch.randn(*shape, generator=g) * scale).to(dtype).to(dev).requires_grad_(grad)

    h, w = t(n, hid), t(vocab, hid, scale=0.5)
    rh, rw = t(n, ref_hid, grad=ref_grad), t(vocab, ref_hid, scale=0.5, grad=ref_grad)
    b, rb = (t(vocab), t(vocab, grad=ref_grad)) if with_bias else (None, None)
    mask = (torch.rand(n, generator=g) < 0.8).to(dev)
    logit_scale, softcap = transform
    if softcap is not None and backend not in SOFTCAP_BACKENDS:
        with pytest.raises(BackendUnavailableError, match="softcap is not implemented"):
            linear_full_kl(h, w, rh, rw, softcap=softcap, backend=backend)
        return
    kl = linear_full_kl(h, w, rh, rw, bias=b, ref_bias=rb, temperature=temperature, mask=mask, chunk_size=chunk,
                        backend=backend, logit_scale=logit_scale, softcap=softcap)
    leaves = [x for x in (h, w, b, rh, rw, rb) if x is not None and x.requires_grad]
    doubles = [x.detach().double().requires_grad_(x.requires_grad) if x is not None else None
               for x in (h, w, b, rh, rw, rb)]
    want = _want(*doubles, mask, temperature, logit_scale, softcap)
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=3e-2, atol=3e-2)
    assert kl.shape == (n,) and kl.dtype == torch.float32
    torch.testing.assert_close(kl.double(), want, **tol)
    if not kl.requires_grad:
        return
    up = torch.randn(n, generator=g, dtype=torch.float64).to(dev)
    got = torch.autograd.grad((kl.double() * up).sum(), leaves)
    ref_leaves = [d for d in doubles if d is not None and d.requires_grad]
    expected = torch.autograd.grad((want * up).sum(), ref_leaves, allow_unused=True)
    for a, e in zip(got, expected):
        assert a.dtype == dtype
        gtol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=5e-2, atol=5e-2 * (1 + n))
        torch.testing.assert_close(a.double(), torch.zeros_like(a.double()) if e is None else e, **gtol)


def test_gradcheck_float64():
    g = torch.Generator().manual_seed(1)
    h, w = torch.randn(5, 4, generator=g, dtype=torch.float64), torch.randn(6, 4, generator=g, dtype=torch.float64)
    rh, rw = torch.randn(5, 3, generator=g, dtype=torch.float64), torch.randn(6, 3, generator=g, dtype=torch.float64)
    b = torch.randn(6, generator=g, dtype=torch.float64)
    mask = torch.tensor([True, True, False, True, True])
    args = [x.requires_grad_() for x in (h, w, b, rh, rw)]
    assert torch.autograd.gradcheck(
        lambda h, w, b, rh, rw: linear_full_kl(h, w, rh, rw, bias=b, mask=mask, temperature=1.3, chunk_size=2),
        args)


def test_padded_shape_and_chunks_agree():
    g = torch.Generator().manual_seed(2)
    h, w = torch.randn(2, 3, 8, generator=g), torch.randn(40, 8, generator=g)
    rh, rw = torch.randn(2, 3, 5, generator=g), torch.randn(40, 5, generator=g)
    whole = linear_full_kl(h, w, rh, rw)
    assert whole.shape == (2, 3)
    for chunk in (1, 2, 5):
        torch.testing.assert_close(linear_full_kl(h, w, rh, rw, chunk_size=chunk), whole)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(ref_weight=torch.zeros(9, 5)), ValueError, "ref_weight must cover weight's vocabulary V = 10"),
    (dict(ref_hidden=torch.zeros(4, 5)), ValueError, r"ref_hidden must have hidden's token shape \[3\]"),
    (dict(ref_weight=torch.zeros(10, 4)), ValueError, r"ref_weight must be \[V, H\] .* ref_hidden.shape\[-1\] = 5"),
    (dict(ref_bias=torch.zeros(3)), ValueError, "ref_bias must be None or a \\[10\\] tensor"),
    (dict(hidden=torch.zeros(3, 8, dtype=torch.int32)), TypeError, "hidden must be float32"),
    (dict(mask=torch.ones(3)), TypeError, "mask must be a bool tensor"),
    (dict(chunk_size=0), ValueError, "chunk_size must be None or an int >= 1"),
    (dict(temperature=-1.0), ValueError, "temperature must be a finite number > 0"),
])
def test_bad_arguments_name_themselves(kwargs, error, match):
    args = dict(hidden=torch.zeros(3, 8), weight=torch.zeros(10, 8), ref_hidden=torch.zeros(3, 5),
                ref_weight=torch.zeros(10, 5))
    args.update(kwargs)
    with pytest.raises(error, match=match):
        linear_full_kl(args.pop("hidden"), args.pop("weight"), args.pop("ref_hidden"), args.pop("ref_weight"), **args)


def test_row_backend_refusals_name_the_op():
    h, w = torch.zeros(2, 3, dtype=torch.float64), torch.zeros(4, 3, dtype=torch.float64)
    with pytest.raises(BackendUnavailableError, match="(?s)linear_full_kl .*backend 'cpu' cannot run.*float64"):
        linear_full_kl(h, w, h, w, backend="cpu")
    with pytest.raises(BackendUnavailableError, match="(?s)linear_full_kl .*backend 'cuda' cannot run.*inputs are on cpu"):
        linear_full_kl(h.float(), w.float(), h.float(), w.float(), backend="cuda")
