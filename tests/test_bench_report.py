"""kl-kernels bench's report, flags and plot, from a committed results folder and synthetic rows (no timing here,
no timed assertion): one screen of summary (a line per table, then every row of ours slower than another
contender, the flagged rows, the contenders not run), the flag logic (a row above its same-bytes copy or whose
rounds spread more than 2x gets a ``flag`` and a mark), and a plot whose labels all fit (issue 64 item 2)."""

from __future__ import annotations

import shutil

import pytest
import torch

from conftest import REPO
from kl_kernels.bench import contenders, flags, report

FULL_RUN = REPO / "bench" / "results" / "cpu-2core-amd-epyc-18gbs"  # both allocators, every task, both sizes


@pytest.fixture
def folder(tmp_path):
    for name in ("results.json", "token_logprobs.json", "hidden_states_logprobs.json", "hidden_states_loss.json"):
        shutil.copy(FULL_RUN / name, tmp_path / name)
    return tmp_path


def test_summary_of_a_full_run_is_one_screen(folder):
    lines = report.summary(folder).splitlines()
    assert len(lines) <= report.SCREEN and max(map(len, lines)) <= report.WIDTH
    text = "\n".join(lines)
    tables = [line.split("  ")[0] for line in lines[lines.index(next(x for x in lines if x.startswith("table "))):]]
    for title in ("kl_reward (TorchRL math)", "vs TorchRL KLComputation", "TorchRL transforms",
                  "kl_penalty_loss (verl PPO)", "token_logprobs", "linear_token_logprobs", "GRPO loss (hidden states)"):
        assert title in tables, title
    assert "copy (same bytes)" not in text  # the % copy reference is a column, not a row


def test_summary_rows_carry_the_measured_ratios(folder):
    """A table's line is its fastest row of ours with results.json's own median and ratios (the default
    allocator's run), and the log-prob tables' speed-ups are ratios of their medians."""
    lines = report.summary(folder).splitlines()
    medium = next(line for line in lines if line.startswith("kl_reward (TorchRL math)") and "medium" in line)
    assert medium.split()[-7:] == ["medium", "kl_reward[cpu]", "(packed)", "0.382", "39.9x", "8.62x", "55%"]
    tlp = next(line for line in lines if line.startswith("token_logprobs "))
    assert tlp.split()[1:5] == ["token_logprobs[cpu]+inplace", "115", f"{2419.894401995407 / 115.00928099849261:.1f}x",
                                f"{751.016301997879 / 115.00928099849261:.2f}x"]
    assert "[cpu]+inplace <1" in " ".join(lines)  # a peak of 0 MiB reads "<1", never "0 MiB"


def test_a_folder_from_before_the_flags_is_read_with_todays_rules(folder):
    """The committed runs from before issue 64 have no flags: their padded rows above the copy get one when
    read, and the per-sample floor (no math), which moves no tensor data, has no % copy."""
    groups, _, _ = report.load_groups(folder)
    large = [g for g in groups if g["table"].startswith("kl_reward (TorchRL") and "large" in g["table"]]
    above = {g["name"]: g for g in large if g["pct_copy"] and g["pct_copy"] > 100}
    assert set(above) == {"kl_reward[cpu] (padded)", "kl_reward[cpu] out= (padded)"}
    assert all("of a same-bytes copy" in g["flag"] for g in above.values())
    assert all(g["pct_copy"] is None for g in groups if g["impl"].startswith("per-sample floor"))


def test_summary_says_where_ours_is_slower_and_why(folder):
    text = report.summary(folder)
    notes = " ".join(text[text.index("Where one of ours is slower"):text.index("Flagged")].split())
    assert "linear_token_logprobs[cpu] 4459 ms vs compile 3026 ms" in notes and "4 N H V matmuls" in notes
    assert "kl_reward[cpu]" not in notes  # faster than every contender in its tables


def _g(name, ms, x_eager, x_compile=None, layout="padded", table="loss, medium", **kw):
    return dict(table=table, short="loss", size="medium", eager="eager", name=f"{name} ({layout})", impl=name,
                layout=layout, ms=ms, ms_other=None, x_eager=x_eager, x_compile=x_compile, pct_copy=10.0, **kw)


