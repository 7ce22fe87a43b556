"""The adversarial sweep: hundreds of odd or wrong calls to both ops, each judged in a worker process.

``tests/adversarial/catalogue.py`` generates the calls (dtypes, shapes off by one, offsets and
lengths of every wrong kind, negative bits, empty batches and sequences, zero-stride, overlapping and
misaligned inputs, meta and sparse tensors, hostile containers, non-finite scalars, reversed clamps,
requires_grad mixes) with what each must do; ``worker.py`` runs each through every backend here and
judges it: the float64 reference's answers (and gradients), or a ValueError/TypeError naming the
argument; inputs unchanged either way. A crash or a hang fails its call, not the run
(``pool.py``). The whole sweep runs once per session, on two workers.
"""

from __future__ import annotations

import pytest

from adversarial.catalogue import build_catalogue
from adversarial.pool import run_calls

CALLS = build_catalogue()
# the sweep (a module fixture) runs once, on one xdist worker: pyproject.toml one_worker_modules


@pytest.fixture(scope="module")
def verdicts():
    return run_calls(sorted(CALLS), workers=2, timeout=120.0)


def test_catalogue_is_large_and_covers_both_ops():
    ops = {c.op for c in CALLS.values()}
    assert ops == {"kl_reward", "kl_penalty_loss"}
    assert len(CALLS) >= 400
    kinds = {c.expect if isinstance(c.expect, str) else c.expect[0] for c in CALLS.values()}
    assert kinds == {"ok", "error", "unavailable"}
    assert sum(c.grad for c in CALLS.values()) >= 20


def test_pool_reports_a_crash_and_a_hang_and_goes_on():
    """The harness cannot pass a call that kills or hangs its worker: it reports it and carries on."""
    names = ["selftest/abort", "kl_reward/plain/packed/f32", "selftest/hang", "kl_reward/plain/list/f32"]
    got = run_calls(names, workers=1, timeout=8.0)
    assert got["selftest/abort"]["verdict"] == "fail" and "died" in got["selftest/abort"]["detail"]
    assert got["selftest/hang"]["verdict"] == "fail" and "hang" in got["selftest/hang"]["detail"]
    assert got["kl_reward/plain/packed/f32"]["verdict"] == "pass"
    assert got["kl_reward/plain/list/f32"]["verdict"] == "pass"


@pytest.mark.parametrize("name", sorted(CALLS))
def test_call(verdicts, name):
    v = verdicts[name]
    assert v["verdict"] == "pass", v["detail"]
