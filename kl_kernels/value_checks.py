"""Value checks of index tensors (offsets, lengths, prompt_lens) on accelerators, and their deferral.

Where a value check reads its tensor (:func:`checks_on_host`): on the host for CPU tensors (a ``ValueError`` at
once), on the device otherwise: one launch of a check kernel (:func:`kernel_check`, csrc/cuda/ragged_checks.cu)
that records a bad value in the device's error word (:mod:`kl_kernels.device_errors`), no host sync. A
validation defers those launches to the launch that follows it (:func:`deferring`), where the CUDA forwards of
kl_reward and kl_penalty_loss fold them into their own combine kernels (``launching.fold_value_checks``).

:func:`check_errors` (``kl_kernels.check_errors``) launches what is deferred, waits for the device and raises
what its error word holds.

Shared machinery below the ops: it imports no op. The layer of the value checks, from the ground up:
:mod:`~kl_kernels.device_errors` (the error word), this module (where and when a check runs),
:mod:`~kl_kernels.index_checks` (the checks of offsets and lengths); the layouts and the launchers stand
on them (``tests/test_structure.py`` holds that order).
"""

from __future__ import annotations

import os
import threading

import torch

from . import _extensions, codes, device_errors
from ._compat import torch as torch_compat


def values_checkable(t: torch.Tensor) -> bool:
    """Whether the value checks may read ``t``: not while torch.compile traces (a host sync would
    break the graph) and not on the meta device, which holds no values (dispatch then reports that
    no backend runs on meta, instead of a failed read here)."""
    return not torch.compiler.is_compiling() and t.device.type != "meta"


SYNC_CHECKS_ENV = "KL_KERNELS_SYNC_CHECKS"


def checks_on_host(t: torch.Tensor) -> bool:
    """Whether the value checks of ``t`` read its values on the host, raising ``ValueError``: always
    for CPU tensors; for accelerator tensors only with ``KL_KERNELS_SYNC_CHECKS=1`` (one host
    synchronization per call, for debugging). Otherwise they run on the device and record a bad value in
    its error word (:mod:`kl_kernels.device_errors`): no host synchronization, CUDA-graph capturable, the
    ``ValueError`` raised at the next call of ours on the device or at ``kl_kernels.check_errors()``."""
    return t.device.type == "cpu" or os.environ.get(SYNC_CHECKS_ENV, "").strip() == "1"


def device_check(ok: torch.Tensor, message: str) -> None:
    """Assert ``ok`` (a bool tensor on an accelerator) without reading it on the host
    (``torch._assert_async``): a device-side assertion, after which the CUDA context is unusable. Left
    only for the checks that have no error-word kind (a mismatch of two tensors' sequence lengths); value
    checks record in the error word instead (:func:`kernel_check`, :func:`device_errors.record_where`)."""
    torch_compat.assert_async(ok, f"kl_kernels: {message}")


def kernel_check(kernel: str, values: torch.Tensor, batch: int, bound: int, *per_sequence, name: str,
                 bound_kind: int = -1) -> bool:
    """Enqueue the value check ``kernel`` (``"offsets_valid"`` or ``"lengths_valid"``,
    csrc/cuda/ragged_checks.cu) of CUDA tensor ``values`` (int64, contiguous) on the current stream; a bad
    value is recorded in the device's error word as argument ``name`` (kl_kernels.device_errors).
    ``lengths_valid`` takes two more: ``offsets`` and ``seq_lengths`` (each a tensor or None), the
    per-sequence bounds of a packed or padded batch's ``prompt_lens`` (else ``bound``), and
    ``bound_kind`` (prompt_lens: the index of their bound in ``device_errors.SEQUENCE_BOUNDS``). One
    launch where the same check in torch operations takes five or six. False when it cannot run (not
    contiguous int64 CUDA tensors, no ``_cuda`` kernel): the caller checks with torch operations."""
    given = [t for t in (values, *per_sequence) if t is not None]
    if any(t.device.type != "cuda" or t.dtype != torch.int64 or not t.is_contiguous() for t in given):
        return False
    fn, reason = _extensions.kernel("_cuda", kernel)  # (loads the extension at the first check, not at import)
    if reason:
        return False
    with torch.cuda.device(values.device):
        code = launch_check(fn, values, batch, bound, *per_sequence, name=name, bound_kind=bound_kind,
                            stream=torch.cuda.current_stream(values.device).cuda_stream)
    _extensions.raise_for(code, _extensions.load("_cuda")[0], f"the {kernel} check")  # the kernels' one table of codes
    return True


# --------------------------------------------------------------------------- value checks folded into kernels
# A validation (each op's problem.py: build_problem, a plan's CallChecks) defers the check launches of
# :func:`kernel_check` between :func:`defer_checks` and :func:`stop_deferring`: they wait on this thread for the
# launch that follows. The CUDA forwards of kl_reward and kl_penalty_loss take over those they cover (their
# combine kernels check the same values and record the same finding: launching.fold_value_checks); any other
# launch, backend or read of the word launches them first (:func:`flush_deferred`: launching.launch_kernel,
# Triton's launch_tiles, backends.select for a backend that folds nothing, check_errors, the next validation).
# So a check is never lost, at worst launched later than the validation that asked for it.


