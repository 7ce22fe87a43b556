"""The suite's scheduler (tests/xdist_once.py): a module in ``one_worker_modules`` runs on one xdist
worker, so its module fixture is set up once per session; other tests still spread over the workers.

Run as a small pytest session of its own on two workers (the plugin, not this suite's conftest), so it
fails if xdist stops calling the hook or changes how work units are formed, as its xdist_group marks
silently stopped working under pytest 9.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import REPO

pytest.importorskip("xdist")

GROUPED = '''
import os, pytest

@pytest.fixture(scope="module")
def expensive():
    with open(os.environ["SETUPS"], "a") as f:
        f.write(f"{os.getpid()}\\n")
    return 1

@pytest.mark.parametrize("i", range(8))
def test_uses_it(expensive, i):
    pass
'''

SPREAD = '''
import os, time, pytest

@pytest.mark.parametrize("i", range(24))
def test_elsewhere(i):
    time.sleep(0.05)
    with open(os.environ["SPREAD"], "a") as f:
        f.write(f"{os.getpid()}\\n")
'''


def test_a_listed_module_runs_on_one_worker_and_the_rest_spread(tmp_path):
    (tmp_path / "test_grouped.py").write_text(GROUPED)
    (tmp_path / "test_spread.py").write_text(SPREAD)
    (tmp_path / "pytest.ini").write_text(textwrap.dedent("""\
        [pytest]
        addopts = --dist loadgroup -p xdist_once
        one_worker_modules = test_grouped.py
        """))
    env = dict(os.environ, SETUPS=str(tmp_path / "setups"), SPREAD=str(tmp_path / "spread"),
               PYTHONPATH=os.pathsep.join([str(REPO / "tests"), os.environ.get("PYTHONPATH", "")]))
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "2", "-p", "no:cacheprovider", str(tmp_path)],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "32 passed" in res.stdout, res.stdout[-2000:]
    setups = Path(tmp_path / "setups").read_text().split()
    assert len(setups) == 1, f"the module fixture was set up {len(setups)} times (pids {setups})"
    assert len(set(Path(tmp_path / "spread").read_text().split())) == 2, "the other tests should use both workers"


def test_the_listed_modules_exist(pytestconfig):
    """A renamed module would silently drop out of pyproject.toml's one_worker_modules."""
    names = pytestconfig.getini("one_worker_modules")
    assert names and all((REPO / "tests" / name).is_file() for name in names), names
