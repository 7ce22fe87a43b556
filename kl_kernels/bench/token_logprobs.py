"""Benchmark of ``token_logprobs`` (issue 28): time and peak extra memory of per-token log-probs and
entropy from logits, forward + backward, side by side in one run, against what RL trainers write
(eager ``log_softmax(logits.float() / T).gather`` + ``logsumexp - sum(softmax * logits)``, verl's
``entropy_from_logits``) and ``torch.compile`` of it.

Peak memory: each contender runs in a fresh process (``spawn``); after the inputs exist and a
warm-up call ran (and compiled), the resident high-water mark is reset (Linux ``clear_refs``) and
the figure is its peak during one call over the resident size before it (``VmHWM - VmRSS``): what a
forward + backward needs beyond its inputs, the logits' gradient included. Times: median of 5 calls, each
round alternating with a copy of the logits (``floor_ms``: 1.5 such copies, the bytes a forward + backward
must move, timed in the same rounds; :func:`kl_kernels.bench.timing.measure_interleaved`).

Run: ``python -m kl_kernels.bench.token_logprobs [--device cpu|cuda] [--out DIR] [--sizes N:V ...]``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
from pathlib import Path

import torch

from .machine import describe
from .timing import measure, measure_interleaved

DEFAULT_SIZES = ((2048, 32768), (4096, 65536), (2048, 131072))
CONTENDERS = ("eager", "compile", "token_logprobs[torch]", "token_logprobs[cpu]", "token_logprobs[cpu]+inplace",
              "token_logprobs[cuda]", "token_logprobs[cuda]+inplace", "token_logprobs[triton]",
              "token_logprobs[triton]+inplace")
FUSED = ("[cpu]", "[cuda]", "[triton]")  # the fused kernels' backends
TEMPERATURE = 0.7


def _eager(logits, labels):
    z = logits.float() / TEMPERATURE
    lp = torch.log_softmax(z, -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    p = torch.softmax(z, -1)
    entropy = torch.logsumexp(z, -1) - (p * z).sum(-1)
    return lp, entropy


def _step(name: str, logits: torch.Tensor, labels: torch.Tensor, fn):
    """One forward + backward of ``name``; returns nothing (the gradient is dropped)."""
    if name.startswith("token_logprobs"):
        from kl_kernels import token_logprobs

        # inplace: the gradient overwrites the logits (a leaf here, whose .grad then aliases them): later
        # calls read gradients as logits, which costs the same
        x = logits.detach().requires_grad_()
        backend = name[name.index("[") + 1:name.index("]")]
        out = token_logprobs(x, labels, temperature=TEMPERATURE, return_entropy=True, backend=backend,
                             inplace_backward=name.endswith("inplace"))
        (out.log_probs.sum() + 0.01 * out.entropy.sum()).backward()
        return
    x = logits.detach().requires_grad_()
    lp, entropy = fn(x, labels)
    (lp.sum() + 0.01 * entropy.sum()).backward()


def _status_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024.0  # kB
    raise RuntimeError(f"no {field} in /proc/self/status")


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:  # "5": reset the peak resident size (Linux >= 4.0)
        f.write("5")


def measure_one(name: str, n: int, vocab: int, dtype: str, device: torch.device, repeats: int = 5) -> dict:
    """One contender's row: time (median of ``repeats`` calls after a warm-up, which also compiles) and
    the peak extra memory of one call (CPU: resident high-water mark over the resident size before it,
    in a process of its own for a clean figure; CUDA: torch's allocator peak over what was allocated)."""
    torch.manual_seed(0)
    logits = (torch.randn(n, vocab, device=device) * 3).to(getattr(torch, dtype))
    labels = torch.randint(0, vocab, (n,), device=device)
    fn = torch.compile(_eager) if name == "compile" else _eager
    try:
        _step(name, logits, labels, fn)  # warm-up (and compile)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device) / 2**20
            _step(name, logits, labels, fn)
            torch.cuda.synchronize(device)
            peak = torch.cuda.max_memory_allocated(device) / 2**20 - before
        else:
            _reset_peak()
            before = _status_mib("VmRSS")
            _step(name, logits, labels, fn)
            peak = _status_mib("VmHWM") - before
        # the step and a copy of the same bytes alternate round by round (the floor of this row, same rounds)
        copy = _copy_floor_call(logits)
        (timing, _), (floor, _) = measure_interleaved([lambda: _step(name, logits, labels, fn), copy], device,
                                                      warmup=0, repeats=repeats, budget_s=20.0)
    except Exception as e:  # reported as a row, not a crash of the benchmark
        return dict(contender=name, n=n, vocab=vocab, dtype=dtype, error=f"{type(e).__name__}: {e}")
    return dict(contender=name, n=n, vocab=vocab, dtype=dtype, ms=timing.median_ms, min_ms=timing.min_ms,
                runs=timing.repeats, peak_extra_mib=round(peak, 1), round_ms=list(timing.times_ms),
                floor_ms=1.5 * floor.median_ms, floor_round_ms=[1.5 * t for t in floor.times_ms],
                logits_mib=round(logits.numel() * logits.element_size() / 2**20, 1))


def _copy_floor_call(logits: torch.Tensor):
    """``dst.copy_(logits)``: reads the logits and writes as many bytes, 2x their bytes; the step must move 3x
    (the logits read forward and backward, their gradient written), so its floor is 1.5 of these copies."""
    dst = torch.empty_like(logits)
    return lambda: dst.copy_(logits)


def contenders(device: torch.device, with_compile: bool = True) -> tuple:
    """The contenders that run on ``device``: the CPU kernel on the CPU, the CUDA C++ and Triton kernels on a
    GPU (Triton's CPU interpreter and the emulated CUDA kernels are test tools, not contenders)."""
    names = [c for c in CONTENDERS if with_compile or c != "compile"]
    own = ("[cpu]",) if device.type == "cpu" else ("[cuda]", "[triton]")
    return tuple(c for c in names if any(o in c for o in own) or not any(f in c for f in FUSED))


def _child(name: str, n: int, vocab: int, dtype: str, queue) -> None:
    queue.put(measure_one(name, n, vocab, dtype, torch.device("cpu")))


def run(sizes=DEFAULT_SIZES, dtype: str = "bfloat16", progress=print) -> dict:
    """Every contender at every size, each in a fresh process (CPU), each with its copy floor; ``progress`` gets a
    line per row as it comes (``kl-kernels bench`` passes its status line)."""
    ctx = mp.get_context("spawn")
    rows = []
    for n, vocab in sizes:
        for name in contenders(torch.device("cpu")):
            queue = ctx.Queue()
            proc = ctx.Process(target=_child, args=(name, n, vocab, dtype, queue))
            proc.start()
            proc.join(timeout=900)
            rows.append(queue.get() if not queue.empty() else dict(contender=name, n=n, vocab=vocab, dtype=dtype,
                                                                  error=f"exit code {proc.exitcode}"))
            progress(_line(rows[-1]))
    return dict(machine=describe(torch.device("cpu")), temperature=TEMPERATURE, rows=rows)


def run_here(sizes, dtype: str, device: torch.device, with_compile: bool = True, progress=print,
             skip: dict | None = None) -> list[dict]:
    """Every contender in this process (``kl-kernels bench``): on the CPU the peaks after the first
    contender include what earlier ones left in glibc's heap; the standalone run (:func:`run`) is
    the clean figure. ``skip``: contender -> why it is not run (a row with that ``error``)."""
    rows = []
    for n, vocab in sizes:
        for name in contenders(device, with_compile):
            if skip and name in skip:
                rows.append(dict(contender=name, n=n, vocab=vocab, dtype=dtype, error=skip[name]))
            else:
                rows.append(measure_one(name, n, vocab, dtype, device, repeats=3))
            progress(_line(rows[-1]))
    return rows


def line(r: dict) -> str:
    return _line(r)


def _line(r: dict) -> str:
    if "error" in r:
        return f"{r['contender']:<28} N={r['n']:<6} V={r['vocab']:<7} {r['dtype']}: {r['error']}"
    return (f"{r['contender']:<28} N={r['n']:<6} V={r['vocab']:<7} {r['dtype']}: {r['ms']:9.1f} ms  "
            f"peak +{r['peak_extra_mib']:8.1f} MiB (logits {r['logits_mib']} MiB)")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", default=None, help="N:V pairs (default: %s)" % " ".join(
        f"{n}:{v}" for n, v in DEFAULT_SIZES))
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                        help="cpu: each contender in its own process; cuda: all in this one (torch's "
                             "allocator peaks are per call)")
    parser.add_argument("--out", default=None, help="folder for results.json")
    args = parser.parse_args(argv)
    sizes = DEFAULT_SIZES if args.sizes is None else tuple(tuple(map(int, s.split(":"))) for s in args.sizes)
    if args.device == "cuda":
        device = torch.device("cuda")
        result = dict(machine=describe(device), temperature=TEMPERATURE,
                      rows=run_here(sizes, args.dtype, device, progress=lambda m: print(m, flush=True)))
    else:
        result = run(sizes, args.dtype, progress=lambda m: print(m, flush=True))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps(result, indent=1))
        print(f"wrote {out / 'results.json'}")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))
    main()
