"""The CUDA C++ backend of kl_penalty_loss on a GPU: oracle, aggregations, agreement with the CPU
kernel, long rows, determinism, the caller's stream and CUDA graph capture.

Every test here carries the ``cuda`` marker and skips without a GPU (conftest.py).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kl_kernels import kl_penalty_loss
from loss_batches import AGGREGATIONS, LOSS_LAYOUTS, check_loss, loss_cases
from test_kl_penalty_fused import (_padded_batch, check_inputs_never_modified, check_long_row,
                                    check_nan_at_a_counted_token, check_negative_bit,
                                    check_non_contiguous)

pytestmark = pytest.mark.cuda


def test_non_contiguous_inputs():
    check_non_contiguous("cuda", "cuda")


def test_negative_bit_inputs():
    check_negative_bit("cuda", "cuda")


def test_nan_at_a_counted_token():
    check_nan_at_a_counted_token("cuda", "cuda")


def test_long_row_and_inputs_never_modified():
    check_long_row("cuda", "cuda")
    check_inputs_never_modified("cuda", "cuda")


@pytest.mark.parametrize("layout", LOSS_LAYOUTS)
@given(case=loss_cases(dtypes=(torch.float32, torch.bfloat16, torch.float16)))
@settings(max_examples=30)
def test_matches_oracle(case, layout):
    check_loss(case, layout, "cuda", device="cuda", grads=layout != "nested_jagged")


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@given(case=loss_cases(dtypes=(torch.float32,)), layout=st.sampled_from(["packed", "padded_left", "padded_right"]))
@settings(max_examples=10)
def test_every_aggregation(case, layout, aggregation):
    case.aggregation = aggregation
    check_loss(case, layout, "cuda", device="cuda")


def test_same_as_cpu_kernel():
    b = _padded_batch(B=5, T=4099)  # rows span tiles of 2048
    kw = dict(beta=torch.tensor([0.1, 0.2, 0.3, 0.4, 0.5]), clip_epsilon=(0.2, 0.28), entropy_coef=0.01,
              estimator="k3", aggregation="seq-mean-token-mean")
    outs = []
    for backend, dev in (("cpu", "cpu"), ("cuda", "cuda")):
        x = {k: (v.to(dev) if isinstance(v, torch.Tensor) else v) for k, v in {**b, **kw}.items()}
        x["log_probs"] = x["log_probs"].detach().requires_grad_()
        out = kl_penalty_loss(**x, backend=backend)
        out.loss.backward()
        outs.append((out, x["log_probs"].grad))
    for u, v in zip(outs[0][0], outs[1][0]):
        torch.testing.assert_close(v.cpu(), u, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(outs[1][1].cpu(), outs[0][1], rtol=1e-5, atol=1e-7)


def test_long_row_determinism_and_graph_capture():
    """A row of 1M tokens: repeated calls bitwise equal; the forward captured in a CUDA graph on a
    side stream replays to the same result (no host sync, the caller's stream)."""
    g = torch.Generator().manual_seed(0)
    n = 1 << 20
    lp = (-torch.rand(n + 5, generator=g) * 4).cuda()
    kw = dict(old_log_probs=lp + 0.1, advantages=torch.randn(n + 5, generator=g).cuda(),
              offsets=torch.tensor([0, n, n, n + 5]).cuda(), beta=torch.tensor(0.05).cuda(), estimator="k3",
              clip_epsilon=0.2, backend="cuda")
    first = kl_penalty_loss(lp, **kw)
    again = kl_penalty_loss(lp, **kw)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side):
        kl_penalty_loss(lp, **kw)  # warm-up on the capture stream
        with torch.cuda.graph(graph, stream=side):
            captured = kl_penalty_loss(lp, **kw)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(captured.loss, first.loss, rtol=0, atol=0)
