"""kl_penalty_loss with the terms weighed apart: ``kl_aggregation``, ``entropy_aggregation`` and
``num_sequences`` (issue 27: OpenRLHF token-means the KL and entropy terms of a sequence-level
policy loss, TRL the entropy bonus, verl 0.9.1 divides by the non-empty sequences), against the
float64 oracle on every backend, values and gradients, and the argument checks."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import CUDA_EMULATED, triton_device
from kl_kernels import kl_penalty_loss
from loss_batches import LossCase, check_loss, loss_cases

BACKENDS = ["torch", "cpu", CUDA_EMULATED, pytest.param("triton", marks=pytest.mark.triton)]


@pytest.mark.parametrize("backend", BACKENDS)
@given(case=loss_cases(dtypes=(torch.float32, torch.bfloat16), split=True),
       layout=st.sampled_from(["packed", "padded_left", "padded_right", "list"]))
@settings(max_examples=12)
def test_split_terms_match_oracle(case, layout, backend):
    check_loss(case, layout, backend, device=(triton_device() or "cpu") if backend == "triton" else "cpu")


@given(case=loss_cases(dtypes=(torch.float64,), split=True), layout=st.sampled_from(["packed", "padded_left"]))
@settings(max_examples=15)
def test_split_terms_match_oracle_float64_reference(case, layout):
    check_loss(case, layout, "torch")


def _batch():
    g = torch.Generator().manual_seed(3)
    lp = [-torch.rand(n, generator=g, dtype=torch.float64) * 3 for n in (5, 0, 3, 1)]
    old = [x + 0.1 * torch.randn(x.shape, generator=g, dtype=torch.float64) for x in lp]
    ref = [x + 0.2 * torch.randn(x.shape, generator=g, dtype=torch.float64) for x in lp]
    ent = [torch.rand(x.shape, generator=g, dtype=torch.float64) for x in lp]
    adv = [float(torch.randn((), generator=g)) for _ in lp]
    mask = [torch.tensor([True, False, True, True, True]), torch.zeros(0, dtype=torch.bool),
            torch.tensor([False, False, False]), torch.tensor([True])]  # row 2: no counted token
    return LossCase(lp=[x.float() for x in lp], old=[x.float() for x in old], adv=adv, mask=mask,
                    ref=[x.float() for x in ref], ent=[x.float() for x in ent], beta=0.2, estimator="k3",
                    clip=(0.2, 0.28), entropy_coef=0.05)


@pytest.mark.parametrize("backend", ["torch", "cpu", CUDA_EMULATED])
@pytest.mark.parametrize("layout", ["packed", "padded_left"])
def test_openrlhf_convention_sequence_policy_token_mean_kl_and_entropy(backend, layout):
    """OpenRLHF: a seq-mean-token-mean policy loss, KL and entropy token means; two sequences of four
    have no counted token."""
    case = _batch()
    case.aggregation, case.kl_aggregation, case.entropy_aggregation = "seq-mean-token-mean", "token-mean", "token-mean"
    check_loss(case, layout, backend)


@pytest.mark.parametrize("backend", ["torch", "cpu", CUDA_EMULATED])
@pytest.mark.parametrize("aggregation", ["seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"])
def test_verl_nonempty_sequence_count(backend, aggregation):
    """verl 0.9.1 divides the seq-mean modes by the sequences with a counted token (2 of 4 here)."""
    case = _batch()
    case.aggregation, case.num_sequences = aggregation, "nonempty"
    check_loss(case, "padded_right", backend)
    case.num_sequences = 7  # a data-parallel global count
    check_loss(case, "packed", backend)


def test_split_equals_the_sum_of_separate_calls():
    """The KL term with its own aggregation is the policy-only loss plus the KL-only loss (advantages
    0: no policy term), each aggregated its way: values and gradients."""
    case = _batch()
    from loss_batches import build

    kw = build(case, "padded_left").kwargs
    kw.pop("aggregation")
    lp = kw.pop("log_probs")
    full = kl_penalty_loss(lp, **kw, aggregation="seq-mean-token-mean", kl_aggregation="token-mean", backend="cpu")
    (g_full,) = torch.autograd.grad(full.loss, lp)
    pol = kl_penalty_loss(lp, **{**kw, "beta": 0.0, "entropy_coef": 0.0}, aggregation="seq-mean-token-mean",
                          backend="cpu")
    kl = kl_penalty_loss(lp, **{**kw, "advantages": torch.zeros_like(kw["advantages"]), "entropy_coef": 0.0},
                         aggregation="token-mean", backend="cpu")
    ent = kl_penalty_loss(lp, **{**kw, "beta": 0.0, "advantages": torch.zeros_like(kw["advantages"])},
                          aggregation="seq-mean-token-mean", backend="cpu")
    torch.testing.assert_close(full.loss, pol.loss + kl.loss + ent.loss, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(full.loss_kl, kl.loss_kl)
    (g_sum,) = torch.autograd.grad(pol.loss + kl.loss + ent.loss, lp)
    torch.testing.assert_close(g_full, g_sum, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("kwargs, match", [
    (dict(kl_aggregation="mean"), "kl_aggregation must be None"),
    (dict(entropy_aggregation="none"), "entropy_aggregation must be None"),
    (dict(aggregation="none", kl_aggregation="token-mean"), "cannot combine with aggregation='none'"),
    (dict(num_sequences="nonempty"), "num_sequences applies to the seq-mean aggregations"),
    (dict(aggregation="seq-mean-token-mean", num_sequences="all"), "num_sequences must be None, 'nonempty'"),
    (dict(aggregation="seq-mean-token-mean", num_sequences=-1), "integer >= 0"),
    (dict(aggregation="seq-mean-token-mean", num_sequences=torch.ones(2)), "0-dim real tensor"),
    (dict(aggregation="seq-mean-token-mean", num_global_tokens=5), "num_global_tokens applies to"),
    (dict(norm_length=4), "norm_length applies to the aggregations"),
])
def test_bad_arguments_name_themselves(kwargs, match):
    lp = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=match):
        kl_penalty_loss(lp, lp, torch.ones(2), **kwargs)


def test_a_token_mean_kl_takes_the_global_token_count():
    """num_global_tokens applies to whichever term is a token mean."""
    case = _batch()
    from loss_batches import build

    kw = build(case, "packed").kwargs
    kw.update(aggregation="seq-mean-token-mean", kl_aggregation="token-mean", beta=1.0, entropy_coef=0.0)
    a = kl_penalty_loss(**kw, num_global_tokens=50, backend="cpu")
    b = kl_penalty_loss(**kw, backend="cpu")
    n = int(b.num_tokens)
    torch.testing.assert_close(a.loss_kl * 50, b.loss_kl * n)
    torch.testing.assert_close(a.loss_objective, b.loss_objective)
