"""The fused kl_penalty_loss ops: opcheck, torch.compile, nasty sizes, non-contiguous inputs,
determinism, no input modified; and the 2-process data-parallel equivalence (gloo, CPU)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap

import pytest
import torch

from conftest import CUDA_EMULATED, REPO
from kl_kernels import kl_penalty_loss

FUSED = ["cpu", CUDA_EMULATED]


def _padded_batch(B=5, T=37, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(B, T, generator=g) * 4
    return dict(log_probs=lp.to(dtype), old_log_probs=(lp + torch.randn(B, T, generator=g) * 0.3).to(dtype),
                ref_log_probs=(lp + torch.randn(B, T, generator=g) * 0.3).to(dtype),
                advantages=torch.randn(B, T, generator=g).to(dtype), entropy=torch.rand(B, T, generator=g).to(dtype),
                mask=torch.rand(B, T, generator=g) < 0.8, lengths=torch.tensor([T, 0, 1, T // 2, 3][:B]))


def _op_args(kind="padded", token_out=False, seq_lr=False):
    b = _padded_batch()
    if kind == "padded":
        geo = (b["mask"], None, b["lengths"])
        lp, old, ref, adv, ent = (b[k] for k in ("log_probs", "old_log_probs", "ref_log_probs", "advantages", "entropy"))
        layout = 1
    else:
        lp, old, ref, adv, ent = (b[k].flatten() for k in ("log_probs", "old_log_probs", "ref_log_probs", "advantages",
                                                            "entropy"))
        geo = (b["mask"].flatten(), torch.tensor([0, 10, 10, 11, 100, 185]), None)
        layout = 0
    weights = torch.rand(lp.shape, generator=torch.Generator().manual_seed(5)).to(adv.dtype)
    return (lp.requires_grad_(), old, ref, adv, ent.requires_grad_(), *geo, torch.tensor([0.1, 0.2, 0.3, 0.4, 0.5]),
            0.0, False, layout, True, 3, False, 0.8, 1.28, 0.01, token_out, weights, 3.0, True, [-20.0, 20.0, -10.0, 10.0],
            torch.tensor([0.05, -0.1, 0.0, 0.3, -2.0]) if seq_lr else None, seq_lr)  # kl_times_ratio with GSPO


@pytest.mark.parametrize("kind", ["padded", "packed"])
@pytest.mark.parametrize("token_out", [False, True], ids=["sums", "token_out"])
@pytest.mark.parametrize("seq_lr", [False, True], ids=["token_ratio", "seq_ratio"])
def test_opcheck(kind, token_out, seq_lr):
    """torch.library.opcheck: schema, fake tensors, autograd registration, AOT dispatch."""
    torch.library.opcheck(torch.ops.kl_kernels.kl_penalty_fwd.default, _op_args(kind, token_out, seq_lr))


def test_opcheck_backward_op():
    grad = torch.randn(5, 37)
    args = (grad, torch.randn(5), torch.randn(5, 37), torch.rand(5, 37) < 0.5, None, torch.tensor([37, 0, 1, 18, 3]),
            1, True, torch.bfloat16, True, torch.float32, 0.01)
    torch.library.opcheck(torch.ops.kl_kernels.kl_penalty_bwd.default, args)


def check_fullgraph_compile(backend, aggregation, device="cpu"):
    """torch.compile(fullgraph=True) of a function calling kl_penalty_loss: same values and gradient as eager."""
    b = _on(_padded_batch(), device)
    lp = b.pop("log_probs").requires_grad_()
    beta = torch.tensor(0.2, device=device)

    def fn(x):
        out = kl_penalty_loss(x, **b, beta=beta, clip_epsilon=0.2, entropy_coef=0.01, estimator="k3",
                              aggregation=aggregation, backend=backend)
        loss = out.loss.sum() if aggregation == "none" else out.loss
        return loss, out.kl_mean, out.num_tokens

    eager = fn(lp)
    (g_eager,) = torch.autograd.grad(eager[0], lp)
    compiled = torch.compile(fn, fullgraph=True)(lp)
    (g_comp,) = torch.autograd.grad(compiled[0], lp)
    for got, want in zip(compiled, eager):
        torch.testing.assert_close(got, want)
    torch.testing.assert_close(g_comp, g_eager)


@pytest.mark.slow
@pytest.mark.parametrize("aggregation", ["token-mean", "none"])
def test_fullgraph_compile_matches_eager(aggregation):
    check_fullgraph_compile("cpu", aggregation)


def _on(batch: dict, device) -> dict:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def check_non_contiguous(backend, device="cpu"):
    """Strided views (every other column of a wider tensor) give the same result as contiguous copies."""
    b = _padded_batch(T=80)
    wide = {k: (torch.stack([v, v], -1).flatten(-2)[..., ::2] if k not in ("lengths",) else v) for k, v in b.items()}
    assert not wide["log_probs"].is_contiguous()
    wide, b = _on(wide, device), _on(b, device)
    lp_s = wide.pop("log_probs").requires_grad_()
    lp_c = b.pop("log_probs").contiguous().requires_grad_()
    kw = dict(beta=0.3, clip_epsilon=0.2, entropy_coef=0.1, estimator="k2", backend=backend)
    out_s = kl_penalty_loss(lp_s, **wide, **kw)
    out_c = kl_penalty_loss(lp_c, **b, **kw)
    out_s.loss.backward(), out_c.loss.backward()
    for x, y in zip(out_s, out_c):
        torch.testing.assert_close(x, y, rtol=0, atol=0)
    torch.testing.assert_close(lp_s.grad, lp_c.grad, rtol=0, atol=0)


def check_negative_bit(backend, device="cpu"):
    """Inputs carrying torch's negative bit (``z.conj().imag``) give exactly the loss, parts and
    gradients of plain tensors with the same values, for a summed aggregation (the CPU folds it
    into the kernel, launched directly), per-token outputs and an upstream gradient with the bit."""
    from test_kl_reward_fused import negated_view
    b = _on(_padded_batch(T=41, seed=2), device)
    beta = torch.rand(5, device=device)
    upstream = torch.linspace(-1, 1, 5 * 41, device=device).reshape(5, 41)
    for aggregation in ("token-mean", "none"):
        results = []
        for view in ((lambda x: x), negated_view):
            leaves = [b["log_probs"].clone().requires_grad_(), b["entropy"].clone().requires_grad_()]
            data = {k: (view(v) if v.is_floating_point() else v) for k, v in b.items()
                    if k not in ("log_probs", "entropy")}
            out = kl_penalty_loss(view(leaves[0]), entropy=view(leaves[1]), beta=view(beta), clip_epsilon=0.2,
                                  entropy_coef=0.1, estimator="k3", aggregation=aggregation, backend=backend, **data)
            out.loss.backward(view(upstream.clone()) if aggregation == "none" else None, inputs=leaves)
            results.append([*out, *(leaf.grad for leaf in leaves)])
        for i, (x, y) in enumerate(zip(*results)):
            assert torch.equal(x, y), f"{aggregation}: output {i}"


def check_long_row(backend, device="cpu", thread_counts=(None, None), n=70001):
    """One row of ``n`` tokens (70001: beyond 65535; several tiles) next to short and empty ones:
    float64-accurate sums against the reference, and bitwise identical results over repeated calls
    (and over torch's thread counts in ``thread_counts``; None: unchanged)."""
    g = torch.Generator().manual_seed(3)
    lengths = [n, 1, 0, 4097]
    N = sum(lengths)
    lp = -torch.rand(N, generator=g) * 5
    kw = dict(old_log_probs=lp + torch.randn(N, generator=g) * 0.2, advantages=torch.randn(N, generator=g),
              offsets=torch.tensor([0, n, n + 1, n + 1, N]), beta=0.05, estimator="k3", clip_epsilon=0.2,
              aggregation="seq-mean-token-mean")
    ref = kl_penalty_loss(lp.double(), **{k: (v.double() if isinstance(v, torch.Tensor) and v.is_floating_point()
                                              else v) for k, v in kw.items()}, backend="torch")
    runs = []
    threads = torch.get_num_threads()
    try:
        for t in thread_counts:
            torch.set_num_threads(t or threads)
            x = lp.to(device).requires_grad_()
            out = kl_penalty_loss(x, **_on(kw, device), backend=backend)
            out.loss.backward()
            runs.append((out, x.grad))
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(runs[0][0].loss.double().cpu(), ref.loss, rtol=1e-5, atol=1e-6)
    for out, grad in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(out, runs[0][0]))
        assert torch.equal(grad, runs[0][1])


