"""How many device operations one eager ``cuda`` call issues besides its kernels: each is a launch
(and a trip through torch's dispatcher) on a GPU, and on the H200 runs of 2026-11-26 those, not the
kernels, set the time of every call (bench/results/gpu-h200-2026-11-26-third: kl_penalty_loss
forward+backward 1.4-1.7 ms at 137k-2.25M tokens, slower than eager autograd).

Counted here without a GPU, as tests/test_no_host_sync.py runs a call: fake CUDA tensors, the
kernel launch recorded instead of run. Counted: every aten op with a CUDA tensor in its result but
views, allocations (``empty``) and metadata. The bounds are the counts when this test was written:
a change that adds device work to a call fails here and must say why, or lower them.

Before the loss's aggregation moved into the CUDA kernels (``ops._EagerOnDevice``) its forward
issued 38 such ops besides the kernel (13 dtype copies, the float64 sums, weights, means and
roundings of ``aggregate.aggregate``), and its backward ~10 more through autograd.
"""

from __future__ import annotations

import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from kl_kernels import kl_penalty_loss, kl_reward
from test_no_host_sync import _fake_mode, _loss_calls, _reward_calls, kernels_run, launches  # noqa: F401

NOT_LAUNCHES = {"aten.view", "aten.as_strided", "aten.select", "aten.slice", "aten.unbind", "aten.detach",
                "aten.expand", "aten.alias", "aten.unsqueeze", "aten.squeeze", "aten.narrow", "aten._reshape_alias",
                "aten.t", "aten.lift_fresh", "aten.empty", "aten.empty_strided", "aten.empty_like", "prim.device",
                "aten.resolve_conj", "aten.resolve_neg", "aten.split", "aten.split_with_sizes"}


class _DeviceOps(TorchDispatchMode):
    """Records the aten ops that would run on the device (see the module doc)."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if str(func.overloadpacket) not in NOT_LAUNCHES and any(
                isinstance(t, torch.Tensor) and t.device.type == "cuda" for t in tree_leaves(out)):
            self.ops.append(str(func.overloadpacket))
        return out


def _count(fn, kwargs_of, case):
    with _fake_mode():
        kwargs = kwargs_of()[case]
        with _DeviceOps() as ops:
            fn(**kwargs, backend="cuda")
    return collections.Counter(ops.ops)


# Counted: the value checks' own kernels (offsets, lengths and prompt_lens, csrc/cuda/ragged_checks.cu) where
# the forward does not make them itself, and torch operations: list packing (lengths to the device, cumsum,
# cat). The torch._assert_async of each check returns nothing and is not counted. Before the check kernels:
# reward packed 11, padded 4; loss packed 6, padded 4. With them, before the forwards' combine kernels took the
# checks over (issue 49 item 2: kl_kernels.launching.fold_value_checks): reward packed 2 (offsets, prompt_lens),
# padded-last 1 (lengths); loss packed 1, padded 1. Lists: each argument's values concatenated, one copy of
# log_probs' offsets summed on the host (the other lists' lengths compared with its own on the host); before:
# reward 20, loss 8.
REWARD_BOUNDS = {"packed": 0, "padded-last": 0, "list": 7}
# packed, padded: the checks are the forward's; list: packing (the aggregation: none)
LOSS_BOUNDS = {"packed": 0, "padded": 0, "list": 3}


@pytest.mark.parametrize("case", list(REWARD_BOUNDS))
def test_kl_reward(launches, case):
    ops = _count(kl_reward, _reward_calls, case)
    assert kernels_run(launches) == ["kl_reward_forward"]
    checks = len(launches) - 1  # the value checks' own kernels (value_checks.kernel_check)
    print(f"\nREWARD {case}: {sum(ops.values())} torch ops + {checks} check kernels: {dict(ops)}")
    assert sum(ops.values()) + checks <= REWARD_BOUNDS[case], (ops, launches)


@pytest.mark.parametrize("case", list(LOSS_BOUNDS))
def test_kl_penalty_loss_forward(launches, case):
    """Every aggregation of these calls (token-mean with per-sequence beta, seq-mean-token-mean,
    seq-mean-token-sum) is the kernels' now: only the inputs' checks and packing remain."""
    ops = _count(kl_penalty_loss, _loss_calls, case)
    assert kernels_run(launches) == ["kl_penalty_forward"]
    checks = len(launches) - 1
    print(f"\nLOSS {case}: {sum(ops.values())} torch ops + {checks} check kernels: {dict(ops)}")
    assert sum(ops.values()) + checks <= LOSS_BOUNDS[case], (ops, launches)
    assert not {"aten.sum", "aten.mul", "aten.div", "aten.round", "aten.clamp_min", "aten.reciprocal"} & set(ops), ops
