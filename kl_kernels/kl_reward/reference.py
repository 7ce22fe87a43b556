"""The torch reference of ``kl_reward``: the semantics every fused kernel must match.

Vectorized torch ops only (no Python loop over sequences), both native layouts, any float
dtype: with float64 inputs the math runs in float64. It is also the ``"torch"`` backend, and
gradients come from autograd through exactly these formulas.

Per token ``t`` of sequence ``b`` (``d = log_probs - ref_log_probs``)::

    m_t     = valid_t and mask_t and (pos_t >= prompt_lens[b])     # final mask
    x_t     = clamp(d_t, *clamp_input)                            # if given
    e_t     = est(x_t)          k1: x   abs: |x|   k2: x^2/2   k3: expm1(-x) + x
    e_t     = clamp(e_t, *clamp_output)                           # if given
    kl_t    = e_t if m_t else 0                                   # exactly 0, even for NaN inputs
    reward_t = R_t - c_b * kl_t                                   # R per the placement
    kl_sum_b = sum_t kl_t (float32)      count_b = sum_t m_t

Placements: ``"token"`` ``R_t = reward_t``; ``"sequence"`` ``R_t = reward_b`` on every position of the
row; ``"last"`` ``R_t = reward_b`` on the last counted token of ``b`` (the last valid token if none
is counted; dropped for an empty sequence), 0 elsewhere; ``"last_valid"`` the same on the last valid
token of ``b``, counted or not; no reward: ``R_t = 0``.

Backward (what autograd computes here and the kernels implement): with
``g_t = grad_kl_t + grad_kl_sum_b - c_b * grad_reward_t`` and ``m_t`` true,

    dL/dlog_probs_t     =  g_t * est'(d_t)
    dL/dref_log_probs_t = -g_t * est'(d_t) + grad_ref_out_t

where ``est'`` is the derivative through both clamps (0 outside ``[lo, hi]``, boundaries
included as ``torch.clamp``): k1 ``1``, abs ``sign(x)``, k2 ``x``, k3 ``1 - exp(-x)``. The
straight-through variants ``k1+``, ``abs+``, ``k3+`` keep their forward value but use the k2
gradient of the *unclamped* difference, ``est'(d) = d`` (verl's convention). Non-counted tokens
get zero gradient. Reward and coef are data: no gradient flows to them.
"""

from __future__ import annotations

import torch

from .. import ragged
# The building blocks both ops' references use (kl_kernels/reference_math.py), under this module's old names.
from ..reference_math import estimate, straight_through  # noqa: F401
from ..reference_math import checked_frame as _checked_frame
from ..reference_math import final_mask as _final_mask
from ..reference_math import poison as _poison
from .problem import STRAIGHT_THROUGH, KLRewardProblem, RawOutputs


def _last_token(p: KLRewardProblem, m, valid, seq):
    """Bool, per token: is it where a per-sequence reward goes under ``placement="last"`` (the last
    counted token, else the last valid one) or ``"last_valid"`` (the last valid token)."""
    by_mask = p.placement == "last"
    if p.layout == "padded":
        batch, width = m.shape
        if width == 0:
            return torch.zeros_like(m)
        col = torch.arange(width, device=m.device)
        last_counted = torch.where(m, col, -1).amax(1)
        if p.lengths is None:
            last_valid = torch.full((batch,), width - 1, device=m.device)
        elif p.padding_side == "right":
            last_valid = p.lengths - 1
        else:
            last_valid = torch.where(p.lengths > 0, width - 1, -1)
        last = torch.where(last_counted >= 0, last_counted, last_valid) if by_mask else last_valid
        return col == last.unsqueeze(1)
    tok = torch.arange(m.shape[0], device=m.device)
    batch = p.batch_size
    last_counted = torch.full((batch,), -1, device=m.device, dtype=torch.int64).scatter_reduce(
        0, seq, torch.where(m, tok, -1), "amax")
    lengths = ragged.offsets_to_lengths(p.offsets)
    last_valid = torch.where(lengths > 0, p.offsets[1:] - 1, -1)
    last = torch.where(last_counted >= 0, last_counted, last_valid) if by_mask else last_valid
    return tok == last[seq]


def kl_reward_reference(p: KLRewardProblem) -> RawOutputs:
    """Compute ``kl_reward`` on a normalized problem with torch ops (see the module doc)."""
    md = p.math_dtype
    frame = _checked_frame(p)
    valid, pos, per_seq, seq = frame[:4]
    m = _final_mask(p, valid, pos, per_seq)

    # Zero the difference outside the mask *before* the estimator: padding may hold NaN/inf,
    # and where() alone would still send NaN * 0 gradients back through those positions.
    d = torch.where(m, p.log_probs.to(md) - p.ref_log_probs.to(md), 0.0)
    x = torch.clamp(d, *p.clamp_input) if p.clamp_input is not None else d
    value = estimate(x, p.estimator)
    if p.clamp_output is not None:
        value = torch.clamp(value, *p.clamp_output)
    if p.estimator in STRAIGHT_THROUGH and torch.is_grad_enabled():
        value = straight_through(value, d)  # forward: exactly `value`; backward: d
    # a sequence with bad offsets / lengths / prompt_lens (accelerator tensors: recorded in the error word,
    # raised later) gets NaN, as from the fused kernels; frame.bad is None when the host checked them
    kl = _poison(torch.where(m, value, 0.0), frame.bad, per_seq)

    if p.layout == "padded":
        kl_sum = kl.sum(1)
        count = m.sum(1)
    else:
        # segment_reduce accumulates sequentially: in float32 a 70k-token row drifts by ~1e-4
        # relative, so the reference accumulates in float64 and stores float32.
        kl_sum = torch.segment_reduce(kl.to(torch.float64), "sum", offsets=frame.offsets).to(md)
        count = torch.zeros(p.batch_size, dtype=torch.int64, device=p.device).index_add_(0, seq, m.to(torch.int64))

    coef = p.coef
    if isinstance(coef, torch.Tensor):
        coef = coef.to(md) if coef.dim() == 0 else per_seq(coef.to(md))
    penalty = coef * kl
    if p.placement is None:
        reward = -penalty
    elif p.placement == "token":
        reward = p.reward.to(md) - penalty
    elif p.placement == "sequence":
        reward = per_seq(p.reward.to(md)) - penalty
    else:  # "last", "last_valid"
        reward = torch.where(_last_token(p, m, valid, seq), per_seq(p.reward.to(md)), 0.0) - penalty

    ref_out = _poison(torch.where(m, p.ref_log_probs, 0.0), frame.bad, per_seq) if p.return_ref else None
    kl_sum = _poison(kl_sum, frame.bad, None)  # (an empty bad sequence too)
    return RawOutputs(kl.to(p.log_probs.dtype), reward.to(p.reward_dtype), ref_out, kl_sum, count)
