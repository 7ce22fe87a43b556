"""Host-launch machinery shared by every op's launcher (``kl_kernels/<op>/launch.py``): the kernels'
code tables (from ``kl_kernels/codes.py``), turning tensors into addresses and element strides,
choosing the extension for a device (``_C``, ``_cuda``, or the emulated ``_cuda_emu``), running a
kernel on the right stream with its workspace, and its error codes as exceptions (``_extensions.raise_for``).
No op owns this module; ops never import each other's launchers.
"""

from __future__ import annotations

import math

import torch

from . import _extensions, codes, device_errors, value_checks

# The kernels' codes, from the one table (kl_kernels/codes.py, which csrc/common/codes.h is generated from).
DTYPE_CODES = {getattr(torch, name): code for name, code in codes.DTYPE_CODES.items()}
ESTIMATOR_CODES = codes.ESTIMATOR_CODES
PLACEMENT_CODES = codes.PLACEMENT_CODES
LAYOUT_CODES = {**codes.LAYOUT_CODES, "list": codes.LAYOUT_CODES["packed"]}  # list: packed geometry, read in place


# A kernel's [in_lo, in_hi, out_lo, out_hi] with no bound at all (the form clamp_bounds gives).
NO_CLAMP = (-math.inf, math.inf, -math.inf, math.inf)


def clamp_bounds(clamp) -> tuple[float, float]:
    """(lo, hi) with missing bounds as -inf/+inf, the form the op schema carries."""
    if clamp is None:
        return -math.inf, math.inf
    lo, hi = clamp
    return (-math.inf if lo is None else lo), (math.inf if hi is None else hi)


def strides(x: torch.Tensor, layout: int) -> tuple[int, int]:
    """Element strides (s0, s1) so that x is read at row * s0 + col * s1 (packed: row = 0)."""
    if layout == 0:
        return 0, x.stride(0)
    return x.stride(0), x.stride(1)


