"""``kl_reward``: assistant-masked, ragged-batch KL estimate and KL-penalized reward.

Where things are:

* ``api.py``        the public function (validate -> dispatch -> restore the caller's layout)
* ``problem.py``    argument validation, layout normalization, the output named tuple
* ``reference.py``  the torch reference: the semantics, forward and backward formulas
* ``backends.py``   which backends exist, what each supports, in ``"auto"`` order
* ``ops.py``        the ``torch.library`` ops (fake tensors, autograd) around the launchers
* ``launch.py``     host launcher of the C++ kernels (``_C`` on CPU, ``_cuda`` on CUDA, ``_cuda_emu`` emulated):
                    tensors -> argument struct -> ``module.kl_reward_forward`` / ``kl_reward_backward``
* ``launch_triton.py`` host launcher of the Triton kernels (``kl_kernels/triton/kl_reward.py``)

Machinery both ops use lives outside the op: ``kl_kernels/launching.py`` and ``launching_triton.py``.

The kernels: ``csrc/cpu/kl_reward_cpu*.cpp`` and ``csrc/cuda/kl_reward_cuda.cu``, both on the per-token
math of ``csrc/common/kl_math.h``; Triton's in ``kl_kernels/triton/``.
"""

from .api import kl_reward
from .problem import ESTIMATORS, PLACEMENTS, KLRewardOutput

__all__ = ["kl_reward", "KLRewardOutput", "ESTIMATORS", "PLACEMENTS"]
