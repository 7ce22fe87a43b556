"""The LM-head opt-in of the TRL integration (issue 62 item 4): ``kl_kernels.integrations.trl_lm_head`` against
TRL 1.16.0's own fused LM head (``trl.trainer.utils.add_fused_lm_head``) on tiny models built from configs
(a Qwen2, hidden 64, 2 layers, vocabulary 300; a Gemma2 with ``final_logit_softcapping``, a Cohere with
``logit_scale``, a Granite with ``logits_scaling``), and inside TRL's real ``GRPOTrainer``.

The tolerance ("within TRL's own float32 rounding"): both heads are compared with a float64 oracle (the same
model in float64, its logits transformed and soft-maxed exactly), and ours may be off the oracle by at most
twice TRL's largest error plus ``4 eps32 (1 + max |exact|)``: it is as close to the exact value as TRL's head is.
Measured here: log-probs and entropy agree with TRL's within ~5e-7 (a few float32 ulps of values ~6), the
gradients of every parameter within ~2e-6 of values ~5.

The model and trainer tests need transformers, accelerate, datasets (and peft for the PEFT test): they run in the
TRL lane (.ci/lane-trl); the main suite skips them (each test asks for them through a fixture, never at import).
The head alone (``head_log_probs`` against TRL's ``ChunkedLogProbFunction``, the last section) needs only trl,
which the main suite has (installed --no-deps, imported over stand-ins for transformers).
"""

from __future__ import annotations

import copy
import functools
import math
import warnings

import pytest
import torch

EPS32 = torch.finfo(torch.float32).eps
TINY = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256)


@pytest.fixture(scope="module")
def lh():
    """The module under test, with transformers and TRL's head importable (else the test is skipped)."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    pytest.importorskip("trl.trainer.utils")
    from kl_kernels.integrations import trl_lm_head

    return trl_lm_head


def _qwen2(bias=False, tie=False, seed=0):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(Qwen2Config(**TINY, tie_word_embeddings=tie))
    if bias:
        model.lm_head.bias = torch.nn.Parameter(torch.randn(TINY["vocab_size"]) * 0.5)
    return model


def _gemma2(softcap=2.0):
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(1)
    return Gemma2ForCausalLM(Gemma2Config(**TINY, head_dim=16, final_logit_softcapping=softcap))


def _cohere(scale=0.25):
    from transformers import CohereConfig, CohereForCausalLM

    torch.manual_seed(2)
    return CohereForCausalLM(CohereConfig(**TINY, logit_scale=scale, tie_word_embeddings=False))


def _granite(scaling=4.0):
    from transformers import GraniteConfig, GraniteForCausalLM

    torch.manual_seed(3)
    return GraniteForCausalLM(GraniteConfig(**TINY, logits_scaling=scaling))


def _batch(seed=0, b=3, t=20, prompt=8, pad=True):
    """input ids, attention mask (left padding in row 0) and TRL's labels (-100 on padding and the prompt)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, TINY["vocab_size"], (b, t), generator=g)
    am = torch.ones_like(ids)
    am[0, :5] = 0 if pad else 1
    labels = ids.masked_fill(am == 0, -100)
    labels[:, :prompt] = -100
    return ids, am, labels


def _exact(model, ids, am, labels, temperature, shifted=False):
    """The float64 oracle: ``model`` in float64, its logits transformed as TRL's head does, exactly."""
    m = copy.deepcopy(model).double()
    from kl_kernels.integrations.trl_lm_head import config_logit_transform

    scale, softcap = config_logit_transform(m.config)
    h = m.base_model(input_ids=ids, attention_mask=am).last_hidden_state
    lab = labels if shifted else labels[:, 1:]
    h = h if shifted else h[:, :-1]
    x = torch.nn.functional.linear(h, m.lm_head.weight, m.lm_head.bias) * scale
    if softcap is not None:
        x = softcap * torch.tanh(x / softcap)
    logp = (x / temperature).log_softmax(-1)
    mask = lab != -100
    lp = torch.where(mask, logp.gather(-1, lab.clamp(min=0)[..., None])[..., 0], 0.0)
    ent = torch.where(mask, -(logp.exp() * logp).sum(-1), 0.0)
    return m, lp, ent


