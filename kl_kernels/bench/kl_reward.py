"""kl_reward benchmark cases: every available backend vs eager per-sample code vs torch.compile.

The task measured is TorchRL's KL-penalized reward on an RLHF batch: k1 estimate on assistant
tokens, per-sequence score broadcast to every token (``[B, 1, 1]``), ``coef = 0.05``, masked
reference log-probs returned. Contenders, timed side by side in one process:

* ``per-sample eager (TorchRL style)``: the loop TorchRL 0.14's ``KLRewardTransform`` runs on
  padded inputs (``masked_fill`` per sample, ``pad_sequence``, subtract, broadcast);
* ``kl_reward[<backend>]`` for each backend that runs here, packed and padded layouts, and for the
  fused kernels also ``kl_reward[<backend>] out=``: the same call into result buffers allocated once;
* ``torch.compile(reference)``: the torch reference compiled with ``fullgraph=True``; its cold
  compile time (inductor caches off) is reported separately and excluded from the steady state.

A second task, verl's (``TASK_VERL``, issue 49): ``apply_kl_penalty`` on the padded ``[B, T]`` batch with its
response mask, k1, the score on each row's last response token, ``reward - coef * kl``: verl's code as written
(eager), ``torch.compile`` of it, ``kl_reward`` per backend, and ``kl_reward`` called inside a compiled function
(default and, on CUDA, ``mode="reduce-overhead"``: CUDA graphs), which is what a compiled trainer gets.

Before timing, each contender's outputs are checked against the eager reference.
GB/s counts the bytes the op must move at least (inputs read once, outputs written once).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch.nn.utils.rnn import pad_sequence

from ..kl_reward import kl_reward
from ..kl_reward.backends import REGISTRY
from ..kl_reward.problem import build_problem
from .batches import RLHFBatch
from .contenders import Contender, is_copy, set_speedup, time_rows
from .timing import cold_compile_seconds

COEF = 0.05


def per_sample_torchrl_style(lp_padded, ref_padded, mask_padded, score_b11, coef):
    """What TorchRL 0.14's LLM KLRewardTransform computes, the way it computes it."""
    batch = lp_padded.shape[0]
    ref = pad_sequence([ref_padded[i].masked_fill(~mask_padded[i], 0) for i in range(batch)],
                       batch_first=True, padding_value=0, padding_side="left")
    cur = pad_sequence([lp_padded[i].masked_fill(~mask_padded[i], 0) for i in range(batch)],
                       batch_first=True, padding_value=0, padding_side="left")
    kl = cur.unsqueeze(-1) - ref.unsqueeze(-1)
    return kl, score_b11 - coef * kl, ref.unsqueeze(-1)  # TorchRL's kl_penalty, reward, ref_log_prob


def _call(batch: RLHFBatch, layout: str) -> tuple[tuple, dict]:
    """kl_reward's arguments for the benchmarked task in one layout."""
    score = batch.score.view(-1, 1, 1)
    if layout == "packed":
        return (batch.lp, batch.ref, score), dict(mask=batch.mask, offsets=batch.offsets, reward_placement="sequence",
                                                   coef=COEF, return_ref=True)
    return (batch.lp_padded, batch.ref_padded, score), dict(mask=batch.mask_padded, lengths=batch.lengths,
                                                             padding_side="left", coef=COEF, return_ref=True)


def _problem(batch: RLHFBatch, layout: str):
    args, kw = _call(batch, layout)
    return build_problem(*args, estimator="k1", prompt_lens=None, clamp_input=None, clamp_output=None, detach=True,
                         **{"offsets": None, "lengths": None, "mask": None, "padding_side": "left",
                            "reward_placement": "auto", **kw})[0]


def _ours(batch: RLHFBatch, layout: str, backend: str) -> Callable[[], tuple]:
    args, kw = _call(batch, layout)
    return lambda: tuple(kl_reward(*args, backend=backend, **kw))


def _ours_out(batch: RLHFBatch, layout: str, backend: str) -> Callable[[], tuple]:
    """The same call writing into result buffers allocated once (``out=``), as a training loop would."""
    args, kw = _call(batch, layout)
    first = kl_reward(*args, backend=backend, **kw)
    buffers = tuple(None if t is None else torch.empty_like(t) for t in first)
    return lambda: tuple(kl_reward(*args, backend=backend, out=buffers, **kw))


