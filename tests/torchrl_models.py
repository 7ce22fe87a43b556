"""A small real language model with the interface TorchRL's LLM KL transforms use, no downloads.

``TinyLM`` is an actual torch module (embedding + linear head): the log-prob of token t is
``log_softmax(head(emb(token t-1)))[token t]`` (a BOS row for t = 0), computed from the token ids
in ``("tokens", "full")``. Like TorchRL's wrappers it exposes ``in_keys``, ``out_keys``,
``log_probs_key``, ``pad_output``, ``input_mode``, ``layout``, ``generate`` and
``return_log_probs``, and writes ``(log_probs_key, "full")``: padded ``[B, T]`` when
``pad_output`` (padding columns get 0), else one tensor per sample in a lazy stack.
"""

from __future__ import annotations

import torch
from tensordict import LazyStackedTensorDict, TensorDict, lazy_stack

PAD = 0


class TinyLM(torch.nn.Module):
    def __init__(self, vocab: int = 13, dim: int = 8, seed: int = 0, *, pad_output: bool = True,
                 log_probs_key: str = "log_probs", input_mode: str = "tokens", generate: bool = False,
                 return_log_probs: bool = True, layout=torch.strided):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.emb = torch.nn.Embedding(vocab + 1, dim)  # the last row is BOS
        self.head = torch.nn.Linear(dim, vocab)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g))
        self.vocab = vocab
        self.pad_output = pad_output
        self.log_probs_key = log_probs_key
        self.input_mode = input_mode
        self.generate = generate
        self.return_log_probs = return_log_probs
        self.layout = layout
        self.in_keys = [("tokens", "full")]
        self.out_keys = [(log_probs_key, "full")]

    def token_log_probs(self, tokens: torch.Tensor) -> torch.Tensor:
        """[..., L] token ids -> [..., L] log-probs of each token given the previous one."""
        bos = torch.full((*tokens.shape[:-1], 1), self.vocab, dtype=tokens.dtype, device=tokens.device)
        prev = torch.cat([bos, tokens[..., :-1]], -1)
        logp = self.head(self.emb(prev)).log_softmax(-1)
        return logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)

    def forward(self, td):
        key = (self.log_probs_key, "full")
        if isinstance(td, LazyStackedTensorDict):
            for sub in td.tensordicts:
                sub.set(key, self.token_log_probs(sub.get(("tokens", "full"))))
            return td
        tokens = td.get(("tokens", "full"))
        lp = self.token_log_probs(tokens)
        attention = td.get(("masks", "all_attention_mask"), None)
        if attention is not None:
            lp = lp.masked_fill(~attention, 0.0)
        td.set(key, lp)
        return td


