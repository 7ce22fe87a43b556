"""The CUDA kernels under host emulation (the cuda-emulated backend, kl_kernels._cuda_emu).

What the shared oracle/gradient/placement/determinism tests (parametrized over cuda-emulated) do not
say on their own: bugs the emulation found in the CUDA kernels (each test here failed before its fix),
error reporting of launches, that outputs and workspaces are poisoned before every kernel, and the
coverage sweep over every kernel variant (op x layout x estimator x placement x dtype x coefficient
kind x vector/strided path) against the torch reference.
"""

from __future__ import annotations

import itertools
import subprocess
import sys
import textwrap

import pytest
import torch

from conftest import REPO
from kl_kernels import kl_penalty_loss, kl_reward

pytestmark = pytest.mark.cuda_emulated
EMU = "cuda-emulated"


def _emu():
    from kl_kernels import _extensions

    return _extensions.load("_cuda_emu")[0]


# ------------------------------------------------------------------ NaN/inf stay in their sequence


def _tile_batch(kind: str, bad_at: int):
    """Five sequences in one 2048-token tile, every token counted; a bad value goes into sequence 0 at
    position ``bad_at`` of the reference log-probs."""
    g = torch.Generator().manual_seed(3)
    lengths = [7, 40, 1, 300, 13]
    lp = [-torch.rand(n, generator=g) * 3 for n in lengths]
    ref = [x + torch.randn(len(x), generator=g) * 0.2 for x in lp]
    if kind == "packed":
        return torch.cat(lp), torch.cat(ref), {"offsets": torch.tensor([0, *itertools.accumulate(lengths)])}
    width = max(lengths)

    def pad(parts):
        return torch.stack([torch.cat([torch.zeros(width - len(p)), p]) for p in parts])

    return pad(lp), pad(ref), {"lengths": torch.tensor(lengths), "padding_side": "left"}


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("kind", ["packed", "padded"])
def test_kl_reward_non_finite_token_stays_in_its_sequence(kind, bad):
    """A NaN/inf reference log-prob at a counted token of sequence 0 makes its kl_sum non-finite and
    never those of the later sequences of the tile (the kernel once took per-sequence sums as
    differences of tile-wide prefix sums, which carried the NaN/inf into every later sequence)."""
    lp, ref, geo = _tile_batch(kind, 0)
    clean = kl_reward(lp, ref, estimator="k1", backend=EMU, **geo)
    ref.view(-1)[ref.shape[-1] - 7 if kind == "padded" else 0] = bad  # sequence 0's first token
    dirty = kl_reward(lp, ref, estimator="k1", backend=EMU, **geo)
    assert not torch.isfinite(dirty.kl_sum[0])
    torch.testing.assert_close(dirty.kl_sum[1:], clean.kl_sum[1:], rtol=0, atol=0)
    assert torch.equal(dirty.count, clean.count)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("kind", ["packed", "padded"])
def test_kl_penalty_non_finite_token_stays_in_its_sequence(kind, bad):
    """The same for kl_penalty_loss's six per-sequence sums (the forward kernel's outputs)."""
    from kl_kernels.kl_penalty import launch

    lp, ref, geo = _tile_batch(kind, 0)
    layout = 0 if kind == "packed" else 1
    entropy = torch.rand(lp.shape, generator=torch.Generator().manual_seed(0))

    def run():
        return launch.emulated.forward(lp, lp + 0.05, ref, torch.ones_like(lp), entropy, None,
                                       geo.get("offsets"), geo.get("lengths"), None, 0.1, False, layout, True, 3,
                                       False, 0.8, 1.2, 0.01, False)

    clean = run()
    ref.view(-1)[ref.shape[-1] - 7 if kind == "padded" else 0] = bad
    dirty = run()
    assert not torch.isfinite(dirty[0][0])
    for name, want, got in zip(("seq_loss", "stats", "count"), clean[:3], dirty[:3]):
        torch.testing.assert_close(got[1:], want[1:], rtol=0, atol=0, msg=name)


# ------------------------------------------------------------------ out-of-bounds read of coef


