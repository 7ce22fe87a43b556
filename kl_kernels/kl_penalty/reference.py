"""The torch reference of ``kl_penalty_loss``: the semantics every fused kernel must match.

Vectorized torch ops only, both native layouts, any float dtype (float64 inputs: float64 math).
It is also the ``"torch"`` backend: gradients come from autograd through exactly these formulas.

Per token ``t`` of sequence ``b`` with ``m_t`` the final mask (valid and in ``mask``)::

    r_t      = clamp(lr_t, -20, 20)                     ratio_t = exp(r_t)
    lr_t     = lp_t - old_t, or (GSPO) s_b, the sequence's mean lp - old over its counted tokens,
               with d lr_t / d lp_t = 1 (:func:`sequence_log_ratio`)
    gain_t   = ratio_t * A_t                            A per token or per sequence
    clip_t   = clamp(ratio_t, 1 - eps_lo, 1 + eps_hi) * A_t      (= gain_t without clip_epsilon)
    pg_t     = -(gain_t if gain_t <= clip_t else clip_t)         (PPO's pessimistic min)
    obj_t    = w_t * (-A_t * c if A_t < 0 and -A_t * c < pg_t else pg_t)   (dual clip c; none: pg_t)
    d_t      = lp_t - ref_t  (ref_log_probs given: KL(new || ref))
             = old_t - lp_t  (otherwise: TorchRL's KL(old || new), sampled from the old policy)
    kl_t     = v_t * q_t * clamp(est(clamp(d_t, clamp_input)), clamp_output)   k1 d, abs |d|, k2 d^2/2,
               k3 expm1(-d) + d (bounds optional); "+": k2's gradient at the unclamped d
    w_t      = the token's weight (1 without ``weights``); v_t = w_t with ``weight_kl``, else 1
    q_t      = ratio_t with ``kl_times_ratio`` (differentiated), else 1
    loss_t   = m_t * (obj_t + beta_b * kl_t - entropy_coef * entropy_t)

and per sequence the sums of ``loss_t``, ``obj_t``, ``kl_t``, ``entropy_t``, ``ratio_t``, of the
clipped indicator ``[not gain_t <= clip_t]`` (the token took the clipped branch; a NaN gain counts as
clipped) and of TRL's low / high clip flags ``[ratio_t < 1 - eps_lo and A_t < 0]`` /
``[ratio_t > 1 + eps_hi and A_t > 0]`` over counted tokens (accumulated in float64), with the count
(:data:`STAT_COLUMNS`).
``aggregate.py`` turns these into the loss. The gradient reaching ``lp_t`` (what the fused kernels
store in their one gradient buffer) is::

    dloss_t/dlp_t = m_t * (w_t * [not dual_t] * -A_t ratio_t [|lp_t - old_t| <= 20] u_t + beta_b * s * v_t * est'(d_t))
    u_t = 1 if gain_t <= clip_t else [1 - eps_lo <= ratio_t <= 1 + eps_hi]     s = +1 (ref) / -1 (old)

(``kl_times_ratio``: the KL part is ``beta_b * v_t * (ratio_t s est'(d_t) + [|lr_t| <= 20] ratio_t est(d_t))``.)

Non-counted tokens contribute nothing and get zero gradient, whatever they hold (NaN included).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..codes import STRAIGHT_THROUGH
from ..reference_math import (checked_frame, estimate, final_mask, poison, straight_through, token_frame,
                              value_with_gradient_of)
from .problem import LOG_RATIO_BOUND, KLPenaltyProblem

# The per-sequence sums every backend returns next to the loss (``RawLoss.stats``), in this order: the table the
# kernels' ``kStatColumns`` (csrc/common/kl_penalty_args.h; the extensions export it, tests/test_kl_penalty_diagnostics.py
# compares) and the Triton kernels' ``STATS`` stride follow. ``clipped``: the clipped branch was taken
# (``not gain <= clip``, a NaN gain counts); ``clipped_low`` / ``clipped_high``: TRL's is_low_clipped
# (``ratio < 1 - eps_lo and A < 0``) / is_high_clipped (``ratio > 1 + eps_hi and A > 0``), on the unweighted ratio.
STAT_COLUMNS = ("objective", "kl", "entropy", "ratio", "clipped", "clipped_low", "clipped_high")


class RawLoss(NamedTuple):
    """What a backend returns, before aggregation.

    * ``seq_loss [B]``: per-sequence sum of ``loss_t`` (math dtype; carries the gradient).
    * ``stats [B, len(STAT_COLUMNS)]``: per-sequence sums of :data:`STAT_COLUMNS` (no gradient).
    * ``count [B]``: int64 counted tokens.
    * ``token_out``: ``None``, or (``aggregation="none"``) ``[4, *shape]`` per-token ``loss_t``
      (carries the gradient), ``obj_t``, ``beta_b * kl_t``, ``-entropy_coef * entropy_t``.
    """

    seq_loss: torch.Tensor
    stats: torch.Tensor
    count: torch.Tensor
    token_out: torch.Tensor | None


def per_sequence_sum(p: KLPenaltyProblem, x: torch.Tensor, seq) -> torch.Tensor:
    """Sum of a per-token tensor over each sequence, accumulated in float64 (a 70k-token row in
    float32 would drift), returned in float64."""
    if p.layout == "padded":
        return x.to(torch.float64).sum(1)
    out = torch.zeros(p.batch_size, dtype=torch.float64, device=x.device)
    return out.index_add(0, seq, x.to(torch.float64))


def kl_penalty_reference(p: KLPenaltyProblem) -> RawLoss:
    """``kl_penalty_loss``'s per-token terms and per-sequence sums with torch ops (module doc)."""
    md = p.math_dtype
    frame = checked_frame(p)
    valid, pos, per_seq, seq = frame[:4]
    m = final_mask(p, valid, pos, per_seq)

    def tok(x):  # a per-token input in the math dtype, zeroed outside the mask (padding may be NaN)
        return torch.where(m, x.to(md), 0.0)

    lp = p.log_probs.to(md)
    old = tok(p.old_log_probs)
    adv = tok(per_seq(p.advantages) if p.adv_per_seq else p.advantages)
    log_ratio = torch.where(m, lp, 0.0) - old
    if p.importance_sampling_level == "sequence":  # GSPO: the sequence's value, the token's gradient (d/dlp = 1)
        log_ratio = value_with_gradient_of(torch.where(m, per_seq(sequence_log_ratio(p)), 0.0), log_ratio)
    ratio = torch.exp(torch.clamp(log_ratio, -LOG_RATIO_BOUND, LOG_RATIO_BOUND))
    gain = ratio * adv
    if p.objective == "cispo":  # TRL's: -min(ratio, cap).detach() * A * lp (the log-prob's own gradient)
        obj = -torch.clamp(ratio, max=p.ratio_cap).detach() * adv * torch.where(m, lp, 0.0)
        clipped = clipped_high = (ratio > p.ratio_cap) & (adv > 0)  # TRL's cispo_clip_ratio flag
        clipped_low = torch.zeros_like(m)
    elif p.objective == "sapo":  # TRL's: -sigmoid(tau (ratio - 1)) * 4 / tau * A, tau by the sign of A
        tau = torch.where(adv > 0, adv.new_tensor(p.sapo_temperatures[0]), adv.new_tensor(p.sapo_temperatures[1]))
        obj = -torch.sigmoid(tau * (ratio - 1)) * 4 / tau * adv
        clipped = clipped_low = clipped_high = torch.zeros_like(m)
    elif p.clip is not None:
        gain_clipped = torch.clamp(ratio, *p.clip) * adv
        take = gain <= gain_clipped  # NaN: False, as the kernels
        obj = -torch.where(take, gain, gain_clipped)
        clipped = ~take
        clipped_low = (ratio < p.clip[0]) & (adv < 0)
        clipped_high = (ratio > p.clip[1]) & (adv > 0)
    else:
        obj = -gain
        clipped = clipped_low = clipped_high = torch.zeros_like(m)
    if p.dual_clip is not None:  # for A < 0, at most -A * c; the cap carries no gradient
        cap = -adv * p.dual_clip
        obj = torch.where((adv < 0) & (cap < obj), cap.detach(), obj)
    wts = tok(p.weights) if p.weights is not None else None
    if wts is not None:
        obj = wts * obj

    other = tok(p.ref_log_probs) if p.ref_log_probs is not None else old
    d = torch.where(m, lp, 0.0) - other if p.ref_log_probs is not None else other - torch.where(m, lp, 0.0)
    x = torch.clamp(d, *p.clamp_input) if p.clamp_input is not None else d
    kl = estimate(x, p.estimator)
    if p.clamp_output is not None:
        kl = torch.clamp(kl, *p.clamp_output)
    if p.estimator in STRAIGHT_THROUGH and torch.is_grad_enabled():
        kl = straight_through(kl, d)  # value: the (clamped) estimator; gradient: d (k2's, unclamped)
    if p.kl_times_ratio:  # differentiated through the ratio too (its clamp's gradient mask included)
        kl = ratio * kl
    if p.weight_kl:
        kl = wts * kl

    beta = p.beta
    if isinstance(beta, torch.Tensor):
        beta = beta.to(md) if beta.dim() == 0 else per_seq(beta.to(md))
    ent = tok(p.entropy) if p.entropy is not None else None
    penalty = beta * kl
    loss = obj + penalty - p.entropy_coef * ent if ent is not None else obj + penalty
    zero = torch.zeros((), dtype=md, device=p.device)
    # a sequence with bad offsets / lengths (accelerator tensors: recorded in the error word, raised later) gets
    # NaN, as from the fused kernels; frame.bad is None when the host checked them
    loss, obj, kl, penalty = (poison(torch.where(m, x, zero), frame.bad, per_seq) for x in (loss, obj, kl, penalty))

    def sums(x):
        return poison(per_sequence_sum(p, x, seq).to(md), frame.bad, None)

    with torch.no_grad():
        ent_sum = sums(ent) if ent is not None else torch.zeros(p.batch_size, dtype=md, device=p.device)
        ratio_m = torch.where(m, ratio, zero)
        stats = torch.stack([sums(obj), sums(kl), ent_sum, sums(ratio_m)]
                            + [sums((flag & m).to(md)) for flag in (clipped, clipped_low, clipped_high)], dim=1)
        count = m.sum(1) if p.layout == "padded" else torch.zeros(
            p.batch_size, dtype=torch.int64, device=p.device).index_add_(0, seq, m.to(torch.int64))
    token_out = None
    if p.aggregation == "none":
        ent_term = -p.entropy_coef * ent if ent is not None else torch.zeros_like(obj)
        token_out = torch.stack([loss, obj.detach(), penalty.detach(), ent_term.detach()])
    return RawLoss(sums(loss), stats, count, token_out)


