"""TorchRL drop-ins backed by the fused kernels (needs the ``torchrl`` extra).

Change one import and keep the rest of the pipeline::

    # from torchrl.envs.llm.transforms import KLRewardTransform, KLComputation, RetrieveLogProb, RetrieveKL
    from kl_kernels.torchrl import KLRewardTransform, KLComputation, RetrieveLogProb, RetrieveKL

Each class subclasses TorchRL 0.14's (``isinstance``, ``Compose`` and ``TransformedEnv`` keep
working) with the same constructor, defaults, keys and spec transforms; the numeric work of a
call is one fused ``kl_reward`` call for the whole batch. The deviations from TorchRL (inputs it
rejects or gets wrong) are listed in ``python_api/torchrl.md``.

``KLPENPPOLoss`` (``from torchrl.objectives import KLPENPPOLoss`` -> ``from kl_kernels.torchrl import
KLPENPPOLoss``) is TorchRL's KL-penalty PPO loss with the beta gradient fixed; on per-token,
assistant-masked data it runs the fused ``kl_penalty_loss``.

``patch()`` / ``unpatch()`` swap these classes into TorchRL's own modules (and back) for code that
imports TorchRL's names itself.
"""

from __future__ import annotations

try:
    import tensordict as _tensordict  # noqa: F401
    import torchrl as _torchrl  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised in a subprocess test
    raise ImportError(
        "kl_kernels.torchrl needs torchrl 0.14.x and tensordict 0.14.x: pip install 'kl_kernels[torchrl]' "
        f"(import failed: {exc})") from exc

from ._patch import patch, unpatch
from .actor_kl import ActorKLRewardTransform
from .ppo import KLPENPPOLoss
from .transforms import KLComputation, KLRewardTransform, RetrieveKL, RetrieveLogProb

__all__ = ["ActorKLRewardTransform", "KLComputation", "KLPENPPOLoss", "KLRewardTransform", "RetrieveKL", "RetrieveLogProb", "patch",
           "unpatch"]
