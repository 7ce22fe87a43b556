"""The fused kernels beyond the semantic axes: registration, determinism, strides, sizes, dispatch.

Semantics (every axis, gradients) are covered by test_kl_reward_oracle.py and
test_kl_reward_grad.py, which run each backend against the oracle; this file covers what is
specific to a compiled kernel.
"""

from __future__ import annotations

import pytest
import torch

from kl_kernels import BackendUnavailableError, kl_reward, ragged
from kl_kernels.kl_reward import ops  # noqa: F401  (registers kl_kernels::kl_reward_fwd / _bwd)
from kl_kernels.kl_reward.backends import REGISTRY

INF = float("inf")


def _fused_devices():
    """cpu, and cuda on GPU machines; the cuda case skips, with the reason, until its kernel exists."""
    cuda = next(b for b in REGISTRY if b.name == "cuda")
    reasons = cuda.unavailable_reasons() if torch.cuda.is_available() else []
    return ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
        bool(reasons), reason="cuda backend unavailable: " + "; ".join(reasons))])]


def _batch(device="cpu", n_seq=37, max_len=700, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, max_len, (n_seq,), generator=g)
    offsets = torch.zeros(n_seq + 1, dtype=torch.int64)
    offsets[1:] = lengths.cumsum(0)
    n = int(offsets[-1])
    lp = (-torch.rand(n, generator=g) * 6).to(dtype)
    ref = (lp.float() + torch.randn(n, generator=g) * 0.5).to(dtype)
    mask = torch.rand(n, generator=g) < 0.7
    to = lambda x: x.to(device)  # noqa: E731
    return to(lp), to(ref), to(mask), to(offsets), to(lengths)


def _opcheck_samples(device):
    lp, ref, mask, offsets, lengths = _batch(device, n_seq=5, max_len=40)
    b = offsets.shape[0] - 1
    score = torch.randn(b, device=device)
    clamp = [-20.0, 20.0, -10.0, 10.0]
    open_clamp = [-INF, INF, -INF, INF]
    width = int(lengths.max())
    from kl_kernels import ragged
    pad = lambda x, v: ragged.to_padded(x, offsets, padding_side="left", width=width, padding_value=v)  # noqa: E731
    yield "packed-k3-last", (lp, ref, mask, offsets, None, None, score, None, 0.1, 0, True, 3, 3, False, clamp, True,
                             torch.float32)
    yield "packed-k1-nomask", (lp, ref, None, offsets, None, None, None, torch.tensor(0.5, device=device), 0.0, 0,
                               True, 0, 0, False, open_clamp, False, torch.float32)
    yield "padded-token-k3plus", (pad(lp, 0.0), pad(ref, 0.0), pad(mask, False), None, lengths,
                                  torch.minimum(lengths, torch.full_like(lengths, 3)), pad(lp, 1.0), None, 0.2, 1,
                                  True, 1, 3, True, clamp, True, torch.float32)
    yield "padded-seq-bf16", (pad(lp, 0.0).bfloat16(), pad(ref, 0.0).bfloat16(), None, None, lengths, None, score,
                              torch.rand(b, device=device), 0.0, 1, False, 2, 1, False, open_clamp, True,
                              torch.float32)


@pytest.mark.parametrize("device", _fused_devices())
def test_opcheck_forward_and_backward(device):
    """torch.library.opcheck: schema, fake tensors, autograd registration, AOT dispatch."""
    for name, args in _opcheck_samples(device):
        grad_args = list(args)
        grad_args[0] = args[0].detach().clone().requires_grad_()
        grad_args[1] = args[1].detach().clone().requires_grad_()
        for sample in (args, tuple(grad_args)):
            torch.library.opcheck(torch.ops.kl_kernels.kl_reward_fwd.default, sample)


@pytest.mark.parametrize("device", _fused_devices())
def test_opcheck_backward_op(device):
    lp, ref, mask, offsets, _ = _batch(device, n_seq=4, max_len=30)
    b = offsets.shape[0] - 1
    g = torch.randn(lp.shape, device=device)
    args = (lp, ref, mask, offsets, None, None, None, 0.3, 0, True, 3, False, [-INF, INF, -INF, INF], torch.float32,
            g, g, None, torch.randn(b, device=device))
    torch.library.opcheck(torch.ops.kl_kernels.kl_reward_bwd.default, args)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_deterministic_for_any_thread_count(threads):
    """Bitwise identical results run to run and whatever the number of threads."""
    lp, ref, mask, offsets, _ = _batch(n_seq=300, max_len=2000)  # many tiles, rows across tiles
    kw = dict(mask=mask, offsets=offsets, estimator="k3", return_ref=True, backend="cpu")
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        want = kl_reward(lp, ref, torch.ones(300), reward_placement="last", **kw)
        torch.set_num_threads(threads)
        for _ in range(3):
            got = kl_reward(lp, ref, torch.ones(300), reward_placement="last", **kw)
            for a, b in zip(want, got):
                assert torch.equal(a, b)
    finally:
        torch.set_num_threads(before)


