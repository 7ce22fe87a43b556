"""Load the compiled extensions without ever breaking ``import kl_kernels``.

``_C`` (CPU), ``_cuda`` (CUDA) and ``_cuda_emu`` (the CUDA kernels under host emulation, a test
instrument) are optional at import time: a wheel built without nvcc
has no ``_cuda``, a machine without a driver cannot use it, a broken build may fail to load.
Each failure is turned into a reason string that :func:`kl_kernels.info` and the backend
dispatcher report, instead of an exception at import. A missing one is explained in the build's own words
(:func:`build_record`). :func:`raise_for` turns a compiled kernel's return code into an exception.

The ground floor of the package's core: it imports nothing of kl_kernels.
"""

from __future__ import annotations

import functools
import importlib
import json
from pathlib import Path
from types import ModuleType

# Why an extension is missing when no build record says (a source checkout on sys.path, never built).
_WHY_MISSING = {
    "_C": "kl_kernels._C is not built (install kl_kernels from source or a wheel; "
          "a plain source checkout on sys.path has no compiled extension)",
    "_cuda": "kl_kernels._cuda is not built (a build makes it when nvcc and a GPU are there, or when asked: "
             "KL_KERNELS_BUILD_CUDA=1)",
    "_cuda_emu": "kl_kernels._cuda_emu (the CUDA kernels under host emulation, a test instrument) is not built: "
                 "it is built only when asked (KL_KERNELS_BUILD_CUDA_EMU=1 pip install -e .)",
}


@functools.lru_cache(maxsize=None)
def build_record() -> dict:
    """What the build that made this installation decided (``kl_kernels/_build.json``, written by setup.py
    next to the extensions): ``built`` (the extensions' names), and for ``_cuda`` and ``_cuda_emu`` the
    build's own words on why it built or skipped each, e.g. ``"_cuda skipped: nvcc found but no GPU visible
    (...)"``. ``{}`` when there is none (a checkout never built)."""
    try:
        return json.loads((Path(__file__).parent / "_build.json").read_text())
    except (OSError, ValueError):
        return {}


def why_missing(name: str) -> str:
    """Why ``kl_kernels.<name>`` is not there, in the build's own words when it left a record."""
    said = build_record().get(name)
    if said and name not in build_record().get("built", ()):
        return f"kl_kernels.{name} is not built: the build skipped it: {said.removeprefix(f'{name} skipped: ')}"
    return _WHY_MISSING.get(name, f"kl_kernels.{name} is not built")


@functools.lru_cache(maxsize=None)
def load(name: str) -> tuple[ModuleType | None, str | None]:
    """Import ``kl_kernels.<name>``; return ``(module, None)`` or ``(None, reason)``."""
    try:
        return importlib.import_module(f"kl_kernels.{name}"), None
    except ModuleNotFoundError as exc:
        if exc.name == f"kl_kernels.{name}":
            return None, why_missing(name)
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


def raise_for(code: int, module, what: str) -> None:
    """A compiled kernel's return code (0: success; the codes every binding of ``_C``, ``_cuda`` and
    ``_cuda_emu`` returns) as a RuntimeError naming ``what``; ``module``: the extension that ran it (its
    ``error_string`` words a CUDA error, ``code - 1000``)."""
    if code == 1:
        raise RuntimeError(f"{what} kernel: unsupported dtype combination")
    if code == 2:
        raise RuntimeError(f"{what} kernel: too many tokens for one launch")
    if code == 3:
        raise RuntimeError(f"{what} kernel: list inputs, mask_nan and batch totals are for the CPU forward only")
    if code == 4:
        raise RuntimeError(f"{what} kernel: the aggregation on the device (result, g_loss) is the CUDA kernels' only")
    if code == 5:
        raise RuntimeError(f"{what} kernel: an output buffer is missing")
    if code >= 1000:
        raise RuntimeError(f"{what} CUDA kernel launch failed: {module.error_string(code - 1000)}")
    if code != 0:
        raise RuntimeError(f"{what} kernel failed with code {code}")
