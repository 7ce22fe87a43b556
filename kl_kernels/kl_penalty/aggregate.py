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

from .. import ragged
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


def _tokens(x: torch.Tensor, kind: str, offsets):
    if kind in ("packed", "padded"):
        return x
    return ragged.unpack(x, ragged.RaggedLayout(kind, offsets))


def aggregate(p: KLPenaltyProblem, raw: RawLoss, *, kind: str, offsets, num_global_tokens=None,
              process_group=None) -> KLPenaltyLossOutput:
    """Apply ``p.aggregation`` to a backend's per-sequence sums (see the module doc)."""
    md = raw.seq_loss.dtype
    stats = raw.stats.detach().to(torch.float64)
    count = raw.count.to(torch.float64)
    # One small vector of totals, all-reduced once when a process group is given.
    totals = torch.stack([count.sum(), torch.tensor(float(p.batch_size), dtype=torch.float64, device=count.device),
                          stats[:, 1].sum(), stats[:, 3].sum(), stats[:, 4].sum()])
    if process_group is not None:
        totals = _all_reduce(totals, process_group)
    n_tokens, n_seqs, kl_total, ratio_total, clip_total = totals.unbind()
    denom = n_tokens.clamp_min(1.0)
    diag = [(kl_total / denom).to(md), (ratio_total / denom).to(md), (clip_total / denom).to(md)]
    num_tokens = n_tokens.round().to(torch.int64)

    beta = p.beta if isinstance(p.beta, torch.Tensor) else torch.tensor(p.beta, dtype=torch.float64)
    beta = beta.to(device=count.device, dtype=torch.float64)
    if p.aggregation == "none":
        loss, obj, pen, ent = raw.token_out.unbind(0)
        return KLPenaltyLossOutput(_tokens(loss, kind, offsets), _tokens(obj, kind, offsets),
                                   _tokens(pen, kind, offsets), _tokens(ent, kind, offsets), *diag, num_tokens)

    if p.aggregation == "token-mean":
        if num_global_tokens is not None:
            n = num_global_tokens
            n = n.to(device=count.device, dtype=torch.float64) if isinstance(n, torch.Tensor) else \
                torch.tensor(float(n), dtype=torch.float64, device=count.device)
        else:
            n = n_tokens
        weight = (1.0 / n.clamp_min(1.0)).expand(p.batch_size)
    elif p.aggregation == "seq-mean-token-mean":
        weight = 1.0 / (count.clamp_min(1.0) * n_seqs.clamp_min(1.0))
    elif p.aggregation == "seq-mean-token-sum":
        weight = (1.0 / n_seqs.clamp_min(1.0)).expand(p.batch_size)
    elif p.aggregation == "seq-mean-token-sum-norm":
        weight = torch.full((p.batch_size,), 1.0 / p.norm_length, dtype=torch.float64, device=count.device)
    else:  # "sum"
        weight = torch.ones(p.batch_size, dtype=torch.float64, device=count.device)

    loss = (weight * raw.seq_loss.to(torch.float64)).sum().to(md)
    parts = weight.unsqueeze(1) * stats[:, :3]
    loss_obj = parts[:, 0].sum()
    loss_kl = (beta * parts[:, 1]).sum()
    loss_ent = parts[:, 2].sum() * -p.entropy_coef + 0.0  # + 0.0: no -0.0 when entropy_coef is 0
    return KLPenaltyLossOutput(loss, loss_obj.to(md), loss_kl.to(md), loss_ent.to(md), *diag, num_tokens)
