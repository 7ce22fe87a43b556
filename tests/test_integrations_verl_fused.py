"""kl_kernels.integrations.verl.patch_fused_kernels inside verl 0.9.1's own fused forward.

A tiny Qwen2 model built from a config (hidden 64, 2 layers, vocabulary 300; no download) is patched by verl's own
``apply_monkey_patch(use_fused_kernels=True)``; its forward is run by verl's torch backend (``FusedLinearForPPO``,
unpatched: the reference) and then, with ``patch_fused_kernels()``, by each of verl's two routes ("torch" and
"triton"; verl's Triton kernel needs CUDA, ours runs here), on padded input (``attention_mask``, labels rolled by
verl, or given as ``labels`` / pre-shifted ``shift_labels``) and on packed (remove-padding) input (``[1, nnz]``
with ``position_ids`` and ``shift_labels``, as verl's FSDP engine passes it). Compared: the log-probs, the
entropy, and the gradients of ``sum(a * log_probs) + sum(b * entropy)`` to every parameter of the model (the head
directly; the rest through the hidden states).

Tolerances: float32, log-probs and entropy within 1e-5 absolute, every gradient within 1e-5 x its largest
element (measured: 5e-7 and 2e-6 / 8). bfloat16 (verl rounds ``logits / T`` to bf16 before its float32 softmax;
ours divides in float32): log-probs and entropy within the bf16 tolerance of tests/tolerances.py (x4), ours at
least as close as verl's to the float64 softmax of the same bf16 logits; the gradients to the head and the hidden
states within 2^-5 x their largest element (one or two bf16 roundings of d logits apart; measured: 1 ulp of the
head's largest gradient), those deeper in the model (each layer's bf16 backward rounds again) with a cosine
similarity of at least 0.999 to verl's.

Needs transformers: runs in the verl lane (.ci/lane-verl); skipped by tests/peers.py elsewhere.
"""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch

import peers
from kl_kernels.integrations import verl as kv
from tolerances import TOLERANCES

VOCAB, HIDDEN = 300, 64


@pytest.fixture
def monkey_patch(monkeypatch):
    """verl's monkey_patch module; the model class's forward restored after the test (verl sets it on the class).

    verl 0.9.1's apply_monkey_patch imports TRL's value-head class whenever TRL is installed, to patch its
    state_dict; TRL 1.16 (installed beside verl here, for the TRL tests) removed that class, so the import fails
    (test_verl_monkey_patch_fails_beside_trl_1_16 below). The class concerns TRL's own value-head models only,
    so verl's check is answered as in an environment without TRL, for verl's call alone."""
    mp = peers.verl_monkey_patch()
    from transformers import Qwen2ForCausalLM

    monkeypatch.setattr(mp, "is_trl_available", lambda: False)
    saved = Qwen2ForCausalLM.forward
    yield mp
    Qwen2ForCausalLM.forward = saved
    kv.unpatch_fused_kernels()


@pytest.fixture
def verl_kernels():
    """verl's two kernel modules (no model: these import in the main suite too, tests/peers.py's stubs), the
    switch turned off after the test."""
    mods = (peers.verl_module(kv._TORCH_MODULE), peers.verl_module(kv._TRITON_MODULE))
    yield mods
    kv.unpatch_fused_kernels()


def tiny_model(dtype, seed=0):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(cfg).to(dtype)
    with torch.no_grad():  # a head with logits of a few units (a fresh one gives nearly uniform softmaxes)
        model.lm_head.weight.mul_(8.0)
    return model


