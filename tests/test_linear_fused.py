"""The fused hidden-state kernels (kl_kernels/triton/linear_rows.py through token_logprobs/linear_fused.py) against
the float64 oracle of token_logprobs (``oracle_row``, one row at a time in Python floats) applied to logits formed
in float64 from the same (rounded) hidden states and head; the gradients to hidden, weight and bias by the chain
rule in float64 from the oracle's logits gradients. Every dtype the kernels take, entropy on and off, a reference
on and off, masks and ignored labels, temperatures, NaN/inf in single rows, labels out of range, N = 0 and 1, sizes
that are not multiples of the tiles, several vocabulary shares and backward chunks; outputs and workspaces
NaN-poisoned before the kernels write. Under Triton's interpreter on the CPU without a GPU (small tiles), on the
GPU where there is one. Also: determinism, the reference's log-probs as a separate call gives them, inputs
unmodified, what is declined (float64) and why, and the kernels compiled for sm_90 without spills."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import triton_device
from test_token_logprobs import oracle_row
from tolerances import TOLERANCES

from kl_kernels.token_logprobs import linear_fused as F
from kl_kernels.vocab_rows import logit_transform

pytestmark = pytest.mark.triton
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
RECOMPUTES = ("triton", "cublas")


def _dev():
    return triton_device() or "cpu"


def _poisoned(*shape, dtype=None, device=None, **kw):
    t = torch.empty(*shape, dtype=dtype, device=device, **kw)
    return t.fill_(float("nan") if t.is_floating_point() else -7)


@pytest.fixture(autouse=True)
def poison(monkeypatch):
    monkeypatch.setattr(F, "_alloc", _poisoned)


def _oracle(h, w, b, y, counted, temperature, up_lp, up_h, entropy, transform=(1.0, None)):
    """(log_probs, entropy, d hidden, d weight, d bias) in float64 (Python floats through oracle_row; ``transform``
    its (logit_scale, softcap)), and the error scales of the gradients (see _close_grad)."""
    slope = transform[0] / temperature  # the largest d z / d x
    h64, w64 = h.double().cpu(), w.double().cpu()
    z = h64 @ w64.t() + (0 if b is None else b.double().cpu())
    n, vocab = z.shape
    lp, ent = [0.0] * n, [0.0] * n
    d = torch.zeros(n, vocab, dtype=torch.float64)
    c = torch.zeros(n, dtype=torch.float64)
    c3 = torch.zeros(n, dtype=torch.float64)
    ylist, clist = y.tolist(), counted.tolist()
    for r in range(n):
        if not clist[r]:
            continue
        row = z[r].tolist()
        if not 0 <= ylist[r] < vocab:
            lp[r] = ent[r] = float("nan")
            d[r] = float("nan")
            continue
        lp[r], ent[r], d_lp, d_h = oracle_row(row, ylist[r], temperature, *transform)
        d[r] = up_lp[r] * torch.tensor(d_lp, dtype=torch.float64)
        if entropy:
            d[r] += up_h[r] * torch.tensor(d_h, dtype=torch.float64)
        mag = max((abs(v) for v in row if math.isfinite(v)), default=0.0) * slope + 1.0
        c[r] = (abs(up_lp[r]) + (abs(up_h[r]) * mag if entropy else 0.0)) * slope
        c3[r] = c[r] * mag
    grads = (d @ w64, d.t() @ h64, d.sum(0))
    dabs, cm, cm3 = d.abs(), c[:, None].expand(n, vocab), c3[:, None].expand(n, vocab)
    scales = ((dabs @ w64.abs(), cm @ w64.abs(), cm3 @ w64.abs()),
              (dabs.t() @ h64.abs(), cm.t() @ h64.abs(), cm3.t() @ h64.abs()),
              (dabs.sum(0), cm.sum(0), cm3.sum(0)))
    return lp, ent, grads, scales


def _close_value(got, want, scale, what, dtype):
    """A value of float32 math on the tile: within 8 float32 rounding steps of its logits' magnitude (the
    accumulated dot: sum_k |h_k w_k| / T)."""
    tol = TOLERANCES[torch.float32]
    for r, (a, e, s) in enumerate(zip(got, want, scale)):
        if math.isnan(e) or math.isinf(e):
            assert a == e or (math.isnan(a) and math.isnan(e)), f"{what}[{r}] ({dtype}): {a} vs {e}"
        else:
            assert a == e or abs(a - e) <= tol.atol + 8 * tol.rtol * (s + 1.0), f"{what}[{r}] ({dtype}): {a} vs {e}"


def _close_grad(got, want, scales, what, dtype):
    """A gradient: a GEMM (float32 accumulation) of d z rounded to the parameters' dtype, its result rounded to
    it: within a few of the dtype's rounding steps of |result| + sum |d z| |x| (``prop``), plus the float32
    math error of d z, relative to each row's |g_lp| + |g_H| max|z| / T, carried through (``prop2``); with the
    "cublas" recompute (16-bit logits) that scale times max|z| too (``prop3``)."""
    if got is None:
        return
    prop, prop2, prop3 = scales
    gtol, tol = TOLERANCES[dtype], TOLERANCES[torch.float32]
    got = got.detach().double().cpu()
    bound = gtol.atol + 4 * gtol.rtol * (want.abs() + prop) + 16 * tol.rtol * prop2
    if F.RECOMPUTE == "cublas" and dtype != torch.float32:
        # the recomputed logits rounded to the dtype (as eager's are): z off by a rounding step of max |z|
        bound = bound + 4 * gtol.rtol * prop3
    nan = want.isnan()
    assert torch.equal(got.isnan() & nan, nan), f"d {what} ({dtype}): NaN expected at {nan.nonzero().tolist()[:8]}"
    bad = ~nan & ~((got - want).abs() <= bound)
    assert not bad.any(), (f"d {what} ({dtype}) differs at {bad.nonzero().tolist()[:8]}: "
                           f"{got[bad].tolist()[:8]} vs {want[bad].tolist()[:8]}")


def _run(h, w, b, y, counted, temperature, entropy, ref=None, seed=0, transform=(1.0, None)):
    """Call the fused function, check it against the oracle; returns the outputs. ``transform``: (logit_scale,
    softcap), handed to the kernels in their units (vocab_rows.logit_transform), to the oracle as written."""
    t_k, c_k = logit_transform(temperature, *transform)
    dev = h.device
    leaves = [h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_(),
              None if b is None else b.detach().clone().requires_grad_()]
    before = [t.detach().clone() for t in (h, w, *(x for x in (b,) if x is not None))]
    ref_args = () if ref is None else ref
    extra = () if transform == (1.0, None) else (*(ref_args or (None, None, None)), c_k)
    lp, ent, lse, ref_lp = F.FusedLinearTokenLogprobs.apply(*leaves, y, counted, t_k, entropy,
                                                            *(extra or ref_args))
    n = y.numel()
    assert lp.shape == (n,) and lse.shape == (n,) and lp.dtype == torch.float32
    assert ent.shape == ((n,) if entropy else (0,)) and ref_lp.shape == ((n,) if ref else (0,))
    g = torch.Generator().manual_seed(seed)
    up_lp, up_h = torch.randn(n, generator=g, dtype=torch.float64), torch.randn(n, generator=g, dtype=torch.float64)
    total = (lp.double() * up_lp.to(dev)).sum() + ((ent.double() * up_h.to(dev)).sum() if entropy else 0.0)
    wanted = [t for t in leaves if t is not None]
    grads = list(torch.autograd.grad(total, wanted))
    if b is None:
        grads.append(None)
    for a, before_a in zip((h, w, *(x for x in (b,) if x is not None)), before):
        assert torch.equal(a.nan_to_num(), before_a.nan_to_num()), "an input was modified"
    t = temperature
    want_lp, want_ent, want_g, scales = _oracle(h, w, b, y.cpu(), counted.cpu(), t, up_lp.tolist(), up_h.tolist(),
                                                entropy, transform)
    zmag = ((h.double().abs().cpu() @ w.double().abs().cpu().t()).amax(1)
            + (0 if b is None else b.double().abs().nan_to_num(posinf=0.0, neginf=0.0).amax().cpu())) * (
        transform[0] / t)
    _close_value(lp.cpu().tolist(), want_lp, zmag.tolist(), "log_probs", h.dtype)
    if entropy:
        _close_value(ent.cpu().tolist(), want_ent, zmag.tolist(), "entropy", h.dtype)
    for what, a, e, s in zip(("hidden", "weight", "bias"), grads, want_g, scales):
        if what != "bias" or b is not None:
            assert a.dtype == h.dtype and a.shape == (h, w, b)[("hidden", "weight", "bias").index(what)].shape
            _close_grad(a, e, s, what, h.dtype)
    if ref is not None:
        rh, rw, rb = ref
        want_ref = _oracle(rh, rw, rb, y.cpu(), counted.cpu(), t, [0.0] * n, [0.0] * n, False, transform)[0]
        rmag = ((rh.double().abs().cpu() @ rw.double().abs().cpu().t()).amax(1)
                + (0 if rb is None else rb.double().abs().amax().cpu())) * (transform[0] / t)
        _close_value(ref_lp.cpu().tolist(), want_ref, rmag.tolist(), "ref_log_probs", h.dtype)
        alone = F.forward_rows(rh, rw, rb, y, counted, t_k, False, c_k)[0]
        assert torch.equal(alone.nan_to_num(1.5), ref_lp.nan_to_num(1.5)), "the reference's differ from its own call"
    return lp, ent, lse, ref_lp, grads


def _inputs(n, hid, vocab, dtype, with_bias, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    dev = _dev()
    h = (torch.randn(n, hid, generator=g) * scale).to(dtype).to(dev)
    w = (torch.randn(vocab, hid, generator=g) * (0.6 / math.sqrt(max(hid, 1)) * 3)).to(dtype).to(dev)
    b = torch.randn(vocab, generator=g).to(dtype).to(dev) if with_bias else None
    y = torch.randint(0, vocab, (n,), generator=g)
    counted = torch.rand(n, generator=g) < 0.8
    y[~counted & (torch.rand(n, generator=g) < 0.5)] = -100  # ignored labels are not counted
    return h, w, b, y.to(dev), counted.to(dev)


@given(n=st.sampled_from([0, 1, 2, 17, 40, 70]), hid=st.sampled_from([1, 16, 33, 96]),
       vocab=st.sampled_from([1, 31, 33, 150, 300]), dtype=st.sampled_from(DTYPES), with_bias=st.booleans(),
       entropy=st.booleans(), with_ref=st.booleans(), temperature=st.sampled_from([1.0, 0.7, 2.5]),
       scale=st.sampled_from([0.3, 1.0, 8.0]), small_chunks=st.booleans(), recompute=st.sampled_from(RECOMPUTES),
       seed=st.integers(0, 2**31 - 1))
@settings(max_examples=40, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_matches_the_oracle(n, hid, vocab, dtype, with_bias, entropy, with_ref, temperature, scale, small_chunks,
                            recompute, seed):
    h, w, b, y, counted = _inputs(n, hid, vocab, dtype, with_bias, seed, scale)
    ref = None
    if with_ref:  # its own width
        rh, rw, rb, _, _ = _inputs(n, hid + 5, vocab, dtype, with_bias, seed + 1, scale)
        ref = (rh, rw, rb)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(F, "RECOMPUTE", recompute)
        if small_chunks:  # one tile of columns per backward chunk: the float32 d hidden accumulator
            m.setattr(F, "CHUNK_BYTES", 1)
        _run(h, w, b, y, counted, temperature, entropy, ref, seed)


@given(n=st.sampled_from([0, 1, 17, 70]), hid=st.sampled_from([1, 16, 33]), vocab=st.sampled_from([1, 33, 150]),
       dtype=st.sampled_from(DTYPES), with_bias=st.booleans(), entropy=st.booleans(), with_ref=st.booleans(),
       temperature=st.sampled_from([1.0, 0.7]), scale=st.sampled_from([1.0, 8.0]),
       transform=st.sampled_from([(0.25, None), (1.0, 1.5), (2.0, 3.0), (0.5, 30.0)]),
       small_chunks=st.booleans(), recompute=st.sampled_from(RECOMPUTES), seed=st.integers(0, 2**31 - 1))
@settings(max_examples=25, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_logit_scale_and_softcap_match_the_oracle(n, hid, vocab, dtype, with_bias, entropy, with_ref, temperature,
                                                  scale, transform, small_chunks, recompute, seed):
    """TRL's fused LM head's transform z = c tanh(s x / c) / T in the fused kernels (forward tiles, the combine,
    the d z kernel from its own tiles and from cuBLAS's), the reference taking the same."""
    h, w, b, y, counted = _inputs(n, hid, vocab, dtype, with_bias, seed, scale)
    ref = None
    if with_ref:
        rh, rw, rb, _, _ = _inputs(n, hid + 5, vocab, dtype, with_bias, seed + 1, scale)
        ref = (rh, rw, rb)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(F, "RECOMPUTE", recompute)
        if small_chunks:
            m.setattr(F, "CHUNK_BYTES", 1)
        _run(h, w, b, y, counted, temperature, entropy, ref, seed, transform)


@pytest.mark.parametrize("recompute", RECOMPUTES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_special_rows(dtype, recompute, monkeypatch):
    """NaN and +inf in one token's hidden state (that row NaN, the others exact), a row of only -inf logits, a
    label out of range at a counted token (NaN, no out-of-bounds read), columns of -inf (bias) and a label
    on one (log-prob -inf), an uncounted row of NaN (0 out; its 0 gradient times NaN is NaN in d weight, as
    in eager's GEMM)."""
    monkeypatch.setattr(F, "RECOMPUTE", recompute)
    n, hid, vocab = 9, 20, 70
    h, w, b, y, counted = _inputs(n, hid, vocab, dtype, True, 3)
    counted[:] = True
    y = y.clone()
    y[y < 0] = 1
    w[:, 0] = -(w[:, 0].abs() + 0.1)
    h[1, 3] = float("nan")
    h[2, 0] = float("inf")  # w[:, 0] < 0: every logit of the row -inf
    h[3, 0] = -float("inf")  # every logit +inf
    y[4] = vocab  # out of range
    y[5] = -3
    b[7] = float("-inf")
    y[6] = 7  # label on a -inf column
    _run(h, w, b, y, counted, 0.8, True)
    lp, ent, _, _, grads = _run(h, w, b, y, counted, 1.0, False)
    assert lp[[1, 2, 3, 4, 5]].isnan().all() and lp[6].item() == float("-inf")
    assert lp[[0, 7, 8]].isfinite().all()
    # an uncounted NaN row: 0 out, and the other rows' d hidden finite
    counted[[1, 2, 3, 4, 5]] = False
    lp, ent, _, _, grads = _run(h, w, b, y, counted, 1.0, True)
    assert (lp[[1, 2, 3, 4, 5]] == 0).all() and (ent[[1, 2, 3, 4, 5]] == 0).all()
    assert grads[0][[0, 6, 7, 8]].isfinite().all()


@pytest.mark.parametrize("recompute", RECOMPUTES)
@pytest.mark.parametrize("n", [0, 1])
def test_tiny_batches(n, recompute, monkeypatch):
    monkeypatch.setattr(F, "RECOMPUTE", recompute)
    h, w, b, y, counted = _inputs(n, 24, 45, torch.float32, True, 5)
    counted[:] = True
    y[:] = 3
    _run(h, w, b, y, counted, 1.0, True, (h, w * 0.5, None))


@pytest.mark.parametrize("recompute", RECOMPUTES)
def test_deterministic(recompute, monkeypatch):
    monkeypatch.setattr(F, "RECOMPUTE", recompute)
    h, w, b, y, counted = _inputs(40, 48, 200, torch.bfloat16, True, 11)
    outs = []
    for _ in range(2):
        leaves = [t.detach().clone().requires_grad_() for t in (h, w, b)]
        lp, ent, lse, _ = F.FusedLinearTokenLogprobs.apply(*leaves, y, counted, 0.9, True)
        (lp.sum() + 0.3 * ent.sum()).backward()
        outs.append([lp, ent, lse, *(t.grad for t in leaves)])
    for a, b_ in zip(*outs):
        assert torch.equal(a, b_)


def test_partial_gradients_and_none_upstream():
    """Only some inputs need a gradient; an unused entropy output gives the same gradients as none asked."""
    h, w, b, y, counted = _inputs(17, 33, 100, torch.float32, True, 2)
    hh = h.clone().requires_grad_()
    lp, ent, _, _ = F.FusedLinearTokenLogprobs.apply(hh, w, b, y, counted, 1.0, True)
    (g1,) = torch.autograd.grad(lp.sum(), hh)
    lp2, _, _, _ = F.FusedLinearTokenLogprobs.apply(hh, w, b, y, counted, 1.0, False)
    (g2,) = torch.autograd.grad(lp2.sum(), hh)
    assert torch.equal(g1, g2)


def test_what_is_declined_and_why(monkeypatch):
    dev = _dev()
    h, w = torch.randn(3, 16, dtype=torch.float64, device=dev), torch.randn(5, 16, dtype=torch.float64, device=dev)
    assert "float64" in F.fused_reason(h, w)
    h, w = h.float(), w.float()
    assert F.fused_reason(h, w) is None
    assert "unit stride" in F.fused_reason(h.t(), torch.randn(3, 5, device=dev))
    assert "unit stride" in F.fused_reason(h, w.t().contiguous().t())
    assert "bias" in F.fused_reason(h, w, torch.randn(10, device=dev)[::2])
    with pytest.raises(ValueError, match="recompute"):
        F.backward_rows(None, None, h, w, None, None, None, 1.0, None, None, recompute="eager")
    if dev == "cpu":
        monkeypatch.setattr(F, "_interpreting", lambda: False)
        assert "CUDA" in F.fused_reason(h, w)


def test_the_vocabulary_is_cut_into_shares_and_chunks():
    """The test shapes above cross shares (the forward's merge) and chunks: the launch arithmetic."""
    bn, bv = F._tiles(torch.float32)[:2]
    if F._interpreting():
        assert F._shares(70, 300, bn, bv, "cpu") == F.INTERPRETER_SHARES
    assert F.vocab_chunk(8192, 128256, 2, 128) == 8192
    assert F.vocab_chunk(7, 100, 2, 32) == 128  # whole tiles, not past the vocabulary's last one
    assert F.vocab_chunk(1 << 30, 100, 2, 32) == 32  # at least one tile


# ------------------------------------------------------------------ compiled for sm_90 without a GPU

_COMPILE_CHILD = r"""
import json, os, sys, torch
from triton.backends.compiler import GPUTarget
from triton.runtime import driver
from triton.runtime.jit import JITFunction
from kl_kernels.triton import aot

class Stub:
    def get_current_target(self): return GPUTarget("cuda", 90, 32)
    def get_current_device(self): return 0
    def get_current_stream(self, device=None): return 0
    def get_active_torch_device(self): return torch.device("cpu")

driver.set_active(Stub())
out, records, original = sys.argv[1], [], JITFunction.run

def compile_only(self, *args, grid, warmup, **kwargs):
    k = original(self, *args, grid=grid, warmup=True, **kwargs)
    path = os.path.join(out, f"{self.__name__}_{k.hash[:16]}.cubin")
    open(path, "wb").write(k.asm["cubin"])
    records.append(dict(kernel=self.__name__, dtype=str(args[0].dtype), precision=kwargs.get("PRECISION"),
                        warps=k.metadata.num_warps, smem=k.metadata.shared, cubin=path, **aot.res_usage(path)))
    return k

JITFunction.run = compile_only
from kl_kernels.token_logprobs import linear_fused as F
F._interpreting = lambda: False
F._shares = lambda rows, vocab, bn, bv, device: 2
for dtype, tf32 in ((torch.bfloat16, False), (torch.float16, False), (torch.float32, False), (torch.float32, True)):
    torch.backends.cuda.matmul.allow_tf32 = tf32
    h, w, b = torch.randn(300, 4096).to(dtype), torch.randn(1000, 4096).to(dtype), torch.randn(1000).to(dtype)
    y, c = torch.randint(0, 1000, (300,)), torch.ones(300, dtype=torch.bool)
    for ent in (False, True):
        lp, e, lse = F.forward_rows(h, w, b, y, c, 0.7, ent)
        for recompute in ("triton", "cublas"):
            F.backward_rows(torch.randn(300), torch.randn(300) if ent else None, h, w, b, y, c, 0.7, lse, e,
                            (False, False, False), recompute)
json.dump(records, open(os.path.join(out, "records.json"), "w"))
for r in records: print(r)
"""


@pytest.mark.slow
def test_kernels_compile_for_sm90_without_spills(tmp_path):
    """Every kernel, each dtype (fp32 with and without TF32), at its GPU tiles, compiled for sm_90 (the stub
    driver of kl_kernels.triton.aot, a fresh cache, no TRITON_INTERPRET): no local memory (spills or stack),
    shared memory within an H100's 227 KiB, at most 255 registers, the 16-bit tiles' H loop pipelined, and
    their logits tiles on Hopper's warpgroup tensor-core instruction (HGMMA, from wgmma): the older per-warp
    HMMA (mma.sync) path reaches about two thirds of its rate."""
    import json
    import os
    import subprocess
    import sys

    from kl_kernels.triton import aot

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    p = subprocess.run([sys.executable, "-c", _COMPILE_CHILD, str(tmp_path)], env=env, capture_output=True,
                       text=True, cwd=str(F.__file__).rsplit("/kl_kernels/", 1)[0])
    assert p.returncode == 0, p.stderr[-4000:]
    print(p.stdout)
    records = json.load(open(tmp_path / "records.json"))
    names = {r["kernel"] for r in records}
    assert names == {"linear_rows_fwd_kernel", "linear_rows_combine_kernel", "linear_rows_dlogits_kernel"}
    assert {r["dtype"] for r in records} == {"torch.bfloat16", "torch.float16", "torch.float32"}
    assert {r["precision"] for r in records if r["dtype"] == "torch.float32"} == {"ieee", "tf32", None}
    for r in records:
        assert r["local"] + r["stack"] == 0, r
        if r["dtype"] != "torch.float32" and (r["kernel"] == "linear_rows_fwd_kernel" or r["smem"] > 0):
            # the H loop pipelined (cp.async, num_stages buffers): H = 4096 is specialized as a multiple of 16,
            # so the 16-bit tiles' masks are uniform over 8 entries (a hid left unspecialized stopped it); the d z
            # kernel reading cuBLAS's logits has no H loop (no shared memory)
            bn, bv, bk, _, stages = F.GPU_TILES[2]
            assert r["smem"] >= stages * (bn + bv) * bk * 2, r
        assert r["smem"] + r["static_smem"] <= 227 * 1024, r
        assert r["regs"] <= 255, r
    dots = [r for r in records if r["kernel"] != "linear_rows_combine_kernel" and r["smem"] > 0
            and (r["dtype"] != "torch.float32" or r["precision"] == "tf32")]
    assert dots  # the forward and the d z kernel's recompute, 16-bit and TF32
    for r in dots:
        sass = aot.disassemble(r["cubin"])
        assert "HGMMA" in sass and "HMMA" not in sass.replace("HGMMA", ""), r


def test_the_ab_benchmark_runs_and_reports():
    """kl_kernels.bench.linear_fused_ab at a tiny size (here: under the interpreter): a row per contender with
    the fields hidden_states.json asks for, and the fused gradients near the float32 ones."""
    from kl_kernels.bench import linear_fused_ab as ab

    rows = ab.run([(20, 16, 40)], "float32", ["fused", "fused-cublas", "eager"], 1, True, torch.device(_dev()))
    assert [r["contender"] for r in rows] == ["fused", "fused-cublas", "eager"]
    for r in rows:
        assert {"task", "n", "hidden", "vocab", "dtype", "ms", "peak_extra_mib", "machine"} <= set(r)
        assert r["grad_rel_err_hidden"] < 1e-5 and r["grad_rel_err_weight"] < 1e-5
    assert "| fused |" in ab.table(rows)


def test_fused_true_gives_the_chunked_results():
    """``linear_token_logprobs(fused=True)`` (labels with ignore_index, a mask, a [B, T] token shape, a reference)
    gives the default route's results (float32: the same math, to float32 rounding) and gradients, in the caller's
    token shape."""
    from kl_kernels import linear_token_logprobs

    dev = _dev()
    g = torch.Generator().manual_seed(7)
    h = torch.randn(3, 5, 40, generator=g).to(dev)
    w = (torch.randn(90, 40, generator=g) * 0.3).to(dev)
    rh, rw = torch.randn(3, 5, 24, generator=g).to(dev), (torch.randn(90, 24, generator=g) * 0.3).to(dev)
    y = torch.randint(0, 90, (3, 5), generator=g)
    y[0, 1] = -100
    y, mask = y.to(dev), (torch.rand(3, 5, generator=g) < 0.8).to(dev)
    kw = dict(temperature=0.8, return_entropy=True, mask=mask, ref_hidden=rh, ref_weight=rw)
    hf, hc = h.clone().requires_grad_(), h.clone().requires_grad_()
    wf, wc = w.clone().requires_grad_(), w.clone().requires_grad_()
    got = linear_token_logprobs(hf, wf, y, fused=True, **kw)
    want = linear_token_logprobs(hc, wc, y, **kw)
    for a, b in zip(got, want):
        assert a.shape == (3, 5)
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert not got.ref_log_probs.requires_grad
    (got.log_probs.sum() + got.entropy.sum()).backward()
    (want.log_probs.sum() + want.entropy.sum()).backward()
    torch.testing.assert_close(hf.grad, hc.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(wf.grad, wc.grad, rtol=1e-4, atol=1e-5)


def test_fused_true_that_cannot_run_says_why():
    """An explicit ``fused=True`` the kernels cannot take is a ValueError with the reason, before any kernel."""
    from kl_kernels import linear_token_logprobs

    h, w, y = torch.randn(4, 8, dtype=torch.float64), torch.randn(10, 8, dtype=torch.float64), torch.tensor([1, 2, 3, 4])
    with pytest.raises(ValueError, match=r"fused=True.*float64"):
        linear_token_logprobs(h, w, y, fused=True)
    with pytest.raises(TypeError, match="fused must be True or False"):
        linear_token_logprobs(h.float(), w.float(), y, fused="yes")
