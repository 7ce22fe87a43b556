"""A paper model of the CUDA kernels on an H100, derived from the compiled binaries.

No GPU runs in this project's CI, so the GPU figures are predicted, not measured. For every kernel of
``kl_kernels._cuda`` this reads the resources ptxas gave it (``cuobjdump --dump-resource-usage``:
registers, shared memory, local memory, stack) for every architecture it holds (the release list: sm_80,
sm_86, sm_89, sm_90, sm_100, sm_120), and derives:

* occupancy on each (e.g. an H100, sm_90: 64K registers, 2048 threads, 32 blocks and 228 KB of shared
  memory per SM; registers allocated per warp in units of 256; ``ARCH`` below has every target's limits);
* whether the SM can keep enough bytes in flight to saturate HBM (Little's law: ~3.0 TB/s x ~0.6 us
  of DRAM latency = ~1.8 MB in flight over 132 SMs, ~14 KB per SM; each thread has ``kPer`` = 8
  elements of each stream in flight per tile step);
* bytes moved per token and launches per call, per op and dtype, and from them the expected time and
  fraction of a same-bytes copy on the bench's medium and large batches (3.0 TB/s copy, 4 us per
  launch, ~0.2 us per dependent L2 round trip in the combine's walk over a long row's tiles).

``python -m kl_kernels.bench.gpu_model`` prints the page (``bench/gpu_model.md`` holds it, generated;
``tests/test_gpu_model.py`` regenerates it from the current build and requires it up to date).
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from . import sass

# Device facts per architecture, for every target of setup.py's release list (DEFAULT_CUDA_ARCHS, 80;86;89;90;
# 100;120; tests/test_gpu_model.py holds the two lists together). Per-SM limits as the CUDA toolkit's own
# occupancy calculator has them (include/cuda_occupancy.h: blocks per SM, shared memory per SM and per block,
# 256-register allocation units; 1 KB reserved per block) and the programming guide's resident threads per SM.
# name, sms and copy_tbs (a same-bytes copy's measured-class bandwidth) describe the part the time tables
# model: sm_90 only; the other rows give occupancy.
ARCH = {
    "sm_80": dict(name="A100 SXM", regs=65536, threads=2048, blocks=32, smem=167936, smem_block=166912, sms=108,
                  copy_tbs=1.7),
    "sm_86": dict(name="A10 / RTX 30 (GA10x)", regs=65536, threads=1536, blocks=16, smem=102400, smem_block=101376),
    "sm_89": dict(name="L40S / RTX 40 (AD10x)", regs=65536, threads=1536, blocks=24, smem=102400, smem_block=101376),
    "sm_90": dict(name="H100 SXM", regs=65536, threads=2048, blocks=32, smem=233472, smem_block=232448, sms=132,
                  copy_tbs=3.0),
    "sm_100": dict(name="B200", regs=65536, threads=2048, blocks=32, smem=233472, smem_block=232448),
    "sm_120": dict(name="RTX PRO 6000 / RTX 50 (GB20x)", regs=65536, threads=1536, blocks=24, smem=102400,
                   smem_block=101376),
}
LAUNCH_US = 4.0
L2_ROUND_TRIP_US = 0.2
BYTES_IN_FLIGHT_PER_SM = 14 * 1024  # ~3.0 TB/s x 0.6 us / 132 SMs

REPO = Path(__file__).resolve().parents[2]


def _tile_constants():
    text = (REPO / "csrc" / "cuda" / "tiles.cuh").read_text()
    threads = int(re.search(r"constexpr int kThreads = (\d+);", text).group(1))
    per = int(re.search(r"constexpr int kPer = (\d+);", text).group(1))
    return threads, per


def combine_chain(span: int) -> int:
    """Dependent steps of the forward's combine over a row's ``span`` later tiles
    (``combine_sequences``, csrc/cuda/tiles.cuh): one thread's walk up to ``kLongSpan`` tiles, else the
    block's strided partial sums (span / kThreads loads per thread) and its tree (log2 kThreads levels,
    shared memory: counted as a round trip each, an upper bound)."""
    text = (REPO / "csrc" / "cuda" / "tiles.cuh").read_text()
    long_span = int(re.search(r"constexpr int64_t kLongSpan = (\d+);", text).group(1))
    threads = _tile_constants()[0]
    if span <= long_span:
        return span
    return math.ceil(span / threads) + int(math.log2(threads))


def cuobjdump() -> str | None:
    try:
        import triton
        path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
        return str(path) if path.exists() else None
    except ImportError:
        return None


@dataclass
class Usage:
    arch: str
    kernel: str      # family: forward_tile, combine, ...
    variant: str     # the template arguments
    regs: int
    shared: int
    local: int
    stack: int


_FAMILY = re.compile(r"(penalty_forward_tile|penalty_combine|penalty_totals|penalty_backward_tile|forward_tile|combine|"
                     r"backward_tile|offsets_valid|lengths_valid|token_logprobs_forward_kernel|"
                     r"token_logprobs_backward_kernel|full_kl_forward_kernel|full_kl_backward_kernel|"
                     r"token_logprobs_softcap_forward_kernel|token_logprobs_softcap_backward_kernel|"
                     r"full_kl_softcap_forward_kernel|full_kl_softcap_backward_kernel)"
                     r"(I.*)?E")


def resource_usage(so_path: str, tool: str) -> list[Usage]:
    out = subprocess.run([tool, "--dump-resource-usage", so_path], capture_output=True, text=True, check=True).stdout
    usages, arch = [], None
    for line in out.splitlines():
        m = re.match(r"arch = (sm_\d+)", line.strip())
        if m:
            arch = m.group(1)
            continue
        m = re.match(r"\s*Function (\S+):", line)
        if m:
            name = m.group(1)
            continue
        m = re.match(r"\s*REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", line)
        if m and arch:
            fam = _FAMILY.search(name)
            if fam is None:
                continue  # the probe kernel
            usages.append(Usage(arch, fam.group(1), fam.group(2) or "", int(m.group(1)), int(m.group(3)),
                                int(m.group(4)), int(m.group(2))))
    return usages


_MEMORY_OP = re.compile(r"\b((?:LDG|STG|ATOMG|ATOMS|ATOM|RED|LDL|STL)(?:\.[A-Z0-9_]+)*)")


def sass_memory_ops(so_path: str, tool: str) -> dict[tuple[str, str, str], Counter]:
    """Global/local memory and atomic instructions of each kernel's SASS (``cuobjdump --dump-sass``), with
    how many of each it has: ``{(arch, family, variant): Counter({"LDG.E.128": 4, "STG.E": 1, ...})}``;
    width suffixes kept, cache hints (``.CONSTANT``, ``.EF``...) dropped, so ``LDG.E.128.CONSTANT`` counts
    as ``LDG.E.128``."""
    out = subprocess.run([tool, "--dump-sass", so_path], capture_output=True, text=True, check=True).stdout
    ops: dict[tuple[str, str, str], Counter] = {}
    arch, key = None, None
    for line in out.splitlines():
        m = re.search(r"arch = (sm_\d+)", line)
        if m:
            arch = m.group(1)
            continue
        m = re.search(r"Function : (\S+)", line)
        if m:
            fam = _FAMILY.search(m.group(1))
            key = (arch, fam.group(1), fam.group(2) or "") if fam else None
            if key is not None:
                ops.setdefault(key, Counter())
            continue
        if key is None:
            continue
        for op in _MEMORY_OP.findall(line):
            parts = op.split(".")
            keep = [parts[0]] + [q for q in parts[1:] if q in ("E", "64", "128", "U8", "S8", "U16", "S16", "ADD",
                                                                "F32", "F64", "STRONG")]
            ops[key][".".join(keep)] += 1
    return ops


def blocks_per_sm(regs: int, shared: int, threads: int, arch: str) -> tuple[int, str]:
    """Resident blocks per SM and the resource that limits them."""
    if arch not in ARCH:
        raise KeyError(f"gpu_model has no device facts for {arch}: add its limits to ARCH "
                       f"(include/cuda_occupancy.h of the CUDA toolkit)")
    d = ARCH[arch]
    warps = math.ceil(threads / 32)
    regs_per_warp = math.ceil(max(regs, 1) * 32 / 256) * 256
    by_regs = (d["regs"] // regs_per_warp) // warps
    by_threads = d["threads"] // threads
    by_smem = d["smem"] // (shared + 1024) if shared else d["blocks"]
    limits = {"threads": by_threads, "blocks": d["blocks"], "shared memory": by_smem, "registers": by_regs}
    limit = min(limits, key=limits.get)
    return limits[limit], limit


def bandwidth_efficiency(blocks: int, threads: int, streams: int, elem_bytes: int, per: int | None = None) -> float:
    """Fraction of a copy's bandwidth an SM can pull with ``blocks`` resident blocks: bytes in flight
    (threads x kPer elements x streams) against what Little's law asks per SM, capped at 1 (a
    streaming kernel with enough bytes in flight runs as fast as a copy)."""
    per = _tile_constants()[1] if per is None else per  # kPer, read from csrc/cuda/tiles.cuh
    in_flight = blocks * threads * per * streams * elem_bytes
    return min(1.0, in_flight / BYTES_IN_FLIGHT_PER_SM)


# Bytes per token moved by each kernel, per log-prob dtype size `e` (a per-token reward in the same
# dtype, a bool mask, return_ref off): reads then writes.
def traffic(e: int) -> dict:
    return {
        "kl_reward forward (forward_tile)": dict(read=2 * e + 1 + e, write=2 * e, streams=4,
                                                 note="lp, ref, mask, reward -> kl, reward_out"),
        "kl_reward backward (backward_tile)": dict(read=2 * e + 1 + 2 * e, write=2 * e, streams=5,
                                                   note="lp, ref, mask, g_kl, g_reward -> g_lp, g_ref"),
        "kl_penalty_loss forward (penalty_forward_tile)": dict(read=3 * e + 1, write=4, streams=4,
                                                               note="lp, old, ref, mask -> fp32 gradient buffer"),
        "kl_penalty_loss backward (penalty_backward_tile)": dict(read=4 + 1, write=e, streams=2,
                                                                 note="gradient buffer, mask -> g_lp"),
    }


KERNEL_OF = {
    "kl_reward forward (forward_tile)": "forward_tile",
    "kl_reward backward (backward_tile)": "backward_tile",
    "kl_penalty_loss forward (penalty_forward_tile)": "penalty_forward_tile",
    "kl_penalty_loss backward (penalty_backward_tile)": "penalty_backward_tile",
}
LAUNCHES = {"kl_reward forward (forward_tile)": 2, "kl_reward backward (backward_tile)": 1,
            # the loss: tile, combine and (eager calls, every aggregation but "none") the totals kernel
            "kl_penalty_loss forward (penalty_forward_tile)": 3, "kl_penalty_loss backward (penalty_backward_tile)": 1}


def _row_constants():
    text = (REPO / "csrc" / "cuda" / "rows.cuh").read_text()
    threads = int(re.search(r"constexpr int kRowThreads = (\d+);", text).group(1))
    vec = int(re.search(r"constexpr int kRowVec = (\d+);", text).group(1))
    return threads, vec


# The row kernels (token_logprobs, full_kl) at the size the GPU bench measures them (H200,
# bench/results/gpu-h200-2026-11-28): N = 8192 rows, V = 131,072, bf16 logits. Per row: (kernel family,
# rows of V read, each once, rows of V written).
ROW_SIZE = dict(rows=8192, vocab=131072, e=2)
ROW_KERNELS = {
    "token_logprobs forward": ("token_logprobs_forward_kernel", 1, 0),
    "token_logprobs backward": ("token_logprobs_backward_kernel", 1, 1),
    "full_kl forward": ("full_kl_forward_kernel", 2, 0),
    "full_kl backward (both gradients)": ("full_kl_backward_kernel", 2, 2),
}
# What an SM issues: 4 schedulers x 32 lanes a cycle (FP32 and integer instructions alike), and its SFU's
# 16 lanes a cycle (MUFU: the row kernels' exponentials), at an H100 SXM's boost clock.
ISSUE_LANES_PER_CYCLE = 128
SFU_LANES_PER_CYCLE = 16
CLOCK_GHZ = 1.98
ROW_DTYPE_CODE = {"bf16": "ILi1E", "fp32": "ILi0E"}  # the logits dtype as the kernels' template argument
# The soft-capped entry points (softcap=: c tanh(s x / c) / T per entry) walk the same rows as their uncapped
# kernels (the same template body, csrc/cuda/rows.cuh, with the cap as its argument): same streams, one tanh more
# per entry. The static gate holds their loops to budgets of their own; the page's time model is the uncapped one's.
ROW_SOFTCAP = {"token_logprobs_softcap_forward_kernel": "token_logprobs_forward_kernel",
               "token_logprobs_softcap_backward_kernel": "token_logprobs_backward_kernel",
               "full_kl_softcap_forward_kernel": "full_kl_forward_kernel",
               "full_kl_softcap_backward_kernel": "full_kl_backward_kernel"}


def row_loops(so_path: str, tool: str) -> dict[tuple[str, str, str], list[sass.Loop]]:
    """Each row kernel's innermost loading loops (``sass.inner_loading_loops``; its main loop is
    ``sass.pick_main`` of them): ``{(arch, family, variant): [Loop, ...]}``."""
    out = subprocess.run([tool, "--dump-sass", so_path], capture_output=True, text=True, check=True).stdout
    loops = {}
    for block in re.split(r"(?=\n\s*arch = sm_)", out):
        m = re.search(r"arch = (sm_\d+)", block)
        if not m:
            continue
        for name, instrs in sass.functions(block).items():
            fam = _FAMILY.search(name)
            if fam is None or fam.group(1) not in {k for k, _, _ in ROW_KERNELS.values()} | set(ROW_SOFTCAP):
                continue
            loops[(m.group(1), fam.group(1), fam.group(2) or "")] = sass.inner_loading_loops(instrs)
    return loops


def row_instructions_per_entry(loops: dict, arch: str, family: str, dtype: str, steady: bool = False) -> float | None:
    """The main loop's instructions per entry of `family` for logits of `dtype` ("bf16"/"fp32") on `arch`: the
    whole loop's, or (steady) its shortest path's (``sass.Loop.per_entry``); the most of the kernel's variants."""
    streams = next(st for k, st, _ in ROW_KERNELS.values() if k == ROW_SOFTCAP.get(family, family))
    code = ROW_DTYPE_CODE[dtype]
    found = [sass.pick_main(inner).per_entry(16 if dtype == "bf16" else 32, streams, steady)
             for (a, f, v), inner in loops.items() if a == arch and f == family and v.startswith(code) and inner]
    return max(found) if found else None


