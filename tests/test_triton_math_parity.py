"""One math per backend family (issue 30 item 3): Triton's per-token math is the C++ header's.

``kl_kernels/triton/kl_math.py`` follows ``csrc/common/kl_math.h`` operation for operation (the
same expm1/exp algorithm and constants: Estrin's polynomial, the 1.5 * 2^23 rounding trick, the
[-87.3, 89] input range, the PPO ratio through ``exp_bounded``), and the C++ is built without
floating-point contraction (``-ffp-contract=off``: the x86-64-v3 clone of the CPU kernel would
otherwise fuse a*b+c into FMAs and round differently). So the bound proved here is **bitwise**:
Triton under its interpreter (numpy float32, no FMA) and the CPU kernel give the same float32 bits
for every estimator, both clamps, the straight-through variants, bf16 rounding, and the PPO token
math (loss, objective, KL and entropy parts, gradient). Compiled for a GPU, Triton contracts FMAs:
there the results may differ by an ulp or so, and this test does not run.

bf16: the float32 results are the same bits; the last step, float32 to bf16, differs because
Triton's interpreter rounds toward zero where the CPU kernel (and Triton on a GPU: cvt.rn) rounds to
nearest even (``test_the_interpreter_rounds_bf16_toward_zero`` pins that down). So a bf16 output of
Triton here is the CPU kernel's float32 result (the same inputs, upcast exactly) truncated to bf16.
"""

from __future__ import annotations

import os

import pytest
import torch

from conftest import triton_device
from kl_kernels import kl_penalty_loss, kl_reward
from kl_kernels.kl_reward.backends import REGISTRY

