"""Triton kernels of ``kl_penalty_loss``: forward tiles, per-sequence combine, the aggregation's totals, backward.

The twin of ``csrc/cpu/kl_penalty_cpu.cpp`` with the geometry of ``kl_reward.py``: the flat
token space is cut into tiles of ``BLOCK`` elements (one program each, no grid dimension tied to
a row's length), ``frame`` says where each element stands and whether it counts. Per counted
token (``csrc/common/kl_penalty_math.h``)::

    ratio = exp(clamp(lr, -20, 20));  gain = ratio * A;  gain_c = clamp(ratio, lo, hi) * A
    (lr = lp - old, or with SEQ_LR the sequence's log-ratio: GSPO)
    obj   = -(gain <= gain_c ? gain : gain_c);   kl = est(d),  d = sign * (lp - other)
    loss  = obj + beta * kl - entropy_coef * entropy
    grad  = -A * ratio * [|lr| <= 20] * (gain <= gain_c ? 1 : [lo <= ratio <= hi]) + beta * sign * est'(d)

The forward writes ``grad`` (the one float32 buffer kept for backward), optional per-token parts
(aggregation ``"none"``) and eight per-sequence sums (the loss and the stat columns,
``reference.STAT_COLUMNS``: objective, kl, entropy, ratio, clipped, and TRL's low / high clip flags
``ratio < lo and A < 0`` / ``ratio > hi and A > 0``) plus the count, deterministically: fp64
segmented scans inside a tile (integer prefix sums for the flags and the count), two boundary slots
per tile, and ``combine`` adds the slots of sequences that span tiles (as ``kl_reward``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .. import codes
from ..kl_penalty.reference import STAT_COLUMNS

from .kl_math import clamp, exp_bounded, inside, kl_grad, kl_value, segment_sum
from .tiles import coef_of, combine_rows, frame, geometry_bad, later_tiles, segment_places

# Slots hold 8 fp64 values per tile boundary: the loss and the stat columns (a power of two: the combine's
# 2-D block). STATS: the stat columns (the per-sequence stats' row stride).
SLOT_STRIDE = 8
STATS = tl.constexpr(len(STAT_COLUMNS))
assert 1 + len(STAT_COLUMNS) == SLOT_STRIDE
# The PPO log-ratio bound, from the one table (kl_kernels/codes.py; kLogRatioBound in the C++ kernels).
LOG_RATIO_BOUND = tl.constexpr(codes.LOG_RATIO_BOUND)

_SIZES = ("total", "batch", "width", "lp_s0", "old_s0", "ref_s0", "adv_s0", "ent_s0", "mask_s0")


@triton.jit
def _load(ptr, seq, col, offs, s0, s1, counted, full, FLAT: tl.constexpr):
    """A per-token input as fp32, 0 where not counted. ``full``: the tile lies wholly inside the
    input, so a flat read needs no mask and the compiler can widen it to 128 bits (a data-dependent
    mask keeps every access scalar)."""
    if FLAT:
        if full:
            return tl.where(counted, tl.load(ptr + offs).to(tl.float32), 0.0)
        return tl.load(ptr + offs, mask=counted, other=0.0).to(tl.float32)
    return tl.load(ptr + seq * s0 + col * s1, mask=counted, other=0.0).to(tl.float32)


@triton.jit
def _segment(v, first):
    """Per lane: the sum of ``v`` from its segment's first lane to itself (fp64 segmented scan:
    a NaN/inf in one sequence never reaches the next)."""
    return segment_sum(v, first)


@triton.jit
def _put_sum(s, whole_at, slot_at, whole, head, tail):
    """One per-sequence sum ``s`` (fp64, read at each segment's last lane): to the sequence's own
    entry (fp32) where the tile holds the whole sequence, else to the tile's head or tail slot
    (fp64; the tail slot is the row after the head's, 8 entries on)."""
    tl.store(whole_at, s.to(tl.float32), mask=whole)
    tl.store(slot_at, s, mask=head)
    tl.store(slot_at + 8, s, mask=tail)


@triton.jit(do_not_specialize=_SIZES)
def kl_penalty_fwd_kernel(
        lp_ptr, old_ptr, ref_ptr, adv_ptr, ent_ptr, wt_ptr, mask_ptr, beta_ptr, offsets_ptr, lengths_ptr, seq_lr_ptr,
        seq_loss_ptr, stats_ptr, count_ptr, tok_ptr, grad_ptr, slot_sum_ptr, slot_count_ptr,
        total, batch, width, lp_s0, lp_s1, old_s0, old_s1, ref_s0, ref_s1, adv_s0, adv_s1, ent_s0, ent_s1,
        wt_s0, wt_s1, mask_s0, mask_s1, beta_scalar, clip_lo, clip_hi, clip_c, kl_in_lo, kl_in_hi, kl_out_lo,
        kl_out_hi, entropy_coef, size_bucket,
        PACKED: tl.constexpr, LEFT_PAD: tl.constexpr, HAS_LENGTHS: tl.constexpr, HAS_MASK: tl.constexpr,
        HAS_REF: tl.constexpr, HAS_ENT: tl.constexpr, HAS_WT: tl.constexpr, WEIGHT_KL: tl.constexpr,
        ADV_PER_SEQ: tl.constexpr, BETA_MODE: tl.constexpr, SEQ_LR: tl.constexpr, KL_RATIO: tl.constexpr,
        TOKEN_OUT: tl.constexpr, EST: tl.constexpr, STRAIGHT_THROUGH: tl.constexpr, FLAT: tl.constexpr,
        BLOCK: tl.constexpr):
    """One tile: the gradient buffer, optional per-token parts, whole sequences' sums and the
    tile's two boundary slots. ``size_bucket`` is the autotuner's key only."""
    pid = tl.program_id(0).to(tl.int64)
    t0 = pid * BLOCK
    offs = t0 + tl.arange(0, BLOCK).to(tl.int64)
    inb = offs < total
    t_last = tl.minimum(t0 + BLOCK, total) - 1
    seq, col, pos, seq_lo, seq_hi, counted = frame(
        offsets_ptr, lengths_ptr, lengths_ptr, mask_ptr, mask_s0, mask_s1, t0, offs, inb, total, batch, width,
        PACKED, LEFT_PAD, HAS_LENGTHS, False, HAS_MASK, FLAT)
    full = t0 + BLOCK <= total

    lp = _load(lp_ptr, seq, col, offs, lp_s0, lp_s1, counted, full, FLAT)
    old = _load(old_ptr, seq, col, offs, old_s0, old_s1, counted, full, FLAT)
    if HAS_REF:  # KL to the reference model, else to the old policy
        d = lp - _load(ref_ptr, seq, col, offs, ref_s0, ref_s1, counted, full, FLAT)
        sign = 1.0
    else:
        d = old - lp
        sign = -1.0
    # Advantages and entropy stay masked reads (full=False): unmasked too, the bf16 packed 512x4
    # variant took an 8-byte stack frame (ptxas, sm_90), and the static gate allows no local memory.
    if ADV_PER_SEQ:
        adv = tl.load(adv_ptr + seq * adv_s0, mask=counted, other=0.0).to(tl.float32)
    else:
        adv = _load(adv_ptr, seq, col, offs, adv_s0, adv_s1, counted, False, FLAT)
    if HAS_ENT:
        ent = _load(ent_ptr, seq, col, offs, ent_s0, ent_s1, counted, False, FLAT)
    else:
        ent = tl.zeros_like(lp)
    beta = coef_of(beta_ptr, beta_scalar, seq, inb, BETA_MODE)

    if SEQ_LR:  # importance_sampling_level "sequence" (GSPO): the sequence's log-ratio (kl::ppo_token's lr_raw)
        lr_raw = tl.load(seq_lr_ptr + seq, mask=counted, other=0.0)
    else:
        lr_raw = lp - old
    ratio = exp_bounded(clamp(lr_raw, -LOG_RATIO_BOUND, LOG_RATIO_BOUND))  # |.| <= 20: kl::exp_bounded
    gain = ratio * adv
    gain_c = clamp(ratio, clip_lo, clip_hi) * adv
    take = gain <= gain_c  # NaN: false, as torch.where in the reference
    w = tl.where(take, 1.0, inside(ratio, clip_lo, clip_hi))
    # the KL with its optional clamps (+-inf: none), as kl_reward's kernels (kl::kl_value_of / kl_grad_of)
    kl = kl_value(d, kl_in_lo, kl_in_hi, kl_out_lo, kl_out_hi, EST)
    dk = kl_grad(d, kl_in_lo, kl_in_hi, kl_out_lo, kl_out_hi, EST, STRAIGHT_THROUGH)
    pg = -tl.where(take, gain, gain_c)
    # dual clip (kl::ppo_token): for A < 0 the objective is capped at -A * clip_c (inf: never)
    cap = -adv * clip_c
    dual = (adv < 0.0) & (cap < pg)
    obj = tl.where(dual, cap, pg)
    # the clamp's gradient mask (a NaN is outside) selects: an exact 0 outside, not NaN * 0
    in_lr = inside(lr_raw, -LOG_RATIO_BOUND, LOG_RATIO_BOUND) > 0.0
    g_obj = tl.where(in_lr, tl.where(dual, 0.0, -adv * ratio * w), 0.0)
    if KL_RATIO:  # kl_times_ratio (kl::ppo_token's kl_ratio): ratio * kl, differentiated through both
        dr = tl.where(in_lr, ratio * kl, 0.0)
        kl = ratio * kl
        dk = ratio * dk
    if HAS_WT:  # per-token weights: on the policy term, and (WEIGHT_KL) on the KL term
        wt = _load(wt_ptr, seq, col, offs, wt_s0, wt_s1, counted, False, FLAT)
        obj = wt * obj
        g_obj = wt * g_obj
        if WEIGHT_KL:
            kl = wt * kl
            dk = wt * dk
            if KL_RATIO:
                dr = wt * dr
    grad = g_obj + beta * sign * dk
    if KL_RATIO:
        grad = grad + beta * dr
    loss = obj + beta * kl - entropy_coef * ent
    # exactly 0 where not counted (inputs there were read as 0, but the formulas need not give 0)
    grad = tl.where(counted, grad, 0.0)
    loss = tl.where(counted, loss, 0.0)
    obj = tl.where(counted, obj, 0.0)
    kl = tl.where(counted, kl, 0.0)
    ratio = tl.where(counted, ratio, 0.0)
    # Invalid geometry is not tested here: kl_penalty_combine_kernel writes its NaN (tested per element, its
    # four offset loads took kl_penalty_fwd_kernel from 128 to 152 registers at fp32 512x4 with weights).
    tl.store(grad_ptr + offs, grad, mask=inb)
    if TOKEN_OUT:
        tl.store(tok_ptr + offs, loss, mask=inb)
        tl.store(tok_ptr + total + offs, obj, mask=inb)
        tl.store(tok_ptr + 2 * total + offs, beta * kl, mask=inb)
        tl.store(tok_ptr + 3 * total + offs, -entropy_coef * ent + 0.0, mask=inb)  # + 0.0: no -0

    # Where each sequence's share of the tile is read and written, settled before the fp64 scans so
    # the sequence's flat range (seq_lo, seq_hi) is not live across them (registers): the segment's
    # first and last lanes and its place (whole / head slot / tail slot).
    first, _, end, whole, head, tail = segment_places(seq_lo, seq_hi, t0, t_last, inb)
    whole, head, tail = end & whole, end & head, end & tail
    # Each token's four count flags (counted; clipped; TRL's low and high clip flags, ratio < lo and A < 0 /
    # ratio > hi and A > 0) in one int32, bits 0-3; their prefix sums come after the fp64 scans, so no
    # scan result of theirs is live across those (registers: the two extra flags took the fp32 configs
    # from <= 128 to 136-144 registers when their sums were scanned here)
    flags = counted.to(tl.int32) | ((counted & ~take).to(tl.int32) << 1) | \
        ((counted & (ratio < clip_lo) & (adv < 0.0)).to(tl.int32) << 2) | \
        ((counted & (ratio > clip_hi) & (adv > 0.0)).to(tl.int32) << 3)
    slot = (tl.zeros_like(seq) + 2 * pid) * 8  # slot 2*pid's row of 8 (tail: the next row)
    # Each sum is written as soon as it is scanned, so one fp64 scan result is live at a time.
    _put_sum(_segment(loss, first), seq_loss_ptr + seq, slot_sum_ptr + slot, whole, head, tail)
    _put_sum(_segment(obj, first), stats_ptr + seq * STATS + 0, slot_sum_ptr + slot + 1, whole, head, tail)
    _put_sum(_segment(kl, first), stats_ptr + seq * STATS + 1, slot_sum_ptr + slot + 2, whole, head, tail)
    if HAS_ENT:
        s_ent = _segment(ent, first)
    else:
        s_ent = tl.zeros_like(first).to(tl.float64)
    _put_sum(s_ent, stats_ptr + seq * STATS + 2, slot_sum_ptr + slot + 3, whole, head, tail)
    _put_sum(_segment(ratio, first), stats_ptr + seq * STATS + 3, slot_sum_ptr + slot + 4, whole, head, tail)
    # The four counts in one int64 prefix sum, 16 bits each (integers: exact as prefix-sum differences, and
    # no NaN to contain; a tile's count of each is at most BLOCK < 2^15, so no field carries into the next)
    tl.static_assert(BLOCK < 32768)
    f = flags.to(tl.int64)
    packed = (f & 1) | (((f >> 1) & 1) << 16) | (((f >> 2) & 1) << 32) | ((f >> 3) << 48)
    cp = tl.cumsum(packed, 0)
    s_p = cp - tl.gather(cp - packed, first, 0)
    s_cnt = (s_p & 0xFFFF).to(tl.int32)
    _put_sum(((s_p >> 16) & 0xFFFF).to(tl.float64), stats_ptr + seq * STATS + 4, slot_sum_ptr + slot + 5, whole,
             head, tail)
    _put_sum(((s_p >> 32) & 0xFFFF).to(tl.float64), stats_ptr + seq * STATS + 5, slot_sum_ptr + slot + 6, whole,
             head, tail)
    _put_sum((s_p >> 48).to(tl.float64), stats_ptr + seq * STATS + 6, slot_sum_ptr + slot + 7, whole, head, tail)
    # Addressed from the tile's first sequence plus an int32 offset, not as count_ptr + seq: that offset
    # (seq * 8) is the packed frame's offsets_ptr + seq, which the compiler then kept live from the frame to
    # here (Triton 3.8, sm_80, fp32 1024x8 with weights: 128 registers and an 8-byte spill; an int64 offset
    # behind a select spilled on Triton 3.6 instead). The offset is at most BLOCK padded, below the batch size
    # packed: the launcher refuses 2^31 packed sequences or more.
    seq_first = tl.min(seq, axis=0)
    tl.store(count_ptr + seq_first + (seq - seq_first).to(tl.int32), s_cnt.to(tl.int64), mask=whole)
    # Slot 2*pid: the segment holding the tile's first element; 2*pid+1: the one holding its last.
    tl.store(slot_count_ptr + 2 * pid + tl.zeros_like(first), s_cnt, mask=head)
    tl.store(slot_count_ptr + 2 * pid + 1 + tl.zeros_like(first), s_cnt, mask=tail)


@triton.jit(do_not_specialize=("batch", "total", "width"))
def kl_penalty_combine_kernel(offsets_ptr, lengths_ptr, seq_loss_ptr, stats_ptr, count_ptr, slot_sum_ptr,
                              slot_count_ptr, grad_ptr, tok_ptr, batch, total, width, PACKED: tl.constexpr,
                              HAS_LENGTHS: tl.constexpr, TOKEN_OUT: tl.constexpr, TILE: tl.constexpr,
                              BLOCK_B: tl.constexpr, CHUNK: tl.constexpr):
    """Per sequence: finish the sums of sequences that span tiles (fp64; CHUNK later tiles a step,
    ``later_tiles``); zero the empty ones; NaN over a sequence of invalid geometry (its loss, and its
    row of the gradient and of the per-token loss)."""
    b, inb, lo, hi, n, k0, k1, spans = combine_rows(offsets_ptr, batch, width, total, PACKED, TILE, BLOCK_B)
    c = tl.arange(0, 8)
    used = c < 1 + STATS
    m2 = spans[:, None] & used[None, :]
    # The sequence is the last segment of its first tile, then the first segment of the others.
    acc = tl.load(slot_sum_ptr + (2 * k0 + 1)[:, None] * 8 + c[None, :], mask=m2, other=0.0)
    cnt = tl.load(slot_count_ptr + 2 * k0 + 1, mask=spans, other=0).to(tl.int64)
    steps = tl.max(tl.where(spans, k1 - k0, 0), axis=0)
    for j0 in range(1, steps + 1, CHUNK):
        t, m = later_tiles(k0, k1, spans, j0, CHUNK)
        at = (2 * t)[:, :, None] * 8 + c[None, None, :]
        acc += tl.sum(tl.load(slot_sum_ptr + at, mask=m[:, :, None] & used[None, None, :], other=0.0), axis=1)
        cnt += tl.sum(tl.load(slot_count_ptr + 2 * t, mask=m, other=0).to(tl.int64), axis=1)
    empty = inb & (n == 0)
    write = spans | empty
    acc = tl.where(spans[:, None], acc, 0.0).to(tl.float32)
    loss = tl.sum(tl.where(c[None, :] == 0, acc, 0.0), axis=1)
    tl.store(seq_loss_ptr + b, loss, mask=write)
    # invalid geometry (reported through the error word, kl_kernels/device_errors.py): NaN, written here on
    # that path alone (a loop of no steps otherwise) rather than tested per element in the forward tiles
    bad = geometry_bad(offsets_ptr, lengths_ptr, offsets_ptr, b, inb, total, batch, width, PACKED, HAS_LENGTHS,
                       False)
    tl.store(seq_loss_ptr + b, tl.zeros_like(loss) + float("nan"), mask=bad)  # also when empty
    longest = tl.max(tl.where(bad, hi - lo, 0), axis=0)
    for j0 in range(0, longest, CHUNK):
        t = lo[:, None] + j0 + tl.arange(0, CHUNK)[None, :]
        m = bad[:, None] & (t < hi[:, None])
        nan = tl.full([BLOCK_B, CHUNK], float("nan"), tl.float32)
        tl.store(grad_ptr + t, nan, mask=m)
        if TOKEN_OUT:
            tl.store(tok_ptr + t, nan, mask=m)
    stat = write[:, None] & (c[None, :] >= 1) & used[None, :]
    tl.store(stats_ptr + b[:, None] * STATS + (c[None, :] - 1), acc, mask=stat)
    tl.store(count_ptr + b, tl.where(spans, cnt, 0), mask=write)


@triton.jit(do_not_specialize=("batch",))
def kl_penalty_totals_kernel(seq_loss_ptr, stats_ptr, count_ptr, beta_ptr, tokens_ptr, loss_ptr, rest_ptr, n_ptr,
                             weight_ptr, batch, agg_scale, agg_beta, entropy_coef, BETA_MODE: tl.constexpr,
                             PER_TOKEN: tl.constexpr, SEQ_MEAN: tl.constexpr, HAS_TOKENS: tl.constexpr,
                             BLOCK_B: tl.constexpr):
    """One program, after combine: the aggregation's sums over the batch and its outputs, the
    algorithm of the CUDA kernels' penalty_totals and finalize_aggregation
    (csrc/common/kl_penalty_args.h): sequence b's loss weighs w * u_b, w = agg_scale / (PER_TOKEN ?
    max(N, 1) : 1) with N at tokens_ptr (HAS_TOKENS) or this batch's count, u_b = 1 / max(n_b, 1)
    (SEQ_MEAN) or 1; float64 sums, lanes of BLOCK_B sequences reduced by tl.sum (a fixed order).
    The float scalars arrive in float32 (Triton's float arguments)."""
    offs = tl.arange(0, BLOCK_B).to(tl.int64)
    zero = tl.zeros((BLOCK_B,), dtype=tl.float64)
    one = tl.sum(zero, axis=0) + 1.0  # a float64 scalar: the float arguments promoted to float64 through it
    s_loss, s_obj, s_klb, s_ent, s_kl, s_ratio, s_clip = zero, zero, zero, zero, zero, zero, zero
    s_low, s_high, s_ent_all = zero, zero, zero
    s_n = tl.zeros((BLOCK_B,), dtype=tl.int64)
    for start in range(0, batch, BLOCK_B):
        b = start + offs
        inb = b < batch
        n_b = tl.load(count_ptr + b, mask=inb, other=0)
        if SEQ_MEAN:
            u = 1.0 / tl.maximum(n_b, 1).to(tl.float64)
        else:
            u = zero + 1.0
        if BETA_MODE == 0:
            beta = zero + one * agg_beta
        elif BETA_MODE == 1:
            beta = zero + tl.load(beta_ptr).to(tl.float64)
        else:
            beta = tl.load(beta_ptr + b, mask=inb, other=0.0).to(tl.float64)
        at = stats_ptr + b * STATS
        s_loss += tl.where(inb, u * tl.load(seq_loss_ptr + b, mask=inb, other=0.0).to(tl.float64), 0.0)
        s_obj += tl.where(inb, u * tl.load(at, mask=inb, other=0.0).to(tl.float64), 0.0)
        kl_b = tl.load(at + 1, mask=inb, other=0.0).to(tl.float64)
        s_klb += tl.where(inb, u * beta * kl_b, 0.0)
        ent_b = tl.load(at + 2, mask=inb, other=0.0).to(tl.float64)
        s_ent += tl.where(inb, u * ent_b, 0.0)
        s_ent_all += ent_b
        s_kl += kl_b
        s_ratio += tl.load(at + 3, mask=inb, other=0.0).to(tl.float64)
        s_clip += tl.load(at + 4, mask=inb, other=0.0).to(tl.float64)
        s_low += tl.load(at + 5, mask=inb, other=0.0).to(tl.float64)
        s_high += tl.load(at + 6, mask=inb, other=0.0).to(tl.float64)
        s_n += n_b
    n = tl.sum(s_n, axis=0)
    n_f = n.to(tl.float64)
    if HAS_TOKENS:
        big_n = tl.load(tokens_ptr)
    else:
        big_n = n_f
    if PER_TOKEN:
        w = one * agg_scale / tl.maximum(big_n, 1.0)
    else:
        w = one * agg_scale
    denom = tl.maximum(n_f, 1.0)
    tl.store(loss_ptr, (tl.sum(s_loss, axis=0) * w).to(tl.float32))
    tl.store(rest_ptr, (tl.sum(s_obj, axis=0) * w).to(tl.float32))
    tl.store(rest_ptr + 1, (tl.sum(s_klb, axis=0) * w).to(tl.float32))
    tl.store(rest_ptr + 2, (tl.sum(s_ent, axis=0) * w * -(one * entropy_coef) + 0.0).to(tl.float32))
    tl.store(rest_ptr + 3, (tl.sum(s_kl, axis=0) / denom).to(tl.float32))
    tl.store(rest_ptr + 4, (tl.sum(s_ratio, axis=0) / denom).to(tl.float32))
    tl.store(rest_ptr + 5, (tl.sum(s_clip, axis=0) / denom).to(tl.float32))
    tl.store(rest_ptr + 6, (tl.sum(s_low, axis=0) / denom).to(tl.float32))
    tl.store(rest_ptr + 7, (tl.sum(s_high, axis=0) / denom).to(tl.float32))
    tl.store(rest_ptr + 8, (tl.sum(s_ent_all, axis=0) / denom).to(tl.float32))  # (0 without entropy)
    tl.store(n_ptr, n)
    tl.store(weight_ptr, w)


@triton.jit(do_not_specialize=("total", "batch", "width", "mask_s0"))
def kl_penalty_bwd_kernel(
        grad_ptr, g_seq_ptr, g_tok_ptr, mask_ptr, offsets_ptr, lengths_ptr, g_lp_ptr, g_ent_ptr,
        g_loss_ptr, weight_ptr, count_ptr,
        total, batch, width, mask_s0, mask_s1, entropy_coef, size_bucket,
        PACKED: tl.constexpr, LEFT_PAD: tl.constexpr, HAS_LENGTHS: tl.constexpr, HAS_MASK: tl.constexpr,
        HAS_GSEQ: tl.constexpr, HAS_GTOK: tl.constexpr, ENT_GRAD: tl.constexpr, FLAT: tl.constexpr,
        HAS_GLOSS: tl.constexpr, SEQ_MEAN: tl.constexpr, BLOCK: tl.constexpr):
    """grad_lp = (g_tok + g_seq[seq]) * grad and grad_entropy = -entropy_coef * (g_tok + g_seq[seq]) at
    counted tokens, 0 elsewhere. HAS_GLOSS (the aggregation on the device, kl_penalty_totals_kernel):
    g_seq[seq] is g_loss * w (* 1 / max(count[seq], 1) with SEQ_MEAN), read here."""
    pid = tl.program_id(0).to(tl.int64)
    t0 = pid * BLOCK
    offs = t0 + tl.arange(0, BLOCK).to(tl.int64)
    inb = offs < total
    seq, col, pos, seq_lo, seq_hi, counted = frame(
        offsets_ptr, lengths_ptr, lengths_ptr, mask_ptr, mask_s0, mask_s1, t0, offs, inb, total, batch, width,
        PACKED, LEFT_PAD, HAS_LENGTHS, False, HAS_MASK, FLAT)
    g = tl.zeros((BLOCK,), dtype=tl.float32)
    if HAS_GSEQ:
        g += tl.load(g_seq_ptr + seq, mask=counted, other=0.0)
    if HAS_GTOK:
        g += tl.load(g_tok_ptr + offs, mask=counted, other=0.0)
    if HAS_GLOSS:
        g_all = tl.load(g_loss_ptr).to(tl.float64) * tl.load(weight_ptr)
        if SEQ_MEAN:
            n_b = tl.load(count_ptr + seq, mask=counted, other=1)
            g += (g_all * (1.0 / tl.maximum(n_b, 1).to(tl.float64))).to(tl.float32)
        else:
            g += g_all.to(tl.float32)
    grad = tl.load(grad_ptr + offs, mask=counted, other=0.0)
    tl.store(g_lp_ptr + offs, tl.where(counted, g * grad, 0.0).to(g_lp_ptr.dtype.element_ty), mask=inb)
    if ENT_GRAD:
        tl.store(g_ent_ptr + offs, tl.where(counted, -entropy_coef * g, 0.0).to(g_ent_ptr.dtype.element_ty), mask=inb)
