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


def pytest_collection_modifyitems(config, items):
    """GPU and Triton tests skip through their markers, never at import time."""
    skip_cuda = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
    skip_triton = pytest.mark.skip(reason="triton backend unusable here: triton not installed, or no GPU and "
                                          "TRITON_INTERPRET is not 1")
    for item in items:
        # get_closest_marker, not item.keywords: parametrize ids like [cuda] are keywords too
        if item.get_closest_marker("cuda") is not None and not torch.cuda.is_available():
            item.add_marker(skip_cuda)
        if item.get_closest_marker("triton") is not None and triton_device() is None:
            item.add_marker(skip_triton)


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def device(request):
    return torch.device(request.param)
