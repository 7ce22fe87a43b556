"""Static gate of the CUDA kernels (issue 25 item 4): what ptxas made of every kernel in the built
``kl_kernels._cuda`` for every architecture it holds machine code for (CI builds the release list,
sm_80 to sm_120: what a user's ``KL_KERNELS_CUDA_ARCHS=all`` build holds), read with the cuobjdump of
Triton's wheel.

* no local memory and no stack frame (spills) in any kernel;
* no atomics in the SASS (the kernels are deterministic: per-tile partials, no float atomics);
* registers and shared memory that keep at least 2 blocks of ``kThreads`` per SM (one block's scan
  and barrier phases overlap another's loads): ``penalty_forward_tile`` took 146-156 registers
  until it compacted its per-element facts (issue 25 item 4);
* 128-bit global loads (``LDG.E.128``) in the main loops: the vector variant of each tile kernel
  (the backward kernels and the loss forward had none before issue 25 item 4).
"""

from __future__ import annotations

import os

import pytest

from kl_kernels.bench import gpu_model

FAMILIES = {"forward_tile", "combine", "backward_tile", "penalty_forward_tile", "penalty_combine",
            "penalty_totals", "penalty_backward_tile", "offsets_valid", "lengths_valid",
            "token_logprobs_forward_kernel", "token_logprobs_backward_kernel", "full_kl_forward_kernel",
            "full_kl_backward_kernel", *gpu_model.ROW_SOFTCAP}


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


def _asked(spec: str) -> set[str]:
    """The machine-code targets of an arch spec (``'80;90;compute_100'`` -> ``{'sm_80', 'sm_90'}``; ``all``:
    setup.py's release list, which gpu_model.ARCH covers: tests/test_gpu_model.py)."""
    if spec.strip().lower() == "all":
        return set(gpu_model.ARCH)
    return {f"sm_{a.strip().replace('.', '')}" for a in spec.replace(",", ";").split(";")
            if a.strip() and not a.strip().startswith("compute_")}


@pytest.fixture(scope="module")
def arches(usage):
    """Every architecture the binary holds machine code for: what the build was asked for (the module's own
    record, and KL_KERNELS_CUDA_ARCHS when the environment names targets, as .ci/gpu does) must all be there,
    and each must be one the paper model knows (its occupancy limits)."""
    import importlib

    built = {u.arch for u in usage}
    recorded = importlib.import_module("kl_kernels._cuda").probe(False)["cuda_archs"]
    assert _asked(recorded) <= built, f"the build was asked for {recorded}; the binary holds {sorted(built)}"
    env = os.environ.get("KL_KERNELS_CUDA_ARCHS", "")
    assert _asked(env) <= built, f"KL_KERNELS_CUDA_ARCHS={env}; the binary holds {sorted(built)}"
    unknown = built - set(gpu_model.ARCH)
    assert not unknown, f"gpu_model.ARCH has no device facts for {sorted(unknown)}"
    return built


def test_every_kernel_family_is_built_for_every_target(arches, usage, sass):
    got = {(u.arch, u.kernel) for u in usage}
    for arch in arches:
        for fam in FAMILIES:
            assert (arch, fam) in got, f"{fam} missing for {arch}"
    assert {(a, f) for a, f, _ in sass} >= {(a, f) for a in arches for f in FAMILIES}


# The one exception, bounded: on sm_100 and sm_120 CUDA 13's ptxas needs 150-168 registers for the vector
# variants of the loss forward (penalty_forward_tile) where sm_80/sm_90 fit in 126-128, so at the 128-register cap
# that keeps 2 blocks per SM it spills 16-32 bytes per thread (measured with ptxas -v: 16-56 bytes of spill
# stores, in the per-element loop). Neither enable_smem_spilling (it does not engage on this kernel), a higher
# register-usage level nor another cap removed it; 1 block per SM (no spill) would halve the resident warps.
# A stack frame of 32 bytes for 512 resident threads is 16 KB, L1-resident. Not yet measured on such a GPU:
# a lent sm_100/sm_120 machine should time this kernel against the scalar variant (no spill) before this
# allowance stays. Everything else: no stack, and no local memory anywhere.
STACK_ALLOWED = {("sm_100", "penalty_forward_tile"): 32, ("sm_120", "penalty_forward_tile"): 32}


