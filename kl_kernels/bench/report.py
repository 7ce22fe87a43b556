"""Render and store benchmark results: a short summary on screen (one compact table per task and size),
the full tables in ``tables.txt``, every number in JSON and CSV, and (with matplotlib) a PNG.

``python -m kl_kernels.bench.report DIR`` prints the summary and redraws ``DIR/results.png`` from a results
folder written by ``kl-kernels bench`` (``results.json``, and ``token_logprobs.json`` /
``hidden_states_*.json`` when present)."""

from __future__ import annotations

import csv
import json
import sys
import textwrap
from pathlib import Path

from .contenders import COPY, is_copy

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


# ------------------------------------------------------------------ the short summary (kl-kernels bench's screen)

# Contenders that are kl_kernels' fused paths (the [torch] rows are its reference math, the fallback): a summary
# note says when one of them is slower than a contender that is not ours.
_OURS = ("[cpu]", "[cuda]", "[triton]", "kl_kernels.torchrl.")
# Floors (what the task costs with no math) are references, not contenders.
_NOT_CONTENDERS = (COPY, "per-sample floor (no math)", "floor: 1.5 x copy (same bytes)")
# Why one of ours is slower than a contender, where the cause is known (substring of ours, of the other).
KNOWN_REASONS = [
    ("linear_token_logprobs[", "", "it never holds the [N, V] logits, so backward forms each chunk's logits again: "
                                   "4 N x H x V matmuls against 3 for eager or compile; what it buys is peak memory"),
    ("linear_kl_penalty_loss[cpu] two passes", "", "two passes form the logits twice more than one pass does "
                                                   "(one_pass=False is the fallback, not the default)"),
    ("kl_kernels.torchrl.KLRewardTransform (list)", "", "per-sample (list) storage: reading and writing B lazily "
                                                        "stacked TensorDicts costs more than the math"),
]
# Below this many ms per call a difference is mostly fixed per-call cost (argument checks, dispatch, output
# allocation: tens of microseconds) and the noise of a shared machine.
SMALL_MS = 1.0
WIDTH = 100  # characters per summary row


def _ours(name: str) -> bool:
    return any(tag in name for tag in _OURS)


def _ratio(a, b):
    return None if a is None or b is None or not b else a / b


