"""Ragged batches: one canonical form and zero-copy-where-possible converters.

A batch of ``B`` sequences of lengths ``L_0 .. L_{B-1}`` is held canonically as

* ``values``  ``[N, *F]``: the tokens of all sequences back to back (``N = sum L_b``), and
* ``offsets`` ``[B + 1]`` int64: sequence ``b`` is ``values[offsets[b]:offsets[b + 1]]``
  (FlashAttention's ``cu_seqlens``; ``offsets[0] == 0``, non-decreasing, ``offsets[-1] == N``).

Converters go to and from the layouts RL code uses:

============================  ===========================================  ==============
layout                        to canonical                                 copy?
============================  ===========================================  ==============
padded ``[B, T, *F]``         :func:`from_padded` (``lengths`` or mask)    gathers (copy)
list of ``[L_b, *F]``         :func:`from_list`                            concatenates
``torch.nested`` jagged       :func:`from_nested`                          zero-copy
``torch.nested`` strided      :func:`from_nested`                          zero-copy if contiguous
============================  ===========================================  ==============

and back with :func:`to_padded`, :func:`to_list` (views), :func:`to_nested` (jagged: views;
strided: a copy). :func:`pack` / :func:`unpack` do the round trip and remember the caller's
layout, so results can be handed back the way the inputs came.

Padding sides: with ``padding_side="right"`` the ``L_b`` valid tokens of row ``b`` are columns
``0 .. L_b - 1``; with ``"left"`` they are the last ``L_b`` columns (prompts in RLHF batches
are left-padded, responses right-padded).

Example::

    >>> import torch
    >>> from kl_kernels import ragged
    >>> x = torch.tensor([[0., 1., 2.], [0., 0., 3.]])
    >>> r = ragged.from_padded(x, lengths=torch.tensor([2, 1]), padding_side="left")
    >>> r.values, r.offsets
    (tensor([1., 2., 3.]), tensor([0, 2, 3]))
    >>> ragged.to_padded(r.values, r.offsets, padding_side="right")
    tensor([[1., 2.],
            [3., 0.]])
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass
from typing import NamedTuple, Sequence

import torch

# the index checks are kl_kernels.index_checks'; handed on here as part of the converters' public API
from .index_checks import check_lengths, check_offsets

__all__ = [
    "Ragged",
    "RaggedLayout",
    "PADDING_SIDES",
    "lengths_to_offsets",
    "offsets_to_lengths",
    "token_index",
    "padded_validity",
    "check_offsets",
    "check_lengths",
    "from_padded",
    "to_padded",
    "from_list",
    "to_list",
    "SequenceList",
    "from_nested",
    "to_nested",
    "pack",
    "unpack",
]

PADDING_SIDES = ("left", "right")


class Ragged(NamedTuple):
    """Canonical ragged batch: packed ``values [N, *F]`` and int64 ``offsets [B + 1]``."""

    values: torch.Tensor
    offsets: torch.Tensor

    @property
    def lengths(self) -> torch.Tensor:
        """Per-sequence lengths ``[B]`` (int64)."""
        return offsets_to_lengths(self.offsets)

    @property
    def batch_size(self) -> int:
        return self.offsets.shape[0] - 1

    @property
    def num_tokens(self) -> int:
        return self.values.shape[0]


# --------------------------------------------------------------------------- index helpers


def host_ints(values, device) -> torch.Tensor:
    """Python ints -> an int64 tensor on ``device`` without synchronizing the host.

    A plain ``torch.tensor(values, device="cuda")`` copies from pageable memory, which blocks the host
    until the stream drains (and is flagged by ``torch.cuda.set_sync_debug_mode``). On an accelerator the
    values go through pinned memory and a non-blocking copy instead; PyTorch's caching host allocator
    keeps the pinned block alive until the copy has run."""
    device = torch.device(device)
    host = torch.tensor(values, dtype=torch.int64)
    if device.type == "cpu":
        return host
    if device.type == "cuda" and torch.cuda.is_available():  # (a fake CUDA tensor on a CPU-only torch: no pinning)
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def lengths_to_offsets(lengths: torch.Tensor) -> torch.Tensor:
    """``[B]`` lengths -> ``[B + 1]`` int64 offsets starting at 0."""
    lengths = torch.as_tensor(lengths)
    out = torch.zeros(lengths.shape[0] + 1, dtype=torch.int64, device=lengths.device)
    torch.cumsum(lengths.to(torch.int64), dim=0, out=out.narrow(0, 1, lengths.shape[0]))
    return out


def offsets_to_lengths(offsets: torch.Tensor) -> torch.Tensor:
    """``[B + 1]`` offsets -> ``[B]`` lengths (int64)."""
    n = offsets.shape[0] - 1  # narrow, not offsets[1:]: see check_offsets
    return offsets.narrow(0, 1, n) - offsets.narrow(0, 0, n)


def token_index(offsets: torch.Tensor, num_tokens: int, *, positions: bool = True):
    """For each packed token, its sequence id (and, if ``positions``, its position in the sequence).

    Sequence ids are a running count of sequence ends: O(N), a static output size (so
    ``torch.compile`` traces it), and empty sequences need no special case because their end
    markers pile up on the same token. Returns ``(seq, pos)``, ``pos`` ``None`` unless asked for.
    """
    batch = offsets.shape[0] - 1
    ends = torch.zeros(num_tokens + 1, dtype=torch.int64, device=offsets.device)
    ends.index_add_(0, offsets[1:], torch.ones(batch, dtype=torch.int64, device=offsets.device))
    seq = ends[:num_tokens].cumsum(0)
    if not positions:
        return seq, None
    return seq, torch.arange(num_tokens, device=offsets.device, dtype=torch.int64) - offsets[seq]


def padded_validity(lengths: torch.Tensor | None, batch: int, width: int, padding_side: str,
                    device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Validity mask ``[B, T]`` and position-in-sequence ``[B, T]`` of a padded batch.

    ``lengths=None`` means every column is valid. Positions of padding columns are
    meaningless (they are never read through the mask).
    """
    _check_padding_side(padding_side)
    dev = lengths.device if lengths is not None else device
    col = torch.arange(width, device=dev, dtype=torch.int64).unsqueeze(0)
    if lengths is None:
        return torch.ones(batch, width, dtype=torch.bool, device=dev), col.expand(batch, width)
    lengths = lengths.to(torch.int64).unsqueeze(1)
    if padding_side == "right":
        return col < lengths, col.expand(batch, width)
    start = width - lengths
    return col >= start, col - start


