"""kl_penalty_loss's aggregation on the device: the CUDA kernels' totals kernel (csrc/cuda) and
``finalize_aggregation`` (csrc/common/kl_penalty_args.h) write the loss, its parts, the count and the
weight, and the backward kernel reads the loss's gradient there (``ops._EagerOnDevice``).

Run here through the cuda-emulated backend (the same CUDA sources on CPU tensors) and the Triton
kernels (``kl_penalty_totals_kernel``, under the interpreter: a smaller matrix); on a GPU the ``cuda``
and ``triton`` rows of the oracle matrices and ``.ci/gpu_checks.py`` take the same path. Against
the torch aggregation of the same kernel's per-sequence sums (the path every other backend takes,
forced here): the same values up to the order of the float64 sums, and the same
gradients. Why it exists: on the H200 run of 2026-11-26 that torch aggregation was ~38 small
launches per forward and ~10 per backward, and the fused loss was slower than eager autograd.
"""

from __future__ import annotations

import pytest
import torch

from conftest import backend_device
from kl_kernels import kl_penalty_loss
from kl_kernels.kl_penalty import api
from test_kl_penalty_fused import _op_args, _padded_batch

ON_DEVICE = [pytest.param("cuda-emulated", marks=pytest.mark.cuda_emulated),
             pytest.param("triton", marks=pytest.mark.triton)]

BETAS = {"float": 0.3, "0-d": torch.tensor(0.3), "per-seq": torch.tensor([0.1, 0.2, 0.3, 0.4, 0.5])}
AGGREGATIONS = ["token-mean", "token-mean-n", "token-mean-n-tensor", "seq-mean-token-mean", "seq-mean-token-sum",
                "seq-mean-token-sum-norm", "sum"]


def _aggregation_kwargs(name: str) -> dict:
    if name == "token-mean-n":
        return dict(aggregation="token-mean", num_global_tokens=500)
    if name == "token-mean-n-tensor":
        return dict(aggregation="token-mean", num_global_tokens=torch.tensor(321))
    if name == "seq-mean-token-sum-norm":
        return dict(aggregation=name, norm_length=50)
    return dict(aggregation=name)


def _packed(b: dict) -> dict:
    lengths = b.pop("lengths")
    keep = torch.arange(b["mask"].shape[1]) >= b["mask"].shape[1] - lengths[:, None]  # left padding
    b = {k: v[keep] for k, v in b.items()}
    b["offsets"] = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    return b


