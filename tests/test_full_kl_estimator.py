"""``estimator="full"`` of kl_reward and kl_penalty_loss (kl_kernels/full_estimator.py): the exact KL
from both models' logits, as a per-token estimate, against a float64 oracle built from test_full_kl's
row oracle (Python floats): which tokens count (lengths, both padding sides, mask, prompt_lens, empty
and one-token sequences), coef/beta, the reward's placement, every aggregation, clamp_output,
weight_kl, temperature, the gradients to the logits (none through tokens that do not count, NaN
there included), every backend; and the arguments "full" refuses, by name."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import CUDA_EMULATED, backend_device
from kl_kernels import full_kl, kl_penalty_loss, kl_reward
from test_full_kl import oracle_row

# Triton's full_kl kernels meet the oracle in test_full_kl.py; here (the wiring, the same for every
# backend) the interpreter runs one batch, test_triton_agrees_with_cpu: a minute of hypothesis examples
# through it would test the interpreter's speed.
BACKENDS = ["torch", "cpu", CUDA_EMULATED, pytest.param("cuda", marks=pytest.mark.cuda)]
NAN = math.nan


@st.composite
def batches(draw, dtypes=(torch.float32, torch.bfloat16)):
    """Padded ``[B, T, V]`` or packed ``[N, V]`` logits of both models, ragged, with NaN in single
    tokens (counted or not), the mask and the lengths."""
    dtype = draw(st.sampled_from(list(dtypes)))
    vocab = draw(st.sampled_from([1, 5, 33, 300]))
    lens = draw(st.lists(st.integers(0, 5), min_size=1, max_size=4))
    layout = draw(st.sampled_from(["padded", "packed"]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    shape = (len(lens), max(lens)) if layout == "padded" else (sum(lens),)
    x = torch.randn(*shape, vocab, generator=g, dtype=torch.float64) * draw(st.sampled_from([0.5, 3.0, 30.0]))
    r = x + torch.randn(*shape, vocab, generator=g, dtype=torch.float64)
    mask = torch.rand(*shape, generator=g) < 0.8 if draw(st.booleans()) else None
    for _ in range(draw(st.integers(0, 2))):  # NaN in one token of either model, counted or not
        flat = (x if draw(st.booleans()) else r).view(-1, vocab)
        if flat.shape[0]:
            flat[int(torch.randint(0, flat.shape[0], (), generator=g)), 0] = NAN
    side = draw(st.sampled_from(["left", "right"]))
    # logit_scale= / softcap= (full_kl's transform, passed through): none half the time
    scale, cap = draw(st.sampled_from([(1.0, None), (1.0, None), (2.0, None), (0.5, 5.0), (1.0, 10.0)]))
    transform = {} if (scale, cap) == (1.0, None) else dict(logit_scale=scale, softcap=cap)
    return dict(logits=x.to(dtype), ref=r.to(dtype), lens=lens, layout=layout, mask=mask, side=side,
                temperature=draw(st.sampled_from([1.0, 0.7])), transform=transform)


def _layout_args(b, device="cpu"):
    lens = torch.tensor(b["lens"], device=device)
    if b["layout"] == "padded":
        return dict(lengths=lens, padding_side=b["side"])
    return dict(offsets=torch.cat([torch.zeros(1, dtype=torch.int64, device=device), lens.cumsum(0)]))


def _counted(b) -> torch.Tensor:
    """Which tokens count, from first principles (the layout's valid tokens, in the mask)."""
    if b["layout"] == "padded":
        width = max(b["lens"])
        col = torch.arange(width)
        rows = [(col >= width - n) if b["side"] == "left" else (col < n) for n in b["lens"]]
        valid = torch.stack(rows)
    else:
        valid = torch.ones(sum(b["lens"]), dtype=torch.bool)
    return valid if b["mask"] is None else valid & b["mask"]


def _seq_of_token(b) -> list:
    if b["layout"] == "padded":
        return [[i] * max(b["lens"]) for i in range(len(b["lens"]))]
    return [i for i, n in enumerate(b["lens"]) for _ in range(n)]


def _oracle_rows(b):
    """Per token: (KL, d KL / d logits) in float64, from the row oracle."""
    vocab = b["logits"].shape[-1]
    xs = b["logits"].double().reshape(-1, vocab).tolist()
    rs = b["ref"].double().reshape(-1, vocab).tolist()
    out = [oracle_row(x, r, b["temperature"], -math.inf, **b["transform"]) for x, r in zip(xs, rs)]
    return [o[0] for o in out], [o[1] for o in out]


def _close(got: float, want: float, tol: float, what: str):
    if math.isnan(want):
        assert math.isnan(got), f"{what}: {got}, want NaN"
    else:
        assert abs(got - want) <= tol * (1.0 + abs(want)), f"{what}: {got}, want {want}"


def _tol(dtype):
    return 2e-5 if dtype == torch.float32 else 2e-2


def _device_batch(b, backend):
    dev = backend_device(backend)
    return {**b, "logits": b["logits"].to(dev), "ref": b["ref"].to(dev),
            "mask": None if b["mask"] is None else b["mask"].to(dev)}


@pytest.mark.parametrize("backend", BACKENDS)
@given(b=batches())
@settings(max_examples=20, deadline=None)
def test_kl_reward_matches_the_oracle(b, backend):
    dev_b = _device_batch(b, backend)
    logits = dev_b["logits"].clone().requires_grad_()
    ref = dev_b["ref"].clone()
    before = (logits.detach().clone(), ref.clone())
    coef = torch.rand(len(b["lens"]), dtype=torch.float32) + 0.5
    score = torch.randn(len(b["lens"]), dtype=torch.float32)
    out = kl_reward(logits, ref, score.to(logits.device), coef=coef.to(logits.device), estimator="full",
                    mask=dev_b["mask"], reward_placement="last_valid", detach=False, backend=backend,
                    temperature=b["temperature"], **b["transform"], **_layout_args(b, logits.device))
    assert out.kl.dtype == torch.float32 and out.kl.shape == logits.shape[:-1]
    assert out.ref_log_probs is None
    up = torch.randn(out.kl.shape, generator=torch.Generator().manual_seed(1))
    (grad,) = torch.autograd.grad((out.kl * up.to(out.kl.device)).sum(), [logits])
    assert torch.equal(logits.detach().nan_to_num(), before[0].nan_to_num()), "the logits were modified"
    assert torch.equal(ref.nan_to_num(), before[1].nan_to_num()), "the reference logits were modified"

    kls, dkls = _oracle_rows(b)
    counted = _counted(b).reshape(-1).tolist()
    seq = torch.tensor(_seq_of_token(b)).reshape(-1).tolist()
    got, got_r = out.kl.detach().cpu().reshape(-1).tolist(), out.reward.detach().cpu().reshape(-1).tolist()
    got_g = grad.double().cpu().reshape(len(counted), grad.shape[-1]).tolist()
    ups = up.reshape(-1).tolist()
    tol = _tol(b["logits"].dtype)
    for t, c in enumerate(counted):
        if not c:
            assert got[t] == 0.0, f"token {t} does not count: kl {got[t]}"
            assert all(v == 0.0 for v in got_g[t]), f"token {t} does not count, yet has a gradient"
            continue
        _close(got[t], kls[t], tol, f"kl[{t}]")
        for j, (a, d) in enumerate(zip(got_g[t], dkls[t])):
            _close(a, ups[t] * d, 4 * tol, f"d logits[{t}, {j}]")
    # reward = -coef_b * kl_t, the score added at each sequence's last valid token
    last = {}
    for t, s in enumerate(seq):
        if s < len(b["lens"]) and b["lens"][s] and (b["layout"] == "packed" or _valid(b, t)):
            last[s] = t
    for t, s in enumerate(seq):
        want = -float(coef[s]) * (kls[t] if counted[t] else 0.0) + (float(score[s]) if last.get(s) == t else 0.0)
        if b["layout"] == "padded" and not _valid(b, t):
            want = 0.0
        _close(got_r[t], want, tol, f"reward[{t}]")


def _valid(b, t):
    width = max(b["lens"])
    row, col = divmod(t, width)
    n = b["lens"][row]
    return col >= width - n if b["side"] == "left" else col < n


AGGREGATIONS = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "sum", "none"]


