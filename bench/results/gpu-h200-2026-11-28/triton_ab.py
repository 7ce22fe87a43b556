"""Scratch (not committed): Triton row forwards, variants side by side on one GPU.
v0 = cdaf5eb (two-pass), v1 = b764057 (one-pass, per-step block sums), v2 = the tree (lane sums), v2 at BLOCK 2048."""
import importlib, json, shutil, statistics, sys, time
from pathlib import Path
from unittest import mock
import torch
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
here = REPO / "kl_kernels" / "triton"
for f in (REPO / ".scratch").glob("_ab_*.py"):
    shutil.copy(f, here / f.name)
from kl_kernels.token_logprobs import launch_triton as tlp
from kl_kernels.full_kl import launch_triton as fk
dev = torch.device(sys.argv[1] if len(sys.argv) > 1 else "cuda")
N, V, REPS = (8192, 131072, 20) if dev.type == "cuda" else (4, 20000, 2)
def mods(tag):
    if tag == "v2":
        return importlib.import_module("kl_kernels.triton.token_logprobs"), importlib.import_module("kl_kernels.triton.full_kl")
    return (importlib.import_module(f"kl_kernels.triton._ab_{tag}_token_logprobs"),
            importlib.import_module(f"kl_kernels.triton._ab_{tag}_full_kl"))
variants = [("v0", 1024), ("v1", 1024), ("v2", 1024), ("v2", 2048)]
def timed(call):
    if dev.type != "cuda":
        t = time.perf_counter(); out = call(); return (time.perf_counter() - t) * 1e3, out
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record(); out = call(); b.record(); torch.cuda.synchronize(); return a.elapsed_time(b), out
rows = []
for dtype in (torch.bfloat16, torch.float32):
    g = torch.Generator(device=dev).manual_seed(0)
    x = (torch.randn(N, V, generator=g, device=dev) * 3).to(dtype)
    r = (torch.randn(N, V, generator=g, device=dev) * 3).to(dtype)
    labels = torch.arange(N, device=dev) * 7919 % V
    counted = torch.ones(N, dtype=torch.bool, device=dev)
    times, outs = {}, {}
    for rep in range(-1, REPS):
        for tag, block in variants:
            k_t, k_f = mods(tag)
            for op, launcher, mod, call in (
                    ("token_logprobs", tlp, k_t, lambda: tlp.forward(x, labels, counted, 0.7, True)[:2]),
                    ("full_kl", fk, k_f, lambda: fk.forward(x, r, counted, 0.7)[:1])):
                kern = (getattr(mod, f"{op}_fwd_kernel"), getattr(mod, f"{op}_bwd_kernel"))
                with mock.patch.object(launcher, "_kernels", lambda k=kern: k), mock.patch.object(launcher, "BLOCK", block):
                    ms, out = timed(call)
                if rep >= 0:
                    times.setdefault((tag, block, op), []).append(ms)
                outs[tag, block, op] = out
    for (tag, block, op), ts in times.items():
        ref = outs["v0", 1024, op]
        diff = max(((a - b).abs() / (1 + b.abs())).max().item() for a, b in zip(outs[tag, block, op], ref))
        rows.append(dict(dtype=str(dtype), variant=tag, block=block, op=op, best=min(ts), median=statistics.median(ts), diff=diff))
        print(f"{str(dtype):16} {op:15} {tag} BLOCK={block}: best {min(ts):.3f} ms median {statistics.median(ts):.3f} ms  rel diff vs v0 {diff:.2g}", flush=True)
    del x, r
print("JSON", json.dumps(rows))
for f in here.glob("_ab_*.py"):
    f.unlink()
