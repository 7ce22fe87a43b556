"""kl_penalty_loss' diagnostics for TRL's metrics (issue 62 item 3): the clip flags split by the
advantage's sign (``clip_low_fraction``, ``clip_high_fraction``, ``seq_clipped_low``,
``seq_clipped_high``), the per-sequence counts (``seq_num_tokens``) and the entropy's mean
(``entropy_mean``, 0 without entropy), on every backend that runs here, against TRL 1.16's own formulas
(``GRPOTrainer._compute_loss``'s metrics, written out in float64 torch ops below). The oracle matrices
(tests/loss_batches.py ``check_diagnostics``) check the same fields on random batches of every layout,
dtype and option.
"""

from __future__ import annotations

import math

import pytest
import torch

from conftest import CUDA_EMULATED, backend_device
from kl_kernels import kl_penalty_loss
from kl_kernels.kl_penalty import aggregate, launch, reference

BACKENDS = ["torch", "cpu", CUDA_EMULATED, pytest.param("triton", marks=pytest.mark.triton)]
EPS_LO, EPS_HI = 0.2, 0.28


def test_the_stats_layout_is_one_table():
    """The per-sequence stats, the totals and the results: reference.STAT_COLUMNS and
    aggregate.RESULT_FIELDS, which the launchers size their buffers by, and the kernels' constants
    (csrc/common/kl_penalty_args.h), which the extensions export."""
    assert reference.STAT_COLUMNS[-2:] == ("clipped_low", "clipped_high")
    assert launch.STATS == len(reference.STAT_COLUMNS) and launch.TOTALS == launch.STATS + 2
    assert launch.RESULTS == len(aggregate.RESULT_FIELDS)
    fields = aggregate.KLPenaltyLossOutput._fields
    assert fields[:8] == ("loss", "loss_objective", "loss_kl", "loss_entropy", "kl_mean", "ratio_mean",
                          "clip_fraction", "num_tokens"), "the existing fields keep their positions"
    assert all(f in fields for f in aggregate.RESULT_FIELDS)
    import importlib

    seen = 0
    for name in ("kl_kernels._C", "kl_kernels._cuda_emu", "kl_kernels._cuda"):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        seen += 1
        assert module.KL_PENALTY_STAT_COLUMNS == launch.STATS, name
        assert module.KL_PENALTY_TOTALS == launch.TOTALS, name
        assert module.KL_PENALTY_RESULTS == launch.RESULTS, name
    assert seen, "no extension built"
    pytest.importorskip("triton")
    from kl_kernels.triton import kl_penalty as tk

    assert tk.STATS.value == launch.STATS


def _batch(seed=0, B=7, T=11):
    """A padded (right) TRL-like micro-batch: per-sequence advantages of both signs and 0, ratios far
    from the clip bounds (so float32 and float64 flags agree), an empty sequence and a 1-token one."""
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    # (a shift per sequence: GSPO's sequence ratios clip too)
    step = torch.randn(B, T, generator=g, dtype=torch.float64) * 0.3 + torch.randn(B, 1, generator=g,
                                                                                  dtype=torch.float64) * 0.4
    lr = torch.where(torch.rand(B, T, generator=g) < 0.2, torch.zeros_like(step), step)
    # keep |ratio - bound| >= 1e-3 for both bounds
    for bound in (math.log(1 - EPS_LO), math.log(1 + EPS_HI)):
        near = (lr - bound).abs() < 2e-3
        lr = torch.where(near, lr + 5e-3, lr)
    old = lp - lr
    ref = lp + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.3
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    adv[2] = 0.0
    ent = torch.rand(B, T, generator=g, dtype=torch.float64) * 2
    lengths = torch.randint(2, T + 1, (B,), generator=g)
    lengths[0], lengths[1] = 0, 1
    mask = (torch.arange(T)[None, :] < lengths[:, None]) & (torch.rand(B, T, generator=g) < 0.85)
    mask[1, 0] = True
    return dict(lp=lp, old=old, ref=ref, adv=adv, ent=ent, mask=mask)


