"""The log-prob tasks of ``kl-kernels bench`` (``kind="result"`` in :mod:`kl_kernels.bench.tasks`): token_logprobs
from logits and the hidden-state path, one size each (``ctx.plan``), written as result dicts.

The default run times them in this process at small sizes (a few seconds each); ``--full`` runs each contender
in its own process at the large sizes (clean memory peaks: :mod:`kl_kernels.bench.token_logprobs`,
:mod:`kl_kernels.bench.linear_logprobs`). A contender that does not run is a row with ``error`` saying why."""

from __future__ import annotations

import torch

from .machine import describe

# Contenders left out of the default run, and why (each becomes a "not run" row with this reason).
DEFAULT_SKIPS = {
    "token_logprobs[torch]": "the torch fallback, ~8x eager here: --full runs it",
    "linear_token_logprobs[torch]": "the torch fallback: --full runs it",
    "compile": "its compile takes longer than the whole default run: --full runs it",
}


def _dtype_name(ctx) -> str:
    return {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}[ctx.dtype_name]


def token_logprobs(ctx) -> list[dict]:
    from . import token_logprobs as tlp

    n, vocab = ctx.plan.logprobs_size
    dtype = _dtype_name(ctx)
    ctx.progress(f"token_logprobs: N={n}, V={vocab}, {dtype} logits, forward + backward")
    if ctx.plan.own_process and ctx.device.type == "cpu" and ctx.plan.with_compile:
        rows = tlp.run([(n, vocab)], dtype, progress=ctx.progress)["rows"]
    else:
        skip = {} if ctx.plan.full else {k: v for k, v in DEFAULT_SKIPS.items() if k.startswith("token_logprobs")}
        if ctx.plan.quick:
            skip["compile"] = "not in --quick (its compile outlasts the rest of the run)"
        rows = tlp.run_here([(n, vocab)], dtype, ctx.device, with_compile=ctx.plan.with_compile,
                            progress=ctx.progress, skip=skip)
    for r in rows:
        r["ours"] = any(tag in r["contender"] for tag in tlp.FUSED)
    title = f"token_logprobs (log-probs + entropy from logits, fwd+bwd), N={n}, V={vocab}, {dtype}"
    return [dict(file="token_logprobs.json", title=title, baseline="eager", compile="compile",
                 machine=describe(ctx.device), temperature=tlp.TEMPERATURE, rows=rows)]


def hidden_states(ctx) -> list[dict]:
    """The hidden-state path on the CPU (linear_token_logprobs; the GRPO loss step against eager and Liger)."""
    from . import linear_logprobs as ll

    if ctx.device.type != "cpu":  # (on a GPU: python -m kl_kernels.bench.hidden_states)
        return []
    dtype = _dtype_name(ctx)
    if dtype == "float16":  # float32 or bfloat16 only (Liger's CPU path and ours' bench)
        return []
    n, hid, vocab = ctx.plan.hidden_size
    results = []
    for task, names, what in (("logprobs", ll.CONTENDERS, "linear_token_logprobs (from hidden states, fwd+bwd)"),
                              ("loss", ll.LOSS_CONTENDERS, "GRPO loss step from hidden states (fwd+bwd)")):
        ctx.progress(f"hidden-state path ({task}): N={n}, H={hid}, V={vocab}, {dtype}, forward + backward")
        if ctx.plan.own_process:
            rows = ll.run([(n, hid, vocab)], dtype, repeats=3, task=task, progress=ctx.progress)["rows"]
        else:
            rows = []
            for name in names:
                why = "--no-compile" if name == "compile" and not ctx.plan.with_compile else \
                    None if ctx.plan.full else DEFAULT_SKIPS.get(name)
                if why:
                    rows.append(dict(contender=name, n=n, hidden=hid, vocab=vocab, dtype=dtype, error=why))
                else:
                    rows.append(ll.measure_one(name, n, hid, vocab, dtype, 3))
                ctx.progress(ll.line(rows[-1]))
        for r in rows:
            r["ours"] = r["contender"].startswith(("linear_token_logprobs[cpu]", "linear_kl_penalty_loss[cpu]"))
        results.append(dict(file=f"hidden_states_{task}.json", title=f"{what}, N={n}, H={hid}, V={vocab}, {dtype}",
                            baseline="eager" if task == "logprobs" else "eager loss",
                            compile="compile" if task == "logprobs" else None, task=task,
                            machine=describe(torch.device("cpu")), rows=rows))
    return results