def check_non_contiguous(layout, backend, device="cpu"):
    """Strided inputs (every other element; column-major [B, T]) give the values of contiguous copies."""
    lp, ref, mask, offsets, lengths = _batch(device, n_seq=20, max_len=300)
    if layout == "packed":
        spread = lambda x: torch.stack([x, x], dim=1).reshape(-1)[::2]  # noqa: E731  stride 2 view
        args = (spread(lp), spread(ref))
        kw = dict(mask=spread(mask), offsets=offsets)
    else:
        from kl_kernels import ragged
        width = int(lengths.max())
        pad = lambda x: ragged.to_padded(x, offsets, padding_side="right", width=width)  # noqa: E731
        spread = lambda x: pad(x).t().contiguous().t()  # noqa: E731  column-major view of [B, T]
        args = (spread(lp), spread(ref))
        kw = dict(mask=spread(mask), lengths=lengths, padding_side="right")
    assert not args[0].is_contiguous()
    got = kl_reward(*args, estimator="k3", return_ref=True, backend=backend, **kw)
    want = kl_reward(*(a.contiguous() for a in args), estimator="k3", return_ref=True, backend=backend,
                     **{k: (v.contiguous() if isinstance(v, torch.Tensor) else v) for k, v in kw.items()})
    for name, a, b in zip(("kl", "reward", "ref", "kl_sum", "count"), got, want):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=name)


@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_non_contiguous_inputs(layout):
    check_non_contiguous(layout, "cpu")


def negated_view(x: torch.Tensor) -> torch.Tensor:
    """``x``'s values, held negated in memory under torch's negative bit (``z.conj().imag`` of a
    complex ``z``; differentiable): a kernel reading the memory without applying the bit sees -x."""
    v = torch.complex(torch.zeros_like(x), -x).conj().imag
    assert v.is_neg() and torch.equal(v, x)
    return v


def check_negative_bit(layout, backend, device="cpu"):
    """Inputs and an upstream gradient carrying torch's negative bit give exactly the results and
    gradients of plain tensors with the same values, with autograd (the custom op, whose dispatch
    applies the bit) and without (the launcher called directly, which must apply it itself)."""
    lp, ref, mask, offsets, lengths = _batch(device, n_seq=9, max_len=90, seed=4)
    reward = torch.randn(lp.shape, device=device)
    coef = torch.rand(offsets.shape[0] - 1, device=device)
    kw = dict(mask=mask, offsets=offsets, estimator="k3", return_ref=True, backend=backend)
    if layout == "padded":
        from kl_kernels import ragged
        pad = lambda x: ragged.to_padded(x, offsets, padding_side="left")  # noqa: E731
        lp, ref, reward = pad(lp), pad(ref), pad(reward)
        kw.update(mask=pad(mask), offsets=None, lengths=lengths)
    upstream = torch.linspace(-1, 1, lp.numel(), device=device).reshape(lp.shape)
    for graph in (False, True):
        results = []
        for negated in (False, True):
            leaves = [lp.clone().requires_grad_(graph), ref.clone().requires_grad_(graph)]
            view = negated_view if negated else (lambda x: x)
            out = kl_reward(view(leaves[0]), view(leaves[1]), view(reward), coef=view(coef), detach=not graph, **kw)
            if graph:
                (out.kl * 0.5 + out.reward * 0.25).backward(view(upstream.clone()), inputs=leaves)
            results.append([*out, *(leaf.grad for leaf in leaves if graph)])
        for name, a, b in zip(("kl", "reward", "ref", "kl_sum", "count", "grad lp", "grad ref"), *results):
            assert torch.equal(a, b), f"{name} ({'autograd' if graph else 'no autograd'})"


@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_negative_bit_inputs(layout):
    check_negative_bit(layout, "cpu")


def test_negative_bit_in_lists():
    """A list with a tensor under the negative bit is packed (torch.cat applies the bit), not read in place."""
    lps = [torch.rand(n) for n in (5, 0, 8)]
    refs = [torch.rand(n) for n in (5, 0, 8)]
    want = kl_reward(lps, refs, None, backend="cpu")
    for which in (lps, refs):
        which[2] = negated_view(which[2])
        got = kl_reward(lps, refs, None, backend="cpu")
        for a, b in zip(got.kl, want.kl):
            assert torch.equal(a, b)
        which[2] = which[2].clone()  # back to a plain tensor


