"""A/B of the fused hidden-state kernels (issue 48 item 2, ``kl_kernels/token_logprobs/linear_fused.py``) against
eager and ``torch.compile`` of eager, side by side in one process: per-token log-probs and entropy from hidden
states ``[N, H]`` and an LM head ``[V, H]``, forward + backward (upstream gradients of a weighted sum, gradients
to both), time and peak extra memory, and each contender's gradients against a float32 computation (relative
Frobenius error), as the issue's acceptance line asks.

* ``fused``: ``FusedLinearTokenLogprobs.apply`` (the Triton forward, the backward's d z tiles and cuBLAS GEMMs);
* ``fused-cublas``: the same with ``RECOMPUTE = "cublas"`` (the backward's logits again by a cuBLAS GEMM into the
  d z buffer, in bf16, instead of on chip: which is faster is the question this answers);
* ``eager``: ``h @ W.T`` whole, ``log_softmax`` in float32, gather, entropy (as RL trainers write it; the issue's
  eager line);
* ``compile``: ``torch.compile`` of that;
* ``chunked``: ``kl_kernels.linear_token_logprobs`` as it is (its default chunk).

Times: ``measure_interleaved`` (contenders alternate in shuffled rounds), median and min of ``--repeats`` after
a warm-up. Peak extra: ``torch.cuda.max_memory_allocated`` during one step over what was allocated before it
(the inputs' gradients included). Errors: ``||g - g32|| / ||g32||`` for ``d hidden`` and ``d weight``, ``g32``
from the eager formula on the inputs converted to float32 (TF32 off).

Run on a GPU (the issue's case is the default)::

    python -m kl_kernels.bench.linear_fused_ab --json bench/results/<gpu>-<date>/linear_fused_ab.json

``--sizes N:H:V ...``, ``--dtype``, ``--contenders``, ``--repeats``, ``--no-check`` (skip the float32 reference:
it needs ~5 x N x V x 4 bytes). Without a GPU it runs on CPU tensors under Triton's interpreter at a tiny size
(a smoke test of the script, not a timing): ``python -m kl_kernels.bench.linear_fused_ab --sizes 64:32:200``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

ISSUE_SIZE = (8192, 4096, 128256)
CONTENDERS = ("fused", "fused-cublas", "eager", "compile", "chunked")
TEMPERATURE = 1.0


def _eager(hidden, weight, labels):
    z = (hidden @ weight.t()).float() / TEMPERATURE
    logp = torch.log_softmax(z, -1)
    lp = logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return lp, entropy


def _contender(name):
    """``fn(hidden, weight, labels) -> (log_probs, entropy)`` of a contender."""
    if name == "eager":
        return _eager
    if name == "compile":
        return torch.compile(_eager)
    if name in ("fused", "fused-cublas"):
        from kl_kernels.token_logprobs import linear_fused as F

        def fused(h, w, y):
            before = F.RECOMPUTE
            F.RECOMPUTE = "cublas" if name == "fused-cublas" else "triton"  # (read once, at the forward)
            try:
                lp, ent, _, _ = F.FusedLinearTokenLogprobs.apply(h, w, None, y, torch.ones_like(y, dtype=torch.bool),
                                                                 TEMPERATURE, True)
            finally:
                F.RECOMPUTE = before
            return lp, ent
        return fused
    if name == "chunked":
        from kl_kernels import linear_token_logprobs

        def chunked(h, w, y):
            out = linear_token_logprobs(h, w, y, temperature=TEMPERATURE, return_entropy=True)
            return out.log_probs, out.entropy
        return chunked
    raise ValueError(f"unknown contender {name!r} (one of {CONTENDERS})")


def _step(fn, hidden, weight, labels, up):
    h, w = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
    lp, ent = fn(h, w, labels)
    (lp.float() * up[0]).sum().add((ent.float() * up[1]).sum()).backward()
    return h.grad, w.grad


def _peak_mib(fn, hidden, weight, labels, up, device) -> float:
    if device.type != "cuda":
        return float("nan")
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    grads = _step(fn, hidden, weight, labels, up)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del grads
    return peak / 2**20


def _rel(g, ref) -> float:
    return float((g.float() - ref).norm() / ref.norm().clamp_min(1e-30))


def run(sizes, dtype_name, contenders, repeats, check, device):
    from .machine import describe
    from .timing import measure_interleaved

    dtype = getattr(torch, dtype_name)
    rows = []
    machine = describe(device)
    if device.type == "cuda":
        machine["gpu"] = torch.cuda.get_device_name(device)
    for n, hid, vocab in sizes:
        g = torch.Generator(device=device).manual_seed(0)
        hidden = torch.randn(n, hid, generator=g, device=device).to(dtype)
        weight = (torch.randn(vocab, hid, generator=g, device=device) / hid ** 0.5).to(dtype)
        labels = torch.randint(0, vocab, (n,), generator=g, device=device)
        up = (torch.randn(n, generator=g, device=device), torch.randn(n, generator=g, device=device))
        fns = {name: _contender(name) for name in contenders}
        ref = None
        if check:
            allow = torch.backends.cuda.matmul.allow_tf32
            torch.backends.cuda.matmul.allow_tf32 = False
            try:
                ref = _step(_eager, hidden.float(), weight.float(), labels, up)
            finally:
                torch.backends.cuda.matmul.allow_tf32 = allow
        errors = {}
        for name, fn in fns.items():  # also the warm-up (compiles, autotunes)
            gh, gw = _step(fn, hidden, weight, labels, up)
            if ref is not None:
                errors[name] = (_rel(gh, ref[0]), _rel(gw, ref[1]))
            del gh, gw
        ref = None
        peaks = {name: _peak_mib(fn, hidden, weight, labels, up, device) for name, fn in fns.items()}
        steps = [lambda fn=fn: _step(fn, hidden, weight, labels, up) for fn in fns.values()]
        timings = measure_interleaved(steps, device, warmup=1, repeats=repeats, budget_s=60.0)
        for (name, _), (t, _faults) in zip(fns.items(), timings):
            err = errors.get(name, (None, None))
            rows.append(dict(contender=name, task="logprobs", n=n, hidden=hid, vocab=vocab, dtype=dtype_name,
                             ms=t.median_ms, min_ms=t.min_ms, repeats=t.repeats, peak_extra_mib=peaks[name],
                             grad_rel_err_hidden=err[0], grad_rel_err_weight=err[1], device=str(device),
                             machine=machine))
    return rows


def table(rows) -> str:
    lines = ["| N | H | V | dtype | contender | ms (median) | ms (min) | x eager | peak extra MiB | d hidden err "
             "| d weight err |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    eager = {(r["n"], r["hidden"], r["vocab"]): r["ms"] for r in rows if r["contender"] == "eager"}
    for r in rows:
        e = eager.get((r["n"], r["hidden"], r["vocab"]))
        ratio = f"{r['ms'] / e:.2f}" if e else "-"
        fmt = (lambda v: "-" if v is None else f"{v:.2e}")
        lines.append(f"| {r['n']} | {r['hidden']} | {r['vocab']} | {r['dtype']} | {r['contender']} | {r['ms']:.2f} "
                     f"| {r['min_ms']:.2f} | {ratio} | {r['peak_extra_mib']:.0f} | {fmt(r['grad_rel_err_hidden'])} "
                     f"| {fmt(r['grad_rel_err_weight'])} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", nargs="*", default=None, help="N:H:V (default: the issue's 8192:4096:128256)")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    ap.add_argument("--contenders", nargs="*", default=list(CONTENDERS))
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--no-check", action="store_true", help="skip the float32 reference gradients")
    ap.add_argument("--json", default="linear_fused_ab.json")
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        # triton reads the switch when imported (importing kl_kernels did that already): start again with it
        os.execve(sys.executable, [sys.executable, "-m", "kl_kernels.bench.linear_fused_ab",
                                   *(sys.argv[1:] if argv is None else argv)], dict(os.environ, TRITON_INTERPRET="1"))
    sizes = [tuple(int(x) for x in s.split(":")) for s in args.sizes] if args.sizes else [ISSUE_SIZE]
    if device.type == "cpu":
        print("no GPU: CPU tensors under Triton's interpreter (a smoke run; the times mean nothing)", file=sys.stderr)
    rows = run(sizes, args.dtype, args.contenders, args.repeats, not args.no_check, device)
    print(table(rows))
    with open(args.json, "w") as f:
        json.dump(rows, f, indent=1)
    print(f"wrote {args.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