def _compiled(batch: RLHFBatch, layout: str) -> tuple[Callable[[], tuple], float]:
    """torch.compile of the reference (fullgraph); returns the callable and its compile time."""
    eager = _ours(batch, layout, "torch")
    torch._dynamo.reset()
    fn = torch.compile(lambda: eager(), fullgraph=True)
    return fn, cold_compile_seconds(fn, batch.lp.device)


def bytes_moved(batch: RLHFBatch, layout: str) -> int:
    """Minimal traffic: read log-probs, ref, mask (the tokens only: a padded call gets the lengths, so the
    padding need not be read), score, offsets/lengths; write kl, reward, masked ref (every element of the
    layout: the padding is written too), kl_sum, count."""
    elems = batch.lp.numel() if layout == "packed" else batch.lp_padded.numel()
    s = batch.lp.element_size()
    reward_s = torch.promote_types(batch.score.dtype, batch.lp.dtype).itemsize
    b = batch.size.batch
    reads = batch.num_tokens * (2 * s + 1) + b * 4 + (b + 1) * 8
    writes = elems * (2 * s + reward_s) + b * (4 + 8)
    return reads + writes


def _check(reference: tuple, got: tuple, name: str) -> str:
    """Compare the first three outputs (kl, reward, ref) with the eager reference (None: not compared)."""
    for what, want, have in zip(("kl", "reward", "ref_log_probs"), reference, got):
        if want is None or have is None:
            continue
        have = have.reshape(want.shape)
        tol = 1e-5 if want.dtype == torch.float32 else 2e-2
        if not torch.allclose(have.double(), want.double(), rtol=tol, atol=tol):
            err = (have.double() - want.double()).abs().max().item()
            raise AssertionError(f"{name}: {what} differs from the reference (max abs err {err:.3g})")
    return "ok"


def contenders(batch: RLHFBatch, *, with_compile: bool = True, progress=None) -> list[Contender]:
    found = []
    for layout in ("packed", "padded"):
        problem = _problem(batch, layout)
        for backend in REGISTRY:
            # auto's view: a backend that runs here only on request (Triton's CPU interpreter) is no contender
            if not backend.auto_rejection_reasons(problem):
                found.append(Contender(f"kl_reward[{backend.name}]", layout, _ours(batch, layout, backend.name)))
                if backend.name in ("cpu", "cuda"):  # the kernels that write into out= buffers
                    found.append(Contender(f"kl_reward[{backend.name}] out=", layout,
                                           _ours_out(batch, layout, backend.name)))
    if with_compile:
        for layout in ("packed", "padded"):
            if progress:
                progress(f"compiling the reference ({layout})")
            fn, seconds = _compiled(batch, layout)
            found.append(Contender("torch.compile(reference)", layout, fn, seconds))
    score = batch.score.view(-1, 1, 1)
    found.append(Contender("per-sample eager (TorchRL style)", "padded", lambda: per_sample_torchrl_style(
        batch.lp_padded, batch.ref_padded, batch.mask_padded, score, COEF)))
    return found


def verl_apply_kl_penalty(lp, ref, response_mask, score, coef):
    """verl 0.9.1's ``apply_kl_penalty`` (``verl/trainer/ppo/ray_trainer.py``) with k1, as it computes it, the
    score first placed on each row's last response token as verl's reward manager places it
    (``token_level_scores``); verl's ``.item()`` of the batch KL (a host sync) is left to the caller:
    returns ``(kld, token_level_rewards, current_kl)``."""
    width = response_mask.shape[1]
    last = (width - 1) - response_mask.flip(-1).int().argmax(-1)  # the last response token of each row
    placed = torch.where(response_mask.any(-1), score, torch.zeros_like(score))
    token_level_scores = torch.zeros_like(lp).scatter_(1, last.unsqueeze(1), placed.unsqueeze(1))
    kld = (lp - ref) * response_mask  # k1
    token_level_rewards = token_level_scores - coef * kld
    per_row = (kld * response_mask).sum(-1) / response_mask.sum(-1).clamp_min(1)  # verl's masked_mean(axis=-1)
    return kld, token_level_rewards, per_row.mean()


def _verl_call(batch: RLHFBatch):
    return (batch.lp_padded, batch.ref_padded, batch.score), dict(
        mask=batch.mask_padded, lengths=batch.lengths, padding_side="left", coef=COEF, reward_placement="last")


