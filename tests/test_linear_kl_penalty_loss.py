"""linear_kl_penalty_loss (the loss from hidden states and LM heads) against kl_penalty_loss on log-probs of
materialized float64 logits: the loss, its parts and the gradients to the policy's hidden states, head and
bias, padded and packed, with the reference from hidden states or as log-probs, with the entropy term;
argument checks."""

from __future__ import annotations

import importlib

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from conftest import CUDA_EMULATED
from kl_kernels import kl_penalty_loss, linear_kl_penalty_loss


def _materialized(h, w, b, labels, counted, temperature, logit_scale=1.0, softcap=None):
    x = torch.nn.functional.linear(h, w, b) * logit_scale  # TRL's fused LM head: scale, cap, temperature
    logits = (x if softcap is None else softcap * torch.tanh(x / softcap)) / temperature
    logp = torch.log_softmax(logits, -1)
    lp = torch.where(counted, logp.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1), 0.0)
    ent = torch.where(counted, -(logp.exp() * logp).sum(-1), 0.0)
    return lp, ent


@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("ref_from", ["hidden", "log_probs", None])
@pytest.mark.parametrize("entropy_coef", [0.0, 0.01])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("one_pass", [True, False])
@pytest.mark.parametrize("transform", [(1.0, None), (0.5, 3.0)])
def test_matches_the_loss_on_materialized_logits(layout, ref_from, entropy_coef, with_bias, one_pass, transform):
    g = torch.Generator().manual_seed(hash((layout, ref_from, entropy_coef, with_bias)) % 2**31)
    shape = (3, 7) if layout == "padded" else (17,)
    H, H_ref, V, T = 12, 9, 60, 0.8
    h = torch.randn(*shape, H, generator=g, requires_grad=True)
    w = (torch.randn(V, H, generator=g) * 0.4).requires_grad_()
    b = torch.randn(V, generator=g, requires_grad=True) if with_bias else None
    rh, rw = torch.randn(*shape, H_ref, generator=g), torch.randn(V, H_ref, generator=g) * 0.4
    labels = torch.randint(0, V, shape, generator=g)
    labels[torch.rand(shape, generator=g) < 0.15] = -100
    mask = torch.rand(shape, generator=g) < 0.85
    counted = (labels != -100) & mask
    old = -torch.rand(shape, generator=g) * 4
    kwargs = dict(beta=0.05, estimator="k3", clip_epsilon=0.2, entropy_coef=entropy_coef, aggregation="token-mean")
    if layout == "packed":
        kwargs["offsets"] = torch.tensor([0, 5, 5, 12, 17])
        adv = torch.randn(4, 1, generator=g)
    else:
        adv = torch.randn(3, generator=g)
    ref_lp64, _ = _materialized(rh.double(), rw.double(), None, labels, counted, T, *transform)
    if ref_from == "hidden":
        ref_args = dict(ref_hidden=rh, ref_weight=rw)
    elif ref_from == "log_probs":
        ref_args = dict(ref_log_probs=ref_lp64.float())
    else:
        ref_args, kwargs["beta"] = {}, 0.0
    logit_scale, softcap = transform
    got = linear_kl_penalty_loss(h, w, labels, old, adv, bias=b, temperature=T, mask=mask, chunk_size=4,
                                 one_pass=one_pass, logit_scale=logit_scale, softcap=softcap, **ref_args, **kwargs)
    leaves = [t for t in (h, w, b) if t is not None]
    grads = torch.autograd.grad(got.loss, leaves)

    doubles = [t.detach().double().requires_grad_() for t in leaves]
    lp64, ent64 = _materialized(doubles[0], doubles[1], doubles[2] if with_bias else None, labels, counted, T,
                                *transform)
    want = kl_penalty_loss(lp64, old.double(), adv.double(), mask=counted, backend="torch",
                           ref_log_probs=ref_lp64 if ref_args else None,
                           entropy=ent64 if entropy_coef else None, **kwargs)
    wants = torch.autograd.grad(want.loss, doubles)
    torch.testing.assert_close(got.loss.double(), want.loss, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got.kl_mean.double(), want.kl_mean, rtol=1e-4, atol=1e-5)
    for name, a, e in zip(("hidden", "weight", "bias"), grads, wants):
        torch.testing.assert_close(a.double(), e, rtol=1e-4, atol=1e-5, msg=lambda m, name=name: f"d {name}: {m}")


