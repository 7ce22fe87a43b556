"""int32 index tensors (issue 51): ``offsets`` (flash-attention's and verl's ``cu_seqlens`` are int32),
``lengths``, ``prompt_lens`` and ``token_logprobs``' ``labels`` are accepted wherever int64 ones are, on
every backend and layout, and give bitwise the int64 call's results (they are widened on the device, no
host sync)."""

from __future__ import annotations

import pytest
import torch

from conftest import backend_device
from kl_kernels import kl_penalty_loss, kl_reward, ragged, token_logprobs

BACKENDS = [
    "cpu", "torch",
    pytest.param("cuda-emulated", marks=pytest.mark.cuda_emulated),
    pytest.param("triton", marks=pytest.mark.triton),
]
LENGTHS = [3, 0, 5, 1, 4]


def _packed(seed=0):
    g = torch.Generator().manual_seed(seed)
    n = sum(LENGTHS)
    lp, ref, old = (-torch.rand(n, generator=g) * 3 for _ in range(3))
    offsets = ragged.lengths_to_offsets(torch.tensor(LENGTHS))
    return lp, ref, old, offsets


def _padded(seed=0):
    g = torch.Generator().manual_seed(seed)
    b, t = len(LENGTHS), max(LENGTHS)
    lp, ref, old = (-torch.rand(b, t, generator=g) * 3 for _ in range(3))
    return lp, ref, old, torch.tensor(LENGTHS)


def _same(a, b):
    """Bitwise equal, NaN where NaN (every tensor field of two outputs)."""
    for x, y in zip(a, b):
        if isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and x.shape == y.shape
            assert torch.equal(x.view(-1).nan_to_num(7.0), y.view(-1).nan_to_num(7.0)), (x, y)


def _on(device, *ts):
    return [t.to(device) for t in ts]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", ["packed", "padded-left", "padded-right"])
def test_kl_reward_int32_indices(backend, layout):
    dev = backend_device(backend)
    if layout == "packed":
        lp, ref, _, offsets = _on(dev, *_packed())
        geo = lambda dt: dict(offsets=offsets.to(dt))  # noqa: E731
        batch = len(LENGTHS)
    else:
        lp, ref, _, lengths = _on(dev, *_padded())
        side = layout.split("-")[1]
        geo = lambda dt: dict(lengths=lengths.to(dt), padding_side=side)  # noqa: E731
        batch = lp.shape[0]
    prompt = torch.tensor([1, 0, 2, 0, 3], device=dev)
    score = torch.arange(batch, dtype=torch.float32, device=dev)
    kw = dict(coef=0.1, estimator="k3", reward_placement="last", backend=backend)
    want = kl_reward(lp, ref, score, prompt_lens=prompt, **geo(torch.int64), **kw)
    got = kl_reward(lp, ref, score, prompt_lens=prompt.to(torch.int32), **geo(torch.int32), **kw)
    _same(want, got)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_kl_penalty_loss_int32_indices(backend, layout):
    dev = backend_device(backend)
    if layout == "packed":
        lp, ref, old, offsets = _on(dev, *_packed(1))
        geo = lambda dt: dict(offsets=offsets.to(dt))  # noqa: E731
    else:
        lp, ref, old, lengths = _on(dev, *_padded(1))
        geo = lambda dt: dict(lengths=lengths.to(dt))  # noqa: E731
    adv = torch.linspace(-1, 1, lp.numel(), device=dev).reshape(lp.shape)
    kw = dict(ref_log_probs=ref, beta=0.1, estimator="k3", clip_epsilon=0.2, aggregation="seq-mean-token-mean",
              backend=backend)
    want = kl_penalty_loss(lp, old, adv, **geo(torch.int64), **kw)
    got = kl_penalty_loss(lp, old, adv, **geo(torch.int32), **kw)
    _same(want, got)


@pytest.mark.parametrize("backend", BACKENDS)
def test_token_logprobs_int32_labels(backend):
    dev = backend_device(backend)
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(6, 11, generator=g).to(dev)
    labels = torch.tensor([0, 10, -100, 3, 7, 1], device=dev)
    want = token_logprobs(logits, labels, return_entropy=True, backend=backend)
    got = token_logprobs(logits, labels.to(torch.int32), return_entropy=True, backend=backend)
    _same(want, got)


def test_check_offsets_widens_int32_without_changing_the_input():
    off = torch.tensor([0, 2, 2, 5], dtype=torch.int32)
    got = ragged.check_offsets(off, 5)
    assert got.dtype == torch.int64 and got.tolist() == [0, 2, 2, 5] and off.dtype == torch.int32
    with pytest.raises(ValueError, match="non-decreasing"):
        ragged.check_offsets(torch.tensor([0, 3, 2, 5], dtype=torch.int32), 5)
    with pytest.raises(TypeError, match="offsets must be an int64 or int32"):
        ragged.check_offsets(torch.tensor([0, 2], dtype=torch.int16), 2)
