"""Static gate of the Triton kernels compiled for real GPUs (sm_80, sm_90) without a device.

``kl_kernels.triton.aot`` compiles every kernel through the real launchers and every autotune
config (fp32 and bf16 inputs, packed and padded) in child processes without TRITON_INTERPRET and
with a fresh Triton cache, then reads cuobjdump's resource usage, every kernel's PTX load widths and
the SASS of the forward kernels and the row kernels (whose 128-bit loads are checked, and the row kernels' main
loops' instructions per entry, ``ROW_ENTRY_BUDGET``; disassembly was half the gate's CPU time when every kernel
was read; ``python -m kl_kernels.triton.aot`` reads every kernel's SASS, ``--ops token_logprobs,full_kl --rows``
prints the row kernels' table).

Budget: every tile kernel keeps at least 2 blocks per H100 SM at every config it is tuned over, so
one block's prefix-scan / barrier phase overlaps another's loads: registers <= 65536 / (2 x threads
per block), 128 at 8 warps, 255 at 4 or 2. The configs with 4 elements per thread (every fp32 one,
every backward one) are held to 128 at any width (4 blocks of 4 warps). The forward kernels hold 16
bytes of each flat input per thread, one 128-bit load: 4 fp32 or 8 bf16 elements, and the 16-bit
configs (``launching_triton.FORWARD_CONFIGS``: 1024x4, 512x2) use ~185-250 registers, 2-5 blocks per
SM. No local memory at all (spills or stack). The forward kernels must issue 128-bit global loads
(LDG.E.128) for fp32 and bf16.

History: the 4096-wide and 16-warp configs spilled, kl_penalty_fwd in every config; then (4
elements per thread, 512x4 and 1024x8) no kernel spilled but the forward kernels took 128-240
registers (1 block per SM at 8 warps) and bf16 had no 128-bit load. The forward kernels now settle
every integer (counts, last positions, where each segment goes) before their fp64 segmented scans
and store each scanned sum at once, so no int64 frame and at most one fp64 scan result is live across
a scan; the padded frame has no per-element int64 division (triton/tiles.py).
"""

from __future__ import annotations

import pytest
import torch
import triton

from kl_kernels.triton import aot

pytestmark = [pytest.mark.slow, pytest.mark.triton]  # one worker, one compile: pyproject one_worker_modules
ARCHES = (80, 90)
TILE_KERNELS = ("kl_reward_fwd_kernel", "kl_reward_bwd_kernel", "kl_penalty_fwd_kernel", "kl_penalty_bwd_kernel")
FWD = ("kl_reward_fwd_kernel", "kl_penalty_fwd_kernel")
ROWS = tuple(aot.ROW_KERNELS)  # token_logprobs' and full_kl's row kernels
REG_BUDGET = 128  # at 4 elements per thread; every config: at least 2 blocks per SM (aot.blocks_per_sm)


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    return aot.compile_all(ARCHES, str(tmp_path_factory.mktemp("aot")), sass_kernels=FWD + ROWS)


def test_every_kernel_and_config_compiles_for_each_target(records):
    from kl_kernels.launching_triton import GPU_CONFIGS, forward_configs

    seen = {(r["kernel"], r["arch"], r["BLOCK"], r["num_warps"], r["case"]) for r in records}
    for arch in ARCHES:
        for case in ("float32-packed", "float32-padded", "bfloat16-packed", "bfloat16-padded"):
            for kernel in TILE_KERNELS:
                configs = forward_configs(4 if case.startswith("float32") else 2) if kernel in FWD else GPU_CONFIGS
                for block, warps in configs:
                    assert (kernel, arch, block, warps, case) in seen, (kernel, arch, block, warps, case)
            for kernel in ("kl_reward_combine_kernel", "kl_penalty_combine_kernel"):
                assert any(r[0] == kernel and r[1] == arch and r[4] == case for r in seen), (kernel, arch, case)
            assert any(r[0] == "kl_penalty_totals_kernel" and r[1] == arch and r[4] == f"{case}-aggregated"
                       for r in seen), (arch, case)
    assert all(r["regs"] > 0 for r in records)


