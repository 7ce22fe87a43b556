"""Catalogue of bad inputs: each raises TypeError/ValueError naming the argument and what was
expected, before any backend runs, and leaves every input untouched."""

from __future__ import annotations

import pytest
import torch

from batches import assert_unmodified, snapshot
from kl_kernels import kl_reward

B, T = 3, 5


def padded(**over):
    g = torch.Generator().manual_seed(0)
    kw = dict(log_probs=-torch.rand(B, T, generator=g), ref_log_probs=-torch.rand(B, T, generator=g),
              lengths=torch.tensor([5, 2, 0]))
    kw.update(over)
    return kw


def packed(**over):
    kw = dict(log_probs=-torch.rand(7), ref_log_probs=-torch.rand(7), offsets=torch.tensor([0, 3, 3, 7]))
    kw.update(over)
    return kw


def listed(**over):
    kw = dict(log_probs=[torch.zeros(2), torch.zeros(3)], ref_log_probs=[torch.zeros(2), torch.zeros(3)])
    kw.update(over)
    return kw


# (id, kwargs factory, exception type, regex the message must match)
CATALOGUE = [
    # log-probs
    ("logprobs-shape-mismatch", lambda: padded(ref_log_probs=torch.zeros(B, T + 1)), ValueError,
     r"ref_log_probs must have the shape of log_probs \[3, 5\]"),
    ("logprobs-packed-length-mismatch", lambda: packed(ref_log_probs=torch.zeros(8)), ValueError,
     r"ref_log_probs must have the shape of log_probs \[7\]"),
    ("logprobs-list-length-mismatch", lambda: listed(ref_log_probs=[torch.zeros(2), torch.zeros(4)]), ValueError,
     r"ref_log_probs must have the sequence lengths of log_probs: sequence 1 has 4 tokens"),
    ("ref-list-trailing-dim", lambda: listed(ref_log_probs=[torch.zeros(2, 1), torch.zeros(3, 1)]), ValueError,
     r"ref_log_probs must be 1-D \[L\] per sequence like log_probs, got \[L, 1\]"),
    ("ref-list-mixed-ranks", lambda: listed(ref_log_probs=[torch.zeros(2, 1), torch.zeros(3)]), ValueError,
     r"ref_log_probs\[1\] has shape \[3\] but ref_log_probs\[0\] has \[2, 1\]"),
    ("ref-nested-trailing-dim", lambda: dict(
        log_probs=torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)], layout=torch.jagged),
        ref_log_probs=torch.nested.nested_tensor([torch.zeros(2, 1), torch.zeros(3, 1)], layout=torch.jagged)),
     ValueError, r"ref_log_probs must be 1-D \[L\] per sequence like log_probs"),
    ("logprobs-list-count-mismatch", lambda: listed(ref_log_probs=[torch.zeros(2)]), ValueError,
     r"ref_log_probs has 1 sequences but log_probs has 2"),
    ("logprobs-integer", lambda: padded(log_probs=torch.zeros(B, T, dtype=torch.int64)), TypeError,
     r"log_probs must be a floating tensor .* got torch.int64"),
    ("ref-integer", lambda: padded(ref_log_probs=torch.zeros(B, T, dtype=torch.int32)), TypeError,
     r"ref_log_probs must be a floating tensor"),
    ("logprobs-3d", lambda: padded(log_probs=torch.zeros(B, T, 1), ref_log_probs=torch.zeros(B, T, 1), lengths=None),
     ValueError, r"log_probs must be packed \[N\] .* got shape \[3, 5, 1\]"),
    ("logprobs-not-a-tensor", lambda: padded(log_probs="x"), TypeError, r"log_probs must be a tensor, .* got str"),
    ("logprobs-numpy", lambda: padded(log_probs=object(), ref_log_probs=object()), TypeError,
     r"log_probs must be a tensor"),
    ("ref-list-vs-tensor", lambda: padded(ref_log_probs=[torch.zeros(T)] * B), TypeError,
     r"must use the same layout"),
    ("ref-dense-vs-nested", lambda: dict(log_probs=torch.nested.nested_tensor([torch.zeros(2)], layout=torch.jagged),
                                         ref_log_probs=torch.zeros(1, 2)), TypeError,
     r"ref_log_probs must be a nested tensor"),
    # mask
    ("mask-wrong-shape", lambda: padded(mask=torch.ones(B, T - 1, dtype=torch.bool)), ValueError,
     r"mask must have the shape of log_probs \[3, 5\], got \[3, 4\]"),
    ("mask-not-bool", lambda: padded(mask=torch.ones(B, T)), TypeError, r"mask must be a bool tensor .* got torch.float32"),
    ("mask-int", lambda: packed(mask=torch.ones(7, dtype=torch.int64)), TypeError, r"mask must be a bool tensor"),
    ("mask-list-lengths", lambda: listed(mask=[torch.ones(2, dtype=torch.bool), torch.ones(2, dtype=torch.bool)]),
     ValueError, r"mask must have the sequence lengths of log_probs"),
    # offsets
    ("offsets-int16", lambda: packed(offsets=torch.tensor([0, 3, 3, 7], dtype=torch.int16)), TypeError,
     r"offsets must be an int64 or int32 tensor"),  # (int32 is accepted: tests/test_int32_indices.py)
    ("offsets-2d", lambda: packed(offsets=torch.tensor([[0, 3, 3, 7]])), ValueError, r"offsets must be 1-D"),
    ("offsets-empty", lambda: packed(offsets=torch.zeros(0, dtype=torch.int64)), ValueError, r"offsets must be 1-D with B \+ 1 >= 1"),
    ("offsets-not-zero-start", lambda: packed(offsets=torch.tensor([1, 3, 3, 7])), ValueError, r"offsets must start at 0"),
    ("offsets-decreasing", lambda: packed(offsets=torch.tensor([0, 4, 3, 7])), ValueError, r"offsets must be non-decreasing"),
    ("offsets-end-short", lambda: packed(offsets=torch.tensor([0, 3, 3, 6])), ValueError,
     r"offsets must end at the number of tokens N = 7, got offsets\[-1\] = 6"),
    ("offsets-end-long", lambda: packed(offsets=torch.tensor([0, 3, 3, 9])), ValueError, r"offsets must end at .* = 9"),
    ("offsets-missing", lambda: packed(offsets=None), ValueError, r"1-D log_probs is the packed layout and needs offsets"),
    ("offsets-with-padded", lambda: padded(offsets=torch.tensor([0, 5])), ValueError,
     r"offsets is for the packed layout"),
    ("offsets-list", lambda: packed(offsets=[0, 3, 3, 7]), TypeError, r"offsets must be a 1-D int64 tensor"),
    # lengths
    ("lengths-too-long", lambda: padded(lengths=torch.tensor([6, 2, 0])), ValueError, r"lengths must be <= T = 5"),
    ("lengths-negative", lambda: padded(lengths=torch.tensor([-1, 2, 0])), ValueError, r"lengths must be >= 0"),
    ("lengths-wrong-shape", lambda: padded(lengths=torch.tensor([5, 2])), ValueError, r"lengths must have shape \[B\] = \[3\]"),
    ("lengths-float", lambda: padded(lengths=torch.tensor([5.0, 2.0, 0.0])), TypeError, r"lengths must be an integer tensor"),
    ("lengths-with-packed", lambda: packed(lengths=torch.tensor([3, 0, 4])), ValueError,
     r"lengths is for the padded layout"),
    ("lengths-with-list", lambda: listed(lengths=[2, 3]), ValueError, r"lengths must be None when log_probs is a list"),
    # prompt_lens
    ("prompt-lens-exceeds-length", lambda: padded(prompt_lens=torch.tensor([1, 3, 0])), ValueError,
     r"prompt_lens must be <= lengths: sequence 1 has prompt_lens 3 but only 2 tokens"),
    ("prompt-lens-exceeds-packed", lambda: packed(prompt_lens=torch.tensor([0, 1, 0])), ValueError,
     r"prompt_lens must be <= the sequence lengths: sequence 1"),
    ("prompt-lens-negative", lambda: padded(prompt_lens=torch.tensor([-1, 0, 0])), ValueError, r"prompt_lens must be >= 0"),
    ("prompt-lens-shape", lambda: padded(prompt_lens=torch.tensor([1, 1])), ValueError, r"prompt_lens must have shape \[B\] = \[3\]"),
    ("prompt-lens-float", lambda: padded(prompt_lens=[0.5, 0, 0]), TypeError, r"prompt_lens must be an integer tensor"),
    # reward
    ("reward-wrong-shape", lambda: padded(reward=torch.zeros(B, T + 1)), ValueError,
     r"reward must be per-token \[3, 5\] or \[3, 5, 1\], or per-sequence .* got shape \[3, 6\]"),
    ("reward-wrong-batch", lambda: padded(reward=torch.zeros(B + 1, 1)), ValueError, r"reward must be .* got shape \[4, 1\]"),
    ("reward-token-placement-needs-token", lambda: padded(reward=torch.zeros(B), reward_placement="token"), ValueError,
     r"reward_placement='token' needs a per-token reward"),
    ("reward-last-needs-sequence", lambda: padded(reward=torch.zeros(B, T), reward_placement="last"), ValueError,
     r"reward_placement='last' needs a per-sequence reward \[B\]"),
    ("reward-1d-auto-needs-placement", lambda: padded(reward=torch.zeros(B)), ValueError,
     r"pass one explicitly"),
    ("reward-packed-seq-auto", lambda: packed(reward=torch.zeros(3, 1, 1)), ValueError, r"reward_placement='sequence'"),
    ("reward-ambiguous-t1", lambda: dict(log_probs=torch.zeros(4, 1), ref_log_probs=torch.zeros(4, 1),
                                         reward=torch.zeros(4, 1)), ValueError, r"ambiguous"),
    ("reward-ambiguous-n-eq-b", lambda: packed(offsets=torch.tensor([0, 1, 2, 3, 4, 5, 6, 7]), reward=torch.zeros(7)),
     ValueError, r"ambiguous"),
    ("reward-complex", lambda: padded(reward=torch.zeros(B, T, dtype=torch.complex64)), TypeError, r"reward must be a real"),
    ("reward-list-with-dense", lambda: padded(reward=[torch.zeros(T)] * B), TypeError, r"reward is a list"),
    ("reward-list-lengths", lambda: listed(reward=[torch.zeros(2), torch.zeros(1)]), ValueError,
     r"reward must have the sequence lengths of log_probs"),
    ("reward-list-not-tensors", lambda: listed(reward=[torch.zeros(2), 1.0]), TypeError,
     r"reward\[1\] must be a tensor, got float"),
    ("reward-list-ranks", lambda: listed(reward=[torch.zeros(2, 1), torch.zeros(3)]), ValueError,
     r"\[L\] or \[L, 1\] per sequence, consistently"),
    ("reward-string", lambda: padded(reward="1.0"), TypeError, r"reward must be None, a tensor"),
    # coef
    ("coef-wrong-shape", lambda: padded(coef=torch.ones(B + 1)), ValueError,
     r"coef must be a float, a 0-dim tensor or a per-sequence \[B\] tensor \(B = 3\); got shape \[4\]"),
    ("coef-2d", lambda: padded(coef=torch.ones(B, 1)), ValueError, r"coef must be .* got shape \[3, 1\]"),
    ("coef-string", lambda: padded(coef="0.1"), TypeError, r"coef must be a float"),
    ("coef-bool", lambda: padded(coef=True), TypeError, r"coef must be a float"),
    ("coef-bool-tensor", lambda: padded(coef=torch.tensor(True)), TypeError, r"coef must be a real tensor"),
    # options
    ("estimator-unknown", lambda: padded(estimator="k4"), ValueError, r"estimator must be one of 'k1', .* got 'k4'"),
    ("placement-unknown", lambda: padded(reward_placement="first"), ValueError, r"reward_placement must be one of"),
    ("padding-side-unknown", lambda: padded(padding_side="center"), ValueError, r"padding_side must be 'left' or 'right'"),
    ("clamp-reversed", lambda: padded(clamp_input=(1.0, -1.0)), ValueError, r"clamp_input must satisfy lo <= hi"),
    ("clamp-not-pair", lambda: padded(clamp_output=3.0), ValueError, r"clamp_output must be None or a pair"),
    ("clamp-nan", lambda: padded(clamp_output=(float("nan"), 1.0)), ValueError, r"clamp_output bounds must be real"),
    ("detach-not-bool", lambda: padded(detach=1), TypeError, r"detach must be a bool"),
    ("return-ref-not-bool", lambda: padded(return_ref="yes"), TypeError, r"return_ref must be a bool"),
    ("backend-unknown", lambda: padded(backend="numpy"), ValueError, r"backend must be one of 'auto', 'torch'"),
    # devices: 'meta' stands in for a second device on a CPU-only machine
    ("device-ref", lambda: padded(ref_log_probs=torch.zeros(B, T, device="meta")), ValueError,
     r"ref_log_probs is on meta but log_probs is on cpu"),
    ("device-mask", lambda: padded(mask=torch.ones(B, T, dtype=torch.bool, device="meta")), ValueError,
     r"mask is on meta but log_probs is on cpu"),
    ("device-offsets", lambda: packed(offsets=torch.tensor([0, 3, 3, 7], device="meta")), ValueError,
     r"offsets is on meta but log_probs is on cpu"),
    ("device-lengths", lambda: padded(lengths=torch.tensor([5, 2, 0], device="meta")), ValueError, r"lengths is on meta"),
    ("device-prompt-lens", lambda: padded(prompt_lens=torch.tensor([0, 0, 0], device="meta")), ValueError,
     r"prompt_lens is on meta"),
    ("device-reward", lambda: padded(reward=torch.zeros(B, T, device="meta")), ValueError, r"reward is on meta"),
    ("device-coef", lambda: padded(coef=torch.ones(B, device="meta")), ValueError, r"coef is on meta"),
]


