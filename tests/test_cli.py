"""The kl-kernels command: info and a tiny bench run that writes JSON, CSV and PNG."""

from __future__ import annotations

import csv
import json
import shutil
import subprocess
import sys

import pytest

from conftest import REPO


def _cli(*args, timeout=600):
    exe = shutil.which("kl-kernels")
    cmd = [exe, *args] if exe else [sys.executable, "-m", "kl_kernels.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO)


def test_info_json_lists_backends():
    res = _cli("info", "--json")
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    assert set(data["backends"]) == {"torch", "cpu", "cuda", "triton"}


def test_info_text_explains_unavailable_backends():
    res = _cli("info")
    assert res.returncode == 0, res.stderr
    assert "torch" in res.stdout and "available" in res.stdout


@pytest.mark.slow
def test_bench_tiny_writes_results(tmp_path):
    res = _cli("bench", "--quick", "--sizes", "tiny", "--out", str(tmp_path))
    assert res.returncode == 0, res.stdout + res.stderr
    data = json.loads((tmp_path / "results.json").read_text())
    impls = {r["impl"] for r in data["rows"]}
    assert {"kl_reward[torch]", "kl_reward[cpu]", "torch.compile(reference)", "per-sample eager (TorchRL style)"} <= impls
    try:
        import torchrl  # noqa: F401
        assert "TorchRL KLComputation (lazy stack)" in impls
    except ImportError:
        pass
    assert data["copy_bandwidth_gbs"] > 0 and data["machine"]["torch"]
    copies = {(r["task"], r["layout"]): r for r in data["rows"] if r["impl"] == "copy (same bytes)"}
    for row in data["rows"]:
        assert row["median_ms"] > 0 and row["gbs"] > 0
        # every layout of every table has its same-bytes copy, timed in the same rounds, as its % reference
        floor = copies[(row["task"], row["layout"])]
        assert row["mbytes"] == floor["mbytes"]
        assert row["pct_copy_bw"] == pytest.approx(100 * row["gbs"] / floor["gbs"])
        if row is not floor:
            assert row["check"] == "ok"
    rows = list(csv.DictReader((tmp_path / "results.csv").open()))
    assert len(rows) == len(data["rows"])
    assert "x baseline" in res.stdout and "% copy BW" in res.stdout


def test_bench_rejects_unknown_size(tmp_path):
    res = _cli("bench", "--sizes", "huge", "--out", str(tmp_path))
    assert res.returncode == 2 and "unknown size" in res.stderr


def test_interleaved_timing_attributes_each_time_to_its_function(monkeypatch):
    """The rounds run in a shuffled order: every function is still called once per round and its
    timing reported at its own index (a slow function must not lend its time to another). The timer
    reads a fake clock that only the functions advance: a busy machine (a sleep(0) once measured
    2.3 ms under load) cannot blur what is attributed where."""
    import types

    import torch

    from kl_kernels.bench import timing
    clock = [0.0]
    monkeypatch.setattr(timing, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    calls = [0, 0, 0]

    def make(i, seconds):
        def fn():
            calls[i] += 1
            clock[0] += seconds
        return fn
    found = timing.measure_interleaved([make(0, 0.0), make(1, 0.005), make(2, 0.0)], torch.device("cpu"), warmup=1,
                                       repeats=5, budget_s=60.0)
    assert calls == [6, 6, 6]  # one warm-up and five rounds each
    (fast0, _), (slow, _), (fast2, _) = found
    assert slow.repeats == fast0.repeats == fast2.repeats == 5
    assert slow.min_ms >= 4.0 and fast0.median_ms < 2.0 and fast2.median_ms < 2.0
