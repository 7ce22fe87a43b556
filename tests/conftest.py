"""Shared test configuration: hypothesis profiles and GPU markers."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings

sys.path.insert(0, str(Path(__file__).parent))  # tests/oracle.py, batches.py, tolerances.py

# Bounded example counts keep CI short; KL_KERNELS_HYPOTHESIS=thorough explores more locally.
settings.register_profile("ci", max_examples=40, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("thorough", max_examples=400, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile(os.environ.get("KL_KERNELS_HYPOTHESIS", "ci"))

REPO = Path(__file__).resolve().parents[1]


def pytest_collection_modifyitems(config, items):
    """GPU tests skip through their marker, never at import time."""
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
        for item in items:
            if item.get_closest_marker("cuda") is not None:  # not item.keywords: ids like [cuda] are keywords too
                item.add_marker(skip)


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def device(request):
    return torch.device(request.param)
