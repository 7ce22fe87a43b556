"""The determinism guarantee (python_api/README.md, "Determinism"), for every backend that runs here.

Same backend, same inputs: bitwise the same outputs and gradients, run after run and whatever the
number of threads (1, 2, 3). Across backends only the tolerance table holds (tests/tolerances.py;
the oracle tests check it). Both ops, forward and backward, packed, padded and list layouts, with
rows long enough to span several of the fused kernels' tiles.
"""

from __future__ import annotations

import pytest
import torch

from batches import to_device
from conftest import backend_device
from kl_kernels import kl_penalty_loss, kl_reward
from kl_kernels.kl_penalty.backends import REGISTRY as LOSS_REGISTRY
from kl_kernels.kl_reward.backends import REGISTRY as REWARD_REGISTRY


def _backends():
    """(backend, marks): every backend of kl_reward; those not runnable here skip with the reason."""
    out = []
    for b in REWARD_REGISTRY:
        if b.name == "cuda":
            continue  # tests/test_*_cuda.py, on a GPU
        marks = [pytest.mark.triton] if b.name == "triton" else []
        out.append(pytest.param(b.name, marks=marks, id=b.name))
    return out


def _lengths(backend):
    # Triton's interpreter is slow: fewer, shorter rows (still several 1024-token tiles in one row)
    return [0, 1, 2500, 37, 700] if backend in ("triton",) else [0, 1, 9000, 37, 700, 3000, 5]


def _batch(layout, lengths, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    seqs = [[-3 * torch.rand(n, generator=g) for n in lengths] for _ in range(3)]
    masks = [torch.rand(n, generator=g) < 0.9 for n in lengths]
    seqs[0][2][17] = float("nan")  # a NaN at a counted token of a long row
    masks[2][17] = True
    if layout == "packed":
        off = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
        return [torch.cat(s).to(dtype) for s in seqs], torch.cat(masks), {"offsets": off}
    if layout == "padded":
        width = max(lengths)

        def pad(parts, fill):
            return torch.stack([torch.cat([torch.full((width - len(p),), fill, dtype=p.dtype), p]) for p in parts])

        return [pad(s, 0.0).to(dtype) for s in seqs], pad(masks, False), {"lengths": torch.tensor(lengths)}
    return [[t.to(dtype) for t in s] for s in seqs], masks, {}


def _run(op, backend, layout, dtype):
    tensors, mask, geo = to_device(_batch(layout, _lengths(backend), dtype), backend_device(backend))
    lps = tensors[0] if layout == "list" else [tensors[0]]
    lps = [t.clone().requires_grad_() for t in lps]
    lp = lps if layout == "list" else lps[0]
    if op == "kl_reward":
        out = kl_reward(lp, tensors[1], tensors[2], coef=0.1, estimator="k3", mask=mask, return_ref=True,
                        detach=False, backend=backend, **geo)
        flat = [torch.cat(list(x)) if isinstance(x, list) else x for x in out]
        scalar = sum(x.float().nan_to_num(0.0, 0.0, 0.0).sum() for x in flat[:3])
    else:
        adv = torch.linspace(-1, 1, len(_lengths(backend)), device=backend_device(backend))
        out = kl_penalty_loss(lp, tensors[1], adv.unsqueeze(1) if layout == "packed" else adv,
                              ref_log_probs=tensors[2], beta=0.05, estimator="k3", mask=mask, clip_epsilon=0.2,
                              aggregation="seq-mean-token-mean", backend=backend, **geo)
        flat = list(out)
        scalar = out.loss
    grads = torch.autograd.grad(scalar, lps, allow_unused=True)
    return [x.detach() for x in flat] + [g for g in grads if g is not None]


def _bitwise_equal(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.reshape(-1).view(torch.uint8) if a.dtype != torch.bool else a, b.reshape(-1).view(torch.uint8)
        if b.dtype != torch.bool else b)


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("op", ["kl_reward", "kl_penalty_loss"])
@pytest.mark.parametrize("layout", ["packed", "padded", "list"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_bitwise_for_any_thread_count(backend, op, layout, dtype):
    registry = REWARD_REGISTRY if op == "kl_reward" else LOSS_REGISTRY
    entry = next((b for b in registry if b.name == backend), None)
    if entry is None or entry.unavailable_reasons():
        pytest.skip(f"{backend} does not run here: {entry and entry.unavailable_reasons()}")
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        want = _run(op, backend, layout, dtype)
        # Triton's interpreter runs its kernels in NumPy whatever torch's thread count (only the host
        # ops around them see it), and it is slow: one rerun, with 2 threads.
        for threads in (2,) if backend == "triton" else (2, 3, 1):
            torch.set_num_threads(threads)
            got = _run(op, backend, layout, dtype)
            assert len(got) == len(want)
            for i, (a, b) in enumerate(zip(want, got)):
                assert _bitwise_equal(a, b), f"output {i} differs with {threads} threads"
    finally:
        torch.set_num_threads(before)
