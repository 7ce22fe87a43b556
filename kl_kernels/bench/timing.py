"""A small, honest timer: warm-up, then repeats until a count or a time budget; median and min."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch


@dataclass
class Timing:
    median_ms: float
    min_ms: float
    repeats: int
    warmup: int


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(fn: Callable[[], object], device: torch.device, *, warmup: int = 2, repeats: int = 10,
            budget_s: float = 3.0) -> Timing:
    """Time ``fn()``; stops after ``repeats`` runs or once ``budget_s`` is spent (at least 3 runs)."""
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    start = time.perf_counter()
    while len(times) < repeats and (len(times) < 3 or time.perf_counter() - start < budget_s):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return Timing(statistics.median(times), min(times), len(times), warmup)