def _as_close_as_trl(name, ours, trl, exact, factor=2.0):
    """ours is off the exact values by at most ``factor`` x TRL's largest error + 4 eps32 (1 + max|exact|)."""
    exact = exact.double()
    err_trl = (trl.double() - exact).abs().max().item()
    err_ours = (ours.double() - exact).abs().max().item()
    bound = factor * err_trl + 4 * EPS32 * (1 + exact.abs().max().item())
    assert err_ours <= bound, f"{name}: ours off the exact by {err_ours:.3g}, TRL by {err_trl:.3g} (bound {bound:.3g})"
    return err_ours, err_trl


def _pair(lh, model, temperature=1.0, cast=False, outputs=("log_probs", "entropy")):
    """(TRL's head on a copy, ours on another copy, whether ours is in place)."""
    from trl.trainer.utils import add_fused_lm_head as trl_add

    theirs, ours = copy.deepcopy(model), copy.deepcopy(model)
    trl_add(theirs, temperature=temperature, cast_lm_head_to_fp32=cast, outputs=outputs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fused = lh.add_fused_lm_head(ours, temperature=temperature, cast_lm_head_to_fp32=cast, outputs=outputs)
    mine = [w for w in caught if "kl_kernels LM head" in str(w.message)]
    return theirs, ours, fused, mine


def _forward(model, ids, am, labels, shifted=False, **kw):
    key = "shift_labels" if shifted else "labels"
    return model(input_ids=ids, attention_mask=am, **{key: labels}, fused_lm_head=True, **kw)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("shifted", [False, True], ids=["labels", "shift_labels"])
@pytest.mark.parametrize("head", ["plain", "bias", "tied"])
def test_log_probs_entropy_and_gradients_match_trls_head(lh, temperature, shifted, head):
    model = _qwen2(bias=head == "bias", tie=head == "tied")  # (tied: the head is the embedding, two gradients)
    ids, am, labels = _batch()
    if shifted:  # pre-shifted labels, as context/sequence parallelism passes them: scored without shifting
        labels = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], 1)
    theirs, ours, fused, mine = _pair(lh, model, temperature)
    assert fused and not mine
    o_t, o_o = _forward(theirs, ids, am, labels, shifted), _forward(ours, ids, am, labels, shifted)
    m64, lp, ent = _exact(model, ids, am, labels, temperature, shifted)
    for name in ("log_probs", "entropy", "label_mask"):
        a, b = getattr(o_t, name), getattr(o_o, name)
        assert a.shape == b.shape == (3, 20 if shifted else 19) and a.dtype == b.dtype, name
    assert torch.equal(o_t.label_mask, o_o.label_mask)
    assert (o_o.log_probs[~o_o.label_mask] == 0).all() and (o_o.entropy[~o_o.label_mask] == 0).all()
    _as_close_as_trl("log_probs", o_o.log_probs, o_t.log_probs, lp)
    _as_close_as_trl("entropy", o_o.entropy, o_t.entropy, ent)
    _as_close_as_trl("loss", o_o.loss, o_t.loss, -lp.sum() / (labels != -100).sum())
    # gradients through log-probs and entropy (the entropy bonus), to every parameter: the head's and, through
    # the hidden states, the backbone's
    g = torch.randn(o_t.log_probs.shape, generator=torch.Generator().manual_seed(5))
    for out in (o_t, o_o):
        (out.log_probs * g + 0.1 * out.entropy).sum().backward()
    (lp * g + 0.1 * ent).sum().backward()
    for (name, p64), p_t, p_o in zip(m64.named_parameters(), theirs.parameters(), ours.parameters()):
        assert p_o.grad is not None, name
        _as_close_as_trl(f"grad {name}", p_o.grad, p_t.grad, p64.grad)


