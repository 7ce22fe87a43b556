"""kl_kernels.integrations.verl against verl 0.9.1 itself (installed --no-deps, tests/peers.py).

Every shim is compared with verl's own function on hypothesis-generated [B, T] batches: lengths 0..64
(0 and 1 included), responses padded on the right or the left, masks with tool-token holes, empty rows,
diverged tokens (|lp - ref| >= 100), float32 and bfloat16; values and gradients.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings

import peers
from kl_kernels.integrations import verl as kv
from peer_batches import batches, close, exact, printed_without

MODES = ["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "kl+", "k1+", "abs+", "k2+", "mse+", "low_var_kl+", "k3+"]


@pytest.mark.parametrize("mode", MODES)
@given(data=batches())
@settings(max_examples=15, deadline=None)
def test_kl_penalty_equals_verl(mode, data):
    ca = peers.verl_core_algos()
    peer = exact(data)
    got_in = [data.lp.clone().requires_grad_(), data.ref.clone().requires_grad_()]
    want_in = [peer.lp.clone().requires_grad_(), peer.ref.clone().requires_grad_()]
    got = kv.kl_penalty(*got_in, mode)
    want = ca.kl_penalty(*want_in, mode)
    assert got.dtype == data.dtype and got.shape == want.shape
    close(got.detach(), want.detach(), data.dtype, f"{mode} value", scale=want.detach().abs().max().item() + 1)
    up = torch.linspace(-1, 1, got.numel()).reshape(got.shape)
    g_got = torch.autograd.grad((got * up.to(got.dtype)).sum(), got_in)
    g_want = torch.autograd.grad((want * up.to(want.dtype)).sum(), want_in)
    for name, a, b in zip(("logprob", "ref_logprob"), g_got, g_want):
        close(a, b, data.dtype, f"{mode} d/d{name}", scale=b.abs().max().item() + 1)


def test_kl_penalty_modes_verl_rejects_are_rejected_alike():
    ca = peers.verl_core_algos()
    x = torch.zeros(2, 3)
    for mode in ("full", "k4", "full+"):
        with pytest.raises(NotImplementedError):
            ca.kl_penalty(x, x, mode)
    for mode in ("k4", "full+"):
        with pytest.raises(NotImplementedError):
            kv.kl_penalty(x, x, mode)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kl_penalty_full_is_the_exact_kl_over_the_vocabulary(dtype):
    """verl leaves "full" unimplemented (NotImplementedError, checked above); ours takes the [B, T, V]
    logits its code comment describes and gives the exact KL per token, gradients to both."""
    g = torch.Generator().manual_seed(11)
    x = (torch.randn(2, 5, 50, generator=g) * 3).to(dtype).requires_grad_()
    r = (torch.randn(2, 5, 50, generator=g) * 3).to(dtype).requires_grad_()
    got = kv.kl_penalty(x, r, "full")
    a, b = torch.log_softmax(x.double(), -1), torch.log_softmax(r.double(), -1)
    want = (a.exp() * (a - b)).sum(-1)
    assert got.shape == (2, 5) and got.dtype == dtype
    close = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got.double(), want, **close)
    gx, gr = torch.autograd.grad(got.float().sum(), (x, r))
    wx, wr = torch.autograd.grad(want.sum(), (x, r))
    torch.testing.assert_close(gx.double(), wx.double(), **close)
    torch.testing.assert_close(gr.double(), wr.double(), **close)
    with pytest.raises(NotImplementedError, match="kl_kernels.full_kl"):
        kv.kl_mode("full")  # the loss and apply_kl_penalty get per-token log-probs only


AGG_CASES = [
    ("token-mean", {}), ("token-mean", {"dp_size": 4, "batch_num_tokens": 300}), ("token-sum", {"dp_size": 2}),
    ("seq-mean-token-sum", {}), ("seq-mean-token-sum", {"dp_size": 2, "global_batch_size": 9}),
    ("seq-mean-token-sum-norm", {}), ("seq-mean-token-sum-norm", {"loss_scale_factor": 100}),
    ("seq-mean-token-mean", {}), ("seq-mean-token-mean", {"dp_size": 3, "global_batch_size": 7}),
]


@pytest.mark.parametrize("mode, info", AGG_CASES, ids=[f"{m}-{'-'.join(i)}" for m, i in AGG_CASES])
@given(data=batches(dtypes=(torch.float32,)))
@settings(max_examples=15, deadline=None)
def test_agg_loss_equals_verl(mode, info, data):
    ca = peers.verl_core_algos()
    if not data.mask.any():
        return  # verl divides 0 by 0 there (NaN); ours gives 0: tested below
    loss_mat = torch.where(data.mask, data.adv, 1e3)  # garbage outside the mask
    want = ca.agg_loss(loss_mat, data.mask, mode, **info)
    close(kv.agg_loss(loss_mat, data.mask, mode, **info), want, torch.float32, mode)
    # NaN outside the mask never leaks into ours (verl's seq-mean modes multiply it by 0: NaN)
    close(kv.agg_loss(torch.where(data.mask, data.adv, float("nan")), data.mask, mode, **info), want, torch.float32,
          f"{mode} with NaN padding")


def test_agg_loss_of_an_empty_batch_is_zero_where_verl_gives_nan():
    ca = peers.verl_core_algos()
    mask = torch.zeros(2, 3, dtype=torch.bool)
    assert ca.agg_loss(torch.ones(2, 3), mask, "token-mean").isnan()
    assert kv.agg_loss(torch.ones(2, 3), mask, "token-mean") == 0


def _verl_config(**over):
    from omegaconf import OmegaConf

    cfg = dict(clip_ratio=0.2, clip_ratio_low=None, clip_ratio_high=None, clip_ratio_c=3.0, global_batch_info={})
    cfg.update(over)
    return OmegaConf.create(cfg)


POLICY_CASES = [
    ("token-mean", {}, False), ("token-mean", {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28}, True),
    ("token-mean", {"global_batch_info": {"dp_size": 2, "batch_num_tokens": 123}}, False),
    ("seq-mean-token-mean", {}, True), ("seq-mean-token-sum", {"clip_ratio_c": 1.5}, False),
    ("seq-mean-token-sum-norm", {"global_batch_info": {"loss_scale_factor": 64}}, True),
    ("token-sum", {"clip_ratio_c": 10.0}, False),
]


def _compare_policy_loss(ours, theirs, cfg, mode, with_weights, data):
    """A verl policy loss and our shim of it on ``data``: the loss and its gradient; returns both metrics dicts
    (same keys)."""
    peer = exact(data)
    lp_got, lp_want = data.lp.clone().requires_grad_(), peer.lp.clone().requires_grad_()
    got, got_metrics = ours(data.old, lp_got, data.adv, data.mask, mode, cfg, data.weights if with_weights else None)
    want, want_metrics = theirs(peer.old, lp_want, peer.adv, data.mask, mode, cfg,
                                peer.weights if with_weights else None)
    md = torch.float32
    close(got.detach(), want.detach().to(md), md if data.dtype == torch.float32 else data.dtype, "pg_loss")
    g_got, = torch.autograd.grad(got, lp_got)
    g_want, = torch.autograd.grad(want, lp_want)
    close(g_got, g_want, data.dtype, "d pg_loss / d log_prob", scale=g_want.abs().max().item() + 1e-3)
    assert set(got_metrics) == set(want_metrics)
    return got_metrics, want_metrics


@pytest.mark.parametrize("mode, over, with_weights", POLICY_CASES,
                         ids=[f"{m}-{'-'.join(o) or 'default'}-{'w' if w else 'nw'}" for m, o, w in POLICY_CASES])
@given(data=batches())
@settings(max_examples=12, deadline=None)
def test_compute_policy_loss_vanilla_equals_verl(mode, over, with_weights, data):
    peers.verl_core_algos()
    from verl.trainer.ppo import core_algos as ca

    if not data.mask.any():
        return
    got_metrics, want_metrics = _compare_policy_loss(kv.compute_policy_loss_vanilla, ca.compute_policy_loss_vanilla,
                                                     _verl_config(**over), mode, with_weights, data)
    for key in ("actor/pg_clipfrac", "actor/pg_clipfrac_lower"):
        assert got_metrics[key] == pytest.approx(want_metrics[key], abs=2e-6 if data.dtype == torch.float32 else 0.05)
    if not ((data.lp.double() - data.old.double()).abs() > 20).any():  # ours leaves the log-ratio unclamped
        assert got_metrics["actor/ppo_kl"] == pytest.approx(want_metrics["actor/ppo_kl"], rel=1e-4, abs=1e-5)


def test_the_dual_clip_fraction_is_the_kernels_decision_in_bfloat16():
    """pg_clipfrac_lower counts the tokens whose dual clip the loss took. In bf16 the metric was computed in
    bf16 (ratio 1.50109 rounded to 1.5, both sides of the comparison then 2.84375) while the kernels, and
    verl's formula evaluated exactly, compare in float32 / float64 (2.8497 > 2.8477): the loss took the cap
    and the metric said it did not (a hypothesis example, seq-mean-token-sum, clip_ratio_c 1.5)."""
    peers.verl_core_algos()
    from verl.trainer.ppo import core_algos as ca

    bf = dict(dtype=torch.bfloat16)
    lp, old = torch.tensor([[-5.9375, -5.78125]], **bf), torch.tensor([[-6.34375, -4.5625]], **bf)
    adv, mask = torch.tensor([[-1.8984375, -0.62109375]], **bf), torch.ones(1, 2, dtype=torch.bool)
    cfg = _verl_config(clip_ratio_c=1.5)
    _, got = kv.compute_policy_loss_vanilla(old, lp, adv, mask, "seq-mean-token-sum", cfg)
    _, want = ca.compute_policy_loss_vanilla(old.double(), lp.double(), adv.double(), mask, "seq-mean-token-sum", cfg)
    assert got["actor/pg_clipfrac_lower"] == pytest.approx(float(want["actor/pg_clipfrac_lower"])) == 0.5


def _verl_actor_config(**over):
    """verl's own ActorConfig (its GSPO loss asserts one), with ``global_batch_info`` filled in."""
    from verl.workers.config import ActorConfig

    info = over.pop("global_batch_info", {})
    cfg = ActorConfig(strategy="fsdp", clip_ratio=0.2, ppo_micro_batch_size_per_gpu=1, rollout_n=1, **over)
    cfg.global_batch_info.update(info)
    return cfg


