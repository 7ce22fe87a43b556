"""Shared test configuration: hypothesis profiles and GPU markers."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import torch

# Without a GPU, Triton kernels run under Triton's interpreter on CPU tensors. The switch must be
# set before triton is imported (torch._dynamo, and so kl_kernels, import it), hence here, first.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))  # tests/oracle.py, batches.py, tolerances.py

# The xdist scheduler that keeps each module of pyproject's one_worker_modules on one worker (its
# docstring says why xdist's own xdist_group marks are not enough); hooks are found by name here.
from xdist_once import pytest_addoption, pytest_xdist_make_scheduler  # noqa: E402,F401

# Triton's interpreter scans with a combine function of ours element by element in Python: most of the
# suite's time until tests/triton_interpreter.py vectorized it (the same combine function, in log2(n) steps).
if os.environ.get("TRITON_INTERPRET") == "1":
    import triton_interpreter  # noqa: E402

    triton_interpreter.install()

# Bounded example counts keep CI short; KL_KERNELS_HYPOTHESIS=thorough explores more locally.
settings.register_profile("ci", max_examples=40, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("thorough", max_examples=400, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile(os.environ.get("KL_KERNELS_HYPOTHESIS", "ci"))

REPO = Path(__file__).resolve().parents[1]


def triton_device() -> str | None:
    """Where the triton backend runs here: "cuda", "cpu" (interpreter), or None (it cannot)."""
    if importlib.util.find_spec("triton") is None:
        return None
    if os.environ.get("TRITON_INTERPRET") == "1":
        return "cpu"
    return "cuda" if torch.cuda.is_available() else None


def backend_device(backend: str) -> str:
    """Where a test puts the inputs of ``backend``: Triton on the GPU when there is one (its CPU
    interpreter otherwise), cuda on the GPU, everything else on the CPU."""
    if backend == "triton":
        return triton_device() or "cpu"
    return "cuda" if backend == "cuda" else "cpu"


def cuda_emulated_reason() -> str | None:
    """Why the cuda-emulated backend (kl_kernels._cuda_emu) cannot run here, or None."""
    from kl_kernels import _extensions

    return _extensions.kernel("_cuda_emu", "kl_reward_forward")[1]


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda_emulated: runs the CUDA kernels under host emulation "
                                       "(kl_kernels._cuda_emu; skipped when it is not built)")
    config.addinivalue_line("markers", "torchrl: needs the `torchrl` extra (torchrl and tensordict)")


def torchrl_missing() -> str | None:
    """Which of the `torchrl` extra's packages is not installed here, or None."""
    return next((m for m in ("tensordict", "torchrl") if importlib.util.find_spec(m) is None), None)


def pytest_collection_modifyitems(config, items):
    """GPU, Triton and emulated-CUDA tests skip through their markers, never at import time."""
    emulated_reason = cuda_emulated_reason() if any(i.get_closest_marker("cuda_emulated") for i in items) else None
    skip_emulated = pytest.mark.skip(reason=f"cuda-emulated backend unavailable: {emulated_reason}")
    skip_cuda = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
    skip_triton = pytest.mark.skip(reason="triton backend unusable here: triton not installed, or no GPU and "
                                          "TRITON_INTERPRET is not 1")
    for item in items:
        # get_closest_marker, not item.keywords: parametrize ids like [cuda] are keywords too
        if item.get_closest_marker("cuda") is not None and not torch.cuda.is_available():
            item.add_marker(skip_cuda)
        if item.get_closest_marker("triton") is not None and triton_device() is None:
            item.add_marker(skip_triton)
        if emulated_reason is not None and item.get_closest_marker("cuda_emulated") is not None:
            item.add_marker(skip_emulated)
        if item.get_closest_marker("torchrl") is not None and torchrl_missing():
            item.add_marker(pytest.mark.skip(reason=f"the `torchrl` extra is not installed ({torchrl_missing()} "
                                                    "missing): pip install 'kl_kernels[torchrl]'"))
    # The few slow tests first (stable: the rest keep their order), so that pytest-xdist starts them
    # early instead of ending the run on one of them (the wheel build alone takes ~4 minutes) while
    # the other workers idle.
    items[:] = sorted(items, key=lambda i: i.get_closest_marker("slow") is None)


def pytest_runtest_logreport(report):
    """With ``KL_TESTS_FAILURE_LOG`` set, append each failure's traceback to that file as it happens
    (.ci/gpu: a suite stopped by its time limit never reaches pytest's own failure report)."""
    path = os.environ.get("KL_TESTS_FAILURE_LOG")
    if path and report.failed and "PYTEST_XDIST_WORKER" not in os.environ:  # xdist: the controller's copy only
        with open(path, "a") as f:
            f.write(f"=== {report.nodeid} ({report.when})\n{report.longreprtext}\n\n")


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def device(request):
    return torch.device(request.param)


# The backend name of the CUDA kernels under host emulation, as a parameter of backend lists.
CUDA_EMULATED = pytest.param("cuda-emulated", marks=pytest.mark.cuda_emulated)
