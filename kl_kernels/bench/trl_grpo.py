"""The ``trl`` task of ``kl-kernels bench`` (issue 62 item 6): one GRPO micro-batch step of TRL 1.16's
``GRPOTrainer`` from the last hidden states, forward + backward, time and peak extra memory.

The step: the policy's hidden states ``[B, T, H]`` (prompt + completion) and LM head ``[V, H]`` give the
completion's log-probs and entropy through the fused LM head (labels rolled by one, ``-100`` on the prompt and
the completions' padding, temperature 0.7); the reference model's hidden states and head give its log-probs
(no gradient); then ``loss_type="grpo"``, ``beta=0.04``, ``epsilon=0.2``, ``epsilon_high=0.28``,
``use_bias_correction_kl=False``, and ``loss.backward()`` to the policy's hidden states and head. Contenders:

* ``trl``: TRL's fused head (``trl.kernels.ChunkedLogProbFunction`` called as ``add_fused_lm_head``'s forward
  calls it: every position on the CPU, the scored ones on a GPU) and TRL's own ``GRPOTrainer._compute_loss``
  (called unbound on a stand-in trainer that carries the attributes it reads, as tests/test_integrations_trl.py
  does): stock TRL, the baseline;
* ``trl head + kl_kernels loss``: what ``kl_kernels.integrations.trl.GRPOTrainer`` runs by default
  (``lm_head="trl"``): TRL's head, the fused loss (:func:`kl_kernels.integrations.trl.grpo_loss`);
* ``kl_kernels head + trl loss``: the LM-head opt-in alone
  (:func:`kl_kernels.integrations.trl_lm_head.head_log_probs`, what ``lm_head="kl_kernels"`` puts under the
  model's forward) with TRL's loss;
* ``kl_kernels head + kl_kernels loss``: the switch with ``lm_head="kl_kernels"``;
* ``linear_kl_penalty_loss``: the same loss in one call from both models' hidden states (each chunk of
  logits formed once on the CPU); no entropy (TRL logs its mean), and not what the trainer runs (its
  reference log-probs come from another model call): what a fused step could be.

Every contender's loss is checked against stock TRL's (``loss_rel_diff``). Timing: the contenders alternate
in shuffled rounds (:func:`kl_kernels.bench.timing.measure_interleaved`). Peak extra memory: on the CPU the
process's resident high-water mark over its resident size before one call, in this process, after glibc's
``malloc_trim(0)`` has returned what the earlier calls freed (``python -m kl_kernels.bench.trl_grpo
--own-process`` gives each contender a fresh process instead), on a GPU torch's allocator peak over what was
allocated.

TRL's head and loss are imported from the installed ``trl``; without ``transformers`` TRL's modules are
imported over stand-ins for it (:mod:`kl_kernels.bench.peer_stubs`), which is TRL's own code path on the CPU
(no Triton there) but not on a GPU (TRL's Triton kernels are used only when transformers says Triton is
there): then, and without ``trl``, the TRL rows are "not run" rows saying why.

Run alone: ``python -m kl_kernels.bench.trl_grpo [--size N:H:V] [--dtype bfloat16] [--repeats R]``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import math
from collections import defaultdict
from types import SimpleNamespace

import torch

TEMPERATURE = 0.7
BETA = 0.04
EPSILON = (0.2, 0.28)
CONTENDERS = ("trl", "trl head + kl_kernels loss", "kl_kernels head + trl loss", "kl_kernels head + kl_kernels loss",
              "linear_kl_penalty_loss")
# What TRL's modules import at module level that a CPU bench environment may lack (tests/peers.py's list)
_TRL_STUBS = ("transformers", "accelerate", "datasets", "huggingface_hub", "pandas", "pyarrow")


def shape(n: int, hid: int, vocab: int) -> dict:
    """``N`` tokens as ``B`` sequences of ``T`` (a quarter of them prompt): B = 4 up to N = 512, else 8."""
    b = 4 if n <= 512 else 8
    t = max(4, n // b)
    return dict(batch=b, seq=t, prompt=t // 4, completion=t - t // 4, hidden=hid, vocab=vocab)


def make_inputs(n: int, hid: int, vocab: int, dtype: torch.dtype, device, seed: int = 0) -> dict:
    """The micro-batch: hidden states and heads of both models, input ids, TRL's labels (``-100`` on the
    prompt and on the completions' padding: ragged lengths, at least one token each), advantages, and the
    old policy's log-probs (the policy's own, perturbed: some tokens clip)."""
    s = shape(n, hid, vocab)
    b, t, p, c = s["batch"], s["seq"], s["prompt"], s["completion"]
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(b, t, hid, generator=g)
    weight = torch.randn(vocab, hid, generator=g) / hid ** 0.5
    ref_hidden = hidden + 0.1 * torch.randn(b, t, hid, generator=g)
    ref_weight = weight + 0.01 * torch.randn(vocab, hid, generator=g)
    ids = torch.randint(0, vocab, (b, t), generator=g)
    lengths = torch.randint(1, c + 1, (b,), generator=g)
    lengths[0] = c
    completion_mask = (torch.arange(c)[None] < lengths[:, None]).long()
    attention_mask = torch.cat([torch.ones(b, p, dtype=torch.long), completion_mask], 1)
    labels = ids.masked_fill(attention_mask == 0, -100)
    labels[:, :-c] = -100  # (TRL: only the completion is scored)
    x = dict(hidden=hidden, weight=weight, ref_hidden=ref_hidden, ref_weight=ref_weight)
    x = {k: v.to(device=device, dtype=dtype) for k, v in x.items()}
    from ..integrations.trl_lm_head import head_log_probs

    with torch.no_grad():
        lp = head_log_probs(x["hidden"][:, :-1], x["weight"], None, labels[:, 1:].to(device),
                            temperature=TEMPERATURE, return_entropy=False)[0][:, -c:]
    old = lp + 0.1 * torch.randn(b, c, generator=g).to(device)
    x.update(ids=ids.to(device), labels=labels.to(device), completion_mask=completion_mask.to(device),
             advantages=torch.randn(b, generator=g).to(device), old=old.float(), shape=s)
    return x


# ------------------------------------------------------------------ TRL's side


def trl_modules(device) -> tuple[SimpleNamespace | None, str | None]:
    """``(modules, None)`` with TRL's head function, its chunk size and device rule and ``GRPOTrainer``, or
    ``(None, why)``."""
    if importlib.util.find_spec("trl") is None:
        return None, "trl is not installed (pip install --no-deps trl==1.16.0)"
    real = importlib.util.find_spec("transformers") is not None
    if not real and torch.device(device).type != "cpu":
        return None, ("TRL's head on a GPU needs transformers (its Triton kernels are chosen through "
                      "transformers.utils.is_triton_available); not installed here")
    from .peer_stubs import stubbed

    try:
        with stubbed(() if real else _TRL_STUBS):
            import trl.kernels.chunked_logprob as kernel
            import trl.trainer.grpo_trainer as grpo
            import trl.trainer.utils as utils
    except Exception as e:  # reported as rows, not a crash of the bench
        return None, f"TRL's modules did not import: {type(e).__name__}: {e}"
    return SimpleNamespace(head=kernel.ChunkedLogProbFunction, use_triton=kernel._use_triton,
                           chunk=utils._CHUNKED_LOGPROB_CHUNK_SIZE, grpo=grpo, real=real), None


def trl_call_context(trl):
    """TRL's backward imports ``trl.trainer.utils.maybe_gather_lm_head_ctx``, which asks transformers whether
    DeepSpeed ZeRO-3 is on: without transformers, its stand-in answers no (as transformers would here)."""
    if trl.real:
        return contextlib.nullcontext()
    from .peer_stubs import stubbed

    return stubbed(_TRL_STUBS)


def trl_head(trl, hidden, weight, labels, want_entropy):
    """The head part of TRL 1.16's ``add_fused_lm_head`` forward (trl/trainer/utils.py), from the backbone's
    last hidden states ``[B, T, H]`` and TRL's ``labels [B, T]``: ``(log_probs, entropy)`` ``[B, T - 1]``."""
    h, lab = hidden[:, :-1], labels[:, 1:]
    mask = lab != -100
    compact = trl.use_triton(h.device)
    outputs = ("log_probs", "entropy") if want_entropy else ("log_probs",)
    per_token = trl.head.apply(h[mask] if compact else h.reshape(-1, h.size(-1)), weight, None,
                               lab[mask] if compact else lab.clamp(min=0).reshape(-1), TEMPERATURE, trl.chunk, None,
                               1.0, outputs)
    if compact:
        per_token = [None if v is None else v.new_zeros(mask.shape).masked_scatter(mask, v) for v in per_token]
    else:
        per_token = [None if v is None else v.view(mask.shape).masked_fill(~mask, 0) for v in per_token]
    return per_token[0], per_token[1]