def test_no_local_memory_or_stack(usage):
    bad = sorted({(u.arch, u.kernel, u.variant, u.local, u.stack) for u in usage
                  if u.local or u.stack > STACK_ALLOWED.get((u.arch, u.kernel), 0)})
    assert not bad, f"kernels with spills or a stack frame: {bad}"


# The atomics allowed, integer ones only (no float atomic anywhere: results never depend on timing):
# * the compare-and-swap that claims the device error word (csrc/cuda/errors.cuh, kl_kernels/device_errors.py),
#   in the value checks alone, on the bad-value path;
# * in the forwards' combine kernels, which make those value checks themselves (issue 49: no launches of their
#   own; csrc/cuda/tiles.cuh's record_first_check): the error word's claim, a 64-bit atomicMin that takes the
#   grid's first finding (ATOMG.E.64 / RED.E when its result is unused) and a 64-bit blocks-done counter
#   (ATOMG.E.ADD.64) in the workspace. Which finding is recorded is the smallest key, whatever the order.
ERROR_WORD_KERNELS = {"offsets_valid", "lengths_valid"}
FOLDED_CHECK_KERNELS = {"combine", "penalty_combine"}


def test_no_atomics(sass):
    def atomics(k, ops):
        found = sorted(o for o in ops if o.startswith(("ATOM", "RED")))
        if k[1] in ERROR_WORD_KERNELS:  # a 64-bit integer CAS (ATOMG.E.CAS.64... or ATOMG.E.64 with .CAS folded)
            found = [o for o in found if not (o.startswith("ATOMG") and ".ADD" not in o and ".F" not in o)]
        if k[1] in FOLDED_CHECK_KERNELS:  # integer atomics (CAS, MIN, ADD): none on floats
            found = [o for o in found if ".F" in o]
        return found

    bad = sorted((k, atomics(k, ops)) for k, ops in sass.items() if atomics(k, ops))
    assert not bad, f"atomics in: {bad}"


def _blocks(usage, families):
    threads, _ = gpu_model._tile_constants()
    return sorted({(u.arch, u.kernel, u.regs, u.shared, gpu_model.blocks_per_sm(u.regs, u.shared, threads, u.arch))
                   for u in usage if u.kernel in families})


def test_two_blocks_per_sm(usage):
    threads, _ = gpu_model._tile_constants()
    rows = sorted({(u.arch, u.kernel, u.variant, u.regs, u.shared,
                    gpu_model.blocks_per_sm(u.regs, u.shared, threads, u.arch)) for u in usage})
    assert rows and not [r for r in rows if r[5][0] < 2], [r for r in rows if r[5][0] < 2]


# The vector variant of each tile kernel (template flag VEC true: a whole 8-element run, every
# per-token stream flat and 16-byte aligned) loads and stores 128 bits at a time; the combines
# read per-sequence slots and are left out.
VECTOR_VARIANT = {"forward_tile": "Lb1EEEvNS_12KLRewardArgs", "backward_tile": "Lb1EEEvNS_12KLRewardArgs",
                  "penalty_forward_tile": "Lb1EEEvNS_13KLPenaltyArgs", "penalty_backward_tile": "Lb1EEEvNS_13KLPenaltyArgs"}


@pytest.mark.parametrize("family", sorted(VECTOR_VARIANT))
def test_vector_variants_issue_128_bit_loads(arches, sass, family):
    vector = {k: ops for k, ops in sass.items() if k[1] == family and k[2].endswith(VECTOR_VARIANT[family])}
    assert arches <= {k[0] for k in vector}, f"no vector variant of {family} for some arch: {sorted(vector)}"
    bad = sorted(k for k, ops in vector.items() if "LDG.E.128" not in ops)
    assert not bad, f"vector variants without LDG.E.128: {bad}"
    scalar = {k for k in sass if k[1] == family and not k[2].endswith(VECTOR_VARIANT[family])}
    assert scalar, f"{family}: the scalar (strided/misaligned) variant is missing"