GSPO_CASES = [
    ("seq-mean-token-mean", {}, False), ("seq-mean-token-mean", {"clip_ratio_low": 3e-4, "clip_ratio_high": 4e-4}, True),
    ("token-mean", {"global_batch_info": {"dp_size": 2, "batch_num_tokens": 123}}, True),
    ("seq-mean-token-sum", {}, False),
]


@pytest.mark.parametrize("mode, over, with_weights", GSPO_CASES,
                         ids=[f"{m}-{'-'.join(o) or 'default'}-{'w' if w else 'nw'}" for m, o, w in GSPO_CASES])
@given(data=batches())
@settings(max_examples=12, deadline=None)
def test_compute_policy_loss_gspo_equals_verl(mode, over, with_weights, data):
    """verl's GSPO (sequence-level ratio, GSPO-token gradient): value, gradient and metrics. Skips
    batches where a response's mean log-ratio exceeds 10, where verl clamps (ours: 20, documented)."""
    peers.verl_core_algos()
    from verl.trainer.ppo import core_algos as ca

    if not data.mask.any():
        return
    m = data.mask.bool()
    d = torch.where(m, data.lp.double() - data.old.double(), 0.0).sum(-1) / m.sum(-1).clamp_min(1)
    if (d > 10).any():
        return
    got_metrics, want_metrics = _compare_policy_loss(kv.compute_policy_loss_gspo, ca.compute_policy_loss_gspo,
                                                     _verl_actor_config(**over), mode, with_weights, data)
    assert got_metrics["actor/pg_clipfrac_lower"] == 0.0
    assert got_metrics["actor/pg_clipfrac"] == pytest.approx(want_metrics["actor/pg_clipfrac"],
                                                             abs=2e-6 if data.dtype == torch.float32 else 0.05)


