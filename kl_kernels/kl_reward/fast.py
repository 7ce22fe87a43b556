"""kl_reward's eager fast lanes on the CPU: plain tensors, or lists of them, straight to the fused kernel.

The general path (``problem.py`` -> dispatch -> ``launch.py``) validates and builds the kernel's
arguments in Python: ~50 us a call with warm caches, ~300 us right after a model forward or any large
copy has evicted them, against ~30 us for the kernel itself at B = 256. For the commonest calls
(no ``prompt_lens`` or clamps; no gradient to record; a Python number or a float32 tensor, 0-d or
[B], as ``coef``) one C call checks everything and fills the arguments; Python only allocates the
outputs and launches:

* dense packed or padded CPU tensors: ``kl_reward_dense_plan`` (``csrc/cpu/dense_plan.cpp``);
* lists of per-sequence CPU tensors (a lazily stacked TorchRL batch), read in place with a
  per-token reward list or none: ``kl_reward_list_plan`` (``csrc/cpu/list_plan.cpp``), which reads
  each sample's tensors together in one pass; the per-sequence results are split off (and handed
  to ``store``) while the kernel runs, once ``kl_reward_list_readable`` has confirmed the flags the
  plan left for then (else the outputs are dropped and the general path runs).

The lanes never report an error: for anything else, every invalid input included, the plan is None
and the general path runs, raises and reports as always. ``tests/test_kl_reward_fast.py`` checks over
generated valid and invalid calls that whatever a lane takes, the general path returns bitwise the
same, and that the lanes take the common calls.
"""

from __future__ import annotations

import functools
import os
from typing import Callable, NamedTuple

import torch

from .. import _extensions, ragged
from ..backends import ENV_VAR
from ..launching import DTYPE_CODES, raise_for
from .launch import allocate_outputs
from .problem import KLRewardOutput, _check_out

_CPU = torch.device("cpu")
_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}  # the plans' dtype codes -> dtypes


class _Kernels(NamedTuple):
    dense_plan: Callable
    list_plan: Callable | None  # None: an extension built before the list lane (that lane is closed)
    list_readable: Callable | None
    forward: Callable
    forward_during: Callable | None


@functools.lru_cache(maxsize=None)
def _kernels() -> _Kernels | None:
    """The CPU extension's plans and forwards, or None without them (the lanes are then closed)."""
    found = {name: _extensions.kernel("_C", f"kl_reward_{name}")[0] for name in _Kernels._fields}
    if found["dense_plan"] is None or found["forward"] is None:
        return None
    if found["forward_during"] is None or found["list_readable"] is None:
        found["list_plan"] = None
    return _Kernels(**found)


def _open(backend) -> bool:
    """Whether the call may take a lane: eager (traced calls take the registered op), and for the cpu
    backend ("auto" is it unless the environment names another one; any other backend name, or a bad
    one, goes the general way)."""
    return not torch.compiler.is_compiling() and (backend == "cpu" or (
        backend == "auto" and os.environ.get(ENV_VAR, "").strip() in ("", "auto", "cpu")))


def try_run(log_probs, ref_log_probs, reward, coef, estimator, mask, offsets, lengths, padding_side,
            reward_placement, return_ref, detach, mask_nan, backend,
            store: Callable[[KLRewardOutput], None] | None = None, out=None) -> KLRewardOutput | None:
    """``kl_reward``'s result through a fast lane, or None when the call is not for one. The arguments
    are ``kl_reward``'s (``store`` as for ``kl_reward_storing``: called with the outputs before they
    are returned); the caller has checked that ``prompt_lens``, ``clamp_input`` and ``clamp_output``
    are None."""
    if not _open(backend):  # first: a traced call must not reach the extension lookup
        return None
    kernels = _kernels()
    if kernels is None:
        return None
    if isinstance(log_probs, (list, tuple)):
        if kernels.list_plan is None or offsets is not None or lengths is not None or out is not None:
            return None
        return _run_list(kernels, log_probs, ref_log_probs, reward, coef, estimator, mask, padding_side,
                         reward_placement, return_ref, detach, mask_nan, store)
    plan = kernels.dense_plan(torch.Tensor, log_probs, ref_log_probs, reward, mask, offsets, lengths, coef, estimator,
                              padding_side, reward_placement, return_ref, detach, mask_nan, torch.is_grad_enabled())
    if plan is None:
        return None
    args, reward_code, trailing = plan
    given = None
    if out is not None:  # the caller's buffers, checked as the general path checks them (problem.py)
        given = _check_out(out, "packed" if log_probs.dim() == 1 else "padded", log_probs, ref_log_probs,
                           _DTYPES[reward_code], trailing, args.batch, return_ref, False,
                           (("log_probs", log_probs), ("ref_log_probs", ref_log_probs), ("mask", mask),
                            ("reward", reward), ("offsets", offsets), ("lengths", lengths), ("coef", coef)))
    kl, reward_out, ref_out, kl_sum, count = allocate_outputs(args, log_probs.shape, log_probs.dtype,
                                                              _DTYPES[reward_code], _CPU, return_ref, given)
    raise_for(kernels.forward(args, torch.get_num_threads()), None, "kl_reward")
    result = KLRewardOutput(kl, reward_out.unsqueeze(-1) if trailing else reward_out, ref_out, kl_sum, count)
    if out is not None:  # the caller's own tensors (not views of them)
        result = KLRewardOutput(*(r if o is None else o for o, r in zip(out, result)))
    out = result
    if store is not None:
        store(out)
    return out


def _run_list(kernels: _Kernels, log_probs, ref_log_probs, reward, coef, estimator, mask, padding_side,
              reward_placement, return_ref, detach, mask_nan, store) -> KLRewardOutput | None:
    plan = kernels.list_plan(torch.Tensor, log_probs, ref_log_probs, reward, mask, coef, estimator, padding_side,
                             reward_placement, return_ref, detach, mask_nan, torch.is_grad_enabled())
    if plan is None:
        return None
    args, dtype_code, reward_code, trailing, lengths, keep = plan  # keep: what args points into
    kl, reward_out, ref_out, kl_sum, count = allocate_outputs(args, (args.total,), _DTYPES[dtype_code],
                                                              _DTYPES[reward_code], _CPU, return_ref)
    done = []

    def split():
        # Runs while the kernel writes the outputs: views and stores only (see launch.forward_during).
        # First the flags the plan left out (list_plan.cpp): when one is set (a negative bit, or a
        # log-prob requiring grad under autograd), nothing is handed out and the general path runs.
        if not kernels.list_readable(keep):
            return
        out = KLRewardOutput(ragged.to_list(kl, None, lengths),
                             ragged.to_list(reward_out.unsqueeze(-1) if trailing else reward_out, None, lengths),
                             None if ref_out is None else ragged.to_list(ref_out, None, lengths), kl_sum, count)
        done.append(out)
        if store is not None:
            store(out)

    raise_for(kernels.forward_during(args, torch.get_num_threads(), split), None, "kl_reward")
    del keep
    return done[0] if done else None
