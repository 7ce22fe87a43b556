"""Which benchmark rows are not to be read as fact, and why: the ``flag`` field of a row (None: nothing seen).

A row is flagged when

* it reads above 100 % of the same-bytes copy timed in the same rounds (``pct_copy_bw``): an op that must move
  those bytes cannot beat a copy of them. Where it happens anyway the cause is known: the fused CPU kernels write
  large outputs with streaming stores (no read of each destination line first), which ``torch``'s ``copy_`` does
  not, so the copy moves up to 1.5x the bytes it is counted for; on a shared machine the copy may also have hit a
  slow phase the row missed. The table is re-timed once first (``contenders.time_rows``);
* its rounds spread more than :data:`SPREAD` x (the 90th over the 10th percentile of its per-round times): a
  shared machine's scheduler (a 2-thread kernel waits a time slice for a descheduled thread: a 0.1 ms call takes
  5-10 ms in such rounds), so its median depends on how many rounds were hit;
* its table's same-bytes copy ran at under :data:`LOADED` of the machine's copy bandwidth measured at the start:
  a loaded machine, the whole table's times are inflated;
* under ``--malloc both``: its median differs more than :data:`ALLOCATORS` x between the two allocator runs
  while its page faults per call do not explain it.

:func:`mark` is the table mark of a flagged cell (``!``); :func:`describe` is the flag's text.
"""

from __future__ import annotations

import statistics

SPREAD = 2.0       # p90 / p10 of a row's per-round times above this: flagged
LOADED = 0.25      # a same-bytes copy under this fraction of the machine's copy bandwidth: a loaded machine
ALLOCATORS = 4.0   # the same row's medians under the two allocators differing more than this, faults aside
ABOVE = 100.0      # % of the same-bytes copy
MARK = "!"
COPY = "copy (same bytes)"


def add(row: dict, reason: str) -> None:
    """Append ``reason`` to ``row['flag']`` (reasons joined by "; ", each once)."""
    have = [r for r in (row.get("flag") or "").split("; ") if r]
    if reason not in have:
        have.append(reason)
    row["flag"] = "; ".join(have) or None


def spread(times) -> float | None:
    """p90 / p10 of ``times`` (None with fewer than 3 or a zero p10)."""
    times = [t for t in (times or []) if t is not None]
    if len(times) < 3:
        return None
    cuts = statistics.quantiles(times, n=10, method="inclusive")
    return cuts[-1] / cuts[0] if cuts[0] > 0 else None


def above_copy(row: dict) -> bool:
    pct = row.get("pct_copy_bw")
    return row.get("impl") != COPY and pct is not None and pct > ABOVE


def flag_table(rows: list[dict], machine_copy_gbs: float | None = None) -> None:
    """Set ``flag`` on the rows of one table (one task, size and allocator; its copy rows included)."""
    copies = {r["layout"]: r for r in rows if r.get("impl") == COPY}
    for r in rows:
        r.setdefault("flag", None)
        s = spread(r.get("round_ms"))
        if s is not None and s > SPREAD:
            add(r, f"rounds spread {s:.1f}x (p90/p10 of its per-round ms)")
        if above_copy(r):
            add(r, f"{r['pct_copy_bw']:.0f}% of a same-bytes copy" + (" after a re-time" if r.get("retimed") else "")
                + " (a loaded machine's noise, or a kernel's streamed stores and fills, which skip the read of each "
                  "line a copy's stores make)")
        # (a copy expected to take under 50 us at the machine's bandwidth is call overhead, not bandwidth)
        if r.get("impl") == COPY and machine_copy_gbs and r.get("gbs") and r["gbs"] < LOADED * machine_copy_gbs \
                and r.get("mbytes", 0) * 1e6 / (machine_copy_gbs * 1e9) >= 50e-6:
            add(r, f"the copy ran at {r['gbs']:.1f} GB/s, under {LOADED:.0%} of the machine's {machine_copy_gbs:.1f}: "
                   "a loaded machine")
    for r in rows:
        copy = copies.get(r.get("layout"))
        if r.get("impl") == COPY or copy is None or not copy.get("flag"):
            continue
        if "a loaded machine" in copy["flag"]:  # the whole table ran slow: its times too, not only its % copy
            add(r, f"a loaded machine: its table's same-bytes copy ran at {copy['gbs']:.1f} GB/s, under "
                   f"{LOADED:.0%} of the machine's {machine_copy_gbs:.1f}")
        elif r.get("pct_copy_bw") is not None:
            add(r, "its % copy rests on a flagged copy")


def flag_result(result: dict) -> None:
    """Set ``flag`` on the rows of a log-prob result (``round_ms`` spread; above its own copy floor)."""
    for r in result.get("rows", []):
        if "ms" not in r:
            continue
        r.setdefault("flag", None)
        s = spread(r.get("round_ms"))
        if s is not None and s > SPREAD:
            add(r, f"rounds spread {s:.1f}x (p90/p10 of its per-round ms)")
        if r.get("floor_ms") and r["ms"] < r["floor_ms"]:
            add(r, f"faster than the copy floor timed in its rounds ({100 * r['floor_ms'] / r['ms']:.0f}%)")


def flag_allocators(rows: list[dict]) -> None:
    """``--malloc both``: flag a row whose median differs more than :data:`ALLOCATORS` x from the same row under
    the other allocator while its page faults per call are alike (the allocator's own effect shows as faults)."""
    by = {}
    for r in rows:
        by.setdefault((r["task"], r["size"], r["impl"], r["layout"]), []).append(r)
    for pair in by.values():
        if len(pair) != 2 or not all(r.get("median_ms") for r in pair):
            continue
        slow, fast = sorted(pair, key=lambda r: -r["median_ms"])
        ratio = slow["median_ms"] / fast["median_ms"]
        faults = (slow.get("page_faults_per_call") or 0) - (fast.get("page_faults_per_call") or 0)
        if ratio > ALLOCATORS and faults < 50:
            for r in pair:
                add(r, f"{ratio:.1f}x apart under the two allocators ({fast['median_ms']:.3g} vs "
                       f"{slow['median_ms']:.3g} ms) with alike page faults: the machine, not the allocator")


def mark(row: dict, cell: str = "ms") -> str:
    """The mark of a flagged row's cell: ``cell="pct"`` for its % copy (reasons about the copy), ``"ms"`` for
    its time (every other reason)."""
    reasons = [r for r in (row.get("flag") or "").split("; ") if r]
    about_copy = [r for r in reasons if any(k in r for k in ("of a same-bytes copy", "flagged copy", "copy floor"))]
    return MARK if (about_copy if cell == "pct" else [r for r in reasons if r not in about_copy]) else ""
