"""The first-use self-check (kl_kernels/selfcheck.py), tested with CPU backends standing in for GPU ones.

On a GPU the cuda and triton rows carry ``self_check_devices={"cuda"}``. Here the same mechanism is
exercised on the CPU: a cpu row that must pass the check before "auto" takes it, once correct and
once deliberately broken (it must then be skipped, with the reason logged), the cache, the explicit
name that bypasses the check, and ``kl-kernels info --check``.
"""

from __future__ import annotations

import dataclasses
import logging
import subprocess
import sys

import pytest
import torch

from kl_kernels import kl_penalty_loss, kl_reward, selfcheck, token_logprobs
from kl_kernels.full_kl import backends as full_kl_backends
from kl_kernels.kl_penalty import backends as loss_backends
from kl_kernels.token_logprobs import backends as logprobs_backends
from kl_kernels.kl_reward import backends as reward_backends
from kl_kernels.kl_reward.problem import RawOutputs

CPU = frozenset({"cpu"})


def _install(monkeypatch, module, api_module, rows):
    monkeypatch.setattr(module, "REGISTRY", rows)
    monkeypatch.setattr(sys.modules[api_module], "REGISTRY", rows)


def _with_cpu_row(registry, **changes):
    return [dataclasses.replace(b, **changes) if b.name == "cpu" else b for b in registry]


@pytest.fixture(autouse=True)
def fresh_verdicts():
    selfcheck.clear()
    yield
    selfcheck.clear()


def _calls(run):
    """A backend run function that counts its calls."""
    counter = {"n": 0}

    def counted(problem, **kw):
        counter["n"] += 1
        return run(problem, **kw)
    return counted, counter


def test_a_checked_backend_that_passes_is_used(monkeypatch):
    cpu = next(b for b in reward_backends.REGISTRY if b.name == "cpu")
    run, counter = _calls(cpu.run)
    _install(monkeypatch, reward_backends, "kl_kernels.kl_reward.api",
             _with_cpu_row(reward_backends.REGISTRY, self_check_devices=CPU, run=run))
    lp, ref = torch.randn(2, 5), torch.randn(2, 5)
    out = kl_reward(lp, ref, coef=0.1, clamp_input=(-20, 20))  # the general path: dispatch
    torch.testing.assert_close(out.kl, lp - ref)
    assert selfcheck.verdicts()[("kl_reward", "cpu", "cpu", selfcheck.__version__)] == []
    checked = counter["n"]
    assert checked > 50  # the check ran the backend on the canonical batches
    kl_reward(lp, ref, coef=0.1, clamp_input=(-20, 20))
    assert counter["n"] == checked + 1  # cached: the second call runs the op once, no new check


def _broken(run):
    def broken(problem, **kw):
        raw = run(problem, **kw)
        return RawOutputs(raw.kl * 2, raw.reward, raw.ref_log_probs, raw.kl_sum, raw.count)
    return broken


def test_a_broken_backend_is_skipped_and_logged(monkeypatch, caplog):
    cpu = next(b for b in reward_backends.REGISTRY if b.name == "cpu")
    _install(monkeypatch, reward_backends, "kl_kernels.kl_reward.api",
             _with_cpu_row(reward_backends.REGISTRY, self_check_devices=CPU, run=_broken(cpu.run)))
    lp, ref = torch.randn(2, 5), torch.randn(2, 5)
    with caplog.at_level(logging.WARNING, logger="kl_kernels"):
        out = kl_reward(lp, ref, coef=0.1, clamp_input=(-20, 20))
    torch.testing.assert_close(out.kl, lp - ref)  # right: "auto" fell back to the torch reference
    assert any("failed its first-use self-check" in r.getMessage() and "'cpu'" in r.getMessage()
               for r in caplog.records)
    failures = selfcheck.verdicts()[("kl_reward", "cpu", "cpu", selfcheck.__version__)]
    assert failures and all(" kl" in f or "grad" in f for f in failures), failures[:3]
    # named explicitly, it runs (broken as it is): the user asked for it
    wrong = kl_reward(lp, ref, coef=0.1, clamp_input=(-20, 20), backend="cpu")
    torch.testing.assert_close(wrong.kl, 2 * (lp - ref))
    # and "auto" with no backend left says why
    only = [b for b in reward_backends.REGISTRY if b.name == "cpu"]
    _install(monkeypatch, reward_backends, "kl_kernels.kl_reward.api", only)
    with pytest.raises(RuntimeError, match="failed its first-use self-check"):
        kl_reward(lp, ref, coef=0.1, clamp_input=(-20, 20))


def test_the_loss_check_catches_a_broken_gradient(monkeypatch):
    cpu = next(b for b in loss_backends.REGISTRY if b.name == "cpu")

    def wrong_grad(problem, **kw):
        raw = cpu.run(problem, **kw)
        # the same values, twice the gradient (the aggregations the kernel does not fold in go through here)
        return raw._replace(seq_loss=raw.seq_loss * 2 - raw.seq_loss.detach())

    rows = _with_cpu_row(loss_backends.REGISTRY, self_check_devices=CPU, run=wrong_grad)
    _install(monkeypatch, loss_backends, "kl_kernels.kl_penalty.api", rows)
    failures = selfcheck.run("kl_penalty_loss", "cpu", "cpu")
    assert failures and all("grad" in f for f in failures), failures[:3]
    lp = torch.randn(2, 4, requires_grad=True)
    kl_penalty_loss(lp, torch.randn(2, 4), torch.randn(2), clip_epsilon=0.2)  # "auto": not the cpu row
    assert not selfcheck.passed("kl_penalty_loss", "cpu", "cpu")