def trl_loss(trl, x, lp, entropy, ref):
    """TRL's own ``GRPOTrainer._compute_loss``, unbound, on a stand-in trainer whose
    ``_get_per_token_logps_and_entropies`` hands over the head's completion log-probs and entropy."""
    b, p = x["completion_mask"].shape[0], x["shape"]["prompt"]
    fake = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (lp, entropy, None),
        aux_loss_enabled=False, top_entropy_quantile=1.0, off_policy_mask_threshold=None,
        importance_sampling_level="token", beta=BETA, loss_type="grpo", epsilon_low=EPSILON[0],
        epsilon_high=EPSILON[1], use_vllm=False, vllm_importance_sampling_correction=False,
        model=SimpleNamespace(training=True), current_gradient_accumulation_steps=1,
        max_completion_length=x["shape"]["completion"], _entropy_bonus_enabled=False,
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        accelerator=SimpleNamespace(num_processes=1, gather=lambda v: v, reduce=lambda v, reduction="sum": v),
        args=SimpleNamespace(use_bias_correction_kl=False, delta=None, steps_per_generation=1))
    inputs = dict(prompt_ids=x["ids"][:, :p], prompt_mask=torch.ones_like(x["ids"][:, :p]),
                  completion_ids=x["ids"][:, p:], completion_mask=x["completion_mask"], advantages=x["advantages"],
                  old_per_token_logps=x["old"], ref_per_token_logps=ref)
    assert b == lp.shape[0]
    return trl.grpo.GRPOTrainer._compute_loss(fake, None, inputs)


