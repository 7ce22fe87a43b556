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


# Liger-Kernel 0.8.5's LigerFusedLinearGRPOLoss loss types as kl_penalty_loss arguments (TRL's GRPO formulas,
# python_api/kl_penalty_loss.md): grpo = mean over each sequence's tokens, then over all B sequences; bnpo =
# over all counted tokens; dr_grpo = sum / (B * max_completion_length); dapo = over the counted tokens (no
# num_items_in_batch: the batch's own).
LIGER_TYPES = {"grpo": dict(aggregation="seq-mean-token-mean"), "bnpo": dict(aggregation="token-mean"),
               "dr_grpo": dict(aggregation="seq-mean-token-sum-norm", norm_length=7),
               "dapo": dict(aggregation="token-mean")}


@pytest.mark.parametrize("loss_type", list(LIGER_TYPES))
@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("with_old", [False, True])
def test_parity_with_liger_fused_linear_grpo_loss(loss_type, beta, with_old):
    """The same GRPO step from hidden states through Liger-Kernel 0.8.5's LigerFusedLinearGRPOLoss (its CPU
    path, compiled=False) and through linear_kl_penalty_loss: loss and gradients to the hidden states, the
    LM head and its bias; the reference from its own hidden states and head (k3 to it, beta)."""
    import peers

    liger = peers.liger_grpo_loss()
    g = torch.Generator().manual_seed(7)
    B, T, H, V, temp = 3, 7, 16, 80, 0.8
    h = torch.randn(B, T, H, generator=g, requires_grad=True)
    w = (torch.randn(V, H, generator=g) * 0.5).requires_grad_()
    b = torch.randn(V, generator=g, requires_grad=True)
    rh, rw = torch.randn(B, T, H, generator=g), torch.randn(V, H, generator=g) * 0.5
    ids = torch.randint(0, V, (B, T), generator=g)
    attention = torch.ones(B, T)
    attention[1, 4:] = 0
    attention[2, 6:] = 0
    adv = torch.randn(B, generator=g)
    with torch.no_grad():
        now = torch.log_softmax((h @ w.t() + b) / temp, -1).gather(-1, ids[..., None])[..., 0]
    old = (now + 0.3 * torch.randn(B, T, generator=g)) if with_old else None

    loss_fn = liger.LigerFusedLinearGRPOLoss(beta=beta, compiled=False, use_ref_model=beta != 0.0, loss_type=loss_type,
                                             max_completion_length=T, temperature=temp, chunk_size=2)
    theirs = loss_fn(h, w, ids, attention, adv, bias=b, old_per_token_logps=old, ref_input=rh if beta else None,
                     ref_weight=rw if beta else None, ref_bias=None)[0]
    g_theirs = torch.autograd.grad(theirs, (h, w, b))

    ours = linear_kl_penalty_loss(h, w, ids, old if old is not None else now, adv, bias=b, temperature=temp,
                                  mask=attention.bool(), chunk_size=5, clip_epsilon=0.2, estimator="k3",
                                  beta=beta, **(dict(ref_hidden=rh, ref_weight=rw) if beta else {}),
                                  **LIGER_TYPES[loss_type]).loss
    g_ours = torch.autograd.grad(ours, (h, w, b))
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    for name, a, e in zip(("hidden", "weight", "bias"), g_ours, g_theirs):
        torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-6, msg=lambda m, name=name: f"d {name}: {m}")
