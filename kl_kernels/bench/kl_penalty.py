"""kl_penalty_loss benchmark: forward + backward of a PPO step's policy loss.

The task, verl's PPO actor loss step: PPO-clipped objective (``clip_epsilon = 0.2``) with dual clip
(``clip_ratio_c = 3.0``, verl's default) plus ``beta * k3`` KL to a reference model (``beta = 0.05``),
``token-mean`` over assistant tokens, per-token advantages, gradient w.r.t. the
policy log-probs; one call = loss forward + ``torch.autograd.grad`` of it w.r.t. the log-probs (as
in training, where the log-probs are a model's output and their gradient is handed on, not stored
in a leaf's ``.grad``). Contenders, timed side by side:

* ``eager autograd (verl style)``: the usual padded ``[B, T]`` formulation with a response mask, as
  verl's ``compute_policy_loss_vanilla`` and ``kl_penalty`` write it (``clamp``/``exp`` ratio,
  ``maximum`` of the two PPO terms, the dual clip's ``minimum`` where ``A < 0``,
  ``exp(ref - lp) - (ref - lp) - 1``, masked sum over mask sum), differentiated by autograd;
* ``torch.compile(eager)``: the same function compiled with ``fullgraph=True`` (forward and, through
  AOTAutograd, backward); cold compile time reported separately;
* ``kl_penalty_loss inside torch.compile (default)`` (and ``(reduce-overhead)``, CUDA graphs, on a GPU):
  ours called from a compiled function, padded with lengths;
* ``kl_penalty_loss[<backend>]`` for each backend that runs here (packed and padded layouts), and
  for the fused ones also ``kl_penalty_loss[<backend>] out=``: the same call with its gradient
  buffer allocated once (``out=``), as a training loop would.

Each contender's loss and gradient are checked against the eager one before timing. GB/s counts
the minimal traffic: log-probs, old and reference log-probs, advantages and mask read once, the
gradient written once.
"""

from __future__ import annotations

import functools

import torch

from .. import ragged
from ..kl_penalty import kl_penalty_loss
from ..kl_penalty.backends import REGISTRY
from ..kl_penalty.problem import build_problem
from .batches import RLHFBatch
from .contenders import Contender, is_copy, set_speedup, time_rows
from .timing import cold_compile_seconds

TASK = "verl PPO actor loss (clip, dual clip, k3 KL to the reference), forward + backward"
BETA, CLIP, DUAL_CLIP = 0.05, 0.2, 3.0


def eager_loss(lp, old, ref, adv, mask, beta=BETA, eps=CLIP, clip_c=DUAL_CLIP):
    """PPO-clip with dual clip + k3 KL penalty, token-mean over the mask, as RL libraries write it
    (verl's formulas)."""
    ratio = torch.exp(torch.clamp(lp - old, -20.0, 20.0))
    pg = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1 - eps, 1 + eps))
    pg = torch.where(adv < 0, torch.minimum(-adv * clip_c, pg), pg)
    d = ref - lp
    kl = torch.exp(d) - d - 1
    m = mask.to(lp.dtype)
    return ((pg + beta * kl) * m).sum() / m.sum().clamp_min(1.0)


def _ours_padded(lp, old, ref, adv, mask, lengths):
    """:func:`eager_loss`'s arguments, our loss (the fused kernels by dispatch), padded with lengths."""
    return kl_penalty_loss(lp, old, adv, ref_log_probs=ref, beta=BETA, estimator="k3", mask=mask, clip_epsilon=CLIP,
                           dual_clip=DUAL_CLIP, lengths=lengths, padding_side="left").loss


class _Data:
    """The batch's tensors for the loss: old policy and advantages derived reproducibly."""

    def __init__(self, batch: RLHFBatch, seed: int = 0):
        g = torch.Generator().manual_seed(seed + 1)
        dev = batch.lp.device
        n = batch.lp.shape[0]
        noise = (0.05 * torch.randn(n, generator=g)).to(dev, batch.lp.dtype)
        self.offsets, self.lengths = batch.offsets, batch.lengths
        self.packed = dict(lp=batch.lp, old=batch.lp + noise, ref=batch.ref,
                           adv=torch.randn(n, generator=g).to(dev, batch.lp.dtype), mask=batch.mask)
        width = batch.lp_padded.shape[1]
        self.padded = {k: ragged.to_padded(v, batch.offsets, padding_side="left", width=width,
                                           padding_value=False if v.dtype == torch.bool else 0.0)
                       for k, v in self.packed.items()}


def _ours(data: _Data, layout: str, backend: str, with_out: bool = False):
    t = data.packed if layout == "packed" else data.padded
    lp = t["lp"].detach().clone().requires_grad_()
    geo = dict(offsets=data.offsets) if layout == "packed" else dict(lengths=data.lengths, padding_side="left")
    buffer = torch.empty(lp.shape, dtype=torch.float32, device=lp.device) if with_out else None

    def call():
        out = kl_penalty_loss(lp, t["old"], t["adv"], ref_log_probs=t["ref"], beta=BETA, estimator="k3",
                              mask=t["mask"], clip_epsilon=CLIP, dual_clip=DUAL_CLIP, backend=backend, out=buffer,
                              **geo)
        (grad,) = torch.autograd.grad(out.loss, lp)
        return out.loss.detach(), grad
    return call


