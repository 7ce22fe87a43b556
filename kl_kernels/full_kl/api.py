"""``full_kl``: the exact KL divergence of the policy from the reference over the whole vocabulary, per
token, from both models' logits."""

from __future__ import annotations

import torch

from .. import backends as _dispatch
from .backends import REGISTRY
from .problem import build_problem


def full_kl(logits: torch.Tensor, ref_logits: torch.Tensor, *, temperature: float = 1.0,
            mask: torch.Tensor | None = None, backend: str = "auto", logit_scale: float = 1.0,
            softcap: float | None = None) -> torch.Tensor:
    r"""Per token, ``KL(pi || pi_ref) = sum_v pi(v) (log pi(v) - log pi_ref(v))`` over the whole
    vocabulary, with ``pi = softmax(logits / T)`` and ``pi_ref = softmax(ref_logits / T)``: the exact KL
    that the sampled estimators k1/k2/k3 of :func:`kl_kernels.kl_reward` estimate from one token (verl's
    ``kl_penalty="full"``), without an ``[N, V]`` float32 copy of either tensor.

    Args:
        logits: ``[*S, V]`` the policy's logits (e.g. ``[N, V]`` packed or ``[B, T, V]``, a slice such as
            ``logits[:, :-1]`` read in place), float32/bfloat16/float16/float64. Gradients flow.
        ref_logits: ``[*S, V]`` the reference model's logits, same shape, dtype and device. Gradients
            flow too when it requires them (usually it is frozen and does not).
        temperature: ``T > 0``, applied to both (default 1.0).
        logit_scale: ``s``, finite ``> 0`` (default 1.0), and softcap: ``c``, ``None`` (default: none) or
            finite ``> 0``, applied to both models' logits before the temperature, as
            :func:`kl_kernels.token_logprobs` does (TRL's fused LM head, Gemma's
            ``final_logit_softcapping``): ``x -> c tanh(s x / c) / T`` (``s x / T`` without a cap). The
            scale folds into the temperature on the host; the cap is a compile-time specialization of every
            backend's kernels.
        mask: optional bool ``[*S]``: tokens where it is False give 0 and no gradient.
        backend: ``"auto"`` (the fused CPU kernel for CPU tensors of fp32/bf16/fp16; on a GPU the fused
            ``"cuda"`` kernel, else ``"triton"``, each once it has passed its first-use self-check there;
            else the chunked torch math), ``"cpu"``, ``"cuda"``, ``"triton"``, ``"torch"``, or
            ``"cuda-emulated"`` (the CUDA kernel on CPU tensors: tests); the ``KL_KERNELS_BACKEND``
            environment variable overrides ``"auto"``.

    Returns:
        ``[*S]`` float32 (float64 for float64 logits), ``>= 0`` up to rounding.

    Formula, per counted row (``a = log_softmax(logits / T)``, ``b = log_softmax(ref_logits / T)``,
    ``p = e^a``, ``q = e^b``)::

        KL = sum_j p_j (a_j - b_j)          d KL / d logits_j = p_j ((a_j - b_j) - KL) / T
                                            d KL / d ref_logits_j = (q_j - p_j) / T

    With ``logit_scale``/``softcap``, ``logits / T`` reads ``c tanh(s logits / c) / T`` (the same for the
    reference) and ``1 / T`` in the gradients ``s (1 - tanh^2(s x_j / c)) / T`` of each tensor's own entry
    (``s / T`` without a cap); the rules below apply to the capped logits (a capped ``+-inf`` is finite).

    A counted row with NaN or ``+inf`` in either tensor, or only ``-inf`` in either, gives NaN; ``-inf``
    entries elsewhere are a masked vocabulary (probability 0); the policy putting mass where the
    reference has none gives ``+inf``; a row whose KL is not finite has NaN gradients. Deterministic.

    Example::

        >>> import torch
        >>> from kl_kernels import full_kl
        >>> logits = torch.tensor([[2.0, 0.0, 0.0], [1.0, 1.0, 1.0]], requires_grad=True)
        >>> ref = torch.tensor([[0.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
        >>> kl = full_kl(logits, ref)
        >>> kl.detach()
        tensor([0.4330, 0.0000])
        >>> kl.sum().backward()
        >>> logits.grad[1]
        tensor([0., 0., 0.])
        >>> full_kl(logits.detach(), ref, softcap=1.0)  # the first row's gap capped at tanh(2) = 0.964
        tensor([0.1146, 0.0000])
    """
    problem = build_problem(logits, ref_logits, temperature=temperature, mask=mask, logit_scale=logit_scale,
                            softcap=softcap)
    impl = _dispatch.select(REGISTRY, backend, op="full_kl", problem=problem)
    return impl.run(problem)
