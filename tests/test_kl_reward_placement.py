"""Reward placement: what 'auto' infers, what it refuses, and the trailing dim of 1."""

from __future__ import annotations

import pytest
import torch

from kl_kernels import kl_reward

B, T = 2, 3
LP = torch.tensor([[-1.0, -2.0, -0.5], [-0.1, -0.2, -0.3]])
REF = torch.tensor([[-1.5, -1.0, -0.5], [-0.3, -0.2, -0.1]])
KL = LP - REF


@pytest.mark.parametrize("shape, placement, out_shape", [
    ((B, T), "token", (B, T)),
    ((B, T, 1), "token", (B, T, 1)),
    ((B, 1), "sequence", (B, T)),
    ((B, 1, 1), "sequence", (B, T, 1)),
], ids=["token", "token-trailing", "seq-B1-broadcast", "seq-B11-torchrl"])
def test_auto_infers_unambiguous_shapes(shape, placement, out_shape):
    reward = torch.arange(1.0, 1.0 + torch.Size(shape).numel()).reshape(shape)
    auto = kl_reward(LP, REF, reward, coef=0.5)
    explicit = kl_reward(LP, REF, reward, coef=0.5, reward_placement=placement)
    assert auto.reward.shape == out_shape and torch.equal(auto.reward, explicit.reward)
    want = (reward if placement == "token" else reward.reshape(B, 1, *shape[2:])).expand(out_shape) - 0.5 * KL.reshape(
        out_shape)
    torch.testing.assert_close(auto.reward, want)


def test_auto_refuses_per_sequence_vector():
    with pytest.raises(ValueError, match="'sequence', as TorchRL.*'last', as OpenRLHF.*'last_valid', as verl"):
        kl_reward(LP, REF, torch.ones(B))


def test_last_and_sequence_placements_differ_as_documented():
    score = torch.tensor([10.0, 20.0])
    seq = kl_reward(LP, REF, score, reward_placement="sequence", lengths=torch.tensor([2, 3]), padding_side="right")
    last = kl_reward(LP, REF, score, reward_placement="last", lengths=torch.tensor([2, 3]), padding_side="right")
    assert seq.reward[0].tolist() == pytest.approx([10 - 0.5, 10 + 1.0, 10.0])  # padding column keeps reward[b]
    assert last.reward[0].tolist() == pytest.approx([-0.5, 10 + 1.0, 0.0])      # reward on the last valid token
    assert last.reward[1].tolist() == pytest.approx([-0.2, 0.0, 20 + 0.2])


def test_last_placement_goes_to_last_masked_token():
    mask = torch.tensor([[True, False, False], [False, True, False]])
    out = kl_reward(LP, REF, torch.tensor([1.0, 2.0]), mask=mask, reward_placement="last", coef=0.0)
    assert out.reward.tolist() == [[1.0, 0.0, 0.0], [0.0, 2.0, 0.0]]


@pytest.mark.parametrize("backend", ["torch", "cpu", pytest.param("cuda-emulated", marks=pytest.mark.cuda_emulated),
                                     pytest.param("triton", marks=pytest.mark.triton)])
@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_last_valid_placement_ignores_the_mask(backend, layout):
    """"last_valid": the reward goes on the last valid token even when it is masked out (a tool's
    output at the end of a turn), where "last" puts it on the last counted one; the kl there is 0
    unless that token counts."""
    from conftest import backend_device

    mask = torch.tensor([[True, False, False], [False, True, True]])
    kw = dict(coef=0.5, lengths=torch.tensor([3, 2]), padding_side="right")
    lp, ref = LP, REF
    if layout == "packed":
        keep = torch.tensor([[True, True, True], [True, True, False]])
        lp, ref, mask = LP[keep], REF[keep], mask[keep]
        kw = dict(coef=0.5, offsets=torch.tensor([0, 3, 5]))
    dev = backend_device(backend)
    lp, ref, mask = lp.to(dev), ref.to(dev), mask.to(dev)
    kw = {k: v.to(dev) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
    score = torch.tensor([10.0, 20.0], device=dev)
    got = {p: kl_reward(lp, ref, score, mask=mask, reward_placement=p, backend=backend, **kw).reward.cpu()
           for p in ("last", "last_valid")}
    flat = (lambda r: r[keep]) if layout == "packed" else (lambda r: r)
    k = KL * torch.tensor([[True, False, False], [False, True, False]])  # counted: valid and in the mask
    # row 0: last counted is column 0, last valid column 2 (not counted); row 1 (length 2): column 1 for both
    want_last = torch.tensor([[10.0, 0.0, 0.0], [0.0, 20.0, 0.0]]) - 0.5 * k
    want_valid = torch.tensor([[0.0, 0.0, 10.0], [0.0, 20.0, 0.0]]) - 0.5 * k
    torch.testing.assert_close(got["last"], flat(want_last))
    torch.testing.assert_close(got["last_valid"], flat(want_valid))


def test_reward_dtype_promotion():
    lp = LP.to(torch.bfloat16)
    out = kl_reward(lp, REF.to(torch.bfloat16), torch.ones(B, T, dtype=torch.float32))
    assert out.kl.dtype == torch.bfloat16 and out.reward.dtype == torch.float32 and out.kl_sum.dtype == torch.float32
    out = kl_reward(lp, REF.to(torch.bfloat16), torch.ones(B, T, dtype=torch.int64))
    assert out.reward.dtype == torch.bfloat16


@pytest.mark.parametrize("coef", [0.25, torch.tensor(0.25), torch.tensor([0.25, 0.25])], ids=["float", "0d", "per-seq"])
def test_coef_kinds_agree(coef):
    out = kl_reward(LP, REF, coef=coef)
    torch.testing.assert_close(out.reward, -0.25 * KL)
