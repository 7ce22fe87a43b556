"""The kl-kernels command: info and a tiny bench run that writes JSON, CSV and PNG."""

from __future__ import annotations

import csv
import json
import re
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
    res = _cli("bench", "--quick", "--sizes", "tiny", "--malloc", "both", "--device", "cpu", "--out", str(tmp_path))
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
    tlp = {r["contender"]: r for r in json.loads((tmp_path / "token_logprobs.json").read_text())["rows"]}
    assert set(tlp) == {"eager", "compile", "token_logprobs[torch]", "token_logprobs[cpu]",
                        "token_logprobs[cpu]+inplace"}
    assert "--full" in tlp.pop("token_logprobs[torch]")["error"]  # not in the short runs, and it says so
    assert "--quick" in tlp.pop("compile")["error"]
    # each row's copy floor timed in its own rounds
    assert all("error" not in r and r["ms"] > 0 and r["floor_ms"] > 0 and len(r["round_ms"]) == 3
               for r in tlp.values()), tlp
    copies = {(r["malloc"], r["task"], r["layout"]): r for r in data["rows"] if r["impl"] == "copy (same bytes)"}
    for row in data["rows"]:
        assert row["median_ms"] > 0 and "flag" in row
        # every layout of every table has its same-bytes copy, timed in the same rounds, as its % reference
        floor = copies[(row["malloc"], row["task"], row["layout"])]
        if row["impl"] == FLOOR:  # computes nothing and moves no tensor data: no GB/s, no % copy, no check
            assert row["check"].startswith("not checked") and row["gbs"] is row["pct_copy_bw"] is None
            continue
        assert row["gbs"] > 0 and row["mbytes"] == floor["mbytes"]
        assert row["pct_copy_bw"] == pytest.approx(100 * row["gbs"] / floor["gbs"])
        if row is not floor:
            assert row["check"] == "ok"
        # the spread of % copy BW comes from the same rounds as the copy's, paired round by round
        assert len(row["round_ms"]) == row["repeats"] == floor["repeats"]
        per_round = sorted(100 * c / t for c, t in zip(floor["round_ms"], row["round_ms"]))
        assert per_round[0] <= row["pct_copy_bw_p10"] <= row["pct_copy_bw_p90"] <= per_round[-1]
        if row["x_vs_baseline"] is not None:
            assert row["x_vs_baseline_p10"] <= row["x_vs_baseline_p90"]
        # above the copy: flagged, never shown as fact
        assert row is floor or row["pct_copy_bw"] <= 100 or "of a same-bytes copy" in row["flag"]
    rows = list(csv.DictReader((tmp_path / "results.csv").open()))
    assert len(rows) == len(data["rows"]) and "round_ms" not in rows[0] and "x_vs_compile_p90" in rows[0]
    # every table goes to tables.txt (both allocators); the screen gets one line per table (issue 64 item 2)
    tables = (tmp_path / "tables.txt").read_text()
    assert "x baseline (p10-p90)" in tables and "malloc: glibc default" in tables and "ms tuned" in tables
    out = res.stdout.splitlines()
    assert len(out) <= 45 and max(map(len, out[:-1])) <= 100, res.stdout  # (the last line: the folder)
    assert out[-1].startswith(f"Results in {tmp_path.resolve()}/ (") and "/tmp/tmp" not in res.stdout.replace(
        str(tmp_path), "")
    assert "x eager" in res.stdout and "x compile" in res.stdout and "% copy" in res.stdout
    # stderr: one progress line per task with its time (no warnings, no status lines when not a terminal)
    progress = res.stderr.splitlines()
    assert progress and all(re.fullmatch(r"\[\d+/\d+\] .+ \(\d+ s, \d+ s CPU\)", line) for line in progress), \
        res.stderr
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


def _ctx(tmp_path, **plan):
    import torch

    from kl_kernels.bench import tasks
    return tasks.Context(tasks.plan(**plan), torch.device("cpu"), torch.float32, 0, tmp_path, 10.0)


def test_bench_hidden_state_task_runs_in_own_processes_only_in_the_full_run(tmp_path, monkeypatch):
    """The hidden_states task (both parts: log-probs; the GRPO loss step against Liger): ``--full`` runs each
    contender in its own process (kl_kernels.bench.linear_logprobs.run, stubbed here), the default run in this
    process (measure_one, stubbed) with the slow contenders as "not run" rows that say why."""
    from kl_kernels.bench import linear_logprobs, logprob_tasks

    calls, here = [], []

    def fake_run(sizes, dtype, repeats, task, **kwargs):
        calls.append((tuple(sizes), dtype, task))
        return dict(machine={}, rows=[dict(contender=c, ms=1.0) for c in (
            linear_logprobs.LOSS_CONTENDERS if task == "loss" else linear_logprobs.CONTENDERS)])

    monkeypatch.setattr(linear_logprobs, "run", fake_run)
    monkeypatch.setattr(linear_logprobs, "measure_one", lambda name, *a: here.append(name) or dict(
        contender=name, n=1, hidden=1, vocab=1, dtype="float32", ms=1.0, peak_extra_mib=0.0))
    full = logprob_tasks.hidden_states(_ctx(tmp_path, full=True))
    assert [task for _, _, task in calls] == ["logprobs", "loss"] and all(d == "float32" for _, d, _ in calls)
    assert calls[0][0] == ((2048, 512, 32768),) and here == []
    assert [r["file"] for r in full] == ["hidden_states_logprobs.json", "hidden_states_loss.json"]
    assert full[1]["task"] == "loss" and {r["contender"] for r in full[1]["rows"]} >= {"liger",
                                                                                      "linear_kl_penalty_loss[cpu]"}
    default = logprob_tasks.hidden_states(_ctx(tmp_path))
    assert len(calls) == 2 and "liger" in here and "compile" not in here  # in this process, without compile
    skipped = {r["contender"]: r["error"] for r in default[0]["rows"] if "error" in r}
    assert set(skipped) == {"compile", "linear_token_logprobs[torch]"} and all("--full" in e for e in skipped.values())


