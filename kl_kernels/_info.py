"""``kl_kernels.info()``: what is built, what can run here, and why not."""

from __future__ import annotations

import os
import platform
import sys

import torch

from . import _extensions
from .backends import BACKEND_NAMES, ENV_VAR
from .kl_penalty.backends import REGISTRY as PENALTY_REGISTRY
from .kl_reward.backends import REGISTRY
from .full_kl.backends import REGISTRY as FULL_KL_REGISTRY
from .token_logprobs.backends import REGISTRY as LOGPROBS_REGISTRY
from .version import __version__


def info() -> dict:
    """Build and runtime facts of this installation.

    Returns a dict with ``version``, ``torch``, ``python``, ``platform``, the
    ``KL_KERNELS_BACKEND`` override, each compiled extension's own report (``extensions``:
    ``_C``, ``_cuda``) and, for each backend (``torch``, ``cpu``, ``cuda``, ``triton``),
    ``{"available": bool, "reason": str | None, "devices", "dtypes", "layouts", "notes"}``,
    where ``reason`` lists every cause of unavailability (``kl_reward``'s backends; those of
    ``kl_penalty_loss`` are under ``kl_penalty_loss_backends``, those of ``token_logprobs`` under
    ``token_logprobs_backends``, those of ``full_kl`` under ``full_kl_backends``).

    Example::

        >>> import kl_kernels
        >>> kl_kernels.info()["backends"]["torch"]["available"]
        True
    """
    return {
        "version": __version__,
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "backend_override": os.environ.get(ENV_VAR) or None,
        "extensions": {name: _extensions.probe(name) for name in ("_C", "_cuda", "_cuda_emu")},
        "backends": {b.name: b.describe() for b in sorted(REGISTRY, key=lambda b: BACKEND_NAMES.index(b.name))},
        "kl_penalty_loss_backends": {b.name: b.describe() for b in PENALTY_REGISTRY},
        "token_logprobs_backends": {b.name: b.describe() for b in LOGPROBS_REGISTRY},
        "full_kl_backends": {b.name: b.describe() for b in FULL_KL_REGISTRY},
    }


# The CUDA runtime's own words for "this machine cannot run it", in plain terms (cudaGetDeviceCount's errors).
_PLAIN_CUDA_ERRORS = (
    ("driver version is insufficient", "no CUDA driver"),
    ("no CUDA-capable device", "no GPU visible"),
    ("CUDA driver is a stub library", "no CUDA driver"),
)


def extension_status(report: dict) -> tuple[str, str]:
    """One extension's state in plain words: ``(state, detail)``, e.g. ``("built (sm_90)", "not usable here: no
    CUDA driver")`` for ``_cuda`` on a machine without a GPU driver (the extension is fine; the machine
    cannot run it), ``("not built", why)``, or ``("built", "usable")``. ``report`` is one entry of
    ``info()["extensions"]``."""
    if not report.get("loaded"):
        error = report.get("error") or ""
        return ("not built" if "is not built" in error else "failed to load"), error
    archs = report.get("cuda_archs")
    if archs and archs != "emulated":
        state = "built (" + ", ".join(f"sm_{a.strip()}" for a in str(archs).replace(";", ",").split(",")) + ")"
    else:
        state = "built (CUDA kernels emulated on the CPU)" if archs == "emulated" else "built"
    error = report.get("error")
    if not error:
        return state, "usable"
    if "driver version is insufficient" in error and report.get("driver_version"):
        runtime = report.get("cuda_runtime_compiled") or 0
        return state, (f"not usable here: the CUDA driver ({report['driver_version'] // 1000}."
                       f"{report['driver_version'] % 1000 // 10}) is older than the CUDA runtime it was built with "
                       f"({runtime // 1000}.{runtime % 1000 // 10})")
    plain = next((words for pattern, words in _PLAIN_CUDA_ERRORS if pattern in error), error)
    return state, f"not usable here: {plain}"


_SHORT_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "float64": "fp64"}


def _plain(reason: str) -> str:
    """A backend's reason, the CUDA runtime's words for a machine without a GPU put plainly."""
    prefix = "CUDA runtime of kl_kernels._cuda: "
    if reason.startswith(prefix):
        error = reason[len(prefix):]
        return "kl_kernels._cuda cannot run here: " + next((w for p, w in _PLAIN_CUDA_ERRORS if p in error), error)
    return reason


def format_info(data: dict) -> str:
    """``kl-kernels info``'s text: the versions, one aligned row per extension and one per backend of
    each op (its devices, dtypes and whether it can run here, and why not)."""
    torch_build = f"CUDA {data['torch_cuda']}" if data.get("torch_cuda") else "CPU-only build"
    lines = [f"kl_kernels {data['version']}   torch {data['torch']} ({torch_build})   python {data['python']}",
             f"platform: {data['platform']}"]
    if data.get("backend_override"):
        lines.append(f"KL_KERNELS_BACKEND={data['backend_override']} (overrides backend='auto')")
    ext_rows = [(name, *extension_status(ext)) for name, ext in data["extensions"].items()]
    lines += ["", "compiled extensions:"] + _aligned(ext_rows)
    ops = [("kl_reward", data["backends"]), ("kl_penalty_loss", data.get("kl_penalty_loss_backends", {})),
           ("token_logprobs", data.get("token_logprobs_backends", {})), ("full_kl", data.get("full_kl_backends", {}))]
    rows, seen = [], {}
    for op, backends in ops:
        for name, b in backends.items():
            reasons = "; ".join(map(_plain, (b["reason"] or "").split("; ")))
            status = "available" if b["available"] else f"unavailable: {reasons}"
            key = (name, ",".join(b["devices"]), status)
            seen.setdefault(key, []).append((op, b))
    for (name, devices, status), entries in seen.items():
        b = entries[0][1]
        dtypes = ",".join(_SHORT_DTYPES.get(d, d) for d in b["dtypes"])
        ops_of = "all ops" if len(entries) == len(ops) else ", ".join(op for op, _ in entries)
        rows.append((name, devices, dtypes, ops_of, status))
    lines += ["", "backends (backend='auto' tries cuda, triton, cpu, torch; cuda-emulated only when named):"]
    lines += _aligned([("backend", "devices", "dtypes", "ops", "status"), *rows])
    return "\n".join(lines)


def _aligned(rows: list[tuple]) -> list[str]:
    """Rows of cells, every column but the last padded to its widest cell."""
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]) - 1)]
    return ["  " + "  ".join(f"{str(c):{w}s}" for c, w in zip(r, widths)) + "  " + str(r[-1]) for r in rows]