@pytest.mark.parametrize("kwargs, match", [
    (dict(ref_hidden=torch.zeros(2, 3, 4)), "ref_hidden and ref_weight come together"),
    (dict(ref_weight=torch.zeros(10, 4)), "ref_hidden and ref_weight come together"),
    (dict(ref_bias=torch.zeros(10)), "ref_bias needs ref_hidden and ref_weight"),
    (dict(ref_hidden=torch.zeros(2, 3, 4), ref_weight=torch.zeros(10, 4), ref_log_probs=torch.zeros(2, 3)),
     "either as ref_hidden/ref_weight or as ref_log_probs"),
])
def test_bad_reference_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        linear_kl_penalty_loss(torch.zeros(2, 3, 8), torch.zeros(10, 8), torch.zeros(2, 3, dtype=torch.int64),
                               torch.zeros(2, 3), torch.zeros(2), **kwargs)


# Liger-Kernel 0.8.5's LigerFusedLinearGRPOLoss loss types as kl_penalty_loss arguments (TRL's GRPO formulas,
# python_api/kl_penalty_loss.md): grpo = mean over each sequence's tokens, then over all B sequences; bnpo =
# over all counted tokens; dr_grpo = sum / (B * max_completion_length); dapo = over the counted tokens (no
# num_items_in_batch: the batch's own).
LIGER_TYPES = {"grpo": dict(aggregation="seq-mean-token-mean"), "bnpo": dict(aggregation="token-mean"),
               "dr_grpo": dict(aggregation="seq-mean-token-sum-norm", norm_length=7),
               "dapo": dict(aggregation="token-mean")}


@pytest.mark.parametrize("loss_type", list(LIGER_TYPES))
@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("with_old", [False, True])
def test_parity_with_liger_fused_linear_grpo_loss(loss_type, beta, with_old):
    """The same GRPO step from hidden states through Liger-Kernel 0.8.5's LigerFusedLinearGRPOLoss (its CPU
    path, compiled=False) and through linear_kl_penalty_loss: loss and gradients to the hidden states, the
    LM head and its bias; the reference from its own hidden states and head (k3 to it, beta)."""
    import peers

    liger = peers.liger_grpo_loss()
    g = torch.Generator().manual_seed(7)
    B, T, H, V, temp = 3, 7, 16, 80, 0.8
    h = torch.randn(B, T, H, generator=g, requires_grad=True)
    w = (torch.randn(V, H, generator=g) * 0.5).requires_grad_()
    b = torch.randn(V, generator=g, requires_grad=True)
    rh, rw = torch.randn(B, T, H, generator=g), torch.randn(V, H, generator=g) * 0.5
    ids = torch.randint(0, V, (B, T), generator=g)
    attention = torch.ones(B, T)
    attention[1, 4:] = 0
    attention[2, 6:] = 0
    adv = torch.randn(B, generator=g)
    with torch.no_grad():
        now = torch.log_softmax((h @ w.t() + b) / temp, -1).gather(-1, ids[..., None])[..., 0]
    old = (now + 0.3 * torch.randn(B, T, generator=g)) if with_old else None

    loss_fn = liger.LigerFusedLinearGRPOLoss(beta=beta, compiled=False, use_ref_model=beta != 0.0, loss_type=loss_type,
                                             max_completion_length=T, temperature=temp, chunk_size=2)
    theirs = loss_fn(h, w, ids, attention, adv, bias=b, old_per_token_logps=old, ref_input=rh if beta else None,
                     ref_weight=rw if beta else None, ref_bias=None)[0]
    g_theirs = torch.autograd.grad(theirs, (h, w, b))

    ours = linear_kl_penalty_loss(h, w, ids, old if old is not None else now, adv, bias=b, temperature=temp,
                                  mask=attention.bool(), chunk_size=5, clip_epsilon=0.2, estimator="k3",
                                  beta=beta, **(dict(ref_hidden=rh, ref_weight=rw) if beta else {}),
                                  **LIGER_TYPES[loss_type]).loss
    g_ours = torch.autograd.grad(ours, (h, w, b))
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    for name, a, e in zip(("hidden", "weight", "bias"), g_ours, g_theirs):
        torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-6, msg=lambda m, name=name: f"d {name}: {m}")


