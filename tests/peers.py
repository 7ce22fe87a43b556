"""Import the real peer packages (verl, OpenRLHF, TRL) for parity tests of our shims.

Not a test module: tests call one of the functions below and get the peer's module back,
or the test is skipped when that peer is not installed.

    verl_core_algos()          verl.trainer.ppo.core_algos   (kl_penalty, agg_loss, policy losses, KL controllers)
    verl_torch_functional()    verl.utils.torch_functional   (masked_mean, masked_sum, ...)
    verl_apply_kl_penalty()    verl's apply_kl_penalty function itself (see its docstring)
    verl_monkey_patch()        verl.models.transformers.monkey_patch (needs transformers: the verl lane)
    verl_losses()              verl.workers.utils.losses     (ppo_loss; needs datasets: the verl lane)
    verl_module(name)          any verl module the stubs cover (verl.protocol, verl.workers.config, ...)
    openrlhf_utils()           openrlhf.models.utils         (compute_approx_kl, compute_reward, masked_mean)
    openrlhf_loss()            openrlhf.models.loss          (PolicyLoss, aggregate_loss)
    openrlhf_kl_controllers()  openrlhf.trainer.ppo_utils.kl_controller
    openrlhf_module(name)      any OpenRLHF module, the trainer's too (experience_maker, ray.ppo_actor)
    openrlhf_actor()           openrlhf.models.actor (Actor; needs transformers and peft: the verl lane)
    trl_grpo_module()          trl.trainer.grpo_trainer      (GRPOTrainer._compute_loss, GRPOConfig fields)

Pinned peers: verl==0.9.1, openrlhf==0.11.2, trl==1.16.0. Their declared dependencies (ray, vllm,
deepspeed, flash-attn, transformers, ...) are far too heavy for this project, and none of them is called by
the loss/KL math we compare against, so they are installed with --no-deps plus a few small real
packages (omegaconf; PEER_PIP below), and the heavy modules they import at module level are stubbed:

* A stub is made only for a top-level package that is NOT importable (find_spec is None), so a really
  installed package is always used as it is, submodules included.
* Each peer names its own stub list: only the modules that its import chain needs unconditionally. A module
  that the peer imports under `try/except ImportError` (flash_attn in verl.utils.torch_functional,
  torch_npu, ...) is never stubbed for it, or the peer would take the "available" branch and later call a stub.
* Stubs live in sys.modules only while the peer module is being imported, and are removed right after:
  the peer keeps the references it bound, while later `importlib.util.find_spec("ray")`,
  `pytest.importorskip("ray")` or `import transformers` elsewhere in the same pytest process still see
  that the package is absent. A function-level import of a stubbed module in the peer, at call time, raises
  ImportError as it would without the stub (OpenRLHF's log_probs_from_logits relies on that for flash_attn).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys

import pytest

from kl_kernels.bench.peer_stubs import stubbed as _stubbed

# The pip command that makes every function below return a module (tested with Python 3.11, torch 2.13 CPU).
# --no-deps is essential: the peers' declared dependencies would replace torch and pull in CUDA builds.
PEER_PIP = (
    "pip install --no-deps verl==0.9.1 openrlhf==0.11.2 trl==1.16.0 liger-kernel==0.8.5 "
    "omegaconf==2.3.0 antlr4-python3-runtime==4.9.3 pyyaml"
)


# --------------------------------------------------------------------------------------------- import


LANE = "not in the suite's virtualenv: .ci/lane-verl runs these tests"


def _require(peer, dist_modules, hint=None):
    """Skip unless the peer's own package and its small real dependencies are installed."""
    absent = [m for m in dist_modules if importlib.util.find_spec(m) is None]
    if absent:
        pytest.skip(f"{peer} not installed: no module {', '.join(absent)} ({hint or 'install with: ' + PEER_PIP})")


def _import(peer, module, real, stubs):
    """Import `module` of `peer` (skipping when `real` modules are absent), with `stubs` stubbed if missing."""
    if module in sys.modules:
        return sys.modules[module]
    _require(peer, real)
    with _stubbed(stubs):
        return importlib.import_module(module)


# verl's import chain (verl/__init__ -> verl.protocol, verl.utils.*, verl.workers.config) needs, unconditionally:
#   ray          verl/protocol.py:29 `import ray` (remote-call plumbing of DataProto)
#   transformers verl/utils/torch_functional.py:30 `from transformers import PreTrainedTokenizer` (annotation);
#                verl/utils/model.py:51, verl/utils/transformers_compat.py:28 (HF model helpers)
#   codetiming   verl/utils/profiler/performance.py:23 `from codetiming import Timer` (timing only)
# omegaconf is real (the policy losses read DictConfig/dataclass configs; verl.utils.config uses OmegaConf),
# and so is tensordict (verl.utils.torch_functional imports TensorDict; apply_kl_penalty's data.batch is one).
# flash_attn and torch_npu are NOT stubbed: verl imports them under try/except ImportError.
_VERL_REAL = ("verl", "omegaconf", "yaml", "tensordict")
_VERL_STUBS = ("ray", "transformers", "codetiming")


