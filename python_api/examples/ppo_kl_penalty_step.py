"""A few PPO update steps on a tiny token policy with kl_kernels.kl_penalty_loss and an adaptive
KL coefficient: ragged responses (right padding), per-sequence advantages, PPO clip, k3 KL to a
frozen reference, entropy bonus. Runs on the CPU in a second.

    python python_api/examples/ppo_kl_penalty_step.py
"""

from __future__ import annotations

import torch

from kl_kernels import AdaptiveKLController, kl_penalty_loss

VOCAB, B, T = 32, 8, 12
torch.manual_seed(0)


class TinyPolicy(torch.nn.Module):
    """Next-token logits from the previous token: enough to have real log-probs and entropies."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, 16)
        self.out = torch.nn.Linear(16, VOCAB)

    def forward(self, tokens):  # [B, T] -> log-probs of the given tokens [B, T] and entropies [B, T]
        prev = torch.nn.functional.pad(tokens[:, :-1], (1, 0))
        logp = torch.log_softmax(self.out(self.emb(prev)), -1)
        return logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1), -(logp.exp() * logp).sum(-1)


policy, reference = TinyPolicy(), TinyPolicy()
reference.load_state_dict(policy.state_dict())
optimizer = torch.optim.Adam(policy.parameters(), lr=3e-2)
ctl = AdaptiveKLController(beta=0.1, dtarg=0.01)

tokens = torch.randint(0, VOCAB, (B, T))
lengths = torch.randint(1, T + 1, (B,))           # ragged responses, right-padded
with torch.no_grad():
    old_log_probs, _ = policy(tokens)
    ref_log_probs, _ = reference(tokens)
scores = torch.randn(B)
advantages = (scores - scores.mean()) / (scores.std() + 1e-6)  # one advantage per sequence

for step in range(4):
    log_probs, entropy = policy(tokens)
    out = kl_penalty_loss(log_probs, old_log_probs, advantages, ref_log_probs=ref_log_probs, beta=ctl.beta,
                          estimator="k3", lengths=lengths, padding_side="right", clip_epsilon=0.2,
                          entropy=entropy, entropy_coef=0.01)
    optimizer.zero_grad()
    out.loss.backward()
    optimizer.step()
    ctl.update(out.kl_mean)  # after the step: the gradient used the beta of its own forward pass
    print(f"step {step}: loss {float(out.loss):+.4f}  objective {float(out.loss_objective):+.4f}  "
          f"kl {float(out.kl_mean):.5f}  clip {float(out.clip_fraction):.2f}  beta -> {float(ctl.beta):.3f}")
    assert torch.isfinite(out.loss)
assert int(out.num_tokens) == int(lengths.sum())
