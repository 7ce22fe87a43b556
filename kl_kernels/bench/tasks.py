"""The tasks of ``kl-kernels bench``: what runs, in which order, and how long a run may take.

A task is registered by name with :func:`register` (one line below, :data:`TASKS`); its function is named as
``"module:function"`` and imported only when the task runs, so ``import kl_kernels.bench.tasks`` stays cheap.

Two kinds of task:

* ``"table"``: ``fn(ctx) -> list[dict]``: rows of same-bytes tables (``contenders.time_rows``), for every size in
  ``ctx.sizes``; they go to ``results.json`` / ``results.csv``, and run under each allocator setting.
* ``"result"``: ``fn(ctx) -> list[dict]``: result dicts, each written to ``<out>/<file>``:
  ``{"file": "<name>.json", "title": str, "rows": [row, ...], "baseline": str, "compile": str | None}`` where a
  row is ``{"contender": str, "ms": float, "min_ms": float, "round_ms": [float, ...], "peak_extra_mib": float,
  "ours": bool, "error": str, "flag": str}`` (``ms`` and ``contender`` required, or ``error``: why it did not run).
  ``baseline``/``compile`` name the rows the speed-ups are taken against. Result tasks run once (tuned malloc
  under ``--malloc both``), after the table tasks.

:func:`plan` decides sizes, rounds and per-contender budget: the default run is sized to take about two minutes
on a 2-core machine; ``--full`` is the long run (medium and large, both allocators, 30 rounds, the log-prob
tasks at their large sizes, each contender in its own process).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable


@dataclass(frozen=True)
class Task:
    name: str            # kl-kernels bench --tasks NAME
    target: str          # "module:function" (relative modules resolve under kl_kernels.bench)
    kind: str = "table"  # "table" or "result" (module doc)
    default: bool = True  # in the default run (else: with --full or when named)
    about: str = ""      # one line (kl-kernels bench --list)

    def function(self) -> Callable:
        module, _, fn = self.target.partition(":")
        if module.startswith("."):
            module = "kl_kernels.bench" + module
        return getattr(importlib.import_module(module), fn)


@dataclass
class Plan:
    """What a run times: sizes of the RLHF batches, rounds and budget per table, the log-prob sizes."""

    full: bool
    sizes: list
    repeats: int          # rounds per table (each round times every contender once)
    budget_s: float       # seconds per contender a table may spend (at least 3 rounds)
    malloc: str           # "both", "default" or "tuned"
    logprobs_size: tuple  # (N, V) of token_logprobs
    hidden_size: tuple    # (N, H, V) of the hidden-state path
    own_process: bool     # log-prob contenders each in its own process (clean memory peaks)
    with_compile: bool = True
    retime: bool = True   # re-time a table once where a row reads above its same-bytes copy
    quick: bool = False   # the smoke run: no torch.compile of the log-prob steps (its compile outlasts the rest)


@dataclass
class Context:
    """What a task function gets."""

    plan: Plan
    device: object        # torch.device
    dtype: object         # torch.dtype
    seed: int
    out: Path
    copy_gbs: float       # the machine's copy bandwidth measured at the start (GB/s)
    progress: Callable[[str], None] = field(default=lambda msg: None)

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).replace("torch.", "")

    def per_size(self, run: Callable, **extra) -> list[dict]:
        """A table task's rows: ``run(batch, copy_gbs=, repeats=, budget_s=, progress=, retime=, **extra)`` on the
        plan's batch of each size (:func:`kl_kernels.bench.batches.cached_batch`), the rows joined."""
        from .batches import cached_batch

        rows = []
        for name in self.plan.sizes:
            batch = cached_batch(name, self.dtype, self.device, self.seed)
            rows += run(batch, copy_gbs=self.copy_gbs, repeats=self.plan.repeats, budget_s=self.plan.budget_s,
                        progress=lambda m, n=name: self.progress(f"[{n}] {m}"), retime=self.plan.retime, **extra)
        return rows


# Rounds per table in the full run (each round times every contender once, in a shuffled order), within a budget
# of 3 s per contender: a median of 10 moved by +-15% between runs on the 2-core CI VM.
FULL_REPEATS, FULL_BUDGET_S = 30, 3.0
# The default run: one size, one allocator, 10 rounds in at most 0.3 s per contender: ~2 minutes on 2 cores.
DEFAULT_REPEATS, DEFAULT_BUDGET_S = 10, 0.3


def plan(*, full: bool = False, quick: bool = False, sizes=None, malloc: str | None = None,
         with_compile: bool = True) -> Plan:
    """The run's plan. Default: ``medium`` only, glibc's default allocator (a user's process), 10 rounds,
    token_logprobs at N = 256, V = 32768 and the hidden-state path at N = 256, H = 128, V = 8192, all in this
    process. ``full``: ``medium`` and ``large``, both allocators, 30 rounds, N = 2048 log-prob sizes in own
    processes. ``quick``: ``small`` and ``medium``, 3 rounds (a smoke run). ``sizes``/``malloc`` override."""
    if full:
        p = Plan(True, ["medium", "large"], FULL_REPEATS, FULL_BUDGET_S, "both", (2048, 32768), (2048, 512, 32768),
                 True)
    elif quick:
        p = Plan(False, ["small", "medium"], 3, 0.2, "default", (256, 8192), (256, 128, 4096), False, retime=False,
                 quick=True)
    else:
        p = Plan(False, ["medium"], DEFAULT_REPEATS, DEFAULT_BUDGET_S, "default", (256, 32768), (256, 128, 8192),
                 False)
    if sizes:
        p.sizes = list(sizes)
    if malloc:
        p.malloc = malloc
    p.with_compile = with_compile
    return p


TASKS: dict[str, Task] = {}


def register(task: Task) -> Task:
    """Add (or replace) a task; the order of registration is the order of the run."""
    if task.kind not in ("table", "result"):
        raise ValueError(f"task {task.name!r}: kind must be 'table' or 'result', got {task.kind!r}")
    TASKS[task.name] = task
    return task


def selected(names=None, *, full: bool = False, device_type: str = "cpu") -> list[Task]:
    """The tasks of a run: ``names`` in registration order, else every default task (every task with ``full``)."""
    if names:
        unknown = [n for n in names if n not in TASKS]
        if unknown:
            raise ValueError(f"unknown task(s) {unknown}; choose from {list(TASKS)}")
        return [t for t in TASKS.values() if t.name in names]
    return [t for t in TASKS.values() if full or t.default]


register(Task("kl_reward", ".kl_reward:run_task", about="kl_reward against TorchRL's and verl's math, eager and "
              "compiled, and TorchRL's KLComputation"))
register(Task("torchrl", ".torchrl_transforms:run_task", about="whole TorchRL transform calls: kl_kernels.torchrl "
              "against TorchRL 0.14's classes (needs torchrl)"))
register(Task("kl_penalty", ".kl_penalty:run_task", about="verl's PPO actor loss, forward + backward"))
register(Task("token_logprobs", ".logprob_tasks:token_logprobs", kind="result",
              about="log-probs and entropy from logits, forward + backward: time and peak memory"))
register(Task("hidden_states", ".logprob_tasks:hidden_states", kind="result",
              about="log-probs and the GRPO loss from hidden states (CPU): time and peak memory"))
# Other helpers' tasks: one register(...) line each, below.
register(Task("trl", ".trl_grpo:run_task", kind="result", about="TRL GRPOTrainer's micro-batch step from hidden "
              "states (policy + reference): TRL's fused LM head and loss against kl_kernels', time and peak memory"))
