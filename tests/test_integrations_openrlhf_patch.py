"""kl_kernels.integrations.openrlhf.patch(): OpenRLHF 0.11.2's own code paths, switched with one call.

* The switch: every name OpenRLHF looks up (models.utils, models.actor, models.loss, models, and the trainer's
  experience_maker and ray.ppo_actor that bound them) is ours while on, OpenRLHF's after ``unpatch``.
* The actor: OpenRLHF's ``Actor`` around a tiny Qwen2 built from a config (hidden 64, 2 layers, vocabulary 300),
  its forward's action log-probs and entropy and every parameter's gradient, unpatched against patched (float32:
  values within 1e-5, gradients within 1e-5 x their largest element; bfloat16 model: the same bounds as
  tests/test_integrations_verl_fused.py). Needs transformers and peft: the verl lane.
* The PPO actor's training step: ``ActorPPOTrainer.training_step`` itself (unbound, with the Actor above, a
  strategy that runs ``loss.backward()``), PolicyLoss (ppo and gspo), the KL loss (compute_approx_kl with each
  estimator, unbiased gradient on and off) and the entropy loss: the gradients it leaves on the model and its
  metrics, unpatched against patched. Needs the Actor: the verl lane.
* The experience maker: ``compute_approx_kl`` as make_experience calls it, then
  ``RemoteExperienceMaker.compute_advantages_and_returns`` itself (unbound) with OpenRLHF's own KL controller and
  ``Experience`` objects: rewards, returns and advantages, unpatched against patched (within 1e-6). Main suite.
"""

from __future__ import annotations

import importlib.metadata
from types import SimpleNamespace

import pytest
import torch

import peers
from kl_kernels.integrations import openrlhf as ko

VOCAB, HIDDEN = 300, 64


@pytest.fixture
def trainer_modules():
    mods = SimpleNamespace(utils=peers.openrlhf_utils(), loss=peers.openrlhf_loss(),
                           maker=peers.openrlhf_module("openrlhf.trainer.ppo_utils.experience_maker"),
                           ppo_actor=peers.openrlhf_module("openrlhf.trainer.ray.ppo_actor"),
                           experience=peers.openrlhf_module("openrlhf.trainer.ppo_utils.experience"),
                           kl_ctl=peers.openrlhf_kl_controllers())
    yield mods
    ko.unpatch()


def test_patch_sets_every_name_and_unpatch_restores(trainer_modules, monkeypatch):
    import openrlhf.models as models
    import openrlhf.models.actor as actor

    m = trainer_modules
    places = [(m.utils, "compute_approx_kl"), (m.utils, "compute_reward"), (m.utils, "log_probs_from_logits"),
              (m.utils, "compute_entropy"), (actor, "log_probs_from_logits"), (actor, "compute_entropy"),
              (m.loss, "PolicyLoss"), (models, "PolicyLoss"), (m.maker, "compute_approx_kl"),
              (m.maker, "compute_reward"), (m.ppo_actor, "compute_approx_kl"), (m.ppo_actor, "PolicyLoss")]
    before = [getattr(mod, name) for mod, name in places]
    with ko.patch() as switch:
        assert switch.made
        for mod, name in places:
            assert getattr(mod, name) is getattr(ko, name), f"{mod.__name__}.{name}"
        assert not ko.patch().made  # idempotent
    assert [getattr(mod, name) for mod, name in places] == before
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.12.0")
    with pytest.raises(RuntimeError, match="0.11.2"):
        ko.patch()
    assert m.utils.compute_approx_kl is before[0]


def _experiences(experience_mod, maker, seed, n=2, B=4, A=6):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        mask = torch.ones(B, A, dtype=torch.bool)
        mask[0, 4:] = False
        mask[1, 1:] = False
        lp = -torch.rand(B, A, generator=g) * 2
        base = lp + torch.randn(B, A, generator=g) * 0.5
        lp[2, 3] = -40.0  # a diverged token: OpenRLHF's clamps
        exp = experience_mod.Experience(action_mask=mask, action_log_probs=lp, base_action_log_probs=base,
                                        rewards=torch.randn(B, generator=g), values=torch.randn(B, A, generator=g),
                                        index=list(range(i * B, (i + 1) * B)))
        exp.kl = maker.compute_approx_kl(lp, base, kl_estimator="k3")  # as make_experience calls it
        out.append(exp)
    return out


