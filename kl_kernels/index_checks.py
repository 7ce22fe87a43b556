"""The value checks of index tensors: ``offsets`` ``[B + 1]`` (a packed batch's sequence boundaries) and
``lengths`` ``[B]`` (a padded batch's valid tokens per row), int64 or int32.

Structure (type, dtype, rank, device) is checked at once; the values where :mod:`kl_kernels.value_checks`
says: on the host for CPU tensors (a ``ValueError`` at once), on the device for accelerator tensors (a check
kernel recording into the device's error word, :mod:`kl_kernels.device_errors`, deferred to the launch that
follows while a validation defers), not at all under ``torch.compile`` or on the meta device. The messages
are :func:`kl_kernels.device_errors.value_error_message`'s, the same on both paths.

The layer of the value checks: this module stands on :mod:`~kl_kernels.value_checks` and
:mod:`~kl_kernels.device_errors`; the layouts (:mod:`kl_kernels.ragged`, :mod:`kl_kernels.layouts`) and the
launchers stand on it (``tests/test_structure.py`` holds that order). ``kl_kernels.ragged`` hands
:func:`check_offsets` and :func:`check_lengths` on as part of its public API.
"""

from __future__ import annotations

import functools

import torch

from . import _extensions, device_errors, value_checks

__all__ = ["INDEX_DTYPES", "check_offsets", "check_offset_values", "check_lengths", "check_length_values"]


def _int64_facts_cpu(v: torch.Tensor, plain: bool = False):
    """``(first, last, min, max, non_decreasing)`` of a non-empty contiguous int64 CPU vector, read
    by the CPU extension in one call (instead of five torch ops: these checks run on every call), or
    ``None`` where torch ops must do it (other devices, strided or other dtypes, no extension, and a
    tensor with torch's negative bit, whose memory holds the negation of its values). ``plain``: the
    caller knows ``v`` is a non-empty contiguous int64 tensor without the negative bit (a call plan's
    checks: its signature and its builder's conditions hold that), so only the device is looked at."""
    if v.device.type != "cpu":
        return None
    n = v.numel()
    if not plain and (v.dtype != torch.int64 or not v.is_contiguous() or n == 0 or v.is_neg()):
        return None
    fn = _int64_facts_kernel()
    return None if fn is None else fn(v.data_ptr(), n)


@functools.lru_cache(maxsize=None)
def _int64_facts_kernel():
    return _extensions.kernel("_C", "int64_facts")[0]  # (loads _C at the first check, not at import)


# The integer dtypes index tensors (offsets, lengths, prompt_lens, labels) may have: int32 is what
# flash-attention's unpadding and verl's remove-padding path produce as cu_seqlens. They are widened
# to int64 on their device (one cast kernel, no host sync) before anything reads them.
INDEX_DTYPES = (torch.int64, torch.int32)


def check_offsets(offsets, num_tokens: int, *, name: str = "offsets", device=None) -> torch.Tensor:
    """Raise if ``offsets`` is not a valid ``[B + 1]`` int64 or int32 offsets vector for ``num_tokens``;
    return it as int64 (int32 widened on its device: a new tensor, the input unchanged).

    Structure (type, dtype, rank, device) is always checked; the values (start at 0,
    non-decreasing, end at ``num_tokens``) too: on the host for CPU tensors, on the device for
    accelerator tensors (:func:`value_checks.checks_on_host`). Under ``torch.compile`` the value checks are
    skipped so as not to break the graph, and on the meta device, which has no values.
    """
    if not isinstance(offsets, torch.Tensor):
        raise TypeError(f"{name} must be a 1-D int64 tensor [B + 1], got {type(offsets).__name__}")
    if offsets.dtype not in INDEX_DTYPES:
        raise TypeError(f"{name} must be an int64 or int32 tensor (cu_seqlens), got {offsets.dtype}")
    if offsets.dim() != 1 or offsets.shape[0] < 1:
        raise ValueError(f"{name} must be 1-D with B + 1 >= 1 entries, got shape {tuple(offsets.shape)}")
    if device is not None and offsets.device != torch.device(device):
        raise ValueError(f"{name} must be on {device} like the values, got {offsets.device}")
    if value_checks.values_checkable(offsets):
        return check_offset_values(offsets, num_tokens, name)
    return offsets if offsets.dtype == torch.int64 else offsets.to(torch.int64)


