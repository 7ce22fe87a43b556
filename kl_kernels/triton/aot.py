"""Compile the Triton kernels for a real NVIDIA GPU on a machine without one, and read the binaries.

``python -m kl_kernels.triton.aot --arch 80 --arch 90 [--json FILE] [--table]`` runs one child
process per architecture (without ``TRITON_INTERPRET``, with a fresh ``TRITON_CACHE_DIR`` so
nothing cached can hide a failure). The child replaces Triton's active driver by a stub that
reports ``GPUTarget("cuda", arch, 32)``, makes ``JITFunction.run`` compile without launching
and the autotuner compile every config instead of benchmarking, then calls the project's own
launchers (``kl_kernels.<op>.launch_triton.forward/backward``) on small CPU tensors, so each
kernel is compiled with the signature, alignment attributes and constexprs a real call produces.
For each compiled kernel it reports ``cuobjdump -res-usage`` (registers, stack, local memory,
static shared memory), the kernel's dynamic shared memory, the PTX global-load widths (``ld.global``,
read from the PTX in memory) and, for the kernels asked for (all by default), the SASS global-load
widths (``cuobjdump -sass``: ~0.8 s of CPU per kernel, most of a compile's cost here, so the test gate
disassembles only the kernels whose load widths it checks); ptxas and cuobjdump are the ones shipped
in the Triton wheel.

Coverage: every autotune config for fp32 and bf16 inputs, packed and padded, forward and
backward of both ops, plus the combine kernels and the loss's totals kernel; the row kernels of
token_logprobs and full_kl (fp32 and bf16 rows 16-byte aligned, bf16 rows at an odd V), every variant, and their softcap=
specializations on aligned rows (cases "<dtype>-rows-softcap").

The row kernels' main loops (issue 48): ``python -m kl_kernels.triton.aot --ops token_logprobs,full_kl
--rows`` prints, for each, the instructions and loaded bits per iteration of its pass(es) over a row
(``row_passes``, with ``kl_kernels/bench/sass.py``), instructions per entry and the issue-rate time they
predict at N = 8192, V = 131,072 on an H200 (``row_table``; bench/results/triton-row-loops-sass-2026-11-28
has the before/after tables); tests/test_triton_static.py holds them to a budget.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

H100_REGS_PER_SM = 65536
H100_MAX_THREADS_PER_SM = 2048


def _tool(name: str) -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def res_usage(cubin_path: str) -> dict:
    out = subprocess.run([_tool("cuobjdump"), "-res-usage", cubin_path], capture_output=True, text=True,
                         check=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", out)
    if not m:
        raise RuntimeError(f"no resource usage in cuobjdump output: {out[:500]}")
    return dict(regs=int(m.group(1)), stack=int(m.group(2)), static_smem=int(m.group(3)), local=int(m.group(4)))


def disassemble(cubin_path: str) -> str:
    """``cuobjdump -sass`` of a cubin (~0.8 s of CPU per kernel)."""
    return subprocess.run([_tool("cuobjdump"), "-sass", cubin_path], capture_output=True, text=True,
                          check=True).stdout


def global_loads(sass: str) -> dict:
    """Count of SASS global loads by width in bits (LDG.E.128 -> 128; no width suffix -> 32)."""
    counts: dict[str, int] = {}
    for op in re.findall(r"\bLDG\.E((?:\.[A-Z0-9_]+)*)", sass):
        width = next((w for w in ("128", "64", "U16", "S16", "U8", "S8") if f".{w}" in op), "32")
        counts[width] = counts.get(width, 0) + 1
    return counts


def ptx_global_loads(ptx: str) -> dict:
    """Count of PTX global loads by width in bits (``ld.global.v4.b32`` -> 128, ``ld.global.b16`` -> 16),
    keyed as ``global_loads`` keys SASS widths ("128", "64", "32", then "16"/"8")."""
    counts: dict[str, int] = {}
    for op in re.findall(r"\bld\.global((?:\.[\w:]+)*)", ptx):
        parts = op.split(".")
        vec = next((int(p[1:]) for p in parts if re.fullmatch(r"v\d", p)), 1)
        bits = next((int(p[1:]) for p in reversed(parts) if re.fullmatch(r"[bsuf]\d+", p)), 32)
        width = str(vec * bits)
        counts[width] = counts.get(width, 0) + 1
    return counts


# The row kernels: (rows read side by side: full_kl reads the policy's and the reference's, passes over a row:
# full_kl's forward reads its rows twice, a max pass then a sums pass)
ROW_KERNELS = {"token_logprobs_fwd_kernel": (1, 1), "token_logprobs_bwd_kernel": (1, 1), "full_kl_fwd_kernel": (2, 2),
               "full_kl_bwd_kernel": (2, 1)}
LANE_INSTRUCTIONS_PER_S = 132 * 128 * 1.98e9  # an H200's FP32 issue rate (SMs x lanes x clock): 33.5e12


def row_passes(sass_text: str, entry_bits: int, streams: int, passes: int) -> dict | None:
    """A row kernel's ``passes`` passes over its row in SASS: its main loop (``bench.sass.main_loop``), then the
    main loop of what is left outside it, and so on, each with its instructions and global-load bits per iteration
    and instructions per entry (``Loop.per_entry``: an entry is one vocabulary position, ``streams`` rows read
    side by side); ``per_entry`` is their sum: what one entry costs a call. A loop the compiler unrolled keeps
    a remainder loop (fewer loads per iteration, at most unroll - 1 iterations), which is not a pass: so the
    count is given, not found. None if the kernel has no loop that loads."""
    from ..bench import sass

    (instrs,) = sass.functions(sass_text).values()
    found = []
    while len(found) < passes and (lp := sass.main_loop(instrs)) is not None:
        found.append(dict(instructions=lp.instructions, load_bits=lp.load_bits,
                          per_entry=round(lp.per_entry(entry_bits, streams), 2), ops=dict(lp.ops.most_common())))
        instrs = [i for i in instrs if not lp.start <= i.addr <= lp.end]
    if not found:
        return None
    return dict(entry_bits=entry_bits, streams=streams, passes=found,
                per_entry=round(sum(p["per_entry"] for p in found), 2))


def blocks_per_sm(regs: int, num_warps: int) -> int:
    """H100 blocks per SM allowed by registers (allocation granularity 256 per warp) and threads."""
    per_warp = -(-max(regs, 1) * 32 // 256) * 256
    by_regs = H100_REGS_PER_SM // (per_warp * num_warps)
    return min(by_regs, H100_MAX_THREADS_PER_SM // (32 * num_warps), 32)


# --------------------------------------------------------------------------- the child process


def _child(arch: int, out_dir: str, sass_kernels: frozenset | None = None, ops: frozenset | None = None) -> list[dict]:
    assert os.environ.get("TRITON_INTERPRET", "0") in ("", "0"), "the compile child runs without TRITON_INTERPRET"
    import torch
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import JITFunction

    class StubDriver:
        def get_current_target(self):
            return GPUTarget("cuda", arch, 32)

        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def get_active_torch_device(self):
            return torch.device("cpu")

    driver.set_active(StubDriver())
    records: list[dict] = []
    case = {"name": ""}
    original_run = JITFunction.run

    def compile_only(self, *args, grid, warmup, **kwargs):
        k = original_run(self, *args, grid=grid, warmup=True, **kwargs)
        path = os.path.join(out_dir, f"{self.__name__}_{arch}_{k.hash[:16]}.cubin")
        with open(path, "wb") as f:
            f.write(k.asm["cubin"])
        sass_text = disassemble(path) if sass_kernels is None or self.__name__ in sass_kernels else None
        row = ROW_KERNELS.get(self.__name__)
        entry_bits = 32 if case["name"].startswith("float32") else 16
        flags = ",".join(sorted(n for n, v in kwargs.items() if n.isupper() and v is True))
        records.append(dict(kernel=self.__name__, arch=arch, case=case["name"], flags=flags,
                            BLOCK=kwargs.get("BLOCK"),
                            num_warps=k.metadata.num_warps, dyn_smem=k.metadata.shared, cubin=path,
                            **res_usage(path), ptx_loads=ptx_global_loads(k.asm["ptx"]),
                            loads=None if sass_text is None else global_loads(sass_text),
                            row_loop=None if sass_text is None or row is None
                            else row_passes(sass_text, entry_bits, *row)))
        return k

    def every_config(self, *args, **kwargs):
        kwargs = {k: v for k, v in kwargs.items() if k not in ("grid", "warmup")}
        self.nargs = dict(zip(self.arg_names, args))
        for cfg in self.prune_configs(kwargs):  # the configs a real call of these arguments tunes over
            self.fn.run(*args, grid=None, warmup=True, **kwargs, **cfg.all_kwargs())
        self.best_config = self.configs[0]

    JITFunction.run = compile_only
    Autotuner.run = every_config

    g = torch.Generator().manual_seed(0)
    if ops is None or "tiles" in ops:
        _tiles(g, case)
    if ops is None or "token_logprobs" in ops:
        _token_logprobs(g, case)
    if ops is None or "full_kl" in ops:
        _full_kl(g, case)
    return records


def _tiles(g, case):
    """kl_reward and kl_penalty_loss: the tile kernels, the combines and the loss's totals kernel."""
    import torch

    from kl_kernels.kl_penalty import launch_triton as P
    from kl_kernels.kl_reward import launch_triton as R

    lens = [700, 0, 1500, 3, 2100]
    B = len(lens)
    inf = float("inf")
    for dtype in (torch.float32, torch.bfloat16):
        for layout in ("packed", "padded"):
            case["name"] = f"{str(dtype)[6:]}-{layout}"
            if layout == "packed":
                shape = (sum(lens),)
                offsets = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
                lengths = None
            else:
                shape = (B, max(lens))
                offsets, lengths = None, torch.tensor(lens)
            mk = lambda dt=dtype: torch.randn(shape, generator=g).to(dt)  # noqa: E731
            lay = 0 if layout == "packed" else 1
            mask = torch.rand(shape, generator=g) > 0.2
            coef = torch.rand(B, generator=g)
            clamp = (-10.0, 10.0, -inf, 5.0)
            R.forward(mk(), mk(), mask, offsets, lengths, None, mk(), coef, 0.1, lay, True, 1, 3, False, clamp, True,
                      dtype)
            R.backward(mk(), mk(), mask, offsets, lengths, None, coef, 0.1, lay, True, 3, True, clamp, dtype, mk(),
                       mk(), mk(), torch.randn(B))
            _, _, _, _, grad = P.forward(mk(), mk(), mk(), mk(torch.float32), mk(torch.float32), mask, offsets,
                                         lengths, coef, 0.05, False, lay, True, 3, False, 0.8, 1.2, 0.01, False)
            # the heaviest variant too: per-token weights on both terms and dual clip (kl_penalty_loss options)
            case["name"] = f"{str(dtype)[6:]}-{layout}-weights"
            P.forward(mk(), mk(), mk(), mk(torch.float32), mk(torch.float32), mask, offsets, lengths, coef, 0.05, False,
                      lay, True, 3, False, 0.8, 1.2, 0.01, False, mk(torch.float32), 3.0, True,
                      [-20.0, 20.0, -10.0, 10.0])
            # the aggregation on the device: the totals kernel and the backward reading the loss's gradient
            case["name"] = f"{str(dtype)[6:]}-{layout}-aggregated"
            args = (mk(), mk(), mk(), mk(torch.float32), mk(torch.float32), mask, offsets, lengths, coef, 0.05, False,
                    lay, True, 3, False, 0.8, 1.2, 0.01, False)
            _, _, _, weight, grad_a, _, _, back, _ = P.forward_aggregated(args, 1.0, True, True, None, 0.0, 0.01)
            P.backward_aggregated(back, grad_a, weight, torch.ones(()), dtype, True, torch.float32)
            case["name"] = f"{str(dtype)[6:]}-{layout}"
            P.backward(grad, torch.randn(B), None, mask, offsets, lengths, lay, True, dtype, True, torch.float32,
                       0.01)


