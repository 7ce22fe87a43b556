"""kl_kernels.bench.hidden_states runs on the CPU with tiny sizes (a smoke test of the GPU benchmark): the
rows it writes, the float32 agreement it reports, an unavailable peer reported with its reason, the budget
and a size that does not fit memory as rows, not crashes. No timing is asserted."""

from __future__ import annotations

import json

import torch

from kl_kernels.bench import hidden_states as hs

KEYS = {"contender", "task", "n", "hidden", "vocab", "dtype", "ms", "peak_extra_mib", "machine"}


def test_smoke_on_cpu(tmp_path):
    rows = hs.main(["--device", "cpu", "--sizes", "32:8:40", "--contenders", "ours", "eager", "verl", "liger",
                    "--repeats", "1", "--out", str(tmp_path)])
    written = json.loads((tmp_path / "hidden_states.json").read_text())
    assert [r["contender"] for r in written] == [r["contender"] for r in rows]
    got = {(r["task"], r["contender"]): r for r in written}
    assert set(got) == {("logprobs", "ours"), ("logprobs", "eager"), ("logprobs", "verl"), ("grpo_loss", "ours"),
                        ("grpo_loss", "eager"), ("grpo_loss", "liger")}
    for key, r in got.items():
        assert KEYS <= set(r), key
        assert (r["n"], r["hidden"], r["vocab"], r["dtype"]) == (32, 8, 40, "bfloat16")
        assert r["machine"]["device"] == "cpu"
    assert "unavailable" in got["logprobs", "verl"] and got["logprobs", "verl"]["ms"] is None
    for key in (("logprobs", "ours"), ("logprobs", "eager"), ("grpo_loss", "ours"), ("grpo_loss", "eager")):
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