def check_inputs_never_modified(backend, device="cpu"):
    b = _on(_padded_batch(), device)
    copies = {k: v.clone() for k, v in b.items()}
    b["log_probs"].requires_grad_()
    kl_penalty_loss(**b, beta=0.5, clip_epsilon=0.2, backend=backend).loss.backward()
    for k, v in copies.items():
        assert torch.equal(b[k].detach(), v), f"{k} was modified"


@pytest.mark.parametrize("backend", FUSED)
def test_non_contiguous_inputs(backend):
    check_non_contiguous(backend)


@pytest.mark.parametrize("backend", FUSED)
def test_negative_bit_inputs(backend):
    check_negative_bit(backend)


@pytest.mark.parametrize("backend", FUSED)
def test_long_row_and_determinism(backend):
    check_long_row(backend, thread_counts=(1, None, 1))


@pytest.mark.parametrize("backend", ["torch"] + FUSED)
def test_inputs_never_modified(backend):
    check_inputs_never_modified(backend)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("aggregation", ["token-mean", "token-mean-n", "seq-mean-token-sum", "sum"])
def test_folded_aggregation_matches_the_tensor_path(aggregation, layout, dtype, monkeypatch):
    """Eager CPU calls with a one-weight aggregation fold it into the kernel (the batch totals, and a
    backward that scales the gradient buffer by ``g_loss * w``). Against the tensor path of the same
    kernel (forced): equal values and parts, and equal gradients of log_probs and entropy under a
    non-unit upstream gradient (the folded backward reads it as a float)."""
    from kl_kernels.kl_penalty import aggregate as agg
    from kl_kernels.kl_penalty import api

    b = _padded_batch(dtype=dtype)
    if layout == "packed":
        lengths = b.pop("lengths")
        keep = torch.arange(b["mask"].shape[1]) >= b["mask"].shape[1] - lengths[:, None]  # left padding
        b = {k: v[keep] for k, v in b.items()}
        b["offsets"] = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    extra = dict(aggregation="token-mean", num_global_tokens=500) if aggregation == "token-mean-n" else dict(
        aggregation=aggregation)
    kw = dict(beta=torch.tensor(0.3), clip_epsilon=(0.2, 0.28), entropy_coef=0.05, estimator="k3", backend="cpu",
              **extra)
    calls, folded_run = [], api.run_fused_aggregated
    monkeypatch.setattr(api, "run_fused_aggregated", lambda *a: calls.append(1) or folded_run(*a))

    def run():
        lp = b["log_probs"].clone().requires_grad_()
        ent = b["entropy"].clone().requires_grad_()
        rest = {k: v for k, v in b.items() if k not in ("log_probs", "entropy")}
        out = kl_penalty_loss(lp, **rest, entropy=ent, **kw)
        (-2.5 * out.loss).backward()
        return out, lp.grad, ent.grad

    folded = run()
    assert calls, "an eager CPU call with a one-weight aggregation takes the folded path"
    with monkeypatch.context() as m:
        m.setattr(agg, "_ON_HOST", ())
        tensor_path = run()
    assert len(calls) == 1
    got, want = folded[0], tensor_path[0]
    assert got.loss.requires_grad and not any(t.requires_grad for t in got[1:])
    for name in ("seq_num_tokens", "sequence_stats"):  # the same kernel's per-sequence outputs
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    for name in got._fields[:-2]:
        x, y = getattr(got, name), getattr(want, name)
        assert x.dtype == y.dtype and x.shape == y.shape == (), name
        # per-sequence sums in float64 (folded) vs rounded to float32 first (tensor path)
        torch.testing.assert_close(x.detach(), y.detach(), rtol=1e-6, atol=1e-7, msg=name)
    for x, y in zip(folded[1:], tensor_path[1:]):
        assert x.dtype == dtype
        torch.testing.assert_close(x, y, rtol=0, atol=0)