GUARDED_COEF = textwrap.dedent("""
    import ctypes, mmap, sys, torch
    from kl_kernels import kl_reward
    page = mmap.PAGESIZE
    buf = mmap.mmap(-1, 2 * page)
    base = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    assert libc.mprotect(base + page, page, 0) == 0  # PROT_NONE: any read past coef faults
    B, T = 3, 5  # 15 elements: threads 2.. of the one tile start past the end (seq = i0 / T >= B)
    coef = torch.frombuffer(buf, dtype=torch.float32, count=B, offset=page - 4 * B)
    coef[:] = torch.tensor([0.1, 0.2, 0.3])
    g = torch.Generator().manual_seed(0)
    lp, ref = -torch.rand(B, T, generator=g), -torch.rand(B, T, generator=g)
    for placement, reward in (("token", torch.ones(B, T)), ("sequence", torch.ones(B)), ("last", torch.ones(B))):
        out = kl_reward(lp, ref, reward, coef=coef, lengths=torch.tensor([5, 2, 0]), reward_placement=placement,
                        backend=sys.argv[1])
        want = kl_reward(lp, ref, reward, coef=coef.clone(), lengths=torch.tensor([5, 2, 0]),
                         reward_placement=placement, backend="torch")
        torch.testing.assert_close(out.reward, want.reward)
    print("ok")
""")


def test_padded_per_sequence_coef_is_never_read_past_the_batch():
    """A thread wholly past the end of a padded batch computed seq = i0 / T >= B and read coef[seq]
    (found by AddressSanitizer on the emulated build). With coef ending right before a PROT_NONE page,
    such a read faults: the run must not."""
    proc = subprocess.run([sys.executable, "-c", GUARDED_COEF, EMU], capture_output=True, text=True, timeout=120,
                          cwd=REPO / "tests")
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", (proc.returncode, proc.stdout, proc.stderr[-2000:])


# ------------------------------------------------------------------ launch errors


def test_an_earlier_runtime_error_is_not_blamed_on_a_launch():
    """The kernels report their own launch's error: an error an unrelated runtime call left behind (here
    recorded directly) does not fail a kl_reward / kl_penalty_loss call, and stays for its owner
    (status() once read cudaGetLastError, which returned and cleared it)."""
    emu = _emu()
    lp, ref = -torch.rand(2, 9), -torch.rand(2, 9)
    emu.emu_record_error(101)  # cudaErrorInvalidDevice, e.g. from a cudaSetDevice that failed
    try:
        kl_reward(lp, ref, backend=EMU)
        kl_penalty_loss(lp, lp + 0.1, torch.ones(2), beta=0.1, backend=EMU)
        assert emu.emu_peek_last_error() == 101
    finally:
        emu.emu_get_last_error()


def test_a_failed_launch_raises_once_and_leaves_no_error_behind():
    emu = _emu()
    lp, ref = -torch.rand(2, 9), -torch.rand(2, 9)
    emu.emu_fail_next_launch(701)  # cudaErrorLaunchOutOfResources
    with pytest.raises(RuntimeError, match="kl_reward CUDA kernel launch failed: too many resources"):
        kl_reward(lp, ref, backend=EMU)
    assert emu.emu_peek_last_error() == 0
    kl_reward(lp, ref, backend=EMU)  # the next call is fine
    emu.emu_fail_next_launch(9)
    with pytest.raises(RuntimeError, match="kl_penalty_loss CUDA kernel launch failed: invalid configuration"):
        kl_penalty_loss(lp, lp + 0.1, torch.ones(2), beta=0.1, backend=EMU)
    assert emu.emu_peek_last_error() == 0


# ------------------------------------------------------------------ poisoning, and that the emulation runs


def test_outputs_and_workspace_are_poisoned_before_the_kernels():
    """The emulated entry points fill every output with 0xFF bytes (NaN, count -1) and the workspace
    with a NaN pattern before any kernel runs; seen here through an argument set the kernels refuse
    (code 3: the CPU-only mask_nan), so nothing overwrites the poison."""
    from kl_kernels.kl_reward import launch

    emu = _emu()
    lp, ref = -torch.rand(3, 5), -torch.rand(3, 5)
    args, keep = launch.make_args(emu, log_probs=lp, ref_log_probs=ref, mask=None, offsets=None, lengths=None,
                                  prompt_lens=None, reward=None, coef=None, coef_scalar=1.0, layout=1, left_pad=True,
                                  placement=0, estimator=0, straight_through=False, clamp=[-1e9, 1e9, -1e9, 1e9])
    kl, reward, ref_out, kl_sum, count = (torch.zeros(3, 5), torch.zeros(3, 5), torch.zeros(3, 5), torch.zeros(3),
                                          torch.zeros(3, dtype=torch.int64))
    args.kl, args.reward_out, args.ref_out = kl.data_ptr(), reward.data_ptr(), ref_out.data_ptr()
    args.kl_sum, args.count = kl_sum.data_ptr(), count.data_ptr()
    args.mask_nan = 1
    workspace = torch.zeros(emu.kl_reward_workspace_bytes(args), dtype=torch.uint8)
    assert emu.kl_reward_forward(args, workspace.data_ptr(), 0) == 3
    for t in (kl, reward, ref_out, kl_sum):
        assert t.isnan().all()
    assert (count == -1).all()
    assert workspace.view(torch.float64).isnan().all() and (workspace.view(torch.int64) > 2**62).all()


