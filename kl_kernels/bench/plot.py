"""``results.png`` of a ``kl-kernels bench`` folder: one panel per table (task and size), a bar per contender
(its speed-up over the table's eager baseline, log scale where they span a decade), labelled with that speed-up
as a plain number and its % of the same-bytes copy (or its peak memory), ``!`` where the row is flagged;
kl_kernels' rows in blue, the others in grey; below the bars, a note for each contender that did not run and why.

Nothing is cut: contender names wrap onto two lines, the x range grows until every label fits its panel
(:func:`overflowing` lists any text that does not; the tests call it)."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

from . import flags
from .report import is_ours, load_groups, x_text

NAME_WIDTH = 30  # characters per line of a contender's name on the y axis (two lines at most)
NOTE_WIDTH = 88  # characters per line of a "not run" note


def _name(text: str) -> str:
    lines = textwrap.wrap(text, NAME_WIDTH, break_long_words=False)
    if len(lines) > 2:  # (no name is this long today) two lines, the rest on the second
        lines = [lines[0], " ".join(lines[1:])]
    return "\n".join(lines)


def bar_label(g: dict) -> str:
    label = x_text(g["x_eager"]) + flags.mark(g)
    if g.get("pct_copy") is not None:
        label += f"  {g['pct_copy']:.0f}% copy" + flags.mark(g, "pct")
    if g.get("peak_mib") is not None:
        label += "  peak <1 MiB" if g["peak_mib"] < 1 else f"  peak {g['peak_mib']:.0f} MiB"
    return label


def draw(groups: list[dict], machine: dict):
    """The figure (matplotlib) of a folder's summary rows; None without rows."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, NullFormatter

    titles = list(dict.fromkeys(g["table"] for g in groups))
    if not titles:
        return None
    cols = 2
    rows_n = (len(titles) + cols - 1) // cols

    def slots(t):
        sel = [g for g in groups if g["table"] == t]
        return sum(1 for g in sel if g.get("x_eager")) + 0.8 * sum(1 for g in sel if g.get("error"))
    heights = [0.34 * max(slots(t) for t in titles[i:i + cols]) + 1.4 for i in range(0, len(titles), cols)]
    fig, axes = plt.subplots(rows_n, cols, figsize=(15, sum(heights) + 0.5), squeeze=False, dpi=90,
                             gridspec_kw=dict(height_ratios=heights))
    for ax in axes.flat[len(titles):]:
        ax.set_visible(False)
    for ax, title in zip(axes.flat, titles):
        sel = [g for g in groups if g["table"] == title and g.get("x_eager")][::-1]
        missing = [g for g in groups if g["table"] == title and g.get("error")]
        eager = next((g["eager"] for g in groups if g["table"] == title), "")
        xs = [g["x_eager"] for g in sel]
        n_notes = len(missing)
        ys = [i + n_notes for i in range(len(sel))]
        ax.barh(ys, xs, color=["tab:blue" if is_ours(g) else "0.65" for g in sel], height=0.7)
        ax.set_yticks(ys, [_name(g["name"]) for g in sel], fontsize=7.5)
        top, low = max(xs + [1.0]), min(xs + [1.0])
        log = top / low > 8  # speed-ups spanning decades: log scale
        if log:
            ax.set_xscale("log")
            ax.set_xlim(low / 1.6, top * 3)
            ax.xaxis.set_minor_formatter(NullFormatter())
        else:
            ax.set_xlim(0, top * 1.35)
        ax.set_ylim(-0.6, len(sel) + n_notes - 0.4)
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}x"))
        ax.axvline(1.0, color="black", linewidth=0.8)
        for y, g in zip(ys, sel):
            ax.text(g["x_eager"] * 1.06 if log else g["x_eager"] + top * 0.015, y, bar_label(g), va="center",
                    fontsize=7.5, gid="bar-label")
        for k, g in enumerate(missing):
            note = textwrap.fill(f"not run: {g['name']}: {g['error']}", NOTE_WIDTH, max_lines=2, placeholder=" ...")
            ax.text(0.01, n_notes - 1 - k, note, transform=ax.get_yaxis_transform(), va="center", fontsize=7,
                    style="italic", color="0.3", gid="note")
        ax.set_title(textwrap.fill(title, 70) + "\n" + textwrap.shorten(f"speed-up over {eager}", 70), fontsize=9)
        ax.tick_params(axis="x", labelsize=8)
        ax.grid(axis="x", which="major", alpha=0.3)
    who = " | ".join(str(x) for x in (machine.get("gpu") or machine.get("cpu"), f"torch {machine.get('torch')}",
                                      machine.get("git_commit")) if x)
    fig.suptitle(f"kl-kernels bench: speed-up over eager per task (blue: kl_kernels; {flags.MARK}: flagged)  |  {who}",
                 fontsize=11)
    fig.tight_layout(rect=(0, 0, 1, 0.985))
    _fit_labels(fig)
    return fig


def _fit_labels(fig, tries: int = 8) -> None:
    """Widen each panel's x range until its bar labels end inside it."""
    for ax in fig.axes:
        for _ in range(tries):
            renderer = fig.canvas.get_renderer()
            box = ax.get_window_extent(renderer)
            right = max((t.get_window_extent(renderer).x1 for t in ax.texts if t.get_gid() == "bar-label"),
                        default=box.x1)
            margin = 0.03 * (box.x1 - box.x0)  # (the saved PNG's dpi renders text a little wider or narrower)
            if right <= box.x1 - margin:
                break
            lo, hi = ax.get_xlim()
            need = (right - box.x0 + 2 * margin) / max(box.x1 - box.x0, 1.0)  # the axis must be this much wider
            if ax.get_xscale() == "log":
                ax.set_xlim(lo, lo * (hi / lo) ** need)
            else:
                ax.set_xlim(lo, lo + (hi - lo) * need)


def overflowing(fig) -> list[str]:
    """Every text of the figure that is cut: a bar label or note past its panel, a tick label or title past the
    figure."""
    renderer = fig.canvas.get_renderer()
    page = fig.bbox
    bad = []
    for ax in fig.axes:
        if not ax.get_visible():
            continue
        box = ax.get_window_extent(renderer)
        for t in ax.texts:
            e = t.get_window_extent(renderer)
            if e.x0 < box.x0 - 1 or e.x1 > box.x1 + 1 or e.y0 < box.y0 - 1 or e.y1 > box.y1 + 1:
                bad.append(f"{t.get_text()!r} past its panel")
        lo, hi = ax.get_xlim()
        ticks = [t for t in ax.get_xticklabels() if lo <= t.get_position()[0] <= hi]  # (the others are not drawn)
        for t in ax.get_yticklabels() + ticks + [ax.title]:
            e = t.get_window_extent(renderer)
            if t.get_text() and (e.x0 < page.x0 - 1 or e.x1 > page.x1 + 1 or e.y0 < page.y0 - 1 or e.y1 > page.y1 + 1):
                bad.append(f"{t.get_text()!r} past the figure")
    return bad


def plot(out_dir: Path) -> Path | None:
    """Draw ``out_dir/results.png`` from the folder's JSON; None without matplotlib or rows."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("matplotlib not installed: no PNG plot (pip install 'kl_kernels[bench]')", file=sys.stderr)
        return None
    import matplotlib.pyplot as plt

    groups, machine, _ = load_groups(out_dir)
    fig = draw(groups, machine)
    if fig is None:
        return None
    path = out_dir / "results.png"
    fig.savefig(path, dpi=fig.dpi)  # (the dpi the labels were fitted at)
    plt.close(fig)
    return path