ONE_PASS_AGGREGATIONS = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm",
                         "token-sum-norm", "sum"]


@st.composite
def loss_calls(draw):
    """A loss from hidden states with options drawn from everything one pass takes."""
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    layout = draw(st.sampled_from(["padded", "packed"]))
    lens = draw(st.lists(st.integers(0, 6), min_size=1, max_size=4))
    batch = len(lens)
    shape = (batch, max(max(lens), 1)) if layout == "padded" else (sum(lens),)
    H, V = 8, draw(st.sampled_from([1, 7, 40]))
    labels = torch.randint(0, V, shape, generator=g)
    labels[torch.rand(shape, generator=g) < 0.1] = -100
    kw = dict(beta=draw(st.sampled_from([0.0, 0.05, "per-sequence"])),
              estimator=draw(st.sampled_from(["k1", "k2", "k3", "k3+", "abs"])),
              clip_epsilon=draw(st.sampled_from([None, 0.2, (0.2, 0.28)])),
              dual_clip=draw(st.sampled_from([None, 3.0])),
              aggregation=draw(st.sampled_from(ONE_PASS_AGGREGATIONS)),
              entropy_coef=draw(st.sampled_from([0.0, 0.01])),
              kl_times_ratio=draw(st.booleans()),
              clamp_output=draw(st.sampled_from([None, (-10.0, 10.0)])))
    if kw["beta"] == "per-sequence":
        kw["beta"] = torch.rand(batch, generator=g) * 0.1
    if layout == "packed":
        kw["offsets"] = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
        if "norm" in kw["aggregation"]:
            kw["norm_length"] = 6.0
        adv = torch.randn(batch, 1, generator=g) if draw(st.booleans()) else torch.randn(shape, generator=g)
    else:
        kw["lengths"] = torch.tensor(lens)
        kw["padding_side"] = draw(st.sampled_from(["left", "right"]))
        adv = torch.randn(batch, generator=g) if draw(st.booleans()) else torch.randn(shape, generator=g)
    if draw(st.booleans()):
        kw["weights"] = torch.rand(shape, generator=g) + 0.5
        kw["weight_kl"] = draw(st.booleans())
    if kw["aggregation"] == "token-mean" and draw(st.booleans()):
        kw["num_global_tokens"] = 50
    if kw["aggregation"].startswith("seq-mean") and draw(st.booleans()):
        kw["num_sequences"] = "nonempty"
    ref = draw(st.sampled_from(["hidden", "log_probs", None]))
    if ref == "hidden":
        kw.update(ref_hidden=torch.randn(*shape, 5, generator=g), ref_weight=torch.randn(V, 5, generator=g))
    elif ref == "log_probs":
        kw["ref_log_probs"] = -torch.rand(shape, generator=g) * 3
    tensors = dict(hidden=torch.randn(*shape, H, generator=g), weight=torch.randn(V, H, generator=g) * 0.5,
                   bias=torch.randn(V, generator=g) if draw(st.booleans()) else None, labels=labels,
                   old=-torch.rand(shape, generator=g) * 3, adv=adv,
                   mask=(torch.rand(shape, generator=g) < 0.9) if draw(st.booleans()) else None)
    return tensors, kw, draw(st.sampled_from([1, 3, 64])), draw(st.sampled_from([1.0, 0.7]))


def _run(tensors, kw, chunk, temperature, one_pass, backend):
    h = tensors["hidden"].clone().requires_grad_()
    w = tensors["weight"].clone().requires_grad_()
    b = None if tensors["bias"] is None else tensors["bias"].clone().requires_grad_()
    out = linear_kl_penalty_loss(h, w, tensors["labels"], tensors["old"], tensors["adv"], bias=b, mask=tensors["mask"],
                                 temperature=temperature, chunk_size=chunk, one_pass=one_pass,
                                 logprobs_backend=backend, backend=backend, **kw)
    leaves = [t for t in (h, w, b) if t is not None]
    return out, torch.autograd.grad(out.loss, leaves)