def test_the_backend_runs_the_emulated_kernels():
    emu = _emu()
    before = emu.emu_counters()
    out = kl_reward(-torch.rand(3000), -torch.rand(3000), offsets=torch.tensor([0, 2500, 3000]), backend=EMU)
    after = emu.emu_counters()
    assert after["launches"] == before["launches"] + 2  # forward tiles, combine
    assert after["blocks"] == before["blocks"] + 2 + 1  # two 2048-token tiles, one combine block
    assert after["barriers"] > before["barriers"] and after["shuffles"] > before["shuffles"]
    assert out.count.tolist() == [2500, 500]


@pytest.mark.parametrize("softcap", [None, 30.0])
def test_row_kernel_outputs_are_poisoned_before_the_kernels(softcap):
    """The row kernels' emulated entry points (token_logprobs, full_kl) poison their outputs too: seen through
    a dtype code the kernels refuse (1), so nothing overwrites the poison; the gradient rows of a slab layout
    are poisoned row by row (the slab's gap keeps its value), and inplace_backward's target, the logits, not;
    with and without a soft cap (the capped kernels are entry points of their own)."""
    from kl_kernels.full_kl import launch as fkl_launch
    from kl_kernels.token_logprobs import launch as tlp_launch

    emu = _emu()
    x, r = torch.randn(2, 4, 6), torch.randn(2, 4, 6)
    labels, counted = torch.zeros(2, 3, dtype=torch.int64), torch.ones(2, 3, dtype=torch.bool)
    a, _keep = tlp_launch._args(emu, x[:, :-1], labels, counted, 1.0, softcap)
    outs = [torch.zeros(6) for _ in range(3)]
    a.log_probs, a.lse, a.entropy = (t.data_ptr() for t in outs)
    a.dtype = 7  # poisoned as a 2-byte dtype: the gradients below are bf16
    assert emu.token_logprobs_forward(a, 0) == 1
    assert all(t.isnan().all() for t in outs)
    grad = torch.zeros(2, 4, 6, dtype=torch.bfloat16)
    a.grad_logits, a.g_stride_outer, a.g_stride_inner = grad.data_ptr(), grad.stride(0), grad.stride(1)
    assert emu.token_logprobs_backward(a, 0) == 1
    assert grad[:, :-1].isnan().all() and (grad[:, -1] == 0).all()
    a.grad_logits = a.logits  # inplace_backward: the logits are read, not poisoned
    before = x.clone()
    assert emu.token_logprobs_backward(a, 0) == 1 and torch.equal(x, before)

    f, _keep = fkl_launch._args(emu, x, r, torch.ones(2, 4, dtype=torch.bool), 1.0, softcap)
    outs = [torch.zeros(8) for _ in range(3)]
    f.kl, f.lse, f.ref_lse = (t.data_ptr() for t in outs)
    f.dtype = 7
    assert emu.full_kl_forward(f, 0) == 1 and all(t.isnan().all() for t in outs)
    gx, gr = torch.zeros(2, 4, 6, dtype=torch.bfloat16), torch.zeros(2, 4, 6, dtype=torch.bfloat16)
    f.grad_logits, f.g_stride_outer, f.g_stride_inner = gx.data_ptr(), gx.stride(0), gx.stride(1)
    f.grad_ref, f.gr_stride_outer, f.gr_stride_inner = gr.data_ptr(), gr.stride(0), gr.stride(1)
    assert emu.full_kl_backward(f, 0) == 1 and gx.isnan().all() and gr.isnan().all()


def test_row_kernels_take_several_rows_per_block():
    """The emulated row launches cap their grid at 3 blocks (csrc/cuda/rows.cuh), so a batch of 10 rows runs
    the grid-stride loop: each block takes 3-4 rows, reusing its shared memory after the barriers."""
    from kl_kernels import full_kl, token_logprobs

    emu = _emu()
    x = torch.randn(10, 300)
    before = emu.emu_counters()
    out = token_logprobs(x, torch.arange(10), return_entropy=True, backend=EMU)
    after = emu.emu_counters()
    assert after["launches"] == before["launches"] + 1 and after["blocks"] == before["blocks"] + 3
    want = token_logprobs(x, torch.arange(10), return_entropy=True, backend="cpu")
    torch.testing.assert_close(out.log_probs, want.log_probs)
    torch.testing.assert_close(out.entropy, want.entropy)
    torch.testing.assert_close(full_kl(x, x.flip(0), backend=EMU), full_kl(x, x.flip(0), backend="cpu"))


