"""kl_kernels.integrations.trl.grpo_loss against TRL 1.16.0's own ``GRPOTrainer._compute_loss``.

TRL computes the loss inside a trainer method (trl/trainer/grpo_trainer.py:3020-3185: the ratio at
3082-3096, k3 KL at 3098-3105, the clipped per-token loss at 3112-3120, the vLLM importance-sampling
ratio at 3146-3147, "+ beta * kl" at 3149-3150, the loss types' normalisers at 3153-3185). The method
is called unbound on a stand-in ``self`` carrying only the attributes it reads (tests/peers.py), with
the model's per-token log-probs handed in, so the comparison is with TRL's code itself, values and
gradients, on hypothesis-generated batches (tests/peer_batches.py).
"""

from __future__ import annotations

import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings

import peers
from kl_kernels.integrations import trl as kt
from peer_batches import batches, close, exact, printed_without
from tolerances import TOLERANCES


def _trl_loss(lp, inputs, *, loss_type, beta, eps_low, eps_high, use_vllm, grad_accum, training, mcl, delta=None,
              level="token", bias_correction=False):
    grpo = peers.trl_grpo_module()
    fake = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda model, *a, **k: (lp, torch.zeros_like(lp.detach()), None),
        aux_loss_enabled=False, top_entropy_quantile=1.0, off_policy_mask_threshold=None,
        importance_sampling_level=level, beta=beta, loss_type=loss_type, epsilon_low=eps_low, epsilon_high=eps_high,
        use_vllm=use_vllm, vllm_importance_sampling_correction=True, model=SimpleNamespace(training=training),
        current_gradient_accumulation_steps=grad_accum, max_completion_length=mcl, _entropy_bonus_enabled=False,
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        accelerator=SimpleNamespace(num_processes=2, gather=lambda x: x, reduce=lambda x, reduction="sum": x),
        args=SimpleNamespace(use_bias_correction_kl=bias_correction, delta=delta, steps_per_generation=2))
    return grpo.GRPOTrainer._compute_loss(fake, None, inputs)


# (loss type, beta, vLLM ratio, delta: TRL's two-sided clip, 1.5 >= 1 + epsilon_high)
CASES = [("dapo", 0.0, False, None), ("dapo", 0.04, True, 1.5), ("grpo", 0.04, False, None), ("grpo", 0.0, True, 2.0),
         ("bnpo", 0.1, False, 1.5), ("dr_grpo", 0.04, True, None), ("luspo", 0.0, False, None)]


@pytest.mark.parametrize("loss_type, beta, use_vllm, delta", CASES, ids=[
    f"{c[0]}-beta{c[1]}-{'vllm' if c[2] else 'plain'}{'' if c[3] is None else f'-delta{c[3]}'}" for c in CASES])
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@given(data=batches())
@settings(max_examples=10, deadline=None)
def test_grpo_loss_equals_trls(loss_type, beta, use_vllm, delta, training, data):
    _compare_with_trl(loss_type, beta, use_vllm, delta, training, data, "token")


# use_bias_correction_kl (TRL's default) with beta != 0: the KL term times the differentiable ratio
BIAS_CASES = [("dapo", 0.04, False, None), ("grpo", 0.1, True, 1.5), ("bnpo", 0.04, True, None)]


