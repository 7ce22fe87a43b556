"""kl_reward's eager fast lane on the CPU: plain dense tensors straight to the fused kernel.

The general path (``problem.py`` -> dispatch -> ``launch.py``) validates and builds the kernel's
arguments in Python: ~50 us a call with warm caches, ~300 us right after a model forward or any large
copy has evicted them, against ~30 us for the kernel itself at B = 256. For the commonest call (dense
packed or padded CPU tensors that need no gradient, a Python number or a float32 tensor, 0-d or [B], as
``coef``, and no ``prompt_lens``, clamps or ``mask_nan``) one C call, ``kl_reward_dense_plan`` in
``csrc/cpu/dense_plan.cpp``, checks everything and fills the arguments; Python only allocates the
outputs and launches.

The lane never reports an error: for anything else, every invalid input included, the plan is None
and the general path runs, raises and reports as always. ``tests/test_kl_reward_fast.py`` checks over
generated valid and invalid calls that whatever the lane takes, the general path returns bitwise the
same, and that the lane takes the common calls.
"""

from __future__ import annotations

import functools
import os

import torch

from .. import _extensions
from ..backends import ENV_VAR
from .launch import DTYPE_CODES, allocate_outputs, raise_for
from .problem import KLRewardOutput

_CPU = torch.device("cpu")
_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}  # the plan's reward dtype code -> dtype


@functools.lru_cache(maxsize=None)
def _kernels():
    """(plan, forward) of the CPU extension, or None without them (the lane is then closed)."""
    plan, _ = _extensions.kernel("_C", "kl_reward_dense_plan")
    forward, _ = _extensions.kernel("_C", "kl_reward_forward")
    return (plan, forward) if plan is not None and forward is not None else None


def try_run(log_probs, ref_log_probs, reward, coef, estimator, mask, offsets, lengths, padding_side,
            reward_placement, return_ref, detach, backend) -> KLRewardOutput | None:
    """``kl_reward``'s result through the fast lane, or None when the call is not for it. The
    arguments are ``kl_reward``'s; the caller has checked that ``prompt_lens``, ``clamp_input``,
    ``clamp_output`` are None and ``mask_nan`` is False."""
    # Traced calls take the general path (the registered op); "auto" here is the cpu backend unless
    # the environment names another one (any other backend name, or a bad one, goes the general way).
    if torch.compiler.is_compiling() or (backend != "cpu" and (
            backend != "auto" or os.environ.get(ENV_VAR, "").strip() not in ("", "auto", "cpu"))):
        return None
    kernels = _kernels()
    if kernels is None:
        return None
    plan = kernels[0](torch.Tensor, log_probs, ref_log_probs, reward, mask, offsets, lengths, coef, estimator,
                      padding_side, reward_placement, return_ref, detach, torch.is_grad_enabled())
    if plan is None:
        return None
    args, reward_code, trailing = plan
    kl, reward_out, ref_out, kl_sum, count = allocate_outputs(args, log_probs.shape, log_probs.dtype,
                                                              _DTYPES[reward_code], _CPU, return_ref)
    raise_for(kernels[1](args, torch.get_num_threads()), None, "kl_reward")
    return KLRewardOutput(kl, reward_out.unsqueeze(-1) if trailing else reward_out, ref_out, kl_sum, count)
