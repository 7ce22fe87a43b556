"""The switch inside TRL 1.16.0's real GRPOTrainer: ``kl_kernels.integrations.trl.GRPOTrainer`` and ``patch``.

Each case trains the tiny model of tests/trl_trainer_harness.py (2-layer Qwen2 from a config, a byte-level
tokenizer built in code, 4 prompts x 4 generations, a deterministic reward, 4 optimizer steps of 2 micro-batches,
steps 2 and 4 off-policy) twice: stock TRL, and the same configuration through the switch. One stock run per
configuration (cached for the module).

* A fused option: every metric TRL logs (loss, grad_norm, kl, entropy, clip_ratio/*, policy_loss, entropy_coef,
  aux_loss, the generation's own) and the gradient of every parameter just before each optimizer step agree
  within TOLERANCE (float32 sums in another order: the fused call sums tokens in its own order, and the
  difference grows through 3 optimizer steps), and the option is not inert (its stock gradients differ from
  the base configuration's).
* An option left to TRL: exactly one TRLFallbackWarning naming it, and TRL's numbers exactly (bitwise).

Needs transformers, accelerate, datasets and trl (the `.ci/lane-trl` lane): skipped without them, test by test.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings

import pytest
import torch

import trl_trainer_harness as harness


@pytest.fixture(autouse=True)
def _trl_stack():
    missing = harness.trl_stack_missing()
    if missing:
        pytest.skip(f"TRL's trainer stack is not installed ({missing} missing): the .ci/lane-trl lane runs these")


# Agreement of the switch with stock TRL over the 4 steps (float32). Metrics: |ours - TRL| <= 1e-5 |TRL| + 1e-6.
# Gradients: |ours - TRL| <= GRAD_RTOL * (the largest |TRL| gradient of that parameter), GRAD_RTOL 1e-5 (measured
# on the torch and Triton-interpreter backends: bitwise equal at step 1, <= 2.3e-6 at steps 2-4). GRAD_RTOL_AMPLIFIED
# 2e-4 where the run amplifies float32 rounding: with a static entropy bonus the step-1 gradients differ by ~1.5e-7
# (the bonus's mean summed in another order) and AdamW's first update, ~lr * sign(g), turns the rounding of
# near-zero entries into weight differences of ~lr (measured 4.9e-5 at steps 2-4); a MoE model's top-2 routing
# turns step-2 weight differences of ~1e-7 into another expert for a token now and then (measured 2.8e-5).
TOLERANCE = dict(rtol=1e-5, atol=1e-6)
GRAD_RTOL, GRAD_RTOL_AMPLIFIED = 1e-5, 2e-4
# Logged by TRL but not by the loss: identical by construction, except the wall time
NOT_COMPARED = ("step_time",)

FUSED = {
    "dapo": {},  # TRL's default loss type; beta 0.04 with the bias-corrected KL (TRL's default)
    "grpo": dict(loss_type="grpo"),
    "bnpo": dict(loss_type="bnpo"),
    "dr_grpo": dict(loss_type="dr_grpo"),
    "no-bias-correction": dict(use_bias_correction_kl=False),
    "beta0": dict(beta=0.0),
    "delta": dict(delta=1.5),
    "gspo-grpo": dict(loss_type="grpo", importance_sampling_level="sequence", beta=0.0),
    "gspo-luspo": dict(loss_type="luspo", importance_sampling_level="sequence", use_bias_correction_kl=False),
    "top-entropy": dict(top_entropy_quantile=0.5),
    "off-policy-mask": dict(off_policy_mask_threshold=1e-4),
    "entropy-coef": dict(entropy_coef=0.01, loss_type="grpo"),
    "entropy-coef-dapo": dict(entropy_coef=0.01),
    "adaptive-entropy": dict(use_adaptive_entropy=True, entropy_coef=0.01, entropy_target=10.0,
                             entropy_coef_delta=0.02),
    "epsilon": dict(epsilon=0.1, epsilon_high=0.1, loss_type="bnpo"),
    "moe-aux-loss": dict(model="qwen2-moe"),  # the model's router_aux_loss_coef (0.01): TRL's aux_loss
}

# (overrides, what the warning names)
FALLBACK = {
    "cispo": (dict(loss_type="cispo"), "loss_type='cispo'"),
    "sapo": (dict(loss_type="sapo"), "loss_type='sapo'"),
    "vespo": (dict(loss_type="vespo"), "loss_type='vespo'"),
    "delta-below": (dict(delta=1.1), "delta=1.1"),
    # the dual clip still, but TRL counts high clips after capping the ratio at delta: never, at 1 + epsilon_high
    "delta-at-1+epsilon_high": (dict(delta=1.28), "delta=1.28 equal to 1 + epsilon_high"),
    "gspo-bias-corrected-kl": (dict(loss_type="luspo", importance_sampling_level="sequence"),
                               "use_bias_correction_kl=True with beta != 0 and importance_sampling_level='sequence'"),
    "entropy-coef-with-top-entropy": (dict(entropy_coef=0.01, top_entropy_quantile=0.5), "top_entropy_quantile=0.5"),
}


@functools.cache
def _stock(name: str, overrides: tuple) -> harness.Run:
    return _run(dict(overrides))


def _run(overrides: dict, **kw) -> harness.Run:
    """``overrides``' "model" (a harness.MODELS name) picks the model; the rest are GRPOConfig fields."""
    overrides = dict(overrides)
    factory = harness.MODELS[overrides.pop("model", "qwen2")]
    return harness.run(overrides, model_factory=factory, **kw)


