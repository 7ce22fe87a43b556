"""kl_reward's eager fast lanes (kl_kernels/kl_reward/fast.py, csrc/cpu/dense_plan.cpp, list_plan.cpp).

The lanes are second readers of kl_reward's arguments, in C++, for plain dense CPU tensors and for
lists of per-sequence CPU tensors. Their contract: whatever they take, the general path (problem.py
-> dispatch -> launch.py) takes too and returns bitwise the same; anything else they decline (None)
so that the general path runs and reports. The differential tests below draw arguments that are
often wrong on purpose (shapes, dtypes, offsets, lengths, strings, flags) and hold the lanes to that
contract; the other tests pin down that they do take the common calls (so they cannot silently
close) and decline what they must.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kl_kernels import kl_reward, ragged
from kl_kernels.kl_reward import ESTIMATORS, PLACEMENTS, api, fast
from kl_kernels.kl_reward.api import kl_reward_storing

pytestmark = pytest.mark.skipif(fast._kernels() is None, reason="the CPU extension has no fast lane")

FIELDS = ("kl", "reward", "ref_log_probs", "kl_sum", "count")


def _general(lp, ref, reward, **kw):
    return api._general(lp, ref, reward, **kw)


def _lane(lp, ref, reward=None, *, coef=1.0, estimator="k1", mask=None, offsets=None, lengths=None,
          padding_side="left", reward_placement="auto", return_ref=False, detach=True, mask_nan=False, backend="auto",
          store=None):
    return fast.try_run(lp, ref, reward, coef, estimator, mask, offsets, lengths, padding_side, reward_placement,
                        return_ref, detach, mask_nan, backend, store)


def _assert_same(got, want):
    for name, a, b in zip(FIELDS, got, want, strict=True):
        if b is None:
            assert a is None, name
            continue
        if isinstance(b, list):  # list inputs: one result per sequence
            assert isinstance(a, list) and len(a) == len(b), name
            _assert_same_tensors(name, a, b)
            continue
        _assert_same_tensors(name, [a], [b])


def _assert_same_tensors(name, got: list, want: list):
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape and a.requires_grad == b.requires_grad, name
        assert torch.equal(a, b) or (torch.isnan(a) == torch.isnan(b)).all() and torch.equal(
            a.nan_to_num(), b.nan_to_num()), name


def _batch(layout, dtype=torch.float32, seed=0, lengths=(5, 0, 3, 1, 7)):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor(lengths)
    n, b = int(lengths.sum()), lengths.shape[0]
    if layout == "packed":
        shape = (n,)
        extra = dict(offsets=torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]))
    else:
        shape = (b, int(lengths.max()) + 2)
        extra = dict(lengths=lengths, padding_side=layout.split("_")[1]) if layout != "padded_full" else {}
    lp = (-torch.rand(shape, generator=g) * 5).to(dtype)
    ref = (lp.float() + torch.randn(shape, generator=g) * 0.3).to(dtype)
    mask = torch.rand(shape, generator=g) < 0.7
    return lp, ref, mask, b, shape, extra


COMMON = [
    ("packed", dict(), None),
    ("packed", dict(reward_placement="sequence", return_ref=True), "B11"),
    ("packed", dict(reward_placement="last"), "B"),
    ("packed", dict(reward_placement="token"), "tok1"),
    ("packed", dict(), "tok"),
    ("padded_left", dict(return_ref=True), "B11"),
    ("padded_right", dict(), "B1"),
    ("padded_left", dict(reward_placement="sequence"), "B"),
    ("padded_right", dict(reward_placement="last", return_ref=True), "B11"),
    ("padded_left", dict(reward_placement="last_valid"), "B1"),
    ("packed", dict(reward_placement="last_valid", return_ref=True), "B"),
    ("padded_left", dict(), "tok1"),
    ("padded_full", dict(), "tok"),
]


def test_the_common_calls_cover_every_placement():
    used = {o.get("reward_placement", "auto") for _, o, _ in COMMON}
    assert used == set(PLACEMENTS)


def _reward(kind, b, shape, dtype=torch.float32, seed=1):
    g = torch.Generator().manual_seed(seed)
    sizes = {None: None, "B": (b,), "B1": (b, 1), "B11": (b, 1, 1), "tok": shape, "tok1": (*shape, 1)}[kind]
    return None if sizes is None else torch.randn(sizes, generator=g).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("estimator", ESTIMATORS)  # problem.py's list: one added there must reach the lane too
@pytest.mark.parametrize("layout,options,reward_kind", COMMON,
                         ids=[f"{c[0]}-{c[2]}-{'-'.join(f'{k}={v}' for k, v in c[1].items()) or 'defaults'}"
                              for c in COMMON])
def test_the_lane_takes_the_common_calls(layout, options, reward_kind, estimator, dtype):
    lp, ref, mask, b, shape, extra = _batch(layout, dtype)
    for reward_dtype in {dtype, torch.float32}:
        reward = _reward(reward_kind, b, shape, reward_dtype)
        for m in (None, mask):
            kw = dict(coef=0.2, estimator=estimator, mask=m, **extra, **options)
            got = _lane(lp, ref, reward, **kw)
            assert got is not None, "the fast lane declined a plain dense call"
            _assert_same(got, _general(lp, ref, reward, **kw))
            _assert_same(kl_reward(lp, ref, reward, **kw), got)


@pytest.mark.parametrize("coef", ["0-d", "per-sequence"])
def test_the_lane_reads_a_float32_tensor_coef_in_place(coef):
    """TorchRL keeps its coefficient as a 0-d tensor: the kernel reads it (or one per sequence)."""
    lp, ref, mask, b, shape, extra = _batch("padded_left")
    c = torch.tensor(0.3) if coef == "0-d" else torch.rand(b, generator=torch.Generator().manual_seed(2))
    reward = torch.randn(b, 1, 1, generator=torch.Generator().manual_seed(3))
    kw = dict(mask=mask, coef=c, return_ref=True, **extra)
    got = _lane(lp, ref, reward, **kw)
    assert got is not None
    _assert_same(got, _general(lp, ref, reward, **kw))


def test_the_lane_reads_strided_and_expanded_inputs():
    lp, ref, mask, b, shape, extra = _batch("padded_left")
    wide = torch.randn(b, shape[1] * 2)
    cases = [
        (wide[:, ::2], ref, mask),                       # column stride 2
        (lp.t().contiguous().t(), ref, mask.t().contiguous().t()),  # column-major
        (lp, torch.tensor(-1.0).expand(shape), mask),   # stride 0
    ]
    reward = torch.randn(b, 3)[:, :1].unsqueeze(-1)     # [B, 1, 1] with a row stride of 3
    for x, y, m in cases:
        kw = dict(mask=m, coef=0.5, return_ref=True, **extra)
        got = _lane(x, y, reward, **kw)
        assert got is not None
        _assert_same(got, _general(x, y, reward, **kw))


def _neg_bit(x):
    return torch._neg_view(x)


DECLINED = {
    "float64 tensor coef": lambda lp, ref, mask, b, ex: _lane(lp, ref, coef=torch.tensor(0.5, dtype=torch.float64),
                                                              **ex),
    "coef of B + 1": lambda lp, ref, mask, b, ex: _lane(lp, ref, coef=torch.rand(b + 1), **ex),
    "strided [B] coef": lambda lp, ref, mask, b, ex: _lane(lp, ref, coef=torch.rand(2 * b)[::2], **ex),
    "bool coef": lambda lp, ref, mask, b, ex: _lane(lp, ref, coef=True, **ex),
    "int32 lengths": lambda lp, ref, mask, b, ex: _lane(lp, ref, lengths=ex["lengths"].int()),
    "lengths as a list": lambda lp, ref, mask, b, ex: _lane(lp, ref, lengths=ex["lengths"].tolist()),
    "lengths > T": lambda lp, ref, mask, b, ex: _lane(lp, ref, lengths=ex["lengths"] + lp.shape[1]),
    "negative length": lambda lp, ref, mask, b, ex: _lane(lp, ref, lengths=ex["lengths"] - 2),
    "offsets on padded": lambda lp, ref, mask, b, ex: _lane(lp, ref, offsets=torch.zeros(b + 1, dtype=torch.int64)),
    "uint8 mask": lambda lp, ref, mask, b, ex: _lane(lp, ref, mask=mask.to(torch.uint8), **ex),
    "mask of another shape": lambda lp, ref, mask, b, ex: _lane(lp, ref, mask=mask[:, :-1], **ex),
    "float64 log-probs": lambda lp, ref, mask, b, ex: _lane(lp.double(), ref.double(), **ex),
    "mixed log-prob dtypes": lambda lp, ref, mask, b, ex: _lane(lp, ref.bfloat16(), **ex),
    "ref of another shape": lambda lp, ref, mask, b, ex: _lane(lp, ref[:, :-1], **ex),
    "3-d log-probs": lambda lp, ref, mask, b, ex: _lane(lp[..., None], ref[..., None]),
    "float64 reward": lambda lp, ref, mask, b, ex: _lane(lp, ref, torch.randn(b, 1, 1, dtype=torch.float64), **ex),
    "bf16 reward, fp32 log-probs": lambda lp, ref, mask, b, ex: _lane(lp, ref, torch.randn(b, 1, 1).bfloat16(), **ex),
    "integer reward": lambda lp, ref, mask, b, ex: _lane(lp, ref, torch.ones(b, 1, 1, dtype=torch.int64), **ex),
    "[B] reward, auto, padded": lambda lp, ref, mask, b, ex: _lane(lp, ref, torch.randn(b), **ex),
    "reward of a wrong shape": lambda lp, ref, mask, b, ex: _lane(lp, ref, torch.randn(b + 1, 1, 1), **ex),
    "token placement of a [B] reward": lambda lp, ref, mask, b, ex: _lane(lp, ref, torch.randn(b),
                                                                          reward_placement="token", **ex),
    "sequence placement of a token reward": lambda lp, ref, mask, b, ex: _lane(
        lp, ref, torch.randn(lp.shape), reward_placement="sequence", **ex),
    "a Parameter (a subclass)": lambda lp, ref, mask, b, ex: _lane(torch.nn.Parameter(lp, requires_grad=False), ref,
                                                                   **ex),
    "requires grad, detach=False": lambda lp, ref, mask, b, ex: _lane(lp.clone().requires_grad_(), ref,
                                                                      detach=False, **ex),
    "negative bit": lambda lp, ref, mask, b, ex: _lane(_neg_bit(-lp), ref, **ex),
    "estimator k4": lambda lp, ref, mask, b, ex: _lane(lp, ref, estimator="k4", **ex),
    "estimator not a str": lambda lp, ref, mask, b, ex: _lane(lp, ref, estimator=["k1"], **ex),
    "padding_side middle": lambda lp, ref, mask, b, ex: _lane(lp, ref, padding_side="middle",
                                                              lengths=ex["lengths"]),
    "reward_placement bogus": lambda lp, ref, mask, b, ex: _lane(lp, ref, torch.randn(b, 1, 1),
                                                                 reward_placement="bogus", **ex),
    "return_ref=1": lambda lp, ref, mask, b, ex: _lane(lp, ref, return_ref=1, **ex),
    "detach=None": lambda lp, ref, mask, b, ex: _lane(lp, ref, detach=None, **ex),
    "backend torch": lambda lp, ref, mask, b, ex: _lane(lp, ref, backend="torch", **ex),
    "backend not a str": lambda lp, ref, mask, b, ex: _lane(lp, ref, backend=None, **ex),
    "meta tensors": lambda lp, ref, mask, b, ex: _lane(lp.to("meta"), ref.to("meta")),
}


@pytest.mark.parametrize("case", list(DECLINED))
def test_the_lane_declines(case):
    lp, ref, mask, b, shape, extra = _batch("padded_left")
    assert DECLINED[case](lp, ref, mask, b, extra) is None


@pytest.mark.parametrize("case", ["offsets not from 0", "offsets decreasing", "offsets dipping inside",
                                  "offsets short of N", "int32 offsets", "strided offsets", "lengths on packed"])
def test_the_lane_declines_bad_offsets(case):
    lp, ref, mask, b, shape, extra = _batch("packed")
    off = extra["offsets"]
    dip = off.clone()
    dip[2] = off[1] - 1  # from 0 to N, but one step back in between
    bad = {"offsets not from 0": off + 1, "offsets decreasing": off.flip(0), "offsets dipping inside": dip,
           "offsets short of N": torch.cat([off[:-1], off[-1:] - 1]), "int32 offsets": off.int(),
           "strided offsets": torch.stack([off, off], 1)[:, 0], "lengths on packed": None}[case]
    if case == "lengths on packed":
        assert _lane(lp, ref, offsets=off, lengths=torch.ones(b, dtype=torch.int64)) is None
        return
    got = _lane(lp, ref, offsets=bad)
    if case == "strided offsets":  # valid values, but launch.py copies them contiguous: general path
        assert got is None
        return
    assert got is None
    with pytest.raises((TypeError, ValueError)):
        kl_reward(lp, ref, offsets=bad)  # and the general path reports it


def test_the_lane_is_closed_where_the_general_path_must_run(monkeypatch):
    lp, ref, mask, b, shape, extra = _batch("padded_left")
    monkeypatch.setenv("KL_KERNELS_BACKEND", "torch")
    assert _lane(lp, ref, **extra) is None
    monkeypatch.setenv("KL_KERNELS_BACKEND", " cpu ")
    assert _lane(lp, ref, **extra) is not None
    monkeypatch.delenv("KL_KERNELS_BACKEND")
    with torch.enable_grad():  # detach=False under autograd, inputs not requiring grad: the same call
        assert _lane(lp, ref, detach=False, **extra) is not None
    with torch.no_grad():  # requiring grad, but nothing records: the same call too
        assert _lane(lp.clone().requires_grad_(), ref, detach=False, **extra) is not None
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert _lane(lp, ref, **extra) is None


def test_kl_reward_asks_the_lane_only_without_the_options_it_leaves_out(monkeypatch):
    calls = []
    real = fast.try_run
    monkeypatch.setattr(fast, "try_run", lambda *a: calls.append(1) or real(*a))
    lp, ref, mask, b, shape, extra = _batch("padded_left")
    kl_reward(lp, ref, **extra)
    assert calls == [1]
    for option in (dict(prompt_lens=torch.zeros(b, dtype=torch.int64)), dict(clamp_input=(-1.0, 1.0)),
                   dict(clamp_output=(None, 2.0))):
        kl_reward(lp, ref, **extra, **option)
    assert calls == [1]
    kl_reward(lp, ref, mask_nan=True, **extra)
    kl_reward_storing(lambda out: None, list(lp), list(ref), mask_nan=True)
    assert calls == [1, 1, 1]


# ---------------------------------------------------------------- differential: anything it takes


def _start(draw):
    """What the raw-call strategies share: a seeded generator; ``clean``, true in half the draws, where
    ``pick(valid, wrong)`` chooses among the valid choices only (so the lanes take many), and among
    all in the rest; and 0 to 4 sequence lengths (0 and 1 included)."""
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    clean = draw(st.booleans())

    def pick(valid, wrong=()):
        return draw(st.sampled_from(list(valid) if clean else [*valid, *wrong]))

    return g, clean, pick, [draw(st.sampled_from([0, 1, 2, 5, 9])) for _ in range(draw(st.integers(0, 4)))]


@st.composite
def raw_calls(draw):
    """kl_reward arguments, plain dense tensors but often wrong: both layouts, every dtype pairing,
    reward shapes right and wrong, offsets and lengths valid or not, odd strings and flags. Half the
    draws pick among valid choices only (so the lane takes many of them), the rest among all."""
    g, clean, pick, lens = _start(draw)
    b = len(lens)
    n = sum(lens)
    padded = draw(st.booleans())
    width = (max(lens, default=0) + draw(st.integers(0, 2))) if padded else None
    shape = (b, width) if padded else (n,)
    dtypes = [torch.float32, torch.bfloat16, torch.float16]
    dt = pick(dtypes, [torch.float64])
    ref_dt = dt if clean or draw(st.integers(0, 4)) else draw(st.sampled_from(dtypes))
    lp = (-torch.rand(shape, generator=g) * 4).to(dt)
    ref = (-torch.rand(shape, generator=g) * 4).to(ref_dt)
    if not clean and draw(st.integers(0, 6)) == 0:
        ref = ref[..., :-1] if ref.numel() else ref.unsqueeze(0)  # a shape mismatch
    kw = {}
    offsets = torch.tensor([0, *torch.tensor(lens, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int64)
    lengths = torch.tensor(lens, dtype=torch.int64)
    if not padded:
        kw["offsets"] = pick([offsets], [offsets + 1, offsets.int(), None])
    else:
        kw["lengths"] = pick([lengths, None], [lengths + 3, lengths.int()])
        kw["padding_side"] = pick(["left", "right"], ["up"])
    if draw(st.booleans()):
        m = torch.rand(shape, generator=g) < 0.6
        kw["mask"] = pick([m], [m.to(torch.uint8), m.unsqueeze(-1)])
    tok = tuple(shape)
    reward_shape = pick([None, (b,), (b, 1), (b, 1, 1), tok, (*tok, 1)], [(b + 1,), (b, 2)])
    reward = None
    if reward_shape is not None:
        reward = torch.randn(reward_shape, generator=g).to(pick([dt, torch.float32], [torch.float64, torch.int64]))
    kw["reward_placement"] = pick(["auto", "token", "sequence", "last"], ["nope"])
    kw["estimator"] = pick(["k1", "abs", "k2", "k3", "k1+", "abs+", "k2+", "k3+"], ["k4", "kl"])
    kw["coef"] = pick([0.1, 2, 0.0, float("nan"), torch.tensor(0.3), torch.rand(b, generator=g)],
                      [True, torch.tensor(0.3, dtype=torch.float64), torch.rand(b + 1, generator=g)])
    kw["return_ref"] = pick([False, True], [1])
    kw["detach"] = draw(st.sampled_from([True, False]))
    if draw(st.integers(0, 5)) == 0:
        lp = lp.requires_grad_() if lp.is_floating_point() else lp
    return lp, ref, reward, kw


def _agrees_with_the_general_path(lane, call):
    """Whatever ``lane`` takes of ``call`` (under autograd, so inputs requiring grad are declined),
    the general path returns bitwise."""
    lp, ref, reward, kw = call
    with torch.enable_grad():
        got = lane(lp, ref, reward, **kw)
        if got is None:
            return
        want = _general(lp, ref, reward, **kw)  # must not raise: the lane took it
    _assert_same(got, want)


@given(raw_calls())
def test_whatever_the_lane_takes_the_general_path_returns_bitwise(call):
    _agrees_with_the_general_path(_lane, call)


# ---------------------------------------------------------------- the list lane (list_plan.cpp)

LENGTHS = (5, 0, 3, 1, 7, 2)


def _samples(dtype=torch.float32, seed=0, lengths=LENGTHS, nan_pads=False):
    """Per-sequence log-probs, reference log-probs and an assistant mask, as lists (each its own tensor)."""
    g = torch.Generator().manual_seed(seed)
    lp = [(-torch.rand(n, generator=g) * 5).to(dtype) for n in lengths]
    ref = [(x.float() + torch.randn(n, generator=g) * 0.3).to(dtype) for x, n in zip(lp, lengths)]
    if nan_pads:  # TorchRL's KLComputation marks alignment pads as NaN
        for x in ref:
            x[: len(x) // 3] = float("nan")
    mask = [torch.rand(n, generator=g) < 0.7 for n in lengths]
    return lp, ref, mask


def _token_rewards(kind, lengths=LENGTHS, dtype=torch.float32, seed=1):
    g = torch.Generator().manual_seed(seed)
    if kind is None:
        return None
    return [torch.randn((n, 1) if kind == "L1" else (n,), generator=g).to(dtype) for n in lengths]


def _list_lane(lp, ref, reward=None, **kw):
    kw.setdefault("mask_nan", False)
    return _lane(lp, ref, reward, **kw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("estimator", ESTIMATORS)
@pytest.mark.parametrize("reward_kind", [None, "L", "L1"], ids=lambda k: f"reward-{k}")
def test_the_list_lane_takes_the_common_calls(reward_kind, estimator, dtype):
    lp, ref, mask = _samples(dtype, nan_pads=True)
    for reward_dtype in {dtype, torch.float32}:
        reward = _token_rewards(reward_kind, dtype=reward_dtype)
        for m, mask_nan, return_ref, placement in ((None, True, False, "auto"), (mask, False, True, "token"),
                                                   (mask, True, True, "auto")):
            kw = dict(coef=0.2, estimator=estimator, mask=m, mask_nan=mask_nan, return_ref=return_ref,
                      reward_placement=placement)
            got = _list_lane(lp, ref, reward, **kw)
            assert got is not None, "the list lane declined a plain list call"
            _assert_same(got, _general(lp, ref, reward, **kw))
            _assert_same(kl_reward(lp, ref, reward, **kw), got)


@pytest.mark.parametrize("coef", ["0-d", "per-sequence", "int"])
def test_the_list_lane_reads_the_coef(coef):
    lp, ref, mask = _samples()
    c = {"0-d": torch.tensor(0.3), "per-sequence": torch.rand(len(lp), generator=torch.Generator().manual_seed(2)),
         "int": 2}[coef]
    kw = dict(coef=c, mask=mask)
    got = _list_lane(lp, ref, _token_rewards("L1"), **kw)
    assert got is not None
    _assert_same(got, _general(lp, ref, _token_rewards("L1"), **kw))


def test_the_list_lane_takes_tuples_views_and_a_batch_of_one():
    lp, ref, mask = _samples()
    rows = torch.randn(4, 6)
    cases = [
        (tuple(lp), tuple(ref), tuple(_token_rewards("L"))),
        (list(rows), list(rows * 0.5), None),               # rows of one tensor: contiguous views
        ([rows[0, 2:]], [rows[1, 2:]], [torch.ones(4, 1)]),  # a batch of one, at an offset into storage
        ([torch.zeros(0)], [torch.zeros(0)], [torch.zeros(0, 1)]),
        ([rows[0, :1]], [rows[:1, 3]], None),                # length 1: any stride reads the same
    ]
    for x, y, r in cases:
        got = _list_lane(x, y, r, coef=0.5)
        assert got is not None
        _assert_same(got, _general(x, y, r, coef=0.5))


def test_the_list_lane_hands_its_outputs_to_store_and_propagates_its_errors():
    lp, ref, mask = _samples()
    seen = []
    got = _list_lane(lp, ref, _token_rewards("L1"), store=seen.append)
    assert len(seen) == 1 and seen[0] is got

    def fail(out):
        raise KeyError("from store")

    with pytest.raises(KeyError, match="from store"):
        _list_lane(lp, ref, store=fail)


def _bad_list(case, lp, ref, mask, reward):
    """(lp, ref, reward, extra kwargs) of a list call the lane must decline."""
    strided = torch.randn(2 * len(lp[0]))[::2]
    return {
        "empty lists": ([], [], None, {}),
        "offsets given": (lp, ref, None, dict(offsets=torch.tensor([0, 1]))),
        "lengths given": (lp, ref, None, dict(lengths=torch.tensor([1]))),
        "a strided sample": ([strided, *lp[1:]], ref, None, {}),
        "[L, 1] log-probs": ([x[:, None] for x in lp], [x[:, None] for x in ref], None, {}),
        "a shorter reference": (lp, [ref[0][:-1], *ref[1:]], None, {}),
        "fewer references": (lp, ref[:-1], None, {}),
        "a reference tensor": (lp, torch.cat(ref), None, {}),
        "mixed log-prob dtypes": ([lp[0].bfloat16(), *lp[1:]], ref, None, {}),
        "bf16 reference": (lp, [x.bfloat16() for x in ref], None, {}),
        "float64 log-probs": ([x.double() for x in lp], [x.double() for x in ref], None, {}),
        "int log-probs": ([x.long() for x in lp], [x.long() for x in ref], None, {}),
        "a Parameter": ([torch.nn.Parameter(lp[0], requires_grad=False), *lp[1:]], ref, None, {}),
        "not a tensor": ([lp[0].tolist(), *lp[1:]], ref, None, {}),
        "negative bit": ([_neg_bit(-lp[0]), *lp[1:]], ref, None, {}),
        "negative-bit reward": (lp, ref, [_neg_bit(-reward[0]), *reward[1:]], {}),
        "requires grad, detach=False": ([lp[0].clone().requires_grad_(), *lp[1:]], ref, None, dict(detach=False)),
        "meta tensors": ([x.to("meta") for x in lp], [x.to("meta") for x in ref], None, {}),
        "mixed reward ranks": (lp, ref, [reward[0].squeeze(-1), *reward[1:]], {}),
        "[L, 1, 1] rewards": (lp, ref, [r[..., None] for r in reward], {}),
        "[L, 2] rewards": (lp, ref, [r.expand(-1, 2).contiguous() for r in reward], {}),
        "a shorter reward": (lp, ref, [reward[0][:-1], *reward[1:]], {}),
        "fewer rewards": (lp, ref, reward[:-1], {}),
        "float64 rewards": (lp, ref, [r.double() for r in reward], {}),
        "mixed reward dtypes": (lp, ref, [reward[0].bfloat16(), *reward[1:]], {}),
        "bf16 rewards, fp32 log-probs": (lp, ref, [r.bfloat16() for r in reward], {}),
        "int rewards": (lp, ref, [r.long() for r in reward], {}),
        "a per-sequence reward tensor": (lp, ref, torch.randn(len(lp)), {}),
        "sequence placement": (lp, ref, reward, dict(reward_placement="sequence")),
        "last placement": (lp, ref, reward, dict(reward_placement="last")),
        "uint8 mask": (lp, ref, None, dict(mask=[m.to(torch.uint8) for m in mask])),
        "a shorter mask": (lp, ref, None, dict(mask=[mask[0][:-1], *mask[1:]])),
        "a mask tensor": (lp, ref, None, dict(mask=torch.cat(mask))),
        "mask_nan=1": (lp, ref, None, dict(mask_nan=1)),
        "coef of B + 1": (lp, ref, None, dict(coef=torch.rand(len(lp) + 1))),
        "float64 tensor coef": (lp, ref, None, dict(coef=torch.tensor(0.5, dtype=torch.float64))),
        "padding_side middle": (lp, ref, None, dict(padding_side="middle")),
        "estimator k4": (lp, ref, None, dict(estimator="k4")),
        "return_ref=1": (lp, ref, None, dict(return_ref=1)),
        "backend torch": (lp, ref, None, dict(backend="torch")),
    }[case]


LIST_DECLINED = ["empty lists", "offsets given", "lengths given", "a strided sample", "[L, 1] log-probs",
                 "a shorter reference", "fewer references", "a reference tensor", "mixed log-prob dtypes",
                 "bf16 reference", "float64 log-probs", "int log-probs", "a Parameter", "not a tensor", "negative bit",
                 "negative-bit reward", "requires grad, detach=False", "meta tensors", "mixed reward ranks",
                 "[L, 1, 1] rewards", "[L, 2] rewards", "a shorter reward", "fewer rewards", "float64 rewards",
                 "mixed reward dtypes", "bf16 rewards, fp32 log-probs", "int rewards", "a per-sequence reward tensor",
                 "sequence placement", "last placement", "uint8 mask", "a shorter mask", "a mask tensor", "mask_nan=1",
                 "coef of B + 1", "float64 tensor coef", "padding_side middle", "estimator k4", "return_ref=1",
                 "backend torch"]


@pytest.mark.parametrize("case", LIST_DECLINED)
def test_the_list_lane_declines(case):
    lp, ref, mask = _samples(lengths=(4, 3, 5))
    lp, ref, reward, extra = _bad_list(case, lp, ref, mask, _token_rewards("L1", lengths=(4, 3, 5)))
    with torch.enable_grad():
        assert _list_lane(lp, ref, reward, **extra) is None


@st.composite
def raw_list_calls(draw):
    """kl_reward arguments as lists of per-sequence tensors, often wrong: lengths that disagree,
    strided or oddly shaped samples, dtypes mixed within a list, reward ranks and dtypes right and
    wrong, odd strings and flags. Half the draws pick among valid choices only."""
    g, clean, pick, lens = _start(draw)
    b = len(lens)
    dtypes = [torch.float32, torch.bfloat16, torch.float16]
    dt = pick(dtypes, [torch.float64])

    def sample(n, dtype, kind="vector"):
        kind = pick([kind], ["strided", "column", "other dtype", "longer"])
        if kind == "strided":
            return (-torch.rand(2 * n + 1, generator=g) * 4).to(dtype)[::2][:n]
        if kind == "column":
            return (-torch.rand(n, 1, generator=g) * 4).to(dtype)
        if kind == "other dtype":
            return (-torch.rand(n, generator=g) * 4).to(torch.bfloat16 if dtype == torch.float32 else torch.float32)
        return (-torch.rand(n + (kind == "longer"), generator=g) * 4).to(dtype)

    lp = [sample(n, dt) for n in lens]
    ref = [sample(n, dt) for n in lens]
    if draw(st.booleans()) and b:
        for x in ref:
            x[: len(x) // 2] = float("nan")
    kw = {}
    if draw(st.booleans()):
        kw["mask"] = [pick([m], [m.to(torch.uint8), m[:-1]]) for m in (torch.rand(n, generator=g) < 0.6 for n in lens)]
    reward = None
    rank = pick([None, 1, 2], [3])
    if rank is not None:
        rdt = pick([dt, torch.float32], [torch.float64, torch.int64, torch.bfloat16])
        reward = [torch.randn((n,) + (1,) * (rank - 1), generator=g).to(rdt) for n in lens]
        if not clean and b and draw(st.booleans()):
            reward[0] = reward[0].reshape(-1)  # ranks mixed
    kw["reward_placement"] = pick(["auto", "token"], ["sequence", "last", "nope"])
    kw["estimator"] = pick(["k1", "abs", "k2", "k3", "k1+", "abs+", "k2+", "k3+"], ["k4"])
    kw["coef"] = pick([0.1, 2, float("nan"), torch.tensor(0.3), torch.rand(b, generator=g)],
                      [True, torch.tensor(0.3, dtype=torch.float64), torch.rand(b + 1, generator=g)])
    kw["return_ref"] = pick([False, True], [1])
    kw["mask_nan"] = pick([False, True], [0])
    kw["detach"] = draw(st.sampled_from([True, False]))
    if b and draw(st.integers(0, 5)) == 0:
        lp[0] = lp[0].requires_grad_() if lp[0].is_floating_point() else lp[0]
    return lp, ref, reward, kw


@given(raw_list_calls())
def test_whatever_the_list_lane_takes_the_general_path_returns_bitwise(call):
    _agrees_with_the_general_path(_list_lane, call)


def test_the_lanes_read_the_flags_of_the_tensor_type_as_it_is_now(monkeypatch):
    """The extension reads is_neg and requires_grad through the C functions behind torch.Tensor's
    attributes, looked up once per version of the type: an attribute replaced later is honoured."""
    lp, ref, mask = _samples()
    dense = torch.cat(lp), torch.cat(ref)
    offsets = ragged.lengths_to_offsets(list(LENGTHS))
    with torch.enable_grad():
        assert _list_lane(lp, ref, detach=False) is not None
        assert _lane(*dense, offsets=offsets, detach=False) is not None
        monkeypatch.setattr(torch.Tensor, "is_neg", lambda self: True)
        assert _list_lane(lp, ref) is None and _lane(*dense, offsets=offsets) is None
        monkeypatch.undo()
        monkeypatch.setattr(torch.Tensor, "requires_grad", property(lambda self: True))
        assert _list_lane(lp, ref, detach=False) is None and _lane(*dense, offsets=offsets, detach=False) is None
        assert _list_lane(lp, ref, detach=True) is not None  # nothing to record: the flag is not read
        monkeypatch.undo()
        assert _list_lane(lp, ref, detach=False) is not None
        assert _lane(*dense, offsets=offsets, detach=False) is not None


@pytest.mark.parametrize("flag", ["negative bit", "requires grad"])
def test_a_flag_found_while_the_kernel_runs_hands_nothing_out(flag):
    """The list lane reads the negative bit and requires_grad while its kernel runs (list_plan.cpp):
    when one is set, store never sees the lane's outputs, and the general path's result (negation
    applied, autograd recorded) is what kl_reward_storing returns and stores, once."""
    lp, ref, mask = _samples()
    reward = _token_rewards("L1")
    if flag == "negative bit":
        lp = [*lp[:3], _neg_bit(-lp[3]), *lp[4:]]  # the same values, through a pending negation
    else:
        lp = [*lp[:3], lp[3].clone().requires_grad_(), *lp[4:]]
    seen = []
    with torch.enable_grad():
        assert _list_lane(lp, ref, reward, detach=False, store=seen.append) is None
        assert seen == []
        out = kl_reward_storing(seen.append, lp, ref, reward, detach=False)
    assert len(seen) == 1 and seen[0] is out
    plain = [x.detach().clone() for x in lp]  # negation resolved, no autograd
    _assert_same_tensors("kl", [k.detach() for k in out.kl], _general(plain, ref, reward).kl)
    assert (out.kl[3].grad_fn is not None) == (flag == "requires grad")
