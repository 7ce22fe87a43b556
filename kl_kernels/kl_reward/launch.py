"""Host launcher of the fused kl_reward kernels: allocate outputs, fill the argument struct, launch.

The compiled kernels (``csrc/cpu/kl_reward_cpu.cpp``, ``csrc/cuda/kl_reward_cuda.cu``) take a plain
``KLRewardArgs`` of raw addresses, element strides and dtype codes; this module is the only
place that turns torch tensors into those. Inputs may have any strides; outputs are allocated
contiguous in the layout's shape. Everything here has already been validated by ``problem.py``.
"""

from __future__ import annotations

import math

import torch

from .. import _extensions, codes, ragged

# The kernels' codes, from the one table (kl_kernels/codes.py, which csrc/common/codes.h is generated from).
DTYPE_CODES = {getattr(torch, name): code for name, code in codes.DTYPE_CODES.items()}
ESTIMATOR_CODES = codes.ESTIMATOR_CODES
PLACEMENT_CODES = codes.PLACEMENT_CODES
LAYOUT_CODES = {**codes.LAYOUT_CODES, "list": codes.LAYOUT_CODES["packed"]}  # list: packed geometry, read in place


def clamp_bounds(clamp) -> tuple[float, float]:
    """(lo, hi) with missing bounds as -inf/+inf, the form the op schema carries."""
    if clamp is None:
        return -math.inf, math.inf
    lo, hi = clamp
    return (-math.inf if lo is None else lo), (math.inf if hi is None else hi)


def _strides(x: torch.Tensor, layout: int) -> tuple[int, int]:
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


def _ptr(x: torch.Tensor | None) -> int:
    return 0 if x is None or x.numel() == 0 else x.data_ptr()


def coefficient(coef: torch.Tensor | None, scalar: float, keep: list) -> tuple[int, float, int]:
    """(mode, scalar, address) of a coefficient for the kernels' CoefMode: a float (mode 0), or a 0-d
    (1) / per-sequence (2) tensor read on device as float32 (kept alive in ``keep``)."""
    if coef is None:
        return 0, float(scalar), 0
    coef = as_contiguous(coef, torch.float32)  # a device op: no host sync
    keep.append(coef)
    return (1 if coef.dim() == 0 else 2), 0.0, _ptr(coef)


# The extension of the cuda-emulated backend: the CUDA kernels compiled against the host emulation
# of csrc/emu, run on CPU tensors (setup.py); launched as the CUDA ones, with stream 0.
EMULATED = "_cuda_emu"


def kernel_module(device: torch.device, op: str = "kl_reward", what: str = "kl_reward", ext: str | None = None):
    """The extension holding op ``op``'s kernels for ``device`` (or extension ``ext``, by name), or a
    RuntimeError naming ``what`` and why there is none (e.g. a wheel built without nvcc has no
    ``_cuda``; dispatch never routes there)."""
    name = ext or ("_C" if device.type == "cpu" else "_cuda")
    _, reason = _extensions.kernel(name, f"{op}_forward")
    if reason:
        raise RuntimeError(f"{what}: no fused kernel for {device.type} tensors: {reason}")
    return _extensions.load(name)[0]


def _set_input(a, field: str, strides: str, x, layout: int, keep: list) -> None:
    """Point input ``field`` of ``a`` at ``x``: a tensor (address and element strides) or, for
    list inputs, a :class:`~kl_kernels.ragged.SequenceList` (one address per sequence in
    ``<field>_ptrs``, contiguous values: strides (0, 1))."""
    if isinstance(x, ragged.SequenceList):
        addresses = x.addresses
        keep.append(addresses)
        setattr(a, f"{field}_ptrs", addresses.data_ptr())
        setattr(a, f"{strides}_s0", 0)
        setattr(a, f"{strides}_s1", 1)
        return
    setattr(a, field, _ptr(x))
    s0, s1 = _strides(x, layout)
    setattr(a, f"{strides}_s0", s0)
    setattr(a, f"{strides}_s1", s1)


