"""Hidden states and an LM head, shared by the ops that compute logits chunk by chunk instead of whole
(``linear_token_logprobs``, ``linear_full_kl``, ``linear_kl_penalty_loss``): the argument rules (the
policy's head, the reference's next to it), the chunk schedule per device and the backward's two walks.

A chunk of ``C`` tokens has logits ``hidden_c @ weight.T (+ bias)`` (torch's matmul: MKL/oneDNN on the CPU,
cuBLAS on a GPU; float32 inputs on a GPU follow ``torch.backends.cuda.matmul.allow_tf32``, as every torch
matmul does), ``C x V`` of them, which a row pass consumes before the next chunk is formed: the extra
memory is O(C x V), not O(N x V). Forward always walks the tokens. Backward walks either:

* **the tokens** (``"tokens"``: the one-pass loss's walk, and ``KL_KERNELS_HEAD_SCHEDULE=tokens``): per chunk the logits are recomputed, their gradient
  written over them by the row pass, ``d hidden_c = d_c @ weight`` and ``d weight += d_c.T @ hidden_c``
  into a float32 ``[V, H]`` accumulator (the GEMM adds into it in place, no ``[V, H]`` temporary: ``addmm_``
  for float32 inputs, cuBLAS's float32 output ``out_dtype`` for bf16/fp16 on a GPU, where torch has it).
* **the vocabulary** (``"vocab"``, the default on every device): per slice ``[v0, v1)`` of the head, the logits of
  *all* tokens against it, ``hidden @ weight[v0:v1].T`` ``[N, Vs]``, are recomputed, the row pass writes
  their gradient over them (it needs only the saved ``lse``/entropy per token; a label outside the slice
  is "not here"), then ``d weight[v0:v1] = d_s.T @ hidden`` in **one** GEMM over all tokens, written once
  in the parameter's dtype (cuBLAS accumulates in float32 inside: no float32 ``[V, H]`` buffer, no
  per-chunk cast and add), and ``d hidden += d_s @ weight[v0:v1]`` into a float32 ``[N, H]`` accumulator
  (float32 GEMM output where torch has it, ``out_dtype``). Four GEMMs of the head in all (forward,
  recompute, ``d weight``, ``d hidden``), every one with thousands of rows: what fills a GPU's tensor
  cores; one pass of the row kernel per slice. Deterministic (a fixed order, no atomics).

On the CPU the vocabulary walk measured at least as fast as the token walk and lighter (N = 2048, H = 512,
V = 32k, 2-core VM shared with other jobs, 2026-11-28, `kl_kernels.bench.linear_logprobs --rounds 2`: best
7.3 s vs 10.1 s wall, 132 vs 197 MiB peak; CPU time in one process, min of 4 alternated: 3.08 vs 3.15 s in
float32, 1.07 vs 1.35 s in bf16, eager 3.9 s / 2.7 s), so it is the default there too.

On the token walk the per-chunk ``[V, H]`` accumulation is what made a GPU slow (issue 48: 190 of 277 ms
at N = 8192, H = 4096, V = 128k, bf16, on an H200, 64 chunks of 130 tokens); on the vocabulary walk the
extra memory of backward is the head's gradient itself, an ``[N, Vs]`` slice and ``d hidden`` in float32.
``KL_KERNELS_HEAD_SCHEDULE=tokens|vocab`` overrides the default (tests, A/B runs).
"""

from __future__ import annotations

import numbers
import os

import torch

from .vocab_rows import LOGIT_DTYPES