def _trl_metrics(b, level, bias_correction):
    """TRL 1.16 GRPOTrainer._compute_loss's logged metrics (kl, entropy, clip_ratio/*), float64, written
    as its code computes them (masked means; at sequence level one value per sequence, over all B)."""
    f = {k: (v.to(torch.float32).to(torch.float64) if v.dtype == torch.float64 else v) for k, v in b.items()}
    mask = f["mask"].to(torch.float64)
    per_token_logps, old, ref, ent = f["lp"], f["old"], f["ref"], f["ent"]
    advantages = f["adv"].unsqueeze(1)
    log_ratio = per_token_logps - old
    if level == "token":
        log_importance_weights = log_ratio
    else:
        log_importance_weights = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    coef_1 = torch.exp(log_importance_weights)
    per_token_kl = torch.exp(ref - per_token_logps) - (ref - per_token_logps) - 1
    if bias_correction:
        per_token_kl = per_token_kl * coef_1

    def masked_seq_mean(x):
        if x.shape[1] == 1:
            return x.squeeze(1)
        return (x * mask).sum(-1) / mask.sum(-1)

    def global_masked_mean(x):
        if x.shape[1] == 1:
            return float(x.sum() / max(x.shape[0], 1))
        return float((x * mask).sum() / mask.sum().clamp(min=1.0))

    is_low = ((coef_1 < 1 - EPS_LO) & (advantages < 0)).to(torch.float64)
    is_high = ((coef_1 > 1 + EPS_HI) & (advantages > 0)).to(torch.float64)
    return dict(kl=global_masked_mean(per_token_kl), entropy=global_masked_mean(ent),
                low_mean=global_masked_mean(is_low), high_mean=global_masked_mean(is_high),
                region_mean=global_masked_mean(((is_low + is_high) > 0).to(torch.float64)),
                low_min=float(torch.nan_to_num(masked_seq_mean(is_low), nan=math.inf).min()),
                high_max=float(torch.nan_to_num(masked_seq_mean(is_high), nan=-math.inf).max()))


def _ours(out, level):
    """TRL's metrics from one fused call's outputs (what kl_kernels.integrations.trl logs)."""
    n_b, low_b, high_b = out.seq_num_tokens.double(), out.seq_clipped_low.double(), out.seq_clipped_high.double()
    if level == "token":
        n = n_b.sum().clamp(min=1.0)
        low_seq, high_seq = low_b / n_b, high_b / n_b  # NaN for an empty sequence (0 / 0), as TRL's
        means = dict(low_mean=float(low_b.sum() / n), high_mean=float(high_b.sum() / n),
                     region_mean=float((low_b + high_b).sum() / n))
    else:  # one flag per sequence, over all B (an empty sequence: ratio exp(0) = 1, not clipped)
        low_seq, high_seq = (low_b > 0).double(), (high_b > 0).double()
        B = max(len(n_b), 1)
        means = dict(low_mean=float(low_seq.sum() / B), high_mean=float(high_seq.sum() / B),
                     region_mean=float(((low_seq + high_seq) > 0).double().sum() / B))
    return dict(means, kl=float(out.kl_mean), entropy=float(out.entropy_mean),
                low_min=float(torch.nan_to_num(low_seq, nan=math.inf).min()),
                high_max=float(torch.nan_to_num(high_seq, nan=-math.inf).max()))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("bias_correction", [False, True])
@pytest.mark.parametrize("aggregation", ["seq-mean-token-mean", "token-mean"])
def test_trl_metrics_from_one_call(backend, level, bias_correction, aggregation):
    b = _batch(seed=13)
    dev = backend_device(backend)
    f32 = {k: (v.to(torch.float32) if v.dtype == torch.float64 else v).to(dev) for k, v in b.items()}
    lp = f32["lp"].clone().requires_grad_()
    out = kl_penalty_loss(lp, f32["old"], f32["adv"], ref_log_probs=f32["ref"], beta=0.04, estimator="k3",
                          mask=f32["mask"], padding_side="right", clip_epsilon=(EPS_LO, EPS_HI), entropy=f32["ent"],
                          aggregation=aggregation, importance_sampling_level=level, kl_times_ratio=bias_correction,
                          backend=backend)
    out.loss.backward()
    want, got = _trl_metrics(b, level, bias_correction), _ours(out, level)
    assert got["low_mean"] > 0 and got["high_mean"] > 0, "the batch clips both ways"
    for name in ("low_mean", "high_mean", "region_mean", "low_min", "high_max"):
        assert got[name] == pytest.approx(want[name], rel=1e-12, abs=1e-12), name
    assert got["kl"] == pytest.approx(want["kl"], rel=2e-6, abs=1e-7)
    assert got["entropy"] == pytest.approx(want["entropy"], rel=2e-6, abs=1e-7)
    # the token fractions of the output itself
    n = float(out.num_tokens)
    assert float(out.clip_low_fraction) == pytest.approx(float(out.seq_clipped_low.sum()) / n, rel=1e-6)
    assert float(out.clip_high_fraction) == pytest.approx(float(out.seq_clipped_high.sum()) / n, rel=1e-6)
    # the kernels' clipped flag is low | high here (no NaN)
    assert float(out.clip_fraction) == pytest.approx(float(out.clip_low_fraction + out.clip_high_fraction), rel=1e-6)
    assert out.seq_num_tokens.tolist() == b["mask"].sum(1).double().tolist()


