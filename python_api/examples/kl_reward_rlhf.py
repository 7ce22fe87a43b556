"""End-to-end example: KL-penalized rewards for a multi-turn RLHF batch, three ways.

Run with ``python python_api/examples/kl_reward_rlhf.py``. The test suite runs it too, so it stays
correct. It builds a small batch of chat transcripts: a prompt, then assistant turns separated by a
tool turn. It computes the reward that TorchRL, verl and an adaptive-coefficient trainer would feed to
the advantage estimator, and checks that the packed, padded and nested layouts agree.
"""

import torch

from kl_kernels import info, kl_reward, ragged

torch.manual_seed(0)

# --- a batch of 4 transcripts with different lengths ------------------------------------------
lengths = torch.tensor([9, 5, 12, 1])
offsets = ragged.lengths_to_offsets(lengths)
n = int(lengths.sum())
policy_lp = -torch.rand(n) * 3            # log-probs of the sampled tokens under the policy
reference_lp = policy_lp + 0.2 * torch.randn(n)
prompt_lens = torch.tensor([3, 2, 4, 1])  # prompt tokens never count
# assistant mask: assistant turns, with a tool turn (not counted) in the middle of transcript 2
assistant = torch.ones(n, dtype=torch.bool)
assistant[int(offsets[2]) + 7: int(offsets[2]) + 9] = False
score = torch.tensor([1.0, 0.0, -0.5, 2.0])   # one scalar score per transcript

# --- TorchRL style: padded (left), per-token reward [B, T, 1] built by broadcasting the score ----
lp_pad = ragged.to_padded(policy_lp, offsets, padding_side="left")
ref_pad = ragged.to_padded(reference_lp, offsets, padding_side="left")
mask_pad = ragged.to_padded(assistant, offsets, padding_side="left")
torchrl = kl_reward(lp_pad, ref_pad, score.view(-1, 1, 1), coef=0.1, mask=mask_pad, lengths=lengths,
                    prompt_lens=prompt_lens, return_ref=True)
print("TorchRL-style reward shape:", tuple(torchrl.reward.shape))  # (4, 12, 1)

# --- verl style: packed, clamped k3, score on the last assistant token -------------------------
verl = kl_reward(policy_lp, reference_lp, score, coef=0.1, estimator="k3", mask=assistant, offsets=offsets,
                 prompt_lens=prompt_lens, reward_placement="last", clamp_input=(-20, 20), clamp_output=(-10, 10))
per_sequence_return = torch.segment_reduce(verl.reward, "sum", offsets=offsets)
torch.testing.assert_close(per_sequence_return, score - 0.1 * verl.kl_sum)
print("verl-style returns:", [round(x, 4) for x in per_sequence_return.tolist()])
print("counted tokens per transcript:", verl.count.tolist())

# --- the same batch as a jagged nested tensor: the layout comes back nested ---------------------
nested = torch.nested.nested_tensor_from_jagged(policy_lp, offsets)
nested_ref = torch.nested.nested_tensor_from_jagged(reference_lp, offsets)
nested_mask = torch.nested.nested_tensor_from_jagged(assistant, offsets)
out = kl_reward(nested, nested_ref, mask=nested_mask, prompt_lens=prompt_lens, estimator="k3")
assert out.kl.is_nested
torch.testing.assert_close(out.kl.values(), verl.kl)

# --- the padded TorchRL-style KL equals the packed one, token for token ---------------------------
packed_kl = kl_reward(policy_lp, reference_lp, mask=assistant, offsets=offsets, prompt_lens=prompt_lens).kl
torch.testing.assert_close(ragged.from_padded(torchrl.kl, lengths, padding_side="left").values, packed_kl)

# --- an adaptive coefficient stays a tensor: no host sync, no recompilation ----------------------
coef = torch.tensor(0.05)
for step in range(3):
    out = kl_reward(policy_lp, reference_lp, score, coef=coef, mask=assistant, offsets=offsets,
                    reward_placement="last")
    mean_kl = out.kl_sum.sum() / out.count.sum().clamp(min=1)
    coef = torch.where(mean_kl > 0.01 * 1.5, coef * 2, torch.where(mean_kl < 0.01 / 1.5, coef / 2, coef))
print("coefficient after 3 adaptive steps:", round(float(coef), 4))
print("backend used: torch reference" if not info()["backends"]["cpu"]["available"] else "backend: fused CPU")
