"""From per-sequence sums to the loss: the aggregations, data parallelism and diagnostics.

Every backend returns the same :class:`~kl_kernels.kl_penalty.reference.RawLoss` (per-sequence
sums ``S_b`` and counts ``n_b``); the loss is ``sum_b w_b * S_b`` with per-sequence weights ``w_b``
that depend only on counts, never on values, so they carry no gradient:

=========================  =================================  ============================================
aggregation                ``w_b``                            meaning
=========================  =================================  ============================================
``token-mean``             ``1 / N``                          mean over counted tokens (N: all ranks')
``seq-mean-token-mean``    ``1 / (max(n_b, 1) * B)``          mean over sequences of their token mean
``seq-mean-token-sum``     ``1 / B``                          mean over sequences of their token sum
``seq-mean-token-sum-norm`` ``1 / norm_length``               token sum over a constant length (Dr. GRPO,
                                                              verl's definition: no division by ``B``)
``sum``                    ``1``                              plain sum
=========================  =================================  ============================================

``B`` counts every sequence of the batch (an empty one adds 0 to the numerator, as verl). With
data parallelism (``num_global_tokens`` or ``process_group``) ``N`` and ``B`` are the totals over
all ranks, so each rank's loss is its share: **the sum over ranks equals the loss of the union
batch**, and so do the gradients (each rank's gradient is the union's, restricted to its tokens).
Under DDP, which averages gradients over ``W`` ranks, scale the loss by ``W`` to train on the
union's loss. An empty union (``N = 0`` or ``B = 0``) gives a loss of 0.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..layouts import TokenLayout
from .problem import KLPenaltyProblem
from .reference import RawLoss


class KLPenaltyLossOutput(NamedTuple):
    """Result of :func:`kl_kernels.kl_penalty_loss`.

    * ``loss``: the aggregated loss (0-d; per-token in the caller's layout for ``"none"``), with
      gradient to ``log_probs`` (and ``entropy``).
    * ``loss_objective``, ``loss_kl``, ``loss_entropy``: its parts (same aggregation, detached):
      ``loss = loss_objective + loss_kl + loss_entropy``.
    * ``kl_mean``, ``ratio_mean``, ``clip_fraction``: means over counted tokens (detached; over all
      ranks when ``process_group`` is given, else over this call's tokens).
    * ``num_tokens``: int64 0-d count of counted tokens (all ranks' with ``process_group``).
    """

    loss: object
    loss_objective: object
    loss_kl: object
    loss_entropy: object
    kl_mean: torch.Tensor
    ratio_mean: torch.Tensor
    clip_fraction: torch.Tensor
    num_tokens: torch.Tensor


def _all_reduce(vec: torch.Tensor, process_group) -> torch.Tensor:
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("kl_penalty_loss: process_group was given but torch.distributed is not initialized")
    vec = vec.clone()
    dist.all_reduce(vec, op=dist.ReduceOp.SUM, group=process_group)
    return vec


_UNIFORM = ("token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm", "sum")
_ON_HOST = _UNIFORM  # aggregations that CPU tensors take through _aggregate_on_host


def _uniform_weight(p: KLPenaltyProblem, n_tokens, n_seqs):
    """``w`` of an aggregation with one weight for every sequence; floats or float64 0-d tensors."""
    if p.aggregation == "token-mean":
        return 1.0 / (max(n_tokens, 1.0) if isinstance(n_tokens, float) else n_tokens.clamp_min(1.0))
    if p.aggregation == "seq-mean-token-sum":
        return 1.0 / (max(n_seqs, 1.0) if isinstance(n_seqs, float) else n_seqs.clamp_min(1.0))
    if p.aggregation == "seq-mean-token-sum-norm":
        return 1.0 / p.norm_length
    return 1.0


def on_host(p: KLPenaltyProblem, process_group) -> bool:
    """Whether the call aggregates on the host: CPU tensors, one weight for every sequence (a float
    beta, or a 0-d one), no process group, eager. Its totals are then read as host floats (free for
    CPU tensors) and its outputs built in a handful of torch calls: on a 2-core machine each torch
    call costs ~8 us, as much as the kernel spends on thousands of tokens; the generic path of
    :func:`aggregate` needs ~35 of them."""
    return (p.device.type == "cpu" and process_group is None and p.aggregation in _ON_HOST
            and not (isinstance(p.beta, torch.Tensor) and p.beta.dim() == 1) and not torch.compiler.is_compiling())


def on_device(p: KLPenaltyProblem, process_group) -> bool:
    """Whether the CUDA kernels (real or emulated) aggregate the call themselves: every aggregation
    but ``"none"``, any beta, no process group, eager (the totals kernel and
    ``finalize_aggregation`` of csrc/common/kl_penalty_args.h). On a GPU the generic path below
    costs ~30 small launches per forward and ~10 per backward: the H200 run of 2026-11-26 measured
    the loss host-bound at 1.4-1.7 ms a step, slower than eager autograd."""
    return process_group is None and p.aggregation != "none" and not torch.compiler.is_compiling()


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
    floats ``(objective, kl, entropy, ratio, clipped, count)``: the weight and the values of
    ``loss_objective``, ``loss_kl``, ``loss_entropy``, ``kl_mean``, ``ratio_mean`` and
    ``clip_fraction``, in float64 arithmetic (the loss itself is ``w`` times the sum of the
    sequences' losses)."""
    obj_total, kl_total, ent_total, ratio_total, clip_total, n_tokens = totals
    n = float(num_global_tokens) if num_global_tokens is not None else n_tokens
    w = _uniform_weight(p, n, float(p.batch_size))
    denom = max(n_tokens, 1.0)
    return w, [obj_total * w, kl_total * w * float(p.beta), ent_total * w * -p.entropy_coef + 0.0, kl_total / denom,
               ratio_total / denom, clip_total / denom]


def _aggregate_on_host(p: KLPenaltyProblem, raw: RawLoss, num_global_tokens) -> KLPenaltyLossOutput:
    """:func:`aggregate` for :func:`on_host` calls: same formulas, same float64 arithmetic, same
    rounding to the output dtype as the generic path."""
    md = raw.seq_loss.dtype
    count = raw.count.sum()
    totals = raw.stats.detach().sum(0, dtype=torch.float64).tolist() + [float(count)]
    w, parts = uniform_parts(p, totals, num_global_tokens)
    loss = (raw.seq_loss.sum(dtype=torch.float64) * w).to(md)
    return KLPenaltyLossOutput(loss, *torch.tensor(parts, dtype=md).unbind(), count)


def aggregate(p: KLPenaltyProblem, raw: RawLoss, *, kind: str, offsets, num_global_tokens=None,
              process_group=None) -> KLPenaltyLossOutput:
    """Apply ``p.aggregation`` to a backend's per-sequence sums (see the module doc)."""
    if on_host(p, process_group):
        return _aggregate_on_host(p, raw, num_global_tokens)
    md = raw.seq_loss.dtype
    dev = raw.count.device
    # Few, small ops: at RLHF batch sizes each torch call here costs about as much as a kernel pass.
    # (Tensor methods (select, narrow, unbind) rather than Python indexing throughout: the same ops,
    # and they also run under a fake CUDA mode on a CPU-only torch, tests/test_no_host_sync.py.)
    col = raw.stats.detach().to(torch.float64).sum(0)  # objective, kl, entropy, ratio, clipped totals
    _, col_kl, _, col_ratio, col_clip = col.unbind()
    n_tokens = raw.count.sum().to(torch.float64)
    # torch.full, not torch.tensor(..., device=dev): a fill kernel, no (synchronizing) host-to-device copy
    n_seqs = torch.full((), float(p.batch_size), dtype=torch.float64, device=dev)
    if process_group is not None:  # one all-reduce of every count and total
        n_tokens, n_seqs, kl_total, ratio_total, clip_total = _all_reduce(
            torch.stack([n_tokens, n_seqs, col_kl, col_ratio, col_clip]), process_group).unbind()
    else:
        kl_total, ratio_total, clip_total = col_kl, col_ratio, col_clip
    denom = n_tokens.clamp_min(1.0)
    diag = [(kl_total / denom).to(md), (ratio_total / denom).to(md), (clip_total / denom).to(md)]
    num_tokens = n_tokens.round().to(torch.int64)
    if p.aggregation == "none":
        tokens = TokenLayout(kind, offsets)._tokens  # back to the caller's layout
        return KLPenaltyLossOutput(*map(tokens, raw.token_out.unbind(0)), *diag, num_tokens)

    per_seq_beta = isinstance(p.beta, torch.Tensor) and p.beta.dim() == 1
    if p.aggregation in _UNIFORM:
        # One weight for every sequence: loss = w * sum_b S_b.
        n = n_tokens
        if num_global_tokens is not None:
            n = num_global_tokens.to(device=dev, dtype=torch.float64) if isinstance(
                num_global_tokens, torch.Tensor) else torch.full((), float(num_global_tokens), dtype=torch.float64,
                                                                device=dev)
        w = _uniform_weight(p, n, n_seqs)
        loss = (raw.seq_loss.to(torch.float64).sum() * w).to(md)
        parts = col.narrow(0, 0, 3) * w
        kl_part = (raw.stats.select(1, 1).to(torch.float64) * p.beta.to(torch.float64)).sum() * w if per_seq_beta \
            else parts.select(0, 1) * (p.beta.to(torch.float64) if isinstance(p.beta, torch.Tensor) else p.beta)
    else:  # "seq-mean-token-mean": per-sequence weights
        weight = 1.0 / (raw.count.to(torch.float64).clamp_min(1.0) * n_seqs.clamp_min(1.0))
        loss = (weight * raw.seq_loss.to(torch.float64)).sum().to(md)
        wstats = weight.unsqueeze(1) * raw.stats.detach().narrow(1, 0, 3).to(torch.float64)
        parts = wstats.sum(0)
        beta = p.beta.to(torch.float64) if isinstance(p.beta, torch.Tensor) else p.beta
        kl_part = (wstats.select(1, 1) * beta).sum()
    part_objective, _, part_entropy = parts.unbind()
    loss_ent = part_entropy * -p.entropy_coef + 0.0  # + 0.0: no -0.0 when entropy_coef is 0
    return KLPenaltyLossOutput(loss, part_objective.to(md), kl_part.to(md), loss_ent.to(md), *diag, num_tokens)
