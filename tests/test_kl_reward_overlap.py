"""The list path's overlap: the cpu kernel writing its outputs while the calling thread splits them
into per-sequence views and stores them (``kl_reward_storing``, ``launch.forward_during``).

Each result is compared bitwise with the same kernel on the packed batch, which runs without any
overlap: an output element the overlapped kernel failed to write, or wrote after ``kl_reward``
returned, shows up as a difference.
"""

from __future__ import annotations

import pytest
import torch

from kl_kernels import _extensions, kl_reward, ragged
from kl_kernels.kl_reward.api import kl_reward_storing


def _lists(n_seq=150, seed=0):
    """Per-sequence inputs (lengths 0, 1, 7, then up to 500: several of the kernel's 16384-token
    tiles) with NaN alignment pads and per-token rewards [L, 1], as KLComputation reads them."""
    g = torch.Generator().manual_seed(seed)
    lengths = [0, 1, 7] + torch.randint(0, 500, (n_seq - 3,), generator=g).tolist()
    lps = [-5 * torch.rand(n, generator=g) for n in lengths]
    refs = [-5 * torch.rand(n, generator=g) for n in lengths]
    for r in refs[3::7]:
        r[-2:] = float("nan")
    rewards = [torch.randn(n, 1, generator=g) for n in lengths]
    return lps, refs, rewards


def _packed(lps, refs, rewards, **kw):
    offsets = ragged.lengths_to_offsets([len(t) for t in lps])
    return kl_reward(torch.cat(lps), torch.cat(refs), torch.cat(rewards).squeeze(-1), offsets=offsets,
                     reward_placement="token", backend="cpu", **kw)


def _assert_equal_to_packed(out, want):
    assert torch.equal(torch.cat(out.kl).nan_to_num(7.0), want.kl.nan_to_num(7.0))  # NaN where want has NaN
    assert torch.equal(torch.cat(out.reward).squeeze(-1).nan_to_num(7.0), want.reward.nan_to_num(7.0))
    assert torch.equal(out.kl_sum.nan_to_num(7.0), want.kl_sum.nan_to_num(7.0))
    assert torch.equal(out.count, want.count)


@pytest.fixture
def overlap_calls(monkeypatch):
    """Counts the calls of the extension's overlapping entry point (so a test cannot pass on the
    plain path by accident)."""
    module = _extensions.load("_C")[0]
    real = module.kl_reward_forward_during
    calls = []
    monkeypatch.setattr(module, "kl_reward_forward_during", lambda *a: calls.append(1) or real(*a))
    yield calls


@pytest.mark.parametrize("threads", [1, 2, 3], ids=lambda n: f"{n}threads")
@pytest.mark.parametrize("mask_nan", [True, False], ids=["mask_nan", "nan_counts"])
def test_stored_outputs_equal_the_packed_kernel(threads, mask_nan, overlap_calls):
    lps, refs, rewards = _lists()
    want = _packed(lps, refs, rewards, coef=0.3, mask_nan=mask_nan)
    stored = []
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = kl_reward_storing(stored.append, lps, refs, rewards, coef=0.3, mask_nan=mask_nan, backend="cpu")
    finally:
        torch.set_num_threads(before)
    assert overlap_calls == [1]
    assert len(stored) == 1 and stored[0] is out  # store saw the very outputs returned, once
    assert [t.shape for t in out.reward] == [r.shape for r in rewards]
    _assert_equal_to_packed(out, want)
    fresh = sum(_lists(), [])
    assert all(torch.equal(x.nan_to_num(7.0), y.nan_to_num(7.0)) for x, y in zip(lps + refs + rewards, fresh))


def test_plain_kl_reward_on_lists_takes_the_overlap(overlap_calls):
    lps, refs, rewards = _lists(seed=1)
    out = kl_reward(lps, refs, rewards, coef=0.3, backend="cpu")
    assert overlap_calls == [1]
    _assert_equal_to_packed(out, _packed(lps, refs, rewards, coef=0.3))


def test_an_exception_in_store_propagates_once_the_kernel_is_done(overlap_calls):
    lps, refs, rewards = _lists(seed=2)
    seen = []

    def store(out):
        seen.append(out)
        raise KeyError("store failed")

    with pytest.raises(KeyError, match="store failed"):
        kl_reward_storing(store, lps, refs, rewards, coef=0.3, backend="cpu")
    assert overlap_calls == [1]
    _assert_equal_to_packed(seen[0], _packed(lps, refs, rewards, coef=0.3))  # every output written


