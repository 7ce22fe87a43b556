"""The documentation runs: python_api/ code blocks, python_api/examples/ scripts, docstring examples."""

from __future__ import annotations

import doctest
import re
import subprocess
import sys

import pytest

import kl_kernels
from conftest import REPO

PAGES = sorted((REPO / "python_api").glob("*.md"))
EXAMPLES = sorted((REPO / "python_api" / "examples").glob("*.py"))
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
# ```python trl blocks need TRL's trainer stack (transformers, accelerate, datasets: not in the suite's virtualenv):
# test_trl_code_blocks_run runs them in .ci/lane-trl and skips them, saying why, elsewhere. No other tag exists:
# test_every_python_fence_runs fails on one, so a block cannot drop out of both tests unnoticed.
TRL_BLOCK = re.compile(r"^```python trl\n(.*?)^```", re.S | re.M)
FENCE = re.compile(r"^```python(.*)$", re.M)
TRL_STACK = ("transformers", "accelerate", "datasets", "trl")
# The same for ```python verl and ```python openrlhf blocks (python_api/integrations.md): they need verl's and
# OpenRLHF's import chains (the packages below); test_verl_lane_code_blocks_run runs them in .ci/lane-verl, with
# stubs only for what cannot import on a CPU machine (OpenRLHF's model utilities import deepspeed), and skips
# them, saying why, elsewhere.
VERL_LANE_BLOCKS = {"verl": (("ray", "transformers", "datasets", "verl"), ()),
                    "openrlhf": (("transformers", "peft", "openrlhf"), ("deepspeed", "flash_attn", "vllm"))}
TORCHRL_IMPORT = re.compile(r"^\s*(from|import) (torchrl|tensordict|kl_kernels\.torchrl)\b", re.M)


def _param(path, text):
    """A page or script, marked `torchrl` when it imports the `torchrl` extra."""
    return pytest.param(path, id=path.name, marks=[pytest.mark.torchrl] if TORCHRL_IMPORT.search(text) else [])


def test_there_is_something_to_run():
    assert PAGES and EXAMPLES and any(BLOCK.search(p.read_text()) for p in PAGES)


@pytest.mark.parametrize("page", [_param(p, "\n".join(BLOCK.findall(p.read_text()))) for p in PAGES
                                  if BLOCK.search(p.read_text())])
def test_page_code_blocks_run(page):
    namespace: dict = {}
    for i, block in enumerate(BLOCK.findall(page.read_text())):
        exec(compile(block, f"{page.name}[block {i}]", "exec"), namespace)  # noqa: S102


def test_every_python_fence_runs():
    for page in PAGES:
        tags = {t.strip() for t in FENCE.findall(page.read_text())}
        known = {"", "trl", *VERL_LANE_BLOCKS}
        assert tags <= known, f"{page.name}: ```python fences tagged {sorted(tags - known)} run nowhere"


@pytest.mark.parametrize("page", [p for p in PAGES if TRL_BLOCK.search(p.read_text())], ids=lambda p: p.name)
def test_trl_code_blocks_run(page):
    import importlib.util

    missing = next((m for m in TRL_STACK if importlib.util.find_spec(m) is None), None)
    if missing:
        pytest.skip(f"```python trl blocks need TRL's trainer stack ({missing} missing): .ci/lane-trl runs them")
    namespace: dict = {}
    for i, block in enumerate(TRL_BLOCK.findall(page.read_text())):
        exec(compile(block, f"{page.name}[trl block {i}]", "exec"), namespace)  # noqa: S102


@pytest.mark.parametrize("page, tag", [(p, t) for p in PAGES for t in VERL_LANE_BLOCKS
                                       if re.search(rf"^```python {t}$", p.read_text(), re.M)],
                         ids=lambda x: getattr(x, "name", x))
def test_verl_lane_code_blocks_run(page, tag):
    import importlib.util

    from kl_kernels.bench.peer_stubs import stubbed

    stack, stubs = VERL_LANE_BLOCKS[tag]
    missing = next((m for m in stack if importlib.util.find_spec(m) is None), None)
    if missing:
        pytest.skip(f"```python {tag} blocks need {tag}'s import chain ({missing} missing): .ci/lane-verl runs them")
    namespace: dict = {}
    blocks = re.findall(rf"^```python {tag}\n(.*?)^```", page.read_text(), re.S | re.M)
    with stubbed(stubs):
        for i, block in enumerate(blocks):
            exec(compile(block, f"{page.name}[{tag} block {i}]", "exec"), namespace)  # noqa: S102


@pytest.mark.parametrize("script", [_param(p, p.read_text()) for p in EXAMPLES])
def test_example_scripts_run(script):
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert res.returncode == 0, res.stdout + res.stderr


@pytest.mark.parametrize("module", ["kl_kernels.ragged", "kl_kernels.kl_reward.api", "kl_kernels._info",
                                    pytest.param("kl_kernels.torchrl.transforms", marks=pytest.mark.torchrl),
                                    pytest.param("kl_kernels.torchrl.ppo", marks=pytest.mark.torchrl),
                                    "kl_kernels.kl_penalty.controllers",
                                    "kl_kernels.kl_penalty.api", "kl_kernels.token_logprobs.linear",
                                    "kl_kernels.full_kl.linear", "kl_kernels.linear_loss"])
def test_docstring_examples(module):
    mod = __import__(module, fromlist=["_"])
    result = doctest.testmod(mod, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0


def test_python_api_pages_name_every_public_symbol():
    text = " ".join(p.read_text() for p in PAGES) + (REPO / "python_api" / "README.md").read_text()
    for name in kl_kernels.__all__:
        if name != "__version__":
            assert name in text, f"{name} is public but undocumented in python_api/"
