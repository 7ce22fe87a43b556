"""The backends of ``kl_penalty_loss``, in ``"auto"`` preference order, with what each supports.

=========  =========  ========================  ============================================
backend    devices    dtypes                    status in this version
=========  =========  ========================  ============================================
cpu        cpu        fp32, bf16, fp16          fused multi-threaded C++ kernel (``_C``)
torch      cpu, cuda  fp32, bf16, fp16, fp64    vectorized torch reference (autograd)
=========  =========  ========================  ============================================

The CUDA and Triton kernels of this op are not written yet: asking for ``backend="cuda"`` or
``"triton"`` raises :class:`~kl_kernels.BackendUnavailableError` saying so, and ``"auto"`` on a GPU
runs the torch reference.
"""

from __future__ import annotations

import torch

from ..backends import Backend
from .reference import kl_penalty_reference

HALF_AND_SINGLE = frozenset({torch.float32, torch.bfloat16, torch.float16})
BOTH_LAYOUTS = frozenset({"packed", "padded"})


def _not_written(name):
    return lambda: [f"the {name} kernel of kl_penalty_loss is not implemented yet (use 'torch'"
                    f"{' or cpu' if name != 'cpu' else ''})"]


def _unreachable(problem):
    raise AssertionError("dispatch never runs an unavailable backend")


REGISTRY: list[Backend] = [
    Backend("cuda", frozenset({"cuda"}), HALF_AND_SINGLE, BOTH_LAYOUTS, _not_written("CUDA"), _unreachable,
            notes="not implemented yet"),
    Backend("triton", frozenset({"cuda"}), HALF_AND_SINGLE, BOTH_LAYOUTS, _not_written("Triton"), _unreachable,
            notes="not implemented yet"),
    Backend("torch", frozenset({"cpu", "cuda"}), HALF_AND_SINGLE | {torch.float64}, BOTH_LAYOUTS, lambda: [],
            kl_penalty_reference, notes="vectorized torch reference (float64-capable)"),
]
