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
