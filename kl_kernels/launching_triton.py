"""Triton launch machinery shared by every op's Triton launcher (``kl_kernels/<op>/launch_triton.py``):
the autotune configurations and the tile each program covers, the interpreter's tile size, and
launching a tile kernel over the flat token space. No op owns this module.

On a GPU the tile kernels are autotuned over ``GPU_CONFIGS`` keyed on the token count rounded up to a
power of two (``size_bucket``), so ragged batches of similar size reuse one tuned configuration. The
forward kernels' configurations depend on the log-probs' element size (``forward_configs``): each
thread holds 16 bytes of every flat input, one 128-bit load (4 fp32 elements, 8 bf16/fp16 ones).
Under Triton's interpreter (``TRITON_INTERPRET=1``, CPU tensors) there is nothing to time: the tile
is chosen so that a batch spans about eight tiles (16 to 1024 elements), which keeps the
interpreter's per-program cost bounded and still makes small test batches cross tile boundaries.
"""

from __future__ import annotations

import math

import torch

from . import device_errors, value_checks

# (BLOCK, num_warps) pairs the tile kernels are tuned over on a GPU: 4 elements per thread.
GPU_CONFIGS = ((512, 4), (1024, 8))
# The forward kernels' pairs by the log-probs' element size in bytes: 16 bytes per thread, so a flat
# input is read with 128-bit loads (tests/test_triton_static.py). 16-bit inputs hold 8 elements per
# thread, which costs registers (~185-250 against ~110-128 at 4): they keep 4 or 2 warps, so at least
# 2 blocks still fit an SM; an 8-warp block of them would fit only one.
FORWARD_CONFIGS = {4: GPU_CONFIGS, 2: ((1024, 4), (512, 2))}
MIN_BLOCK = min(b for cfgs in (GPU_CONFIGS, *FORWARD_CONFIGS.values()) for b, _ in cfgs)
INTERPRETER_TILES = 8
COMBINE_BLOCK = 128
# The combine kernels add a row's later tiles COMBINE_CHUNK at a time (triton/tiles.py, later_tiles),
# over [rows, COMBINE_CHUNK] slots per step: few rows per program keep that in registers (kl_reward's
# three slot streams, the loss's six sums per slot).
COMBINE_CHUNK = 16
REWARD_COMBINE_BLOCK = 32
PENALTY_COMBINE_BLOCK = 8


def kernel_set(fwd, combine, bwd):
    """The (forward, combine, backward) Triton kernels as launched: forward and backward wrapped in
    the autotuner on a GPU, as they are under the interpreter."""
    import triton

    from .triton import interpreting

    if interpreting():
        return fwd, combine, bwd
    configs = [triton.Config({"BLOCK": b}, num_warps=w) for b, w in GPU_CONFIGS]
    fwd_configs = [triton.Config({"BLOCK": b}, num_warps=w) for cfgs in FORWARD_CONFIGS.values() for b, w in cfgs]
    return (triton.autotune(fwd_configs, key=["size_bucket"],
                            prune_configs_by={"early_config_prune": _by_element_size})(fwd), combine,
            triton.autotune(configs, key=["size_bucket"])(bwd))


def forward_configs(element_size: int):
    """The forward kernels' (BLOCK, num_warps) pairs for log-probs of this element size in bytes
    (sizes without their own entry take the 4-byte ones)."""
    return FORWARD_CONFIGS.get(element_size, GPU_CONFIGS)


def _by_element_size(configs, named_args, **kwargs):
    """Autotuner pruning: the configs of the log-probs' element size (the autotuner's cache key
    holds every tensor argument's dtype, so each dtype is tuned on its own)."""
    want = set(forward_configs(named_args["lp_ptr"].element_size()))
    return [c for c in configs if (c.kwargs["BLOCK"], c.num_warps) in want]


def tuned(kernel) -> bool:
    return hasattr(kernel, "configs")


def interpreter_block(total: int) -> int:
    return min(1024, max(16, 1 << (max(1, math.ceil(total / INTERPRETER_TILES)) - 1).bit_length()))


def size_bucket(n: int) -> int:
    return 1 << max(10, (max(n, 1) - 1).bit_length())


def readable_flat(x: torch.Tensor | None, layout: int) -> bool:
    """Readable at the flat output index (contiguous in the layout's shape)?"""
    if x is None:
        return True
    if layout == 0:
        return x.stride(0) == 1 or x.shape[0] <= 1
    return x.is_contiguous()


def or_dummy(x, dummy):
    return dummy if x is None else x


def launch_tiles(kernel, total: int, args, flags) -> int:
    """Launch a tile kernel, one program per ``BLOCK`` elements of the flat token space: the
    autotuned ``BLOCK`` on a GPU, the interpreter's tile otherwise. Returns the ``BLOCK`` used. First, a
    bad value recorded in the device's error word (kl_kernels.device_errors) is raised (no sync)."""
    device_errors.raise_pending(args[0].device)
    if value_checks.DEFERRED.pending:  # a validation's deferred value checks (the Triton kernels fold none)
        value_checks.flush_deferred()
    if tuned(kernel):
        kernel[lambda meta: (triton_cdiv(total, meta["BLOCK"]),)](*args, **flags)
        return kernel.best_config.kwargs["BLOCK"]
    block = interpreter_block(total)
    kernel[(triton_cdiv(total, block),)](*args, **flags, BLOCK=block)
    return block


def triton_cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b
