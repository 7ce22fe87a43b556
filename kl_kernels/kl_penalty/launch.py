"""Host launcher of the fused kl_penalty_loss kernels: allocate outputs, fill the argument struct, launch.

The compiled kernels (``csrc/cpu/kl_penalty_cpu.cpp``, ``csrc/cuda/kl_penalty_cuda.cu``) take a plain
``KLPenaltyArgs`` whose ``g``
member is kl_reward's ``KLRewardArgs`` (geometry, mask, log-probs), filled by kl_reward's
``make_args``; this module adds the loss's own inputs. Inputs may have any strides; outputs are
allocated contiguous in the layout's shape. Everything has been validated by ``problem.py``.
"""

from __future__ import annotations

import math

import torch

from ..kl_reward.launch import (DTYPE_CODES, _ptr, _strides, as_contiguous, coefficient, kernel_module, launch_kernel,
                                make_args)

NO_CLAMP = [-math.inf, math.inf, -math.inf, math.inf]


def _args(module, like, mask, offsets, lengths, layout, left_pad, estimator, straight_through, lp_dtype):
    """KLPenaltyArgs with the geometry of ``like`` (a per-token tensor of the problem's shape)."""
    g, keep = make_args(module, log_probs=like, ref_log_probs=like, mask=mask, offsets=offsets, lengths=lengths,
                        prompt_lens=None, reward=None, coef=None, coef_scalar=0.0, layout=layout, left_pad=left_pad,
                        placement=0, estimator=estimator, straight_through=straight_through, clamp=NO_CLAMP)
    g.dtype = DTYPE_CODES[lp_dtype]
    a = module.KLPenaltyArgs()
    a.g = g
    return a, keep


def forward(log_probs, old_log_probs, ref_log_probs, advantages, entropy, mask, offsets, lengths, beta, beta_scalar,
            adv_per_seq, layout, left_pad, estimator, straight_through, clip_lo, clip_hi, entropy_coef, token_out):
    """Run the fused forward; returns (seq_loss [B], stats [B, 5], count [B], token_out [4, *shape] or
    empty, grad [*shape]), all float32 but count (int64)."""
    dev = log_probs.device
    module = kernel_module(dev, "kl_penalty", "kl_penalty_loss")
    a, keep = _args(module, log_probs, mask, offsets, lengths, layout, left_pad, estimator, straight_through,
                    log_probs.dtype)
    for name, t in (("old", old_log_probs), ("ref", ref_log_probs), ("ent", entropy)):
        if t is not None:
            setattr(a, name, _ptr(t))
            s0, s1 = _strides(t, layout)
            setattr(a, f"{name}_s0", s0)
            setattr(a, f"{name}_s1", s1)
    a.adv = _ptr(advantages)
    a.adv_per_seq = int(adv_per_seq)
    a.adv_s0, a.adv_s1 = (advantages.stride(0), 0) if adv_per_seq else _strides(advantages, layout)
    a.aux_dtype = DTYPE_CODES[advantages.dtype]
    a.beta_mode, a.beta_scalar, a.beta = coefficient(beta, beta_scalar, keep)
    a.clip_lo, a.clip_hi, a.entropy_coef = float(clip_lo), float(clip_hi), float(entropy_coef)

    batch, shape = a.g.batch, log_probs.shape
    seq_loss = torch.empty(batch, dtype=torch.float32, device=dev)
    stats = torch.empty(batch, 5, dtype=torch.float32, device=dev)
    count = torch.empty(batch, dtype=torch.int64, device=dev)
    tok = torch.empty((4, *shape) if token_out else (0,), dtype=torch.float32, device=dev)
    grad = torch.empty(shape, dtype=torch.float32, device=dev)
    a.seq_loss, a.stats, a.count, a.grad = _ptr(seq_loss), _ptr(stats), _ptr(count), _ptr(grad)
    a.token_out = _ptr(tok) if token_out else 0
    launch_kernel(module, "kl_penalty", "forward", a, dev, "kl_penalty_loss")
    del keep
    return seq_loss, stats, count, tok, grad


def backward(grad, g_seq, g_tok, mask, offsets, lengths, layout, left_pad, lp_dtype, entropy_grad, aux_dtype,
             entropy_coef):
    """Scale the saved gradient buffer: grad_lp = (g_tok + g_seq[b]) * grad at counted tokens, and
    (``entropy_grad``) grad_entropy = -entropy_coef * (g_tok + g_seq[b]). Returns (grad_lp, grad_ent or empty)."""
    dev = grad.device
    module = kernel_module(dev, "kl_penalty", "kl_penalty_loss")
    a, keep = _args(module, grad, mask, offsets, lengths, layout, left_pad, 0, False, lp_dtype)
    a.aux_dtype = DTYPE_CODES[aux_dtype]
    a.entropy_coef = float(entropy_coef)
    a.grad = _ptr(grad)
    for name, t in (("g_seq", g_seq), ("g_tok", g_tok)):
        if t is not None:
            t = as_contiguous(t, torch.float32)
            keep.append(t)
            setattr(a, name, _ptr(t))
    g_lp = torch.empty(grad.shape, dtype=lp_dtype, device=dev)
    g_ent = torch.empty(grad.shape if entropy_grad else (0,), dtype=aux_dtype, device=dev)
    a.g_lp = _ptr(g_lp)
    a.g_ent = _ptr(g_ent) if entropy_grad else 0
    launch_kernel(module, "kl_penalty", "backward", a, dev, "kl_penalty_loss")
    del keep
    return g_lp, g_ent
