"""``token_logprobs``' ``torch.library`` ops: forward and backward of each backend (the chunked torch math,
the fused CPU kernel, the CUDA kernel, the same under host emulation, the Triton kernels), with fake
implementations and autograd, so ``torch.compile(fullgraph=True)`` traces one opaque op instead of
unrolling the chunk loop. ``temperature`` and ``want_entropy`` are schema arguments:
changing them never recompiles a kernel (there is none to compile)."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import launch, launch_triton, reference
from .problem import TokenLogprobsProblem


@torch.library.custom_op("kl_kernels::token_logprobs_fwd", mutates_args=())
def token_logprobs_fwd(logits: Tensor, labels: Tensor, counted: Tensor, temperature: float, want_entropy: bool,
                       inplace_backward: bool) -> tuple[Tensor, Tensor, Tensor]:
    """``(log_probs [*S], entropy [*S] or [0], lse [N])``; ``inplace_backward`` is read by the
    autograd formula only."""
    return reference.forward(logits, labels, counted, temperature, want_entropy)


def _fake_forward(logits, labels, counted, temperature, want_entropy, inplace_backward):
    md = reference.math_dtype(logits)  # the fused kernels read fp32/bf16/fp16: float32 there too
    return (logits.new_empty(labels.shape, dtype=md),
            logits.new_empty(labels.shape if want_entropy else (0,), dtype=md),
            logits.new_empty((labels.numel(),), dtype=md))


def _fake_backward(grad_lp, grad_entropy, logits, labels, counted, temperature, lse, entropy):
    return torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)


token_logprobs_fwd.register_fake(_fake_forward)


@torch.library.custom_op("kl_kernels::token_logprobs_bwd", mutates_args=())
def token_logprobs_bwd(grad_lp: Optional[Tensor], grad_entropy: Optional[Tensor], logits: Tensor, labels: Tensor,
                       counted: Tensor, temperature: float, lse: Tensor, entropy: Tensor) -> Tensor:
    """``d loss / d logits``, a new contiguous tensor of the logits' shape and dtype."""
    out = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
    return reference.backward(grad_lp, grad_entropy, logits, labels, counted, temperature, lse, entropy, out)


token_logprobs_bwd.register_fake(_fake_backward)


@torch.library.custom_op("kl_kernels::token_logprobs_triton_fwd", mutates_args=())
def token_logprobs_triton_fwd(logits: Tensor, labels: Tensor, counted: Tensor, temperature: float, want_entropy: bool,
                              inplace_backward: bool) -> tuple[Tensor, Tensor, Tensor]:
    """The Triton kernels' forward (kl_kernels/triton/token_logprobs.py): as ``token_logprobs_fwd``, float32."""
    return launch_triton.forward(logits, labels, counted, temperature, want_entropy)


token_logprobs_triton_fwd.register_fake(_fake_forward)


@torch.library.custom_op("kl_kernels::token_logprobs_triton_bwd", mutates_args=())
def token_logprobs_triton_bwd(grad_lp: Optional[Tensor], grad_entropy: Optional[Tensor], logits: Tensor,
                              labels: Tensor, counted: Tensor, temperature: float, lse: Tensor,
                              entropy: Tensor) -> Tensor:
    """The Triton kernels' backward: ``d loss / d logits``, a new contiguous tensor."""
    out = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
    return launch_triton.backward(grad_lp, grad_entropy, logits, labels, counted, temperature, lse, entropy, out)


token_logprobs_triton_bwd.register_fake(_fake_backward)


