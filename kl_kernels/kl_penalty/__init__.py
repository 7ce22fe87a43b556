"""The KL-penalty loss side of kl_kernels (issue: KL-penalty PPO loss).

This version has the KL coefficient controllers (``controllers.py``); the fused loss op comes
with its own issue.
"""

from .controllers import AdaptiveKLController, FixedKLController, KLController, ZieglerKLController

__all__ = ["AdaptiveKLController", "FixedKLController", "KLController", "ZieglerKLController"]
