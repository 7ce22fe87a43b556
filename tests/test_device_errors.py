"""Bad values on an accelerator (issue 51): recorded in the device's error word, never asserted.

What a GPU call does with a bad ``offsets`` / ``lengths`` / ``prompt_lens`` / label, run here on CPU tensors
through the same machinery: ``checks_on_host`` made False (the accelerator path of the checks), the check
kernels run by the CUDA emulation (``_cuda_emu``, the same source as ``_cuda``) or, for the Triton
interpreter and the torch backend, the torch-operation checks, each recording into the CPU's error word
(``kl_kernels.device_errors``). For each case:

* the bad call returns (nothing asserts, nothing reads outside its buffers: the ASan lane runs this module),
  with NaN in the affected sequences' outputs and the valid sequences' outputs as a valid call gives them;
* ``kl_kernels.check_errors()`` (or the next call) raises the ``ValueError`` the host check gives for the
  same input, word for word, and clears the word;
* a valid call right after works.

Inside the bad call the emulation has already recorded the error (it runs synchronously, where a GPU would
still be running the check), so the launchers' read of the word is switched off for that call alone: the
outputs are what a GPU call returns before the error surfaces.
"""

from __future__ import annotations

import math

import pytest
import torch

from conftest import backend_device
import kl_kernels
from kl_kernels import check_errors, codes, device_errors, kl_penalty_loss, kl_reward, ragged, token_logprobs, value_checks

EMULATED = pytest.param("cuda-emulated", marks=pytest.mark.cuda_emulated)
TRITON = pytest.param("triton", marks=pytest.mark.triton)
BACKENDS = ["torch", EMULATED, TRITON]


@pytest.fixture(autouse=True)
def _clean_word():
    device_errors.word("cpu").tensor.zero_()
    yield
    device_errors.word("cpu").tensor.zero_()


def _host_message(fn, **kw) -> str:
    """The ValueError the host checks (CPU tensors) give for the call."""
    with pytest.raises(ValueError) as e:
        fn(**kw)
    return str(e.value)


def _emulated_check_kernel(module, launched=None):
    """A stand-in for ``value_checks.kernel_check``: the check kernel run by the emulation (``module``:
    ``_cuda_emu``; False, as when it cannot run, without it) through the same argument marshalling
    (``value_checks.launch_check``), recording into the CPU's error word; each kernel's name appended to
    ``launched``."""

    def check_kernel(kernel, values, batch, bound, *per_sequence, name, bound_kind=-1):
        if module is None:
            return False
        if launched is not None:
            launched.append(kernel)
        assert value_checks.launch_check(getattr(module, kernel), values, batch, bound, *per_sequence, name=name,
                                         bound_kind=bound_kind, stream=0) == 0
        return True

    return check_kernel


def _as_on_a_gpu(monkeypatch, fn, **kw):
    """``fn(**kw)`` with the value checks on their accelerator path and the launchers' read of the error
    word off (see the module doc): the outputs a GPU call returns before its error surfaces."""
    from kl_kernels import _extensions

    module = _extensions.load("_cuda_emu")[0]

    with monkeypatch.context() as mp:
        mp.setattr(value_checks, "checks_on_host", lambda t: False)
        mp.setattr(value_checks, "kernel_check", _emulated_check_kernel(module))
        mp.setattr(device_errors, "raise_pending", lambda device: None)
        # every backend runs through: the torch backend too clamps what it indexes with (on a GPU an index out of
        # range in torch's own operations is a device-side assertion; here on the CPU, an IndexError)
        return fn(**kw)


LENGTHS = [3, 2, 4, 3]


def _packed(dev):
    g = torch.Generator().manual_seed(5)
    n = sum(LENGTHS)
    lp, ref = -torch.rand(n, generator=g) * 2, -torch.rand(n, generator=g) * 2
    return lp.to(dev), ref.to(dev), ragged.lengths_to_offsets(torch.tensor(LENGTHS)).to(dev)


