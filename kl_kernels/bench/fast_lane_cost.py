"""What ``kl_reward``'s C++ fast lanes save per call (issue 30 item 4: one validator per op).

The lanes (``kl_kernels/kl_reward/fast.py``: ``csrc/cpu/dense_plan.cpp``, ``list_plan.cpp``) check the
commonest eager CPU calls in one C call; every other call, and all of them without the lanes, takes the
general path (``problem.py`` -> dispatch -> ``launch.py``), whose rules the lanes restate. This times the
same calls with the lanes open and closed, alternating in one process (each figure: the best of three
rounds of the median of ``--calls`` calls), on the bench's RLHF batches: packed and padded tensors with a
per-sequence score and ``return_ref``, a list of per-sequence tensors without a reward, and the bench's
TorchRL KLComputation task (per-token rewards, a list and packed).

Run: ``python -m kl_kernels.bench.fast_lane_cost [--sizes tiny medium large] [--calls 200]``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from .. import kl_reward
from ..kl_reward import fast
from .batches import SIZES, make_batch
from .machine import describe


def _median_us(f, calls: int) -> float:
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        f()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def _calls(b):
    seq = dict(coef=0.05, return_ref=True, reward_placement="sequence")
    lengths = b.lengths.tolist()
    lp_list, ref_list = list(torch.split(b.lp, lengths)), list(torch.split(b.ref, lengths))
    rewards = [torch.zeros(n, 1) for n in lengths]
    packed_reward = torch.zeros(b.lp.shape[0], 1)
    return {
        "packed": lambda: kl_reward(b.lp, b.ref, b.score.view(-1, 1, 1), mask=b.mask, offsets=b.offsets, **seq),
        "padded": lambda: kl_reward(b.lp_padded, b.ref_padded, b.score.view(-1, 1, 1), mask=b.mask_padded,
                                    padding_side="left", **seq),
        "list": lambda: kl_reward(lp_list, ref_list, None, coef=0.05),
        # the bench's TorchRL KLComputation task (kl_kernels/bench/kl_reward.py): per-token rewards [L, 1]
        "KLComputation list": lambda: kl_reward(lp_list, ref_list, rewards, coef=0.05),
        "KLComputation packed": lambda: kl_reward(b.lp, b.ref, packed_reward, coef=0.05, offsets=b.offsets,
                                                  reward_placement="token"),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", nargs="+", default=["tiny", "medium", "large"], choices=sorted(SIZES))
    p.add_argument("--calls", type=int, default=200)
    args = p.parse_args(argv)
    lanes = fast._kernels
    facts = describe(torch.device("cpu"))
    print(f"# {facts['cpu']}, {facts['cpu_count']} cores, torch {facts['torch']}, kl_kernels {facts['git_commit']}")
    print("size | input | fast lane us | general path us | general / lane")
    try:
        for name in args.sizes:
            b = make_batch(SIZES[name])
            calls = args.calls if SIZES[name].batch < 1024 else max(args.calls // 10, 5)
            for what, f in _calls(b).items():
                best = {}
                for _ in range(3):
                    for open_ in (True, False):
                        fast._kernels = lanes if open_ else (lambda: None)
                        f()
                        t = _median_us(f, calls)
                        best[open_] = min(best.get(open_, t), t)
                print(f"{name} | {what} | {best[True]:.1f} | {best[False]:.1f} | {best[False] / best[True]:.2f}x")
    finally:
        fast._kernels = lanes
    return 0


if __name__ == "__main__":
    sys.exit(main())
