"""kl_penalty_loss(out=...): a caller-provided float32 buffer for the per-token gradient.

The fused backends keep one float32 buffer ``dloss_t / dlp_t`` from the forward to the backward
(the loss's only token-sized allocation besides the returned gradient). ``out=`` hands them the
caller's buffer so a training loop allocates it once. Checked here: same loss and gradient as
without it, the buffer really is written (it starts NaN-poisoned), reuse across steps, the guard
against a second write before the first backward, the argument checks, and the backends that
cannot use it saying so.
"""

from __future__ import annotations

import pytest
import torch

from batches import to_device
from conftest import CUDA_EMULATED, backend_device
from kl_kernels import BackendUnavailableError, kl_penalty_loss

FUSED = ["cpu", CUDA_EMULATED, pytest.param("triton", marks=pytest.mark.triton)]


def _call(layout, beta=0.1, aggregation="token-mean"):
    g = torch.Generator().manual_seed(3)
    if layout == "packed":
        shape, kw = (41,), dict(offsets=torch.tensor([0, 0, 1, 18, 41]))
    else:
        shape, kw = (4, 13), dict(lengths=torch.tensor([0, 1, 13, 7]), padding_side=layout.split("_")[1])
    lp = -torch.rand(shape, generator=g)
    old = lp + 0.1 * torch.randn(shape, generator=g)
    ref = lp + 0.2 * torch.randn(shape, generator=g)
    adv = torch.randn(shape, generator=g)
    mask = torch.rand(shape, generator=g) < 0.8
    if beta == "per_seq":
        beta = torch.tensor([0.1, 0.2, 0.05, 0.3])
    return (lp, old, adv), dict(kw, ref_log_probs=ref, mask=mask, beta=beta, estimator="k3", clip_epsilon=0.2,
                                aggregation=aggregation)


def _loss_and_grad(args, kw, backend, out=None):
    lp = args[0].detach().clone().requires_grad_()
    res = kl_penalty_loss(lp, *args[1:], **kw, backend=backend, out=out)
    total = res.loss.sum() if res.loss.dim() else res.loss
    (grad,) = torch.autograd.grad(total, lp)
    return res, grad


@pytest.mark.parametrize("backend", FUSED)
@pytest.mark.parametrize("layout", ["packed", "padded_left", "padded_right"])
@pytest.mark.parametrize("beta, aggregation", [(0.1, "token-mean"), ("per_seq", "seq-mean-token-mean"),
                                               (0.1, "none")])
def test_out_gives_the_same_loss_and_gradient(backend, layout, beta, aggregation):
    args, kw = to_device(_call(layout, beta, aggregation), backend_device(backend))
    want, want_grad = _loss_and_grad(args, kw, backend)
    out = torch.full(args[0].shape, float("nan"), device=args[0].device)
    address = out.data_ptr()
    for _ in range(2):  # a loop reusing its buffer
        got, grad = _loss_and_grad(args, kw, backend, out=out)
        for name, g, w in zip(type(want)._fields, got, want):
            torch.testing.assert_close(g, w, msg=name, rtol=0, atol=0)
        torch.testing.assert_close(grad, want_grad, rtol=0, atol=0)
    assert out.data_ptr() == address and not out.isnan().any()  # written everywhere, in place


@pytest.mark.parametrize("backend", FUSED)
def test_out_is_written_by_the_forward(backend):
    args, kw = to_device(_call("packed"), backend_device(backend))
    out = torch.full(args[0].shape, float("nan"), device=args[0].device)
    with torch.no_grad():
        kl_penalty_loss(*args, **kw, backend=backend, out=out)
    assert not out.isnan().any()
    _, grad = _loss_and_grad(args, kw, backend)
    # token-mean: the loss's gradient is the buffer over the counted-token count
    torch.testing.assert_close(out / int(kw["mask"].sum()), grad)


