"""First-use self-check: a backend proves itself on this device before ``"auto"`` trusts it.

No CI machine of this project has a GPU, so the GPU kernels are tested in emulation and compiled for
real targets, but never run there before a user's first call. A backend whose row in the registry
names ``self_check_devices`` is therefore chosen by ``"auto"`` on such a device only after it has
passed this check there: the op is run on a small canonical set of batches (packed and padded on both
sides, empty and one-token sequences, a row spanning several kernel tiles, a NaN and an infinite
log-ratio at counted tokens, per-sequence coefficients, every estimator, the placements, fp32 and
bf16, forward and gradient) and compared with the torch reference on the same device, within the
tolerance of each dtype. The verdict is cached per process, op, backend, device and package version;
a failure is logged once (logger ``kl_kernels``) with every reason, and ``"auto"`` moves on to the
next backend. A backend named explicitly runs without the check (the user asked for it).

``kl-kernels info --check`` runs the check for every backend available here, on demand.

This module is the machinery below the ops (the verdict cache, the canonical batches, the comparison):
each op's own check lives in its package (``kl_kernels/<op>/self_check.py``) and is handed over by its
``backends.py`` (:func:`register`), so that nothing here imports an op.
"""

from __future__ import annotations

import logging
import math
import threading
from typing import Callable

import torch

from .version import __version__

log = logging.getLogger("kl_kernels")

# (op, backend, device, version) -> list of failure reasons ([] = passed)
_VERDICTS: dict[tuple, list] = {}
_LOCK = threading.Lock()
_RUNNING = threading.local()

# Tolerances of the check against the torch reference (the same backend family: float32 math).
_TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 1e-4), torch.float16: (4e-3, 1e-4)}


def _lengths_sets():
    # empty and one-token rows, a row spanning several 1024-token tiles, odd sizes
    return [[0, 1, 7, 2600, 33], [5], [1, 0, 1], [300, 299, 1, 0, 0, 1024]]


def _batches(device, dtype):
    """The canonical batches: kwargs for both layouts, with the edge values in place."""
    g = torch.Generator().manual_seed(1234)
    for lengths in _lengths_sets():
        n, b = sum(lengths), len(lengths)
        lp = -3 * torch.rand(n, generator=g, dtype=torch.float64)
        ref = -3 * torch.rand(n, generator=g, dtype=torch.float64)
        mask = torch.rand(n, generator=g) < 0.85
        if n > 40:
            lp[9], ref[20], mask[9], mask[20] = math.nan, -math.inf, True, True  # counted NaN and inf log-ratio
        offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64)
        coef = torch.linspace(0.05, 0.2, b, dtype=torch.float32)
        yield "packed", dict(log_probs=lp.to(dtype), ref_log_probs=ref.to(dtype), mask=mask, offsets=offsets), coef
        width = max(lengths) + 1
        for side in ("left", "right"):
            def pad(x, fill):
                out = torch.full((b, width), fill, dtype=x.dtype)
                for i, (s, e) in enumerate(zip(offsets[:-1].tolist(), offsets[1:].tolist())):
                    if side == "left":
                        out[i, width - (e - s):] = x[s:e]
                    else:
                        out[i, :e - s] = x[s:e]
                return out
            yield f"padded-{side}", dict(log_probs=pad(lp, 0.0).to(dtype), ref_log_probs=pad(ref, 0.0).to(dtype),
                                         mask=pad(mask, False), lengths=torch.tensor(lengths),
                                         padding_side=side), coef


def _to(kw, device):
    return {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}


def _compare(what, got, want, dtype, failures):
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    if got.shape != want.shape:
        failures.append(f"{what}: shape {list(got.shape)} vs reference {list(want.shape)}")
        return
    rtol, atol = _TOL.get(dtype, _TOL[torch.float32])
    ok = (got == want) | (got.isnan() & want.isnan()) | ((got - want).abs() <= atol + rtol * want.abs())
    if not bool(ok.all()):
        bad = (~ok).nonzero().flatten()[:3].tolist()
        failures.append(f"{what}: differs from the torch reference at {bad}: "
                        f"{got.flatten()[bad].tolist()} vs {want.flatten()[bad].tolist()}")


def _logits_cases(dtype):
    """Logits and labels for token_logprobs: V = 1, a block's edges (1023-1025), a long row; a masked
    vocabulary entry (-inf), a one-hot row, a NaN row, ignored labels, labels 0 and V-1; [N, V] rows and
    [B, T, V] slabs (``logits[:, :-1]``)."""
    g = torch.Generator().manual_seed(4321)
    for vocab in (1, 1023, 1025, 5000):
        x = torch.randn(2, 5, vocab, generator=g, dtype=torch.float64) * 4
        y = torch.randint(0, vocab, (2, 5), generator=g)
        y[0, 0], y[1, 4], y[1, 1] = 0, vocab - 1, -100
        if vocab > 1:
            x[0, 2, (int(y[0, 2]) + 1) % vocab] = -math.inf
            x[1, 3] = -math.inf
            x[1, 3, int(y[1, 3])] = 2.0
            x[0, 4, vocab // 2] = math.nan
        mask = torch.ones(2, 5, dtype=torch.bool)
        mask[1, 0] = False
        yield f"V={vocab} rows", x.to(dtype), y, mask
        yield f"V={vocab} slabs", x.to(dtype)[:, :-1], y[:, :-1], mask[:, :-1]


# op -> its check(backend, device) -> failures: each op registers its own (kl_kernels/<op>/self_check.py, from
# its backends.py), so that this module, below the ops, imports none of them.
CHECKS: dict[str, Callable[[str, torch.device], list]] = {}


def register(op: str, check: Callable[[str, torch.device], list]) -> None:
    """Make ``check(backend, device) -> failures`` the self-check of ``op`` (an op's backends.py calls this)."""
    CHECKS[op] = check


def _key(op, backend, device):
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return op, backend, str(device), __version__


def run(op: str, backend: str, device) -> list:
    """Run the check now (no cache); return the failures (empty: passed). ``op``'s package must have
    been imported (its backends register its check)."""
    _RUNNING.active = True
    try:
        with torch.enable_grad():
            return CHECKS[op](backend, torch.device(device))
    finally:
        _RUNNING.active = False


def passed(op: str, backend: str, device) -> bool:
    """Whether ``backend`` passed ``op``'s self-check on ``device`` (run on first ask, then cached).

    Under ``torch.compile`` nothing can run: a verdict not yet cached counts as not passed. While a
    check runs (it calls the op with explicit backends), nested asks answer True."""
    if getattr(_RUNNING, "active", False):
        return True
    key = _key(op, backend, device)
    with _LOCK:
        if key in _VERDICTS:
            return not _VERDICTS[key]
    if torch.compiler.is_compiling():
        return False
    failures = run(op, backend, device)
    with _LOCK:
        _VERDICTS[key] = failures
    if failures:
        log.warning("kl_kernels: backend %r failed its first-use self-check for %s on %s; 'auto' will not use it "
                    "in this process (%d problem(s)): %s", backend, op, key[2], len(failures),
                    "; ".join(failures[:5]))
    return not failures


def verdicts() -> dict:
    """The cached verdicts: ``{(op, backend, device, version): failures}``."""
    with _LOCK:
        return dict(_VERDICTS)


def clear() -> None:
    """Forget every verdict (tests; a process that swapped its extension), and the call plans that were
    dispatched under them (kl_kernels/plans.py)."""
    from . import plans

    with _LOCK:
        _VERDICTS.clear()
    plans.clear()
