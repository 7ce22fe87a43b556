"""Render and store benchmark results: a short summary on screen (one line per table, then the notes: where one
of ours is slower, what is flagged, what did not run), every table in ``tables.txt``, every number in JSON and CSV,
and (with matplotlib) a PNG (:mod:`kl_kernels.bench.plot`).

``python -m kl_kernels.bench.report DIR`` prints the summary and redraws ``DIR/results.png`` from a results
folder written by ``kl-kernels bench`` (``results.json``, and the result tasks' JSON: ``token_logprobs.json``,
``hidden_states_*.json`` and any other with a ``title`` and ``rows``)."""

from __future__ import annotations

import csv
import json
import sys
import textwrap
from pathlib import Path

from . import flags
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
WIDTH = 100  # characters per summary line
SCREEN = 40  # lines of the summary at most


def _fmt(fmt: str, value) -> str:
    return "-" if value is None else fmt.format(value)


def _cell(row: dict, key: str, fmt: str) -> str:
    text = _fmt(fmt, row.get(key))
    lo, hi = row.get(f"{key}_p10"), row.get(f"{key}_p90")
    # (a copy's % of itself is 100 in every round: no spread to show)
    if key in RANGES and row.get(key) is not None and lo is not None and not is_copy(row):
        text += f" ({RANGES[key].format(lo)}-{RANGES[key].format(hi)})"
    if key in ("median_ms", "pct_copy_bw"):
        text += flags.mark(row, "ms" if key == "median_ms" else "pct") or " "
    return text


def table(rows: list[dict], title: str) -> str:
    """A plain-text table of every column; a flagged row's ms carries ``!`` and its reason follows the table."""
    head = [label for _, label, _ in COLUMNS]
    body = [[_cell(r, key, fmt) for key, _, fmt in COLUMNS] for r in rows]
    widths = [max(len(h), *(len(row[i]) for row in body)) for i, h in enumerate(head)]
    line = lambda cells: "  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))  # noqa: E731
    out = [title, line(head), line(["-" * w for w in widths])]
    out += [line(row) for row in body]
    out += [f"  {flags.MARK} {r['impl']} ({r['layout']}): {r['flag']}" for r in rows if r.get("flag")]
    return "\n".join(out)


def full_tables(rows: list[dict], machine: dict, copy_gbs: float) -> str:
    """Every column of every table (with the p10-p90 spreads), one table per task, size and allocator."""
    out = [f"kl_kernels {machine['kl_kernels']} | torch {machine['torch']} | {machine.get('gpu') or machine['cpu']} | "
           f"{machine['torch_threads']} threads | measured copy bandwidth {copy_gbs:.1f} GB/s | malloc: "
           f"{machine['malloc']}",
           "% copy BW: GB/s over that of 'copy (same bytes)', a dst.copy_(src) moving the bytes counted for the "
           "row's layout, timed in the same shuffled rounds",
           "(p10-p90): the 10th and 90th percentiles of the same ratio taken round by round (both timed in every "
           "round); the headline is the ratio of the medians",
           f"{flags.MARK}: a flagged row (its reason below the table): not to be read as a result"]
    for size, task, malloc in dict.fromkeys((r["size"], r["task"], r.get("malloc")) for r in rows):
        sel = [r for r in rows if r["size"] == size and r["task"] == task and r.get("malloc") == malloc]
        r0 = sel[0]
        out.append(table(sel, f"\n{task}, {size}: B={r0['batch']}, {r0['tokens']:,} tokens ({r0['padded_elems']:,} "
                              f"padded), {r0['dtype']}; baseline: {r0['baseline']}; malloc: {malloc}"))
    return "\n".join(out)


def print_tables(rows: list[dict], machine: dict, copy_gbs: float) -> None:
    """The full tables on stdout."""
    print(full_tables(rows, machine, copy_gbs))


# ------------------------------------------------------------------ summary rows (one dict per contender)

