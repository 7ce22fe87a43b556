"""kl_kernels.bench.hidden_states runs on the CPU with tiny sizes (a smoke test of the GPU benchmark): the
rows it writes, the float32 agreement it reports, an unavailable peer reported with its reason, the budget
and a size that does not fit memory as rows, not crashes. No timing is asserted."""

from __future__ import annotations

import json

import torch

from kl_kernels.bench import hidden_states as hs

KEYS = {"contender", "task", "n", "hidden", "vocab", "dtype", "ms", "peak_extra_mib", "machine"}


def test_smoke_on_cpu(tmp_path):
    rows = hs.main(["--device", "cpu", "--sizes", "32:8:40", "--contenders", "ours", "eager", "verl", "verl_torch",
                    "liger", "--repeats", "1", "--out", str(tmp_path)])
    written = json.loads((tmp_path / "hidden_states.json").read_text())
    assert [r["contender"] for r in written] == [r["contender"] for r in rows]
    got = {(r["task"], r["contender"]): r for r in written}
    assert set(got) == {("logprobs", "ours"), ("logprobs", "eager"), ("logprobs", "verl"), ("logprobs", "verl_torch"),
                        ("logprobs", "liger"), ("grpo_loss", "ours"), ("grpo_loss", "eager"), ("grpo_loss", "liger")}
    for key, r in got.items():
        assert KEYS <= set(r), key
        assert (r["n"], r["hidden"], r["vocab"], r["dtype"]) == (32, 8, 40, "bfloat16")
        assert r["machine"]["device"] == "cpu"
    assert "unavailable" in got["logprobs", "verl"] and got["logprobs", "verl"]["ms"] is None
    peers_here = [k for k in (("logprobs", "verl_torch"), ("logprobs", "liger")) if "unavailable" not in got[k]]
    for key in [("logprobs", "ours"), ("logprobs", "eager"), ("grpo_loss", "ours"), ("grpo_loss", "eager")] + peers_here:
        r = got[key]
        assert r["ms"] > 0
        # bf16 against the float32 computation: close, and not trivially zero (a real comparison)
        assert 0 < r["grad_weight_rel_err"] < 2e-2 and 0 < r["grad_hidden_rel_err"] < 2e-2, key
        assert r["loss_rel_err"] < 1e-2, key
    assert got["logprobs", "ours"]["lp_max_abs_err"] < 0.1


def test_budget_and_out_of_memory_are_rows(monkeypatch):
    rows = hs.run([(16, 4, 10)], "cpu", contenders=["ours"], tasks=("logprobs",), repeats=1, budget_s=-1.0)
    assert rows[0]["skipped"] and rows[0]["ms"] is None

    def no_memory(*a, **k):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 80 GiB")
    monkeypatch.setattr(hs, "_inputs", no_memory)
    rows = hs.run([(16, 4, 10)], "cpu", contenders=["ours", "eager"], tasks=("logprobs",), repeats=1)
    assert [r["contender"] for r in rows] == ["ours", "eager"]
    assert all("do not fit" in r["error"] for r in rows)


def test_the_verl_import_leaves_no_stub_behind():
    """verl's kernel is imported with ray/transformers/codetiming stubbed when absent; the stubs must be gone
    afterwards, or later imports (tests/peers.py, TorchRL's ray service, a transformers check) see a fake package."""
    import importlib.util
    import sys

    from kl_kernels.bench import peer_stubs

    absent = [r for r in ("ray", "transformers", "codetiming")
              if r not in sys.modules and importlib.util.find_spec(r) is None]
    with peer_stubs.stubbed(("ray", "transformers", "codetiming")):
        for root in absent:
            __import__(root + ".sub")
    assert not [n for n in sys.modules if n.partition(".")[0] in absent]
    assert all(importlib.util.find_spec(r) is None for r in absent)


def test_rows_carry_the_gemm_physics(tmp_path):
    """One head GEMM is timed per size and task; every timed row says how many of them its step took, and ours
    and eager (whose algorithms we know) their GEMM floor: count x the GEMM's time, and the row's % of it."""
    rows = hs.run([(32, 8, 40)], "cpu", contenders=["ours", "eager"], repeats=2)
    assert {(r["task"], r["contender"]) for r in rows} == {(t, c) for t in ("logprobs", "grpo_loss")
                                                           for c in ("ours", "eager")}
    for r in rows:
        assert r["head_gemm_ms"] > 0 and r["head_gemm_tflops"] > 0
        assert r["head_gemms"] == round(r["ms"] / r["head_gemm_ms"], 2)
        count = hs.head_gemms(r["task"], r["contender"], "cpu")
        assert r["gemm_floor_ms"] == round(count * r["head_gemm_ms"], 3)
        assert r["pct_of_gemm_floor"] == round(100 * count * r["head_gemm_ms"] / r["ms"], 1)
    assert hs.head_gemms("grpo_loss", "ours", "cuda") == 5 and hs.head_gemms("grpo_loss", "ours", "cpu") == 4
    assert hs.head_gemms("logprobs", "verl", "cuda") is None  # a peer's algorithm: not claimed