def _token_logprobs(g, case):
    """token_logprobs: one program per row of the logits, with and without the entropy."""
    import torch

    from kl_kernels.token_logprobs import launch_triton as T

    for dtype, vocab in ((torch.float32, 4096), (torch.bfloat16, 4096), (torch.bfloat16, 3001)):
        # rows 16-byte aligned, as at any V % 16 == 0; and an odd V (rows at any 2-byte boundary: scalar loads)
        case["name"] = f"{str(dtype)[6:]}-rows" + ("" if vocab % 16 == 0 else "-unaligned")
        logits = torch.randn(6, vocab, generator=g).to(dtype)
        labels, counted = torch.randint(0, vocab, (6,), generator=g), torch.rand(6, generator=g) > 0.2
        for entropy in (False, True):
            _, ent, lse = T.forward(logits, labels, counted, 0.7, entropy)
            T.backward(torch.randn(6), torch.randn(6) if entropy else None, logits, labels, counted, 0.7, lse, ent,
                       torch.empty_like(logits))
            if vocab % 16 == 0:  # softcap= (the SOFTCAP specialization), on aligned rows: "<dtype>-rows-softcap"
                name, case["name"] = case["name"], case["name"] + "-softcap"
                _, ent, lse = T.forward(logits, labels, counted, 0.7, entropy, 30.0)
                T.backward(torch.randn(6), torch.randn(6) if entropy else None, logits, labels, counted, 0.7, lse,
                           ent, torch.empty_like(logits), 30.0)
                case["name"] = name


