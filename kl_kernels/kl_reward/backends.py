"""The backends of ``kl_reward``, in ``"auto"`` preference order, with what each supports.

=========  =========  ========================  ============================================
backend    devices    dtypes                    status in this version
=========  =========  ========================  ============================================
cuda       cuda       fp32, bf16, fp16          fused CUDA C++ kernel (``_cuda``); "auto" only
                                                after its first-use self-check (see below)
triton     cuda       fp32, bf16, fp16          Triton kernels (``kl_kernels/triton/``); CPU
                                                tensors too under ``TRITON_INTERPRET=1``, on
                                                explicit request only
cpu        cpu        fp32, bf16, fp16          fused multi-threaded C++ kernel (``_C``)
cuda-      cpu        fp32, bf16, fp16          the CUDA kernels of ``cuda`` compiled against a host
emulated                                        emulation of CUDA (``_cuda_emu``): a test instrument,
                                                slow; runs only when named, never for "auto"
torch      cpu, cuda  fp32, bf16, fp16, fp64    vectorized torch reference: always available
=========  =========  ========================  ============================================

The fused kernels also need ``log_probs`` and ``ref_log_probs`` in one dtype (mixed pairs go to
the reference). Only ``cpu`` reads lists of per-sample tensors in place (the ``"list"`` layout;
other backends get them packed) and ``mask_nan`` outside autograd (folded into the mask otherwise).
A compiled backend is available only when its extension loads *and* holds the kernel: the Python
side looks the kernel up by name, so a build without it is reported as such and never used. Asking for an unavailable backend raises
:class:`~kl_kernels.backends.BackendUnavailableError` with every reason.
"""

from __future__ import annotations

import dataclasses

import torch

from .. import selfcheck
from ..backends import BOTH_LAYOUTS, HALF_AND_SINGLE, Backend, fused_backends
from .ops import run_fused
from . import self_check
from .reference import kl_reward_reference

KERNEL_FORWARD = "kl_reward_forward"  # symbol the compiled extensions will export


def _same_logprob_dtype(problem) -> list[str]:
    if problem.log_probs.dtype != problem.ref_log_probs.dtype:
        return [f"log_probs ({problem.log_probs.dtype}) and ref_log_probs ({problem.ref_log_probs.dtype}) differ in "
                "dtype; the fused kernels read both in one dtype"]
    return []


def _gpu_kernel_reasons(problem) -> list[str]:
    """What the cuda and triton kernels decline: mixed log-prob dtypes, and an unfolded mask_nan."""
    reasons = _same_logprob_dtype(problem)
    if problem.mask_nan:
        reasons.append("mask_nan without autograd is read by the cpu kernel and the torch reference only")
    return reasons


def _kl_reward_fused_backends() -> list[Backend]:
    """The shared fused rows, plus kl_reward's CPU-only extras: list inputs read in place (the
    ``"list"`` layout, see problem.py) and ``mask_nan``, which the GPU kernels do not take."""
    rows = []
    for b in fused_backends(KERNEL_FORWARD, run_fused, _same_logprob_dtype):
        if b.name == "cpu":
            b = dataclasses.replace(b, layouts=BOTH_LAYOUTS | {"list"})
        else:
            b = dataclasses.replace(b, requires=_gpu_kernel_reasons)
        rows.append(b)
    return rows


REGISTRY: list[Backend] = _kl_reward_fused_backends() + [
    Backend("torch", frozenset({"cpu", "cuda"}), HALF_AND_SINGLE | {torch.float64}, BOTH_LAYOUTS, lambda: [],
            kl_reward_reference, notes="vectorized torch reference (float64-capable)"),
]


# This op's first-use self-check, handed to the shared machinery (which imports no op).
selfcheck.register("kl_reward", self_check.check)
