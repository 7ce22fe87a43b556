"""Static gate of the Triton kernels compiled for real GPUs (sm_80, sm_90) without a device.

``kl_kernels.triton.aot`` compiles every kernel through the real launchers and every autotune
config (fp32 and bf16 inputs, packed and padded) in child processes without TRITON_INTERPRET and
with a fresh Triton cache, then reads cuobjdump's resource usage and SASS.

Budget: a forward/backward tile kernel may use at most 128 registers per thread. At 128
registers a 4-warp block holds 128 * 128 = 16384 registers, so an H100 SM (65536) keeps 4 such
blocks (2 at 8 warps): at least 2 blocks per SM at every config we tune over, so one block's
prefix-scan / barrier phase overlaps another's loads. No local memory at all (spills or stack).
The forward kernels must issue 128-bit global loads (LDG.E.128) for fp32 and bf16.

No local memory holds since the autotune configs keep 4 elements per thread (512x4, 1024x8: the
4096-wide and 16-warp configs spilled, kl_penalty_fwd in every config). The register budget and the
128-bit loads of the forward kernels do not hold yet (issue 25 item 3): strict xfails, so they turn
into failures the moment a fix makes them pass unnoticed.
"""

from __future__ import annotations

import pytest

from kl_kernels.triton import aot

pytestmark = [pytest.mark.slow, pytest.mark.triton, pytest.mark.xdist_group("triton_static")]  # one compile
ARCHES = (80, 90)
TILE_KERNELS = ("kl_reward_fwd_kernel", "kl_reward_bwd_kernel", "kl_penalty_fwd_kernel", "kl_penalty_bwd_kernel")
FWD = ("kl_reward_fwd_kernel", "kl_penalty_fwd_kernel")
REG_BUDGET = 128
NOT_FIXED = pytest.mark.xfail(strict=True, reason="issue 25 item 3: forward register budget and bf16 128-bit loads not met yet")


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    return aot.compile_all(ARCHES, str(tmp_path_factory.mktemp("aot")))


def test_every_kernel_and_config_compiles_for_each_target(records):
    from kl_kernels.launching_triton import GPU_CONFIGS

    seen = {(r["kernel"], r["arch"], r["BLOCK"], r["num_warps"], r["case"]) for r in records}
    for arch in ARCHES:
        for case in ("float32-packed", "float32-padded", "bfloat16-packed", "bfloat16-padded"):
            for kernel in TILE_KERNELS:
                for block, warps in GPU_CONFIGS:
                    assert (kernel, arch, block, warps, case) in seen, (kernel, arch, block, warps, case)
            for kernel in ("kl_reward_combine_kernel", "kl_penalty_combine_kernel"):
                assert any(r[0] == kernel and r[1] == arch and r[4] == case for r in seen), (kernel, arch, case)
            assert any(r[0] == "kl_penalty_totals_kernel" and r[1] == arch and r[4] == f"{case}-aggregated"
                       for r in seen), (arch, case)
    assert all(r["regs"] > 0 for r in records)


def _offenders(records, kernels, bad):
    return sorted({(r["kernel"], r["arch"], r["BLOCK"], r["num_warps"], r["case"], r["regs"], r["local"] + r["stack"])
                   for r in records if r["kernel"] in kernels and bad(r)})


def test_backward_kernels_keep_the_budget_without_local_memory(records):
    bwd = ("kl_reward_bwd_kernel", "kl_penalty_bwd_kernel")
    assert not _offenders(records, bwd, lambda r: r["local"] + r["stack"] > 0)
    assert not _offenders(records, bwd, lambda r: r["regs"] > REG_BUDGET)


def test_no_local_memory_in_any_kernel(records):
    assert not _offenders(records, set(r["kernel"] for r in records), lambda r: r["local"] + r["stack"] > 0)


@NOT_FIXED
def test_forward_register_budget(records):
    assert not _offenders(records, FWD, lambda r: r["regs"] > REG_BUDGET)


@NOT_FIXED
def test_forward_kernels_issue_128_bit_loads(records):
    assert not _offenders(records, FWD, lambda r: not r["loads"].get("128"))


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


def test_occupancy_model():
    assert aot.blocks_per_sm(128, 4) == 4 and aot.blocks_per_sm(128, 8) == 2
    assert aot.blocks_per_sm(255, 4) == 2 and aot.blocks_per_sm(255, 8) == 1
    assert aot.blocks_per_sm(32, 4) == 16