def _key(overrides: dict) -> tuple:
    return tuple(sorted(overrides.items()))


def _ours(overrides: dict, **kw) -> harness.Run:
    from kl_kernels.integrations.trl import GRPOTrainer

    return _run(overrides, trainer_cls=GRPOTrainer, **kw)


def _close(got: float, want: float) -> bool:
    if want is None or got is None:
        return got is want
    if math.isnan(want):
        return math.isnan(got)
    return abs(got - want) <= TOLERANCE["rtol"] * abs(want) + TOLERANCE["atol"]


def _compare(ours: harness.Run, stock: harness.Run, grad_rtol: float = GRAD_RTOL) -> dict:
    """Assert agreement; return the largest differences seen (reported by the lane)."""
    assert len(ours.logs) == len(stock.logs) == 4 and len(ours.grads) == len(stock.grads) == 4
    worst = {}
    for step, (got, want) in enumerate(zip(ours.logs, stock.logs)):
        assert got.keys() == want.keys(), f"step {step}: logged {sorted(got.keys() ^ want.keys())} differently"
        for k in want:
            if k in NOT_COMPARED or not isinstance(want[k], (int, float)):
                continue
            assert _close(got[k], want[k]), f"step {step + 1} {k}: ours {got[k]!r}, TRL {want[k]!r}"
            if want[k] is not None and not math.isnan(want[k]):
                worst[k] = max(worst.get(k, 0.0), abs(got[k] - want[k]))
    for step, (got, want) in enumerate(zip(ours.grads, stock.grads)):
        assert got.keys() == want.keys()
        for name in want:
            g, w = got[name], want[name]
            scale = w.abs().max().item()
            err = (g - w).abs()
            bound = grad_rtol * scale
            assert (err <= bound).all(), (f"step {step + 1} grad of {name}: max |ours - TRL| = {err.max().item():.3g} "
                                          f"(|TRL| max {scale:.3g})")
            rel = err.max().item() / scale if scale else err.max().item()
            worst[f"grad(step {step + 1}) rel"] = max(worst.get(f"grad(step {step + 1}) rel", 0.0), rel)
    return worst


def _differs(a: harness.Run, b: harness.Run) -> bool:
    return any(not torch.equal(x[n], y[n]) for x, y in zip(a.grads, b.grads) for n in x)


@pytest.mark.parametrize("name", list(FUSED))
def test_fused_option_matches_stock_trl(name, record_property):
    overrides = FUSED[name]
    stock = _stock(name, _key(overrides))
    ours = _ours(overrides)
    assert ours.trainer._kl_kernels_plan is not None, "the switch did not fuse this configuration"
    if "model" in overrides:
        assert ours.trainer._kl_kernels_plan.aux_loss and "aux_loss" in stock.logs[0]
    assert not ours.warnings, [str(w.message) for w in ours.warnings]
    amplified = (overrides.get("entropy_coef", 0.0) != 0.0 and not overrides.get("use_adaptive_entropy")
                 or overrides.get("model") == "qwen2-moe")
    worst = _compare(ours, stock, GRAD_RTOL_AMPLIFIED if amplified else GRAD_RTOL)
    record_property("max_abs_diff", worst)
    print(f"\n[{name}] largest |ours - TRL|: " + ", ".join(f"{k} {v:.2g}" for k, v in sorted(worst.items())))
    if overrides:  # the option acts: its stock gradients are not the base configuration's
        assert _differs(stock, _stock("dapo", _key(FUSED["dapo"]))), f"{name}: the option changes nothing here"


@pytest.mark.parametrize("overrides", [dict(loss_type="grpo"), dict(loss_type="dapo", entropy_coef=0.01)],
                         ids=["grpo", "dapo-entropy-coef"])
