"""The device-side value checks of offsets and lengths (csrc/cuda/ragged_checks.cu), which an eager
call on CUDA tensors enqueues instead of six torch operations per check (``value_checks.kernel_check``).

Run here under the host emulation (``kl_kernels._cuda_emu``, the same source): on random offsets and
lengths, valid or broken at one place, across the block's 256 threads (B up to 700), what the kernel
records in the error word (kl_kernels/device_errors.py) raises the host check's ``ValueError``, word for
word (``ragged.check_offsets`` / ``check_lengths`` on CPU tensors), and nothing when the host check
passes. On a GPU, ``.ci/gpu`` and ``.ci/gpu_checks.py`` run the calls that use it.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from batches import LAYOUTS, check
from kl_kernels import _extensions, codes, device_errors, ragged, value_checks
from strategies import cases
from test_kl_reward_oracle import _auto_is_ambiguous

pytestmark = pytest.mark.cuda_emulated


def _recorded(values: torch.Tensor) -> str | None:
    """The message of the error recorded on ``values``' device (the CPU's word, the emulated kernels'),
    clearing it; None when none."""
    try:
        device_errors.raise_pending(values.device)
    except ValueError as e:
        return str(e).split(" (found on ")[0]
    return None


def _kernel_says(kernel: str, values: torch.Tensor, batch: int, bound: int, *per_sequence, name: str,
                 bound_kind: int = -1) -> str | None:
    """The emulated kernel's finding as the message it raises (None: valid)."""
    module = _extensions.load("_cuda_emu")[0]
    assert _recorded(values) is None  # nothing left over
    code = value_checks.launch_check(getattr(module, kernel), values, batch, bound, *per_sequence, name=name,
                                     bound_kind=bound_kind, stream=0)
    assert code == 0
    return _recorded(values)


def _host_says(check, *args) -> str | None:
    try:
        check(*args)
    except ValueError as e:
        return str(e)
    return None


@st.composite
def _offsets(draw):
    lengths = draw(st.lists(st.integers(0, 5), min_size=0, max_size=700))
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    total = offsets[-1]
    fault = draw(st.sampled_from(["none", "start", "end", "decrease", "total"]))
    if fault == "start":
        offsets[0] = draw(st.sampled_from([-1, 1]))
    elif fault == "end":
        offsets[-1] += draw(st.sampled_from([-1, 1]))
    elif fault == "decrease" and len(offsets) > 2:
        i = draw(st.integers(1, len(offsets) - 2))
        offsets[i] = offsets[i + 1] + 1
    elif fault == "total":
        total += 1
    return torch.tensor(offsets, dtype=torch.int64), total


@given(case=_offsets())
@settings(max_examples=60, deadline=None)
def test_offsets_kernel_agrees_with_the_host_check(case):
    offsets, total = case
    want = _host_says(ragged.check_offsets, offsets, total)
    assert _kernel_says("offsets_valid", offsets, offsets.shape[0] - 1, total, name="offsets") == want


@given(lengths=st.lists(st.integers(-2, 40), min_size=0, max_size=700), width=st.integers(0, 38))
@settings(max_examples=60, deadline=None)
def test_lengths_kernel_agrees_with_the_host_check(lengths, width):
    t = torch.tensor(lengths, dtype=torch.int64)
    want = _host_says(ragged.check_lengths, t, len(lengths), width)
    got = _kernel_says("lengths_valid", t, len(lengths), width, None, None, name="lengths")
    # one bad value each side at most is the host's report (it names the smallest / largest); the kernel
    # names the first bad one: the same message when there is one of a kind
    below, above = (t < 0).sum().item(), (t > width).sum().item()
    if below <= 1 and (below == 1 or above <= 1):
        assert got == want
    else:
        assert (got is None) == (want is None)


@given(data=st.data())
@settings(max_examples=60, deadline=None)
def test_prompt_lens_kernel_agrees_with_the_host_check(data):
    """prompt_lens against each sequence's length: from offsets (packed) or from lengths (padded)."""
    from kl_kernels import kl_reward

    lens = data.draw(st.lists(st.integers(0, 6), min_size=1, max_size=300))
    prompt = torch.tensor([data.draw(st.integers(-1, n + 1)) for n in lens], dtype=torch.int64)
    lengths = torch.tensor(lens, dtype=torch.int64)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    width = max(lens)
    for packed in (True, False):
        kw = dict(offsets=offsets) if packed else dict(lengths=lengths, padding_side="right")
        shape = (int(offsets[-1]),) if packed else (len(lens), width)
        try:
            kl_reward(torch.zeros(shape), torch.zeros(shape), prompt_lens=prompt, backend="torch", **kw)
            want = None
        except ValueError as e:
            want = str(e)
        got = _kernel_says("lengths_valid", prompt, len(lens), width, offsets if packed else None,
                           None if packed else lengths, name="prompt_lens", bound_kind=0 if packed else 1)
        if ((prompt < 0).sum() + (prompt > lengths).sum()) <= 1:  # one bad value: the same message
            assert got == want, (packed, lens, prompt.tolist())
        else:
            assert (got is None) == (want is None), (packed, lens, prompt.tolist())