def _diverged_batch(seed: int, t: int = 64) -> SimpleNamespace:
    """One float32 row of ``t`` tokens, 5 % of them diverged from the reference by 100 (and half of those from the
    old policy by 30), as peer_batches.batches draws them."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(1, t, generator=g) < 0.85
    lp = -torch.rand(1, t, generator=g, dtype=torch.float64) * 6
    old = lp + torch.randn(1, t, generator=g, dtype=torch.float64) * 0.05
    ref = lp + torch.randn(1, t, generator=g, dtype=torch.float64) * 0.05
    hit = torch.rand(1, t, generator=g) < 0.05
    ref = torch.where(hit, lp + torch.where(torch.rand(1, t, generator=g) < 0.5, -100.0, 100.0), ref)
    old = torch.where(hit & (torch.rand(1, t, generator=g) < 0.5), lp - 30.0, old)
    adv = torch.randn(1, t, generator=g, dtype=torch.float64)
    weights = torch.rand(1, t, generator=g, dtype=torch.float64) * 2
    f = torch.float32
    return SimpleNamespace(lp=lp.to(f), old=old.to(f), ref=ref.to(f), adv=adv.to(f), mask=mask, weights=weights.to(f),
                           dtype=f)


@pytest.mark.parametrize("seed", [202, 301, 1104])
def test_bias_corrected_gradient_at_diverged_tokens(seed):
    """Batches where TRL's own float32 gradient happened to be near exact at a diverged token while ours carried
    the float32 error of the KL gradient's two cancelling terms (CI failed on such a hypothesis example; these
    seeds fail the bound without its amplification factor)."""
    _compare_with_trl("dapo", 0.04, False, None, True, _diverged_batch(seed), "token", bias_correction=True)


@pytest.mark.parametrize("loss_type, beta, use_vllm, delta", BIAS_CASES, ids=[
    f"{c[0]}-beta{c[1]}-{'vllm' if c[2] else 'plain'}{'' if c[3] is None else f'-delta{c[3]}'}" for c in BIAS_CASES])
@given(data=batches())
@settings(max_examples=10, deadline=None)
def test_grpo_loss_with_bias_corrected_kl_equals_trls(loss_type, beta, use_vllm, delta, data):
    _compare_with_trl(loss_type, beta, use_vllm, delta, True, data, "token", bias_correction=True)


# GSPO (importance_sampling_level="sequence"): TRL's recommended grpo/luspo and the token-summing dapo; the
# vLLM ratio sequence-shaped [B, 1] or token-shaped [B, T] (TRL's loss and gradient through the sequence mean are
# those of the ratio's mean over the sequence's counted tokens, which the fused call takes)
SEQ_CASES = [("grpo", 0.0, False, None), ("grpo", 0.04, True, 2.0), ("dapo", 0.04, True, None),
             ("luspo", 0.0, True, None)]


@pytest.mark.parametrize("loss_type, beta, use_vllm, delta", SEQ_CASES, ids=[
    f"{c[0]}-beta{c[1]}-{'vllm' if c[2] else 'plain'}{'' if c[3] is None else f'-delta{c[3]}'}" for c in SEQ_CASES])
@given(data=batches())
@settings(max_examples=10, deadline=None)
def test_grpo_loss_sequence_level_equals_trls(loss_type, beta, use_vllm, delta, data):
    _compare_with_trl(loss_type, beta, use_vllm, delta, True, data, "sequence")


def _compare_with_trl(loss_type, beta, use_vllm, delta, training, data, level, bias_correction=False):
    b, t = data.mask.shape
    if ((data.lp.double() - data.old.double()).abs() > 20).any():  # ours clamps the log-ratio at +-20, TRL does not
        data.old = data.lp + (data.old - data.lp).clamp(-19, 19)  # (19: bf16 rounding stays inside)
    # TRL multiplies the per-token loss by the mask, so an overflowing KL at a token that does not count
    # gives inf * 0 = NaN; ours never reads such tokens (documented): keep the padding's KL finite here
    data.ref = torch.where(data.mask, data.ref, data.lp)
    if bias_correction:  # the product rule ratio * (kl + kl') cancels: k3 ~ e^|d| of a diverged reference times a
        # ratio up to e^19 leaves float32 (TRL's autograd as ours, rounded differently) an error ~ ulp(ratio * kl),
        # far above the result's own ulp (past e^88: inf - inf). Diverged tokens kept within e^+-5 of lp here
        data.ref = (data.lp.double() + (data.ref.double() - data.lp.double()).clamp(-5, 5)).to(data.dtype)
        data.old = (data.lp.double() + (data.old.double() - data.lp.double()).clamp(-5, 5)).to(data.dtype)
    peer = exact(data)
    adv = data.adv[:, 0].contiguous()  # TRL's [B] advantages
    isr = (data.weights[:, :1] if b % 2 else data.weights) if use_vllm else None  # [B, 1] or [B, T]
    n_items = torch.tensor(float(data.mask.sum()) * 3)
    kw = dict(loss_type=loss_type, beta=beta, epsilon_low=0.2, epsilon_high=0.28, training=training, delta=delta,
              importance_sampling_level=level)
    lp_got, lp_want = data.lp.clone().requires_grad_(), peer.lp.clone().requires_grad_()
    got = kt.grpo_loss(lp_got, adv, data.mask, old_per_token_logps=data.old, ref_per_token_logps=data.ref,
                       importance_sampling_ratio=isr, use_bias_correction_kl=bias_correction,
                       max_completion_length=t + 5,
                       num_items_in_batch=n_items, num_processes=2, gradient_accumulation_steps=3,
                       steps_per_generation=2, **kw)
    inputs = dict(prompt_ids=torch.zeros(b, 1, dtype=torch.long), prompt_mask=torch.ones(b, 1, dtype=torch.long),
                  completion_ids=torch.zeros(b, t, dtype=torch.long), completion_mask=data.mask.long(),
                  advantages=peer.adv[:, 0].contiguous(), old_per_token_logps=peer.old, ref_per_token_logps=peer.ref,
                  num_items_in_batch=n_items)
    if isr is not None:
        inputs["importance_sampling_ratio"] = isr.to(peer.lp.dtype)
    want = _trl_loss(lp_want, inputs, loss_type=loss_type, beta=beta, eps_low=0.2, eps_high=0.28, use_vllm=use_vllm,
                     grad_accum=3, training=training, mcl=t + 5, delta=delta, level=level,
                     bias_correction=bias_correction)
    md = torch.float32 if data.dtype == torch.float32 else data.dtype
    if not torch.isfinite(want):  # TRL's k3 is unclamped: exp(ref - lp) overflows on a diverged token (inf, or
        assert not torch.isfinite(got)  # NaN from inf * 0 at a masked one); ours overflows alike (inf)
        return
    close(got.detach(), want.detach().float(), md, "loss")
    g_got, = torch.autograd.grad(got, lp_got)
    g_want, = torch.autograd.grad(want, lp_want)
    if not bias_correction:
        close(g_got, g_want, data.dtype, "d loss / d per_token_logps", scale=g_want.abs().max().item() + 1e-3)
        return
    # With the bias correction a token's gradient is a difference of terms ~ beta ratio k3 (up to ~e^10 / N
    # here) that nearly cancel: TRL's own float32 gradient is then off from its float64 one by ~ulp of those
    # terms, far above the result's ulp (hypothesis found TRL 3.7e-7 off on a -6.4e-4 gradient, ours 1.1e-7).
    # So ours is held to TRL's float64 gradient, within the tolerance plus twice TRL's own float32 error there.
    lp64 = peer.lp.double().clone().requires_grad_()
    want64 = _trl_loss(lp64, {k: v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v
                              for k, v in inputs.items()}, loss_type=loss_type, beta=beta, eps_low=0.2, eps_high=0.28,
                       use_vllm=use_vllm, grad_accum=3, training=training, mcl=t + 5, delta=delta, level=level,
                       bias_correction=True)
    g64, = torch.autograd.grad(want64, lp64)
    tol = TOLERANCES[data.dtype]
    # The KL term's gradient is ratio * (k3 + k3') = -ratio * d (d = ref - lp): float32 rounds the two terms (each
    # ~ ratio e^|d|), so its error is theirs, (|k3| + |k3'|) / |d| times the result's own (~58x at the |d| = 5 kept
    # here). TRL's float32 may be luckier at a token than ours: the bound carries that factor.
    d = peer.ref.double() - peer.lp.double()
    amplification = torch.where(d.abs() > 1e-3, ((d.exp() - d - 1).abs() + (1 - d.exp()).abs())
                                / d.abs().clamp_min(1e-3), torch.ones_like(d)).clamp_min(1.0)
    bound = (4 * tol.atol * (g64.abs().max().item() + 1e-3) + 4 * tol.rtol * amplification * g64.abs()
             + 2 * (g_want.double() - g64).abs())
    err = (g_got.double() - g64).abs()
    assert (err <= bound).all(), f"d loss / d per_token_logps: {g_got} vs {g64} (TRL's float32: {g_want}; bound {bound})"


def test_options_not_fused_say_so():
    lp, adv, mask = -torch.rand(2, 3), torch.randn(2), torch.ones(2, 3, dtype=torch.bool)
    for kw, match in ((dict(delta=1.1), "delta=1.1 below 1 \\+ epsilon_high"),
                      (dict(importance_sampling_level="sequence", advantages=torch.randn(2, 3)), "per-token advantages"),
                      (dict(beta=0.1, ref_per_token_logps=lp, importance_sampling_level="sequence"),
                       "use_bias_correction_kl"),
                      (dict(loss_type="sapo"), "sapo")):
        with pytest.raises(NotImplementedError, match=match):
            kt.grpo_loss(lp, kw.pop("advantages", adv), mask, num_items_in_batch=6, **kw)


def test_the_shim_imports_without_trl():
    assert printed_without("trl", "from kl_kernels.integrations import trl as kt\nimport torch\nprint(kt.grpo_loss("
                           "torch.zeros(1, 2), torch.ones(1), torch.ones(1, 2), num_items_in_batch=2).item())") == ["-1.0"]


def test_the_switch_imports_without_trl_and_needs_it_when_used():
    """``from kl_kernels.integrations.trl import patch`` works without TRL (GRPOTrainer is made on first access);
    asking for GRPOTrainer then raises TRL's ImportError."""
    code = ("from kl_kernels.integrations.trl import patch, TRLFallbackWarning\n"
            "import kl_kernels.integrations.trl as kt\n"
            "try:\n    kt.GRPOTrainer\nexcept ImportError as e:\n    print(type(e).__name__, e.name)")
    assert printed_without("trl", code) == ["ModuleNotFoundError", "trl"]