def test_evaluation_matches_stock_trl(overrides):
    """trainer.evaluate(): TRL's prediction_step calls the loss in eval mode (no gradient-accumulation divisor, dapo's
    normaliser without the accumulation window, metrics under eval_)."""
    stock = harness.run(overrides, evaluate=True)
    ours = _ours(overrides, evaluate=True)
    assert ours.trainer._kl_kernels_plan is not None
    assert stock.evaluation.keys() == ours.evaluation.keys() and "eval_loss" in stock.evaluation
    for k, want in stock.evaluation.items():
        if k not in ("eval_runtime", "eval_samples_per_second", "eval_steps_per_second", "eval_step_time"):
            # after 4 steps trained from gradients that agree to ~1e-6 (2e-4 with the bonus), the weights differ
            assert _close(ours.evaluation[k], want) or abs(ours.evaluation[k] - want) <= 1e-4 * max(1.0, abs(want)), (
                k, ours.evaluation[k], want)


# Two processes (accelerate's multi-CPU over gloo, per-process batch 2: the same 4 prompts x 4 generations a step):
# dapo's normaliser divides by the process count, the metrics are reduced and gathered, TRL's high-entropy mask
# gathers the entropies of both processes, and sequence-level clip counts are gathered per sequence
DISTRIBUTED = [dict(per_device_train_batch_size=2), dict(per_device_train_batch_size=2, top_entropy_quantile=0.5),
               dict(per_device_train_batch_size=2, loss_type="grpo", importance_sampling_level="sequence", beta=0.0)]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_match_stock_trl(tmp_path):
    import json
    import os
    import subprocess
    import sys

    out = tmp_path / "results.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        [str(harness.REPO), os.environ.get("PYTHONPATH", "")]))
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                          "--master_port", str(_free_port()), str(harness.REPO / "tests" / "trl_trainer_harness.py"), str(out),
                          json.dumps(DISTRIBUTED)], capture_output=True, text=True, timeout=600, cwd=harness.REPO,
                         env=env)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    for r in json.loads(out.read_text()):
        assert r["fused"] and r["processes"] == 2 and r["steps"] == 4, r["overrides"]
        assert r["grad_rel"] <= GRAD_RTOL, (r["overrides"], r["grad_rel"])
        for step, (got, want) in enumerate(zip(r["ours"], r["stock"], strict=True)):
            assert got.keys() == want.keys()
            for k in want:
                if k not in NOT_COMPARED and isinstance(want[k], (int, float)):
                    assert _close(got[k], want[k]), (r["overrides"], step + 1, k, got[k], want[k])
        print(f"\n[2 processes {r['overrides']}] gradients within {r['grad_rel']:.2g} of each parameter's largest")


def test_the_run_clips_and_goes_off_policy():
    """The base configuration exercises what the comparisons need: ratios off 1 (steps 2 and 4) and clipping."""
    logs = _stock("dapo", _key(FUSED["dapo"])).logs
    assert logs[1]["clip_ratio/region_mean"] > 0 or logs[3]["clip_ratio/region_mean"] > 0
    assert all(log["kl"] > 0 for log in logs[1:])


@pytest.mark.parametrize("name", list(FALLBACK))
def test_option_left_to_trl_warns_once_and_is_trls(name):
    overrides, named = FALLBACK[name]
    stock = _stock(name, _key(overrides))
    ours = _ours(overrides)
    assert ours.trainer._kl_kernels_plan is None
    assert len(ours.warnings) == 1 and named in str(ours.warnings[0].message), [str(w.message) for w in ours.warnings]
    _assert_identical(ours, stock)


def _assert_identical(ours, stock):
    for got, want in zip(ours.logs, stock.logs, strict=True):
        assert {k: v for k, v in got.items() if k not in NOT_COMPARED} == {
            k: v for k, v in want.items() if k not in NOT_COMPARED}
    for got, want in zip(ours.grads, stock.grads, strict=True):
        assert all(torch.equal(got[n], want[n]) for n in want)


def test_patch_on_a_constructed_trainer_and_a_subclass():
    """``patch(trainer)`` on TRL's own trainer fuses as the class does; a subclass's own _compute_loss is kept, with
    the warning naming it."""
    import trl

    from kl_kernels.integrations.trl import TRLFallbackWarning, patch

    stock = _stock("dapo", _key(FUSED["dapo"]))
    ours = harness.run({}, patch=patch)
    assert ours.trainer._kl_kernels_plan is not None and not ours.warnings
    _compare(ours, stock)
    # patching again changes nothing, and warns nothing; the LM-head opt-in is still honoured then
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert patch(ours.trainer) is ours.trainer
    assert not [w for w in caught if "kl_kernels" in str(w.message)]
    assert not getattr(ours.trainer.model, "_kl_kernels_lm_head", None)
    patch(ours.trainer, lm_head="kl_kernels")
    assert ours.trainer.model._kl_kernels_lm_head

    class Mine(trl.GRPOTrainer):
        def _compute_loss(self, model, inputs):
            return super()._compute_loss(model, inputs)

    mine = harness.run({}, trainer_cls=Mine, patch=patch)
    assert mine.trainer._kl_kernels_plan is None
    assert len(mine.warnings) == 1 and "Mine._compute_loss" in str(mine.warnings[0].message)
    assert mine.warnings[0].category is TRLFallbackWarning
    _assert_identical(mine, stock)