def test_kernel_check_falls_back_where_it_cannot_run():
    """CPU tensors, other dtypes and strided values are not the kernels': False, and the caller uses
    torch operations (or the host check, for CPU tensors)."""
    assert value_checks.kernel_check("offsets_valid", torch.tensor([0, 1]), 1, 1, name="offsets") is False
    assert value_checks.kernel_check("lengths_valid", torch.tensor([1, 2], dtype=torch.int32), 2, 3, None, None,
                                     name="lengths") is False


def _checks_as_on_a_gpu(monkeypatch) -> list:
    """Make the value checks take their accelerator path on CPU tensors: ``checks_on_host`` False,
    ``kernel_check`` run by the emulated kernels through the same argument marshalling, recording into the
    CPU's error word. Returns the list the kernels' names are appended to, call by call."""
    module = _extensions.load("_cuda_emu")[0]
    calls = []

    def on_the_emulator(kernel, values, batch, bound, *per_sequence, name, bound_kind=-1):
        calls.append(kernel)
        code = value_checks.launch_check(getattr(module, kernel), values, batch, bound, *per_sequence, name=name,
                                         bound_kind=bound_kind, stream=0)
        assert code == 0
        return True

    monkeypatch.setattr(value_checks, "checks_on_host", lambda t: False)
    monkeypatch.setattr(value_checks, "kernel_check", on_the_emulator)
    return calls


def test_every_call_site_passes_what_the_kernels_take(monkeypatch):
    """The eager calls that enqueue a value check on a GPU, run here through the emulated kernels
    (``checks_on_host`` made False, ``kernel_check`` routed to ``_cuda_emu`` by the same argument
    marshalling): each passes arguments the binding accepts, valid batches pass and a bad
    ``prompt_lens`` is recorded, raised by the next call as the host's ValueError, after which calls work.
    A packed batch's ``prompt_lens`` check once passed ``width=None``, a TypeError on every packed GPU call
    with ``prompt_lens`` (first H100 run)."""
    from kl_kernels import kl_penalty_loss, kl_reward

    calls = _checks_as_on_a_gpu(monkeypatch)
    lens = torch.tensor([3, 0, 2])
    offsets = torch.tensor([0, 3, 3, 5])
    prompt = torch.tensor([1, 0, 2])
    packed, padded = torch.randn(5), torch.randn(3, 4)
    for kw in (dict(offsets=offsets), dict(lengths=lens, padding_side="left"), dict()):
        x = padded if "offsets" not in kw else packed
        out = kl_reward(x, x * 0.5, torch.ones(3), prompt_lens=prompt, reward_placement="last", backend="torch", **kw)
        assert out.reward.isfinite().all()
        kl_penalty_loss(x, x * 0.5, torch.ones_like(x), ref_log_probs=x * 0.25, backend="torch", **kw)
    assert set(calls) == {"offsets_valid", "lengths_valid"}
    kl_reward(packed, packed, prompt_lens=torch.tensor([4, 0, 0]), offsets=offsets, backend="torch")  # no raise here
    with pytest.raises(ValueError, match="prompt_lens must be <= the sequence lengths: sequence 0 has prompt_lens 4 "
                                         "but only 3 tokens"):
        kl_reward(packed, packed, offsets=offsets, backend="torch")  # the next call
    assert kl_reward(packed, packed, offsets=offsets, backend="torch").kl.eq(0).all()  # and then calls work


@pytest.mark.parametrize("layout", LAYOUTS)
@given(case=cases(dtypes=(torch.float32, torch.bfloat16)))
@settings(max_examples=20, deadline=None)
def test_oracle_cases_on_the_accelerator_path_of_the_checks(layout, case):
    """The oracle's random cases (every layout, masks, prompt_lens, rewards, placements) with the
    value checks on their accelerator path (above): the calls run and match the float64 oracle, as
    on the CPU path. The first H100 run found a call site only that path reaches; this sweeps them."""
    assume(not (layout == "nested_strided" and case.batch == 0))  # torch has no empty strided nested tensor
    assume(not _auto_is_ambiguous(case, layout))  # raises, asking for a placement (tested in the oracle)
    with pytest.MonkeyPatch.context() as mp:
        _checks_as_on_a_gpu(mp)
        check(case, layout, backend="torch")