def check_offset_values(offsets: torch.Tensor, num_tokens: int, name: str = "offsets", *,
                        plain: bool = False) -> torch.Tensor:
    """:func:`check_offsets`' value checks alone, for offsets whose structure is known to be right (an int64
    or int32 ``[B + 1]`` tensor on the values' device, values readable: a call plan's signature holds all
    that, kl_kernels/plans.py); returns them as int64 (int32 widened on the device) like check_offsets.
    ``plain``: as :func:`_int64_facts_cpu`'s, for the int64 tensor."""
    if offsets.dtype != torch.int64:
        offsets = offsets.to(torch.int64)
    device_errors.raise_pending(offsets.device)  # an earlier call's bad value on this device, before this call's
    if not value_checks.checks_on_host(offsets):
        n = offsets.shape[0]
        if not value_checks.value_check("offsets_valid", offsets, n - 1, num_tokens, name=name):
            # torch operations, in the host check's order: the first recorded wins (narrow/select rather than
            # Python indexing: they also trace under a fake CUDA mode on a CPU-only torch, which
            # tests/test_no_host_sync.py uses)
            first, last = offsets.narrow(0, 0, 1), offsets.narrow(0, n - 1, 1)
            device_errors.record_where(first.ne(0), first, "offsets_start", name, num_tokens)
            if n > 1:
                dips = offsets.narrow(0, 1, n - 1).lt(offsets.narrow(0, 0, n - 1))
                device_errors.record_where(dips, offsets.narrow(0, 1, n - 1), "offsets_decreasing", name, num_tokens)
            device_errors.record_where(last.ne(num_tokens), last, "offsets_end", name, num_tokens)
        return offsets
    facts = _int64_facts_cpu(offsets, plain)
    if facts is not None:
        first_v, last_v, decreasing_v = facts[0], facts[1], not facts[4]
    else:
        n = offsets.shape[0]
        first, last = offsets.select(0, 0), offsets.select(0, n - 1)
        decreasing = offsets.narrow(0, 1, n - 1).lt(offsets.narrow(0, 0, n - 1)).any() if n > 1 else \
            torch.zeros((), dtype=torch.bool)
        # One host sync for all three facts.
        first_v, last_v, decreasing_v = torch.stack(
            [first, last, decreasing.to(torch.int64).to(offsets.device)]).tolist()
    if first_v != 0:
        raise ValueError(device_errors.value_error_message("offsets_start", name, first_v, num_tokens))
    if decreasing_v:
        raise ValueError(device_errors.value_error_message("offsets_decreasing", name))
    if last_v != num_tokens:
        raise ValueError(device_errors.value_error_message("offsets_end", name, last_v, num_tokens))
    return offsets


def check_lengths(lengths: torch.Tensor, batch: int, width: int, name: str = "lengths") -> torch.Tensor:
    """Raise unless ``lengths`` is an integer ``[B]`` tensor with ``0 <= lengths <= width``; return it as int64.

    The value checks run on the device for accelerator tensors (:func:`value_checks.checks_on_host`) and are
    skipped under ``torch.compile`` and on the meta device.
    """
    lengths = torch.as_tensor(lengths)
    if lengths.dtype.is_floating_point or lengths.dtype.is_complex or lengths.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor [B], got {lengths.dtype}")
    if lengths.shape != (batch,):
        raise ValueError(f"{name} must have shape [B] = [{batch}], got {tuple(lengths.shape)}")
    if value_checks.values_checkable(lengths):
        return check_length_values(lengths, batch, width, name)
    return lengths if lengths.dtype == torch.int64 else lengths.to(torch.int64)


def check_length_values(lengths: torch.Tensor, batch: int, width: int, name: str = "lengths", *,
                        plain: bool = False) -> torch.Tensor:
    """:func:`check_lengths`' value checks alone, for lengths whose structure is known to be right (an
    integer ``[B]`` tensor, values readable: a call plan's signature holds that, kl_kernels/plans.py);
    returns them as int64 (widened on their device) like check_lengths. ``plain``: as
    :func:`_int64_facts_cpu`'s, for the int64 tensor."""
    if lengths.dtype != torch.int64:  # widened on its device: the kernels and checks read int64
        lengths = lengths.to(torch.int64)
    if not batch:
        return lengths
    device_errors.raise_pending(lengths.device)  # an earlier call's bad value on this device
    if not value_checks.checks_on_host(lengths):
        if not value_checks.value_check("lengths_valid", lengths, batch, width, None, None, name=name):
            device_errors.record_where(lengths.lt(0), lengths, "below_zero", name, width)
            device_errors.record_where(lengths.gt(width), lengths, "above_bound", name, width)
        return lengths
    facts = _int64_facts_cpu(lengths, plain)
    lo, hi = facts[2:4] if facts is not None else torch.stack([lengths.min(), lengths.max()]).tolist()
    if lo < 0:
        raise ValueError(device_errors.value_error_message("below_zero", name, lo, width))
    if hi > width:
        raise ValueError(device_errors.value_error_message("above_bound", name, hi, width))
    return lengths