@pytest.mark.parametrize("backend", FUSED)
def test_folded_aggregation_without_grad_and_loss_unused(backend):
    """The folded path (the CPU kernel's host totals, the CUDA kernels' device aggregation) under
    no_grad, and a loss that gets no gradient (only a part is used)."""
    b = _padded_batch()
    lp = b.pop("log_probs").requires_grad_()
    with torch.no_grad():
        a = kl_penalty_loss(lp, **b, beta=0.1, backend=backend)
    assert not a.loss.requires_grad
    c = kl_penalty_loss(lp, **b, beta=0.1, backend=backend)
    torch.testing.assert_close(a.loss, c.loss.detach(), rtol=0, atol=0)
    (c.loss * 0 + c.kl_mean).backward()
    assert torch.equal(lp.grad, torch.zeros_like(lp))


def _backward_kernel_calls(monkeypatch) -> list:
    """Records each run of the CPU backward kernel of the folded path (launch.backward_with_args)."""
    from kl_kernels.kl_penalty import launch
    calls, real = [], launch.backward_with_args
    monkeypatch.setattr(launch, "backward_with_args", lambda *a: calls.append(1) or real(*a))
    return calls


def _counted(b) -> torch.Tensor:
    """Which tokens of _padded_batch's left-padded batch count (valid and in the mask)."""
    T = b["mask"].shape[1]
    return b["mask"] & (torch.arange(T) >= T - b["lengths"][:, None])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("upstream", [1.0, 0.37, 0.0, -2.0, float("inf")], ids=str)
