"""The backends of ``kl_penalty_loss``, in ``"auto"`` preference order, with what each supports.

=========  =========  ========================  ============================================
backend    devices    dtypes                    status in this version
=========  =========  ========================  ============================================
cuda       cuda       fp32, bf16, fp16          fused CUDA C++ kernel (``_cuda``): by name only until a GPU
                                                run validates it (``CUDA_KERNEL_VALIDATED_ON_GPU``)
triton     cuda       fp32, bf16, fp16          Triton kernels (``kl_kernels/triton/kl_penalty.py``);
                                                CPU tensors under ``TRITON_INTERPRET=1`` on request
cpu        cpu        fp32, bf16, fp16          fused multi-threaded C++ kernel (``_C``)
torch      cpu, cuda  fp32, bf16, fp16, fp64    vectorized torch reference (autograd)
=========  =========  ========================  ============================================

The CUDA C++ kernel compiles in CI but has not yet run on a GPU: like kl_reward's, ``"auto"`` does
not pick it until a GPU run of the suite flips ``CUDA_KERNEL_VALIDATED_ON_GPU`` (shared with
kl_reward); ``"auto"`` on a GPU runs the Triton kernels when Triton is installed, else the torch
reference.
"""

from __future__ import annotations

import torch

from .. import _extensions
from ..backends import Backend
from ..kl_reward.backends import CUDA_KERNEL_VALIDATED_ON_GPU, _torch_cuda_reason, _triton_reasons
from ..triton import interpreting
from .ops import run_fused
from .reference import kl_penalty_reference

HALF_AND_SINGLE = frozenset({torch.float32, torch.bfloat16, torch.float16})
BOTH_LAYOUTS = frozenset({"packed", "padded"})


def _cpu_reasons() -> list[str]:
    _, reason = _extensions.kernel("_C", "kl_penalty_forward")
    return [reason] if reason else []


def _cuda_reasons() -> list[str]:
    _, reason = _extensions.kernel("_cuda", "kl_penalty_forward")
    return ([reason] if reason else []) + _torch_cuda_reason()


def _same_logprob_dtype(problem) -> list[str]:
    dtypes = {problem.log_probs.dtype, problem.old_log_probs.dtype}
    if problem.ref_log_probs is not None:
        dtypes.add(problem.ref_log_probs.dtype)
    if len(dtypes) > 1:
        return [f"log_probs, old_log_probs and ref_log_probs differ in dtype ({', '.join(sorted(map(str, dtypes)))}); "
                "the fused kernels read them in one dtype"]
    return []


def _run_triton(problem):
    return run_fused(problem, triton=True)


REGISTRY: list[Backend] = [
    Backend("cuda", frozenset({"cuda"}), HALF_AND_SINGLE, BOTH_LAYOUTS, _cuda_reasons, run_fused,
            requires=_same_logprob_dtype, auto_devices=None if CUDA_KERNEL_VALIDATED_ON_GPU else frozenset(),
            notes="fused CUDA C++ kernel" + ("" if CUDA_KERNEL_VALIDATED_ON_GPU else
                                             " (not yet validated on a GPU: runs only when requested by name)")),
    Backend("triton", frozenset({"cuda", "cpu"} if interpreting() else {"cuda"}), HALF_AND_SINGLE, BOTH_LAYOUTS,
            _triton_reasons, _run_triton, requires=_same_logprob_dtype, auto_devices=frozenset({"cuda"}),
            notes="Triton kernels" + (" (interpreter: CPU tensors on request)" if interpreting() else "")),
    Backend("cpu", frozenset({"cpu"}), HALF_AND_SINGLE, BOTH_LAYOUTS, _cpu_reasons, run_fused,
            requires=_same_logprob_dtype, notes="fused multi-threaded C++ kernel"),
    Backend("torch", frozenset({"cpu", "cuda"}), HALF_AND_SINGLE | {torch.float64}, BOTH_LAYOUTS, lambda: [],
            kl_penalty_reference, notes="vectorized torch reference (float64-capable)"),
]
