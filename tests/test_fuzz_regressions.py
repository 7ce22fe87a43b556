"""Replays the fuzzer's saved inputs (tests/fuzz/regressions: each one a finding, fixed; corpus: the
inputs that reached new code) through the fuzz harness's checks. The fuzzing itself runs in CI's
fuzz lane (.ci/fuzz), for a bounded time."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

FUZZ = Path(__file__).with_name("fuzz")

pytest.importorskip("atheris")


@pytest.mark.parametrize("folder", ["regressions", "corpus"])
def test_saved_inputs_pass_the_harness(folder):
    files = sorted(str(p) for p in (FUZZ / folder).iterdir() if p.is_file())
    assert files, f"tests/fuzz/{folder} is empty"
    proc = subprocess.run([sys.executable, str(FUZZ / "fuzz_ops.py"), "--replay", *files], capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"replayed {len(files)} inputs" in proc.stdout
