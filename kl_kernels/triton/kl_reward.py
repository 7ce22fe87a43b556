"""Triton kernels of ``kl_reward``: forward tiles, per-sequence combine, backward.

The flat token space (packed: ``N`` tokens; padded: ``B * T`` elements, row-major) is cut into
tiles of ``BLOCK`` elements, one program each, so no grid dimension ever depends on a row's
length. Each element finds its sequence (padded: a division; packed: a binary search over
``offsets``, narrowed to the tile's own range of sequences), decides whether it counts
(validity, prompt, mask) and writes ``kl``, ``reward_out`` and the masked ref in place.

Per-sequence sums are deterministic without float atomics: a segmented scan inside the tile
(fp64), read at each sequence's last element in the tile, gives each sequence's share of the
tile (a NaN or inf stays in its own sequence). A sequence that lies wholly in one tile is finished
there; the tile's first and last segments (which may continue into neighbouring tiles) are also
written to two slots per tile (fp64), and ``combine`` adds the slots of each spanning sequence
(16 tiles a step, ``later_tiles``), then applies the ``"last"``/``"last_valid"`` placements. Two launches per forward, one backward.

All index arithmetic is int64. Runtime values (sizes, strides, coef, clamps) are runtime
arguments; only structural choices (layout, estimator, which optional tensors exist) are
``tl.constexpr``, so a changing coefficient never recompiles. Sizes are excluded from value
specialization (``do_not_specialize``) so ragged batches do not multiply variants.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .kl_math import kl_grad, kl_value, segment_sum
from .tiles import coef_of, combine_rows, frame, geometry_bad, later_tiles, segment_places

# Runtime integers that change from batch to batch: no specialization on their values.
_SIZES = ("total", "batch", "width", "lp_s0", "ref_s0", "mask_s0", "rw_s0")


@triton.jit(do_not_specialize=_SIZES)
def kl_reward_fwd_kernel(
        lp_ptr, ref_ptr, mask_ptr, reward_ptr, coef_ptr, offsets_ptr, lengths_ptr, prompt_ptr,
        kl_ptr, rw_out_ptr, ref_out_ptr, kl_sum_ptr, count_ptr, last_ptr, slot_sum_ptr, slot_count_ptr, slot_last_ptr,
        total, batch, width, lp_s0, lp_s1, ref_s0, ref_s1, mask_s0, mask_s1, rw_s0, rw_s1,
        coef_scalar, in_lo, in_hi, out_lo, out_hi, size_bucket,
        PACKED: tl.constexpr, LEFT_PAD: tl.constexpr, HAS_LENGTHS: tl.constexpr, HAS_PROMPT: tl.constexpr,
        HAS_MASK: tl.constexpr, PLACEMENT: tl.constexpr, COEF_MODE: tl.constexpr, RETURN_REF: tl.constexpr,
        EST: tl.constexpr, FLAT: tl.constexpr, BLOCK: tl.constexpr):
    """One tile: per-token outputs, whole sequences' sums, and the tile's two boundary slots.

    ``size_bucket`` is unused in the body: it is the autotuner's key (a power of two of the
    token count), so ragged batches of similar size share one tuned configuration.
    """
    pid = tl.program_id(0).to(tl.int64)
    t0 = pid * BLOCK
    offs = t0 + tl.arange(0, BLOCK).to(tl.int64)
    inb = offs < total
    t_last = tl.minimum(t0 + BLOCK, total) - 1
    seq, col, pos, seq_lo, seq_hi, counted = frame(
        offsets_ptr, lengths_ptr, prompt_ptr, mask_ptr, mask_s0, mask_s1, t0, offs, inb, total, batch, width,
        PACKED, LEFT_PAD, HAS_LENGTHS, HAS_PROMPT, HAS_MASK, FLAT)

    if FLAT:  # every input is contiguous in the layout's shape: plain (vectorizable) offsets
        lp_at = lp_ptr + offs
        ref_at = ref_ptr + offs
        rw_at = reward_ptr + offs
    else:
        lp_at = lp_ptr + seq * lp_s0 + col * lp_s1
        ref_at = ref_ptr + seq * ref_s0 + col * ref_s1
        rw_at = reward_ptr + seq * rw_s0 + col * rw_s1
    if FLAT and t0 + BLOCK <= total:
        # A whole tile of flat inputs: unmasked loads, which the compiler can widen to 128 bits (a
        # data-dependent mask keeps every access scalar). Uncounted lanes are zeroed below.
        lp = tl.where(counted, tl.load(lp_at).to(tl.float32), 0.0)
        ref = tl.load(ref_at)
        ref = tl.where(counted, ref, tl.zeros_like(ref))
    else:
        lp = tl.load(lp_at, mask=counted, other=0.0).to(tl.float32)
        ref = tl.load(ref_at, mask=counted, other=0.0)
    k = kl_value(lp - ref.to(tl.float32), in_lo, in_hi, out_lo, out_hi, EST)
    k = tl.where(counted, k, 0.0)  # exactly 0 where not counted, whatever the clamps say
    # invalid geometry (reported through the error word, kl_kernels/device_errors.py): NaN, also in the sums
    bad = geometry_bad(offsets_ptr, lengths_ptr, prompt_ptr, seq, inb, total, batch, width, PACKED, HAS_LENGTHS,
                       HAS_PROMPT)
    k = tl.where(bad, float("nan"), k)
    tl.store(kl_ptr + offs, k.to(kl_ptr.dtype.element_ty), mask=inb)
    if RETURN_REF:
        ref_kept = tl.where(counted, ref, tl.zeros_like(ref))
        tl.store(ref_out_ptr + offs, tl.where(bad, float("nan"), ref_kept.to(tl.float32)).to(ref.dtype), mask=inb)

    c = coef_of(coef_ptr, coef_scalar, seq, inb, COEF_MODE)
    if PLACEMENT == 1:    # per-token reward
        base = tl.load(rw_at, mask=inb, other=0.0).to(tl.float32)
    elif PLACEMENT == 2:  # per-sequence reward, broadcast
        base = tl.load(reward_ptr + seq * rw_s0, mask=inb, other=0.0).to(tl.float32)
    else:                 # none, or "last" (its slot is written by combine)
        base = tl.zeros_like(k)
    tl.store(rw_out_ptr + offs, (base - c * k).to(rw_out_ptr.dtype.element_ty), mask=inb)

    # Each sequence's share of this tile, without atomics: a segmented scan (fp64) for the values,
    # so a NaN/inf in one sequence never reaches the next; prefix-sum differences for the counts
    # (integers: exact), read at each segment's last element. Everything integer (counts, last
    # counted positions, where each segment is written) is settled and stored before the fp64 scan,
    # so the positions and the sequence's flat range are not live across it (registers).
    first, last_lane, end, whole, head, tail = segment_places(seq_lo, seq_hi, t0, t_last, inb)
    cnt = counted.to(tl.int32)
    ccnt = tl.cumsum(cnt, 0)
    seg_count = ccnt - tl.gather(ccnt - cnt, first, 0)
    is_last_counted = counted & (tl.gather(ccnt, last_lane, 0) == ccnt)  # no counted lane after it
    tl.store(count_ptr + seq, seg_count.to(tl.int64), mask=end & whole)
    tl.store(last_ptr + seq, tl.zeros_like(pos) - 1, mask=end & whole & (seg_count == 0))
    tl.store(last_ptr + seq, pos, mask=is_last_counted & whole)
    # Slot 2*pid: the segment holding the tile's first element; 2*pid+1: the one holding its last.
    _store_slot_counts(slot_count_ptr, slot_last_ptr, 2 * pid, head, end, is_last_counted, seg_count, pos)
    _store_slot_counts(slot_count_ptr, slot_last_ptr, 2 * pid + 1, tail, end, is_last_counted, seg_count, pos)
    seg_sum = segment_sum(k, first)
    tl.store(kl_sum_ptr + seq, seg_sum.to(tl.float32), mask=end & whole)
    tl.store(slot_sum_ptr + 2 * pid + tl.zeros_like(seq), seg_sum, mask=head & end)
    tl.store(slot_sum_ptr + 2 * pid + 1 + tl.zeros_like(seq), seg_sum, mask=tail & end)


@triton.jit
def _store_slot_counts(slot_count_ptr, slot_last_ptr, slot, member, end, is_last_counted, seg_count, pos):
    """Write one boundary segment's count and last counted position to ``slot``."""
    at = tl.zeros_like(pos) + slot
    tl.store(slot_count_ptr + at, seg_count, mask=member & end)
    tl.store(slot_last_ptr + at, tl.zeros_like(pos) - 1, mask=member & end & (seg_count == 0))
    tl.store(slot_last_ptr + at, pos, mask=member & is_last_counted)