def batch(layout, seed):
    """Model inputs for one layout, and the token shape of verl's outputs."""
    g = torch.Generator().manual_seed(seed)
    if layout == "packed":  # verl's remove-padding input: sequences of lengths 1, 4, 7, 3 back to back
        lengths = [1, 4, 7, 3]
        ids = torch.randint(0, VOCAB, (1, sum(lengths)), generator=g)
        pos = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
        return dict(input_ids=ids, position_ids=pos, attention_mask=None,
                    shift_labels=torch.roll(ids, -1, dims=1)), ids.shape
    ids = torch.randint(0, VOCAB, (3, 9), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0  # left padding
    mask[2, 7:] = 0  # right padding
    inputs = dict(input_ids=ids, attention_mask=mask)
    if layout == "labels":
        inputs["labels"] = torch.randint(0, VOCAB, ids.shape, generator=g)
    elif layout == "shift_labels":
        inputs["shift_labels"] = torch.randint(0, VOCAB, ids.shape, generator=g)
    return inputs, ids.shape


def run(model, inputs, shape, temperature, autocast=False):
    """log-probs, entropy (as verl's forward returns them) and every parameter's gradient of a weighted sum."""
    model.zero_grad(set_to_none=True)
    g = torch.Generator().manual_seed(123)
    a, b = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    seen = []
    hook = model.model.register_forward_hook(lambda mod, args, out: seen.append(out[0]) or out[0].retain_grad())
    try:
        with ctx:
            out = model(**inputs, return_dict=True, temperature=temperature)
    finally:
        hook.remove()
    lp, ent = out.log_probs, out.entropy
    ((lp.reshape(shape) * a).sum() + (ent.float().reshape(shape) * b).sum()).backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    grads["hidden_states"] = seen[0].grad.detach().clone()
    return lp.detach(), ent.detach(), grads


def oracle(model, inputs, temperature):
    """log-probs and entropy in float64 from the model's own last hidden states (in its dtype) and head, with the
    labels verl uses."""
    labels = inputs.get("shift_labels")
    if labels is None:
        labels = torch.roll(inputs.get("labels", inputs["input_ids"]), -1, dims=-1)
    with torch.no_grad():
        hidden = model.model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"],
                             position_ids=inputs.get("position_ids")).last_hidden_state
        logits = (hidden @ model.lm_head.weight.T).double() / temperature
    logp = torch.log_softmax(logits, -1)
    return logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1), -(logp.exp() * logp).sum(-1)


CASES = [(backend, dtype, layout, temperature)  # (temperature 1 on one layout: the same path, T = 1 exactly)
         for backend in ("torch", "triton")
         for dtype in ("float32", "bfloat16", "autocast")
         for layout in ("padded", "labels", "shift_labels", "packed")
         for temperature in ((1.0, 0.7) if layout == "padded" else (0.7,))]


@pytest.mark.parametrize("backend, dtype, layout, temperature", CASES,
                         ids=[f"{b}-{d}-{lay}-T{t}" for b, d, lay, t in CASES])
def test_patched_forward_equals_verl_torch_backend(monkey_patch, backend, dtype, layout, temperature):
    autocast = dtype == "autocast"
    model = tiny_model(torch.float32 if autocast else getattr(torch, dtype))
    inputs, shape = batch(layout, seed=sum(map(ord, backend + dtype + layout)))
    monkey_patch.apply_monkey_patch(model, use_remove_padding=layout == "packed", use_fused_kernels=True,
                                    fused_kernels_backend="torch")
    want_lp, want_ent, want_grads = run(model, inputs, shape, temperature, autocast)  # verl's own FusedLinearForPPO
    with kv.patch_fused_kernels():
        monkey_patch.apply_monkey_patch(model, use_remove_padding=layout == "packed", use_fused_kernels=True,
                                        fused_kernels_backend=backend)
        got_lp, got_ent, got_grads = run(model, inputs, shape, temperature, autocast)
    # what verl's route returns: torch, log-probs float32 [*S] and entropy in the hidden states' dtype;
    # triton, both float32, flattened to [N]
    out_shape = shape if backend == "torch" else (shape.numel(),)
    assert got_lp.shape == want_lp.reshape(out_shape).shape and got_lp.dtype == torch.float32
    assert got_ent.shape == got_lp.shape
    assert got_ent.dtype == (want_ent.dtype if backend == "torch" else torch.float32)
    got_lp, got_ent = got_lp.reshape(shape), got_ent.reshape(shape).float()
    want_lp, want_ent = want_lp.reshape(shape), want_ent.reshape(shape).float()
    if dtype == "float32":
        torch.testing.assert_close(got_lp, want_lp, rtol=0, atol=1e-5)
        torch.testing.assert_close(got_ent, want_ent, rtol=0, atol=1e-5)
        rel = 1e-5
    else:
        tol = TOLERANCES[torch.bfloat16]
        torch.testing.assert_close(got_lp, want_lp, rtol=4 * tol.rtol, atol=4 * tol.atol)
        torch.testing.assert_close(got_ent, want_ent, rtol=4 * tol.rtol, atol=4 * tol.atol)
        if not autocast:  # ours at least as close as verl's to the exact softmax of the same bf16 logits
            exact_lp, exact_ent = oracle(model, inputs, temperature)
            assert (got_lp.double() - exact_lp).abs().max() <= (want_lp.double() - exact_lp).abs().max() + 1e-6
        rel = 2.0 ** -5
    assert got_grads.keys() == want_grads.keys() and "lm_head.weight" in got_grads
    for name, want in want_grads.items():
        got = got_grads[name]
        assert got.dtype == want.dtype, name
        if dtype == "float32" or name in ("lm_head.weight", "hidden_states"):
            scale = want.float().abs().max().item()
            torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=rel * scale + 1e-12,
                                       msg=lambda m, name=name: f"d/d {name}: {m}")
        else:  # deeper in bf16, each layer's backward rounds again: the gradients' directions agree
            cos = torch.nn.functional.cosine_similarity(got.double().flatten(), want.double().flatten(), dim=0)
            assert cos >= 0.999, f"d/d {name}: cosine {cos.item()}"