# Contenders that are kl_kernels' fused paths (the [torch] rows are its reference math, the fallback): a note says
# when one of them is slower than a contender that is not ours. A result row may say so itself (``ours``).
_OURS = ("[cpu]", "[cuda]", "[triton]", "kl_kernels.torchrl.", "inside torch.compile")
# Floors (what the task costs with no math) are references, not contenders.
_NOT_CONTENDERS = (COPY, "per-sample floor (no math)", "floor: 1.5 x copy (same bytes)")
# Why one of ours is slower than a contender, where the cause is known (substring of ours, of the other).
KNOWN_REASONS = [
    ("linear_token_logprobs[", "", "backward forms each chunk's logits again (4 N H V matmuls vs 3): it buys memory"),
    ("linear_kl_penalty_loss[cpu] two passes", "", "two passes form the logits twice more (the fallback)"),
    ("kl_kernels.torchrl.KLRewardTransform (list)", "", "per-sample storage: B TensorDicts cost more than the math"),
]
# Below this many ms per call a difference is mostly fixed per-call cost (argument checks, dispatch, output
# allocation: tens of microseconds) and the noise of a shared machine.
SMALL_MS = 1.0


def is_ours(g: dict) -> bool:
    if g.get("ours") is not None:
        return bool(g["ours"])
    return any(tag in g["impl"] for tag in _OURS)


def _ratio(a, b):
    return None if a is None or b is None or not b else a / b


