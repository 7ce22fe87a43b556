"""Layout rules both ops share (no op owns this module): which tensors are log-probs, one device for
every argument, and normalizing the caller's layout (packed ``[N]`` + ``offsets``, padded ``[B, T]``
+ ``lengths``, a list of 1-D tensors, a nested tensor) into a native one, plus handing per-token
results back in the caller's layout (:class:`TokenLayout`).

Bad input raises ``TypeError`` (wrong kind or dtype) or ``ValueError`` (wrong shape, value or
device) naming the argument and what was expected. Inputs are never modified.
"""

from __future__ import annotations

import numbers
import weakref
from dataclasses import dataclass

import torch

from . import device_errors, index_checks, ragged, value_checks

LOGPROB_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_DTYPE_NAMES = "float32, bfloat16, float16 (or float64 with the torch backend)"


class NativeLayout:
    """Properties of a normalized problem in a native layout (``layout``, ``log_probs`` and, packed,
    ``offsets``), shared by the ops' problem classes."""

    mask_nan = False  # a problem whose op has no NaN-pad option (kl_reward's dataclass overrides it)
    # An empty list and no other tensor argument: the batch has no device, and there is nothing to
    # compute (backends.select waives the device check and answers with the reference).
    device_free = False

    @property
    def batch_size(self) -> int:
        return self.log_probs.shape[0] if self.layout == "padded" else self.offsets.shape[0] - 1

    @property
    def num_tokens(self) -> int:
        return self.log_probs.numel()

    @property
    def device(self) -> torch.device:
        return self.log_probs.device


@dataclass(frozen=True)
class TokenLayout:
    """How to hand per-token results back in the caller's layout."""

    kind: str  # "packed", "padded", "list", "nested_jagged", "nested_strided"
    offsets: torch.Tensor | None
    lengths: tuple | None = None  # lists: the sequence lengths as Python ints (read from the shapes)

    def _tokens(self, x: torch.Tensor, lengths: list[int] | None = None):
        if self.kind in ("packed", "padded"):
            return x
        if self.kind == "list":
            return ragged.to_list(x, self.offsets, lengths)
        return ragged.unpack(x, ragged.RaggedLayout(self.kind, self.offsets))


def check_logprob_tensor(x, name):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a tensor, got {type(x).__name__}")
    if x.dtype not in LOGPROB_DTYPES:
        raise TypeError(f"{name} must be a floating tensor ({_DTYPE_NAMES}), got {x.dtype}")


def check_mask_tensor(mask, shape, name="mask"):
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"{name} must be a bool tensor, got {type(mask).__name__}")
    if mask.dtype != torch.bool:
        raise TypeError(f"{name} must be a bool tensor (use mask.bool()), got {mask.dtype}")
    if tuple(mask.shape) != tuple(shape):
        raise ValueError(f"{name} must have the shape of log_probs {list(shape)}, got {list(mask.shape)}")


def int_vector(x, name, batch, device):
    """Lengths-like argument: tensor or sequence of ints -> int64 ``[B]`` tensor on ``device``."""
    if not isinstance(x, torch.Tensor):
        if isinstance(x, (list, tuple)) and all(isinstance(v, numbers.Integral) and not isinstance(v, bool) for v in x):
            x = ragged.host_ints(list(x), device)
        else:
            raise TypeError(f"{name} must be an integer tensor [B] or a sequence of ints, got {type(x).__name__}")
    if x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor [B], got {x.dtype}")
    if tuple(x.shape) != (batch,):
        raise ValueError(f"{name} must have shape [B] = [{batch}], got {list(x.shape)}")
    check_device(name, x.device, device)
    return x if x.dtype == torch.int64 else x.to(torch.int64)


def check_device(name, got, want):
    if got != want:
        raise ValueError(f"{name} is on {got} but log_probs is on {want}: every tensor argument must be on the same device")


def same_device(device, **tensors):
    for name, t in tensors.items():
        if isinstance(t, torch.Tensor):
            check_device(name, t.device, device)


# normalize_layout's nested log_probs: their packed offsets (by id, with a weak reference to tell a reused id)
# -> the token count N, so that pack_ragged_arg compares another nested argument's N with it on the host (its
# callers hand it only the offsets). An entry leaves with its offsets tensor.
_NESTED_TOKENS: dict[int, tuple[weakref.ref, int]] = {}


