"""``kl_reward``: assistant-masked, ragged-batch KL estimate and KL-penalized reward.

Where things are:

* ``api.py``        the public function (validate -> dispatch -> restore the caller's layout)
* ``fast.py``       the eager fast lanes: plain dense CPU tensors, or lists of them, checked in one C call, straight to the kernel
* ``problem.py``    argument validation, layout normalization, the output named tuple
* ``reference.py``  the torch reference: the semantics, forward and backward formulas
* ``backends.py``   which backends exist, what each supports, in ``"auto"`` order
"""

from .api import kl_reward
from .problem import ESTIMATORS, PLACEMENTS, KLRewardOutput

__all__ = ["kl_reward", "KLRewardOutput", "ESTIMATORS", "PLACEMENTS"]
