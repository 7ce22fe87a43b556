"""bench/gpu_model.md, the GPU paper model, is generated from the compiled CUDA kernels: regenerate it
from this build and require the committed page to match (a kernel whose registers change must come
with its page: ``python -m kl_kernels.bench.gpu_model --write``). Also checks the model's arithmetic
on known limits."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from kl_kernels.bench import gpu_model

REPO = Path(__file__).resolve().parents[1]


def test_occupancy_arithmetic():
    # 256 threads: 8 warps. 64 registers/thread -> 2048 per warp -> 32 warps -> 4 blocks.
    assert gpu_model.blocks_per_sm(64, 0, 256, "sm_90") == (4, "registers")
    assert gpu_model.blocks_per_sm(150, 0, 256, "sm_90") == (1, "registers")  # 152 x 32 = 4864 per warp
    assert gpu_model.blocks_per_sm(32, 0, 256, "sm_90") == (8, "threads")
    assert gpu_model.blocks_per_sm(32, 100_000, 256, "sm_90")[0] == 2
    assert gpu_model.bandwidth_efficiency(1, 256, 4, 4) == 1.0
    assert gpu_model.bandwidth_efficiency(1, 32, 1, 2) < 0.1
    # sm_86 and sm_120: 1536 threads, 16 and 24 blocks, 100 KB of shared memory per SM (cuda_occupancy.h)
    assert gpu_model.blocks_per_sm(32, 0, 256, "sm_120") == (6, "threads")
    assert gpu_model.blocks_per_sm(32, 0, 64, "sm_86") == (16, "blocks")
    assert gpu_model.blocks_per_sm(32, 40_000, 256, "sm_120") == (2, "shared memory")
    with pytest.raises(KeyError, match="no device facts for sm_75"):
        gpu_model.blocks_per_sm(32, 0, 256, "sm_75")


def _release_archs() -> set[str]:
    """setup.py's release list (DEFAULT_CUDA_ARCHS), read without running setup.py."""
    tree = ast.parse((REPO / "setup.py").read_text())
    (value,) = [n.value.value for n in tree.body if isinstance(n, ast.Assign)
                and any(getattr(t, "id", None) == "DEFAULT_CUDA_ARCHS" for t in n.targets)]
    return {f"sm_{a}" for a in value.split(";")}


def test_the_model_knows_every_arch_the_build_targets():
    """A build for an arch the model has no limits for would fail the static gate's occupancy check on a user's
    machine (KeyError 'sm_86', issue 50): the model covers exactly the release list."""
    assert set(gpu_model.ARCH) == _release_archs()


def test_page_is_up_to_date():
    so, tool = gpu_model.built_extension(), gpu_model.cuobjdump()
    if so is None or tool is None:
        pytest.skip("needs kl_kernels._cuda built with nvcc and triton's cuobjdump")
    built = {u.arch for u in gpu_model.resource_usage(so, tool)}
    if built != _release_archs():
        pytest.skip(f"bench/gpu_model.md describes CI's build (KL_KERNELS_CUDA_ARCHS=all: "
                    f"{sorted(_release_archs())}); this one holds {sorted(built)}")
    want = gpu_model.page(so, tool)
    got = (REPO / "bench" / "gpu_model.md").read_text()
    assert got == want, "bench/gpu_model.md is stale: run `python -m kl_kernels.bench.gpu_model --write`"


def test_a_long_row_is_not_a_serial_walk():
    """The forward's combine over one 8M-token row (4,096 tiles of 2,048): before the block-wide sum
    (csrc/cuda/tiles.cuh, combine_sequences) one thread walked the 4,096 tile slots, ~0.8 ms of
    dependent L2 round trips at 0.2 us, 40x the row's own streaming time at 3 TB/s (~22 us for fp32
    k-estimates in and out); now it must stay under the streaming time. Rows up to 16 later tiles keep
    the walk (16 steps: 3 us)."""
    assert gpu_model.combine_chain(16) == 16
    assert gpu_model.combine_chain(4096) * gpu_model.L2_ROUND_TRIP_US < 22