@triton.jit(do_not_specialize=("batch", "total", "width", "lp_s0", "ref_s0", "rw_s0"))
def kl_reward_combine_kernel(
        lp_ptr, ref_ptr, reward_ptr, coef_ptr, offsets_ptr, lengths_ptr, rw_out_ptr,
        kl_sum_ptr, count_ptr, last_ptr, slot_sum_ptr, slot_count_ptr, slot_last_ptr,
        batch, total, width, lp_s0, lp_s1, ref_s0, ref_s1, rw_s0,
        coef_scalar, in_lo, in_hi, out_lo, out_hi,
        PACKED: tl.constexpr, LEFT_PAD: tl.constexpr, HAS_LENGTHS: tl.constexpr, PLACE_LAST: tl.constexpr,
        LAST_VALID: tl.constexpr, COEF_MODE: tl.constexpr, EST: tl.constexpr, TILE: tl.constexpr,
        BLOCK_B: tl.constexpr, CHUNK: tl.constexpr):
    """Per sequence: finish the sums of sequences spanning tiles (fp64; CHUNK later tiles a step,
    ``later_tiles``), zero the empty ones, and put a ``"last"``-placed (``LAST_VALID``: ``"last_valid"``) reward on its token."""
    b, inb, lo, hi, n, k0, k1, spans = combine_rows(offsets_ptr, batch, width, total, PACKED, TILE, BLOCK_B)
    # The sequence is the last segment of its first tile, then the first segment of the others.
    acc = tl.load(slot_sum_ptr + 2 * k0 + 1, mask=spans, other=0.0)
    cnt = tl.load(slot_count_ptr + 2 * k0 + 1, mask=spans, other=0).to(tl.int64)
    lst = tl.load(slot_last_ptr + 2 * k0 + 1, mask=spans, other=-1)
    steps = tl.max(tl.where(spans, k1 - k0, 0), axis=0)
    for j0 in range(1, steps + 1, CHUNK):
        t, m = later_tiles(k0, k1, spans, j0, CHUNK)
        acc += tl.sum(tl.load(slot_sum_ptr + 2 * t, mask=m, other=0.0), axis=1)
        cnt += tl.sum(tl.load(slot_count_ptr + 2 * t, mask=m, other=0).to(tl.int64), axis=1)
        lst = tl.maximum(lst, tl.max(tl.load(slot_last_ptr + 2 * t, mask=m, other=-1), axis=1))
    empty = inb & (n == 0)
    tl.store(kl_sum_ptr + b, tl.where(spans, acc, 0.0).to(tl.float32), mask=spans | empty)
    tl.store(count_ptr + b, tl.where(spans, cnt, 0), mask=spans | empty)
    bad = geometry_bad(offsets_ptr, lengths_ptr, offsets_ptr, b, inb, total, batch, width, PACKED, HAS_LENGTHS, False)
    tl.store(kl_sum_ptr + b, tl.zeros_like(acc).to(tl.float32) + float("nan"), mask=bad)  # also when empty
    if PLACE_LAST:
        last = tl.where(spans, lst, tl.load(last_ptr + b, mask=inb & (n > 0) & ~spans, other=-1))
        if PACKED:
            length = n
        elif HAS_LENGTHS:
            length = tl.minimum(tl.maximum(tl.load(lengths_ptr + b, mask=inb, other=0), 0), width)  # (clamped)
        else:
            length = tl.zeros_like(b) + width
        if LAST_VALID:  # the last valid token, counted exactly when it is the last counted one
            last = tl.where(last == length - 1, last, -1)
        pos = tl.where(last >= 0, last, length - 1)
        has = inb & (pos >= 0) & (pos < length)  # an empty sequence has no slot (>=: only under bad geometry)
        if PACKED:
            col = lo + pos
            out = col
        else:
            if LEFT_PAD:
                col = pos + (width - length)
            else:
                col = pos
            out = lo + col
        hit = has & (last >= 0)
        lp = tl.load(lp_ptr + b * lp_s0 + col * lp_s1, mask=hit, other=0.0).to(tl.float32)
        ref = tl.load(ref_ptr + b * ref_s0 + col * ref_s1, mask=hit, other=0.0).to(tl.float32)
        k = tl.where(hit, kl_value(lp - ref, in_lo, in_hi, out_lo, out_hi, EST), 0.0)
        rb = tl.load(reward_ptr + b * rw_s0, mask=has, other=0.0).to(tl.float32)
        c = coef_of(coef_ptr, coef_scalar, b, inb, COEF_MODE)
        tl.store(rw_out_ptr + out, (rb - c * k).to(rw_out_ptr.dtype.element_ty), mask=has)


