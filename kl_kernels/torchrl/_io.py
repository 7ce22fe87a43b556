"""Reading TorchRL's LLM log-prob entries into one packed batch, and writing results back.

TorchRL stores per-token entries in three ways: dense padded tensors in a dense TensorDict,
per-sample tensors in a lazily stacked TensorDict (ragged), and nested tensors (strided or
jagged). :func:`read` turns any of them into a :class:`Batch`: either dense ``[B, T, ...]`` or
packed values with int64 offsets (one ``torch.cat`` for a lazy stack, zero-copy for jagged
nested tensors), so the numeric work is one vectorized call, never a loop over samples.
:func:`write` stores a result the way the input came.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from tensordict import LazyStackedTensorDict, TensorDict, TensorDictBase, unravel_key

from .. import _extensions, ragged
from .._compat import tensordict as td_compat


@dataclass
class Batch:
    """One per-token entry: ``values`` is ``[B, T, ...]`` (``layout is None``) or packed ``[N, ...]``
    with ``layout`` (a :class:`kl_kernels.ragged.RaggedLayout`) saying how it was stored."""

    values: torch.Tensor
    layout: ragged.RaggedLayout | None
    lazy: bool

    @property
    def dense(self) -> bool:
        return self.layout is None

    @property
    def offsets(self) -> torch.Tensor | None:
        return None if self.layout is None else self.layout.offsets

    @property
    def batch_size(self) -> int:
        return self.values.shape[0] if self.dense else self.layout.offsets.shape[0] - 1

    def sample_shapes(self) -> list[torch.Size]:
        if self.dense:
            return [self.values.shape[1:]] * self.values.shape[0]
        lengths = ragged.offsets_to_lengths(self.offsets).tolist()
        return [torch.Size((n, *self.values.shape[1:])) for n in lengths]


def is_lazy(td: TensorDictBase) -> bool:
    return isinstance(td, LazyStackedTensorDict)


def has(td: TensorDictBase, key) -> bool:
    """Whether ``td`` holds ``key`` (for a lazy stack: its first sample does), without gathering it."""
    if is_lazy(td):
        return bool(td.tensordicts) and has(td.tensordicts[0], key)
    return _dense_get(td, key) is not None


def _dense_get(td: TensorDictBase, key):
    """``td.get(key, None)`` for a dense TensorDict, or the list of per-sample tensors when ``key`` lives
    in a lazily stacked sub-TensorDict with ragged leaves (what a pad_output=False model writes):
    there ``td.get`` tries to stack and raises; TorchRL reads it with ``as_list=True``."""
    try:
        return td.get(key, None)
    except RuntimeError:
        items = td.get(key, None, as_list=True)
        return None if items is None else list(items)


def plain_samples(td: LazyStackedTensorDict) -> bool:
    """A lazy stack of plain, unlocked TensorDicts: their entries can be read and set directly."""
    return not td.is_locked and td_compat.all_plain_unlocked(td.tensordicts)  # per sample and call: one loop


def shallow_copy(td: TensorDictBase) -> TensorDictBase:
    """``td.copy()``: new containers holding the same tensors, which a model may write into without
    touching ``td``. For a lazy stack of plain samples the containers are rebuilt directly, a few
    us a sample instead of TensorDict's ~40 (B = 1024: more than the rest of a transform call);
    anything else (non-tensor data, tensorclasses, other TensorDict types) gets ``td.copy()``."""
    if is_lazy(td) and plain_samples(td):
        copies = [_copy_plain(sub) for sub in td.tensordicts]
        if None not in copies:
            return type(td)(*copies, stack_dim=td.stack_dim, stack_dim_name=td_compat.stack_dim_name(td))
    return td.copy()


def _copy_plain(td: TensorDict) -> TensorDict | None:
    """What ``TensorDict._clone(recurse=False)`` makes of a TensorDict of tensors and plain
    TensorDicts (new containers at every level, same leaves, unlocked), or ``None`` for anything else."""
    own = td_compat.entries(td)
    if own is None:
        return None
    source = {}
    for name, value in own.items():
        if type(value) is TensorDict:
            value = _copy_plain(value)
            if value is None:
                return None
        elif not isinstance(value, torch.Tensor):
            return None
        source[name] = value
    return td_compat.new_tensordict(source, td.batch_size, td.device, td_compat.names_or_none(td))


def fast_leaves(td: LazyStackedTensorDict, key) -> list | None:
    """The per-sample tensors under ``key``, read straight from the samples' storage.

    ``LazyStackedTensorDict.get(..., as_list=True)`` costs ~15 us per sample in TensorDict's
    generic machinery (B = 1024: ~15 ms, more than the fused kernel); the samples' own dicts give
    the same tensors for ~0.3 us each. ``None`` (use the public API) when anything is unusual."""
    entries = td_compat.entries_of(td.tensordicts) if plain_samples(td) else None
    if entries is None:
        return None
    nodes = entries_at(entries, key)
    if nodes is None or not all([isinstance(n, torch.Tensor) for n in nodes]):  # a sub-TensorDict: not a leaf
        return None
    return nodes


def sample_entries(td: TensorDictBase) -> list[dict] | None:
    """The entry dicts of the samples of a lazy stack of plain samples of batch size ``()`` (so a
    result can be set into them directly), or ``None``. One pass over the samples."""
    if not is_lazy(td) or td.batch_dims != 1 or not plain_samples(td):
        return None
    return td_compat.entries_of(td.tensordicts)


def sample_leaves(td: TensorDictBase, keys) -> tuple[tuple[dict, ...], tuple[tuple, ...]] | None:
    """``(entries, leaves)``: the samples' entry dicts (those of :func:`sample_entries`) of ``td``
    and, for each of ``keys``, every sample's value under it (``leaves[k][i]``: a leaf, or anything
    else: the caller checks), all tuples; or ``None`` when ``td`` is not such a stack or some sample
    lacks a key. Tuples, because what takes them next (:func:`put_entries`, ``kl_reward``'s list reader,
    ``sequence_facts``) uses a tuple as it is and would copy a list.

    One pass over the samples, every key of a sample together, in C when the CPU extension is there
    (``csrc/cpu/tensordict_samples.cpp``: ~0.1 ms less than the Python walk for three keys at B = 256
    right after another call has evicted the caches), else in Python; both follow the same rules
    (tests compare them)."""
    if not is_lazy(td) or td.batch_dims != 1 or td.is_locked:
        return None
    paths = tuple(_path(key) for key in keys)
    walk = _walker() if WALK_IN_C and td_compat.SUPPORTED else None  # it reads the same internals
    if walk is not None:
        return walk(td.tensordicts, TensorDict, paths)
    entries = sample_entries(td)
    if entries is None:
        return None
    leaves = [entries_at(entries, path) for path in paths]
    return None if any(x is None for x in leaves) else (tuple(entries), tuple(tuple(x) for x in leaves))


# Whether sample_leaves and put_entries loop over the samples in C (when the extension has them);
# tests switch it off to compare with the Python loops.
WALK_IN_C = True


@functools.lru_cache(maxsize=None)
def _walker():
    return _extensions.kernel("_C", "sample_leaves")[0]


@functools.lru_cache(maxsize=None)
def _putter():
    return _extensions.kernel("_C", "put_entries")[0]


def _path(key) -> tuple[str, ...]:
    path = unravel_key(key)
    return (path,) if isinstance(path, str) else path


def entries_at(entries: list[dict], key) -> list | None:
    """Each sample's value under ``key`` (a leaf, or anything else: the caller checks), or ``None``
    when some sample lacks it. One comprehension per path level: this runs per sample and call."""
    path = _path(key)
    try:
        nodes = [e[path[0]] for e in entries]
        for name in path[1:]:
            if not all([type(n) is TensorDict for n in nodes]):  # a leaf or another container on the way
                return None
            own = td_compat.entries_of(nodes)
            if own is None:
                return None
            nodes = [e[name] for e in own]
    except KeyError:
        return None
    return nodes


def set_entries(td: LazyStackedTensorDict, entries: list[dict], name: str, tensors: list, td_device) -> None:
    """Set top-level entry ``name`` of each sample (``entries`` from :func:`sample_entries`) to one of
    ``tensors``: directly, as TensorDict.set does once its checks pass (~10 us a sample), when the
    samples' device allows it, checked once per call; else through ``td.set``. ``td_device``:
    ``td.device`` (a lazy stack computes it from every sample: the caller may have it already)."""
    if not tensors:
        return
    device = tensors[0].device
    if (td_device is not None and td_device != device) or (td_device is None and not all(
            sub.device is None or sub.device == device for sub in td.tensordicts)):
        _set_split(td, name, tensors)
        return
    put_entries(entries, name, tensors)


def put_entries(entries, name: str, tensors) -> None:
    """Set top-level entry ``name`` of each sample (``entries``, a list or tuple from
    :func:`sample_entries` or :func:`sample_leaves`) to one of ``tensors`` (a list or tuple), with
    no check: the caller knows each tensor is on its sample's device. In one C loop when the
    extension has it (``csrc/cpu/tensordict_samples.cpp``)."""
    put = _putter() if WALK_IN_C else None
    if put is not None and put(entries, name, tensors):
        return
    for e, t in zip(entries, tensors):
        e[name] = t


def read(td: TensorDictBase, key) -> Batch | None:
    """The entry ``key`` of ``td`` as a :class:`Batch`, or ``None`` when absent."""
    if is_lazy(td):
        items = fast_leaves(td, key)
        if items is None:
            items = td.get(key, None, as_list=True)
        if items is None:
            return None
        r, layout = ragged.pack(list(items))
        return Batch(r.values, layout, lazy=True)
    x = _dense_get(td, key)
    if isinstance(x, list):  # ragged per-sample tensors: the strided nested tensor TorchRL builds from them
        x = torch.nested.nested_tensor(x)
    if x is None:
        return None
    if isinstance(x, torch.Tensor) and x.is_nested:
        r, layout = ragged.pack(x)
        return Batch(r.values, layout, lazy=False)
    return Batch(x, None, lazy=False)


def like(batch: Batch, values: torch.Tensor):
    """``values`` (dense like ``batch``, or packed with its offsets) in the storage of ``batch``."""
    return values if batch.dense else ragged.unpack(values, batch.layout)  # a lazy stack's layout is "list"


def write(td: TensorDictBase, key, batch: Batch, values: torch.Tensor) -> None:
    """Store ``values`` under ``key`` the way ``batch`` was stored (a lazy stack gets per-sample tensors)."""
    out = like(batch, values)
    if batch.lazy:
        write_samples(td, key, out)
        return
    td.set(key, out)


def write_samples(td: LazyStackedTensorDict, key, tensors: list) -> None:
    """Store one tensor per sample of the lazy stack ``td`` under ``key``."""
    name = unravel_key(key)
    entries = sample_entries(td) if isinstance(name, str) else None
    if entries is not None:
        set_entries(td, entries, name, tensors, td.device)
        return
    _set_split(td, key, tensors)


def _set_split(td: LazyStackedTensorDict, key, tensors: list) -> None:
    # A strided nested tensor set into a lazy stack is split into its samples, as TorchRL does.
    td.set(key, torch.nested.as_nested_tensor(list(tensors), layout=torch.strided))
