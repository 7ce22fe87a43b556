"""kl_kernels.torchrl.KLRewardTransform with TorchRL's real LLM wrapper (``TransformersWrapper`` around a
tiny Qwen2 model built from a config and a byte-level tokenizer built in code: no download), as TorchRL's
own ``test_chat_env_kl`` builds it. TorchRL 0.14.1's signature decides: ``KLRewardTransform(ref_model)`` and
``KLRewardTransform(ref_model=...)`` are the language-model transform. The LLM wrappers have ``get_dist``,
``in_keys`` and ``out_keys``, so a duck-typed probabilistic-actor check took them for the classic-control
actor form (issue 50 item 6). Needs ``transformers`` (skipped without it)."""

from __future__ import annotations

import warnings

import pytest
import torch

pytestmark = pytest.mark.torchrl
warnings.filterwarnings("ignore", category=DeprecationWarning)


@pytest.fixture(scope="module")
def tiny():
    """(model, tokenizer): a 1-layer Qwen2 with random weights and a byte-level BPE tokenizer without merges."""
    pytest.importorskip("transformers")
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from trl_trainer_harness import tokenizer  # (tokenizers and transformers only: TRL's is not imported)

    tok = tokenizer()
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=len(tok), max_position_embeddings=512, hidden_size=16, intermediate_size=32,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    return Qwen2ForCausalLM(config).eval(), tok


def _ref(tiny, pad_output):
    from torchrl.modules.llm import TransformersWrapper

    model, tok = tiny
    # as TorchRL's test_chat_env_kl builds its reference model
    return TransformersWrapper(model, tokenizer=tok, input_mode="tokens", generate=False, return_log_probs=True,
                               pad_output=pad_output)


@pytest.mark.parametrize("pad_output", [True, False], ids=["padded", "unpadded"])
@pytest.mark.parametrize("form", ["positional", "ref_model="])
def test_llm_wrapper_builds_the_language_model_transform(tiny, pad_output, form):
    from torchrl.envs.llm.transforms import kl as trl

    import kl_kernels.torchrl as ours
    from kl_kernels.torchrl import ActorKLRewardTransform

    ref = _ref(tiny, pad_output)
    t = ours.KLRewardTransform(ref, coef=0.5) if form == "positional" else ours.KLRewardTransform(ref_model=ref,
                                                                                                  coef=0.5)
    assert type(t) is ours.KLRewardTransform and isinstance(t, trl.KLRewardTransform)
    assert not isinstance(t, ActorKLRewardTransform)
    assert t.ref_model is ref and float(t.coef) == 0.5
    # TorchRL's own class takes both forms the same way
    assert trl.KLRewardTransform(ref).ref_model is ref and trl.KLRewardTransform(ref_model=ref).ref_model is ref


def test_actor_form_stays_for_actor_keyword_and_non_llm_actors(tiny):
    """The seeds' classic-control form: actor= always; a positional probabilistic actor that is no LLM wrapper."""
    from tensordict.nn import TensorDictModule
    from torch import nn
    from torchrl.modules import ProbabilisticActor, TanhNormal

    import kl_kernels.torchrl as ours
    from kl_kernels.torchrl import ActorKLRewardTransform

    net = TensorDictModule(nn.Sequential(nn.Linear(3, 4), nn.Tanh()), in_keys=["observation"], out_keys=["param"])
    from tensordict.nn import NormalParamExtractor
    extract = TensorDictModule(NormalParamExtractor(), in_keys=["param"], out_keys=["loc", "scale"])
    from tensordict.nn import TensorDictSequential
    actor = ProbabilisticActor(TensorDictSequential(net, extract), in_keys=["loc", "scale"],
                               distribution_class=TanhNormal, return_log_prob=True)
    assert isinstance(ours.KLRewardTransform(actor), ActorKLRewardTransform)
    assert isinstance(ours.KLRewardTransform(actor=actor), ActorKLRewardTransform)
    assert isinstance(ours.KLRewardTransform(actor=_ref(tiny, True)), ActorKLRewardTransform)  # asked by name


@pytest.mark.slow
def test_in_a_chat_env_as_torchrl_test_chat_env_kl(tiny):
    """TransformedEnv(ChatEnv(...), KLRewardTransform(ref_model)) rolled out one step with a generating
    TransformersWrapper policy (then scored, so that the full log-probs exist, as vLLM's wrapper returns
    them in TorchRL's test), padded: the reward has TorchRL's [B, 1, T, 1] shape and the KL is the policy's
    minus the reference model's log-probs on the assistant tokens, recomputed here by calling the wrapper.
    TorchRL 0.14.1's own transform fails this rollout (its _step reads no reference log-probs)."""
    from tensordict import TensorDict
    from torchrl.envs import TransformedEnv
    from torchrl.envs.llm import ChatEnv
    from torchrl.modules.llm import TransformersWrapper

    import kl_kernels.torchrl as ours

    model, tok = tiny
    common = dict(tokenizer=tok, input_mode="history", return_log_probs=True, pad_output=True,
                  chat_template_name="chatml_format")
    gen = TransformersWrapper(model, generate=True, generate_kwargs=dict(max_new_tokens=5, do_sample=True), **common)
    score = TransformersWrapper(model, generate=False, **common)
    ref = _ref(tiny, True)
    env = TransformedEnv(ChatEnv(batch_size=(3,), input_mode="history", tokenizer=tok),
                         ours.KLRewardTransform(ref, coef=0.3))
    torch.manual_seed(0)
    start = env.reset(TensorDict({"query": ["hi", "hello there", "a"]}, batch_size=(3,)))
    r = env.rollout(1, lambda td: score(gen(td)), tensordict=start)
    reward, kl = r.get(("next", "reward")), r.get(("next", "kl_penalty"))
    assert reward.shape[:2] == (3, 1) and reward.shape[2] > 1 and reward.shape[3] == 1 and kl.shape == reward.shape
    step = r[:, 0]
    with torch.no_grad():
        ref_lp = ref(step.select(*ref.in_keys).copy()).get(("log_probs", "full"))
    mask = step.get(("masks", "all_assistant_mask"))
    want = torch.where(mask, step.get(("log_probs", "full")) - ref_lp, 0.0)
    torch.testing.assert_close(kl[:, 0, :, 0], want, atol=1e-5, rtol=1e-5)
    assert mask.any()
