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

from ..launching import resolved, strides
from ..launching_triton import (COMBINE_CHUNK, MIN_BLOCK, REWARD_COMBINE_BLOCK, interpreter_block, readable_flat,
                                kernel_set, launch_tiles, or_dummy, size_bucket, triton_cdiv, tuned)

@functools.lru_cache(maxsize=None)
def _kernels():
    from ..triton import kl_reward as k  # imported on first use: triton is optional

    return kernel_set(k.kl_reward_fwd_kernel, k.kl_reward_combine_kernel, k.kl_reward_bwd_kernel)


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
        clamp=(lo, hi, olo, ohi), flags=flags, lp_s=strides(log_probs, layout), ref_s=strides(ref_log_probs, layout),
        mask_s=strides(mask_u8, layout) if mask is not None else (0, 0))


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
    block = interpreter_block(total) if not tuned(fwd) else MIN_BLOCK
    slots = 2 * max(1, math.ceil(total / block))  # enough for the smallest tile the tuner may pick
    slot_sum = torch.empty(slots, dtype=torch.float64, device=dev)
    slot_count = torch.empty(slots, dtype=torch.int32, device=dev)
    slot_last = torch.empty(slots, dtype=torch.int64, device=dev)
    if reward is None:
        rw_s0 = rw_s1 = 0
    elif placement == 1:
        rw_s0, rw_s1 = strides(reward, layout)
    else:
        rw_s0, rw_s1 = reward.stride(0), 0
    flat = all(readable_flat(x, layout) for x in (log_probs, ref_log_probs, mask, reward if placement == 1 else None))
    lo, hi, olo, ohi = c["clamp"]
    if total > 0:
        args = (log_probs, ref_log_probs, or_dummy(c["mask"], dummy), or_dummy(reward, dummy), or_dummy(c["coef"], kl_sum),
                or_dummy(c["offsets"], count), or_dummy(c["lengths"], count), or_dummy(c["prompt_lens"], count),
                kl, reward_out, ref_out if return_ref else kl, kl_sum, count, last, slot_sum, slot_count, slot_last,
                total, batch, c["width"], *c["lp_s"], *c["ref_s"], *c["mask_s"], rw_s0, rw_s1,
                c["coef_scalar"], lo, hi, olo, ohi, size_bucket(total))
        flags = dict(c["flags"], HAS_PROMPT=c["prompt_lens"] is not None, HAS_MASK=mask is not None,
                     # "last_valid" (4) is "last" (3) to the tiles: both place the reward in combine
                     PLACEMENT=min(placement, 3), RETURN_REF=bool(return_ref), FLAT=flat)
        block = launch_tiles(fwd, total, args, flags)
    if batch > 0:
        combine[(triton_cdiv(batch, REWARD_COMBINE_BLOCK),)](
            log_probs, ref_log_probs, or_dummy(reward, dummy), or_dummy(c["coef"], kl_sum), or_dummy(c["offsets"], count),
            or_dummy(c["lengths"], count), reward_out, kl_sum, count, last, slot_sum, slot_count, slot_last,
            batch, total, c["width"], *c["lp_s"], *c["ref_s"], rw_s0, c["coef_scalar"], lo, hi, olo, ohi,
            **c["flags"], PLACE_LAST=placement in (3, 4), LAST_VALID=placement == 4, TILE=block,
            BLOCK_B=REWARD_COMBINE_BLOCK, CHUNK=COMBINE_CHUNK)
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
    flat = all(readable_flat(x, layout) for x in (log_probs, ref_log_probs, mask))
    lo, hi, olo, ohi = c["clamp"]
    args = (log_probs, ref_log_probs, or_dummy(c["mask"], dummy), or_dummy(c["coef"], g_lp), or_dummy(c["offsets"], g_lp),
            or_dummy(c["lengths"], g_lp), or_dummy(c["prompt_lens"], g_lp), *(or_dummy(g, dummy) for g in grads), g_lp, g_ref,
            total, c["batch"], c["width"], *c["lp_s"], *c["ref_s"], *c["mask_s"],
            c["coef_scalar"], lo, hi, olo, ohi, size_bucket(total))
    flags = dict(c["flags"], HAS_PROMPT=c["prompt_lens"] is not None, HAS_MASK=mask is not None,
                 HAS_GKL=grads[0] is not None, HAS_GRW=grads[1] is not None, HAS_GRO=grads[2] is not None,
                 HAS_GSUM=grads[3] is not None, STRAIGHT_THROUGH=bool(straight_through), FLAT=flat)
    launch_tiles(bwd, total, args, flags)
    return g_lp, g_ref


