"""The ragged-batch layer: canonical form, converters, zero-copy guarantees, round trips."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kl_kernels import ragged
from strategies import lengths_strategy


def _batch(lengths, feature=(), seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, *feature, generator=g) for n in lengths]


@given(lengths=lengths_strategy(), side=st.sampled_from(ragged.PADDING_SIDES), extra=st.integers(0, 3),
       feature=st.sampled_from([(), (1,), (2, 3)]))
def test_padded_round_trip(lengths, side, extra, feature):
    if not lengths:
        feature = ()  # an empty list carries no feature dims
    seqs = _batch(lengths, feature)
    r = ragged.from_list(seqs)
    width = max(lengths, default=0) + extra
    padded = ragged.to_padded(r.values, r.offsets, padding_side=side, width=width, padding_value=-7.0)
    assert padded.shape == (len(lengths), width, *feature)
    for b, s in enumerate(seqs):  # valid tokens where the padding side says, padding value elsewhere
        n = s.shape[0]
        row = padded[b, width - n:] if side == "left" else padded[b, :n]
        pad = padded[b, : width - n] if side == "left" else padded[b, n:]
        assert torch.equal(row, s) and (pad == -7.0).all()
    back = ragged.from_padded(padded, torch.tensor(lengths, dtype=torch.int64), padding_side=side)
    assert torch.equal(back.values, r.values) and torch.equal(back.offsets, r.offsets)


def test_from_padded_with_validity_mask():
    x = torch.arange(12.0).reshape(3, 4)
    mask = torch.tensor([[0, 1, 1, 1], [0, 0, 0, 0], [1, 1, 0, 0]], dtype=torch.bool)
    r = ragged.from_padded(x, mask=mask)
    assert r.values.tolist() == [1.0, 2.0, 3.0, 8.0, 9.0] and r.offsets.tolist() == [0, 3, 3, 5]


def test_lengths_offsets_helpers():
    offsets = ragged.lengths_to_offsets(torch.tensor([3, 0, 2]))
    assert offsets.tolist() == [0, 3, 3, 5] and offsets.dtype == torch.int64
    assert ragged.offsets_to_lengths(offsets).tolist() == [3, 0, 2]
    seq, pos = ragged.token_index(offsets, 5)
    assert seq.tolist() == [0, 0, 0, 2, 2] and pos.tolist() == [0, 1, 2, 0, 1]
    assert ragged.lengths_to_offsets(torch.zeros(0, dtype=torch.int64)).tolist() == [0]


def test_list_round_trip_gives_views():
    seqs = _batch([3, 0, 5])
    r = ragged.from_list(seqs)
    parts = ragged.to_list(r.values, r.offsets)
    assert [p.data_ptr() for p in parts if p.numel()] == [r.values.data_ptr(), r.values[3:].data_ptr()]
    assert all(torch.equal(a, b) for a, b in zip(parts, seqs))


def test_jagged_nested_is_zero_copy_both_ways():
    nt = torch.nested.nested_tensor(_batch([2, 0, 4]), layout=torch.jagged)
    r = ragged.from_nested(nt)
    assert r.values.data_ptr() == nt.values().data_ptr() and r.offsets.tolist() == [0, 2, 2, 6]
    back = ragged.to_nested(r.values, r.offsets)
    assert back.values().data_ptr() == r.values.data_ptr()


def test_strided_nested_contiguous_is_zero_copy():
    seqs = _batch([2, 3], feature=(1,))
    nt = torch.nested.nested_tensor(seqs, layout=torch.strided)
    r = ragged.from_nested(nt)
    assert r.values.shape == (5, 1) and r.values.untyped_storage().data_ptr() == nt.values().untyped_storage().data_ptr()
    back = ragged.to_nested(r.values, r.offsets, layout=torch.strided)
    assert back.layout == torch.strided and all(torch.equal(a, b) for a, b in zip(back.unbind(), seqs))


def test_jagged_with_holes_is_compacted():
    values = torch.arange(10.0)
    nt = torch.nested.narrow(values.reshape(2, 5), 1, torch.tensor([0, 1]), torch.tensor([2, 3]), layout=torch.jagged)
    r = ragged.from_nested(nt)
    assert r.values.tolist() == [0.0, 1.0, 6.0, 7.0, 8.0] and r.offsets.tolist() == [0, 2, 5]


@pytest.mark.parametrize("kind", ["packed", "padded", "list", "nested_jagged", "nested_strided"])
def test_pack_unpack_returns_the_callers_layout(kind):
    seqs = _batch([3, 1, 4])
    r = ragged.from_list(seqs)
    x = {"packed": r.values, "padded": ragged.to_padded(r.values, r.offsets, padding_side="right"),
         "list": seqs, "nested_jagged": torch.nested.nested_tensor(seqs, layout=torch.jagged),
         "nested_strided": torch.nested.nested_tensor(seqs, layout=torch.strided)}[kind]
    kw = {"offsets": r.offsets} if kind == "packed" else (
        {"lengths": torch.tensor([3, 1, 4]), "padding_side": "right"} if kind == "padded" else {})
    packed, layout = ragged.pack(x, **kw)
    assert torch.equal(packed.values, r.values)
    out = ragged.unpack(packed.values * 2, layout)
    if kind in ("packed", "padded"):
        assert isinstance(out, torch.Tensor) and out.shape == x.shape
    elif kind == "list":
        assert isinstance(out, list) and [t.shape for t in out] == [t.shape for t in seqs]
    else:
        assert out.is_nested and out.layout == x.layout


def test_converters_are_differentiable():
    seqs = [t.requires_grad_() for t in _batch([2, 3])]
    r = ragged.from_list(seqs)
    ragged.to_padded(r.values, r.offsets, padding_side="left").sum().backward()
    assert all(torch.equal(s.grad, torch.ones_like(s)) for s in seqs)


@pytest.mark.parametrize("offsets, exc, pattern", [
    (torch.tensor([0, 2, 1]), ValueError, "non-decreasing"),
    (torch.tensor([1, 3]), ValueError, "start at 0"),
    (torch.tensor([0, 2]), ValueError, "end at the number of tokens N = 3"),
    (torch.tensor([0, 3], dtype=torch.int16), TypeError, "int64 or int32"),
    (torch.tensor([0, 1, 2, 0, 3]), ValueError, "non-decreasing"),  # a dip in the middle
], ids=["decreasing", "start", "end", "dtype", "dip"])
@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided"])
def test_check_offsets(offsets, exc, pattern, strided):
    """Contiguous CPU offsets are checked by the extension, strided ones by torch ops: same verdicts."""
    if strided:  # the same values, every other element of a buffer
        offsets = torch.stack([offsets, torch.full_like(offsets, -7)], 1).reshape(-1)[::2]
        assert not offsets.is_contiguous()
    with pytest.raises(exc, match=pattern):
        ragged.check_offsets(offsets, 3)


@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided"])
def test_check_offsets_accepts_valid(strided):
    offsets = torch.tensor([0, 0, 2, 2, 3])
    if strided:
        offsets = torch.stack([offsets, torch.full_like(offsets, -7)], 1).reshape(-1)[::2]
    ragged.check_offsets(offsets, 3)
    ragged.check_offsets(torch.tensor([0]), 0)


@pytest.mark.parametrize("lengths", [torch.tensor([2, -1, 0]), torch.tensor([2, 4, 0]),
                                     torch.tensor([2, -1, 0], dtype=torch.int32), torch.tensor([2, 9, 0, 0])[::2] * 1,
                                     torch.tensor([2, 9, 4, 0])[::2]],
                         ids=["negative", "too-long", "int32", "copy", "strided"])
def test_check_lengths(lengths):
    """CPU int64 contiguous lengths are checked by the extension, anything else by torch ops."""
    bad = int(lengths.min()) < 0 or int(lengths.max()) > 3
    if bad:
        with pytest.raises(ValueError, match=">= 0" if int(lengths.min()) < 0 else "<= T = 3"):
            ragged.check_lengths(lengths, lengths.shape[0], 3)
    else:
        assert ragged.check_lengths(lengths, lengths.shape[0], 3).tolist() == lengths.tolist()


def test_from_padded_rejects_bad_arguments():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="exactly one of lengths"):
        ragged.from_padded(x)
    with pytest.raises(ValueError, match="lengths must be <= T = 3"):
        ragged.from_padded(x, torch.tensor([4, 0]))
    with pytest.raises(ValueError, match="padding_side must be"):
        ragged.from_padded(x, torch.tensor([1, 0]), padding_side="top")
    with pytest.raises(ValueError, match="1-D tensor needs offsets"):
        ragged.pack(torch.zeros(3))