def _check_padding_side(padding_side) -> None:
    if padding_side not in PADDING_SIDES:
        raise ValueError(f"padding_side must be 'left' or 'right', got {padding_side!r}")


# --------------------------------------------------------------------------- padded


def from_padded(x: torch.Tensor, lengths: torch.Tensor | None = None, *, mask: torch.Tensor | None = None,
                padding_side: str = "left") -> Ragged:
    """Padded ``[B, T, *F]`` -> :class:`Ragged`.

    Validity comes from ``lengths [B]`` (with ``padding_side``) or from a boolean validity
    ``mask [B, T]`` (tokens kept in row-major order; give exactly one of the two). This
    gathers, so it copies.
    """
    _check_padding_side(padding_side)
    if x.dim() < 2:
        raise ValueError(f"x must be padded [B, T, *F], got shape {tuple(x.shape)}")
    batch, width = x.shape[:2]
    if (lengths is None) == (mask is None):
        raise ValueError("from_padded needs exactly one of lengths [B] or a validity mask [B, T]")
    if mask is not None:
        if mask.dtype != torch.bool:
            raise TypeError(f"mask must be bool [B, T], got {mask.dtype}")
        if mask.shape != (batch, width):
            raise ValueError(f"mask must have shape [B, T] = [{batch}, {width}], got {tuple(mask.shape)}")
        valid, lengths = mask, mask.sum(1)
    else:
        lengths = check_lengths(lengths, batch, width)
        valid, _ = padded_validity(lengths, batch, width, padding_side)
    return Ragged(x[valid], lengths_to_offsets(lengths))