def run_verl(batch: RLHFBatch, *, copy_gbs: float, with_compile: bool = True, repeats: int = 10,
             budget_s: float = 3.0, progress=None, retime: bool = True) -> list[dict]:
    """verl's KL-penalized reward (module doc): its code eager and compiled against ``kl_reward``, eager and
    inside a compiled function, padded ``[B, T]``; the per-token kl and rewards checked against the reference."""
    args, kw = _verl_call(batch)
    mask = batch.mask_padded

    def verl_eager():
        return verl_apply_kl_penalty(batch.lp_padded, batch.ref_padded, mask, batch.score, COEF)

    def ours(backend):
        return lambda: tuple(kl_reward(*args, backend=backend, **kw))

    found = [Contender("verl apply_kl_penalty (eager)", "padded", verl_eager)]
    problem = build_problem(*args, estimator="k1", prompt_lens=None, clamp_input=None, clamp_output=None, detach=True,
                            offsets=None, return_ref=False, **kw)[0]
    for backend in REGISTRY:  # the fused ones (the torch backend, our reference, has its rows in the first task)
        if backend.name != "torch" and not backend.auto_rejection_reasons(problem):
            found.append(Contender(f"kl_reward[{backend.name}]", "padded", ours(backend.name)))
    if with_compile:
        modes = ["default"] + (["reduce-overhead"] if batch.lp.device.type == "cuda" else [])
        torch._dynamo.reset()
        verl_compiled = torch.compile(verl_eager, fullgraph=True)
        found.append(Contender("torch.compile(verl apply_kl_penalty)", "padded", verl_compiled,
                               cold_compile_seconds(verl_compiled, batch.lp.device)))
        for mode in modes:
            inside = torch.compile(lambda: tuple(kl_reward(*args, **kw)), fullgraph=True,
                                   mode=None if mode == "default" else mode)
            found.append(Contender(f"kl_reward inside torch.compile ({mode})", "padded", inside,
                                   cold_compile_seconds(inside, batch.lp.device)))
    want = tuple(kl_reward(*args, backend="torch", **kw))[:2]
    refs = {"padded": (want[0], want[1], None)}
    for c in found:
        if c.name.startswith(("verl", "torch.compile(verl")):
            c.extract = lambda out: (out[0], out[1], None)
    elems, s = batch.lp_padded.numel(), batch.lp.element_size()
    # read lp, ref, mask (the tokens only: the call has the lengths); write kl, reward (padding included)
    nbytes = batch.num_tokens * (2 * s + 1) + elems * 2 * s + batch.size.batch * (4 + 8)
    rows = _time_rows(batch, TASK_VERL, found, refs, lambda layout: nbytes, copy_gbs, repeats, budget_s, progress,
                      "verl apply_kl_penalty (eager)", retime)
    baseline = rows[0]
    compiled = next((r for r in rows if r["impl"].startswith("torch.compile(verl")), None)
    for r in rows:
        if not is_copy(r):
            set_speedup(r, "x_vs_baseline", baseline)
            set_speedup(r, "x_vs_compile", compiled)
    return rows


TASK_VERL = "verl apply_kl_penalty task"
TASK_TRANSFORM = "KLRewardTransform task"
TASK_KLCOMPUTATION = "TorchRL KLComputation task"


def _time_rows(batch, task, candidates, refs, nbytes_of, copy_gbs, repeats, budget_s, progress, baseline,
               retime: bool = True):
    """Check every contender against the reference, then time them side by side (interleaved rounds,
    with a copy of the same bytes per layout: see contenders.py)."""
    checks = []
    for c in candidates:
        if c.unchecked:
            checks.append(f"not checked ({c.unchecked})")
            continue
        if progress:
            progress(f"{task}: checking {c.name} ({c.layout})")
        out = c.fn()
        checks.append(_check(refs[c.layout], c.extract(out) if c.extract else out, c.name))
    return time_rows(batch, task, candidates, checks, nbytes_of, copy_gbs, repeats, budget_s, baseline, progress,
                     retime=retime)


def run_task(ctx) -> list[dict]:
    """The ``kl_reward`` task of ``kl-kernels bench`` (:mod:`kl_kernels.bench.tasks`): :func:`run` per size."""
    return ctx.per_size(run, with_compile=ctx.plan.with_compile)