# (name, offsets edit, the sequences whose geometry is bad: their own offsets, or a decrease next to them;
# with a decrease the sequence searches may put any token anywhere, so only monotone cases promise the rest)
OFFSETS_CASES = [
    ("decreasing", lambda o: torch.tensor([0, 3, 1, 9, 12]), [0, 1, 2]),
    ("start-negative", lambda o: torch.cat([o[:1] - 2, o[1:]]), [0]),
    ("start-positive", lambda o: torch.cat([o[:1] + 1, o[1:]]), [0]),
    ("end-beyond", lambda o: torch.cat([o[:-1], o[-1:] + 5]), [3]),
    ("end-short", lambda o: torch.cat([o[:-1], o[-1:] - 2]), [3]),
    ("huge", lambda o: torch.tensor([0, 2 ** 62, 5, 9, 12]), [0, 1, 2]),
    ("negative-middle", lambda o: torch.tensor([0, -5, 5, 9, 12]), [0, 1]),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", OFFSETS_CASES, ids=[c[0] for c in OFFSETS_CASES])
def test_bad_offsets_are_recorded_poisoned_and_raised(monkeypatch, backend, case):
    _, edit, bad = case
    dev = backend_device(backend)
    lp, ref, offsets = _packed(dev)
    bad_offsets = edit(offsets.cpu()).to(dev)
    score = torch.arange(4.0, device=dev)
    kw = dict(coef=0.1, estimator="k3", reward_placement="last", backend=backend)
    want_message = _host_message(kl_reward, log_probs=lp.cpu(), ref_log_probs=ref.cpu(), reward=score.cpu(),
                                 offsets=bad_offsets.cpu(), **dict(kw, backend="torch"))
    good = kl_reward(lp, ref, score, offsets=offsets, **kw)
    out = _as_on_a_gpu(monkeypatch, kl_reward, log_probs=lp, ref_log_probs=ref, reward=score, offsets=bad_offsets,
                       **kw)
    # every backend (the torch one too): NaN in the affected sequences, the rest as a valid call gives
    for b in range(4):
        if b in bad:
            assert math.isnan(out.kl_sum[b].item()), (b, out.kl_sum)
        elif bool((bad_offsets[1:] >= bad_offsets[:-1]).all()):  # monotone: the others computed as usual
            assert torch.equal(out.kl_sum[b], good.kl_sum[b]), (b, out.kl_sum, good.kl_sum)
    with pytest.raises(ValueError) as e:
        check_errors("cpu")
    assert str(e.value).split(" (found on ")[0] == want_message
    check_errors("cpu")  # cleared: nothing more
    again = kl_reward(lp, ref, score, offsets=offsets, **kw)
    assert torch.equal(again.kl, good.kl) and torch.equal(again.kl_sum, good.kl_sum)


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_next_call_raises_and_the_one_after_works(monkeypatch, backend):
    dev = backend_device(backend)
    lp, ref, offsets = _packed(dev)
    bad = torch.tensor([0, 3, 1, 9, 12], device=dev)
    _as_on_a_gpu(monkeypatch, kl_reward, log_probs=lp, ref_log_probs=ref, offsets=bad, backend=backend)
    assert device_errors.word("cpu").pending()
    with pytest.raises(ValueError, match=r"offsets must be non-decreasing \(sequence lengths >= 0\) \(found on cpu"):
        kl_reward(lp, ref, offsets=offsets, backend=backend)
    assert not device_errors.word("cpu").pending()
    out = kl_reward(lp, ref, offsets=offsets, backend=backend)
    assert out.kl_sum.isfinite().all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("side", ["left", "right"])
def test_bad_lengths_and_prompt_lens(monkeypatch, backend, side):
    dev = backend_device(backend)
    g = torch.Generator().manual_seed(6)
    lp, ref = (-torch.rand(4, 5, generator=g)).to(dev), (-torch.rand(4, 5, generator=g)).to(dev)
    good_lengths = torch.tensor([3, 5, 0, 2], device=dev)
    for lengths, prompt, bad_row in ((torch.tensor([3, 7, 0, 2]), None, 1),       # above T
                                     (torch.tensor([3, 5, -1, 2]), None, 2),      # below 0
                                     (good_lengths.cpu(), torch.tensor([0, 6, 0, 0]), 1)):  # prompt above length
        lengths = lengths.to(dev)
        kw = dict(lengths=lengths, padding_side=side, estimator="k1", backend=backend)
        if prompt is not None:
            kw["prompt_lens"] = prompt.to(dev)
        cpu_kw = {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
        want = _host_message(kl_reward, log_probs=lp.cpu(), ref_log_probs=ref.cpu(), **dict(cpu_kw, backend="torch"))
        good = kl_reward(lp, ref, **dict(kw, lengths=good_lengths, prompt_lens=None))
        out = _as_on_a_gpu(monkeypatch, kl_reward, log_probs=lp, ref_log_probs=ref, **kw)
        assert math.isnan(out.kl_sum[bad_row].item()) and out.kl[bad_row].isnan().all()
        others = [b for b in range(4) if b != bad_row]
        assert torch.equal(out.kl_sum[others], good.kl_sum[others])
        with pytest.raises(ValueError) as e:
            check_errors("cpu")
        assert str(e.value).split(" (found on ")[0] == want


@pytest.mark.parametrize("backend", BACKENDS)
def test_kl_penalty_loss_bad_offsets(monkeypatch, backend):
    dev = backend_device(backend)
    lp, ref, offsets = _packed(dev)
    bad = torch.tensor([0, 3, 1, 9, 12], device=dev)
    kw = dict(ref_log_probs=ref, beta=0.1, estimator="k3", aggregation="seq-mean-token-mean", backend=backend)
    out = _as_on_a_gpu(monkeypatch, kl_penalty_loss, log_probs=lp, old_log_probs=lp, advantages=torch.ones_like(lp),
                       offsets=bad, **kw)
    assert math.isnan(out.loss.item())  # the bad sequences' NaN reaches the mean
    with pytest.raises(ValueError, match="offsets must be non-decreasing"):
        check_errors("cpu")
    assert kl_penalty_loss(lp, lp, torch.ones_like(lp), offsets=offsets, **kw).loss.isfinite()


@pytest.mark.parametrize("backend", ["torch", "cpu", EMULATED, TRITON])
def test_labels_outside_the_vocabulary(monkeypatch, backend):
    dev = backend_device(backend)
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(5, 7, generator=g).to(dev)
    labels = torch.tensor([1, 9, -100, 3, 0], device=dev)
    want = _host_message(token_logprobs, logits=logits.cpu(), labels=labels.cpu(), backend="torch")
    out = _as_on_a_gpu(monkeypatch, token_logprobs, logits=logits, labels=labels, backend=backend)
    assert out is not None and math.isnan(out.log_probs[1].item()) and out.log_probs[[0, 3, 4]].isfinite().all()
    with pytest.raises(ValueError) as e:
        check_errors("cpu")
    assert str(e.value).split(" (found on ")[0] == want
    assert token_logprobs(logits, labels.clamp(0, 6), backend=backend).log_probs.isfinite().all()


def test_first_error_wins_and_the_word_layout_is_the_tables():
    """Two bad values: the first recorded is reported; the word's slots are codes.py's table."""
    w = device_errors.word("cpu")
    assert w.tensor.shape == (codes.ERROR_WORD_SLOTS,) and w.tensor.dtype == torch.int64
    x = torch.tensor([5, -1, 7])
    device_errors.record_where(x.lt(0), x, "below_zero", "lengths", 4)
    device_errors.record_where(x.gt(4), x, "above_bound", "lengths", 4)
    t = w.tensor.tolist()
    assert t[codes.ERROR_SLOTS["kind"]] == codes.VALUE_ERROR_CODES["below_zero"]
    assert t[codes.ERROR_SLOTS["index"]] == 1 and t[codes.ERROR_SLOTS["value"]] == -1
    with pytest.raises(ValueError, match=r"lengths must be >= 0, got -1 \(found on cpu.*at index 1\)"):
        check_errors("cpu")
    assert w.tensor.eq(0).all()


# ---------------------------------------------------------------------------- nested arguments' sequence lengths

NESTED = [3, 4, 5]


def _nt(tensors, layout):
    return torch.nested.nested_tensor(tensors, layout=layout)


def _nested_call(op, arg, layout, dev, bad):
    """``(fn, kwargs)`` of a call of ``op`` on nested log_probs whose argument ``arg`` is a nested tensor of its own
    (its own offsets), with its first two sequences' lengths swapped when ``bad`` (the same total)."""
    g = torch.Generator().manual_seed(11)
    lens = [4, 3, 5] if bad else NESTED

    def own(lengths, dtype=torch.float32):
        if dtype == torch.bool:
            return _nt([torch.ones(n, dtype=torch.bool, device=dev) for n in lengths], layout)
        return _nt([(-torch.rand(n, generator=g)).to(dev) for n in lengths], layout)

    lp = own(NESTED)
    if op == "kl_reward":
        kw = dict(log_probs=lp, ref_log_probs=own(NESTED), estimator="k3", coef=0.1)
        kw[{"reward": "reward", "ref_log_probs": "ref_log_probs", "mask": "mask"}[arg]] = own(
            lens, torch.bool if arg == "mask" else torch.float32)
        return kl_reward, kw
    kw = dict(log_probs=lp, old_log_probs=own(NESTED), advantages=own(NESTED), ref_log_probs=own(NESTED),
              beta=0.1, estimator="k3", aggregation="seq-mean-token-mean")
    if arg == "entropy":
        kw["entropy_coef"] = 0.01
    kw[arg] = own(lens)
    return kl_penalty_loss, kw


NESTED_ARGS = [("kl_reward", a) for a in ("ref_log_probs", "mask", "reward")] + [
    ("kl_penalty_loss", a) for a in ("old_log_probs", "ref_log_probs", "advantages", "entropy", "weights")]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", [torch.jagged, torch.strided], ids=["jagged", "strided"])
@pytest.mark.parametrize("op,arg", NESTED_ARGS, ids=[f"{o}-{a}" for o, a in NESTED_ARGS])
def test_nested_argument_with_other_sequence_lengths(monkeypatch, backend, layout, op, arg):
    """A nested argument whose sequence lengths differ from log_probs' (the same total): on an accelerator the
    error word, not a device-side assertion (``value_checks.device_check`` must not be called); the outputs NaN;
    check_errors() raises the host's message; a valid call after works."""
    dev = backend_device(backend)
    fn, kw = _nested_call(op, arg, layout, dev, bad=True)
    cpu_fn, cpu_kw = _nested_call(op, arg, layout, "cpu", bad=True)
    want = _host_message(cpu_fn, **dict(cpu_kw, backend="torch"))
    assert f"{arg} must have the sequence lengths of log_probs: sequence 0 has 4 tokens in {arg} but 3" in want

    def no_assert(*a, **k):
        raise AssertionError("a device-side assertion on a user's value")
    monkeypatch.setattr(value_checks, "device_check", no_assert)
    if reward_kw := (arg == "reward"):
        kw["reward_placement"] = "token"
    out = _as_on_a_gpu(monkeypatch, fn, backend=backend, **kw)
    if op == "kl_penalty_loss":
        assert out.loss.isnan(), out
    else:  # the poisoned reward reaches the reward; the others every counted token's kl
        poisoned = out.reward if reward_kw else out.kl
        assert torch.cat([t.reshape(-1) for t in poisoned.unbind()]).isnan().all(), out
        assert reward_kw or out.kl_sum.isnan().all(), out
    with pytest.raises(ValueError) as e:
        check_errors("cpu")
    assert str(e.value).split(" (found on ")[0] == want
    fn, kw = _nested_call(op, arg, layout, dev, bad=False)
    if reward_kw:
        kw["reward_placement"] = "token"
    out = fn(backend=backend, **kw)
    assert (out.kl_sum.isfinite().all() if op == "kl_reward" else out.loss.isfinite()), out
    check_errors("cpu")


@pytest.mark.parametrize("op,arg", NESTED_ARGS, ids=[f"{o}-{a}" for o, a in NESTED_ARGS])
def test_nested_argument_with_another_token_total_is_refused_on_the_host(monkeypatch, op, arg):
    """Another total number of tokens is a host fact (shapes): a ValueError at the call on an accelerator too,
    before any kernel (the kernels would read past the shorter buffer)."""
    fn, kw = _nested_call(op, arg, torch.jagged, "cpu", bad=False)
    short = [t[:-1] if i == 2 else t for i, t in enumerate(kw[arg].unbind())]
    kw[arg] = _nt(short, torch.jagged)
    if arg == "reward":
        kw["reward_placement"] = "token"
    with monkeypatch.context() as mp:
        mp.setattr(value_checks, "checks_on_host", lambda t: False)
        with pytest.raises(ValueError, match=f"{arg} must have the sequence lengths of log_probs: it holds 11 tokens "
                                             "in all but log_probs 12"):
            fn(backend="torch", **kw)
    check_errors("cpu")  # nothing recorded


def test_nested_arguments_on_log_probs_own_offsets_compare_nothing(monkeypatch):
    """Nested tensors built on one offsets tensor share it: nothing to compare, no device work."""
    values = -torch.rand(12)
    offsets = torch.tensor([0, 3, 7, 12])
    lp = torch.nested.nested_tensor_from_jagged(values, offsets)
    ref = torch.nested.nested_tensor_from_jagged(values - 0.5, offsets)
    called = []
    record = device_errors.record_where
    monkeypatch.setattr(device_errors, "record_where",
                        lambda *a, **k: called.append(a) if a[2] == "lengths_mismatch" else record(*a, **k))
    with monkeypatch.context() as mp:
        mp.setattr(value_checks, "checks_on_host", lambda t: False)
        out = kl_reward(lp, ref, backend="torch")
    assert not called and out.kl_sum.isfinite().all()


def test_no_device_side_assertion_left_in_the_package():
    """No call of ``torch._assert_async`` / ``value_checks.device_check`` (a device-side assertion, which ends the CUDA
    context) outside their definitions: every value check of accelerator tensors records in the error word."""
    import pathlib
    import re

    import kl_kernels

    root = pathlib.Path(kl_kernels.__file__).parent
    # the definitions themselves: torch_compat.assert_async, and value_checks.device_check's body (kept for the tests)
    definitions = {"_compat/torch.py", 'value_checks.py: torch_compat.assert_async(ok, f"kl_kernels: {message}")'}
    found = []
    for path in root.rglob("*.py"):
        name = str(path.relative_to(root))
        if name in definitions:
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#")[0]
            if re.search(r"(assert_async|\bdevice_check)\(", code) and not re.match(r"\s*def ", code) and \
                    f"{name}: {code.strip()}" not in definitions:
                found.append(f"{name}:{i}: {line.strip()}")
    assert not found, found


# ---------------------------------------------------------------------------- the issue's table, every op, int32 too

def _matrix_call(op, case, dt, dev, good=False):
    """``(fn, kwargs, bad_at)`` of a call of ``op`` with the bad value ``case`` in index dtype ``dt`` (``good``: the
    valid call of the same shape); ``bad_at``: the sequence (or token) whose outputs must be NaN."""
    g = torch.Generator().manual_seed(13)
    lens = [3, 2, 4, 3]
    n = sum(lens)
    if op in ("kl_reward", "kl_penalty_loss"):
        if case.startswith("lengths"):
            lp, ref = (-torch.rand(4, 5, generator=g)).to(dev), (-torch.rand(4, 5, generator=g)).to(dev)
            geo = dict(lengths=torch.tensor([3, 2 if good else 6, 4, 3], dtype=dt, device=dev))
            bad_at = 1
        else:
            lp, ref = (-torch.rand(n, generator=g)).to(dev), (-torch.rand(n, generator=g)).to(dev)
            offsets = {"offsets-decreasing": [0, 3, 1, 9, 12], "offsets-end-beyond": [0, 3, 5, 9, 15],
                       "prompt_lens-above-sequence": [0, 3, 5, 9, 12]}[case]
            geo = dict(offsets=torch.tensor([0, 3, 5, 9, 12] if good else offsets, dtype=dt, device=dev))
            bad_at = {"offsets-decreasing": 1, "offsets-end-beyond": 3, "prompt_lens-above-sequence": 2}[case]
            if case == "prompt_lens-above-sequence":
                geo["prompt_lens"] = torch.tensor([0, 1, 1 if good else 5, 0], dtype=dt, device=dev)
        if op == "kl_reward":
            return kl_reward, dict(log_probs=lp, ref_log_probs=ref, estimator="k3", coef=0.1, **geo), bad_at
        return kl_penalty_loss, dict(log_probs=lp, old_log_probs=ref, advantages=torch.ones_like(lp), beta=0.1,
                                     ref_log_probs=ref, estimator="k3", aggregation="seq-mean-token-mean",
                                     **geo), bad_at
    vocab, hid = 7, 4
    labels = torch.tensor([1, 3 if good else 9, -100, 3, 0], dtype=dt, device=dev)
    if op == "token_logprobs":
        return token_logprobs, dict(logits=torch.randn(5, vocab, generator=g).to(dev), labels=labels), 1
    hidden, weight = torch.randn(5, hid, generator=g).to(dev), torch.randn(vocab, hid, generator=g).to(dev)
    if op == "linear_token_logprobs":
        return kl_kernels.linear_token_logprobs, dict(hidden=hidden, weight=weight, labels=labels), 1
    return kl_kernels.linear_kl_penalty_loss, dict(hidden=hidden[None], weight=weight, labels=labels[None],
                                                   old_log_probs=torch.full((1, 5), -2.0, device=dev),
                                                   advantages=torch.ones(1, device=dev), beta=0.0), 1


MATRIX = [("kl_reward", c) for c in ("offsets-decreasing", "offsets-end-beyond", "lengths-above-T",
                                      "prompt_lens-above-sequence")] + [
    ("kl_penalty_loss", c) for c in ("offsets-decreasing", "offsets-end-beyond", "lengths-above-T")] + [
    (op, "label-outside-vocabulary") for op in ("token_logprobs", "linear_token_logprobs", "linear_kl_penalty_loss")]


def _backend_kw(op, backend):
    return dict(logprobs_backend=backend, backend=backend) if op == "linear_kl_penalty_loss" else dict(backend=backend)


@pytest.mark.parametrize("dt", [torch.int64, torch.int32], ids=["int64", "int32"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op,case", MATRIX, ids=[f"{o}-{c}" for o, c in MATRIX])
def test_each_bad_value_of_the_issue_on_each_op(monkeypatch, op, case, backend, dt):
    """Issue 51's table on every op that takes the value, every backend that runs here (the torch one too), int64
    and int32: the bad call runs through on the accelerator path with NaN where the value was bad, check_errors()
    raises the CPU's ValueError word for word, and a valid call right after works."""
    dev = backend_device(backend)
    fn, kw, bad_at = _matrix_call(op, case, dt, "cpu")
    want = _host_message(fn, **kw, **_backend_kw(op, "torch"))
    fn, kw, bad_at = _matrix_call(op, case, dt, dev)
    out = _as_on_a_gpu(monkeypatch, fn, **kw, **_backend_kw(op, backend))
    if op == "kl_reward":
        assert math.isnan(out.kl_sum[bad_at].item()), out.kl_sum
    elif op.endswith("kl_penalty_loss"):
        assert math.isnan(out.loss.item()), out.loss
    else:
        assert math.isnan(out.log_probs[bad_at].item()) and out.log_probs[[0, 2, 3, 4]].isfinite().all(), out
    with pytest.raises(ValueError) as e:
        check_errors("cpu")
    assert str(e.value).split(" (found on ")[0] == want
    fn, kw, _ = _matrix_call(op, case, dt, dev, good=True)
    out = fn(**kw, **_backend_kw(op, backend))
    got = out.kl_sum if op == "kl_reward" else out.loss if op.endswith("kl_penalty_loss") else out.log_probs
    assert got.isfinite().all(), got
    check_errors("cpu")  # nothing recorded by the valid call


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_next_call_of_another_op_raises_it(monkeypatch, backend):
    """The word is the device's, not an op's: a bad label of token_logprobs surfaces at the next kl_penalty_loss
    call on the device (before it runs anything), which works when called again."""
    dev = backend_device(backend)
    fn, kw, _ = _matrix_call("token_logprobs", "label-outside-vocabulary", torch.int32, dev)
    _as_on_a_gpu(monkeypatch, fn, backend=backend, **kw)
    loss_fn, loss_kw, _ = _matrix_call("kl_penalty_loss", "offsets-end-beyond", torch.int64, dev, good=True)
    with pytest.raises(ValueError, match=r"labels must be in \[0, 7\) .* got 9 \(found on cpu"):
        loss_fn(backend=backend, **loss_kw)
    assert loss_fn(backend=backend, **loss_kw).loss.isfinite()


@pytest.mark.parametrize("op", ["kl_reward", "kl_penalty_loss"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("offsets", [[0, 3, 1, 9, 12], [0, 3, 5, 9, 15], [0, 3, 5, 9, 10]],
                         ids=["decreasing", "end-beyond", "end-short"])
def test_a_jagged_tensors_own_bad_offsets(monkeypatch, op, backend, offsets):
    """``nested_tensor_from_jagged`` checks no value: a jagged log_probs' own offsets are checked as offsets are
    (they were read as they came: the cpu kernel returned sums of the wrong tokens, the torch backend raised
    IndexError). On the CPU a ValueError at the call naming ``log_probs.offsets()``; on the accelerator path the
    error word, NaN outputs, and a valid call after works."""
    dev = backend_device(backend)
    values = -torch.rand(12, generator=torch.Generator().manual_seed(17))

    def call(off, **kw):
        nt = torch.nested.nested_tensor_from_jagged(values.to(dev), torch.tensor(off, device=dev))
        ref = torch.nested.nested_tensor_from_jagged(values.to(dev) * 0.9, nt.offsets())
        if op == "kl_reward":
            return kl_reward(nt, ref, estimator="k3", backend=backend, **kw).kl_sum
        adv = torch.nested.nested_tensor_from_jagged(torch.ones(12, device=dev), nt.offsets())
        return kl_penalty_loss(nt, ref, adv, beta=0.1, aggregation="seq-mean-token-mean", backend=backend, **kw).loss
    if dev != "cpu":
        pytest.skip("the accelerator path is simulated on CPU tensors")
    with pytest.raises(ValueError, match=r"log_probs\.offsets\(\) must ") as e:  # the host check
        call(offsets)
    want = str(e.value)
    got = _as_on_a_gpu(monkeypatch, call, off=offsets)
    assert got.isnan().any(), got
    with pytest.raises(ValueError) as e:
        check_errors("cpu")
    assert str(e.value).split(" (found on ")[0] == want
    assert call([0, 3, 5, 9, 12]).isfinite().all()
    check_errors("cpu")


_SHORT_OFFSETS = """
import torch
from kl_kernels import device_errors, kl_penalty_loss, value_checks
value_checks.checks_on_host = lambda t: False          # the accelerator path of the value checks
device_errors.raise_pending = lambda device: None
for _ in range(8):  # (a heap corruption shows at some later free: several calls, as in a training loop)
    lp = -torch.rand(12)
    out = kl_penalty_loss(lp, lp * 0.9, torch.ones(12), offsets=torch.tensor([0, 3, 5, 9, 10]), beta=0.1,
                          aggregation="seq-mean-token-mean", backend="triton")
    assert out.loss.isnan()
"""


@pytest.mark.triton
def test_triton_loss_offsets_ending_short_of_the_data():
    """Bad offsets that end short of the data (``offsets[-1] < N``) on the accelerator path of the Triton loss must
    run through memory-safely (NaN, the error recorded). Run in a subprocess: the failure was a heap corruption
    that aborted the interpreter's process (tokens past offsets[B] were sequence B's: the forward wrote
    seq_loss[B]; kl_kernels/triton/tiles.py's frame now gives them to B - 1, as the CUDA kernels do)."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-c", _SHORT_OFFSETS], env=env, capture_output=True, text=True,
                          timeout=300, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert done.returncode == 0, done.stderr[-2000:]


_NO_SEQUENCE = """
import sys, torch
from kl_kernels import device_errors, kl_penalty_loss, kl_reward, value_checks
value_checks.checks_on_host = lambda t: False          # the accelerator path of the value checks
raise_pending = device_errors.raise_pending
device_errors.raise_pending = lambda device: None  # as on a GPU: the check's record not yet visible to the launch
backend, op = sys.argv[1], sys.argv[2]
lp = -torch.rand(5)
for dt in (torch.int64, torch.int32):
    try:
        if op == "kl_reward":
            kl_reward(lp, lp * 0.9, offsets=torch.tensor([0], dtype=dt), backend=backend)
        else:
            kl_penalty_loss(lp, lp * 0.9, torch.ones(5), offsets=torch.tensor([0], dtype=dt), beta=0.1,
                            backend=backend)
    except ValueError as e:
        print(e)
    else:
        raise SystemExit("no ValueError")
    raise_pending("cpu")   # nothing in the word: refused on the host, before any check ran
device_errors.raise_pending = raise_pending
kl_reward(lp, lp * 0.9, offsets=torch.tensor([0, 5]), backend=backend)   # a valid call after
"""


@pytest.mark.parametrize("op", ["kl_reward", "kl_penalty_loss"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_offsets_with_no_sequence_for_tokens_are_refused_on_the_host(op, backend):
    """``offsets`` of shape [1] (no sequence) with N > 0 tokens: wrong whatever the value (offsets[0] must be 0 and
    offsets[-1] N), a host fact: a ValueError at the call on an accelerator too. (The fused kernels wrote out of
    bounds on it, a segfault under cuda-emulated and the Triton interpreter: hence a subprocess.)"""
    import os
    import subprocess
    import sys

    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-c", _NO_SEQUENCE, backend, op], env=env, capture_output=True, text=True,
                          timeout=300, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert done.returncode == 0, (done.returncode, done.stdout[-1000:], done.stderr[-2000:])
    assert done.stdout.count("offsets must end at the number of tokens N = 5") == 2, done.stdout


# --------------------------------------------------------------------------- checks folded into the forward
# Issue 49 item 2: the CUDA forwards of kl_reward and kl_penalty_loss check offsets / lengths / prompt_lens in
# their own combine kernel (csrc/cuda/tiles.cuh: check_key, record_first_check) instead of ragged_checks.cu's
# launches of their own. Each case runs twice through the CUDA kernels under emulation, with the value checks
# on their accelerator path: once with the check kernels (the validation's launches, as without folding) and
# once with them deferred to the forward, which must then launch none and leave the very same finding in the
# error word (kind, argument, index, value, bound, extra: the same ValueError, word for word). Batches of 600
# sequences, so that the combine runs on 3 blocks and the first finding is the grid's, not a block's.

def _folded_cases():
    n = 600
    lens = torch.tensor([(i * 7) % 5 for i in range(n)])  # zeros among them
    offsets = ragged.lengths_to_offsets(lens)
    total = int(offsets[-1])
    g = torch.Generator().manual_seed(11)
    lp, ref = -torch.rand(total, generator=g), -torch.rand(total, generator=g)
    lp_pad, ref_pad = -torch.rand(n, 6, generator=g), -torch.rand(n, 6, generator=g)

    def edited(t, **at):
        t = t.clone()
        for i, v in at.items():
            t[int(i[1:])] = v
        return t

    dec = edited(offsets, i550=int(offsets[549]) - 1)  # a decrease at 550 (later ones are fine)
    both = edited(dec, i600=total + 3)  # and a wrong end: the decrease comes first
    start = edited(offsets, i0=1)
    end = edited(offsets, i600=total - 1)
    plen = torch.zeros(n, dtype=torch.int64)
    reward = dict(estimator="k3", coef=0.1)
    rows = torch.full((n,), 4)
    return {
        "reward-offsets-decreasing": (kl_reward, dict(log_probs=lp, ref_log_probs=ref, offsets=dec, **reward)),
        "reward-offsets-decrease-then-end": (kl_reward, dict(log_probs=lp, ref_log_probs=ref, offsets=both,
                                                             reward=torch.ones(n), reward_placement="last",
                                                             **reward)),
        "reward-offsets-start": (kl_reward, dict(log_probs=lp, ref_log_probs=ref, offsets=start, **reward)),
        "reward-offsets-end": (kl_reward, dict(log_probs=lp, ref_log_probs=ref, offsets=end, **reward)),
        "reward-prompt-packed": (kl_reward, dict(log_probs=lp, ref_log_probs=ref, offsets=offsets,
                                                 prompt_lens=edited(plen, i433=9, i599=-1), **reward)),
        # lengths: a negative one at 500 comes before one above T at 10 (the check's ranks, then the index)
        "reward-lengths": (kl_reward, dict(log_probs=lp_pad, ref_log_probs=ref_pad, padding_side="right",
                                           lengths=edited(rows, i10=7, i500=-2), **reward)),
        "reward-lengths-above": (kl_reward, dict(log_probs=lp_pad, ref_log_probs=ref_pad, lengths=edited(rows, i300=9),
                                                 **reward)),
        "reward-prompt-padded": (kl_reward, dict(log_probs=lp_pad, ref_log_probs=ref_pad, lengths=rows,
                                                 prompt_lens=edited(plen, i270=5), **reward)),
        "reward-prompt-width": (kl_reward, dict(log_probs=lp_pad, ref_log_probs=ref_pad,
                                                prompt_lens=edited(plen, i599=7), **reward)),
        # lengths and prompt_lens both bad: the lengths' finding first, as their launches came first
        "reward-lengths-and-prompt": (kl_reward, dict(log_probs=lp_pad, ref_log_probs=ref_pad,
                                                      lengths=edited(rows, i590=8),
                                                      prompt_lens=edited(plen, i3=-1), **reward)),
        "loss-offsets": (kl_penalty_loss, dict(log_probs=lp, old_log_probs=lp, advantages=torch.ones(total),
                                               ref_log_probs=ref, beta=0.1, offsets=dec,
                                               aggregation="seq-mean-token-mean")),
        "loss-lengths": (kl_penalty_loss, dict(log_probs=lp_pad, old_log_probs=lp_pad, advantages=torch.ones(n),
                                               lengths=edited(rows, i400=-1), aggregation="token-mean")),
    }


FOLDED_CASES = list(_folded_cases())


@pytest.mark.cuda_emulated
@pytest.mark.parametrize("case", FOLDED_CASES)
def test_the_forward_checks_bad_values_itself_with_no_check_launch(monkeypatch, case):
    from kl_kernels import _extensions

    module = _extensions.load("_cuda_emu")[0]
    fn, kw = _folded_cases()[case]
    kw = dict(kw, backend="cuda-emulated")
    word = device_errors.word("cpu")
    launched = []

    check_kernel = _emulated_check_kernel(module, launched)

    found = {}
    for way, deferred in (("check kernels", False), ("folded", True)):
        with monkeypatch.context() as mp:
            mp.setattr(value_checks, "checks_on_host", lambda t: False)  # the accelerator path of the checks
            mp.setattr(value_checks, "kernel_check", check_kernel)
            mp.setattr(value_checks, "deferrable", lambda kernel, *t: deferred)  # as with _cuda on a GPU
            mp.setattr(device_errors, "raise_pending", lambda device: None)  # (the emulation ran the checks already)
            out = fn(**kw)
        found[way] = word.take()
        assert found[way] is not None, way
        if way == "check kernels":
            assert launched, "the unfolded path launches its checks"
            launched.clear()
    assert launched == [], "the forward made the value checks itself"
    assert found["folded"] == found["check kernels"]
    nan = out.kl_sum.isnan() if fn is kl_reward else out.loss.isnan()
    assert bool(nan.any())  # the bad sequences are poisoned
    f = found["folded"]
    want = device_errors.value_error_message(f["kind"], f["arg"], f["value"], f["bound"], f["extra"], f["index"])
    assert want.split(" must")[0] in ("offsets", "lengths", "prompt_lens")


@pytest.mark.cuda_emulated
def test_folded_check_raises_at_the_next_call_and_a_valid_call_works(monkeypatch):
    """The folded path end to end: the bad call returns NaN, the next call raises the host's ValueError, the one
    after works; no check kernel ran."""
    lp, ref, offsets = _packed("cpu")
    bad = torch.tensor([0, 3, 1, 9, 12])
    want = _host_message(kl_reward, log_probs=lp, ref_log_probs=ref, offsets=bad, backend="torch")

    def no_launch(*a, **k):
        raise AssertionError("a check kernel was launched")

    with monkeypatch.context() as mp:
        mp.setattr(value_checks, "checks_on_host", lambda t: False)
        mp.setattr(value_checks, "kernel_check", no_launch)
        mp.setattr(value_checks, "deferrable", lambda kernel, *t: True)
        out = kl_reward(lp, ref, offsets=bad, backend="cuda-emulated")
        assert out.kl_sum[:3].isnan().all()
        with pytest.raises(ValueError) as e:
            kl_reward(lp, ref, offsets=offsets, backend="cuda-emulated")
        assert str(e.value).split(" (found on ")[0] == want
        good = kl_reward(lp, ref, offsets=offsets, backend="cuda-emulated")
    assert good.kl_sum.isfinite().all()
    assert not device_errors.word("cpu").pending()


@pytest.mark.parametrize("backend", ["torch", TRITON])
def test_deferred_checks_are_launched_for_a_backend_that_does_not_fold_them(monkeypatch, backend):
    """The validation defers its check launches to the forward; a backend whose kernels do not make them
    (backends.FOLDING_BACKENDS) gets them launched at its selection: none is lost."""
    from kl_kernels import _extensions

    module = _extensions.load("_cuda_emu")[0]
    if module is None:
        pytest.skip("kl_kernels._cuda_emu is not built")
    dev = backend_device(backend)
    g = torch.Generator().manual_seed(6)
    lp, ref = (-torch.rand(4, 5, generator=g)).to(dev), (-torch.rand(4, 5, generator=g)).to(dev)
    lengths = torch.tensor([3, 7, 0, 2], device=dev)
    want = _host_message(kl_reward, log_probs=lp.cpu(), ref_log_probs=ref.cpu(), lengths=lengths.cpu(),
                         backend="torch")
    launched = []

    check_kernel = _emulated_check_kernel(module, launched)

    with monkeypatch.context() as mp:
        mp.setattr(value_checks, "checks_on_host", lambda t: False)
        mp.setattr(value_checks, "kernel_check", check_kernel)
        mp.setattr(value_checks, "deferrable", lambda kernel, *t: True)
        mp.setattr(device_errors, "raise_pending", lambda device: None)
        kl_reward(lp, ref, lengths=lengths, backend=backend)
    assert launched == ["lengths_valid"] and not value_checks.DEFERRED.pending
    with pytest.raises(ValueError) as e:
        check_errors("cpu")
    assert str(e.value).split(" (found on ")[0] == want


@pytest.mark.cuda_emulated
@pytest.mark.parametrize("op", ["kl_reward", "kl_penalty_loss"])
def test_inside_torch_compile_a_bad_offset_still_surfaces(op):
    """Inside a torch.compile'd function no validation runs at call time (the graph calls the op, whose value
    checks would break the graph): the CUDA forwards check the geometry they read themselves (the folded checks
    of their combine kernel), so a bad offsets tensor still records its ValueError, raised by check_errors() or
    the next call, and a valid call after works. (Before: NaN outputs and no error at all.)"""
    lp, ref, offsets = _packed("cpu")
    bad = offsets.clone()
    bad[2] = bad[1] - 1  # decreasing at index 2
    want = _host_message(kl_reward, log_probs=lp, ref_log_probs=ref, offsets=bad, backend="torch").split(" (")[0]

    def f(lp, ref, offsets):
        if op == "kl_reward":
            return kl_reward(lp, ref, offsets=offsets, estimator="k3", backend="cuda-emulated").kl_sum
        return kl_penalty_loss(lp, ref, torch.ones_like(lp), offsets=offsets, beta=0.1,
                               backend="cuda-emulated").loss

    compiled = torch.compile(f, dynamic=False)
    assert compiled(lp, ref, offsets).isfinite().all()
    check_errors("cpu")
    got = compiled(lp, ref, bad)
    assert got.isnan().any()
    with pytest.raises(ValueError) as e:
        check_errors("cpu")
    assert str(e.value).startswith(want), (str(e.value), want)
    assert compiled(lp, ref, offsets).isfinite().all()
    check_errors("cpu")
