"""Compat module for Triton's interpreter (the tests' only use of its internals): two speed-ups.

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

Second: every call of a ``@triton.jit`` helper from a kernel (our kernels call a dozen per tile:
the KL formulas, the segment sums) re-patches the language (``_patch_lang``), and each of its five
``_patch_builtin`` calls walks every member of ``tl``/``tl.core``/``tl.tensor``/``tl.math`` with
``inspect.getmembers`` to find the builtins: a third of the interpreter's time in the adversarial sweep
(38,731 walks for 211 calls). ``install()`` finds each package's builtin names once (no launch is
running then, so nothing is patched yet) and later looks at only those names; it patches exactly
what the original would (a member that is still a builtin), in the same order. Packages it has not
seen go through the original.

Version-gated: only for the Triton versions whose interpreter was read (``SUPPORTED``) and when the
internals look as expected; otherwise nothing is patched and the interpreter's own (slow, correct)
code runs. ``KL_KERNELS_SLOW_SCAN=1`` keeps the interpreter's own code on purpose.
"""

from __future__ import annotations

import os

SUPPORTED = ("3.",)  # Triton major versions whose interpreter's ScanOps was read for this
_original = None
_original_patch_builtin = None
_builtin_names: dict = {}  # package (module or class) -> its builtin members' names, getmembers order


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
    if not all(callable(getattr(interpreter, f, None)) for f in ("_patch_builtin", "_patch_attr", "_patch_lang")):
        return "triton's interpreter has no _patch_builtin/_patch_attr/_patch_lang"
    return None


def _packages():
    """What the interpreter's ``_patch_lang`` hands ``_patch_builtin`` (Triton 3.x)."""
    import triton.language as tl

    pkgs = [tl, tl.core, tl.tensor, tl.math]
    base = getattr(tl.core, "tensor_descriptor_base", None)
    return pkgs + ([base] if base is not None else [])


def _cached_patch_builtin(pkg, builder, scope):
    import triton.language as tl
    from triton.runtime import interpreter

    names = _builtin_names.get(pkg)
    if names is None:  # a package install() did not see: the original walk
        return _original_patch_builtin(pkg, builder, scope)
    for name in names:
        member = getattr(pkg, name)
        if tl.core.is_builtin(member):  # not already patched by an enclosing launch
            interpreter._patch_attr(pkg, name, member, builder, scope)


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


def builtin_names(pkg) -> tuple:
    """The names of ``pkg``'s builtin members, as the interpreter's walk finds them (getmembers order)."""
    import inspect

    import triton.language as tl

    return tuple(name for name, member in inspect.getmembers(pkg) if tl.core.is_builtin(member))


def install() -> bool:
    """Patch the interpreter's generic scan and builtin walk (idempotent; call it while no kernel runs).
    Returns whether they are patched."""
    global _original, _original_patch_builtin
    if _original is not None:
        return True
    if why_not() is not None:
        return False
    from triton.runtime import interpreter

    for pkg in _packages():
        _builtin_names[pkg] = builtin_names(pkg)
    _original_patch_builtin = interpreter._patch_builtin
    interpreter._patch_builtin = _cached_patch_builtin
    _original = interpreter.ScanOps.generic_scan
    interpreter.ScanOps.generic_scan = _log_step_scan
    return True


def original_scan():
    """The interpreter's own generic scan (patched or not)."""
    from triton.runtime import interpreter

    return _original or interpreter.ScanOps.generic_scan


def original_patch_builtin():
    """The interpreter's own builtin walk (patched or not)."""
    from triton.runtime import interpreter

    return _original_patch_builtin or interpreter._patch_builtin
