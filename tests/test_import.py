"""Importing kl_kernels stays cheap: nothing of torch._dynamo (1-2 s), Triton, TorchRL or tensordict is
imported by ``import kl_kernels`` or by ``kl-kernels --help``; they load when first used. A structural test
(which modules are loaded), not a timing one: ``python -X importtime -c "import kl_kernels"`` shows the time."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import REPO

HEAVY = ("torch._dynamo", "torch._inductor", "triton", "torchrl", "tensordict", "sympy")


def _loaded_after(code: str) -> list[str]:
    """The modules loaded in a fresh interpreter after running ``code``."""
    probe = code + "\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"
    res = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout.splitlines()[-1])


def _heavy(modules: list[str]) -> list[str]:
    return [m for m in modules if m.split(".")[0] in HEAVY or m.startswith(HEAVY)]


def test_import_loads_no_dynamo_triton_or_torchrl():
    assert _heavy(_loaded_after("import kl_kernels")) == []


def test_cli_help_loads_no_dynamo_triton_or_torchrl():
    modules = _loaded_after("import contextlib, io\nfrom kl_kernels import cli\n"
                            "with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
                            "    cli.main(['--help'])\n"
                            "with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
                            "    cli.main(['bench', '--help'])")
    assert _heavy(modules) == []


def test_ops_still_register_and_run_after_the_cheap_import():
    """The torch.library ops are registered by the import itself (no dynamo needed for that), and the
    first call runs."""
    modules = _loaded_after("import torch, kl_kernels\n"
                            "lp = torch.randn(5)\n"
                            "out = kl_kernels.kl_reward(lp, lp + 0.1, torch.zeros(2), offsets=torch.tensor([0, 2, 5]), "
                            "reward_placement='last', backend='torch')\n"
                            "assert out.kl.shape == (5,)")
    assert "kl_kernels.kl_reward.ops" in modules


def test_constant_result_mark_matches_torch():
    """backends marks its availability probe constant for torch.compile the way
    ``torch.compiler.assume_constant_result`` does, without importing dynamo at import time: if a torch
    release changes what the decorator sets, this fails (and tests/test_compile.py's traces would break)."""
    import torch

    from kl_kernels import backends

    def probe():
        return []

    marked = torch.compiler.assume_constant_result(probe)
    attrs = {k: v for k, v in vars(marked).items() if not k.startswith("__")}
    assert attrs and all(getattr(backends._unavailable_reasons, k, None) == v for k, v in attrs.items())


@pytest.mark.parametrize("code", ["import kl_kernels.torchrl"])
def test_torchrl_module_still_imports_torchrl_when_asked(code):
    from conftest import torchrl_missing

    if torchrl_missing():
        pytest.skip(f"{torchrl_missing()} not installed")
    assert "torchrl" in _loaded_after(code)