def _masks_batch(seed: int, b: int = 6, t: int = 12):
    """float32 [B, T] inputs with an empty row, off-policy old log-probs and positive entropies (with gradient)."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(b, t, generator=g) < 0.8
    mask[1] = False  # an empty sequence
    lp = -torch.rand(b, t, generator=g) * 4
    old = lp + torch.randn(b, t, generator=g) * 0.3
    ref = lp + torch.randn(b, t, generator=g) * 0.2
    adv = torch.randn(b, generator=g)
    ent = torch.rand(b, t, generator=g) * 5
    high = (torch.rand(b, t, generator=g) < 0.5) & mask  # a high-entropy mask, as TRL's get_high_entropy_mask's
    return lp, old, ref, adv, ent, high, mask


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "bnpo", "dr_grpo", "luspo"])
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("case", ["entropy-mask+off-policy", "entropy-bonus+off-policy", "entropy-bonus"])
@pytest.mark.parametrize("seed", [0, 1])
def test_token_weights_and_entropy_bonus_equal_trls(loss_type, level, case, seed):
    """The switch's use of grpo_loss: TRL's high-entropy mask and off-policy sequence mask as token_weights, the
    entropy bonus as entropy/entropy_coef, against TRL's _compute_loss with those options (loss, and gradients to
    the log-probs and the entropies)."""
    grpo = peers.trl_grpo_module()
    lp, old, ref, adv, ent, high, mask = _masks_batch(seed)
    b, t = mask.shape
    beta = 0.04 if level == "token" else 0.0  # (bias-corrected KL at sequence level: TRL's path)
    masked, bonus = "entropy-mask" in case, "bonus" in case
    threshold = 0.05 if "off-policy" in case else None
    coef = 0.01 if bonus else 0.0
    n_items = torch.tensor(float(mask.sum()) * 3)
    lp_want, ent_want = lp.clone().requires_grad_(), ent.clone().requires_grad_()
    metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
    fake = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda model, *a, **k: (lp_want, ent_want, None),
        get_high_entropy_mask=lambda entropies, m, thr: high, get_off_policy_mask=grpo.GRPOTrainer.get_off_policy_mask,
        aux_loss_enabled=False, top_entropy_quantile=0.5 if masked else 1.0, off_policy_mask_threshold=threshold,
        importance_sampling_level=level, beta=beta, loss_type=loss_type, epsilon_low=0.2, epsilon_high=0.28,
        use_vllm=False, vllm_importance_sampling_correction=True, model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=3, max_completion_length=t + 5, _entropy_bonus_enabled=bonus,
        use_adaptive_entropy=False, entropy_coef=coef, _metrics=metrics,
        accelerator=SimpleNamespace(num_processes=2, gather=lambda x: x, reduce=lambda x, reduction="sum": x,
                                    sync_gradients=True),
        args=SimpleNamespace(use_bias_correction_kl=True, delta=None, steps_per_generation=2))
    inputs = dict(prompt_ids=torch.zeros(b, 1, dtype=torch.long), prompt_mask=torch.ones(b, 1, dtype=torch.long),
                  completion_ids=torch.zeros(b, t, dtype=torch.long), completion_mask=mask.long(), advantages=adv,
                  old_per_token_logps=old, ref_per_token_logps=ref, num_items_in_batch=n_items)
    want = grpo.GRPOTrainer._compute_loss(fake, None, inputs)
    weights = high.float() if masked else None
    if threshold is not None:  # what the switch does: TRL's own function, its [B, 1] mask as a weight
        keep = grpo.GRPOTrainer.get_off_policy_mask(adv.unsqueeze(1), lp, old, mask.long(), threshold).float()
        weights = keep if weights is None else weights * keep
    lp_got, ent_got = lp.clone().requires_grad_(), ent.clone().requires_grad_()
    got, out = kt.grpo_loss(lp_got, adv, mask, old_per_token_logps=old, ref_per_token_logps=ref, loss_type=loss_type,
                            beta=beta, epsilon_low=0.2, epsilon_high=0.28, importance_sampling_level=level,
                            max_completion_length=t + 5, num_items_in_batch=n_items, num_processes=2,
                            gradient_accumulation_steps=3, steps_per_generation=2, token_weights=weights,
                            entropy=ent_got, entropy_coef=coef, return_output=True)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    g_got = torch.autograd.grad(got, [lp_got, ent_got], allow_unused=True)
    g_want = torch.autograd.grad(want, [lp_want, ent_want], allow_unused=True)
    for name, x, y in zip(("per_token_logps", "entropies"), g_got, g_want):
        x = torch.zeros_like(lp) if x is None else x
        y = torch.zeros_like(lp) if y is None else y
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6 * (y.abs().max().item() + 1e-3), msg=name)
    # TRL's entropy metric (a masked token mean) from the call's by-product
    assert math.isclose(out.entropy_mean.item(), metrics["train"]["entropy"][0], rel_tol=1e-5)


def test_the_docs_option_table_names_every_option_the_switch_reads():
    """python_api/integrations.md's TRL option table and kl_kernels.integrations.trl.options say the same: each
    option the switch reads (or leaves to the loss types that are TRL's path) is named in the docs' table."""
    from conftest import REPO
    from kl_kernels.integrations.trl import options

    text = (REPO / "python_api" / "integrations.md").read_text()
    section = text[text.index("## TRL (1.16.0)"):]
    section = section[:section.index("\n## ", 1)]
    for name in list(options.FUSED) + list(options.TRL_LOSS_ONLY):
        assert f"`{name}`" in section, f"GRPOConfig.{name} is read by the switch but not in the docs' TRL table"


def _trainer_pair(grpo, loss_type, level, beta, bonus, adaptive, lp, ent, high):
    """Two stand-ins of one TRL trainer (TRL's _compute_loss reads one, the switch's the other), with an accelerator
    that plays a second process: reduce adds 1 to every entry of the stacked totals, gather appends the values
    plus 0.25 (so a total or a gather that the switch forgot, or built in another order, shows)."""
    from kl_kernels.integrations.trl.options import Plan

    def reduce(x, reduction="sum"):
        return x + 1.0

    def gather(x):
        x = x.reshape(-1)
        return torch.cat([x, x + 0.25])

    def make(lp_, ent_):
        return SimpleNamespace(
            _get_per_token_logps_and_entropies=lambda model, *a, **k: (lp_, ent_, None),
            get_high_entropy_mask=lambda entropies, m, thr: high, get_off_policy_mask=grpo.GRPOTrainer.get_off_policy_mask,
            aux_loss_enabled=False, top_entropy_quantile=1.0, off_policy_mask_threshold=None,
            importance_sampling_level=level, beta=beta, loss_type=loss_type, epsilon_low=0.2, epsilon_high=0.28,
            use_vllm=False, vllm_importance_sampling_correction=True, model=SimpleNamespace(training=True),
            current_gradient_accumulation_steps=3, max_completion_length=lp.shape[1] + 5,
            _entropy_bonus_enabled=bonus, use_adaptive_entropy=adaptive, entropy_coef=0.01 if bonus else 0.0,
            _last_world_entropy=float("inf") if not adaptive else 1.0, _entropy_window_stats=None,
            _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
            accelerator=SimpleNamespace(num_processes=2, gather=gather, gather_for_metrics=gather, reduce=reduce,
                                        sync_gradients=True),
            args=SimpleNamespace(use_bias_correction_kl=True, delta=None, steps_per_generation=2, entropy_target=3.0,
                                 entropy_coef_delta=0.005, entropy_coef_min=0.0, entropy_coef_max=1.0))

    lp_t, ent_t = lp.clone().requires_grad_(), ent.clone().requires_grad_()
    lp_o, ent_o = lp.clone().requires_grad_(), ent.clone().requires_grad_()
    theirs, ours = make(lp_t, ent_t), make(lp_o, ent_o)
    ours._kl_kernels_plan = Plan(
        loss_type=loss_type, beta=beta, epsilon_low=0.2, epsilon_high=0.28, delta=None, importance_sampling_level=level,
        use_bias_correction_kl=True, vllm_ratio=False, top_entropy_quantile=1.0, off_policy_mask_threshold=None,
        entropy_bonus=bonus, adaptive_entropy=adaptive, aux_loss=False, router_aux_loss_coef=0.0,
        max_completion_length=lp.shape[1] + 5, steps_per_generation=2)
    return theirs, ours, (lp_t, ent_t), (lp_o, ent_o)


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "luspo"])
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("bonus", ["none", "static", "adaptive"])
def test_the_switch_logs_trls_metrics(loss_type, level, bonus):
    """The switch's _compute_loss against TRL's on the same stand-in trainer (two processes played by the
    accelerator): the loss, its gradients, every metric TRL logs (kl, entropy, clip_ratio/*, policy_loss,
    entropy_coef) and the adaptive controller's state after the optimizer-step boundary."""
    from kl_kernels.integrations.trl.trainer import _fused_compute_loss

    grpo = peers.trl_grpo_module()
    lp, old, ref, adv, ent, high, mask = _masks_batch(3, b=8, t=10)
    old = lp + (old - lp) * 2  # ratios far enough from 1 to clip both ways
    beta = 0.04 if level == "token" else 0.0
    theirs, ours, (lp_t, ent_t), (lp_o, ent_o) = _trainer_pair(
        grpo, loss_type, level, beta, bonus != "none", bonus == "adaptive", lp, ent, high)
    b, t = mask.shape
    inputs = dict(prompt_ids=torch.zeros(b, 1, dtype=torch.long), prompt_mask=torch.ones(b, 1, dtype=torch.long),
                  completion_ids=torch.zeros(b, t, dtype=torch.long), completion_mask=mask.long(), advantages=adv,
                  old_per_token_logps=old, ref_per_token_logps=ref,
                  num_items_in_batch=torch.tensor(float(mask.sum()) * 3))
    want = grpo.GRPOTrainer._compute_loss(theirs, None, inputs)
    got = _fused_compute_loss(ours, None, inputs)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    for x, y in zip(torch.autograd.grad(got, [lp_o, ent_o], allow_unused=True),
                    torch.autograd.grad(want, [lp_t, ent_t], allow_unused=True)):
        x = torch.zeros_like(lp) if x is None else x
        y = torch.zeros_like(lp) if y is None else y
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6 * (y.abs().max().item() + 1e-3))
    m_want, m_got = theirs._metrics["train"], ours._metrics["train"]
    assert m_got.keys() == m_want.keys()
    assert m_want["clip_ratio/low_mean"][0] > 0.01 or m_want["clip_ratio/high_mean"][0] > 0.01
    for k in m_want:
        assert len(m_got[k]) == len(m_want[k]) == 1, k
        assert math.isclose(m_got[k][0], m_want[k][0], rel_tol=1e-5, abs_tol=1e-7), (k, m_got[k], m_want[k])
    assert ours.entropy_coef == theirs.entropy_coef and ours._entropy_window_stats is theirs._entropy_window_stats
    assert math.isclose(ours._last_world_entropy, theirs._last_world_entropy, rel_tol=1e-6)