@triton.jit(do_not_specialize=_SIZES)
def kl_reward_bwd_kernel(
        lp_ptr, ref_ptr, mask_ptr, coef_ptr, offsets_ptr, lengths_ptr, prompt_ptr,
        g_kl_ptr, g_rw_ptr, g_ro_ptr, g_sum_ptr, g_lp_ptr, g_ref_ptr,
        total, batch, width, lp_s0, lp_s1, ref_s0, ref_s1, mask_s0, mask_s1,
        coef_scalar, in_lo, in_hi, out_lo, out_hi, size_bucket,
        PACKED: tl.constexpr, LEFT_PAD: tl.constexpr, HAS_LENGTHS: tl.constexpr, HAS_PROMPT: tl.constexpr,
        HAS_MASK: tl.constexpr, COEF_MODE: tl.constexpr, HAS_GKL: tl.constexpr, HAS_GRW: tl.constexpr,
        HAS_GRO: tl.constexpr, HAS_GSUM: tl.constexpr, EST: tl.constexpr, STRAIGHT_THROUGH: tl.constexpr,
        FLAT: tl.constexpr, BLOCK: tl.constexpr):
    """Gradients of log_probs and ref_log_probs; 0 wherever a token is not counted.

    g = g_kl_sum[seq] + g_kl - coef * g_reward;  g_lp = g * dkl/dd;  g_ref = g_ref_out - g_lp
    """
    pid = tl.program_id(0).to(tl.int64)
    t0 = pid * BLOCK
    offs = t0 + tl.arange(0, BLOCK).to(tl.int64)
    inb = offs < total
    seq, col, pos, seq_lo, seq_hi, counted = frame(
        offsets_ptr, lengths_ptr, prompt_ptr, mask_ptr, mask_s0, mask_s1, t0, offs, inb, total, batch, width,
        PACKED, LEFT_PAD, HAS_LENGTHS, HAS_PROMPT, HAS_MASK, FLAT)
    if FLAT:
        lp_at = lp_ptr + offs
        ref_at = ref_ptr + offs
    else:
        lp_at = lp_ptr + seq * lp_s0 + col * lp_s1
        ref_at = ref_ptr + seq * ref_s0 + col * ref_s1
    d = tl.load(lp_at, mask=counted, other=0.0).to(tl.float32) - tl.load(ref_at, mask=counted, other=0.0).to(tl.float32)
    g = tl.zeros_like(d)
    if HAS_GSUM:
        g += tl.load(g_sum_ptr + seq, mask=counted, other=0.0)
    if HAS_GKL:
        g += tl.load(g_kl_ptr + offs, mask=counted, other=0.0).to(tl.float32)
    if HAS_GRW:
        g -= coef_of(coef_ptr, coef_scalar, seq, inb, COEF_MODE) * tl.load(g_rw_ptr + offs, mask=counted, other=0.0).to(tl.float32)
    g_lp = tl.where(counted, g * kl_grad(d, in_lo, in_hi, out_lo, out_hi, EST, STRAIGHT_THROUGH), 0.0)
    if HAS_GRO:
        g_ref = tl.where(counted, tl.load(g_ro_ptr + offs, mask=counted, other=0.0).to(tl.float32) - g_lp, 0.0)
    else:
        g_ref = 0.0 - g_lp
    bad = geometry_bad(offsets_ptr, lengths_ptr, prompt_ptr, seq, inb, total, batch, width, PACKED, HAS_LENGTHS,
                       HAS_PROMPT)
    g_lp = tl.where(bad, float("nan"), g_lp)
    g_ref = tl.where(bad, float("nan"), g_ref)
    tl.store(g_lp_ptr + offs, g_lp.to(g_lp_ptr.dtype.element_ty), mask=inb)
    tl.store(g_ref_ptr + offs, g_ref.to(g_ref_ptr.dtype.element_ty), mask=inb)