def _eager(data: _Data, fn=eager_loss):
    t = data.padded
    lp = t["lp"].detach().clone().requires_grad_()

    def call():
        loss = fn(lp, t["old"], t["ref"], t["adv"], t["mask"])
        (grad,) = torch.autograd.grad(loss, lp)
        return loss.detach(), grad
    return call


def _compiled(data: _Data):
    torch._dynamo.reset()
    fn = torch.compile(eager_loss, fullgraph=True)
    call = _eager(data, fn)
    return call, cold_compile_seconds(call, data.offsets.device)


def _grad_packed(out, layout, data: _Data):
    """(loss, gradient) with the gradient as packed values, for comparison across layouts."""
    loss, grad = out
    if layout == "packed":
        return loss, grad
    return loss, ragged.from_padded(grad, data.lengths, padding_side="left").values


def run_task(ctx) -> list[dict]:
    """The ``kl_penalty`` task of ``kl-kernels bench`` (:mod:`kl_kernels.bench.tasks`): :func:`run` per size."""
    return ctx.per_size(run, with_compile=ctx.plan.with_compile)


def run(batch: RLHFBatch, *, copy_gbs: float, with_compile: bool = True, repeats: int = 10, budget_s: float = 3.0,
        progress=None, retime: bool = True) -> list[dict]:
    data = _Data(batch)
    found = [Contender("eager autograd (verl style)", "padded", _eager(data))]
    if with_compile:
        if progress:
            progress("kl_penalty: compiling the eager loss (forward and backward)")
        fn, seconds = _compiled(data)
        found.append(Contender("torch.compile(eager)", "padded", fn, seconds))
        # Ours called inside a compiled function (issue 49 item 3: its ops captured whole, the call's host
        # cost within the graph), and with CUDA graphs on a GPU.
        for mode in ["default"] + (["reduce-overhead"] if data.offsets.device.type == "cuda" else []):
            inside = torch.compile(functools.partial(_ours_padded, lengths=data.lengths), fullgraph=True,
                                   mode=None if mode == "default" else mode)
            call = _eager(data, inside)
            found.append(Contender(f"kl_penalty_loss inside torch.compile ({mode})", "padded", call,
                                   cold_compile_seconds(call, data.offsets.device)))
    for layout in ("packed", "padded"):
        t = data.packed if layout == "packed" else data.padded
        geo = dict(offsets=data.offsets, lengths=None) if layout == "packed" else dict(offsets=None,
                                                                                     lengths=data.lengths)
        problem = build_problem(t["lp"], t["old"], t["adv"], ref_log_probs=t["ref"], beta=BETA, estimator="k3",
                                mask=t["mask"], padding_side="left", clip_epsilon=CLIP, dual_clip=DUAL_CLIP,
                                entropy=None,
                                entropy_coef=0.0, aggregation="token-mean", norm_length=None, **geo)[0]
        for backend in REGISTRY:
            if not backend.auto_rejection_reasons(problem):
                found.append(Contender(f"kl_penalty_loss[{backend.name}]", layout, _ours(data, layout, backend.name)))
                if backend.name != "torch":  # the fused kernels' gradient buffer, allocated once
                    found.append(Contender(f"kl_penalty_loss[{backend.name}] out=", layout,
                                           _ours(data, layout, backend.name, with_out=True)))

    want_loss, want_grad = _grad_packed(found[0].fn(), "padded", data)
    checks = []
    for c in found:
        if progress:
            progress(f"kl_penalty: checking {c.name} ({c.layout})")
        loss, grad = _grad_packed(c.fn(), c.layout, data)
        tol = 1e-4 if batch.lp.dtype == torch.float32 else 2e-2
        ok = torch.allclose(loss.double(), want_loss.double(), rtol=tol, atol=1e-6) and torch.allclose(
            grad.double(), want_grad.double(), rtol=tol, atol=1e-9 + tol * float(want_grad.abs().max()))
        if not ok:
            raise AssertionError(f"{c.name} ({c.layout}): loss or gradient differs from the eager autograd result")
        checks.append("ok")
    s = batch.lp.element_size()

    def nbytes(layout):  # read lp, old, ref, adv, mask (the tokens only: padded calls get the lengths); write grad
        elems = batch.lp.numel() if layout == "packed" else batch.lp_padded.numel()
        return batch.num_tokens * (4 * s + 1) + elems * s
    rows = time_rows(batch, TASK, found, checks, nbytes, copy_gbs, repeats, budget_s, "eager autograd (verl style)",
                     progress, retime=retime)
    compiled = next((r for r in rows if r["impl"].startswith("torch.compile")), None)
    for r in rows:
        if not is_copy(r):
            set_speedup(r, "x_vs_baseline", rows[0])
            set_speedup(r, "x_vs_compile", compiled)
    return rows
