"""The backends of ``kl_penalty_loss``, in ``"auto"`` preference order, with what each supports.

=========  =========  ========================  ============================================
backend    devices    dtypes                    status in this version
=========  =========  ========================  ============================================
cuda       cuda       fp32, bf16, fp16          fused CUDA C++ kernel (``_cuda``); "auto" only after
                                                its first-use self-check on the device
triton     cuda       fp32, bf16, fp16          Triton kernels (``kl_kernels/triton/kl_penalty.py``);
                                                CPU tensors under ``TRITON_INTERPRET=1`` on request
cpu        cpu        fp32, bf16, fp16          fused multi-threaded C++ kernel (``_C``)
cuda-      cpu        fp32, bf16, fp16          the CUDA kernels under a host emulation of CUDA
emulated                                        (``_cuda_emu``), on CPU tensors, only when named
torch      cpu, cuda  fp32, bf16, fp16, fp64    vectorized torch reference (autograd)
=========  =========  ========================  ============================================

The GPU kernels have not run on a GPU in CI: as for kl_reward, ``"auto"`` on a CUDA device takes the
cuda and triton rows only after they pass the first-use self-check there (:mod:`kl_kernels.selfcheck`),
else the next row (the torch reference at last).
"""

from __future__ import annotations

import torch

from .. import selfcheck
from ..backends import BOTH_LAYOUTS, HALF_AND_SINGLE, Backend, fused_backends
from .ops import run_fused
from . import self_check
from .reference import kl_penalty_reference


def _same_logprob_dtype(problem) -> list[str]:
    dtypes = {problem.log_probs.dtype, problem.old_log_probs.dtype}
    if problem.ref_log_probs is not None:
        dtypes.add(problem.ref_log_probs.dtype)
    if len(dtypes) > 1:
        return [f"log_probs, old_log_probs and ref_log_probs differ in dtype ({', '.join(sorted(map(str, dtypes)))}); "
                "the fused kernels read them in one dtype"]
    return []


def _ppo_objective(problem) -> list[str]:
    if problem.objective != "ppo":
        return [f"objective={problem.objective!r} is not in the fused kernels' formula table yet (the torch "
                "backend runs it)"]
    return []


def _fused_requirements(problem) -> list[str]:
    return _same_logprob_dtype(problem) + _ppo_objective(problem)


def _no_gradient_buffer(problem) -> list[str]:
    if problem.grad_out is not None:
        return ["out= is the fused kernels' gradient buffer; the torch reference differentiates by autograd and "
                "has none (call without out=, or pick a fused backend)"]
    return []


REGISTRY: list[Backend] = fused_backends("kl_penalty_forward", run_fused, _fused_requirements) + [
    Backend("torch", frozenset({"cpu", "cuda"}), HALF_AND_SINGLE | {torch.float64}, BOTH_LAYOUTS, lambda: [],
            kl_penalty_reference, notes="vectorized torch reference (float64-capable)",
            requires=_no_gradient_buffer),
]


# This op's first-use self-check, handed to the shared machinery (which imports no op).
selfcheck.register("kl_penalty_loss", self_check.check)
