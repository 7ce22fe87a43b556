"""Host launcher of the Triton kl_reward kernels (``kl_kernels/triton/kl_reward.py``).

Same signature as ``launch.py`` (the C++ launcher), so one ``torch.library`` registration
pattern serves both. Allocates outputs and scratch, picks the grid and launches; on a GPU the
forward tile kernel is autotuned over a small config set keyed on the token count rounded up to
a power of two, so ragged batches of similar size reuse one tuned configuration. Under Triton's
interpreter (``TRITON_INTERPRET=1``, CPU tensors) there is nothing to time: the tile is chosen
so that a batch spans about eight tiles (16 to 1024 elements), which keeps the interpreter's
per-program cost bounded and still makes small test batches cross tile boundaries.
"""

from __future__ import annotations

import functools
import math

import torch

from .launch import _strides, resolved

# (BLOCK, num_warps) pairs the forward/backward tile kernels are tuned over on a GPU.
GPU_CONFIGS = ((1024, 4), (2048, 8), (4096, 8), (4096, 16))
MIN_BLOCK = min(b for b, _ in GPU_CONFIGS)
INTERPRETER_TILES = 8
COMBINE_BLOCK = 128


def kernel_set(module_name: str, prefix: str):
    """(forward, combine, backward) Triton kernels ``<prefix>_fwd_kernel`` etc. of
    ``kl_kernels.triton.<module_name>``; forward and backward wrapped in the autotuner on a GPU."""
    import importlib

    import triton

    from ..triton import interpreting

    k = importlib.import_module(f"kl_kernels.triton.{module_name}")
    fwd, combine, bwd = (getattr(k, f"{prefix}_{part}_kernel") for part in ("fwd", "combine", "bwd"))
    if interpreting():
        return fwd, combine, bwd
    configs = [triton.Config({"BLOCK": b}, num_warps=w) for b, w in GPU_CONFIGS]
    return (triton.autotune(configs, key=["size_bucket"])(fwd), combine,
            triton.autotune(configs, key=["size_bucket"])(bwd))


@functools.lru_cache(maxsize=None)
def _kernels():
    return kernel_set("kl_reward", "kl_reward")


def _tuned(kernel) -> bool:
    return hasattr(kernel, "configs")


def _interpreter_block(total: int) -> int:
    return min(1024, max(16, 1 << (max(1, math.ceil(total / INTERPRETER_TILES)) - 1).bit_length()))


def _size_bucket(n: int) -> int:
    return 1 << max(10, (max(n, 1) - 1).bit_length())


def _flat(x: torch.Tensor | None, layout: int) -> bool:
    """Readable at the flat output index (contiguous in the layout's shape)?"""
    if x is None:
        return True
    if layout == 0:
        return x.stride(0) == 1 or x.shape[0] <= 1
    return x.is_contiguous()


def _common(log_probs, ref_log_probs, mask, offsets, lengths, prompt_lens, coef, coef_scalar, layout, left_pad,
            estimator, clamp):
    """Kernel arguments shared by forward and backward: tensors, scalars, strides, and ``flags``, the
    constexprs both kernels take."""
    dummy = log_probs
    packed = layout == 0
    batch = offsets.shape[0] - 1 if packed else log_probs.shape[0]
    width = 0 if packed else log_probs.shape[1]
    offsets = offsets.to(torch.int64).contiguous() if offsets is not None else None
    lengths = lengths.to(torch.int64).contiguous() if lengths is not None else None
    prompt_lens = prompt_lens.to(torch.int64).contiguous() if prompt_lens is not None else None
    if coef is None:
        coef_mode, coef_t = 0, None
    else:
        coef_t = coef.to(torch.float32).contiguous()
        coef_mode = 1 if coef_t.dim() == 0 else 2
    mask_u8 = mask.view(torch.uint8) if mask is not None else None
    lo, hi, olo, ohi = (float(v) for v in clamp)
    flags = dict(PACKED=packed, LEFT_PAD=bool(left_pad), HAS_LENGTHS=lengths is not None, COEF_MODE=coef_mode,
                 EST=int(estimator))
    return dict(
        dummy=dummy, batch=batch, width=width, offsets=offsets, lengths=lengths,
        prompt_lens=prompt_lens, coef=coef_t, coef_scalar=float(coef_scalar), mask=mask_u8,
        clamp=(lo, hi, olo, ohi), flags=flags, lp_s=_strides(log_probs, layout), ref_s=_strides(ref_log_probs, layout),
        mask_s=_strides(mask_u8, layout) if mask is not None else (0, 0))


