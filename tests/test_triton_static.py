"""Static gate of the Triton kernels compiled for real GPUs (sm_80, sm_90) without a device.

``kl_kernels.triton.aot`` compiles every kernel through the real launchers and every autotune
config (fp32 and bf16 inputs, packed and padded) in child processes without TRITON_INTERPRET and
with a fresh Triton cache, then reads cuobjdump's resource usage, every kernel's PTX load widths and
the SASS of the forward kernels (whose 128-bit loads are checked; disassembly was half the gate's
CPU time when every kernel was read; ``python -m kl_kernels.triton.aot`` reads every kernel's SASS).

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

from kl_kernels.triton import aot

pytestmark = [pytest.mark.slow, pytest.mark.triton]  # one worker, one compile: pyproject one_worker_modules
ARCHES = (80, 90)
TILE_KERNELS = ("kl_reward_fwd_kernel", "kl_reward_bwd_kernel", "kl_penalty_fwd_kernel", "kl_penalty_bwd_kernel")
FWD = ("kl_reward_fwd_kernel", "kl_penalty_fwd_kernel")
REG_BUDGET = 128  # at 4 elements per thread; every config: at least 2 blocks per SM (aot.blocks_per_sm)


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    return aot.compile_all(ARCHES, str(tmp_path_factory.mktemp("aot")), sass_kernels=FWD)


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


def test_forward_register_budget(records):
    assert not _offenders(records, FWD, _over_budget)
    # the 4-element configs (fp32) within REG_BUDGET, the 8-element ones (bf16) at 2+ blocks per SM
    assert {r["BLOCK"] // (32 * r["num_warps"]) for r in records if r["kernel"] in FWD} == {4, 8}


def test_forward_kernels_issue_128_bit_loads(records):
    assert not _offenders(records, FWD, lambda r: not r["loads"].get("128"))


def test_sass_is_read_for_the_forward_kernels_and_agrees_with_the_ptx(records):
    """The SASS of every forward kernel is read; where it is, its 128-bit loads are the PTX's v4 loads
    (ptxas keeps Triton's vector widths), which the table shows for the kernels not disassembled."""
    assert all(r["loads"] is not None for r in records if r["kernel"] in FWD)
    assert all(r["loads"] is None for r in records if r["kernel"] not in FWD)
    disagree = [(r["kernel"], r["arch"], r["case"], r["loads"], r["ptx_loads"]) for r in records
                if r["loads"] is not None and bool(r["loads"].get("128")) != bool(r["ptx_loads"].get("128"))]
    assert not disagree
    assert aot.ptx_global_loads("@%p1 ld.global.v4.b32 { %r1, %r2, %r3, %r4 }, [ %rd1 + 0 ];\n"
                                "ld.global.L1::evict_last.b16 %rs1, [%rd2];\n ld.global.v2.b32 {%r5, %r6}, [%rd3];") \
        == {"128": 1, "16": 1, "64": 1}


def test_token_logprobs_kernels_compile_within_the_budget(records):
    """token_logprobs' row kernels (issue 28), both dtypes, each target: compiled, no local memory (the
    test above), at most REG_BUDGET registers. Their loads stay scalar (masked rows of any stride)."""
    rows = [r for r in records if r["kernel"].startswith("token_logprobs_")]
    for arch in ARCHES:
        for kernel in ("token_logprobs_fwd_kernel", "token_logprobs_bwd_kernel"):
            for case in ("float32-rows", "bfloat16-rows"):
                assert any(r["kernel"] == kernel and r["arch"] == arch and r["case"] == case for r in rows)
    assert not _offenders(rows, {r["kernel"] for r in rows}, lambda r: r["regs"] > REG_BUDGET)


def test_full_kl_kernels_compile_within_the_budget(records):
    """full_kl's row kernels (issue 28), both dtypes, each target, the backward with and without the
    reference's gradient: compiled, no local memory (the test above), at most REG_BUDGET registers."""
    rows = [r for r in records if r["kernel"].startswith("full_kl_")]
    for arch in ARCHES:
        for kernel in ("full_kl_fwd_kernel", "full_kl_bwd_kernel"):
            for case in ("float32-rows", "bfloat16-rows"):
                assert any(r["kernel"] == kernel and r["arch"] == arch and r["case"] == case for r in rows)
    assert not _offenders(rows, {r["kernel"] for r in rows}, lambda r: r["regs"] > REG_BUDGET)


# How often each row forward reads a row, as 16-bit PTX loads (a bf16 row's entries: nothing else is 16 bits wide)
# against the backward, which reads each entry once by construction: token_logprobs' forward once (one pass
# with an online max, kl_kernels/triton/row_math.py) and the label's entry once more; full_kl's twice (a max
# pass, then a sums pass: on an H200 its one-pass forwards were slower, kl_kernels/triton/full_kl.py).
FORWARD_READS = {"token_logprobs": (1, 1), "full_kl": (2, 0)}  # op: (passes, extra loads)


@pytest.mark.parametrize("op", sorted(FORWARD_READS))
def test_row_forwards_read_each_entry_as_designed(records, op):
    passes, extra = FORWARD_READS[op]
    rows = [r for r in records if r["case"] == "bfloat16-rows" and r["kernel"].startswith(op + "_")]
    for arch in ARCHES:
        fwd = [r["ptx_loads"].get("16", 0) for r in rows if r["arch"] == arch and r["kernel"] == f"{op}_fwd_kernel"]
        bwd = {r["ptx_loads"].get("16", 0) for r in rows if r["arch"] == arch and r["kernel"] == f"{op}_bwd_kernel"}
        assert fwd and len(bwd) == 1 and min(bwd) > 0, (arch, fwd, bwd)
        assert set(fwd) == {passes * min(bwd) + extra}, (arch, fwd, bwd)


def test_occupancy_model():
    assert aot.blocks_per_sm(128, 4) == 4 and aot.blocks_per_sm(128, 8) == 2
    assert aot.blocks_per_sm(255, 4) == 2 and aot.blocks_per_sm(255, 8) == 1
    assert aot.blocks_per_sm(32, 4) == 16
