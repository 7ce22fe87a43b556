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



def _planned(op) -> int:
    """How many plans (not Unplanned marks) ``op``'s plan cache (kl_kernels/plans.py) holds."""
    import importlib

    from kl_kernels import plans

    cache = importlib.import_module(f"kl_kernels.{op}.api")._PLANS
    return sum(type(p) is not plans.Unplanned for p in cache.plans.values())


def _lengths(seed):
    return torch.tensor(LENGTHS)[torch.randperm(len(LENGTHS), generator=torch.Generator().manual_seed(seed))]


@pytest.mark.parametrize("prompt", [None, "int32"])
@pytest.mark.parametrize("layout", ["packed", "padded-left", "padded-right"])
def test_planned_kl_reward_calls_read_the_widened_int32_indices(layout, prompt):
    """The calls after the first of an int32 signature run its plan (kl_kernels/plans.py), which must hand
    the kernel the checks' widened int64 offsets, lengths and prompt_lens, not the caller's int32 tensors
    (the kernel would read them as int64: garbage sums). New index values every call, one signature; then
    each compared bitwise with the int64 call and closely with the torch reference."""
    from kl_kernels import plans

    def call(seed, dt, **kw):
        lens = _lengths(seed)
        if layout == "packed":
            lp, ref, _, _ = _packed(seed)
            geo = dict(offsets=ragged.lengths_to_offsets(lens).to(dt))
        else:
            lp, ref, _, _ = _padded(seed)
            geo = dict(lengths=lens.to(dt), padding_side=layout.split("-")[1])
        prompt_lens = None if prompt is None else ((lens // 2) * (seed % 2)).to(dt)
        score = torch.arange(len(LENGTHS), dtype=torch.float32) + seed
        return kl_reward(lp, ref, score, prompt_lens=prompt_lens, coef=0.1 + seed, estimator="k3",
                         reward_placement="last", **geo, **kw)

    plans.clear()
    got = [call(seed, torch.int32) for seed in range(4)]
    assert _planned("kl_reward") == 1, "the int32 calls were not planned: this test would not cover the plan"
    for seed, g in enumerate(got):
        _same(call(seed, torch.int64), g)
        torch.testing.assert_close(tuple(g), tuple(call(seed, torch.int64, backend="torch")), rtol=1e-6, atol=1e-6,
                                   msg=f"call {seed}")


@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_planned_kl_penalty_loss_calls_read_the_widened_int32_indices(layout):
    """As the kl_reward test above, for kl_penalty_loss's plan (offsets, lengths), loss and gradient."""
    from kl_kernels import plans

    def call(seed, dt, **kw):
        lens = _lengths(seed)
        if layout == "packed":
            lp, ref, old, _ = _packed(seed)
            geo = dict(offsets=ragged.lengths_to_offsets(lens).to(dt))
        else:
            lp, ref, old, _ = _padded(seed)
            geo = dict(lengths=lens.to(dt))
        adv = torch.linspace(-1, 1 + seed, lp.numel()).reshape(lp.shape)
        x = lp.requires_grad_()
        out = kl_penalty_loss(x, old, adv, ref_log_probs=ref, beta=0.1, estimator="k3", clip_epsilon=0.2, **geo,
                              **kw)  # (token-mean: a planned aggregation)
        return out, torch.autograd.grad(out.loss, x)[0]

    plans.clear()
    got = [call(seed, torch.int32) for seed in range(4)]
    assert _planned("kl_penalty") == 1, "the int32 calls were not planned: this test would not cover the plan"
    for seed, (out, grad) in enumerate(got):
        same, g_same = call(seed, torch.int64)
        _same(same, out)
        assert torch.equal(g_same, grad)
        want, g_want = call(seed, torch.int64, backend="torch")
        torch.testing.assert_close(out.loss, want.loss, rtol=1e-5, atol=1e-6, msg=f"call {seed}")
        torch.testing.assert_close(grad, g_want, rtol=1e-5, atol=1e-6, msg=f"call {seed}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_linear_ops_int32_labels(backend):
    """The hidden-state ops read the labels through token_logprobs' problem: int32 labels give the int64 call's
    results bitwise."""
    from kl_kernels import linear_kl_penalty_loss, linear_token_logprobs

    dev = backend_device(backend)
    g = torch.Generator().manual_seed(3)
    hidden, weight = torch.randn(2, 3, 4, generator=g).to(dev), torch.randn(9, 4, generator=g).to(dev)
    labels = torch.tensor([[0, 8, -100], [3, 7, 1]], device=dev)
    want = linear_token_logprobs(hidden, weight, labels, return_entropy=True, backend=backend)
    got = linear_token_logprobs(hidden, weight, labels.to(torch.int32), return_entropy=True, backend=backend)
    _same(want, got)
    kw = dict(beta=0.1, logprobs_backend=backend, backend=backend)
    old, adv = torch.full((2, 3), -2.0, device=dev), torch.tensor([1.0, -1.0], device=dev)
    want = linear_kl_penalty_loss(hidden, weight, labels, old, adv, **kw)
    got = linear_kl_penalty_loss(hidden, weight, labels.to(torch.int32), old, adv, **kw)
    _same(want, got)