def test_a_contender_failing_after_its_first_step_is_a_row(monkeypatch):
    """The rounds interleave the contenders; one that fails in them is timed alone again, fails again and
    becomes an error row, while the others keep their times."""
    real = hs._logprobs_fn
    calls = []

    def flaky(name, device):
        fn = real(name, device)
        if name != "eager":
            return fn

        def once(h, w, y):
            calls.append(1)
            if len(calls) > 1:
                raise ValueError("second call refused")
            return fn(h, w, y)
        return once
    monkeypatch.setattr(hs, "_logprobs_fn", flaky)
    rows = hs.run([(16, 8, 30)], "cpu", contenders=["ours", "eager"], tasks=("logprobs",), repeats=2)
    got = {r["contender"]: r for r in rows}
    assert got["ours"]["ms"] > 0 and "error" not in got["ours"]
    assert got["eager"]["ms"] is None and "second call refused" in got["eager"]["error"]


def _row(task, contender, ms, peak=1000.0, gh=1e-3, gw=1e-3, size=hs.ACCEPTANCE):
    n, h, v = size
    row = dict(task=task, contender=contender, n=n, hidden=h, vocab=v, ms=ms, peak_extra_mib=peak,
               grad_hidden_rel_err=gh, grad_weight_rel_err=gw)
    count = hs.head_gemms(task, contender, "cuda")
    return hs._physics(row, dict(head_gemm_ms=11.0, head_gemm_tflops=780.0), task, "cuda") if count else row


def test_acceptance_reads_the_bounds():
    rows = [_row("logprobs", "ours", 50.0), _row("logprobs", "eager", 66.0, gh=4e-3, gw=5e-3),
            _row("logprobs", "verl", 77.0), _row("grpo_loss", "ours", 58.0, peak=1600.0),
            _row("grpo_loss", "eager", 66.0), _row("grpo_loss", "liger", 400.0)]
    lines = hs.acceptance(rows)
    assert [t.split()[0] for t in lines] == ["PASS"] * 5 + ["FAIL", "FAIL", "PASS"]
    assert "0.758 x eager's 66.0 ms" in lines[0] and "44.0 ms (4 head GEMMs at 780 TFLOP/s)" in lines[0]
    assert "ours' floor 55.0 ms (5 head GEMMs" in lines[5] and "bound 0.85 x = 56.1 ms" in lines[5]
    assert "1600 MiB" in lines[6] and "6.9x Liger's" in lines[7]
    # gradients further from float32 than the bound, but no further than eager's: pass; beyond both: fail
    rows[0] = _row("logprobs", "ours", 50.0, gh=3e-3, gw=6e-3)
    assert [t.split()[0] for t in hs.acceptance(rows)[2:4]] == ["PASS", "FAIL"]
    # rows of another size, or without a time, decide nothing
    assert hs.acceptance([_row("logprobs", "ours", 1.0, size=(1, 2, 3))])[0].startswith("n/a")
    assert all(t.startswith("n/a") for t in hs.acceptance([dict(_row("logprobs", "ours", 1.0), ms=None)]))


def test_verl_imports_where_its_heavy_dependencies_are_absent():
    """The GPU machine's image has torch, triton and transformers but neither tensordict nor ray nor codetiming,
    all of which verl's package imports at import time (verl/__init__ -> verl.protocol -> tensordict): its fused
    kernel must import there all the same, or the benchmark reports verl as unavailable. A child process with
    those packages made absent (the path finder, which finds installed packages, told not to find them)."""
    import importlib.util
    import subprocess
    import sys

    if importlib.util.find_spec("verl") is None:
        import pytest

        pytest.skip("verl is not installed (pip install --no-deps verl==0.9.1)")
    child = ("import importlib.machinery as m, importlib.util\n"
             "absent, find = {'tensordict', 'ray', 'codetiming', 'transformers'}, m.PathFinder.find_spec\n"
             "m.PathFinder.find_spec = classmethod(lambda cls, name, path=None, target=None: None\n"
             "    if name.partition('.')[0] in absent else find(name, path, target))\n"
             "assert importlib.util.find_spec('tensordict') is None\n"
             "from kl_kernels.bench import hidden_states as hs\n"
             "print(hs.peer_logprobs('verl'), hs.peer_logprobs('verl_torch'))\n")
    p = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-3000:]


def test_cpu_bench_has_a_row_for_every_verl_route():
    """kl_kernels.bench.linear_logprobs (the CPU bench of the default `kl-kernels bench` run): verl's torch route
    and Liger's fused linear cross-entropy (verl's "liger" route) are timed; verl's Triton route is a row saying why
    it cannot run on a CPU, never silently absent."""
    import importlib.util

    from kl_kernels.bench import linear_logprobs as ll

    assert {"verl[torch]", "verl[triton]", "liger[ce]"} <= set(ll.CONTENDERS)
    rows = {name: ll.measure_one(name, 16, 8, 40, "float32", 1) for name in ("verl[torch]", "verl[triton]", "liger[ce]")}
    assert "CUDA" in rows["verl[triton]"]["error"] and "ms" not in rows["verl[triton]"]
    for name, module in (("verl[torch]", "verl"), ("liger[ce]", "liger_kernel")):
        if importlib.util.find_spec(module) is None:
            assert "not installed" in rows[name]["error"]
        else:
            assert rows[name]["ms"] > 0 and "error" not in rows[name], rows[name]


def test_verls_triton_route_says_cuda_before_looking_for_verl(monkeypatch):
    """On a CPU, verl's Triton route cannot run whether verl is installed or not: with the device given, it says so
    first (a fresh machine's bench said "verl is not installed", and installing it would not have helped)."""
    import pytest

    from kl_kernels.bench import hidden_states as hs

    monkeypatch.setattr(hs, "_verl_module", lambda name: pytest.fail(f"{name} looked for"))
    with pytest.raises(RuntimeError, match="CUDA tensors only"):
        hs.peer_logprobs("verl", device="cpu")
