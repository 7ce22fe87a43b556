"""The Triton backend of kl_penalty_loss against the float64 oracle, its registration and guarantees.

Without a GPU these run under Triton's interpreter (``TRITON_INTERPRET=1``, set by conftest.py
before triton is imported) on CPU tensors, with bounded hypothesis examples; on a GPU machine the
same tests run compiled on CUDA tensors.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import triton_device
from kl_kernels import kl_penalty_loss
from kl_kernels.kl_penalty import ops  # noqa: F401  (registers kl_kernels::kl_penalty_triton_fwd / _bwd)
from loss_batches import AGGREGATIONS, LOSS_LAYOUTS, check_loss, loss_cases
from test_kl_penalty_fused import (_op_args, _padded_batch, check_fullgraph_compile, check_inputs_never_modified,
                                    check_long_row, check_nan_at_a_counted_token, check_negative_bit,
                                    check_non_contiguous)

pytestmark = pytest.mark.triton
DEVICE = triton_device() or "cpu"


@pytest.mark.parametrize("layout", LOSS_LAYOUTS)
@given(case=loss_cases(dtypes=(torch.float32, torch.bfloat16, torch.float16)))
@settings(max_examples=10)
def test_matches_oracle(case, layout):
    check_loss(case, layout, "triton", device=DEVICE, grads=layout != "nested_jagged")


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@given(case=loss_cases(dtypes=(torch.float32,)), layout=st.sampled_from(["packed", "padded_left", "padded_right"]))
@settings(max_examples=5)
def test_every_aggregation(case, layout, aggregation):
    case.aggregation = aggregation
    check_loss(case, layout, "triton", device=DEVICE)


@pytest.mark.parametrize("kind", ["padded", "packed"])
@pytest.mark.parametrize("token_out", [False, True], ids=["sums", "token_out"])
def test_opcheck(kind, token_out):
    args = tuple(a.to(DEVICE) if isinstance(a, torch.Tensor) else a for a in _op_args(kind, token_out))
    torch.library.opcheck(torch.ops.kl_kernels.kl_penalty_triton_fwd.default, args)


def test_same_as_cpu_kernel_on_every_output():
    """Triton and the C++ kernel compute the same per-token math: every output and both gradients
    agree to float32 rounding (per-sequence clip bounds, per-sequence beta, k3, entropy)."""
    b = _padded_batch(B=5, T=53)
    kw = dict(beta=torch.tensor([0.1, 0.2, 0.3, 0.4, 0.5]), clip_epsilon=(0.2, 0.28), entropy_coef=0.01,
              estimator="k3", aggregation="seq-mean-token-mean")
    results = []
    for backend, dev in (("cpu", "cpu"), ("triton", DEVICE)):
        x = {k: (v.to(dev) if isinstance(v, torch.Tensor) else v) for k, v in b.items()}
        x["log_probs"] = x["log_probs"].detach().requires_grad_()
        x["entropy"] = x["entropy"].detach().requires_grad_()
        out = kl_penalty_loss(**x, **{k: (v.to(dev) if isinstance(v, torch.Tensor) else v) for k, v in kw.items()},
                              backend=backend)
        out.loss.backward()
        results.append((out, x["log_probs"].grad, x["entropy"].grad))
    (a, ga, ea), (t, gt, et) = results
    for name, u, v in zip(a._fields, a, t):
        torch.testing.assert_close(v.cpu(), u, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
    torch.testing.assert_close(gt.cpu(), ga, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(et.cpu(), ea, rtol=1e-5, atol=1e-7)


def test_non_contiguous_inputs():
    check_non_contiguous("triton", DEVICE)


def test_negative_bit_inputs():
    check_negative_bit("triton", DEVICE)


def test_long_row_and_determinism():
    # Under the interpreter (no GPU) 9001 tokens, still 9 of its 1024-wide tiles: the full 70001 took
    # ~107 s of CI there, and a 1-D grid has no 65535 limit to cross
    check_long_row("triton", DEVICE, n=70001 if DEVICE == "cuda" else 20001)  # 20 tiles of 1024: two combine steps


def test_nan_at_a_counted_token():
    check_nan_at_a_counted_token("triton", DEVICE)


def test_inputs_never_modified():
    check_inputs_never_modified("triton", DEVICE)


@pytest.mark.slow
def test_fullgraph_compile_matches_eager():
    check_fullgraph_compile("triton", "token-mean", DEVICE)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("kind", ["packed", "padded"])
def test_non_finite_counted_token_stays_in_its_sequence(kind, bad):
    """A NaN/inf reference log-prob at a counted token of sequence 0 makes its per-sequence sums
    non-finite, never those of the later sequences in the same tile (segmented scan in the tile)."""
    from kl_kernels.kl_penalty import launch_triton

    args = [a.detach().clone().to(DEVICE) if isinstance(a, torch.Tensor) else a for a in _op_args(kind)]
    args[5][:] = True  # every token counted
    args[22] = [-math.inf, math.inf, -math.inf, math.inf]  # no KL clamps: they would make the bad token's KL finite
    clean = launch_triton.forward(*args)
    args[2].view(-1)[0] = bad  # ref_log_probs: sequence 0's first token
    dirty = launch_triton.forward(*args)
    assert not torch.isfinite(dirty[0][0])
    for want, got in zip(clean[:3], dirty[:3]):
        torch.testing.assert_close(got[1:].cpu(), want[1:].cpu(), rtol=0, atol=0, equal_nan=True)