def test_gspo_shim_goes_through_the_sequence_level_option(monkeypatch):
    import kl_kernels.integrations.verl as mod

    seen = []
    real = mod.kl_penalty_loss
    monkeypatch.setattr(mod, "kl_penalty_loss", lambda *a, **k: seen.append(k) or real(*a, **k))
    lp, old = torch.randn(2, 5), torch.randn(2, 5)
    config = SimpleNamespace(clip_ratio=0.2, clip_ratio_c=3.0)  # attributes, as verl reads: no verl needed
    kv.compute_policy_loss_gspo(old, lp, torch.randn(2, 5), torch.ones(2, 5, dtype=torch.bool), config=config)
    assert seen[0]["importance_sampling_level"] == "sequence" and seen[0]["dual_clip"] is None


@pytest.mark.parametrize("fn", ["compute_policy_loss_vanilla", "compute_policy_loss_gspo"])
def test_a_plain_dict_config_is_refused_as_verl_refuses_it(fn):
    """verl reads its config by attribute (ActorConfig, an OmegaConf DictConfig): a plain dict raises
    AttributeError there. The same call must behave the same: ours raises an error that is an AttributeError (what
    verl's callers catch) and a TypeError (this project's error for an argument of the wrong type), naming the
    argument; accepting the dict would let code pass here and fail once verl's own function is back."""
    ca = peers.verl_core_algos()
    lp, old, adv = torch.randn(2, 5), torch.randn(2, 5), torch.randn(2, 5)
    mask = torch.ones(2, 5, dtype=torch.bool)
    config = {"clip_ratio": 0.2, "clip_ratio_c": 3.0, "global_batch_info": {}}
    with pytest.raises(AttributeError if fn.endswith("vanilla") else AssertionError):  # gspo: asserts ActorConfig
        getattr(ca, fn)(old, lp, adv, mask, "token-mean", config)
    with pytest.raises(AttributeError, match="config") as err:
        getattr(kv, fn)(old, lp, adv, mask, "token-mean", config)
    assert isinstance(err.value, TypeError)
    with pytest.raises(AttributeError, match="config"):
        kv.compute_policy_loss_with_kl(old, lp, old, adv, mask, "token-mean", config)
    with pytest.raises(AttributeError):
        ca.get_kl_controller({"type": "fixed", "kl_coef": 0.1})
    with pytest.raises(AttributeError, match="kl_ctrl"):
        kv.get_kl_controller({"type": "fixed", "kl_coef": 0.1})