@pytest.mark.parametrize("make, exc, pattern", [c[1:] for c in CATALOGUE], ids=[c[0] for c in CATALOGUE])
def test_bad_input_is_rejected_clearly(make, exc, pattern):
    kwargs = make()
    snap = snapshot(kwargs)
    with pytest.raises(exc, match=pattern):
        kl_reward(**kwargs)
    assert_unmodified(snap)


def test_catalogue_ids_are_unique():
    ids = [c[0] for c in CATALOGUE]
    assert len(ids) == len(set(ids))


@pytest.mark.parametrize("make", [padded, packed, listed], ids=["padded", "packed", "list"])
def test_catalogue_bases_are_valid(make):
    """Each bad case differs from a valid call in one argument: the bases themselves must work."""
    kl_reward(**make())


def test_zero_length_rows_and_empty_batch_work():
    out = kl_reward(torch.zeros(0, 4), torch.zeros(0, 4), lengths=torch.zeros(0, dtype=torch.int64))
    assert out.kl.shape == (0, 4) and out.kl_sum.shape == (0,)
    out = kl_reward(torch.zeros(0), torch.zeros(0), offsets=torch.tensor([0, 0, 0]))
    assert out.count.tolist() == [0, 0]
    out = kl_reward(torch.zeros(2, 0), torch.zeros(2, 0), reward=torch.ones(2), reward_placement="last")
    assert out.reward.shape == (2, 0)


