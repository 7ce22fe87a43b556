"""kl_penalty_loss against the float64 oracle: every layout, aggregation, dtype and option, values
and gradients, for each backend that can run here."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import CUDA_EMULATED
from kl_kernels import kl_penalty_loss
from loss_batches import AGGREGATIONS, LOSS_LAYOUTS, LossCase, check_loss, loss_cases

BACKENDS = ["torch", "cpu", CUDA_EMULATED]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", LOSS_LAYOUTS)
@given(case=loss_cases())
def test_matches_oracle(case, layout, backend):
    if backend != "torch" and case.dtype == torch.float64:
        return
    grads = layout != "nested_jagged"  # nested leaves: values only (grads are checked in the other layouts)
    check_loss(case, layout, backend, grads=grads)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@given(case=loss_cases(dtypes=(torch.float32,)), layout=st.sampled_from(["packed", "padded_left", "list"]))
@settings(max_examples=15)
def test_every_aggregation(case, layout, aggregation, backend):
    case.aggregation = aggregation
    check_loss(case, layout, backend)


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm", "sum"])
@given(case=loss_cases(dtypes=(torch.float32,)), layout=st.sampled_from(["packed", "padded_left"]))
@settings(max_examples=10)
def test_generic_aggregation_on_cpu(case, layout, aggregation, module_monkeypatch):
    """CPU tensors take the host-float path of the one-weight aggregations; accelerators take the
    tensor path. Forced here on CPU tensors, the tensor path must match the oracle as well."""
    from kl_kernels.kl_penalty import aggregate as agg

    case.aggregation = aggregation
    with module_monkeypatch.context() as m:
        m.setattr(agg, "_ON_HOST", ())
        check_loss(case, layout, "cpu")


@pytest.fixture(scope="module")
def module_monkeypatch():
    with pytest.MonkeyPatch.context() as m:
        yield m


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("estimator", ["k1", "k3", "k3+"])
def test_gradcheck_float64(estimator, aggregation):
    """torch.autograd.gradcheck (float64, the torch backend) w.r.t. log_probs and entropy. Straight-through
    estimators are checked against their surrogate (k2's gradient) by design, so they compare the
    Jacobian with that of a k2 loss whose value differs but whose gradient is the intended one."""
    g = torch.Generator().manual_seed(0)
    B, T = 4, 6
    lp = (-torch.rand(B, T, generator=g, dtype=torch.float64) * 2).requires_grad_()
    ent = torch.rand(B, T, generator=g, dtype=torch.float64).requires_grad_()
    kw = dict(old_log_probs=lp.detach() + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64),
              advantages=torch.randn(B, generator=g, dtype=torch.float64), lengths=torch.tensor([6, 0, 1, 4]),
              mask=torch.rand(B, T, generator=g) < 0.8, beta=torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64),
              clip_epsilon=(0.2, 0.28), entropy_coef=0.05, aggregation=aggregation, backend="torch")

    def fn(est):
        def f(x, e):
            out = kl_penalty_loss(x, entropy=e, estimator=est, **kw).loss
            return out
        return f

    if estimator.endswith("+"):
        got = torch.autograd.functional.jacobian(fn(estimator), (lp, ent))
        want = torch.autograd.functional.jacobian(fn("k2"), (lp, ent))
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b)
    else:
        assert torch.autograd.gradcheck(fn(estimator), (lp, ent))
