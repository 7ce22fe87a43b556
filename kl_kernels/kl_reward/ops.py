"""``torch.library`` registration of the fused kl_reward kernels: ops, fake tensors, autograd.

Two custom ops per kernel family wrap a host launcher: ``kl_kernels::kl_reward_fwd`` /
``kl_reward_bwd`` the C++ kernels (``launch.py``, which picks ``_C`` or ``_cuda`` by device) and
``kl_kernels::kl_reward_triton_fwd`` / ``kl_reward_triton_bwd`` the Triton kernels
(``launch_triton.py``; CPU tensors only under Triton's interpreter). Their fake implementations give ``torch.compile`` and ``torch.export``
output shapes without running anything, and ``register_autograd`` makes the forward
differentiable with the fused backward. ``run_fused`` maps a normalized ``KLRewardProblem`` onto
the forward op of the ``cpu``/``cuda`` backends or, with ``triton=True``, of the ``triton`` backend.

The schema carries runtime values (coef, clamps) as runtime arguments, so a changing coefficient
never causes a recompilation.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
from torch import Tensor

from .. import launching, op_library
from . import launch, launch_triton
from .problem import KLRewardProblem, RawOutputs

_DEVICES = ("cpu", "cuda")


def _define(name: str, launcher):
    """Register ``kl_kernels::<name>_fwd`` / ``<name>_bwd`` around ``launcher``'s forward and
    backward (same signatures for every launcher), with fake implementations and autograd."""

    @op_library.define(f"kl_kernels::{name}_fwd", device_types=_DEVICES)
    def fwd(log_probs: Tensor, ref_log_probs: Tensor, mask: Optional[Tensor], offsets: Optional[Tensor],
            lengths: Optional[Tensor], prompt_lens: Optional[Tensor], reward: Optional[Tensor],
            coef: Optional[Tensor], coef_scalar: float, layout: int, left_pad: bool, placement: int,
            estimator: int, straight_through: bool, clamp: Sequence[float], return_ref: bool,
            reward_dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        """Fused forward: (kl, reward_out, ref_out (empty unless return_ref), kl_sum, count)."""
        return launcher.forward(log_probs, ref_log_probs, mask, offsets, lengths, prompt_lens, reward, coef,
                                coef_scalar, layout, left_pad, placement, estimator, straight_through, clamp,
                                return_ref, reward_dtype)

    @fwd.register_fake
    def _(log_probs, ref_log_probs, mask, offsets, lengths, prompt_lens, reward, coef, coef_scalar, layout, left_pad,
          placement, estimator, straight_through, clamp, return_ref, reward_dtype):
        batch = offsets.shape[0] - 1 if layout == 0 else log_probs.shape[0]
        shape = log_probs.shape
        return (log_probs.new_empty(shape), log_probs.new_empty(shape, dtype=reward_dtype),
                ref_log_probs.new_empty(shape if return_ref else (0,)),
                log_probs.new_empty((batch,), dtype=torch.float32), log_probs.new_empty((batch,), dtype=torch.int64))

    @op_library.define(f"kl_kernels::{name}_bwd", device_types=_DEVICES)
    def bwd(log_probs: Tensor, ref_log_probs: Tensor, mask: Optional[Tensor], offsets: Optional[Tensor],
            lengths: Optional[Tensor], prompt_lens: Optional[Tensor], coef: Optional[Tensor], coef_scalar: float,
            layout: int, left_pad: bool, estimator: int, straight_through: bool, clamp: Sequence[float],
            reward_dtype: torch.dtype, g_kl: Optional[Tensor], g_reward: Optional[Tensor],
            g_ref_out: Optional[Tensor], g_kl_sum: Optional[Tensor]) -> tuple[Tensor, Tensor]:
        """Fused backward: (grad_log_probs, grad_ref_log_probs) from the outputs' gradients."""
        return launcher.backward(log_probs, ref_log_probs, mask, offsets, lengths, prompt_lens, coef, coef_scalar,
                                 layout, left_pad, estimator, straight_through, clamp, reward_dtype,
                                 g_kl, g_reward, g_ref_out, g_kl_sum)

    @bwd.register_fake
    def _(log_probs, ref_log_probs, mask, offsets, lengths, prompt_lens, coef, coef_scalar, layout, left_pad,
          estimator, straight_through, clamp, reward_dtype, g_kl, g_reward, g_ref_out, g_kl_sum):
        return log_probs.new_empty(log_probs.shape), ref_log_probs.new_empty(ref_log_probs.shape)

    def setup_context(ctx, inputs, output):
        (log_probs, ref_log_probs, mask, offsets, lengths, prompt_lens, reward, coef, coef_scalar, layout, left_pad,
         placement, estimator, straight_through, clamp, return_ref, reward_dtype) = inputs
        ctx.save_for_backward(log_probs, ref_log_probs, mask, offsets, lengths, prompt_lens, coef)
        ctx.params = (coef_scalar, layout, left_pad, estimator, straight_through, list(clamp), reward_dtype)
        ctx.return_ref = return_ref

    def backward(ctx, g_kl, g_reward, g_ref_out, g_kl_sum, _g_count):
        log_probs, ref_log_probs, mask, offsets, lengths, prompt_lens, coef = ctx.saved_tensors
        g_lp, g_ref = bwd(log_probs, ref_log_probs, mask, offsets, lengths, prompt_lens, coef, *ctx.params, g_kl,
                          g_reward, g_ref_out if ctx.return_ref else None, g_kl_sum)
        return (g_lp, g_ref) + (None,) * 15

    fwd.register_autograd(backward, setup_context=setup_context)
    return fwd, bwd