def test_int64_addressing_beyond_2_pow_31():
    """Inputs read at element offsets > 2^31: a padded view whose row stride is 2^31 + 5, over an
    untouched (lazily mapped) bf16 buffer; compared with a contiguous copy."""
    stride = 2**31 + 5
    width = 64
    try:
        storage = torch.empty(stride + width + 1, dtype=torch.bfloat16)
    except RuntimeError as exc:  # pragma: no cover - machines that refuse the 4 GiB mapping
        pytest.skip(f"cannot map a 4 GiB buffer here: {exc}")
    g = torch.Generator().manual_seed(0)
    for row in range(2):
        storage[row * stride: row * stride + width] = (-torch.rand(width, generator=g) * 4).to(torch.bfloat16)
    lp = storage.as_strided((2, width), (stride, 1))
    ref = storage.as_strided((2, width), (stride, 1), storage_offset=1)
    lengths = torch.tensor([width, width - 1])
    got = kl_reward(lp, ref, lengths=lengths, estimator="k2", return_ref=True, backend="cpu")
    want = kl_reward(lp.contiguous(), ref.contiguous(), lengths=lengths, estimator="k2", return_ref=True,
                     backend="cpu")
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    del storage


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_streamed_outputs_equal_the_cached_path(layout, dtype):
    """Problems touching over 32 MiB write every output (kl, reward, masked ref, and the filled
    prompt/padding tokens) with streaming stores, in blocks aligned to the output's cache lines.
    Outputs are bitwise those of the same sequences run in small batches (plain stores); sums agree
    to float64 rounding. Ragged odd lengths put every run start and end at a different alignment;
    token, sequence and last-token rewards cover every reward path (last: the last counted token,
    which the pass tracks only for that placement)."""
    g = torch.Generator().manual_seed(11)
    lengths = torch.randint(1, 3001, (2600,), generator=g)
    lengths[::7] = 0
    lengths[5] = 1
    n = int(lengths.sum())
    lp = (-torch.rand(n, generator=g) * 4).to(dtype)
    ref = (-torch.rand(n, generator=g) * 4).to(dtype)
    mask = torch.rand(n, generator=g) < 0.7
    reward = torch.randn(n, generator=g)
    score = torch.randn(lengths.numel(), generator=g)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])

    def call(lo, hi, placement):
        token_reward = placement == "token"
        o = offsets[lo:hi + 1] - offsets[lo]
        sl = slice(int(offsets[lo]), int(offsets[hi]))
        args = [lp[sl], ref[sl]]
        kw = dict(mask=mask[sl], coef=0.05, estimator="k3", return_ref=True, backend="cpu")
        if layout == "packed":
            kw["offsets"] = o
        else:
            width = int(lengths.max())
            pad = lambda x: ragged.to_padded(x, o, padding_side="left", width=width,  # noqa: E731
                                             padding_value=False if x.dtype == torch.bool else 0.0)
            args = [pad(args[0]), pad(args[1])]
            kw.update(lengths=lengths[lo:hi], padding_side="left", mask=pad(mask[sl]))
            if token_reward:
                reward_sl = pad(reward[sl])
        if token_reward:
            args.append(reward[sl] if layout == "packed" else reward_sl)
        else:
            args.append(score[lo:hi].view(-1, 1, 1) if layout == "padded" else score[lo:hi].view(-1, 1))
            kw["reward_placement"] = placement
        return kl_reward(*args, **kw)

    B = lengths.numel()
    # at least 13 bytes a token here (bf16 lp, ref, kl and ref out, the mask, a float32 reward out)
    assert n * 13 > 32 * 2**20, "not large enough to stream"
    for placement in ("token", "sequence", "last", "last_valid"):
        whole = call(0, B, placement)
        step = 60  # sub-batches far below the streaming threshold
        parts = [call(lo, min(lo + step, B), placement) for lo in range(0, B, step)]
        for name in ("kl", "reward", "ref_log_probs"):
            got = getattr(whole, name)
            want = torch.cat([getattr(p, name) for p in parts])
            assert torch.equal(got, want), (name, placement)
        torch.testing.assert_close(whole.kl_sum, torch.cat([p.kl_sum for p in parts]), rtol=1e-6, atol=1e-6)
        assert torch.equal(whole.count, torch.cat([p.count for p in parts]))


