"""The backends of ``token_logprobs``, in ``"auto"`` preference order.

=========  =========  ========================  ============================================
backend    devices    dtypes                    status in this version
=========  =========  ========================  ============================================
cuda       cuda       fp32, bf16, fp16          not built yet (issue 28): says so when named
triton     cuda       fp32, bf16, fp16          Triton kernels (``kl_kernels/triton/token_logprobs.py``), one
                                                program per row: compiled for sm_80/sm_90 and run in Triton's
                                                interpreter in CI; ran on an H200 (2026-11-27: tests, no-sync,
                                                CUDA graph); "auto" after its first-use self-check
cpu        cpu        fp32, bf16, fp16          fused multi-threaded C++ kernel (``_C``,
                                                ``csrc/cpu/token_logprobs_cpu.cpp``): a row at a time
torch      cpu, cuda  fp32, bf16, fp16, fp64    chunked torch math (reference.py): no [N, V]
                                                float32 temporary, backward recomputed per chunk
=========  =========  ========================  ============================================
"""

from __future__ import annotations

import torch

from ..triton import interpreting
from ..backends import GPU_SELF_CHECK, HALF_AND_SINGLE, Backend, _extension_reasons, _triton_reasons
from .ops import run_cpu, run_torch, run_triton

_ROWS = frozenset({"packed"})


def _not_built(kind: str):  # the CUDA C++ row kernel
    def reasons() -> list[str]:
        return [f"token_logprobs has no fused {kind} kernel yet (issue 28); backend='torch' (or 'auto') runs it "
                "chunked, without an [N, V] float32 temporary"]
    return reasons


def _vocabulary_contiguous(problem) -> list[str]:
    if problem.logits.dim() and problem.logits.stride(-1) != 1 and problem.vocab > 1:
        return [f"the logits' vocabulary dimension has stride {problem.logits.stride(-1)}; the fused kernel reads "
                "each row contiguously (pass logits.contiguous(), or backend='torch')"]
    return []


def _never(problem):  # an unavailable row is never chosen
    raise AssertionError("unreachable: the backend is declared unavailable")


REGISTRY: list[Backend] = [
    Backend("cuda", frozenset({"cuda"}), HALF_AND_SINGLE, _ROWS, _not_built("CUDA"), _never, notes="not built yet"),
    Backend("triton", frozenset({"cuda", "cpu"} if interpreting() else {"cuda"}), HALF_AND_SINGLE, _ROWS,
            _triton_reasons, run_triton, requires=_vocabulary_contiguous, auto_devices=frozenset({"cuda"}),
            self_check_devices=GPU_SELF_CHECK,
            notes="Triton kernels, one program per row" + (" (interpreter: CPU tensors on request)" if interpreting()
                                                          else " (auto: after its first-use self-check)")),
    Backend("cpu", frozenset({"cpu"}), HALF_AND_SINGLE, _ROWS,
            lambda: _extension_reasons("_C", "token_logprobs_forward"), run_cpu, requires=_vocabulary_contiguous,
            notes="fused multi-threaded C++ kernel"),
    Backend("torch", frozenset({"cpu", "cuda"}), HALF_AND_SINGLE | {torch.float64}, _ROWS, lambda: [], run_torch,
            notes="chunked torch math (float64-capable)"),
]