# The interpreter computes with numpy, which warns where float32 overflows to inf on purpose (exp's range ends).
pytestmark = [pytest.mark.triton, pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")]

ESTIMATORS = ["k1", "abs", "k2", "k3", "k1+", "abs+", "k2+", "k3+"]


@pytest.fixture(autouse=True)
def _interpreter_and_cpu_kernel():
    if triton_device() != "cpu":
        pytest.skip("bitwise parity holds for Triton's interpreter; compiled for a GPU, Triton uses FMAs")
    reasons = next(b for b in REGISTRY if b.name == "cpu").unavailable_reasons()
    if reasons:
        pytest.skip(f"the cpu backend does not run here: {reasons}")


def _log_ratios(n_per_scale=2000, seed=0):
    """Log-ratios over every range the math branches on: |d| < ln2/2 (expm1's polynomial), the
    reduction, the clamps, exp's overflow and underflow, exact zeros, inf and NaN."""
    g = torch.Generator().manual_seed(seed)
    d = torch.cat([torch.randn(n_per_scale, generator=g) * s for s in (1e-4, 0.05, 0.3, 2.0, 30.0, 200.0)]
                  + [torch.tensor([0.0, -0.0, 0.34657359, -0.34657359, 88.7, -88.7, 89.5, -104.0,
                                   float("inf"), float("-inf"), float("nan")])])
    ref = -torch.rand(d.numel(), generator=g) * 5
    return ref + d, ref


def _same_bits(a: torch.Tensor, b: torch.Tensor, what: str):
    assert a.dtype == b.dtype and a.shape == b.shape, what
    nan_a, nan_b = a.isnan(), b.isnan()
    assert torch.equal(nan_a, nan_b), f"{what}: NaN at different tokens"
    ia = a[~nan_a].contiguous().view(torch.int16 if a.element_size() == 2 else torch.int32)
    ib = b[~nan_b].contiguous().view(torch.int16 if b.element_size() == 2 else torch.int32)
    diff = (ia != ib).nonzero().flatten()
    assert diff.numel() == 0, (f"{what}: {diff.numel()} tokens differ, first at {diff[:5].tolist()}: "
                               f"{a[~nan_a][diff[:5]].tolist()} vs {b[~nan_b][diff[:5]].tolist()}")


def _toward_zero_bf16(x: torch.Tensor) -> torch.Tensor:
    """float32 -> bf16 rounding toward zero (the low 16 bits dropped), NaN kept."""
    cut = (x.view(torch.int32) & -65536).view(torch.float32).to(torch.bfloat16)  # exact: 8 mantissa bits left
    return torch.where(x.isnan(), x.to(torch.bfloat16), cut)


def test_the_interpreter_rounds_bf16_toward_zero():
    """What the bf16 comparisons below rely on (it fails, so they get revisited, if Triton's
    interpreter starts rounding to nearest even as the hardware does)."""
    import triton
    import triton.language as tl

    @triton.jit
    def cast(x_ptr, y_ptr, N: tl.constexpr):
        o = tl.arange(0, N)
        tl.store(y_ptr + o, tl.load(x_ptr + o).to(tl.bfloat16))

    x = torch.randn(64, generator=torch.Generator().manual_seed(0))
    y = torch.empty(64, dtype=torch.bfloat16)
    cast[(1,)](x, y, 64)
    assert torch.equal(y, _toward_zero_bf16(x)) and not torch.equal(y, x.to(torch.bfloat16))


def _kl_and_grad(lp, ref, offsets, estimator, clamps, backend):
    x = lp.clone().requires_grad_()
    out = kl_reward(x, ref, offsets=offsets, estimator=estimator, detach=False, backend=backend, **clamps)
    out.kl.float().nan_to_num(0.0, 0.0, 0.0).sum().backward()
    return out.kl.detach(), x.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("clamps", [{}, {"clamp_input": (-10.0, 10.0), "clamp_output": (-5.0, 5.0)}],
                         ids=["no-clamp", "clamps"])
@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_kl_reward_token_math_is_bitwise_the_cpu_kernels(estimator, clamps, dtype):
    lp, ref = _log_ratios()
    lp, ref = lp.to(dtype), ref.to(dtype)
    offsets = torch.tensor([0, lp.numel()])
    got = _kl_and_grad(lp, ref, offsets, estimator, clamps, "triton")
    if dtype == torch.float32:
        want = _kl_and_grad(lp, ref, offsets, estimator, clamps, "cpu")
    else:  # the CPU kernel's float32 results for the same (exactly upcast) inputs, cut to bf16 as the interpreter does
        want = tuple(_toward_zero_bf16(t) for t in _kl_and_grad(lp.float(), ref.float(), offsets, estimator, clamps,
                                                                 "cpu"))
    _same_bits(want[0], got[0], "kl")
    _same_bits(want[1], got[1], "d kl / d log_probs")


PPO_OPTIONS = {"plain": {}, "dual-clip-weights": {"dual_clip": 1.5, "weights": True},
               "weights-on-kl": {"weights": True, "weight_kl": True},
               "kl-clamps": {"clamp_input": (-10.0, 10.0), "clamp_output": (-5.0, 5.0)},
               "gspo": {"importance_sampling_level": "sequence", "dual_clip": 1.5},
               "kl-times-ratio": {"kl_times_ratio": True, "weights": True, "weight_kl": True}}


def _ppo_cases():
    """Every estimator with every option set, and every pair of any two of (estimator, option set, clip or
    not, ref or old) at least once: 48 cases that cover all pairs of the full 192-case product (the clip
    and ref choices run through all four combinations per estimator and both values per option set).
    The full product took 1,013 s of a CI run (Triton's interpreter, before tests/triton_interpreter.py
    vectorized its scans) and would still take minutes; KL_KERNELS_HYPOTHESIS=thorough runs all of it."""
    full = os.environ.get("KL_KERNELS_HYPOTHESIS") == "thorough"
    for i, estimator in enumerate(ESTIMATORS):
        for j, (name, options) in enumerate(PPO_OPTIONS.items()):
            for clip in (None, 0.2):
                for with_ref in (True, False):
                    if full or ((clip is not None) == bool((i + j) % 2) and with_ref == bool((i + j // 2) % 2)):
                        yield pytest.param(estimator, clip, with_ref, options,
                                           id=f"{estimator}-{'clip' if clip else 'no-clip'}-{'ref' if with_ref else 'old'}-{name}")


def test_the_ppo_cases_cover_every_pair():
    cases = [p.values for p in _ppo_cases()]
    axes = [ESTIMATORS, [None, 0.2], [True, False], list(PPO_OPTIONS.values())]
    for a in range(4):
        for b in range(a + 1, 4):
            for x in axes[a]:
                for y in axes[b]:
                    assert any(c[a] == x and c[b] == y for c in cases), (a, b, x, y)


@pytest.mark.parametrize("estimator,clip,with_ref,options", list(_ppo_cases()))
def test_ppo_token_math_is_bitwise_the_cpu_kernels(estimator, clip, with_ref, options):
    lp, other = _log_ratios(n_per_scale=800, seed=1)
    g = torch.Generator().manual_seed(2)
    old = lp + torch.randn(lp.numel(), generator=g) * 0.5  # ratios around 1, some far (the 20 clamp)
    old[::97] = lp[::97] + 30.0
    adv = torch.randn(lp.numel(), generator=g)
    ent = torch.rand(lp.numel(), generator=g)
    offsets = torch.tensor([0, lp.numel()])
    if options.get("importance_sampling_level") == "sequence":
        # GSPO: 7-token sequences, whose float64 sums of lp - old the CPU pre-pass and the torch ops (Triton's)
        # add in the same order: the same sequence log-ratios, so the token math is compared bit for bit
        offsets = torch.cat([torch.arange(0, lp.numel(), 7), torch.tensor([lp.numel()])])
    if options.get("weights"):
        options = dict(options, weights=torch.rand(lp.numel(), generator=g) * 2)
    got = {}
    for backend in ("cpu", "triton"):
        x = lp.clone().requires_grad_()
        out = kl_penalty_loss(x, old, adv, ref_log_probs=other if with_ref else None, beta=0.1, estimator=estimator,
                              offsets=offsets, clip_epsilon=clip, entropy=ent, entropy_coef=0.01, aggregation="none",
                              backend=backend, **options)
        out.loss.nan_to_num(0.0, 0.0, 0.0).sum().backward()
        got[backend] = (out.loss.detach(), out.loss_objective, out.loss_kl, out.loss_entropy, x.grad)
    for name, a, b in zip(("loss", "objective", "kl part", "entropy part", "d loss / d log_probs"),
                          got["cpu"], got["triton"]):
        _same_bits(a, b, name)
