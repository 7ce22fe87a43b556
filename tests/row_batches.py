"""Rows of logits that move a one-pass (online) max: the row kernels read each row once, merging each run's
max into a running one and moving the sums so far onto it (csrc/common/row_math.h). Every row here makes
that move happen in some way the kernels must get right, at float32 precision against the float64 oracle."""

from __future__ import annotations

import math

import torch

FLT_MAX = torch.finfo(torch.float32).max

KINDS = ("ascending", "steep", "max-last", "neg-inf-prefix", "far-jump", "last-only", "descending", "huge-prefix",
         "lowest-prefix", "far-steps")


def moving_max_row(kind: str, vocab: int, g: torch.Generator) -> torch.Tensor:
    """One float64 row of ``vocab`` logits of the named kind."""
    noise = torch.randn(vocab, generator=g, dtype=torch.float64)
    idx = torch.arange(vocab, dtype=torch.float64)
    half = vocab // 2
    if kind == "ascending":  # the max rises in every run, gently (many entries count)
        return torch.sort(noise * 4).values
    if kind == "steep":  # rises by 0.05 an entry: each run's max beats the last by ~13 (a span of 256)
        return idx * 0.05 + noise * 0.01
    if kind == "max-last":
        row = noise * 3
        row[-1] = 12.0
        return row
    if kind == "neg-inf-prefix":  # the running max is -inf for the first runs
        row = noise * 3
        row[: (vocab * 3) // 5] = -math.inf
        return row
    if kind == "far-jump":  # the first half is beyond the far bound below the second (its sums become 0)
        row = noise * 2
        row[:half] -= 500.0
        return row
    if kind == "last-only":  # one finite entry, the last
        row = torch.full((vocab,), -math.inf, dtype=torch.float64)
        row[-1] = 1.5
        return row
    if kind == "descending":  # the max first: nothing moves (the control)
        return torch.sort(noise * 4, descending=True).values
    if kind == "huge-prefix":  # -1e30 then ordinary logits (-inf in float16)
        row = noise * 3
        row[:half] = -1e30
        return row
    if kind == "lowest-prefix":  # -FLT_MAX (a finite logit, the running max's floor itself) then ordinary ones
        row = noise * 3
        row[:half] = -FLT_MAX
        return row
    if kind == "far-steps":  # the max rises by ~90 (past the far bound) every 256 entries
        return idx * (90.0 / 256.0) + noise * 0.1
    raise ValueError(kind)


def moving_max_rows(vocab: int, seed: int, kinds=KINDS) -> torch.Tensor:
    """[len(kinds), vocab] float64, one row per kind."""
    g = torch.Generator().manual_seed(seed)
    return torch.stack([moving_max_row(k, vocab, g) for k in kinds])


def shifted(t: torch.Tensor, shift: int) -> torch.Tensor:
    """A leaf equal to ``t`` (contiguous, requiring grad) whose data starts ``shift`` elements into a larger
    buffer: rows that start at another offset from a 16-byte boundary than a fresh tensor's (the CUDA row
    kernels read each row's entries before its first boundary one by one, then 8-entry vectors; a gradient row
    freshly allocated is then of another phase than its logits row)."""
    buf = torch.zeros(t.numel() + shift, dtype=t.dtype, device=t.device)
    buf[shift:] = t.detach().reshape(-1)
    return buf[shift:].view(t.shape).requires_grad_(t.dtype.is_floating_point)


def effective(x: list, temperature: float, logit_scale: float = 1.0, softcap=None):
    """(z, dz/dx) per entry of one row of logits: ``z = c tanh(s x / c) / T`` (``s x / T`` without a cap),
    float64 Python math, the formula as TRL's fused LM head writes it (not the kernels' folded form): the
    oracles' logit transform."""
    if softcap is None:
        return [logit_scale * v / temperature for v in x], [logit_scale / temperature] * len(x)
    t = [math.tanh(logit_scale * v / softcap) for v in x]
    return [softcap * u / temperature for u in t], [logit_scale * (1 - u * u) / temperature for u in t]


# The backends whose row kernels implement the soft-cap (token_logprobs and full_kl alike); the others decline a
# soft-cap (their backends' ``requires``), which the tests check instead. One place: a backend's kernels land here.
SOFTCAP_BACKENDS = frozenset({"torch", "triton", "cpu", "cuda-emulated", "cuda"})