# ------------------------------------------------------------------ the steps


def _ours_loss(x, lp, ref):
    from ..integrations.trl import grpo_loss

    return grpo_loss(lp, x["advantages"], x["completion_mask"], old_per_token_logps=x["old"],
                     ref_per_token_logps=ref, loss_type="grpo", beta=BETA, epsilon_low=EPSILON[0],
                     epsilon_high=EPSILON[1], use_bias_correction_kl=False)


def step_function(name: str, x: dict, trl=None, keep: list | None = None):
    """``step() -> loss`` (detached) of one contender: forward + backward from fresh leaves (the policy's hidden
    states and head; with ``keep``, a list, each call leaves them there)."""
    from ..integrations.trl_lm_head import head_log_probs

    c = x["shape"]["completion"]

    def ours_head(hidden, weight, want_entropy):
        lp, ent, _ = head_log_probs(hidden[:, :-1], weight, None, x["labels"][:, 1:], temperature=TEMPERATURE,
                                    return_entropy=want_entropy)
        return lp, ent

    def step():
        h = x["hidden"].detach().requires_grad_()
        w = x["weight"].detach().requires_grad_()
        if keep is not None:
            keep[:] = [h, w]
        if name == "linear_kl_penalty_loss":
            from .. import linear_kl_penalty_loss

            labels = x["labels"][:, 1:]
            old = torch.zeros(labels.shape, device=labels.device)
            old[:, -c:] = x["old"]
            loss = linear_kl_penalty_loss(h[:, :-1], w, labels, old, x["advantages"],
                                          ref_hidden=x["ref_hidden"][:, :-1], ref_weight=x["ref_weight"],
                                          temperature=TEMPERATURE, beta=BETA, estimator="k3", clip_epsilon=EPSILON,
                                          aggregation="seq-mean-token-mean").loss
        else:
            head_name, loss_name = ("trl", "trl") if name == "trl" else \
                [part.split()[0] for part in name.split(" + ")]
            ctx = trl_call_context(trl) if "trl" in (head_name, loss_name) else contextlib.nullcontext()
            with ctx:
                head = (lambda hh, ww, e: trl_head(trl, hh, ww, x["labels"], e)) if head_name == "trl" else ours_head
                lp, ent = head(h, w, True)
                with torch.no_grad():
                    ref = head(x["ref_hidden"], x["ref_weight"], False)[0][:, -c:]
                lp, ent = lp[:, -c:], ent[:, -c:]
                loss = trl_loss(trl, x, lp, ent, ref) if loss_name == "trl" else _ours_loss(x, lp, ref)
                loss.backward()
            return loss.detach()
        loss.backward()
        return loss.detach()
    return step


# ------------------------------------------------------------------ memory and the run


def _trim_heap() -> None:
    """glibc's ``malloc_trim(0)``: the memory freed by the contenders before goes back to the system, so that
    the next call's allocations are counted in the resident high-water mark instead of reusing it unseen."""
    import ctypes
    import ctypes.util

    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: the peak may then read low after other contenders
        pass


