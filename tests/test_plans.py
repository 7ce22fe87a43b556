"""Call plans (kl_kernels/plans.py, issue 49 item 1): an eager call whose signature was seen before runs
the plan its first call's validation built. Held here: the Python-level call budget of such a call, the
results of planned calls on fresh tensors and values (equal to the reference's), the value checks still
made on every planned call (each bad value raises exactly as on first sight), and the launcher's reused
argument struct equal, field by field, to what the launcher's own filling gives for the same tensors."""

from __future__ import annotations

import gc
import math
import sys

import pytest
import torch

from kl_kernels import kl_reward, plans, value_checks

B, T = 8, 30
KL_REWARD_BUDGET = 60  # Python-level calls (sys.setprofile "call" + "c_call") of one planned eager call, B = 8


def _count(f) -> int:
    """Python-level calls of ``f()``. The cyclic garbage collector is off meanwhile (after a collection): a
    collection that happens to run inside the call would add the finalizers and weakref callbacks of objects
    of earlier calls, or of earlier tests in the worker (seen: 129 calls once where every lone run gave 127)."""
    events = []

    def profile(frame, event, arg):
        if event in ("call", "c_call"):
            events.append(event)
    gc.collect()
    gc.disable()
    sys.setprofile(profile)
    try:
        f()
    finally:
        sys.setprofile(None)
        gc.enable()
    return len(events) - 1  # (sys.setprofile's own c_call event when it is switched off)


def _verl(layout, g=None):
    """kl_reward as verl calls it (padded [B, T], a response mask, k1, the score on the last token), or
    the same batch packed."""
    g = g or torch.Generator().manual_seed(0)
    lp, ref = -torch.rand(B, T, generator=g), -torch.rand(B, T, generator=g)
    mask, score = torch.rand(B, T, generator=g) < 0.8, torch.randn(B, generator=g)
    if layout == "packed":
        return (lp.reshape(-1), ref.reshape(-1), score), dict(mask=mask.reshape(-1), offsets=torch.arange(B + 1) * T)
    return (lp, ref, score), dict(mask=mask)


