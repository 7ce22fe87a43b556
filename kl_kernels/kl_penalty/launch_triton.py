"""Host launcher of the Triton kl_penalty_loss kernels (``kl_kernels/triton/kl_penalty.py``).

Same signatures as ``launch.py`` (the C++ launcher), so ``ops.py`` registers both the same way.
Tile sizes, autotuning (GPU) and the interpreter's tile choice are kl_reward's
(``kl_reward/launch_triton.py``).
"""

from __future__ import annotations

import functools
import math

import torch

from ..launching import NO_CLAMP, resolved, strides
from .launch import RESULTS, STATS
from ..launching_triton import (COMBINE_BLOCK, COMBINE_CHUNK, MIN_BLOCK, PENALTY_COMBINE_BLOCK, interpreter_block,
                                kernel_set, launch_tiles, or_dummy, readable_flat, size_bucket, triton_cdiv, tuned)


@functools.lru_cache(maxsize=None)
def _kernels():
    from ..triton import kl_penalty as k  # imported on first use: triton is optional

    return kernel_set(k.kl_penalty_fwd_kernel, k.kl_penalty_combine_kernel, k.kl_penalty_bwd_kernel)


@functools.lru_cache(maxsize=None)
def _totals_kernel():
    from ..triton import kl_penalty as k

    return k.kl_penalty_totals_kernel


def _geometry(like, mask, offsets, lengths, layout):
    packed = layout == 0
    batch = offsets.shape[0] - 1 if packed else like.shape[0]
    width = 0 if packed else like.shape[1]
    offsets = offsets.to(torch.int64).contiguous() if offsets is not None else None
    lengths = lengths.to(torch.int64).contiguous() if lengths is not None else None
    mask_u8 = mask.view(torch.uint8) if mask is not None else None
    mask_s = strides(mask_u8, layout) if mask is not None else (0, 0)
    return packed, batch, width, offsets, lengths, mask_u8, mask_s


