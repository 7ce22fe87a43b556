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
                                    "kl_kernels.full_kl.linear", "kl_kernels.linear_loss",
                                    "kl_kernels.integrations.verl", "kl_kernels.integrations.openrlhf"])
def test_docstring_examples(module):
    mod = __import__(module, fromlist=["_"])
    result = doctest.testmod(mod, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0


def test_python_api_pages_name_every_public_symbol():
    text = " ".join(p.read_text() for p in PAGES) + (REPO / "python_api" / "README.md").read_text()
    for name in kl_kernels.__all__:
        if name != "__version__":
            assert name in text, f"{name} is public but undocumented in python_api/"


README = REPO / "README.md"


def _readme_first_screen() -> list[str]:
    """The README's lines up to the end of its Quick start (the next heading after it)."""
    lines = README.read_text().splitlines()
    start = lines.index("## Quick start")
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    return lines[:end]


def test_the_readme_example_runs_and_prints_what_the_readme_shows():
    """The README's one ```python block, run as a script, prints, and the README shows what it prints."""
    blocks = BLOCK.findall(README.read_text())
    assert len(blocks) == 1, "the README holds one example; the rest are python_api/ pages"
    assert len(blocks[0].strip().splitlines()) <= 5
    res = subprocess.run([sys.executable, "-c", blocks[0]], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert res.returncode == 0, res.stdout + res.stderr
    printed = " ".join(res.stdout.split())
    assert printed and printed in " ".join(README.read_text().split()), printed


def test_the_readme_first_screen_is_one_screen_with_two_commands():
    """Issue 64: the first screen (to the end of the Quick start) under 60 lines, no line over 160 characters outside
    code blocks; the Quick start's two commands: one runs the benchmark, the other the tests, and CI (.ci/run) runs
    that test command."""
    screen = _readme_first_screen()
    assert len(screen) < 60, len(screen)
    in_code, long = False, []
    for number, line in enumerate(README.read_text().splitlines(), 1):
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and len(line) > 160:
            long.append(f"README.md:{number}: {len(line)} characters")
    assert not long, long
    quick = "\n".join(screen[screen.index("## Quick start"):])
    (block,) = re.findall(r"^```bash\n(.*?)^```", quick, re.S | re.M)
    commands = [line.split("  #")[0].strip() for line in block.splitlines() if line.strip()]
    assert len(commands) == 2 and "kl-kernels bench" in commands[0], commands
    ci = (REPO / ".ci" / "run").read_text().splitlines()
    assert any(line.strip().endswith(commands[1]) for line in ci), f".ci/run does not run {commands[1]!r}"