def test_folded_backward_hands_over_its_buffer(upstream, dtype, monkeypatch):
    """The folded backward returns its float32 gradient buffer scaled in place (no backward kernel,
    no second buffer) when that gives the kernel's bits: float32 log-probs and a finite upstream
    gradient with a + sign. Against the backward kernel (forced by retain_graph, which keeps the
    buffer for a later backward): bit for bit equal gradients, +0 (never -0) at every non-counted
    token, and the kernel runs exactly where it must."""
    b = _padded_batch(dtype=dtype)
    del b["entropy"]  # an entropy gradient always takes the kernel
    # KL to the old policy with k1: the math on a non-counted token's zeroed inputs has gradient
    # -beta there, so a buffer masked by a 0/1 product would hold -0.
    del b["ref_log_probs"]
    kw = dict(beta=0.3, clip_epsilon=0.2, estimator="k1", backend="cpu")
    calls = _backward_kernel_calls(monkeypatch)

    def grad(retain: bool) -> torch.Tensor:
        lp = b["log_probs"].clone().requires_grad_()
        out = kl_penalty_loss(lp, **{k: v for k, v in b.items() if k != "log_probs"}, **kw)
        out.loss.backward(torch.tensor(upstream), retain_graph=retain)
        return lp.grad

    in_place, kernel = grad(False), grad(True)
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    assert torch.equal(in_place.view(bits), kernel.view(bits))
    assert torch.equal(kernel.view(bits)[~_counted(b)], torch.zeros_like(kernel.view(bits)[~_counted(b)]))
    hands_over = dtype == torch.float32 and 0.0 <= upstream < float("inf")
    assert len(calls) == (1 if hands_over else 2)


