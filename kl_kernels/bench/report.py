"""Render and store benchmark results: a table per size, JSON, CSV and (with matplotlib) a PNG."""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

from .contenders import is_copy

COLUMNS = [
    ("impl", "implementation", "{}"),
    ("layout", "layout", "{}"),
    ("median_ms", "ms", "{:.3f}"),
    ("mtokens_per_s", "Mtok/s", "{:.1f}"),
    ("gbs", "GB/s", "{:.2f}"),
    ("pct_copy_bw", "% copy BW (p10-p90)", "{:.0f}%"),
    ("x_vs_baseline", "x baseline (p10-p90)", "{:.1f}x"),
    ("x_vs_compile", "x compile (p10-p90)", "{:.2f}x"),
    ("compile_s", "compile s", "{:.1f}"),
    ("page_faults_per_call", "faults/call", "{:.0f}"),
]
# Ratios shown with the spread of the same ratio round by round (contenders.py): the number format
# of the percentiles, without the unit.
RANGES = {"pct_copy_bw": "{:.0f}", "x_vs_baseline": "{:.1f}", "x_vs_compile": "{:.2f}"}
# Per-round times stay in the JSON; a CSV cell holds one number.
CSV_SKIP = ("round_ms",)


def _fmt(fmt: str, value) -> str:
    return "-" if value is None else fmt.format(value)


def _cell(row: dict, key: str, fmt: str) -> str:
    text = _fmt(fmt, row.get(key))
    lo, hi = row.get(f"{key}_p10"), row.get(f"{key}_p90")
    # (a copy's % of itself is 100 in every round: no spread to show)
    if key in RANGES and row.get(key) is not None and lo is not None and not is_copy(row):
        text += f" ({RANGES[key].format(lo)}-{RANGES[key].format(hi)})"
    return text


def table(rows: list[dict], title: str) -> str:
    """A plain-text table (always available; rich is only used for the live display)."""
    head = [label for _, label, _ in COLUMNS]
    body = [[_cell(r, key, fmt) for key, _, fmt in COLUMNS] for r in rows]
    widths = [max(len(h), *(len(row[i]) for row in body)) for i, h in enumerate(head)]
    line = lambda cells: "  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))  # noqa: E731
    out = [title, line(head), line(["-" * w for w in widths])]
    out += [line(row) for row in body]
    return "\n".join(out)


def print_tables(rows: list[dict], machine: dict, copy_gbs: float) -> None:
    """Plain text on purpose: rich would re-wrap wide tables to the terminal width."""
    print(f"\nkl_kernels {machine['kl_kernels']} | torch {machine['torch']} | {machine.get('gpu') or machine['cpu']} | "
          f"{machine['torch_threads']} threads | measured copy bandwidth {copy_gbs:.1f} GB/s (256 MiB, best of 7) | "
          f"malloc: {machine['malloc']}")
    print("% copy BW: GB/s over that of 'copy (same bytes)', a dst.copy_(src) moving the bytes counted for the "
          "row's layout, timed in the same shuffled rounds")
    print("(p10-p90): the 10th and 90th percentiles of the same ratio taken round by round (both timed in every "
          "round); the headline is the ratio of the medians")
    for size, task in dict.fromkeys((r["size"], r["task"]) for r in rows):
        sel = [r for r in rows if r["size"] == size and r["task"] == task]
        r0 = sel[0]
        print(table(sel, f"\n{task}, {size}: B={r0['batch']}, {r0['tokens']:,} tokens ({r0['padded_elems']:,} padded), "
                         f"{r0['dtype']}; baseline: {r0['baseline']}; malloc: {r0.get('malloc', machine['malloc'])}"))


def write(rows: list[dict], machine: dict, copy_gbs: float, out_dir: Path) -> list[Path]:
    """results.json (machine + rows), results.csv and results.png (when matplotlib is present)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / "results.json", out_dir / "results.csv"]
    paths[0].write_text(json.dumps({"machine": machine, "copy_bandwidth_gbs": copy_gbs, "rows": rows}, indent=2))
    with paths[1].open("w", newline="") as f:
        fields = [k for k in rows[0] if k not in CSV_SKIP] if rows else []
        writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    png = _plot(rows, machine, copy_gbs, out_dir / "results.png")
    if png:
        paths.append(png)
    return paths


def _plot(rows, machine, copy_gbs, path: Path) -> Path | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no PNG plot (pip install 'kl_kernels[bench]')", file=sys.stderr)
        return None
    panels = list(dict.fromkeys((r["size"], r["task"]) for r in rows))
    # A grid a person reads at a glance: one row per task, one column per size (8 panels in one strip
    # made a 5280 x 495 image).
    tasks = list(dict.fromkeys(task for _, task in panels))
    sizes = list(dict.fromkeys(size for size, _ in panels))
    fig, axes = plt.subplots(len(tasks), len(sizes), figsize=(6.5 * len(sizes), 3.6 * len(tasks)), squeeze=False)
    for ax in axes.flat:
        ax.set_visible(False)
    for size, task in panels:
        ax = axes[tasks.index(task)][sizes.index(size)]
        ax.set_visible(True)
        sel = [r for r in rows if r["size"] == size and r["task"] == task]
        labels = [f"{r['impl']}\n({r['layout']}{', ' + r['malloc'] if 'malloc' in r else ''})" for r in sel]
        ax.barh(labels, [r["gbs"] for r in sel], color="tab:blue")
        ax.axvline(copy_gbs, color="tab:red", linestyle="--", label=f"copy {copy_gbs:.1f} GB/s")
        ax.set_xlabel("GB/s (minimal bytes moved / median time)")
        ax.set_title(f"{task}\n{size}: B={sel[0]['batch']}, {sel[0]['tokens']:,} tokens", fontsize=9)
        ax.legend(loc="lower right")
        ax.tick_params(axis="y", labelsize=7)
    fig.suptitle(f"kl_reward | {machine.get('gpu') or machine['cpu']} | torch {machine['torch']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
