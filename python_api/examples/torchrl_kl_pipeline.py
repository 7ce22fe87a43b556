"""A TorchRL-style KL-reward data pipeline with kl_kernels' drop-in transforms.

A small real reference model (an embedding and a linear head: log-prob of each token given the
previous one) scores the tokens. The policy's log-probs are in the data, as a collector leaves them.
KLRewardTransform subtracts coef * KL from the reward on assistant tokens, on a left-padded batch and
on a ragged lazy stack. RetrieveKL then runs both models and KLComputation. Each is used as TorchRL
documents it; only the import changes.
"""

import warnings

import torch
from tensordict import TensorDict, lazy_stack

from kl_kernels.torchrl import KLRewardTransform, RetrieveKL

warnings.filterwarnings("ignore", category=DeprecationWarning)
VOCAB = 32


class TinyLM(torch.nn.Module):
    """The interface TorchRL's transforms use, over a real (tiny) torch model."""

    def __init__(self, seed, *, log_probs_key="log_probs", pad_output=True, input_mode="tokens"):
        super().__init__()
        torch.manual_seed(seed)
        self.emb, self.head = torch.nn.Embedding(VOCAB + 1, 16), torch.nn.Linear(16, VOCAB)
        self.log_probs_key, self.pad_output, self.input_mode = log_probs_key, pad_output, input_mode
        self.generate, self.return_log_probs, self.layout = False, True, torch.strided
        self.in_keys, self.out_keys = [("tokens", "full")], [(log_probs_key, "full")]

    @torch.no_grad()
    def token_log_probs(self, tokens):
        prev = torch.cat([torch.full_like(tokens[..., :1], VOCAB), tokens[..., :-1]], -1)
        return self.head(self.emb(prev)).log_softmax(-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)

    def forward(self, td):
        key = (self.log_probs_key, "full")
        if self.pad_output:
            td.set(key, self.token_log_probs(td["tokens", "full"]))
        else:
            for sub in td.tensordicts:
                sub.set(key, self.token_log_probs(sub["tokens", "full"]))
        return td


class ActionKey:
    # Inside a TransformedEnv the transform reads the action key from the env; here we give it.
    action_key = ("tokens", "full")


class PipelineKLReward(ActionKey, KLRewardTransform):
    pass


policy, reference = TinyLM(0), TinyLM(1)
lengths, prompts = [7, 12, 4], [3, 5, 2]
seqs = [torch.randint(0, VOCAB, (n,)) for n in lengths]
assistant = [torch.arange(n) >= p for n, p in zip(lengths, prompts)]

# 1. A left-padded batch, one score per sequence ([B, 1, 1]), as TorchRL's envs store it.
width = max(lengths)
pad = lambda xs, v: torch.stack([torch.cat([torch.full((width - len(x),), v, dtype=x.dtype), x]) for x in xs])  # noqa: E731
tokens = pad(seqs, 0)
data = TensorDict({("tokens", "full"): tokens, ("log_probs", "full"): policy.token_log_probs(tokens),
                   ("masks", "all_assistant_mask"): pad(assistant, False)}, batch_size=(3,))
scores = TensorDict({"reward": torch.tensor([1.0, 0.0, -1.0]).view(3, 1, 1)}, batch_size=(3,))
out = PipelineKLReward(reference, coef=0.05)._step(data, scores.clone())
print("padded: reward", tuple(out["reward"].shape), "kl", tuple(out["kl_penalty"].shape))
kl = out["kl_penalty"].squeeze(-1)
assert (kl[~data["masks", "all_assistant_mask"]] == 0).all()  # only assistant tokens count
assert torch.allclose(out["reward"].squeeze(-1), scores["reward"].view(3, 1) - 0.05 * kl)

# 2. The same samples as a ragged lazy stack (pad_output=False): TorchRL 0.14.1 fails here.
ragged_ref = TinyLM(1, pad_output=False)
data = lazy_stack([TensorDict({("tokens", "full"): s, ("log_probs", "full"): policy.token_log_probs(s),
                               ("masks", "all_assistant_mask"): m}) for s, m in zip(seqs, assistant)])
scores = lazy_stack([TensorDict({"reward": torch.tensor([[r]])}) for r in (1.0, 0.0, -1.0)])
out = PipelineKLReward(ragged_ref, coef=0.05)._step(data, scores)
print("ragged: reward", [tuple(r.shape) for r in out.get("reward", as_list=True)])

# 3. RetrieveKL: the generation and reference models' log-probs, then KLComputation.
gen = TinyLM(0, pad_output=False, input_mode="history")
ref = TinyLM(1, pad_output=False, input_mode="history", log_probs_key="ref_log_probs")
batch = lazy_stack([TensorDict({("tokens", "full"): s, ("masks", "all_assistant_mask"): m,
                                "reward": torch.zeros(len(s), 1)}) for s, m in zip(seqs, assistant)])
out = RetrieveKL(gen, ref, coeff=0.05)(batch)
print("RetrieveKL: kl_penalty", [tuple(k.shape) for k in out.get("kl_penalty", as_list=True)])