def make_args(module, *, log_probs, ref_log_probs, mask, offsets, lengths, prompt_lens, reward, coef,
              coef_scalar, layout, left_pad, placement, estimator, straight_through, clamp, mask_nan=False):
    """A filled ``KLRewardArgs`` (``clamp``: [in_lo, in_hi, out_lo, out_hi], missing bounds infinite); returns it with the tensors it points into (keep them alive)."""
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
            setattr(a, name, _ptr(t))
    a.left_pad = int(left_pad)
    a.dtype = DTYPE_CODES[log_probs.dtype]
    _set_input(a, "lp", "lp", log_probs, layout, keep)
    _set_input(a, "ref", "ref", ref_log_probs, layout, keep)
    if mask is not None:
        _set_input(a, "mask", "mask", mask, layout, keep)
    a.mask_nan = int(mask_nan)
    a.placement = placement
    if reward is not None:
        a.reward_dtype = DTYPE_CODES[reward.dtype]
        if placement == 1:
            _set_input(a, "reward", "rw", reward, layout, keep)
        else:
            a.reward, a.rw_s0, a.rw_s1 = _ptr(reward), reward.stride(0), 0
    else:
        a.reward_dtype = a.dtype
    a.coef_mode, a.coef_scalar, a.coef = coefficient(coef, coef_scalar, keep)
    est = module.EstimatorParams()
    est.estimator, est.straight_through = estimator, int(straight_through)
    lo, hi, olo, ohi = clamp
    est.in_lo_set, est.in_hi_set = int(math.isfinite(lo)), int(math.isfinite(hi))
    est.out_lo_set, est.out_hi_set = int(math.isfinite(olo)), int(math.isfinite(ohi))
    est.in_lo, est.in_hi, est.out_lo, est.out_hi = (v if math.isfinite(v) else 0.0 for v in (lo, hi, olo, ohi))
    a.est = est
    return a, keep


def launch_kernel(module, op: str, kind: str, args, device, what: str) -> None:
    """Run kernel ``<op>_<kind>`` (``kind``: forward or backward) of ``module``: on the CPU with
    torch's thread count; on CUDA enqueued on torch's current stream of ``device``, the forward with
    ``<op>_workspace_bytes`` of scratch from torch's caching allocator (no host sync). Error codes
    become RuntimeErrors naming ``what``."""
    name = f"{op}_{kind}"
    if getattr(module, "EMULATED", False):
        # The CUDA entry points on CPU memory: a CPU workspace, and stream 0, since CPU tensors have
        # no stream (the emulation runs each launch to completion before returning).
        if kind == "forward":
            workspace = torch.empty(getattr(module, f"{op}_workspace_bytes")(args), dtype=torch.uint8)
            code = getattr(module, name)(args, _ptr(workspace), 0)
        else:
            code = getattr(module, name)(args, 0)
    elif device.type == "cpu":
        code = getattr(module, name)(args, torch.get_num_threads())
    else:
        stream = torch.cuda.current_stream(device).cuda_stream
        with torch.cuda.device(device):  # the kernels launch on the current device
            if kind == "forward":
                nbytes = getattr(module, f"{op}_workspace_bytes")(args)
                workspace = torch.empty(nbytes, dtype=torch.uint8, device=device)
                # Allocated on this stream, so freeing it right after the enqueue is safe: the
                # caching allocator hands the block only to work queued after this kernel.
                code = getattr(module, name)(args, _ptr(workspace), stream)
            else:
                code = getattr(module, name)(args, stream)
    raise_for(code, module, what)


def raise_for(code: int, module, what: str) -> None:
    """A kernel's error code (0: success) as a RuntimeError naming ``what``."""
    if code == 1:
        raise RuntimeError(f"{what} kernel: unsupported dtype combination")
    if code == 2:
        raise RuntimeError(f"{what} kernel: too many tokens for one launch")
    if code == 3:
        raise RuntimeError(f"{what} kernel: list inputs, mask_nan and batch totals are for the CPU forward only")
    if code >= 1000:
        raise RuntimeError(f"{what} CUDA kernel launch failed: {module.error_string(code - 1000)}")
    if code != 0:
        raise RuntimeError(f"{what} kernel failed with code {code}")


