"""kl_kernels.torchrl.KLPENPPOLoss: equal to TorchRL 0.14.1's on a continuous-control actor and
critic (side by side, same inputs), except the documented beta-gradient fix; and its fused token
path against the float64 oracle."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

torchrl = pytest.importorskip("torchrl")  # the `torchrl` extra
from tensordict import TensorDict  # noqa: E402
from torchrl.objectives import KLPENPPOLoss as TheirLoss  # noqa: E402

import kl_kernels.torchrl as ours  # noqa: E402
import kl_kernels.torchrl.ppo as ours_ppo  # noqa: E402
from oracle_kl_penalty import Seq, oracle_loss  # noqa: E402
from torchrl_models import continuous_actor_critic, token_actor  # noqa: E402

warnings.filterwarnings("ignore", category=DeprecationWarning)
B = 24


def perturbed(module, scale: float, seed: int):
    """A copy of ``module`` with Gaussian noise of std ``scale`` added to every parameter."""
    out = copy.deepcopy(module)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in out.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))
    return out


def rollout(actor, seed: int, *, batch: int = B, keys=None) -> TensorDict:
    """Data as a collector plus GAE leave them: observations, the behaviour policy's action,
    log-prob and distribution parameters, advantage, value target and old state value."""
    keys = keys or {}
    g = torch.Generator().manual_seed(seed)
    td = TensorDict({"observation": torch.randn(batch, 4, generator=g)}, [batch])
    with torch.no_grad():
        td = actor(td)
    td.set(keys.get("advantage", "advantage"), torch.randn(batch, 1, generator=g))
    td.set(keys.get("value_target", "value_target"), torch.randn(batch, 1, generator=g))
    td.set(keys.get("value", "state_value"), torch.randn(batch, 1, generator=g))
    if "sample_log_prob" in keys:
        td.rename_key_("action_log_prob", keys["sample_log_prob"])
    return td


def pair(actor_scale: float = 0.3, tanh: bool = False, **kwargs):
    """TorchRL's loss and ours on identical copies of a (perturbed) actor and critic."""
    actor, critic = continuous_actor_critic(tanh=tanh)
    actor = perturbed(actor, actor_scale, seed=7)
    theirs = TheirLoss(copy.deepcopy(actor), copy.deepcopy(critic), **kwargs)
    mine = ours.KLPENPPOLoss(copy.deepcopy(actor), copy.deepcopy(critic), **kwargs)
    return theirs, mine


def run_both(theirs, mine, td, seed: int = 0):
    torch.manual_seed(seed)  # Monte-Carlo KL / entropy draw the same samples in both
    a = theirs(td.clone())
    torch.manual_seed(seed)
    b = mine(td.clone())
    return a, b


def assert_same_outputs(a: TensorDict, b: TensorDict):
    assert set(a.keys(True, True)) == set(b.keys(True, True))
    for key in a.keys(True, True):
        x, y = a.get(key), b.get(key)
        assert x.shape == y.shape, (key, x.shape, y.shape)
        torch.testing.assert_close(y, x, rtol=1e-6, atol=1e-6, msg=lambda m: f"{key}: {m}")


CONFIGS = {
    "defaults": {},
    "reduction-sum": {"reduction": "sum"},
    "reduction-none": {"reduction": "none"},
    "clip-value": {"clip_value": 0.2},
    "normalize-advantage": {"normalize_advantage": True},
    "no-entropy": {"entropy_bonus": False},
    "critic-l2-coeff": {"critic_coeff": 0.5, "loss_critic_type": "l2"},
    "no-critic": {"critic_coeff": 0.0},
    "separate-losses": {"separate_losses": True},
    "non-functional": {"functional": False},
    "beta-dtarg": {"beta": 0.3, "dtarg": 0.5, "increment": 1.5, "decrement": 0.75},
    "entropy-coeff": {"entropy_coeff": 0.05},
}