def verl_core_algos():
    """verl.trainer.ppo.core_algos (verl 0.9.1): kl_penalty, kl_penalty_forward, agg_loss,
    compute_policy_loss_vanilla, get_policy_loss_fn, AdaptiveKLController, FixedKLController, get_kl_controller."""
    return _import("verl", "verl.trainer.ppo.core_algos", _VERL_REAL, _VERL_STUBS)


def verl_torch_functional():
    """verl.utils.torch_functional (verl 0.9.1): masked_mean, masked_sum, masked_whiten, ..."""
    return _import("verl", "verl.utils.torch_functional", _VERL_REAL, _VERL_STUBS)


def verl_apply_kl_penalty():
    """verl's `apply_kl_penalty(data, kl_ctrl, kl_penalty="kl") -> (data, metrics)`, as a function.

    It lives in verl/trainer/ppo/ray_trainer.py, whose import chain reaches megatron, vllm, uvicorn/fastapi and
    more, and whose own body needs only torch, core_algos and masked_mean. So its exact source is taken out
    of the installed file (by the AST, not by line numbers) and run with those globals. `data` only needs a
    `.batch` mapping with `batch_size` (a tensordict.TensorDict works) holding response_mask,
    token_level_scores, old_log_probs, ref_log_prob; it writes data.batch["token_level_rewards"].
    """
    core_algos = verl_core_algos()
    verl_F = verl_torch_functional()
    import ast
    import torch

    spec = importlib.util.find_spec("verl.trainer.ppo.ray_trainer")
    with open(spec.origin, encoding="utf-8") as f:
        source = f.read()
    tree = ast.parse(source, filename=spec.origin)
    node = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "apply_kl_penalty")
    namespace = {"torch": torch, "core_algos": core_algos, "masked_mean": verl_F.masked_mean, "DataProto": object}
    exec(compile(ast.Module(body=[node], type_ignores=[]), spec.origin, "exec"), namespace)
    return namespace["apply_kl_penalty"]


def verl_monkey_patch():
    """verl.models.transformers.monkey_patch (verl 0.9.1): apply_monkey_patch, which routes a Hugging Face model's
    forward through verl's fused kernels. Needs transformers really installed (the verl lane, .ci/lane-verl: a
    stub cannot build a model); skipped without it. ray and codetiming are stubbed only where absent."""
    _require("verl's model patch", ("transformers",), LANE)
    return _import("verl", "verl.models.transformers.monkey_patch", _VERL_REAL, ("ray", "codetiming"))


def verl_module(name):
    """Any verl 0.9.1 module whose import chain the verl stubs cover (verl.protocol for DataProto, verl.workers.config
    for ActorConfig, verl.trainer.config for AlgoConfig/KLControlConfig, ...)."""
    return _import("verl", name, _VERL_REAL, _VERL_STUBS)


def verl_losses():
    """verl.workers.utils.losses (verl 0.9.1): ppo_loss, the actor's loss (policy loss from the registry, entropy
    and KL terms). Its import chain reaches verl.utils.dataset, which imports `datasets` (the verl lane,
    .ci/lane-verl, installs it); skipped without it."""
    _require("verl's actor losses", ("datasets",), LANE)
    return _import("verl", "verl.workers.utils.losses", _VERL_REAL, _VERL_STUBS)


# OpenRLHF: openrlhf/models/__init__ imports the whole model package (Actor, reward models, ring attention), and
# openrlhf/trainer/ppo_utils/__init__ imports experience/replay-buffer/length-penalty helpers. Unconditionally:
#   peft, transformers
#                openrlhf/models/actor.py:6-9 (LoRA, HF models, HfDeepSpeedConfig); openrlhf/utils/utils.py:5
#   flash_attn   openrlhf/models/ring_attn_utils.py:3-4 (varlen attention). log_probs_from_logits' own
#                `from flash_attn...` at call time still raises ImportError (stub gone) and takes the torch path.
#   deepspeed    openrlhf/models/utils.py:4 (ZeRO helpers)
#   pylatexenc   openrlhf/utils/math_utils.py:13 (math-answer reward parsing), reached via openrlhf.utils
_OPENRLHF_REAL = ("openrlhf",)
_OPENRLHF_STUBS = ("deepspeed", "transformers", "peft", "flash_attn", "pylatexenc")


