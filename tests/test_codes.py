"""One table of codes (kl_kernels/codes.py): the generated C++ header matches it, and every reader of
a code reads it from there."""

from __future__ import annotations

import torch

from kl_kernels import codes
from kl_kernels.kl_penalty import problem as loss_problem
from kl_kernels import launching as launch
from kl_kernels.kl_reward import problem


def test_generated_header_is_up_to_date():
    assert codes.HEADER_PATH.read_text() == codes.header(), \
        "csrc/common/codes.h is stale: run `python -m kl_kernels.codes --write` and rebuild"


def test_header_carries_the_table():
    text = codes.header()
    for name, code in codes.ESTIMATOR_CODES.items():
        base = {"k1": "kK1", "abs": "kAbs", "k2": "kK2", "k3": "kK3"}[name]
        assert f"{base} = {code}" in text
    assert f"kLogRatioBound = {codes.LOG_RATIO_BOUND!r}f" in text
    assert f"kRowFar = {codes.ROW_FAR!r}f" in text


def test_the_header_is_the_only_cpp_definition():
    """No other C++ file defines these enums or the bound again."""
    root = codes.HEADER_PATH.parents[1]
    for path in root.rglob("*"):
        if path.suffix not in (".h", ".cuh", ".cpp", ".cu") or path == codes.HEADER_PATH:
            continue
        text = path.read_text()
        for enum in ("Estimator", "Placement", "Layout", "DType", "CoefMode"):
            assert f"enum {enum} " not in text, f"{path} redefines enum {enum}"
        assert "kLogRatioBound =" not in text, f"{path} redefines kLogRatioBound"


def test_python_readers_use_the_table():
    assert launch.DTYPE_CODES == {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
    assert launch.ESTIMATOR_CODES is codes.ESTIMATOR_CODES and launch.PLACEMENT_CODES is codes.PLACEMENT_CODES
    assert problem.ESTIMATORS is codes.ESTIMATORS and problem.STRAIGHT_THROUGH is codes.STRAIGHT_THROUGH
    assert loss_problem.LOG_RATIO_BOUND == codes.LOG_RATIO_BOUND


def test_a_changed_code_fails_the_check(monkeypatch):
    """The freshness test above cannot pass by accident: a changed code changes the header."""
    before = codes.header()
    monkeypatch.setitem(codes.ESTIMATOR_CODES, "k3", 7)
    try:
        after = codes.header()
    except AssertionError:
        return  # the table's own consistency check caught it
    assert after != before


def test_triton_reads_the_table():
    pytest = __import__("pytest")
    pytest.importorskip("triton")
    from kl_kernels.triton import kl_math, kl_penalty
    assert (kl_math.K1.value, kl_math.ABS.value, kl_math.K2.value, kl_math.K3.value) == tuple(
        codes.ESTIMATOR_CODES[n] for n in ("k1", "abs", "k2", "k3"))
    assert kl_penalty.LOG_RATIO_BOUND.value == codes.LOG_RATIO_BOUND
    source = "".join(open(m.__file__).read() for m in (kl_math, kl_penalty))
    assert "EST == 0" not in source and "20.0, 20.0" not in source  # no literal restating the table
