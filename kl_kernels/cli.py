"""The ``kl-kernels`` command: ``info`` (what is built and can run here) and ``bench`` (its tasks:
:mod:`kl_kernels.bench.tasks`)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

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


def _bench_child(args, plan, table_tasks, say) -> list | None:
    """Run the table tasks with glibc's default allocator in a child process (quiet: its rows come back through
    a temporary folder); return its rows, or None if it failed (its output is shown then)."""
    import os
    import subprocess
    import tempfile
    argv = [sys.executable, "-m", "kl_kernels.cli", "bench", "--malloc", "default", "--dtype", args.dtype,
            "--seed", str(args.seed), "--child", "--sizes", *plan.sizes, "--tasks", *(t.name for t in table_tasks)]
    argv += ["--full"] if args.full else ["--quick"] if args.quick else []
    argv += ["--device", args.device] if args.device else []
    argv += ["--no-compile"] if args.no_compile else []
    say("the table tasks under glibc's default allocator first (a child process), then the tuned one here")
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


def _cpu_seconds() -> float:
    """CPU time of this process and its finished children (the compiler torch.compile runs, the child of
    --malloc both, the log-prob tasks' own processes); 0 where getrusage is missing."""
    try:
        import resource
    except ImportError:
        return 0.0
    return sum(r.ru_utime + r.ru_stime for r in (resource.getrusage(resource.RUSAGE_SELF),
                                                   resource.getrusage(resource.RUSAGE_CHILDREN)))


def _task_line(quiet: bool):
    """The per-task progress: one line on stderr when a task ends, with its wall time and the CPU time it took
    (always, also to a log; on a shared machine the CPU time is the steadier figure)."""
    last = [_cpu_seconds()]

    def line(text: str, seconds: float) -> None:
        cpu, last[0] = _cpu_seconds() - last[0], _cpu_seconds()
        if quiet:
            return
        _clear_progress()
        print(f"{text} ({seconds:.0f} s, {cpu:.0f} s CPU)", file=sys.stderr, flush=True)
    return line


def _run_task(task, ctx) -> tuple[list, str | None]:
    """``task``'s rows or results, and None; or ``[]`` and why it failed (one task's failure, a peer's import
    error say, does not end the run: its progress line and the summary say so)."""
    try:
        return task.function()(ctx), None
    except Exception as e:  # noqa: BLE001
        return [], _one_line(f"{type(e).__name__}: {e}")


def _one_line(text: str, width: int = 160) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[:width - 3] + "..."


def cmd_bench(args) -> int:
    import os
    import time
    import warnings

    import torch

    from .bench import flags, machine, report, tasks

    started = time.perf_counter()
    # Library warnings (torch.compile's, nested tensors' prototype notice) are not results: keep the report short.
    warnings.filterwarnings("ignore")
    if args.list:
        for t in tasks.TASKS.values():
            print(f"{t.name:15s} {'default' if t.default else '--full '}  {t.about}")
        return 0
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    from .bench import batches
    unknown = [s for s in args.sizes or () if s not in batches.SIZES]
    if unknown:
        print(f"unknown size(s) {unknown}; choose from {list(batches.SIZES)}", file=sys.stderr)
        return 2
    plan = tasks.plan(full=args.full, quick=args.quick, sizes=args.sizes,
                      malloc="default" if args.system_malloc else args.malloc, with_compile=not args.no_compile)
    try:
        chosen = tasks.selected(args.tasks, full=args.full)
    except ValueError as e:
        print(f"kl-kernels bench: {e}", file=sys.stderr)
        return 2
    if args.no_token_logprobs:
        chosen = [t for t in chosen if t.name not in ("token_logprobs", "hidden_states")]
    table_tasks = [t for t in chosen if t.kind == "table"]
    result_tasks = [] if args.child else [t for t in chosen if t.kind == "result"]
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    say = _progress() if not args.child else (lambda msg: None)
    done = _task_line(args.child)
    out = Path(args.out)
    if out.is_dir():  # a summary of this run only: what an earlier run left here would be read with it
        for old in ("results.json", "results.csv", "results.png", "tables.txt", "summary.txt"):
            (out / old).unlink(missing_ok=True)
        for old in out.glob("*.json"):
            old.unlink()
    steps = len(table_tasks) + len(result_tasks) + (plan.malloc == "both" and bool(table_tasks))
    step = iter(range(1, steps + 1))
    mode, earlier = plan.malloc, []
    load = [os.getloadavg()[0]] if hasattr(os, "getloadavg") else []
    if mode == "both" and table_tasks:
        # The allocator users have first: glibc's default (freed temporaries unmapped, re-faulted on the
        # next call), in a child process since mallopt cannot be undone; then the tuned one, here.
        t0 = time.perf_counter()
        earlier = _bench_child(args, plan, table_tasks, say)
        if earlier is None:
            return 1
        done(f"[{next(step)}/{steps}] {', '.join(t.name for t in table_tasks)} under glibc's default allocator "
             f"(a child process): {sum(not r['impl'].startswith('copy') for r in earlier)} rows",
             time.perf_counter() - t0)
        mode = "tuned"
    malloc = "glibc default" if mode == "default" else machine.keep_freed_memory()
    say(f"measuring copy bandwidth on {device} (malloc: {malloc})")
    copy_gbs = machine.copy_bandwidth_gbs(device, nbytes=(256 if plan.full else 64) * 2**20)
    facts = {**machine.describe(device), "malloc": malloc, "plan": "full" if plan.full else
             "quick" if args.quick else "default", "sizes": plan.sizes, "repeats": plan.repeats}
    ctx = tasks.Context(plan, device, dtype, args.seed, out, copy_gbs, say)
    rows = []
    for task in table_tasks:
        t0 = time.perf_counter()
        got, failed = _run_task(task, ctx)
        rows += got
        tables = len(dict.fromkeys((r["task"], r["size"]) for r in got))
        done(f"[{next(step)}/{steps}] {task.name} ({', '.join(plan.sizes)}): {tables} tables, "
             f"{sum(not r['impl'].startswith('copy') for r in got)} rows"
             + (f", failed: {failed}" if failed else ", skipped (" + (
                 "torchrl not installed" if task.name == "torchrl" else "nothing to run") + ")" if not got else ""),
             time.perf_counter() - t0)
    for r in rows:
        r["malloc"] = malloc
    if earlier:
        facts["malloc"] = f"both: {earlier[0]['malloc']} (rows first) and {malloc}"
        flags.flag_allocators(earlier + rows)
    results = []
    for task in result_tasks:
        t0 = time.perf_counter()
        got, failed = _run_task(task, ctx)
        if failed:  # the task's table says so ("not run", with the error), and the run goes on
            got = [dict(file=f"{task.name}.json", title=task.name, baseline=None, compile=None,
                        rows=[dict(contender=task.name, error=f"the task failed: {failed}")])]
        for res in got:
            flags.flag_result(res)
            (out / res["file"]).parent.mkdir(parents=True, exist_ok=True)
            (out / res["file"]).write_text(json.dumps(res, indent=1))
        results += got
        done(f"[{next(step)}/{steps}] {task.name}: " + ("; ".join(
            f"{sum('ms' in r for r in res['rows'])} of {len(res['rows'])} contenders" for res in got) or "skipped"),
            time.perf_counter() - t0)
    if hasattr(os, "getloadavg"):
        load.append(os.getloadavg()[0])
    facts.update(load_average=load, cpu_count=os.cpu_count(), seconds=round(time.perf_counter() - started, 1),
                 cpu_seconds=round(_cpu_seconds(), 1))
    report.write(earlier + rows, facts, copy_gbs, out)
    if args.child:
        return 0
    say("writing the summary and the plot")
    report.finish(out)
    _clear_progress()
    if args.details:
        print((out / "tables.txt").read_text())
    print((out / "summary.txt").read_text(), end="")
    print("Files: summary.txt (this), tables.txt (every row), results.json/.csv (every number), results.png")
    print(f"Results in {out.resolve()}/ ({time.perf_counter() - started:.0f} s)")
    return 0


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
    p_bench = sub.add_parser("bench", help="check and time the ops against eager, torch.compile and the RL libraries' "
                                           "code on RLHF-shaped batches (~2 minutes on 2 cores; --full: the long run)")
    p_bench.add_argument("--full", action="store_true",
                         help="the long run: medium and large, both allocators, 30 rounds, the log-prob tasks at "
                              "N = 2048 each contender in its own process, every registered task (~15 min on 2 cores)")
    p_bench.add_argument("--quick", action="store_true", help="small and medium sizes, 3 rounds (a smoke run)")
    p_bench.add_argument("--tasks", nargs="+", metavar="TASK", help="only these tasks (kl-kernels bench --list)")
    p_bench.add_argument("--list", action="store_true", help="list the tasks and exit")
    p_bench.add_argument("--sizes", nargs="+", metavar="SIZE",
                         help="tiny, small, medium (B=256, 100..1000 tokens), large (B=1024, 256..4096); "
                              "default: medium (--full: medium large)")
    p_bench.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32")
    p_bench.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    p_bench.add_argument("--no-compile", action="store_true", help="skip the torch.compile contenders")
    p_bench.add_argument("--seed", type=int, default=0)
    p_bench.add_argument("--malloc", choices=["both", "default", "tuned"], default=None,
                         help="allocator settings to time the table tasks under: glibc's default (freed temporaries "
                              "unmapped and re-faulted, what a user's process has), tuned (mmap threshold 32 MiB, no "
                              "trimming), or both, the default first (default: default; --full: both)")
    p_bench.add_argument("--system-malloc", action="store_true", help="the same as --malloc default")
    p_bench.add_argument("--out", default="kl_kernels_bench",
                         help="folder for the results: summary.txt, tables.txt, results.json/.csv/.png, ...")
    p_bench.add_argument("--details", action="store_true",
                         help="also print every table (every contender, every column, p10-p90 spreads)")
    p_bench.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # the default-allocator run
    p_bench.add_argument("--no-token-logprobs", action="store_true",
                         help="skip the token_logprobs and hidden_states tasks (the same as leaving them out of "
                              "--tasks)")
    p_bench.set_defaults(func=cmd_bench)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
