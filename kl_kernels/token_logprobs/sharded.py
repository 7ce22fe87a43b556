r"""A vocabulary split over a process group's ranks (tensor parallelism: Megatron's and verl's layout):
``token_logprobs(..., process_group=g)`` and ``linear_token_logprobs(..., process_group=g)``.

Rank ``r`` of ``g`` holds a contiguous shard ``[start_r, start_r + V_r)`` of the vocabulary, the shards in
rank order (``start_0 = 0``, ``start_{r+1} = start_r + V_r``; sizes may differ, each ``V_r >= 1``): logits
``[*S, V_r]`` or an LM head's rows ``[V_r, H]``. ``labels`` are global ids in ``[0, V)``, ``V = sum V_r``.
The shard sizes are all-gathered once per call (one ``[world]`` int64 all-gather and a host read of it).

Forward: each rank's row pass over its shard (the op's own kernel, the label of a row read on the rank
that holds it) gives per token its shard's ``lse_r``, entropy ``H_r`` (of the shard's own softmax) and the
label's logit ``z_y`` where it holds it; then three all-reduces of ``[N]`` vectors merge them (no ``[N, V]``
gather)::

    m   = max_r lse_r                                  (all-reduce MAX)
    lse = m + log sum_r exp(lse_r - m)                 (all-reduce SUM, with z_y and a NaN count)
    H   = sum_r exp(lse_r - lse) (H_r + lse - lse_r)   (all-reduce SUM)
    log_probs = z_y - lse

so every rank returns the full log-probs and entropy. Backward needs no communication: each rank's row
pass writes its shard's gradient from the merged ``lse`` and ``H`` (a label outside the shard is no entry of
it). ``d hidden`` on the hidden-state path is each rank's share ``d logits_r @ W_r``, as Megatron's
vocab-parallel cross-entropy leaves it: the caller all-reduces it over the group (Megatron's
``ColumnParallelLinear`` backward does). Every rank must make the same call (the collectives pair up) and
apply the same upstream gradient (it does when every rank computes the same loss from the replicated
log-probs).

A row holding NaN or ``+inf`` on any rank gives NaN, as unsharded. A shard whose row is entirely ``-inf``
(masked vocabulary held on one rank) gives NaN too, where the unsharded call would not: keep at least one
finite logit per row on every rank.
"""

from __future__ import annotations

import torch

_DEVICE_BACKENDS = {"gloo": {"cpu", "cuda"}, "nccl": {"cuda"}, "mpi": {"cpu"}, "ucc": {"cpu", "cuda"},
                    "xccl": {"xpu"}}


def check_group(process_group, device: torch.device, name: str = "process_group") -> None:
    """``process_group`` is None, or a ``torch.distributed.ProcessGroup`` of an initialized default group
    whose backend runs collectives on ``device``'s tensors; else a ``TypeError``/``ValueError`` naming
    ``name``."""
    if process_group is None:
        return
    import torch.distributed as dist

    group_type = getattr(dist, "ProcessGroup", None) if dist.is_available() else None
    if group_type is None or not isinstance(process_group, group_type):
        raise TypeError(f"{name} must be None or a torch.distributed.ProcessGroup (the ranks holding the "
                        f"vocabulary's shards), got {type(process_group).__name__}")
    if not dist.is_initialized():
        raise ValueError(f"{name} was given but torch.distributed is not initialized")
    backend = str(dist.get_backend(process_group)).lower()
    if ":" in backend:  # "cpu:gloo,cuda:nccl"
        can = {part.split(":")[0] for part in backend.split(",") if ":" in part}
    else:
        can = _DEVICE_BACKENDS.get(backend)
    if can is not None and device.type not in can:
        raise ValueError(f"{name}'s backend {backend!r} cannot run collectives on {device.type} tensors "
                         f"(gloo for CPU tensors, nccl for CUDA ones)")


def vocab_range(process_group, local_vocab: int, device: torch.device) -> tuple[int, int]:
    """``(start, total)``: this rank's first global id and the whole vocabulary, from the shard sizes of
    every rank (one all-gather, read on the host)."""
    import torch.distributed as dist

    world = dist.get_world_size(process_group)
    mine = torch.tensor([local_vocab], dtype=torch.int64, device=device)
    sizes = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(sizes, mine, group=process_group)
    sizes = torch.cat(sizes).tolist()
    rank = dist.get_rank(process_group)
    return int(sum(sizes[:rank])), int(sum(sizes))