def _num(value, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


def _ms(value) -> str:
    """Three significant digits, no exponent: 0.382, 17.5, 4653."""
    if value is None:
        return "-"
    return f"{value:.3f}" if value < 1 else f"{value:.2f}" if value < 10 else f"{value:.1f}" if value < 100 else \
        f"{value:.0f}"


def _grid(head: list[str], body: list[list[str]]) -> list[str]:
    """Rows of cells: the first column left-aligned, the others right-aligned, two spaces apart."""
    widths = [max(len(h), *(len(r[i]) for r in body)) if body else len(h) for i, h in enumerate(head)]
    fmt = lambda cells: "  ".join(c.ljust(w) if i == 0 else c.rjust(w)  # noqa: E731
                                  for i, (c, w) in enumerate(zip(cells, widths))).rstrip()
    return [fmt(head)] + [fmt(r) for r in body]


def _short(text: str, width: int) -> str:
    return text if len(text) <= width else text[:width - 3] + "..."


def table_rows(rows: list[dict], other: list[dict] | None = None) -> list[dict]:
    """The summary's rows of the task tables (``results.json``'s rows of one allocator run; ``other``: the same
    tables under the other allocator, for its ms): one dict per contender with ``name``, ``ms``, ``ms_other``,
    ``x_eager``, ``x_compile``, ``pct_copy``, ``table`` (title) and ``eager`` (the table's baseline)."""
    other_ms = {(r["task"], r["size"], r["impl"], r["layout"]): r["median_ms"] for r in other or []}
    out = []
    for r in rows:
        if is_copy(r):
            continue
        title = (f"{_task_name(r['task'])}, {r['size']}: B={r['batch']}, {r['tokens']:,} tokens, {r['dtype']}")
        layout = r["layout"].split(" (")[0]  # "list (KLComputation)": the name says KLComputation already
        out.append(dict(table=title, eager=r.get("baseline"), name=f"{r['impl']} ({layout})", ms=r["median_ms"],
                        ms_other=other_ms.get((r["task"], r["size"], r["impl"], r["layout"])),
                        x_eager=r.get("x_vs_baseline"), x_compile=r.get("x_vs_compile"), pct_copy=r.get("pct_copy_bw"),
                        layout=r["layout"], impl=r["impl"], task=r["task"], size=r["size"]))
    return out


def _task_name(task: str) -> str:
    return {"KLRewardTransform task": "kl_reward (TorchRL's KLRewardTransform math)",
            "TorchRL KLComputation task": "kl_reward vs TorchRL KLComputation",
            "TorchRL transform call task": "TorchRL transforms, whole call"}.get(
        task, "kl_penalty_loss (verl PPO actor loss, fwd+bwd)" if task.startswith("verl PPO") else task)


def logprob_rows(result: dict, title: str) -> list[dict]:
    """The summary's rows of a token_logprobs or hidden-state result (``rows`` of contender, ms, peak): speed-ups
    over its ``eager``/``eager loss`` and ``compile`` rows, % of its copy floor where it has one."""
    rows = [r for r in result["rows"] if "ms" in r or "error" in r]
    by = {r["contender"]: r.get("ms") for r in rows}
    eager = by.get("eager", by.get("eager loss"))
    floor = next((r["ms"] for r in rows if r["contender"].startswith("floor")), None)
    out = []
    for r in rows:
        if r["contender"].startswith("floor"):
            continue
        ms = r.get("ms")
        out.append(dict(table=title, eager="eager" if "eager" in by else "eager loss", name=r["contender"], ms=ms,
                        ms_other=None, x_eager=_ratio(eager, ms), x_compile=_ratio(by.get("compile"), ms),
                        pct_copy=None if floor is None or ms is None else 100 * floor / ms,
                        peak_mib=r.get("peak_extra_mib"), error=r.get("error"), impl=r["contender"], layout="",
                        task=title, size=""))
    return out


def summary_lines(groups: list[dict], other_label: str | None = None) -> list[str]:
    """One compact table per group (``table``/``eager`` of its rows), then the notes: each of ours that is
    slower than a contender that is not ours, and why where known."""
    lines, notes, not_run = [], [], []
    for title in dict.fromkeys(g["table"] for g in groups):
        sel = [g for g in groups if g["table"] == title]
        peak = any(g.get("peak_mib") is not None for g in sel)
        head = ["contender", "ms"] + ([other_label] if other_label and any(g["ms_other"] for g in sel) else [])
        head += ["x eager", "x compile", "% copy"] + (["peak MiB"] if peak else [])
        body = []
        for g in sel:
            if g.get("error"):  # (its reason below the tables: a long cell would widen the ms column)
                body.append([_short(g["name"], 46), "not run"] + [""] * (len(head) - 2))
                not_run.append(f"- {_short(title, 40)}: {g['name']}: {g['error']}")
                continue
            cells = [_short(g["name"], 46), _ms(g["ms"])]
            if len(head) > (5 + peak):
                cells.append(_ms(g["ms_other"]))
            cells += [_num(g["x_eager"], "{:.1f}x"), _num(g["x_compile"], "{:.2f}x"), _num(g["pct_copy"], "{:.0f}%")]
            cells += [_num(g.get("peak_mib"), "{:.0f}")] if peak else []
            body.append(cells)
        lines += ["", _short(title, WIDTH)] + _grid(head, body)
        notes += _slower(sel)
    if notes:
        lines += ["", "Where one of ours is slower than another contender:"] + notes
    if not_run:
        lines += ["", "Not run here:"] + [_short(line, WIDTH) for line in not_run]
    return lines


def _slower(sel: list[dict]) -> list[str]:
    """A note per kl_kernels row slower than a contender that is not ours in the same table (same layout, or
    the table's eager baseline), with the reason where it is known."""
    notes = []
    others = [g for g in sel if not _ours(g["name"]) and g.get("ms") and not g["impl"].startswith(_NOT_CONTENDERS)
              and "[torch]" not in g["name"]]
    for g in sel:
        if not _ours(g["impl"]) or not g.get("ms"):
            continue
        faster = [o for o in others if o["ms"] < g["ms"] and (o["layout"] == g["layout"] or o["impl"] == g["eager"])]
        if not faster:
            continue
        best = min(faster, key=lambda o: o["ms"])
        why = next((r for mine, theirs, r in KNOWN_REASONS if mine in g["name"] and theirs in best["name"]),
                   "likely per-call overhead at a sub-millisecond size, and a noisy machine" if g["ms"] < SMALL_MS
                   else "cause not known")
        where = g["table"].split(", N=")[0].split(":")[0]
        notes.append(_wrap(f"- {where}: {g['name']} {_ms(g['ms'])} ms vs {best['name']} {_ms(best['ms'])} ms: {why}"))
    return notes


def _wrap(text: str) -> str:
    return "\n".join(textwrap.wrap(text, WIDTH, subsequent_indent="  "))


def write(rows: list[dict], machine: dict, copy_gbs: float, out_dir: Path) -> list[Path]:
    """results.json (machine + rows), results.csv and tables.txt (every column of every table). The PNG and
    the summary come from the whole folder (:func:`finish`), once the log-prob results are there too."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / "results.json", out_dir / "results.csv", out_dir / "tables.txt"]
    paths[0].write_text(json.dumps({"machine": machine, "copy_bandwidth_gbs": copy_gbs, "rows": rows}, indent=2))
    with paths[1].open("w", newline="") as f:
        fields = [k for k in rows[0] if k not in CSV_SKIP] if rows else []
        writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    paths[2].write_text(full_tables(rows, machine, copy_gbs) + "\n")
    return paths


def full_tables(rows: list[dict], machine: dict, copy_gbs: float) -> str:
    """Every column of every table (with the p10-p90 spreads), one table per task, size and allocator."""
    out = [f"kl_kernels {machine['kl_kernels']} | torch {machine['torch']} | {machine.get('gpu') or machine['cpu']} | "
           f"{machine['torch_threads']} threads | measured copy bandwidth {copy_gbs:.1f} GB/s | malloc: "
           f"{machine['malloc']}",
           "% copy BW: GB/s over that of 'copy (same bytes)', a dst.copy_(src) moving the bytes counted for the "
           "row's layout, timed in the same shuffled rounds",
           "(p10-p90): the 10th and 90th percentiles of the same ratio taken round by round (both timed in every "
           "round); the headline is the ratio of the medians"]
    for size, task, malloc in dict.fromkeys((r["size"], r["task"], r.get("malloc")) for r in rows):
        sel = [r for r in rows if r["size"] == size and r["task"] == task and r.get("malloc") == malloc]
        r0 = sel[0]
        out.append(table(sel, f"\n{task}, {size}: B={r0['batch']}, {r0['tokens']:,} tokens ({r0['padded_elems']:,} "
                              f"padded), {r0['dtype']}; baseline: {r0['baseline']}; malloc: {malloc}"))
    return "\n".join(out)


def print_tables(rows: list[dict], machine: dict, copy_gbs: float) -> None:
    """The full tables on stdout (``kl-kernels bench --details``)."""
    print(full_tables(rows, machine, copy_gbs))


TUNED = "ms tuned"
LEGEND = [
    "ms: median per call; a table's contenders alternate in shuffled rounds (noise hits them alike).",
    "x eager, x compile: speed-up over the table's eager baseline (its row: 1.0x) and over torch.compile.",
    "% copy: bandwidth as % of a same-bytes memory copy timed alongside (100% = as fast as memory goes).",
]
_MALLOC_LINE = ("ms = glibc's default allocator (what your process has; ratios use it); ms tuned = freed memory kept "
                "mapped (mmap threshold 32 MiB, no trim): the gap is page faults on temporaries.")
_LOGPROBS = (("token_logprobs.json", "token_logprobs (log-probs + entropy from logits, fwd+bwd)"),
             ("hidden_states_logprobs.json", "linear_token_logprobs (from hidden states, fwd+bwd)"),
             ("hidden_states_loss.json", "GRPO loss step from hidden states (fwd+bwd)"))


def load_groups(out_dir: Path) -> tuple[list[dict], dict, str | None]:
    """Every summary row of a results folder, its machine facts, and the label of the second allocator's ms
    column (None when it holds one allocator's run)."""
    groups, machine, other_label = [], {}, None
    path = out_dir / "results.json"
    if path.exists():
        data = json.loads(path.read_text())
        machine = data["machine"]
        rows = data["rows"]
        mallocs = list(dict.fromkeys(r.get("malloc") for r in rows))
        first = [r for r in rows if r.get("malloc") == mallocs[0]]
        second = [r for r in rows if len(mallocs) > 1 and r.get("malloc") == mallocs[1]]
        other_label = TUNED if second else None
        groups += table_rows(first, second)
    for name, what in _LOGPROBS:
        path = out_dir / name
        if not path.exists():
            continue
        result = json.loads(path.read_text())
        r0 = next((r for r in result["rows"] if "n" in r), None)
        if r0 is None:
            continue
        shape = f"N={r0['n']}" + (f", H={r0['hidden']}" if "hidden" in r0 else "") + f", V={r0['vocab']}"
        groups += logprob_rows(result, f"{what}, {shape}, {r0['dtype']}")
        machine = machine or result.get("machine", {})
    return groups, machine, other_label


def summary(out_dir: Path) -> str:
    """The short report of a results folder: the machine, the legend, one compact table per task and size,
    the notes where one of ours is slower."""
    groups, machine, other_label = load_groups(out_dir)
    head = [" | ".join(str(x) for x in (
        f"kl_kernels {machine.get('kl_kernels', '?')}" + (f" ({machine['git_commit']})" if machine.get("git_commit")
                                                          else ""),
        f"torch {machine.get('torch', '?')}", machine.get("gpu") or machine.get("cpu", "?"),
        f"{machine.get('torch_threads', '?')} threads") if x)]
    malloc = machine.get("malloc")
    head += LEGEND + ([_wrap(_MALLOC_LINE)] if other_label else [f"allocator: {malloc}"] if malloc else [])
    return "\n".join(head + summary_lines(groups, other_label))


def finish(out_dir: Path) -> list[Path]:
    """summary.txt and results.png of a results folder (after every part of the bench wrote its JSON)."""
    text = summary(out_dir)
    (out_dir / "summary.txt").write_text(text + "\n")
    paths = [out_dir / "summary.txt"]
    png = plot(out_dir)
    if png:
        paths.append(png)
    return paths


def plot(out_dir: Path) -> Path | None:
    """results.png: one panel per table (task and size), a bar per contender: its speed-up over the table's
    eager baseline (log scale where they span a decade), labelled with that speed-up and its % of copy
    bandwidth (or its peak memory); kl_kernels' rows in blue, the others in grey."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FuncFormatter, NullFormatter
    except ImportError:
        print("matplotlib not installed: no PNG plot (pip install 'kl_kernels[bench]')", file=sys.stderr)
        return None
    groups, machine, _ = load_groups(out_dir)
    titles = list(dict.fromkeys(g["table"] for g in groups))
    if not titles:
        return None
    cols = 2
    rows_n = (len(titles) + cols - 1) // cols
    heights = [0.3 * max(len([g for g in groups if g["table"] == t and g.get("x_eager")]) for t in titles[i:i + cols])
               + 1.3 for i in range(0, len(titles), cols)]
    fig, axes = plt.subplots(rows_n, cols, figsize=(15, sum(heights) + 0.4), squeeze=False,
                             gridspec_kw=dict(height_ratios=heights))
    for ax in axes.flat[len(titles):]:
        ax.set_visible(False)
    for ax, title in zip(axes.flat, titles):
        sel = [g for g in groups if g["table"] == title and g.get("x_eager")][::-1]
        eager = next((g["eager"] for g in groups if g["table"] == title), "")
        xs = [g["x_eager"] for g in sel]
        ax.barh(range(len(sel)), xs, color=["tab:blue" if _ours(g["impl"]) else "0.65" for g in sel], height=0.7)
        ax.set_yticks(range(len(sel)), [_short(g["name"], 46) for g in sel], fontsize=8)
        top, low = max(xs + [1.0]), min(xs + [1.0])
        if top / low > 8:  # speed-ups spanning decades: log scale
            ax.set_xscale("log")
            ax.set_xlim(low / 1.6, top * 6)
            ax.xaxis.set_minor_formatter(NullFormatter())
        else:
            ax.set_xlim(0, top * 1.6)
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}x"))
        ax.axvline(1.0, color="black", linewidth=0.8)
        for i, g in enumerate(sel):
            label = f"{g['x_eager']:.2g}x" + (f"  {g['pct_copy']:.0f}% copy" if g.get("pct_copy") is not None else "")
            label += f"  peak {g['peak_mib']:.0f} MiB" if g.get("peak_mib") is not None else ""
            ax.text(g["x_eager"] * 1.08 if ax.get_xscale() == "log" else g["x_eager"] + top * 0.02, i, label,
                    va="center", fontsize=7.5)
        ax.set_title(textwrap.fill(title, 64) + "\n" + _short(f"speed-up over {eager}", 64), fontsize=9)
        ax.tick_params(axis="x", labelsize=8)
        ax.grid(axis="x", which="major", alpha=0.3)
    who = " | ".join(str(x) for x in (machine.get("gpu") or machine.get("cpu"), f"torch {machine.get('torch')}",
                                      machine.get("git_commit")) if x)
    fig.suptitle(f"kl-kernels bench: speed-up over eager per task (blue: kl_kernels)  |  {who}", fontsize=11)
    fig.tight_layout(rect=(0, 0, 1, 0.985))
    path = out_dir / "results.png"
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    import argparse
    parser = argparse.ArgumentParser(description="Print the summary of a kl-kernels bench results folder and "
                                                 "redraw its results.png.")
    parser.add_argument("folder", type=Path)
    args = parser.parse_args(argv)
    paths = finish(args.folder)
    print((args.folder / "summary.txt").read_text(), end="")
    print(f"\nwrote {', '.join(str(p) for p in paths)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
