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


@pytest.mark.parametrize("aggregation", [a for a in AGGREGATIONS if a != "none"])
@pytest.mark.parametrize("with_ref", [False, True], ids=["kl_to_old", "kl_to_ref"])
def test_gradcheck_float64_sequence_level(aggregation, with_ref):
    """GSPO (importance_sampling_level="sequence"): the fused gradient rule d r_t / d lp_t = 1 (verl's
    GSPO-token) is the exact gradient of the loss whenever a sequence's tokens weigh alike, as in every
    aggregation (the loss depends on lp through each sequence's mean log-ratio): gradcheck holds."""
    g = torch.Generator().manual_seed(1)
    B, T = 4, 6
    lp = (-torch.rand(B, T, generator=g, dtype=torch.float64) * 2).requires_grad_()
    kw = dict(old_log_probs=lp.detach() + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64),
              advantages=torch.randn(B, generator=g, dtype=torch.float64), lengths=torch.tensor([6, 0, 1, 4]),
              mask=torch.rand(B, T, generator=g) < 0.8, beta=0.1, clip_epsilon=(0.2, 0.28), dual_clip=3.0,
              aggregation=aggregation, backend="torch", importance_sampling_level="sequence",
              ref_log_probs=lp.detach() - 0.2 if with_ref else None)
    assert torch.autograd.gradcheck(lambda x: kl_penalty_loss(x, **kw).loss, (lp,))


@pytest.mark.parametrize("backend", BACKENDS)
def test_sequence_level_ratio_is_the_sequences_mean_log_ratio(backend):
    """Every counted token of a sequence takes exp(mean log-ratio over its counted tokens); tokens outside
    the mask (and padding, NaN here) neither count nor move it; a sequence with no counted token is 0."""
    lp = torch.tensor([[-1.0, -2.0, -0.5, float("nan")], [-1.0, -1.0, -1.0, -1.0]])
    old = torch.tensor([[-1.2, -1.5, -0.5, 0.0], [-1.0, -1.0, -1.0, -1.0]])
    mask = torch.tensor([[True, True, False, True], [False, False, False, False]])
    out = kl_penalty_loss(lp, old, torch.tensor([1.0, 1.0]), lengths=torch.tensor([3, 4]), padding_side="right",
                          mask=mask, beta=0.0, importance_sampling_level="sequence", aggregation="none", backend=backend)
    s = ((-1.0 + 1.2) + (-2.0 + 1.5)) / 2
    want = torch.tensor([[-torch.tensor(s).exp().item()] * 2 + [0.0, 0.0], [0.0] * 4])
    torch.testing.assert_close(out.loss.detach(), want)
    assert out.ratio_mean.item() == pytest.approx(torch.tensor(s).exp().item(), rel=1e-6)


def test_importance_sampling_level_is_checked():
    lp = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="importance_sampling_level must be 'token' or 'sequence'"):
        kl_penalty_loss(lp, lp, torch.zeros(2), importance_sampling_level="seq")


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean", "none"])
@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_gradcheck_float64_kl_times_ratio(estimator, aggregation):
    """kl_times_ratio: the KL term times the ratio, differentiated through both (torch backend, float64)."""
    g = torch.Generator().manual_seed(2)
    B, T = 4, 6
    lp = (-torch.rand(B, T, generator=g, dtype=torch.float64) * 2).requires_grad_()
    kw = dict(old_log_probs=lp.detach() + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64),
              advantages=torch.randn(B, generator=g, dtype=torch.float64), lengths=torch.tensor([6, 0, 1, 4]),
              mask=torch.rand(B, T, generator=g) < 0.8, beta=0.5, clip_epsilon=0.2, estimator=estimator,
              ref_log_probs=lp.detach() - 0.4 * torch.rand(B, T, generator=g, dtype=torch.float64),
              aggregation=aggregation, backend="torch", kl_times_ratio=True)
    assert torch.autograd.gradcheck(lambda x: kl_penalty_loss(x, **kw).loss, (lp,))


def test_kl_times_ratio_is_checked():
    lp = torch.zeros(2, 3)
    with pytest.raises(TypeError, match="kl_times_ratio must be a bool"):
        kl_penalty_loss(lp, lp, torch.zeros(2), kl_times_ratio=1)
