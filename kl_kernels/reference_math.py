"""The torch reference's building blocks both ops share (no op owns this module): the KL
estimators' values, the straight-through gradient, and which tokens count. The formulas are
documented where each op's semantics are (``kl_reward/reference.py``, ``kl_penalty/reference.py``).
"""

from __future__ import annotations

import torch

from . import ragged
from .layouts import and_not_nan


def estimate(x: torch.Tensor, estimator: str) -> torch.Tensor:
    """The estimator's value on the (clamped) log-ratio ``x``; ``+`` variants use the base form."""
    base = estimator.rstrip("+")
    if base == "k1":
        return x
    if base == "abs":
        return x.abs()
    if base == "k2":
        return 0.5 * x * x
    if base == "k3":
        return torch.expm1(-x) + x  # expm1 keeps k3 accurate near 0, where exp(-x) - 1 cancels
    raise ValueError(f"unknown estimator {estimator!r}")


class _StraightThrough(torch.autograd.Function):
    """Forward ``value``, backward ``grad * d``: the straight-through estimators' k2 gradient.

    The usual trick ``value.detach() + (k2 - k2.detach())`` computes ``inf - inf = NaN`` in the
    forward wherever the log-ratio ``d`` is infinite; the fused kernels return the estimator's
    value there (+-inf) and the gradient ``d``, and so does this."""

    @staticmethod
    def forward(value, d):
        return value.clone()

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[1])

    @staticmethod
    def backward(ctx, grad):
        (d,) = ctx.saved_tensors
        return None, grad * d


class _ValueOf(torch.autograd.Function):
    """Forward ``value``, backward the incoming gradient to ``x`` unchanged (d out / d x = 1)."""

    @staticmethod
    def forward(value, x):
        return value.clone()

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, grad):
        return None, grad


def value_with_gradient_of(value: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``value``, differentiated as if it were ``x`` (GSPO's sequence log-ratio with the token's
    gradient). Unlike ``value.detach() + x - x.detach()``, an infinite ``x`` gives no NaN."""
    return _ValueOf.apply(value.detach(), x)


def straight_through(value: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """``value`` (an estimator's value on ``d``) with the gradient of k2 at ``d`` (``d`` itself)."""
    return _StraightThrough.apply(value.detach(), d)


def token_frame(p):
    """Validity, position-in-sequence and a per-sequence broadcaster for a normalized problem's
    layout (either op's: ``layout``, ``log_probs``, ``offsets``/``lengths``, ``padding_side``,
    ``prompt_lens``)."""
    device = p.device
    if p.layout == "padded":
        batch, width = p.log_probs.shape
        valid, pos = ragged.padded_validity(p.lengths, batch, width, p.padding_side, device=device)
        valid = valid if p.lengths is not None else None
        return valid, pos, (lambda v: v.unsqueeze(1)), None
    seq, pos = ragged.token_index(p.offsets, p.num_tokens, positions=p.prompt_lens is not None)
    return None, pos, (lambda v: v[seq]), seq


def final_mask(p, valid, pos, per_seq):
    """Which tokens count: valid in the layout, the mask, past the prompt, and (``mask_nan``) neither
    log-prob NaN; an all-true mask when nothing restricts them."""
    m = valid
    if p.mask is not None:
        m = p.mask if m is None else m & p.mask
    if p.prompt_lens is not None:
        outside_prompt = pos >= per_seq(p.prompt_lens)
        m = outside_prompt if m is None else m & outside_prompt
    if p.mask_nan:  # NaN log-probs mark alignment pads (TorchRL's KLComputation)
        m = and_not_nan(m, p.log_probs, p.ref_log_probs)
    if m is None:
        m = torch.ones(p.log_probs.shape, dtype=torch.bool, device=p.device)
    return m
