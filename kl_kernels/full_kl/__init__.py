"""``full_kl``: the exact ``KL(pi || pi_ref)`` over the whole vocabulary per token, from the policy's and
the reference's logits, without an ``[N, V]`` float32 copy, with gradients to both.

Files: ``api.py`` (the public function), ``problem.py`` (argument checks), ``reference.py`` (the math,
chunked over rows, any float dtype), ``ops.py`` (the ``torch.library`` ops with fake and autograd),
``launch.py`` (the fused C++ kernels' launcher; the kernels are ``csrc/cpu/full_kl_cpu.cpp`` and
``csrc/cuda/full_kl_cuda.cu``, their shared math ``csrc/common/row_math.h``),
``launch_triton.py`` (the Triton kernels' launcher; the kernels are ``kl_kernels/triton/full_kl.py``),
``backends.py`` (which backends run it), ``linear.py`` (``linear_full_kl``: from both models' hidden
states and LM heads, chunked over tokens). Tests: ``tests/test_full_kl.py``; docs: ``python_api/full_kl.md``.
"""

from .api import full_kl
from .linear import linear_full_kl

__all__ = ["full_kl", "linear_full_kl"]