@pytest.mark.parametrize("cast", [False, True], ids=["autocast_bf16", "cast_lm_head_to_fp32"])
def test_autocast_and_cast_lm_head_to_fp32(lh, cast):
    """Under bf16 autocast TRL's head computes the logits in bf16 (and ours too); with cast_lm_head_to_fp32
    both compute the head in float32, autocast off (the trainer has cast the head to float32 first)."""
    model = _qwen2()
    if cast:
        model.lm_head.float()
    ids, am, labels = _batch(1)
    theirs, ours, fused, _ = _pair(lh, model, 0.9, cast=cast)
    assert fused
    with torch.autocast("cpu", dtype=torch.bfloat16):
        o_t, o_o = _forward(theirs, ids, am, labels), _forward(ours, ids, am, labels)
    m64, lp, ent = _exact(model, ids, am, labels, 0.9)
    assert o_o.log_probs.dtype == o_t.log_probs.dtype == torch.float32
    _as_close_as_trl("log_probs", o_o.log_probs, o_t.log_probs, lp)
    _as_close_as_trl("entropy", o_o.entropy, o_t.entropy, ent)
    if cast:  # float32 head: TRL's float32 rounding, as elsewhere
        assert (o_o.log_probs - o_t.log_probs).abs().max() < 1e-2  # (the backbone ran in bf16 in both)
    g = torch.randn(o_t.log_probs.shape, generator=torch.Generator().manual_seed(6))
    for out in (o_t, o_o):
        (out.log_probs * g).sum().backward()
    (lp * g).sum().backward()
    # bf16 backbone: both are off the float64 oracle by bf16 rounding; ours rounds each vocabulary slice's
    # d hidden product to bf16 on the CPU where TRL keeps float32 products (measured: 1.2x TRL's error)
    for (name, p64), p_t, p_o in zip(m64.named_parameters(), theirs.parameters(), ours.parameters()):
        _as_close_as_trl(f"grad {name}", p_o.grad, p_t.grad, p64.grad, factor=2.0)


@pytest.mark.parametrize("make, option", [(_gemma2, "final_logit_softcapping"), (_cohere, "logit scale"),
                                          (_granite, "logit scale")], ids=["gemma2_softcap", "cohere_scale",
                                                                           "granite_scaling"])
def test_softcap_and_logit_scale(lh, make, option):
    """The config's soft-cap and logit scale, read as TRL reads them: computed by ours where this kl_kernels'
    linear_token_logprobs takes softcap=/logit_scale=, else TRL's head with one warning naming the option."""
    model = make()
    ids, am, labels = _batch(2, pad=False)  # (Gemma2 in float64, the oracle, gives NaN rows with left padding)
    theirs, ours, fused, mine = _pair(lh, model, 0.8)
    o_t, o_o = _forward(theirs, ids, am, labels), _forward(ours, ids, am, labels)
    m64, lp, ent = _exact(model, ids, am, labels, 0.8)
    if not fused:  # TRL's head computes: one warning, naming the option, and TRL's outputs bit for bit
        assert len(mine) == 1 and option in str(mine[0].message), [str(w.message) for w in mine]
        assert torch.equal(o_o.log_probs, o_t.log_probs) and torch.equal(o_o.entropy, o_t.entropy)
        return
    assert not mine
    scale, softcap = lh.config_logit_transform(model.config)
    assert (scale, softcap) != (1.0, None)
    _as_close_as_trl("log_probs", o_o.log_probs, o_t.log_probs, lp)
    _as_close_as_trl("entropy", o_o.entropy, o_t.entropy, ent)
    for out in (o_t, o_o):
        (out.log_probs + 0.1 * out.entropy).sum().backward()
    (lp + 0.1 * ent).sum().backward()
    for (name, p64), p_t, p_o in zip(m64.named_parameters(), theirs.parameters(), ours.parameters()):
        if p_t.grad is not None:
            _as_close_as_trl(f"grad {name}", p_o.grad, p_t.grad, p64.grad)