def llm_batch(lengths, prompt_lengths, *, policy: TinyLM, padded: bool, padding_side: str = "left", seed: int = 0,
              per_token_reward: bool = True, assistant_mask: bool = True):
    """A batch as TorchRL's LLM envs store it: tokens, masks, the policy's log-probs, a reward.

    ``padded``: a dense TensorDict of ``[B, T]`` entries padded on ``padding_side`` (prompt tokens
    ``[B, P]``, ``P = max(prompt_lengths)``); otherwise a lazy stack of per-sample entries.
    """
    g = torch.Generator().manual_seed(seed)
    samples = []
    for n, p in zip(lengths, prompt_lengths):
        tokens = torch.randint(1, policy.vocab, (n,), generator=g)
        assistant = torch.zeros(n, dtype=torch.bool)
        assistant[p:] = torch.rand(n - p, generator=g) < 0.8  # a few tool tokens inside the response
        reward = torch.randn(n, 1, generator=g) if per_token_reward else torch.randn(1, 1, generator=g)
        samples.append(dict(tokens=tokens, prompt=tokens[:p], assistant=assistant, reward=reward))
    with torch.no_grad():
        for s in samples:
            s["log_probs"] = policy.token_log_probs(s["tokens"])
    if not padded:
        tds = []
        for s in samples:
            d = {("tokens", "full"): s["tokens"], ("tokens", "prompt"): s["prompt"],
                 ("masks", "all_attention_mask"): torch.ones_like(s["assistant"]),
                 ("log_probs", "full"): s["log_probs"]}
            if assistant_mask:
                d[("masks", "all_assistant_mask")] = s["assistant"]
            tds.append(TensorDict(d, batch_size=()))
        data = lazy_stack(tds)
        rewards = lazy_stack([TensorDict({"reward": s["reward"]}, batch_size=()) for s in samples])
        return data, rewards
    width = max(lengths, default=0)
    pwidth = max(prompt_lengths, default=0)

    def pad(x, w, value):
        out = torch.full((w,), value, dtype=x.dtype)
        if padding_side == "left":
            out[w - x.shape[0]:] = x
        else:
            out[:x.shape[0]] = x
        return out

    b = len(samples)
    d = {("tokens", "full"): torch.stack([pad(s["tokens"], width, PAD) for s in samples]) if b else
         torch.zeros(0, 0, dtype=torch.long),
         ("tokens", "prompt"): torch.stack([pad(s["prompt"], pwidth, PAD) for s in samples]) if b else
         torch.zeros(0, 0, dtype=torch.long),
         ("masks", "all_attention_mask"): torch.stack([pad(torch.ones(len(s["tokens"]), dtype=torch.bool), width,
                                                           False) for s in samples]),
         ("log_probs", "full"): torch.stack([pad(s["log_probs"], width, 0.0) for s in samples])}
    if assistant_mask:
        d[("masks", "all_assistant_mask")] = torch.stack([pad(s["assistant"], width, False) for s in samples])
    data = TensorDict(d, batch_size=(b,))
    if per_token_reward:
        reward = torch.stack([pad(s["reward"].squeeze(-1), width, 0.0) for s in samples]).unsqueeze(-1)
    else:
        reward = torch.stack([s["reward"] for s in samples])
    return data, TensorDict({"reward": reward}, batch_size=(b,))


def continuous_actor_critic(seed: int = 1, obs_dim: int = 4, act_dim: int = 2, *, tanh: bool = False):
    """A small continuous-control actor and critic, as in TorchRL's PPO tutorials: deterministic
    weights from ``seed``. The actor's distribution is an independent normal (analytic KL) or,
    with ``tanh``, a tanh-normal (no analytic KL: TorchRL's Monte-Carlo estimate)."""
    from tensordict.nn import NormalParamExtractor, TensorDictModule
    from torchrl.modules import IndependentNormal, ProbabilisticActor, TanhNormal, ValueOperator

    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(obs_dim, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2 * act_dim),
                              NormalParamExtractor())
    actor = ProbabilisticActor(TensorDictModule(net, in_keys=["observation"], out_keys=["loc", "scale"]),
                               in_keys=["loc", "scale"], distribution_class=TanhNormal if tanh else IndependentNormal,
                               return_log_prob=True)
    critic = ValueOperator(torch.nn.Sequential(torch.nn.Linear(obs_dim, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)),
                           in_keys=["observation"])
    return actor, critic


class _TokenLogits(torch.nn.Module):
    """Logits of token t from the context token at t (embedding + linear head)."""

    def __init__(self, vocab: int, dim: int):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, dim)
        self.head = torch.nn.Linear(dim, vocab)

    def forward(self, context):
        return self.head(self.emb(context))


def token_actor(vocab: int = 11, dim: int = 8, seed: int = 0):
    """A per-token policy as a TorchRL actor: ``"context"`` ``[B, T]`` token ids -> a categorical
    distribution over the vocabulary per token; ``"action"`` ``[B, T]``, ``"action_log_prob"`` ``[B, T]``."""
    from tensordict.nn import TensorDictModule
    from torchrl.modules import ProbabilisticActor

    torch.manual_seed(seed)
    return ProbabilisticActor(TensorDictModule(_TokenLogits(vocab, dim), in_keys=["context"], out_keys=["logits"]),
                              in_keys=["logits"], distribution_class=torch.distributions.Categorical,
                              return_log_prob=True)