# ------------------------------------------------------------------ edge geometries (also the ASan lane's)

EDGE_LENGTHS = [[0], [1], [0, 1, 0], [3, 5, 2049, 7], [4097, 1]]  # empty, one token, rows over 2-3 tiles


def _storage(n: int, how: str, g) -> torch.Tensor:
    """``n`` log-prob-like values laid out contiguous, misaligned (storage offset 1: no 16-byte vector
    path) or strided (every other element)."""
    base = -3 * torch.rand(2 * n + 2, generator=g)
    return {"contiguous": base[:n].clone(), "misaligned": base[1:n + 1], "strided": base[: 2 * n: 2]}[how]


def _edge_inputs(lengths, kind, how, g):
    b, n = len(lengths), sum(lengths)
    streams = [_storage(n, how, g) for _ in range(4)]  # lp, ref/old, adv, reward
    offsets = torch.tensor([0, *itertools.accumulate(lengths)])
    if kind == "packed":
        return streams, {"offsets": offsets}
    width = max(max(lengths), 1)
    side = "left" if kind == "padded-left" else "right"
    out = []
    for s in streams:
        full = torch.zeros(b, 2 * width)
        x = full[:, ::2] if how == "strided" else full[:, :width]  # strided: column stride 2
        for i, (lo, hi) in enumerate(zip(offsets[:-1].tolist(), offsets[1:].tolist())):
            L = hi - lo
            if L:
                (x[i, width - L:] if side == "left" else x[i, :L]).copy_(s[lo:hi])
        out.append(x)
    return out, {"lengths": torch.tensor(lengths), "padding_side": side}


@pytest.mark.parametrize("how", ["contiguous", "misaligned", "strided"])
@pytest.mark.parametrize("kind", ["packed", "padded-left", "padded-right"])
@pytest.mark.parametrize("lengths", EDGE_LENGTHS, ids=lambda v: "-".join(map(str, v)))
def test_edge_geometries_match_the_reference(lengths, kind, how):
    """Odd sizes, empty and one-token rows, rows over several tiles, per-sequence coefficients,
    misaligned and strided inputs: both ops, forward and gradient, against the torch backend. The
    sanitizer lane (.ci/asan-fuzz) runs this file on an ASan/UBSan build of the emulation."""
    g = torch.Generator().manual_seed(len(lengths) * 100 + sum(lengths))
    (lp, ref, adv, reward), geo = _edge_inputs(lengths, kind, how, g)
    coef = torch.linspace(0.05, 0.3, len(lengths))
    results = {}
    for backend in (EMU, "torch"):
        out = kl_reward(lp, ref, reward, coef=coef, estimator="k3", reward_placement="token", backend=backend, **geo)
        # the backward kernel (vector and strided paths): gradients of the kl and the reward
        lpg, refg = lp.detach().clone().requires_grad_(True), ref.detach().clone().requires_grad_(True)
        if how != "contiguous":  # keep the caller's layout: views of a larger buffer
            lpg, refg = lp.detach().requires_grad_(True), ref.detach().requires_grad_(True)
        o = kl_reward(lpg, refg, reward, coef=coef, estimator="k2", reward_placement="token", detach=False,
                      backend=backend, **geo)
        (o.kl * 0.5 + o.reward * 0.25).sum().backward()
        reward_grads = (lpg.grad, refg.grad)
        x = lp.detach().clone().requires_grad_(True) if how == "contiguous" else lp.detach().requires_grad_(True)
        loss = kl_penalty_loss(x, ref, adv, ref_log_probs=ref - 0.1, beta=coef, clip_epsilon=0.2, backend=backend,
                               **geo)
        loss.loss.backward()
        results[backend] = (out.kl, out.reward, out.kl_sum, out.count, *reward_grads, loss.loss, loss.loss_kl,
                            loss.kl_mean, x.grad)
        x.grad = None
    for name, got, want in zip(("kl", "reward", "kl_sum", "count", "d lp", "d ref", "loss", "loss_kl", "kl_mean",
                                "grad"), results[EMU],
                               results["torch"]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, equal_nan=True, msg=name)