def _remember_tokens(offsets: torch.Tensor, num_tokens: int) -> None:
    key = id(offsets)
    _NESTED_TOKENS[key] = (weakref.ref(offsets, lambda _, key=key: _NESTED_TOKENS.pop(key, None)), num_tokens)


def _tokens_of(offsets: torch.Tensor) -> int | None:
    found = _NESTED_TOKENS.get(id(offsets))
    return found[1] if found is not None and found[0]() is offsets else None


def _same_lengths_on_device(name, offsets, lp_offsets) -> torch.Tensor:
    """A nested argument's sequence lengths against log_probs', on the device without a host read: a
    mismatch is recorded in the device's error word (the ValueError the host check gives, raised at the next
    call of ours or at ``kl_kernels.check_errors()``; kl_kernels.device_errors) instead of a device-side
    assertion. Returns the scale that poisons a floating tensor: a 0-d float32 1, or NaN on a mismatch (every
    token: a mismatch shifts every later sequence). The caller has made sure on the host that both hold as
    many tokens in all, so nothing reads outside a buffer."""
    lens_x = ragged.offsets_to_lengths(offsets.to(lp_offsets.device))
    lens_lp = ragged.offsets_to_lengths(lp_offsets)
    differ = lens_x.ne(lens_lp)
    device_errors.record_where(differ, lens_x, "lengths_mismatch", name, lens_lp)
    return torch.where(differ.any(), float("nan"), 1.0)


def pack_ragged_arg(x, name, lp_offsets, kind, empty_dtype=torch.float32, lp_lengths=None):
    """A list / nested argument in the same ragged structure as log_probs -> packed values.

    ``empty_dtype`` is the dtype given to an empty list, which carries none of its own.
    ``lp_lengths``: log_probs' sequence lengths as Python ints (lists: compared with ``x``'s own
    shapes on the host, whatever the device; then no offsets of ``x`` are made on the device).

    Nested arguments on an accelerator, with offsets of their own (not log_probs' tensor): the token totals
    are compared on the host (shapes: no sync), the sequence lengths on the device, a mismatch recorded in
    the error word and floating values NaN-poisoned (:func:`_same_lengths_on_device`); never a device-side
    assertion.
    """
    values, scale = _pack_ragged_arg(x, name, lp_offsets, kind, empty_dtype, lp_lengths)
    if scale is not None and values.dtype.is_floating_point:
        values = values * scale.to(values.dtype)
    return values


def _pack_ragged_arg(x, name, lp_offsets, kind, empty_dtype, lp_lengths):
    """:func:`pack_ragged_arg`'s packed values, not poisoned, and the poisoning scale of a comparison on the
    device (None: compared on the host)."""
    offsets = None  # x's own offsets, when the lengths are compared on the device
    if kind == "list":
        if not isinstance(x, (list, tuple)):
            raise TypeError(f"{name} must be a list of tensors like log_probs, got {type(x).__name__}")
        if lp_lengths is not None:
            values, batch = ragged.cat_list(x, name=name, empty_device=lp_offsets.device), len(x)
        else:
            values, offsets = ragged.from_list(x, name=name, empty_device=lp_offsets.device)
            batch = offsets.shape[0] - 1
        if not x:
            values = values.to(empty_dtype)
    else:
        if not (isinstance(x, torch.Tensor) and x.is_nested):
            raise TypeError(f"{name} must be a nested tensor like log_probs, got "
                            f"{'a regular tensor' if isinstance(x, torch.Tensor) else type(x).__name__}")
        if (x.layout == torch.jagged) != (kind == "nested_jagged"):
            raise ValueError(f"{name} must use the same nested layout as log_probs ({kind.split('_')[1]})")
        values, offsets = ragged.from_nested(x, name=name)
        batch = offsets.shape[0] - 1
    if batch != lp_offsets.shape[0] - 1:
        raise ValueError(f"{name} has {batch} sequences but log_probs has {lp_offsets.shape[0] - 1}")
    if values.numel():
        check_device(name, values.device, lp_offsets.device)
    if lp_lengths is not None:  # host facts: no device read
        lens_x, lens_lp = [t.shape[0] for t in x], list(lp_lengths)
        same = lens_x == lens_lp
    elif offsets is lp_offsets:  # log_probs' own offsets tensor (nested tensors built on one): nothing to compare
        same = True
    elif not value_checks.checks_on_host(lp_offsets) and value_checks.values_checkable(lp_offsets):
        total = _tokens_of(lp_offsets)
        if total is None:  # (unreachable: every caller hands normalize_layout's offsets)
            raise RuntimeError(f"kl_kernels: {name}: pack_ragged_arg needs log_probs' offsets from normalize_layout")
        if values.shape[0] != total:  # a host fact: the kernels would read past the shorter buffer
            raise ValueError(f"{name} must have the sequence lengths of log_probs: it holds {values.shape[0]} "
                             f"tokens in all but log_probs {total}")
        return values, _same_lengths_on_device(name, offsets, lp_offsets)
    else:
        same = torch.equal(offsets.to(lp_offsets.device), lp_offsets)
        if not same:
            lens_x = ragged.offsets_to_lengths(offsets).tolist()
            lens_lp = ragged.offsets_to_lengths(lp_offsets).tolist()
    if not same:
        b = next(i for i, (u, v) in enumerate(zip(lens_x, lens_lp)) if u != v)
        raise ValueError(device_errors.value_error_message("lengths_mismatch", name, lens_x[b], lens_lp[b],
                                                           index=b))
    return values, None


