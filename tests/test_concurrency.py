"""The fused CPU ops called from several Python threads at once.

The CPU kernels release the GIL, so a data pipeline's thread pool (or a Ray actor's threads) can run
them concurrently: each call then runs its tiles on its own OpenMP team, and the list layout runs
Python work (splitting outputs into per-sample views) on the calling thread inside that team. Every
call must give exactly what it gives alone (the kernels are deterministic for any thread count and
share no mutable state) and none may hang. The threads are daemons joined with a timeout, so a
deadlock fails the test instead of hanging the run.
"""

from __future__ import annotations

import threading

import pytest
import torch

from kl_kernels import kl_penalty_loss, kl_reward

THREADS = 4
REPEATS = 5


def _available(backend_name: str) -> bool:
    from kl_kernels.kl_reward.backends import REGISTRY

    return not next(b for b in REGISTRY if b.name == backend_name).unavailable_reasons()


pytestmark = pytest.mark.skipif(not _available("cpu"), reason="the fused CPU kernel (_C) is not built")


def _problem(seed: int):
    """A packed batch of its own per thread: > 1 tile of 16384 tokens, so every call is parallel."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 1500, (48,), generator=g)
    lengths[seed % 48] = 0  # an empty sequence somewhere
    offsets = torch.zeros(lengths.shape[0] + 1, dtype=torch.int64)
    offsets[1:] = lengths.cumsum(0)
    n = int(offsets[-1])
    lp = -torch.rand(n, generator=g) * 6
    ref = lp + torch.randn(n, generator=g) * 0.5
    mask = torch.rand(n, generator=g) < 0.7
    score = torch.randn(lengths.shape[0], generator=g)
    advantages = torch.randn(n, generator=g)
    return dict(lp=lp, ref=ref, mask=mask, offsets=offsets, score=score, advantages=advantages)


def _forward(p):
    out = kl_reward(p["lp"], p["ref"], p["score"], estimator="k3", mask=p["mask"], offsets=p["offsets"],
                    reward_placement="last", coef=0.1, return_ref=True, backend="cpu")
    return [out.kl, out.reward, out.ref_log_probs, out.kl_sum, out.count]


def _lists(p):
    # the list layout: the kernel's tiles run while this thread (holding the GIL) splits the outputs
    sizes = torch.diff(p["offsets"]).tolist()
    out = kl_reward(list(p["lp"].split(sizes)), list(p["ref"].split(sizes)), mask=list(p["mask"].split(sizes)),
                    coef=0.05, backend="cpu")
    return [torch.cat(out.kl), torch.cat(out.reward), out.kl_sum, out.count]


def _backward(p):
    lp = p["lp"].clone().requires_grad_()
    ref = p["ref"].clone().requires_grad_()
    out = kl_reward(lp, ref, p["score"], estimator="k3+", mask=p["mask"], offsets=p["offsets"],
                    reward_placement="sequence", coef=0.1, detach=False, backend="cpu")
    (out.kl.sum() + 0.5 * out.reward.sum() + out.kl_sum.sum()).backward()
    return [lp.grad, ref.grad]


def _loss(p):
    lp = p["lp"].clone().requires_grad_()
    out = kl_penalty_loss(lp, p["lp"] + 0.01, p["advantages"], ref_log_probs=p["ref"], beta=0.05, estimator="k3",
                          mask=p["mask"], offsets=p["offsets"], clip_epsilon=0.2, backend="cpu")
    out.loss.backward()
    return [out.loss.detach(), lp.grad]


CALLS = {"kl_reward forward": _forward, "kl_reward lists": _lists, "kl_reward backward": _backward,
         "kl_penalty_loss": _loss}


@pytest.mark.parametrize("name", list(CALLS))
def test_threads_at_once_give_what_each_call_gives_alone(name):
    call = CALLS[name]
    problems = [_problem(seed) for seed in range(THREADS)]
    alone = [call(p) for p in problems]
    results: dict[int, list] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(THREADS)

    def worker(i):
        try:
            start.wait(timeout=30)  # all threads enter the kernels together
            results[i] = [call(problems[i]) for _ in range(REPEATS)]
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), f"{name}: a thread is still running after 120 s (deadlock?)"
    assert not errors, errors
    for i in range(THREADS):
        for got in results[i]:
            for have, want in zip(got, alone[i], strict=True):
                assert torch.equal(have, want), f"{name}, thread {i}: differs from the same call made alone"


def test_concurrent_calls_with_torch_ops_on_other_threads():
    """Our kernels on some threads while torch's own parallel ops run on others (both on OpenMP
    teams of the same runtime): results unchanged, nothing hangs."""
    problems = [_problem(seed) for seed in range(2)]
    alone = [_forward(p) for p in problems]
    big = torch.randn(2_000_000)
    errors: list[BaseException] = []
    got: dict[int, list] = {}

    def ours(i):
        try:
            got[i] = [_forward(problems[i]) for _ in range(REPEATS)]
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    def theirs():
        try:
            for _ in range(REPEATS * 3):
                torch.sort(big * 2.0)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=ours, args=(i,), daemon=True) for i in range(2)]
    threads += [threading.Thread(target=theirs, daemon=True) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a thread is still running after 120 s (deadlock?)"
    assert not errors, errors
    for i in range(2):
        for result in got[i]:
            assert all(torch.equal(a, b) for a, b in zip(result, alone[i], strict=True))