def _full_kl(g, case):
    """full_kl: one program per row of both models' logits, gradients to one side or both."""
    import torch

    from kl_kernels.full_kl import launch_triton as F

    for dtype, vocab in ((torch.float32, 4096), (torch.bfloat16, 4096), (torch.bfloat16, 3001)):
        case["name"] = f"{str(dtype)[6:]}-rows" + ("" if vocab % 16 == 0 else "-unaligned")
        logits, ref = torch.randn(6, vocab, generator=g).to(dtype), torch.randn(6, vocab, generator=g).to(dtype)
        counted = torch.rand(6, generator=g) > 0.2
        kl, lse, ref_lse = F.forward(logits, ref, counted, 0.7)
        for want_ref in (False, True):
            F.backward(torch.randn(6), logits, ref, counted, 0.7, kl, lse, ref_lse, torch.empty_like(logits),
                       torch.empty_like(ref) if want_ref else None)
        if vocab % 16 == 0:  # softcap= (the SOFTCAP specialization), on aligned rows: "<dtype>-rows-softcap"
            name, case["name"] = case["name"], case["name"] + "-softcap"
            kl, lse, ref_lse = F.forward(logits, ref, counted, 0.7, 30.0)
            for want_ref in (False, True):
                F.backward(torch.randn(6), logits, ref, counted, 0.7, kl, lse, ref_lse, torch.empty_like(logits),
                           torch.empty_like(ref) if want_ref else None, 30.0)
            case["name"] = name


