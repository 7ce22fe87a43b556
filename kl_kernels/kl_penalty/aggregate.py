"""From per-sequence sums to the loss: the aggregations, data parallelism and diagnostics.

Every backend returns the same :class:`~kl_kernels.kl_penalty.reference.RawLoss` (per-sequence
sums ``S_b`` and counts ``n_b``); the loss is ``sum_b w_b * S_b`` with per-sequence weights ``w_b``
that depend only on counts, never on values, so they carry no gradient:

==========================  ===============================  ============================================
aggregation                 ``w_b``                          meaning
==========================  ===============================  ============================================
``token-mean``              ``1 / N``                        mean over counted tokens (N: all ranks')
``seq-mean-token-mean``     ``1 / (max(n_b, 1) * B)``        mean over sequences of their token mean
``seq-mean-token-sum``      ``1 / B``                        mean over sequences of their token sum
``seq-mean-token-sum-norm`` ``1 / (B * norm_length)``        mean over sequences of their token sum over a
                                                             constant length (Dr. GRPO; verl 0.9.1, TRL's
                                                             ``dr_grpo``)
``token-sum-norm``          ``1 / norm_length``              token sum over a constant length (verl <= 0.4's
                                                             ``seq-mean-token-sum-norm``: no division by B)
``sum``                     ``1``                            plain sum
==========================  ===============================  ============================================

``B`` is ``num_sequences``: every sequence of the batch by default (an empty one adds 0 to the
numerator: TorchRL, verl <= 0.4, TRL), ``"nonempty"`` for the sequences with a counted token
(verl 0.9.1), or the caller's count. Every count is at least 1 in a denominator.

The policy, KL and entropy terms may each take their own aggregation (``kl_aggregation``,
``entropy_aggregation``; OpenRLHF token-means the KL and entropy terms of a sequence-level policy
loss, TRL the entropy bonus): ``loss = sum_b (w_b S_obj_b + w'_b beta_b S_kl_b - w''_b c S_ent_b)``.
Such a call (:func:`run_split`) counts the tokens of each sequence before the kernel, runs it with
``beta_b * w'_b / w_b`` as the per-sequence KL coefficient (one fused pass and one gradient buffer
still serve both terms: every ``w_b > 0``) and sums the entropy term, which has no fused math, with
torch ops.

With data parallelism (``num_global_tokens``, ``num_sequences`` or ``process_group``) ``N`` and
``B`` are the totals over all ranks, so each rank's loss is its share: **the sum over ranks equals
the loss of the union batch**, and so do the gradients (each rank's gradient is the union's,
restricted to its tokens). Under DDP, which averages gradients over ``W`` ranks, scale the loss by
``W`` to train on the union's loss. An empty union (``N = 0`` or ``B = 0``) gives a loss of 0.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from dataclasses import replace

from ..layouts import TokenLayout
from ..reference_math import final_mask, token_frame
from .problem import KLPenaltyProblem, _aggregations
from .reference import STAT_COLUMNS, RawLoss, per_sequence_sum

# The aggregated values of KLPenaltyLossOutput besides the loss and the count, in the order the kernels write
# them (``kResults``, csrc/common/kl_penalty_args.h's finalize_aggregation; the Triton totals kernel)
RESULT_FIELDS = ("loss_objective", "loss_kl", "loss_entropy", "kl_mean", "ratio_mean", "clip_fraction",
                 "clip_low_fraction", "clip_high_fraction", "entropy_mean")


class KLPenaltyLossOutput(NamedTuple):
    """Result of :func:`kl_kernels.kl_penalty_loss`.

    * ``loss``: the aggregated loss (0-d; per-token in the caller's layout for ``"none"``), with
      gradient to ``log_probs`` (and ``entropy``).
    * ``loss_objective``, ``loss_kl``, ``loss_entropy``: its parts (same aggregation, detached):
      ``loss = loss_objective + loss_kl + loss_entropy``.
    * ``kl_mean``, ``ratio_mean``, ``clip_fraction``: means over counted tokens (detached; over all
      ranks when ``process_group`` is given, else over this call's tokens). ``kl_mean`` is the mean
      of the KL term as the loss weighs it by beta: times the ratio with ``kl_times_ratio``, times
      the weights with ``weight_kl``, after ``clamp_output``.
    * ``num_tokens``: int64 0-d count of counted tokens (all ranks' with ``process_group``).
    * ``clip_low_fraction``, ``clip_high_fraction``: means over counted tokens (reduced as
      ``clip_fraction``) of TRL's clip flags ``[ratio_t < 1 - eps_lo and A_t < 0]`` and
      ``[ratio_t > 1 + eps_hi and A_t > 0]`` on the unweighted ratio (0 without ``clip_epsilon``).
    * ``entropy_mean``: the mean of ``entropy`` over counted tokens (reduced likewise), whatever
      ``entropy_coef``; 0 when no ``entropy`` is given (as ``loss_entropy``).
    * ``seq_num_tokens``: int64 ``[B]``, each sequence's counted tokens, and ``sequence_stats``:
      ``[B, len(STAT_COLUMNS)]`` (float32; float64 for the float64 reference), each sequence's sums of
      :data:`~kl_kernels.kl_penalty.reference.STAT_COLUMNS` over its counted tokens (``objective``,
      ``kl``, ``entropy``, ``ratio``, ``clipped``, ``clipped_low``, ``clipped_high``), of this call only
      (never all-reduced). Properties (float32 ``[B]`` views, made when read):
      ``seq_clipped_low``, ``seq_clipped_high``: each sequence's low / high clipped tokens, what
      TRL's per-sequence clip metrics (``clip_ratio/low_min``, ``high_max``) are made of.
    """

    loss: object
    loss_objective: object
    loss_kl: object
    loss_entropy: object
    kl_mean: torch.Tensor
    ratio_mean: torch.Tensor
    clip_fraction: torch.Tensor
    num_tokens: torch.Tensor
    clip_low_fraction: torch.Tensor
    clip_high_fraction: torch.Tensor
    entropy_mean: torch.Tensor
    seq_num_tokens: torch.Tensor
    sequence_stats: torch.Tensor

    @property
    def seq_clipped_low(self) -> torch.Tensor:
        """float32 ``[B]``: each sequence's low-clipped counted tokens (``ratio < 1 - eps_lo``, ``A < 0``)."""
        return self.sequence_stats.select(1, _LOW).to(torch.float32)

    @property
    def seq_clipped_high(self) -> torch.Tensor:
        """float32 ``[B]``: each sequence's high-clipped counted tokens (``ratio > 1 + eps_hi``, ``A > 0``)."""
        return self.sequence_stats.select(1, _HIGH).to(torch.float32)


# Where the clip flags' sums sit in the stats (reference.STAT_COLUMNS)
_LOW, _HIGH = STAT_COLUMNS.index("clipped_low"), STAT_COLUMNS.index("clipped_high")


def make_output(loss, rest: torch.Tensor, num_tokens: torch.Tensor, stats: torch.Tensor,
                count: torch.Tensor) -> KLPenaltyLossOutput:
    """The output from the aggregated values: ``rest`` (the :data:`RESULT_FIELDS` in order, [9]),
    ``num_tokens`` (0-d int64) and this call's per-sequence ``stats`` ([B, len(STAT_COLUMNS)]) and
    ``count`` ([B] int64)."""
    obj, kl, ent, kl_mean, ratio_mean, clip, low, high, ent_mean = rest.unbind()
    return KLPenaltyLossOutput(loss, obj, kl, ent, kl_mean, ratio_mean, clip, num_tokens, low, high, ent_mean, count,
                               stats)


def _all_reduce(vec: torch.Tensor, process_group) -> torch.Tensor:
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("kl_penalty_loss: process_group was given but torch.distributed is not initialized")
    vec = vec.clone()
    dist.all_reduce(vec, op=dist.ReduceOp.SUM, group=process_group)
    return vec


_UNIFORM = ("token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm", "token-sum-norm", "sum")
_ON_HOST = _UNIFORM  # aggregations that CPU tensors take through _aggregate_on_host


def _at_least_one(x):
    # max(x, 1.0) for a float without the two builtin calls (NaN stays NaN, as with max); per planned call
    if x.__class__ is float or not isinstance(x, torch.Tensor):
        return x if not x < 1.0 else 1.0
    return x.clamp_min(1.0)


def _uniform_weight(p: KLPenaltyProblem, n_tokens, n_seqs, aggregation=None):
    """``w`` of an aggregation with one weight for every sequence (``p.aggregation`` by default);
    floats or float64 0-d tensors."""
    aggregation = aggregation or p.aggregation
    if aggregation == "token-mean":
        return 1.0 / _at_least_one(n_tokens)
    if aggregation == "seq-mean-token-sum":
        return 1.0 / _at_least_one(n_seqs)
    if aggregation == "seq-mean-token-sum-norm":
        return 1.0 / (_at_least_one(n_seqs) * p.norm_length)
    if aggregation == "token-sum-norm":
        return 1.0 / p.norm_length
    return 1.0


def _weight(p: KLPenaltyProblem, aggregation: str, count: torch.Tensor, n_tokens: torch.Tensor,
            n_seqs: torch.Tensor) -> torch.Tensor:
    """The float64 weight ``w_b`` of ``aggregation``: ``[B]`` for ``seq-mean-token-mean``, else 0-d."""
    if aggregation == "seq-mean-token-mean":
        return 1.0 / (count.to(torch.float64).clamp_min(1.0) * n_seqs.clamp_min(1.0))
    w = _uniform_weight(p, n_tokens, n_seqs, aggregation)
    return w if isinstance(w, torch.Tensor) else torch.full((), w, dtype=torch.float64, device=count.device)


def _sequence_count(p: KLPenaltyProblem, count: torch.Tensor) -> torch.Tensor:
    """``B`` before any all-reduce, a float64 0-d tensor on the counts' device (no host copy)."""
    if p.num_sequences == "nonempty":
        return (count > 0).sum().to(torch.float64)
    if isinstance(p.num_sequences, torch.Tensor):
        return p.num_sequences.to(device=count.device, dtype=torch.float64)
    # torch.full, not torch.tensor(..., device=dev): a fill kernel, no (synchronizing) host-to-device copy
    n = p.batch_size if p.num_sequences is None else p.num_sequences
    return torch.full((), float(n), dtype=torch.float64, device=count.device)


def _token_count(num_global_tokens, n_tokens: torch.Tensor) -> torch.Tensor:
    """``N`` of ``token-mean``: the caller's global count, else this call's (all-reduced) one."""
    if num_global_tokens is None:
        return n_tokens
    if isinstance(num_global_tokens, torch.Tensor):
        return num_global_tokens.to(device=n_tokens.device, dtype=torch.float64)
    return torch.full((), float(num_global_tokens), dtype=torch.float64, device=n_tokens.device)


def _reduces_sequence_count(p: KLPenaltyProblem) -> bool:
    return p.num_sequences is None or p.num_sequences == "nonempty"  # a caller's count is already global


def run_split(p: KLPenaltyProblem, impl, *, kind: str, offsets, num_global_tokens=None,
              process_group=None) -> KLPenaltyLossOutput:
    """A call whose terms are weighed differently (``p.split_terms``): count each sequence's
    tokens first, run the backend with the KL coefficient ``beta_b * w_kl_b / w_b`` (and without
    a differently aggregated entropy term, summed here with torch ops), then :func:`aggregate`."""
    valid, pos, per_seq, seq = token_frame(p)
    m = final_mask(p, valid, pos, per_seq)
    count = per_sequence_sum(p, m, seq)  # float64 [B]
    n_tokens, n_seqs = count.sum(), _sequence_count(p, count)
    if process_group is not None:
        n_tokens, n_seqs = _all_reduce(torch.stack([n_tokens, n_seqs]), process_group).unbind()
    n_tok = _token_count(num_global_tokens, n_tokens)
    agg_policy, agg_kl, agg_entropy = _aggregations(p)
    run = replace(p)
    kl_sums = None
    if p.kl_values is not None:  # estimator="full": the KL term is summed here, the kernels run without it
        kl_sums = per_sequence_sum(p, p.kl_values, seq)
        run.kl_values, run.beta, run.weight_kl = None, 0.0, False
    elif agg_kl != agg_policy:
        ratio = _weight(p, agg_kl, count, n_tok, n_seqs) / _weight(p, agg_policy, count, n_tok, n_seqs)
        beta = p.beta.to(torch.float64) if isinstance(p.beta, torch.Tensor) else p.beta
        # float32 as the kernels read it (float64 for the float64 reference: no rounding of beta there)
        run.beta = (ratio * beta).to(torch.float64 if p.math_dtype == torch.float64 else torch.float32)
    entropy_sums = None
    if agg_entropy != agg_policy and p.entropy is not None:
        ent = torch.where(m, p.entropy, torch.zeros((), dtype=p.entropy.dtype, device=p.entropy.device))
        entropy_sums = per_sequence_sum(p, ent, seq)
        run.entropy, run.entropy_coef = None, 0.0
    raw = impl.run(run)
    if kl_sums is not None and raw.token_out is not None:  # "none": each token's own KL term
        beta = per_seq(p.beta) if isinstance(p.beta, torch.Tensor) and p.beta.dim() == 1 else p.beta
        penalty = beta * p.kl_values
        loss, obj, _, ent = raw.token_out.unbind(0)
        raw = raw._replace(token_out=torch.stack([loss + penalty.to(loss.dtype), obj,
                                                  penalty.detach().to(loss.dtype), ent]))
    return aggregate(p, raw, kind=kind, offsets=offsets, num_global_tokens=num_global_tokens,
                     process_group=process_group, entropy_sums=entropy_sums, kl_sums=kl_sums)


def on_host(p: KLPenaltyProblem, process_group) -> bool:
    """Whether the call aggregates on the host: CPU tensors, one weight for every sequence (a float
    beta, or a 0-d one), no process group, eager. Its totals are then read as host floats (free for
    CPU tensors) and its outputs built in a handful of torch calls: on a 2-core machine each torch
    call costs ~8 us, as much as the kernel spends on thousands of tokens; the generic path of
    :func:`aggregate` needs ~35 of them."""
    return (p.device.type == "cpu" and process_group is None and p.aggregation in _ON_HOST and not p.split_terms
            and not (isinstance(p.beta, torch.Tensor) and p.beta.dim() == 1) and not torch.compiler.is_compiling())


def on_device(p: KLPenaltyProblem, process_group) -> bool:
    """Whether the CUDA kernels (real or emulated) aggregate the call themselves: every aggregation
    but ``"none"``, any beta, no process group, eager (the totals kernel and
    ``finalize_aggregation`` of csrc/common/kl_penalty_args.h). On a GPU the generic path below
    costs ~30 small launches per forward and ~10 per backward: the H200 run of 2026-11-26 measured
    the loss host-bound at 1.4-1.7 ms a step, slower than eager autograd."""
    return (process_group is None and p.aggregation != "none" and not p.split_terms
            and not torch.compiler.is_compiling())


def device_weight(p: KLPenaltyProblem, num_global_tokens) -> tuple[float, bool, bool, torch.Tensor | None]:
    """The weights of an :func:`on_device` call as the kernels take them: ``(agg_scale,
    agg_per_token, agg_seq_mean, agg_tokens)``, sequence b's loss weighing ``w * u_b`` with
    ``w = agg_scale / (agg_per_token ? max(N, 1) : 1)`` (``N``: the value of ``agg_tokens``, a
    float64 [1] device tensor, or the batch's own count when it is None) and ``u_b = 1 / max(n_b,
    1)`` with ``agg_seq_mean``, else 1. The weights of the table above, the device-side counts left
    to the kernels."""
    if p.aggregation == "seq-mean-token-mean":
        return 1.0 / max(float(p.batch_size), 1.0), False, True, None
    if p.aggregation != "token-mean":
        return _uniform_weight(p, None, float(p.batch_size)), False, False, None
    if num_global_tokens is None:
        return 1.0, True, False, None
    if isinstance(num_global_tokens, torch.Tensor):
        return 1.0, True, False, num_global_tokens.reshape(1).to(torch.float64)
    return _uniform_weight(p, float(num_global_tokens), None), False, False, None


def uniform_parts(p: KLPenaltyProblem, totals, num_global_tokens) -> tuple[float, list[float]]:
    """``(w, parts)`` of a one-weight aggregation (:func:`on_host`) from the batch totals, host
    floats (the sums of :data:`~kl_kernels.kl_penalty.reference.STAT_COLUMNS`, then the count): the
    weight and the values of :data:`RESULT_FIELDS`, in float64 arithmetic (the loss itself is ``w``
    times the sum of the sequences' losses)."""
    obj_total, kl_total, ent_total, ratio_total, clip_total, low_total, high_total, n_tokens = totals
    n = float(num_global_tokens) if num_global_tokens is not None else n_tokens
    w = _uniform_weight(p, n, float(p.batch_size))
    denom = n_tokens if not n_tokens < 1.0 else 1.0  # (a float: _at_least_one's, inline)
    return w, [obj_total * w, kl_total * w * float(p.beta), ent_total * w * -p.entropy_coef + 0.0, kl_total / denom,
               ratio_total / denom, clip_total / denom, low_total / denom, high_total / denom, ent_total / denom]


def _aggregate_on_host(p: KLPenaltyProblem, raw: RawLoss, num_global_tokens) -> KLPenaltyLossOutput:
    """:func:`aggregate` for :func:`on_host` calls: same formulas, same float64 arithmetic, same
    rounding to the output dtype as the generic path."""
    md = raw.seq_loss.dtype
    count = raw.count.sum()
    totals = raw.stats.detach().sum(0, dtype=torch.float64).tolist() + [float(count)]
    w, parts = uniform_parts(p, totals, num_global_tokens)
    loss = (raw.seq_loss.sum(dtype=torch.float64) * w).to(md)
    return make_output(loss, torch.tensor(parts, dtype=md), count, raw.stats.detach(), raw.count)


def aggregate(p: KLPenaltyProblem, raw: RawLoss, *, kind: str, offsets, num_global_tokens=None,
              process_group=None, entropy_sums=None, kl_sums=None) -> KLPenaltyLossOutput:
    """Apply the aggregations to a backend's per-sequence sums (see the module doc).
    ``entropy_sums``: :func:`run_split`'s per-sequence entropy sums (differentiable), when the
    backend ran without the entropy term; ``kl_sums`` the same for the KL term (``estimator="full"``)."""
    if on_host(p, process_group):
        return _aggregate_on_host(p, raw, num_global_tokens)
    md = raw.seq_loss.dtype
    # Few, small ops: at RLHF batch sizes each torch call here costs about as much as a kernel pass.
    # (Tensor methods (select, narrow, unbind) rather than Python indexing throughout: the same ops,
    # and they also run under a fake CUDA mode on a CPU-only torch, tests/test_no_host_sync.py.)
    stats = raw.stats.detach()
    col = stats.to(torch.float64).sum(0)  # the totals of STAT_COLUMNS
    _, col_kl, col_ent, col_ratio, col_clip, col_low, col_high = col.unbind()
    if kl_sums is not None:
        col_kl = kl_sums.detach().sum()
    if entropy_sums is not None:  # the entropy ran apart from the kernel (run_split)
        col_ent = entropy_sums.detach().sum()
    n_tokens = raw.count.sum().to(torch.float64)
    n_seqs = _sequence_count(p, raw.count)
    if process_group is not None:  # one all-reduce of every count and total
        n_tokens, n_seqs_all, *totals = _all_reduce(
            torch.stack([n_tokens, n_seqs, col_kl, col_ratio, col_clip, col_low, col_high, col_ent]),
            process_group).unbind()
        n_seqs = n_seqs_all if _reduces_sequence_count(p) else n_seqs
    else:
        totals = [col_kl, col_ratio, col_clip, col_low, col_high, col_ent]
    denom = n_tokens.clamp_min(1.0)
    # kl_mean, ratio_mean, clip_fraction; then clip_low_fraction, clip_high_fraction, entropy_mean
    diag = [(t / denom).to(md) for t in totals]
    num_tokens = n_tokens.round().to(torch.int64)
    if p.aggregation == "none":
        tokens = TokenLayout(kind, offsets)._tokens  # back to the caller's layout
        return KLPenaltyLossOutput(*map(tokens, raw.token_out.unbind(0)), *diag[:3], num_tokens, *diag[3:],
                                   raw.count, stats)

    n_tok = _token_count(num_global_tokens, n_tokens)
    agg_policy, agg_kl, agg_entropy = _aggregations(p)
    w = _weight(p, agg_policy, raw.count, n_tok, n_seqs)
    w_kl = w if agg_kl == agg_policy else _weight(p, agg_kl, raw.count, n_tok, n_seqs)
    terms = stats.narrow(1, 0, 3).to(torch.float64)
    loss = (w * raw.seq_loss.to(torch.float64)).sum()
    part_objective = (w * terms.select(1, 0)).sum()
    beta = p.beta.to(torch.float64) if isinstance(p.beta, torch.Tensor) else p.beta
    if kl_sums is None:
        kl_part = (w_kl * beta * terms.select(1, 1)).sum()
    else:  # the KL term, summed apart (run_split)
        term = (w_kl * beta * kl_sums).sum()
        loss = loss + term
        kl_part = term.detach()
    if entropy_sums is None:
        loss_ent = (w * terms.select(1, 2)).sum() * -p.entropy_coef + 0.0  # + 0.0: no -0.0 when entropy_coef is 0
    else:  # the entropy term, summed apart with its own weights (run_split)
        term = (_weight(p, agg_entropy, raw.count, n_tok, n_seqs) * entropy_sums).sum() * -p.entropy_coef
        loss = loss + term
        loss_ent = term.detach() + 0.0
    return KLPenaltyLossOutput(loss.to(md), part_objective.to(md), kl_part.to(md), loss_ent.to(md), *diag[:3],
                               num_tokens, *diag[3:], raw.count, stats)
