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
    for row in data["rows"]:
        assert row["check"] == "ok" and row["median_ms"] > 0 and row["gbs"] > 0
    rows = list(csv.DictReader((tmp_path / "results.csv").open()))
    assert len(rows) == len(data["rows"])
    assert "x baseline" in res.stdout and "% copy BW" in res.stdout


def test_bench_rejects_unknown_size(tmp_path):
    res = _cli("bench", "--sizes", "huge", "--out", str(tmp_path))
    assert res.returncode == 2 and "unknown size" in res.stderr