@pytest.mark.parametrize("backend", BACKENDS)
@given(b=batches(), aggregation=st.sampled_from(AGGREGATIONS), weight_kl=st.booleans(),
       clamp_output=st.sampled_from([None, (None, 1.0)]), kl_aggregation=st.sampled_from([None, "token-mean"]))
@settings(max_examples=20, deadline=None)
def test_kl_penalty_loss_adds_the_exact_kl_term(b, backend, aggregation, weight_kl, clamp_output, kl_aggregation):
    """loss(full) = loss without a KL term + beta * aggregate(kl_t) (kl_t the oracle's, clamped and
    weighted), and its gradient to the logits is the KL term's, through counted tokens only."""
    if aggregation == "none":
        kl_aggregation = None
    dev_b = _device_batch(b, backend)
    dev = dev_b["logits"].device
    g = torch.Generator().manual_seed(2)
    shape = b["logits"].shape[:-1]
    lp = torch.randn(shape, generator=g) - 1.0
    old = (lp + 0.1 * torch.randn(shape, generator=g)).to(dev)
    lp = lp.to(dev).requires_grad_()
    adv = torch.randn(len(b["lens"]), 1, generator=g).to(dev)
    weights = (torch.rand(shape, generator=g) + 0.5).to(dev)
    beta = 0.3
    logits = dev_b["logits"].clone().requires_grad_()
    common = dict(clip_epsilon=0.2, mask=dev_b["mask"], weights=weights, aggregation=aggregation,
                  norm_length=None, kl_aggregation=kl_aggregation,
                  **_layout_args(b, dev))
    out = kl_penalty_loss(lp, old, adv, beta=beta, estimator="full", logits=logits, ref_logits=dev_b["ref"],
                          temperature=b["temperature"], weight_kl=weight_kl, clamp_output=clamp_output,
                          backend=backend, **b["transform"], **common)
    base = kl_penalty_loss(lp, old, adv, beta=0.0, backend="torch", **common)

    kls, dkls = _oracle_rows(b)
    counted = _counted(b).reshape(-1).tolist()
    seq = torch.tensor(_seq_of_token(b)).reshape(-1).tolist()
    w = weights.cpu().double().reshape(-1).tolist()
    n_tok = max(sum(counted), 1)
    n_seq = len(b["lens"])
    per_seq_n = [sum(1 for t, c in enumerate(counted) if c and seq[t] == s) for s in range(n_seq)]

    def term_weight(t):  # the aggregation's weight of token t's KL term
        agg = kl_aggregation or aggregation
        return {"token-mean": 1.0 / n_tok, "seq-mean-token-mean": 1.0 / (max(per_seq_n[seq[t]], 1) * n_seq),
                "seq-mean-token-sum": 1.0 / n_seq, "sum": 1.0, "none": 1.0}[agg]

    def kl_t(t):  # the KL term's value and d value / d KL at a counted token
        k, slope = kls[t], 1.0
        if clamp_output is not None and k > clamp_output[1]:
            k, slope = clamp_output[1], 0.0
        return (k * w[t], slope * w[t]) if weight_kl else (k, slope)

    tol = _tol(b["logits"].dtype)
    if aggregation == "none":
        up = torch.randn(shape, generator=torch.Generator().manual_seed(3)).to(dev)
        (gl,) = torch.autograd.grad((out.loss * up).sum(), [logits])
        got = (out.loss - base.loss).detach().cpu().reshape(-1).tolist()
        got_kl = out.loss_kl.detach().cpu().reshape(-1).tolist()
        ups = up.cpu().reshape(-1).tolist()
        for t, c in enumerate(counted):
            want = beta * kl_t(t)[0] if c else 0.0
            _close(got[t], want, tol, f"loss_t[{t}] - its objective")
            _close(got_kl[t], want, tol, f"loss_kl[{t}]")
        scale = ups
    else:
        (gl,) = torch.autograd.grad(out.loss, [logits])
        want = sum(beta * term_weight(t) * kl_t(t)[0] for t, c in enumerate(counted) if c)
        _close(float(out.loss - base.loss), want, tol, "loss - objective")
        _close(float(out.loss_kl), want, tol, "loss_kl")
        _close(float(out.loss_objective), float(base.loss_objective), 1e-6, "loss_objective")
        scale = [1.0] * len(counted)
    kl_mean = sum(kl_t(t)[0] for t, c in enumerate(counted) if c) / n_tok
    _close(float(out.kl_mean), kl_mean, tol, "kl_mean")
    got_g = gl.double().cpu().reshape(len(counted), gl.shape[-1]).tolist()
    for t, c in enumerate(counted):
        if not c:
            assert all(v == 0.0 for v in got_g[t]), f"token {t} does not count, yet its logits have a gradient"
            continue
        k_w = beta * kl_t(t)[1] * (term_weight(t) if aggregation != "none" else 1.0) * scale[t]
        for j, (a, d) in enumerate(zip(got_g[t], dkls[t])):
            _close(a, k_w * d, 4 * tol, f"d logits[{t}, {j}]")
    # the policy term's gradient is the base call's: the KL term reads no log-prob
    (g_full,) = torch.autograd.grad(out.loss.sum(), [lp])
    (g_base,) = torch.autograd.grad(base.loss.sum(), [lp])
    torch.testing.assert_close(g_full, g_base, rtol=1e-5, atol=1e-6, equal_nan=True)