@pytest.mark.parametrize("grad_of", ["log_probs", "entropy"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_linear_for_ppo_2d_equals_verl_with_one_output_differentiated(verl_kernels, dtype, grad_of):
    """The classes themselves on 2-D hidden states [N, H] (verl's other accepted shape), with only one output in
    the loss (verl's backward takes a None gradient for the other)."""
    tf = verl_kernels[0]

    g = torch.Generator().manual_seed(5)
    h0 = torch.randn(37, HIDDEN, generator=g).to(dtype)
    w0 = (torch.randn(VOCAB, HIDDEN, generator=g) * 0.5).to(dtype)
    ids = torch.randint(0, VOCAB, (37,), generator=g)
    results = []
    for cls in (tf.FusedLinearForPPO, kv.FusedLinearForPPO):
        h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
        lp, ent = cls().forward(h, w, ids, 0.9)
        out = lp if grad_of == "log_probs" else ent
        gh, gw = torch.autograd.grad(out.float().sum(), (h, w))
        results.append((lp.detach(), ent.detach(), gh, gw))
    (wlp, went, wgh, wgw), (glp, gent, ggh, ggw) = results
    assert glp.dtype == wlp.dtype == torch.float32 and gent.dtype == went.dtype == dtype
    tol = dict(rtol=0, atol=1e-5) if dtype == torch.float32 else dict(rtol=0.064, atol=4e-5)
    torch.testing.assert_close(glp, wlp, **tol)
    torch.testing.assert_close(gent.float(), went.float(), **tol)
    rel = 1e-5 if dtype == torch.float32 else 2.0 ** -5
    for a, b in ((ggh, wgh), (ggw, wgw)):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a.float(), b.float(), rtol=0, atol=rel * b.float().abs().max().item())


def test_patch_is_idempotent_and_undone(verl_kernels):
    tf, lce = verl_kernels

    verl_cls, verl_fn = tf.FusedLinearForPPO, lce.linear_cross_entropy
    assert verl_cls is not kv.FusedLinearForPPO
    with kv.patch_fused_kernels() as outer:
        assert outer.made and tf.FusedLinearForPPO is kv.FusedLinearForPPO
        assert lce.linear_cross_entropy is kv.linear_cross_entropy
        with kv.patch_fused_kernels() as inner:  # already patched: nothing to do, nothing undone at its exit
            assert not inner.made
        assert tf.FusedLinearForPPO is kv.FusedLinearForPPO
    assert tf.FusedLinearForPPO is verl_cls and lce.linear_cross_entropy is verl_fn
    kv.patch_fused_kernels()
    kv.patch_fused_kernels()
    kv.unpatch_fused_kernels()
    assert tf.FusedLinearForPPO is verl_cls and lce.linear_cross_entropy is verl_fn
    kv.unpatch_fused_kernels()  # nothing patched: no-op


def test_patch_refuses_an_unchecked_verl_version(verl_kernels, monkeypatch):
    import verl

    tf = verl_kernels[0]

    monkeypatch.setattr(verl, "__version__", "0.10.0")
    with pytest.raises(RuntimeError, match="0.9.1"):
        kv.patch_fused_kernels()
    assert tf.FusedLinearForPPO is not kv.FusedLinearForPPO


def test_liger_route_and_megatron_options_are_handed_to_verl_with_one_warning(verl_kernels, monkeypatch):
    """fused_kernels_backend="liger", reduction != "none" and dist_process_group run verl's own code (each with one
    warning naming it), never ours silently."""
    calls = []

    class Spy:
        def __init__(self, chunk_size, impl_backend):
            calls.append(("cls", impl_backend))

        def forward(self, *args):
            return "verl's liger"

    def spy_fn(*args):
        calls.append(("fn", args[4], args[5]))
        return "verl's kernel"

    h, w, ids = torch.randn(4, HIDDEN), torch.randn(VOCAB, HIDDEN), torch.randint(0, VOCAB, (4,))
    tf, lce = verl_kernels
    verl_objects = (tf.FusedLinearForPPO, lce.linear_cross_entropy)
    with kv.patch_fused_kernels():
        # verl's objects as the switch hands them over (spies), the switch's own record untouched
        spies = {"FusedLinearForPPO": Spy, "linear_cross_entropy": spy_fn}
        monkeypatch.setattr(kv._SWITCHES, "original", lambda switch, module, name: spies[name])
        monkeypatch.setattr(kv, "_WARNED", set())
        with pytest.warns(UserWarning, match="'liger'"):
            assert kv.FusedLinearForPPO(impl_backend="liger").forward(h, w, ids) == "verl's liger"
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the second call: no second warning
            assert kv.FusedLinearForPPO(impl_backend="liger").forward(h, w, ids) == "verl's liger"
        with pytest.warns(UserWarning, match="reduction='mean'"):
            assert kv.linear_cross_entropy(h, w, ids, 1.0, "mean") == "verl's kernel"
        group = object()
        with pytest.warns(UserWarning, match="dist_process_group"):
            assert kv.linear_cross_entropy(h, w, ids, 1.0, "none", group) == "verl's kernel"
    assert calls == [("cls", "liger"), ("cls", "liger"), ("fn", "mean", None), ("fn", "none", group)]
    assert (tf.FusedLinearForPPO, lce.linear_cross_entropy) == verl_objects  # verl's own back


def test_verl_monkey_patch_fails_beside_trl_1_16(monkey_patch, monkeypatch):
    """Why the fixture answers verl's TRL check: with TRL 1.16 importable, verl 0.9.1's apply_monkey_patch itself
    fails (a verl/TRL mismatch, not this project's; users of verl without TRL never meet it)."""
    import importlib.util

    if importlib.util.find_spec("trl") is None:
        pytest.skip("TRL is not installed here")
    from verl.utils.import_utils import is_trl_available

    monkeypatch.setattr(monkey_patch, "is_trl_available", is_trl_available)
    with pytest.raises(ImportError, match="AutoModelForCausalLMWithValueHead"):
        monkey_patch.apply_monkey_patch(tiny_model(torch.float32), use_remove_padding=False,
                                        use_fused_kernels=True, fused_kernels_backend="torch")


def test_the_docs_ray_setup_hook_switches_verl_in_a_ray_worker():
    """The docs' one line: Ray's worker_process_setup_hook (which verl's main_ppo passes on from
    ray_kwargs.ray_init.runtime_env) names a switch, and in a real Ray worker process verl's names are then ours.
    (patch_fused_kernels here: kv.patch() also imports verl's trainer module, whose stack this lane lacks.)"""
    import importlib.util
    import os

    peers.verl_monkey_patch()
    if importlib.util.find_spec("ray") is None:
        pytest.skip("ray is not installed (.ci/lane-verl installs it)")
    import ray

    from conftest import REPO

    path = os.pathsep.join([str(REPO)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False,
             runtime_env={"worker_process_setup_hook": "kl_kernels.integrations.verl.patch_fused_kernels",
                          "env_vars": {"PYTHONPATH": path}})
    try:
        @ray.remote
        def routes():
            from verl.utils.experimental import torch_functional as tf
            from verl.utils.kernel import linear_cross_entropy as lce

            return tf.FusedLinearForPPO.__module__, lce.linear_cross_entropy.__module__
        assert ray.get(routes.remote(), timeout=120) == ("kl_kernels.integrations.verl",) * 2
    finally:
        ray.shutdown()
    from verl.utils.experimental import torch_functional as tf

    assert tf.FusedLinearForPPO.__module__ != "kl_kernels.integrations.verl"  # the driver was not switched