def _num(value, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


def ms_text(value) -> str:
    """Three significant digits, no exponent: 0.382, 17.5, 4653."""
    if value is None:
        return "-"
    return f"{value:.3f}" if value < 1 else f"{value:.2f}" if value < 10 else f"{value:.1f}" if value < 100 else \
        f"{value:.0f}"


def x_text(value) -> str:
    """A speed-up as a plain number: 0.67x, 8.62x, 29.8x, 140x (never 1.4e+02x)."""
    if value is None:
        return "-"
    return f"{value:.2f}x" if value < 10 else f"{value:.1f}x" if value < 100 else f"{value:.0f}x"


def _grid(head: list[str], body: list[list[str]], left: int = 2) -> list[str]:
    """Rows of cells: the first ``left`` columns left-aligned, the others right-aligned, two spaces apart."""
    widths = [max(len(h), *(len(r[i]) for r in body)) if body else len(h) for i, h in enumerate(head)]
    fmt = lambda cells: "  ".join(c.ljust(w) if i < left else c.rjust(w)  # noqa: E731
                                  for i, (c, w) in enumerate(zip(cells, widths))).rstrip()
    return [fmt(head)] + [fmt(r) for r in body]


def _short(text: str, width: int) -> str:
    return text if len(text) <= width else text[:width - 3] + "..."


SHORT = {"KLRewardTransform task": "kl_reward (TorchRL math)", "TorchRL KLComputation task": "vs TorchRL KLComputation",
         "verl apply_kl_penalty task": "verl apply_kl_penalty", "TorchRL transform call task": "TorchRL transforms"}


def _short_task(task: str) -> str:
    return SHORT.get(task, "kl_penalty_loss (verl PPO)" if task.startswith("verl PPO") else _short(task, 26))


def _task_name(task: str) -> str:
    return {"KLRewardTransform task": "kl_reward (TorchRL's KLRewardTransform math)",
            "TorchRL KLComputation task": "kl_reward vs TorchRL KLComputation",
            "TorchRL transform call task": "TorchRL transforms, whole call"}.get(
        task, "kl_penalty_loss (verl PPO actor loss, fwd+bwd)" if task.startswith("verl PPO") else task)


def table_rows(rows: list[dict], other: list[dict] | None = None) -> list[dict]:
    """The summary's rows of the task tables (``results.json``'s rows of one allocator run; ``other``: the same
    tables under the other allocator, for its ms): one dict per contender with ``name``, ``ms``, ``ms_other``,
    ``x_eager``, ``x_compile``, ``pct_copy``, ``flag``, ``table`` (title) and ``eager`` (the table's baseline)."""
    other_ms = {(r["task"], r["size"], r["impl"], r["layout"]): r["median_ms"] for r in other or []}
    out = []
    for r in rows:
        if is_copy(r):
            continue
        title = f"{_task_name(r['task'])}, {r['size']}: B={r['batch']}, {r['tokens']:,} tokens, {r['dtype']}"
        layout = r["layout"].split(" (")[0]  # "list (KLComputation)": the name says KLComputation already
        out.append(dict(table=title, short=_short_task(r["task"]), size=r["size"], eager=r.get("baseline"),
                        name=f"{r['impl']} ({layout})", ms=r["median_ms"],
                        ms_other=other_ms.get((r["task"], r["size"], r["impl"], r["layout"])),
                        x_eager=r.get("x_vs_baseline"), x_compile=r.get("x_vs_compile"), pct_copy=r.get("pct_copy_bw"),
                        flag=r.get("flag"), layout=r["layout"], impl=r["impl"], task=r["task"]))
    return out


def logprob_rows(result: dict, title: str) -> list[dict]:
    """The summary's rows of a result task (token_logprobs, the hidden-state path, ...: ``rows`` of contender, ms,
    peak): speed-ups over its ``baseline`` (default ``eager``/``eager loss``) and ``compile`` rows, % of its copy
    floor where it has one (the row's own ``floor_ms``, timed in its rounds; older files: a ``floor`` row)."""
    rows = [r for r in result["rows"] if "ms" in r or "error" in r]
    by = {r["contender"]: r.get("ms") for r in rows}
    base = result.get("baseline") or ("eager" if "eager" in by else "eager loss")
    compiled = by.get(result["compile"]) if "compile" in result and result["compile"] else by.get("compile")
    floor_row = next((r["ms"] for r in rows if r["contender"].startswith("floor")), None)
    out = []
    for r in rows:
        if r["contender"].startswith("floor"):
            continue
        ms, floor = r.get("ms"), r.get("floor_ms", floor_row)
        short = result.get("short") or _RESULT_SHORT.get(title.split(" (")[0].split(",")[0],
                                                         title.split(" (")[0].split(",")[0])
        out.append(dict(table=title, short=_short(short, 26), size="", eager=base,
                        name=r["contender"], ms=ms, ms_other=None, x_eager=_ratio(by.get(base), ms),
                        x_compile=_ratio(compiled, ms),
                        pct_copy=None if floor is None or ms is None else 100 * floor / ms,
                        peak_mib=r.get("peak_extra_mib"), error=r.get("error"), flag=r.get("flag"), ours=r.get("ours"),
                        impl=r["contender"], layout="", task=title))
    return out


_RESULT_SHORT = {"GRPO loss step from hidden states": "GRPO loss (hidden states)"}
_LOGPROBS = (("token_logprobs.json", "token_logprobs (log-probs + entropy from logits, fwd+bwd)"),
             ("hidden_states_logprobs.json", "linear_token_logprobs (from hidden states, fwd+bwd)"),
             ("hidden_states_loss.json", "GRPO loss step from hidden states (fwd+bwd)"))
TUNED = "ms tuned"


def load_groups(out_dir: Path) -> tuple[list[dict], dict, str | None]:
    """Every summary row of a results folder, its machine facts, and the label of the second allocator's ms
    column (None when it holds one allocator's run)."""
    groups, machine, other_label = [], {}, None
    path = out_dir / "results.json"
    if path.exists():
        data = json.loads(path.read_text())
        machine = data["machine"]
        rows = data["rows"]
        if rows and "flag" not in rows[0]:  # a folder from before the flags: read with today's rules
            _flag_legacy(rows, data.get("copy_bandwidth_gbs"))
        mallocs = list(dict.fromkeys(r.get("malloc") for r in rows))
        first = [r for r in rows if r.get("malloc") == mallocs[0]]
        second = [r for r in rows if len(mallocs) > 1 and r.get("malloc") == mallocs[1]]
        other_label = TUNED if second else None
        groups += table_rows(first, second)
    legacy = dict(_LOGPROBS)
    names = [n for n, _ in _LOGPROBS] + sorted(p.name for p in out_dir.glob("*.json") if p.name not in legacy)
    for name in names:
        path = out_dir / name
        if name == "results.json" or not path.exists():
            continue
        result = json.loads(path.read_text())
        if not isinstance(result, dict) or "rows" not in result or (name not in legacy and "title" not in result):
            continue
        title = result.get("title")
        if title is None:  # (files from before the task registry)
            r0 = next((r for r in result["rows"] if "n" in r), None)
            if r0 is None:
                continue
            shape = f"N={r0['n']}" + (f", H={r0['hidden']}" if "hidden" in r0 else "") + f", V={r0['vocab']}"
            title = f"{legacy[name]}, {shape}, {r0['dtype']}"
        groups += logprob_rows(result, title)
        machine = machine or result.get("machine", {})
    return groups, machine, other_label


def _flag_legacy(rows: list[dict], copy_gbs: float | None) -> None:
    """Rows written before issue 64: the floor that moves no tensor data loses its % copy (it was given its
    task's bytes: 394-5464 % in those folders), and every table gets today's flags."""
    for r in rows:
        if r["impl"].startswith("per-sample floor"):
            r["pct_copy_bw"] = r["gbs"] = None
    for key in dict.fromkeys((r["task"], r["size"], r.get("malloc")) for r in rows):
        flags.flag_table([r for r in rows if (r["task"], r["size"], r.get("malloc")) == key], copy_gbs)


# ------------------------------------------------------------------ the notes: slower, flagged, not run


def slower(sel: list[dict]) -> list[dict]:
    """Every kl_kernels row of one table slower than a contender that is not ours: its eager baseline, its
    torch.compile (the table's ``x compile`` below 1) or any other contender of its layout. One entry per row:
    ``row``, ``other`` (the fastest such contender) and ``why`` (known reason, or what is likely)."""
    others = [g for g in sel if not is_ours(g) and g.get("ms") and not g["impl"].startswith(_NOT_CONTENDERS)
              and "[torch]" not in g["name"]]
    found = []
    for g in sel:
        if not is_ours(g) or not g.get("ms"):
            continue
        faster = [o for o in others if o["ms"] < g["ms"] and (o["layout"] == g["layout"] or o["impl"] == g["eager"])]
        if g.get("x_compile") is not None and g["x_compile"] < 1:
            faster += [o for o in others if "compile" in o["impl"] and o not in faster]
        if g.get("x_eager") is not None and g["x_eager"] < 1:
            faster += [o for o in others if o["impl"] == g["eager"] and o not in faster]
        if not faster:
            continue
        best = min(faster, key=lambda o: o["ms"])
        why = next((r for mine, theirs, r in KNOWN_REASONS if mine in g["name"] and theirs in best["name"]), None)
        found.append(dict(row=g, other=best, known=why is not None, why=why or (
            "per-call overhead at a sub-millisecond size, or a noisy machine" if g["ms"] < SMALL_MS
            else "cause not known")))
    return found


def _where(g: dict) -> str:
    return g["short"] + (f" ({g['size']})" if g.get("size") else "")


def notes(groups: list[dict]) -> tuple[list[str], list[str], list[str]]:
    """(slower, flagged, not run): one line each, at most :data:`WIDTH` characters."""
    slow, flagged, not_run = [], [], []
    for title in dict.fromkeys(g["table"] for g in groups):
        sel = [g for g in groups if g["table"] == title]
        for s in slower(sel):
            g, o = s["row"], s["other"]
            mark = flags.mark(g) or flags.mark(o)
            line = f"- {_where(g)}: {g['name']} {ms_text(g['ms'])}{mark} ms vs {o['name']} {ms_text(o['ms'])} ms"
            # (a known reason may take a second line; "not known" and the small-size guess stay on one)
            slow += _wrapped(f"{line}: {s['why']}") if s["known"] else [_short(line, WIDTH)]
        not_run += [g for g in sel if g.get("error")]
        flagged += [g for g in sel if g.get("flag") and not g.get("error")]
    return slow, _flag_lines(flagged), _not_run_lines(not_run)


def _not_run_lines(rows: list[dict]) -> list[str]:
    """The rows that did not run, one line per reason, the reason first (a peer's pip command whole), then the
    contenders: a fresh machine without the peers has ten such rows but five reasons. The short run's leave-outs
    (logprob_tasks.DEFAULT_SKIPS: each says why and that --full runs it) are one line; tables.txt has each row with
    its table and its own reason."""
    from .logprob_tasks import DEFAULT_SKIPS

    by_reason: dict[str, list[str]] = {}
    for g in rows:
        reason = "--full runs them" if g["error"] in DEFAULT_SKIPS.values() else g["error"]
        by_reason.setdefault(reason, []).append(g["name"])
    return [_short(f"- {reason}: {', '.join(dict.fromkeys(names))}", WIDTH) for reason, names in by_reason.items()]


_FLAG_KINDS = (  # (what a reason starts with or holds, how the summary names the kind)
    ("% of a same-bytes copy", "above its same-bytes copy"),
    ("faster than the copy floor", "faster than its copy floor"),
    ("rounds spread", "rounds spread > 2x (a loaded machine's scheduler)"),
    ("apart under the two allocators", "the two allocator runs > 4x apart with alike page faults"),
    ("a loaded machine", "a loaded machine (its table's copy under a quarter of the machine's bandwidth)"),
    ("flagged copy", "% copy against a copy whose own rounds spread"),
)


def _flag_lines(flagged: list[dict]) -> list[str]:
    """The flagged rows by kind of reason: one line each (two at most), the rows of the rarer kinds named."""
    lines = []
    for key, kind in _FLAG_KINDS:
        hit = [g for g in flagged if any(key in r and not any(k in r for k, _ in _FLAG_KINDS[:_FLAG_KINDS.index(
            (key, kind))]) for r in g["flag"].split("; "))]
        if not hit:
            continue
        if key == "% of a same-bytes copy":
            names = ", ".join(f"{g['name']} in {g['short']} {_pct(g['pct_copy'])}" if g.get("pct_copy") else g["name"]
                              for g in hit)
        else:
            names = ", ".join(g["name"] for g in hit) if len(hit) <= 3 else f"{len(hit)} rows (tables.txt)"
        lines += _wrapped(f"- {kind}: {names}")
    return lines


# ------------------------------------------------------------------ the screen


SLOWER_TITLE = "Where one of ours is slower than another contender ([torch] reference rows aside):"
LEGEND = [
    "ms: median per call. x eager, x compile: speed-up over the table's eager baseline and torch.compile.",
    f"% copy: bandwidth over a same-bytes copy timed in the same rounds. {flags.MARK}: flagged, not a result.",
]


def _wrapped(text: str, lines: int = 2) -> list[str]:
    """``text`` on at most ``lines`` lines of :data:`WIDTH` characters (the rest cut with "...")."""
    return textwrap.wrap(text, WIDTH, subsequent_indent="  ", max_lines=lines, placeholder=" ...")


def _ours_name(name: str) -> str:
    return name.replace("kl_kernels.torchrl.", "torchrl.").replace(" (default)", "")


# The screen's share of the lists a loaded machine (slower rows, kinds of flag: one line or two each) or a machine
# without the peers (reasons not run) lengthens: one screen in all, whatever the noise; tables.txt has every
# slower row, each row's flag and each row not run. At most SLOWER_LINES, FLAGGED_LINES and NOT_RUN_LINES lines
# each, the last of them then "... and N more". The rest of the default run's summary is 32 lines on the 2-core
# CI machine (header, legend, the nine tables, memory, the lists' titles, the files), so at most 45. (A fresh
# machine without verl, Liger and TRL has five reasons not run; CI's, with them, two.)
SLOWER_LINES = 5
FLAGGED_LINES = 3
NOT_RUN_LINES = 5


def _capped(lines: list[str], cap: int, what: str) -> list[str]:
    """``lines`` (entries of one line or two: an entry starts with "- ") within ``cap`` lines: whole entries,
    then one line counting those left out."""
    entries = []
    for line in lines:
        if line.startswith("- ") or not entries:
            entries.append([line])
        else:
            entries[-1].append(line)
    if sum(map(len, entries)) <= cap:
        return lines
    shown = []
    for e in entries:
        if len(shown) + len(e) > cap - 1:
            break
        shown += e
    left = len(entries) - sum(1 for x in shown if x.startswith("- "))
    return shown + [f"- ... and {left} more {what} (tables.txt lists every one)"]


def summary_lines(groups: list[dict], other_label: str | None = None) -> list[str]:
    """One line per table (the fastest of ours against the table's eager baseline and torch.compile), the peak
    memory of the log-prob tables, then the rows of ours slower than another contender and the flagged rows
    (``SLOWER_LINES`` / ``FLAGGED_LINES`` of each at most, then a count; tables.txt lists every slower row) and the
    contenders not run, a line per reason (``NOT_RUN_LINES`` at most). (``other_label``: the second allocator's ms
    is in tables.txt, not here.)"""
    sizes = len({g["size"] for g in groups if g.get("size")}) > 1
    head = ["table"] + (["size"] if sizes else []) + ["fastest of ours", "ms", "x eager", "x compile", "% copy"]
    body, memory = [], []
    for title in dict.fromkeys(g["table"] for g in groups):
        sel = [g for g in groups if g["table"] == title]
        mine = [g for g in sel if is_ours(g) and g.get("ms")]
        best = min(mine, key=lambda g: g["ms"]) if mine else None
        cells = [_short(sel[0]["short"], 26)] + ([sel[0]["size"]] if sizes else [])
        cells += [_short(_ours_name(best["name"]) if best else "(none ran)", 28 if sizes else 32)]
        if best:
            cells += [ms_text(best["ms"]) + flags.mark(best), x_text(best["x_eager"]), x_text(best["x_compile"]),
                      ("-" if best["pct_copy"] is None else _pct(best["pct_copy"])) + flags.mark(best, "pct")]
        else:
            cells += ["-"] * 4
        body.append(cells)
        peaks = [g for g in sel if g.get("peak_mib") is not None and g.get("ms")]
        if peaks:
            op = sel[0]["short"]
            memory.append(_short(f"- {op}: " + ", ".join(
                f"{g['name'].replace(op, '') or g['name']} {_mib(g['peak_mib'])}" for g in peaks), WIDTH))
    lines = [""] + _grid(head, body, left=3 if sizes else 2)
    if memory:
        lines += ["", "Peak extra memory of one forward + backward (MiB):"] + memory
    slow, flagged, not_run = notes(groups)
    if slow:
        lines += ["", SLOWER_TITLE] + _capped(slow, SLOWER_LINES, "rows")
    if flagged:
        lines += ["", f"Flagged ({flags.MARK}; each row's reason: results.json's `flag`, tables.txt):"] + _capped(
            flagged, FLAGGED_LINES, "kinds")
    if not_run:
        lines += ["", "Not run here:"] + _capped(not_run, NOT_RUN_LINES, "reasons")
    return lines


def _pct(value: float) -> str:
    """100.4 % reads 100.4%, not 100%: a figure above the copy must not read as the copy's."""
    return f"{value:.1f}%" if 100 < value < 100.95 else f"{value:.0f}%"


def _mib(value: float) -> str:
    return "<1" if value < 1 else f"{value:.0f}"


def summary(out_dir: Path) -> str:
    """The short report of a results folder: the machine, the legend, a line per table, the notes."""
    groups, machine, other_label = load_groups(out_dir)
    load = machine.get("load_average") or []
    cores = machine.get("cpu_count")
    head = [" | ".join(str(x) for x in (
        f"kl_kernels {machine.get('kl_kernels', '?')}" + (f" ({machine['git_commit']})" if machine.get("git_commit")
                                                          else ""),
        f"torch {machine.get('torch', '?')}", machine.get("gpu") or machine.get("cpu", "?"),
        f"{machine.get('torch_threads', '?')} threads",
        f"load {min(load):.1f}-{max(load):.1f}" if load and not (cores and max(load) > cores) else None,
        f"malloc: {machine['malloc']}" if machine.get("malloc") and not other_label else None) if x)]
    head = _wrapped(head[0].replace(" | ", "\u00a0|\u00a0"))  # (wrapped between the facts, not inside one)
    head = [line.replace("\u00a0", " ") for line in head]
    if load and cores and max(load) > cores:
        head.append(_short(f"A loaded machine: load average {min(load):.1f}-{max(load):.1f} on {cores} cores. "
                           "Expect noise; see the flags.", WIDTH))
    if other_label:
        head.append("ms: glibc's default allocator (under the tuned one, freed memory kept mapped: tables.txt)")
    return "\n".join(head + LEGEND + summary_lines(groups, other_label))


def details(out_dir: Path) -> str:
    """Every table of the folder as the summary shows a table (every contender: ms, x eager, x compile,
    % copy, peak MiB), flagged cells marked: the first part of ``tables.txt``."""
    groups, _, other_label = load_groups(out_dir)
    lines = []
    for title in dict.fromkeys(g["table"] for g in groups):
        sel = [g for g in groups if g["table"] == title]
        peak = any(g.get("peak_mib") is not None for g in sel)
        head = ["contender", "ms"] + ([other_label] if other_label and any(g["ms_other"] for g in sel) else [])
        head += ["x eager", "x compile", "% copy"] + (["peak MiB"] if peak else [])
        body = []
        for g in sel:
            if g.get("error"):
                body.append([g["name"], "not run"] + [""] * (len(head) - 2))
                continue
            cells = [g["name"], ms_text(g["ms"]) + flags.mark(g)]
            cells += [ms_text(g["ms_other"])] if len(head) > 5 + peak else []
            cells += [x_text(g["x_eager"]), x_text(g["x_compile"]),
                      _num(g["pct_copy"], "{:.0f}%") + flags.mark(g, "pct")]
            cells += [_mib(g["peak_mib"]) if g.get("peak_mib") is not None else "-"] if peak else []
            body.append(cells)
        grid = _grid(head, body)
        lines += ["", title] + grid
        lines += [f"  {flags.MARK} {g['name']}: {g['flag']}" for g in sel if g.get("flag")]
        lines += [f"  not run: {g['name']}: {g['error']}" for g in sel if g.get("error")]
    slow = notes(groups)[0]
    if slow:  # every one (the summary shows SLOWER_LINES of them)
        lines += ["", SLOWER_TITLE] + slow
    return "\n".join(lines)


# ------------------------------------------------------------------ files


def write(rows: list[dict], machine: dict, copy_gbs: float, out_dir: Path) -> list[Path]:
    """results.json (machine + rows), results.csv and tables.txt (every column of every table). The PNG and
    the summary come from the whole folder (:func:`finish`), once the result tasks' JSON are there too."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / "results.json", out_dir / "results.csv", out_dir / "tables.txt"]
    paths[0].write_text(json.dumps({"machine": machine, "copy_bandwidth_gbs": copy_gbs, "rows": rows}, indent=2))
    with paths[1].open("w", newline="") as f:
        fields = list(dict.fromkeys(k for r in rows for k in r if k not in CSV_SKIP))
        writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    paths[2].write_text(full_tables(rows, machine, copy_gbs) + "\n")
    return paths


def finish(out_dir: Path, tables: bool = True) -> list[Path]:
    """summary.txt and results.png of a results folder (after every task wrote its JSON); with ``tables``,
    tables.txt too: every table as the summary would show it, then every column of the task tables
    (:func:`write`'s)."""
    text = summary(out_dir)
    (out_dir / "summary.txt").write_text(text + "\n")
    paths = [out_dir / "summary.txt"]
    full = out_dir / "tables.txt"
    if tables:
        rest = full.read_text() if full.exists() else ""
        full.write_text("Every table (" + flags.MARK + ": flagged, its reason below the table):\n" + details(out_dir)
                        + ("\n\nEvery column of the task tables:\n" + rest if rest.strip() else "\n"))
        paths.append(full)
    png = plot(out_dir)
    if png:
        paths.append(png)
    return paths


def plot(out_dir: Path) -> Path | None:
    """results.png of a folder (:func:`kl_kernels.bench.plot.plot`)."""
    from .plot import plot as draw_png
    return draw_png(out_dir)


def main(argv=None) -> int:
    import argparse
    parser = argparse.ArgumentParser(description="Print the summary of a kl-kernels bench results folder and "
                                                 "redraw its results.png.")
    parser.add_argument("folder", type=Path)
    args = parser.parse_args(argv)
    paths = finish(args.folder, tables=False)
    print((args.folder / "summary.txt").read_text(), end="")
    print(f"\nwrote {', '.join(str(p) for p in paths)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