def test_folded_backward_twice_and_under_saved_tensor_hooks(monkeypatch):
    """A retained graph backpropagated twice: the first backward leaves the saved buffer as it was
    (the kernel runs), the second may then scale it, and the accumulated gradient is twice one
    backward's. Under saved-tensor hooks that keep what they are handed, the buffer they hold is
    never written (the kernel runs)."""
    b = _padded_batch()
    rest = {k: v for k, v in b.items() if k not in ("log_probs", "entropy")}
    calls = _backward_kernel_calls(monkeypatch)
    lp = b["log_probs"].clone().requires_grad_()
    kl_penalty_loss(lp, **rest, beta=0.1, backend="cpu").loss.backward()
    once = lp.grad.clone()
    assert not calls

    lp.grad = None
    out = kl_penalty_loss(lp, **rest, beta=0.1, backend="cpu")
    out.loss.backward(retain_graph=True)
    out.loss.backward()
    assert torch.equal(lp.grad, 2 * once) and len(calls) == 1

    kept = []
    lp.grad = None
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
        out = kl_penalty_loss(lp, **rest, beta=0.1, backend="cpu")
    before = [t.clone() for t in kept]
    out.loss.backward()
    assert torch.equal(lp.grad, once) and len(calls) == 2
    assert kept and all(torch.equal(t, u) for t, u in zip(kept, before))


def check_nan_at_a_counted_token(backend, device="cpu"):
    """A NaN input at a counted token makes the loss NaN, as in the torch reference (the kernels'
    exp/expm1 must not turn it into a number), and the gradient is NaN exactly where the reference's
    is (a NaN old log-prob: the objective's gradient is an exact 0 there, torch.clamp's mask), equal
    elsewhere."""
    for where in ("log_probs", "old_log_probs", "ref_log_probs"):
        b = _padded_batch()
        b["mask"][:] = True
        b[where][0, -1] = float("nan")  # lengths[0] = T: a counted token under left padding
        runs = []
        for name, dev in (("torch", "cpu"), (backend, device)):
            lp = b["log_probs"].clone().to(dev).requires_grad_()
            out = kl_penalty_loss(lp, **_on({k: v for k, v in b.items() if k != "log_probs"}, dev), beta=0.2,
                                  estimator="k3", clip_epsilon=0.2, entropy_coef=0.01, backend=name)
            out.loss.backward()
            runs.append((out.loss.cpu(), lp.grad.cpu()))
        (want, want_g), (got, got_g) = runs
        assert got.isnan() and want.isnan(), where
        assert torch.equal(got_g.isnan(), want_g.isnan()), where
        ok = ~want_g.isnan()
        torch.testing.assert_close(got_g[ok], want_g[ok], rtol=1e-5, atol=1e-7, msg=where)


@pytest.mark.parametrize("backend", FUSED)
def test_nan_at_a_counted_token(backend):
    check_nan_at_a_counted_token(backend)


# --------------------------------------------------------------------------- data parallel


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# One process group of 2 ranks runs every (aggregation, backend) case in turn, in the same order on
# both ranks (so their collectives pair up): starting 2 processes per case cost ~9 s a case.
WORKER = textwrap.dedent("""
    import os, sys, torch, torch.distributed as dist
    from kl_kernels import kl_penalty_loss
    rank, world, cases = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3].split(",")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    data = torch.load(sys.argv[4])
    mine = data["shards"][rank]
    for case in cases:
        agg, backend = case.split("/")
        lp = mine["log_probs"].clone().requires_grad_()
        kw = {k: v for k, v in mine.items() if k != "log_probs"}
        if agg == "token-mean-n":  # the explicit global count instead of the process group
            out = kl_penalty_loss(lp, **kw, aggregation="token-mean", num_global_tokens=data["n_global"],
                                  backend=backend)
        elif agg == "split":  # each term its own weights, B the non-empty sequences of both ranks
            out = kl_penalty_loss(lp, **kw, aggregation="seq-mean-token-mean", kl_aggregation="token-mean",
                                  num_sequences="nonempty", process_group=dist.group.WORLD, backend=backend)
        else:
            out = kl_penalty_loss(lp, **kw, aggregation=agg, process_group=dist.group.WORLD, backend=backend)
        out.loss.backward()
        total = out.loss.detach().clone()
        dist.all_reduce(total)
        torch.save(dict(loss_sum=total, grad=lp.grad, kl_mean=out.kl_mean, num_tokens=out.num_tokens,
                        clip_low_fraction=out.clip_low_fraction, clip_high_fraction=out.clip_high_fraction,
                        entropy_mean=out.entropy_mean, seq_num_tokens=out.seq_num_tokens,
                        seq_clipped_low=out.seq_clipped_low, seq_clipped_high=out.seq_clipped_high),
                   os.path.join(sys.argv[5], f"rank{rank}-{agg}-{backend}.pt"))
    dist.destroy_process_group()
""")

