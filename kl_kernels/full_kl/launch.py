"""Host launcher of the fused C++ ``full_kl`` kernels: ``csrc/cpu/full_kl_cpu.cpp`` (``_C``) for CPU tensors,
``csrc/cuda/full_kl_cuda.cu`` (``_cuda``) for CUDA ones, or the CUDA kernels under host emulation on CPU
tensors (``_cuda_emu``: :data:`emulated`). Fill ``FullKLArgs`` from tensors, allocate the outputs on the
logits' device, launch (on CUDA: torch's current stream, no host sync). Everything has been validated by ``problem.py``; both
tensors' vocabulary dimension is contiguous (``backends.py`` requires it) and their rows form an
``[N, V]`` view or ``[B, T, V]`` slabs (``kl_kernels.vocab_rows``)."""

from __future__ import annotations

import torch

from ..launching import DTYPE_CODES, EMULATED, ExtensionLauncher, kernel_module, launch_kernel, ptr, resolved
from ..vocab_rows import row_map, rows_of


def _args(module, logits, ref_logits, counted, temperature, softcap):
    logits, ref_logits = resolved(logits, ref_logits)
    x, r = rows_of(logits), rows_of(ref_logits)
    a = module.FullKLArgs()
    a.logits, a.ref_logits, a.dtype = ptr(x), ptr(r), DTYPE_CODES[x.dtype]
    a.rows, a.vocab = counted.numel(), x.shape[-1]
    a.inner, a.stride_outer, a.stride_inner = row_map(x)
    inner, a.ref_stride_outer, a.ref_stride_inner = row_map(r)
    assert inner == a.inner, "same shapes give the same row structure"
    counted = counted.contiguous()
    a.counted, a.inv_temperature = ptr(counted), 1.0 / temperature
    if softcap:  # (the field's default, 0, is no cap)
        a.softcap = softcap
    return a, [x, r, counted]


def forward(logits, ref_logits, counted, temperature: float, softcap: float = 0.0, *, ext: str | None = None):
    """``(kl [*S], lse [N], ref_lse [N])``, float32 on the logits' device."""
    module = kernel_module(logits.device, "full_kl_forward", "full_kl", ext)
    a, keep = _args(module, logits, ref_logits, counted, temperature, softcap)
    n, dev = counted.numel(), logits.device
    kl = torch.empty(counted.shape, dtype=torch.float32, device=dev)
    lse, ref_lse = torch.empty(n, dtype=torch.float32, device=dev), torch.empty(n, dtype=torch.float32, device=dev)
    a.kl, a.lse, a.ref_lse = ptr(kl), ptr(lse), ptr(ref_lse)
    launch_kernel(module, module.full_kl_forward, a, logits.device, "full_kl")
    del keep
    return kl, lse, ref_lse


def _target(out):
    return out if out.dim() <= 3 else out.view(-1, out.shape[-1])


def backward(grad_kl, logits, ref_logits, counted, temperature: float, kl, lse, ref_lse, grad_logits, grad_ref,
             softcap: float = 0.0, *,
             ext: str | None = None):
    """Write the gradients into ``grad_logits`` / ``grad_ref`` (contiguous, the logits' shape and dtype;
    None: not wanted)."""
    module = kernel_module(logits.device, "full_kl_backward", "full_kl", ext)
    a, keep = _args(module, logits, ref_logits, counted, temperature, softcap)
    g = grad_kl.reshape(-1).to(torch.float32).contiguous()
    a.grad_kl, a.kl, a.lse, a.ref_lse = ptr(g), ptr(kl.reshape(-1)), ptr(lse), ptr(ref_lse)
    if grad_logits is not None:
        t = _target(grad_logits)
        a.grad_logits = ptr(t)
        _, a.g_stride_outer, a.g_stride_inner = row_map(t)
    if grad_ref is not None:
        t = _target(grad_ref)
        a.grad_ref = ptr(t)
        _, a.gr_stride_outer, a.gr_stride_inner = row_map(t)
    launch_kernel(module, module.full_kl_backward, a, logits.device, "full_kl")
    del keep, g


emulated = ExtensionLauncher(EMULATED, forward, backward)  # the cuda-emulated backend's launcher (ops.py)