def check_million_token_row(layout, backend, device="cpu"):
    """One row of 1,000,003 tokens (packed next to a 2-token row, or padded [1, N]) vs the reference."""
    n = 1_000_003
    g = torch.Generator().manual_seed(1)
    lp = (-torch.rand(n, generator=g) * 3).to(device)
    ref = (-torch.rand(n, generator=g) * 3).to(device)
    if layout == "packed":
        kw = dict(offsets=torch.tensor([0, 2, n], device=device))
    else:
        lp, ref = lp.view(1, n), ref.view(1, n)
        kw = dict(lengths=torch.tensor([n - 7], device=device))
    got = kl_reward(lp, ref, estimator="k3", backend=backend, **kw)
    want = kl_reward(lp, ref, estimator="k3", backend="torch", **kw)
    torch.testing.assert_close(got.kl, want.kl, rtol=2e-6, atol=1e-6)
    torch.testing.assert_close(got.kl_sum, want.kl_sum, rtol=1e-5, atol=1e-3)
    assert torch.equal(got.count, want.count)


@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_a_row_of_a_million_tokens(layout):
    check_million_token_row(layout, "cpu")


def test_fused_op_on_a_device_without_its_kernel_says_so():
    """The op is registered for CUDA ahead of the CUDA kernel: the launcher names what is missing."""
    from kl_kernels import launching as launch
    if not launch._extensions.kernel("_cuda", "kl_reward_forward")[1]:
        pytest.skip("this build has the CUDA kernel")
    with pytest.raises(RuntimeError, match="no fused kernel for cuda tensors"):
        launch.kernel_module(torch.device("cuda"), "kl_reward_forward", "kl_reward")


def test_auto_prefers_the_fused_kernel_and_declines_what_it_cannot_run():
    lp, ref, _, offsets, _ = _batch(n_seq=3, max_len=20)
    cpu = next(b for b in REGISTRY if b.name == "cpu")
    assert not cpu.unavailable_reasons()
    kl_reward(lp, ref, offsets=offsets, backend="cpu")
    with pytest.raises(BackendUnavailableError, match="dtype float64 not supported by cpu"):
        kl_reward(lp.double(), ref.double(), offsets=offsets, backend="cpu")
    with pytest.raises(BackendUnavailableError, match="differ in dtype"):
        kl_reward(lp, ref.bfloat16(), offsets=offsets, backend="cpu")
    out = kl_reward(lp, ref.bfloat16(), offsets=offsets)  # auto: falls back to the reference
    assert out.kl.dtype == torch.float32


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_bad_input_never_reaches_a_kernel(backend):
    """Validation runs first for every backend: a bad offsets vector raises ValueError, not a crash."""
    lp = torch.zeros(5)
    with pytest.raises(ValueError, match="offsets must end at"):
        kl_reward(lp, lp, offsets=torch.tensor([0, 2, 9]), backend=backend)
    with pytest.raises(ValueError, match="lengths must be <= T"):
        kl_reward(lp.view(1, 5), lp.view(1, 5), lengths=torch.tensor([6]), backend=backend)


def test_coefficient_changes_do_not_recompile():
    """coef is a runtime argument of the op: a new value reuses the compiled graph."""
    from torch._dynamo.testing import CompileCounter
    lp, ref, mask, offsets, _ = _batch(n_seq=4, max_len=50)
    counter = CompileCounter()

    @torch.compile(backend=counter, fullgraph=True)
    def step(coef):
        return kl_reward(lp, ref, mask=mask, offsets=offsets, coef=coef, backend="cpu").reward

    for value in (0.1, 0.2, 0.3):
        step(torch.tensor(value))
    assert counter.frame_count == 1


def _forked_child_sum(queue, lp, ref, offsets):
    packed = kl_reward(lp, ref, offsets=offsets, backend="cpu").kl_sum.tolist()
    # lists: the kernel's tiles on the child's own pool while this thread splits the outputs
    sizes = torch.diff(offsets).tolist()
    lists = kl_reward(list(lp.split(sizes)), list(ref.split(sizes)), backend="cpu").kl_sum.tolist()
    queue.put((packed, lists))


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="needs fork()")
def test_parallel_kernel_in_a_forked_child():
    """The CPU kernel runs on torch's OpenMP team, which is not fork-safe; a forked child (as in a
    fork-started DataLoader worker) must fall back to a fresh pool of its own, not hang."""
    import multiprocessing as mp

    from kl_kernels import _extensions
    runtime = _extensions.probe("_C").get("parallel_runtime")
    assert runtime in ("openmp (torch's)", "own thread pool")
    lp, ref, _, offsets, _ = _batch(n_seq=40, max_len=3000)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        want = kl_reward(lp, ref, offsets=offsets, backend="cpu").kl_sum.tolist()  # the parent's team exists now
        ctx = mp.get_context("fork")
        queue = ctx.Queue()
        child = ctx.Process(target=_forked_child_sum, args=(queue, lp, ref, offsets))
        child.start()
        child.join(60)
        if child.is_alive():
            child.kill()
            pytest.fail("kl_reward hung in a forked child")
        assert child.exitcode == 0 and queue.get(timeout=10) == (want, want)
    finally:
        torch.set_num_threads(before)