def test_store_may_run_the_kernel_itself():
    """store runs while the outer kernel's tiles run on torch's threads: a kl_reward inside it (any
    code may run there, a garbage-collector callback included) must neither deadlock nor disturb it."""
    lps, refs, rewards = _lists(seed=3)
    inner = []
    out = kl_reward_storing(lambda _: inner.append(kl_reward(lps[::-1], refs[::-1], rewards[::-1], backend="cpu")),
                            lps, refs, rewards, backend="cpu")
    _assert_equal_to_packed(out, _packed(lps, refs, rewards))
    _assert_equal_to_packed(inner[0], _packed(lps[::-1], refs[::-1], rewards[::-1]))


def test_store_runs_once_when_there_is_nothing_to_compute(overlap_calls):
    calls = []
    out = kl_reward_storing(calls.append, [torch.zeros(0), torch.zeros(0)], [torch.zeros(0), torch.zeros(0)],
                            backend="cpu")
    assert overlap_calls == [1] and calls == [out]
    assert out.count.tolist() == [0, 0] and [t.numel() for t in out.kl] == [0, 0]


def test_an_extension_without_the_overlap_runs_kernel_then_store(monkeypatch):
    module = _extensions.load("_C")[0]
    monkeypatch.setattr(module, "kl_reward_forward_during", None)
    lps, refs, rewards = _lists(seed=4)
    stored = []
    out = kl_reward_storing(stored.append, lps, refs, rewards, coef=0.3, backend="cpu")
    assert stored == [out]
    _assert_equal_to_packed(out, _packed(lps, refs, rewards, coef=0.3))


def test_store_on_other_layouts_sees_finished_outputs():
    """Without lists (packed, padded, the torch backend) store runs after the kernel: same contract."""
    lps, refs, rewards = _lists(seed=5)
    offsets = ragged.lengths_to_offsets([len(t) for t in lps])
    for backend in ("cpu", "torch"):
        stored = []
        out = kl_reward_storing(stored.append, torch.cat(lps), torch.cat(refs), offsets=offsets, backend=backend)
        assert stored == [out]


def test_the_overlap_refuses_exactly_the_dtypes_the_kernel_refuses():
    """kl_reward_forward_during refuses an unsupported (log-prob, reward) dtype pair before it
    calls ``store`` (outputs handed out unwritten would be silently wrong); it must refuse exactly
    the pairs the plain kernel refuses. Every pair of dtype codes, known and unknown; where a code
    names a dtype, the tensors really have it, so a pair that runs reads valid memory."""
    from kl_kernels import launching as launch
    from kl_kernels.kl_reward.launch import _prepare_forward

    module = _extensions.load("_C")[0]
    dtypes = {code: dtype for dtype, code in launch.DTYPE_CODES.items()}
    supported = {(lp, rw) for lp in dtypes for rw in dtypes if rw in (lp, launch.DTYPE_CODES[torch.float32])}
    assert len(supported) == 5  # fp32/fp32, and bf16 or fp16 log-probs with the same dtype or fp32 rewards
    no_clamp = [*launch.clamp_bounds(None), *launch.clamp_bounds(None)]
    packed, token, k1 = launch.LAYOUT_CODES["packed"], launch.PLACEMENT_CODES["token"], launch.ESTIMATOR_CODES["k1"]
    for lp_code in [*dtypes, 3, -1]:
        for rw_code in [*dtypes, 3, -1]:
            lp_dtype, rw_dtype = dtypes.get(lp_code, torch.float32), dtypes.get(rw_code, torch.float32)
            codes = []
            for overlapped in (False, True):
                lp = torch.full((5,), -1.0, dtype=lp_dtype)
                offsets = torch.tensor([0, 2, 5])
                outputs, args, _, keep = _prepare_forward(
                    lp, lp - 0.5, None, offsets, None, None, torch.ones(5, dtype=rw_dtype), None, 0.1, packed, False,
                    token, k1, False, no_clamp, False, rw_dtype, False)
                args.dtype, args.reward_dtype = lp_code, rw_code
                if overlapped:
                    stored = []
                    codes.append(module.kl_reward_forward_during(args, 1, lambda: stored.append(1)))
                    assert stored == ([1] if codes[-1] == 0 else []), (lp_code, rw_code)
                else:
                    codes.append(module.kl_reward_forward(args, 1))
                if codes[-1] == 0:
                    assert torch.equal(outputs[0].float(), torch.full((5,), 0.5)), (lp_code, rw_code)  # k1 = lp - ref
            want = 0 if (lp_code, rw_code) in supported else 1
            assert codes == [want, want], (lp_code, rw_code)
