"""``full_kl``'s ``torch.library`` ops: forward and backward of each backend (the chunked torch math, the
fused CPU kernel, the CUDA kernel, the same under host emulation, the Triton kernels), with fake
implementations and autograd, so ``torch.compile(fullgraph=True)`` traces one opaque op each.
``temperature`` and ``softcap`` (kernel units, 0.0: none; ``problem.py``) are schema arguments: changing
them never recompiles a kernel."""

from __future__ import annotations

import torch
from torch import Tensor

from .. import op_library
from . import launch, launch_triton, reference
from .problem import FullKLProblem


def _fake_forward(logits, ref_logits, counted, temperature, softcap):
    md = reference.math_dtype(logits)  # the fused kernels read fp32/bf16/fp16: float32 there too
    n = counted.numel()
    return logits.new_empty(counted.shape, dtype=md), logits.new_empty((n,), dtype=md), logits.new_empty((n,), dtype=md)


def _fake_backward(grad_kl, logits, ref_logits, counted, temperature, softcap, kl, lse, ref_lse, want_logits,
                   want_ref):
    def grad(want):
        return torch.empty(logits.shape if want else (0,), dtype=logits.dtype, device=logits.device)
    return grad(want_logits), grad(want_ref)


def _register(name: str, forward, backward, device_types=None):
    """``kl_kernels::{name}_fwd`` / ``_bwd`` ops around a launcher pair, with fakes and autograd."""

    def fwd(logits: Tensor, ref_logits: Tensor, counted: Tensor, temperature: float,
            softcap: float) -> tuple[Tensor, Tensor, Tensor]:
        return forward(logits, ref_logits, counted, temperature, softcap=softcap)

    def bwd(grad_kl: Tensor, logits: Tensor, ref_logits: Tensor, counted: Tensor, temperature: float, softcap: float,
            kl: Tensor, lse: Tensor, ref_lse: Tensor, want_logits: bool, want_ref: bool) -> tuple[Tensor, Tensor]:
        def new(want):  # contiguous: the kernels write rows at the logits' own row map
            return torch.empty(logits.shape if want else (0,), dtype=logits.dtype, device=logits.device)
        g_logits, g_ref = new(want_logits), new(want_ref)
        backward(grad_kl, logits, ref_logits, counted, temperature, kl, lse, ref_lse,
                 g_logits if want_logits else None, g_ref if want_ref else None, softcap=softcap)
        return g_logits, g_ref

    fwd_op = op_library.define(f"kl_kernels::{name}_fwd", fwd, device_types=device_types)
    bwd_op = op_library.define(f"kl_kernels::{name}_bwd", bwd, device_types=device_types)
    fwd_op.register_fake(_fake_forward)
    bwd_op.register_fake(_fake_backward)

    def setup_context(ctx, inputs, output):
        logits, ref_logits, counted, temperature, softcap = inputs
        kl, lse, ref_lse = output
        ctx.save_for_backward(logits, ref_logits, counted, kl, lse, ref_lse)
        ctx.temperature, ctx.softcap = temperature, softcap
        ctx.mark_non_differentiable(lse, ref_lse)

    def autograd_backward(ctx, grad_kl, _grad_lse, _grad_ref_lse):
        logits, ref_logits, counted, kl, lse, ref_lse = ctx.saved_tensors
        want_logits, want_ref = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        g_logits, g_ref = bwd_op(grad_kl, logits, ref_logits, counted, ctx.temperature, ctx.softcap, kl, lse, ref_lse,
                                 want_logits, want_ref)
        return (g_logits if want_logits else None), (g_ref if want_ref else None), None, None, None

    fwd_op.register_autograd(autograd_backward, setup_context=setup_context)
    return fwd_op, bwd_op


full_kl_fwd, full_kl_bwd = _register("full_kl", reference.forward, reference.backward)
# The fused C++ kernels: the CPU one (_C), the CUDA one (_cuda), and the CUDA one under host emulation on CPU
# tensors (_cuda_emu: the cuda-emulated backend).
full_kl_cpu_fwd, full_kl_cpu_bwd = _register("full_kl_cpu", launch.forward, launch.backward, device_types="cpu")
full_kl_cuda_fwd, full_kl_cuda_bwd = _register("full_kl_cuda", launch.forward, launch.backward, device_types="cuda")
full_kl_cuda_emu_fwd, full_kl_cuda_emu_bwd = _register("full_kl_cuda_emu", launch.emulated.forward,
                                                       launch.emulated.backward, device_types="cpu")
full_kl_triton_fwd, full_kl_triton_bwd = _register("full_kl_triton", launch_triton.forward, launch_triton.backward)


def run_torch(p: FullKLProblem) -> Tensor:
    """The torch backend: ``kl [*S]`` in the math dtype."""
    return full_kl_fwd(p.logits, p.ref_logits, p.counted, p.temperature, p.softcap)[0]


def run_fused(p: FullKLProblem, emulated: bool = False) -> Tensor:
    """The fused C++ backends (cpu on CPU tensors, cuda on CUDA ones; ``emulated``: the CUDA kernel on CPU
    tensors): ``kl [*S]``, float32."""
    op = full_kl_cuda_emu_fwd if emulated else full_kl_cpu_fwd if p.logits.device.type == "cpu" else full_kl_cuda_fwd
    return op(p.logits, p.ref_logits, p.counted, p.temperature, p.softcap)[0]


def run_triton(p: FullKLProblem) -> Tensor:
    """The Triton backend: ``kl [*S]``, float32."""
    return full_kl_triton_fwd(p.logits, p.ref_logits, p.counted, p.temperature, p.softcap)[0]
