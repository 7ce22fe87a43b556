"""The ``kl-kernels`` command: ``info`` (what is built and can run here) and ``bench``."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# Rounds per table (each round times every contender once, in a shuffled order), within a budget of
# 3 s per contender. A median of 10 moved by +-15% between runs on the 2-core CI VM; with 30 the
# whole bench took 83 s there.
REPEATS = 30


def _progress():
    """A progress callback: one line on stderr rewritten in place when stderr is a terminal, nothing
    otherwise (a log or a pipe gets the summary only)."""
    if not sys.stderr.isatty():
        return lambda msg: None
    import shutil

    width = shutil.get_terminal_size((100, 20)).columns - 1

    def say(msg: str) -> None:
        sys.stderr.write("\r\033[K" + msg[:width])
        sys.stderr.flush()
    return say


def _clear_progress() -> None:
    if sys.stderr.isatty():
        sys.stderr.write("\r\033[K")
        sys.stderr.flush()


def cmd_check(include_named_only: bool = False) -> int:
    """``kl-kernels info --check``: the self-check of every available non-reference backend that
    ``"auto"`` may choose, on each device here where it may (for CUDA, the current device). With
    ``--all``, also the rows that run only when named (Triton's CPU interpreter, cuda-emulated: test
    instruments, slow; minutes on a 2-core machine)."""
    import torch

    from . import selfcheck
    from .kl_penalty.backends import REGISTRY as PENALTY_REGISTRY
    from .kl_reward.backends import REGISTRY
    from .full_kl.backends import REGISTRY as FULL_KL_REGISTRY
    from .token_logprobs.backends import REGISTRY as LOGPROBS_REGISTRY
    failed = 0
    for op, registry in (("kl_reward", REGISTRY), ("kl_penalty_loss", PENALTY_REGISTRY),
                         ("token_logprobs", LOGPROBS_REGISTRY), ("full_kl", FULL_KL_REGISTRY)):
        for b in registry:
            if b.name == "torch":
                continue
            reasons = b.unavailable_reasons()
            for device in sorted(b.devices):
                if device == "cuda" and not torch.cuda.is_available():
                    continue
                if not include_named_only and b.auto_devices is not None and device not in b.auto_devices:
                    continue
                if reasons:
                    print(f"{op:16s} {b.name:14s} {device:5s} skipped: {'; '.join(reasons)}")
                    continue
                failures = selfcheck.run(op, b.name, device)
                failed += bool(failures)
                print(f"{op:16s} {b.name:14s} {device:5s} " + ("passed" if not failures else
                      f"FAILED ({len(failures)}): " + "; ".join(failures[:3])))
    return 1 if failed else 0


def cmd_info(args) -> int:
    from ._info import format_info, info
    if args.check:
        return cmd_check(include_named_only=args.all)
    data = info()
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    print(format_info(data))
    return 0


def _bench_child(args, say) -> list | None:
    """Run this bench with glibc's default allocator in a child process (quiet: its rows come back through
    a temporary folder); return its rows, or None if it failed (its output is shown then)."""
    import os
    import subprocess
    import tempfile
    argv = [sys.executable, "-m", "kl_kernels.cli", "bench", "--malloc", "default", "--dtype", args.dtype,
            "--seed", str(args.seed), "--child"]
    argv += ["--quick"] if args.quick else []
    argv += ["--sizes", *args.sizes] if args.sizes else []
    argv += ["--device", args.device] if args.device else []
    argv += ["--no-compile"] if args.no_compile else []
    say("glibc's default allocator first (a child process), then the tuned one here")
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, PYTHONWARNINGS="ignore")
        done = subprocess.run(argv + ["--out", tmp], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=env)
        if done.returncode != 0:
            _clear_progress()
            print(done.stdout, file=sys.stderr)
            print("kl-kernels bench: the run under glibc's default allocator failed (above)", file=sys.stderr)
            return None
        return json.loads((Path(tmp) / "results.json").read_text())["rows"]


def cmd_bench(args) -> int:
    import textwrap
    import warnings

    import torch

    from .bench import batches, kl_penalty, kl_reward as cases, machine, report, torchrl_transforms

    # Library warnings (torch.compile's, nested tensors' prototype notice) are not results: keep the report short.
    warnings.filterwarnings("ignore")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    sizes = args.sizes or (["small", "medium"] if args.quick else ["medium", "large"])
    unknown = [s for s in sizes if s not in batches.SIZES]
    if unknown:
        print(f"unknown size(s) {unknown}; choose from {list(batches.SIZES)}", file=sys.stderr)
        return 2
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    say = _progress() if not args.child else (lambda msg: None)
    out = Path(args.out)
    if out.is_dir():  # a summary of this run only: what an earlier run left here would be read with it
        for old in ("results.json", "results.csv", "results.png", "tables.txt", "summary.txt", "token_logprobs.json",
                    "hidden_states_logprobs.json", "hidden_states_loss.json"):
            (out / old).unlink(missing_ok=True)
    mode = "default" if args.system_malloc else args.malloc
    earlier = []
    if mode == "both":
        # The allocator users have first: glibc's default (freed temporaries unmapped, re-faulted on the
        # next call), in a child process since mallopt cannot be undone; then the tuned one, here.
        earlier = _bench_child(args, say)
        if earlier is None:
            return 1
        mode = "tuned"
    malloc = "glibc default" if mode == "default" else machine.keep_freed_memory()
    say(f"measuring copy bandwidth on {device} (malloc: {malloc})")
    copy_gbs = machine.copy_bandwidth_gbs(device, nbytes=(64 if args.quick else 256) * 2**20)
    facts = {**machine.describe(device), "malloc": malloc}
    rows = []
    repeats, budget_s = (3, 1.0) if args.quick else (REPEATS, 3.0)
    for name in sizes:
        batch = batches.make_batch(batches.SIZES[name], dtype=dtype, device=device, seed=args.seed)
        step = lambda msg, n=name: say(f"[{n}, malloc {mode}] {msg}")  # noqa: E731
        step(f"B={batch.size.batch}, {batch.num_tokens:,} tokens")
        rows += cases.run(batch, copy_gbs=copy_gbs, with_compile=not args.no_compile, repeats=repeats,
                          budget_s=budget_s, progress=step)
        rows += torchrl_transforms.run(batch, copy_gbs=copy_gbs, repeats=repeats, budget_s=budget_s, progress=step)
        rows += kl_penalty.run(batch, copy_gbs=copy_gbs, with_compile=not args.no_compile, repeats=repeats,
                               budget_s=budget_s, progress=step)
    for r in rows:
        r["malloc"] = malloc
    if earlier:
        facts["malloc"] = f"both: {earlier[0]['malloc']} (rows first) and {malloc}"
    report.write(earlier + rows, facts, copy_gbs, out)
    if args.child:
        return 0
    if not args.no_token_logprobs:
        _bench_token_logprobs(args, device, facts, say)
        if device.type == "cpu":
            _bench_hidden_states(args, say)
    say("writing the summary and the plot")
    report.finish(out)
    _clear_progress()
    if args.details:
        print((out / "tables.txt").read_text())
    print((out / "summary.txt").read_text(), end="")
    files = sorted(p.name for p in out.iterdir() if p.suffix in (".json", ".csv", ".png", ".txt"))
    print("\n" + textwrap.fill(f"Files: {', '.join(files)} (tables.txt: every column of every table; JSON/CSV: "
                              "every number)", 100, subsequent_indent="  "))
    print(f"Results in {out.resolve()}/")
    return 0


def _bench_token_logprobs(args, device, facts, say) -> Path:
    """token_logprobs (log-probs and entropy from logits, forward + backward) against eager
    ``log_softmax().gather`` and its torch.compile: time and peak extra memory, one size. On the CPU
    without ``--quick`` each contender runs in its own process (clean peaks); ``--quick`` and a GPU
    run them here (``python -m kl_kernels.bench.token_logprobs`` runs more sizes)."""
    from .bench import token_logprobs as tlp

    size = (256, 8192) if args.quick else (2048, 32768)
    dtype = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[args.dtype]
    say(f"token_logprobs: N={size[0]}, V={size[1]}, {dtype} logits, forward + backward (time, peak extra memory)")
    own_process = device.type == "cpu" and not args.quick and not args.no_compile
    if own_process:  # each contender in its own process: clean memory peaks
        rows = tlp.run([size], dtype, progress=say)["rows"]
    else:  # --quick: no torch.compile contender here (its compile alone takes longer than the rest)
        rows = tlp.run_here([size], dtype, device, with_compile=not (args.no_compile or args.quick), progress=say)
    path = Path(args.out) / "token_logprobs.json"
    path.write_text(json.dumps(dict(machine=facts, temperature=tlp.TEMPERATURE, rows=rows), indent=1))
    return path


def _bench_hidden_states(args, say) -> list:
    """The hidden-state path (``kl_kernels.bench.linear_logprobs``): ``linear_token_logprobs`` against
    eager ``(hidden @ weight.T).log_softmax().gather`` + entropy and its torch.compile, and a GRPO loss step
    (``linear_kl_penalty_loss``) against eager and Liger-Kernel's ``LigerFusedLinearGRPOLoss``: time and
    peak extra memory, each contender in its own process, one size. Not with ``--quick``: each contender
    starts a process and its eager step takes seconds (``python -m kl_kernels.bench.linear_logprobs``
    runs it alone, at any size)."""
    from .bench import linear_logprobs

    if args.quick:  # (python -m kl_kernels.bench.linear_logprobs runs it alone)
        return []
    dtype = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[args.dtype]
    if dtype == "float16":  # float32 or bfloat16 only (Liger's CPU path and ours' bench)
        return []
    paths = []
    for task, size in (("logprobs", (2048, 512, 32768)), ("loss", (2048, 512, 32768))):
        say(f"hidden-state path ({task}): N={size[0]}, H={size[1]}, V={size[2]}, {dtype}, forward + backward, "
            "each contender in its own process")
        result = linear_logprobs.run([size], dtype, repeats=3, task=task, progress=say)
        result["task"] = task
        path = Path(args.out) / f"hidden_states_{task}.json"
        path.write_text(json.dumps(result, indent=1))
        paths.append(path)
    return paths


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="kl-kernels", description="Fused KL-penalty kernels for RLHF.")
    sub = parser.add_subparsers(dest="command", required=True)
    p_info = sub.add_parser("info", help="backends, build and runtime facts")
    p_info.add_argument("--json", action="store_true", help="print the full report as JSON")
    p_info.add_argument("--check", action="store_true",
                        help="run the first-use self-check (kl_kernels.selfcheck) of every available fused "
                             "backend that 'auto' may choose, on every device here, against the torch reference; "
                             "exit 1 if one fails")
    p_info.add_argument("--all", action="store_true",
                        help="with --check: also the backends that run only when named (Triton's CPU interpreter, "
                             "cuda-emulated)")
    p_info.set_defaults(func=cmd_info)
    p_bench = sub.add_parser("bench", help="check and time kl_reward, the TorchRL transforms and kl_penalty_loss "
                                                   "on RLHF-shaped batches")
    p_bench.add_argument("--quick", action="store_true", help="small and medium sizes, fewer repeats")
    p_bench.add_argument("--sizes", nargs="+", metavar="SIZE",
                         help="tiny, small, medium (B=256, 100..1000 tokens), large (B=1024, 256..4096)")
    p_bench.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32")
    p_bench.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    p_bench.add_argument("--no-compile", action="store_true", help="skip the torch.compile contender")
    p_bench.add_argument("--seed", type=int, default=0)
    p_bench.add_argument("--malloc", choices=["both", "default", "tuned"], default="both",
                         help="allocator settings to time under: glibc's default (freed temporaries unmapped and "
                              "re-faulted, what a user's process has), tuned (mmap threshold 32 MiB, no trimming), "
                              "or both, the default first (default: both)")
    p_bench.add_argument("--system-malloc", action="store_true", help="the same as --malloc default")
    p_bench.add_argument("--out", default="kl_kernels_bench",
                         help="folder for the results: summary.txt, tables.txt, results.json/.csv/.png, ...")
    p_bench.add_argument("--details", action="store_true",
                         help="also print the full tables (every column, p10-p90 spreads, both allocators)")
    p_bench.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # the default-allocator run
    p_bench.add_argument("--no-token-logprobs", action="store_true",
                         help="skip the token_logprobs rows (log-probs from logits, kl_kernels.bench.token_logprobs) "
                              "and the hidden-state path's (kl_kernels.bench.linear_logprobs; CPU, not with --quick)")
    p_bench.set_defaults(func=cmd_bench)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
