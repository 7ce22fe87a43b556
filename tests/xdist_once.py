"""One xdist worker per listed module, so a module fixture that costs minutes runs once per session.

Some modules share one expensive module-scoped fixture among their tests: the Triton compile of every
kernel and config for two GPU targets (``test_triton_static.py``), the adversarial sweep
(``test_adversarial.py``), the dump of the CUDA binary's SASS (``test_cuda_static.py``). Spread over
two workers, each worker runs the fixture: minutes of CI twice.

pytest-xdist's own answer, ``--dist loadgroup`` with ``xdist_group`` marks, silently does nothing
with pytest 9: xdist 3.8 tags a grouped test by assigning ``item._nodeid``, an attribute pytest 9
no longer reads (the node id is ``item._id``), so grouped tests were scheduled one by one like any
other and each worker set the fixture up (seen as two ~240 s setups of the Triton compile).

This plugin keeps xdist's loadgroup scheduler and only changes how a test id maps to a work unit:
a test of a module named in the ``one_worker_modules`` ini option (pyproject.toml) belongs to its
module's unit, every other test is a unit of its own (as under loadgroup). xdist sends the
multi-test units first (its ``--loadscope-reorder`` default), so the long ones do not end the run.
Checked by ``tests/test_xdist_once.py`` in a subprocess run on two workers.
"""

from __future__ import annotations

import pytest

try:
    from xdist.scheduler import LoadGroupScheduling
except ImportError:  # pragma: no cover - without pytest-xdist the suite runs in one process
    LoadGroupScheduling = None


def pytest_addoption(parser):
    parser.addini("one_worker_modules", type="linelist", default=[],
                  help="test module file names whose tests all run on one xdist worker (--dist loadgroup)")


if LoadGroupScheduling is not None:

    class ModuleOnOneWorker(LoadGroupScheduling):
        """loadgroup, plus: every test of a listed module is in one work unit (the module's path)."""

        def __init__(self, config, log=None):
            super().__init__(config, log)
            self.modules = frozenset(config.getini("one_worker_modules"))

        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            if path.rsplit("/", 1)[-1] in self.modules:
                return path
            return super()._split_scope(nodeid)


@pytest.hookimpl(tryfirst=True, optionalhook=True)  # optional: xdist may be absent or disabled
def pytest_xdist_make_scheduler(config, log):
    if LoadGroupScheduling is None or config.getvalue("dist") != "loadgroup":
        return None
    return ModuleOnOneWorker(config, log)
