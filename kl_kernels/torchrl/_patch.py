"""Replace TorchRL's KL transforms with ours in TorchRL's own modules, for code you do not own.

``patch()`` assigns this package's classes to every TorchRL module attribute that exposes
TorchRL's class (``torchrl.envs.llm.transforms.kl``, ``torchrl.envs.llm.transforms``,
``torchrl.envs.llm``), so ``from torchrl.envs.llm import KLRewardTransform`` executed afterwards,
and TorchRL's own ``RetrieveKL`` (which builds ``RetrieveLogProb``/``KLComputation`` by module
lookup), get ours. ``unpatch()`` restores the originals. Both are idempotent and return the
``"module.Name"`` strings they changed. Names already imported elsewhere (``from torchrl... import X``
run before ``patch()``) are not changed.
"""

from __future__ import annotations

import importlib

_NAMES = ("KLRewardTransform", "KLComputation", "RetrieveLogProb", "RetrieveKL")
_MODULES = ("torchrl.envs.llm.transforms.kl", "torchrl.envs.llm.transforms", "torchrl.envs.llm")
_ORIGINAL: dict[str, type] = {}


def _originals() -> dict[str, type]:
    from . import transforms as ours
    if not _ORIGINAL:
        _ORIGINAL.update({n: getattr(ours, f"_Trl{n}") for n in _NAMES})
    return _ORIGINAL


def _swap(to_ours: bool) -> list[str]:
    from . import transforms as ours
    originals = _originals()
    changed = []
    for mod_name in _MODULES:
        mod = importlib.import_module(mod_name)
        for name in _NAMES:
            old, new = (originals[name], getattr(ours, name)) if to_ours else (getattr(ours, name), originals[name])
            if getattr(mod, name, None) is old:
                setattr(mod, name, new)
                changed.append(f"{mod_name}.{name}")
    return changed


def patch() -> list[str]:
    """Point TorchRL's module attributes at kl_kernels' classes; returns what was replaced
    (empty when already patched)."""
    return _swap(True)


def unpatch() -> list[str]:
    """Undo ``patch()``; returns what was restored (empty when not patched)."""
    return _swap(False)