# --------------------------------------------------------------------------- the parent


def compile_all(arches=(80, 90), out_dir: str | None = None, sass_kernels=None, ops=None) -> list[dict]:
    """Compile in one child process per architecture (in parallel); returns the records. SASS load
    widths (``loads``) and, for the row kernels, their passes (``row_loop``, ``row_passes``) for the kernels
    named in ``sass_kernels`` (None: every kernel), else None. ``ops``: some of "tiles" (kl_reward and
    kl_penalty_loss), "token_logprobs", "full_kl" (None: all)."""
    out_dir = out_dir or tempfile.mkdtemp(prefix="kl_triton_aot_")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    procs = []
    for arch in arches:
        d = os.path.join(out_dir, f"sm{arch}")
        os.makedirs(d, exist_ok=True)
        e = dict(env, TRITON_CACHE_DIR=os.path.join(d, "cache"))
        only = [] if sass_kernels is None else ["--sass-only", ",".join(sorted(sass_kernels))]
        only += [] if ops is None else ["--ops", ",".join(sorted(ops))]
        procs.append((arch, d, subprocess.Popen([sys.executable, "-m", "kl_kernels.triton.aot", "--child", str(arch),
                                                 d, *only], env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                                text=True)))
    records = []
    for arch, d, p in procs:
        out, err = p.communicate()
        if p.returncode:
            raise RuntimeError(f"compiling for sm_{arch} failed:\n{err[-4000:]}")
        with open(os.path.join(d, "records.json")) as f:
            records += json.load(f)
    return records


def _wide(r: dict) -> str:
    if r.get("loads") is not None:
        return "yes" if r["loads"].get("128") else "no"
    return ("yes" if r["ptx_loads"].get("128") else "no") + " (PTX)"


