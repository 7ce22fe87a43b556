"""The KL-penalty loss side of kl_kernels.

* ``api.py``: :func:`kl_penalty_loss`, the public function; ``problem.py`` validates and
  normalizes its arguments; ``reference.py`` is the torch reference (the ``"torch"`` backend);
  ``aggregate.py`` turns per-sequence sums into the loss (aggregations, data parallelism);
  ``backends.py`` declares the backends.
* ``controllers.py``: the KL coefficient controllers (fixed, TorchRL's adaptive, Ziegler's).
"""

from .aggregate import KLPenaltyLossOutput
from .api import kl_penalty_loss
from .controllers import AdaptiveKLController, FixedKLController, KLController, ZieglerKLController
from .problem import AGGREGATIONS

__all__ = ["kl_penalty_loss", "KLPenaltyLossOutput", "AGGREGATIONS", "AdaptiveKLController", "FixedKLController",
           "KLController", "ZieglerKLController"]
