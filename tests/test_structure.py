"""Design convention 2: the ops are siblings. Neither op's code (its package folder and its Triton
kernels) imports the other op's modules; what both use lives in shared modules that no op owns
(``kl_kernels/launching.py``, ``layouts.py``, ``backends.py``, ``triton/tiles.py``, ``triton/kl_math.py``...).
The Triton loss kernels imported the reward kernels' private ``_frame``/``_coef``/``_combine_rows``
until a fresh reader noticed (2026-11-26)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "kl_kernels"
OPS = ("kl_reward", "kl_penalty", "token_logprobs", "full_kl")
IMPORT = re.compile(r"^\s*(?:from\s+(\S+)\s+import|import\s+(\S+))")


def _files_of(op: str) -> list[Path]:
    kernels = PACKAGE / "triton" / f"{op}.py"
    return sorted((PACKAGE / op).rglob("*.py")) + ([kernels] if kernels.exists() else [])


@pytest.mark.parametrize("op", OPS)
def test_an_op_imports_nothing_of_the_other(op):
    others = [o for o in OPS if o != op]
    offenders = []
    for path in _files_of(op):
        for i, line in enumerate(path.read_text().splitlines(), 1):
            m = IMPORT.match(line)
            if m and any(re.search(rf"(^|\.){other}\b", m.group(1) or m.group(2)) for other in others):
                offenders.append(f"{path.relative_to(PACKAGE)}:{i}: {line.strip()}")
    assert not offenders, f"{op} imports another op ({', '.join(others)}):\n" + "\n".join(offenders)
