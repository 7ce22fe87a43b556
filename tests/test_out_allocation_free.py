"""``kl_reward(..., out=...)`` allocates nothing proportional to the batch (issue 49 item 4).

``out=`` exists so that a training loop's call takes no fresh memory: under glibc's default allocator a
multi-MB temporary may be freshly mapped, and page-faulted, on every call. Every torch allocation of a
call is counted here with a dispatch mode (allocations by the C++ kernels are B-sized scratch only), at
two batch sizes: an ``out=`` call may allocate a few tensors of at most ``B`` elements (views, a 0-element
placeholder), never one that grows with the tokens. Before the fix the ``mask_nan`` call allocated two
``[B, T]`` results and copied them into the buffers. Page faults per call are in
``python -m kl_kernels.bench.per_call --faults`` (not asserted: they depend on the heap's history)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kl_kernels import kl_reward

# ops that allocate no memory of their own (views and metadata)
_VIEWS = {"view", "detach", "alias", "_reshape_alias", "squeeze", "unsqueeze", "as_strided", "expand", "select",
          "slice", "t", "transpose", "permute", "unbind", "promote_types", "reshape", "narrow", "split"}


class _Allocations(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.sizes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket.__name__.rstrip("_") not in _VIEWS:
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    self.sizes.append((func.overloadpacket.__name__, t.numel()))
        return out


def _batch(b, t, layout):
    g = torch.Generator().manual_seed(b)
    lp, ref = -torch.rand(b, t, generator=g), -torch.rand(b, t, generator=g)
    mask = torch.rand(b, t, generator=g) < 0.8
    if layout == "packed":
        return lp.reshape(-1), ref.reshape(-1), dict(mask=mask.reshape(-1), offsets=torch.arange(b + 1) * t)
    return lp, ref, dict(mask=mask, padding_side="left")


CASES = {
    "verl last": dict(reward="seq", reward_placement="last"),
    "last_valid k3 clamps": dict(reward="seq", reward_placement="last_valid", estimator="k3", clamp_input=(-20, 20),
                                 clamp_output=(-10, 10)),
    "token reward return_ref": dict(reward="token", return_ref=True),
    "lengths prompt_lens": dict(reward=None, lengths="lengths", prompt_lens="prompt"),
    "coef per sequence": dict(reward="seq", reward_placement="sequence", coef="per-seq"),
    "mask_nan": dict(reward=None, mask_nan=True),
}


def _call(b, t, layout, case, backend):
    lp, ref, kw = _batch(b, t, layout)
    spec = dict(CASES[case])
    reward = {"seq": torch.randn(b), "token": torch.randn(lp.shape), None: None}[spec.pop("reward")]
    if spec.get("lengths") == "lengths":
        if layout == "packed":
            spec.pop("lengths")
        else:
            spec["lengths"] = torch.full((b,), t - 1)
    if spec.get("prompt_lens") == "prompt":
        spec["prompt_lens"] = torch.full((b,), 2)
    if spec.get("coef") == "per-seq":
        spec["coef"] = torch.linspace(0.1, 0.2, b)
    kw.update(spec)
    first = kl_reward(lp, ref, reward, backend=backend, **kw)
    out = tuple(None if x is None else torch.empty_like(x) for x in first)
    return lambda: kl_reward(lp, ref, reward, backend=backend, out=out, **kw)


@pytest.mark.parametrize("layout", ["packed", "padded"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_out_call_allocates_nothing_batch_proportional(layout, case):
    largest = {}
    for b, t in ((8, 64), (64, 512)):
        call = _call(b, t, layout, case, "cpu")
        call()
        with _Allocations() as seen:
            call()
        big = [(name, n) for name, n in seen.sizes if n > b]
        assert not big, f"B = {b}, T = {t}: an out= call allocated {big}"
        largest[b] = max((n for _, n in seen.sizes), default=0)
    assert largest[64] <= 64  # (B-sized at most: the per-sequence views of a [B] reward, a coefficient)