def forward(log_probs, ref_log_probs, mask, offsets, lengths, prompt_lens, reward, coef, coef_scalar, layout,
            left_pad, placement, estimator, straight_through, clamp, return_ref, reward_dtype, mask_nan=False,
            out=None, ext=None):
    """Run the fused forward; returns (kl, reward_out, ref_out or empty, kl_sum, count). List inputs
    (:class:`~kl_kernels.ragged.SequenceList`) and ``mask_nan`` are for the CPU kernel, outside autograd.
    ``out``: checked result buffers (problem.py's ``_check_out``), written in place where given.
    ``ext``: the extension to run (default: ``_C`` or ``_cuda`` by device)."""
    outputs, args, module, keep = _prepare_forward(
        log_probs, ref_log_probs, mask, offsets, lengths, prompt_lens, reward, coef, coef_scalar, layout, left_pad,
        placement, estimator, straight_through, clamp, return_ref, reward_dtype, mask_nan, out, ext)
    launch_kernel(module, "kl_reward", "forward", args, outputs[0].device, "kl_reward")
    del keep
    return outputs


def forward_during(during, log_probs, ref_log_probs, mask, offsets, lengths, prompt_lens, reward, coef, coef_scalar,
                   layout, left_pad, placement, estimator, straight_through, clamp, return_ref, reward_dtype,
                   mask_nan=False):
    """:func:`forward` on the CPU, calling ``during(outputs)`` with the outputs *not yet written*
    while the kernel's tiles run on torch's other threads; then this thread joins the tiles. For
    callers with Python work that does not read the outputs (splitting them into per-sample views,
    storing those): it overlaps the kernel instead of following it. Returns the outputs; an
    exception from ``during`` propagates once the kernel is done. An extension without
    ``kl_reward_forward_during`` runs the kernel, then ``during``."""
    outputs, args, module, keep = _prepare_forward(
        log_probs, ref_log_probs, mask, offsets, lengths, prompt_lens, reward, coef, coef_scalar, layout, left_pad,
        placement, estimator, straight_through, clamp, return_ref, reward_dtype, mask_nan)
    run = getattr(module, "kl_reward_forward_during", None)
    if run is None:
        launch_kernel(module, "kl_reward", "forward", args, outputs[0].device, "kl_reward")
        during(outputs)
    else:
        raise_for(run(args, torch.get_num_threads(), lambda: during(outputs)), module, "kl_reward")
    del keep
    return outputs


def _prepare_forward(log_probs, ref_log_probs, mask, offsets, lengths, prompt_lens, reward, coef, coef_scalar,
                     layout, left_pad, placement, estimator, straight_through, clamp, return_ref, reward_dtype,
                     mask_nan, out=None, ext=None):
    """The forward's outputs (allocated) and filled argument struct, its module, and what it points into."""
    log_probs, ref_log_probs, mask, offsets, lengths, prompt_lens, reward, coef = resolved(
        log_probs, ref_log_probs, mask, offsets, lengths, prompt_lens, reward, coef)
    module = kernel_module(log_probs.device, ext=ext)
    args, keep = make_args(module, log_probs=log_probs, ref_log_probs=ref_log_probs, mask=mask, offsets=offsets,
                           lengths=lengths, prompt_lens=prompt_lens, reward=reward, coef=coef,
                           coef_scalar=coef_scalar, layout=layout, left_pad=left_pad, placement=placement,
                           estimator=estimator, straight_through=straight_through, clamp=clamp, mask_nan=mask_nan)
    # The inputs themselves too: resolved() may have made copies that nothing else holds.
    keep += [log_probs, ref_log_probs, mask, reward]
    kl, reward_out, ref_out, kl_sum, count = allocate_outputs(args, log_probs.shape, log_probs.dtype, reward_dtype,
                                                              log_probs.device, return_ref, out)
    if ref_out is None:  # the launchers always return five tensors
        ref_out = torch.empty((0,), dtype=ref_log_probs.dtype, device=log_probs.device)
    return (kl, reward_out, ref_out, kl_sum, count), args, module, keep