@pytest.mark.parametrize("backend", BACKENDS)
def test_entropy_mean_whatever_the_coefficient_and_zero_without(backend):
    b = _batch()
    dev = backend_device(backend)
    f32 = {k: (v.to(torch.float32) if v.dtype == torch.float64 else v).to(dev) for k, v in b.items()}
    want = float((b["ent"] * b["mask"]).sum() / b["mask"].sum())
    kw = dict(mask=f32["mask"], padding_side="right", backend=backend)
    for coef in (0.0, 0.01):
        out = kl_penalty_loss(f32["lp"], f32["old"], f32["adv"], entropy=f32["ent"], entropy_coef=coef, **kw)
        assert float(out.entropy_mean) == pytest.approx(want, rel=2e-6)
    # the entropy term aggregated apart (run_split: the kernel runs without the entropy)
    out = kl_penalty_loss(f32["lp"], f32["old"], f32["adv"], entropy=f32["ent"], entropy_coef=0.01,
                          aggregation="seq-mean-token-mean", entropy_aggregation="token-mean", **kw)
    assert float(out.entropy_mean) == pytest.approx(want, rel=2e-6)
    out = kl_penalty_loss(f32["lp"], f32["old"], f32["adv"], **kw)
    assert float(out.entropy_mean) == 0.0
    assert float(out.clip_low_fraction) == 0.0 and float(out.clip_high_fraction) == 0.0  # no clip_epsilon
    assert not out.seq_clipped_low.any() and not out.seq_clipped_high.any()


@pytest.mark.parametrize("backend", BACKENDS)
def test_weights_do_not_change_the_flags(backend):
    """The flags read the ratio, never the weights (TRL's vLLM importance-sampling ratio multiplies the
    loss, not coef_1)."""
    b = _batch(seed=13)
    dev = backend_device(backend)
    f32 = {k: (v.to(torch.float32) if v.dtype == torch.float64 else v).to(dev) for k, v in b.items()}
    kw = dict(mask=f32["mask"], padding_side="right", clip_epsilon=(EPS_LO, EPS_HI), backend=backend)
    plain = kl_penalty_loss(f32["lp"], f32["old"], f32["adv"], **kw)
    weighted = kl_penalty_loss(f32["lp"], f32["old"], f32["adv"], weights=torch.rand_like(f32["lp"]) * 3, **kw)
    for name in ("seq_clipped_low", "seq_clipped_high", "seq_num_tokens"):
        assert torch.equal(getattr(plain, name), getattr(weighted, name)), name
    assert plain.seq_clipped_low.sum() > 0 and plain.seq_clipped_high.sum() > 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_per_token_output_and_lists_carry_the_sequence_fields(backend):
    """aggregation="none" and the list layout return the same per-sequence fields as a padded call."""
    b = _batch(seed=4)
    dev = backend_device(backend)
    f32 = {k: (v.to(torch.float32) if v.dtype == torch.float64 else v).to(dev) for k, v in b.items()}
    kw = dict(clip_epsilon=(EPS_LO, EPS_HI), entropy=f32["ent"], backend=backend)
    padded = kl_penalty_loss(f32["lp"], f32["old"], f32["adv"], mask=f32["mask"], padding_side="right", **kw)
    none = kl_penalty_loss(f32["lp"], f32["old"], f32["adv"], mask=f32["mask"], padding_side="right",
                           aggregation="none", **kw)
    for name in ("seq_num_tokens", "seq_clipped_low", "seq_clipped_high", "clip_low_fraction",
                 "clip_high_fraction", "entropy_mean"):
        torch.testing.assert_close(getattr(none, name), getattr(padded, name), rtol=1e-6, atol=0, msg=name)