# Logits per chunk by default on the CPU: about 2^24 (64 MiB in float32), whatever V: the tokens per
# chunk, forward and backward (measured there: bench/results/linear-logprobs-cpu-2core).
CHUNK_LOGITS = 1 << 24
# On a GPU, forward's chunks: about 2^27 logits (256 MiB in bf16; ~1,000 tokens at V = 128k: GEMMs with
# enough rows for the tensor cores, issue 48's chunk_size=1024 row), and backward's vocabulary slices:
# about 2^25 logits (64 MiB in bf16; 4,096 columns at N = 8192), so that backward's extra memory at
# N = 8192, H = 4096, V = 128k is the head's gradient (0.98 GiB) + d hidden in float32 (2 x 128 MiB while a
# slice's share is added) + a slice: under 1.5 GiB.
GPU_CHUNK_LOGITS = 1 << 27
# A GPU chunk's tokens are the rows of its GEMMs: whole multiples of a tensor-core tile's 128 rows (1,046 tokens
# at V = 128,256 would leave 22-row tiles, and an N = 8192 batch a short last chunk; 1,024 makes 8 equal ones).
GPU_TOKEN_TILE = 128
GPU_SLICE_LOGITS = 1 << 25
SCHEDULES = ("tokens", "vocab")


def check_lm_head(hidden, weight, bias, *, names=("hidden", "weight", "bias")) -> int:
    """``hidden [*S, H]``, ``weight [V, H]`` and ``bias [V]`` or None of one float dtype and device, or a
    ``TypeError``/``ValueError`` naming the argument; returns ``V``."""
    h_name, w_name, b_name = names
    for name, t in ((h_name, hidden), (w_name, weight)):
        if not isinstance(t, torch.Tensor) or t.is_nested or t.layout != torch.strided:
            raise TypeError(f"{name} must be a dense tensor, got {type(t).__name__}")
        if t.dtype not in LOGIT_DTYPES:
            raise TypeError(f"{name} must be float32, bfloat16, float16 or float64, got {t.dtype}")
    if hidden.dim() < 1:
        raise ValueError(f"{h_name} must be [*S, H], got shape {list(hidden.shape)}")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1] or weight.shape[0] == 0:
        raise ValueError(f"{w_name} must be [V, H] with V >= 1 and H = {h_name}.shape[-1] = {hidden.shape[-1]}, "
                         f"got {list(weight.shape)}")
    if weight.dtype != hidden.dtype or weight.device != hidden.device:
        raise ValueError(f"{w_name} must have {h_name}'s dtype and device ({hidden.dtype}, {hidden.device}), got "
                         f"{weight.dtype}, {weight.device}")
    vocab = weight.shape[0]
    if bias is not None and (not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (vocab,)
                             or bias.dtype != hidden.dtype or bias.device != hidden.device):
        raise ValueError(f"{b_name} must be None or a [{vocab}] tensor of {h_name}'s dtype and device, got "
                         f"{getattr(bias, 'dtype', type(bias).__name__)} {list(getattr(bias, 'shape', []))}")
    return vocab


def check_ref_head(hidden, vocab: int, ref_hidden, ref_weight, ref_bias, *, required: bool) -> bool:
    """The reference model's ``ref_hidden [*S, H_ref]``, ``ref_weight [V, H_ref]`` and optional ``ref_bias
    [V]`` next to the policy's ``hidden`` (vocabulary ``vocab``): they come together (``ref_bias`` only with
    them), with hidden's token shape, dtype and device and the same vocabulary (their own width ``H_ref``).
    Returns whether a reference is given (``required``: it must be), or raises a ``TypeError``/``ValueError``
    naming the argument."""
    if (ref_hidden is None) != (ref_weight is None):
        raise ValueError("ref_hidden and ref_weight come together (the reference's hidden states and LM head), got "
                         + ("ref_hidden only" if ref_weight is None else "ref_weight only"))
    if ref_hidden is None:
        if required:
            raise TypeError("ref_hidden and ref_weight are required (the reference's hidden states and LM head)")
        if ref_bias is not None:
            raise ValueError("ref_bias needs ref_hidden and ref_weight")
        return False
    ref_vocab = check_lm_head(ref_hidden, ref_weight, ref_bias, names=("ref_hidden", "ref_weight", "ref_bias"))
    if ref_vocab != vocab:
        raise ValueError(f"ref_weight must cover weight's vocabulary V = {vocab}, got {ref_vocab} rows")
    if tuple(ref_hidden.shape[:-1]) != tuple(hidden.shape[:-1]):
        raise ValueError(f"ref_hidden must have hidden's token shape {list(hidden.shape[:-1])} (its own width), got "
                         f"{list(ref_hidden.shape)}")
    if ref_hidden.dtype != hidden.dtype or ref_hidden.device != hidden.device:
        raise ValueError(f"ref_hidden must have hidden's dtype and device ({hidden.dtype}, {hidden.device}), got "
                         f"{ref_hidden.dtype}, {ref_hidden.device}")
    return True