def _offenders(records, kernels, bad):
    return sorted({(r["kernel"], r["arch"], r["BLOCK"], r["num_warps"], r["case"], r["regs"], r["local"] + r["stack"])
                   for r in records if r["kernel"] in kernels and bad(r)})


def _over_budget(r):
    per_thread = r["BLOCK"] // (32 * r["num_warps"])
    return aot.blocks_per_sm(r["regs"], r["num_warps"]) < 2 or (per_thread <= 4 and r["regs"] > REG_BUDGET)


def test_backward_kernels_keep_the_budget_without_local_memory(records):
    bwd = ("kl_reward_bwd_kernel", "kl_penalty_bwd_kernel")
    assert not _offenders(records, bwd, lambda r: r["local"] + r["stack"] > 0)
    assert not _offenders(records, bwd, _over_budget)


def test_no_local_memory_in_any_kernel(records):
    assert not _offenders(records, set(r["kernel"] for r in records), lambda r: r["local"] + r["stack"] > 0)


# Triton 3.6 (torch 2.11's: the GPU image's, and what verl 0.9.1's torch pin brings) allocates the fp32 forward
# configs 144-167 registers (kl_penalty_fwd's: up to 144) where 3.8 and 3.9 keep them within 128: its 1024 x 8 config
# then fits 1 block per SM (its 512 x 4, which the autotuner also times, 3). Capping them (maxnreg=128) spilled 16-80
# bytes a thread in the padded cases, which the no-local-memory gate refuses. A known gap on that Triton, not a
# pass: strict, so the day it holds the mark must go. (Each Triton allocates differently: .ci/torch-versions runs
# this gate on 3.6 and 3.8 too, and a change that holds on one can spill on another.)
TRITON_3_6 = tuple(int(x) for x in triton.__version__.split(".")[:2]) <= (3, 6)