def forward(log_probs, old_log_probs, ref_log_probs, advantages, entropy, mask, offsets, lengths, beta, beta_scalar,
            adv_per_seq, layout, left_pad, estimator, straight_through, clip_lo, clip_hi, entropy_coef, token_out,
            weights=None, clip_c=math.inf, weight_kl=False, clamp=NO_CLAMP, seq_lr=None, kl_ratio=False,
            grad_out=None):
    """Run the Triton forward; returns (seq_loss [B], stats [B, STATS], count [B], token_out [4, *shape] or
    empty, grad [*shape]), as ``launch.forward`` (``grad_out``: the caller's buffer for ``grad``;
    ``seq_lr``: float32 [B], the sequences' log-ratios, GSPO; ``kl_ratio``: kl_times_ratio)."""
    (log_probs, old_log_probs, ref_log_probs, advantages, entropy, mask, offsets, lengths, beta, weights,
     seq_lr) = resolved(log_probs, old_log_probs, ref_log_probs, advantages, entropy, mask, offsets, lengths, beta,
                        weights, seq_lr)
    fwd, combine, _ = _kernels()
    dev, shape, total = log_probs.device, log_probs.shape, log_probs.numel()
    packed, batch, width, offsets, lengths, mask_u8, mask_s = _geometry(log_probs, mask, offsets, lengths, layout)
    if packed and batch >= 2 ** 31:  # (a tile's counts are stored at its first sequence + an int32 offset)
        raise ValueError(f"offsets: the Triton kl_penalty kernels take at most 2^31 - 1 packed sequences a call, got "
                         f"{batch} (split the batch, or backend='cuda')")
    seq_loss = torch.empty(batch, dtype=torch.float32, device=dev)
    stats = torch.empty(batch, STATS, dtype=torch.float32, device=dev)
    count = torch.empty(batch, dtype=torch.int64, device=dev)
    tok = torch.empty((4, *shape) if token_out else (0,), dtype=torch.float32, device=dev)
    grad = torch.empty(shape, dtype=torch.float32, device=dev) if grad_out is None else grad_out
    if beta is None:
        beta_mode, beta_t = 0, None
    else:
        beta_t = beta.to(torch.float32).contiguous()  # a device op: no host sync
        beta_mode = 1 if beta_t.dim() == 0 else 2
    block = interpreter_block(total) if not tuned(fwd) else MIN_BLOCK
    slots = 2 * max(1, math.ceil(total / block))  # enough for the smallest tile the tuner may pick
    slot_sum = torch.empty(slots, 8, dtype=torch.float64, device=dev)
    slot_count = torch.empty(slots, dtype=torch.int32, device=dev)
    adv_s = (advantages.stride(0), 0) if adv_per_seq else strides(advantages, layout)
    zero_s = (0, 0)
    per_token = (log_probs, old_log_probs, ref_log_probs, mask, entropy, None if adv_per_seq else advantages, weights)
    flat = all(readable_flat(x, layout) for x in per_token)
    if total > 0:
        dummy = log_probs
        args = (log_probs, old_log_probs, or_dummy(ref_log_probs, dummy), advantages, or_dummy(entropy, dummy),
                or_dummy(weights, dummy), or_dummy(mask_u8, dummy), or_dummy(beta_t, seq_loss),
                or_dummy(offsets, count), or_dummy(lengths, count), or_dummy(seq_lr, seq_loss),
                seq_loss, stats, count, tok if token_out else grad, grad, slot_sum, slot_count,
                total, batch, width, *strides(log_probs, layout), *strides(old_log_probs, layout),
                *(strides(ref_log_probs, layout) if ref_log_probs is not None else zero_s), *adv_s,
                *(strides(entropy, layout) if entropy is not None else zero_s),
                *(strides(weights, layout) if weights is not None else zero_s), *mask_s,
                float(beta_scalar), float(clip_lo), float(clip_hi), float(clip_c),
                *(float(v) for v in clamp),
                float(entropy_coef), size_bucket(total))
        flags = dict(PACKED=packed, LEFT_PAD=bool(left_pad), HAS_LENGTHS=lengths is not None,
                     HAS_MASK=mask is not None, HAS_REF=ref_log_probs is not None, HAS_ENT=entropy is not None,
                     HAS_WT=weights is not None, WEIGHT_KL=bool(weight_kl) and weights is not None,
                     ADV_PER_SEQ=bool(adv_per_seq), BETA_MODE=beta_mode, SEQ_LR=seq_lr is not None,
                     KL_RATIO=bool(kl_ratio),
                     TOKEN_OUT=bool(token_out),
                     EST=int(estimator), STRAIGHT_THROUGH=bool(straight_through), FLAT=flat)
        block = launch_tiles(fwd, total, args, flags)
    if batch > 0:
        combine[(triton_cdiv(batch, PENALTY_COMBINE_BLOCK),)](
            or_dummy(offsets, count), or_dummy(lengths, count), seq_loss, stats, count, slot_sum, slot_count, grad,
            tok if token_out else grad, batch, total, width, PACKED=packed, HAS_LENGTHS=lengths is not None,
            TOKEN_OUT=bool(token_out), TILE=block, BLOCK_B=PENALTY_COMBINE_BLOCK, CHUNK=COMBINE_CHUNK)
    return seq_loss, stats, count, tok, grad


def forward_aggregated(forward_args, agg_scale, agg_per_token, agg_seq_mean, agg_tokens, agg_beta, agg_entropy_coef,
                       ext=None, grad_out=None):
    """``launch.forward_aggregated`` with the Triton kernels: the forward, then the totals kernel
    (``kl_penalty_totals_kernel``) writes the loss, its parts, the count and the weight on the
    device. Same arguments (``ext`` unused) and results (the per-sequence stats and counts too); ``args`` is what
    :func:`backward_aggregated` needs, ``keep`` empty."""
    if forward_args[18]:  # token_out
        raise ValueError("forward_aggregated: per-token outputs (token_out) are not aggregated")
    beta = forward_args[8]
    # as the forward reads it (a device op, no host sync), converted once: the forward's own conversion is then a no-op
    beta_t = beta.to(torch.float32).contiguous() if beta is not None else None
    seq_loss, stats, count, _, grad = forward(*forward_args[:8], beta_t, *forward_args[9:], grad_out=grad_out)
    dev, batch = grad.device, count.shape[0]
    f32 = dict(dtype=torch.float32, device=dev)
    loss, rest = torch.empty((), **f32), torch.empty(RESULTS, **f32)
    n = torch.empty((), dtype=torch.int64, device=dev)
    weight = torch.empty(1, dtype=torch.float64, device=dev)
    tokens = agg_tokens.to(torch.float64).contiguous() if agg_tokens is not None else None
    _totals_kernel()[(1,)](
        seq_loss, stats, count, or_dummy(beta_t, seq_loss), or_dummy(tokens, weight), loss, rest, n, weight, batch,
        float(agg_scale), float(agg_beta), float(agg_entropy_coef),
        BETA_MODE=0 if beta_t is None else 1 if beta_t.dim() == 0 else 2, PER_TOKEN=bool(agg_per_token),
        SEQ_MEAN=bool(agg_seq_mean), HAS_TOKENS=tokens is not None, BLOCK_B=COMBINE_BLOCK)
    (mask, offsets, lengths, layout, left_pad, entropy_coef) = (forward_args[5], forward_args[6], forward_args[7],
                                                                forward_args[11], forward_args[12], forward_args[17])
    args = dict(mask=mask, offsets=offsets, lengths=lengths, layout=layout, left_pad=left_pad,
                entropy_coef=entropy_coef, count=count, seq_mean=bool(agg_seq_mean))
    return loss, rest, n, weight, grad, stats, count, args, []


