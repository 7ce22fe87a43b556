"""verl 0.9.1's KL paths, each switched to kl_kernels, on verl's own objects.

* KL in the reward: ``apply_kl_penalty`` on a real ``DataProto``, with verl's own controllers (made by verl's
  ``get_kl_controller`` from an ``AlgoConfig``), against verl's function (its exact source: tests/peers.py); and
  ``patch_kl_reward``, the switch of the trainer modules' name.
* The actor's KL loss: verl's own ``ppo_loss`` (``verl/workers/utils/losses.py``) with a real ``ActorConfig``
  (``use_kl_loss=True``, every ``kl_loss_type``), unpatched against ``patch_kl_loss()``: loss, metrics and the
  gradient to the log-probs.
* The policy-loss registry: ``register()`` and ``policy_loss.loss_mode="kl_kernels"`` in the same ``ppo_loss``.

Tolerances: float32 inputs; the losses within 2e-6 relative (+1e-7), the gradients within 1e-6 x their largest
element, the reward within 1e-6 (measured: a few float32 ulps).
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

import peers
from kl_kernels.integrations import verl as kv

MODES = ["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"]


def _dataproto(seed, B=5, T=7):
    protocol = peers.verl_module("verl.protocol")
    g = torch.Generator().manual_seed(seed)
    mask = (torch.rand(B, T, generator=g) < 0.8).float()
    mask[0] = 0  # an empty response
    mask[1, 3:] = 0
    lp = -torch.rand(B, T, generator=g) * 3
    return protocol.DataProto.from_dict(tensors={
        "response_mask": mask, "token_level_scores": torch.randn(B, T, generator=g) * mask,
        "old_log_probs": lp, "ref_log_prob": lp + torch.randn(B, T, generator=g) * 0.5})


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", ["fixed", "adaptive"])
def test_apply_kl_penalty_on_a_dataproto_with_verls_controllers(mode, kind):
    ca = peers.verl_core_algos()
    algo = peers.verl_module("verl.trainer.config")
    verl_apply = peers.verl_apply_kl_penalty()
    config = algo.AlgoConfig(use_kl_in_reward=True, kl_penalty=mode,
                             kl_ctrl=algo.KLControlConfig(type=kind, kl_coef=0.05, horizon=20, target_kl=0.01))
    runs = []
    for fn in (verl_apply, kv.apply_kl_penalty):
        ctl = ca.get_kl_controller(config.kl_ctrl)  # verl's own controller object, for both
        data = _dataproto(seed=MODES.index(mode))
        values = []
        for _ in range(3):  # three steps: the adaptive controller's coefficient moves between them
            data, metrics = fn(data, ctl, kl_penalty=config.kl_penalty)
            values.append((data.batch["token_level_rewards"].clone(), metrics, ctl.value))
        runs.append(values)
    for (want, want_m, want_v), (got, got_m, got_v) in zip(*runs):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        assert got_m.keys() == want_m.keys()
        assert got_m["actor/reward_kl_penalty"] == pytest.approx(want_m["actor/reward_kl_penalty"], rel=1e-5, abs=1e-7)
        assert got_m["actor/reward_kl_penalty_coeff"] == pytest.approx(want_m["actor/reward_kl_penalty_coeff"],
                                                                        rel=1e-6)
        assert got_v == pytest.approx(want_v, rel=1e-6)
    if kind == "adaptive":
        assert runs[0][0][2] != runs[0][2][2]  # the coefficient did move


def test_patch_kl_reward_sets_the_trainers_name(monkeypatch):
    """patch_kl_reward sets apply_kl_penalty in verl's trainer modules. Importing verl.trainer.ppo.ray_trainer needs
    verl's whole trainer stack (vllm, torchdata, datasets, transfer_queue, ...): where it imports it is used; where
    not, the patch must say so (ImportError naming the module), and the name swap is checked on a stand-in module
    holding verl's own apply_kl_penalty (its exact source)."""
    import importlib

    verl_apply = peers.verl_apply_kl_penalty()
    name = "verl.trainer.ppo.ray_trainer"
    try:
        importlib.import_module(name)
    except ImportError:
        with pytest.raises(ImportError, match="patch_kl_reward needs verl"):
            kv.patch_kl_reward()
        stand_in = types.ModuleType(name)
        stand_in.apply_kl_penalty = verl_apply
        monkeypatch.setitem(sys.modules, name, stand_in)
    trainer = sys.modules[name]
    before = trainer.apply_kl_penalty
    with kv.patch_kl_reward() as switch:
        assert switch.made and trainer.apply_kl_penalty is kv.apply_kl_penalty
        assert not kv.patch_kl_reward().made  # idempotent
    assert trainer.apply_kl_penalty is before


def _ppo_batch(seed, B=4, P=3, R=6):
    """A micro-batch as verl's engine hands it to ppo_loss: prompts/responses/attention_mask, the response-aligned
    tensors, the global batch info, and the model's packed log-probs (one per counted token of each sequence)."""
    from tensordict import TensorDict

    tu = peers.verl_module("verl.utils.tensordict_utils")
    g = torch.Generator().manual_seed(seed)
    am = torch.ones(B, P + R, dtype=torch.long)
    am[0, :1] = 0  # a left-padded prompt
    am[1, P + 4:] = 0  # shorter responses
    am[2, P + 1:] = 0
    old = -torch.rand(B, R, generator=g) * 2
    data = TensorDict({"prompts": torch.randint(0, 50, (B, P), generator=g),
                       "responses": torch.randint(0, 50, (B, R), generator=g), "attention_mask": am,
                       "response_mask": am[:, P:].clone(), "old_log_probs": old,
                       "advantages": torch.randn(B, R, generator=g),
                       "ref_log_prob": old + torch.randn(B, R, generator=g) * 0.3}, batch_size=[B])
    tu.assign_non_tensor(data, dp_size=1, batch_num_tokens=None, global_batch_size=None)
    log_probs = -torch.rand(int(am.sum()), generator=g) * 2
    return data, log_probs


