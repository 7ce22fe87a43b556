"""Contenders of a benchmark table and their rows: timed side by side, with a copy of the same bytes.

Every table times its contenders in shuffled rounds (``timing.measure_interleaved``) together with
one extra contender per layout, ``copy (same bytes)``: ``dst.copy_(src)`` moving exactly the bytes
that the table counts for that layout (half read, half written). That copy is the memory-bound floor
of the op at its own working-set size, measured in the same rounds, so a slow phase of a shared
machine, or caches left cold by the contender before, hit it as they hit the op. "% copy BW" of a row
is its GB/s over that copy's GB/s. The machine's copy bandwidth measured once at the start of the run
(256 MiB, best of 7) is kept next to it in the JSON as ``pct_machine_copy_bw``: on the 2-core CI VM
that single number moved between 21 and 36 GB/s from run to run, while the ops' own GB/s moved much
less, so it made every percentage swing with it.

Each ratio (% copy BW, x baseline, x compile) is the ratio of two medians, and comes with the 10th
and 90th percentiles of the same ratio taken round by round (``<name>_p10``/``<name>_p90``): both
calls ran in every round, so a slow phase of the machine that hits them alike cancels in that round.
The spread says how far one run's headline ratio can be trusted on a noisy machine.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Callable

import torch

from .batches import RLHFBatch
from .timing import measure_interleaved

COPY = "copy (same bytes)"


@dataclass
class Contender:
    """A timed callable. ``extract`` (optional) turns what ``fn`` returns into what is checked, so
    result conversions stay out of the timed call. ``unchecked``: why the contender's results are not
    checked (a floor that computes nothing), or ``None``: they are."""

    name: str
    layout: str
    fn: Callable[[], object]
    compile_s: float | None = None
    extract: Callable[[object], tuple] | None = None
    unchecked: str | None = None
    moves_bytes: bool = True  # False: a floor that moves no tensor data (no GB/s, no % copy)


def same_bytes_copy(nbytes: int, device: torch.device) -> Callable[[], object]:
    """``dst.copy_(src)`` over two float32 buffers of ``nbytes / 2`` bytes each: it moves ``nbytes``
    counted as STREAM does (read + write)."""
    src = torch.ones(max(1, nbytes // 8), dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    return lambda: dst.copy_(src)


def time_rows(batch: RLHFBatch, task: str, candidates: list[Contender], checks: list[str],
              nbytes_of: Callable[[str], int], copy_gbs: float, repeats: int, budget_s: float, baseline: str,
              progress=None, retime: bool = True) -> list[dict]:
    """Time ``candidates`` (already checked: ``checks[i]`` says how) and a same-bytes copy per layout
    side by side; one row per candidate, then one per copy, each with its time of every round
    (``round_ms``). ``x_vs_baseline``/``x_vs_compile`` are left to the caller (:func:`set_speedup`;
    None on the copy rows). A table with a row above 100 % of its copy is timed again once (``retimed``)
    when ``retime``; then every row gets its ``flag`` (:mod:`kl_kernels.bench.flags`)."""
    from . import flags

    device = batch.lp.device
    layouts = list(dict.fromkeys(c.layout for c in candidates))
    copies = [Contender(COPY, layout, same_bytes_copy(nbytes_of(layout), device)) for layout in layouts]
    if progress:
        progress(f"{task}: timing {len(candidates)} contenders and {len(copies)} same-bytes copies in shuffled rounds")
    everyone = candidates + copies
    timings = measure_interleaved([c.fn for c in everyone], device, repeats=repeats, budget_s=budget_s)
    rows = _rows(batch, task, everyone, checks + ["not checked (a copy)"] * len(copies), timings, nbytes_of,
                 copy_gbs, baseline)
    if retime and any(flags.above_copy(r) for r in rows):
        if progress:
            progress(f"{task}: a row above its same-bytes copy: timing the table again")
        timings = measure_interleaved([c.fn for c in everyone], device, repeats=repeats, budget_s=budget_s)
        rows = _rows(batch, task, everyone, checks + ["not checked (a copy)"] * len(copies), timings, nbytes_of,
                     copy_gbs, baseline)
        for r in rows:
            r["retimed"] = True
    flags.flag_table(rows, copy_gbs)
    return rows


def _rows(batch, task, everyone, checks, timings, nbytes_of, copy_gbs, baseline) -> list[dict]:
    copies = {c.layout: t for c, (t, _) in zip(everyone, timings) if c.name == COPY}
    floor = {layout: nbytes_of(layout) / (t.median_ms * 1e-3) / 1e9 for layout, t in copies.items()}
    rows = []
    for c, check, (t, faults) in zip(everyone, checks, timings):
        nbytes = nbytes_of(c.layout) if c.moves_bytes else None
        gbs = None if nbytes is None else nbytes / (t.median_ms * 1e-3) / 1e9
        rows.append(dict(
            task=task, size=batch.size.name, batch=batch.size.batch, tokens=batch.num_tokens,
            padded_elems=batch.lp_padded.numel(), dtype=str(batch.lp.dtype).replace("torch.", ""),
            impl=c.name, layout=c.layout, median_ms=t.median_ms, min_ms=t.min_ms, repeats=t.repeats,
            mbytes=None if nbytes is None else nbytes / 1e6, gbs=gbs, copy_same_bytes_gbs=floor[c.layout],
            pct_copy_bw=None if gbs is None else 100.0 * gbs / floor[c.layout],
            pct_machine_copy_bw=None if gbs is None else 100.0 * gbs / copy_gbs,
            mtokens_per_s=batch.num_tokens / (t.median_ms * 1e-3) / 1e6,
            compile_s=c.compile_s, page_faults_per_call=faults, check=check, baseline=baseline,
            x_vs_baseline=None, x_vs_compile=None, round_ms=list(t.times_ms)))
        for name in ("x_vs_baseline", "x_vs_compile"):
            _set_range(rows[-1], name, [])
        # same bytes, so a round's % of copy bandwidth is the copy's time over the row's
        _set_range(rows[-1], "pct_copy_bw", [] if gbs is None else
                   [100.0 * a / b for a, b in zip(copies[c.layout].times_ms, t.times_ms)])
    return rows


def set_speedup(row: dict, name: str, reference: dict | None) -> None:
    """``row[name]``: how many times faster than ``reference`` (a row of the same table) the row ran,
    as the ratio of the two medians, with ``<name>_p10``/``<name>_p90`` from the ratios round by round.
    ``reference`` None: no such contender in this table (all three None)."""
    if reference is None:
        row[name] = None
        _set_range(row, name, [])
        return
    row[name] = reference["median_ms"] / row["median_ms"]
    _set_range(row, name, [a / b for a, b in zip(reference["round_ms"], row["round_ms"])])


def _set_range(row: dict, name: str, per_round: list[float]) -> None:
    """``<name>_p10``/``<name>_p90``: the 10th and 90th percentiles of ``per_round`` (None when empty)."""
    if not per_round:
        row[f"{name}_p10"] = row[f"{name}_p90"] = None
        return
    cuts = statistics.quantiles(per_round, n=10, method="inclusive") if len(per_round) > 1 else per_round * 9
    row[f"{name}_p10"], row[f"{name}_p90"] = cuts[0], cuts[-1]


def is_copy(row: dict) -> bool:
    return row["impl"] == COPY
