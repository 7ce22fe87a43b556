"""The ``trl`` task of ``kl-kernels bench`` (kl_kernels/bench/trl_grpo.py): its plumbing, not its speed. Each
contender runs at a tiny size and gives a timed row (or a row saying why it did not run), every contender's loss
is stock TRL's (the rows compute the same GRPO step), and a missing TRL is a "not run" row, never an absent one.
TRL is imported over stand-ins for transformers where transformers is absent (the main suite), and for real in
the TRL lane."""

from __future__ import annotations

import importlib.util
import json
from types import SimpleNamespace

import pytest
import torch

from kl_kernels.bench import trl_grpo

TINY = (48, 16, 64)  # N, H, V: 4 sequences of 12 tokens
TIMED = ("ms", "min_ms", "round_ms", "peak_extra_mib", "loss", "loss_rel_diff")


def _need_trl():
    if importlib.util.find_spec("trl") is None:
        pytest.skip("trl is not installed (pip install --no-deps trl==1.16.0)")


def test_every_contender_runs_and_computes_stock_trls_loss():
    _need_trl()
    result = trl_grpo.measure(*TINY, torch.float32, "cpu", repeats=3, budget_s=0.0)
    assert result["file"] == "trl_grpo.json" and result["baseline"] == "trl" and len(result["short"]) <= 26
    rows = {r["contender"]: r for r in result["rows"]}
    assert list(rows) == list(trl_grpo.CONTENDERS)
    for name, r in rows.items():
        assert "error" not in r, (name, r.get("error"))
        assert all(k in r for k in TIMED), (name, r)
        assert len(r["round_ms"]) >= 3 and r["min_ms"] <= r["ms"]
        # the same step: TRL's loss within float32 rounding (log-probs of different heads, sums in another order)
        assert r["loss_rel_diff"] <= 1e-5, (name, r["loss"], rows["trl"]["loss"])
    assert rows["trl"]["ours"] is False and rows["kl_kernels head + kl_kernels loss"]["ours"] is True
    assert result["shape"] == dict(batch=4, seq=12, prompt=3, completion=9, hidden=16, vocab=64)


def test_the_step_differentiates_to_the_policy_only():
    """Every contender's backward reaches the policy's hidden states and head (fresh leaves per call)."""
    _need_trl()
    x = trl_grpo.make_inputs(*TINY, torch.float32, "cpu")
    trl, why = trl_grpo.trl_modules("cpu")
    assert why is None
    for name in trl_grpo.CONTENDERS:
        leaves = []
        trl_grpo.step_function(name, x, trl, keep=leaves)()
        assert len(leaves) == 2 and all(t.grad is not None and t.grad.abs().sum() > 0 for t in leaves), name
        assert x["hidden"].grad is None and x["ref_hidden"].grad is None and x["ref_weight"].grad is None


def test_without_trl_its_rows_say_why(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "trl" else real(name, *a))
    result = trl_grpo.measure(*TINY, torch.float32, "cpu", repeats=3, budget_s=0.0,
                              contenders=("trl", "kl_kernels head + trl loss", "kl_kernels head + kl_kernels loss"))
    rows = {r["contender"]: r for r in result["rows"]}
    assert "trl is not installed" in rows["trl"]["error"] and "ms" not in rows["trl"]
    assert "trl is not installed" in rows["kl_kernels head + trl loss"]["error"]
    assert "error" not in rows["kl_kernels head + kl_kernels loss"]
    assert "loss_rel_diff" not in rows["kl_kernels head + kl_kernels loss"]  # nothing to compare with


def test_trls_head_on_a_gpu_without_transformers_is_a_note(monkeypatch):
    _need_trl()
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "transformers" else real(name, *a))
    modules, why = trl_grpo.trl_modules("cuda")
    assert modules is None and "transformers" in why


def test_run_task_sizes_and_result_format(monkeypatch):
    calls = []

    def fake_measure(n, hid, vocab, dtype, device, **kw):
        calls.append(((n, hid, vocab), kw["repeats"]))
        return {"file": "trl_grpo.json", "rows": []}

    monkeypatch.setattr(trl_grpo, "measure", fake_measure)
    for full, size in ((False, trl_grpo.DEFAULT_SIZE), (True, trl_grpo.FULL_SIZE)):
        ctx = SimpleNamespace(plan=SimpleNamespace(full=full, repeats=30 if full else 12, budget_s=1.0),
                              dtype=torch.float32, device=torch.device("cpu"), seed=0, progress=lambda m: None)
        assert trl_grpo.run_task(ctx) == [{"file": "trl_grpo.json", "rows": []}]
        assert calls[-1] == (size, 30 if full else 5)


def test_registered_with_the_bench():
    tasks = pytest.importorskip("kl_kernels.bench.tasks")
    task = tasks.TASKS["trl"]
    assert task.kind == "result" and task.function() is trl_grpo.run_task


def test_main_writes_the_result(tmp_path, capsys):
    _need_trl()
    out = tmp_path / "trl.json"
    trl_grpo.main(["--size", ":".join(map(str, TINY)), "--repeats", "3", "--out", str(out)])
    result = json.loads(out.read_text())
    assert [r["contender"] for r in result["rows"]] == list(trl_grpo.CONTENDERS)
    assert "TRL GRPO step B=4 T=12" in capsys.readouterr().out
