"""Compat module for Triton's interpreter (the tests' only use of its internals): a vectorized scan.

Under ``TRITON_INTERPRET=1``, ``tl.associative_scan`` with a combine function of our own (the
segmented sums of ``kl_kernels/triton/kl_math.py``: every forward kernel scans five or six values
per tile) runs element by element in Python: the interpreter's ``ScanOps.generic_scan`` calls the
combine function once per element, on scalars. That was most of the suite's time (seconds per small
test; a 4,811-token case took 12 of its 13 s in it).

``install()`` replaces that one method with a log-step (Hillis-Steele) scan: ``ceil(log2 n)`` calls of
the same combine function on whole shifted arrays. For an associative combine function (what
``tl.associative_scan`` requires, and what a GPU's compiled scan relies on too: it combines in a tree
of warp shuffles, not left to right) the results are the same values; float sums may round
differently in the last bit, as they do between the interpreter and a GPU. NaN/inf isolation is the
combine function's own and holds in any order. ``tests/test_triton_interpreter.py`` holds the patched
scan to the interpreter's own on segmented, multi-value, reversed and 2-D scans.

Version-gated: only for the Triton versions whose interpreter was read (``SUPPORTED``) and when the
internals look as expected; otherwise nothing is patched and the interpreter's own (slow, correct)
scan runs. ``KL_KERNELS_SLOW_SCAN=1`` keeps the interpreter's own scan on purpose.
"""

from __future__ import annotations

import os

SUPPORTED = ("3.",)  # Triton major versions whose interpreter's ScanOps was read for this
_original = None


def why_not() -> str | None:
    """Why the vectorized scan is not installed here, or None when it can be."""
    if os.environ.get("KL_KERNELS_SLOW_SCAN") == "1":
        return "KL_KERNELS_SLOW_SCAN=1"
    try:
        import triton
        from triton.runtime import interpreter
    except ImportError:
        return "triton is not installed"
    if not triton.__version__.startswith(SUPPORTED):
        return f"triton {triton.__version__} is not one of {SUPPORTED}"
    ops = getattr(interpreter, "ScanOps", None)
    if ops is None or not all(hasattr(ops, a) for a in ("generic_scan", "to_tensor", "apply_impl")):
        return "triton's interpreter has no ScanOps.generic_scan/to_tensor"
    return None


def _log_step_scan(self, input):
    import numpy as np
    import triton.language as tl

    axis = self.axis
    out = [np.array(arg.handle.data, copy=True) for arg in input]
    n = out[0].shape[axis]
    tail = [slice(None)] * out[0].ndim
    step = 1
    while step < n:
        # Whole arrays (the interpreter's tensors must keep power-of-two shapes): lane i combines lane
        # i - step with itself; lanes below step take nothing (their rolled-in left sides are discarded).
        acc = tuple(self.to_tensor(np.roll(o, step, axis=axis), input[i].dtype) for i, o in enumerate(out))
        cur = tuple(self.to_tensor(o.copy(), input[i].dtype) for i, o in enumerate(out))
        got = self.combine_fn.fn(*acc, *cur)
        got = got if isinstance(got, tuple) else (got,)
        tail[axis] = slice(step, n)
        for j, o in enumerate(out):  # every combine of this step read the previous step's values (copies)
            v = got[j].handle.data if isinstance(got[j], tl.core.tensor) else np.broadcast_to(got[j], o.shape)
            o[tuple(tail)] = v[tuple(tail)]
        step *= 2
    return [self.to_tensor(o, input[i].dtype) for i, o in enumerate(out)]


def install() -> bool:
    """Patch the interpreter's generic scan (idempotent). Returns whether it is patched."""
    global _original
    if _original is not None:
        return True
    if why_not() is not None:
        return False
    from triton.runtime import interpreter

    _original = interpreter.ScanOps.generic_scan
    interpreter.ScanOps.generic_scan = _log_step_scan
    return True


def original_scan():
    """The interpreter's own generic scan (patched or not)."""
    from triton.runtime import interpreter

    return _original or interpreter.ScanOps.generic_scan