@pytest.mark.parametrize("mode", ["kl", "low_var_kl", "mse", "abs", "k3+"])
@pytest.mark.parametrize("adaptive", [False, True])
@given(data=batches())
@settings(max_examples=10, deadline=None)
def test_apply_kl_penalty_equals_verl(mode, adaptive, data):
    ca = peers.verl_core_algos()
    apply = peers.verl_apply_kl_penalty()
    scores = torch.where(data.mask, torch.randn(data.mask.shape, dtype=torch.float64).to(data.dtype), 0.0)

    def run(fn, ctl):
        d = data if fn is not apply else exact(data)
        batch = {"response_mask": data.mask.to(torch.int64), "token_level_scores": scores.to(d.old.dtype),
                 "old_log_probs": d.old, "ref_log_prob": d.ref}
        if fn is apply:
            from tensordict import TensorDict
            batch = TensorDict(batch, batch_size=[data.mask.shape[0]])
        out, metrics = fn(SimpleNamespace(batch=batch), ctl, kl_penalty=mode)
        return out.batch["token_level_rewards"], metrics, ctl.value

    def ctl(mod):
        return mod.AdaptiveKLController(0.05, 0.01, 1000) if adaptive else mod.FixedKLController(0.05)

    got, got_m, got_v = run(kv.apply_kl_penalty, ctl(kv))
    want, want_m, want_v = run(apply, ctl(ca))
    close(got, want, data.dtype, "token_level_rewards", scale=want.abs().max().item() + 1)
    assert set(got_m) == set(want_m)
    tol = 1e-5 if data.dtype == torch.float32 else 2e-2
    assert got_m["actor/reward_kl_penalty"] == pytest.approx(want_m["actor/reward_kl_penalty"], rel=tol, abs=tol)
    assert got_m["actor/reward_kl_penalty_coeff"] == pytest.approx(want_m["actor/reward_kl_penalty_coeff"])
    assert got_v == pytest.approx(want_v, rel=1e-5)


def test_controllers_follow_verls():
    ca = peers.verl_core_algos()
    ours, theirs = kv.AdaptiveKLController(0.1, 6.0, 10000), ca.AdaptiveKLController(0.1, 6.0, 10000)
    for kl, n in ((2.0, 256), (9.0, 512), (6.0, 64), (100.0, 10000)):
        ours.update(current_kl=kl, n_steps=n)
        theirs.update(current_kl=kl, n_steps=n)
        assert ours.value == pytest.approx(theirs.value, rel=1e-6)
    cfg = SimpleNamespace(type="adaptive", kl_coef=0.2, target_kl=1.0, horizon=50)
    assert isinstance(kv.get_kl_controller(cfg), kv.AdaptiveKLController)
    assert kv.get_kl_controller(SimpleNamespace(type="fixed", kl_coef=0.3)).value == 0.3
    with pytest.raises(NotImplementedError):
        kv.get_kl_controller(SimpleNamespace(type="pid"))


def test_register_puts_the_fused_loss_in_verls_registry():
    peers.verl_core_algos()
    from verl.trainer.ppo import core_algos as ca

    assert kv.register() == ["kl_kernels", "kl_kernels_gspo"]
    assert ca.get_policy_loss_fn("kl_kernels") is kv.compute_policy_loss_vanilla
    assert ca.get_policy_loss_fn("kl_kernels_gspo") is kv.compute_policy_loss_gspo
    assert ca.get_policy_loss_fn("gspo") is not kv.compute_policy_loss_gspo
    assert ca.get_policy_loss_fn("vanilla") is not kv.compute_policy_loss_vanilla