@pytest.mark.xfail(TRITON_3_6, strict=True, reason="Triton 3.6: the fp32 forward configs take up to 144-167 registers")
def test_forward_register_budget(records):
    assert not _offenders(records, FWD, _over_budget)
    # the 4-element configs (fp32) within REG_BUDGET, the 8-element ones (bf16) at 2+ blocks per SM
    assert {r["BLOCK"] // (32 * r["num_warps"]) for r in records if r["kernel"] in FWD} == {4, 8}


def test_forward_kernels_issue_128_bit_loads(records):
    assert not _offenders(records, FWD, lambda r: not r["loads"].get("128"))


def test_sass_is_read_for_the_forward_kernels_and_agrees_with_the_ptx(records):
    """The SASS of every forward kernel and row kernel is read; where it is, its 128-bit loads are the PTX's v4
    loads (ptxas keeps Triton's vector widths), which the table shows for the kernels not disassembled."""
    assert all(r["loads"] is not None for r in records if r["kernel"] in FWD + ROWS)
    assert all(r["loads"] is None for r in records if r["kernel"] not in FWD + ROWS)
    disagree = [(r["kernel"], r["arch"], r["case"], r["loads"], r["ptx_loads"]) for r in records
                if r["loads"] is not None and bool(r["loads"].get("128")) != bool(r["ptx_loads"].get("128"))]
    assert not disagree
    assert aot.ptx_global_loads("@%p1 ld.global.v4.b32 { %r1, %r2, %r3, %r4 }, [ %rd1 + 0 ];\n"
                                "ld.global.L1::evict_last.b16 %rs1, [%rd2];\n ld.global.v2.b32 {%r5, %r6}, [%rd3];") \
        == {"128": 1, "16": 1, "64": 1}


def test_token_logprobs_kernels_compile_within_the_budget(records):
    """token_logprobs' row kernels (issue 28), both dtypes, rows 16-byte aligned or not (odd V), each target:
    compiled, no local memory (the test above), at most REG_BUDGET registers."""
    rows = [r for r in records if r["kernel"].startswith("token_logprobs_")]
    for arch in ARCHES:
        for kernel in ("token_logprobs_fwd_kernel", "token_logprobs_bwd_kernel"):
            for case in ("float32-rows", "bfloat16-rows", "bfloat16-rows-unaligned"):
                assert any(r["kernel"] == kernel and r["arch"] == arch and r["case"] == case for r in rows)
    assert not _offenders(rows, {r["kernel"] for r in rows}, lambda r: r["regs"] > REG_BUDGET)


def test_full_kl_kernels_compile_within_the_budget(records):
    """full_kl's row kernels (issue 28), both dtypes, rows aligned or not, each target, the backward with and
    without the reference's gradient: compiled, no local memory (the test above), at most REG_BUDGET registers."""
    rows = [r for r in records if r["kernel"].startswith("full_kl_")]
    for arch in ARCHES:
        for kernel in ("full_kl_fwd_kernel", "full_kl_bwd_kernel"):
            for case in ("float32-rows", "bfloat16-rows", "bfloat16-rows-unaligned"):
                assert any(r["kernel"] == kernel and r["arch"] == arch and r["case"] == case for r in rows)
    assert not _offenders(rows, {r["kernel"] for r in rows}, lambda r: r["regs"] > REG_BUDGET)


# The row kernels' main loops (issue 48): instructions per entry of the loop(s) that read a row (aot.row_passes:
# full_kl's forward has two passes, the others one; an entry is one vocabulary position, both rows for full_kl),
# at most this many on sm_90 for 16-byte aligned rows (V % 16 == 0), over every variant (entropy or not, one or
# both gradients). At 33.5e12 lane-instructions/s an H200 issues 8192 x 131,072 entries' 15 instructions in
# 0.48 ms, a bf16 read of them at copy speed takes 0.51 ms: under ~15 a kernel is bound by its bytes. Before
# issue 48 (scalar loads, a software exp, per-entry flags and label compares, a block-wide max per step): 79 / 78
# (token_logprobs forward, bf16 / fp32), 47 / 45 (backward), 101 / 96 (full_kl forward), 73 / 68 (backward).
# Reached (sm_90, Triton 3.9): 10.7 / 10.8, 8.9 / 7.9, 22.2 / 17.9, 19.4 / 17.8, and on Triton 3.6 (torch 2.11's,
# the GPU image's: .ci/torch-versions runs this gate there too) 10.3 / 10.6, 8.9 / 7.4, 21.9 / 17.9, 19.8 / 17.8;
# the budgets leave ~7-12 % over the larger. (The forwards' inner loops are unrolled in Triton's IR,
# ``loop_unroll_factor``: 3.6 left them rolled, 1-3 more instructions an entry; and e^-y is taken as
# exp2(y * -log2 e), row_math.exp_neg_ftz: 3.6 lowers -y to an FADD 0 - y.)
ROW_ENTRY_BUDGET = {
    ("token_logprobs_fwd_kernel", "bfloat16"): 12.0, ("token_logprobs_fwd_kernel", "float32"): 12.0,
    ("token_logprobs_bwd_kernel", "bfloat16"): 10.0, ("token_logprobs_bwd_kernel", "float32"): 9.0,
    ("full_kl_fwd_kernel", "bfloat16"): 24.0, ("full_kl_fwd_kernel", "float32"): 19.5,
    ("full_kl_bwd_kernel", "bfloat16"): 21.5, ("full_kl_bwd_kernel", "float32"): 19.5,
}
# softcap= (the SOFTCAP specialization, aot's "<dtype>-rows-softcap" cases: c tanh(x / c) / T per entry, an
# accurate tanh, ~15-20 instructions an entry a capped row): measured on sm_90 with Triton 3.6, 3.8 and 3.9 at
# most 30.6 / 30.6 (token_logprobs forward, bf16 / fp32), 32.4 / 31.0 (backward), 60.4 / 56.4 (full_kl forward),
# 65.5 / 63.0 (backward, both gradients); ~10 % over. (Issue-bound at these counts: a capped model pays for its
# tanh; the uncapped kernels are separate specializations, untouched.)
ROW_ENTRY_BUDGET_SOFTCAP = {
    ("token_logprobs_fwd_kernel", "bfloat16"): 33.5, ("token_logprobs_fwd_kernel", "float32"): 33.5,
    ("token_logprobs_bwd_kernel", "bfloat16"): 35.5, ("token_logprobs_bwd_kernel", "float32"): 34.0,
    ("full_kl_fwd_kernel", "bfloat16"): 66.0, ("full_kl_fwd_kernel", "float32"): 62.0,
    ("full_kl_bwd_kernel", "bfloat16"): 72.0, ("full_kl_bwd_kernel", "float32"): 69.0,
}
# Rows not 16-byte aligned (odd V: scalar loads) cost more and are held to a looser bound, which still keeps the
# lanes' state in one thread each (row_math.lane_tile; the 8-thread layout cost ~42 for the forward)
UNALIGNED_ENTRY_BUDGET = 33.0


def _row_loops(records, case):
    return [r for r in records if r["kernel"] in ROWS and r["case"] == case]


@pytest.mark.parametrize("case", ["bfloat16-rows", "float32-rows", "bfloat16-rows-softcap", "float32-rows-softcap"])
def test_row_kernels_main_loops_within_the_instruction_budget(records, case):
    loops = _row_loops(records, case)
    assert {r["kernel"] for r in loops} == set(ROWS)
    assert all(r["row_loop"] is not None and len(r["row_loop"]["passes"]) == aot.ROW_KERNELS[r["kernel"]][1]
               for r in loops)
    dtype = case.split("-")[0]
    budget = ROW_ENTRY_BUDGET_SOFTCAP if case.endswith("-softcap") else ROW_ENTRY_BUDGET
    assert all(("SOFTCAP" in r["flags"].split(",")) == case.endswith("-softcap") for r in loops)
    over = sorted((r["kernel"], r["flags"], r["row_loop"]["per_entry"]) for r in loops if r["arch"] == 90
                  and r["row_loop"]["per_entry"] > budget[(r["kernel"], dtype)])
    assert not over, f"instructions per entry over ROW_ENTRY_BUDGET on sm_90: {over}"
    # the gate counts what it should: the entries a loop's loads bring in, one or two rows side by side
    assert all(r["row_loop"]["entry_bits"] == (16 if dtype == "bfloat16" else 32) for r in loops)
    unaligned = [(r["kernel"], r["flags"], r["arch"], r["row_loop"]["per_entry"])
                 for r in _row_loops(records, "bfloat16-rows-unaligned")]
    assert unaligned and not [u for u in unaligned if u[3] > UNALIGNED_ENTRY_BUDGET], unaligned


@pytest.mark.parametrize("case", ["bfloat16-rows", "float32-rows", "bfloat16-rows-softcap", "float32-rows-softcap"])
def test_row_kernels_read_aligned_rows_with_128_bit_loads(records, case):
    """Every global load in a row kernel's main loop(s) is 128 bits wide on 16-byte aligned rows (the forward's
    lane tiles, row_math.lane_tile; the backward's BLOCK of 8 bf16 / 4 fp32 entries a thread), every target."""
    scalar = [(r["kernel"], r["flags"], r["arch"], p["load_bits"], p["ops"].get("LDG"))
              for r in _row_loops(records, case) for p in r["row_loop"]["passes"]
              if p["load_bits"] != 128 * p["ops"].get("LDG", 0)]
    assert not scalar, scalar


# How often each row kernel reads each entry of a counted row, counted under Triton's interpreter: token_logprobs'
# forward once (one pass with an online max, kl_kernels/triton/row_math.py) and the label's entry once more;
# full_kl's twice (a max pass, then a sums pass: on an H200 its one-pass forwards were slower,
# kl_kernels/triton/full_kl.py); each backward once. A row not counted is not read (but for token_logprobs'
# label entry).


def _reads(call, tensors):
    """How many times a call reads each element of ``tensors`` under Triton's interpreter (masked-off lanes not
    counted): each tensor's count, in its shape."""
    import numpy as np
    from triton.runtime import interpreter

    counts = [np.zeros(t.numel(), dtype=np.int64) for t in tensors]
    original = interpreter.InterpreterBuilder.create_masked_load

    def counting(self, ptrs, mask, other, *args):
        addrs = np.asarray(ptrs.data).reshape(-1)[np.broadcast_to(mask.data, ptrs.data.shape).reshape(-1)]
        for t, c in zip(tensors, counts):
            lo, size = t.data_ptr(), t.element_size()
            hit = addrs[(addrs >= lo) & (addrs < lo + t.numel() * size)]
            np.add.at(c, ((hit - lo) // size).astype(np.int64), 1)
        return original(self, ptrs, mask, other, *args)

    interpreter.InterpreterBuilder.create_masked_load = counting
    try:
        call()
    finally:
        interpreter.InterpreterBuilder.create_masked_load = original
    return [torch.from_numpy(c).reshape(t.shape) for c, t in zip(counts, tensors)]


@pytest.mark.parametrize("vocab", [3001, 4096])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_kernels_read_each_entry_as_designed(vocab, dtype):
    from conftest import triton_device

    if triton_device() != "cpu":
        pytest.skip("reads are counted under Triton's interpreter")
    from kl_kernels.full_kl import launch_triton as F
    from kl_kernels.token_logprobs import launch_triton as T

    g = torch.Generator().manual_seed(vocab)
    x, ref = (torch.randn(4, vocab, generator=g).to(dtype) for _ in range(2))
    y = torch.tensor([5, 0, vocab - 1, 7])
    counted = torch.tensor([True, False, True, True])
    want = torch.ones(4, vocab, dtype=torch.int64)
    want[1] = 0
    out = {}
    (fwd,) = _reads(lambda: out.update(zip(("lp", "ent", "lse"), T.forward(x, y, counted, 0.7, True))), [x])
    label = torch.zeros_like(want)
    label[torch.arange(4), y] = 1
    assert torch.equal(fwd, want + label)
    (bwd,) = _reads(lambda: T.backward(torch.randn(4), torch.randn(4), x, y, counted, 0.7, out["lse"], out["ent"],
                                       torch.empty_like(x)), [x])
    label[1] = 0  # (a row not counted is written with zeros, unread)
    assert torch.equal(bwd, want + label)  # the label's entry read before the loop writes its gradient
    fx, fr = _reads(lambda: out.update(zip(("kl", "lse", "ref_lse"), F.forward(x, ref, counted, 0.7))), [x, ref])
    assert torch.equal(fx, 2 * want) and torch.equal(fr, 2 * want)
    bx, br = _reads(lambda: F.backward(torch.randn(4), x, ref, counted, 0.7, out["kl"], out["lse"], out["ref_lse"],
                                       torch.empty_like(x), torch.empty_like(ref)), [x, ref])
    assert torch.equal(bx, want) and torch.equal(br, want)


def test_occupancy_model():
    assert aot.blocks_per_sm(128, 4) == 4 and aot.blocks_per_sm(128, 8) == 2
    assert aot.blocks_per_sm(255, 4) == 2 and aot.blocks_per_sm(255, 8) == 1
    assert aot.blocks_per_sm(32, 4) == 16
