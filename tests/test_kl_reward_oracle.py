"""kl_reward against the float64 oracle over every semantic axis (hypothesis), every layout."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from batches import LAYOUTS, Case, _per_sequence, backend_accepts, build, check
from conftest import CUDA_EMULATED, backend_device
from kl_kernels import BackendUnavailableError, kl_reward
from strategies import cases


def _auto_is_ambiguous(case: Case, layout: str) -> bool:
    """A per-token reward with reward_placement='auto' whose shape also fits a per-sequence one (an
    empty reward of an empty batch is not: either reading gives the same nothing)."""
    if case.placement != "auto" or case.reward_kind not in ("token", "token1") or case.batch == 0:
        return False
    if layout == "packed":
        return sum(case.lengths) == case.batch
    if layout.startswith("padded"):
        return max(case.lengths, default=0) + case.left_pad_extra == 1
    return False


BACKENDS = ["torch", "cpu", CUDA_EMULATED]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", LAYOUTS)
@given(case=cases())
def test_matches_oracle(layout, backend, case):
    assume(not (layout == "nested_strided" and case.batch == 0))  # torch has no empty strided nested tensor
    if _auto_is_ambiguous(case, layout):
        with pytest.raises(ValueError, match="ambiguous"):
            kl_reward(**build(case, layout).kwargs, backend=backend)
        return
    if not backend_accepts(case, backend):
        with pytest.raises(BackendUnavailableError, match="dtype"):
            kl_reward(**build(case, layout).kwargs, backend=backend)
        return
    check(case, layout, backend=backend)


@pytest.mark.parametrize("layout", ["packed", "padded_left", "padded_right"])
@given(case=cases(dtypes=(torch.float64,)))
@settings(max_examples=25)
def test_float64_reference_is_oracle_exact(layout, case):
    """In float64 the reference agrees with the oracle to ~1e-12: it *is* the semantics."""
    if _auto_is_ambiguous(case, layout):
        return
    check(case, layout, backend="torch")


def _long_case(n, dtype):
    g = torch.Generator().manual_seed(n)
    lp = (-torch.rand(n, generator=g, dtype=torch.float64) * 8).to(dtype)
    ref = (lp.double() + torch.randn(n, generator=g, dtype=torch.float64) * 0.3).to(dtype)
    mask = torch.rand(n, generator=g) < 0.7
    return Case(lp=[lp, lp[:3], lp[:0]], ref=[ref, ref[:3], ref[:0]], mask=[mask, mask[:3], mask[:0]],
                prompt_lens=[1000, 1, 0], estimator="k3", clamp_input=(-20.0, 20.0), clamp_output=(-10.0, 10.0),
                coef_kind="per_seq", coef=[0.1, 0.2, 0.3], reward_kind="B", placement="last",
                reward_seq=torch.tensor([1.0, -1.0, 0.5]))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", ["packed", "padded_left", "padded_right", "nested_jagged"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_row_longer_than_a_grid_dimension(layout, dtype, backend):
    """One row of 70001 tokens (> 65535, a prime-ish odd size) next to tiny and empty rows."""
    check(_long_case(70001, dtype), layout, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", [x for x in LAYOUTS if x != "nested_strided"])
def test_empty_batch(layout, backend):
    out = kl_reward(**build(Case(lp=[], ref=[]), layout).kwargs, backend=backend)
    assert out.kl_sum.shape == (0,) and out.count.shape == (0,)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_all_sequences_empty(layout, backend):
    empty = torch.zeros(0)
    case = Case(lp=[empty, empty], ref=[empty, empty], reward_kind="B", placement="last",
                reward_seq=torch.tensor([1.0, 2.0]))
    out, _, _ = check(case, layout, backend=backend)
    assert out.count.tolist() == [0, 0] and out.kl_sum.tolist() == [0.0, 0.0]


@pytest.mark.parametrize("backend", BACKENDS + [pytest.param("triton", marks=pytest.mark.triton)])
@pytest.mark.parametrize("layout", ["packed", "padded_left", "list"])
def test_nan_in_counted_token_propagates(layout, backend):
    """NaN is never hidden: a NaN log-prob in a counted token gives NaN kl, reward and kl_sum."""
    lp = torch.tensor([-1.0, float("nan"), -2.0])
    ref = torch.tensor([-1.5, -1.0, -2.5])
    case = Case(lp=[lp, lp[:1]], ref=[ref, ref[:1]], reward_kind="token", placement="token",
                reward_tok=[torch.ones(3), torch.ones(1)])
    out, built, _ = check(case, layout, device=backend_device(backend), backend=backend)
    assert math.isnan(out.kl_sum[0]) and not math.isnan(out.kl_sum[1])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", ["packed", "padded_right"])
def test_nan_in_masked_token_is_ignored(layout, backend):
    lp = torch.tensor([-1.0, float("nan"), -2.0])
    ref = torch.tensor([-1.5, float("inf"), -2.5])
    case = Case(lp=[lp], ref=[ref], mask=[torch.tensor([True, False, True])], estimator="k3")
    out, _, _ = check(case, layout, backend=backend)
    assert math.isfinite(out.kl_sum[0])


def test_last_placement_preserves_the_sequence_total():
    """With 'last', every non-empty sequence keeps sum(reward_out) == reward - coef * kl_sum,
    also when no token is counted (the reward then sits on the last valid token)."""
    g = torch.Generator().manual_seed(0)
    lengths = torch.tensor([5, 3, 0, 4])
    lp = -torch.rand(12, generator=g, dtype=torch.float64)
    ref = -torch.rand(12, generator=g, dtype=torch.float64)
    mask = torch.tensor([1, 1, 0, 1, 0, 0, 0, 0, 0, 1, 1, 0], dtype=torch.bool)
    offsets = torch.tensor([0, 5, 8, 8, 12])
    score = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64)
    out = kl_reward(lp, ref, score, coef=0.5, mask=mask, offsets=offsets, reward_placement="last", estimator="k3")
    totals = torch.segment_reduce(out.reward, "sum", offsets=offsets)
    expected = torch.where(lengths > 0, score - 0.5 * out.kl_sum, torch.zeros(4, dtype=torch.float64))
    torch.testing.assert_close(totals, expected)
    assert out.reward[5:8].tolist() == [0.0, 0.0, 2.0]  # nothing counted in row 1: last valid token


@given(st.integers(1, 6), st.integers(0, 2**31 - 1))
def test_layouts_agree_bitwise(batch, seed):
    """The same tokens through every layout give bit-identical kl and reward (fp32)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 9, (batch,), generator=g).tolist()
    lp = [-torch.rand(n, generator=g) * 5 for n in lengths]
    ref = [-torch.rand(n, generator=g) * 5 for n in lengths]
    case = Case(lp=lp, ref=ref, estimator="k3", reward_kind="B", placement="last",
                reward_seq=torch.rand(batch, generator=g))
    results = {}
    for layout in ("packed", "padded_left", "padded_right", "list", "nested_jagged", "nested_strided"):
        out, built, _ = check(case, layout)
        results[layout] = [torch.cat(_per_sequence(x, built, lengths)[0]) for x in (out.kl, out.reward)]
    first = results["packed"]
    for layout, got in results.items():
        for a, b in zip(first, got):
            assert torch.equal(a, b), layout