def table(records: list[dict]) -> str:
    rows = {}
    for r in records:
        key = (r["kernel"], r["arch"], r["BLOCK"], r["num_warps"], r["case"].split("-")[0])
        prev = rows.get(key)
        if prev is None or r["regs"] > prev["regs"] or r["local"] > prev["local"]:
            rows[key] = r
    lines = ["| kernel | sm | BLOCK | warps | dtype | regs (max over layouts) | local/spill bytes | smem bytes "
             "| 128-bit LDG | H100 blocks/SM (regs) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for key in sorted(rows, key=lambda k: (k[0], k[1], k[2] or 0, k[3], k[4])):
        r = rows[key]
        lines.append(f"| {r['kernel']} | {r['arch']} | {r['BLOCK'] or '-'} | {r['num_warps']} | {key[4]} | {r['regs']} "
                     f"| {r['local'] + r['stack']} | {r['dyn_smem'] + r['static_smem']} "
                     f"| {_wide(r)} | {blocks_per_sm(r['regs'], r['num_warps'])} |")
    return "\n".join(lines)


# the row kernels' model (bench/results/gpu-h200-2026-11-28): N x V entries, time >= max(bytes at copy speed,
# instructions per entry x entries / LANE_INSTRUCTIONS_PER_S); a bf16 read of the logits at copy speed, 0.51 ms
MODEL_N, MODEL_V, READ_FLOOR_MS = 8192, 131072, 0.51


def row_table(records: list[dict]) -> str:
    """The row kernels' main loops: instructions per iteration and per entry (each pass), and the issue-rate time
    they predict at N = 8192, V = 131,072 against the 0.51 ms a bf16 read of the logits takes at copy speed."""
    lines = [f"Instruction floor at N = {MODEL_N}, V = {MODEL_V:,}: instr/entry x N x V / "
             f"{LANE_INSTRUCTIONS_PER_S:.3g} lane-instructions/s; a bf16 read of one logits tensor at copy speed: "
             f"{READ_FLOOR_MS} ms.", "",
             "| kernel | flags | sm | dtype | BLOCK x warps | regs | instructions / loaded bits per iteration "
             "(each pass) | instr/entry | predicted ms |", "|---|---|---|---|---|---|---|---|---|"]
    seen = set()
    for r in sorted((r for r in records if r.get("row_loop")),
                    key=lambda r: (r["kernel"], r["flags"], r["arch"], r["case"])):
        key = (r["kernel"], r["flags"], r["arch"], r["case"], r["BLOCK"], r["num_warps"])
        if key in seen:
            continue
        seen.add(key)
        lp = r["row_loop"]
        passes = " + ".join(f"{p['instructions']} / {p['load_bits']}" for p in lp["passes"])
        ms = lp["per_entry"] * MODEL_N * MODEL_V / LANE_INSTRUCTIONS_PER_S * 1e3
        dtype = r["case"].split("-")[0] + (" (odd V)" if r["case"].endswith("unaligned") else "")
        lines.append(f"| {r['kernel']} | {r['flags'] or '-'} | {r['arch']} | {dtype} "
                     f"| {r['BLOCK']} x {r['num_warps']} | {r['regs']} | {passes} | {lp['per_entry']:.2f} | {ms:.2f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--child", nargs=2, metavar=("ARCH", "DIR"), help=argparse.SUPPRESS)
    ap.add_argument("--sass-only", help=argparse.SUPPRESS)
    ap.add_argument("--ops", help='comma-separated: "tiles", "token_logprobs", "full_kl" (default: all)')
    ap.add_argument("--rows", action="store_true", help="print the row kernels' main-loop table")
    ap.add_argument("--arch", type=int, action="append")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    if args.child:
        arch, d = int(args.child[0]), args.child[1]
        recs = _child(arch, d, frozenset(args.sass_only.split(",")) if args.sass_only else None,
                      frozenset(args.ops.split(",")) if args.ops else None)
        with open(os.path.join(d, "records.json"), "w") as f:
            json.dump(recs, f)
        return 0
    recs = compile_all(tuple(args.arch or (80, 90)), ops=frozenset(args.ops.split(",")) if args.ops else None)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(recs, f, indent=1)
    print(row_table(recs) if args.rows else table(recs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