def test_config_logit_transform_reads_trls_rule(lh):
    from types import SimpleNamespace as NS

    assert lh.config_logit_transform(NS(model_type="x")) == (1.0, None)
    assert lh.config_logit_transform(NS(logit_scale=0.5, output_multiplier=3.0)) == (0.5, None)
    assert lh.config_logit_transform(NS(logit_scale=None, output_multiplier=3.0)) == (3.0, None)
    assert lh.config_logit_transform(NS(lm_head_multiplier=2.0, final_logit_softcapping=30.0)) == (2.0, 30.0)
    assert lh.config_logit_transform(NS(model_type="granite", logits_scaling=4.0)) == (0.25, None)
    assert lh.config_logit_transform(NS(model_type="hyperclovax", logits_scaling=4.0)) == (4.0, None)


def test_fully_masked_micro_batch_is_a_differentiable_zero(lh):
    model = _qwen2()
    ids, am, _ = _batch(3)
    labels = torch.full_like(ids, -100)
    theirs, ours, _, _ = _pair(lh, model)
    o_t, o_o = _forward(theirs, ids, am, labels), _forward(ours, ids, am, labels)
    assert torch.equal(o_o.log_probs, o_t.log_probs) and torch.equal(o_o.loss, o_t.loss)
    assert o_o.loss.item() == 0 and o_o.loss.requires_grad
    o_o.loss.backward()
    assert all(p.grad is None or not p.grad.any() for p in ours.parameters())


def test_adding_the_same_head_twice_changes_nothing(lh):
    model = _qwen2()
    assert lh.add_fused_lm_head(model, temperature=0.7)
    forward = model.forward
    assert lh.add_fused_lm_head(model, temperature=0.7) and model.forward is forward
    assert lh.add_fused_lm_head(model, temperature=0.5) and model.forward is not forward  # another head: re-added
    ids, am, labels = _batch(7)
    lp = _forward(model, ids, am, labels).log_probs
    _, exact, _ = _exact(model, ids, am, labels, 0.5)
    assert (lp.double() - exact).abs().max() <= 8 * EPS32 * (1 + exact.abs().max())


def test_num_items_in_batch_and_generation(lh):
    model = _qwen2()
    ids, am, labels = _batch(4)
    theirs, ours, _, _ = _pair(lh, model)
    o_t = _forward(theirs, ids, am, labels, num_items_in_batch=50)
    o_o = _forward(ours, ids, am, labels, num_items_in_batch=50)
    assert abs(o_o.loss.item() - o_t.loss.item()) <= 8 * EPS32 * abs(o_t.loss.item())
    # without fused_lm_head the model's own forward (logits), and generate works
    assert torch.equal(ours(input_ids=ids, attention_mask=am).logits, model(input_ids=ids, attention_mask=am).logits)
    out = ours.generate(ids[1:, :6], max_new_tokens=3, do_sample=False)
    assert torch.equal(out, model.generate(ids[1:, :6], max_new_tokens=3, do_sample=False))


