"""Bad input to kl_penalty_loss: a TypeError/ValueError naming the argument, before any kernel runs."""

from __future__ import annotations

import pytest
import torch

from kl_kernels import BackendUnavailableError, kl_penalty_loss


def _ok(**over):
    lp = -torch.rand(3, 5)
    kw = dict(log_probs=lp, old_log_probs=lp.clone(), advantages=torch.randn(3), lengths=torch.tensor([5, 2, 0]))
    kw.update(over)
    return kw


BAD = [
    ("aggregation", dict(aggregation="mean"), ValueError, "aggregation must be one of"),
    ("estimator", dict(estimator="k4"), ValueError, "estimator must be one of"),
    ("clip negative", dict(clip_epsilon=-0.1), ValueError, "clip_epsilon must be >= 0"),
    ("clip >= 1", dict(clip_epsilon=(1.0, 0.2)), ValueError, "lower epsilon must be < 1"),
    ("clip triple", dict(clip_epsilon=(0.1, 0.2, 0.3)), ValueError, "pair (eps_low, eps_high)"),
    ("clip nan", dict(clip_epsilon=float("nan")), ValueError, "clip_epsilon must be finite"),
    ("entropy_coef str", dict(entropy_coef="0.1"), TypeError, "entropy_coef must be a real number"),
    ("beta bool", dict(beta=True), TypeError, "beta must be a real number"),
    ("beta shape", dict(beta=torch.ones(2)), ValueError, "beta must be a float, a 0-dim tensor or a per-sequence [B]"),
    ("beta int tensor", dict(beta=torch.ones(3, dtype=torch.int64)), TypeError, "beta must be a float, a 0-dim"),
    ("old shape", dict(old_log_probs=torch.zeros(3, 4)), ValueError, "old_log_probs must have the shape of log_probs"),
    ("old int", dict(old_log_probs=torch.zeros(3, 5, dtype=torch.int64)), TypeError, "old_log_probs must be a floating"),
    ("ref shape", dict(ref_log_probs=torch.zeros(5, 3)), ValueError, "ref_log_probs must have the shape of log_probs"),
    ("entropy shape", dict(entropy=torch.zeros(3)), ValueError, "entropy must have the shape of log_probs"),
    ("entropy int", dict(entropy=torch.zeros(3, 5, dtype=torch.int32)), TypeError, "entropy must be a floating"),
    ("adv shape", dict(advantages=torch.zeros(4)), ValueError, "advantages must be per-token [3, 5]"),
    ("adv int", dict(advantages=torch.zeros(3, dtype=torch.int64)), TypeError, "advantages must be a floating"),
    ("adv list", dict(advantages=[torch.zeros(5)]), TypeError, "advantages is a list or nested tensor"),
    ("mask float", dict(mask=torch.ones(3, 5)), TypeError, "mask must be a bool tensor"),
    ("lengths too long", dict(lengths=torch.tensor([6, 1, 1])), ValueError, "lengths"),
    ("norm_length other agg", dict(norm_length=10), ValueError, "norm_length applies to"),
    ("norm_length zero", dict(norm_length=0, aggregation="seq-mean-token-sum-norm"), ValueError,
     "norm_length must be > 0"),
    ("global tokens agg", dict(num_global_tokens=10, aggregation="sum"), ValueError,
     "num_global_tokens applies to aggregation='token-mean'"),
    ("global tokens negative", dict(num_global_tokens=-1), ValueError, "num_global_tokens must be an integer >= 0"),
    ("global tokens and group", dict(num_global_tokens=3, process_group=object()), ValueError,
     "num_global_tokens or process_group"),
    ("backend name", dict(backend="gpu"), ValueError, "backend must be one of"),
    ("dual clip 1", dict(dual_clip=1.0), ValueError, "dual_clip must be > 1.0"),
    ("dual clip nan", dict(dual_clip=float("nan")), ValueError, "dual_clip must be finite"),
    ("dual clip str", dict(dual_clip="3"), TypeError, "dual_clip must be a real number"),
    ("weights shape", dict(weights=torch.ones(3)), ValueError, "weights must have the shape of log_probs"),
    ("weights int", dict(weights=torch.ones(3, 5, dtype=torch.int64)), TypeError, "weights must be a floating"),
    ("weights list", dict(weights=[torch.ones(5)] * 3), TypeError, "weights must be a regular tensor"),
    ("weight_kl int", dict(weight_kl=1, weights=torch.ones(3, 5)), TypeError, "weight_kl must be a bool"),
    ("weight_kl alone", dict(weight_kl=True), ValueError, "pass weights too"),
    ("clamp_input triple", dict(clamp_input=(1, 2, 3)), ValueError, "clamp_input must be None or a pair"),
    ("clamp_output lo > hi", dict(clamp_output=(1.0, -1.0)), ValueError, "clamp_output must satisfy lo <= hi"),
    ("clamp_input nan", dict(clamp_input=(float("nan"), 1.0)), ValueError, "clamp_input bounds must be real"),
]


@pytest.mark.parametrize("name,over,exc,msg", BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_rejected_clearly(name, over, exc, msg):
    with pytest.raises(exc, match=None) as info:
        kl_penalty_loss(**_ok(**over))
    assert msg in str(info.value), str(info.value)


def test_packed_per_sequence_advantages_need_b1():
    lp = -torch.rand(7)
    kw = dict(old_log_probs=lp, offsets=torch.tensor([0, 3, 7]))
    with pytest.raises(ValueError, match=r"pass per-sequence advantages as \[B, 1\]"):
        kl_penalty_loss(lp, advantages=torch.zeros(2), **kw)
    kl_penalty_loss(lp, advantages=torch.zeros(2, 1), **kw)  # [B, 1]: per-sequence
    kl_penalty_loss(lp, advantages=torch.zeros(7), **kw)     # [N]: per-token


def test_packed_norm_length_required():
    lp = -torch.rand(7)
    with pytest.raises(ValueError, match="pass norm_length"):
        kl_penalty_loss(lp, lp, torch.zeros(7), offsets=torch.tensor([0, 3, 7]), aggregation="seq-mean-token-sum-norm")


def test_process_group_without_init():
    import torch.distributed as dist

    group = dist.ProcessGroup(0, 1)  # a real group object, while torch.distributed is not initialized
    with pytest.raises(RuntimeError, match="torch.distributed is not initialized"):
        kl_penalty_loss(**_ok(process_group=group))
    with pytest.raises(TypeError, match="process_group must be None or a torch.distributed.ProcessGroup"):
        kl_penalty_loss(**_ok(process_group=object()))


def test_cuda_backend_on_cpu_tensors_says_why():
    with pytest.raises(BackendUnavailableError, match="cuda"):
        kl_penalty_loss(**_ok(), backend="cuda")


def test_fused_declines_mixed_dtypes_with_a_reason():
    kw = _ok()
    kw["old_log_probs"] = kw["old_log_probs"].to(torch.bfloat16)
    with pytest.raises(BackendUnavailableError, match="differ in dtype"):
        kl_penalty_loss(**kw, backend="cpu")
    kl_penalty_loss(**kw)  # auto: the reference takes it