def test_bench_token_logprobs_task_runs_in_own_processes_only_in_the_full_run(tmp_path, monkeypatch):
    """``--full`` on the CPU: the token_logprobs contenders each in their own process (clean peaks; stubbed
    here); the default run: in this process at N = 256, V = 32768, the torch fallback a "not run" row."""
    from kl_kernels.bench import logprob_tasks, token_logprobs as tlp

    seen = []
    monkeypatch.setattr(tlp, "run", lambda sizes, dtype, **k: seen.append(("own", sizes)) or dict(rows=[]))
    monkeypatch.setattr(tlp, "run_here", lambda sizes, *a, **k: seen.append(("here", sizes, k.get("skip"))) or [])
    logprob_tasks.token_logprobs(_ctx(tmp_path, full=True))
    (result,) = logprob_tasks.token_logprobs(_ctx(tmp_path))
    assert seen[0] == ("own", [(2048, 32768)]) and seen[1][:2] == ("here", [(256, 32768)])
    assert list(seen[1][2]) == ["token_logprobs[torch]"]
    assert result["file"] == "token_logprobs.json" and result["baseline"] == "eager" and "N=256" in result["title"]


def test_bench_plan_default_full_quick():
    """The default run: medium only, glibc's default allocator, 10 rounds of at most 0.3 s per contender, the
    log-prob tasks small and in this process (~2 minutes on 2 cores); --full: today's long run; --quick: a smoke
    run; --sizes and --malloc override."""
    from kl_kernels.bench import tasks

    default = tasks.plan()
    assert (default.sizes, default.malloc, default.repeats, default.budget_s, default.own_process) == (
        ["medium"], "default", 10, 0.3, False)
    assert default.logprobs_size == (256, 32768) and default.hidden_size == (256, 128, 8192)
    full = tasks.plan(full=True)
    assert (full.sizes, full.malloc, full.repeats, full.budget_s, full.own_process) == (
        ["medium", "large"], "both", 30, 3.0, True)
    assert full.logprobs_size == (2048, 32768) and full.hidden_size == (2048, 512, 32768)
    assert tasks.plan(quick=True).sizes == ["small", "medium"]
    assert tasks.plan(sizes=["tiny"], malloc="tuned").sizes == ["tiny"]
    assert tasks.plan(sizes=["tiny"], malloc="tuned").malloc == "tuned"
    assert [t.name for t in tasks.selected()] == [t.name for t in tasks.TASKS.values() if t.default]
    assert [t.name for t in tasks.selected(["kl_penalty", "kl_reward"])] == ["kl_reward", "kl_penalty"]
    with pytest.raises(ValueError, match="unknown task"):
        tasks.selected(["nope"])


def fake_result_task(ctx):
    """A registered result task for test_bench_runs_a_registered_result_task."""
    rows = [dict(contender="eager", ms=10.0, round_ms=[10.0, 10.0, 10.0]),
            dict(contender="ours[cpu]", ms=2.0, round_ms=[1.0, 2.0, 9.0], ours=True, peak_extra_mib=0.0),
            dict(contender="peer", error="peer-lib not installed (pip install peer-lib)")]
    return [dict(file="fake.json", title="fake task, N=1", baseline="eager", compile=None, rows=rows)]


def test_bench_runs_a_registered_result_task(tmp_path, monkeypatch, capsys):
    """A task registered by another module (kl_kernels.bench.tasks.register) runs with --tasks, prints one
    progress line with its time, writes its JSON with the flags added (a 9x spread of rounds), and its table,
    flag and "not run" note reach the summary."""
    from kl_kernels import cli
    from kl_kernels.bench import tasks

    monkeypatch.setitem(tasks.TASKS, "fake", tasks.Task("fake", "test_cli:fake_result_task", kind="result"))
    assert cli.main(["bench", "--tasks", "fake", "--device", "cpu", "--out", str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    assert err.startswith("[1/1] fake: 2 of 3 contenders (") and err.rstrip().endswith(" s CPU)")
    saved = json.loads((tmp_path / "fake.json").read_text())
    ours = next(r for r in saved["rows"] if r["contender"] == "ours[cpu]")
    assert "rounds spread" in ours["flag"]
    assert "fake task" in out and "5.00x" in out and "peer-lib not installed" in out
    assert any(line.startswith("- rounds spread > 2x") and "ours[cpu]" in line for line in out.splitlines())
    assert len(out.splitlines()) <= 45 and max(map(len, out.splitlines()[:-1])) <= 100  # (the last: the folder)