@pytest.mark.parametrize("config", list(CONFIGS), ids=list(CONFIGS))
def test_outputs_and_beta_equal_torchrl(config):
    """Five updates, each on fresh data from a behaviour policy at a different distance (KL above,
    inside and below the target band): every output and beta after each step equal TorchRL's."""
    kwargs = CONFIGS[config]
    theirs, mine = pair(**kwargs)
    base, _ = continuous_actor_critic()
    for step, scale in enumerate([0.0, 0.3, 0.05, 0.0, 0.3]):
        td = rollout(perturbed(base, scale, seed=100 + step), seed=step)
        a, b = run_both(theirs, mine, td, seed=step)
        assert_same_outputs(a, b)
        torch.testing.assert_close(mine.beta, theirs.beta, rtol=0, atol=0)
    assert theirs.state_dict().keys() == mine.state_dict().keys()


def test_monte_carlo_kl_equals_torchrl():
    """A tanh-normal actor has no analytic KL: both take the same Monte-Carlo estimate."""
    theirs, mine = pair(tanh=True, samples_mc_kl=3)
    base, _ = continuous_actor_critic(tanh=True)
    td = rollout(base, seed=3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        a, b = run_both(theirs, mine, td, seed=11)
    assert_same_outputs(a, b)
    assert float(a["kl"].abs().sum()) > 0


def test_custom_keys_equal_torchrl():
    names = {"advantage": "adv", "value_target": "ret", "value": "v_old", "sample_log_prob": "lp_old"}
    theirs, mine = pair(clip_value=0.1)
    for loss in (theirs, mine):
        loss.set_keys(**names)
    base, _ = continuous_actor_critic()
    td = rollout(base, seed=5, keys=names)
    a, b = run_both(theirs, mine, td)
    assert_same_outputs(a, b)
    assert sorted(map(str, theirs.in_keys)) == sorted(map(str, mine.in_keys))
    assert theirs.out_keys == mine.out_keys


def test_value_estimator_path_equals_torchrl():
    """No advantage in the data: both run their GAE (on the detached critic) first."""
    theirs, mine = pair()
    base, _ = continuous_actor_critic()
    td = rollout(base, seed=9)
    del td["advantage"], td["value_target"], td["state_value"]
    td.set(("next", "observation"), torch.randn(B, 4))
    td.set(("next", "reward"), torch.randn(B, 1))
    td.set(("next", "done"), torch.zeros(B, 1, dtype=torch.bool))
    td.set(("next", "terminated"), torch.zeros(B, 1, dtype=torch.bool))
    a, b = run_both(theirs, mine, td)
    assert_same_outputs(a, b)


def _objective_grads(loss, td):
    out = loss(td.clone())
    params = [p for p in loss.actor_network_params.values(True, True) if p.requires_grad]
    return torch.autograd.grad(out["loss_objective"], params)


@pytest.mark.parametrize("impl", [
    "kl_kernels",
    pytest.param("torchrl", marks=pytest.mark.xfail(strict=True, reason="TorchRL 0.14.1 rescales beta in place "
                                                                        "before backward: the documented bug")),
])
def test_gradient_uses_the_beta_of_the_forward(impl):
    """The KL is far above target, so beta doubles during the call. The gradient must be the one of
    the value returned (computed with the old beta): TorchRL's loss with a frozen beta
    (increment = decrement = 1) gives it. TorchRL's adaptive loss uses the doubled beta instead."""
    base, _ = continuous_actor_critic()
    td = rollout(base, seed=1)
    cls = ours.KLPENPPOLoss if impl == "kl_kernels" else TheirLoss
    adaptive = cls(*_modules(), beta=1.0)
    frozen = TheirLoss(*_modules(), beta=1.0, increment=1.0, decrement=1.0)
    got = _objective_grads(adaptive, td)
    assert float(adaptive.beta) == 2.0  # the update happened
    want = _objective_grads(frozen, td)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def _modules():
    actor, critic = continuous_actor_critic()
    return perturbed(actor, 0.3, seed=7), critic


def test_reset_state_dict_and_isinstance():
    _, mine = pair()
    assert isinstance(mine, TheirLoss)
    base, _ = continuous_actor_critic()
    mine(rollout(base, seed=0))
    assert float(mine.beta) != 1.0
    other = ours.KLPENPPOLoss(*_modules())
    other.load_state_dict(mine.state_dict())
    assert float(other.beta) == float(mine.beta)
    mine.reset()
    assert float(mine.beta) == 1.0 and isinstance(mine.beta, torch.Tensor)
    assert "beta" in dict(mine.named_buffers())


def test_beta_update_is_in_place_on_the_buffer():
    """The update is tensor ops on the buffer: the same buffer object, changed in place."""
    _, mine = pair()
    buf = mine.beta
    base, _ = continuous_actor_critic()
    mine(rollout(base, seed=2))
    assert mine.beta is buf


# --------------------------------------------------------------------------- token (LM) path
V, T = 11, 9
LENGTHS = [9, 4, 1, 7, 0, 6]  # left padded into T columns


def token_batch(seed: int, *, per_token_adv: bool, actor=None, keep_logits: bool = False):
    """A left-padded batch of token sequences with assistant masks, sampled from ``actor``
    (``keep_logits``: also the behaviour policy's logits, which TorchRL's generic path needs)."""
    actor = actor or token_actor(V)
    g = torch.Generator().manual_seed(seed)
    b = len(LENGTHS)
    valid = torch.zeros(b, T, dtype=torch.bool)
    for i, n in enumerate(LENGTHS):
        valid[i, T - n:] = True
    assistant = valid & (torch.rand(b, T, generator=g) < 0.7)
    td = TensorDict({"context": torch.randint(0, V, (b, T), generator=g)}, [b])
    with torch.no_grad():
        td = actor(td)
    td.set(("masks", "all_assistant_mask"), assistant)
    adv = torch.randn(b, T, 1, generator=g) if per_token_adv else torch.randn(b, 1, generator=g)
    td.set("advantage", adv)
    if not keep_logits:
        del td["logits"]  # an LM rollout keeps the sampled tokens' log-probs, not the logits
    return td


def token_oracle(loss, td, beta: float, reduction: str = "mean"):
    """The float64 oracle of the token path, from the current actor's log-probs and entropies."""
    with torch.no_grad(), loss.actor_network_params.to_module(loss.actor_network):
        dist = loss.actor_network.get_dist(td.clone())
        lp = dist.log_prob(td["action"]).double()
        ent = dist.entropy().double()
    old = td["action_log_prob"].double()
    mask = td["masks", "all_assistant_mask"]
    adv = td["advantage"].double()
    adv = adv.squeeze(-1) if adv.shape[1:] == (T, 1) else adv.expand(-1, T)
    seqs = [Seq(lp=lp[i].tolist(), old=old[i].tolist(), adv=adv[i].tolist(), mask=mask[i].tolist(),
                ent=ent[i].tolist(), beta=beta) for i in range(mask.shape[0])]
    agg = {"mean": "token-mean", "sum": "sum", "none": "none"}[reduction]
    return oracle_loss(seqs, estimator=loss.kl_estimator, entropy_coef=float(loss.entropy_coeff), aggregation=agg)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("adv", ["per-seq-adv", "per-token-adv"])
def test_token_path_matches_oracle(backend, reduction, adv):
    actor = token_actor(V)
    td = token_batch(0, per_token_adv=adv == "per-token-adv", actor=actor)
    loss = ours.KLPENPPOLoss(perturbed(actor, 0.2, seed=3), None, critic_coeff=0.0, beta=0.5, entropy_coeff=0.03,
                             reduction=reduction, backend=backend)
    want = token_oracle(loss, td, beta=0.5, reduction=reduction)
    out = loss(td)
    if reduction == "none":
        mask = td["masks", "all_assistant_mask"]
        want_tok = torch.tensor(want.token_loss, dtype=torch.float64)
        assert out["loss_objective"].shape == mask.shape
        # per token: objective + KL, and the entropy part separately (0 at tokens not counted)
        got = out["loss_objective"].double() + out["loss_entropy"].double()
        torch.testing.assert_close(got, want_tok, rtol=2e-5, atol=2e-6)
        assert bool((out["loss_entropy"][~mask] == 0).all()) and bool((out["loss_objective"][~mask] == 0).all())
    else:
        torch.testing.assert_close(out["loss_objective"].double(),
                                   torch.tensor(want.loss_objective + want.loss_kl, dtype=torch.float64),
                                   rtol=2e-5, atol=2e-6)
        torch.testing.assert_close(out["loss_entropy"].double(), torch.tensor(want.loss_entropy, dtype=torch.float64),
                                   rtol=2e-5, atol=2e-6)
    torch.testing.assert_close(out["kl"].double(), torch.tensor(want.kl_mean, dtype=torch.float64), rtol=2e-5,
                               atol=2e-6)
    assert float(loss.beta) == (1.0 if want.kl_mean > 0.015 else 0.25 if want.kl_mean < 0.01 / 1.5 else 0.5)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_token_path_gradient(backend):
    """d loss_objective / d actor parameters equals autograd of the plain formula (masked token mean)."""
    actor = token_actor(V)
    td = token_batch(1, per_token_adv=False, actor=actor)
    new = perturbed(actor, 0.2, seed=4)
    loss = ours.KLPENPPOLoss(new, None, critic_coeff=0.0, beta=0.7, entropy_bonus=False, backend=backend)
    params = [p for p in loss.actor_network_params.values(True, True) if p.requires_grad]
    got = torch.autograd.grad(loss(td)["loss_objective"], params)
    with loss.actor_network_params.to_module(loss.actor_network):
        lp = loss.actor_network.get_dist(td.clone()).log_prob(td["action"])
        old, mask = td["action_log_prob"], td["masks", "all_assistant_mask"]
        per_tok = -(lp - old).exp() * td["advantage"] + 0.7 * (old - lp)
        want = torch.autograd.grad((per_tok * mask).sum() / mask.sum(), params)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("beta", [0.0, 0.5])
@pytest.mark.parametrize("adv", ["per-seq-adv", "per-token-adv"])
def test_token_path_against_torchrl_generic_path(adv, beta):
    """Issue 26 item 5: the same LM-shaped batch (assistant mask, per-token log-probs, and the
    behaviour policy's logits so TorchRL can build its distribution) through TorchRL's generic
    KLPENPPOLoss, told to reduce over the assistant mask (``loss_mask_key``), and our token path.
    The objective, the entropy loss and their gradients are equal; the one difference is the KL
    term: TorchRL's is the analytic KL of the stored logits, ours the sample estimate (k1) on the
    sampled tokens, so ours - theirs = beta * masked-mean(k1 - analytic KL), values and gradients.
    beta is held fixed (increment = decrement = 1) to leave TorchRL's beta-gradient bug out."""
    actor = token_actor(V)
    td = token_batch(5, per_token_adv=adv == "per-token-adv", actor=actor, keep_logits=True)
    new = perturbed(actor, 0.2, seed=8)
    kw = dict(critic_coeff=0.0, beta=beta, increment=1.0, decrement=1.0, entropy_coeff=0.03)
    theirs = TheirLoss(copy.deepcopy(new), None, **kw)
    theirs.loss_mask_key = ("masks", "all_assistant_mask")
    mine = ours.KLPENPPOLoss(copy.deepcopy(new), None, **kw)
    mask = td["masks", "all_assistant_mask"]
    count = mask.sum()

    def run(loss):
        params = [p for p in loss.actor_network_params.values(True, True) if p.requires_grad]
        out = loss(td.clone())
        total = out["loss_objective"] + out["loss_entropy"]
        return out, torch.autograd.grad(total, params), params

    a, grads_a, _ = run(theirs)
    b, grads_b, params = run(mine)
    with mine.actor_network_params.to_module(mine.actor_network):
        new_dist = mine.actor_network.get_dist(td.clone())
        k1 = td["action_log_prob"] - new_dist.log_prob(td["action"])
        analytic = torch.distributions.kl_divergence(torch.distributions.Categorical(logits=td["logits"]), new_dist)
        gap = beta * torch.where(mask, k1 - analytic, 0.0).sum() / count
    grads_gap = torch.autograd.grad(gap, params, allow_unused=True)
    torch.testing.assert_close(b["loss_objective"] - a["loss_objective"], gap.detach(), rtol=1e-5, atol=2e-6)
    torch.testing.assert_close(b["loss_entropy"], a["loss_entropy"], rtol=1e-5, atol=1e-6)
    for gb, ga, gg in zip(grads_b, grads_a, grads_gap):
        torch.testing.assert_close(gb - ga, torch.zeros_like(gb) if gg is None else gg, rtol=1e-4, atol=2e-6)
    # the reported KL and entropy (documented deviations): TorchRL's "kl" is the analytic KL per
    # position [*B, T, 1] and its "entropy" a mean over every position; ours are token means over the
    # counted tokens
    torch.testing.assert_close(a["kl"], analytic.detach().unsqueeze(-1), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(b["kl"], torch.where(mask, k1, 0.0).detach().sum() / count, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(a["entropy"], new_dist.entropy().detach().mean(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(b["entropy"], torch.where(mask, new_dist.entropy(), 0.0).detach().sum() / count,
                               rtol=1e-5, atol=1e-6)
    if beta:  # the comparison is not vacuous: the two KL terms differ on this batch
        assert abs(float(gap.detach())) > 1e-3


def test_token_path_goes_through_fused_op_and_ignores_other_tokens(monkeypatch):
    calls = []
    real = ours_ppo.kl_penalty_loss
    monkeypatch.setattr(ours_ppo, "kl_penalty_loss", lambda *a, **k: calls.append(k) or real(*a, **k))
    actor = token_actor(V)
    td = token_batch(2, per_token_adv=True, actor=actor)
    loss = ours.KLPENPPOLoss(perturbed(actor, 0.2, seed=5), None, critic_coeff=0.0, beta=1.0, increment=1.0,
                             decrement=1.0)
    a = loss(td.clone())
    assert len(calls) == 1 and calls[0]["mask"] is not None
    other = td.clone()
    outside = ~td["masks", "all_assistant_mask"]
    other["action_log_prob"] = torch.where(outside, torch.full_like(td["action_log_prob"], 3.0),
                                           td["action_log_prob"])
    other["advantage"] = torch.where(outside.unsqueeze(-1), 1e6, td["advantage"])
    b = loss(other)
    for key in ("loss_objective", "kl", "kl_approx", "entropy", "loss_entropy"):
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=0)


def test_token_path_normalizes_advantage_over_counted_tokens():
    actor = token_actor(V)
    td = token_batch(3, per_token_adv=True, actor=actor)
    mask = td["masks", "all_assistant_mask"]
    adv = td["advantage"].squeeze(-1)
    loc = adv[mask].mean()
    scale = adv[mask].std(correction=0)
    norm = td.clone()
    norm["advantage"] = ((adv - loc) / scale).unsqueeze(-1)
    kw = dict(critic_coeff=0.0, beta=1.0, increment=1.0, decrement=1.0)
    a = ours.KLPENPPOLoss(perturbed(actor, 0.2, seed=6), None, normalize_advantage=True, **kw)(td)
    b = ours.KLPENPPOLoss(perturbed(actor, 0.2, seed=6), None, **kw)(norm)
    torch.testing.assert_close(a["loss_objective"], b["loss_objective"], rtol=1e-5, atol=1e-6)


def test_token_path_bad_inputs():
    actor = token_actor(V)
    td = token_batch(0, per_token_adv=False, actor=actor)
    loss = ours.KLPENPPOLoss(actor, None, critic_coeff=0.0)
    bad = td.clone()
    bad["masks", "all_assistant_mask"] = bad["masks", "all_assistant_mask"].float()
    with pytest.raises(TypeError, match="token mask .* must be a bool tensor"):
        loss(bad)
    bad = td.clone()
    bad["advantage"] = torch.randn(len(LENGTHS), T + 1)
    with pytest.raises(ValueError, match="advantage"):
        loss(bad)
    with pytest.raises(ValueError, match="delay_actor"):
        ours.KLPENPPOLoss(actor, None, critic_coeff=0.0, delay_actor=True)(td)
    with pytest.raises(ValueError, match="kl_estimator"):
        ours.KLPENPPOLoss(actor, None, critic_coeff=0.0, kl_estimator="k9")