def test_k3_at_extreme_log_prob_differences():
    """k3 = expm1(-d) + d and its gradient 1 - exp(-d) through the kernels' own exp/expm1, across
    their regimes: the series near 0, the range reduction, underflow of exp(-d) (d >= 87) and
    overflow to inf (d <= -88.8), against float64 rounded to float32 (inf where float32 overflows)."""
    d = torch.tensor([-200.0, -89.0, -88.7, -88.0, -60.0, -20.0, -1.0, -0.35, -0.34, -1e-3, -1e-7, 0.0, 1e-7, 1e-3,
                      0.34, 0.35, 1.0, 20.0, 60.0, 86.9, 87.0, 87.5, 100.0, 200.0])
    ref = torch.full_like(d, -3.0)
    lp = (ref + d).requires_grad_()
    out = kl_reward(lp, ref, estimator="k3", offsets=torch.tensor([0, d.numel()]), detach=False, backend="cpu")
    out.kl.sum().backward()
    d64 = lp.detach().double() - ref.double()
    want_kl = (torch.expm1(-d64) + d64).float()
    want_grad = (-torch.expm1(-d64)).float()
    # expm1(-d) + d cancels for small d in float32 whatever the expm1: allow ulps of |d| there.
    for got, want in ((out.kl, want_kl), (lp.grad, want_grad)):
        assert torch.equal(torch.isinf(got), torch.isinf(want)), (got, want)
        fin = torch.isfinite(want)
        err = (got[fin].double() - want[fin].double()).abs()
        bound = 2e-6 * want[fin].double().abs() + 4e-7 * d64[fin].abs()
        assert bool((err <= bound).all()), (d[fin][err > bound], got[fin][err > bound], want[fin][err > bound])


def check_nan_through_the_clamps(backend, device="cpu"):
    """A NaN log-prob at a counted token, every estimator, with and without clamps: the values and
    the gradients of both log-probs are NaN exactly where the torch reference's are and equal
    elsewhere. Outside a clamp (a NaN is outside any bound) autograd passes an exact 0, not NaN."""
    g = torch.Generator().manual_seed(5)
    lp = -torch.rand(3, 9, generator=g) * 3
    ref = -torch.rand(3, 9, generator=g) * 3
    lp[0, -1] = ref[2, -2] = float("nan")  # counted tokens (left padding, lengths below)
    for estimator in ("k1", "abs", "k2", "k3", "k3+"):
        for clamps in (dict(), dict(clamp_input=(-1.0, 1.0)), dict(clamp_input=(None, 0.5)),
                       dict(clamp_output=(None, 2.0)), dict(clamp_input=(-3.0, None), clamp_output=(0.0, 5.0))):
            runs = []
            for name, dev in (("torch", "cpu"), (backend, device)):
                x, r = lp.clone().to(dev).requires_grad_(), ref.clone().to(dev).requires_grad_()
                out = kl_reward(x, r, lengths=torch.tensor([9, 4, 7], device=dev), coef=0.1, estimator=estimator,
                                detach=False, backend=name, **clamps)
                (out.kl.sum() + 0.5 * out.reward.sum()).backward()
                runs.append([t.detach().cpu() for t in (out.kl, out.reward, x.grad, r.grad)])
            for name, want, got in zip(("kl", "reward", "grad lp", "grad ref"), *runs):
                what = f"{name}, {estimator}, {clamps}"
                assert torch.equal(got.isnan(), want.isnan()), what
                ok = ~want.isnan()
                torch.testing.assert_close(got[ok], want[ok], rtol=1e-5, atol=1e-6, msg=what)


def test_nan_through_the_clamps():
    check_nan_through_the_clamps("cpu")


# --------------------------------------------------------------------------- lists read in place, NaN pads


