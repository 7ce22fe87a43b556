"""tensordict's private internals that kl_kernels.torchrl uses, each with a safe fallback.

The TorchRL transforms read and write thousands of per-sample TensorDicts per call; tensordict's
public API costs ~10-40 us a sample there (more than the fused kernel at B = 1024), its storage
~0.3 us. Checked on tensordict 0.14.x (the `torchrl` extra pins it). On import this module probes a
small TensorDict once; a tensordict without what is used here (``SUPPORTED`` false) gets the
fallbacks, which are always correct and at worst slower:

* ``entries(td)`` / ``entries_of(tds)``: a plain TensorDict's own ``{name: value}`` dict
  (``td._tensordict``), which may be read and set directly; for a list of them, the list of dicts.
  Fallback: ``None`` (callers then take tensordict's public API).
* ``all_plain_unlocked(tds)``: every one of ``tds`` is exactly a ``TensorDict`` and not locked
  (``_is_locked``, the attribute behind the ``is_locked`` property). Fallback: ``is_locked``.

The list forms loop inside this module: they run per sample and call on the transforms' hot path,
where a compat call per sample cost 17-60 us more at B = 1024 than the loop itself.
* ``new_tensordict(source, batch_size, device, names)``: a TensorDict over ``source`` without
  re-checking it (``TensorDict._new_unsafe``). Fallback: the public constructor.
* ``names_or_none(td)``: ``td._maybe_names()``: ``None`` when no dim is named. Fallback: from
  ``td.names``.
* ``stack_dim_name(td)``: a lazy stack's stack-dim name (``_td_dim_name``). Fallback: ``None`` when
  the stack has no names, else from ``td.names``.

The C++ walk over samples (``csrc/cpu/tensordict_samples.cpp``) reads ``_tensordict`` and
``_is_locked`` too: ``kl_kernels.torchrl._io`` runs it only when ``SUPPORTED``.
"""

from __future__ import annotations

import torch
from tensordict import LazyStackedTensorDict, TensorDict

CHECKED_ON = ("0.14",)


def _probe() -> bool:
    try:
        td = TensorDict({"x": torch.zeros(1)}, batch_size=[1])
        stack = LazyStackedTensorDict(td, td)
        return (type(td._tensordict) is dict and td._is_locked is False and td._maybe_names() is None
                and callable(getattr(TensorDict, "_new_unsafe", None)) and hasattr(stack, "_td_dim_name"))
    except Exception:  # anything missing or changed: the public API
        return False


SUPPORTED = _probe()


def entries(td) -> dict | None:
    return td._tensordict if SUPPORTED else None


def entries_of(tds) -> list | None:
    return [td._tensordict for td in tds] if SUPPORTED else None


def all_plain_unlocked(tds) -> bool:
    if SUPPORTED:
        return all([type(td) is TensorDict and not td._is_locked for td in tds])
    return all([type(td) is TensorDict and not td.is_locked for td in tds])


def new_tensordict(source: dict, batch_size, device, names) -> TensorDict:
    if SUPPORTED:
        return TensorDict._new_unsafe(source=source, batch_size=batch_size, device=device, names=names, nested=False)
    return TensorDict(source, batch_size=batch_size, device=device, names=names)


def names_or_none(td):
    if SUPPORTED:
        return td._maybe_names()
    names = td.names
    return None if all(n is None for n in names) else names


def stack_dim_name(td: LazyStackedTensorDict):
    if SUPPORTED:
        return td._td_dim_name
    names = td.names
    return None if all(n is None for n in names) else names[td.stack_dim]