# The C++ kernels (the launcher picks _C or _cuda by device), the Triton kernels, and the CUDA
# kernels under host emulation on CPU tensors (the cuda-emulated backend: _cuda_emu).
kl_reward_fwd, kl_reward_bwd = _define("kl_reward", launch)
kl_reward_triton_fwd, kl_reward_triton_bwd = _define("kl_reward_triton", launch_triton)
kl_reward_cuda_emu_fwd, kl_reward_cuda_emu_bwd = _define("kl_reward_cuda_emu", launch.emulated)


def run_fused(p: KLRewardProblem, triton: bool = False, emulated: bool = False) -> RawOutputs:
    """The fused backends' entry point: a normalized problem through ``kl_kernels::kl_reward_fwd``
    (C++ kernels), ``kl_kernels::kl_reward_triton_fwd`` (``triton=True``) or
    ``kl_kernels::kl_reward_cuda_emu_fwd`` (``emulated=True``: the CUDA kernels on CPU tensors)."""
    args = forward_args(p)
    needs_graph = torch.is_grad_enabled() and (p.log_probs.requires_grad or p.ref_log_probs.requires_grad)
    if p.layout == "list" or p.mask_nan:
        # Only built for eager calls without autograd on the CPU (problem.py): the launcher reads
        # the per-sequence tensors in place and masks NaN pads itself; it writes into the caller's
        # out= buffers too (lists take no out=), so no per-call [B, T] temporary is made and copied.
        kl, reward, ref_out, kl_sum, count = launch.forward(*args, mask_nan=p.mask_nan, out=p.out)
    elif needs_graph or torch.compiler.is_compiling():
        op = kl_reward_triton_fwd if triton else kl_reward_cuda_emu_fwd if emulated else kl_reward_fwd
        kl, reward, ref_out, kl_sum, count = op(*args)
    elif triton:
        # Eager and no autograd: the op would only add dispatcher overhead around the same launch.
        kl, reward, ref_out, kl_sum, count = launch_triton.forward(*args)
    else:  # the C++ kernels write into the caller's out= buffers (api.py copies for the others)
        kl, reward, ref_out, kl_sum, count = (launch.emulated if emulated else launch).forward(*args, out=p.out)
    return _raw(p, (kl, reward, ref_out, kl_sum, count))


def forward_args(p: KLRewardProblem) -> tuple:
    """The 17 arguments of ``kl_kernels::kl_reward_fwd`` (and of the launchers' forward) for ``p``."""
    coef_tensor = p.coef if isinstance(p.coef, torch.Tensor) else None
    coef_scalar = 0.0 if coef_tensor is not None else float(p.coef)
    clamp = [*launching.clamp_bounds(p.clamp_input), *launching.clamp_bounds(p.clamp_output)]
    return (p.log_probs, p.ref_log_probs, p.mask, p.offsets, p.lengths, p.prompt_lens, p.reward, coef_tensor,
            coef_scalar, launching.LAYOUT_CODES[p.layout], p.padding_side == "left", launching.PLACEMENT_CODES[p.placement],
            launching.ESTIMATOR_CODES[p.estimator.rstrip("+")], p.estimator.endswith("+"), clamp, p.return_ref,
            p.reward_dtype)


def _raw(p: KLRewardProblem, outputs) -> RawOutputs:
    """The launchers' (kl, reward, ref_out, kl_sum, count) as RawOutputs (ref_out only if asked for)."""
    kl, reward, ref_out, kl_sum, count = outputs
    return RawOutputs(kl, reward, ref_out if p.return_ref else None, kl_sum, count)


def run_fused_list(p: KLRewardProblem, during: Callable[[RawOutputs], None]) -> RawOutputs:
    """The cpu backend on the ``"list"`` layout, calling ``during(raw)`` while the kernel runs on
    torch's other threads: ``raw``'s tensors are not yet written, ``during`` may only make views
    of them and store those (see ``launch.forward_during``)."""
    outputs = launch.forward_during(lambda outputs: during(_raw(p, outputs)), *forward_args(p), mask_nan=p.mask_nan)
    return _raw(p, outputs)