def to_padded(values: torch.Tensor, offsets: torch.Tensor, *, padding_side: str = "left",
              width: int | None = None, padding_value: float = 0.0) -> torch.Tensor:
    """Packed ``values [N, *F]`` + ``offsets`` -> padded ``[B, T, *F]``.

    ``width`` defaults to the longest sequence (one host sync to read it); padding positions hold
    ``padding_value``. Differentiable with respect to ``values``.
    """
    _check_padding_side(padding_side)
    lengths = offsets_to_lengths(offsets)
    batch = lengths.shape[0]
    if width is None:
        width = int(lengths.max()) if batch else 0
    seq, pos = token_index(offsets, values.shape[0])
    if padding_side == "left":
        pos = pos + (width - lengths)[seq]
    out = values.new_full((batch, width, *values.shape[1:]), padding_value)
    return out.index_put((seq, pos), values)


# --------------------------------------------------------------------------- lists


def plain_sequence(x, name: str):
    """A list or tuple argument as every reader will see it; anything else as it is.

    An exact ``list`` or ``tuple`` comes back unchanged. A subclass may override ``__len__``,
    ``__getitem__`` or ``__iter__`` so that different readers see different items (a C reader
    sized by ``len()`` read past the end of a shorter iteration): it is read here once, through
    its iterator, into a tuple that every backend then reads, and a ``len()`` that disagrees with
    what it yields is a ``ValueError`` naming ``name``. The ops call this on every sequence
    argument before anything else reads it.
    """
    kind = type(x)
    if kind is list or kind is tuple or not isinstance(x, (list, tuple)):
        return x
    items = tuple(iter(x))
    claimed = len(x)
    if claimed != len(items):
        raise ValueError(f"{name} is a {kind.__name__} (a {'list' if isinstance(x, list) else 'tuple'} subclass) "
                         f"whose len() is {claimed} but which yields {len(items)} items: pass a plain list")
    return items


def from_list(tensors: Sequence[torch.Tensor], *, name: str = "tensors", empty_device=None) -> Ragged:
    """List of ``[L_b, *F]`` tensors -> :class:`Ragged` (concatenates: a copy). An empty list gives
    float32 ``[0]`` values on ``empty_device`` (default: the CPU)."""
    values = cat_list(tensors, name=name, empty_device=empty_device)
    if not tensors:
        return Ragged(values, torch.zeros(1, dtype=torch.int64, device=empty_device))
    # the offsets summed on the host from the shapes, sent in one copy without a sync
    return Ragged(values, host_ints([0, *itertools.accumulate(t.shape[0] for t in tensors)], values.device))


def cat_list(tensors: Sequence[torch.Tensor], *, name: str = "tensors", empty_device=None) -> torch.Tensor:
    """:func:`from_list`'s values alone (checked the same way), for a list whose lengths the caller
    compares on the host: no offsets made on the device."""
    tensors = list(tensors)
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}[{i}] must be a tensor, got {type(t).__name__}")
        if t.dim() < 1:
            raise ValueError(f"{name}[{i}] must be at least 1-D [L, *F], got a 0-d tensor")
    if not tensors:
        return torch.zeros(0, device=empty_device)
    device = tensors[0].device
    for i, t in enumerate(tensors):
        if t.device != device:
            raise ValueError(f"{name}[{i}] is on {t.device} but {name}[0] is on {device}: "
                             "all tensors must be on one device")
        if t.shape[1:] != tensors[0].shape[1:]:
            raise ValueError(f"{name}[{i}] has shape {list(t.shape)} but {name}[0] has {list(tensors[0].shape)}: "
                             "all tensors must be [L_b, *F] with the same F")
    return torch.cat(tensors)


