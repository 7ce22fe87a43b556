"""A vocabulary split over a process group (``process_group=`` of ``token_logprobs`` and
``linear_token_logprobs``, ``vocab_process_group=`` of ``linear_kl_penalty_loss``): 2 and 4 gloo processes
on the CPU (spawned, a free port on 127.0.0.1), uneven shards, against the unsharded call in the same
process: log-probs, entropy, the reference's log-probs, the loss, and the gradients (each rank's shard of
the logits' / head's gradient; ``hidden``'s after the caller's all-reduce), with masks and ignore_index;
the argument checks name the argument."""

from __future__ import annotations

import gc
import os
import socket
import weakref

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as tmp

from kl_kernels import linear_kl_penalty_loss, linear_token_logprobs, token_logprobs

SPLITS = {2: (13, 24), 4: (5, 1, 20, 11)}  # uneven, one of a single id
TOL = dict(rtol=2e-5, atol=2e-5)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _problem(vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    n, hid = 11, 6
    h = torch.randn(n, hid, generator=g)
    w = torch.randn(vocab, hid, generator=g) * 0.7
    b = torch.randn(vocab, generator=g)
    rh, rw = torch.randn(n, hid, generator=g), torch.randn(vocab, hid, generator=g) * 0.7
    y = torch.randint(0, vocab, (n,), generator=g)
    y[3] = -100
    y[4] = vocab - 1  # the last shard's last id
    y[5] = 0
    mask = torch.ones(n, dtype=torch.bool)
    mask[7] = False
    up, up_ent = torch.randn(n, generator=g), torch.randn(n, generator=g)
    return h, w, b, rh, rw, y, mask, up, up_ent


def _rows(t, rank, sizes):
    s0 = sum(sizes[:rank])
    return t[s0:s0 + sizes[rank]]


def _cols(t, rank, sizes):
    s0 = sum(sizes[:rank])
    return t[:, s0:s0 + sizes[rank]]


def _check_logits(rank, sizes, group, backend):
    h, w, b, _, _, y, mask, up, up_ent = _problem(sum(sizes))
    logits = (h @ w.t() + b).detach()
    full = logits.clone().requires_grad_()
    cap = dict(logit_scale=0.7, softcap=4.0)  # (TRL's fused LM head's transform, sharded alike)
    want = token_logprobs(full, y, temperature=0.8, return_entropy=True, mask=mask, backend=backend, **cap)
    (want.log_probs * up + want.entropy * up_ent).sum().backward()
    mine = _cols(logits, rank, sizes).clone().requires_grad_()
    got = token_logprobs(mine, y, temperature=0.8, return_entropy=True, mask=mask, backend=backend,
                         process_group=group, **cap)
    torch.testing.assert_close(got.log_probs, want.log_probs, **TOL)
    torch.testing.assert_close(got.entropy, want.entropy, **TOL)
    (got.log_probs * up + got.entropy * up_ent).sum().backward()
    torch.testing.assert_close(mine.grad, _cols(full.grad, rank, sizes), **TOL)
    # log-probs only, no entropy: its gradient too
    mine2 = _cols(logits, rank, sizes).clone().requires_grad_()
    lp = token_logprobs(mine2, y, ignore_index=-100, backend=backend, process_group=group).log_probs
    full2 = logits.clone().requires_grad_()
    lp_want = token_logprobs(full2, y, backend=backend).log_probs
    torch.testing.assert_close(lp, lp_want, **TOL)
    (lp * up).sum().backward()
    (lp_want * up).sum().backward()
    torch.testing.assert_close(mine2.grad, _cols(full2.grad, rank, sizes), **TOL)


def _check_linear(rank, sizes, group, backend):
    h, w, b, rh, rw, y, mask, up, up_ent = _problem(sum(sizes), seed=1)
    results = []
    for sharded in (False, True):
        hh = h.clone().requires_grad_()
        ww = (_rows(w, rank, sizes) if sharded else w).clone().requires_grad_()
        bb = (_rows(b, rank, sizes) if sharded else b).clone().requires_grad_()
        out = linear_token_logprobs(hh, ww, y, bias=bb, temperature=0.9, return_entropy=True, mask=mask,
                                    chunk_size=4, backend=backend, ref_hidden=rh, logit_scale=1.3, softcap=2.5,
                                    ref_weight=_rows(rw, rank, sizes) if sharded else rw,
                                    process_group=group if sharded else None)
        (out.log_probs * up + out.entropy * up_ent).sum().backward()
        g_h = hh.grad.clone()
        if sharded:  # the caller's all-reduce of hidden's gradient (Megatron's ColumnParallelLinear)
            dist.all_reduce(g_h, group=group)
        results.append((out, g_h, ww.grad, bb.grad))
    (want, wh, ww_, wb), (got, gh, gw, gb) = results
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e, **TOL)
    torch.testing.assert_close(gh, wh, **TOL)
    torch.testing.assert_close(gw, _rows(ww_, rank, sizes), **TOL)
    torch.testing.assert_close(gb, _rows(wb, rank, sizes), **TOL)