DP_AGGREGATIONS = ["token-mean", "token-mean-n", "seq-mean-token-mean", "seq-mean-token-sum", "split"]
DP_BACKENDS = ["torch"] + FUSED


def _backend_runs(backend: str) -> bool:
    from kl_kernels.kl_penalty.backends import REGISTRY

    return not next(b for b in REGISTRY if b.name == backend).unavailable_reasons()


def _dp_shards():
    g = torch.Generator().manual_seed(7)
    T = 23
    lengths = [[23, 5, 0], [1, 17]]  # different sizes and token counts on the two ranks
    shards = []
    for lens in lengths:
        B = len(lens)
        lp = -torch.rand(B, T, generator=g) * 3
        shards.append(dict(log_probs=lp, old_log_probs=lp + torch.randn(B, T, generator=g) * 0.2,
                           advantages=torch.randn(B, generator=g), mask=torch.rand(B, T, generator=g) < 0.7,
                           lengths=torch.tensor(lens), beta=0.1, estimator="k3", clip_epsilon=0.2,
                           entropy=torch.rand(B, T, generator=g) * 2))
    return shards


def _dp_union_loss(shards, aggregation, backend):
    """The loss of the union batch in one process, and the log-probs whose gradient it filled."""
    union = {k: (torch.cat([s[k] for s in shards]) if isinstance(shards[0][k], torch.Tensor) else shards[0][k])
             for k in shards[0]}
    lp_u = union.pop("log_probs").clone().requires_grad_()
    if aggregation == "split":
        want = kl_penalty_loss(lp_u, **union, aggregation="seq-mean-token-mean", kl_aggregation="token-mean",
                               num_sequences="nonempty", backend=backend)
    else:
        agg = "token-mean" if aggregation == "token-mean-n" else aggregation
        want = kl_penalty_loss(lp_u, **union, aggregation=agg, backend=backend)
    want.loss.backward()
    return want, lp_u


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory):
    """Every case run once by 2 processes on gloo; the runnable backends only (the others' tests skip)."""
    out = tmp_path_factory.mktemp("ranks")
    shards = _dp_shards()
    names = [b.values[0] if hasattr(b, "values") else b for b in DP_BACKENDS]
    cases = [f"{agg}/{b}" for b in names if _backend_runs(b) for agg in DP_AGGREGATIONS]
    n_global = int(_dp_union_loss(shards, "token-mean", "torch")[0].num_tokens)  # the same for every case
    torch.save(dict(shards=shards, n_global=n_global), out / "data.pt")
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), OMP_NUM_THREADS="1",
               PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(r), "2", ",".join(cases), str(out / "data.pt"),
                               str(out)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for r in range(2)]
    logs = []
    for p in procs:
        log, _ = p.communicate(timeout=600)
        logs.append((p.returncode, log.decode()))
    return out, shards, logs


