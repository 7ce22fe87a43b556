"""Gradients of kl_reward: gradcheck in float64, and analytic oracle gradients for every layout."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from conftest import CUDA_EMULATED
from batches import Case, _per_sequence, backend_accepts, build, expected, to_device
from kl_kernels import ESTIMATORS, kl_reward
from strategies import cases
from tolerances import assert_close_to_oracle


GRAD_LAYOUTS = ["packed", "padded_left", "padded_right", "list", "nested_jagged"]


def _gradcheck_inputs(layout, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = [5, 0, 1, 7]
    n = sum(lengths)
    lp = -torch.rand(n, generator=g, dtype=torch.float64) * 3
    ref = lp + torch.randn(n, generator=g, dtype=torch.float64) * 0.8
    mask = torch.rand(n, generator=g) < 0.8
    offsets = torch.tensor([0, 5, 5, 6, 13])
    if layout == "packed":
        return lp, ref, mask, dict(offsets=offsets)
    width = max(lengths) + 1
    from kl_kernels import ragged
    pad = lambda x, v: ragged.to_padded(x, offsets, padding_side="left", width=width, padding_value=v)  # noqa: E731
    return pad(lp, float("nan")), pad(ref, float("nan")), pad(mask, False), dict(
        lengths=torch.tensor(lengths), padding_side="left")


@pytest.mark.parametrize("layout", ["packed", "padded"])
@pytest.mark.parametrize("clamps", [None, "verl"], ids=["no-clamp", "clamped"])
@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_gradcheck(estimator, clamps, layout):
    """torch.autograd.gradcheck (float64) on every output w.r.t. both log-prob inputs."""
    lp, ref, mask, layout_kw = _gradcheck_inputs(layout)
    clamp_kw = dict(clamp_input=(-0.9, 0.9), clamp_output=(-10.0, 0.3)) if clamps else {}
    coef = torch.tensor([0.5, 1.0, 2.0, 0.1], dtype=torch.float64)
    score = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64)
    nan_free = lambda x: torch.nan_to_num(x, nan=-1.0)  # noqa: E731  (padding is NaN; finite for gradcheck)

    def make(est, clamp):
        def fn(a, b):
            out = kl_reward(a, b, score, coef=coef, estimator=est, mask=mask, prompt_lens=torch.tensor([1, 0, 0, 2]),
                            reward_placement="last", return_ref=True, detach=False, **clamp, **layout_kw)
            return out.kl, out.reward, out.ref_log_probs, out.kl_sum
        return fn

    inputs = (nan_free(lp).requires_grad_(), nan_free(ref).requires_grad_())
    if estimator.endswith("+"):
        # Straight-through: the gradient is by design not the forward's derivative but that of the
        # unclamped k2 surrogate; check exactly that, and gradcheck the surrogate itself.
        surrogate = make("k2", {})
        got = torch.autograd.functional.jacobian(make(estimator, clamp_kw), inputs)
        want = torch.autograd.functional.jacobian(surrogate, inputs)
        for g_out, w_out in zip(got[:2] + got[3:], want[:2] + want[3:]):  # ref output: no estimator in it
            for g, w in zip(g_out, w_out):
                torch.testing.assert_close(g, w)
        assert torch.autograd.gradcheck(surrogate, inputs)
    else:
        assert torch.autograd.gradcheck(make(estimator, clamp_kw), inputs)


def _with_grad(kwargs, layout):
    """Leaf copies of the log-prob inputs that require grad, in the given layout."""
    def leaf(x):
        if isinstance(x, list):
            return [t.detach().clone().requires_grad_() for t in x]
        if x.is_nested:
            return torch.nested.nested_tensor([t.detach() for t in x.unbind()], layout=x.layout, requires_grad=True)
        return x.detach().clone().requires_grad_()
    kwargs = dict(kwargs)
    kwargs["log_probs"], kwargs["ref_log_probs"] = leaf(kwargs["log_probs"]), leaf(kwargs["ref_log_probs"])
    return kwargs


def _grad_of(x):
    if isinstance(x, list):
        return [t.grad for t in x]
    return x.grad


def _dot(out, upstream):
    if isinstance(out, list):
        return sum((o * u).sum() for o, u in zip(out, upstream))
    if out.is_nested:
        return sum((o * u).sum() for o, u in zip(out.unbind(), upstream.unbind()))
    return (out * upstream).sum()


def _randn_like(x, g):
    if isinstance(x, list):
        return [torch.randn(t.shape, generator=g, dtype=torch.float64).to(t.dtype) for t in x]
    if x.is_nested:
        return torch.nested.nested_tensor([_randn_like(t, g) for t in x.unbind()], layout=x.layout)
    return torch.randn(x.shape, generator=g, dtype=torch.float64).to(x.dtype)


@pytest.mark.parametrize("backend", ["torch", "cpu", CUDA_EMULATED])
@pytest.mark.parametrize("layout", GRAD_LAYOUTS)
@given(case=cases(dtypes=(torch.float32, torch.bfloat16, torch.float64)), seed=st.integers(0, 2**31 - 1))
def test_gradients_match_oracle(layout, backend, case, seed):
    check_gradients(case, layout, backend, seed)


def check_gradients(case, layout, backend, seed, device="cpu"):
    """Random upstream grads on kl, reward, ref output and kl_sum; input grads vs the analytic oracle."""
    if case.placement == "auto":
        case.placement = "token"  # placement inference is tested elsewhere
    if (layout == "nested_jagged" and case.batch == 0) or not backend_accepts(case, backend):
        return
    built = build(case, layout)
    kwargs = _with_grad(to_device(built.kwargs, device), layout)
    out = kl_reward(**kwargs, detach=False, backend=backend)
    g = torch.Generator().manual_seed(seed)
    up = {k: to_device(_randn_like(to_device(getattr(out, k), "cpu"), g), device)
          for k in ("kl", "reward", "ref_log_probs")}
    # out.kl_sum's device, not `device`: an empty list carries none, and such a call answers on the CPU
    up_sum = torch.randn(case.batch, generator=g, dtype=torch.float64).to(out.kl_sum.dtype).to(out.kl_sum.device)
    loss = _dot(out.kl, up["kl"]) + _dot(out.reward, up["reward"]) + _dot(out.ref_log_probs, up["ref_log_probs"]) \
        + (out.kl_sum * up_sum).sum()
    if not loss.requires_grad:  # nothing counted anywhere: no graph, and that is correct
        assert all(c == 0 for c in out.count.tolist())
        return
    loss.backward()

    lengths = built.case.lengths
    trailing = case.reward_kind in ("token1", "B11")
    split = lambda x, tr=False: _per_sequence(x, built, lengths, trailing=tr)  # noqa: E731
    up, up_sum = to_device(up, "cpu"), up_sum.cpu()
    g_lp, pad_lp = split(to_device(_grad_of(kwargs["log_probs"]), "cpu"))
    g_ref, pad_ref = split(to_device(_grad_of(kwargs["ref_log_probs"]), "cpu"))
    u_kl, _ = split(up["kl"])
    u_rw, _ = split(up["reward"], trailing)
    u_ref, _ = split(up["ref_log_probs"])
    for b, e in enumerate(expected(built.case)):
        c = built.case.coef_of(b)
        rw = u_rw[b].squeeze(-1) if trailing else u_rw[b]
        gt = [float(u_kl[b][t]) + float(up_sum[b]) - c * float(rw[t]) for t in range(lengths[b])]
        want_lp = [gt[t] * e.dkl_dd[t] for t in range(lengths[b])]
        want_ref = [-gt[t] * e.dkl_dd[t] + (float(u_ref[b][t]) if e.counted[t] else 0.0) for t in range(lengths[b])]
        # Each grad is a sum of terms (kl, kl_sum and reward upstreams; ref: plus the ref-output path)
        # rounded to the input dtype separately: bound the error by the terms' magnitudes.
        terms = [abs(float(u_kl[b][t])) + abs(float(up_sum[b])) + abs(c * float(rw[t])) for t in range(lengths[b])]
        scale_lp = [terms[t] * abs(e.dkl_dd[t]) for t in range(lengths[b])]
        scale_ref = [scale_lp[t] + abs(float(u_ref[b][t])) for t in range(lengths[b])]
        assert_close_to_oracle(g_lp[b], want_lp, f"grad log_probs[{b}]", scale=scale_lp)
        assert_close_to_oracle(g_ref[b], want_ref, f"grad ref_log_probs[{b}]", scale=scale_ref)
    for (_, pl), (_, pr) in zip(pad_lp, pad_ref):
        assert (pl == 0).all() and (pr == 0).all(), "padding must get exactly zero gradient"


def test_detach_true_returns_no_history():
    lp = torch.randn(6, requires_grad=True)
    ref = torch.randn(6, requires_grad=True)
    out = kl_reward(lp, ref, offsets=torch.tensor([0, 2, 6]))
    assert not out.kl.requires_grad and not out.reward.requires_grad and not out.kl_sum.requires_grad


def test_reward_and_coef_get_no_gradient():
    lp = torch.randn(4, dtype=torch.float64, requires_grad=True)
    ref = torch.randn(4, dtype=torch.float64)
    reward = torch.randn(4, dtype=torch.float64, requires_grad=True)
    coef = torch.tensor(0.3, dtype=torch.float64, requires_grad=True)
    out = kl_reward(lp, ref, reward, coef=coef, offsets=torch.tensor([0, 4]), detach=False)
    out.reward.sum().backward()
    assert reward.grad is None and coef.grad is None and lp.grad is not None


@pytest.mark.parametrize("estimator", ["k1+", "abs+", "k2+", "k3+"])
def test_straight_through_forward_is_exact_and_gradient_is_d(estimator):
    """'+' variants: forward bit-identical to the base estimator, gradient d (k2's), clamps ignored."""
    lp = torch.tensor([-1.0, -0.2, -3.0, -0.5], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([-0.4, -0.2, -0.1, -2.5], dtype=torch.float64)
    kw = dict(offsets=torch.tensor([0, 4]), clamp_input=(-1.0, 1.0), clamp_output=(-10.0, 0.5))
    base = kl_reward(lp, ref, estimator=estimator[:-1], **kw).kl
    out = kl_reward(lp, ref, estimator=estimator, detach=False, **kw)
    assert torch.equal(out.kl.detach(), base)
    out.kl.sum().backward()
    torch.testing.assert_close(lp.grad, (lp - ref).detach())


def test_nan_padding_does_not_poison_gradients():
    lp = torch.tensor([[float("nan"), -1.0, -2.0]], requires_grad=True)
    ref = torch.tensor([[float("nan"), -1.5, -1.0]], requires_grad=True)
    out = kl_reward(lp, ref, lengths=torch.tensor([2]), estimator="k3", detach=False)
    out.kl.sum().backward()
    assert torch.isfinite(lp.grad).all() and lp.grad[0, 0] == 0 and torch.isfinite(ref.grad).all()