@pytest.mark.parametrize("case", ["outputs", "moe", "zero_scale"])
def test_what_ours_does_not_compute_stays_trls_with_one_warning(lh, case):
    if case == "outputs":
        model, outputs, option = _qwen2(), ("log_probs", "entropy", "is_top1"), "is_top1"
    elif case == "zero_scale":  # TRL keeps a 0.0 scale (every logit 0); kl_kernels takes a scale > 0
        model, outputs, option = _cohere(scale=0.0), ("log_probs", "entropy"), "logit scale 0.0"
    else:
        from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

        torch.manual_seed(4)
        model = Qwen2MoeForCausalLM(Qwen2MoeConfig(**TINY, num_experts=4, num_experts_per_tok=2,
                                                   moe_intermediate_size=32, shared_expert_intermediate_size=32))
        outputs, option = ("log_probs", "entropy"), "output_router_logits"
    ids, am, labels = _batch(5)
    theirs, ours, fused, mine = _pair(lh, model, outputs=outputs)
    assert not fused and len(mine) == 1 and option in str(mine[0].message)
    o_t, o_o = _forward(theirs, ids, am, labels), _forward(ours, ids, am, labels)
    for name in outputs:
        assert torch.equal(getattr(o_o, name), getattr(o_t, name)), name


_DTENSOR_SCRIPT = """
import gc, warnings
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
import test_integrations_trl_lm_head as t
from kl_kernels.integrations import trl_lm_head as lh

dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
mesh = init_device_mesh("cpu", (1,))
theirs, ours, fused, _ = t._pair(lh, t._qwen2())
assert fused
for m in (theirs, ours):  # FSDP2 shards the head's parameters as DTensors after the head is added
    m.lm_head.weight = torch.nn.Parameter(distribute_tensor(m.lm_head.weight.detach(), mesh, [Shard(0)]))
ids, am, labels = t._batch(8)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    want = t._forward(theirs, ids, am, labels)
    got = [t._forward(ours, ids, am, labels) for _ in range(2)]
mine = [str(w.message) for w in caught if issubclass(w.category, lh.LMHeadFallbackWarning)]
assert len(mine) == 1 and "DTensor" in mine[0], mine
assert all(torch.equal(g.log_probs, want.log_probs) and torch.equal(g.entropy, want.entropy) for g in got)
del theirs, ours, want, got, caught
gc.collect()
dist.destroy_process_group()
print("OK")
"""


def test_an_fsdp2_dtensor_head_stays_trls_with_one_warning(lh):
    """A DTensor head (FSDP2, found at the call): TRL's head gathers it; ours hands the call to TRL's head, warning
    once. In a child process: a one-rank gloo group, its lifetime kept out of the test process."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("torch.distributed.tensor")
    here = Path(__file__).resolve().parent
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(here.parent), str(here), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", _DTENSOR_SCRIPT], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0 and "OK" in done.stdout, done.stdout[-2000:] + done.stderr[-4000:]


def test_peft_model(lh):
    """A LoRA-wrapped policy as TRL's trainer has it: the head added to the base model, called through the
    PeftModel, with the adapters on (policy) and off (TRL's reference under PEFT); gradients to the adapters."""
    peft = pytest.importorskip("peft")
    from trl.trainer.utils import add_fused_lm_head as trl_add

    base = _qwen2()
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    torch.manual_seed(7)
    theirs = peft.get_peft_model(copy.deepcopy(base), config)
    ours = copy.deepcopy(theirs)
    trl_add(theirs.get_base_model(), outputs=("log_probs", "entropy"))
    assert lh.add_fused_lm_head(ours.get_base_model(), outputs=("log_probs", "entropy"))
    ids, am, labels = _batch(6)
    o_t, o_o = _forward(theirs, ids, am, labels), _forward(ours, ids, am, labels)
    for name in ("log_probs", "entropy"):
        diff = (getattr(o_o, name) - getattr(o_t, name)).abs().max().item()
        assert diff <= 8 * EPS32 * (1 + getattr(o_t, name).abs().max().item()), (name, diff)
    with theirs.disable_adapter(), ours.disable_adapter():
        r_t, r_o = _forward(theirs, ids, am, labels), _forward(ours, ids, am, labels)
    assert (r_o.log_probs - o_o.log_probs).abs().max() > 1e-3  # the adapters were really off
    assert (r_o.log_probs - r_t.log_probs).abs().max() <= 8 * EPS32 * (1 + r_t.log_probs.abs().max())
    for out in (o_t, o_o):
        (out.log_probs + 0.1 * out.entropy).sum().backward()
    lora = [(n, p) for n, p in ours.named_parameters() if p.requires_grad]
    assert lora and all("lora" in n for n, _ in lora)
    for (name, p_o), p_t in zip(lora, [p for p in theirs.parameters() if p.requires_grad]):
        scale = p_t.grad.abs().max().item()
        assert (p_o.grad - p_t.grad).abs().max().item() <= 1e-5 * (1 + scale), name


# ------------------------------------------------------------------ inside TRL's GRPOTrainer


def _save(tmp_path_factory, moe=False):
    """A tiny Qwen2 (or Qwen2-MoE) and the byte-level tokenizer saved to a folder (the trainer loads it by path;
    no hub)."""
    pytest.importorskip("datasets")
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM

    from trl_trainer_harness import tokenizer

    tok = tokenizer()
    torch.manual_seed(0)
    kw = dict(**{**TINY, "vocab_size": len(tok)}, tie_word_embeddings=False, bos_token_id=tok.bos_token_id,
              eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    if moe:
        model = Qwen2MoeForCausalLM(Qwen2MoeConfig(**kw, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                                   shared_expert_intermediate_size=32))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**kw))
    path = tmp_path_factory.mktemp("tiny-qwen2-moe" if moe else "tiny-qwen2")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path), tok