# the C++ kernels' rows: cpu, and cuda through its host emulation (the same host Python as on a GPU)
BACKENDS = ["auto", pytest.param("cuda-emulated", marks=pytest.mark.cuda_emulated)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_a_planned_kl_reward_call_stays_within_its_call_budget(layout, backend):
    args, kw = _verl(layout)

    def call():
        kl_reward(*args, coef=0.05, estimator="k1", reward_placement="last", backend=backend, **kw)
    call(), call()
    n = _count(call)
    assert n <= KL_REWARD_BUDGET, f"{n} Python-level calls (budget {KL_REWARD_BUDGET})"


def _case(name, g):
    lp, ref = -torch.rand(B, T, generator=g), -torch.rand(B, T, generator=g)
    mask = torch.rand(B, T, generator=g) < 0.8
    lengths = torch.randint(0, T + 1, (B,), generator=g)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    n = int(offsets[-1])
    c = float(torch.rand((), generator=g))
    cases = {
        "padded verl": ((lp, ref, torch.randn(B, generator=g)), dict(mask=mask, coef=c, reward_placement="last")),
        "padded lengths prompt k3": ((lp, ref, torch.randn(B, 1, 1, generator=g)),
                                     dict(lengths=lengths, prompt_lens=lengths // 3, padding_side="right", coef=c,
                                          estimator="k3", clamp_input=(-20.0, 20.0), clamp_output=(-10, 10))),
        "padded token trailing ref": ((lp, ref, torch.randn(B, T, 1, generator=g)),
                                      dict(mask=mask, coef=torch.rand(B, generator=g), return_ref=True)),
        "packed last_valid bf16 reward": ((lp.reshape(-1)[:n], ref.reshape(-1)[:n],
                                           torch.randn(B, generator=g).bfloat16()),
                                          dict(offsets=offsets, mask=mask.reshape(-1)[:n], coef=torch.tensor(c),
                                               reward_placement="last_valid", estimator="abs+")),
        "packed mask_nan": ((lp.reshape(-1)[:n], ref.reshape(-1)[:n].clone().index_fill_(0, torch.tensor([0]),
                                                                                          math.nan), None),
                            dict(offsets=offsets, mask_nan=True, coef=2)),
    }
    return cases[name]


CASES = ["padded verl", "padded lengths prompt k3", "padded token trailing ref", "packed last_valid bf16 reward",
         "packed mask_nan"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("with_out", [False, True])
@pytest.mark.parametrize("name", CASES)
def test_planned_calls_on_fresh_tensors_and_values_match_the_reference(name, with_out, backend):
    if backend == "cuda-emulated" and "mask_nan" in name:
        pytest.skip("mask_nan is the CPU kernel's (lists, NaN pads): the CUDA kernels decline it")
    plans.clear()
    for seed in range(4):  # one signature, new tensors and values every call: the first validated, then planned
        args, kw = _case(name, torch.Generator().manual_seed(seed))
        want = kl_reward(*args, backend="torch", **kw)
        out = None
        if with_out:
            out = tuple(None if t is None else torch.full_like(t, math.nan) if t.is_floating_point()
                        else torch.full_like(t, -7) for t in want)
        got = kl_reward(*args, out=out, backend=backend, **kw)
        for field, g, w in zip(want._fields, got, want):
            if w is None:
                assert g is None, field
                continue
            if out is not None:
                assert g is out[want._fields.index(field)], field
            assert g.shape == w.shape and g.dtype == w.dtype, field
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6, equal_nan=True, msg=f"{name} seed {seed} {field}")


def _bad_values():
    """(name, valid call's kwargs, the same signature with one bad value, message)."""
    args, kw = _verl("packed")
    lp, ref, score = args
    padded_args, padded_kw = _verl("padded")
    lengths = torch.full((B,), T)
    yield ("offsets", (args, dict(kw, offsets=torch.arange(B + 1) * T)),
           (args, dict(kw, offsets=(torch.arange(B + 1) * T).flip(0))), "offsets must start at 0")
    yield ("offsets end", (args, kw), (args, dict(kw, offsets=torch.arange(B + 1) * (T - 1))), "offsets must end")
    yield ("lengths", (padded_args, dict(padded_kw, lengths=lengths)),
           (padded_args, dict(padded_kw, lengths=lengths + 1)), "lengths must be <= T")
    yield ("prompt_lens", (padded_args, dict(padded_kw, lengths=lengths, prompt_lens=lengths - 1)),
           (padded_args, dict(padded_kw, lengths=lengths - 2, prompt_lens=lengths - 1)), "prompt_lens must be <=")
    yield ("coef nan", (args, dict(kw, coef=0.1)), (args, dict(kw, coef=math.nan)), "coef must be finite")
    yield ("coef huge int", (args, dict(kw, coef=1)), (args, dict(kw, coef=2 ** 200)), "coef must be finite")
    yield ("coef tensor inf", (args, dict(kw, coef=torch.ones(B))),
           (args, dict(kw, coef=torch.full((B,), math.inf))), "coef must be finite")
    buffers = [torch.empty(B * T), torch.empty(B * T), None, torch.empty(B), torch.empty(B, dtype=torch.int64)]
    yield ("out overlaps an input", (args, dict(kw, out=tuple(buffers))),
           (args, dict(kw, out=(lp, *buffers[1:]))), "out.kl overlaps log_probs")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name, valid, bad, message", list(_bad_values()), ids=[c[0] for c in _bad_values()])
def test_a_planned_call_checks_every_value_as_the_first_call_does(name, valid, bad, message, backend):
    plans.clear()
    (bad_args, bad_kw) = bad
    with pytest.raises(ValueError, match=message) as cold:
        kl_reward(*bad_args, reward_placement="last", backend=backend, **bad_kw)
    (args, kw) = valid
    kl_reward(*args, reward_placement="last", backend=backend, **kw)
    kl_reward(*args, reward_placement="last", backend=backend, **kw)  # planned
    with pytest.raises(ValueError, match=message) as warm:
        kl_reward(*bad_args, reward_placement="last", backend=backend, **bad_kw)
    assert str(warm.value) == str(cold.value)


def test_the_plan_signature_tells_bools_ints_and_floats_apart():
    """True == 1 == 1.0: a plan built for detach=True must not take detach=1 (a TypeError on first sight)."""
    args, kw = _verl("padded")
    kw = dict(kw, reward_placement="last")
    kl_reward(*args, detach=True, **kw), kl_reward(*args, detach=True, **kw)
    with pytest.raises(TypeError, match="detach must be a bool"):
        kl_reward(*args, detach=1, **kw)
    kl_reward(*args, clamp_input=(-1.0, 1.0), **kw), kl_reward(*args, clamp_input=(-1.0, 1.0), **kw)
    with pytest.raises(ValueError, match="clamp_input bounds must be real numbers"):
        kl_reward(*args, clamp_input=(-1.0, True), **kw)


def test_the_reused_struct_holds_what_the_launcher_fills_for_the_same_tensors():
    """ForwardPlan rewrites every per-call field: its struct, after a call on other tensors, equals
    make_args's for those tensors (a field the plan forgot would keep the first call's address)."""
    from kl_kernels.kl_reward import launch
    from kl_kernels.kl_reward.ops import forward_args
    from kl_kernels.kl_reward.problem import build_problem

    def problem(seed):
        (lp, ref, score), kw = _case("padded lengths prompt k3", torch.Generator().manual_seed(seed))
        kw = dict(kw, mask=torch.rand(B, T) < 0.5, coef=torch.rand(B))
        opts = dict(estimator="k1", mask=None, offsets=None, lengths=None, padding_side="left", prompt_lens=None,
                    reward_placement="auto", clamp_input=None, clamp_output=None, return_ref=True, detach=True)
        opts.update(kw)
        return build_problem(lp, ref, score, **opts)[0]

    first, second = problem(0), problem(1)
    fa = forward_args(first)
    plan = launch.ForwardPlan(fa[0], fa[1], fa[6], first.coef, *fa[9:])
    plan(first.log_probs, first.ref_log_probs, first.mask, None, first.lengths, first.prompt_lens, first.reward,
         first.coef)
    outs = plan(second.log_probs, second.ref_log_probs, second.mask, None, second.lengths, second.prompt_lens,
                second.reward, second.coef)
    got = plan.local.args
    fb = forward_args(second)
    want, _ = launch.make_args(plan.module, log_probs=fb[0], ref_log_probs=fb[1], mask=fb[2], offsets=fb[3],
                               lengths=fb[4], prompt_lens=fb[5], reward=fb[6], coef=fb[7], coef_scalar=fb[8],
                               layout=fb[9], left_pad=fb[10], placement=fb[11], estimator=fb[12],
                               straight_through=fb[13], clamp=fb[14])
    launch.allocate_outputs(want, fb[0].shape, fb[0].dtype, fb[16], fb[0].device, True, outs)
    fields = [f for f in dir(want) if not f.startswith("_")]
    for field in fields:
        g, w = getattr(got, field), getattr(want, field)
        if field == "est":
            g, w = ({f: getattr(x, f) for f in dir(x) if not f.startswith("_")} for x in (g, w))
        if field == "coef":  # (make_args's own float32 copy of the coefficient: another address, same values)
            continue
        assert g == w, field


# --------------------------------------------------------------------------- kl_penalty_loss

# Python-level calls of one planned eager loss forward + backward (the caller's .backward() included), B = 8,
# padded with lengths as verl's actor step (packed the same): 120 at this commit, issue 49's budget (d51469c: ~460;
# 147 right after the merge of the int32 index work, whose checks the plans now repeat in their value-only form;
# 127 before the folded forward became _PlannedTotal's own and the weight's float paths lost their builtin calls).
# Of the 120, torch's autograd (Function.apply, Tensor.backward, the saved-tensor hooks probe) takes ~45, the
# signature (plans.facts: 2 per tensor) 14, the lengths' value check 7, the folded aggregation's weight and
# parts ~6, the backward's in-place test 3. 124 since issue 62's TRL metrics: the per-sequence stats and counts
# the output carries (sequence_stats, seq_num_tokens), two buffers and their addresses (+4).
LOSS_BUDGET = 124


def _loss_call(layout, g, beta=0.05, out=None, **over):
    lp, old, ref = (-torch.rand(B, T, generator=g) for _ in range(3))
    adv, mask = torch.randn(B, T, generator=g), torch.rand(B, T, generator=g) < 0.8
    lengths = torch.randint(0, T + 1, (B,), generator=g)
    geo = dict(lengths=lengths, padding_side="left")
    if layout == "packed":
        lp, old, ref, adv, mask = (x.reshape(-1) for x in (lp, old, ref, adv, mask))
        geo = dict(offsets=torch.arange(B + 1) * T)
    kw = dict(ref_log_probs=ref, beta=beta, estimator="k3", mask=mask, clip_epsilon=0.2, dual_clip=3.0, **geo)
    kw.update(over)
    return lp.requires_grad_(), old, adv, kw


# The same call through the CUDA kernels' host path (api.py's _DevicePlan), counted through their host emulation
# with the value checks on their accelerator path (deferred by the plan's CallChecks and folded into the forward's
# combine: value_checks.checks_on_host and value_checks.deferrable stubbed as on a GPU, where deferrable makes ~5
# calls more):
# 159 at this commit. ~500 before the device plan (every call validated in full); 146 before the folded checks
# (their deferral costs ~13 calls, the check launch it saves ~5 us of a GPU's host time).
DEVICE_LOSS_BUDGET = 160
LOSS_BACKENDS = BACKENDS


@pytest.mark.parametrize("backend", LOSS_BACKENDS)
@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_a_planned_loss_forward_backward_stays_within_its_call_budget(layout, backend, monkeypatch):
    from kl_kernels import kl_penalty_loss

    lp, old, adv, kw = _loss_call(layout, torch.Generator().manual_seed(0))
    if backend == "cuda-emulated":  # the checks' accelerator path, as on a GPU (see DEVICE_LOSS_BUDGET)
        monkeypatch.setattr(value_checks, "checks_on_host", lambda t: False)
        monkeypatch.setattr(value_checks, "deferrable", lambda kernel, *tensors: True)

    def call():
        kl_penalty_loss(lp, old, adv, backend=backend, **kw).loss.backward()
    call(), call()
    n = _count(call)
    budget = LOSS_BUDGET if backend == "auto" else DEVICE_LOSS_BUDGET
    assert n <= budget, f"{n} Python-level calls (budget {budget})"


@pytest.mark.parametrize("backend", LOSS_BACKENDS)
@pytest.mark.parametrize("beta", ["float", "tensor"])
@pytest.mark.parametrize("with_out", [False, True])
@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_planned_loss_calls_on_fresh_tensors_match_the_reference(layout, with_out, beta, backend):
    from kl_kernels import kl_penalty_loss

    plans.clear()
    for seed in range(4):
        g = torch.Generator().manual_seed(seed)
        b = float(torch.rand((), generator=g)) if beta == "float" else torch.rand((), generator=g)
        lp, old, adv, kw = _loss_call(layout, g, beta=b)
        ref_lp = lp.detach().clone().requires_grad_()
        want = kl_penalty_loss(ref_lp, old, adv, backend="torch", **kw)
        out = torch.full(lp.shape, math.nan) if with_out else None
        got = kl_penalty_loss(lp, old, adv, out=out, backend=backend, **kw)
        for field, gv, wv in zip(want._fields, got, want):
            torch.testing.assert_close(gv, wv, rtol=1e-5, atol=1e-6, msg=f"seed {seed} {field}")
        (g_got,) = torch.autograd.grad(got.loss, lp)
        (g_want,) = torch.autograd.grad(want.loss, ref_lp)
        torch.testing.assert_close(g_got, g_want, rtol=1e-5, atol=1e-6)


def _loss_bad_values():
    g = lambda: torch.Generator().manual_seed(3)  # noqa: E731
    yield ("offsets", dict(layout="packed"), dict(offsets=(torch.arange(B + 1) * T).flip(0)), "offsets must start at 0")
    yield ("lengths", dict(layout="padded"), dict(lengths=torch.full((B,), T + 1)), "lengths must be <= T")
    yield ("beta nan", dict(layout="padded"), dict(beta=math.nan), "beta must be finite")
    yield ("beta tensor inf", dict(layout="padded", beta=torch.tensor(0.1)), dict(beta=torch.tensor(math.inf)),
           "beta must be finite")
    del g


@pytest.mark.parametrize("backend", LOSS_BACKENDS)
@pytest.mark.parametrize("name, valid, bad, message", list(_loss_bad_values()), ids=[c[0] for c in _loss_bad_values()])
def test_a_planned_loss_call_checks_every_value_as_the_first_call_does(name, valid, bad, message, backend):
    from kl_kernels import kl_penalty_loss

    plans.clear()
    valid = dict(valid)
    layout = valid.pop("layout")
    lp, old, adv, kw = _loss_call(layout, torch.Generator().manual_seed(0), **valid)
    kw["backend"] = backend
    bad_kw = dict(kw, **bad)
    with pytest.raises(ValueError, match=message) as cold:
        kl_penalty_loss(lp, old, adv, **bad_kw)
    kl_penalty_loss(lp, old, adv, **kw), kl_penalty_loss(lp, old, adv, **kw)  # planned
    with pytest.raises(ValueError, match=message) as warm:
        kl_penalty_loss(lp, old, adv, **bad_kw)
    assert str(warm.value) == str(cold.value)
    out = torch.empty(lp.shape)
    kl_penalty_loss(lp, old, adv, out=out, **kw), kl_penalty_loss(lp, old, adv, out=out, **kw)
    with pytest.raises(ValueError, match="out overlaps old_log_probs"):
        kl_penalty_loss(lp, old, adv, out=old, **kw)


def test_the_copied_loss_struct_holds_what_the_launcher_fills_for_the_same_tensors():
    from kl_kernels.kl_penalty import launch
    from kl_kernels.kl_penalty.ops import _fused_args
    from kl_kernels.kl_penalty.problem import build_problem

    def problem(seed):
        lp, old, adv, kw = _loss_call("padded", torch.Generator().manual_seed(seed), beta=torch.tensor(0.3))
        opts = dict(offsets=None, lengths=None, padding_side="left", clip_epsilon=None, entropy=None,
                    entropy_coef=0.0, aggregation="token-mean", norm_length=None)
        opts.update(kw)
        return build_problem(lp, old, adv, **opts)[0]

    first, second = problem(0), problem(1)
    plan = launch.TotalsPlan(_fused_args(first, cpu_kernel=True))
    fb = _fused_args(second, cpu_kernel=True)
    grad, _, _, _, got, _ = plan(*fb[:8], fb[8], fb[19])
    _, want, _ = launch._prepare_forward(*fb)
    want.grad = grad.data_ptr()

    def fields(x):
        return {f: getattr(x, f) for f in dir(x) if not f.startswith("_") and not callable(getattr(x, f))}
    g, w = fields(got), fields(want)
    for name in w:
        if name in ("g", "est"):
            continue
        if name == "beta":  # (_prepare_forward's own float32 copy of a beta tensor: same values)
            continue
        assert g[name] == w[name], name
    gg, wg = fields(got.g), fields(want.g)
    for name in wg:
        if name == "est":
            assert fields(got.g.est) == fields(want.g.est)
        else:
            assert gg[name] == wg[name], f"g.{name}"


@pytest.mark.cuda_emulated
def test_the_copied_device_struct_holds_what_the_launcher_fills_for_the_same_tensors():
    """api.py's _DevicePlan: the launcher's AggregatedPlan, built from one call, run for another call of
    the same signature, leaves the struct (the backward's) as forward_aggregated fills it for that call's
    tensors, but for the addresses of the outputs each allocates."""
    from kl_kernels.kl_penalty import launch
    from kl_kernels.kl_penalty.aggregate import device_weight
    from kl_kernels.kl_penalty.ops import _fused_args
    from kl_kernels.kl_penalty.problem import build_problem

    def problem(seed):
        lp, old, adv, kw = _loss_call("padded", torch.Generator().manual_seed(seed), beta=torch.tensor(0.3))
        opts = dict(offsets=None, lengths=None, padding_side="left", clip_epsilon=None, entropy=None,
                    entropy_coef=0.0, aggregation="token-mean", norm_length=None)
        opts.update(kw)
        return build_problem(lp, old, adv, **opts)[0]

    first, second = problem(0), problem(1)
    scale, per_token, seq_mean, _ = device_weight(first, None)
    plan = launch.AggregatedPlan(_fused_args(first), scale, per_token, seq_mean, first.entropy_coef,
                                 ext=launch.EMULATED)
    fb = _fused_args(second)
    loss, rest, n, weight, grad, _, _, got, _ = plan(*fb[:4], *fb[5:9], 0.0)
    want_loss, want_rest, want_n, _, _, _, _, want, _ = launch.forward_aggregated(
        fb, scale, per_token, seq_mean, None, 0.0, second.entropy_coef, ext=launch.EMULATED)
    torch.testing.assert_close((loss, rest, n), (want_loss, want_rest, want_n))

    def fields(x):
        return {f: getattr(x, f) for f in dir(x) if not f.startswith("_") and not callable(getattr(x, f))}
    g, w = fields(got), fields(want)
    for name in w:
        if name in ("g", "est", "grad", "count", "result_weight", "beta"):  # (outputs: each call's own)
            continue
        assert g[name] == w[name], name
    gg, wg = fields(got.g), fields(want.g)
    for name in wg:
        if name == "est":
            assert fields(got.g.est) == fields(want.g.est)
        else:
            assert gg[name] == wg[name], f"g.{name}"


def test_nested_tensors_are_never_planned():
    """A strided nested tensor is a plain ``torch.Tensor`` whose signature (plans.facts) is its type alone:
    a plan made from one call would run another nested batch of other lengths with the first's geometry
    (and without offsets). Every nested call takes the general path and matches the reference."""
    plans.clear()
    for lengths in ([3, 0, 4], [1], [5, 2], [0]):
        g = torch.Generator().manual_seed(len(lengths))
        lp, ref = ([-torch.rand(n, generator=g) for n in lengths] for _ in range(2))
        nlp, nref = (torch.nested.nested_tensor(x, layout=torch.strided) for x in (lp, ref))
        got = kl_reward(nlp, nref, coef=0.5, estimator="k3")
        want = kl_reward(nlp, nref, coef=0.5, estimator="k3", backend="torch")
        torch.testing.assert_close(got.kl_sum, want.kl_sum)
        for a, b in zip(got.kl.unbind(), want.kl.unbind()):
            torch.testing.assert_close(a, b)


def test_a_call_keeps_no_reference_to_its_process_group_or_tensor_counts():
    """A plan signature holds only values (options, tensors' facts): a process group or a tensor-valued count
    kept in an op's plan cache would outlive the call. The group would outlive ``destroy_process_group``
    and be torn down at interpreter exit, after gloo's threads (``terminate called without an active
    exception``: the 2-rank test's workers aborted that way on torch 2.15.0), and a CUDA count tensor
    would stay allocated."""
    import torch.distributed as dist

    from kl_kernels import kl_penalty_loss

    if not dist.is_available():
        pytest.skip("torch.distributed is not available in this torch build")
    lp, old, adv, kw = _loss_call("padded", torch.Generator().manual_seed(5))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        group = dist.new_group([0])
        before = sys.getrefcount(group)
        for _ in range(3):
            kl_penalty_loss(lp, old, adv, **kw, process_group=group).loss.backward()
        assert sys.getrefcount(group) == before, "a kl_penalty_loss call kept a reference to its process_group"
    finally:
        dist.destroy_process_group()
    n = torch.tensor(1000)
    before = sys.getrefcount(n)
    for _ in range(3):
        kl_penalty_loss(lp, old, adv, **kw, num_global_tokens=n).loss.backward()
    assert sys.getrefcount(n) == before, "a kl_penalty_loss call kept a reference to its num_global_tokens tensor"


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("name", CASES[:4])
def test_the_launchers_plan_under_autograd_and_compile_matches_the_reference(name, compiled, monkeypatch):
    """kl_reward's launcher keeps a ForwardPlan per signature (kl_reward/launch.py's forward): what the op
    ``kl_kernels::kl_reward_fwd`` runs under autograd and inside a torch.compile'd graph, where api.py's
    plans do not reach. On fresh tensors and values of one signature: the reference's values and gradients,
    and from the second call on the struct is not filled again (make_args runs for the first call only)."""
    from kl_kernels.kl_reward import launch

    plans.clear()
    filled = []
    real = launch.make_args
    monkeypatch.setattr(launch, "make_args", lambda *a, **k: filled.append(1) or real(*a, **k))

    def f(*args, **kw):
        return kl_reward(*args, **kw)
    run = torch.compile(f, dynamic=False) if compiled else f
    for seed in range(4):
        args, kw = _case(name, torch.Generator().manual_seed(seed))
        lp = args[0].clone().requires_grad_()
        lp_ref = args[0].clone().requires_grad_()
        got = run(lp, *args[1:], detach=False, **kw)
        want = kl_reward(lp_ref, *args[1:], backend="torch", detach=False, **kw)
        torch.testing.assert_close(got.reward, want.reward, rtol=1e-5, atol=1e-6, equal_nan=True)
        torch.testing.assert_close(got.kl, want.kl, rtol=1e-5, atol=1e-6, equal_nan=True)
        got.reward.sum().backward()
        want.reward.sum().backward()
        torch.testing.assert_close(lp.grad, lp_ref.grad, rtol=1e-5, atol=1e-6, equal_nan=True)
        if seed == 0:
            filled.clear()
    # (the backward's launcher fills its struct every call: one make_args per backward; the packed case's
    # token count differs per seed: a new signature, planned anew, every call)
    assert len(filled) == (3 if name.startswith("padded") else 6), f"the forward's struct was filled again: {len(filled) - 3} times in 3 planned calls"


@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("how", ["compiled", "eager, aggregation='none'"])
def test_the_loss_launchers_plans_match_the_reference(how, layout, monkeypatch):
    """kl_penalty_loss's launcher keeps a ForwardPlan and a BackwardPlan per signature (kl_penalty/launch.py):
    what the ops ``kl_kernels::kl_penalty_fwd``/``_bwd`` run inside a torch.compile'd graph and on the
    general path. On fresh tensors and values of one signature: the reference's values and gradients, and
    the structs filled for the first call only."""
    from kl_kernels import kl_penalty_loss
    from kl_kernels.kl_penalty import launch

    plans.clear()
    filled = []
    for name in ("_prepare_forward", "_args"):
        real = getattr(launch, name)
        monkeypatch.setattr(launch, name, lambda *a, _real=real, _name=name, **k: filled.append(_name) or _real(*a, **k))
    over = dict(aggregation="none") if how.startswith("eager") else {}

    def f(lp, old, adv, **kw):
        return kl_penalty_loss(lp, old, adv, **kw, **over).loss
    run = torch.compile(f, dynamic=False) if how == "compiled" else f
    for seed in range(4):
        g = torch.Generator().manual_seed(seed)
        lp, old, adv, kw = _loss_call(layout, g, beta=float(torch.rand((), generator=g)))
        ref_lp = lp.detach().clone().requires_grad_()
        got = run(lp, old, adv, **kw)
        want = kl_penalty_loss(ref_lp, old, adv, backend="torch", **kw, **over).loss
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=f"seed {seed}")
        weights = torch.rand(got.shape, generator=g)
        (g_got,) = torch.autograd.grad(got, lp, weights)
        (g_want,) = torch.autograd.grad(want, ref_lp, weights)
        torch.testing.assert_close(g_got, g_want, rtol=1e-5, atol=1e-6, msg=f"seed {seed}")
        if seed == 0:
            assert filled, "the first call did not reach the launcher"
            filled.clear()
    assert not filled, f"the launcher filled a struct again in planned calls: {filled}"