def local_labels(labels: torch.Tensor, start: int, local_vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(here, label_in_shard)``: whether each token's label lies in ``[start, start + V_r)``, and its
    index there (0 elsewhere: the forward kernels read a label's logit, any in-range one does)."""
    here = (labels >= start) & (labels < start + local_vocab)
    return here, torch.where(here, labels - start, 0)


def shard_forward(fwd, logits, labels, counted, start: int, temperature: float, want_entropy: bool,
                  softcap: float = 0.0) -> tuple:
    """One shard's ``(lse_r, H_r or [0], z_y)`` per token (``z_y`` 0 where the shard lacks the label), from
    the row pass ``fwd`` (``row_pass``'s first) on ``logits [C, V_r]``."""
    here, inside = local_labels(labels, start, logits.shape[-1])
    lp_r, ent_r, lse_r = fwd(logits, inside, counted, temperature, want_entropy, softcap=softcap)
    lp_r = lp_r.reshape(-1)
    zy = torch.where(counted & here, lp_r + lse_r, 0.0)
    return lse_r, ent_r.reshape(-1) if want_entropy else ent_r, zy


def merge(process_group, counted, lse_r, ent_r, zy, want_entropy: bool) -> tuple:
    """The ranks' shard statistics merged (module doc): ``(log_probs [N], entropy [N] or [0], lse [N])``,
    0 at non-counted tokens (``lse`` 0 there too)."""
    import torch.distributed as dist

    zero = torch.zeros((), dtype=lse_r.dtype, device=lse_r.device)
    lse_r = torch.where(counted, lse_r, zero)
    bad = torch.isnan(lse_r)  # NaN/+inf logits, or a shard's row all -inf
    m = torch.where(bad, float("-inf"), lse_r)
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=process_group)
    m = torch.where(torch.isfinite(m), m, zero)
    sums = torch.stack([torch.where(bad, zero, torch.exp(lse_r - m)), zy, bad.to(lse_r.dtype)])
    dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=process_group)
    undefined = sums[2] > 0
    lse = torch.where(undefined, float("nan"), m + torch.log(sums[0]))
    lse = torch.where(counted, lse, zero)
    lp = torch.where(counted, sums[1] - lse, zero)
    ent = ent_r
    if want_entropy:
        part = torch.where(bad | ~counted, zero, torch.exp(lse_r - lse) * (ent_r + (lse - lse_r)))
        dist.all_reduce(part, op=dist.ReduceOp.SUM, group=process_group)
        ent = torch.where(counted, torch.where(undefined, float("nan"), part), zero)
    return lp, ent, lse


class ShardedRows(torch.autograd.Function):
    """``token_logprobs`` on a shard of the logits: forward merges the ranks' statistics, backward is the
    rank's own row pass (``fwd``/``bwd`` from ``row_pass``)."""

    @staticmethod
    def forward(ctx, logits, labels, counted, temperature, softcap, want_entropy, fwd, bwd, group, start):
        rows = logits.reshape(-1, logits.shape[-1])
        lab, cnt = labels.reshape(-1), counted.reshape(-1)
        lse_r, ent_r, zy = shard_forward(fwd, rows, lab, cnt, start, temperature, want_entropy, softcap)
        lp, ent, lse = merge(group, cnt, lse_r, ent_r, zy, want_entropy)
        ctx.save_for_backward(logits, lab, cnt, lse, ent)
        ctx.temperature, ctx.want_entropy, ctx.bwd, ctx.start = temperature, want_entropy, bwd, start
        ctx.softcap = softcap
        return lp.reshape(labels.shape), (ent.reshape(labels.shape) if want_entropy else ent)

    @staticmethod
    def backward(ctx, grad_lp, grad_ent):
        logits, lab, cnt, lse, ent = ctx.saved_tensors
        rows = logits.reshape(-1, logits.shape[-1])
        g_ent = grad_ent.reshape(-1) if ctx.want_entropy and grad_ent is not None else None
        g_lp = None if grad_lp is None else grad_lp.reshape(-1)
        out = torch.empty(rows.shape, dtype=logits.dtype, device=logits.device)
        # labels outside the shard (negative or past it) are no entry of it, in every row pass
        ctx.bwd(g_lp, g_ent, rows, lab - ctx.start, cnt, ctx.temperature, lse, ent if g_ent is not None else lse[:0],
                out, softcap=ctx.softcap)
        return out.view(logits.shape), None, None, None, None, None, None, None, None, None
