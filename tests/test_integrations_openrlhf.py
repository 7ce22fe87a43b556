"""kl_kernels.integrations.openrlhf against OpenRLHF 0.11.2 itself (installed --no-deps, tests/peers.py).

Each shim is compared with OpenRLHF's own function on hypothesis-generated [B, T] batches
(tests/peer_batches.py: lengths 0..64, both paddings, tool-token holes, empty rows, diverged
tokens, float32 and bfloat16), values and gradients. In bfloat16 OpenRLHF's formulas are run in
float64 on the same inputs (ours computes in float32, OpenRLHF upcasts too, so this is tight).
"""

from __future__ import annotations


import pytest
import torch
from hypothesis import given, settings

import peers
from kl_kernels.integrations import openrlhf as ko
from peer_batches import batches, close, exact, printed_without


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
@pytest.mark.parametrize("unbiased", ["no", "unbiased", "unbiased-with-old"])
@given(data=batches())
@settings(max_examples=12, deadline=None)
def test_compute_approx_kl_equals_openrlhf(estimator, unbiased, data):
    ou = peers.openrlhf_utils()
    peer = exact(data)
    old = {"unbiased-with-old": (data.old, peer.old)}.get(unbiased, (None, None))
    got_in = [data.lp.clone().requires_grad_(), data.ref.clone().requires_grad_()]
    want_in = [peer.lp.clone().requires_grad_(), peer.ref.clone().requires_grad_()]
    kw = dict(kl_estimator=estimator, unbiased_gradient=unbiased != "no")
    got = ko.compute_approx_kl(*got_in, log_probs_old=old[0], **kw)
    want = ou.compute_approx_kl(*want_in, log_probs_old=old[1], **kw)
    assert got.dtype == torch.float32  # OpenRLHF upcasts
    # The value: OpenRLHF's straight-through `value.detach() + s - s.detach()` (s = w (lp - base)^2 / 2, up to
    # ~5e4 for a diverged token) rounds the value to s's float32 ulp (10 came back as 10.00049); ours is the
    # estimate itself, which is OpenRLHF's value without the straight-through (its documented forward value).
    want_value = ou.compute_approx_kl(*want_in, kl_estimator=estimator) if unbiased != "no" else want
    close(got.detach(), want_value.detach(), torch.float32, "kl", scale=11.0)
    up = torch.linspace(-1, 1, got.numel()).reshape(got.shape)
    g_got = torch.autograd.grad((got * up).sum(), got_in)
    g_want = torch.autograd.grad((want * up.to(want.dtype)).sum(), want_in)
    for name, a, b in zip(("log_probs", "log_probs_base"), g_got, g_want):
        close(a, b, data.dtype, f"d kl / d {name}", scale=b.abs().max().item() + 1)


@given(data=batches(dtypes=(torch.float32,)))
@settings(max_examples=20, deadline=None)
def test_compute_reward_equals_openrlhf(data):
    ou = peers.openrlhf_utils()
    b = data.mask.shape[0]
    r = torch.randn(b, generator=torch.Generator().manual_seed(3)) * 20
    kl = ko.compute_approx_kl(data.lp, data.ref, kl_estimator="k3")
    for clip in (None, (-10.0, 10.0)):
        got = ko.compute_reward(r, 0.05, kl, action_mask=data.mask, reward_clip_range=clip)
        want = ou.compute_reward(r, 0.05, kl, action_mask=data.mask, reward_clip_range=clip)
        close(got, want, torch.float32, f"reward (clip {clip})")


@given(data=batches(dtypes=(torch.float32,)))
@settings(max_examples=20, deadline=None)
def test_masked_mean_equals_openrlhf(data):
    ou = peers.openrlhf_utils()
    x = data.adv
    for dim in (None, -1):
        want = ou.masked_mean(x, data.mask, dim=dim)
        got = ko.masked_mean(x, data.mask, dim=dim)
        keep = ~want.isnan()  # OpenRLHF divides 0 by 0 on empty rows (or an empty mask); ours gives 0 there
        close(got[keep], want[keep], torch.float32, f"masked_mean dim={dim}")
        assert (got[~keep] == 0).all()


LOSS_CASES = [
    dict(), dict(clip_eps_high=0.28), dict(dual_clip=3.0), dict(dual_clip=1.5, token_level_loss=False),
    dict(token_level_loss=False), dict(forward=dict(dp_size=2, batch_num_tokens=77)),
    dict(token_level_loss=False, forward=dict(dp_size=4, global_batch_size=9)),
    dict(policy_loss_type="gspo"), dict(policy_loss_type="gspo", dual_clip=3.0, clip_eps_low=3e-4, clip_eps_high=4e-4),
    dict(policy_loss_type="gspo", forward=dict(dp_size=2, global_batch_size=5)),
    # the importance-sampling correction (the rollout log-probs: the batch's ref)
    dict(is_correction_level="token"), dict(is_correction_level="token", is_correction_mode="clip", dual_clip=3.0),
    dict(is_correction_level="seq", token_level_loss=False),
    dict(is_correction_level="seq", is_correction_gating="binary_kl", is_correction_threshold=(0.0, 0.02)),
    dict(is_correction_level="token", is_correction_gating="tv", is_correction_threshold=(0.0, 0.05)),
    dict(policy_loss_type="gspo", is_correction_level="token"),
]


