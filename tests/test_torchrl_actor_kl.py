"""The classic-control KLRewardTransform(actor, ...) (TorchRL <= 0.10's, seeds 000/001)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("torchrl")
from tensordict import TensorDict  # noqa: E402
from tensordict.nn import NormalParamExtractor  # noqa: E402
from tensordict.nn import TensorDictModule as Mod  # noqa: E402
from torch import nn  # noqa: E402
from torchrl.modules import ProbabilisticActor  # noqa: E402
from torchrl.modules.distributions import TanhNormal  # noqa: E402

from kl_kernels.torchrl import ActorKLRewardTransform, KLRewardTransform  # noqa: E402


def make_actor(n_obs=3, n_act=1, seed=0):
    torch.manual_seed(seed)
    module = Mod(nn.Sequential(nn.Linear(n_obs, n_act * 2), NormalParamExtractor()),
                 in_keys=["observation"], out_keys=["loc", "scale"])
    return ProbabilisticActor(module, in_keys=["loc", "scale"], distribution_class=TanhNormal, return_log_prob=True)


def test_seed_example_on_pendulum():
    """Seed 000's example, only the import changed and the doc's stray ')' in
    ``apply_(lambda x: + 1))`` removed (a SyntaxError as printed)."""
    pytest.importorskip("gymnasium")
    from torchrl.envs import TransformedEnv
    from torchrl.envs.libs.gym import GymEnv

    base_env = GymEnv("Pendulum-v1")
    n_obs = base_env.observation_spec["observation"].shape[-1]
    n_act = base_env.action_spec.shape[-1]
    module = Mod(
        nn.Sequential(nn.Linear(n_obs, n_act * 2), NormalParamExtractor()),
        in_keys=["observation"],
        out_keys=["loc", "scale"],
    )
    actor = ProbabilisticActor(
        module,
        in_keys=["loc", "scale"],
        distribution_class=TanhNormal,
        return_log_prob=True,
    )
    transform = KLRewardTransform(actor, out_keys="reward_kl")
    env = TransformedEnv(base_env, transform)
    with torch.no_grad():
        # modify the actor parameters
        _ = TensorDict(dict(actor.named_parameters()), []).apply_(lambda x: + 1)
        td = env.rollout(3, actor)
    # check that rewards have been modified
    assert (td.get(("next", "reward")) != td.get(("next", "reward_kl"))).all()
    assert isinstance(transform, ActorKLRewardTransform)
    assert ("reward_kl",) in [k if isinstance(k, tuple) else (k,) for k in env.full_reward_spec.keys(True, True)]


def _step_data(actor, n=6, seed=1):
    g = torch.Generator().manual_seed(seed)
    obs = torch.randn(n, 3, generator=g)
    with torch.no_grad():
        td = actor(TensorDict({"observation": obs}, [n]))
    nxt = TensorDict({"reward": torch.randn(n, 1, generator=g)}, [n])
    return td, nxt


@pytest.mark.parametrize("coef", [1.0, 0.3])
def test_matches_float64_recomputation(coef):
    actor = make_actor(seed=0)
    t = KLRewardTransform(actor, coef=coef, out_keys=["reward_kl"])
    frozen = {k: v.detach().double().clone() for k, v in actor.named_parameters()}
    with torch.no_grad():
        for p in actor.parameters():
            p.add_(0.5 * torch.randn_like(p))
    td, nxt = _step_data(actor)
    out = t._step(td, nxt.clone())

    def logp(params):
        a64 = make_actor()
        a64.double()
        with torch.no_grad():
            for k, p in a64.named_parameters():
                p.copy_(params[k])
        d = a64.get_dist(TensorDict({"observation": td["observation"].double()}, td.batch_size))
        return d.log_prob(td["action"].double())

    cur = {k: v.detach().double() for k, v in actor.named_parameters()}
    kl = logp(cur) - logp(frozen)
    want = nxt["reward"].double() - coef * kl.reshape(-1, 1)
    assert out["reward_kl"].shape == nxt["reward"].shape
    torch.testing.assert_close(out["reward_kl"].double(), want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out["reward"], nxt["reward"])
    assert (kl.abs() > 1e-3).all()


def test_unchanged_actor_gives_zero_kl_and_in_place_default():
    actor = make_actor(seed=3)
    t = KLRewardTransform(actor)
    td, nxt = _step_data(actor)
    out = t._step(td, nxt.clone())
    torch.testing.assert_close(out["reward"], nxt["reward"])


def test_frozen_params_follow_casts_only_with_requires_grad():
    actor = make_actor()
    t0 = KLRewardTransform(actor)
    t1 = KLRewardTransform(actor, requires_grad=True)
    assert not any(True for _ in t0.parameters())
    assert all(p.requires_grad for p in t1.parameters()) and len(list(t1.parameters())) == 2
    t0.double()
    t1.double()
    assert all(v.dtype == torch.float32 for v in t0.frozen_params.values(True, True))
    assert all(v.dtype == torch.float64 for v in t1.frozen_params.values(True, True))
    with torch.no_grad():
        for p in actor.parameters():
            p.add_(1.0)
    assert all((t0.frozen_params[k] != v).all() for k, v in TensorDict.from_module(actor).items(True, True))


def test_dispatch_and_errors():
    actor = make_actor()
    assert isinstance(KLRewardTransform(actor), ActorKLRewardTransform)
    assert isinstance(KLRewardTransform(actor=actor, coef=0.1), ActorKLRewardTransform)
    with pytest.raises(TypeError, match="first argument"):
        KLRewardTransform(3.0)
    with pytest.raises(TypeError, match="actor"):
        KLRewardTransform(actor=nn.Linear(2, 2))
    with pytest.raises(TypeError, match="in_keys"):
        KLRewardTransform(actor, in_keys=3)
    with pytest.raises(ValueError, match="same length"):
        KLRewardTransform(actor, in_keys=["a", "b"], out_keys="c")
    with pytest.raises(TypeError, match="coef"):
        KLRewardTransform(actor, coef="x")
