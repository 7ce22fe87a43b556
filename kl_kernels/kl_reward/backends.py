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
import functools
import importlib.util

import torch

from .. import _extensions
from ..backends import Backend
from .ops import run_fused
from .reference import kl_reward_reference
from ..triton import interpreting

KERNEL_FORWARD = "kl_reward_forward"  # symbol the compiled extensions will export
HALF_AND_SINGLE = frozenset({torch.float32, torch.bfloat16, torch.float16})
BOTH_LAYOUTS = frozenset({"packed", "padded"})


def _torch_cuda_reason() -> list[str]:
    if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
        return [f"torch {torch.__version__} is a CPU-only build (no CUDA)"]
    if not torch.cuda.is_available():
        return ["torch sees no CUDA device (torch.cuda.is_available() is False)"]
    return []


def _cpu_reasons(kernel: str) -> list[str]:
    _, reason = _extensions.kernel("_C", kernel)
    return [reason] if reason else []


def _emulated_reasons(kernel: str) -> list[str]:
    _, reason = _extensions.kernel("_cuda_emu", kernel)
    return [reason] if reason else []


def _cuda_reasons(kernel: str) -> list[str]:
    _, reason = _extensions.kernel("_cuda", kernel)
    reasons = [reason] if reason else []
    if _extensions.load("_cuda")[0] is not None:
        runtime_error = _extensions.probe("_cuda").get("error")
        if runtime_error:
            reasons.append(f"CUDA runtime of kl_kernels._cuda: {runtime_error}")
    return reasons + _torch_cuda_reason()


@functools.lru_cache(maxsize=None)
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def _triton_reasons() -> list[str]:
    if not _triton_installed():
        return ["triton is not installed (pip install 'kl_kernels[triton]')"]
    if interpreting():
        return []  # CPU tensors run in the interpreter
    return _torch_cuda_reason()


def _same_logprob_dtype(problem) -> list[str]:
    if problem.log_probs.dtype != problem.ref_log_probs.dtype:
        return [f"log_probs ({problem.log_probs.dtype}) and ref_log_probs ({problem.ref_log_probs.dtype}) differ in "
                "dtype; the fused kernels read both in one dtype"]
    return []


# The GPU kernels are compiled and statically checked in CI and run there in emulation, but no CI
# machine has a GPU: on a CUDA device "auto" takes the cuda and triton rows only once they have passed
# the first-use self-check on that device (kl_kernels/selfcheck.py), and otherwise moves on (a backend
# named explicitly runs without it).
GPU_SELF_CHECK = frozenset({"cuda"})


def fused_backends(kernel: str, run_fused, requires) -> list[Backend]:
    """The ``cuda``, ``triton``, ``cpu`` and ``cuda-emulated`` rows of an op, in ``"auto"`` order: C++
    kernels found by their forward symbol ``kernel`` in ``_cuda`` / ``_C`` / ``_cuda_emu``, all run
    by ``run_fused(problem, triton=False|True, emulated=False|True)``, all declining problems that
    ``requires`` rejects. One place for the policy every op shares (the GPU self-check, Triton's
    interpreter and the CUDA emulation on explicit request only)."""
    return [
        Backend("cuda", frozenset({"cuda"}), HALF_AND_SINGLE, BOTH_LAYOUTS, functools.partial(_cuda_reasons, kernel),
                run_fused, requires=requires, self_check_devices=GPU_SELF_CHECK,
                notes="fused CUDA C++ kernel (auto: after its first-use self-check on the device)"),
        Backend("triton", frozenset({"cuda", "cpu"} if interpreting() else {"cuda"}), HALF_AND_SINGLE, BOTH_LAYOUTS,
                _triton_reasons, functools.partial(run_fused, triton=True), requires=requires,
                auto_devices=frozenset({"cuda"}), self_check_devices=GPU_SELF_CHECK,
                notes="Triton kernels" + (" (interpreter: CPU tensors on request)" if interpreting() else
                                          " (auto: after its first-use self-check on the device)")),
        Backend("cpu", frozenset({"cpu"}), HALF_AND_SINGLE, BOTH_LAYOUTS, functools.partial(_cpu_reasons, kernel),
                run_fused, requires=requires, notes="fused multi-threaded C++ kernel"),
        # The CUDA kernels on CPU tensors, for tests: "auto" never takes it (no auto device).
        Backend("cuda-emulated", frozenset({"cpu"}), HALF_AND_SINGLE, BOTH_LAYOUTS,
                functools.partial(_emulated_reasons, kernel), functools.partial(run_fused, emulated=True),
                requires=requires, auto_devices=frozenset(),
                notes="the CUDA kernels under a host emulation of CUDA (CPU tensors; a test instrument, slow)"),
    ]


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