class SequenceList:
    """The per-sequence tensors of a list input, left where they are.

    A kernel that takes one address per sequence (the CPU ``kl_reward`` forward) reads them in
    place: no ``torch.cat``, whose per-tensor overhead made packing a lazily stacked batch of
    1024 samples cost more than the kernel. The object stands for the packed ``[N]`` tensor
    (``shape``, ``dtype``, ``device``, ``numel()``) and carries ``addresses`` (int64 ``[B]``,
    where each sequence starts) and ``offsets`` (int64 ``[B + 1]``); :meth:`pack` makes the
    packed tensor when a backend needs it. Built by :meth:`of`, which accepts only what such a
    kernel can read. It is only ever read outside autograd (the fused forward without a graph),
    hence ``requires_grad = False``.
    """

    __slots__ = ("tensors", "dtype", "shape", "addresses", "offsets", "_offsets_buffer")
    device = torch.device("cpu")
    requires_grad = False
    is_nested = False

    def __init__(self, dtype, num_tokens, addresses: bytearray, offsets: bytearray, tensors: tuple):
        # ``tensors``: a snapshot that keeps the addresses valid even if the caller's list changes
        # while the kernel runs (without the GIL).
        self.tensors, self.dtype, self.shape = tensors, dtype, torch.Size((num_tokens,))
        self.addresses = torch.frombuffer(addresses, dtype=torch.int64)  # (keeps the buffer alive)
        self.offsets = torch.frombuffer(offsets, dtype=torch.int64)
        self._offsets_buffer = offsets

    @classmethod
    def of(cls, tensors, dtypes, *, trailing_one: bool = False, like: "SequenceList | None" = None,
           reject_grad: bool = False) -> "SequenceList | None":
        """``tensors`` (a non-empty list or tuple) if they are plain ``torch.Tensor`` objects of one
        dtype among ``dtypes`` on the CPU, each contiguous ``[L]`` (``[L, 1]`` with
        ``trailing_one``), with the sequence lengths of ``like`` if given, none carrying torch's
        negative bit, and with ``reject_grad`` none requiring grad; else ``None`` (pack them).

        The facts are read by the CPU extension in one pass (this runs per sample of every call);
        without the extension there is no kernel to read lists in place, so always ``None``."""
        facts = _sequence_facts_kernel()
        if facts is None or not isinstance(tensors, (list, tuple)):
            return None
        found = facts(tensors, torch.Tensor, trailing_one, None if like is None else like._offsets_buffer, reject_grad,
                      READ_THROUGH_DLPACK)
        if found is None or found[0] not in dtypes:
            return None
        return cls(*found)

    def numel(self) -> int:
        return self.shape[0]

    def dim(self) -> int:
        return 1

    def pack(self) -> torch.Tensor:
        """The packed ``[N]`` tensor (a copy)."""
        return torch.cat([t.reshape(-1) for t in self.tensors])


# Whether SequenceList.of reads tensors through DLPack's C exchange table (when torch offers one:
# ~0.2 instead of ~0.7 us a tensor, see csrc/cpu/tensor_lists.cpp) rather than their Python
# attributes. Both give the same answers; tests switch it off to check the attribute path.
READ_THROUGH_DLPACK = True


@functools.lru_cache(maxsize=None)
def _sequence_facts_kernel():
    from . import _extensions  # not at import time: kl_kernels.ragged must import without the extension

    return _extensions.kernel("_C", "sequence_facts")[0]


def to_list(values: torch.Tensor, offsets: torch.Tensor, lengths: list[int] | None = None) -> list[torch.Tensor]:
    """:class:`Ragged` parts -> list of views ``values[offsets[b]:offsets[b+1]]``. ``lengths``: the
    sequence lengths as Python ints, when the caller has them already (several splits of one layout)."""
    if lengths is None:
        lengths = offsets_to_lengths(offsets).tolist()
    if values.requires_grad or torch.compiler.is_compiling():
        return list(values.split(lengths))
    # Outside autograd the views need no view tracking (the parts never overlap, so an in-place
    # change of one is invisible to the others); that makes each part ~40% cheaper, which
    # counts when a lazily stacked batch of 1024 samples gets its results back.
    return list(torch.unsafe_split_with_sizes(values, lengths))


# --------------------------------------------------------------------------- nested tensors


