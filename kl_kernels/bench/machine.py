"""Provenance of a benchmark run, and the machine's measured copy bandwidth."""

from __future__ import annotations

import ctypes
import os
import platform
import subprocess
import time
from pathlib import Path

import torch

from ..version import __version__


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _git_commit() -> str | None:
    try:
        here = Path(__file__).resolve().parents[2]
        out = subprocess.run(["git", "-C", str(here), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=5)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def keep_freed_memory() -> str:
    """Make glibc reuse freed large blocks instead of unmapping them (bench only).

    By default glibc serves every multi-MB temporary with a fresh mmap and unmaps it on free,
    so eager torch code pays a page fault per 4 KiB touched on every call: on the 2-core CI
    machine that was ~70% of the eager reference's time and swung 3x between runs depending on
    heap state. Raising the mmap and trim thresholds (what jemalloc/tcmalloc-based RL stacks get
    anyway) measures the code, not the page-fault lottery. Returns what was done.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
        m_trim_threshold, m_mmap_threshold = -1, -3
        ok = libc.mallopt(m_mmap_threshold, 32 * 2**20) and libc.mallopt(m_trim_threshold, 2**31 - 1)
    except (OSError, AttributeError):
        return "system default (not glibc)"
    return "glibc, mmap threshold 32 MiB, no trimming" if ok else "system default (mallopt refused)"


def minor_faults() -> int:
    """Minor page faults of this process so far (0 where getrusage is unavailable)."""
    try:
        import resource
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    except (ImportError, OSError):
        return 0


def describe(device: torch.device) -> dict:
    """Machine and software facts to store next to every result."""
    facts = {
        "kl_kernels": __version__,
        "git_commit": _git_commit(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "device": str(device),
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        facts.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1),
                     cuda=torch.version.cuda, driver=_nvidia_driver())
    return facts


def _nvidia_driver() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError, IndexError):
        return None


def copy_bandwidth_gbs(device: torch.device, nbytes: int = 256 * 2**20, repeats: int = 7) -> float:
    """Best-of-``repeats`` ``dst.copy_(src)`` bandwidth, counting read + write (STREAM 'copy')."""
    from .timing import measure
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    t = measure(lambda: dst.copy_(src), device, warmup=2, repeats=repeats, budget_s=5.0)
    return 2 * nbytes / (t.min_ms * 1e-3) / 1e9