def _actor_config(**over):
    config = peers.verl_module("verl.workers.config")
    return config.ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, **over)


def _run_ppo_loss(losses, cfg, seed):
    data, lp = _ppo_batch(seed)
    lp = lp.requires_grad_()
    loss, metrics = losses.ppo_loss(cfg, {"log_probs": lp}, data)
    (grad,) = torch.autograd.grad(loss, lp)
    return loss.detach(), {k: (float(v.values[0]) if hasattr(v, "values") else v) for k, v in metrics.items()}, grad


KL_LOSS_TYPES = MODES + ["low_var_kl+", "k1+", "k2+"]


@pytest.mark.parametrize("kl_loss_type", KL_LOSS_TYPES)
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_patch_kl_loss_runs_verls_actor_kl_loss(kl_loss_type, agg):
    losses = peers.verl_losses()
    cfg = _actor_config(use_kl_loss=True, kl_loss_type=kl_loss_type, kl_loss_coef=0.3, loss_agg_mode=agg)
    seed = KL_LOSS_TYPES.index(kl_loss_type)
    want = _run_ppo_loss(losses, cfg, seed)
    calls = []
    with kv.patch_kl_loss():
        assert losses.kl_penalty is kv.kl_penalty
        real = kv.kl_reward
        try:  # count that the KL term went through kl_kernels' op
            kv.kl_reward = lambda *a, **k: calls.append(1) or real(*a, **k)
            got = _run_ppo_loss(losses, cfg, seed)
        finally:
            kv.kl_reward = real
    assert losses.kl_penalty is not kv.kl_penalty and calls
    torch.testing.assert_close(got[0], want[0], rtol=2e-6, atol=1e-7)
    assert got[1].keys() == want[1].keys()
    for key, value in want[1].items():
        assert float(got[1][key]) == pytest.approx(float(value), rel=2e-6, abs=1e-7), key
    torch.testing.assert_close(got[2], want[2], rtol=0, atol=1e-6 * want[2].abs().max().item())


def test_registered_policy_loss_in_verls_ppo_loss():
    """register(): verl's ppo_loss with policy_loss.loss_mode="kl_kernels" (a real PolicyLossConfig) gives what
    loss_mode="vanilla" gives, the KL loss on too."""
    losses = peers.verl_losses()
    config = peers.verl_module("verl.workers.config")
    assert "kl_kernels" in kv.register()
    runs = []
    for mode in ("vanilla", "kl_kernels"):
        cfg = _actor_config(use_kl_loss=True, clip_ratio_low=0.1, clip_ratio_high=0.28,
                            policy_loss=config.PolicyLossConfig(loss_mode=mode))
        runs.append(_run_ppo_loss(losses, cfg, seed=3))
    (want, want_m, want_g), (got, got_m, got_g) = runs
    torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-7)
    for key in ("actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "kl_loss"):
        assert float(got_m[key]) == pytest.approx(float(want_m[key]), rel=2e-6, abs=1e-7), key
    torch.testing.assert_close(got_g, want_g, rtol=0, atol=1e-6 * want_g.abs().max().item())


def test_patch_turns_every_switch_on_all_or_nothing(monkeypatch):
    """kv.patch(), the one call of the docs (Ray's setup hook): every switch on and the loss registered; unpatch()
    turns them off; and when one switch cannot be turned on (verl's trainer module does not import), none stays on."""
    import importlib

    losses = peers.verl_losses()
    from verl.trainer.ppo import core_algos
    from verl.utils.experimental import torch_functional as tf
    from verl.utils.kernel import linear_cross_entropy as lce

    name = "verl.trainer.ppo.ray_trainer"
    before = (tf.FusedLinearForPPO, lce.linear_cross_entropy, losses.kl_penalty)
    try:
        importlib.import_module(name)
    except ImportError:
        with pytest.raises(ImportError, match="patch_kl_reward"):
            kv.patch()
        assert (tf.FusedLinearForPPO, lce.linear_cross_entropy, losses.kl_penalty) == before  # nothing left on
        stand_in = types.ModuleType(name)
        stand_in.apply_kl_penalty = peers.verl_apply_kl_penalty()
        monkeypatch.setitem(sys.modules, name, stand_in)
    trainer = sys.modules[name]
    verl_apply = trainer.apply_kl_penalty
    try:
        kv.patch()
        assert tf.FusedLinearForPPO is kv.FusedLinearForPPO and lce.linear_cross_entropy is kv.linear_cross_entropy
        assert losses.kl_penalty is kv.kl_penalty and trainer.apply_kl_penalty is kv.apply_kl_penalty
        assert core_algos.get_policy_loss_fn("kl_kernels") is kv.compute_policy_loss_vanilla
        kv.patch()  # a second call (another hook run): nothing changes
    finally:
        kv.unpatch()
    assert (tf.FusedLinearForPPO, lce.linear_cross_entropy, losses.kl_penalty) == before
    assert trainer.apply_kl_penalty is verl_apply