class DenseLazyLM(TinyLM):
    """A ``pad_output=False`` model run on a *dense* batch (``TensorDict(batch_size=(B,))`` whose token
    groups are lazily stacked sub-TensorDicts with ragged leaves): it writes its log-probs the same
    way, as a lazily stacked sub-TensorDict ``{log_probs_key: lazy_stack([{"full": [L_b]}])}``."""

    def forward(self, td):
        if isinstance(td, LazyStackedTensorDict):
            return super().forward(td)
        tokens = td.get("tokens").get("full", as_list=True)
        td.set(self.log_probs_key, lazy_stack([TensorDict({"full": self.token_log_probs(t)}) for t in tokens]))
        return td


def dense_of_lazy(data: LazyStackedTensorDict, keys=("tokens", "masks", "log_probs")) -> TensorDict:
    """The dense ``TensorDict(batch_size=(B,))`` holding ``data``'s groups as lazily stacked sub-TensorDicts."""
    return TensorDict({k: data.get(k) for k in keys}, batch_size=[len(data.tensordicts)])


class GenerativeTinyLM(torch.nn.Module):
    """A generating policy for ``ChatEnv(input_mode="history")``, as TorchRL's wrappers with
    ``generate=True``: reads ``("history", "prompt")`` per sample, "tokenizes" it (one id per character
    of ``role:content``), samples ``new_tokens`` reply tokens from ``TinyLM(seed)`` and writes the
    ``ChatHistory`` (prompt, response, full), ``("tokens", "full"/"prompt"/"response")``,
    ``("masks", "all_assistant_mask"/"all_attention_mask")`` and ``("log_probs", "full")``, ragged
    per sample in the lazy stack it returns. Its ``in_keys``/``out_keys`` are TensorDict-style."""

    def __init__(self, seed: int = 1, new_tokens: int = 4):
        super().__init__()
        self.lm = TinyLM(seed=seed, input_mode="history", pad_output=False)
        self.new_tokens = new_tokens
        self.generate = True
        self.in_keys = [("history", "prompt")]
        self.out_keys = [("history", "full"), ("tokens", "full"), ("log_probs", "full")]

    def encode(self, history) -> torch.Tensor:
        ids = []
        for j in range(history.batch_size[0]):
            m = history[j]
            ids += [1 + ord(c) % (self.lm.vocab - 1) for c in f"{m.role}:{m.content}"]
        return torch.tensor(ids, dtype=torch.long)

    def forward(self, td):
        from torchrl.data.llm import History
        from torchrl.modules.llm.policies import ChatHistory

        if not isinstance(td, LazyStackedTensorDict):
            td = lazy_stack(list(td.unbind(0)))
        for i, sub in enumerate(td.tensordicts):
            history = sub.get(("history", "prompt"))
            prompt = self.encode(history)
            g = torch.Generator().manual_seed(1000 * i + len(prompt))
            response = torch.randint(1, self.lm.vocab, (self.new_tokens,), generator=g)
            full = torch.cat([prompt, response])
            reply = History(role="assistant", content="".join(chr(96 + int(t)) for t in response))
            sub.set("history", ChatHistory(prompt=history, response=reply.unsqueeze(0),
                                           full=lazy_stack([history[j] for j in range(history.batch_size[0])]
                                                           + [reply])))
            assistant = torch.zeros(len(full), dtype=torch.bool)
            assistant[len(prompt):] = True
            sub.set(("tokens", "full"), full)
            sub.set(("tokens", "prompt"), prompt)
            sub.set(("tokens", "response"), response)
            sub.set(("masks", "all_assistant_mask"), assistant)
            sub.set(("masks", "all_attention_mask"), torch.ones_like(assistant))
            with torch.no_grad():
                sub.set(("log_probs", "full"), self.lm.token_log_probs(full))
        return td
