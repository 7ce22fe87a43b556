"""The CUDA C++ backend of kl_reward on a GPU: oracle, gradients, sizes, streams, graphs, syncs.

Every test here carries the ``cuda`` marker and skips without a GPU (conftest.py). The semantic
checks are the shared ones (``batches.check``, ``check_gradients``) with inputs on the GPU;
what is CUDA-specific is below them: the caller's stream, CUDA graph capture, no host syncs.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from batches import LAYOUTS, Case, backend_accepts, build, check, to_device
from kl_kernels import BackendUnavailableError, kl_reward
from strategies import cases
from test_kl_reward_fused import _batch, check_million_token_row, check_nan_through_the_clamps, check_negative_bit
from test_kl_reward_grad import GRAD_LAYOUTS, check_gradients
from test_kl_reward_oracle import _auto_is_ambiguous, _long_case

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("layout", LAYOUTS)
@given(case=cases())
@settings(max_examples=30)
def test_matches_oracle(layout, case):
    if (layout == "nested_strided" and case.batch == 0) or _auto_is_ambiguous(case, layout):
        return
    if not backend_accepts(case, "cuda"):
        with pytest.raises(BackendUnavailableError, match="dtype"):
            kl_reward(**to_device(build(case, layout).kwargs, "cuda"), backend="cuda")
        return
    check(case, layout, device="cuda", backend="cuda")


@pytest.mark.parametrize("layout", GRAD_LAYOUTS)
@given(case=cases(dtypes=(torch.float32, torch.bfloat16, torch.float16)), seed=st.integers(0, 2**31 - 1))
@settings(max_examples=20)
def test_gradients_match_oracle(layout, case, seed):
    check_gradients(case, layout, "cuda", seed, device="cuda")


@pytest.mark.parametrize("layout", ["packed", "padded_left", "padded_right", "nested_jagged"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_row_longer_than_a_grid_dimension(layout, dtype):
    check(_long_case(70001, dtype), layout, device="cuda", backend="cuda")


@pytest.mark.parametrize("layout", [x for x in LAYOUTS if x != "nested_strided"])
def test_empty_batch(layout):
    out = kl_reward(**to_device(build(Case(lp=[], ref=[]), layout).kwargs, "cuda"), backend="cuda")
    assert out.kl_sum.shape == (0,) and out.count.shape == (0,)


@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_a_row_of_a_million_tokens(layout):
    check_million_token_row(layout, "cuda", "cuda")


def test_deterministic_and_matches_the_cpu_kernel():
    lp, ref, mask, offsets, _ = _batch("cuda", n_seq=300, max_len=3000)
    reward = torch.ones(300, device="cuda")
    kw = dict(mask=mask, offsets=offsets, estimator="k3", return_ref=True, reward_placement="last")
    want = kl_reward(lp, ref, reward, backend="cuda", **kw)
    for _ in range(3):
        for a, b in zip(want, kl_reward(lp, ref, reward, backend="cuda", **kw)):
            assert torch.equal(a, b)
    cpu = kl_reward(*to_device((lp, ref, reward), "cpu"), backend="cpu", **to_device(kw, "cpu"))
    for a, b in zip(want, cpu):
        torch.testing.assert_close(a.cpu(), b, rtol=2e-6, atol=1e-5)


@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_non_contiguous_and_misaligned_inputs(layout):
    """Strided views and a 4-byte offset (no 16-byte vector loads) match contiguous inputs."""
    lp, ref, mask, offsets, lengths = _batch("cuda", n_seq=20, max_len=300)
    if layout == "packed":
        views = [(lambda x: torch.stack([x, x], dim=1).reshape(-1)[::2]),       # stride 2
                 (lambda x: torch.cat([x[:1], x])[1:])]                           # misaligned by one element
        kw_of = lambda f: dict(mask=f(mask), offsets=offsets)  # noqa: E731
    else:
        from kl_kernels import ragged
        width = int(lengths.max())
        pad = lambda x: ragged.to_padded(x, offsets, padding_side="right", width=width)  # noqa: E731
        views = [(lambda x: pad(x).t().contiguous().t()), (lambda x: torch.cat([pad(x)[:, :1], pad(x)], 1)[:, 1:])]
        kw_of = lambda f: dict(mask=f(mask), lengths=lengths, padding_side="right")  # noqa: E731
    for f in views:
        got = kl_reward(f(lp), f(ref), estimator="k3", return_ref=True, backend="cuda", **kw_of(f))
        base = (lambda x: x) if layout == "packed" else pad
        want = kl_reward(base(lp), base(ref), estimator="k3", return_ref=True, backend="cuda",
                         **kw_of(base))
        for name, a, b in zip(("kl", "reward", "ref", "kl_sum", "count"), got, want):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=name)


@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_negative_bit_inputs(layout):
    check_negative_bit(layout, "cuda", "cuda")


def test_runs_on_the_current_stream_without_host_sync():
    lp, ref, mask, offsets, _ = _batch("cuda", n_seq=50, max_len=500)
    score = torch.randn(50, device="cuda")
    want = kl_reward(lp, ref, score, mask=mask, offsets=offsets, estimator="k3", reward_placement="sequence",
                     backend="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    torch.cuda.set_sync_debug_mode("error")  # any host synchronization raises
    try:
        with torch.cuda.stream(side):
            got = kl_reward(lp, ref, score, mask=mask, offsets=offsets, estimator="k3",
                            reward_placement="sequence", backend="cuda")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.current_stream().wait_stream(side)
    for a, b in zip(got, want):
        assert (a is None and b is None) or torch.equal(a, b)  # ref_log_probs is None without return_ref


def test_cuda_graph_capture_and_replay():
    lp, ref, mask, offsets, _ = _batch("cuda", n_seq=30, max_len=400)
    coef = torch.tensor(0.1, device="cuda")
    score = torch.randn(30, device="cuda")
    fn = lambda: kl_reward(lp, ref, score, coef=coef, mask=mask, offsets=offsets, estimator="k3",  # noqa: E731
                           reward_placement="last", backend="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()  # warm up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fn()
    for value in (0.1, 0.7):
        coef.fill_(value)
        lp.add_(0.01)
        graph.replay()
        torch.cuda.synchronize()
        for a, b in zip(captured, fn()):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_auto_picks_the_cuda_kernel_only_after_its_self_check():
    """On a GPU "auto" runs the first-use self-check (kl_kernels/selfcheck.py) before taking the CUDA kernel."""
    from kl_kernels import selfcheck
    from kl_kernels.backends import select
    from kl_kernels.kl_reward import backends
    from kl_kernels.kl_reward.problem import build_problem
    selfcheck.clear()
    lp, ref, _, offsets, _ = _batch("cuda", n_seq=3, max_len=20)
    problem, _ = build_problem(lp, ref, None, coef=0.1, estimator="k1", mask=None, offsets=offsets, lengths=None,
                               padding_side="left", prompt_lens=None, reward_placement="auto", clamp_input=None,
                               clamp_output=None, return_ref=False, detach=True)
    chosen = select(backends.REGISTRY, "auto", op="kl_reward", problem=problem)
    assert any(key[:2] == ("kl_reward", "cuda") for key in selfcheck.verdicts())
    assert chosen.name == "cuda" and selfcheck.passed("kl_reward", "cuda", lp.device), selfcheck.verdicts()


def test_nan_through_the_clamps():
    check_nan_through_the_clamps("cuda", "cuda")