def _one_token_vocabulary():
    """A vocabulary of one token (every log-prob 0, every gradient 0 in exact math), where two passes' logits,
    formed again in backward by a product of another shape, differ from the forward's by its rounding and so
    give d hidden ~2e-5, not 0 (CI, 2026-11-28, on cuda-emulated; with these inputs on torch)."""
    t = torch.tensor
    tensors = dict(hidden=t([[[0.3762, 0.3816, 1.9237, -0.0363, -1.0995, 1.9811, 0.0205, 0.2710],
                              [-1.7578, -0.3069, -0.9657, 1.4390, -0.4613, -0.7612, 1.2658, 0.9881],
                              [-1.4586, -1.8714, 0.1691, 0.3575, 0.0601, -0.0485, -1.2084, -1.1652],
                              [0.0919, -0.7607, 0.8859, -0.3480, -1.4050, 0.1369, -0.0657, -0.8351],
                              [-0.0615, -2.1366, -0.3814, -0.7010, -1.5622, -1.2260, 0.5612, 0.4441]]]),
                   weight=t([[0.9589, -0.1746, -0.7288, 1.2971, -0.0129, -1.3323, -1.5062, -0.4885]]), bias=None,
                   labels=t([[0, 0, 0, 0, 0]]), old=t([[-2.5098, -1.4196, -2.8796, -0.6208, -2.0425]]),
                   adv=t([1.9429]), mask=None)
    kw = dict(beta=t([0.0360]), estimator="k1", clip_epsilon=None, dual_clip=None, aggregation="sum",
              entropy_coef=0.0, kl_times_ratio=False, clamp_output=None, lengths=t([5]), padding_side="left",
              ref_hidden=t([[[3.0950, 2.0249, 0.0843, -0.5395, -0.2584], [-1.2432, -0.2289, -0.4655, -2.9303, 1.0725],
                             [0.1741, -0.4939, 0.1553, -1.1632, -0.2866], [1.7042, -0.2941, -0.8174, 1.4403, 0.3135],
                             [0.7214, -1.6212, 0.7938, -0.6085, 1.3073]]]),
              ref_weight=t([[-1.9337, -0.0543, -0.4630, 0.1831, -0.9288]]))
    return tensors, kw, 1, 0.7


@pytest.mark.parametrize("backend", ["torch", "cpu", CUDA_EMULATED])
@given(call=loss_calls())
@example(call=_one_token_vocabulary())
@settings(max_examples=20, deadline=None)
def test_one_pass_equals_two_passes(call, backend):
    """One pass (the loss's gradient into d hidden / d weight chunk by chunk, three matmuls per chunk) and
    two passes (log-probs, the loss, the logits again in backward): the loss, every part and diagnostic,
    and the gradients to hidden, weight and bias agree (up to float64 summation order), over layouts,
    aggregations, coefficients, estimators, clips, weights, references, entropy, kl_times_ratio and chunk
    sizes down to one token (chunks that count no token included)."""
    tensors, kw, chunk, temperature = call
    before = {k: None if v is None else v.clone() for k, v in tensors.items()}
    one, g_one = _run(tensors, kw, chunk, temperature, True, backend)
    two, g_two = _run(tensors, kw, chunk, temperature, False, backend)
    for name, a, e in zip(one._fields, one, two):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-7, msg=lambda m, name=name: f"{name}: {m}")
    # (float32 sums in another order: one pass adds each chunk's d weight into an accumulator, two passes
    # walk the vocabulary and take each slice's d weight from one product over all tokens. And two passes form
    # the logits again in backward with a product of another shape (all tokens against a vocabulary slice, not
    # a chunk of tokens against all of it), so those differ from the forward's by ulps of sum_k |h_k w_k| / T,
    # and p = e^(z - lse) with them: the absolute bound grows with that scale, as a one-token vocabulary shows,
    # where every exact gradient is 0.)
    h, w = tensors["hidden"].reshape(-1, tensors["hidden"].shape[-1]), tensors["weight"]
    zscale = float((h.abs() @ w.abs().T).max()) / temperature if h.numel() and w.numel() else 0.0
    for name, a, e in zip(("hidden", "weight", "bias"), g_one, g_two):
        torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-5 * max(1.0, zscale),
                                   msg=lambda m, name=name: f"d {name}: {m}")
    for k, v in tensors.items():
        assert v is None or torch.equal(v, before[k]), f"{k} was modified"


