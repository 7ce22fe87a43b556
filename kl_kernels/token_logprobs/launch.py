"""Host launcher of the fused C++ ``token_logprobs`` kernels: ``csrc/cpu/token_logprobs_cpu.cpp`` (``_C``)
for CPU tensors, ``csrc/cuda/token_logprobs_cuda.cu`` (``_cuda``) for CUDA ones, or the CUDA kernels under
host emulation on CPU tensors (``_cuda_emu``: :data:`emulated`). Fill ``TokenLogprobsArgs`` from tensors,
allocate the outputs on the logits' device, launch (on CUDA: torch's current stream, no host sync). Everything has been validated
by ``problem.py``; the logits' vocabulary dimension is contiguous (``backends.py`` requires it) and
their rows form an ``[N, V]`` view or ``[B, T, V]`` slabs (``kl_kernels.vocab_rows``)."""

from __future__ import annotations

import torch

from ..launching import DTYPE_CODES, EMULATED, ExtensionLauncher, kernel_module, launch_kernel, ptr, resolved
from ..vocab_rows import row_map, rows_of


def _args(module, logits, labels, counted, temperature, softcap):
    logits, = resolved(logits)
    rows = rows_of(logits)
    a = module.TokenLogprobsArgs()
    a.logits, a.dtype, a.rows, a.vocab = ptr(rows), DTYPE_CODES[rows.dtype], labels.numel(), rows.shape[-1]
    a.inner, a.stride_outer, a.stride_inner = row_map(rows)
    labels = labels.contiguous()
    counted = counted.contiguous()
    a.labels, a.counted, a.inv_temperature = ptr(labels), ptr(counted), 1.0 / temperature
    if softcap:  # (the field's default, 0, is no cap)
        a.softcap = softcap
    return a, [rows, labels, counted]


def forward(logits, labels, counted, temperature: float, want_entropy: bool, softcap: float = 0.0, *,
            ext: str | None = None):
    """``(log_probs [*S], entropy [*S] or [0], lse [N])``, float32 on the logits' device."""
    module = kernel_module(logits.device, "token_logprobs_forward", "token_logprobs", ext)
    a, keep = _args(module, logits, labels, counted, temperature, softcap)
    n, dev = labels.numel(), logits.device
    lp = torch.empty(labels.shape, dtype=torch.float32, device=dev)
    ent = torch.empty(labels.shape if want_entropy else (0,), dtype=torch.float32, device=dev)
    lse = torch.empty(n, dtype=torch.float32, device=dev)
    a.log_probs, a.lse, a.entropy = ptr(lp), ptr(lse), ptr(ent) if want_entropy else 0
    launch_kernel(module, module.token_logprobs_forward, a, logits.device, "token_logprobs")
    del keep
    return lp, ent, lse


def backward(grad_lp, grad_entropy, logits, labels, counted, temperature: float, lse, entropy, out,
             softcap: float = 0.0, *,
             ext: str | None = None):
    """Write the logits' gradient into ``out`` (the logits' shape and dtype, e.g. the logits themselves)."""
    module = kernel_module(logits.device, "token_logprobs_backward", "token_logprobs", ext)
    a, keep = _args(module, logits, labels, counted, temperature, softcap)
    g_lp = None if grad_lp is None else grad_lp.reshape(-1).to(torch.float32).contiguous()
    g_ent = None if grad_entropy is None else grad_entropy.reshape(-1).to(torch.float32).contiguous()
    target = out if out.dim() <= 3 else out.view(-1, out.shape[-1])
    a.grad_logits = ptr(target)
    _, a.g_stride_outer, a.g_stride_inner = row_map(target)
    a.lse, a.entropy = ptr(lse), ptr(entropy) if g_ent is not None else 0
    a.grad_lp, a.grad_entropy = ptr(g_lp), ptr(g_ent)
    launch_kernel(module, module.token_logprobs_backward, a, logits.device, "token_logprobs")
    del keep, g_lp, g_ent
    return out


emulated = ExtensionLauncher(EMULATED, forward, backward)  # the cuda-emulated backend's launcher (ops.py)
