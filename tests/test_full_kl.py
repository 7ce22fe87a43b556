"""full_kl against an independent float64 oracle (Python floats, one row at a time): values and the
gradients to both logits, packed ``[N, V]``, padded ``[B, T, V]`` and sliced slabs (the reference in
another layout too), every dtype, adversarial rows (huge magnitudes, -inf entries in either tensor, the
policy's mass where the reference has none, a constant shift between the models, one-hot rows, NaN and
+inf, V = 1, V across the kernels' 256/1024 steps), mask; gradcheck, opcheck, torch.compile, argument
checks, the backends' declarations, verl's kl_penalty="full"."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import row_batches
from row_batches import SOFTCAP_BACKENDS, effective
from conftest import CUDA_EMULATED, backend_device
from kl_kernels import BackendUnavailableError, full_kl
from kl_kernels.full_kl import ops  # noqa: F401 - registers the torch.library ops
from tolerances import TOLERANCES

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
INF, NAN = math.inf, math.nan


def _log_softmax(z: list) -> list | None:
    if any(math.isnan(v) or v == INF for v in z) or all(v == -INF for v in z):
        return None
    top = max(z)
    lse = top + math.log(math.fsum(math.exp(v - top) for v in z))
    return [v - lse for v in z]


# Below this log-probability a float32 probability is 0 in the fused kernels (their exp flushes under
# e^-87.3; torch's own exp keeps denormals to e^-103): whether the policy's mass "where the reference has
# none" makes the KL infinite then depends on the math dtype, so the oracle answers both ways there.
# The kernels' e^y (kl_math.h exp_reduce: 2^n as 2 * 2^(n-1), with 2^(n-1) = 0 at n = -126) is 0 for
# y < -125.5 ln 2 (e^y < 2.0e-38: the bottom of float32's normal range). It was -87.3 here (exp's input
# clamp), which called a policy probability of e^-87.05 = 1.5e-38 "in range": a kernel flushing it
# looked wrong (test_a_probability_the_kernels_flush_counts_as_zero).
FLOAT32_TINY_LOG_P = -125.5 * math.log(2.0)


def oracle_row(x: list, r: list, temperature: float, tiny_log_p: float = -INF, logit_scale: float = 1.0,
               softcap=None):
    """(KL, d KL / d x, d KL / d r) of one row, in float64 Python math; policy probabilities with a log
    below ``tiny_log_p`` count as 0; both rows through ``row_batches.effective`` (scale, soft-cap,
    temperature)."""
    (zx, dzx), (zr, dzr) = effective(x, temperature, logit_scale, softcap), effective(r, temperature, logit_scale,
                                                                                      softcap)
    a, b = _log_softmax(zx), _log_softmax(zr)
    n = len(x)
    if a is None or b is None:
        return NAN, [NAN] * n, [NAN] * n
    p, q = [math.exp(v) if v >= tiny_log_p else 0.0 for v in a], [math.exp(v) for v in b]
    terms = [p[j] * (a[j] - b[j]) for j in range(n) if p[j] > 0]
    kl = INF if any(t == INF for t in terms) else math.fsum(terms)
    if not math.isfinite(kl):
        return kl, [NAN] * n, [NAN] * n
    dx = [(p[j] * ((a[j] - b[j]) - kl) if p[j] > 0 else 0.0) * dzx[j] for j in range(n)]
    dr = [(q[j] - p[j]) * dzr[j] for j in range(n)]
    return kl, dx, dr


ROW_KINDS = ["plain"] * 6 + ["policy-neg-inf", "ref-neg-inf", "both-neg-inf", "one-hot", "shifted", "nan-policy",
                             "nan-ref", "inf-ref", "ref-all-neg-inf"]


@st.composite
def cases(draw, dtypes=DTYPES):
    dtype = draw(st.sampled_from(list(dtypes)))
    vocab = draw(st.sampled_from([1, 2, 3, 7, 33, 64, 300, 1100]))
    layout = draw(st.sampled_from(["packed", "padded", "sliced"]))
    shape = (draw(st.integers(0, 6)),) if layout == "packed" else (draw(st.integers(0, 3)), draw(st.integers(0, 4)))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    scale = draw(st.sampled_from([0.1, 3.0, 30.0] + ([3e3] if dtype != torch.float16 else [])))
    full = shape if layout != "sliced" else (shape[0], shape[1] + 1)
    x = torch.randn(*full, vocab, generator=g, dtype=torch.float64) * scale
    r = x + torch.randn(*full, vocab, generator=g, dtype=torch.float64) * draw(st.sampled_from([0.01, 1.0, scale]))
    xf, rf = x.view(-1, vocab), r.view(-1, vocab)
    for row in range(xf.shape[0]):
        kind = draw(st.sampled_from(ROW_KINDS))
        j = int(torch.randint(0, vocab, (), generator=g))
        if kind == "policy-neg-inf" and vocab > 1:
            xf[row, j] = -INF
        elif kind == "ref-neg-inf":
            rf[row, j] = -INF  # where the policy has mass: KL = +inf (or NaN if V = 1: no reference mass)
        elif kind == "both-neg-inf" and vocab > 1:
            xf[row, j], rf[row, j] = -INF, -INF
        elif kind == "one-hot":
            xf[row] = -INF
            xf[row, j] = 1.0
        elif kind == "shifted":  # the same distribution, logits shifted: KL = 0
            rf[row] = xf[row] + 37.0
        elif kind == "nan-policy":
            xf[row, j] = NAN
        elif kind == "nan-ref":
            rf[row, j] = NAN
        elif kind == "inf-ref":
            rf[row, j] = INF
        elif kind == "ref-all-neg-inf":
            rf[row] = -INF
    mask = (torch.rand(full, generator=g) < 0.8) if draw(st.booleans()) else None
    logits, ref = x.to(dtype), r.to(dtype)
    if layout == "sliced":  # logits[:, :-1]: [B, T, V] slabs, not an [N, V] view
        logits, mask = logits[:, :-1], (None if mask is None else mask[:, :-1])
        ref = ref[:, :-1] if draw(st.booleans()) else ref[:, :-1].contiguous()  # either layout
    temperature = draw(st.sampled_from([1.0, 0.7, 2.5]))
    return logits, ref, mask, temperature


BACKENDS = ["torch", "cpu", pytest.param("triton", marks=pytest.mark.triton), CUDA_EMULATED,
            pytest.param("cuda", marks=pytest.mark.cuda)]


def _check(logits, ref, mask, temperature, *, backend="auto", ref_grad=True, shifts=(0, 0), logit_scale=1.0,
           softcap=None):
    md = torch.float64 if logits.dtype == torch.float64 else torch.float32
    if backend in ("cpu", "triton", "cuda-emulated", "cuda") and logits.dtype == torch.float64:
        backend = "torch"  # the fused kernels read fp32/bf16/fp16
    dev = backend_device(backend)
    logits, ref = logits.to(dev), ref.to(dev)
    mask = None if mask is None else mask.to(dev)
    x = row_batches.shifted(logits, shifts[0]) if shifts[0] else logits.detach().clone().requires_grad_()
    w = (row_batches.shifted(ref, shifts[1]) if shifts[1] else ref.detach().clone()).requires_grad_(ref_grad)
    before = (logits.detach().clone(), ref.detach().clone())
    transform = {} if logit_scale == 1.0 and softcap is None else dict(logit_scale=logit_scale, softcap=softcap)
    kl = full_kl(x, w, temperature=temperature, mask=mask, backend=backend, **transform)
    assert kl.dtype == md and kl.shape == logits.shape[:-1]
    g = torch.Generator().manual_seed(0)
    up = torch.randn(kl.shape, generator=g, dtype=md)
    leaves = [x, w] if ref_grad else [x]
    grads = torch.autograd.grad((kl * up.to(dev)).sum(), leaves) if kl.requires_grad else [torch.zeros_like(x)] * 2
    for t, b in zip((x, w), before):
        assert torch.equal(t.detach().nan_to_num(), b.nan_to_num()), "an input was modified"
    tol, gtol = TOLERANCES[md], TOLERANCES[logits.dtype]
    vocab = logits.shape[-1]
    rows_x = logits.detach().double().reshape(-1, vocab).tolist()
    rows_r = ref.detach().double().reshape(-1, vocab).tolist()
    counted = mask.reshape(-1).tolist() if mask is not None else [True] * len(rows_x)
    got = kl.detach().reshape(-1).tolist()
    got_g = [t.double().reshape(-1, vocab).tolist() for t in grads]
    ups = up.reshape(-1).tolist()
    for i, (rx, rr) in enumerate(zip(rows_x, rows_r)):
        if not counted[i]:
            assert got[i] == 0, f"row {i}: not counted, KL {got[i]}"
            assert all(v == 0 for gg in got_g for v in gg[i]), f"row {i}: not counted, has a gradient"
            continue
        want, dx, dr = oracle_row(rx, rr, temperature, -INF, logit_scale, softcap)
        zs = effective(rx + rr, temperature, logit_scale, softcap)[0]
        mag = max((abs(v) for v in zs if math.isfinite(v)), default=0.0) + 1.0
        slope = logit_scale / temperature  # the largest d z / d x
        if md == torch.float32 and want == INF and got[i] != INF:
            # the policy's mass where the reference has none is below float32's range: either answer
            want, dx, dr = oracle_row(rx, rr, temperature, FLOAT32_TINY_LOG_P, logit_scale, softcap)
        if not math.isfinite(want):
            assert got[i] == want or (math.isnan(want) and math.isnan(got[i])), f"row {i}: KL {got[i]} vs {want}"
        else:
            assert abs(got[i] - want) <= tol.atol + 8 * tol.rtol * mag, f"row {i}: KL {got[i]} vs {want}"
        for what, gg, wants in zip(("d logits", "d ref_logits"), got_g, (dx, dr)):
            for j, (a, b) in enumerate(zip(gg[i], wants)):
                b *= ups[i]
                if math.isnan(b):
                    assert math.isnan(a), f"row {i} {what}[{j}]: {a} vs NaN"
                else:
                    bound = gtol.atol + 4 * gtol.rtol * abs(b) + 16 * tol.rtol * abs(ups[i]) * mag * slope
                    assert abs(a - b) <= bound, f"row {i} {what}[{j}]: {a} vs {b} (bound {bound})"


@pytest.mark.parametrize("backend", BACKENDS)
@given(case=cases())
@settings(max_examples=60)
def test_matches_the_oracle(case, backend):
    _check(*case, backend=backend)


TRANSFORMS = st.sampled_from([(1.0, None), (0.0625, None), (3.0, None), (1.0, 30.0), (0.5, 30.0), (1.0, 2.0),
                              (4.0, 0.5), (1 / 7, 50.0)])


@pytest.mark.parametrize("backend", BACKENDS)
@given(case=cases(), transform=TRANSFORMS)
@settings(max_examples=40)
def test_logit_scale_and_softcap_match_the_oracle(case, transform, backend):
    """Both models' logits through ``z = c tanh(s x / c) / T``: the KL and both gradients against the float64
    oracle written from that formula (a capped -inf/+inf is finite: the reference's "no mass" rows get a
    finite KL)."""
    logit_scale, softcap = transform
    if softcap is not None and backend not in SOFTCAP_BACKENDS and case[0].dtype != torch.float64:
        dev = backend_device(backend)
        with pytest.raises(BackendUnavailableError, match="softcap is not implemented"):
            full_kl(case[0].to(dev), case[1].to(dev), softcap=softcap, backend=backend)
        return
    _check(*case, backend=backend, logit_scale=logit_scale, softcap=softcap)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_probability_the_kernels_flush_counts_as_zero(backend):
    """The policy puts e^-87.05 = 1.5e-38 where the reference has none (-inf): a float32 normal number,
    but below what the kernels' exp represents (2.0e-38). torch's exp keeps it (KL = +inf), the kernels
    flush it (KL finite: the KL of the other entries); _check accepts both and, for a finite answer,
    compares it with the oracle that drops probabilities below FLOAT32_TINY_LOG_P. Hypothesis found it
    when that bound was -87.3 (the cpu kernel's finite KL was judged against +inf)."""
    x = torch.tensor([[62.0, 62.0 - 87.05, 20.0, -3.0, 30.0]])  # the others add < 1e-13 to the softmax sum
    r = torch.tensor([[61.5, -INF, 21.0, -2.0, 29.0]])
    _check(x, r, None, 1.0, backend=backend)
    kl = full_kl(x.to(backend_device(backend)), r.to(backend_device(backend)), backend=backend)
    assert kl.item() == INF or 0 < kl.item() < 1, kl


@pytest.mark.parametrize("backend", BACKENDS)
def test_logits_in_the_thousands_keep_the_kl_to_the_oracle(backend):
    """Hypothesis found it in CI (torch 2.14.1's lane; the row is the two entries that mattered): at logits of
    ~7,500 and ~13,000 the log-probability gaps a - b are ~10,800, so the torch backend's a = z - lse, with lse
    rounded to float32 at that magnitude (an error up to half of its 4.9e-4 ulp), moved p by up to 2.4e-4 and
    the KL by 1.7 (the bound: 0.21). The fused kernels take a = (z - max) - log s, where the large terms cancel
    exactly, as log_softmax does."""
    x = torch.tensor([[7538.91845703125, 7534.77001953125]])
    r = torch.tensor([[2176.528076171875, 12995.248046875]])
    _check(x, r, None, 1.0, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_frozen_reference_gets_no_gradient(backend):
    g = torch.Generator().manual_seed(1)
    x, r = torch.randn(4, 50, generator=g), torch.randn(4, 50, generator=g)
    _check(x, r, None, 1.0, backend=backend, ref_grad=False)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("vocab", [1, 255, 256, 257, 1023, 1024, 1025, 2047, 2048, 2049, 2064, 3000, 4096])
def test_kernel_row_steps(backend, vocab):
    """The fused kernels' lanes (16), spans (256), Triton's steps (256 lanes of 16 bytes: 2048 bf16 entries; rows
    16-byte aligned at V % 16 == 0, else strided lanes), the CUDA kernel's threads (256) and vectors (8 entries,
    one or two a thread and step), their heads and tails; slabs too."""
    g = torch.Generator().manual_seed(vocab)
    x = (torch.randn(2, 3, vocab, generator=g) * 4).to(torch.bfloat16)
    r = (torch.randn(2, 3, vocab, generator=g) * 4).to(torch.bfloat16)
    if vocab > 2:
        x[0, 1, vocab // 2] = -INF
    _check(x, r, None, 0.9, backend=backend)
    _check(x[:, 1:], r[:, 1:], None, 1.0, backend=backend)


@pytest.mark.parametrize("backend", ["cpu", CUDA_EMULATED, pytest.param("triton", marks=pytest.mark.triton),
                                     pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [5, 300])
def test_rows_at_every_alignment(backend, dtype, vocab):
    """The CUDA kernels walk the policy's row as csrc/cuda/rows.cuh says (the entries before its first 16-byte
    boundary one by one, then 8-entry vectors, then the rest) and read the reference's row and write the
    gradients' rows in vectors only where those have the policy row's phase: the policy's rows and the
    reference's at every pair of offsets from a boundary, the same and different (V = 300: head, vectors and
    tail; V = 5: no vector); the gradients land in fresh rows (another phase, unless both are aligned)."""
    g = torch.Generator().manual_seed(vocab)
    x = (torch.randn(3, vocab, generator=g) * 4).to(dtype)
    r = x + (torch.randn(3, vocab, generator=g)).to(dtype)
    r[1, vocab // 2] = -INF
    steps = 16 // x.element_size()
    for sx in range(steps):
        for sr in (sx, (sx + 1) % steps, (sx + 3) % steps):
            _check(x, r, None, 0.8, backend=backend, shifts=(sx, sr))


@pytest.mark.parametrize("backend", ["cpu", CUDA_EMULATED, pytest.param("triton", marks=pytest.mark.triton),
                                     pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [5, 300, 2049])
def test_softcapped_row_walks(backend, dtype, vocab):
    """The soft-capped kernels over the row walks at offsets of the two rows (same and different phases), -inf
    and +inf entries in either (capped: finite, so the "no reference mass" row has a finite KL)."""
    g = torch.Generator().manual_seed(vocab)
    x = (torch.randn(3, vocab, generator=g) * 20).to(dtype)
    r = x + (torch.randn(3, vocab, generator=g) * 5).to(dtype)
    r[1, vocab // 2] = -INF
    x[2, vocab // 3] = INF
    steps = 16 // x.element_size()
    for sx, sr in ((0, 0), (1, 1), (1, 4), (steps - 1, 2)):
        _check(x, r, None, 0.8, backend=backend, shifts=(sx, sr), logit_scale=0.5, softcap=7.0)


# The C++ kernels at every size and dtype; Triton under the interpreter (~5 s a case) at 3 steps of a row.
ONE_PASS_CASES = [pytest.param(b, d, v, marks=CUDA_EMULATED.marks if b == "cuda-emulated" else ())
                  for b in ("cpu", "cuda-emulated") for d in (torch.float32, torch.bfloat16) for v in (300, 2500, 5000)]
ONE_PASS_CASES += [pytest.param("triton", torch.bfloat16, 2500, marks=pytest.mark.triton)]
# Triton's forward adds each lane's terms in float32 over 16 steps (row_math.FOLD), then in float64: 17 steps and
# a partial one (a step is 2048 bf16 / 1024 fp32 entries); rows aligned (V % 16 == 0) and not
ONE_PASS_CASES += [pytest.param("triton", torch.bfloat16, 17 * 2048 + 16, marks=pytest.mark.triton),
                   pytest.param("triton", torch.float32, 17 * 1024 + 5, marks=pytest.mark.triton)]
# On a GPU: the CUDA kernels' grid-stride steps (2048 entries a block step) and Triton's, up to 40 steps
ONE_PASS_CASES += [pytest.param(b, d, v, marks=pytest.mark.cuda)
                   for b in ("cuda", "triton") for d in (torch.float32, torch.bfloat16) for v in (5000, 81921)]


@pytest.mark.parametrize("backend, dtype, vocab", ONE_PASS_CASES)
def test_one_pass_rows_whose_maxima_move(backend, dtype, vocab):
    """The CPU and CUDA forwards read both rows once, moving S, R and A onto running maxima
    (csrc/common/row_math.h; Triton's forward is two-pass and takes the same rows):
    each kind of tests/row_batches.py for the policy against each for the reference (either moving alone,
    both at once, in opposite directions), against the oracle (KL and both gradients)."""
    rows, ref_rows = row_batches.moving_max_rows(vocab, seed=vocab), row_batches.moving_max_rows(vocab, seed=vocab + 1)
    x = torch.cat([rows] * 4)  # each kind against four others and itself
    r = torch.cat([ref_rows.roll(shift, 0) for shift in (0, 1, 3, 6)])
    _check(x.to(dtype), r.to(dtype), None, 1.0, backend=backend)


def reference_gaps_under_a_rising_max(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows where the reference is -inf at entries whose policy probability looks positive against the
    running max when they are read, but is 0 (even in float64) against the row's final max: the policy's
    logits rise 0.03 an entry (~31 per 1024-entry run, ~61 per 2048-entry CUDA block step, each below the
    far bound, so no rebase drops the sums), to ~900. Row 0: the reference -inf on the first 1024 entries
    (final policy probability e^-870 = 0: the KL is finite); row 1: also on one entry 3 below the policy's
    max (probability e^-3: the KL is +inf); row 2: on the last 1024 (the max is read first: the control);
    row 3: on the first 1024 and every 7th entry after (spread over all runs and CUDA threads)."""
    g = torch.Generator().manual_seed(vocab)
    ramp = torch.arange(vocab, dtype=torch.float64) * 0.03 + torch.randn(vocab, generator=g, dtype=torch.float64) * 0.01
    x = torch.stack([ramp] * 4)
    r = torch.randn(4, vocab, generator=g, dtype=torch.float64) * 2
    r[0, :1024] = -math.inf
    r[1, :1024] = -math.inf
    r[1, vocab - 100] = -math.inf
    x[2] = ramp.flip(0)
    r[2, -1024:] = -math.inf
    r[3, :1024] = -math.inf
    r[3, 1024::7] = -math.inf
    x[3, 1024::7] -= 1000.0  # below the far bound of the max read before them: probability 0 when read
    return x, r


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", BACKENDS)
def test_reference_minus_inf_where_the_final_probability_is_zero(backend, dtype):
    """A -inf reference logit makes the KL +inf only where the policy's probability is positive against
    the row's final max (as a two-pass kernel computes it), not where it looked positive against a
    running max that later rose (the one-pass forward's rebase cannot move an inf term; row_math.h keeps
    those entries out of A and decides +inf at the end). Found by the one-pass tests at V = 81921."""
    x, r = reference_gaps_under_a_rising_max(30000)
    kl = full_kl(x.to(dtype).to(backend_device(backend)), r.to(dtype).to(backend_device(backend)), backend=backend)
    assert math.isfinite(kl[0].item()) and math.isfinite(kl[2].item()) and math.isfinite(kl[3].item()), kl
    assert kl[1].item() == math.inf, kl
    _check(x.to(dtype), r.to(dtype), None, 1.0, backend=backend)


def test_backends_agree_on_a_shift_invariant_row():
    """Shifting either model's logits by a constant changes nothing (the kernels subtract each row's own
    max before the difference): KL of a row with itself + 1000 is 0 to float32 rounding, not ~1e-4."""
    x = torch.randn(3, 500, dtype=torch.float64)
    for backend in ("torch", "cpu"):
        kl = full_kl(x.float(), (x + 1000.0).float(), backend=backend)
        want = full_kl(x, x + 1000.0, backend="torch")
        assert (kl.double() - want).abs().max() < 2e-4, (backend, kl)


def test_float64_gradcheck():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 3, 6, generator=g, dtype=torch.float64, requires_grad=True)
    r = torch.randn(2, 3, 6, generator=g, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[True, False, True], [True, True, True]])
    assert torch.autograd.gradcheck(lambda a, b: full_kl(a, b, temperature=1.3, mask=mask), (x, r))


def test_matches_kl_div_of_log_softmax():
    g = torch.Generator().manual_seed(3)
    x, r = torch.randn(5, 40, generator=g) * 3, torch.randn(5, 40, generator=g) * 3
    want = torch.nn.functional.kl_div(torch.log_softmax(r, -1), torch.log_softmax(x, -1), log_target=True,
                                      reduction="none").sum(-1)
    for backend in ("torch", "cpu"):
        torch.testing.assert_close(full_kl(x, r, backend=backend), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("op", ["full_kl", "full_kl_cpu", pytest.param("full_kl_triton", marks=pytest.mark.triton),
                                pytest.param("full_kl_cuda_emu", marks=pytest.mark.cuda_emulated)])
@pytest.mark.parametrize("softcap", [0.0, 2.5])
def test_opcheck(op, softcap):
    if softcap and op.removeprefix("full_kl").removeprefix("_") not in {
            b.replace("cuda-emulated", "cuda_emu").replace("torch", "") for b in SOFTCAP_BACKENDS}:
        pytest.skip(f"{op} has no soft-cap yet (test_logit_scale_and_softcap_match_the_oracle checks it declines)")
    g = torch.Generator().manual_seed(4)
    dev = backend_device("triton" if op.endswith("triton") else "cpu")
    x = torch.randn(5, 11, generator=g).to(dev).requires_grad_()
    r = torch.randn(5, 11, generator=g).to(dev).requires_grad_()
    counted = torch.tensor([True, False, True, True, True], device=dev)
    fwd, bwd = getattr(torch.ops.kl_kernels, f"{op}_fwd"), getattr(torch.ops.kl_kernels, f"{op}_bwd")
    torch.library.opcheck(fwd.default, (x, r, counted, 0.9, softcap))
    kl, lse, ref_lse = fwd(x.detach(), r.detach(), counted, 0.9, softcap)
    for want in ((True, True), (True, False), (False, True)):
        torch.library.opcheck(bwd.default, (torch.randn(5, device=dev), x.detach(), r.detach(), counted, 0.9, softcap,
                                            kl, lse, ref_lse, *want))


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_compile_fullgraph(backend):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 5, 40, generator=g).to(backend_device(backend)).requires_grad_()
    r = torch.randn(2, 5, 40, generator=g).to(backend_device(backend))

    def f(x, r):
        return full_kl(x, r, temperature=0.7, backend=backend).sum()

    eager = f(x, r)
    (ge,) = torch.autograd.grad(eager, x)
    compiled = torch.compile(f, fullgraph=True)(x, r)
    (gc,) = torch.autograd.grad(compiled, x)
    torch.testing.assert_close(compiled, eager)
    torch.testing.assert_close(gc, ge)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(logits=[1.0]), TypeError, "logits must be a dense tensor"),
    (dict(ref_logits=torch.zeros(3, 4, dtype=torch.int64)), TypeError, "ref_logits must be float32"),
    (dict(ref_logits=torch.zeros(3, 5)), ValueError, r"ref_logits must have the logits' shape \[3, 4\]"),
    (dict(ref_logits=torch.zeros(3, 4, dtype=torch.bfloat16)), TypeError, "ref_logits must have the logits' dtype"),
    (dict(logits=torch.zeros(3, 0), ref_logits=torch.zeros(3, 0)), ValueError, "vocabulary V >= 1"),
    (dict(mask=torch.ones(3)), TypeError, "mask must be a bool tensor"),
    (dict(mask=torch.ones(4, dtype=torch.bool)), ValueError, r"mask must have the logits' shape without"),
    (dict(temperature=0.0), ValueError, "temperature must be a finite number > 0"),
    (dict(temperature=True), ValueError, "temperature must be"),
    (dict(backend="nope"), ValueError, "backend"),
    (dict(logit_scale=0.0), ValueError, "logit_scale must be a finite number > 0"),
    (dict(logit_scale=float("nan")), ValueError, "logit_scale"),
    (dict(softcap=0.0), ValueError, "softcap must be None"),
    (dict(softcap=-1.0), ValueError, "softcap must be None"),
    (dict(softcap=False), ValueError, "softcap"),
])
def test_bad_arguments_name_themselves(kwargs, error, match):
    args = dict(logits=torch.zeros(3, 4), ref_logits=torch.zeros(3, 4))
    args.update(kwargs)
    with pytest.raises(error, match=match):
        full_kl(args.pop("logits"), args.pop("ref_logits"), **args)


def test_the_cuda_backend_on_cpu_tensors_says_why():
    with pytest.raises(BackendUnavailableError, match="inputs are on cpu, cuda runs on"):
        full_kl(torch.zeros(2, 3), torch.zeros(2, 3), backend="cuda")


def test_strided_vocabulary_goes_to_torch_under_auto_and_is_refused_by_name():
    x = torch.randn(3, 8).t()  # [8, 3], vocabulary stride 8
    r = torch.randn(8, 3)
    torch.testing.assert_close(full_kl(x, r), full_kl(x.contiguous(), r, backend="cpu"))
    with pytest.raises(BackendUnavailableError, match="logits' vocabulary dimension has stride 8"):
        full_kl(x, r, backend="cpu")


def test_info_lists_the_backends():
    import kl_kernels

    rows = kl_kernels.info()["full_kl_backends"]
    assert rows["torch"]["available"] and rows["cpu"]["available"]
    assert list(rows) == ["cuda", "triton", "cpu", "cuda-emulated", "torch"]
    assert rows["cuda"]["available"] or rows["cuda"]["reason"]  # an unavailable backend says why


def test_cpu_kernel_is_bitwise_deterministic_for_any_thread_count():
    g = torch.Generator().manual_seed(8)
    x = torch.randn(64, 5000, generator=g).requires_grad_()
    r = torch.randn(64, 5000, generator=g).requires_grad_()
    before = torch.get_num_threads()
    results = []
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            kl = full_kl(x, r, backend="cpu")
            results.append((kl, *torch.autograd.grad(kl.sum(), (x, r))))
    finally:
        torch.set_num_threads(before)
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other))