def _peak_extra_mib(step, device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        step()
        torch.cuda.synchronize(device)
        return (torch.cuda.max_memory_allocated(device) - before) / 2**20
    from .token_logprobs import _reset_peak, _status_mib

    _trim_heap()
    _reset_peak()
    before = _status_mib("VmRSS")
    step()
    return _status_mib("VmHWM") - before


def measure(n: int, hid: int, vocab: int, dtype: torch.dtype, device, *, repeats: int = 5, budget_s: float = 1.0,
            seed: int = 0, contenders=CONTENDERS, progress=lambda msg: None) -> dict:
    """One result dict (``kl_kernels.bench.tasks``' result format): a row per contender."""
    from .machine import describe
    from .timing import measure_interleaved

    device = torch.device(device)
    x = make_inputs(n, hid, vocab, dtype, device, seed)
    s = x["shape"]
    trl, why = trl_modules(device)
    rows, steps = [], []
    reference = None
    for name in contenders:
        row = dict(contender=name, ours=name != "trl" and "kl_kernels" in name or name == "linear_kl_penalty_loss",
                   n=s["batch"] * s["seq"], hidden=hid, vocab=vocab, dtype=str(dtype).replace("torch.", ""))
        if (name == "trl" or "trl " in name) and trl is None:
            rows.append(dict(row, error=why))
            continue
        step = step_function(name, x, trl)
        progress(f"trl task: {name} (warm-up, peak memory)")
        try:
            loss = step()  # warm-up
            row["peak_extra_mib"] = round(_peak_extra_mib(step, device), 1)
        except Exception as e:  # a row saying why, not a crash of the bench
            rows.append(dict(row, error=f"{type(e).__name__}: {e}"))
            continue
        row["loss"] = float(loss)
        if name == "trl":
            reference = float(loss)
        rows.append(row)
        steps.append((row, step))
    for row in rows:
        if reference is not None and "loss" in row:
            row["loss_rel_diff"] = abs(row["loss"] - reference) / max(abs(reference), 1e-30)
    if steps:
        progress(f"trl task: timing {len(steps)} contenders in shuffled rounds")
        timings = measure_interleaved([st for _, st in steps], device, warmup=0, repeats=repeats, budget_s=budget_s)
        for (row, _), (timing, faults) in zip(steps, timings):
            row.update(ms=timing.median_ms, min_ms=timing.min_ms, round_ms=list(timing.times_ms))
    title = (f"TRL GRPO step B={s['batch']} T={s['seq']} ({s['completion']} completion) H={hid} V={vocab} "
             f"{str(dtype).replace('torch.', '')}: the policy's and reference's LM heads and the loss, from hidden "
             "states, fwd+bwd")
    return dict(file="trl_grpo.json", title=title, short="TRL GRPO step (hidden)", baseline="trl", compile=None,
                machine=describe(device), temperature=TEMPERATURE, beta=BETA, epsilon=list(EPSILON), shape=s, rows=rows)


# The default run's size (a few seconds on 2 CPU cores) and --full's.
DEFAULT_SIZE = (256, 256, 8192)
FULL_SIZE = (2048, 512, 32768)


def run_task(ctx) -> list[dict]:
    """``kl-kernels bench``'s ``trl`` task (``kl_kernels.bench.tasks``): one size, in this process."""
    n, hid, vocab = FULL_SIZE if ctx.plan.full else DEFAULT_SIZE
    repeats = ctx.plan.repeats if ctx.plan.full else min(ctx.plan.repeats, 5)
    return [measure(n, hid, vocab, ctx.dtype, ctx.device, repeats=repeats, budget_s=ctx.plan.budget_s, seed=ctx.seed,
                    progress=ctx.progress)]


def line(r: dict) -> str:
    if "error" in r:
        return f"{r['contender']:<36} not run: {r['error']}"
    return (f"{r['contender']:<36} {r['ms']:9.1f} ms (min {r['min_ms']:.1f})  peak +{r['peak_extra_mib']:8.1f} MiB  "
            f"loss {r['loss']:.6f} (rel diff to TRL {r.get('loss_rel_diff', math.nan):.1e})")


def _child(args, queue):
    queue.put(measure(*args[:5], repeats=args[5], contenders=(args[6],))["rows"][0])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default=":".join(map(str, DEFAULT_SIZE)), help="N:H:V (tokens, width, vocabulary)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--own-process", action="store_true", help="each contender in a fresh process (clean peaks)")
    parser.add_argument("--out", default=None, help="write the result dict to this JSON file")
    args = parser.parse_args(argv)
    n, hid, vocab = map(int, args.size.split(":"))
    dtype = getattr(torch, args.dtype)
    if args.own_process:
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        result = measure(n, hid, vocab, dtype, args.device, repeats=1, contenders=())
        for name in CONTENDERS:
            queue = ctx.Queue()
            proc = ctx.Process(target=_child, args=((n, hid, vocab, dtype, args.device, args.repeats, name), queue))
            proc.start()
            proc.join()
            result["rows"].append(queue.get() if not queue.empty() else dict(contender=name,
                                                                            error=f"exit code {proc.exitcode}"))
        ref = next((r["loss"] for r in result["rows"] if r["contender"] == "trl" and "loss" in r), None)
        for r in result["rows"]:
            if ref is not None and "loss" in r:
                r["loss_rel_diff"] = abs(r["loss"] - ref) / max(abs(ref), 1e-30)
    else:
        result = measure(n, hid, vocab, dtype, args.device, repeats=args.repeats,
                         progress=lambda m: print(m, flush=True))
    print(result["title"])
    for r in result["rows"]:
        print(line(r))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
