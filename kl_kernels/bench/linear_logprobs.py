"""Benchmark of the hidden-state path (issue 28 item 7): per-token log-probs and entropy from hidden states
``[N, H]`` and an LM head ``[V, H]``, forward + backward (gradients to both), time and peak extra memory,
each contender in a fresh process, side by side in one run:

* ``eager``: ``logits = hidden @ weight.T`` whole, then ``log_softmax(logits.float() / T).gather`` and the
  entropy, as RL trainers write it;
* ``compile``: ``torch.compile`` of that;
* ``linear_token_logprobs[cpu]``: the chunked path (``kl_kernels.linear_token_logprobs``: one chunk of
  logits at a time, the fused CPU row kernel, recomputed in backward);
* ``linear_token_logprobs[torch]``: the same with the chunked torch row math;
* the routes of verl 0.9.1's ``use_fused_kernels=True`` (:func:`kl_kernels.bench.hidden_states.peer_logprobs`):
  ``verl[torch]`` (``FusedLinearForPPO``: chunks of 512 tokens, logits recomputed in backward), ``verl[triton]``
  (its Triton kernel: CUDA only, a row saying so here) and ``liger[ce]`` (Liger-Kernel 0.8.5's fused linear
  cross-entropy with entropy, verl's ``"liger"`` route: its torch fallback on the CPU).

With ``--task loss``: a whole GRPO loss step from hidden states (policy and reference, k3 KL with beta =
0.04, clip 0.2, TRL's "grpo" aggregation, 8 sequences), forward + backward to the policy's hidden states and
head: ``eager loss`` (both models' logits whole, ``log_softmax().gather``, TRL's per-token loss in torch),
``liger`` (Liger-Kernel 0.8.5's ``LigerFusedLinearGRPOLoss``, chunked, ``compiled=False``: its CPU path),
``linear_kl_penalty_loss[cpu]`` (ours: one pass, each chunk's logits formed once and the loss's gradient
taken into ``d hidden``/``d weight`` at once, as Liger does) and ``linear_kl_penalty_loss[cpu] two passes``
(``one_pass=False``: chunked log-probs, the fused loss, the logits formed again in backward).

Peak memory as in :mod:`kl_kernels.bench.token_logprobs` (resident high-water mark of one call over the
resident size before it, after a warm-up call); the inputs' gradients are part of every contender's peak.
Times: median of ``--repeats`` calls after the warm-up.

Run: ``python -m kl_kernels.bench.linear_logprobs [--task logprobs|loss] [--sizes N:H:V ...] [--dtype bfloat16]
[--contenders NAME ...] [--rounds R] [--out DIR]`` (``--rounds``: the contenders alternated R times, each
one's best round printed: for a shared, noisy machine). On a GPU: :mod:`kl_kernels.bench.hidden_states`.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
from pathlib import Path

import torch

from .machine import describe
from .timing import measure
from .token_logprobs import _reset_peak, _status_mib

DEFAULT_SIZES = ((2048, 512, 32768), (8192, 512, 131072))
CONTENDERS = ("eager", "compile", "linear_token_logprobs[cpu]", "linear_token_logprobs[torch]", "verl[torch]",
              "verl[triton]", "liger[ce]")
PEERS = {"verl[torch]": "verl_torch", "verl[triton]": "verl", "liger[ce]": "liger"}  # -> hidden_states.peer_logprobs
LOSS_CONTENDERS = ("eager loss", "liger", "linear_kl_penalty_loss[cpu]", "linear_kl_penalty_loss[cpu] two passes")
SEQUENCES = 8
TEMPERATURE = 0.7


def _eager(hidden, weight, labels):
    z = (hidden @ weight.t()).float() / TEMPERATURE
    lp = torch.log_softmax(z, -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    p = torch.softmax(z, -1)
    entropy = torch.logsumexp(z, -1) - (p * z).sum(-1)
    return lp, entropy


def _step(name, hidden, weight, labels, fn):
    h, w = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
    if name.startswith("linear_token_logprobs"):
        from kl_kernels import linear_token_logprobs

        out = linear_token_logprobs(h, w, labels, temperature=TEMPERATURE, return_entropy=True,
                                    backend=name[name.index("[") + 1:name.index("]")])
        lp, entropy = out.log_probs, out.entropy
    else:
        lp, entropy = fn(h, w, labels)
    (lp.sum() + 0.01 * entropy.sum()).backward()


def _loss_inputs(n, hid, vocab, dtype):
    b, t = SEQUENCES, n // SEQUENCES
    f = getattr(torch, dtype)
    return dict(hidden=torch.randn(b, t, hid).to(f), weight=(torch.randn(vocab, hid) / hid ** 0.5).to(f),
                ref_hidden=torch.randn(b, t, hid).to(f), ref_weight=(torch.randn(vocab, hid) / hid ** 0.5).to(f),
                labels=torch.randint(0, vocab, (b, t)), old=-torch.rand(b, t) * 5 - 5, adv=torch.randn(b),
                mask=torch.ones(b, t))


def _loss_step(name, x, liger_fn=None):
    h, w = x["hidden"].detach().requires_grad_(), x["weight"].detach().requires_grad_()
    if name == "liger":
        loss = liger_fn(h, w, x["labels"], x["mask"], x["adv"], old_per_token_logps=x["old"], ref_input=x["ref_hidden"],
                        ref_weight=x["ref_weight"])[0]
    elif name.startswith("linear_kl_penalty_loss"):
        from kl_kernels import linear_kl_penalty_loss

        loss = linear_kl_penalty_loss(h, w, x["labels"], x["old"], x["adv"], ref_hidden=x["ref_hidden"],
                                      ref_weight=x["ref_weight"], temperature=TEMPERATURE, mask=x["mask"].bool(),
                                      beta=0.04, estimator="k3", clip_epsilon=0.2, aggregation="seq-mean-token-mean",
                                      logprobs_backend="cpu", one_pass=not name.endswith("two passes")).loss
    else:  # TRL's per-token GRPO loss on whole logits
        def logps(hidden, weight):
            z = (hidden @ weight.t()).float() / TEMPERATURE
            return torch.log_softmax(z, -1).gather(-1, x["labels"].unsqueeze(-1)).squeeze(-1)
        lp = logps(h, w)
        with torch.no_grad():
            ref = logps(x["ref_hidden"], x["ref_weight"])
        ratio = torch.exp(lp - x["old"])
        a = x["adv"].unsqueeze(1)
        per_token = -torch.min(ratio * a, ratio.clamp(0.8, 1.2) * a)
        per_token = per_token + 0.04 * (torch.exp(ref - lp) - (ref - lp) - 1)
        m = x["mask"]
        loss = ((per_token * m).sum(-1) / m.sum(-1).clamp(min=1)).mean()
    loss.backward()


def measure_one(name: str, n: int, hid: int, vocab: int, dtype: str, repeats: int) -> dict:
    torch.manual_seed(0)
    row = dict(contender=name, n=n, hidden=hid, vocab=vocab, dtype=dtype)
    if name in LOSS_CONTENDERS:
        x = _loss_inputs(n, hid, vocab, dtype)
        liger_fn = None
        if name == "liger":
            try:
                from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss
            except ImportError:
                from .hidden_states import LIGER_MISSING

                return dict(row, error=LIGER_MISSING)
            liger_fn = LigerFusedLinearGRPOLoss(beta=0.04, compiled=False, loss_type="grpo", temperature=TEMPERATURE)

        def step():
            _loss_step(name, x, liger_fn)
    else:
        hidden = torch.randn(n, hid).to(getattr(torch, dtype))
        weight = (torch.randn(vocab, hid) / hid ** 0.5).to(getattr(torch, dtype))
        labels = torch.randint(0, vocab, (n,))
        fn = torch.compile(_eager) if name == "compile" else _eager
        if name in PEERS:
            from .hidden_states import peer_logprobs

            try:
                fn = peer_logprobs(PEERS[name], TEMPERATURE, device="cpu")  # (the CPU bench)
            except (ImportError, RuntimeError) as e:  # a row saying why (our own words), never silently absent
                return dict(row, error=str(e))

        def step():
            _step(name, hidden, weight, labels, fn)
    try:
        step()  # warm-up (and compile)
        _reset_peak()
        before = _status_mib("VmRSS")
        step()
        peak = _status_mib("VmHWM") - before
        timing = measure(step, torch.device("cpu"), warmup=0, repeats=repeats, budget_s=0.0)
    except Exception as e:  # reported as a row, not a crash of the benchmark
        return dict(row, error=f"{type(e).__name__}: {e}")
    return dict(row, ms=timing.median_ms, min_ms=timing.min_ms, runs=timing.repeats, peak_extra_mib=round(peak, 1),
                logits_fp32_mib=round(n * vocab * 4 / 2**20, 1))


def _child(args, queue) -> None:
    queue.put(measure_one(*args))


def line(r: dict) -> str:
    head = f"{r['contender']:<30} N={r['n']:<6} H={r['hidden']:<5} V={r['vocab']:<7} {r['dtype']}"
    if "error" in r:
        return f"{head}: {r['error']}"
    return f"{head}: {r['ms']:10.1f} ms  peak +{r['peak_extra_mib']:9.1f} MiB"


def run(sizes=DEFAULT_SIZES, dtype: str = "bfloat16", repeats: int = 3, task: str = "logprobs", contenders=None,
        rounds: int = 1, progress=lambda text: print(text, flush=True)) -> dict:
    """Each contender in a fresh process; ``rounds`` > 1 alternates them round by round (a noisy machine:
    compare each contender's best round) and keeps every round's row (``round``); ``progress`` gets a line per
    row."""
    ctx = mp.get_context("spawn")
    rows = []
    names = [c for c in (LOSS_CONTENDERS if task == "loss" else CONTENDERS) if contenders is None or c in contenders]
    for n, hid, vocab in sizes:
        for k in range(rounds):
            for name in names:
                queue = ctx.Queue()
                proc = ctx.Process(target=_child, args=((name, n, hid, vocab, dtype, repeats), queue))
                proc.start()
                proc.join(timeout=1800)
                rows.append(queue.get() if not queue.empty() else dict(contender=name, n=n, hidden=hid, vocab=vocab,
                                                                      dtype=dtype, error=f"exit code {proc.exitcode}"))
                rows[-1]["round"] = k
                progress(line(rows[-1]))
    if rounds > 1:
        for n, hid, vocab in sizes:
            for name in names:
                ok = [r for r in rows if r["contender"] == name and (r["n"], r["hidden"], r["vocab"]) == (n, hid, vocab)
                      and "error" not in r]
                if ok:
                    progress(f"best of {len(ok)} rounds: {line(min(ok, key=lambda r: r['min_ms']))} "
                             f"(min {min(r['min_ms'] for r in ok):.1f} ms)")
    return dict(machine=describe(torch.device("cpu")), temperature=TEMPERATURE, rows=rows)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", default=None, help="N:H:V triples (default: %s)" % " ".join(
        ":".join(map(str, s)) for s in DEFAULT_SIZES))
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--task", default="logprobs", choices=["logprobs", "loss"])
    parser.add_argument("--contenders", nargs="+", default=None, choices=CONTENDERS + LOSS_CONTENDERS)
    parser.add_argument("--rounds", type=int, default=1, help="alternate the contenders this many times")
    parser.add_argument("--out", default=None, help="folder for results.json")
    args = parser.parse_args(argv)
    sizes = DEFAULT_SIZES if args.sizes is None else tuple(tuple(map(int, s.split(":"))) for s in args.sizes)
    result = run(sizes, args.dtype, args.repeats, args.task, args.contenders, args.rounds)
    result["task"] = args.task
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps(result, indent=1))
        print(f"wrote {out / 'results.json'}")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))
    main()