@pytest.mark.parametrize("estimator", ["reinforce", "gae", "group_norm"])
def test_experience_maker_rewards_and_advantages(trainer_modules, estimator):
    m = trainer_modules
    args = SimpleNamespace(
        rollout=SimpleNamespace(n_samples_per_prompt=2, max_new_tokens=6),
        reward=SimpleNamespace(clip_range=(-3.0, 3.0), overlong_buffer_len=None, stop_properly_penalty_coef=None),
        algo=SimpleNamespace(advantage=SimpleNamespace(estimator=estimator, gamma=1.0, lambd=0.95, no_std_norm=False)),
        data=SimpleNamespace(max_len=64))
    runs = []
    for patched in (False, True):
        switch = ko.patch() if patched else None
        try:
            maker = m.maker.RemoteExperienceMaker
            fake = SimpleNamespace(strategy=SimpleNamespace(args=args), advantage_estimator=estimator,
                                   kl_ctl=m.kl_ctl.AdaptiveKLController(0.2, 6.0, 100))
            fake.get_advantages_and_returns = lambda *a: maker.get_advantages_and_returns(fake, *a)
            fake.get_cumulative_returns = lambda *a: maker.get_cumulative_returns(fake, *a)
            exps = _experiences(m.experience, m.maker, seed=7)
            assert (m.maker.compute_reward is ko.compute_reward) == patched
            maker.compute_advantages_and_returns(fake, exps)
            runs.append([(e.advantages, e.returns, e.info["return"]) for e in exps])
        finally:
            if switch is not None:
                ko.unpatch()
    for want, got in zip(*runs):
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    """A tiny Qwen2 saved with save_pretrained: OpenRLHF's Actor loads it by path, as from a checkpoint (no hub)."""
    peers.openrlhf_actor()
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      tie_word_embeddings=False)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg)
    with torch.no_grad():  # logits of a few units (a fresh head gives nearly uniform softmaxes)
        model.lm_head.weight.mul_(8.0)
    path = tmp_path_factory.mktemp("qwen2_tiny")
    model.save_pretrained(path)
    return str(path)


def tiny_actor(actor_mod, path, dtype, temperature):
    """OpenRLHF's Actor loaded by path (its loader takes bf16 or fp16; a float32 model is the bf16 one upcast)."""
    actor = actor_mod.Actor(path, attn_implementation="sdpa", param_dtype="bf16", temperature=temperature)
    return actor.to(dtype)


def _batch(seed, B=3, T=10, A=5):
    g = torch.Generator().manual_seed(seed)
    seq = torch.randint(0, VOCAB, (B, T), generator=g)
    att = torch.ones(B, T, dtype=torch.long)
    att[0, :2] = 0  # left-padded prompt
    att[2, T - 2:] = 0  # a shorter response
    action_mask = att[:, -A:].bool()
    return seq, att, action_mask


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _compare_grads(got, want, bf16):
    assert got.keys() == want.keys() and any("lm_head" in k for k in got)
    for name, w in want.items():
        gv = got[name]
        if not bf16 or "lm_head" in name:
            bound = (2.0 ** -5 if bf16 else 1e-5) * w.float().abs().max().item() + 1e-12
            torch.testing.assert_close(gv.float(), w.float(), rtol=0, atol=bound, msg=lambda s, n=name: f"{n}: {s}")
        else:
            cos = torch.nn.functional.cosine_similarity(gv.double().flatten(), w.double().flatten(), dim=0)
            assert cos >= 0.999, f"{name}: cosine {cos.item()}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_actor_forward_log_probs_entropy_and_gradients(tiny_model_dir, dtype, temperature):
    actor_mod = peers.openrlhf_actor()
    actor = tiny_actor(actor_mod, tiny_model_dir, dtype, temperature)
    seq, att, action_mask = _batch(seed=1)
    g = torch.Generator().manual_seed(2)
    a, b = torch.randn(action_mask.shape, generator=g), torch.randn(seq.shape[0], seq.shape[1] - 1, generator=g)
    runs, calls = [], []
    real = ko.token_logprobs
    for patched in (False, True):
        switch = ko.patch() if patched else None
        ko.token_logprobs = lambda *args, **kw: calls.append(patched) or real(*args, **kw)
        try:
            actor.zero_grad(set_to_none=True)
            lp, output = actor(seq, action_mask, attention_mask=att, return_output=True, return_entropy=True)
            ((lp * a).sum() + (output.entropy.float() * b).sum()).backward()
            runs.append((lp.detach(), output.entropy.detach(), _grads(actor)))
        finally:
            ko.token_logprobs = real
            if switch is not None:
                ko.unpatch()
    assert calls == [True, True]  # patched: the log-probs and the entropy through token_logprobs; unpatched: never
    (want_lp, want_ent, want_g), (got_lp, got_ent, got_g) = runs
    assert got_lp.dtype == want_lp.dtype and got_ent.dtype == want_ent.dtype and got_lp.shape == want_lp.shape
    torch.testing.assert_close(got_lp, want_lp, rtol=0, atol=1e-5)  # OpenRLHF casts the logits to float32 first
    torch.testing.assert_close(got_ent, want_ent, rtol=0, atol=1e-5)
    _compare_grads(got_g, want_g, dtype == torch.bfloat16)


