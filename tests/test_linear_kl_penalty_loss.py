"""linear_kl_penalty_loss (the loss from hidden states and LM heads) against kl_penalty_loss on log-probs of
materialized float64 logits: the loss, its parts and the gradients to the policy's hidden states, head and
bias, padded and packed, with the reference from hidden states or as log-probs, with the entropy term;
argument checks."""

from __future__ import annotations

import pytest
import torch

from kl_kernels import kl_penalty_loss, linear_kl_penalty_loss


def _materialized(h, w, b, labels, counted, temperature):
    logits = torch.nn.functional.linear(h, w, b) / temperature
    logp = torch.log_softmax(logits, -1)
    lp = torch.where(counted, logp.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1), 0.0)
    ent = torch.where(counted, -(logp.exp() * logp).sum(-1), 0.0)
    return lp, ent


@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("ref_from", ["hidden", "log_probs", None])
@pytest.mark.parametrize("entropy_coef", [0.0, 0.01])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_the_loss_on_materialized_logits(layout, ref_from, entropy_coef, with_bias):
    g = torch.Generator().manual_seed(hash((layout, ref_from, entropy_coef, with_bias)) % 2**31)
    shape = (3, 7) if layout == "padded" else (17,)
    H, H_ref, V, T = 12, 9, 60, 0.8
    h = torch.randn(*shape, H, generator=g, requires_grad=True)
    w = (torch.randn(V, H, generator=g) * 0.4).requires_grad_()
    b = torch.randn(V, generator=g, requires_grad=True) if with_bias else None
    rh, rw = torch.randn(*shape, H_ref, generator=g), torch.randn(V, H_ref, generator=g) * 0.4
    labels = torch.randint(0, V, shape, generator=g)
    labels[torch.rand(shape, generator=g) < 0.15] = -100
    mask = torch.rand(shape, generator=g) < 0.85
    counted = (labels != -100) & mask
    old = -torch.rand(shape, generator=g) * 4
    kwargs = dict(beta=0.05, estimator="k3", clip_epsilon=0.2, entropy_coef=entropy_coef, aggregation="token-mean")
    if layout == "packed":
        kwargs["offsets"] = torch.tensor([0, 5, 5, 12, 17])
        adv = torch.randn(4, 1, generator=g)
    else:
        adv = torch.randn(3, generator=g)
    ref_lp64, _ = _materialized(rh.double(), rw.double(), None, labels, counted, T)
    if ref_from == "hidden":
        ref_args = dict(ref_hidden=rh, ref_weight=rw)
    elif ref_from == "log_probs":
        ref_args = dict(ref_log_probs=ref_lp64.float())
    else:
        ref_args, kwargs["beta"] = {}, 0.0
    got = linear_kl_penalty_loss(h, w, labels, old, adv, bias=b, temperature=T, mask=mask, chunk_size=4,
                                 **ref_args, **kwargs)
    leaves = [t for t in (h, w, b) if t is not None]
    grads = torch.autograd.grad(got.loss, leaves)

    doubles = [t.detach().double().requires_grad_() for t in leaves]
    lp64, ent64 = _materialized(doubles[0], doubles[1], doubles[2] if with_bias else None, labels, counted, T)
    want = kl_penalty_loss(lp64, old.double(), adv.double(), mask=counted, backend="torch",
                           ref_log_probs=ref_lp64 if ref_args else None,
                           entropy=ent64 if entropy_coef else None, **kwargs)
    wants = torch.autograd.grad(want.loss, doubles)
    torch.testing.assert_close(got.loss.double(), want.loss, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got.kl_mean.double(), want.kl_mean, rtol=1e-4, atol=1e-5)
    for name, a, e in zip(("hidden", "weight", "bias"), grads, wants):
        torch.testing.assert_close(a.double(), e, rtol=1e-4, atol=1e-5, msg=lambda m, name=name: f"d {name}: {m}")


@pytest.mark.parametrize("kwargs, match", [
    (dict(ref_hidden=torch.zeros(2, 3, 4)), "ref_hidden and ref_weight come together"),
    (dict(ref_weight=torch.zeros(10, 4)), "ref_hidden and ref_weight come together"),
    (dict(ref_bias=torch.zeros(10)), "ref_bias needs ref_hidden and ref_weight"),
    (dict(ref_hidden=torch.zeros(2, 3, 4), ref_weight=torch.zeros(10, 4), ref_log_probs=torch.zeros(2, 3)),
     "either as ref_hidden/ref_weight or as ref_log_probs"),
])
def test_bad_reference_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        linear_kl_penalty_loss(torch.zeros(2, 3, 8), torch.zeros(10, 8), torch.zeros(2, 3, dtype=torch.int64),
                               torch.zeros(2, 3), torch.zeros(2), **kwargs)
