"""Batches for the peer-parity tests (tests/test_integrations_*.py): peers' [B, T] tensors with a mask.

Lengths 0..64 (0 and 1 included), responses padded on the right or the left, masks with tool-token
holes, empty rows, optionally diverged tokens (|lp - ref| = 100, |lp - old| = 30), float32 or bfloat16.
"""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import torch
from hypothesis import strategies as st

from tolerances import TOLERANCES


@st.composite
def batches(draw, dtypes=(torch.float32, torch.bfloat16)):
    """A verl-style [B, T] batch: lp, old, ref, advantages, response mask (bool), as float64 masters."""
    b = draw(st.integers(1, 5))
    lengths = draw(st.lists(st.one_of(st.sampled_from([0, 1, 2, 64]), st.integers(0, 64)), min_size=b, max_size=b))
    t = max(max(lengths), 1)
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    side = draw(st.sampled_from(["right", "left"]))
    mask = torch.zeros(b, t, dtype=torch.bool)
    for i, n in enumerate(lengths):
        row = torch.rand(n, generator=g) < 0.85  # tool-token holes
        if side == "right":
            mask[i, :n] = row
        else:
            mask[i, t - n:] = row
    lp = -torch.rand(b, t, generator=g, dtype=torch.float64) * 6
    scale = draw(st.sampled_from([0.05, 0.5, 2.0]))
    old = lp + torch.randn(b, t, generator=g, dtype=torch.float64) * scale
    ref = lp + torch.randn(b, t, generator=g, dtype=torch.float64) * scale
    if draw(st.booleans()):  # diverged tokens
        hit = torch.rand(b, t, generator=g) < 0.05
        ref = torch.where(hit, lp + torch.where(torch.rand(b, t, generator=g) < 0.5, -100.0, 100.0), ref)
        old = torch.where(hit & (torch.rand(b, t, generator=g) < 0.5), lp - 30.0, old)
    adv = torch.randn(b, t, generator=g, dtype=torch.float64)
    weights = torch.rand(b, t, generator=g, dtype=torch.float64) * 2
    dtype = draw(st.sampled_from(list(dtypes)))
    return SimpleNamespace(lp=lp.to(dtype), old=old.to(dtype), ref=ref.to(dtype), adv=adv.to(dtype), mask=mask,
                           weights=weights.to(dtype), dtype=dtype)


def exact(data):
    """``data`` for running the peer: as is in float32; bfloat16 inputs upcast to float64 (exactly), since
    verl's bf16 arithmetic (e.g. k3's ``exp(kl) - kl - 1`` in bf16) loses what our fp32 math keeps: in bf16
    both are compared with the peer's formula evaluated in float64, within the bf16 tolerance."""
    if data.dtype == torch.float32:
        return data
    return SimpleNamespace(**{k: (v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
                              for k, v in vars(data).items()})


def close(got, want, dtype, what, scale=1.0):
    """``got`` within ``dtype``'s tolerance of ``want``; where ``want`` (float64) overflows ``dtype``,
    ``got`` must be that overflow (``want`` rounded to ``dtype``: +-inf)."""
    tol = TOLERANCES[dtype]
    got, want = got.double(), want.double()
    if want.dim():
        rounded = want.to(dtype).double()
        overflow = torch.isinf(rounded) & torch.isfinite(want)
        assert (got[overflow] == rounded[overflow]).all(), f"{what}: {got[overflow]} where {dtype} overflows"
        got, want = got[~overflow], want[~overflow]
    finite = want[torch.isfinite(want)]
    bound = tol.atol * 4 * min(scale, finite.abs().max().item() + 1 if finite.numel() else scale)
    torch.testing.assert_close(got, want, rtol=tol.rtol * 4, atol=bound, equal_nan=True,
                               msg=lambda m: f"{what}: {m}")


def printed_without(peer: str, code: str) -> list[str]:
    """What ``code`` prints, split, in a fresh interpreter where importing ``peer`` fails (as if it
    were not installed): the shims must import and run without their peer."""
    out = subprocess.run([sys.executable, "-c", f"import sys; sys.modules[{peer!r}] = None\n{code}"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()