def backward_aggregated(args, grad, weight, g_loss, lp_dtype, entropy_grad, aux_dtype, ext=None):
    """``launch.backward_aggregated`` with the Triton backward kernel (``args``: from
    :func:`forward_aggregated`): sequence b's incoming gradient g_loss * w * u_b is read on the
    device. Returns (grad_lp, grad_ent or None)."""
    g_lp, g_ent = backward(grad, None, None, args["mask"], args["offsets"], args["lengths"], args["layout"],
                           args["left_pad"], lp_dtype, entropy_grad, aux_dtype, args["entropy_coef"],
                           g_loss=g_loss, weight=weight, count=args["count"], seq_mean=args["seq_mean"])
    return g_lp, g_ent if entropy_grad else None


def backward(grad, g_seq, g_tok, mask, offsets, lengths, layout, left_pad, lp_dtype, entropy_grad, aux_dtype,
             entropy_coef, g_loss=None, weight=None, count=None, seq_mean=False):
    """Scale the saved gradient buffer (see ``launch.backward``); returns (grad_lp, grad_ent or empty).
    ``g_loss`` (a 0-d tensor), ``weight`` and ``count``: the aggregation on the device
    (:func:`backward_aggregated`), in place of ``g_seq``."""
    grad, g_seq, g_tok, mask, offsets, lengths = resolved(grad, g_seq, g_tok, mask, offsets, lengths)
    _, _, bwd = _kernels()
    dev, total = grad.device, grad.numel()
    packed, batch, width, offsets, lengths, mask_u8, mask_s = _geometry(grad, mask, offsets, lengths, layout)
    g_lp = torch.empty(grad.shape, dtype=lp_dtype, device=dev)
    g_ent = torch.empty(grad.shape if entropy_grad else (0,), dtype=aux_dtype, device=dev)
    if total == 0:
        return g_lp, g_ent
    g_seq = g_seq.to(torch.float32).contiguous() if g_seq is not None else None
    g_tok = g_tok.to(torch.float32).contiguous() if g_tok is not None else None
    g_loss = g_loss.to(torch.float32).contiguous() if g_loss is not None else None
    args = (grad, or_dummy(g_seq, grad), or_dummy(g_tok, grad), or_dummy(mask_u8, grad), or_dummy(offsets, grad), or_dummy(lengths, grad),
            g_lp, g_ent if entropy_grad else g_lp, or_dummy(g_loss, grad), or_dummy(weight, grad),
            or_dummy(count, grad), total, batch, width, *mask_s, float(entropy_coef), size_bucket(total))
    flags = dict(PACKED=packed, LEFT_PAD=bool(left_pad), HAS_LENGTHS=lengths is not None, HAS_MASK=mask is not None,
                 HAS_GSEQ=g_seq is not None, HAS_GTOK=g_tok is not None, ENT_GRAD=bool(entropy_grad),
                 FLAT=readable_flat(mask, layout), HAS_GLOSS=g_loss is not None, SEQ_MEAN=bool(seq_mean))
    launch_tiles(bwd, total, args, flags)
    return g_lp, g_ent
