"""Tile machinery both ops' Triton kernels share (no op owns it; the twin of csrc/cuda/tiles.cuh).

The flat token space (packed: ``N`` tokens; padded: ``B * T`` elements, row-major) is cut into
tiles of ``BLOCK`` elements. ``frame`` says where each element of a tile stands (its sequence,
column, position, the sequence's flat range, and whether it counts); the packed layout finds the
sequence by a binary search over ``offsets`` narrowed to the tile's own range of sequences.
``coef_of`` reads a scalar, 0-d or per-sequence coefficient; ``combine_rows`` gives a combine
program its sequences and the tiles each spans.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def last_leq(offsets_ptr, idx, lo, hi):
    """For scalar idx: the last b in [lo, hi] with offsets[b] <= idx (skips empty sequences)."""
    lo = idx * 0 + lo  # int64 scalars: loop-carried values keep one type
    hi = idx * 0 + hi
    while lo < hi:
        mid = lo + (hi - lo + 1) // 2
        if tl.load(offsets_ptr + mid) <= idx:
            lo = mid
        else:
            hi = mid - 1
    return lo


@triton.jit
def last_leq_vec(offsets_ptr, idx, lo, hi):
    """last_leq for a vector idx whose answers all lie in [lo, hi] (the tile's sequences)."""
    steps = hi * 0
    span = hi - lo
    while span > 0:
        span = span >> 1
        steps += 1
    lo_v = tl.zeros_like(idx) + lo
    hi_v = tl.zeros_like(idx) + hi
    for _ in range(steps):
        mid = lo_v + (hi_v - lo_v + 1) // 2
        go = tl.load(offsets_ptr + mid) <= idx
        lo_v = tl.where(go, mid, lo_v)
        hi_v = tl.where(go, hi_v, mid - 1)
    return lo_v


@triton.jit
def frame(offsets_ptr, lengths_ptr, prompt_ptr, mask_ptr, mask_s0, mask_s1, t0, offs, inb, total, batch, width,
           PACKED: tl.constexpr, LEFT_PAD: tl.constexpr, HAS_LENGTHS: tl.constexpr, HAS_PROMPT: tl.constexpr,
           HAS_MASK: tl.constexpr, FLAT: tl.constexpr):
    """Where each element of the tile stands: (seq, col, pos, seq_lo, seq_hi, counted).

    ``col`` is the element's column in its input row (packed: the token index, row stride 0),
    ``pos`` its position in its sequence, ``[seq_lo, seq_hi)`` the sequence's flat range and
    ``counted`` the final mask (valid, past the prompt, mask bit set).
    """
    t_last = tl.minimum(t0 + offs.shape[0], total) - 1
    if PACKED:
        # The last sequence at most (csrc/cuda/tiles.cuh's warp_seq_of): tokens past offsets[B] (bad offsets
        # ending short of the data) belong to sequence B - 1, not to B, whose outputs do not exist.
        b0 = last_leq(offsets_ptr, t0, 0, batch - 1)
        b1 = last_leq(offsets_ptr, t_last, b0, batch - 1)
        seq = last_leq_vec(offsets_ptr, tl.minimum(offs, t_last), b0, b1)
        # Clamped into [0, total] and widened to hold the element: memory-safe under any offsets (bad ones
        # are reported through the error word, kl_kernels/device_errors.py; for valid ones a no-op)
        seq_lo = tl.minimum(tl.minimum(tl.maximum(tl.load(offsets_ptr + seq), 0), total), offs)
        seq_hi = tl.maximum(tl.minimum(tl.maximum(tl.load(offsets_ptr + seq + 1), 0), total), offs + 1)
        col = offs
        pos = offs - seq_lo
        valid = inb
    else:
        # No per-element int64 division (a software routine on NVIDIA GPUs, and the padded tile's
        # biggest register cost): one scalar division for the tile's first element, then each lane's
        # offset from that row start, rel < width + BLOCK, steps over at most one row boundary when
        # width >= BLOCK, and fits int32 when width < BLOCK.
        seq0 = t0 // width
        rel = (t0 - seq0 * width) + tl.arange(0, offs.shape[0])
        if width >= offs.shape[0]:
            step = (rel >= width).to(tl.int64)
            seq = seq0 + step
            col = rel - step * width
        else:
            rel32 = rel.to(tl.int32)
            q = rel32 // width.to(tl.int32)
            seq = seq0 + q.to(tl.int64)
            col = (rel32 - q * width.to(tl.int32)).to(tl.int64)
        seq_lo = seq * width
        seq_hi = seq_lo + width
        if HAS_LENGTHS:
            length = tl.minimum(tl.maximum(tl.load(lengths_ptr + seq, mask=inb, other=0), 0), width)  # (clamped)
        else:
            length = width
        if LEFT_PAD:
            pos = col - (width - length)
        else:
            pos = col
        valid = inb & (pos >= 0) & (pos < length)
    counted = valid
    if HAS_PROMPT:
        counted = counted & (pos >= tl.load(prompt_ptr + seq, mask=inb, other=0))
    if HAS_MASK:
        if FLAT:
            m = tl.load(mask_ptr + offs, mask=counted, other=0)
        else:
            m = tl.load(mask_ptr + seq * mask_s0 + col * mask_s1, mask=counted, other=0)
        counted = counted & (m != 0)
    return seq, col, pos, seq_lo, seq_hi, counted


@triton.jit
def segment_places(seq_lo, seq_hi, t0, t_last, inb):
    """Where each lane's segment (its sequence's share of the tile) starts, ends and is written:
    (first lane, last lane, end = this lane is the segment's last, whole = the tile holds the whole
    sequence, head = the segment holds the tile's first element, tail = its last). whole, head and
    tail are per lane (every lane of the segment), not only at ``end``."""
    idx = tl.arange(0, seq_lo.shape[0])
    first = (tl.maximum(seq_lo, t0) - t0).to(tl.int32)
    last_lane = (tl.minimum(seq_hi - 1, t_last) - t0).to(tl.int32)
    end = inb & (idx == last_lane)
    whole = (seq_lo >= t0) & (seq_hi - 1 <= t_last)
    head = inb & (seq_lo <= t0)
    tail = inb & (seq_hi - 1 >= t_last)
    return first, last_lane, end, whole, head, tail


@triton.jit
def coef_of(coef_ptr, coef_scalar, seq, inb, COEF_MODE: tl.constexpr):
    if COEF_MODE == 0:
        return coef_scalar
    elif COEF_MODE == 1:
        return tl.load(coef_ptr)
    else:
        return tl.load(coef_ptr + seq, mask=inb, other=0.0)


@triton.jit
def combine_rows(offsets_ptr, batch, width, total, PACKED: tl.constexpr, TILE: tl.constexpr, BLOCK_B: tl.constexpr):
    """This combine program's sequences b: (b, in batch, flat row [lo, hi), length n, first and last
    tile k0, k1, spans = non-empty and over more than one tile)."""
    b = tl.program_id(0).to(tl.int64) * BLOCK_B + tl.arange(0, BLOCK_B).to(tl.int64)
    inb = b < batch
    if PACKED:
        # clamped into [0, total], empty where they decrease (valid offsets: unchanged)
        lo = tl.minimum(tl.maximum(tl.load(offsets_ptr + b, mask=inb, other=0), 0), total)
        hi = tl.maximum(tl.minimum(tl.maximum(tl.load(offsets_ptr + b + 1, mask=inb, other=0), 0), total), lo)
    else:
        lo = b * width
        hi = lo + width
    n = hi - lo
    k0 = lo // TILE
    k1 = (hi - 1) // TILE
    return b, inb, lo, hi, n, k0, k1, inb & (n > 0) & (k1 > k0)


@triton.jit
def later_tiles(k0, k1, spans, j0, CHUNK: tl.constexpr):
    """The combine's step over a row's later tiles: tiles ``k0 + j0 .. k0 + j0 + CHUNK - 1`` of each
    row as ``[BLOCK_B, CHUNK]`` indices and their mask (up to ``k1``). A step adds CHUNK head slots with
    one ``tl.sum`` (a fixed tree), so a row over many tiles (one 8M-token row: 8,192 tiles of 1,024) is
    a chain of span / CHUNK dependent steps instead of span; the order depends on the row alone."""
    t = k0[:, None] + j0 + tl.arange(0, CHUNK)[None, :]
    return t, spans[:, None] & (t <= k1[:, None])


@triton.jit
def geometry_bad(offsets_ptr, lengths_ptr, prompt_ptr, seq, inb, total, batch, width, PACKED: tl.constexpr,
                 HAS_LENGTHS: tl.constexpr, HAS_PROMPT: tl.constexpr):
    """Whether sequence ``seq``'s geometry is invalid (csrc/common/kl_reward_args.h's geometry_bad): its
    outputs are NaN. The value checks report such values through the device error word."""
    if PACKED:
        lo = tl.load(offsets_ptr + seq, mask=inb, other=0)
        hi = tl.load(offsets_ptr + seq + 1, mask=inb, other=0)
        bad = (lo < 0) | (hi > total) | (hi < lo) | ((seq == 0) & (lo != 0)) | ((seq == batch - 1) & (hi != total))
        # a decrease next to it moves tokens in or out of its range too
        prev = tl.load(offsets_ptr + seq - 1, mask=inb & (seq > 0), other=0)
        nxt = tl.load(offsets_ptr + seq + 2, mask=inb & (seq + 1 < batch), other=0)
        bad = bad | ((seq > 0) & (prev > lo)) | ((seq + 1 < batch) & (nxt < hi))
        length = hi - lo
    elif HAS_LENGTHS:
        length = tl.load(lengths_ptr + seq, mask=inb, other=0)
        bad = (length < 0) | (length > width)
    else:
        length = seq * 0 + width
        bad = seq < 0
    if HAS_PROMPT:
        p = tl.load(prompt_ptr + seq, mask=inb, other=0)
        bad = bad | (p < 0) | (p > length)
    return inb & bad