def test_one_pass_forms_each_chunks_logits_once(monkeypatch):
    """Three products with the policy's head per chunk (the logits, d hidden, d weight) and one with the
    reference's, against four and one in two passes: counted at torch's linear and matmul."""
    linear_mod = importlib.import_module("kl_kernels.token_logprobs.linear")

    calls = {"linear": 0}
    real = torch.nn.functional.linear

    def counting(*args, **kwargs):
        calls["linear"] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(linear_mod.torch.nn.functional, "linear", counting)
    g = torch.Generator().manual_seed(0)
    h, w = torch.randn(2, 6, 8, generator=g, requires_grad=True), torch.randn(30, 8, generator=g, requires_grad=True)
    args = (h, w, torch.randint(0, 30, (2, 6), generator=g), -torch.rand(2, 6, generator=g), torch.randn(2, generator=g))
    ref = dict(ref_hidden=h.detach() * 0.5, ref_weight=w.detach(), beta=0.1, chunk_size=4)
    for one_pass, logits_per_chunk in ((True, 2), (False, 3)):  # 12 tokens: 3 chunks
        calls["linear"] = 0
        linear_kl_penalty_loss(*args, one_pass=one_pass, **ref).loss.backward()
        assert calls["linear"] == 3 * logits_per_chunk, (one_pass, calls)


@pytest.mark.parametrize("kwargs, reason", [
    (dict(importance_sampling_level="sequence"), "GSPO"),
    (dict(aggregation="none"), "aggregation='none'"),
    (dict(aggregation="seq-mean-token-mean", kl_aggregation="token-mean"), "kl_aggregation weighs its term apart"),
    (dict(entropy=torch.zeros(2, 3), entropy_coef=0.1), "entropy: a caller's entropy tensor"),
    (dict(out=torch.zeros(2, 3)), "out: "),
])
def test_one_pass_says_why_it_cannot_run_and_auto_takes_two(kwargs, reason):
    g = torch.Generator().manual_seed(1)
    args = (torch.randn(2, 3, 4, generator=g), torch.randn(9, 4, generator=g), torch.randint(0, 9, (2, 3), generator=g),
            -torch.rand(2, 3, generator=g), torch.randn(2, generator=g))
    with pytest.raises(ValueError, match="one_pass=True: this loss needs two passes: .*" + reason):
        linear_kl_penalty_loss(*args, one_pass=True, **kwargs)
    auto = linear_kl_penalty_loss(*args, **kwargs)
    two = linear_kl_penalty_loss(*args, one_pass=False, **kwargs)
    torch.testing.assert_close(auto.loss, two.loss, rtol=0, atol=0)


def test_one_pass_checks_the_loss_arguments_before_any_matmul(monkeypatch):
    linear_mod = importlib.import_module("kl_kernels.token_logprobs.linear")

    monkeypatch.setattr(linear_mod.torch.nn.functional, "linear", lambda *a, **k: pytest.fail("a matmul ran"))
    with pytest.raises(ValueError, match="clip_epsilon"):
        linear_kl_penalty_loss(torch.zeros(2, 3, 4), torch.zeros(9, 4), torch.zeros(2, 3, dtype=torch.int64),
                               torch.zeros(2, 3), torch.zeros(2), clip_epsilon=-0.1)
    with pytest.raises(ValueError, match="old_log_probs must be on hidden's device"):
        linear_kl_penalty_loss(torch.zeros(2, 3, 4), torch.zeros(9, 4), torch.zeros(2, 3, dtype=torch.int64),
                               torch.zeros(2, 3, device="meta"), torch.zeros(2, device="meta"))
    with pytest.raises(TypeError, match="one_pass"):
        linear_kl_penalty_loss(torch.zeros(2, 3, 4), torch.zeros(9, 4), torch.zeros(2, 3, dtype=torch.int64),
                               torch.zeros(2, 3), torch.zeros(2), one_pass="yes")
