"""token_logprobs against an independent float64 oracle (Python floats, one row at a time): values
and gradients, packed ``[N, V]`` and padded ``[B, T, V]`` (sliced too), every dtype, adversarial
logits (huge magnitudes, -inf entries, one-hot rows, NaN in one row, V = 1, labels 0 and V-1,
ignore_index, mask), several chunks per call; gradcheck, opcheck, torch.compile, argument checks,
inplace_backward, the backends' declarations; parity with verl 0.9.1's helpers."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kl_kernels import BackendUnavailableError, token_logprobs, vocab_rows
from kl_kernels.token_logprobs import ops  # noqa: F401 - registers the torch.library ops
import row_batches
from row_batches import SOFTCAP_BACKENDS, effective
from conftest import CUDA_EMULATED, backend_device
from tolerances import TOLERANCES

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def oracle_row(x: list, label: int, temperature: float, logit_scale: float = 1.0, softcap=None):
    """(log_prob, entropy, d lp / d x, d H / d x) of one row, in float64 Python math."""
    z, dz = effective(x, temperature, logit_scale, softcap)
    if any(math.isnan(v) or v == math.inf for v in z) or all(v == -math.inf for v in z):
        nan = float("nan")
        return nan, nan, [nan] * len(z), [nan] * len(z)
    top = max(z)
    s = math.fsum(math.exp(v - top) for v in z)
    lse = top + math.log(s)
    p = [math.exp(v - lse) for v in z]
    u = [lse - v for v in z]
    h = math.fsum(pi * ui for pi, ui in zip(p, u) if pi > 0)
    lp = z[label] - lse
    d_lp = [((1.0 if j == label else 0.0) - p[j]) * dz[j] for j in range(len(z))]
    d_h = [(p[j] * (u[j] - h) if p[j] > 0 else 0.0) * dz[j] for j in range(len(z))]
    return lp, h, d_lp, d_h


@st.composite
def cases(draw, dtypes=DTYPES):
    dtype = draw(st.sampled_from(list(dtypes)))
    vocab = draw(st.sampled_from([1, 2, 3, 7, 33, 64]))
    layout = draw(st.sampled_from(["packed", "padded", "sliced"]))
    shape = (draw(st.integers(0, 9)),) if layout == "packed" else (draw(st.integers(0, 3)), draw(st.integers(0, 5)))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    scale = draw(st.sampled_from([0.1, 3.0, 30.0] + ([3e3] if dtype != torch.float16 else [])))
    full = shape if layout != "sliced" else (shape[0], shape[1] + 1)
    x = torch.randn(*full, vocab, generator=g, dtype=torch.float64) * scale
    n_rows = x[..., 0].numel()
    flat = x.view(-1, vocab)
    labels = torch.randint(0, vocab, full, generator=g)
    for r in range(n_rows):
        kind = draw(st.sampled_from(["plain"] * 6 + ["neg-inf", "one-hot", "nan", "label-neg-inf"]))
        lab = int(labels.view(-1)[r])
        if kind == "neg-inf" and vocab > 1:
            flat[r, (lab + 1) % vocab] = -math.inf
        elif kind == "one-hot":
            flat[r] = -math.inf
            flat[r, lab] = 5.0
        elif kind == "nan":
            flat[r, int(torch.randint(0, vocab, (), generator=g))] = math.nan
        elif kind == "label-neg-inf" and vocab > 1:
            flat[r, lab] = -math.inf
    labels.view(-1)[torch.rand(n_rows, generator=g) < 0.15] = -100
    mask = (torch.rand(full, generator=g) < 0.8) if draw(st.booleans()) else None
    logits = x.to(dtype)
    if layout == "sliced":  # logits[:, :-1]: [B, T, V] slabs, not an [N, V] view
        logits, labels = logits[:, :-1], labels[:, :-1]
        mask = None if mask is None else mask[:, :-1]
    temperature = draw(st.sampled_from([1.0, 0.7, 2.5]))
    return logits, labels, mask, temperature


BACKENDS = ["torch", "cpu", pytest.param("triton", marks=pytest.mark.triton), CUDA_EMULATED,
            pytest.param("cuda", marks=pytest.mark.cuda)]


def _check(logits, labels, mask, temperature, *, entropy=True, backend="auto", shift=0, logit_scale=1.0,
           softcap=None):
    md = torch.float64 if logits.dtype == torch.float64 else torch.float32
    if backend in ("cpu", "triton", "cuda-emulated", "cuda") and logits.dtype == torch.float64:
        backend = "torch"  # the fused kernels read fp32/bf16/fp16
    dev = backend_device(backend)  # Triton on the GPU where there is one
    logits, labels = logits.to(dev), labels.to(dev)
    mask = None if mask is None else mask.to(dev)
    leaf = row_batches.shifted(logits, shift) if shift else logits.detach().clone().requires_grad_()
    before = logits.detach().clone()
    transform = {} if logit_scale == 1.0 and softcap is None else dict(logit_scale=logit_scale, softcap=softcap)
    out = token_logprobs(leaf if leaf.shape == logits.shape else logits, labels, temperature=temperature,
                         return_entropy=entropy, mask=mask, backend=backend, **transform)
    assert out.log_probs.dtype == md and out.log_probs.shape == labels.shape
    g = torch.Generator().manual_seed(0)
    up_lp = torch.randn(labels.shape, generator=g, dtype=md).to(dev)
    up_h = torch.randn(labels.shape, generator=g, dtype=md).to(dev)
    total = (out.log_probs * up_lp).sum() + ((out.entropy * up_h).sum() if entropy else 0.0)
    grad = torch.autograd.grad(total, leaf)[0] if total.requires_grad else torch.zeros_like(leaf)
    assert torch.equal(leaf.detach().nan_to_num(), before.nan_to_num()), "the logits were modified"
    tol = TOLERANCES[md]
    gtol = TOLERANCES[logits.dtype]
    rows = logits.detach().double().reshape(-1, logits.shape[-1]).tolist()
    flat_lab = labels.reshape(-1).tolist()
    counted = [lab != -100 and (mask is None or bool(m)) for lab, m in
               zip(flat_lab, (mask.reshape(-1).tolist() if mask is not None else [True] * len(flat_lab)))]
    got_lp = out.log_probs.detach().reshape(-1).tolist()
    got_h = out.entropy.detach().reshape(-1).tolist() if entropy else None
    got_g = grad.double().reshape(-1, logits.shape[-1]).tolist()
    ups_lp, ups_h = up_lp.reshape(-1).tolist(), up_h.reshape(-1).tolist()
    for r, row in enumerate(rows):
        if not counted[r]:
            assert got_lp[r] == 0 and (not entropy or got_h[r] == 0), f"row {r}: not counted, not 0"
            assert all(v == 0 for v in got_g[r]), f"row {r}: not counted, has a gradient"
            continue
        lp, h, d_lp, d_h = oracle_row(row, flat_lab[r], temperature, logit_scale, softcap)
        z, dz = effective(row, temperature, logit_scale, softcap)
        mag = max((abs(v) for v in z if math.isfinite(v)), default=0.0) + 1.0
        slope = logit_scale / temperature  # the largest d z / d x
        for what, got, want in (("log_prob", got_lp[r], lp), ("entropy", got_h[r] if entropy else None, h)):
            if got is None:
                continue
            if math.isnan(want) or math.isinf(want):
                assert got == want or (math.isnan(want) and math.isnan(got)), f"row {r} {what}: {got} vs {want}"
            else:
                assert abs(got - want) <= tol.atol + 8 * tol.rtol * mag, f"row {r} {what}: {got} vs {want}"
        want_g = [a * ups_lp[r] + (b * ups_h[r] if entropy else 0.0) for a, b in zip(d_lp, d_h)]
        gscale = abs(ups_lp[r]) + (abs(ups_h[r]) * mag if entropy else 0.0)
        # p_j = e^(z_j - lse) carries the log-probs' own allowance (lse's rounding, 8 rtol mag above) into the
        # log-prob gradient (1[j = y] - p_j) / T: at most p_j times it
        top = max(z)
        lse = top + math.log(math.fsum(math.exp(v - top) for v in z)) if math.isfinite(top) else top
        p = [math.exp(v - lse) if math.isfinite(lse) else 0.0 for v in z]
        for j, (a, b) in enumerate(zip(got_g[r], want_g)):
            if math.isnan(b):
                assert math.isnan(a), f"row {r} grad[{j}]: {a} vs NaN"
            else:
                bound = (gtol.atol + 4 * gtol.rtol * abs(b)
                         + 8 * tol.rtol * (gscale + abs(ups_lp[r]) * mag * p[j]) * slope)
                assert abs(a - b) <= bound, f"row {r} grad[{j}]: {a} vs {b} (bound {bound})"


@pytest.mark.parametrize("backend", BACKENDS)
@given(case=cases(), entropy=st.booleans())
@settings(max_examples=60)
def test_matches_the_oracle(case, entropy, backend):
    _check(*case, entropy=entropy, backend=backend)


TRANSFORMS = st.sampled_from([(1.0, None), (0.0625, None), (3.0, None), (1.0, 30.0), (0.5, 30.0), (1.0, 2.0),
                              (4.0, 0.5), (1 / 7, 50.0)])


@pytest.mark.parametrize("backend", BACKENDS)
@given(case=cases(), entropy=st.booleans(), transform=TRANSFORMS)
@settings(max_examples=40)
def test_logit_scale_and_softcap_match_the_oracle(case, entropy, transform, backend):
    """``z = c tanh(s x / c) / T`` (TRL's fused LM head, Gemma's final_logit_softcapping): values and
    gradients against the float64 oracle written from that formula; -inf/+inf logits are capped to finite
    values, NaN stays NaN."""
    logit_scale, softcap = transform
    if softcap is not None and backend not in SOFTCAP_BACKENDS and case[0].dtype != torch.float64:
        with pytest.raises(BackendUnavailableError, match="softcap is not implemented"):
            token_logprobs(case[0].to(backend_device(backend)), case[1].to(backend_device(backend)), softcap=softcap,
                           backend=backend)
        return
    _check(*case, entropy=entropy, backend=backend, logit_scale=logit_scale, softcap=softcap)


def test_softcap_auto_picks_a_backend_that_implements_it(monkeypatch):
    """backend="auto" never hands a soft-cap to kernels without it (a backend that declines is passed by)."""
    from kl_kernels.token_logprobs import backends as B

    x, y = torch.randn(4, 9) * 40, torch.tensor([0, 3, 8, -100])
    want = token_logprobs(x, y, softcap=5.0, logit_scale=0.8, return_entropy=True, backend="torch")
    got = token_logprobs(x, y, softcap=5.0, logit_scale=0.8, return_entropy=True)
    torch.testing.assert_close(got.log_probs, want.log_probs)
    import dataclasses
    import importlib  # as if the CPU kernel had no cap: auto passes it by, takes torch

    registry = [dataclasses.replace(b, requires=lambda p: ["no cap"] if p.softcap else []) if b.name == "cpu" else b
                for b in B.REGISTRY]
    monkeypatch.setattr(B, "REGISTRY", registry)
    monkeypatch.setattr(importlib.import_module("kl_kernels.token_logprobs.api"), "REGISTRY", registry)
    got = token_logprobs(x, y, softcap=5.0, logit_scale=0.8, return_entropy=True)
    assert torch.equal(got.log_probs, want.log_probs) and torch.equal(got.entropy, want.entropy)
    # the scale alone reaches every backend: the temperature T / s
    torch.testing.assert_close(token_logprobs(x, y, logit_scale=0.25, temperature=2.0).log_probs,
                               token_logprobs(x, y, temperature=8.0).log_probs, rtol=0, atol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_large_lse_moves_the_gradient_as_it_moves_the_log_prob(backend):
    """Two near-equal logits of ~2,300 at T = 2.5 (lse ~ 911), the label the larger: every backend takes
    ``log p = z - lse`` and ``p = e^(z - lse)`` in float32, where lse carries half an ulp of 911 (3e-5), so the
    label's log-prob is off by up to that (within its own allowance, 8 rtol |z|) and its gradient ``(1 - p) / T``
    by p times it: 6 % of (1 - p) ~ 5e-4 here. The gradient's allowance carries the log-prob's through p (a
    hypothesis case of test_matches_the_oracle in CI's torch 2.14.1 lane, 2026-11-28, on the CPU kernel)."""
    _check(torch.tensor([[2258.6863, 2277.5967, -3731.0852]]), torch.tensor([1]), None, 2.5, entropy=False,
           backend=backend)


@pytest.mark.triton
@pytest.mark.parametrize("vocab", [1, 15, 16, 1023, 1024, 1025, 2047, 2048, 2049, 2064, 4096, 4100])
def test_triton_row_steps(vocab):
    """The Triton kernels' steps over a row (256 lanes of 16 bytes: 2048 bf16, 1024 fp32 entries), the masked
    tail step after the full ones, a slab layout too; rows 16-byte aligned (V % 16 == 0: each lane's entries
    contiguous) and not (strided lanes, row_math.lane_tile)."""
    g = torch.Generator().manual_seed(vocab)
    x = (torch.randn(2, 3, vocab, generator=g) * 4).to(torch.bfloat16)
    x[0, 1, vocab // 2] = -math.inf
    y = torch.randint(0, vocab, (2, 3), generator=g)
    _check(x, y, None, 0.9, backend="triton")
    _check(x[:, 1:], y[:, 1:], None, 1.0, backend="triton")


@given(case=cases(dtypes=(torch.float32, torch.bfloat16)), rows=st.sampled_from([1, 2, 3]))
@settings(max_examples=25)
def test_many_chunks_match_the_oracle(case, rows):
    """A few rows per chunk: the chunk loop, its row ranges and the [B, T, V] slab walk."""
    logits = case[0]
    with pytest.MonkeyPatch.context() as m:
        m.setattr(vocab_rows, "CHUNK_ELEMENTS", rows * logits.shape[-1])
        _check(*case, backend="torch")


@pytest.mark.parametrize("backend", BACKENDS)
def test_log_probs_only_has_no_entropy(backend):
    x = torch.randn(4, 5)
    out = token_logprobs(x.to(backend_device(backend)), torch.tensor([0, 1, 4, -100]).to(backend_device(backend)),
                         backend=backend)
    assert out.entropy is None
    _check(x, torch.tensor([0, 1, 4, -100]), None, 1.0, entropy=False, backend=backend)


@pytest.mark.parametrize("backend", ["cpu", CUDA_EMULATED])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab", [1, 15, 16, 17, 255, 256, 257, 2047, 2048, 2049, 5000])
def test_fused_kernel_row_loops(backend, dtype, vocab):
    """The C++ kernels' row loops and their tails, against the oracle; a slab layout too. The CPU kernel's
    lanes (16) and spans (256); the CUDA kernel's threads (256 per row) and steps (256 x 16 entries: 2 vectors
    of 8 for 16-bit logits, 1 for fp32), under emulation, with more rows than the emulated launch's blocks
    (each block takes several rows)."""
    g = torch.Generator().manual_seed(vocab)
    x = (torch.randn(3, 5, vocab, generator=g) * 4).to(dtype)
    x[0, 1, vocab // 2] = -math.inf
    y = torch.randint(0, vocab, (3, 5), generator=g)
    _check(x, y, None, 0.9, backend=backend)
    _check(x[:, 1:], y[:, 1:], None, 1.0, backend=backend)


@pytest.mark.parametrize("backend", ["cpu", CUDA_EMULATED, pytest.param("triton", marks=pytest.mark.triton),
                                     pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [17, 300, 2049])
def test_softcapped_row_walks(backend, dtype, vocab):
    """The soft-capped kernels (a specialization of their own) over the row walks: scalar head and tail entries,
    vectors, the label's vector (its slope picked out), a -inf and a +inf logit (capped: finite), slabs and an
    in-place backward's shifted rows."""
    g = torch.Generator().manual_seed(vocab)
    x = (torch.randn(3, 5, vocab, generator=g) * 20).to(dtype)
    x[0, 1, vocab // 2] = -math.inf
    x[1, 2, vocab // 3] = math.inf
    y = torch.randint(0, vocab, (3, 5), generator=g)
    _check(x, y, None, 0.9, backend=backend, logit_scale=0.5, softcap=7.0)
    _check(x[:, 1:], y[:, 1:], None, 1.0, backend=backend, softcap=30.0)
    _check(x[0], y[0], None, 1.3, backend=backend, shift=3, logit_scale=2.0, softcap=3.0)


@pytest.mark.parametrize("backend", ["cpu", CUDA_EMULATED, pytest.param("triton", marks=pytest.mark.triton),
                                     pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [5, 300])
def test_rows_at_every_alignment(backend, dtype, vocab):
    """The CUDA kernels read a row's entries before its first 16-byte boundary one by one, then 8-entry vectors
    (128-bit accesses), then the rest one by one (csrc/cuda/rows.cuh): logits whose rows start at each offset
    from a boundary (V = 300: head, vectors and tail; V = 5: no vector), labels in the head, a vector and the
    tail, the gradient in a fresh row of another phase, and in place (the same row)."""
    g = torch.Generator().manual_seed(vocab)
    x = (torch.randn(4, vocab, generator=g) * 4).to(dtype)
    y = torch.tensor([0, vocab - 1, vocab // 2, min(9, vocab - 1)])
    for shift in range(1, 16 // x.element_size() + 1):
        _check(x, y, None, 0.8, backend=backend, shift=shift)
    dev = backend_device(backend)
    base, yd = x.to(dev), y.to(dev)
    for shift in (1, 3):  # in place: the gradient overwrites a row of the logits' own phase
        w = torch.zeros(base.numel() + shift, dtype=dtype, device=dev)
        w[shift:] = base.reshape(-1)
        plain, w = w.clone().requires_grad_(), w.requires_grad_()
        out = token_logprobs((plain * 1.0)[shift:].view(base.shape), yd, return_entropy=True, backend=backend)
        (want,) = torch.autograd.grad(out.log_probs.sum() + out.entropy.sum(), plain)
        logits = (w * 1.0)[shift:].view(base.shape)
        out = token_logprobs(logits, yd, return_entropy=True, inplace_backward=True, backend=backend)
        (got,) = torch.autograd.grad(out.log_probs.sum() + out.entropy.sum(), w)
        torch.testing.assert_close(got, want)


# The C++ kernels at every size and dtype; Triton under the interpreter (~1-2 s a case) at 3 steps of a row.
ONE_PASS_CASES = [pytest.param(b, d, v, marks=CUDA_EMULATED.marks if b == "cuda-emulated" else ())
                  for b in ("cpu", "cuda-emulated") for d in (torch.float32, torch.bfloat16, torch.float16)
                  for v in (300, 2500, 5000)]
ONE_PASS_CASES += [pytest.param("triton", d, 2500, marks=pytest.mark.triton)
                   for d in (torch.float32, torch.bfloat16)]
# Triton's lanes add 16 steps in float32 before float64 (row_math.FOLD): 17 steps and a partial one (a step is
# 2048 bf16 / 1024 fp32 entries); rows not 16-byte aligned (bf16 here) and aligned (fp32)
ONE_PASS_CASES += [pytest.param("triton", torch.bfloat16, 17 * 2048 + 5, marks=pytest.mark.triton),
                   pytest.param("triton", torch.float32, 17 * 1024 + 16, marks=pytest.mark.triton)]
# On a GPU: the CUDA kernels' grid-stride steps (2048 entries a block step) and Triton's, up to 40 steps
ONE_PASS_CASES += [pytest.param(b, d, v, marks=pytest.mark.cuda)
                   for b in ("cuda", "triton") for d in (torch.float32, torch.bfloat16, torch.float16)
                   for v in (5000, 81921)]


@pytest.mark.parametrize("backend, dtype, vocab", ONE_PASS_CASES)
def test_one_pass_rows_whose_max_moves(backend, dtype, vocab):
    """The forward reads each row once, moving its sums onto a running max (csrc/common/row_math.h):
    rows whose max rises at every run, past the far bound, from -inf, -1e30 or -FLT_MAX, only at the end,
    or never (tests/row_batches.py), labels at both ends, against the oracle (values and gradients). Runs:
    the CPU kernel's 1024-entry runs, a Triton lane's 16-byte steps, a CUDA thread's step (one or two 8-entry
    vectors, 2048 entries apart)."""
    x = row_batches.moving_max_rows(vocab, seed=vocab).to(dtype)
    n = x.shape[0]
    y = torch.tensor([vocab - 1 if i % 2 else 0 for i in range(n)])
    _check(x, y, None, 1.0, backend=backend)
    # reversed (the max first), T > 1 (x / T: -FLT_MAX stays finite)
    _check(x.flip(-1), torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(1)), None, 1.25,
           backend=backend)


def test_cpu_kernel_is_bitwise_deterministic_for_any_thread_count():
    g = torch.Generator().manual_seed(8)
    x = torch.randn(64, 5000, generator=g).requires_grad_()
    y = torch.randint(0, 5000, (64,), generator=g)
    before = torch.get_num_threads()
    results = []
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            out = token_logprobs(x, y, return_entropy=True, backend="cpu")
            (grad,) = torch.autograd.grad(out.log_probs.sum() + out.entropy.sum(), x)
            results.append((out.log_probs, out.entropy, grad))
    finally:
        torch.set_num_threads(before)
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other))


def test_matches_log_softmax_gather():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 6, 50, generator=g, requires_grad=True)
    y = torch.randint(0, 50, (3, 6), generator=g)
    want = torch.log_softmax(x.double() / 0.8, -1).gather(-1, y.unsqueeze(-1)).squeeze(-1)
    got = token_logprobs(x, y, temperature=0.8).log_probs
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)
    (gx,) = torch.autograd.grad(got.sum(), x)
    (wx,) = torch.autograd.grad(torch.log_softmax(x / 0.8, -1).gather(-1, y.unsqueeze(-1)).sum(), x)
    torch.testing.assert_close(gx, wx, rtol=1e-5, atol=1e-6)


def test_gradcheck_float64():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 3, 7, generator=g, dtype=torch.float64, requires_grad=True)
    y = torch.randint(0, 7, (2, 3), generator=g)
    y[0, 1] = -100
    mask = torch.tensor([[True, True, False], [True, True, True]])

    def f(x):
        out = token_logprobs(x, y, temperature=1.3, return_entropy=True, mask=mask)
        return out.log_probs, out.entropy

    assert torch.autograd.gradcheck(f, (x,))


@pytest.mark.parametrize("op", ["token_logprobs", "token_logprobs_cpu",
                                pytest.param("token_logprobs_triton", marks=pytest.mark.triton),
                                pytest.param("token_logprobs_cuda_emu", marks=pytest.mark.cuda_emulated)])
@pytest.mark.parametrize("want_entropy", [False, True])
@pytest.mark.parametrize("softcap", [0.0, 2.5])
def test_opcheck(want_entropy, op, softcap):
    if softcap and op.removeprefix("token_logprobs").removeprefix("_") not in {
            b.replace("cuda-emulated", "cuda_emu").replace("torch", "") for b in SOFTCAP_BACKENDS}:
        pytest.skip(f"{op} has no soft-cap yet (test_logit_scale_and_softcap_match_the_oracle checks it declines)")
    g = torch.Generator().manual_seed(3)
    dev = backend_device("triton" if op.endswith("triton") else "cpu")
    x = torch.randn(5, 11, generator=g).to(dev).requires_grad_()
    y = torch.randint(0, 11, (5,), generator=g).to(dev)
    counted = torch.tensor([True, False, True, True, True], device=dev)
    fwd, bwd = getattr(torch.ops.kl_kernels, f"{op}_fwd"), getattr(torch.ops.kl_kernels, f"{op}_bwd")
    torch.library.opcheck(fwd.default, (x, y, counted, 0.9, softcap, want_entropy, False))
    lse = torch.logsumexp(x.detach() / 0.9, -1)
    ent = torch.rand(5, device=dev)
    torch.library.opcheck(bwd.default,
                          (torch.randn(5, device=dev), torch.randn(5, device=dev) if want_entropy else None,
                           x.detach(), y, counted, 0.9, softcap,
                           lse, ent))


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("transform", [{}, dict(logit_scale=0.5, softcap=3.0)])
def test_compile_fullgraph(backend, transform):
    g = torch.Generator().manual_seed(4)
    x = torch.randn(2, 5, 40, generator=g).to(backend_device(backend)).requires_grad_()
    y = torch.randint(0, 40, (2, 5), generator=g).to(backend_device(backend))

    def f(x, y):
        out = token_logprobs(x, y, temperature=0.7, return_entropy=True, backend=backend, **transform)
        return out.log_probs.sum() + 0.1 * out.entropy.sum()

    eager = f(x, y)
    (ge,) = torch.autograd.grad(eager, x)
    compiled = torch.compile(f, fullgraph=True)(x, y)
    (gc,) = torch.autograd.grad(compiled, x)
    torch.testing.assert_close(compiled, eager)
    torch.testing.assert_close(gc, ge)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", [(6, 30), (2, 4, 30)])
def test_inplace_backward_overwrites_the_logits_with_their_gradient(shape, backend):
    g = torch.Generator().manual_seed(5)
    base = torch.randn(*shape, generator=g).to(backend_device(backend))
    y = torch.randint(0, 30, shape[:-1], generator=g).to(backend_device(backend))
    x = base.clone().requires_grad_()
    out = token_logprobs(x * 1.0, y, return_entropy=True, backend=backend)  # non-leaf logits, as a model's output
    (want,) = torch.autograd.grad(out.log_probs.sum() + out.entropy.sum(), x)

    w = base.clone().requires_grad_()
    logits = w * 1.0
    out = token_logprobs(logits, y, return_entropy=True, inplace_backward=True, backend=backend)
    (got,) = torch.autograd.grad(out.log_probs.sum() + out.entropy.sum(), w)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(logits.detach(), want)  # the logits now hold their gradient


def test_inplace_backward_is_refused_under_compile_and_for_unviewable_rows():
    x = torch.randn(2, 3, 4, 5).transpose(1, 2)
    with pytest.raises(ValueError, match="inplace_backward"):
        token_logprobs(x, torch.zeros(2, 4, 3, dtype=torch.int64), inplace_backward=True)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(logits=[1.0]), TypeError, "logits must be a dense tensor"),
    (dict(logits=torch.zeros(3, 4, dtype=torch.int32)), TypeError, "logits must be float32"),
    (dict(logits=torch.zeros(3, 0)), ValueError, "vocabulary V >= 1"),
    (dict(labels=torch.zeros(3, dtype=torch.float32)), TypeError, "labels must be an integer tensor"),
    (dict(labels=torch.zeros(4, dtype=torch.int64)), ValueError, "labels must have the logits' shape"),
    (dict(labels=torch.tensor([0, 4, 1])), ValueError, r"labels must be in \[0, 4\)"),
    (dict(labels=torch.tensor([0, -1, 1])), ValueError, r"labels must be in \[0, 4\)"),
    (dict(mask=torch.ones(3)), TypeError, "mask must be a bool tensor"),
    (dict(mask=torch.ones(2, dtype=torch.bool)), ValueError, "mask must have the labels' shape"),
    (dict(temperature=0.0), ValueError, "temperature must be a finite number > 0"),
    (dict(temperature=float("nan")), ValueError, "temperature"),
    (dict(ignore_index=1.5), TypeError, "ignore_index must be an int"),
    (dict(return_entropy=1), TypeError, "return_entropy must be a bool"),
    (dict(backend="numpy"), ValueError, "backend must be one of"),
    (dict(logit_scale=0.0), ValueError, "logit_scale must be a finite number > 0"),
    (dict(logit_scale=-2.0), ValueError, "logit_scale must be a finite number > 0"),
    (dict(logit_scale=float("inf")), ValueError, "logit_scale"),
    (dict(logit_scale=True), ValueError, "logit_scale"),
    (dict(logit_scale="1"), ValueError, "logit_scale"),
    (dict(softcap=0.0), ValueError, "softcap must be None .* or a finite number > 0"),
    (dict(softcap=-30.0), ValueError, "softcap must be None"),
    (dict(softcap=float("nan")), ValueError, "softcap"),
    (dict(softcap=torch.tensor(30.0)), ValueError, "softcap"),
    (dict(logit_scale=1e-300, temperature=1e10), ValueError, "leaves the float64 range"),
])
def test_bad_arguments_name_themselves(kwargs, error, match):
    args = dict(logits=torch.zeros(3, 4), labels=torch.tensor([0, 1, 3]))
    args.update(kwargs)
    with pytest.raises(error, match=match):
        token_logprobs(args.pop("logits"), args.pop("labels"), **args)


def test_out_of_range_labels_that_do_not_count_are_fine():
    out = token_logprobs(torch.zeros(3, 4), torch.tensor([0, 9, -5]), mask=torch.tensor([True, False, False]))
    torch.testing.assert_close(out.log_probs, torch.tensor([-math.log(4), 0.0, 0.0]))


def test_the_cuda_backend_on_cpu_tensors_says_why():
    with pytest.raises(BackendUnavailableError, match="inputs are on cpu, cuda runs on"):
        token_logprobs(torch.zeros(2, 3), torch.tensor([0, 1]), backend="cuda")


def test_info_lists_the_backends():
    import kl_kernels

    rows = kl_kernels.info()["token_logprobs_backends"]
    assert rows["torch"]["available"] and rows["cpu"]["available"]
    assert list(rows) == ["cuda", "triton", "cpu", "cuda-emulated", "torch"]
    assert rows["cuda"]["available"] or rows["cuda"]["reason"]  # an unavailable backend says why


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_parity_with_verl(dtype):
    """verl 0.9.1's logprobs_from_logits (its torch path, flash-attn absent) and entropy_from_logits."""
    import peers

    tf = peers.verl_torch_functional()
    g = torch.Generator().manual_seed(6)
    x = (torch.randn(3, 9, 100, generator=g) * 4).to(dtype)
    y = torch.randint(0, 100, (3, 9), generator=g)
    want_lp = tf.logprobs_from_logits(x.float(), y)
    want_h = tf.entropy_from_logits(x.float())
    out = token_logprobs(x, y, return_entropy=True)
    torch.testing.assert_close(out.log_probs, want_lp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.entropy, want_h, rtol=1e-5, atol=1e-4)


def test_torch_path_chunks_are_larger_on_a_gpu():
    """On a GPU a chunk of the torch path is 64M logits, not the CPU's cache-sized 1M: with 1M, N = 8192,
    V = 128k took ~1,000 chunks of small launches, 794 ms where eager took 63 (H200, 2026-11-27)."""
    vocab = 131072
    assert vocab_rows.rows_per_chunk(torch.empty(1, vocab)) == (1 << 20) // vocab
    assert vocab_rows.rows_per_chunk(torch.empty(1, vocab, device="meta")) == (1 << 26) // vocab == 512