def _check_loss(rank, sizes, group):
    h, w, _, rh, rw, y, mask, _, _ = _problem(sum(sizes), seed=2)
    hb, yb, mb, rhb = h[:10].reshape(2, 5, -1), y[:10].reshape(2, 5), mask[:10].reshape(2, 5), rh[:10].reshape(2, 5, -1)
    old, adv = torch.full((2, 5), -3.0), torch.tensor([1.0, -0.5])
    results = []
    for sharded in (False, True):
        hh = hb.clone().requires_grad_()
        ww = (_rows(w, rank, sizes) if sharded else w).clone().requires_grad_()
        out = linear_kl_penalty_loss(hh, ww, yb, old, adv, ref_hidden=rhb,
                                     ref_weight=_rows(rw, rank, sizes) if sharded else rw, mask=mb, beta=0.05,
                                     estimator="k3", clip_epsilon=0.2, entropy_coef=0.01, chunk_size=3,
                                     vocab_process_group=group if sharded else None)
        out.loss.backward()
        g_h = hh.grad.clone()
        if sharded:
            dist.all_reduce(g_h, group=group)
        results.append((out.loss, out.loss_kl, g_h, ww.grad))
    (l0, k0, h0, w0), (l1, k1, h1, w1) = results
    torch.testing.assert_close(l1, l0, **TOL)
    torch.testing.assert_close(k1, k0, **TOL)
    torch.testing.assert_close(h1, h0, **TOL)
    torch.testing.assert_close(w1, _rows(w0, rank, sizes), **TOL)


def _check_arguments(rank, sizes, group):
    from unittest import mock

    logits = torch.randn(3, sizes[rank])
    with pytest.raises(TypeError, match="process_group"):
        token_logprobs(logits, torch.zeros(3, dtype=torch.long), process_group="world")
    with mock.patch.object(dist, "get_backend", return_value="nccl"):
        with pytest.raises(ValueError, match="process_group's backend 'nccl' cannot run collectives on cpu"):
            token_logprobs(logits, torch.zeros(3, dtype=torch.long), process_group=group)
        with pytest.raises(ValueError, match="vocab_process_group's backend"):
            linear_kl_penalty_loss(torch.randn(1, 3, 4), torch.randn(sizes[rank], 4), torch.zeros(1, 3, dtype=torch.long),
                                   torch.zeros(1, 3), torch.ones(1), vocab_process_group=group)
    # labels are global ids: one past the whole vocabulary is refused on every rank
    with pytest.raises(ValueError, match=rf"labels must be in \[0, {sum(sizes)}\)"):
        token_logprobs(logits, torch.full((3,), sum(sizes)), process_group=group)
    with pytest.raises(ValueError, match="one_pass=True"):
        linear_kl_penalty_loss(torch.randn(1, 3, 4), torch.randn(sizes[rank], 4), torch.zeros(1, 3, dtype=torch.long),
                               torch.zeros(1, 3), torch.ones(1), vocab_process_group=group, one_pass=True)


def _worker(rank, world, port, backends):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        group = dist.group.WORLD
        sizes = SPLITS[world]
        # The argument checks first: their refused calls leave the group in reference cycles (the mock's
        # call records, the exceptions' frames). A ProcessGroupGloo that outlives destroy_process_group is
        # destroyed at interpreter exit, after its threads' runtime is gone: std::terminate, SIGABRT (1 run of
        # this file in 4 on the 2-core CI machine). Collected here, while the interpreter is whole.
        _check_arguments(rank, sizes, group)
        gc.collect()
        for backend in backends:
            _check_logits(rank, sizes, group, backend)
            _check_linear(rank, sizes, group, backend)
        _check_loss(rank, sizes, group)
        alive = weakref.ref(group)
        del group
    finally:
        dist.destroy_process_group()
    # The library keeps no reference to a process group (no cache keyed by it): after the caller destroys
    # it, it is gone without a collection, as the caller expects.
    assert alive() is None, "a process group outlived destroy_process_group: kl_kernels holds a reference"


@pytest.mark.parametrize("world", [2, 4])
def test_vocab_parallel_matches_unsharded(world):
    import importlib.util

    # the torch row math, and the fused CPU kernel where it is built
    backends = ["torch"] + (["cpu"] if importlib.util.find_spec("kl_kernels._C") is not None else [])
    tmp.spawn(_worker, args=(world, _free_port(), backends), nprocs=world, join=True)


def test_process_group_checks_without_distributed():
    with pytest.raises(TypeError, match="process_group must be None or a torch.distributed.ProcessGroup"):
        token_logprobs(torch.randn(2, 3), torch.zeros(2, dtype=torch.long), process_group=object())
    with pytest.raises(TypeError, match="process_group must be None or a torch.distributed.ProcessGroup"):
        linear_token_logprobs(torch.randn(2, 3), torch.randn(5, 3), torch.zeros(2, dtype=torch.long),
                              process_group=1)
