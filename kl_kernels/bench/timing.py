"""A small, honest timer: warm-up, then repeats until a count or a time budget; median and min.

``measure_interleaved`` times several contenders in rounds (one call of each per round, in a
shuffled order), so that a slow phase of a shared machine hits all of them alike and their ratios
stay meaningful.
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch

from .._compat import torch as torch_compat


@dataclass
class Timing:
    median_ms: float
    min_ms: float
    repeats: int
    warmup: int
    times_ms: tuple = ()  # every timed call, in order (for measure_interleaved: one per round)


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
    return Timing(statistics.median(times), min(times), len(times), warmup, tuple(times))


def measure_interleaved(fns: list[Callable[[], object]], device: torch.device, *, warmup: int = 2,
                        repeats: int = 10, budget_s: float = 3.0) -> list[tuple[Timing, int]]:
    """Time each of ``fns`` once per round, in an order shuffled every round (seeded, so runs are
    comparable): a fixed order would always put the same predecessor before each function, and a
    call right after an allocation-heavy one finds colder caches (measured on the 2-core CI VM: +0.2
    to 0.6 ms on a 1.1 ms call). Returns (Timing, minor page faults per call) per function, in the
    order of ``fns``."""
    from .machine import minor_faults
    for fn in fns:
        for _ in range(warmup):
            fn()
    _sync(device)
    times = [[] for _ in fns]
    faults = [0] * len(fns)
    start = time.perf_counter()
    rounds = 0
    order, rng = list(range(len(fns))), random.Random(0)
    while rounds < repeats and (rounds < 3 or time.perf_counter() - start < budget_s * len(fns)):
        rng.shuffle(order)
        for i in order:
            fn = fns[i]
            f0 = minor_faults()
            t0 = time.perf_counter()
            fn()
            _sync(device)
            times[i].append((time.perf_counter() - t0) * 1e3)
            faults[i] += minor_faults() - f0
        rounds += 1
    return [(Timing(statistics.median(t), min(t), len(t), warmup, tuple(t)), f / len(t)) for t, f in zip(times, faults)]


def cold_compile_seconds(first_call: Callable[[], object], device: torch.device) -> float:
    """Run a freshly ``torch.compile``d callable once and return how long it took: its cold compile
    time. Inductor's caches are off for that call, or an earlier run's on-disk cache would answer."""
    t0 = time.perf_counter()
    with torch_compat.inductor_caches_disabled():
        first_call()
    _sync(device)
    return time.perf_counter() - t0
