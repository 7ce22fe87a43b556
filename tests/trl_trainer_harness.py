"""A tiny, download-free TRL 1.16 GRPO run on the CPU: the harness of tests/test_integrations_trl_trainer.py.

Not a test module. Needs transformers, accelerate, datasets and trl (the `.ci/lane-trl` overlay virtualenv);
callers skip through ``trl_stack_missing()`` (tests/conftest.py's ``trl_trainer`` marker) without them.

``run(config_overrides, trainer_cls=..., ...)`` trains a 2-layer Qwen2 (hidden 64, byte-level vocabulary of
259 tokens, built from a config with a fixed seed) on 4 prompts x 4 generations with a deterministic reward,
``GRPOConfig(beta=0.04, epsilon_high=0.28, num_generations=4, max_completion_length=16,
gradient_accumulation_steps=2, steps_per_generation=4)`` and 4 optimizer steps: steps 2 and 4 reuse the
generation of steps 1 and 3 (off-policy, so the ratio moves off 1 and clipping happens). It returns the
logged metrics of each step and the gradient of every parameter just before each optimizer step.
"""

from __future__ import annotations

import importlib.util
import tempfile
import warnings
from dataclasses import dataclass, field

import torch

PACKAGES = ("transformers", "accelerate", "datasets", "trl", "tokenizers")
REPO = __import__("pathlib").Path(__file__).resolve().parents[1]


def trl_stack_missing() -> str | None:
    """The first of TRL's trainer stack's packages that is not installed here, or None."""
    return next((m for m in PACKAGES if importlib.util.find_spec(m) is None), None)


# The base configuration of every run (the issue's): per-option tests override fields of it
BASE = dict(beta=0.04, epsilon_high=0.28, num_generations=4, max_completion_length=16, gradient_accumulation_steps=2,
            steps_per_generation=4, per_device_train_batch_size=4, max_steps=4, learning_rate=5e-3,
            logging_steps=1, use_cpu=True, report_to="none", seed=7, save_strategy="no", temperature=1.0, disable_tqdm=True,
            bf16=False, disable_dropout=True, dataloader_num_workers=0)


def tokenizer():
    """A byte-level BPE tokenizer without merges (256 bytes + 3 specials), built in code: no download."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab.update({s: len(vocab) + i for i, s in enumerate(specials)})
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", additional_special_tokens=specials)


def model(tok):
    """A 2-layer Qwen2 (hidden 64) with random weights from a fixed seed."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=len(tok), max_position_embeddings=128, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    return Qwen2ForCausalLM(cfg)


def moe_model(tok):
    """A 2-layer Qwen2-MoE (4 experts, 2 per token, router_aux_loss_coef 0.01: TRL adds the load-balancing loss)."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2MoeConfig(vocab_size=len(tok), max_position_embeddings=128, hidden_size=64, intermediate_size=128,
                         moe_intermediate_size=32, shared_expert_intermediate_size=64, num_experts=4,
                         num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         tie_word_embeddings=False, router_aux_loss_coef=0.01, bos_token_id=tok.bos_token_id,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    return Qwen2MoeForCausalLM(cfg)


MODELS = {"qwen2": model, "qwen2-moe": moe_model}


def dataset():
    from datasets import Dataset

    return Dataset.from_dict({"prompt": ["abc", "hello", "kl kernels", "zz top"]})


def reward(completions, **kwargs):
    """Deterministic: how many vowels-and-spaces a completion has, minus its length's distance from 8."""
    return [float(sum(c in "aeiou " for c in s)) - abs(len(s) - 8) / 4 for s in completions]


def _save(m, path):
    """``save_pretrained`` without its rank check: under torch.distributed only rank 0 writes there, and each
    process of tests/test_integrations_trl_trainer.py's two-process run has its own directory."""
    import os

    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    m.config.architectures = [type(m).__name__]
    m.config.save_pretrained(path)
    save_file({k: v.contiguous() for k, v in m.state_dict().items()}, os.path.join(path, "model.safetensors"))


@dataclass
class Run:
    logs: list[dict] = field(default_factory=list)     # the logged metrics of each optimizer step
    grads: list[dict] = field(default_factory=list)    # {name: gradient} just before each optimizer step
    warnings: list = field(default_factory=list)       # warnings raised while the trainer was constructed
    trainer: object = None
    evaluation: dict | None = None                     # trainer.evaluate() after training (evaluate=True)


def run(overrides=None, *, trainer_cls=None, patch=None, model_factory=None, extra_kwargs=None,
        evaluate=False) -> Run:
    """Train the tiny model (``model_factory(tokenizer)``, default :func:`model`) with ``trainer_cls`` (default
    TRL's GRPOTrainer), or TRL's with ``patch(trainer)`` applied after construction."""
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(1)
    out = Run()

    class Capture(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kw):
            out.grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})

        def on_log(self, args, state, control, logs=None, **kw):
            if logs is not None and "loss" in logs:
                out.logs.append(dict(logs))

    tok = tokenizer()
    with tempfile.TemporaryDirectory() as tmp:
        args = GRPOConfig(output_dir=tmp, **{**BASE, **(overrides or {})})
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            path = f"{tmp}/model"  # TRL builds the reference model from the policy's path: save it there
            _save((model_factory or model)(tok), path)
            tok.save_pretrained(path)
            trainer = (trainer_cls or GRPOTrainer)(
                model=path, reward_funcs=reward, args=args, train_dataset=dataset(),
                processing_class=tok, callbacks=[Capture()], **(extra_kwargs or {}))
            if patch is not None:
                patch(trainer)
        out.warnings = [w for w in caught if "kl_kernels" in str(w.message)]
        trainer.train()
        if evaluate:  # the loss in eval mode (no accumulation divisor), on the training prompts
            out.evaluation = trainer.evaluate(dataset())
    out.trainer = trainer
    return out


def main(argv):
    """``python -m torch.distributed.run --nproc_per_node 2 tests/trl_trainer_harness.py OUT.json CONFIGS_JSON``:
    for each configuration (a JSON list of GRPOConfig overrides) stock TRL, then kl_kernels' GRPOTrainer, on every
    process (accelerate's multi-CPU, gloo); rank 0 writes both runs' logs and the largest gradient difference
    (relative to each parameter's largest TRL gradient) to OUT.json."""
    import json
    import os
    import sys

    sys.path.insert(0, os.getcwd())  # kl_kernels from the checkout, as the tests import it
    from kl_kernels.integrations.trl import GRPOTrainer

    warnings.simplefilter("ignore")
    results = []
    for overrides in json.loads(argv[2]):
        stock, ours = run(overrides), run(overrides, trainer_cls=GRPOTrainer)
        worst = max(((g[n] - w[n]).abs().max() / w[n].abs().max().clamp_min(1e-30)).item()
                    for g, w in zip(ours.grads, stock.grads, strict=True) for n in w)
        results.append(dict(overrides=overrides, fused=ours.trainer._kl_kernels_plan is not None,
                            processes=ours.trainer.accelerator.num_processes, ours=ours.logs, stock=stock.logs,
                            grad_rel=worst, steps=len(stock.grads)))
    if int(os.environ.get("RANK", "0")) == 0:
        with open(argv[1], "w") as f:
            json.dump(results, f)


if __name__ == "__main__":
    import sys

    main(sys.argv)