class _Deferred(threading.local):
    def __init__(self):  # (run once per thread)
        self.active = False  # a validation is deferring its check launches
        self.pending = []  # kernel_check's arguments of the checks waiting for the next launch


DEFERRED = _Deferred()


def defer_checks() -> None:
    """Start deferring :func:`kernel_check` launches on this thread (launching what an earlier validation left
    unlaunched first)."""
    if DEFERRED.pending:
        flush_deferred()
    DEFERRED.active = True


def stop_deferring() -> None:
    """Stop deferring; the deferred checks wait for the next launch (:func:`take_deferred`)."""
    DEFERRED.active = False


def deferring(validate, *args, **kwargs):
    """``validate(*args, **kwargs)`` (an op's validation) with its value checks deferred (:func:`defer_checks`)
    to the launch that follows; a validation that fails launches them at once."""
    defer_checks()
    try:
        return validate(*args, **kwargs)
    except BaseException:
        flush_deferred()
        raise
    finally:
        stop_deferring()


def take_deferred() -> list:
    """The deferred checks (each ``(kernel, values, batch, bound, per_sequence, name, bound_kind)``), no longer
    pending: the caller folds them into its kernel or launches them (:func:`launch_deferred`)."""
    pending = DEFERRED.pending
    DEFERRED.pending = []
    return pending


def launch_deferred(entry) -> None:
    """Launch one deferred check now, as :func:`kernel_check` would have."""
    kernel, values, batch, bound, per_sequence, name, bound_kind = entry
    kernel_check(kernel, values, batch, bound, *per_sequence, name=name, bound_kind=bound_kind)


def flush_deferred() -> None:
    """Launch every deferred check of this thread now (and stop deferring)."""
    DEFERRED.active = False
    for entry in take_deferred():
        launch_deferred(entry)


def deferrable(kernel: str, *tensors) -> bool:
    """Whether :func:`kernel_check` would launch ``kernel`` on ``tensors`` (the values and their per-sequence
    bounds, None where absent): CUDA int64 contiguous tensors and the ``_cuda`` check kernel."""
    if any(t is not None and (t.device.type != "cuda" or t.dtype != torch.int64 or not t.is_contiguous())
           for t in tensors):
        return False
    return not _extensions.kernel("_cuda", kernel)[1]


def value_check(kernel: str, values: torch.Tensor, batch: int, bound: int, *per_sequence, name: str,
                bound_kind: int = -1) -> bool:
    """:func:`kernel_check`, deferred while a validation defers (see above): then True without a launch."""
    if DEFERRED.active and deferrable(kernel, values, *per_sequence):
        DEFERRED.pending.append((kernel, values, batch, bound, per_sequence, name, bound_kind))
        return True
    return kernel_check(kernel, values, batch, bound, *per_sequence, name=name, bound_kind=bound_kind)


def launch_check(fn, values: torch.Tensor, batch: int, bound: int, *per_sequence, name: str, bound_kind: int = -1,
                 stream: int) -> int:
    """Call check kernel ``fn`` (a ``_cuda`` or ``_cuda_emu`` binding) the way :func:`kernel_check` does,
    recording into the error word of ``values``' device: the launch's error code. Shared so that the tests
    run every call site's arguments through the emulated kernels on the CPU."""
    errors = device_errors.word(values.device).address
    arg = codes.ARG_CODES.get(name, 0)
    if per_sequence:
        extra = [0 if t is None else t.data_ptr() for t in per_sequence]
        return fn(values.data_ptr(), batch, bound, *extra, errors, arg, bound_kind, stream)
    return fn(values.data_ptr(), batch, bound, errors, arg, stream)


def check_errors(device=None) -> None:
    """Raise the ``ValueError`` of a bad value that a kl_kernels kernel found on ``device`` (default: the
    current CUDA device; CPU: the emulated kernels' word), waiting for the work queued so far first.

    Checks of accelerator tensors' values (``offsets``, ``lengths``, ``prompt_lens``, ``token_logprobs``'
    labels) run inside the kernels and never sync; a bad value surfaces at the next kl_kernels call on the
    device, or here: this synchronizes the current stream of ``device`` and then reads the error word.
    Until then the outputs of the bad call hold NaN for the affected sequences.

    Example::

        out = kl_kernels.kl_reward(lp, ref, score, offsets=cu_seqlens)   # no sync
        kl_kernels.check_errors()          # ValueError: offsets must be non-decreasing ... (if they were not)
    """
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if DEFERRED.pending:  # value checks a validation deferred to a launch that did not come
        flush_deferred()
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
    device_errors.raise_pending(device)