@pytest.mark.triton
def test_triton_agrees_with_cpu():
    g = torch.Generator().manual_seed(5)
    x, r = torch.randn(3, 4, 300, generator=g), torch.randn(3, 4, 300, generator=g)
    lens, lp = torch.tensor([4, 1, 0]), torch.randn(3, 4, generator=g)
    results = {}
    for backend in ("cpu", "triton"):
        dev = backend_device(backend)
        xl = x.to(dev).requires_grad_()
        rw = kl_reward(xl, r.to(dev), estimator="full", lengths=lens.to(dev), detach=False, backend=backend)
        loss = kl_penalty_loss(lp.to(dev), lp.to(dev), torch.ones(3, device=dev), beta=0.5, estimator="full",
                               logits=xl, ref_logits=r.to(dev), lengths=lens.to(dev), backend=backend).loss
        (grad,) = torch.autograd.grad(rw.kl.sum() + loss, [xl])
        results[backend] = [t.detach().cpu() for t in (rw.kl, rw.reward, loss, grad)]
    for a, b in zip(results["cpu"], results["triton"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_the_sampled_k1_of_exact_log_probs_is_not_the_full_kl():
    """"full" is not an alias of a sampled estimator: on a batch where the sampled tokens' k1 and
    the exact KL differ, kl_reward gives the exact one (full_kl's)."""
    g = torch.Generator().manual_seed(0)
    x, r = torch.randn(2, 4, 7, generator=g), torch.randn(2, 4, 7, generator=g)
    out = kl_reward(x, r, estimator="full")
    torch.testing.assert_close(out.kl, full_kl(x, r), rtol=0, atol=0)
    labels = torch.zeros(2, 4, 1, dtype=torch.int64)
    k1 = (x.log_softmax(-1) - r.log_softmax(-1)).gather(-1, labels).squeeze(-1)
    assert not torch.allclose(out.kl, k1)


def test_detach_true_gives_no_graph_and_kl_dtype_widens():
    x, r = torch.randn(3, 5, requires_grad=True), torch.randn(3, 5)
    out = kl_reward(x, r, estimator="full", offsets=torch.tensor([0, 1, 3]))
    assert not out.kl.requires_grad and out.kl.dtype == torch.float32
    wide = kl_reward(x.detach().bfloat16(), r.bfloat16(), estimator="full", offsets=torch.tensor([0, 1, 3]),
                     kl_dtype=torch.float64)
    assert wide.kl.dtype == torch.float64


def test_prompt_lens_and_out_buffers():
    x, r = torch.randn(2, 4, 9), torch.randn(2, 4, 9)
    kl, reward = torch.full((2, 4), NAN), torch.full((2, 4), NAN)
    out = kl_reward(x, r, estimator="full", prompt_lens=torch.tensor([1, 3]), padding_side="right",
                    out=(kl, reward, None, None, None))
    assert out.kl is kl and out.reward is reward
    want = full_kl(x, r)
    want[0, :1], want[1, :3] = 0, 0
    torch.testing.assert_close(kl, want, rtol=0, atol=0)


@pytest.mark.parametrize("call, error, match", [
    (lambda x, r: kl_reward(x, r, estimator="full", clamp_input=(-20, 20)), ValueError, "clamp_input"),
    (lambda x, r: kl_reward(x, r, estimator="full", return_ref=True), ValueError, "return_ref"),
    (lambda x, r: kl_reward(x, r, estimator="full", mask_nan=True), ValueError, "mask_nan"),
    (lambda x, r: kl_reward(list(x), list(r), estimator="full"), TypeError, "dense logits"),
    (lambda x, r: kl_reward(x[..., 0], r[..., 0], estimator="k1", temperature=0.5), ValueError, "temperature"),
    (lambda x, r: kl_reward(x, r, estimator="full", temperature=0.0), ValueError, "temperature"),
    (lambda x, r: kl_reward(x[..., 0], r[..., 0], estimator="k3", softcap=30.0), ValueError,
     "softcap applies to estimator='full'"),
    (lambda x, r: kl_reward(x, r, estimator="full", softcap=0.0), ValueError, "softcap must be None"),
    (lambda x, r: kl_reward(x, r, estimator="full", logit_scale=float("inf")), ValueError, "logit_scale must be"),
    (lambda x, r: kl_penalty_loss(x[..., 0], x[..., 0], torch.ones(2), logit_scale=2.0), ValueError,
     "logit_scale applies to estimator='full'"),
    (lambda x, r: kl_penalty_loss(x[..., 0], x[..., 0], torch.ones(2), estimator="full", logits=x, ref_logits=r,
                                  softcap=-1.0), ValueError, "softcap must be None"),
    (lambda x, r: kl_reward(x, r[:, :-1], estimator="full"), ValueError, "ref_logits"),
    (lambda x, r: kl_reward(x[0, 0], r[0, 0], estimator="full"), ValueError, r"log_probs must be logits \[N, V\]"),
    (lambda x, r: kl_penalty_loss(x[..., 0], x[..., 0], torch.ones(2), estimator="full"), ValueError,
     "needs logits= and ref_logits="),
    (lambda x, r: kl_penalty_loss(x[..., 0], x[..., 0], torch.ones(2), logits=x, ref_logits=r), ValueError,
     "logits is read by estimator='full' only"),
    (lambda x, r: kl_penalty_loss(x[..., 0], x[..., 0], torch.ones(2), estimator="full", logits=x, ref_logits=r,
                                  ref_log_probs=x[..., 0]), ValueError, "ref_log_probs has no meaning"),
    (lambda x, r: kl_penalty_loss(x[..., 0], x[..., 0], torch.ones(2), estimator="full", logits=x, ref_logits=r,
                                  kl_times_ratio=True), ValueError, "kl_times_ratio"),
    (lambda x, r: kl_penalty_loss(x[..., 0], x[..., 0], torch.ones(2), estimator="full", logits=x[:, :-1],
                                  ref_logits=r[:, :-1]), ValueError, r"logits must have the log-probs' shape \[2, 3\]"),
    (lambda x, r: kl_penalty_loss(list(x[..., 0]), list(x[..., 0]), torch.ones(2), estimator="full", logits=x,
                                  ref_logits=r), TypeError, "list batch"),
    (lambda x, r: kl_penalty_loss(x[..., 0], x[..., 0], torch.ones(2), estimator="full", logits=x.to("meta"),
                                  ref_logits=r.to("meta")), ValueError, "logits must be on the log-probs' device"),
])
def test_bad_arguments_name_themselves(call, error, match):
    x, r = torch.randn(2, 3, 5), torch.randn(2, 3, 5)
    with pytest.raises(error, match=match):
        call(x, r)


def test_verl_full_mode_equals_kl_reward_full():
    """verl's kl_penalty(logits, ref_logits, "full") (our shim) and kl_reward's "full" agree."""
    from kl_kernels.integrations import verl

    x, r = torch.randn(2, 3, 6), torch.randn(2, 3, 6)
    torch.testing.assert_close(verl.kl_penalty(x, r, "full"), kl_reward(x, r, estimator="full").kl, rtol=0, atol=0)