def _or(x, dummy):
    return dummy if x is None else x


def forward(log_probs, ref_log_probs, mask, offsets, lengths, prompt_lens, reward, coef, coef_scalar, layout,
            left_pad, placement, estimator, straight_through, clamp, return_ref, reward_dtype):
    """Run the Triton forward; returns (kl, reward_out, ref_out or empty, kl_sum, count)."""
    log_probs, ref_log_probs, mask, offsets, lengths, prompt_lens, reward, coef = resolved(
        log_probs, ref_log_probs, mask, offsets, lengths, prompt_lens, reward, coef)
    fwd, combine, _ = _kernels()
    c = _common(log_probs, ref_log_probs, mask, offsets, lengths, prompt_lens, coef, coef_scalar, layout, left_pad,
                estimator, clamp)
    dev, shape, total, batch, dummy = log_probs.device, log_probs.shape, log_probs.numel(), c["batch"], c["dummy"]
    kl = torch.empty(shape, dtype=log_probs.dtype, device=dev)
    reward_out = torch.empty(shape, dtype=reward_dtype, device=dev)
    ref_out = torch.empty(shape if return_ref else (0,), dtype=ref_log_probs.dtype, device=dev)
    kl_sum = torch.empty(batch, dtype=torch.float32, device=dev)
    count = torch.empty(batch, dtype=torch.int64, device=dev)
    last = torch.empty(batch, dtype=torch.int64, device=dev)
    block = _interpreter_block(total) if not _tuned(fwd) else MIN_BLOCK
    slots = 2 * max(1, math.ceil(total / block))  # enough for the smallest tile the tuner may pick
    slot_sum = torch.empty(slots, dtype=torch.float64, device=dev)
    slot_count = torch.empty(slots, dtype=torch.int32, device=dev)
    slot_last = torch.empty(slots, dtype=torch.int64, device=dev)
    if reward is None:
        rw_s0 = rw_s1 = 0
    elif placement == 1:
        rw_s0, rw_s1 = _strides(reward, layout)
    else:
        rw_s0, rw_s1 = reward.stride(0), 0
    flat = all(_flat(x, layout) for x in (log_probs, ref_log_probs, mask, reward if placement == 1 else None))
    lo, hi, olo, ohi = c["clamp"]
    if total > 0:
        args = (log_probs, ref_log_probs, _or(c["mask"], dummy), _or(reward, dummy), _or(c["coef"], kl_sum),
                _or(c["offsets"], count), _or(c["lengths"], count), _or(c["prompt_lens"], count),
                kl, reward_out, ref_out if return_ref else kl, kl_sum, count, last, slot_sum, slot_count, slot_last,
                total, batch, c["width"], *c["lp_s"], *c["ref_s"], *c["mask_s"], rw_s0, rw_s1,
                c["coef_scalar"], lo, hi, olo, ohi, _size_bucket(total))
        flags = dict(c["flags"], HAS_PROMPT=c["prompt_lens"] is not None, HAS_MASK=mask is not None,
                     PLACEMENT=placement, RETURN_REF=bool(return_ref), FLAT=flat)
        block = launch_tiles(fwd, total, args, flags)
    if batch > 0:
        combine[(triton_cdiv(batch, COMBINE_BLOCK),)](
            log_probs, ref_log_probs, _or(reward, dummy), _or(c["coef"], kl_sum), _or(c["offsets"], count),
            _or(c["lengths"], count), reward_out, kl_sum, count, last, slot_sum, slot_count, slot_last,
            batch, c["width"], *c["lp_s"], *c["ref_s"], rw_s0, c["coef_scalar"], lo, hi, olo, ohi,
            **c["flags"], PLACE_LAST=placement == 3, TILE=block, BLOCK_B=COMBINE_BLOCK)
    return kl, reward_out, ref_out, kl_sum, count


