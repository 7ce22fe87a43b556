"""TRL 1.16.0's ``GRPOTrainer`` with kl_kernels' fused loss: one import.

    from kl_kernels.integrations.trl import GRPOTrainer   # instead of: from trl import GRPOTrainer

:class:`GRPOTrainer` is TRL's, same constructor and ``GRPOConfig``; each micro-batch's loss is one fused
:func:`kl_kernels.kl_penalty_loss` call, and TRL's metrics are logged from its by-products.
:func:`patch` does the same to a trainer already built (TRL's, or a subclass of it). Every ``GRPOConfig``
option that changes the loss is either fused or, for that trainer, left to TRL's own ``_compute_loss`` with one
:class:`TRLFallbackWarning` at construction naming it (:mod:`kl_kernels.integrations.trl.options` has the
table). :func:`grpo_loss` is the loss alone, from the tensors TRL's method has.

Importing this package does not import TRL: ``GRPOTrainer`` is made on first access.
"""

from __future__ import annotations

from .loss import LOSS_TYPES, grpo_loss
from .options import TRLFallbackWarning
from .trainer import patch


def __getattr__(name):
    if name == "GRPOTrainer":
        from .trainer import grpo_trainer_class

        cls = grpo_trainer_class()
        globals()["GRPOTrainer"] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["GRPOTrainer", "LOSS_TYPES", "TRLFallbackWarning", "grpo_loss", "patch"]