def _run(b: dict, backend: str, upstream: float = -2.5, **kw):
    dev = backend_device(backend)  # Triton runs on the GPU where there is one
    b = {k: v.to(dev) for k, v in b.items()}
    kw = {k: v.to(dev) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
    lp = b["log_probs"].clone().requires_grad_()
    ent = b["entropy"].clone().requires_grad_()
    rest = {k: v for k, v in b.items() if k not in ("log_probs", "entropy")}
    out = kl_penalty_loss(lp, **rest, entropy=ent, backend=backend, **kw)
    (upstream * out.loss).backward()
    return out, lp.grad, ent.grad


def _matrix():
    """cuda-emulated: every aggregation form x beta kind x layout x dtype; Triton (its interpreter is
    slow): every aggregation form x layout, per-sequence beta, fp32."""
    for aggregation in AGGREGATIONS:
        for layout in ("padded", "packed"):
            for beta in BETAS:
                for dtype, name in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
                    yield pytest.param("cuda-emulated", aggregation, beta, layout, dtype,
                                       id=f"cuda-emulated-{aggregation}-{beta}-{layout}-{name}",
                                       marks=pytest.mark.cuda_emulated)
            yield pytest.param("triton", aggregation, "per-seq", layout, torch.float32,
                               id=f"triton-{aggregation}-per-seq-{layout}-fp32", marks=pytest.mark.triton)


@pytest.mark.parametrize("backend, aggregation, beta, layout, dtype", list(_matrix()))
def test_matches_the_torch_aggregation(backend, aggregation, beta, layout, dtype, monkeypatch):
    b = _padded_batch(dtype=dtype)
    b = _packed(b) if layout == "packed" else b
    kw = dict(beta=BETAS[beta], clip_epsilon=(0.2, 0.28), entropy_coef=0.05, estimator="k3", dual_clip=3.0,
              weights=torch.rand(b["log_probs"].shape, generator=torch.Generator().manual_seed(1)).to(dtype),
              weight_kl=True, clamp_input=(-20.0, 20.0), **_aggregation_kwargs(aggregation))
    calls, real = [], api.run_fused_on_device
    monkeypatch.setattr(api, "run_fused_on_device", lambda *a, **k: calls.append(1) or real(*a, **k))
    on_device = _run(b, backend, **kw)
    assert calls == [1], f"an eager {backend} call aggregates on the device"
    assert type(on_device[0].loss.grad_fn).__name__ == "_EagerOnDeviceBackward"
    with monkeypatch.context() as m:
        m.setattr(api, "on_device", lambda *a: False)
        torch_path = _run(b, backend, **kw)
    assert calls == [1]
    got, want = on_device[0], torch_path[0]
    assert got.loss.requires_grad and not any(t.requires_grad for t in got[1:])
    for name in ("seq_num_tokens", "sequence_stats"):  # the same kernel's per-sequence outputs
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    for name in got._fields[:-2]:
        x, y = getattr(got, name), getattr(want, name)
        assert x.dtype == y.dtype and x.shape == y.shape == () and x.device == y.device, name
        # the same float32 per-sequence values summed in float64, in another order
        torch.testing.assert_close(x.detach(), y.detach(), rtol=2e-6, atol=1e-7, msg=name)
    for x, y in zip(on_device[1:], torch_path[1:]):
        assert x.dtype == dtype
        # u_b * w (seq-mean-token-mean) against the torch path's single weight: at most an ulp apart
        torch.testing.assert_close(x, y, rtol=1e-6 if dtype == torch.float32 else 1e-2, atol=0)


@pytest.mark.parametrize("backend", ON_DEVICE)
def test_empty_and_uncounted_batches(backend):
    """No sequence, and sequences with nothing counted: loss and parts 0 (no NaN from 0 / 0), count 0,
    zero gradients."""
    b = _padded_batch()
    b["mask"] = torch.zeros_like(b["mask"])
    for aggregation in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "sum"):
        out, g_lp, g_ent = _run(b, backend, beta=0.3, entropy_coef=0.05, aggregation=aggregation)
        assert int(out.num_tokens) == 0
        assert all(float(t.detach()) == 0.0 for t in out[:7] + out[8:10]), out
        assert float(out.entropy_mean) == 0.0 and not out.sequence_stats.any() and not out.seq_num_tokens.any()
        assert not g_lp.any() and not g_ent.any()
    empty = {k: v[:0] for k, v in _padded_batch().items()}
    out, g_lp, _ = _run(empty, backend, beta=0.3, aggregation="token-mean")
    assert float(out.loss.detach()) == 0.0 and int(out.num_tokens) == 0 and g_lp.shape == (0, 37)


@pytest.mark.parametrize("backend", ON_DEVICE)
def test_retained_graph_twice_and_out_buffer(backend):
    """The backward reads the saved buffer and leaves it: a retained graph twice gives twice the
    gradient; with ``out=`` the forward writes the caller's buffer."""
    dev = backend_device(backend)
    b = {k: v.to(dev) for k, v in _padded_batch().items()}
    lp = b.pop("log_probs").requires_grad_()
    buf = torch.full(lp.shape, float("nan"), device=dev)
    out = kl_penalty_loss(lp, **b, beta=0.1, backend=backend, out=buf)
    assert not buf.isnan().any()
    out.loss.backward(retain_graph=True)
    once = lp.grad.clone()
    out.loss.backward()
    torch.testing.assert_close(lp.grad, 2 * once, rtol=0, atol=0)


def test_the_cpu_kernel_refuses_device_aggregation():
    """The aggregation on the device is the CUDA kernels' (the CPU kernel folds it through host
    totals instead): handed to the CPU kernel it raises, it is not ignored."""
    from kl_kernels.kl_penalty import launch

    args = _op_args("padded")  # CPU tensors: the launcher picks _C
    with pytest.raises(RuntimeError, match="aggregation on the device"):
        launch.forward_aggregated(args, 1.0, True, False, None, 0.1, 0.0)
