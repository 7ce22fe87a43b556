"""Per-call cost of eager calls, this tree against another revision (issue 49 items 1 and 4).

Times the calls a training loop makes, at the bench's sizes (``batches.py``: tiny B = 8, medium B = 256,
large B = 1024): ``kl_reward`` as verl calls it (padded ``[B, T]`` with a response mask, k1, the score on the
last token; and the same batch packed) and the loss forward + backward as verl's actor step (PPO clip 0.2,
dual clip 3.0, k3 to the reference, token-mean; padded with lengths, and packed). Per row: the median and
the minimum of the per-call wall time (us), the Python-level calls of one call (``sys.setprofile`` ``call``
+ ``c_call`` events, after warm-up), and for ``kl_reward(..., out=...)`` the minor page faults per call
(``resource.getrusage``; glibc's default allocator: nothing here tunes it).

Two revisions cannot share a process (one ``kl_kernels``), so each round runs one worker process per
revision, alternating (``--rounds``), and each figure is the best round's: the machine is shared and noisy,
and alternating keeps both revisions under the same load. ``--base`` is another checkout of the package
(built in place), e.g. ``git worktree add ../base d51469c`` and its ``_C`` built or copied.

Run: ``python -m kl_kernels.bench.per_call --base /path/to/base [--sizes tiny medium large] [--rounds 3]
[--threads 1]``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve()
TREE = HERE.parents[2]
CALLS = {"tiny": 300, "small": 100, "medium": 60, "large": 12}


def _worker(sizes: list[str], threads: int | None = None) -> dict:
    """Run in a worker process (``kl_kernels`` is whichever tree ``PYTHONPATH`` names)."""
    import resource
    import statistics
    import time

    import torch

    if threads:
        torch.set_num_threads(threads)

    import kl_kernels
    from kl_kernels import kl_penalty_loss, kl_reward
    from kl_kernels.bench.batches import SIZES, make_batch

    def count(f) -> int:
        events = []

        def profile(frame, event, arg):
            if event in ("call", "c_call"):
                events.append(1)
        sys.setprofile(profile)
        try:
            f()
        finally:
            sys.setprofile(None)
        return len(events) - 1  # (the c_call of sys.setprofile itself)

    def timed(f, n):
        for _ in range(3):
            f()
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            f()
            times.append(time.perf_counter() - t0)
        return statistics.median(times) * 1e6, min(times) * 1e6

    rows = {}
    for size in sizes:
        b = make_batch(SIZES[size])
        n = CALLS[size]
        width = b.lp_padded.shape[1]
        g = torch.Generator().manual_seed(1)
        old = b.lp + 0.05 * torch.randn(b.lp.shape[0], generator=g)
        adv = torch.randn(b.lp.shape[0], generator=g)
        pad = lambda x, v=0.0: kl_kernels.ragged.to_padded(x, b.offsets, padding_side="left", width=width,  # noqa
                                                           padding_value=v)
        old_p, adv_p = pad(old), pad(adv)
        lp_leaf, lp_leaf_p = b.lp.clone().requires_grad_(), b.lp_padded.clone().requires_grad_()
        cases = {
            "kl_reward padded (verl)": lambda: kl_reward(b.lp_padded, b.ref_padded, b.score, coef=0.05, estimator="k1",
                                                         mask=b.mask_padded, reward_placement="last"),
            "kl_reward packed": lambda: kl_reward(b.lp, b.ref, b.score, coef=0.05, estimator="k1", mask=b.mask,
                                                  offsets=b.offsets, reward_placement="last"),
            "loss fwd+bwd padded": lambda: kl_penalty_loss(
                lp_leaf_p, old_p, adv_p, ref_log_probs=b.ref_padded, beta=0.05, estimator="k3", mask=b.mask_padded,
                clip_epsilon=0.2, dual_clip=3.0, lengths=b.lengths, padding_side="left").loss.backward(),
            "loss fwd+bwd packed": lambda: kl_penalty_loss(
                lp_leaf, old, adv, ref_log_probs=b.ref, beta=0.05, estimator="k3", mask=b.mask, clip_epsilon=0.2,
                dual_clip=3.0, offsets=b.offsets).loss.backward(),
        }
        first = kl_reward(b.lp_padded, b.ref_padded, b.score, coef=0.05, mask=b.mask_padded, reward_placement="last")
        buffers = tuple(None if t is None else torch.empty_like(t) for t in first)
        cases["kl_reward padded out="] = lambda: kl_reward(b.lp_padded, b.ref_padded, b.score, coef=0.05,
                                                           mask=b.mask_padded, reward_placement="last", out=buffers)
        host_only = set()
        if size == "tiny":
            # Inside torch.compile (issue 49 item 3: the ops' host cost within a compiled graph: the op's
            # dispatch and its launcher, no call plan of api.py there), and the CUDA kernels' eager host path
            # through their host emulation: the same Python as on a GPU, so its call count is the GPU's (its
            # time is the emulated kernels': not reported).
            reward_c = torch.compile(lambda: kl_reward(b.lp_padded, b.ref_padded, b.score, coef=0.05, estimator="k1",
                                                       mask=b.mask_padded, reward_placement="last").reward)
            loss_c = torch.compile(lambda lp: kl_penalty_loss(
                lp, old_p, adv_p, ref_log_probs=b.ref_padded, beta=0.05, estimator="k3", mask=b.mask_padded,
                clip_epsilon=0.2, dual_clip=3.0, lengths=b.lengths, padding_side="left").loss)
            cases["kl_reward padded inside torch.compile"] = reward_c
            cases["loss fwd+bwd padded, torch.compile"] = lambda: loss_c(lp_leaf_p).backward()
            cases["kl_reward padded, CUDA host path (emulated)"] = lambda: kl_reward(
                b.lp_padded, b.ref_padded, b.score, coef=0.05, estimator="k1", mask=b.mask_padded,
                reward_placement="last", backend="cuda-emulated")
            cases["loss fwd+bwd padded, CUDA host path (emulated)"] = lambda: kl_penalty_loss(
                lp_leaf_p, old_p, adv_p, ref_log_probs=b.ref_padded, beta=0.05, estimator="k3", mask=b.mask_padded,
                clip_epsilon=0.2, dual_clip=3.0, lengths=b.lengths, padding_side="left",
                backend="cuda-emulated").loss.backward()
            host_only = {name for name in cases if name.endswith("(emulated)")}
        for name, f in cases.items():
            try:
                if name in host_only:
                    f(), f()
                    rows[f"{size} | {name}"] = {"python_calls": count(f)}
                    continue
                median, best = timed(f, n)
            except Exception as e:  # (e.g. a revision without the backend): the row says so
                rows[f"{size} | {name}"] = {"error": f"{type(e).__name__}: {str(e)[:120]}"}
                continue
            row = {"median_us": median, "min_us": best, "python_calls": count(f)}
            if name.endswith("out="):
                r0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                for _ in range(n):
                    f()
                row["faults_per_call"] = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - r0) / n
            rows[f"{size} | {name}"] = row
    return {"kl_kernels": kl_kernels.__file__, "rows": rows}


def _run(tree: Path, sizes: list[str], threads: int | None) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree))
    extra = ["--threads", str(threads)] if threads else []
    out = subprocess.run([sys.executable, str(HERE), "--worker", "--sizes", *sizes, *extra], env=env,
                         capture_output=True, text=True, check=True, cwd=str(tree))
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", type=Path, help="another checkout of the package (built in place)")
    p.add_argument("--sizes", nargs="+", default=["tiny", "medium", "large"], choices=sorted(CALLS))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads in the workers (default: torch's; 1 keeps a loaded machine's scheduler out of "
                        "the kernels' barriers)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        print(json.dumps(_worker(args.sizes, args.threads)))
        return 0
    trees = {"this tree": TREE}
    if args.base is not None:
        trees = {"base": args.base.resolve(), "this tree": TREE}
    best: dict = {}
    for _ in range(args.rounds):
        for label, tree in trees.items():  # alternating: both revisions under the same load
            got = _run(tree, args.sizes, args.threads)
            for row, v in got["rows"].items():
                have = best.setdefault(label, {}).setdefault(row, v)
                for k in ("median_us", "min_us", "faults_per_call"):
                    if k in v and k in have:
                        have[k] = min(have[k], v[k])
    labels = list(trees)
    print(f"# {sys.executable}; threads {args.threads or 'default'}; {args.rounds} alternating rounds, best round's median/min per call (us); "
          "calls: sys.setprofile call+c_call events of one call; faults: minor page faults per out= call")
    print("row | " + " | ".join(f"{lb} median / min us | {lb} calls" for lb in labels)
          + (" | this / base (median)" if len(labels) == 2 else ""))
    for row in best[labels[-1]]:
        cells = []
        for lb in labels:
            v = best[lb].get(row, {})
            faults = f", {v['faults_per_call']:.1f} faults" if "faults_per_call" in v else ""
            if "error" in v:
                cells.append(f"{v['error']} | -")
                continue
            cells.append(f"{v.get('median_us', float('nan')):.1f} / {v.get('min_us', float('nan')):.1f}{faults} | "
                         f"{v.get('python_calls', '-')}")
        ratio = ""
        if len(labels) == 2 and "median_us" in best["base"].get(row, {}) and "median_us" in best["this tree"][row]:
            ratio = f" | {best['this tree'][row]['median_us'] / best['base'][row]['median_us']:.2f}x"
        print(f"{row} | " + " | ".join(cells) + ratio)
    return 0


if __name__ == "__main__":
    sys.exit(main())
