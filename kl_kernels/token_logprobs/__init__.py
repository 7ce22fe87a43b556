"""``token_logprobs``: per-token log-probs (and entropy) from logits, without an ``[N, V]`` float32 copy.

Files: ``api.py`` (the public function), ``problem.py`` (argument checks), ``reference.py`` (the
math, chunked over rows, any float dtype), ``ops.py`` (the ``torch.library`` ops with fake and
autograd), ``launch.py`` (the fused C++ kernels' launcher; the kernels are
``csrc/cpu/token_logprobs_cpu.cpp`` and ``csrc/cuda/token_logprobs_cuda.cu``, their shared math
``csrc/common/row_math.h``), ``launch_triton.py`` (the Triton kernels' launcher; the kernels are
``kl_kernels/triton/token_logprobs.py``), ``backends.py`` (which backends run it: the fused CPU and
CUDA kernels, Triton, the chunked torch math), ``linear.py`` (``linear_token_logprobs``: from hidden
states and the LM head, chunked over tokens, the reference model's in the same loop when given). Tests:
``tests/test_token_logprobs.py``; benchmark: ``kl_kernels/bench/token_logprobs.py``.
"""

from .api import LinearTokenLogprobsOutput, TokenLogprobsOutput, token_logprobs
from .linear import linear_token_logprobs

__all__ = ["token_logprobs", "linear_token_logprobs", "TokenLogprobsOutput", "LinearTokenLogprobsOutput"]