def test_slower_lists_every_row_of_ours_slower_than_another_contender():
    """Issue 64: the tables showed three (kl_penalty_loss inside torch.compile 0.67x / 0.78x its compile, out=
    packed 0.97x) where the note listed one: a row is listed when its x eager or x compile is below 1 (whatever
    the layout of the compiled row) or another contender of its layout is faster."""
    groups = [_g("eager", 10.0, 1.0, 0.1), _g("torch.compile(eager)", 1.0, 10.0, 1.0),
              _g("kl_penalty_loss inside torch.compile (default)", 1.5, 6.7, 0.67),
              _g("kl_penalty_loss[cpu] out=", 1.03, 9.7, 0.97, layout="packed"),
              _g("kl_penalty_loss[cpu]", 0.8, 12.5, 1.25, layout="packed"),
              _g("kl_penalty_loss[torch]", 12.0, 0.8, 0.08, layout="packed")]
    found = [s["row"]["name"] for s in report.slower(groups)]
    assert found == ["kl_penalty_loss inside torch.compile (default) (padded)", "kl_penalty_loss[cpu] out= (packed)"]
    lines = report.summary_lines(groups)
    listed = " ".join(lines[lines.index(next(x for x in lines if x.startswith("Where one"))):])
    assert "inside torch.compile" in listed and "out= (packed) 1.03 ms vs torch.compile(eager)" in listed


def test_a_loaded_machine_lengthens_the_lists_not_the_screen():
    """CI (load 3-4 on 2 cores) once printed 48 summary lines where test_cli allows 45: every noisy row of ours
    took a line of "Where one of ours is slower". The screen shows SLOWER_LINES of them and counts the rest;
    report.notes (which tables.txt prints whole) still has every one."""
    groups = []
    for k in range(12):
        table = f"loss {k}, medium"
        groups += [_g("eager", 10.0, 1.0, 0.1, table=table), _g("torch.compile(eager)", 1.0, 10.0, 1.0, table=table),
                   _g("kl_penalty_loss[cpu] out=", 1.03, 9.7, 0.97, layout="packed", table=table)]
    lines = report.summary_lines(groups)
    at = lines.index(report.SLOWER_TITLE)
    section = lines[at + 1:lines.index("", at) if "" in lines[at:] else len(lines)]
    assert len(section) <= report.SLOWER_LINES
    shown = sum(1 for x in section if x.startswith("- ") and "more rows" not in x)
    assert section[-1] == f"- ... and {12 - shown} more rows (tables.txt lists every one)"
    assert len(report.notes(groups)[0]) == 12  # every one, for tables.txt


def test_a_row_above_its_copy_or_with_a_wide_spread_is_flagged_and_marked():
    copy = dict(task="t", size="medium", impl=flags.COPY, layout="packed", gbs=20.0, mbytes=10.0, pct_copy_bw=100.0,
                round_ms=[1.0] * 10)
    fast = dict(task="t", size="medium", impl="kl_reward[cpu]", layout="packed", gbs=26.0, pct_copy_bw=130.0,
                round_ms=[0.8] * 10)
    noisy = dict(task="t", size="medium", impl="kl_reward[torch]", layout="packed", gbs=2.0, pct_copy_bw=10.0,
                 round_ms=[1.0] * 5 + [5.0] * 5)
    calm = dict(task="t", size="medium", impl="eager", layout="packed", gbs=1.0, pct_copy_bw=5.0, round_ms=[9.0] * 10)
    flags.flag_table([copy, fast, noisy, calm], machine_copy_gbs=25.0)
    assert "130% of a same-bytes copy" in fast["flag"] and flags.mark(fast, "pct") == "!" and not flags.mark(fast)
    assert "rounds spread 5.0x" in noisy["flag"] and flags.mark(noisy) == "!" and not flags.mark(noisy, "pct")
    assert calm["flag"] is None and copy["flag"] is None
    # the marks reach the tables: the % copy cell of the fast row, the ms cell of the noisy one
    for r in (fast, noisy, calm):
        r.update(median_ms=1.0, mtokens_per_s=1.0, x_vs_baseline=None, x_vs_compile=None, compile_s=None,
                 page_faults_per_call=0)
    lines = report.table([fast, noisy, calm], "t").splitlines()
    assert "130%!" in lines[3] and "1.000!" in lines[4] and "!" not in lines[5]
    assert lines[-2].startswith("  ! kl_reward[cpu] (packed): 130%") and "rounds spread" in lines[-1]
    # a copy at under a quarter of the machine's bandwidth: a loaded machine, the rows' times flagged with it
    slow_copy, row = dict(copy, gbs=4.0, flag=None), dict(calm, flag=None)
    flags.flag_table([slow_copy, row], machine_copy_gbs=25.0)
    assert "a loaded machine" in slow_copy["flag"] and "a loaded machine" in row["flag"] and flags.mark(row) == "!"
    # a copy whose rounds spread: the rows' % copy rest on it (their % cell marked, not their ms)
    noisy_copy, row = dict(copy, round_ms=[1.0] * 5 + [3.0] * 5, flag=None), dict(calm, flag=None)
    flags.flag_table([noisy_copy, row], machine_copy_gbs=25.0)
    assert "flagged copy" in row["flag"] and flags.mark(row, "pct") == "!" and not flags.mark(row)