def allocate_outputs(args, shape, dtype, reward_dtype, device, return_ref: bool, out=None) -> tuple:
    """The forward's outputs (kl, reward_out, ref_out or None without ``return_ref``, kl_sum, count)
    for a filled ``args`` (``args.batch`` sequences of log-probs ``shape``/``dtype``), allocated (or
    taken from ``out``, the caller's checked buffers, where given) and pointed at by ``args`` (with
    the reward output's dtype code)."""
    given = out if out is not None else (None,) * 5
    kl = given[0] if given[0] is not None else torch.empty(shape, dtype=dtype, device=device)
    reward_out = given[1] if given[1] is not None else torch.empty(shape, dtype=reward_dtype, device=device)
    ref_out = (given[2] if given[2] is not None else torch.empty(shape, dtype=dtype, device=device)) \
        if return_ref else None
    kl_sum = given[3] if given[3] is not None else torch.empty(args.batch, dtype=torch.float32, device=device)
    count = given[4] if given[4] is not None else torch.empty(args.batch, dtype=torch.int64, device=device)
    args.reward_dtype = DTYPE_CODES[reward_dtype]
    args.kl, args.reward_out, args.ref_out = _ptr(kl), _ptr(reward_out), _ptr(ref_out)
    args.kl_sum, args.count = _ptr(kl_sum), _ptr(count)
    return kl, reward_out, ref_out, kl_sum, count


def backward(log_probs, ref_log_probs, mask, offsets, lengths, prompt_lens, coef, coef_scalar, layout, left_pad,
             estimator, straight_through, clamp, reward_dtype, g_kl, g_reward, g_ref_out, g_kl_sum, ext=None):
    """Run the fused backward; returns (grad_log_probs, grad_ref_log_probs). ``ext``: as :func:`forward`'s."""
    log_probs, ref_log_probs, mask, offsets, lengths, prompt_lens, coef, g_kl, g_reward, g_ref_out, g_kl_sum = \
        resolved(log_probs, ref_log_probs, mask, offsets, lengths, prompt_lens, coef, g_kl, g_reward, g_ref_out,
                 g_kl_sum)
    module = kernel_module(log_probs.device, ext=ext)
    args, keep = make_args(module, log_probs=log_probs, ref_log_probs=ref_log_probs, mask=mask, offsets=offsets,
                           lengths=lengths, prompt_lens=prompt_lens, reward=None, coef=coef,
                           coef_scalar=coef_scalar, layout=layout, left_pad=left_pad, placement=0,
                           estimator=estimator, straight_through=straight_through, clamp=clamp)
    args.reward_dtype = DTYPE_CODES[reward_dtype]
    grads = {}
    for name, g, dtype in (("g_kl", g_kl, log_probs.dtype), ("g_reward", g_reward, reward_dtype),
                           ("g_ref_out", g_ref_out, ref_log_probs.dtype), ("g_kl_sum", g_kl_sum, torch.float32)):
        if g is not None:
            g = as_contiguous(g, dtype)
            grads[name] = g
            setattr(args, name, _ptr(g))
    g_lp = torch.empty(log_probs.shape, dtype=log_probs.dtype, device=log_probs.device)
    g_ref = torch.empty(ref_log_probs.shape, dtype=ref_log_probs.dtype, device=log_probs.device)
    args.g_lp, args.g_ref = _ptr(g_lp), _ptr(g_ref)
    launch_kernel(module, "kl_reward", "backward", args, log_probs.device, "kl_reward")
    del keep, grads
    return g_lp, g_ref


class ExtensionLauncher:
    """This module's ``forward`` and ``backward`` bound to one extension (``ext``), with the launchers'
    common signature: what the cuda-emulated backend registers its ops around (ops.py)."""

    def __init__(self, ext: str):
        self.ext = ext

    def forward(self, *args, **kwargs):
        return forward(*args, ext=self.ext, **kwargs)

    def backward(self, *args):
        return backward(*args, ext=self.ext)


emulated = ExtensionLauncher(EMULATED)