# The row kernels (csrc/cuda/rows.cuh) walk a row in 8-entry vectors: their main loop (the innermost loop that
# loads, kl_kernels/bench/sass.py) reads the policy's row 128 bits at a time and issues at most ROW_BUDGET
# instructions per entry: (the whole loop, its rare branches included: the rebase when a max rises, the label's
# vector; its steady path). Before the vectors (H200-measured at 34 % of the copy floor, issue-bound): 50
# (token_logprobs forward), 55 (backward), 102 and 113 (full_kl's) per bf16 entry on sm_90, the whole loop.
ROW_BUDGET = {  # family -> {dtype: (whole, steady)}, the most on any arch; measured (sm_80..sm_120) + ~10 %
    "token_logprobs_forward_kernel": {"bf16": (16.5, 11.5), "fp32": (22, 11.5)},
    "token_logprobs_backward_kernel": {"bf16": (20, 14), "fp32": (19, 14)},
    "full_kl_forward_kernel": {"bf16": (57, 35), "fp32": (55, 33)},
    "full_kl_backward_kernel": {"bf16": (23, 21), "fp32": (20, 20)},
    # softcap= (gpu_model.ROW_SOFTCAP): the same walks with c tanh(s x / c) per entry, an accurate tanh (~16
    # instructions; MUFU.TANH's approximation would not meet the float32 oracle): 26.6 steady per bf16 entry in
    # token_logprobs' forward where the uncapped one issues 10.2, 64 where full_kl's issues 32 (two rows capped)
    "token_logprobs_softcap_forward_kernel": {"bf16": (34, 29.5), "fp32": (39.5, 29.5)},
    "token_logprobs_softcap_backward_kernel": {"bf16": (42.5, 36), "fp32": (42, 36)},
    "full_kl_softcap_forward_kernel": {"bf16": (92, 70.5), "fp32": (90, 69)},
    "full_kl_softcap_backward_kernel": {"bf16": (67, 65), "fp32": (64, 64)},
}
# Inner loading loops per kernel: one per (reference/gradient row aligned or not) variant of the walk; a forward
# that read its row twice (a max pass, then a sums pass) would have twice as many.
ROW_LOOPS = {"token_logprobs_forward_kernel": 1, "token_logprobs_backward_kernel": 2, "full_kl_forward_kernel": 2,
             "full_kl_backward_kernel": 2}
ROW_LOOPS.update({capped: ROW_LOOPS[plain] for capped, plain in gpu_model.ROW_SOFTCAP.items()})


@pytest.fixture(scope="module")
def row_loops(binary):
    return gpu_model.row_loops(*binary)


@pytest.mark.parametrize("family", sorted(ROW_BUDGET))
def test_row_kernels_main_loops(arches, row_loops, family):
    from kl_kernels.bench import sass

    seen = set()
    for (arch, fam, variant), inner in row_loops.items():
        if fam != family:
            continue
        assert len(inner) == ROW_LOOPS[family], (arch, variant, [(hex(lp.start), lp.load_bits) for lp in inner])
        main = sass.pick_main(inner)
        if variant.startswith(gpu_model.ROW_DTYPE_CODE["bf16"]):
            assert main.ops["LDG"] * 128 == main.load_bits, (arch, variant, "the main loop has loads below 128 bits")
        seen.add(arch)
    assert seen >= arches, f"{family} missing for {sorted(arches - seen)}"
    for arch in arches:
        for dtype, budgets in ROW_BUDGET[family].items():
            for steady, budget in zip((False, True), budgets):
                per = gpu_model.row_instructions_per_entry(row_loops, arch, family, dtype, steady)
                assert per is not None and per <= budget, (arch, dtype, "steady" if steady else "whole", per, budget)