def from_nested(nt: torch.Tensor, *, name: str = "tensor") -> Ragged:
    """``torch.nested`` tensor (jagged or strided) with the ragged dim first -> :class:`Ragged`.

    Jagged tensors are read through ``values()``/``offsets()`` (zero-copy); contiguous strided
    ones through their buffer (zero-copy); anything else (holes, non-contiguous) is
    concatenated.
    """
    if not getattr(nt, "is_nested", False):
        raise TypeError(f"{name} must be a nested tensor, got a regular tensor")
    if nt.layout == torch.jagged:
        if getattr(nt, "_ragged_idx", 1) != 1:
            raise ValueError(f"{name} must be ragged in dim 1 ([B, j, *F]), got a transposed jagged tensor")
        if nt.lengths() is None:
            return Ragged(nt.values(), nt.offsets().to(torch.int64))
        return from_list(nt.unbind(), name=name)
    sizes = nt._nested_tensor_size()  # [B, ndim] host tensor of per-component shapes
    if sizes.shape[0] == 0:
        return Ragged(torch.zeros(0, dtype=nt.dtype, device=nt.device),
                      torch.zeros(1, dtype=torch.int64, device=nt.device))
    if nt.is_contiguous():
        lengths = sizes[:, 0].to(device=nt.device, dtype=torch.int64)
        feature = tuple(sizes[0, 1:].tolist())
        return Ragged(nt.values().view(-1, *feature), lengths_to_offsets(lengths))
    return from_list(nt.unbind(), name=name)


def to_nested(values: torch.Tensor, offsets: torch.Tensor, *, layout=torch.jagged) -> torch.Tensor:
    """:class:`Ragged` parts -> ``torch.nested`` tensor of the given layout.

    Jagged: a view over ``values`` (zero-copy). Strided: built from views, which copies.
    """
    if layout == torch.jagged:
        return torch.nested.nested_tensor_from_jagged(values, offsets)
    return torch.nested.as_nested_tensor(to_list(values, offsets), layout=torch.strided)


# --------------------------------------------------------------------------- round trip


@dataclass(frozen=True)
class RaggedLayout:
    """What :func:`pack` saw, so :func:`unpack` can hand results back the same way.

    ``kind`` is one of ``"packed"``, ``"padded"``, ``"list"``, ``"nested_jagged"``,
    ``"nested_strided"``. For ``"padded"`` the width and padding side are kept.
    """

    kind: str
    offsets: torch.Tensor
    padding_side: str = "left"
    width: int | None = None


def pack(x, *, offsets: torch.Tensor | None = None, lengths: torch.Tensor | None = None,
         mask: torch.Tensor | None = None, padding_side: str = "left") -> tuple[Ragged, RaggedLayout]:
    """Any supported layout -> (:class:`Ragged`, :class:`RaggedLayout`)."""
    if isinstance(x, (list, tuple)):
        r = from_list(x)
        return r, RaggedLayout("list", r.offsets)
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"expected a tensor, nested tensor or list of tensors, got {type(x).__name__}")
    if x.is_nested:
        r = from_nested(x)
        kind = "nested_jagged" if x.layout == torch.jagged else "nested_strided"
        return r, RaggedLayout(kind, r.offsets)
    if offsets is not None:
        offsets = check_offsets(offsets, x.shape[0], device=x.device)
        return Ragged(x, offsets), RaggedLayout("packed", offsets)
    if x.dim() < 2:
        raise ValueError(f"a 1-D tensor needs offsets [B + 1] (packed layout); got shape {tuple(x.shape)}")
    if lengths is None and mask is None:
        lengths = torch.full((x.shape[0],), x.shape[1], dtype=torch.int64, device=x.device)
    r = from_padded(x, lengths, mask=mask, padding_side=padding_side)
    return r, RaggedLayout("padded", r.offsets, padding_side, x.shape[1])


def unpack(values: torch.Tensor, layout: RaggedLayout, *, padding_value: float = 0.0):
    """Packed ``values`` (same token order as :func:`pack` produced) -> the caller's layout."""
    if layout.kind == "packed":
        return values
    if layout.kind == "padded":
        return to_padded(values, layout.offsets, padding_side=layout.padding_side, width=layout.width,
                         padding_value=padding_value)
    if layout.kind == "list":
        return to_list(values, layout.offsets)
    if layout.kind == "nested_jagged":
        return to_nested(values, layout.offsets, layout=torch.jagged)
    if layout.kind == "nested_strided":
        return to_nested(values, layout.offsets, layout=torch.strided)
    raise ValueError(f"unknown layout kind {layout.kind!r}")
