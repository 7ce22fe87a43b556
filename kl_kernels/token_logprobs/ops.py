"""``token_logprobs``' ``torch.library`` ops: forward and backward of each backend (the chunked torch math,
the fused CPU kernel, the CUDA kernel, the same under host emulation, the Triton kernels), with fake
implementations and autograd, so ``torch.compile(fullgraph=True)`` traces one opaque op instead of
unrolling the chunk loop. ``temperature``, ``softcap`` (kernel units, 0.0: none; ``problem.py``) and
``want_entropy`` are schema arguments:
changing them never recompiles a kernel (there is none to compile)."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .. import op_library
from . import launch, launch_triton, reference
from .problem import TokenLogprobsProblem


def _fake_forward(logits, labels, counted, temperature, softcap, want_entropy, inplace_backward):
    md = reference.math_dtype(logits)  # the fused kernels read fp32/bf16/fp16: float32 there too
    return (logits.new_empty(labels.shape, dtype=md),
            logits.new_empty(labels.shape if want_entropy else (0,), dtype=md),
            logits.new_empty((labels.numel(),), dtype=md))


def _fake_backward(grad_lp, grad_entropy, logits, labels, counted, temperature, softcap, lse, entropy):
    return torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)


def _setup_context(ctx, inputs, output):
    logits, labels, counted, temperature, softcap, want_entropy, inplace = inputs
    _lp, entropy, lse = output
    ctx.save_for_backward(logits, labels, counted, lse, entropy)
    ctx.temperature, ctx.softcap, ctx.want_entropy, ctx.inplace = temperature, softcap, want_entropy, inplace
    ctx.mark_non_differentiable(lse)


def _backward_with(bwd, inplace_write):
    def backward(ctx, grad_lp, grad_entropy, _grad_lse):
        logits, labels, counted, lse, entropy = ctx.saved_tensors
        if not ctx.want_entropy:
            grad_entropy = None
        if ctx.inplace:  # eager only (problem.py): the gradient overwrites the logits, chunk by chunk
            with torch.no_grad():
                target = logits.detach()  # shares the version counter: a later reader of the logits is told
                grad = inplace_write(grad_lp, grad_entropy, target, labels, counted, ctx.temperature, lse, entropy,
                                     target, softcap=ctx.softcap)
        else:
            grad = bwd(grad_lp, grad_entropy, logits, labels, counted, ctx.temperature, ctx.softcap, lse, entropy)
        return grad, None, None, None, None, None, None
    return backward


def _define(name: str, launcher, device_types=None):
    """``kl_kernels::{name}_fwd`` / ``_bwd`` around a launcher pair (``reference``, ``launch``,
    ``launch.emulated`` or ``launch_triton``: the same signatures), with fakes and autograd.

    ``{name}_fwd(logits, labels, counted, temperature, softcap, want_entropy, inplace_backward)`` gives
    ``(log_probs [*S], entropy [*S] or [0], lse [N])`` (``inplace_backward`` is read by the autograd formula
    only); ``{name}_bwd(grad_lp, grad_entropy, logits, labels, counted, temperature, softcap, lse, entropy)`` gives
    ``d loss / d logits``, a new contiguous tensor of the logits' shape and dtype."""

    def fwd(logits: Tensor, labels: Tensor, counted: Tensor, temperature: float, softcap: float, want_entropy: bool,
            inplace_backward: bool) -> tuple[Tensor, Tensor, Tensor]:
        return launcher.forward(logits, labels, counted, temperature, want_entropy, softcap=softcap)

    def bwd(grad_lp: Optional[Tensor], grad_entropy: Optional[Tensor], logits: Tensor, labels: Tensor,
            counted: Tensor, temperature: float, softcap: float, lse: Tensor, entropy: Tensor) -> Tensor:
        out = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        return launcher.backward(grad_lp, grad_entropy, logits, labels, counted, temperature, lse, entropy, out,
                                 softcap=softcap)

    fwd_op = op_library.define(f"kl_kernels::{name}_fwd", fwd, device_types=device_types)
    bwd_op = op_library.define(f"kl_kernels::{name}_bwd", bwd, device_types=device_types)
    fwd_op.register_fake(_fake_forward)
    bwd_op.register_fake(_fake_backward)
    fwd_op.register_autograd(_backward_with(bwd_op, launcher.backward), setup_context=_setup_context)
    return fwd_op, bwd_op


# The chunked torch math; the fused C++ kernels: the CPU one (_C), the CUDA one (_cuda), and the CUDA one under
# host emulation on CPU tensors (_cuda_emu: the cuda-emulated backend); the Triton kernels.
token_logprobs_fwd, token_logprobs_bwd = _define("token_logprobs", reference)
token_logprobs_cpu_fwd, token_logprobs_cpu_bwd = _define("token_logprobs_cpu", launch, "cpu")
token_logprobs_cuda_fwd, token_logprobs_cuda_bwd = _define("token_logprobs_cuda", launch, "cuda")
token_logprobs_cuda_emu_fwd, token_logprobs_cuda_emu_bwd = _define("token_logprobs_cuda_emu", launch.emulated, "cpu")
token_logprobs_triton_fwd, token_logprobs_triton_bwd = _define("token_logprobs_triton", launch_triton)


def run_torch(p: TokenLogprobsProblem) -> tuple[Tensor, Tensor | None]:
    """The torch backend: ``(log_probs, entropy or None)``."""
    lp, entropy, _lse = token_logprobs_fwd(p.logits, p.labels, p.counted, p.temperature, p.softcap,
                                           p.return_entropy, p.inplace_backward)
    return lp, (entropy if p.return_entropy else None)


def run_triton(p: TokenLogprobsProblem) -> tuple[Tensor, Tensor | None]:
    """The Triton backend: ``(log_probs, entropy or None)``, float32."""
    lp, entropy, _lse = token_logprobs_triton_fwd(p.logits, p.labels, p.counted, p.temperature, p.softcap,
                                                  p.return_entropy, p.inplace_backward)
    return lp, (entropy if p.return_entropy else None)


def run_fused(p: TokenLogprobsProblem, emulated: bool = False) -> tuple[Tensor, Tensor | None]:
    """The fused C++ backends (cpu on CPU tensors, cuda on CUDA ones; ``emulated``: the CUDA kernel on CPU
    tensors): ``(log_probs, entropy or None)``, float32."""
    op = (token_logprobs_cuda_emu_fwd if emulated else
          token_logprobs_cpu_fwd if p.logits.device.type == "cpu" else token_logprobs_cuda_fwd)
    lp, entropy, _lse = op(p.logits, p.labels, p.counted, p.temperature, p.softcap, p.return_entropy,
                           p.inplace_backward)
    return lp, (entropy if p.return_entropy else None)