def openrlhf_utils():
    """openrlhf.models.utils (openrlhf 0.11.2): compute_approx_kl, compute_reward, masked_mean, ..."""
    return _import("openrlhf", "openrlhf.models.utils", _OPENRLHF_REAL, _OPENRLHF_STUBS)


def openrlhf_loss():
    """openrlhf.models.loss (openrlhf 0.11.2): PolicyLoss, aggregate_loss, ValueLoss, ..."""
    return _import("openrlhf", "openrlhf.models.loss", _OPENRLHF_REAL, _OPENRLHF_STUBS)


def openrlhf_kl_controllers():
    """openrlhf.trainer.ppo_utils.kl_controller (openrlhf 0.11.2): AdaptiveKLController, FixedKLController."""
    return _import("openrlhf", "openrlhf.trainer.ppo_utils.kl_controller", _OPENRLHF_REAL, _OPENRLHF_STUBS)


# OpenRLHF's trainer modules (trainer/ppo_utils/experience_maker.py, trainer/ray/ppo_actor.py) also need ray (remote
# calls; real in the verl lane), aiohttp (its vLLM/agent HTTP client; real in the verl lane) and vllm (GPU-only:
# always a stub), through openrlhf/trainer/ray/__init__ -> vllm_engine.
_OPENRLHF_TRAINER_STUBS = _OPENRLHF_STUBS + ("ray", "vllm", "aiohttp")


def openrlhf_module(name):
    """Any OpenRLHF 0.11.2 module, its trainer modules included (stubs: _OPENRLHF_TRAINER_STUBS, where absent). The
    trainer's chain also imports tqdm (progress bars), which the suite's virtualenv lacks: skipped there, run in the
    verl lane."""
    if name.startswith("openrlhf.trainer") or name.startswith("openrlhf.utils"):
        _require("OpenRLHF's trainer modules", ("tqdm",), LANE)
    return _import("openrlhf", name, _OPENRLHF_REAL, _OPENRLHF_TRAINER_STUBS)


def openrlhf_actor():
    """openrlhf.models.actor (OpenRLHF 0.11.2): Actor, whose forward computes the policy's log-probs and entropy.
    Needs transformers and peft really installed (the verl lane, .ci/lane-verl: a stub cannot build a model);
    skipped without them."""
    _require("OpenRLHF's Actor", ("transformers", "peft"), LANE)
    return _import("openrlhf", "openrlhf.models.actor", _OPENRLHF_REAL, _OPENRLHF_TRAINER_STUBS)


# TRL: trl/trainer/grpo_trainer.py is a transformers.Trainer subclass; at module level it (and trl.data_utils,
# trl.trainer.utils, trl.experimental.utils, base_trainer, callbacks) needs, unconditionally:
#   transformers, accelerate   Trainer/TrainingArguments bases, gather/set_seed/logging helpers (grpo_trainer.py:36-58)
#   datasets, pyarrow          dataset types and Arrow helpers (grpo_trainer.py:39, data_utils.py:21-23)
#   huggingface_hub            model-card / hub upload helpers (grpo_trainer.py:40)
#   pandas                     completion logging tables (grpo_trainer.py:33)
# None of them is used by GRPOTrainer._compute_loss, whose math is plain torch; vllm, peft, wandb, ... are
# probed with find_spec / is_*_available and imported lazily, so they need no stub.
# GRPOTrainer cannot be constructed with these stubs: call `GRPOTrainer._compute_loss(fake_self, None, inputs)`
# unbound, with a namespace carrying the attributes it reads (recipe in /tmp/peers/NOTES.md, TRL section).
_TRL_REAL = ("trl",)
_TRL_STUBS = ("transformers", "accelerate", "datasets", "huggingface_hub", "pandas", "pyarrow")


def trl_grpo_module():
    """trl.trainer.grpo_trainer (trl 1.16.0): GRPOTrainer (use its _compute_loss unbound) and GRPOConfig (its
    defaults can be read with dataclasses.fields; it cannot be instantiated over the stubbed TrainingArguments)."""
    return _import("trl", "trl.trainer.grpo_trainer", _TRL_REAL, _TRL_STUBS)


# Liger-Kernel (0.8.5): its package init imports its Triton kernels (triton is this project's test
# dependency: real) and nothing heavy; its chunked losses run on CPU tensors with compiled=False.
_LIGER_REAL = ("liger_kernel", "triton")


def liger_grpo_loss():
    """liger_kernel.chunked_loss.grpo_loss (liger-kernel 0.8.5): LigerFusedLinearGRPOLoss, the fused linear
    GRPO loss from hidden states (chunked over the batch, gradients formed during the forward)."""
    return _import("liger-kernel", "liger_kernel.chunked_loss.grpo_loss", _LIGER_REAL, ())