@pytest.mark.parametrize("case", LOSS_CASES, ids=[str(c) for c in LOSS_CASES])
@given(data=batches())
@settings(max_examples=12, deadline=None)
def test_policy_loss_equals_openrlhf(case, data):
    ol = peers.openrlhf_loss()
    if not data.mask.any():
        return  # OpenRLHF's mean over no token is 0 / 0; ours 0
    case = dict(case)
    fwd = case.pop("forward", {})
    if case.get("policy_loss_type") == "gspo":  # OpenRLHF's GSPO ratio is unclamped, ours +-20 (documented)
        m = data.mask.bool()
        s = torch.where(m, data.lp.double() - data.old.double(), 0.0).sum(-1) / m.sum(-1).clamp_min(1)
        if (s.abs() > 20).any():
            return
    if case.get("policy_loss_type") == "gspo" and case.get("is_correction_level", "off") != "off":
        m = data.mask.bool()  # (the GSPO ratio is then to the rollout policy)
        s = torch.where(m, data.lp.double() - data.ref.double(), 0.0).sum(-1) / m.sum(-1).clamp_min(1)
        if (s.abs() > 20).any():
            return
    correcting = case.get("is_correction_level", "off") != "off"
    if correcting:  # the rollout log-probs: the batch's ref, within e^+-20 of old (a weight exp(old - rollout)
        # past float32's range is inf for both in their dtypes); and old itself at masked tokens: OpenRLHF
        # multiplies every token by its weight, masked ones too (inf * 0 = NaN), ours never reads them
        rollout = data.old.double() + (data.ref.double() - data.old.double()).clamp(-20, 20)
        data.ref = torch.where(data.mask, rollout.to(data.dtype), data.old)
    peer = exact(data)
    lp_got, lp_want = data.lp.clone().requires_grad_(), peer.lp.clone().requires_grad_()
    got = ko.PolicyLoss(**case)(lp_got, data.old, data.adv, action_mask=data.mask,
                                rollout_log_probs=data.ref if correcting else None, **fwd)
    want = ol.PolicyLoss(**case)(lp_want, peer.old, peer.adv, action_mask=data.mask,
                                 rollout_log_probs=peer.ref if correcting else None, **fwd)
    assert len(got) == len(want) == 5
    for k in (3, 4):  # vllm_kl, is_filter_ratio: the PPO correction's metrics
        assert (got[k] is None) == (want[k] is None)
        if want[k] is not None:
            close(got[k].detach().float(), want[k].detach().float(), data.dtype, f"output {k}")
    close(got[0].detach(), want[0].detach().float(), torch.float32 if data.dtype == torch.float32 else data.dtype,
          "loss")
    g_got, = torch.autograd.grad(got[0], lp_got)
    g_want, = torch.autograd.grad(want[0], lp_want)
    close(g_got, g_want, data.dtype, "d loss / d log_probs", scale=g_want.abs().max().item() + 1e-3)
    tol = 2e-6 if data.dtype == torch.float32 else 0.05
    assert float(got[1]) == pytest.approx(float(want[1]), abs=tol), "clip_ratio"
    assert float(got[2]) == pytest.approx(float(want[2]), rel=1e-4, abs=1e-5 if data.dtype == torch.float32 else 0.05)


def test_policy_loss_bad_options_are_refused_as_openrlhf_refuses_them():
    ol = peers.openrlhf_loss()
    bad = [dict(is_correction_level="all"), dict(is_correction_mode="drop"),
           dict(is_correction_gating="kl"), dict(is_correction_level="seq", is_correction_mode="clip"),
           dict(is_correction_level="token", is_correction_gating="tv")]  # tv with a lower bound 0.5
    for kw in bad:
        with pytest.raises(ValueError) as theirs:
            ol.PolicyLoss(**kw)
        with pytest.raises(ValueError) as ours:
            ko.PolicyLoss(**kw)
        assert str(ours.value) == str(theirs.value), kw
    lp = -torch.rand(2, 3)
    with pytest.raises(ValueError, match="Invalid policy loss type: grpo"):  # OpenRLHF: at forward, the same words
        ol.PolicyLoss(policy_loss_type="grpo")(lp, lp, torch.randn(2, 3))
    with pytest.raises(ValueError, match="Invalid policy loss type: grpo"):  # ours: when built
        ko.PolicyLoss(policy_loss_type="grpo")
    with pytest.raises(ValueError, match="needs rollout_log_probs"):
        ko.PolicyLoss(is_correction_level="token")(lp, lp, torch.randn(2, 3))


def test_controllers_follow_openrlhfs():
    oc = peers.openrlhf_kl_controllers()
    ours, theirs = ko.AdaptiveKLController(0.01, 6.0, 10000), oc.AdaptiveKLController(0.01, 6.0, 10000)
    for kl, n in ((2.0, 256), (9.0, 512), (6.0, 64), (100.0, 10000)):
        ours.update(kl, n)
        theirs.update(kl, n)
        assert ours.value == pytest.approx(theirs.value, rel=1e-6)
    fixed = ko.FixedKLController(0.3)
    fixed.update(1.0, 10)
    assert fixed.value == oc.FixedKLController(0.3).value == 0.3


def test_the_shim_imports_without_openrlhf():
    assert printed_without("openrlhf", "from kl_kernels.integrations import openrlhf as ko\nimport torch\n"
                           "print(ko.compute_approx_kl(torch.zeros(1, 2), torch.ones(1, 2)).sum().item())") == ["-2.0"]