@pytest.mark.parametrize("case", ["packed", "padded lengths", "prompt_lens", "loss packed", "loss padded"])
def test_meta_tensors_are_reported_as_a_device_no_backend_runs_on(case):
    """Meta tensors hold no values: the value checks of offsets, lengths and prompt_lens skip them
    (a read failed with torch's "Cannot copy out of meta tensor"), and dispatch says why nothing runs."""
    from kl_kernels import BackendUnavailableError, kl_penalty_loss

    def m(*shape):
        return torch.empty(*shape, device="meta")

    offsets, lengths = torch.tensor([0, 4, 10], device="meta"), torch.tensor([1, 2, 3], device="meta")
    call = {"packed": lambda: kl_reward(m(10), m(10), offsets=offsets),
            "padded lengths": lambda: kl_reward(m(3, 5), m(3, 5), lengths=lengths),
            "prompt_lens": lambda: kl_reward(m(3, 5), m(3, 5), prompt_lens=lengths),
            "loss packed": lambda: kl_penalty_loss(m(10), m(10), m(10), offsets=offsets),
            "loss padded": lambda: kl_penalty_loss(m(3, 5), m(3, 5), m(3, 5), lengths=lengths)}[case]
    with pytest.raises(BackendUnavailableError, match="inputs are on meta"):
        call()
