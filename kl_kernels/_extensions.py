"""Load the compiled extensions without ever breaking ``import kl_kernels``.

``_C`` (CPU), ``_cuda`` (CUDA) and ``_cuda_emu`` (the CUDA kernels under host emulation, a test
instrument) are optional at import time: a wheel built without nvcc
has no ``_cuda``, a machine without a driver cannot use it, a broken build may fail to load.
Each failure is turned into a reason string that :func:`kl_kernels.info` and the backend
dispatcher report, instead of an exception at import.
"""

from __future__ import annotations

import functools
import importlib
from types import ModuleType

_WHY_MISSING = {
    "_C": "kl_kernels._C is not built (install kl_kernels from source or a wheel; "
          "a plain source checkout on sys.path has no compiled extension)",
    "_cuda": "kl_kernels._cuda is not built (this build had no nvcc, or KL_KERNELS_BUILD_CUDA=0)",
    "_cuda_emu": "kl_kernels._cuda_emu (the CUDA kernels under host emulation) is not built: release wheels "
                 "leave it out (KL_KERNELS_BUILD_CUDA_EMU=0); build from source on Linux, e.g. pip install -e .[test]",
}


@functools.lru_cache(maxsize=None)
def load(name: str) -> tuple[ModuleType | None, str | None]:
    """Import ``kl_kernels.<name>``; return ``(module, None)`` or ``(None, reason)``."""
    try:
        return importlib.import_module(f"kl_kernels.{name}"), None
    except ModuleNotFoundError as exc:
        if exc.name == f"kl_kernels.{name}":
            return None, _WHY_MISSING.get(name, f"kl_kernels.{name} is not built")
        return None, f"kl_kernels.{name} failed to import: {exc}"
    except Exception as exc:  # undefined symbols, ABI mismatch, ...: report, never raise
        return None, f"kl_kernels.{name} failed to load: {type(exc).__name__}: {exc}"


@functools.lru_cache(maxsize=None)
def probe(name: str) -> dict:
    """The extension's own build/runtime report, or ``{"error": reason}``."""
    module, reason = load(name)
    if module is None:
        return {"loaded": False, "error": reason}
    try:
        report = dict(module.probe())
    except Exception as exc:
        return {"loaded": True, "error": f"probe() failed: {type(exc).__name__}: {exc}"}
    report["loaded"] = True
    report["path"] = getattr(module, "__file__", None)
    return report


def kernel(name: str, symbol: str):
    """Return the compiled function ``symbol`` of extension ``name`` and ``None``, or
    ``None`` and the reason it is not there."""
    module, reason = load(name)
    if module is None:
        return None, reason
    fn = getattr(module, symbol, None)
    if fn is None:
        return None, (f"kl_kernels.{name} is built but has no {symbol} kernel "
                      "(this version ships only the build probe for it)")
    return fn, None