@pytest.mark.parametrize("beta", [0.1, "per_seq"])  # the CPU's host-aggregated path and the general one
def test_a_second_call_before_backward_is_caught(beta):
    args, kw = _call("packed", beta, "token-mean" if beta == 0.1 else "seq-mean-token-mean")
    lp = args[0].clone().requires_grad_()
    out = torch.empty(args[0].shape)
    first = kl_penalty_loss(lp, *args[1:], **kw, backend="cpu", out=out)
    kl_penalty_loss(lp, *args[1:], **kw, backend="cpu", out=out)  # overwrites the first call's gradient
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        first.loss.backward()


def test_a_leaf_gradient_never_aliases_the_buffer():
    # The CPU backward scales the buffer in place and hands it to autograd; a leaf's .grad must
    # still be its own tensor, or the next call would overwrite it.
    args, kw = _call("packed")
    lp = args[0].clone().requires_grad_()
    out = torch.empty(args[0].shape)
    kl_penalty_loss(lp, *args[1:], **kw, backend="cpu", out=out).loss.backward()
    kept = lp.grad.clone()
    assert lp.grad.data_ptr() != out.data_ptr()
    kl_penalty_loss(lp.detach() + 1.0, *args[1:], **kw, backend="cpu", out=out)
    torch.testing.assert_close(lp.grad, kept, rtol=0, atol=0)


def test_the_reference_says_it_cannot_use_the_buffer():
    args, kw = _call("packed")
    with pytest.raises(BackendUnavailableError, match="out="):
        kl_penalty_loss(*args, **kw, backend="torch", out=torch.empty(args[0].shape))


def test_lists_use_the_packed_shape():
    args, kw = _call("packed")
    offsets = kw.pop("offsets").tolist()
    split = [[t[a:b] for a, b in zip(offsets, offsets[1:])] for t in (*args, kw["ref_log_probs"], kw["mask"])]
    lp, old, adv, ref, mask = split
    kw.update(ref_log_probs=ref, mask=mask)
    want = kl_penalty_loss(lp, old, adv, **kw, backend="cpu")
    out = torch.full(args[0].shape, float("nan"))
    got = kl_penalty_loss(lp, old, adv, **kw, backend="cpu", out=out)
    torch.testing.assert_close(got.loss, want.loss, rtol=0, atol=0)
    assert not out.isnan().any()


def _bad_cases():
    args, kw = _call("packed")
    lp = args[0]
    yield "not a tensor", [0.0] * lp.numel(), TypeError, "out must be a strided tensor"
    yield "dtype", torch.empty(lp.shape, dtype=torch.float64), ValueError, r"out must be torch.float32 of shape \[41\]"
    yield "shape", torch.empty(40), ValueError, r"out must be torch.float32 of shape \[41\], got torch.float32 \[40\]"
    yield "strided", torch.empty(82)[::2], ValueError, "out must be contiguous"
    yield "requires grad", torch.empty(lp.shape, requires_grad=True), ValueError, "not require grad"
    yield "device", torch.empty(lp.shape, device="meta"), ValueError, "out is on meta but log_probs is on cpu"
    yield "is an input", "log_probs", ValueError, "out overlaps log_probs"
    yield "is in an input", "old_log_probs[1:]", ValueError, "out overlaps old_log_probs"


@pytest.mark.parametrize("case, out, error, match", list(_bad_cases()), ids=[c[0] for c in _bad_cases()])
def test_bad_out_is_refused_before_any_kernel(case, out, error, match):
    args, kw = _call("packed")
    before = [a.clone() for a in args]
    if isinstance(out, str) and out == "log_probs":
        out = args[0]
    elif isinstance(out, str):  # a 41-float view starting inside old_log_probs
        joined = torch.cat([args[1], torch.zeros(1)])
        args = (args[0], joined[:41], args[2])
        out = joined[1:]
    with pytest.raises(error, match=match):
        kl_penalty_loss(*args, **kw, backend="cpu", out=out)
    for a, b in zip(args, before):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


def test_out_is_refused_under_compile(monkeypatch):
    args, kw = _call("packed")
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    with pytest.raises(ValueError, match="torch.compile"):
        kl_penalty_loss(*args, **kw, backend="cpu", out=torch.empty(args[0].shape))