@pytest.fixture(scope="module")
def saved_model(lh, tmp_path_factory):
    return _save(tmp_path_factory)


def _train(saved_model, tmp_path, ours, switch=None, fused=True, **config):
    """Stock TRL (``ours`` False) or with :func:`patch_lm_head`; with ``switch`` ("trl" or "kl_kernels"):
    kl_kernels' one-switch ``GRPOTrainer(..., lm_head=switch)`` instead."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    if switch is not None:
        from kl_kernels.integrations.trl import GRPOTrainer as switched

        GRPOTrainer = functools.partial(switched, lm_head=switch)  # noqa: N806

    path, tok = saved_model
    torch.set_num_threads(1)
    args = GRPOConfig(output_dir=str(tmp_path / f"{ours}-{switch}"), use_cpu=True, report_to="none", seed=0,
                      beta=0.04, epsilon_high=0.28, num_generations=4, max_completion_length=16,
                      per_device_train_batch_size=4, gradient_accumulation_steps=2, steps_per_generation=4,
                      max_steps=4, logging_steps=1, save_strategy="no", learning_rate=5e-3, temperature=0.9,
                      **config)

    def reward(completions, **kw):  # deterministic
        return [float(len(c) % 7) - 3.0 for c in completions]

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = GRPOTrainer(model=path, reward_funcs=reward, args=args, processing_class=tok,
                              train_dataset=Dataset.from_dict({"prompt": [f"count {i}:" for i in range(16)]}))
    if ours:
        from kl_kernels.integrations.trl_lm_head import patch_lm_head

        assert patch_lm_head(trainer) == fused
        assert trainer.ref_model is not None and bool(getattr(trainer.ref_model, "_kl_kernels_lm_head", 0)) == fused
    if switch is not None:  # the switch put ours on both models, or left TRL's
        on = switch == "kl_kernels"
        assert bool(getattr(trainer.model, "_kl_kernels_lm_head", False)) == on
        assert bool(getattr(trainer.ref_model, "_kl_kernels_lm_head", False)) == on
    trainer.train()
    return [h for h in trainer.state.log_history if "loss" in h and "train_runtime" not in h]


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16_autocast"])
def test_inside_grpo_trainer_metrics_match_stock_trl(lh, saved_model, tmp_path, bf16):
    """4 optimizer steps (learning rate 5e-3: the policy moves, clipping happens), gradient accumulation 2, 4 steps
    per generation (off-policy steps), beta = 0.04 (the reference model's head is ours too): every logged metric
    against stock TRL's.

    bf16=False: float32 level: loss, grad norm, entropy within relative 1e-5 (measured: <= 2.4e-7), kl within
    1e-7 absolute (measured 2.2e-8), clip ratios equal. bf16=True (TRL's CPU default: autocast, the head's
    logits in bf16 in both): the log-probs agree (7.8e-8 on a forward) but the gradients differ at bf16 level
    (ours rounds the head's bf16 gradients where TRL keeps float32: grad norm of the first step 3.6e-4
    relative), and the runs drift apart at that level: measured loss 4.6e-4, grad norm 1.7e-3, entropy 3.6e-5
    relative, kl 1.1e-3 absolute (of 0.033), one clipped token of 128; asserted with ~3x margins."""
    stock = _train(saved_model, tmp_path, False, bf16=bf16)
    mine = _train(saved_model, tmp_path, True, bf16=bf16)
    assert len(stock) == len(mine) == 4
    assert any(h["clip_ratio/region_mean"] > 0 for h in stock)  # clipping happened
    rel, kl_abs, clip_abs = (5e-3, 3e-3, 2 / 128) if bf16 else (1e-5, 1e-7, 0.0)
    for step, (a, b) in enumerate(zip(stock, mine)):
        assert a.keys() == b.keys()
        for key in a:
            if key in ("step_time", "learning_rate", "epoch") or not isinstance(a[key], (int, float)):
                continue
            if key == "kl":
                ok = abs(a[key] - b[key]) <= kl_abs
            elif key.startswith("clip_ratio/"):
                ok = abs(a[key] - b[key]) <= clip_abs
            else:
                ok = math.isclose(a[key], b[key], rel_tol=rel, abs_tol=1e-7)
            assert ok, (step, key, a[key], b[key])


def test_a_fallback_inside_the_trainer_warns_once_and_is_stock_trl(lh, tmp_path_factory, tmp_path):
    """A MoE policy (TRL's head adds the router's load-balancing loss): the policy and the reference keep TRL's
    head, with ONE warning naming output_router_logits, and the run is stock TRL's, bitwise."""
    saved = _save(tmp_path_factory, moe=True)
    stock = _train(saved, tmp_path, False, bf16=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mine = _train(saved, tmp_path, True, fused=False, bf16=False)
    ours = [str(w.message) for w in caught if issubclass(w.category, lh.LMHeadFallbackWarning)]
    assert len(ours) == 1 and "output_router_logits" in ours[0], ours
    assert "aux_loss" in stock[0]
    for a, b in zip(stock, mine):
        assert {k: v for k, v in a.items() if k != "step_time"} == {k: v for k, v in b.items() if k != "step_time"}


def test_the_switchs_lm_head_option(lh, saved_model, tmp_path):
    """kl_kernels.integrations.trl.GRPOTrainer(..., lm_head="kl_kernels"): the fused loss with our head on the policy
    and the reference, against the same switch with TRL's head (lm_head="trl"): float32 level, as above."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        theirs = _train(saved_model, tmp_path, False, switch="trl", bf16=False)
        mine = _train(saved_model, tmp_path, False, switch="kl_kernels", bf16=False)
    assert not [w for w in caught if "kl_kernels LM head" in str(w.message)]
    assert len(theirs) == len(mine) == 4
    for step, (a, b) in enumerate(zip(theirs, mine)):
        for key in ("loss", "grad_norm", "entropy", "kl", "clip_ratio/region_mean"):
            assert math.isclose(a[key], b[key], rel_tol=1e-5, abs_tol=1e-7), (step, key, a[key], b[key])


# ------------------------------------------------------------------ the head alone (no transformers: the main suite)


@pytest.fixture(scope="module")
def trl_kernel():
    """TRL's head function from the installed trl (over stand-ins for transformers where it is absent: its CPU
    path), as kl_kernels.bench.trl_grpo imports it; skipped without trl."""
    from kl_kernels.bench import trl_grpo

    modules, why = trl_grpo.trl_modules("cpu")
    if modules is None:
        pytest.skip(why)
    return modules


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize("transform", [(1.0, None), (0.25, None), (1.0, 2.0), (3.0, 5.0)],
                         ids=["plain", "scale", "softcap", "scale_softcap"])
def test_head_log_probs_against_trls_head_function(trl_kernel, dtype, temperature, transform):
    """``head_log_probs`` (what the opt-in runs after the backbone) against TRL's ``ChunkedLogProbFunction`` called
    as TRL's forward calls it, on random hidden states and a head with a bias, both against a float64 oracle."""
    from kl_kernels.integrations import trl_lm_head as lh

    scale, softcap = transform
    if (scale, softcap) != (1.0, None) and not lh._op_takes_transform():
        pytest.skip("this kl_kernels' linear_token_logprobs has no logit_scale=/softcap= yet (the softcap helper's)")
    g = torch.Generator().manual_seed(11)
    b, t, hid, vocab = 3, 17, 24, 97
    hidden = (torch.randn(b, t, hid, generator=g) * 2).to(dtype).requires_grad_()
    weight = (torch.randn(vocab, hid, generator=g) / hid ** 0.5).to(dtype).requires_grad_()
    bias = (torch.randn(vocab, generator=g) * 0.3).to(dtype).requires_grad_()
    labels = torch.randint(0, vocab, (b, t), generator=g)
    labels[0, :6] = -100
    labels[2] = -100  # a row without a scored token
    tr_lp, tr_ent = trl_kernel.head.apply(hidden.reshape(-1, hid), weight, bias, labels.clamp(min=0).reshape(-1),
                                          temperature, trl_kernel.chunk, softcap, scale, ("log_probs", "entropy"))[:2]
    mask = labels != -100
    tr_lp, tr_ent = tr_lp.view(b, t).masked_fill(~mask, 0), tr_ent.view(b, t).masked_fill(~mask, 0)
    kw = {} if (scale, softcap) == (1.0, None) else dict(logit_scale=scale, softcap=softcap)
    lp, ent, m = lh.head_log_probs(hidden, weight, bias, labels, temperature=temperature, **kw)
    assert torch.equal(m, mask) and lp.dtype == ent.dtype == torch.float32 and lp.shape == (b, t)
    assert (lp[~mask] == 0).all() and (ent[~mask] == 0).all()
    x = torch.nn.functional.linear(hidden.double(), weight.double(), bias.double()) * scale
    if softcap is not None:
        x = softcap * torch.tanh(x / softcap)
    logp = (x / temperature).log_softmax(-1)
    ex_lp = torch.where(mask, logp.gather(-1, labels.clamp(min=0)[..., None])[..., 0], 0.0)
    ex_ent = torch.where(mask, -(logp.exp() * logp).sum(-1), 0.0)
    _as_close_as_trl("log_probs", lp, tr_lp, ex_lp)
    _as_close_as_trl("entropy", ent, tr_ent, ex_ent)
    grads = []
    from kl_kernels.bench.trl_grpo import trl_call_context

    up = torch.linspace(-1, 1, b * t).view(b, t)
    for out_lp, out_ent in ((tr_lp, tr_ent), (lp, ent), (ex_lp, ex_ent)):
        with trl_call_context(trl_kernel):  # (TRL's backward asks transformers about ZeRO-3)
            grads.append(torch.autograd.grad((out_lp * up + 0.3 * out_ent).sum(), (hidden, weight, bias)))
    for name, g_t, g_o, g_x in zip(("hidden", "weight", "bias"), *grads):
        # bf16 inputs: TRL returns float32-accumulated gradients rounded once to bf16, and so does ours
        _as_close_as_trl(f"grad {name}", g_o, g_t, g_x, factor=2.0 if dtype == torch.float32 else 3.0)