@pytest.mark.slow
@pytest.mark.parametrize("backend", DP_BACKENDS)
@pytest.mark.parametrize("aggregation", DP_AGGREGATIONS)
def test_two_ranks_equal_the_union(aggregation, backend, two_rank_runs):
    """2 processes on gloo: the ranks' losses sum to the loss of the union batch, each rank's gradient
    is the union's gradient on its tokens, and process-group diagnostics are the union's."""
    out, shards, logs = two_rank_runs
    for code, log in logs:
        assert code == 0, log
    want, lp_u = _dp_union_loss(shards, aggregation, backend)
    n_global = int(want.num_tokens)
    ranks = [torch.load(out / f"rank{r}-{aggregation}-{backend}.pt") for r in range(2)]
    torch.testing.assert_close(ranks[0]["loss_sum"], want.loss.detach(), rtol=1e-6, atol=1e-7)
    grad = torch.cat([r["grad"] for r in ranks])
    torch.testing.assert_close(grad, lp_u.grad, rtol=1e-6, atol=1e-8)
    if aggregation != "token-mean-n":
        for r in ranks:
            assert int(r["num_tokens"]) == n_global
            for name in ("kl_mean", "clip_low_fraction", "clip_high_fraction", "entropy_mean"):
                torch.testing.assert_close(r[name], getattr(want, name), rtol=1e-6, atol=1e-7, msg=name)
        assert want.clip_low_fraction > 0 and want.clip_high_fraction > 0
    for name in ("seq_num_tokens", "seq_clipped_low", "seq_clipped_high"):  # each rank's own sequences
        assert torch.equal(torch.cat([r[name] for r in ranks]), getattr(want, name)), name


@pytest.mark.parametrize("layout", ["packed", "padded"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cpu_sequence_log_ratio_pre_pass(layout, dtype):
    """GSPO's CPU pre-pass (``kl_penalty_sequence_log_ratio``) against the reference's torch ops: long rows
    that span several tiles (combined in tile order), an empty row, a row with no counted token (0), a
    strided input, and a NaN at a counted token that poisons its own sequence only."""
    from kl_kernels.kl_penalty import launch
    from kl_kernels.kl_penalty.problem import build_problem
    from kl_kernels.kl_penalty.reference import sequence_log_ratio

    g = torch.Generator().manual_seed(3)
    lengths = [20000, 0, 7, 13000, 5, 1]
    B, T = len(lengths), max(lengths)
    lp = (-torch.rand(B, T, generator=g) * 4).to(dtype)
    old = (lp.double() + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)).to(dtype)
    mask = torch.rand(B, T, generator=g) < 0.7
    mask[4] = False  # row 4: nothing counts
    lp[2, 3] = float("nan")
    mask[2, 3] = True
    wide = torch.zeros(B, 2 * T, dtype=dtype)
    wide[:, ::2] = old
    old_strided = wide[:, ::2]  # column stride 2
    if layout == "padded":
        kw = dict(lengths=torch.tensor(lengths), padding_side="right")
        args = (lp, old_strided, mask)
    else:
        keep = torch.arange(T).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)
        offsets = torch.tensor([0] + lengths).cumsum(0)
        kw = dict(offsets=offsets)
        args = (lp[keep], old[keep], mask[keep])
    p, _, _ = build_problem(args[0], args[1], torch.zeros(B, 1), ref_log_probs=None, beta=0.0, estimator="k1",
                            mask=args[2], padding_side=kw.get("padding_side", "left"), clip_epsilon=None,
                            entropy=None, entropy_coef=0.0, aggregation="sum", norm_length=None,
                            offsets=kw.get("offsets"), lengths=kw.get("lengths"), importance_sampling_level="sequence")
    got = launch.sequence_log_ratio(p.log_probs, p.old_log_probs, p.mask, p.offsets, p.lengths,
                                    0 if layout == "packed" else 1, p.padding_side == "left")
    want = sequence_log_ratio(p)
    assert got.dtype == torch.float32 and got.shape == (B,)
    assert torch.isnan(got[2]) and torch.isnan(want[2])
    assert got[1] == 0 and got[4] == 0
    keep = torch.tensor([True, True, False, True, True, True])
    torch.testing.assert_close(got[keep], want[keep].float(), rtol=1e-6, atol=1e-7)