def row_kernel_lines(worst: dict, loops: dict) -> list[str]:
    """The row kernels' section of the page: bytes and instructions per call, and the predicted time against a
    same-bytes copy (sm_90)."""
    threads, vec = _row_constants()
    n, v, e = ROW_SIZE["rows"], ROW_SIZE["vocab"], ROW_SIZE["e"]
    issue = ARCH["sm_90"]["sms"] * ISSUE_LANES_PER_CYCLE * CLOCK_GHZ * 1e3  # lane-instructions per us
    sfu = ARCH["sm_90"]["sms"] * SFU_LANES_PER_CYCLE * CLOCK_GHZ * 1e3
    lines = ["", "## The row kernels (token_logprobs, full_kl) on an H100 (sm_90)", "",
             f"One block of {threads} threads per row, rows in a grid-stride loop; every kernel reads each row once "
             "(the forwards with an online max: each thread's sums moved onto its running max as it rises, then "
             "onto the block's, summed in a fixed order; csrc/common/row_math.h) in "
             f"{vec}-entry vectors, 128-bit accesses on 16-byte aligned rows (csrc/cuda/rows.cuh). Size: the GPU "
             f"bench's, N = {n:,} rows, V = {v:,}, bf16 logits. These kernels are bound by what they issue as much "
             "as by their bytes, so the time is the larger of two floors: the bytes at a copy's rate, and the "
             "main loop's instructions per entry at "
             f"{ARCH['sm_90']['sms']} SMs x {ISSUE_LANES_PER_CYCLE} lanes x {CLOCK_GHZ} GHz, read from the SASS "
             "(`kl_kernels/bench/sass.py`): the whole loop (its rare branches included: the rebase when a max "
             "rises, the label's vector) and its steady path (those branches not taken), which the prediction "
             f"uses. One exponential an entry and row also needs the SFU ({SFU_LANES_PER_CYCLE} lanes a cycle an "
             f"SM): {n * v / sfu:.0f} us each at this size.", "",
             "| kernel | blocks/SM | MB moved | instructions / entry (loop; steady) | bytes us | issue us | "
             "predicted us | copy us | fraction of copy |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    copy_bw = ARCH["sm_90"]["copy_tbs"] * 1e12
    for what, (kernel, streams, writes) in ROW_KERNELS.items():
        blocks = worst.get(("sm_90", kernel))
        whole = row_instructions_per_entry(loops, "sm_90", kernel, "bf16")
        steady = row_instructions_per_entry(loops, "sm_90", kernel, "bf16", steady=True)
        if blocks is None or whole is None:
            continue
        moved = n * v * e * (streams + writes)  # each byte once
        bytes_us = moved / copy_bw * 1e6
        issue_us = n * v * steady / issue
        us = max(bytes_us, issue_us) + LAUNCH_US
        copy_us = bytes_us + LAUNCH_US  # the floor
        lines.append(f"| {what} | {blocks} | {moved / 1e6:.0f} | {whole:.1f}; {steady:.1f} | {bytes_us:.0f} | "
                     f"{issue_us:.0f} | {us:.0f} | {copy_us:.0f} | {copy_us / us:.0%} |")
    lines += ["", "Measured on an H200 (`bench/results/gpu-h200-2026-11-28/`), before the vectors: the token_logprobs "
              "kernels took 4.5 ms forward + backward (34 % of the copy floor), the forward 1.77 ms where a read of "
              "the same bytes takes 0.51 ms. Their main loops then issued 50 (forward) and 55 (backward) "
              "instructions per bf16 entry on sm_90: a software exp polynomial (~20), 16-bit loads with int64 "
              "index and bound arithmetic per entry, a NaN flag and the label compare per entry; 50 per entry "
              "predicts 1.6 ms for that forward (its steady path, 40 a bf16 entry: 1.3 ms), close to what was measured. "
              "Now: 128-bit accesses and one bound check a vector, the SFU's ex2 (RowExp), the NaN flag taken from "
              "the sums, the label handled in its vector only, bf16 stores by the F2FP conversion. The table's "
              "times are a prediction until a GPU measures them (`.ci/gpu`); H200 rows read at ~4.3 TB/s "
              "(a measured copy), above this H100 model's 3.0."]
    return lines


def _batch_facts():
    from .batches import SIZES, make_batch
    out = {}
    for name in ("medium", "large"):
        b = make_batch(SIZES[name], device="cpu", seed=0)
        lengths = b.lengths
        out[name] = dict(tokens=int(lengths.sum()), batch=int(lengths.numel()), longest=int(lengths.max()))
    return out


def page(so_path: str, tool: str) -> str:
    threads, per = _tile_constants()
    tile = threads * per
    usages = resource_usage(so_path, tool)
    lines = ["# GPU paper model: the CUDA kernels on every target of the release build, from the compiled binaries",
             "",
             "Generated by `python -m kl_kernels.bench.gpu_model` from the `_cuda` extension built in CI "
             "(`KL_KERNELS_CUDA_ARCHS=all`: sm_80, sm_86, sm_89, sm_90, sm_100, sm_120; occupancy on each, time on "
             "an H100); `tests/test_gpu_model.py` regenerates it and requires this "
             "file to match. **Predicted, not measured**: no GPU has run these kernels (see the model's "
             "assumptions in `kl_kernels/bench/gpu_model.py`). A lent GPU runs `.ci/gpu`, which measures them.",
             "", f"Tile: {threads} threads x {per} elements = {tile} tokens per block; one block per tile.", "",
             "## Resources per kernel (every template instance: min-max)", "",
             "| arch | kernel | instances | registers | shared B | local B | stack B | blocks/SM (limit) | "
             "warps/SM |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    fams = {}
    for u in usages:
        fams.setdefault((u.arch, u.kernel), []).append(u)
    worst = {}
    for (arch, kernel), us in sorted(fams.items(), key=lambda kv: (int(kv[0][0][3:]), kv[0][1])):  # sm_80 first
        regs = [u.regs for u in us]
        shared = max(u.shared for u in us)
        blocks, limit = blocks_per_sm(max(regs), shared, threads, arch)
        worst[(arch, kernel)] = blocks
        lines.append(f"| {arch} | `{kernel}` | {len(us)} | {min(regs)}-{max(regs)} | {shared} | "
                     f"{max(u.local for u in us)} | {max(u.stack for u in us)} | {blocks} ({limit}) | "
                     f"{blocks * threads // 32} |")
    facts = _batch_facts()
    lines += ["", "## Expected time on an H100 (sm_90), fp32 and bf16 log-probs", "",
              "Per call: bytes / (3.0 TB/s x efficiency x grid fill) + launches x 4 us (+ the combine's walk "
              "over the longest row's tiles at ~0.2 us per dependent L2 round trip, forwards). Efficiency (of a "
              "copy's bandwidth): min(1, bytes in flight per SM / 14 KB); grid fill: min(1, tiles / 132 SMs). Copy: one "
              "launch plus the same bytes at 3.0 TB/s; fraction of copy: copy time over predicted time.", "",
              "| kernel | dtype | B/token | blocks/SM | efficiency | grid fill | size | tokens | predicted us | "
              "copy us | fraction of copy |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for dtype, e in (("fp32", 4), ("bf16", 2)):
        for what, t in traffic(e).items():
            kernel = KERNEL_OF[what]
            blocks = worst.get(("sm_90", kernel))
            if blocks is None:
                continue
            eff = bandwidth_efficiency(blocks, threads, t["streams"], e, per)
            per_token = t["read"] + t["write"]
            for size, f in facts.items():
                nbytes = per_token * f["tokens"]
                stream_us = nbytes / (ARCH["sm_90"]["copy_tbs"] * 1e12) * 1e6
                tiles = math.ceil(f["tokens"] / tile)
                fill = min(1.0, tiles / ARCH["sm_90"]["sms"])  # a grid smaller than the GPU leaves SMs idle
                chain = combine_chain(math.ceil(f["longest"] / tile)) * L2_ROUND_TRIP_US if "forward" in what else 0.0
                us = stream_us / (eff * fill) + LAUNCHES[what] * LAUNCH_US + chain
                copy_us = stream_us + LAUNCH_US  # a same-bytes copy is one kernel launch too
                lines.append(f"| {what} | {dtype} | {per_token} | {blocks} | {eff:.2f} | {fill:.2f} | {size} | "
                             f"{f['tokens']:,} | {us:.1f} | {copy_us:.1f} | {copy_us / us:.0%} |")
    lines += row_kernel_lines(worst, row_loops(so_path, tool))
    lines += ["", "## What the figures say, and what would move them", "",
              "* Measured once on a GPU (an H200, `bench/results/gpu-h200-2026-11-26/`): the whole call, not the "
              "kernels, sets the time today. `kl_reward[cuda]` took 0.45-0.51 ms per call at both sizes (8-9% of "
              "a same-bytes copy), where this model gives the kernels 10-24 us: the Python host path "
              "(validation, dispatch, argument structs, the device-side value checks, allocations) dominates. "
              "What moves it: fewer Python calls on the host path (checks and argument building), value checks "
              "folded into the kernels, one output allocation, CUDA graphs on the caller's side. The third run "
              "(`bench/results/gpu-h200-2026-11-26-third/`) measured the loss forward+backward at 1.4-1.7 ms, "
              "slower than eager autograd: its aggregation was ~38 small torch launches per forward and ~10 per "
              "backward. It now runs in the kernels (`penalty_totals`, one block, and the backward reading the "
              "loss's gradient on the device), and the offsets/lengths/prompt_lens value checks are made by the "
              "forwards' combine kernels (`tiles.cuh`; before, one small kernel each, `ragged_checks.cu`, where "
              "torch took six launches): a packed or padded `kl_reward` or loss forward issues no launch besides "
              "its own (`tests/test_launch_count.py` counts them).",
              "* At these sizes (1.5-50 MB per call) launches weigh as much as the bytes: the medium batch "
              "streams in ~1 us at 3 TB/s, and its 67 tiles fill half of an H100's 132 SMs. The forwards pay a "
              "second launch (the combine) that a copy does not. What moves it: fusing the combine into the "
              "forward (a last-block-done counter: an integer atomic, deterministic), smaller tiles for small "
              "batches (more blocks), CUDA graphs on the caller's side (the eager path has no host sync), and "
              "larger batches per call.",
              "* A kernel whose blocks/SM is limited by registers (see the table) keeps fewer bytes in flight; "
              "the efficiency column shows whether that costs bandwidth (below 1 it does). What moves it: "
              "`__launch_bounds__(kThreads, 2)` or fewer live values per thread.",
              "* The forward's combine finishes a row over several tiles from the tiles' boundary slots: one "
              "thread walks up to 16 later tiles (the longest large-batch row, 4,096 tokens, spans 2-3 tiles: "
              f"negligible); a longer row is summed by the whole block, strided, then a tree of fixed shape "
              f"(deterministic). A single 8M-token row spans 4,096 tiles: {combine_chain(4096)} dependent steps, "
              f"~{combine_chain(4096) * L2_ROUND_TRIP_US:.0f} us (one thread's walk was 4,096 steps, ~0.8 ms).",
              "* The Triton kernels' resources are in `bench/triton_static.md` (generated by the Triton static "
              "gate) where present."]
    return "\n".join(lines) + "\n"


def built_extension() -> str | None:
    for p in sorted((REPO / "kl_kernels").glob("_cuda.*.so")):
        return str(p)
    try:
        import kl_kernels._cuda as m
        return m.__file__
    except ImportError:
        return None


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    so, tool = built_extension(), cuobjdump()
    if so is None or tool is None:
        print("needs the built kl_kernels._cuda and triton's cuobjdump", file=sys.stderr)
        return 2
    text = page(so, tool)
    if argv[:1] == ["--write"]:
        (REPO / "bench" / "gpu_model.md").write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