def test_tool_mask_matches_stock_trl():
    """TRL's tool mask (tokens a tool wrote, out of the loss: ``completion_mask * tool_mask`` masks every term,
    normaliser and metric). Tools need a chat model here; a subclass marks completion tokens 2-4 as a tool's,
    as TRL's tool loop returns ``tool_mask``, and ``patch`` is applied to it (a subclass of TRL's trainer)."""
    import trl

    from kl_kernels.integrations.trl import patch

    class WithToolTokens(trl.GRPOTrainer):
        def _generate_and_score_completions(self, inputs):
            out = super()._generate_and_score_completions(inputs)
            tool_mask = torch.ones_like(out["completion_mask"])
            tool_mask[:, 2:5] = 0
            out["tool_mask"] = tool_mask
            return out

    stock = harness.run({}, trainer_cls=WithToolTokens)
    ours = harness.run({}, trainer_cls=WithToolTokens, patch=patch)
    assert ours.trainer._kl_kernels_plan is not None and not ours.warnings
    _compare(ours, stock)
    assert _differs(stock, _stock("dapo", _key(FUSED["dapo"])))


def test_an_option_kl_kernels_does_not_know_goes_to_trl():
    """A GRPOConfig field outside kl_kernels' table (a later TRL's option; here a subclass's) set away from its
    default: TRL's loss, one warning naming it. At its default it changes nothing and the loss is fused."""
    from trl import GRPOConfig

    from kl_kernels.integrations.trl import GRPOTrainer
    from kl_kernels.integrations.trl.options import unknown_options

    @dataclasses.dataclass
    class LaterConfig(GRPOConfig):
        new_loss_knob: float = 0.0

    base = dict(harness.BASE, output_dir="/tmp/unused")
    assert unknown_options(LaterConfig(**base)) == []
    assert unknown_options(LaterConfig(**base, new_loss_knob=0.5)) == ["new_loss_knob=0.5"]
    assert unknown_options(GRPOConfig(**base)) == []  # TRL 1.16's own fields: all in the table
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = _construct(GRPOTrainer, LaterConfig(**base, new_loss_knob=0.5))
    ours = [w for w in caught if "kl_kernels" in str(w.message)]
    assert trainer._kl_kernels_plan is None and len(ours) == 1 and "new_loss_knob=0.5" in str(ours[0].message)


def test_another_trl_version_goes_to_trl(monkeypatch):
    """The option table is TRL 1.16's: under another TRL version the trainer keeps TRL's loss, saying so."""
    import trl
    from trl import GRPOConfig

    from kl_kernels.integrations.trl import GRPOTrainer

    monkeypatch.setattr(trl, "__version__", "1.17.0")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = _construct(GRPOTrainer, GRPOConfig(**dict(harness.BASE, output_dir="/tmp/unused")))
    ours = [w for w in caught if "kl_kernels" in str(w.message)]
    assert trainer._kl_kernels_plan is None and len(ours) == 1 and "TRL 1.17.0" in str(ours[0].message)


def _construct(cls, args):
    import tempfile

    tok = harness.tokenizer()
    with tempfile.TemporaryDirectory() as tmp:
        harness.model(tok).save_pretrained(tmp)
        return cls(model=tmp, reward_funcs=harness.reward, args=args, train_dataset=harness.dataset(),
                   processing_class=tok)


def test_every_grpo_config_field_is_in_the_table():
    """TRL 1.16's GRPOConfig fields (those it adds to TrainingArguments) are each in exactly one table."""
    from transformers import TrainingArguments
    from trl import GRPOConfig

    from kl_kernels.integrations.trl import options

    base = {f.name for f in dataclasses.fields(TrainingArguments)}
    own = {f.name for f in dataclasses.fields(GRPOConfig)} - base
    tables = [set(options.FUSED), set(options.TRL_LOSS_ONLY), set(options.INPUTS), set(options.LOGGING)]
    assert set().union(*tables) == own
    assert sum(map(len, tables)) == len(own)  # no field in two tables


def test_lm_head_argument_is_checked_before_trl_builds_anything():
    from kl_kernels.integrations.trl import GRPOTrainer

    with pytest.raises(ValueError, match="lm_head must be one of"):
        GRPOTrainer(model="unused", lm_head="liger")
