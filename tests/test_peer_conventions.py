"""The core ``kl_penalty_loss`` reproduces each peer's default aggregation with its own options
(``aggregation``, ``kl_aggregation``, ``entropy_aggregation``, ``num_sequences``,
``num_global_tokens``, ``norm_length``), without the shims: compared with the peers' own
aggregation functions (verl 0.9.1 ``agg_loss``, OpenRLHF 0.11.2 ``PolicyLoss`` / ``aggregate_loss``
/ ``compute_approx_kl``) and, for TRL 1.16 (whose aggregation lives inside
``GRPOTrainer._compute_loss``), with its formulas. Values and gradients, float32, batches with
empty rows and tool-token holes (tests/peer_batches.py). The table is python_api/kl_penalty_loss.md's.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings

import peers
from kl_kernels import kl_penalty_loss
from kl_kernels.integrations.openrlhf import KL_ESTIMATORS
from peer_batches import batches, close

BACKENDS = ["torch", "cpu"]


def _per_token(data, **kw):
    """Our per-token loss ``[B, T]`` (aggregation "none"), differentiable, for the peer to aggregate."""
    lp = data.lp.clone().requires_grad_()
    return lp, kl_penalty_loss(lp, data.old, data.adv, mask=data.mask, aggregation="none", backend="torch", **kw).loss


def _compare(got, got_leaf, want, want_leaf, what):
    close(got.detach(), want.detach(), torch.float32, what, scale=want.detach().abs().item() + 1)
    (g_got,) = torch.autograd.grad(got, got_leaf)
    (g_want,) = torch.autograd.grad(want, want_leaf)
    close(g_got, g_want, torch.float32, f"d {what}", scale=g_want.abs().max().item() + 1e-3)


VERL = [("token-mean", "token-mean", {}), ("seq-mean-token-mean", "seq-mean-token-mean", {}),
        ("seq-mean-token-sum", "seq-mean-token-sum", {}), ("seq-mean-token-sum-norm", "seq-mean-token-sum-norm", {}),
        ("seq-mean-token-mean", "seq-mean-token-mean", {"dp_size": 2, "global_batch_size": 9}),
        ("token-mean", "token-mean", {"dp_size": 4, "batch_num_tokens": 300}), ("token-sum", "sum", {})]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode, ours, info", VERL, ids=[f"{m}-{'-'.join(i) or 'local'}" for m, _, i in VERL])
@given(data=batches(dtypes=(torch.float32,)))
@settings(max_examples=10, deadline=None)
def test_verl_agg_loss(mode, ours, info, backend, data):
    """verl 0.9.1: ``agg_loss`` of the whole per-token loss (policy + KL; verl aggregates both the same
    way); its seq-mean modes divide by the sequences with a counted token (``num_sequences="nonempty"``,
    or ``global_batch_size``), its token-mean by ``batch_num_tokens``; times ``dp_size``."""
    if not data.mask.any():
        return  # verl divides 0 by 0 (NaN); ours gives 0 (tests/test_integrations_verl.py)
    ca = peers.verl_core_algos()
    opts = dict(ref_log_probs=data.ref, beta=0.05, estimator="k3", clamp_input=(-20.0, 20.0),
                clamp_output=(-10.0, 10.0), clip_epsilon=(0.2, 0.28), dual_clip=3.0)
    leaf, mat = _per_token(data, **opts)
    want = ca.agg_loss(mat, data.mask, mode, **info)
    kw = dict(opts, aggregation=ours)
    if ours.startswith("seq-mean"):
        kw["num_sequences"] = info.get("global_batch_size", "nonempty")
    if "batch_num_tokens" in info:
        kw["num_global_tokens"] = info["batch_num_tokens"]
    lp = data.lp.clone().requires_grad_()
    got = kl_penalty_loss(lp, data.old, data.adv, mask=data.mask, backend=backend, **kw).loss * info.get("dp_size", 1)
    _compare(got, lp, want, leaf, mode)


OPENRLHF = [(False, {}), (True, {}), (False, {"dp_size": 2, "batch_num_tokens": 250, "global_batch_size": 11}),
            (True, {"dp_size": 2, "batch_num_tokens": 250})]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("token_level, info", OPENRLHF,
                         ids=[f"{'token' if t else 'seq'}-{'-'.join(i) or 'local'}" for t, i in OPENRLHF])
@given(data=batches(dtypes=(torch.float32,)))
@settings(max_examples=10, deadline=None)
def test_openrlhf_actor_loss(token_level, info, backend, data):
    """OpenRLHF 0.11.2's actor step (``ppo_actor.py`` ``training_step``): ``PolicyLoss`` aggregated at
    token or sequence level (sequences: the non-empty ones), plus ``kl_coef`` times the token-level
    ``aggregate_loss`` of ``compute_approx_kl`` (k3), minus ``entropy_coef`` times the token-level
    aggregate of the entropy, the same ``loss_batch_info`` for all three."""
    if not data.mask.any():
        return  # OpenRLHF's masked_mean divides 0 by 0
    loss_mod, utils = peers.openrlhf_loss(), peers.openrlhf_utils()
    ent = torch.rand(data.lp.shape, generator=torch.Generator().manual_seed(5))
    lp_want = data.lp.clone().requires_grad_()
    m = data.mask.float()
    policy = loss_mod.PolicyLoss(clip_eps_low=0.2, clip_eps_high=0.28, dual_clip=3.0, token_level_loss=token_level)
    actor_loss = policy(lp_want, data.old, data.adv, action_mask=m, **info)[0]
    kl = utils.compute_approx_kl(lp_want, data.ref, kl_estimator="k3")
    want = (actor_loss + loss_mod.aggregate_loss(kl, m, **info) * 0.01
            - loss_mod.aggregate_loss(ent, m, **info) * 0.02)

    est, clamp_in, clamp_out = KL_ESTIMATORS["k3"]
    lp = data.lp.clone().requires_grad_()
    kw = dict(aggregation="token-mean" if token_level else "seq-mean-token-mean", kl_aggregation="token-mean",
              entropy_aggregation="token-mean")
    if not token_level:
        kw["num_sequences"] = info.get("global_batch_size", "nonempty")
    if "batch_num_tokens" in info:
        kw["num_global_tokens"] = info["batch_num_tokens"]
    got = kl_penalty_loss(lp, data.old, data.adv, mask=data.mask, ref_log_probs=data.ref, beta=0.01, estimator=est,
                          clamp_input=clamp_in, clamp_output=clamp_out, clip_epsilon=(0.2, 0.28), dual_clip=3.0,
                          entropy=ent, entropy_coef=0.02, backend=backend, **kw).loss * info.get("dp_size", 1)
    _compare(got, lp, want, lp_want, "openrlhf actor loss")


TRL = ["grpo", "bnpo", "dr_grpo", "dapo"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("loss_type", TRL)
@given(data=batches(dtypes=(torch.float32,)))
@settings(max_examples=10, deadline=None)
def test_trl_loss_types(loss_type, backend, data):
    """TRL 1.16 ``GRPOTrainer._compute_loss`` (grpo_trainer.py, the ``loss_type`` branches): ``grpo``
    means each row's token mean over every row (``(l * m).sum(-1) / m.sum(-1).clamp(min=1)``, then
    ``.mean()``); ``bnpo`` the token mean of the batch; ``dr_grpo`` the sum over ``B *
    max_completion_length``; ``dapo`` the sum over the generation batch's token count
    (``num_items_in_batch``). The per-token loss includes ``beta`` times the k3 KL."""
    m = data.mask
    leaf, mat = _per_token(data, ref_log_probs=data.ref, beta=0.04, estimator="k3", clip_epsilon=(0.2, 0.28))
    masked = torch.where(m, mat, 0.0)
    B, T = m.shape
    max_len, items = T + 5, int(m.sum()) + 17
    want = {"grpo": lambda: (masked.sum(-1) / m.sum(-1).clamp(min=1)).mean(),
            "bnpo": lambda: masked.sum() / m.sum().clamp(min=1),
            "dr_grpo": lambda: masked.sum() / (B * max_len),
            "dapo": lambda: masked.sum() / items}[loss_type]()
    kw = {"grpo": dict(aggregation="seq-mean-token-mean"), "bnpo": dict(aggregation="token-mean"),
          "dr_grpo": dict(aggregation="seq-mean-token-sum-norm", norm_length=max_len),
          "dapo": dict(aggregation="token-mean", num_global_tokens=items)}[loss_type]
    lp = data.lp.clone().requires_grad_()
    got = kl_penalty_loss(lp, data.old, data.adv, mask=m, ref_log_probs=data.ref, beta=0.04, estimator="k3",
                          clip_epsilon=(0.2, 0.28), backend=backend, **kw).loss
    _compare(got, lp, want, leaf, loss_type)
