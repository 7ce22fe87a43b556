"""Backend declarations and dispatch, shared by every op.

Each op keeps an ordered registry of :class:`Backend` objects (its preference order). A backend
*declares* what it supports (devices, dtypes, layouts, a token limit) and how to check that it
is present (extension built and loaded, kernel compiled, device visible). Dispatch:

* ``backend="auto"``: the first backend that accepts the inputs. The environment variable
  ``KL_KERNELS_BACKEND`` overrides ``"auto"`` (and only ``"auto"``) with an explicit name. On the
  devices in a backend's ``self_check_devices`` (the GPU kernels on ``cuda``, which CI never runs
  on a GPU), ``"auto"`` takes it only once it has passed the first-use self-check there
  (:mod:`kl_kernels.selfcheck`); a failure is logged and ``"auto"`` moves on.
* an explicit name: that backend, or :class:`BackendUnavailableError` listing every reason it
  cannot run these inputs.

Nothing here imports a compiled extension at import time; availability is computed lazily and
cached, so a missing extension never breaks ``import kl_kernels``.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from dataclasses import dataclass
from typing import Callable

import torch

from . import _extensions, value_checks
from ._compat import torch as _compat_torch

ENV_VAR = "KL_KERNELS_BACKEND"
# The backends whose forward kernels make the deferred value checks of offsets / lengths / prompt_lens
# themselves (kl_kernels.launching.fold_value_checks): for any other, select launches them first.
FOLDING_BACKENDS = frozenset({"cuda", "cuda-emulated"})
BACKEND_NAMES = ("torch", "cpu", "cuda", "triton", "cuda-emulated")


class BackendUnavailableError(RuntimeError):
    """An explicitly requested backend cannot run the given inputs; the message lists why."""


@dataclass(frozen=True)
class Backend:
    """A declared implementation of one op.

    ``availability`` returns the reasons the backend cannot run at all on this machine (empty
    list = available); ``requires`` (optional) the reasons it cannot run one given problem beyond
    device, dtype, layout and size; ``run`` takes the op's normalized problem, which exposes
    ``device``, ``dtypes``, ``layout`` and ``num_tokens``. ``auto_devices`` narrows where
    ``"auto"`` may choose it (e.g. Triton's CPU interpreter runs only on explicit request).
    """

    name: str
    devices: frozenset
    dtypes: frozenset
    layouts: frozenset
    availability: Callable[[], list]
    run: Callable
    max_tokens: int | None = None
    notes: str = ""
    requires: Callable[[object], list] | None = None
    auto_devices: frozenset | None = None  # where "auto" may pick it (default: all its devices)
    self_check_devices: frozenset = frozenset()  # where "auto" needs it to pass selfcheck first

    def unavailable_reasons(self) -> list[str]:
        return list(_unavailable_reasons(self.availability))

    def rejection_reasons(self, problem) -> list[str]:
        """Every reason this backend cannot run ``problem``."""
        reasons = self.unavailable_reasons()
        if problem.device.type not in self.devices and not problem.device_free:
            reasons.append(f"inputs are on {problem.device.type}, {self.name} runs on {sorted(self.devices)}")
        bad = sorted({str(d).replace("torch.", "") for d in problem.dtypes if d not in self.dtypes})
        if bad:
            ok = sorted(str(d).replace("torch.", "") for d in self.dtypes)
            reasons.append(f"dtype {', '.join(bad)} not supported by {self.name} (supports {', '.join(ok)})")
        if problem.layout not in self.layouts:
            reasons.append(f"layout {problem.layout!r} not supported by {self.name} (supports {sorted(self.layouts)})")
        if self.max_tokens is not None and problem.num_tokens > self.max_tokens:
            reasons.append(f"{problem.num_tokens} tokens exceed {self.name}'s limit of {self.max_tokens}")
        if self.requires is not None:
            reasons += self.requires(problem)
        return reasons

    def accepts(self, problem, *, auto: bool = False) -> bool:
        """Whether :meth:`rejection_reasons` (:meth:`auto_rejection_reasons` with ``auto``) is empty,
        without building the messages: ``"auto"`` asks it of every backend ahead of the chosen one,
        on every call."""
        device = problem.device.type
        if not problem.device_free and (device not in self.devices or (
                auto and self.auto_devices is not None and device not in self.auto_devices)):
            return False
        if _unavailable_reasons(self.availability) or not problem.dtypes <= self.dtypes:
            return False
        if problem.layout not in self.layouts or (self.max_tokens is not None and problem.num_tokens > self.max_tokens):
            return False
        return self.requires is None or not self.requires(problem)

    def auto_rejection_reasons(self, problem, op: str = "") -> list[str]:
        """rejection_reasons, plus devices where it runs only when asked for by name, and a failed
        first-use self-check."""
        reasons = self.rejection_reasons(problem)
        if not reasons and self.auto_devices is not None and problem.device.type not in self.auto_devices:
            reasons.append(f"on {problem.device.type} {self.name} runs only when requested by name")
        if not reasons and op and not self.trusted(op, problem.device):
            reasons.append(f"{self.name} failed its first-use self-check on {problem.device} "
                           "(logged by the 'kl_kernels' logger; `kl-kernels info --check` repeats it)")
        return reasons

    def trusted(self, op: str, device: torch.device) -> bool:
        """Whether "auto" may use it on ``device``: no self-check needed there, or it passed."""
        if device.type not in self.self_check_devices:
            return True
        from . import selfcheck  # (below the ops: each op registers its own check there)

        return selfcheck.passed(op, self.name, device)

    def describe(self) -> dict:
        reasons = self.unavailable_reasons()
        return {
            "available": not reasons,
            "reason": "; ".join(reasons) if reasons else None,
            "devices": sorted(self.devices),
            "dtypes": sorted(str(d).replace("torch.", "") for d in self.dtypes),
            "layouts": sorted(self.layouts),
            "notes": self.notes,
        }


@_compat_torch.assume_constant_result  # (torch.compiler's, without importing dynamo at import time)
def _unavailable_reasons(availability: Callable[[], list]) -> tuple:
    """Run a backend's availability probe eagerly, also while torch.compile traces a caller.

    Probing imports extensions and asks the driver, which dynamo cannot (and need not) trace:
    the answer does not change within a process, so the traced graph takes it as a constant.
    """
    return _probe_once(availability)


@functools.lru_cache(maxsize=None)
def _probe_once(availability: Callable[[], list]) -> tuple:
    # Once per probe and process: what it asks (extension loaded and holding the kernel, CUDA
    # visible, Triton installed) cannot change while the process runs, and "auto" asks every
    # backend ahead of the chosen one on every call (~20 us each, a lazy stack's whole budget
    # per sample at B = 4). A forked child inherits the answers, as it inherits the loaded modules.
    return tuple(availability())


def requested_backend(backend: str) -> str:
    """Resolve the user's ``backend`` argument against ``KL_KERNELS_BACKEND``."""
    if not isinstance(backend, str) or backend not in ("auto", *BACKEND_NAMES):
        raise ValueError(f"backend must be one of 'auto', {', '.join(map(repr, BACKEND_NAMES))}; got {backend!r}")
    if backend == "auto":
        env = os.environ.get(ENV_VAR, "").strip()
        if env and env != "auto":
            if env not in BACKEND_NAMES:
                raise ValueError(f"environment variable {ENV_VAR} must be one of 'auto', "
                                 f"{', '.join(map(repr, BACKEND_NAMES))}; got {env!r}")
            return env
    return backend


def select(registry: list[Backend], backend: str, *, op: str, problem) -> Backend:
    """Pick the backend that runs ``problem`` for ``op`` (see the module doc).

    A device-free problem (an empty list and no other tensor: no sequence, no device) is checked as
    any other, minus the device, and then answered by the reference (``torch``): there is nothing
    to compute, and a GPU backend has no device to launch on. Its outputs are empty CPU tensors."""
    chosen = _select(registry, backend, op=op, problem=problem)
    if problem.device_free:
        chosen = next(b for b in registry if b.name == "torch")
    if value_checks.DEFERRED.pending and chosen.name not in FOLDING_BACKENDS:
        value_checks.flush_deferred()  # the validation's value checks: only the CUDA forwards make them themselves
    return chosen


def _select(registry: list[Backend], backend: str, *, op: str, problem) -> Backend:
    name = requested_backend(backend)
    if name != "auto":
        chosen = next((b for b in registry if b.name == name), None)
        if chosen is None:
            raise BackendUnavailableError(f"{op}: no backend named {name!r} exists for this op")
        reasons = [] if chosen.accepts(problem) else chosen.rejection_reasons(problem)
        if reasons:
            source = f" (from {ENV_VAR})" if backend == "auto" else ""
            raise BackendUnavailableError(
                f"{op}: backend {name!r}{source} cannot run these inputs:\n  - " + "\n  - ".join(reasons))
        return chosen
    for candidate in registry:
        if candidate.accepts(problem, auto=True) and candidate.trusted(op, problem.device):
            return candidate
    all_reasons = [f"{candidate.name}: " + "; ".join(candidate.auto_rejection_reasons(problem, op))
                   for candidate in registry]
    raise BackendUnavailableError(f"{op}: no backend can run these inputs:\n  - " + "\n  - ".join(all_reasons))


# --------------------------------------------------------------------------- the fused rows every op shares

HALF_AND_SINGLE = frozenset({torch.float32, torch.bfloat16, torch.float16})
BOTH_LAYOUTS = frozenset({"packed", "padded"})


def _torch_cuda_reason() -> list[str]:
    if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
        return [f"torch {torch.__version__} is a CPU-only build (no CUDA)"]
    if not torch.cuda.is_available():
        return ["torch sees no CUDA device (torch.cuda.is_available() is False)"]
    return []


def _extension_reasons(ext: str, kernel: str) -> list[str]:
    """Why extension ``ext`` cannot run ``kernel`` (not built, failed to load, lacks it), or nothing."""
    _, reason = _extensions.kernel(ext, kernel)
    return [reason] if reason else []


def _cuda_reasons(kernel: str) -> list[str]:
    reasons = _extension_reasons("_cuda", kernel)
    if _extensions.load("_cuda")[0] is not None:
        runtime_error = _extensions.probe("_cuda").get("error")
        if runtime_error:
            reasons.append(f"CUDA runtime of kl_kernels._cuda: {runtime_error}")
    return reasons + _torch_cuda_reason()


@functools.lru_cache(maxsize=None)
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def _triton_reasons() -> list[str]:
    from .triton import interpreting  # (kl_kernels.triton does not import triton itself)

    if not _triton_installed():
        return ["triton is not installed (pip install 'kl_kernels[triton]')"]
    if interpreting():
        return []  # CPU tensors run in the interpreter
    return _torch_cuda_reason()


# The GPU kernels are compiled and statically checked in CI and run there in emulation, but no CI
# machine has a GPU: on a CUDA device "auto" takes the cuda and triton rows only once they have passed
# the first-use self-check on that device (kl_kernels/selfcheck.py), and otherwise moves on (a backend
# named explicitly runs without it).
GPU_SELF_CHECK = frozenset({"cuda"})


def kernel_extension(impl: Backend, run_fused) -> str | None:
    """The extension whose C++ kernels the row ``impl`` of :func:`fused_backends` runs (``"_C"`` for
    ``cpu``, ``"_cuda"`` for ``cuda``, ``"_cuda_emu"`` for ``cuda-emulated``), for an op's call plans to
    launch directly; None for the other rows (Triton, the reference) and for a row whose ``run`` is no
    longer the op's ``run_fused`` (a test swapped it)."""
    run = impl.run
    if impl.name in ("cpu", "cuda"):
        return ("_C" if impl.name == "cpu" else "_cuda") if run is run_fused else None
    if (impl.name == "cuda-emulated" and type(run) is functools.partial and run.func is run_fused
            and run.keywords == {"emulated": True}):
        return "_cuda_emu"
    return None


def fused_backends(kernel: str, run_fused, requires) -> list[Backend]:
    """The ``cuda``, ``triton``, ``cpu`` and ``cuda-emulated`` rows of an op, in ``"auto"`` order: C++
    kernels found by their forward symbol ``kernel`` in ``_cuda`` / ``_C`` / ``_cuda_emu``, all run
    by ``run_fused(problem, triton=False|True, emulated=False|True)``, all declining problems that
    ``requires`` rejects. One place for the policy every op shares (the GPU self-check, Triton's
    interpreter and the CUDA emulation on explicit request only)."""
    from .triton import interpreting

    return [
        Backend("cuda", frozenset({"cuda"}), HALF_AND_SINGLE, BOTH_LAYOUTS, functools.partial(_cuda_reasons, kernel),
                run_fused, requires=requires, self_check_devices=GPU_SELF_CHECK,
                notes="fused CUDA C++ kernel (auto: after its first-use self-check on the device)"),
        Backend("triton", frozenset({"cuda", "cpu"} if interpreting() else {"cuda"}), HALF_AND_SINGLE, BOTH_LAYOUTS,
                _triton_reasons, functools.partial(run_fused, triton=True), requires=requires,
                auto_devices=frozenset({"cuda"}), self_check_devices=GPU_SELF_CHECK,
                notes="Triton kernels" + (" (interpreter: CPU tensors on request)" if interpreting() else
                                          " (auto: after its first-use self-check on the device)")),
        Backend("cpu", frozenset({"cpu"}), HALF_AND_SINGLE, BOTH_LAYOUTS,
                functools.partial(_extension_reasons, "_C", kernel), run_fused, requires=requires,
                notes="fused multi-threaded C++ kernel"),
        # The CUDA kernels on CPU tensors, for tests: "auto" never takes it (no auto device).
        Backend("cuda-emulated", frozenset({"cpu"}), HALF_AND_SINGLE, BOTH_LAYOUTS,
                functools.partial(_extension_reasons, "_cuda_emu", kernel), functools.partial(run_fused, emulated=True),
                requires=requires, auto_devices=frozenset(),
                notes="the CUDA kernels under a host emulation of CUDA (CPU tensors; a test instrument, slow)"),
    ]