def backward(log_probs, ref_log_probs, mask, offsets, lengths, prompt_lens, coef, coef_scalar, layout, left_pad,
             estimator, straight_through, clamp, reward_dtype, g_kl, g_reward, g_ref_out, g_kl_sum):
    """Run the Triton backward; returns (grad_log_probs, grad_ref_log_probs)."""
    log_probs, ref_log_probs, mask, offsets, lengths, prompt_lens, coef, g_kl, g_reward, g_ref_out, g_kl_sum = \
        resolved(log_probs, ref_log_probs, mask, offsets, lengths, prompt_lens, coef, g_kl, g_reward, g_ref_out,
                 g_kl_sum)
    _, _, bwd = _kernels()
    c = _common(log_probs, ref_log_probs, mask, offsets, lengths, prompt_lens, coef, coef_scalar, layout, left_pad,
                estimator, clamp)
    dev, total, dummy = log_probs.device, log_probs.numel(), c["dummy"]
    g_lp = torch.empty(log_probs.shape, dtype=log_probs.dtype, device=dev)
    g_ref = torch.empty(ref_log_probs.shape, dtype=ref_log_probs.dtype, device=dev)
    if total == 0:
        return g_lp, g_ref
    grads = [None if g is None else g.to(dtype).contiguous() for g, dtype in (
        (g_kl, log_probs.dtype), (g_reward, reward_dtype), (g_ref_out, ref_log_probs.dtype),
        (g_kl_sum, torch.float32))]
    flat = all(_flat(x, layout) for x in (log_probs, ref_log_probs, mask))
    lo, hi, olo, ohi = c["clamp"]
    args = (log_probs, ref_log_probs, _or(c["mask"], dummy), _or(c["coef"], g_lp), _or(c["offsets"], g_lp),
            _or(c["lengths"], g_lp), _or(c["prompt_lens"], g_lp), *(_or(g, dummy) for g in grads), g_lp, g_ref,
            total, c["batch"], c["width"], *c["lp_s"], *c["ref_s"], *c["mask_s"],
            c["coef_scalar"], lo, hi, olo, ohi, _size_bucket(total))
    flags = dict(c["flags"], HAS_PROMPT=c["prompt_lens"] is not None, HAS_MASK=mask is not None,
                 HAS_GKL=grads[0] is not None, HAS_GRW=grads[1] is not None, HAS_GRO=grads[2] is not None,
                 HAS_GSUM=grads[3] is not None, STRAIGHT_THROUGH=bool(straight_through), FLAT=flat)
    launch_tiles(bwd, total, args, flags)
    return g_lp, g_ref


def launch_tiles(kernel, total: int, args, flags) -> int:
    """Launch a tile kernel, one program per ``BLOCK`` elements of the flat token space: the
    autotuned ``BLOCK`` on a GPU, the interpreter's tile otherwise. Returns the ``BLOCK`` used."""
    if _tuned(kernel):
        kernel[lambda meta: (triton_cdiv(total, meta["BLOCK"]),)](*args, **flags)
        return kernel.best_config.kwargs["BLOCK"]
    block = _interpreter_block(total)
    kernel[(triton_cdiv(total, block),)](*args, **flags, BLOCK=block)
    return block


def triton_cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b
