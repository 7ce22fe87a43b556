"""Static gate of the CUDA kernels (issue 25 item 4): what ptxas made of every kernel in the built
``kl_kernels._cuda`` (CI builds it for sm_80 and sm_90), read with the cuobjdump of Triton's wheel.

* no local memory and no stack frame (spills) in any kernel;
* no atomics in the SASS (the kernels are deterministic: per-tile partials, no float atomics);
* registers and shared memory that keep at least 2 blocks of ``kThreads`` per SM (one block's scan
  and barrier phases overlap another's loads);
* 128-bit global loads (``LDG.E.128``) in the main loops: the vector variant of each tile kernel.

What the kernels do not meet yet is a strict xfail naming the kernel and the numbers, so a fix
that makes it pass turns the xfail into a failure and must update this file.
"""

from __future__ import annotations

import pytest

from kl_kernels.bench import gpu_model

ARCHES = {"sm_80", "sm_90"}
FAMILIES = {"forward_tile", "combine", "backward_tile", "penalty_forward_tile", "penalty_combine",
            "penalty_backward_tile"}


@pytest.fixture(scope="module")
def binary():
    so, tool = gpu_model.built_extension(), gpu_model.cuobjdump()
    if so is None or tool is None:
        pytest.skip("needs kl_kernels._cuda built with nvcc (KL_KERNELS_BUILD_CUDA=1) and triton's cuobjdump")
    return so, tool


@pytest.fixture(scope="module")
def usage(binary):
    return gpu_model.resource_usage(*binary)


@pytest.fixture(scope="module")
def sass(binary):
    return gpu_model.sass_memory_ops(*binary)


def test_every_kernel_family_is_built_for_the_ci_targets(usage, sass):
    got = {(u.arch, u.kernel) for u in usage}
    for arch in ARCHES:
        for fam in FAMILIES:
            assert (arch, fam) in got, f"{fam} missing for {arch}"
    assert {(a, f) for a, f, _ in sass} >= {(a, f) for a in ARCHES for f in FAMILIES}


def test_no_local_memory_or_stack(usage):
    bad = sorted({(u.arch, u.kernel, u.variant, u.local, u.stack) for u in usage if u.local or u.stack})
    assert not bad, f"kernels with spills or a stack frame: {bad}"


def test_no_atomics(sass):
    bad = sorted((k, sorted(o for o in ops if o.startswith(("ATOM", "RED")))) for k, ops in sass.items()
                 if any(o.startswith(("ATOM", "RED")) for o in ops))
    assert not bad, f"atomics in: {bad}"


def _blocks(usage, families):
    threads, _ = gpu_model._tile_constants()
    return sorted({(u.arch, u.kernel, u.regs, u.shared, gpu_model.blocks_per_sm(u.regs, u.shared, threads, u.arch))
                   for u in usage if u.kernel in families})


def test_two_blocks_per_sm(usage):
    rows = _blocks(usage, FAMILIES - {"penalty_forward_tile"})
    assert rows and not [r for r in rows if r[4][0] < 2], [r for r in rows if r[4][0] < 2]


@pytest.mark.xfail(strict=True, reason="issue 25: penalty_forward_tile takes 151-156 registers (1 block of 256 "
                                       "threads per SM); __launch_bounds__(256, 2) makes ptxas spill 112-136 bytes")
def test_two_blocks_per_sm_penalty_forward(usage):
    rows = _blocks(usage, {"penalty_forward_tile"})
    assert rows and not [r for r in rows if r[4][0] < 2], [r for r in rows if r[4][0] < 2]


def _vector_loads(sass, family):
    """Per arch: whether some variant of ``family`` issues LDG.E.128."""
    return {arch: any("LDG.E.128" in ops for (a, f, _), ops in sass.items() if a == arch and f == family)
            for arch in ARCHES}


def test_kl_reward_forward_has_128_bit_loads(sass):
    # the vector variant (template flag true: contiguous, 16-byte aligned, whole tile) of every dtype
    vector = {k: ops for k, ops in sass.items() if k[1] == "forward_tile" and k[2].endswith("Lb1EEEvNS_12KLRewardArgs")}
    assert vector and all("LDG.E.128" in ops for ops in vector.values()), sorted(vector)


@pytest.mark.xfail(strict=True, reason="issue 25 item 4: the backward kernels and the loss forward load 32 bits "
                                       "at a time (no vector variant yet)")
@pytest.mark.parametrize("family", ["backward_tile", "penalty_forward_tile", "penalty_backward_tile"])
def test_other_tile_kernels_have_128_bit_loads(sass, family):
    assert all(_vector_loads(sass, family).values())
