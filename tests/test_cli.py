"""The kl-kernels command: info and a tiny bench run that writes JSON, CSV and PNG."""

from __future__ import annotations

import csv
import json
import subprocess
import sys

import pytest

from conftest import REPO
from kl_kernels.bench.torchrl_transforms import FLOOR


def _cli(*args, timeout=600):
    # python -m from the repository root: the tree under test, not whichever checkout an installed
    # kl-kernels script imports (an editable install of another worktree ran that one's code)
    cmd = [sys.executable, "-m", "kl_kernels.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO)


def test_info_json_lists_backends():
    res = _cli("info", "--json")
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    assert set(data["backends"]) == {"torch", "cpu", "cuda", "triton", "cuda-emulated"}


def test_info_text_explains_unavailable_backends():
    res = _cli("info")
    assert res.returncode == 0, res.stderr
    assert "torch" in res.stdout and "available" in res.stdout


def _info_data(cuda_report):
    backend = dict(available=True, reason=None, devices=["cpu"], dtypes=["bfloat16", "float32"], layouts=[], notes="")
    cuda = dict(backend, available=False, devices=["cuda"],
                reason="CUDA runtime of kl_kernels._cuda: CUDA driver version is insufficient for CUDA runtime "
                       "version; torch 2.13.0+cpu is a CPU-only build (no CUDA)")
    backends = {"torch": backend, "cpu": backend, "cuda": cuda, "cuda-emulated": backend}
    return dict(version="0", torch="2.13.0+cpu", torch_cuda=None, python="3.11", platform="Linux", backend_override=None,
                extensions={"_C": {"loaded": True}, "_cuda": cuda_report,
                            "_cuda_emu": {"loaded": True, "cuda_archs": "emulated", "error": None}},
                backends=backends, kl_penalty_loss_backends=backends, token_logprobs_backends=backends,
                full_kl_backends=backends)


def test_info_table_is_aligned_and_says_plainly_why_a_built_extension_cannot_run():
    """Issue 50 item 5: _cuda built but no driver reads as a plain state, not an error; every column of
    the extension and backend tables starts at the same place (the long 'cuda-emulated' name included)."""
    from kl_kernels._info import extension_status, format_info

    no_driver = {"loaded": True, "cuda_archs": "80;90", "driver_version": 0, "cuda_runtime_compiled": 13000,
                 "error": "CUDA driver version is insufficient for CUDA runtime version"}
    assert extension_status(no_driver) == ("built (sm_80, sm_90)", "not usable here: no CUDA driver")
    old_driver = dict(no_driver, driver_version=12040)
    assert extension_status(old_driver)[1] == ("not usable here: the CUDA driver (12.4) is older than the CUDA "
                                               "runtime it was built with (13.0)")
    assert extension_status({"loaded": False, "error": "kl_kernels._cuda is not built (no nvcc)"})[0] == "not built"
    text = format_info(_info_data(no_driver))
    assert "insufficient" not in text and "no CUDA driver" in text
    lines = text.splitlines()
    ext = lines[lines.index("compiled extensions:") + 1:][:3]
    assert [line.split()[0] for line in ext] == ["_C", "_cuda", "_cuda_emu"]
    assert len({line.index(line.split()[1]) for line in ext}) == 1  # the state column is aligned
    start = next(i for i, line in enumerate(lines) if line.split()[:1] == ["backend"])
    table = lines[start:start + 5]
    assert [line.split()[0] for line in table] == ["backend", "torch", "cpu", "cuda", "cuda-emulated"]
    for column in ("devices", "dtypes", "status"):
        at = table[0].index(column)
        assert all(line[at - 2:at] == "  " and line[at] != " " for line in table), column


@pytest.mark.slow
def test_bench_tiny_writes_results(tmp_path):
    res = _cli("bench", "--quick", "--sizes", "tiny", "--device", "cpu", "--out", str(tmp_path))
    assert res.returncode == 0, res.stdout + res.stderr
    data = json.loads((tmp_path / "results.json").read_text())
    impls = {r["impl"] for r in data["rows"]}
    assert {"kl_reward[torch]", "kl_reward[cpu]", "torch.compile(reference)", "per-sample eager (TorchRL style)"} <= impls
    try:
        import torchrl  # noqa: F401
        assert {"TorchRL KLComputation (lazy stack)", "TorchRL KLComputation", FLOOR} <= impls
    except ImportError:
        pass
    assert data["copy_bandwidth_gbs"] > 0 and data["machine"]["torch"]
    # both allocator settings, glibc's default first
    assert [r["malloc"] for r in data["rows"]][0] == "glibc default"
    assert {r["malloc"] for r in data["rows"]} == {"glibc default", data["rows"][-1]["malloc"]} != {"glibc default"}
    assert "kl_reward[cpu] out=" in impls
    tlp = json.loads((tmp_path / "token_logprobs.json").read_text())["rows"]
    assert {r["contender"] for r in tlp} == {"floor: 1.5 x copy (same bytes)", "eager", "token_logprobs[torch]",
                                             "token_logprobs[cpu]", "token_logprobs[cpu]+inplace"}
    assert all("error" not in r and r["ms"] > 0 for r in tlp), tlp
    copies = {(r["malloc"], r["task"], r["layout"]): r for r in data["rows"] if r["impl"] == "copy (same bytes)"}
    for row in data["rows"]:
        assert row["median_ms"] > 0 and row["gbs"] > 0
        # every layout of every table has its same-bytes copy, timed in the same rounds, as its % reference
        floor = copies[(row["malloc"], row["task"], row["layout"])]
        assert row["mbytes"] == floor["mbytes"]
        assert row["pct_copy_bw"] == pytest.approx(100 * row["gbs"] / floor["gbs"])
        if row["impl"] == FLOOR:  # computes nothing: its results are garbage, and it says so
            assert row["check"].startswith("not checked")
        elif row is not floor:
            assert row["check"] == "ok"
        # the spread of % copy BW comes from the same rounds as the copy's, paired round by round
        assert len(row["round_ms"]) == row["repeats"] == floor["repeats"]
        per_round = sorted(100 * c / t for c, t in zip(floor["round_ms"], row["round_ms"]))
        assert per_round[0] <= row["pct_copy_bw_p10"] <= row["pct_copy_bw_p90"] <= per_round[-1]
        if row["x_vs_baseline"] is not None:
            assert row["x_vs_baseline_p10"] <= row["x_vs_baseline_p90"]
    rows = list(csv.DictReader((tmp_path / "results.csv").open()))
    assert len(rows) == len(data["rows"]) and "round_ms" not in rows[0] and "x_vs_compile_p90" in rows[0]
    # the full tables go to tables.txt; the screen gets the short summary (issue 50 item 4)
    assert "x baseline (p10-p90)" in (tmp_path / "tables.txt").read_text()
    out = res.stdout.splitlines()
    assert len(out) < 80 and max(map(len, out)) <= 100, res.stdout
    assert out[-1].startswith(f"Results in {tmp_path.resolve()}/") and "/tmp/tmp" not in res.stdout.replace(
        str(tmp_path), "")
    assert "x eager" in res.stdout and "x compile" in res.stdout and "% copy" in res.stdout and "ms tuned" in res.stdout
    assert res.stderr == ""  # no progress spam, no warnings, when stderr is not a terminal
    assert (tmp_path / "results.png").exists() and (tmp_path / "summary.txt").read_text() in res.stdout


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


def test_speedup_spread_pairs_the_rounds():
    """A row's speedup is the ratio of the medians; its p10/p90 come from the ratio within each
    round, so one slow round of the row (here round 0, a machine hiccup) shows as that round's low
    ratio, not paired with some other round's reference time."""
    from kl_kernels.bench.contenders import set_speedup

    reference = {"median_ms": 30.0, "round_ms": [10.0, 20.0, 30.0, 40.0, 50.0]}
    row = {"median_ms": 15.0, "round_ms": [100.0, 10.0, 15.0, 20.0, 5.0]}
    set_speedup(row, "x_vs_compile", reference)
    assert row["x_vs_compile"] == 2.0
    # per round: 0.1, 2, 2, 2, 10 -> inclusive deciles: p10 = 0.1 + 0.4 * 1.9, p90 = 2 + 0.6 * 8
    assert row["x_vs_compile_p10"] == pytest.approx(0.86)
    assert row["x_vs_compile_p90"] == pytest.approx(6.8)
    set_speedup(row, "x_vs_baseline", None)  # no such contender in the table
    assert row["x_vs_baseline"] is row["x_vs_baseline_p10"] is row["x_vs_baseline_p90"] is None


def test_table_shows_the_spread_next_to_each_ratio():
    from kl_kernels.bench import report

    row = dict(impl="kl_reward[cpu]", layout="packed", median_ms=1.0, mtokens_per_s=1.0, gbs=1.0, pct_copy_bw=80.0,
               pct_copy_bw_p10=70.0, pct_copy_bw_p90=95.0, x_vs_baseline=12.0, x_vs_baseline_p10=10.0,
               x_vs_baseline_p90=14.0, x_vs_compile=None, x_vs_compile_p10=None, x_vs_compile_p90=None,
               compile_s=None, page_faults_per_call=0)
    copy = dict(row, impl="copy (same bytes)", pct_copy_bw=100.0, pct_copy_bw_p10=100.0, pct_copy_bw_p90=100.0,
                x_vs_baseline=None)
    text = report.table([row, copy], "t")
    lines = text.splitlines()
    assert "80% (70-95)" in lines[3] and "12.0x (10.0-14.0)" in lines[3]
    assert "100%" in lines[4] and "(100-100)" not in lines[4]


def test_per_sample_floor_writes_only_its_own_containers():
    pytest.importorskip("torchrl")
    import torch
    from tensordict import TensorDict, lazy_stack

    from kl_kernels import ragged
    from kl_kernels.bench import batches
    from kl_kernels.bench.torchrl_transforms import per_sample_floor

    batch = batches.make_batch(batches.SIZES["tiny"])
    lps, refs = ragged.to_list(batch.lp, batch.offsets), ragged.to_list(batch.ref, batch.offsets)
    td = lazy_stack([TensorDict({("log_probs", "full"): a, ("ref_log_probs", "full"): b, "reward": torch.zeros(len(a), 1)},
                                batch_size=()) for a, b in zip(lps, refs)])
    before = [dict(sub.items(include_nested=True, leaves_only=True)) for sub in td.tensordicts]
    out = per_sample_floor(td, batch)()
    assert out is not td
    for sub, was, lp in zip(td.tensordicts, before, lps):
        assert "kl_penalty" not in sub.keys()
        assert all(sub.get(k) is v for k, v in was.items())  # the benchmark's input, untouched
    # the floor stored one view per sample, of the sample's length, under both output keys
    assert [o["kl_penalty"].shape for o in out.tensordicts] == [lp.shape for lp in lps]
    assert [o["reward"].shape for o in out.tensordicts] == [(*lp.shape, 1) for lp in lps]


def test_bench_runs_the_hidden_state_path_on_the_cpu_but_not_with_quick(tmp_path, monkeypatch):
    """``kl-kernels bench`` (not ``--quick``) times the hidden-state path, both tasks (log-probs; the GRPO
    loss step against Liger), each contender in its own process (kl_kernels.bench.linear_logprobs.run,
    stubbed here: the tiny bench above covers the rest of the command), and writes each task's JSON."""
    import argparse

    from kl_kernels import cli
    from kl_kernels.bench import linear_logprobs

    calls = []

    def fake_run(sizes, dtype, repeats, task, **kwargs):
        calls.append((tuple(sizes), dtype, task))
        return dict(machine={}, rows=[dict(contender=c, ms=1.0) for c in (
            linear_logprobs.LOSS_CONTENDERS if task == "loss" else linear_logprobs.CONTENDERS)])

    monkeypatch.setattr(linear_logprobs, "run", fake_run)
    args = argparse.Namespace(quick=True, dtype="fp32", out=str(tmp_path))
    assert cli._bench_hidden_states(args, print) == [] and calls == []
    args.quick = False
    paths = cli._bench_hidden_states(args, print)
    assert [task for _, _, task in calls] == ["logprobs", "loss"] and all(d == "float32" for _, d, _ in calls)
    assert [p.name for p in paths] == ["hidden_states_logprobs.json", "hidden_states_loss.json"]
    loss = json.loads(paths[1].read_text())
    assert loss["task"] == "loss" and {r["contender"] for r in loss["rows"]} >= {"liger", "linear_kl_penalty_loss[cpu]"}


def test_bench_times_token_logprobs_in_own_processes_without_quick(tmp_path, monkeypatch):
    """Without --quick, on the CPU, the token_logprobs contenders each run in their own process
    (kl_kernels.bench.token_logprobs.run, stubbed here), so their peaks are clean (issue 28 item 7)."""
    import argparse

    import torch

    from kl_kernels import cli
    from kl_kernels.bench import token_logprobs as tlp

    seen = []
    monkeypatch.setattr(tlp, "run", lambda sizes, dtype, **k: seen.append(("own", sizes)) or dict(rows=[]))
    monkeypatch.setattr(tlp, "run_here", lambda sizes, *a, **k: seen.append(("here", sizes)) or [])
    args = argparse.Namespace(quick=False, no_compile=False, dtype="bf16", out=str(tmp_path))
    cli._bench_token_logprobs(args, torch.device("cpu"), {}, print)
    args.quick = True
    cli._bench_token_logprobs(args, torch.device("cpu"), {}, print)
    assert seen == [("own", [(2048, 32768)]), ("here", [(256, 8192)])]
