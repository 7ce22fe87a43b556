"""The backends of ``token_logprobs``, in ``"auto"`` preference order.

=========  =========  ========================  ============================================
backend    devices    dtypes                    status in this version
=========  =========  ========================  ============================================
cuda       cuda       fp32, bf16, fp16          fused CUDA C++ kernel (``_cuda``,
                                                ``csrc/cuda/token_logprobs_cuda.cu``), one block per row:
                                                compiled for sm_80/sm_90 and run in emulation in CI, not yet
                                                on a GPU; "auto" after its first-use self-check
triton     cuda       fp32, bf16, fp16          Triton kernels (``kl_kernels/triton/token_logprobs.py``), one
                                                program per row: compiled for sm_80/sm_90 and run in Triton's
                                                interpreter in CI; ran on an H200 (2026-11-27: tests, no-sync,
                                                CUDA graph); "auto" after its first-use self-check
cpu        cpu        fp32, bf16, fp16          fused multi-threaded C++ kernel (``_C``,
                                                ``csrc/cpu/token_logprobs_cpu.cpp``): a row at a time
cuda-      cpu        fp32, bf16, fp16          the CUDA kernel under host emulation (``_cuda_emu``), on CPU
emulated                                        tensors, only when named (tests)
torch      cpu, cuda  fp32, bf16, fp16, fp64    chunked torch math (reference.py): no [N, V]
                                                float32 temporary, backward recomputed per chunk
=========  =========  ========================  ============================================
"""

from __future__ import annotations

import functools

import torch

from ..triton import interpreting
from .. import selfcheck
from ..backends import GPU_SELF_CHECK, HALF_AND_SINGLE, Backend, _cuda_reasons, _extension_reasons, _triton_reasons
from .ops import run_fused, run_torch, run_triton
from . import self_check

_ROWS = frozenset({"packed"})


def _vocabulary_contiguous(problem) -> list[str]:
    if problem.logits.dim() and problem.logits.stride(-1) != 1 and problem.vocab > 1:
        return [f"the logits' vocabulary dimension has stride {problem.logits.stride(-1)}; the fused kernel reads "
                "each row contiguously (pass logits.contiguous(), or backend='torch')"]
    return []


REGISTRY: list[Backend] = [
    Backend("cuda", frozenset({"cuda"}), HALF_AND_SINGLE, _ROWS, functools.partial(_cuda_reasons, "token_logprobs_forward"),
            run_fused, requires=_vocabulary_contiguous, self_check_devices=GPU_SELF_CHECK,
            notes="fused CUDA C++ kernel, one block per row (auto: after its first-use self-check)"),
    Backend("triton", frozenset({"cuda", "cpu"} if interpreting() else {"cuda"}), HALF_AND_SINGLE, _ROWS,
            _triton_reasons, run_triton, requires=_vocabulary_contiguous, auto_devices=frozenset({"cuda"}),
            self_check_devices=GPU_SELF_CHECK,
            notes="Triton kernels, one program per row" + (" (interpreter: CPU tensors on request)" if interpreting()
                                                          else " (auto: after its first-use self-check)")),
    Backend("cpu", frozenset({"cpu"}), HALF_AND_SINGLE, _ROWS,
            lambda: _extension_reasons("_C", "token_logprobs_forward"), run_fused, requires=_vocabulary_contiguous,
            notes="fused multi-threaded C++ kernel"),
    # The CUDA kernel on CPU tensors, for tests: "auto" never takes it (no auto device).
    Backend("cuda-emulated", frozenset({"cpu"}), HALF_AND_SINGLE, _ROWS,
            functools.partial(_extension_reasons, "_cuda_emu", "token_logprobs_forward"),
            functools.partial(run_fused, emulated=True), requires=_vocabulary_contiguous, auto_devices=frozenset(),
            notes="the CUDA kernel under a host emulation of CUDA (CPU tensors; a test instrument, slow)"),
    Backend("torch", frozenset({"cpu", "cuda"}), HALF_AND_SINGLE | {torch.float64}, _ROWS, lambda: [], run_torch,
            notes="chunked torch math (float64-capable)"),
]


# This op's first-use self-check, handed to the shared machinery (which imports no op).
selfcheck.register("token_logprobs", self_check.check)
