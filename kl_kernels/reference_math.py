"""The torch reference's building blocks both ops share (no op owns this module): the KL
estimators' values, the straight-through gradient, and which tokens count. The formulas are
documented where each op's semantics are (``kl_reward/reference.py``, ``kl_penalty/reference.py``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from . import ragged, value_checks
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


class Frame(NamedTuple):
    """Where each token sits in a normalized problem (:func:`checked_frame`)."""

    valid: torch.Tensor | None  # padded with lengths: [B, T] bool; else None (every token is valid)
    pos: torch.Tensor | None  # position in its sequence (packed: only when prompt_lens are given)
    per_seq: object  # broadcasts a [B] tensor to the tokens
    seq: torch.Tensor | None  # packed: each token's sequence, always in [0, B)
    offsets: torch.Tensor | None  # packed: offsets safe to index with (the problem's own after a host check)
    bad: torch.Tensor | None  # [B] bool: sequences whose geometry was bad (None: checked on the host)


def _unchecked(t: torch.Tensor) -> bool:
    """Whether the values of index tensor ``t`` may still be bad when the torch operations read them: an
    accelerator tensor, whose value checks record a bad value in the device's error word
    (:mod:`kl_kernels.device_errors`) instead of raising on the host. Such values must never reach torch's
    indexing unclamped: on a GPU an out-of-range index is a device-side assertion, which ends the CUDA
    context."""
    return not value_checks.checks_on_host(t)


def safe_offsets(offsets: torch.Tensor, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(safe, bad)`` for packed ``offsets`` ``[B + 1]`` whose values were not checked on the host.

    ``safe``: offsets torch's indexing may use whatever ``offsets`` hold: 0 first, ``num_tokens`` last, the
    inner ones clamped to ``[0, N]`` and made non-decreasing (a running max), so every token gets a
    sequence in ``[0, B)`` (:func:`kl_kernels.ragged.token_index`) and ``segment_reduce`` sums ``N`` tokens.
    ``bad`` ``[B]`` bool: the sequences whose geometry is bad, as the fused kernels poison them
    (``geometry_bad`` of csrc/common/kl_reward_args.h, written there for the kernels): an offset of their own
    outside ``[0, N]``, a negative length, a first offset not 0 or a last not N, or a decrease next to them.
    Torch operations only, no host read: valid offsets come back equal, no sequence marked."""
    batch = offsets.shape[0] - 1
    if batch == 0:  # (no sequence: offsets [x] must be [0] and N = 0; x feeds no index)
        return torch.zeros(1, dtype=offsets.dtype, device=offsets.device), torch.zeros(
            0, dtype=torch.bool, device=offsets.device)
    inner = offsets.narrow(0, 1, batch - 1).clamp(0, num_tokens)
    if batch > 1:
        inner = inner.cummax(0).values
    safe = torch.cat([offsets.new_zeros(1), inner, offsets.new_full((1,), num_tokens)])
    lo, hi = offsets.narrow(0, 0, batch), offsets.narrow(0, 1, batch)
    bad = lo.lt(0) | hi.gt(num_tokens) | hi.lt(lo)  # (a new tensor: updated in place below)
    bad[:1] |= lo[:1].ne(0)
    bad[-1:] |= hi[-1:].ne(num_tokens)
    if batch > 1:  # a decrease next to it moves tokens in or out of its range too
        bad[1:] |= offsets.narrow(0, 0, batch - 1).gt(lo[1:])  # off[b - 1] > off[b]
        bad[:-1] |= offsets.narrow(0, 2, batch - 1).lt(hi[:-1])  # off[b + 2] < off[b + 1]
    return safe, bad


def _bad_padded(p) -> torch.Tensor | None:
    """Padded: the rows whose ``lengths`` lie outside ``[0, T]`` or whose ``prompt_lens`` lie outside
    ``[0, length]`` (None: nothing unchecked)."""
    batch, width = p.log_probs.shape
    bad = None
    if p.lengths is not None and _unchecked(p.lengths):
        bad = p.lengths.lt(0) | p.lengths.gt(width)
    prompt = getattr(p, "prompt_lens", None)
    if prompt is not None and _unchecked(prompt):
        bound = p.lengths if p.lengths is not None else width
        over = prompt.lt(0) | prompt.gt(bound)
        bad = over if bad is None else bad | over
    return bad


def checked_frame(p) -> Frame:
    """:func:`token_frame`, plus the packed offsets to index with and the sequences to poison.

    Index values of accelerator tensors are checked on the device (a bad one is recorded in the error word,
    raised at the next call of ours or at ``kl_kernels.check_errors()``), so the torch operations here may
    meet them: the offsets are replaced by :func:`safe_offsets` (no index out of range, hence no device-side
    assertion) and ``bad`` marks the sequences whose geometry (offsets, lengths, prompt_lens) was bad, for the
    references to NaN-poison their outputs as the fused kernels do. Host-checked values (CPU tensors,
    ``KL_KERNELS_SYNC_CHECKS=1``) are used as they are (``bad`` None)."""
    device = p.device
    prompt = getattr(p, "prompt_lens", None)
    if p.layout == "padded":
        batch, width = p.log_probs.shape
        valid, pos = ragged.padded_validity(p.lengths, batch, width, p.padding_side, device=device)
        valid = valid if p.lengths is not None else None
        return Frame(valid, pos, (lambda v: v.unsqueeze(1)), None, None, _bad_padded(p))
    offsets, bad = p.offsets, None
    if _unchecked(offsets):
        offsets, bad = safe_offsets(offsets, p.num_tokens)
        if prompt is not None:  # bounded by the sequence's own (caller's) length, as the check
            lengths = ragged.offsets_to_lengths(p.offsets)
            bad = bad | prompt.lt(0) | prompt.gt(lengths)
    seq, pos = ragged.token_index(offsets, p.num_tokens, positions=prompt is not None)
    return Frame(None, pos, (lambda v: v[seq]), seq, offsets, bad)


def token_frame(p):
    """Validity, position-in-sequence and a per-sequence broadcaster for a normalized problem's
    layout (either op's: ``layout``, ``log_probs``, ``offsets``/``lengths``, ``padding_side``,
    ``prompt_lens``), and (packed) each token's sequence; safe under any index values
    (:func:`checked_frame`)."""
    return tuple(checked_frame(p)[:4])


def poison(x: torch.Tensor, bad: torch.Tensor | None, per_seq) -> torch.Tensor:
    """``x`` (per token, or per sequence with ``per_seq=None``) with NaN where its sequence is ``bad``: a
    product with 1 or NaN, so the values elsewhere stay bitwise and a poisoned one's gradient is NaN too, as
    the fused kernels'. ``bad`` None (nothing unchecked): ``x`` itself."""
    if bad is None:
        return x
    scale = torch.where(bad, float("nan"), 1.0).to(x.dtype)
    return x * (per_seq(scale) if per_seq is not None else scale)


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