def test_result_rows_and_allocator_runs_are_flagged():
    result = dict(rows=[dict(contender="eager", ms=10.0, round_ms=[10.0, 10.1, 9.9]),
                        dict(contender="ours", ms=1.0, round_ms=[1.0, 3.0, 0.5], floor_ms=2.0)])
    flags.flag_result(result)
    assert result["rows"][0]["flag"] is None
    assert "rounds spread" in result["rows"][1]["flag"] and "faster than the copy floor" in result["rows"][1]["flag"]
    a = dict(task="t", size="medium", impl="kl_reward[cpu]", layout="packed", median_ms=0.364, page_faults_per_call=0)
    b = dict(a, median_ms=5.86)  # the 16x between the two allocator runs, with no page faults to explain it
    eager = dict(a, impl="eager", median_ms=3.0, page_faults_per_call=10)
    eager_b = dict(eager, median_ms=30.0, page_faults_per_call=5000)  # the allocator's own effect: faults
    flags.flag_allocators([a, eager, b, eager_b])
    assert "16.1x apart" in a["flag"] and a["flag"] == b["flag"] and "flag" not in eager


class _Timing:
    def __init__(self, ms):
        self.median_ms = self.min_ms = ms
        self.repeats, self.times_ms = 3, (ms, ms, ms)


def test_time_rows_retimes_a_row_above_its_copy_then_flags_it(monkeypatch):
    """A table with a row above its copy is timed again once; a row still above is flagged, one that is not
    keeps no flag; a floor that moves no tensor data has no GB/s and no % copy."""
    from kl_kernels.bench import batches

    batch = batches.make_batch(batches.SIZES["tiny"])
    rounds = iter([[0.5, 0.1, 1.0, 1.0], [0.5, 2.0, 1.0, 1.0]])  # ours, floor, copy per layout
    monkeypatch.setattr(contenders, "measure_interleaved", lambda fns, *a, **k: [(_Timing(ms), 0.0)
                                                                               for ms in next(rounds)])
    cands = [contenders.Contender("ours", "packed", lambda: None),
             contenders.Contender("floor", "list", lambda: None, moves_bytes=False)]
    rows = contenders.time_rows(batch, "t", cands, ["ok", "not checked"], lambda layout: 1000, 1.0, 3, 0.1, "eager")
    ours, floor = rows[0], rows[1]
    assert ours["retimed"] and ours["pct_copy_bw"] == pytest.approx(200.0)
    assert "200% of a same-bytes copy after a re-time" in ours["flag"]
    assert floor["gbs"] is floor["pct_copy_bw"] is floor["mbytes"] is None and floor["flag"] is None
    rounds = iter([[0.5, 0.1, 1.0, 1.0], [2.0, 0.1, 1.0, 1.0]])
    rows = contenders.time_rows(batch, "t", cands, ["ok", "not checked"], lambda layout: 1000, 1.0, 3, 0.1, "eager")
    assert rows[0]["retimed"] and rows[0]["pct_copy_bw"] == pytest.approx(50.0) and rows[0]["flag"] is None


def test_padded_bytes_count_the_tokens_read_and_the_padding_written():
    """A padded call gets the lengths, so it need not read the padding: counting it inflated the padded rows'
    GB/s (kl_reward[cpu] padded read 138-178 % of the copy at large)."""
    from kl_kernels.bench import batches, kl_reward

    batch = batches.make_batch(batches.SIZES["small"])
    n, elems, b = batch.num_tokens, batch.lp_padded.numel(), batch.size.batch
    assert elems > n
    assert kl_reward.bytes_moved(batch, "padded") == n * 9 + b * 4 + (b + 1) * 8 + elems * 12 + b * 12
    assert kl_reward.bytes_moved(batch, "packed") == n * 9 + b * 4 + (b + 1) * 8 + n * 12 + b * 12


def test_a_contender_that_did_not_run_keeps_the_table_narrow():
    """A contender that could not run (a peer not installed) is a "not run" row with its reason below the tables,
    so a long message does not widen the summary."""
    why = "liger-kernel not installed (No module named 'liger_kernel'); pip install liger-kernel==0.8.5 " * 2
    groups = [dict(table="GRPO step", short="GRPO step", size="", name="liger", impl="liger", layout="", error=why,
                   ms=None, ms_other=None, x_eager=None, x_compile=None, pct_copy=None, eager="eager loss"),
              dict(table="GRPO step", short="GRPO step", size="", name="eager loss", impl="eager loss", layout="",
                   ms=7341.0, ms_other=None, x_eager=1.0, x_compile=None, pct_copy=None, eager="eager loss")]
    lines = report.summary_lines(groups)
    assert max(map(len, lines)) <= report.WIDTH
    assert any("liger-kernel not installed" in line for line in lines[lines.index("Not run here:"):])