def run(batch: RLHFBatch, *, copy_gbs: float, with_compile: bool = True, repeats: int = 10, budget_s: float = 3.0,
        progress=None, retime: bool = True) -> list[dict]:
    """Check and time every contender on ``batch``; rows with ms, GB/s, % of copy BW, speedups."""
    refs = {layout: _ours(batch, layout, "torch")() for layout in ("packed", "padded")}
    rows = _time_rows(batch, TASK_TRANSFORM, contenders(batch, with_compile=with_compile, progress=progress), refs,
                      lambda layout: bytes_moved(batch, layout), copy_gbs, repeats, budget_s, progress,
                      "per-sample eager (TorchRL style)", retime)
    baseline = next(r for r in rows if r["impl"].startswith("per-sample"))
    compiled = {r["layout"]: r for r in rows if r["impl"].startswith("torch.compile")}
    for r in rows:
        if is_copy(r):
            continue
        set_speedup(r, "x_vs_baseline", baseline)
        set_speedup(r, "x_vs_compile", compiled.get(r["layout"]))
    return (rows + run_klcomputation(batch, copy_gbs=copy_gbs, repeats=repeats, budget_s=budget_s, progress=progress,
                                     retime=retime)
            + run_verl(batch, copy_gbs=copy_gbs, with_compile=with_compile, repeats=repeats, budget_s=budget_s,
                       progress=progress, retime=retime))


# --------------------------------------------------------------------------- TorchRL KLComputation


def run_klcomputation(batch: RLHFBatch, *, copy_gbs: float, repeats: int, budget_s: float, progress=None,
                      retime: bool = True) -> list[dict]:
    """TorchRL 0.14's ``KLComputation`` on a lazily stacked TensorDict (its native ragged input:
    k1, no mask, per-token reward ``[L, 1]``) against kl_reward on the same per-sample tensors
    (list layout: read in place) and on packed tensors; the results are concatenated for the check
    outside the timed calls. Skipped without torchrl."""
    try:
        from tensordict import TensorDict, lazy_stack
        from torchrl.envs.llm.transforms.kl import KLComputation
    except ImportError:
        if progress:
            progress("torchrl/tensordict not installed: skipping the KLComputation comparison")
        return []
    from .. import ragged
    lps, refs_ = ragged.to_list(batch.lp, batch.offsets), ragged.to_list(batch.ref, batch.offsets)
    rewards = [torch.zeros(t.shape[0], 1, dtype=torch.float32, device=t.device) for t in lps]
    td = lazy_stack([TensorDict({("log_probs", "full"): a, ("ref_log_probs", "full"): b, "reward": r}, batch_size=())
                     for a, b, r in zip(lps, refs_, rewards)])
    transform = KLComputation(gen_log_probs_full_key=("log_probs", "full"),
                              ref_log_probs_full_key=("ref_log_probs", "full"), coeff=COEF)

    def torchrl_kl(out) -> tuple:  # what is checked, outside the timed call
        return (torch.cat(out.get("kl_penalty", as_list=True)), None, None)

    packed_reward = torch.zeros(batch.lp.shape[0], 1, device=batch.lp.device)
    # KLComputation writes kl_penalty and reward back into td: re-running repeats the same work
    found = [Contender("TorchRL KLComputation (lazy stack)", "list", lambda: transform(td), extract=torchrl_kl)]
    problem = _problem(batch, "packed")
    for backend in REGISTRY:
        if backend.auto_rejection_reasons(problem):
            continue
        name = f"kl_reward[{backend.name}]"
        calls = {"list": lambda b=backend.name: kl_reward(lps, refs_, rewards, coef=COEF, backend=b),
                 "packed": lambda b=backend.name: kl_reward(batch.lp, batch.ref, packed_reward, coef=COEF,
                                                            offsets=batch.offsets, reward_placement="token", backend=b)}
        try:
            for layout, fn in calls.items():
                fn()
                found.append(Contender(name, layout, fn, extract=_first))
        except Exception:  # noqa: BLE001 - a backend that cannot run here is simply not a contender
            continue
    want = (kl_reward(batch.lp, batch.ref, offsets=batch.offsets, coef=COEF, backend="torch").kl, None, None)
    refs = {"list": want, "packed": want}
    s = batch.lp.element_size()
    nbytes = batch.num_tokens * (2 * s + 4 + s + 4) + batch.size.batch * 12  # read lp, ref, reward; write kl, reward
    rows = _time_rows(batch, TASK_KLCOMPUTATION, found, refs, lambda layout: nbytes, copy_gbs, repeats, budget_s,
                      progress, "TorchRL KLComputation", retime)
    for r in rows:
        if not is_copy(r):
            set_speedup(r, "x_vs_baseline", rows[0])
    return rows


def _first(out) -> tuple:
    """kl_reward's kl as one packed tensor (what is checked, outside the timed call)."""
    kl = torch.cat(out.kl) if isinstance(out.kl, list) else out.kl
    return (kl, None, None)