def _list_problem(lp, ref, reward=None, **kw):
    from kl_kernels.kl_reward.problem import build_problem
    args = dict(coef=0.1, estimator="k1", mask=None, offsets=None, lengths=None, padding_side="left",
                prompt_lens=None, reward_placement="auto", clamp_input=None, clamp_output=None, return_ref=False,
                detach=True)
    args.update(kw)
    return build_problem(lp, ref, reward, **args)[0]


def test_lists_are_read_in_place_only_when_the_kernel_can():
    lp, ref, mask, offsets, _ = _batch(n_seq=6, max_len=30, seed=3)
    split = lambda x: list(x.split(torch.diff(offsets).tolist()))  # noqa: E731
    lps, refs, masks = split(lp), split(ref), split(mask)
    assert _list_problem(lps, refs).layout == "list"
    assert _list_problem(lps, refs, mask=masks, reward=[t.unsqueeze(-1) for t in lps]).layout == "list"
    strided = [torch.stack([t, t], 1)[:, 0] for t in lps]  # non-contiguous samples
    assert _list_problem(strided, refs).layout == "packed"
    assert _list_problem([t.double() for t in lps], [t.double() for t in refs]).layout == "packed"
    with_grad = [t.clone().requires_grad_() for t in lps]
    assert _list_problem(with_grad, refs, detach=False).layout == "packed"  # autograd: through the op
    assert _list_problem(with_grad, refs, detach=True).layout == "list"


@pytest.fixture(params=["dlpack", "attributes"])
def list_reader(request, monkeypatch):
    """SequenceList.of reading tensors through DLPack's exchange table or their Python attributes."""
    from kl_kernels import _extensions, ragged
    if request.param == "dlpack":
        # The fast path must really be the one tested here: the torch under test offers the exchange
        # table in the major version our reader speaks (csrc/cpu/dlpack_exchange.h: 1). Torches before
        # 2.13 have none: skip rather than assert one torch's internals.
        version = _extensions.load("_C")[0].exchange_api_version(torch.Tensor)
        if version is None:
            pytest.skip(f"torch {torch.__version__} offers no DLPack exchange table")
        assert version[0] == 1, version
    monkeypatch.setattr(ragged, "READ_THROUGH_DLPACK", request.param == "dlpack")
    return request.param


def test_sequence_list_reads_only_what_the_kernel_can(list_reader):
    """SequenceList.of (the extension's one pass over a list): the addresses and offsets the
    kernel reads, and None for every list it could not read in place."""
    from kl_kernels.ragged import SequenceList
    floats = {torch.float32, torch.bfloat16}
    base = torch.arange(40, dtype=torch.float32)
    parts = [base[0:0], base[3:4], base[5:12], base[20:40]]  # views: lengths 0, 1, 7, 20
    s = SequenceList.of(parts, floats)
    assert s.dtype == torch.float32 and s.shape == (28,) and s.numel() == 28 and s.device.type == "cpu"
    assert s.addresses.tolist() == [t.data_ptr() for t in parts]
    assert s.offsets.tolist() == [0, 0, 1, 8, 28]
    assert torch.equal(s.pack(), torch.cat(parts))
    changing = list(parts)
    kept = SequenceList.of(changing, floats)
    changing.clear()  # the caller's list may change (the kernel runs without the GIL): the snapshot holds
    assert len(kept.tensors) == 4 and torch.equal(kept.pack(), torch.cat(parts))
    assert SequenceList.of(tuple(parts), floats) is not None
    same = [torch.zeros(n) for n in (0, 1, 7, 20)]
    assert SequenceList.of(same, floats, like=s) is not None
    assert SequenceList.of(same[::-1], floats, like=s) is None  # other lengths
    assert SequenceList.of(same[:3], floats, like=s) is None  # another batch size
    column = [t.unsqueeze(-1) for t in same]  # [L, 1]
    assert SequenceList.of(column, floats, trailing_one=True, like=s) is not None
    assert SequenceList.of(column, floats) is None
    assert SequenceList.of(same, floats, trailing_one=True) is None
    assert SequenceList.of([torch.zeros(3, 2)], floats, trailing_one=True) is None
    grad = [torch.zeros(3), torch.zeros(2, requires_grad=True)]
    assert SequenceList.of(grad, floats) is not None
    assert SequenceList.of(grad, floats, reject_grad=True) is None
    assert SequenceList.of(same, floats, reject_grad=True) is not None
    nested = torch.nested.nested_tensor([torch.zeros(2)], layout=torch.jagged)
    sparse = torch.zeros(3).to_sparse()
    for bad in ([], iter(same), [torch.zeros(3), torch.zeros(3, dtype=torch.bfloat16)],
                [torch.zeros(3, dtype=torch.float64)], [torch.zeros(3, 2)[:, 0]], [torch.tensor(1.0)],
                [torch.zeros(2, 2)], [torch.nn.Parameter(torch.zeros(3))], [nested], [sparse],
                [torch.zeros(3, device="meta")], [torch.zeros(3), 1.0], [None],
                [torch.zeros(3), torch._neg_view(torch.zeros(2))],  # a pending negation: torch.cat applies it
                [torch.zeros(3, dtype=torch.complex64).conj().imag], [torch.zeros(4, 2).t()[0]],
                [torch.zeros(1, 3)[:, ::2].reshape(-1)[:0], torch.zeros(2, 3)[:, 1]]):
        assert SequenceList.of(bad, floats) is None, bad
    assert SequenceList.of([torch.zeros(6)[::2][:1], torch.zeros(5)[2:]], floats) is not None  # 1 value: any stride
    assert SequenceList.of([torch.zeros(4, 1)[1:], torch.zeros(2, 3)[:, :1]], floats, trailing_one=True) is None
    assert SequenceList.of([torch.zeros(4, 1)[1:], torch.zeros(3, 3)[:1, :1]], floats, trailing_one=True) is not None