_FLOAT_DTYPES = frozenset(LOGPROB_DTYPES)
_FUSED_DTYPES = _FLOAT_DTYPES - {torch.float64}  # what the fused kernels read


def in_place_lists(log_probs, ref_log_probs, mask, grad_ok):
    """(lp, ref, mask, offsets) as :class:`~kl_kernels.ragged.SequenceList` objects when the lists
    can be read in place (contiguous CPU tensors of the fused dtypes, equal lengths, and no
    gradient needed unless ``grad_ok``), else ``None``: the packing path then validates and
    reports, exactly as for any list."""
    lp = ragged.SequenceList.of(log_probs, _FUSED_DTYPES, reject_grad=not grad_ok)
    if lp is None:
        return None
    ref = ragged.SequenceList.of(ref_log_probs, _FUSED_DTYPES, like=lp, reject_grad=not grad_ok)
    if ref is None:
        return None
    if mask is not None:
        mask = ragged.SequenceList.of(mask, {torch.bool}, like=lp)
        if mask is None:
            return None
    return lp, ref, mask, lp.offsets


def normalize_layout(log_probs, ref_log_probs, mask, offsets, lengths, padding_side, second="ref_log_probs",
                      in_place=None, empty_device=None):
    """Return (kind, lp, ref, mask, offsets, lengths) with lp/ref/mask in a native layout.

    ``second`` is the name of the second log-prob argument in error messages (the loss calls it
    ``old_log_probs``). ``in_place``: ``None``, or lists may stay unpacked, with (``True``) or
    without (``False``) gradients to them (see :func:`in_place_lists`). ``empty_device``: where an
    empty list's packed tensors go (:func:`kl_kernels._checks.device_of`)."""
    if in_place is not None and isinstance(log_probs, (list, tuple)) and offsets is None and lengths is None:
        found = in_place_lists(log_probs, ref_log_probs, mask, grad_ok=in_place)
        if found is not None:
            lp, ref, mask, offsets = found
            return "list", lp, ref, mask, offsets, None
    if isinstance(log_probs, (list, tuple)) or (isinstance(log_probs, torch.Tensor) and log_probs.is_nested):
        kind = "list" if isinstance(log_probs, (list, tuple)) else (
            "nested_jagged" if log_probs.layout == torch.jagged else "nested_strided")
        for arg, val in (("offsets", offsets), ("lengths", lengths)):
            if val is not None:
                raise ValueError(f"{arg} must be None when log_probs is a {kind.replace('_', ' ')}: "
                                 "the sequence lengths come from log_probs itself")
        if kind == "list":
            for i, t in enumerate(log_probs):
                check_logprob_tensor(t, f"log_probs[{i}]")
                if t.dim() != 1:
                    raise ValueError(f"log_probs[{i}] must be 1-D [L], got shape {list(t.shape)}")
            other = next((i for i, t in enumerate(log_probs) if t.dtype != log_probs[0].dtype), None)
            if other is not None:
                raise TypeError(f"log_probs tensors must share one dtype: log_probs[{other}] is "
                                f"{log_probs[other].dtype} but log_probs[0] is {log_probs[0].dtype}")
            packed = ragged.from_list(log_probs, name="log_probs", empty_device=empty_device)  # empty: float32
        else:
            check_logprob_tensor(log_probs, "log_probs")
            if log_probs.dim() != 2:
                raise ValueError(f"nested log_probs must be [B, j] (1-D per sequence), got {log_probs.dim()} dims")
            packed = ragged.from_nested(log_probs, name="log_probs")
        lp, offsets = packed
        if kind == "nested_jagged" and log_probs.lengths() is None:
            # a jagged tensor's own offsets are whatever it was built on (nested_tensor_from_jagged checks no value):
            # checked as offsets are (on an accelerator in the error word), else the kernels would read them as is
            offsets = index_checks.check_offsets(offsets, lp.shape[0], name="log_probs.offsets()")
        host_lengths = [t.shape[0] for t in log_probs] if kind == "list" else None
        if host_lengths is None:  # (nested: pack_ragged_arg compares other nested arguments' totals with it)
            _remember_tokens(offsets, lp.shape[0])
        ref = pack_ragged_arg(ref_log_probs, second, offsets, kind, lp.dtype, host_lengths)
        check_logprob_tensor(ref, second)
        if ref.dim() != 1:
            raise ValueError(f"{second} must be 1-D [L] per sequence like log_probs, got "
                             f"[L, {', '.join(map(str, ref.shape[1:]))}]")
        if mask is not None:
            mask, scale = _pack_ragged_arg(mask, "mask", offsets, kind, torch.bool, host_lengths)
            check_mask_tensor(mask, lp.shape)
            if scale is not None:  # (a bool mask holds no NaN: ref carries the poison)
                ref = ref * scale.to(ref.dtype)
        return kind, lp, ref, mask, offsets, None

    check_logprob_tensor(log_probs, "log_probs")
    check_logprob_tensor(ref_log_probs, second)
    if ref_log_probs.is_nested:
        raise TypeError(f"{second} must be a regular tensor like log_probs, got a nested tensor")
    if log_probs.dim() == 1:
        if offsets is None:
            raise ValueError("1-D log_probs is the packed layout and needs offsets [B + 1] (int64 cu_seqlens); "
                             "for one sequence pass offsets=torch.tensor([0, N])")
        if lengths is not None:
            raise ValueError("lengths is for the padded layout [B, T]; the packed layout takes offsets only")
        if isinstance(offsets, torch.Tensor) and offsets.shape == (1,) and log_probs.shape[0] > 0 and \
                not value_checks.checks_on_host(offsets):
            # no sequence for N > 0 tokens: wrong whatever the value (offsets[0] = 0 and offsets[-1] = N), known
            # from the shapes. Refused here, before the device check records it: the kernels must never run it
            raise ValueError(f"offsets must end at the number of tokens N = {log_probs.shape[0]}, but offsets of "
                             "shape [1] (no sequence) end at offsets[0], which must be 0")
        offsets = index_checks.check_offsets(offsets, log_probs.shape[0], device=log_probs.device)
        kind = "packed"
    elif log_probs.dim() == 2:
        if offsets is not None:
            raise ValueError("offsets is for the packed layout (1-D log_probs [N]); "
                             "padded [B, T] inputs take lengths [B] and padding_side")
        kind = "padded"
        if lengths is not None:
            lengths = int_vector(lengths, "lengths", log_probs.shape[0], log_probs.device)
            lengths = index_checks.check_lengths(lengths, log_probs.shape[0], log_probs.shape[1])
    else:
        raise ValueError("log_probs must be packed [N] (with offsets), padded [B, T], a nested tensor or a list of "
                         f"1-D tensors; got shape {list(log_probs.shape)}")
    if tuple(ref_log_probs.shape) != tuple(log_probs.shape):
        raise ValueError(f"{second} must have the shape of log_probs {list(log_probs.shape)}, "
                         f"got {list(ref_log_probs.shape)}")
    if mask is not None:
        check_mask_tensor(mask, log_probs.shape)
    return kind, log_probs, ref_log_probs, mask, offsets, lengths


def and_not_nan(mask, lp: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """``mask`` (``None``: every token) and "neither log-prob is NaN": ``mask_nan`` as a mask."""
    not_nan = ~(lp.isnan() | ref.isnan())
    return not_nan if mask is None else mask & not_nan