def as_contiguous(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` as a contiguous ``dtype`` tensor: ``x`` itself when it already is (two attribute reads
    instead of two dispatched torch calls: this runs several times per call)."""
    return x if x.dtype == dtype and x.is_contiguous() else x.to(dtype).contiguous()


def resolved(*tensors):
    """``tensors`` with torch's lazy negation applied. A real tensor can carry a pending negation
    (the negative bit, e.g. ``z.conj().imag`` of a complex ``z``) that its memory does not show:
    a kernel reading its address would see the values unnegated. Every launcher passes its tensor
    arguments through here first; a tensor without the bit (all but never) comes back as is, for
    one flag read. ``None`` and in-place lists (checked when they were read) pass through."""
    return [t.resolve_neg() if isinstance(t, torch.Tensor) and t.is_neg() else t for t in tensors]


def read_as_is(tensors, index_tensors) -> bool:
    """Whether a launcher reads ``tensors`` (None: absent) as they are, for every call of their signature
    (``kl_kernels/plans.py``: dtypes, strides, shapes and flags stay): plain (no subclass: fake tensors are
    tracing; not nested), no negative bit (:func:`resolved` would copy), not empty, and ``index_tensors``
    (offsets, lengths, prompt lengths) int64 and contiguous (else converted). The condition of the
    launchers' plans."""
    return not (any(t is not None and (type(t) is not torch.Tensor or t.is_neg() or t.is_nested or t.numel() == 0)
                    for t in tensors)
                or any(t is not None and not (t.dtype == torch.int64 and t.is_contiguous()) for t in index_tensors))


def ptr(x: torch.Tensor | None) -> int:
    return 0 if x is None or x.numel() == 0 else x.data_ptr()


def coefficient(coef: torch.Tensor | None, scalar: float, keep: list) -> tuple[int, float, int]:
    """(mode, scalar, address) of a coefficient for the kernels' CoefMode: a float (mode 0), or a 0-d
    (1) / per-sequence (2) tensor read on device as float32 (kept alive in ``keep``)."""
    if coef is None:
        return 0, float(scalar), 0
    coef = as_contiguous(coef, torch.float32)  # a device op: no host sync
    keep.append(coef)
    return (1 if coef.dim() == 0 else 2), 0.0, ptr(coef)


def set_input(a, field: str, stride_field: str, x, layout: int, keep: list) -> None:
    """Point input ``field`` of the argument struct ``a`` at ``x``: a tensor (address and element
    strides ``<stride_field>_s0/_s1``) or, for list inputs, a :class:`~kl_kernels.ragged.SequenceList`
    (one address per sequence in ``<field>_ptrs``, contiguous values: strides (0, 1))."""
    from .ragged import SequenceList

    if isinstance(x, SequenceList):
        keep.append(x.addresses)
        setattr(a, f"{field}_ptrs", x.addresses.data_ptr())
        setattr(a, f"{stride_field}_s0", 0)
        setattr(a, f"{stride_field}_s1", 1)
        return
    setattr(a, field, ptr(x))
    s0, s1 = strides(x, layout)
    setattr(a, f"{stride_field}_s0", s0)
    setattr(a, f"{stride_field}_s1", s1)


def geometry_args(module, *, log_probs, mask, offsets, lengths, prompt_lens, layout, left_pad, estimator,
                  straight_through, clamp, mask_nan=False):
    """The argument struct every fused kernel starts from, with what the ops share filled in: the
    geometry (layout, sizes, offsets / lengths, padding side, prompt lengths), the log-probs (address,
    strides, dtype), the mask and the estimator with its clamps (``clamp``: [in_lo, in_hi, out_lo,
    out_hi], missing bounds infinite). Returns it with the tensors it points into (keep them alive).

    The C++ type carrying these is ``KLRewardArgs`` (``csrc/common/kl_reward_args.h``), which
    ``KLPenaltyArgs`` embeds as its geometry ``g``; each op's launcher adds its own fields."""
    a = module.KLRewardArgs()
    a.layout = layout
    a.batch = offsets.shape[0] - 1 if layout == 0 else log_probs.shape[0]
    a.width = 0 if layout == 0 else log_probs.shape[1]
    a.total = log_probs.numel()
    keep = []
    for name, t in (("offsets", offsets), ("lengths", lengths), ("prompt_lens", prompt_lens)):
        if t is not None:
            t = as_contiguous(t, torch.int64)
            keep.append(t)
            setattr(a, name, ptr(t))
    a.left_pad = int(left_pad)
    a.dtype = DTYPE_CODES[log_probs.dtype]
    set_input(a, "lp", "lp", log_probs, layout, keep)
    if mask is not None:
        set_input(a, "mask", "mask", mask, layout, keep)
    a.mask_nan = int(mask_nan)
    est = module.EstimatorParams()
    est.estimator, est.straight_through = estimator, int(straight_through)
    lo, hi, olo, ohi = clamp
    est.in_lo_set, est.in_hi_set = int(math.isfinite(lo)), int(math.isfinite(hi))
    est.out_lo_set, est.out_hi_set = int(math.isfinite(olo)), int(math.isfinite(ohi))
    est.in_lo, est.in_hi, est.out_lo, est.out_hi = (v if math.isfinite(v) else 0.0 for v in (lo, hi, olo, ohi))
    a.est = est
    return a, keep


# The extension of the cuda-emulated backend: the CUDA kernels compiled against the host emulation
# of csrc/emu, run on CPU tensors (setup.py); launched as the CUDA ones, with stream 0.
EMULATED = "_cuda_emu"


def kernel_module(device: torch.device, kernel: str, what: str, ext: str | None = None):
    """The extension for ``device`` (or extension ``ext``, by name) that holds ``kernel`` (the
    function's name, written out by each launcher: ``"kl_reward_forward"``...), or a RuntimeError
    naming ``what`` and why there is none (e.g. a wheel built without nvcc has no ``_cuda``;
    dispatch never routes there)."""
    name = ext or ("_C" if device.type == "cpu" else "_cuda")
    _, reason = _extensions.kernel(name, kernel)
    if reason:
        raise RuntimeError(f"{what}: no fused kernel for {device.type} tensors: {reason}")
    return _extensions.load(name)[0]


def launch_kernel(module, kernel, args, device, what: str, *, workspace_bytes=None) -> None:
    """Run ``kernel``, a function of extension ``module`` named at the call site (e.g.
    ``module.kl_reward_forward``, so a reader goes from the launcher straight to the binding): on the
    CPU with torch's thread count; on CUDA enqueued on torch's current stream of ``device``, with
    ``workspace_bytes(args)`` bytes of scratch from torch's caching allocator when the kernel takes a
    workspace (the CUDA forwards, real or emulated; no host sync). The CPU kernels take none: there
    ``workspace_bytes`` is not called (``_C`` has no such function). Error codes become RuntimeErrors
    naming ``what``. First, a bad value an earlier kernel recorded in the device's error word
    (:mod:`kl_kernels.device_errors`) is raised as its ValueError (a plain read of host memory)."""
    device_errors.raise_pending(device)
    emulated = getattr(module, "EMULATED", False)
    if value_checks.DEFERRED.pending:  # the validation's deferred value checks: into this kernel, or launched first
        fold_value_checks(kernel, args)
    elif (emulated or device.type == "cuda") and kernel.__name__ in FOLDING_KERNELS:
        check_own_geometry(args, device)
    if emulated:
        # The CUDA entry points on CPU memory: a CPU workspace, and stream 0, since CPU tensors have
        # no stream (the emulation runs each launch to completion before returning).
        if workspace_bytes is not None:
            workspace = torch.empty(workspace_bytes(args), dtype=torch.uint8)
            code = kernel(args, ptr(workspace), 0)
        else:
            code = kernel(args, 0)
    elif device.type == "cpu":
        code = kernel(args, torch.get_num_threads())
    else:
        stream = torch.cuda.current_stream(device).cuda_stream
        with torch.cuda.device(device):  # the kernels launch on the current device
            if workspace_bytes is not None:
                workspace = torch.empty(workspace_bytes(args), dtype=torch.uint8, device=device)
                # Allocated on this stream, so freeing it right after the enqueue is safe: the
                # caching allocator hands the block only to work queued after this kernel.
                code = kernel(args, ptr(workspace), stream)
            else:
                code = kernel(args, stream)
    if code:  # (0: success; the common case costs no further call)
        _extensions.raise_for(code, module, what)


# The kernels whose combine checks offsets / lengths / prompt_lens itself (csrc/cuda/tiles.cuh's check_key and
# record_first_check; the struct's check_* fields), instead of ragged_checks.cu's launches of their own.
FOLDING_KERNELS = frozenset({"kl_reward_forward", "kl_penalty_forward"})


def fold_value_checks(kernel, args) -> None:
    """Hand the validation's deferred value checks (:func:`kl_kernels.value_checks.take_deferred`) to ``kernel``
    where it covers them: a CUDA forward of :data:`FOLDING_KERNELS` (real or emulated) over a non-empty
    batch and token space, checking the very tensors its ``args`` point at with the same bounds; its
    combine then records the first bad value in the error word of the values' device under the check's
    argument, as the check kernel would (tests/test_device_errors.py). Any other check is launched now,
    before ``kernel``, in the validation's order. (The CPU kernels are never handed any: CPU values are
    checked on the host.)"""
    pending = value_checks.take_deferred()
    g = None
    if getattr(kernel, "__name__", None) in FOLDING_KERNELS:
        g = getattr(args, "g", args)  # (KLPenaltyArgs holds the geometry as g)
        if g.batch > 0 and g.total > 0:
            g.check_offsets = g.check_lengths = g.check_prompt = 0
        else:
            g = None  # (no tile kernel to reset the check state, or no combine)
    for entry in pending:
        field = _folded_field(g, entry) if g is not None else None
        code = codes.ARG_CODES.get(entry[5], 0)
        if field is None or not code or getattr(g, field):
            value_checks.launch_deferred(entry)
            continue
        setattr(g, field, code)
        g.errors = device_errors.word(entry[1].device).address


def check_own_geometry(args, device) -> None:
    """A CUDA forward of :data:`FOLDING_KERNELS` (real or emulated) launched with no validation's checks to
    take (:func:`fold_value_checks`): inside a ``torch.compile``d graph, which calls the op without its
    validation, or after checks made on the host. Its combine then checks the offsets, lengths and
    prompt_lens it reads itself, under their own names, and records a bad one in the error word of
    ``device``: so a compiled call's bad value still surfaces (``check_errors()``, the next call), where it
    would only have given NaN. Values checked on the host already pass again, for a few reads per sequence."""
    g = getattr(args, "g", args)  # (KLPenaltyArgs holds the geometry as g)
    if g.batch <= 0 or g.total <= 0:  # (no tile kernel to reset the check state, or no combine)
        return
    packed = g.layout == 0
    g.check_offsets = _OFFSETS if packed and g.offsets else 0
    g.check_lengths = _LENGTHS if not packed and g.lengths else 0
    g.check_prompt = _PROMPT_LENS if g.prompt_lens else 0
    if g.check_offsets or g.check_lengths or g.check_prompt:
        g.errors = device_errors.word(device).address


_OFFSETS, _LENGTHS, _PROMPT_LENS = (codes.ARG_CODES[name] for name in ("offsets", "lengths", "prompt_lens"))


def _folded_field(g, entry) -> str | None:
    """The field of ``g`` (a filled KLRewardArgs) that asks its combine for the deferred check ``entry``, or
    None when that is not the check of the tensors and bounds ``g`` holds."""
    kernel, values, batch, bound, per_sequence, _, bound_kind = entry
    if batch != g.batch:
        return None
    at = ptr(values)
    if kernel == "offsets_valid":
        return "check_offsets" if g.layout == 0 and at == g.offsets and bound == g.total else None
    offsets, seq_lengths = per_sequence
    if bound_kind < 0:  # lengths, against the padded width
        ok = g.layout == 1 and at == g.lengths and bound == g.width and offsets is None and seq_lengths is None
        return "check_lengths" if ok else None
    if at != g.prompt_lens:
        return None
    if g.layout == 0:  # prompt_lens against the packed sequences' lengths
        ok = bound_kind == 0 and offsets is not None and ptr(offsets) == g.offsets and seq_lengths is None
    elif g.lengths:  # against the padded rows' lengths
        ok = bound_kind == 1 and offsets is None and seq_lengths is not None and ptr(seq_lengths) == g.lengths
    else:  # against the width
        ok = bound_kind == 2 and offsets is None and seq_lengths is None and bound == g.width
    return "check_prompt" if ok else None


class ExtensionLauncher:
    """An op's launcher ``forward`` and ``backward`` bound to one extension (``ext``), with the
    launchers' common signature: what the cuda-emulated backend registers its ops around (ops.py)."""

    def __init__(self, ext: str, forward, backward):
        self.ext, self._forward, self._backward = ext, forward, backward

    def forward(self, *args, **kwargs):
        return self._forward(*args, ext=self.ext, **kwargs)

    def backward(self, *args, **kwargs):
        return self._backward(*args, ext=self.ext, **kwargs)
