"""kl_penalty_loss' other policy objectives (issue 62 item 2): TRL 1.16's ``cispo`` and ``sapo`` loss types,
``objective="cispo"`` (with ``ratio_cap``, TRL's ``epsilon_high``) and ``objective="sapo"`` (with
``sapo_temperatures``). Against the float64 oracle (tests/oracle_kl_penalty.py, every layout and option that
applies) and against TRL's own formulas (``GRPOTrainer._compute_loss``, written out in float64 torch ops below:
values and gradients). So far the torch backend runs them; the fused backends refuse them by name and
``"auto"`` falls back to torch.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kl_kernels import kl_penalty_loss
from kl_kernels.backends import BackendUnavailableError
from loss_batches import LOSS_LAYOUTS, check_loss, loss_cases


@pytest.mark.parametrize("layout", LOSS_LAYOUTS)
@given(case=loss_cases(), objective=st.sampled_from(["cispo", "sapo"]), cap=st.sampled_from([0.9, 1.2, 5.0]),
       taus=st.sampled_from([(1.0, 1.05), (0.5, 2.0)]))
@settings(max_examples=25)
def test_matches_oracle(case, layout, objective, cap, taus):
    case.clip, case.dual_clip, case.objective = None, None, objective
    case.ratio_cap = cap if objective == "cispo" else None
    case.sapo_temperatures = taus
    check_loss(case, layout, "torch", grads=layout != "nested_jagged")


def _trl_loss(lp, old, ref, adv, mask, loss_type, level, beta, eps_high=5.0, taus=(1.0, 1.05)):
    """TRL 1.16 GRPOTrainer._compute_loss's loss for cispo / sapo (beta != 0, use_bias_correction_kl off, no vLLM
    correction), its aggregation as TRL's: grpo-like sequence mean of token means for sapo, and the token sum over
    num_items_in_batch (here the batch's own token count, one process, no accumulation) for cispo."""
    advantages = adv.unsqueeze(1)
    log_ratio = lp - old
    if level == "token":
        log_importance_weights = log_ratio
    else:
        log_importance_weights = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    coef_1 = torch.exp(log_importance_weights)
    per_token_kl = torch.exp(ref - lp) - (ref - lp) - 1
    if loss_type == "cispo":
        clamped_ratios = torch.clamp(coef_1, max=eps_high).detach()
        per_token_loss = -clamped_ratios * advantages * lp
    else:
        # (TRL passes two Python floats, which torch.where makes float32: in float64 the exact temperatures)
        temperatures = torch.where(advantages > 0, advantages.new_tensor(taus[0]), advantages.new_tensor(taus[1]))
        soft_coef_1 = torch.sigmoid(temperatures * (coef_1 - 1)) * 4 / temperatures
        per_token_loss = -soft_coef_1 * advantages
    per_token_loss = per_token_loss + beta * per_token_kl
    if loss_type == "sapo":
        return ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    return (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)


@pytest.mark.parametrize("loss_type", ["cispo", "sapo"])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_trl_formulas_in_float64(loss_type, level):
    """TRL's values and gradients in float64, token and sequence level (GSPO: kl_penalty_loss' GSPO-token
    gradient equals TRL's through the mean when A is constant within each sequence, GRPO's case)."""
    g = torch.Generator().manual_seed(1)
    B, T = 6, 9
    lp0 = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    old = lp0 + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.5
    ref = lp0 + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.3
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    lengths = torch.tensor([9, 0, 1, 5, 9, 3])
    mask = (torch.arange(T)[None, :] < lengths[:, None]) & (torch.rand(B, T, generator=g) < 0.9)
    cap = 1.3  # (TRL's epsilon_high as cispo's cap; 1.3 so that some ratios pass it)
    lp_trl = lp0.clone().requires_grad_()
    want = _trl_loss(lp_trl, old, ref, adv, mask.double(), loss_type, level, beta=0.04, eps_high=cap)
    want.backward()
    lp = lp0.clone().requires_grad_()
    kw = dict(objective="cispo", ratio_cap=cap) if loss_type == "cispo" else dict(objective="sapo")
    out = kl_penalty_loss(lp, old, adv, ref_log_probs=ref, beta=0.04, estimator="k3", mask=mask, padding_side="right",
                          aggregation="seq-mean-token-mean" if loss_type == "sapo" else "token-mean",
                          importance_sampling_level=level, **kw)
    out.loss.backward()
    torch.testing.assert_close(out.loss.detach(), want.detach(), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(lp.grad, lp_trl.grad, rtol=1e-10, atol=1e-14)
    if loss_type == "cispo":  # TRL's cispo_clip_ratio: (coef_1 > epsilon_high) & (A > 0), a token mean
        if level == "token":
            flag = ((lp0 - old).exp() > cap) & (adv[:, None] > 0) & mask
            assert out.seq_clipped_high.tolist() == flag.sum(1).double().tolist()
            assert float(out.clip_high_fraction) == pytest.approx(int(flag.sum()) / int(mask.sum()), rel=1e-12)
            assert flag.any()
        assert not out.seq_clipped_low.any()


def test_fused_backends_refuse_and_auto_falls_back_to_torch():
    lp = -torch.rand(2, 4)
    old = lp + 0.1
    for backend in ("cpu", "cuda-emulated"):
        with pytest.raises(BackendUnavailableError, match="objective='sapo' is not in the fused kernels"):
            kl_penalty_loss(lp, old, torch.tensor([1.0, -1.0]), objective="sapo", backend=backend)
    want = kl_penalty_loss(lp, old, torch.tensor([1.0, -1.0]), objective="cispo", ratio_cap=2.0, backend="torch")
    got = kl_penalty_loss(lp, old, torch.tensor([1.0, -1.0]), objective="cispo", ratio_cap=2.0)
    torch.testing.assert_close(got.loss, want.loss, rtol=0, atol=0)


@pytest.mark.parametrize("kw, message", [
    (dict(objective="grpo"), "objective must be one of"),
    (dict(objective="cispo"), "needs ratio_cap"),
    (dict(objective="cispo", ratio_cap=0.0), "ratio_cap"),
    (dict(objective="sapo", ratio_cap=2.0), "ratio_cap is cispo's cap"),
    (dict(objective="sapo", clip_epsilon=0.2), "clip_epsilon is PPO's clip"),
    (dict(objective="cispo", ratio_cap=5.0, dual_clip=3.0), "dual_clip is PPO's clip"),
    (dict(objective="sapo", sapo_temperatures=(1.0,)), "sapo_temperatures must be a pair"),
    (dict(objective="sapo", sapo_temperatures=(1.0, -1.0)), "sapo_temperatures"),
])
def test_bad_objective_arguments(kw, message):
    lp = -torch.rand(2, 4)
    with pytest.raises(ValueError, match=message):
        kl_penalty_loss(lp, lp + 0.1, torch.tensor([1.0, -1.0]), **kw)


@pytest.mark.parametrize("objective", ["cispo", "sapo"])
def test_linear_loss_one_pass_equals_two_passes(objective):
    """linear_kl_penalty_loss hands the objective to each chunk's per-token call (one pass) as to the
    whole batch's (two passes)."""
    from kl_kernels import linear_kl_penalty_loss

    g = torch.Generator().manual_seed(2)
    B, T, H, V = 3, 5, 8, 17
    hidden = torch.randn(B, T, H, generator=g, dtype=torch.float64)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64) * 0.3
    labels = torch.randint(0, V, (B, T), generator=g)
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    kw = dict(objective=objective, ratio_cap=1.2 if objective == "cispo" else None, beta=0.1, estimator="k3",
              ref_log_probs=old + 0.1, aggregation="seq-mean-token-mean")
    outs, grads = [], []
    for one_pass in (True, False):
        h = hidden.clone().requires_grad_()
        out = linear_kl_penalty_loss(h, weight, labels, old, adv, one_pass=one_pass, **kw)
        out.loss.backward()
        outs.append(out), grads.append(h.grad)
    # (the one pass computes in float32: tests/test_linear_kl_penalty_loss.py's tolerances)
    torch.testing.assert_close(outs[0].loss.double(), outs[1].loss.double(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(outs[0].sequence_stats.double(), outs[1].sequence_stats.double(), rtol=1e-5, atol=1e-6)
