"""``token_logprobs``' ``torch.library`` ops: forward and backward of the chunked torch math, with
fake implementations and autograd, so ``torch.compile(fullgraph=True)`` traces one opaque op
instead of unrolling the chunk loop. ``temperature`` and ``want_entropy`` are schema arguments:
changing them never recompiles a kernel (there is none to compile)."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import reference
from .problem import TokenLogprobsProblem


@torch.library.custom_op("kl_kernels::token_logprobs_fwd", mutates_args=())
def token_logprobs_fwd(logits: Tensor, labels: Tensor, counted: Tensor, temperature: float, want_entropy: bool,
                       inplace_backward: bool) -> tuple[Tensor, Tensor, Tensor]:
    """``(log_probs [*S], entropy [*S] or [0], lse [N])``; ``inplace_backward`` is read by the
    autograd formula only."""
    return reference.forward(logits, labels, counted, temperature, want_entropy)


@token_logprobs_fwd.register_fake
def _(logits, labels, counted, temperature, want_entropy, inplace_backward):
    md = reference.math_dtype(logits)
    return (logits.new_empty(labels.shape, dtype=md),
            logits.new_empty(labels.shape if want_entropy else (0,), dtype=md),
            logits.new_empty((labels.numel(),), dtype=md))


@torch.library.custom_op("kl_kernels::token_logprobs_bwd", mutates_args=())
def token_logprobs_bwd(grad_lp: Optional[Tensor], grad_entropy: Optional[Tensor], logits: Tensor, labels: Tensor,
                       counted: Tensor, temperature: float, lse: Tensor, entropy: Tensor) -> Tensor:
    """``d loss / d logits``, a new contiguous tensor of the logits' shape and dtype."""
    out = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
    return reference.backward(grad_lp, grad_entropy, logits, labels, counted, temperature, lse, entropy, out)


@token_logprobs_bwd.register_fake
def _(grad_lp, grad_entropy, logits, labels, counted, temperature, lse, entropy):
    return torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)


def _setup_context(ctx, inputs, output):
    logits, labels, counted, temperature, want_entropy, inplace = inputs
    _lp, entropy, lse = output
    ctx.save_for_backward(logits, labels, counted, lse, entropy)
    ctx.temperature, ctx.want_entropy, ctx.inplace = temperature, want_entropy, inplace
    ctx.mark_non_differentiable(lse)


def _backward(ctx, grad_lp, grad_entropy, _grad_lse):
    logits, labels, counted, lse, entropy = ctx.saved_tensors
    if not ctx.want_entropy:
        grad_entropy = None
    if ctx.inplace:  # eager only (problem.py): the gradient overwrites the logits, chunk by chunk
        with torch.no_grad():
            target = logits.detach()  # shares the version counter: a later reader of the logits is told
            grad = reference.backward(grad_lp, grad_entropy, target, labels, counted, ctx.temperature, lse,
                                      entropy, target)
    else:
        grad = token_logprobs_bwd(grad_lp, grad_entropy, logits, labels, counted, ctx.temperature, lse, entropy)
    return grad, None, None, None, None, None


token_logprobs_fwd.register_autograd(_backward, setup_context=_setup_context)


def run_torch(p: TokenLogprobsProblem) -> tuple[Tensor, Tensor | None]:
    """The torch backend: ``(log_probs, entropy or None)``."""
    lp, entropy, _lse = token_logprobs_fwd(p.logits, p.labels, p.counted, p.temperature, p.return_entropy,
                                           p.inplace_backward)
    return lp, (entropy if p.return_entropy else None)