def test_list_rewards_are_read_in_place_in_either_shape():
    lps = [torch.rand(n) for n in (4, 0, 9)]
    refs = [torch.rand(n) for n in (4, 0, 9)]
    for reward, trailing in (([t.unsqueeze(-1) for t in lps], True), ([t.clone() for t in lps], False)):
        p = _list_problem(lps, refs, reward=reward)
        assert p.layout == "list" and type(p.reward).__name__ == "SequenceList"
        out = kl_reward(lps, refs, reward, coef=0.5, backend="cpu")
        want = kl_reward(torch.cat(lps), torch.cat(refs), torch.cat([r.reshape(-1) for r in reward]), coef=0.5,
                         offsets=p.offsets, backend="torch")
        for b, r in enumerate(out.reward):
            assert r.shape == reward[b].shape
        assert torch.equal(torch.cat([r.reshape(-1) for r in out.reward]), want.reward)
    with pytest.raises(ValueError, match="consistently"):
        kl_reward(lps, refs, [lps[0].unsqueeze(-1), lps[1], lps[2]], backend="cpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("estimator", ["k1", "k3", "k2"])
@pytest.mark.parametrize("masked", [False, True], ids=["", "mask"])
def test_lists_read_in_place_match_the_oracle(dtype, estimator, masked):
    """The cpu kernel reading per-sequence buffers (lengths 0, 1, a prime, long) in place: every
    output against the float64 oracle, outputs poisoned first, with NaN pads masked or propagated."""
    from oracle import oracle_sequence
    from tolerances import assert_close_to_oracle
    g = torch.Generator().manual_seed(11)
    lengths = [0, 1, 7, 0, 2003, 3, 1]
    lps = [(-torch.rand(n, generator=g) * 4).to(dtype) for n in lengths]
    refs = [(t.float() + torch.randn(n, generator=g) * 0.3).to(dtype) for t, n in zip(lps, lengths)]
    masks = [torch.rand(n, generator=g) < 0.7 for n in lengths]
    rewards = [torch.randn(n, 1, generator=g) for n in lengths]
    refs[2][3] = float("nan")   # alignment pads
    lps[4][100] = float("nan")
    for mask_nan in (False, True):
        out = kl_reward(lps, refs, rewards, coef=0.2, estimator=estimator, mask=masks if masked else None,
                        mask_nan=mask_nan, return_ref=True, backend="cpu")
        assert _list_problem(lps, refs, rewards, mask=masks if masked else None).layout == "list"
        for b, n in enumerate(lengths):
            keep = [bool(m) for m in masks[b]] if masked else [True] * n
            if mask_nan:
                keep = [k and not (lps[b][t].isnan() or refs[b][t].isnan()) for t, k in enumerate(keep)]
            want = oracle_sequence(lps[b].tolist(), refs[b].tolist(), estimator=estimator, mask=keep, coef=0.2,
                                   placement="token", reward=rewards[b].squeeze(-1).tolist())
            assert out.reward[b].shape == (n, 1)
            assert_close_to_oracle(out.kl[b], want.kl, f"kl[{b}]")
            assert_close_to_oracle(out.reward[b].squeeze(-1), want.reward, f"reward[{b}]")
            assert_close_to_oracle(out.ref_log_probs[b], want.ref_out, f"ref[{b}]")
            assert int(out.count[b]) == want.count
            assert_close_to_oracle(out.kl_sum[b:b + 1], [want.kl_sum], f"kl_sum[{b}]", scale=[sum(map(abs, want.kl))])


@pytest.mark.parametrize("placement", ["sequence", "last"])
def test_lists_read_in_place_with_a_per_sequence_reward(placement):
    """A [B] reward next to lists read in place: broadcast, or on the last counted token (which the
    kernel reads back from each sequence's own buffer), against the float64 oracle."""
    from oracle import oracle_sequence
    from tolerances import assert_close_to_oracle
    g = torch.Generator().manual_seed(5)
    lengths = [3, 0, 1, 8]
    lps = [-torch.rand(n, generator=g) * 3 for n in lengths]
    refs = [t + torch.randn(n, generator=g) * 0.2 for t, n in zip(lps, lengths)]
    masks = [torch.rand(n, generator=g) < 0.6 for n in lengths]
    masks[3][-1] = False  # the last counted token is not the last token
    score = torch.randn(len(lengths), generator=g)
    assert _list_problem(lps, refs, score, mask=masks, reward_placement=placement).layout == "list"
    out = kl_reward(lps, refs, score, coef=0.3, mask=masks, reward_placement=placement, backend="cpu")
    for b in range(len(lengths)):
        want = oracle_sequence(lps[b].tolist(), refs[b].tolist(), mask=[bool(m) for m in masks[b]], coef=0.3,
                               placement=placement, reward=float(score[b]))
        assert_close_to_oracle(out.kl[b], want.kl, f"kl[{b}]")
        assert_close_to_oracle(out.reward[b], want.reward, f"reward[{b}]")


@pytest.mark.parametrize("layout", ["packed", "padded", "list"])
@pytest.mark.parametrize("backend", ["cpu", "torch"])
@pytest.mark.parametrize("grad", [False, True], ids=["", "grad"])
def test_mask_nan_leaves_nan_tokens_out(layout, backend, grad):
    """mask_nan: in the kernel (eager, no autograd), or folded into the mask (autograd): NaN tokens
    count for nothing and get no gradient; everything else is untouched."""
    from kl_kernels import ragged
    lp, ref, mask, offsets, lengths = _batch(n_seq=9, max_len=50, seed=5)
    lp, ref = lp.clone(), ref.clone()
    nan_at = torch.arange(0, lp.shape[0], 7)
    ref[nan_at] = float("nan")
    lp[nan_at[::2] + 1] = float("nan")
    counted = mask & ~(lp.isnan() | ref.isnan())
    want = kl_reward(lp, ref, coef=0.3, mask=counted, offsets=offsets, backend="torch")
    if layout == "packed":
        args, kw = (lp, ref), dict(offsets=offsets, mask=mask)
    elif layout == "padded":
        pad = lambda x, v: ragged.to_padded(x, offsets, padding_side="left", padding_value=v)  # noqa: E731
        args, kw = (pad(lp, 0.0), pad(ref, 0.0)), dict(lengths=lengths, mask=pad(mask, False))
    else:
        split = lambda x: list(x.split(lengths.tolist()))  # noqa: E731
        args, kw = (split(lp), split(ref)), dict(mask=split(mask))
    if grad:
        args = tuple([t.clone().requires_grad_() for t in a] if isinstance(a, list) else a.clone().requires_grad_()
                     for a in args)
    out = kl_reward(*args, coef=0.3, mask_nan=True, detach=not grad, backend=backend, **kw)
    packed = lambda x: (torch.cat(x) if isinstance(x, list) else  # noqa: E731
                        ragged.from_padded(x, lengths, padding_side="left").values if x.dim() == 2 else x)
    torch.testing.assert_close(packed(out.kl).detach(), want.kl)
    torch.testing.assert_close(packed(out.reward).detach(), want.reward)
    assert torch.equal(out.count, want.count) and not out.kl_sum.isnan().any()
    if grad:
        out.kl_sum.sum().backward()
        g_lp = packed(args[0].grad if not isinstance(args[0], list) else [t.grad for t in args[0]])
        assert torch.equal(g_lp != 0, counted), "exactly the counted tokens get a k1 gradient"


def test_mask_nan_is_refused_by_the_gpu_kernels_outside_autograd():
    lp, ref, _, offsets, _ = _batch(n_seq=3, max_len=10)
    problem = _list_problem(lp, ref, offsets=offsets, mask_nan=True)
    for b in REGISTRY:
        if b.name in ("cuda", "triton"):
            assert any("mask_nan" in r for r in b.requires(problem))