@pytest.mark.parametrize("broken", ["value", "grad"])
def test_the_token_logprobs_check_catches_a_broken_row_kernel(monkeypatch, broken):
    """token_logprobs' check (its Triton row is checked on a GPU before "auto" takes it): a cpu row off
    by a little in the value or only in the gradient fails it, and "auto" moves on to torch."""
    cpu = next(b for b in logprobs_backends.REGISTRY if b.name == "cpu")

    def wrong(problem):
        lp, entropy = cpu.run(problem)
        if broken == "value":
            return lp + 1e-3 * (lp != 0), entropy
        return lp * 2 - lp.detach(), entropy  # same values, twice the gradient

    rows = _with_cpu_row(logprobs_backends.REGISTRY, self_check_devices=CPU, run=wrong)
    _install(monkeypatch, logprobs_backends, "kl_kernels.token_logprobs.api", rows)
    failures = selfcheck.run("token_logprobs", "cpu", "cpu")
    assert failures and all(("grad" if broken == "grad" else "log_probs") in f for f in failures), failures[:3]
    x, y = torch.randn(3, 7), torch.tensor([0, 6, 2])
    out = token_logprobs(x, y)  # "auto": not the cpu row
    torch.testing.assert_close(out.log_probs, torch.log_softmax(x, -1).gather(-1, y[:, None])[:, 0])
    assert not selfcheck.passed("token_logprobs", "cpu", "cpu")


def test_auto_takes_the_token_logprobs_row_that_passed(monkeypatch):
    cpu = next(b for b in logprobs_backends.REGISTRY if b.name == "cpu")
    calls = []
    rows = _with_cpu_row(logprobs_backends.REGISTRY, self_check_devices=CPU,
                         run=lambda p: (calls.append(1), cpu.run(p))[1])
    _install(monkeypatch, logprobs_backends, "kl_kernels.token_logprobs.api", rows)
    token_logprobs(torch.randn(3, 7), torch.tensor([0, 6, 2]))
    assert selfcheck.verdicts()[("token_logprobs", "cpu", "cpu", selfcheck.__version__)] == []
    assert len(calls) > 16  # the check's cases, then the call itself


@pytest.mark.parametrize("broken", ["kl", "grad logits", "grad ref_logits"])
def test_the_full_kl_check_catches_a_broken_row_kernel(monkeypatch, broken):
    """full_kl's check (its cuda and triton rows are checked on a GPU before "auto" takes them): a cpu row
    off by a little in the value, or in one side's gradient only, fails it, naming what differs."""
    cpu = next(b for b in full_kl_backends.REGISTRY if b.name == "cpu")

    def wrong(problem):
        kl = cpu.run(problem)
        if broken == "kl":
            return kl + 1e-3 * (kl != 0)
        side = (problem.logits if broken == "grad logits" else problem.ref_logits).float().nan_to_num(0, 0, 0)
        extra = side.mean(-1)
        return kl + (extra - extra.detach())  # the same values, another gradient on that side

    rows = _with_cpu_row(full_kl_backends.REGISTRY, self_check_devices=CPU, run=wrong)
    _install(monkeypatch, full_kl_backends, "kl_kernels.full_kl.api", rows)
    failures = selfcheck.run("full_kl", "cpu", "cpu")
    assert failures and all(f" {broken}: " in f for f in failures), failures[:3]


@pytest.mark.triton
def test_the_token_logprobs_check_passes_for_triton():
    """What "auto" runs on a GPU before it takes the Triton row kernels (here, their interpreter)."""
    from conftest import triton_device

    assert selfcheck.run("token_logprobs", "triton", triton_device()) == []


def test_every_backend_here_passes():
    """What `kl-kernels info --check` runs: every available fused backend on this machine."""
    names = {b.name for b in reward_backends.REGISTRY if not b.unavailable_reasons() and "cpu" in b.devices}
    for op in ("kl_reward", "kl_penalty_loss", "token_logprobs", "full_kl"):
        for name in sorted(names - {"torch", "triton"}):  # the interpreter is checked by its own tests
            assert selfcheck.run(op, name, "cpu") == [], (op, name)


def test_info_check_command():
    """The rows "auto" may choose, here the cpu kernels of both ops; the named-only rows (Triton's
    interpreter, cuda-emulated) only with --all (their checks take minutes here: covered in-process by
    test_every_backend_here_passes)."""
    proc = subprocess.run([sys.executable, "-m", "kl_kernels.cli", "info", "--check"], capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert any(line.split()[:2] == ["kl_reward", "cpu"] and line.endswith("passed") for line in lines), proc.stdout
    assert any(line.split()[:2] == ["kl_penalty_loss", "cpu"] and line.endswith("passed") for line in lines)
    assert any(line.split()[:2] == ["token_logprobs", "cpu"] and line.endswith("passed") for line in lines)
    assert any(line.split()[:2] == ["full_kl", "cpu"] and line.endswith("passed") for line in lines)
    assert not any(line.split()[1:2] == ["cuda-emulated"] for line in lines), proc.stdout