def test_tile_search_over_thousands_of_sequences():
    """The tile kernels find their first and last sequences with a 32-way warp search: batches of
    thousands of mostly empty or short sequences (several search rounds, empty rows at tile edges)
    must land every token in its own sequence, for both ops."""
    g = torch.Generator().manual_seed(11)
    lengths = torch.tensor([0, 0, 1, 2, 5, 0, 3])[torch.randint(0, 7, (3000,), generator=g)]
    lengths[1234] = 2500  # one row across tiles among them
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64)
    offsets[1:] = lengths.cumsum(0)
    n = int(offsets[-1])
    lp, ref, adv = -3 * torch.rand(n, generator=g), -3 * torch.rand(n, generator=g), torch.randn(n, generator=g)
    coef = torch.rand(lengths.numel(), generator=g)
    got, want = (kl_reward(lp, ref, coef=coef, offsets=offsets, estimator="k3", backend=b) for b in (EMU, "torch"))
    for name in ("kl", "reward", "kl_sum", "count"):
        torch.testing.assert_close(getattr(got, name), getattr(want, name), rtol=1e-5, atol=1e-6, msg=name)
    got, want = (kl_penalty_loss(lp, lp + 0.01, adv, ref_log_probs=ref, beta=0.1, offsets=offsets,
                                 aggregation="seq-mean-token-mean", backend=b) for b in (EMU, "torch"))
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got.kl_mean, want.kl_mean, rtol=1e-5, atol=1e-6)


def _long_rows():
    g = torch.Generator().manual_seed(5)
    lengths = torch.randint(0, 9, (300,), generator=g)
    for row, n in ((5, 40_000), (6, 2048 * 17 + 3), (100, 2048 * 16 + 1), (255, 70_001), (290, 36_000)):
        lengths[row] = n
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64)
    offsets[1:] = lengths.cumsum(0)
    n = int(offsets[-1])
    lp, ref, adv = -3 * torch.rand(n, generator=g), -3 * torch.rand(n, generator=g), torch.randn(n, generator=g)
    mask = torch.rand(n, generator=g) < 0.8
    ref[int(offsets[255]) + 50_000] = float("nan")  # a counted token of the 70,001-token row
    mask[int(offsets[255]) + 50_000] = True
    score, coef = torch.randn(lengths.numel(), generator=g), torch.rand(lengths.numel(), generator=g)
    return lp, ref, adv, mask, offsets, score, coef


# (one test per op and aggregation: the slowest emulated calls, which xdist then runs side by side)
@pytest.mark.parametrize("op", ["kl_reward", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_long_rows_are_summed_by_the_block(op):
    """Rows spanning more than 16 tiles (kLongSpan, csrc/cuda/tiles.cuh) are finished by the whole block
    of the combine kernel (strided partial sums, then a fixed tree) rather than one thread's walk:
    several such rows in one block of 256 sequences (adjacent, at thread 255) and in the grid-stride's
    second block, next to rows of exactly 16 and 17 later tiles and short and empty ones; a NaN in one
    long row stays in it. Both ops (the loss in two aggregations) against the torch backend, and bitwise
    the same on a second run."""
    lp, ref, adv, mask, offsets, score, coef = _long_rows()
    if op == "kl_reward":
        for placement in ("last", "last_valid"):
            runs = [kl_reward(lp, ref, score, coef=coef, mask=mask, offsets=offsets, estimator="k3",
                              reward_placement=placement, backend=b) for b in (EMU, EMU, "torch")]
            for name in ("kl", "reward", "kl_sum", "count"):
                torch.testing.assert_close(getattr(runs[0], name), getattr(runs[2], name), rtol=1e-5, atol=1e-6,
                                           equal_nan=True, msg=f"{placement} {name}")
                assert torch.equal(getattr(runs[0], name).nan_to_num(7.0), getattr(runs[1], name).nan_to_num(7.0))
            assert runs[0].kl_sum[255].isnan() and runs[0].kl_sum[torch.arange(300) != 255].isfinite().all()
        return
    clean = ref.nan_to_num(-1.0)  # the loss: per-sequence sums feed every aggregate (a NaN would take them all)
    runs = [kl_penalty_loss(lp, lp + 0.01, adv, ref_log_probs=clean, beta=0.1, mask=mask, offsets=offsets,
                            aggregation=op, backend=b) for b in (EMU, EMU, "torch")]
    for name in ("loss", "loss_kl", "kl_mean", "ratio_mean", "clip_fraction", "num_tokens"):
        got, again, want = (getattr(r, name) for r in runs)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=f"{op} {name}")
        assert torch.equal(got, again)