def test_the_shim_imports_without_verl():
    code = ("from kl_kernels.integrations import verl as kv\nimport torch\n"
            "print(kv.kl_penalty(torch.zeros(2, 2), torch.ones(2, 2), 'k1').sum().item())\n"
            "try:\n    kv.register()\nexcept ImportError as e:\n    print('register:', 'needs verl' in str(e))\n")
    assert printed_without("verl", code) == ["-4.0", "register:", "True"]


KL_LOSS_CASES = [("token-mean", "low_var_kl", {}), ("seq-mean-token-mean", "k1", {"kl_loss_coef": 0.1}),
                 ("seq-mean-token-sum-norm", "low_var_kl", {"clip_ratio_c": 2.0}), ("token-mean", "k3+", {}),
                 ("token-sum", "mse", {"kl_loss_coef": 0.05})]


@pytest.mark.parametrize("mode, kl_type, over", KL_LOSS_CASES, ids=[f"{m}-{k}" for m, k, _ in KL_LOSS_CASES])
@given(data=batches())
@settings(max_examples=12, deadline=None)
def test_policy_loss_with_kl_equals_verls_actor_loss(mode, kl_type, over, data):
    """verl's ppo_loss with use_kl_loss (workers/utils/losses.py:132-142): pg_loss + agg_loss(kl_penalty(lp,
    ref, kl_loss_type), mask, mode) * kl_loss_coef, against one fused pass."""
    peers.verl_core_algos()
    from verl.trainer.ppo import core_algos as ca

    if not data.mask.any():
        return
    over = dict(over)  # (the parametrized dict is shared by every example)
    cfg = _verl_config(kl_loss_type=kl_type, kl_loss_coef=over.pop("kl_loss_coef", 0.001), **over)
    peer = exact(data)
    lp_got, lp_want = data.lp.clone().requires_grad_(), peer.lp.clone().requires_grad_()
    got, metrics = kv.compute_policy_loss_with_kl(data.old, lp_got, data.ref, data.adv, data.mask, mode, cfg,
                                                  data.weights)
    pg, want_metrics = ca.compute_policy_loss_vanilla(peer.old, lp_want, peer.adv, data.mask, mode, cfg, peer.weights)
    kl_loss = ca.agg_loss(ca.kl_penalty(lp_want, peer.ref, kl_type), data.mask, mode)
    want = pg + kl_loss * cfg.kl_loss_coef
    md = torch.float32 if data.dtype == torch.float32 else data.dtype
    close(got.detach(), want.detach().float(), md, "loss", scale=want.abs().item() + 1)
    g_got, = torch.autograd.grad(got, lp_got)
    g_want, = torch.autograd.grad(want, lp_want)
    close(g_got, g_want, data.dtype, "d loss / d log_prob", scale=g_want.abs().max().item() + 1e-3)
    assert metrics["actor/kl_coef"] == cfg.kl_loss_coef
    tol = dict(rel=1e-4, abs=1e-5) if data.dtype == torch.float32 else dict(rel=0.05, abs=0.05)
    assert metrics["actor/kl_loss"] == pytest.approx(float(kl_loss), **tol)
    assert metrics["actor/ppo_kl"] == pytest.approx(want_metrics["actor/ppo_kl"], **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("inplace", [False, True])
def test_logprobs_and_entropy_from_logits_equal_verl(dtype, inplace):
    """verl's torch_functional helpers (its torch path: flash-attn is absent) against the shims: values
    and gradients; the entropy within float32 rounding of verl's (which cancels at large logits)."""
    tf = peers.verl_torch_functional()
    g = torch.Generator().manual_seed(11)
    x = (torch.randn(3, 7, 120, generator=g) * 3).to(dtype)
    y = torch.randint(0, 120, (3, 7), generator=g)
    up = torch.randn(3, 7, generator=g)
    want_in = x.float().detach().requires_grad_()
    want = tf.logprobs_from_logits(want_in, y)
    want_h = tf.entropy_from_logits(want_in)
    (g_want,) = torch.autograd.grad((want * up).sum() + want_h.sum(), want_in)
    got_in = x.detach().clone().requires_grad_()
    logits = got_in * 1
    got = kv.logprobs_from_logits(logits, y, inplace_backward=inplace)
    got_h = kv.entropy_from_logits(got_in)
    assert got.dtype == torch.float32 and got.shape == want.shape
    torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_h, want_h.detach(), rtol=1e-5, atol=1e-4)
    (g_got,) = torch.autograd.grad((got * up).sum() + got_h.sum(), got_in)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-3)
    torch.testing.assert_close(g_got.float(), g_want, **tol)
