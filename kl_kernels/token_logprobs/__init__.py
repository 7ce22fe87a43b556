"""``token_logprobs``: per-token log-probs (and entropy) from logits, without an ``[N, V]`` float32 copy.

Files: ``api.py`` (the public function), ``problem.py`` (argument checks), ``reference.py`` (the
math, chunked over rows, any float dtype), ``ops.py`` (the ``torch.library`` ops with fake and
autograd), ``launch.py`` (the fused CPU kernel's launcher; the kernel is
``csrc/cpu/token_logprobs_cpu.cpp``), ``launch_triton.py`` (the Triton kernels' launcher; the kernels are
``kl_kernels/triton/token_logprobs.py``), ``backends.py`` (which backends run it: the fused CPU kernel, the
chunked torch math, Triton when named; the CUDA kernel of issue 28 is declared and says it is not built yet),
``linear.py`` (``linear_token_logprobs``: from hidden states and the LM head, chunked over tokens, the
reference model's in the same loop when given). Tests:
``tests/test_token_logprobs.py``; benchmark: ``kl_kernels/bench/token_logprobs.py``.
"""

from .api import LinearTokenLogprobsOutput, TokenLogprobsOutput, token_logprobs
from .linear import linear_token_logprobs

__all__ = ["token_logprobs", "linear_token_logprobs", "TokenLogprobsOutput", "LinearTokenLogprobsOutput"]
