"""Independent float64 oracle for kl_penalty_loss: Python floats, one token at a time.

Written from the specification (the issue, TorchRL's KLPENPPOLoss docs, verl's aggregation
names), sharing no code with kl_kernels. A batch is a list of sequences, each given by its
*valid* tokens; layouts are the harness's business.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from oracle import _clamp, _est, _est_grad, _inside

LOG_RATIO_BOUND = 20.0


@dataclass
class Seq:
    lp: list
    old: list
    adv: list            # per token (a per-sequence advantage is repeated by the harness)
    mask: list           # bool per token
    ref: list | None = None
    ent: list | None = None
    beta: float = 1.0
    w: list | None = None  # per-token weights (policy term; the KL term too with weight_kl)


@dataclass
class Result:
    loss: float
    loss_objective: float
    loss_kl: float
    loss_entropy: float
    kl_mean: float
    ratio_mean: float
    clip_fraction: float
    num_tokens: int
    grad_lp: list        # per sequence, per valid token: d loss / d lp
    grad_ent: list       # per sequence, per valid token: d loss / d entropy
    token_loss: list     # per sequence, per valid token: loss_t (0 where not counted)
    grad_mag: list = None  # per sequence, per valid token: the sum of |terms| of grad_lp (its rounding scale)
    # TRL's clip metrics (grpo_trainer.py _compute_loss): a counted token is low-clipped when ratio < 1 - eps_lo and
    # A < 0, high-clipped when ratio > 1 + eps_hi and A > 0 (never without a clip). Per sequence, (sure, near): the
    # tokens whose float64 ratio decides the flag, and those within float32 rounding of a bound (either is right)
    seq_low: list = None
    seq_high: list = None
    seq_num_tokens: list = None
    entropy_mean: float = 0.0  # the mean of the entropy over counted tokens (0 without entropy: the caller's NaN)


# |ratio - bound| below this (relative) is within the kernels' float32 rounding of the ratio (GSPO's mean too)
FLAG_BAND = 3e-5


def clip_flags(ratio: float, a: float, clip) -> tuple:
    """((low, high), (low_near, high_near)) of one counted token: TRL's is_low_clipped / is_high_clipped, and
    whether the float64 ratio lies so near the bound that float32 math may decide the other way."""
    if clip is None:
        return (False, False), (False, False)
    lo, hi = clip
    near = [abs(ratio - bound) <= FLAG_BAND * (1.0 + abs(ratio)) for bound in (lo, hi)]
    return (ratio < lo and a < 0, ratio > hi and a > 0), (near[0] and a < 0, near[1] and a > 0)


def token_terms(s: Seq, t: int, *, estimator, clip, dual_clip=None, weight_kl=False, clamp_input=None,
                clamp_output=None, lr=None, kl_times_ratio=False, objective="ppo", ratio_cap=None,
                sapo_temperatures=(1.0, 1.05)):
    """(obj, kl, ent, ratio, clipped, dobj/dlp, dkl/dlp, |terms of dkl/dlp|) of one counted token. ``lr``: the log-ratio
    to use instead of the token's lp - old (GSPO: its sequence's), with d lr / d lp = 1 (GSPO-token)."""
    lr = s.lp[t] - s.old[t] if lr is None else lr
    lrc = min(max(lr, -LOG_RATIO_BOUND), LOG_RATIO_BOUND)
    inside_lr = 1.0 if -LOG_RATIO_BOUND <= lr <= LOG_RATIO_BOUND else 0.0
    ratio = math.exp(lrc)
    a = s.adv[t]
    gain = ratio * a
    if clip is None:
        obj, clipped, w = -gain, False, 1.0
    else:
        lo, hi = clip
        gain_c = min(max(ratio, lo), hi) * a
        if gain <= gain_c:
            obj, clipped, w = -gain, False, 1.0
        else:
            obj, clipped, w = -gain_c, True, (1.0 if lo <= ratio <= hi else 0.0)
    dobj = -a * ratio * inside_lr * w
    if dual_clip is not None and a < 0 and -a * dual_clip < obj:  # dual-clip PPO: a constant cap, no gradient
        obj, dobj = -a * dual_clip, 0.0
    if objective == "cispo":  # TRL 1.16: -clamp(coef_1, max=epsilon_high).detach() * advantages * per_token_logps
        c = min(ratio, ratio_cap)
        obj, dobj, clipped = -c * a * s.lp[t], -c * a, ratio > ratio_cap and a > 0
    elif objective == "sapo":  # TRL 1.16: -sigmoid(tau * (coef_1 - 1)) * 4 / tau * advantages, tau by A's sign
        tau = sapo_temperatures[0] if a > 0 else sapo_temperatures[1]
        sg = 1.0 / (1.0 + math.exp(-tau * (ratio - 1.0)))
        obj, dobj, clipped = -sg * 4.0 / tau * a, -4.0 * a * ratio * sg * (1.0 - sg) * inside_lr, False
    wt = s.w[t] if s.w is not None else 1.0
    obj, dobj = wt * obj, wt * dobj
    if s.ref is not None:
        d, sign = s.lp[t] - s.ref[t], 1.0
    else:
        d, sign = s.old[t] - s.lp[t], -1.0
    base = estimator.rstrip("+")
    x = _clamp(d, clamp_input)  # the KL's clamps, as kl_reward's (oracle.py)
    e_raw = _est(x, base)
    kl = _clamp(e_raw, clamp_output)
    dkl = sign * (d if estimator.endswith("+") else
                  _inside(e_raw, clamp_output) * _est_grad(x, base) * _inside(d, clamp_input))
    dkl_mag = abs(dkl)
    if kl_times_ratio:  # ratio * kl, by the product rule (the ratio's derivative: ratio, 0 outside its clamp)
        # (the two products can cancel exactly, e.g. abs+ below the reference: float32 keeps ~ulp of each)
        kl, dkl, dkl_mag = ratio * kl, ratio * dkl + inside_lr * ratio * kl, abs(ratio * dkl) + abs(ratio * kl)
    if weight_kl:
        kl, dkl, dkl_mag = wt * kl, wt * dkl, abs(wt) * dkl_mag
    ent = s.ent[t] if s.ent is not None else 0.0
    return obj, kl, ent, ratio, clipped, dobj, dkl, dkl_mag


def oracle_weights(counts: list, aggregation: str, *, norm_length=None, global_tokens=None, global_seqs=None,
                   num_sequences=None):
    """``b -> w_b`` of an aggregation (the issue's table; verl 0.9.1's ``agg_loss`` for the seq-mean modes with
    ``num_sequences="nonempty"``, TRL's loss types otherwise), from the per-sequence token counts."""
    n_tok = sum(counts) if global_tokens is None else global_tokens
    if global_seqs is not None:
        n_seq = global_seqs
    elif num_sequences == "nonempty":
        n_seq = sum(1 for c in counts if c > 0)
    elif num_sequences is not None:
        n_seq = int(num_sequences)
    else:
        n_seq = len(counts)

    def weight(b):
        if aggregation == "token-mean":
            return 1.0 / max(n_tok, 1)
        if aggregation == "seq-mean-token-mean":
            return 1.0 / (max(counts[b], 1) * max(n_seq, 1))
        if aggregation == "seq-mean-token-sum":
            return 1.0 / max(n_seq, 1)
        if aggregation == "seq-mean-token-sum-norm":
            return 1.0 / (max(n_seq, 1) * norm_length)
        if aggregation == "token-sum-norm":
            return 1.0 / norm_length
        if aggregation in ("sum", "none"):
            return 1.0
        raise AssertionError(aggregation)
    return weight


def oracle_loss(seqs: list, *, estimator="k1", clip=None, entropy_coef=0.0, aggregation="token-mean",
                norm_length=None, global_tokens=None, global_seqs=None, dual_clip=None, weight_kl=False,
                clamp_input=None, clamp_output=None, importance_sampling_level="token",
                kl_times_ratio=False, kl_aggregation=None, entropy_aggregation=None, num_sequences=None,
                objective="ppo", ratio_cap=None, sapo_temperatures=(1.0, 1.05)) -> Result:
    """The loss of a batch. ``global_tokens`` / ``global_seqs`` replace the local counts (data parallel).
    ``kl_aggregation`` / ``entropy_aggregation`` weigh the KL / entropy terms their own way (None: as
    ``aggregation``); ``num_sequences`` is B: None (every sequence), ``"nonempty"`` or a count.
    ``importance_sampling_level="sequence"`` (GSPO, from the paper and verl's ``compute_policy_loss_gspo``):
    every counted token's log-ratio is its sequence's mean of lp - old over counted tokens."""
    per_seq = []
    for s in seqs:
        lr = None
        if importance_sampling_level == "sequence":
            diffs = [s.lp[t] - s.old[t] for t in range(len(s.lp)) if s.mask[t]]
            total = math.fsum(diffs) if all(map(math.isfinite, diffs)) else sum(diffs)
            lr = total / max(len(diffs), 1)
        rows = []
        for t in range(len(s.lp)):
            if not s.mask[t]:
                rows.append(None)
                continue
            rows.append(token_terms(s, t, estimator=estimator, clip=clip, dual_clip=dual_clip, weight_kl=weight_kl,
                                    clamp_input=clamp_input, clamp_output=clamp_output, lr=lr,
                                    kl_times_ratio=kl_times_ratio, objective=objective, ratio_cap=ratio_cap,
                                    sapo_temperatures=sapo_temperatures))
        per_seq.append(rows)
    counts = [sum(r is not None for r in rows) for rows in per_seq]
    weight = oracle_weights(counts, aggregation, norm_length=norm_length, global_tokens=global_tokens,
                            global_seqs=global_seqs, num_sequences=num_sequences)
    weight_kl = oracle_weights(counts, kl_aggregation or aggregation, norm_length=norm_length,
                               global_tokens=global_tokens, global_seqs=global_seqs, num_sequences=num_sequences)
    weight_ent = oracle_weights(counts, entropy_aggregation or aggregation, norm_length=norm_length,
                                global_tokens=global_tokens, global_seqs=global_seqs, num_sequences=num_sequences)

    obj_terms, kl_terms, ent_terms, grads, grads_ent, token_loss, mags = [], [], [], [], [], [], []
    kl_sum = ratio_sum = clip_sum = ent_sum = 0.0
    seq_low, seq_high = [], []
    for b, (s, rows) in enumerate(zip(seqs, per_seq)):
        w, wk, we = weight(b), weight_kl(b), weight_ent(b)
        g, ge, tl, gm = [], [], [], []
        low, high = [0, 0], [0, 0]  # (sure, near)
        for t, r in enumerate(rows):
            if r is None:
                g.append(0.0), ge.append(0.0), tl.append(0.0), gm.append(0.0)
                continue
            flag_bounds = (-math.inf, ratio_cap) if objective == "cispo" else None if objective == "sapo" else clip
            (is_low, is_high), (low_near, high_near) = clip_flags(r[3], s.adv[t], flag_bounds)
            low[0 if not low_near else 1] += 1 if (is_low or low_near) else 0
            high[0 if not high_near else 1] += 1 if (is_high or high_near) else 0
            obj, kl, ent, ratio, clipped, dobj, dkl, dkl_mag = r
            obj_terms.append(w * obj)
            kl_terms.append(wk * s.beta * kl)
            ent_terms.append(-we * entropy_coef * ent)
            g.append(w * dobj + wk * s.beta * dkl)
            gm.append(abs(w * dobj) + abs(wk * s.beta) * dkl_mag)
            ge.append(-we * entropy_coef)
            tl.append(obj + s.beta * kl - entropy_coef * ent)
            kl_sum += kl
            ratio_sum += ratio
            clip_sum += clipped
            ent_sum += ent
        grads.append(g), grads_ent.append(ge), token_loss.append(tl), mags.append(gm)
        seq_low.append(tuple(low)), seq_high.append(tuple(high))

    def total(xs):
        return math.fsum(xs) if all(map(math.isfinite, xs)) else sum(xs)

    lo, lk, le = total(obj_terms), total(kl_terms), total(ent_terms)
    n_local = sum(counts)
    denom = max(n_local, 1)  # diagnostics: over these tokens (the harness passes the union for process groups)
    return Result(lo + lk + le, lo, lk, le, kl_sum / denom, ratio_sum / denom, clip_sum / denom, n_local, grads,
                  grads_ent, token_loss, mags, seq_low, seq_high, counts, ent_sum / denom)