def _trainer(ppo_actor, actor, policy_loss_type, kl_estimator, unbiased, entropy_coef):
    """An ActorPPOTrainer without __init__ (DeepSpeed, Ray): the attributes training_step reads, its loss built as
    __init__ builds it (ppo_actor.PolicyLoss with the args' options)."""
    args = SimpleNamespace(
        actor=SimpleNamespace(entropy_coef=entropy_coef, aux_loss_coef=0.0, eps_clip_low_high=(0.2, 0.28),
                              dual_clip=3.0, loss_agg_mode="token-mean", policy_loss_type=policy_loss_type),
        algo=SimpleNamespace(kl=SimpleNamespace(use_loss=True, init_coef=0.1, estimator=kl_estimator,
                                                unbiased_gradient=unbiased),
                             advantage=SimpleNamespace(is_correction_level="off", is_correction_mode="mask",
                                                       is_correction_gating="ratio",
                                                       is_correction_threshold=(0.5, 5.0))),
        train=SimpleNamespace(dynamic_batch_enable=False))
    self = SimpleNamespace(args=args, actor=actor, ema_model=None, aux_loss=False, replay_buffer=None, actor_optim=None,
                           actor_scheduler=SimpleNamespace(get_last_lr=lambda: [1e-6]),
                           strategy=SimpleNamespace(ring_attn_group=None, backward=lambda loss, *a: loss.backward(),
                                                    optimizer_step=lambda *a, **k: None, get_grad_norm=lambda m: 0.0))
    self.actor_loss_fn = ppo_actor.PolicyLoss(
        clip_eps_low=args.actor.eps_clip_low_high[0], clip_eps_high=args.actor.eps_clip_low_high[1],
        dual_clip=args.actor.dual_clip if policy_loss_type == "ppo" else None,
        token_level_loss=args.actor.loss_agg_mode == "token-mean", policy_loss_type=policy_loss_type)
    return self


TRAIN_CASES = [("ppo", "k1", False, None), ("ppo", "k2", True, 0.01), ("ppo", "k3", False, 0.0),
               ("ppo", "k3", True, None), ("gspo", "k3", False, 0.01)]


@pytest.mark.parametrize("policy_loss_type, kl_estimator, unbiased, entropy_coef", TRAIN_CASES)
def test_ppo_actor_training_step(trainer_modules, tiny_model_dir, policy_loss_type, kl_estimator, unbiased,
                                 entropy_coef):
    actor_mod = peers.openrlhf_actor()
    m = trainer_modules
    loss_utils = peers.openrlhf_module("openrlhf.utils.loss_utils")
    actor = tiny_actor(actor_mod, tiny_model_dir, torch.float32, 0.9)
    seq, att, action_mask = _batch(seed=3)
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        old = actor(seq, action_mask, attention_mask=att) + torch.randn(action_mask.shape, generator=g) * 0.2
    base = old + torch.randn(action_mask.shape, generator=g) * 0.3
    adv = torch.randn(action_mask.shape, generator=g)
    runs = []
    for patched in (False, True):
        switch = ko.patch() if patched else None
        try:
            trainer = _trainer(m.ppo_actor, actor, policy_loss_type, kl_estimator, unbiased, entropy_coef)
            assert isinstance(trainer.actor_loss_fn, ko.PolicyLoss) == patched
            exp = m.experience.Experience(sequences=seq, attention_mask=att, action_mask=action_mask,
                                          action_log_probs=old, base_action_log_probs=base, advantages=adv)
            info = loss_utils.get_loss_batch_info(trainer.strategy, action_mask)
            actor.zero_grad(set_to_none=True)
            assert (m.ppo_actor.compute_approx_kl is ko.compute_approx_kl) == patched
            metrics = m.ppo_actor.ActorPPOTrainer.training_step(trainer, exp, kl_ctl=0.1, step=0, loss_batch_info=info)
            runs.append((metrics, _grads(actor)))
        finally:
            if switch is not None:
                ko.unpatch()
    (want_m, want_g), (got_m, got_g) = runs
    for key in ("policy_loss", "ppo_clip_ratio", "ppo_kl", "kl", "entropy_loss"):
        if key in want_m:
            torch.testing.assert_close(torch.as_tensor(got_m[key]).float(), torch.as_tensor(want_m[key]).float(),
                                       rtol=1e-5, atol=1e-6, msg=lambda s, k=key: f"{k}: {s}")
    _compare_grads(got_g, want_g, bf16=False)