def test_plain_ratios():
    assert [report.x_text(v) for v in (0.671, 8.62, 29.84, 140.2, 1322.0)] == ["0.67x", "8.62x", "29.8x", "140x",
                                                                               "1322x"]


def test_plot_labels_fit_their_panels(folder):
    """Every text of the plot fits: long names wrap (never "...(default) (p..."), ratios are plain numbers
    (never 1.4e+02x), a 0 MiB peak reads "<1 MiB", and a contender that did not run gets a note saying why."""
    pytest.importorskip("matplotlib")
    from PIL import Image

    from kl_kernels.bench import plot

    groups, machine, _ = report.load_groups(folder)
    title = groups[-1]["table"]
    groups.append(dict(groups[-1], name="liger", impl="liger", ms=None, x_eager=None, peak_mib=None,
                       error="liger-kernel not installed (No module named 'liger_kernel')"))
    groups.append(dict(groups[-1], name="kl_penalty_loss inside torch.compile (reduce-overhead) (padded)",
                       impl="kl_penalty_loss inside torch.compile (reduce-overhead)", ms=1.0, x_eager=140.2, error=None,
                       pct_copy=1322.0, flag="1322% of a same-bytes copy", peak_mib=0.0))
    fig = plot.draw(groups, machine)
    assert plot.overflowing(fig) == []
    texts = [t.get_text() for ax in fig.axes for t in ax.texts + ax.get_yticklabels()]
    assert not any("..." in t or "e+" in t for t in texts)
    assert any(t.startswith("140x") and "1322% copy!" in t and "peak <1 MiB" in t for t in texts)
    assert not any("peak 0 MiB" in t for t in texts)
    assert any(t.startswith("not run: liger: liger-kernel not installed") for t in texts)
    assert any(title.split(",")[0] in ax.get_title() for ax in fig.axes)
    path = report.plot(folder)
    width, height = Image.open(path).size
    assert width <= 1400 and height < 2200


def test_a_fresh_machine_without_the_peers_keeps_one_screen():
    """The README's first command on a fresh machine (no verl, Liger or TRL: 2026-12-02, 898b054): ten "not run"
    rows, one line each, made the tiny bench's screen 49 lines (tests/test_cli.py allows 45). The rows that share a
    reason are one line (the short run's leave-outs one more), each reason whole with its pip command, at most
    NOT_RUN_LINES lines; tables.txt keeps a line per row."""
    from kl_kernels.bench.logprob_tasks import DEFAULT_SKIPS

    def row(table, name, error):
        return dict(table=table, short=table, size="", name=name, impl=name, layout="", error=error, ms=None,
                    ms_other=None, x_eager=None, x_compile=None, pct_copy=None, eager="eager")

    verl = "verl is not installed (pip install --no-deps verl==0.9.1)"
    liger = "liger-kernel is not installed (pip install --no-deps liger-kernel==0.8.5)"
    trl = "trl is not installed (pip install --no-deps trl==1.16.0)"
    cuda = "verl's fused kernel is Triton for CUDA tensors only"
    groups = [row("token_logprobs", "token_logprobs[torch]", DEFAULT_SKIPS["token_logprobs[torch]"]),
              row("linear_token_logprobs", "compile", DEFAULT_SKIPS["compile"]),
              row("linear_token_logprobs", "linear_token_logprobs[torch]", DEFAULT_SKIPS["linear_token_logprobs[torch]"]),
              row("linear_token_logprobs", "verl[torch]", verl), row("linear_token_logprobs", "verl[triton]", cuda),
              row("linear_token_logprobs", "liger[ce]", liger), row("GRPO loss (hidden states)", "liger", liger),
              row("TRL GRPO step (hidden)", "trl", trl), row("TRL GRPO step (hidden)", "trl head + kl_kernels loss", trl),
              row("TRL GRPO step (hidden)", "kl_kernels head + trl loss", trl)]
    lines = report.summary_lines(groups)
    shown = lines[lines.index("Not run here:") + 1:]
    assert len(shown) == 5 <= report.NOT_RUN_LINES, shown
    assert max(map(len, lines)) <= report.WIDTH
    for reason in (verl, liger, trl, cuda):
        assert sum(line.startswith(f"- {reason}: ") for line in shown) == 1, (reason, shown)
    assert f"- {liger}: liger[ce], liger" in shown and f"- {verl}: verl[torch]" in shown
    assert "- --full runs them: token_logprobs[torch], compile, linear_token_logprobs[torch]" in shown
    assert len(report.notes(groups)[2]) == 5  # (the same lines: tables.txt has each row's own)
    many = groups + [row("token_logprobs", f"peer{i}", f"reason {i}") for i in range(4)]
    shown = report.summary_lines(many)[-report.NOT_RUN_LINES:]
    assert len(shown) == report.NOT_RUN_LINES and shown[-1] == "- ... and 5 more reasons (tables.txt lists every one)"