def _define_fused(name: str, launcher, device_types):
    """``kl_kernels::{name}_fwd`` / ``_bwd`` around a C++ launcher (``launch`` or ``launch.emulated``), with fakes."""

    def fwd(logits: Tensor, labels: Tensor, counted: Tensor, temperature: float, want_entropy: bool,
            inplace_backward: bool) -> tuple[Tensor, Tensor, Tensor]:
        return launcher.forward(logits, labels, counted, temperature, want_entropy)

    def bwd(grad_lp: Optional[Tensor], grad_entropy: Optional[Tensor], logits: Tensor, labels: Tensor,
            counted: Tensor, temperature: float, lse: Tensor, entropy: Tensor) -> Tensor:
        out = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        return launcher.backward(grad_lp, grad_entropy, logits, labels, counted, temperature, lse, entropy, out)

    fwd_op = torch.library.custom_op(f"kl_kernels::{name}_fwd", fwd, mutates_args=(), device_types=device_types)
    bwd_op = torch.library.custom_op(f"kl_kernels::{name}_bwd", bwd, mutates_args=(), device_types=device_types)
    fwd_op.register_fake(_fake_forward)
    bwd_op.register_fake(_fake_backward)
    return fwd_op, bwd_op


# The fused C++ kernels: the CPU one (_C), the CUDA one (_cuda), and the CUDA one under host emulation on
# CPU tensors (_cuda_emu: the cuda-emulated backend).
token_logprobs_cpu_fwd, token_logprobs_cpu_bwd = _define_fused("token_logprobs_cpu", launch, "cpu")
token_logprobs_cuda_fwd, token_logprobs_cuda_bwd = _define_fused("token_logprobs_cuda", launch, "cuda")
token_logprobs_cuda_emu_fwd, token_logprobs_cuda_emu_bwd = _define_fused("token_logprobs_cuda_emu", launch.emulated,
                                                                         "cpu")


def _setup_context(ctx, inputs, output):
    logits, labels, counted, temperature, want_entropy, inplace = inputs
    _lp, entropy, lse = output
    ctx.save_for_backward(logits, labels, counted, lse, entropy)
    ctx.temperature, ctx.want_entropy, ctx.inplace = temperature, want_entropy, inplace
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
                                     target)
        else:
            grad = bwd(grad_lp, grad_entropy, logits, labels, counted, ctx.temperature, lse, entropy)
        return grad, None, None, None, None, None
    return backward


token_logprobs_fwd.register_autograd(_backward_with(token_logprobs_bwd, reference.backward),
                                     setup_context=_setup_context)
token_logprobs_cpu_fwd.register_autograd(_backward_with(token_logprobs_cpu_bwd, launch.backward),
                                         setup_context=_setup_context)
token_logprobs_cuda_fwd.register_autograd(_backward_with(token_logprobs_cuda_bwd, launch.backward),
                                          setup_context=_setup_context)
token_logprobs_cuda_emu_fwd.register_autograd(_backward_with(token_logprobs_cuda_emu_bwd, launch.emulated.backward),
                                              setup_context=_setup_context)
token_logprobs_triton_fwd.register_autograd(_backward_with(token_logprobs_triton_bwd, launch_triton.backward),
                                            setup_context=_setup_context)


def run_torch(p: TokenLogprobsProblem) -> tuple[Tensor, Tensor | None]:
    """The torch backend: ``(log_probs, entropy or None)``."""
    lp, entropy, _lse = token_logprobs_fwd(p.logits, p.labels, p.counted, p.temperature, p.return_entropy,
                                           p.inplace_backward)
    return lp, (entropy if p.return_entropy else None)


def run_triton(p: TokenLogprobsProblem) -> tuple[Tensor, Tensor | None]:
    """The Triton backend: ``(log_probs, entropy or None)``, float32."""
    lp, entropy, _lse = token_logprobs_triton_fwd(p.logits, p.labels, p.counted, p.temperature, p.return_entropy,
                                                  p.inplace_backward)
    return lp, (entropy if p.return_entropy else None)


def run_fused(p: TokenLogprobsProblem, emulated: bool = False) -> tuple[Tensor, Tensor | None]:
    """The fused C++ backends (cpu on CPU tensors, cuda on CUDA ones; ``emulated``: the CUDA kernel on CPU
    tensors): ``(log_probs, entropy or None)``, float32."""
    op = (token_logprobs_cuda_emu_fwd if emulated else
          token_logprobs_cpu_fwd if p.logits.device.type == "cpu" else token_logprobs_cuda_fwd)
    lp, entropy, _lse = op(p.logits, p.labels, p.counted, p.temperature, p.return_entropy, p.inplace_backward)
    return lp, (entropy if p.return_entropy else None)
