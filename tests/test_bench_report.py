"""kl-kernels bench's short summary and plot, rendered from a committed results folder (no timing here):
one compact table per task and size with ms, x eager, x compile and % copy, rows of at most 100 characters,
the whole run under 150 lines, every task (the log-prob and hidden-state rows included), and a note where
one of ours is slower than another contender (issue 50 item 4)."""

from __future__ import annotations

import shutil

import pytest

from conftest import REPO
from kl_kernels.bench import report

FULL_RUN = REPO / "bench" / "results" / "cpu-2core-amd-epyc-18gbs"  # both allocators, every task, both sizes


@pytest.fixture
def folder(tmp_path):
    for name in ("results.json", "token_logprobs.json", "hidden_states_logprobs.json", "hidden_states_loss.json"):
        shutil.copy(FULL_RUN / name, tmp_path / name)
    return tmp_path


def test_summary_of_a_full_run_is_short_and_narrow(folder):
    lines = report.summary(folder).splitlines()
    assert len(lines) < 140 and max(map(len, lines)) <= report.WIDTH  # + the two closing lines of the command
    text = "\n".join(lines)
    for title in ("kl_reward (TorchRL's KLRewardTransform math), medium", "kl_reward vs TorchRL KLComputation, large",
                  "TorchRL transforms, whole call, medium", "kl_penalty_loss (verl PPO actor loss, fwd+bwd), large",
                  "token_logprobs (log-probs + entropy from logits, fwd+bwd), N=2048",
                  "linear_token_logprobs (from hidden states, fwd+bwd), N=2048, H=512",
                  "GRPO loss step from hidden states (fwd+bwd)"):
        assert title in text, title
    heads = [line.split() for line in lines if line.startswith("contender ")]
    assert len(heads) == 11 and all({"ms", "eager", "compile", "copy"} <= set(h) for h in heads)
    assert sum("tuned" in h for h in heads) == 8  # the allocator runs: one column, explained once
    assert "copy (same bytes)" not in text  # the % copy reference is a column, not a row


def test_summary_rows_carry_the_measured_ratios(folder):
    """The cells are results.json's own medians and ratios (the default allocator's run; the tuned one's ms
    beside it), and the log-prob tables' speed-ups are ratios of their medians."""
    lines = report.summary(folder).splitlines()
    medium = lines.index("kl_reward (TorchRL's KLRewardTransform math), medium: B=256, 136,658 tokens, float32")
    assert lines[medium + 2].split() == ["kl_reward[cpu]", "(packed)", "0.382", "0.381", "39.9x", "8.62x", "55%"]
    tlp = next(i for i, line in enumerate(lines) if line.startswith("token_logprobs ("))
    inplace = next(line for line in lines[tlp:] if line.startswith("token_logprobs[cpu]+inplace"))
    assert inplace.split()[1:4] == ["115", f"{2419.894401995407 / 115.00928099849261:.1f}x",
                                    f"{751.016301997879 / 115.00928099849261:.2f}x"]


def test_summary_says_where_ours_is_slower_and_why(folder):
    text = report.summary(folder)
    notes = text[text.index("Where one of ours is slower"):]
    assert "linear_token_logprobs[cpu] 4459 ms vs compile 3026 ms" in " ".join(notes.split())
    assert "4 N x H x V matmuls" in " ".join(notes.split())
    assert "kl_reward[cpu]" not in notes  # faster than every contender in its tables


def test_plot_has_a_panel_per_table(folder):
    pytest.importorskip("matplotlib")
    from PIL import Image

    path = report.plot(folder)
    width, height = Image.open(path).size
    assert width <= 1400 and height < 2000


def test_a_contender_that_did_not_run_keeps_the_table_narrow():
    """A contender that could not run (a peer not installed) is a "not run" row; its reason goes below the tables,
    so a long message does not widen the table past the summary's width."""
    why = "liger-kernel not installed (No module named 'liger_kernel'); pip install liger-kernel==0.8.5 " * 2
    groups = [dict(table="GRPO step", name="liger", impl="liger", layout="", error=why, ms=None, ms_other=None,
                   x_eager=None, x_compile=None, pct_copy=None, eager="eager loss"),
              dict(table="GRPO step", name="eager loss", impl="eager loss", layout="", ms=7341.0, ms_other=None,
                   x_eager=1.0, x_compile=None, pct_copy=None, eager="eager loss")]
    lines = report.summary_lines(groups)
    assert max(map(len, lines)) <= report.WIDTH
    assert any(line.startswith("liger") and "not run" in line for line in lines)
    assert any("liger-kernel not installed" in line for line in lines[lines.index("Not run here:"):])
