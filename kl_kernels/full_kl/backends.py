"""The backends of ``full_kl``, in ``"auto"`` preference order.

=========  =========  ========================  ============================================
backend    devices    dtypes                    status in this version
=========  =========  ========================  ============================================
cuda       cuda       fp32, bf16, fp16          not built yet (issue 28): says so when named
triton     cuda       fp32, bf16, fp16          Triton kernels (``kl_kernels/triton/full_kl.py``), one program
                                                per row: compiled for sm_80/sm_90 and run in Triton's
                                                interpreter in CI, not yet on a GPU: only when named
cpu        cpu        fp32, bf16, fp16          fused multi-threaded C++ kernel (``_C``,
                                                ``csrc/cpu/full_kl_cpu.cpp``): a row at a time
torch      cpu, cuda  fp32, bf16, fp16, fp64    chunked torch math (reference.py): no [N, V]
                                                float32 temporary, backward recomputed per chunk
=========  =========  ========================  ============================================
"""

from __future__ import annotations

import torch

from ..backends import HALF_AND_SINGLE, Backend, _extension_reasons, _triton_reasons
from ..triton import interpreting
from .ops import run_cpu, run_torch, run_triton

_ROWS = frozenset({"packed"})


def _not_built() -> list[str]:
    return ["full_kl has no fused CUDA kernel yet (issue 28); backend='torch' (or 'auto') runs it chunked, "
            "without an [N, V] float32 temporary"]


def _vocabulary_contiguous(problem) -> list[str]:
    reasons = []
    for name, t in (("logits", problem.logits), ("ref_logits", problem.ref_logits)):
        if t.stride(-1) != 1 and problem.vocab > 1:
            reasons.append(f"the {name}' vocabulary dimension has stride {t.stride(-1)}; the fused kernel reads "
                           f"each row contiguously (pass {name}.contiguous(), or backend='torch')")
    return reasons


def _never(problem):  # an unavailable row is never chosen
    raise AssertionError("unreachable: the backend is declared unavailable")


REGISTRY: list[Backend] = [
    Backend("cuda", frozenset({"cuda"}), HALF_AND_SINGLE, _ROWS, _not_built, _never, notes="not built yet"),
    Backend("triton", frozenset({"cuda", "cpu"} if interpreting() else {"cuda"}), HALF_AND_SINGLE, _ROWS,
            _triton_reasons, run_triton, requires=_vocabulary_contiguous, auto_devices=frozenset(),
            notes="Triton kernels, one program per row (only when named: not yet run on a GPU)"),
    Backend("cpu", frozenset({"cpu"}), HALF_AND_SINGLE, _ROWS,
            lambda: _extension_reasons("_C", "full_kl_forward"), run_cpu, requires=_vocabulary_contiguous,
            notes="fused multi-threaded C++ kernel"),
    Backend("torch", frozenset({"cpu", "cuda"}), HALF_AND_SINGLE | {torch.float64}, _ROWS, lambda: [], run_torch,
            notes="chunked torch math (float64-capable)"),
]