def sequence_log_ratio(p: KLPenaltyProblem) -> torch.Tensor:
    """GSPO's sequence log-ratio ``s_b = sum_t m_t (lp_t - old_t) / max(n_b, 1)`` over the counted tokens
    (``m_t``, ``n_b`` of them), detached, ``[B]`` contiguous in the math dtype (float32, or float64 for
    float64 math), summed in float64 per sequence (per-sequence sums, not differences of prefix sums:
    a NaN or inf at a counted token makes its own sequence's ``s_b`` NaN or inf, no other). Torch ops on the device, no host read: the
    reference's, and what the GPU backends' kernels read (the CPU kernel has its own pre-pass,
    ``kl_penalty_sequence_log_ratio``, summing the same terms in another order)."""
    with torch.no_grad():
        d = p.log_probs.to(torch.float64) - p.old_log_probs.to(torch.float64)
        if p.layout == "padded":
            valid, pos, per_seq, _ = token_frame(p)
            m = final_mask(p, valid, pos, per_seq)
            d = torch.where(m, d, 0.0)
            total, n = d.sum(1), m.sum(1)
        else:  # per-sequence sums by index_add (traceable, a static output size; no host read)
            _, _, _, seq = token_frame(p)
            if p.mask is not None:
                d = torch.where(p.mask, d, 0.0)
                n = torch.zeros(p.batch_size, dtype=torch.int64, device=d.device).index_add_(
                    0, seq, p.mask.to(torch.int64))
            else:
                n = p.offsets[1:] - p.offsets[:-1]
            total = torch.zeros(p.batch_size, dtype=torch.float64, device=d.device).index_add_(0, seq, d)
        return (total / n.clamp_min(1)).to(p.math_dtype).contiguous()