def chunk_tokens(chunk_size, vocab: int, device=None) -> int:
    """Tokens per forward chunk: ``chunk_size`` (an int >= 1) or, for None, about ``CHUNK_LOGITS`` logits
    on the CPU (``device`` None or a CPU one), ``GPU_CHUNK_LOGITS`` elsewhere, there in whole multiples of
    ``GPU_TOKEN_TILE`` tokens when that many fit."""
    if chunk_size is None:
        if device is None or torch.device(device).type == "cpu":
            return max(1, CHUNK_LOGITS // vocab)
        tokens = max(1, GPU_CHUNK_LOGITS // vocab)
        return tokens - tokens % GPU_TOKEN_TILE if tokens >= GPU_TOKEN_TILE else tokens
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, numbers.Integral) or chunk_size < 1:
        raise ValueError(f"chunk_size must be None or an int >= 1 (tokens per chunk), got {chunk_size!r}")
    return int(chunk_size)


def schedule(device) -> str:
    """Backward's walk for tensors on ``device``: ``"vocab"`` on every device (module doc);
    ``KL_KERNELS_HEAD_SCHEDULE`` (``tokens`` or ``vocab``) overrides it."""
    forced = os.environ.get("KL_KERNELS_HEAD_SCHEDULE", "").strip()
    if forced:
        if forced not in SCHEDULES:
            raise ValueError(f"KL_KERNELS_HEAD_SCHEDULE must be one of {SCHEDULES}, got {forced!r}")
        return forced
    del device  # (the same on every device, measured: module doc)
    return "vocab"


def slice_width(chunk: int, tokens: int, vocab: int, device) -> int:
    """Vocabulary entries per backward slice on the ``"vocab"`` walk: the logits of a forward chunk
    (``chunk x V``) spread over all ``tokens``, at most ``GPU_SLICE_LOGITS`` on a GPU, whole multiples of
    128 when that wide (tensor-core tiles), at least 1, at most ``vocab``."""
    budget = chunk * vocab
    if torch.device(device).type != "cpu":
        budget = min(budget, GPU_SLICE_LOGITS)
    width = max(1, budget // max(tokens, 1))
    if width >= 128:
        width -= width % 128
    return min(width, vocab)


# Whether torch's addmm with out_dtype=float32 runs here (the first refusal turns it off for the process).
_WIDE_OUT = [True]


def _wide_out(x: torch.Tensor) -> bool:
    """Whether cuBLAS can give a float32 product of ``x``'s dtype (bf16/fp16 on a GPU: ``out_dtype``)."""
    return x.dtype in (torch.bfloat16, torch.float16) and x.device.type == "cuda" and hasattr(torch.ops.aten.addmm,
                                                                                            "dtype")


def head_grad_buffers(needs, hidden, weight, bias) -> tuple:
    """``(d hidden, d weight, d bias)`` buffers for the flags ``needs`` (three bools): ``d hidden`` in
    hidden's dtype, the head's in float32 accumulators (chunks add into them in a fixed order); None where
    no gradient is wanted."""
    return (torch.empty_like(hidden) if needs[0] else None,
            torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if needs[1] else None,
            torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if bias is not None and needs[2]
            else None)


def add_chunk_grads(c0, c1, d_logits, hidden, weight, buffers) -> None:
    """A chunk's share of the gradients from its logits' gradient ``d_logits [C, V]``: ``d hidden_c =
    d_logits @ weight``, ``d weight += d_logits.T @ hidden_c``, ``d bias += sum_c d_logits``."""
    g_hidden, g_weight, g_bias = buffers
    if g_hidden is not None:
        g_hidden[c0:c1] = d_logits @ weight
    if g_weight is not None:
        if d_logits.dtype == torch.float32:  # the GEMM adds into the accumulator: no [V, H] temporary
            g_weight.addmm_(d_logits.t(), hidden[c0:c1])
        elif _wide_out(d_logits) and _WIDE_OUT[0]:  # bf16/fp16 on a GPU: cuBLAS adds into the float32 buffer
            try:
                torch.addmm(g_weight, d_logits.t(), hidden[c0:c1], out_dtype=torch.float32, out=g_weight)
            except (RuntimeError, TypeError, NotImplementedError):  # refused at dispatch (no host sync)
                _WIDE_OUT[0] = False
                g_weight += (d_logits.t() @ hidden[c0:c1]).float()
        else:
            g_weight += (d_logits.t() @ hidden[c0:c1]).float()
    if g_bias is not None:
        g_bias += d_logits.sum(0, dtype=torch.float32)


def head_grads_out(buffers, weight, bias) -> tuple:
    """The buffers as autograd returns them: the head's accumulators cast to their parameters' dtypes."""
    g_hidden, g_weight, g_bias = buffers
    return (g_hidden, None if g_weight is None else g_weight.to(weight.dtype),
            None if g_bias is None else g_bias.to(bias.dtype))




def vocab_walk_grads(needs, hidden, weight, bias, width: int, slice_grad) -> tuple:
    """Backward on the ``"vocab"`` walk (module doc): ``(d hidden, d weight, d bias)`` in the parameters'
    dtypes (None where ``needs``, three bools, says no), from ``slice_grad(v0, v1, logits_s)``, which writes
    the gradient of the logits of every token against ``weight[v0:v1]`` over ``logits_s [N, v1 - v0]``
    (and returns it). ``width`` entries per slice (:func:`slice_width`)."""
    vocab = weight.shape[0]
    # (contiguous: a slice of rows is then a block the GEMM writes in place)
    g_weight = torch.empty(weight.shape, dtype=weight.dtype, device=weight.device) if needs[1] else None
    g_bias = torch.empty(bias.shape, dtype=bias.dtype, device=bias.device) if bias is not None and needs[2] else None
    acc_dtype = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    acc = torch.zeros(hidden.shape, dtype=acc_dtype, device=hidden.device) if needs[0] else None
    wide_out = _wide_out(hidden)
    for v0 in range(0, vocab, width):
        v1 = min(v0 + width, vocab)
        w_s = weight[v0:v1]
        d = slice_grad(v0, v1, torch.nn.functional.linear(hidden, w_s, None if bias is None else bias[v0:v1]))
        if g_weight is not None:  # one GEMM over all tokens, written once (fp32 accumulation inside cuBLAS/MKL)
            torch.mm(d.t(), hidden, out=g_weight[v0:v1])
        if g_bias is not None:
            g_bias[v0:v1] = d.sum(0, dtype=acc_dtype)
        if acc is not None:
            if d.dtype == acc.dtype:
                acc.addmm_(d, w_s)
            elif wide_out and _WIDE_OUT[0]:  # cuBLAS's float32 output, the accumulator added in its epilogue
                try:
                    acc = torch.addmm(acc, d, w_s, out_dtype=torch.float32)
                except (RuntimeError, TypeError, NotImplementedError):  # refused at dispatch (no host sync)
                    _WIDE_OUT[0] = False
                    acc += d @ w_s
            else:
                acc += d @ w_s
        del d
    return (None if acc is None else acc.to(hidden.dtype)), g_weight, g_bias


def row_pass_backend(registry, backend: str, op: str, chunk_problem, caller: str) -> str:
    """The name of the backend that runs a chunk's row pass: ``op``'s own dispatch asked about
    ``chunk_problem`` (a chunk's fresh contiguous logits, one row standing in); a refusal names ``caller``."""
    from . import backends as _dispatch

    try:
        return _dispatch.select(registry, backend, op=op, problem=chunk_problem).name
    except _dispatch.BackendUnavailableError as exc:
        raise _dispatch.BackendUnavailableError(f"{caller} (its row pass): {exc}") from None
