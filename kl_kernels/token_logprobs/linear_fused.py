r"""The fused GPU route of ``linear_token_logprobs`` (issue 48, item 2): the Triton kernels of
``kl_kernels/triton/linear_rows.py``, their launchers, and :class:`FusedLinearTokenLogprobs`, an autograd function
with the inputs and outputs of ``linear.py``'s ``_LinearTokenLogprobs`` (without its ``chunk`` and ``backend``).

Forward: one kernel forms each ``[BLOCK_N, BLOCK_V]`` logits tile on chip (``tl.dot`` over H, float32
accumulation) and folds it into per-token online sums (max, ``S``, ``W``, the label's logit): no ``[N, V]`` or
``[C, V]`` tensor reaches HBM. The vocabulary is cut into ``shares`` so that the grid fills the GPU when N is
small (N = 8192 is only 64 token blocks of 128 for 132 SMs); a second small kernel merges the shares' partials
(``5 x shares x N`` numbers) per token in share order. With a reference (``ref_hidden``, ``ref_weight``), the
same two kernels run once more on its pair, without the entropy: its log-probs, no gradients.

Backward (``d z = (1[j = y] - p) g_lp / T + p (lse - z - H) g_H / T``): the vocabulary is taken a chunk of
``V_c`` columns at a time. A Triton kernel recomputes the chunk's logits tiles (``tl.dot``, as the forward) and
writes ``d z`` in the parameters' dtype into one ``[N, V_c]`` buffer, then cuBLAS (``torch.mm``, float32
accumulation inside the GEMM) writes ``d weight[v0:v1] = d z^T @ hidden`` once, in the weight's dtype (every
token's contribution to those rows is in this one GEMM: no float32 ``[V, H]`` accumulator, no per-chunk cast
and add), and ``d hidden += d z @ weight[v0:v1]`` into a float32 ``[N, H]`` accumulator (cuBLAS's ``addmm`` with
``out_dtype=float32``: 16-bit operands, the sum kept in float32 across chunks, no temporary; fp32 inputs add into
``d hidden`` itself), ``d bias[v0:v1] = sum_n d z`` in float32. Chunks in a fixed order, no atomics: deterministic.

Why not a d-weight kernel per (V block, H block) that loops over the tokens and recomputes each logits tile it
needs: a ``[BLOCK_V, BLOCK_H]`` output needs ``d z`` for its ``BLOCK_V`` columns and every token, i.e. the full
``H``-long dot per tile, once per H block: ``H / BLOCK_H`` recomputes (32 at H = 4096, BLOCK_H = 128), 32 F of
logits FLOPs (F below) instead of 1 F. Keeping a ``[BLOCK_V, H]`` float32 accumulator on chip instead (2 MiB at
BLOCK_V = 128) does not fit. The ``d z`` buffer costs one write and two reads of ``N x V_c`` 16-bit entries per
chunk (2 x 3 x N x V bytes in all: 6.3 GB at the issue's size, ~1.3 ms of HBM at 4.8 TB/s) against GEMMs of
~2 x N x H x V FLOPs each.

Accounting at the issue's size (N = 8192, H = 4096, V = 128,256, bf16; ``F = 2 N H V = 8.6 TFLOP``):
forward 1 F (the fused kernel); backward 3 F (recomputed logits, ``d weight``, ``d hidden``): 4 F = 34.4 TFLOP
in all, against eager's 3 F plus its ``[N, V]`` float32 traffic. At ~650 TFLOP/s (H200 bf16 dense, measured
cuBLAS level; Triton's fused tile a bit less) that is ~53 ms for the GEMM work against eager's 66.5 ms: the
acceptance bound (0.85 x 66.5 = 56.5 ms) leaves little room, and only a GPU run can tell (``python -m
kl_kernels.bench.linear_fused_ab``). Extra memory: ``d weight`` 0.98 GiB (the result itself), the ``d z`` buffer
``N x V_c x 2`` bytes (``CHUNK_BYTES`` = 128 MiB: ``V_c`` = 8,192 at N = 8192), the float32 ``d hidden``
accumulator 128 MiB, ``d hidden`` 64 MiB, the forward's partials (``5 x shares x N``, < 2 MiB), ``lse``/entropy
``N`` floats: about 1.3 GiB, under the 1.5 GiB bound.

Conditions (:func:`fused_reason` says why a call is declined, and the caller falls back to the chunked path):
CUDA tensors (or CPU tensors under ``TRITON_INTERPRET=1``, for tests), Triton importable, float32 / bfloat16 /
float16 (float64 is declined: no tensor-core ``tl.dot`` path for it, and the chunked path computes it exactly
in float64), ``hidden [N, H]`` and ``weight [V, H]`` (and the reference's) with unit stride along H (any row
stride), ``bias`` contiguous. No size or alignment condition: tiles are masked. Speed wants H and the row
strides multiples of 16 (Triton specializes such ints; only then are the 16-bit tiles' H loops pipelined with
asynchronous copies: tests/test_linear_fused.py checks the sm_90 build at H = 4096).

``RECOMPUTE = "cublas"`` forms the backward's logits with one cuBLAS GEMM per chunk into the ``d z`` buffer
(rounded to the parameters' dtype, as eager's are) and the same d z kernel reads and overwrites them: no extra
memory, one more ``N x V_c`` write and read per chunk, cuBLAS's GEMM speed for the recompute instead of the Triton
tile's (a 128 x 64 tile reads ~43 FLOP per byte from L2, below what the tensor cores need at full rate). Which is
faster is for a GPU run to say (the A/B bench's ``fused`` and ``fused-cublas``); the default stays ``"triton"``
(float32 logits, no rounding).

fp32 inputs follow ``torch.backends.cuda.matmul.allow_tf32``: ``tl.dot(..., input_precision="tf32")`` where it is
set (the forward's logits then carry TF32's ~1e-3 relative error, as cuBLAS's would), ``"ieee"`` otherwise; the
backward's ``torch.mm`` follows the same flag by itself.

Example (CUDA tensors; the lead's dispatch in ``linear_token_logprobs`` calls it after ``prepare``)::

    h = torch.randn(8192, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(128256, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    y = torch.randint(0, 128256, (8192,), device="cuda")
    assert fused_reason(h, w) is None
    lp, ent, lse, _ = FusedLinearTokenLogprobs.apply(h, w, None, y, y >= 0, 1.0, True)  # [N] float32 each
    (lp.sum() + 0.01 * ent.sum()).backward()  # h.grad [N, H], w.grad [V, H], bf16
"""

from __future__ import annotations

import torch

from ..launching import resolved
from ..vocab_rows import triton_cap, triton_cap_flag

# Workspace of the backward's d z buffer: N x V_c entries of the parameters' dtype, V_c a multiple of the
# tile's BLOCK_V (at least one tile)
CHUNK_BYTES = 128 << 20
COMBINE_BLOCK = 128
# How the backward forms a chunk's logits again: "triton" (on chip in the d z kernel, float32, never stored) or
# "cublas" (one GEMM into the d z buffer, rounded to the parameters' dtype as eager's logits are, then read by the
# d z kernel). Which is faster on a GPU is unmeasured: kl_kernels/bench/linear_fused_ab.py times both.
RECOMPUTE = "triton"
# (BLOCK_N, BLOCK_V, BLOCK_K, num_warps, num_stages) on a GPU, by the inputs' element size (fp32: by tl.dot's
# precision): compiled for sm_90 without spills (tests/test_linear_fused.py), registers (fwd/d z kernel) 172/236
# for 16-bit (3 stages of cp.async over H), 176/98 for fp32 "ieee" (an FMA dot: larger fp32 tiles spilled),
# 174/186 for "tf32"; 128 x 128
# 16-bit tiles spilled in the d z kernel. Untimed: a GPU session tunes them (kl_kernels/bench/linear_fused_ab.py).
# Under the interpreter small tiles, so that test shapes cross tile and share boundaries.
GPU_TILES = {2: (128, 64, 64, 8, 3), 4: (128, 32, 16, 8, 2), "tf32": (128, 64, 32, 8, 2)}
# the d z kernel reading cuBLAS's logits (RECOMPUTE = "cublas"): no tl.dot, 16 entries per thread (32 spilled)
FROM_BUFFER_TILES = (32, 128, 16, 8, 1)
INTERPRETER_TILES = (16, 32, 16, 4, 1)
INTERPRETER_SHARES = 3  # up to this many shares of the vocabulary under the interpreter (the combine's merge)
FUSED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# every output and workspace comes from here: tests NaN-fill them (poison) so that an unwritten one fails
_alloc = torch.empty


def _kernels():
    from ..triton import linear_rows as k  # imported on first use: triton is optional

    return k.linear_rows_fwd_kernel, k.linear_rows_combine_kernel, k.linear_rows_dlogits_kernel


def _interpreting() -> bool:
    from ..triton import interpreting

    return interpreting()


def fused_reason(hidden, weight, bias=None, ref_hidden=None, ref_weight=None, ref_bias=None) -> str | None:
    """Why the fused kernels cannot take these (already checked) tensors, or None when they can: the conditions
    of the module docstring. ``hidden`` is ``[N, H]`` (the token dims flattened)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return "triton is not installed"
    if hidden.device.type != "cuda" and not (hidden.device.type == "cpu" and _interpreting()):
        return f"needs CUDA tensors (got {hidden.device.type}; CPU tensors only under TRITON_INTERPRET=1)"
    if hidden.dtype not in FUSED_DTYPES:
        return (f"{hidden.dtype} is not fused (float32, bfloat16, float16 are): no tensor-core tl.dot path for it; "
                "the chunked path computes it")
    for name, t in (("hidden", hidden), ("weight", weight), ("ref_hidden", ref_hidden), ("ref_weight", ref_weight)):
        if t is not None and (t.dim() != 2 or (t.stride(1) != 1 and t.shape[1] > 1)):
            return f"{name} must be 2-D with unit stride along H (got shape {list(t.shape)}, strides {t.stride()})"
    for name, t in (("bias", bias), ("ref_bias", ref_bias)):
        if t is not None and not t.is_contiguous():
            return f"{name} must be contiguous"
    return None


def _tiles(dtype):
    if _interpreting():
        return INTERPRETER_TILES
    return GPU_TILES["tf32" if _precision(dtype) == "tf32" else torch.empty((), dtype=dtype).element_size()]


def _precision(dtype) -> str:
    """tl.dot's input precision: fp32 inputs follow torch's TF32 switch for CUDA matmuls."""
    if dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32 and not _interpreting():
        return "tf32"
    return "ieee"


def _upcast(dtype) -> bool:
    """Tiles to float32 before tl.dot: bf16 under the interpreter only (its bf16 dot is wrong)."""
    return dtype == torch.bfloat16 and _interpreting()


def _shares(rows: int, vocab: int, block_n: int, block_v: int, device) -> int:
    """Vocabulary shares per token block: enough programs for two per SM, each share whole tiles."""
    tiles = -(-vocab // block_v)
    if _interpreting():
        return max(1, min(INTERPRETER_SHARES, tiles))
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    blocks = -(-rows // block_n)
    return max(1, min(tiles, -(-2 * sms // blocks)))


def forward_rows(hidden, weight, bias, labels, counted, temperature: float, want_entropy: bool, softcap: float = 0.0):
    """``(log_probs, entropy, lse)`` float32 ``[N]`` (entropy ``[0]`` without ``want_entropy``) of ``softmax((hidden
    @ weight.T + bias) / temperature)`` at ``labels [N]``, 0 where ``counted [N]`` (bool) is False. ``hidden [N,
    H]``, ``weight [V, H]``, ``bias [V]`` or None, as :func:`fused_reason` accepts them. ``softcap`` (kernel units,
    0.0: none): the logits ``x`` become ``c tanh(x / c)`` before the temperature."""
    fwd, combine, _ = _kernels()
    hidden, weight = resolved(hidden, weight)
    n, hid = hidden.shape
    vocab, dev = weight.shape[0], hidden.device
    lp = _alloc(n, dtype=torch.float32, device=dev)
    ent = _alloc(n if want_entropy else 0, dtype=torch.float32, device=dev)
    lse = _alloc(n, dtype=torch.float32, device=dev)
    if n == 0:
        return lp, ent, lse
    bn, bv, bk, warps, stages = _tiles(hidden.dtype)
    shares = _shares(n, vocab, bn, bv, dev)
    per_share = -(-(-(-vocab // bv)) // shares) * bv  # whole tiles per share
    shares = -(-vocab // per_share)
    part_m = _alloc((shares, n), dtype=torch.float32, device=dev)
    part_s = _alloc((shares, n), dtype=torch.float64, device=dev)
    part_w = _alloc((shares, n), dtype=torch.float64, device=dev)
    part_zy = _alloc((shares, n), dtype=torch.float32, device=dev)
    part_nan = _alloc((shares, n), dtype=torch.int32, device=dev)
    labels = labels.contiguous()
    flags = counted.contiguous().view(torch.uint8)  # the kernels read the bool mask as bytes
    b = bias.contiguous() if bias is not None else lp  # (a valid stand-in pointer, never read)
    fwd[(-(-n // bn), shares)](hidden, weight, b, labels, part_m, part_s, part_w, part_zy, part_nan, n, vocab, hid,
                               hidden.stride(0), weight.stride(0), per_share, 1.0 / temperature,
                               *triton_cap(temperature, softcap), HAS_BIAS=bias is not None,
                               WANT_ENTROPY=want_entropy, PRECISION=_precision(hidden.dtype),
                               UPCAST=_upcast(hidden.dtype), BLOCK_N=bn, BLOCK_V=bv, BLOCK_K=bk,
                               **triton_cap_flag(softcap), num_warps=warps, num_stages=stages)
    combine[(-(-n // COMBINE_BLOCK),)](part_m, part_s, part_w, part_zy, part_nan, labels, flags, lp, lse,
                                       ent if want_entropy else lp, n, vocab, shares, WANT_ENTROPY=want_entropy,
                                       BLOCK=COMBINE_BLOCK, num_warps=4)
    return lp, ent, lse


def vocab_chunk(rows: int, vocab: int, element_size: int, block_v: int) -> int:
    """Columns per backward chunk: ``CHUNK_BYTES`` of ``d z`` entries, whole tiles, at least one tile."""
    cols = max(block_v, CHUNK_BYTES // max(1, rows * element_size) // block_v * block_v)
    return min(cols, -(-vocab // block_v) * block_v)


def backward_rows(grad_lp, grad_entropy, hidden, weight, bias, labels, counted, temperature: float, lse, entropy,
                  needs=(True, True, True), recompute: str | None = None, softcap: float = 0.0):
    """``(d hidden, d weight, d bias)`` (None where ``needs`` says no, or no bias) of ``sum(grad_lp * log_probs +
    grad_entropy * entropy)`` (either gradient may be None), from :func:`forward_rows`' ``lse`` and ``entropy``,
    in the parameters' dtypes. ``recompute`` (default ``RECOMPUTE``): how a chunk's logits are formed again,
    ``"triton"`` (on chip, in the d z kernel) or ``"cublas"`` (one GEMM into the d z buffer, in the parameters'
    dtype, which the d z kernel then reads and overwrites)."""
    recompute = RECOMPUTE if recompute is None else recompute
    if recompute not in ("triton", "cublas"):
        raise ValueError(f"recompute must be 'triton' or 'cublas', got {recompute!r}")
    _, _, dlogits = _kernels()
    hidden, weight = resolved(hidden, weight)
    n, hid = hidden.shape
    vocab, dev, dtype = weight.shape[0], hidden.device, hidden.dtype
    want_h, want_w, want_b = needs[0], needs[1], needs[2] and bias is not None
    d_hidden = _alloc(hidden.shape, dtype=dtype, device=dev) if want_h else None
    d_weight = _alloc(weight.shape, dtype=dtype, device=dev) if want_w else None
    d_bias = _alloc(vocab, dtype=torch.float32, device=dev) if want_b else None
    if n == 0 or (grad_lp is None and grad_entropy is None):
        for t in (d_hidden, d_weight, d_bias):
            if t is not None:
                t.zero_()
        return d_hidden, d_weight, None if d_bias is None else d_bias.to(dtype)
    bn, bv, bk, warps, stages = _tiles(dtype)
    cols = vocab_chunk(n, vocab, hidden.element_size(), bv)
    chunks = -(-vocab // cols)
    if recompute == "cublas" and not _interpreting():
        bn, bv, bk, warps, stages = FROM_BUFFER_TILES  # an elementwise pass: its own tile (the GEMM tile spilled)
    # cuBLAS writes a chunk's logits contiguous (a [n, v1 - v0] view of the front of the buffer); the Triton
    # recompute keeps the buffer's row stride (cols) for every chunk
    flat = _alloc(n * cols, dtype=dtype, device=dev)
    from_buffer = recompute == "cublas"
    acc = (_alloc(hidden.shape, dtype=torch.float32, device=dev)
           if want_h and chunks > 1 and dtype != torch.float32 else None)
    g_lp = None if grad_lp is None else grad_lp.reshape(-1).to(torch.float32).contiguous()
    g_ent = None if grad_entropy is None else grad_entropy.reshape(-1).to(torch.float32).contiguous()
    labels = labels.contiguous()
    flags = counted.contiguous().view(torch.uint8)
    b = bias.contiguous() if bias is not None else lse
    for c in range(chunks):
        v0, v1 = c * cols, min((c + 1) * cols, vocab)
        if from_buffer:
            d = flat[:n * (v1 - v0)].view(n, v1 - v0)
            if bias is not None:
                torch.addmm(bias[v0:v1], hidden, weight[v0:v1].t(), out=d)
            else:
                torch.mm(hidden, weight[v0:v1].t(), out=d)
        else:
            d = flat.view(n, cols)[:, :v1 - v0]
        dlogits[(-(-n // bn), -(-(v1 - v0) // bv))](
            hidden, weight, b, labels, flags, lse, entropy if g_ent is not None else lse,
            g_lp if g_lp is not None else lse, g_ent if g_ent is not None else lse, d, n, hid, v0, v1,
            hidden.stride(0), weight.stride(0), d.stride(0), 1.0 / temperature, *triton_cap(temperature, softcap),
            HAS_BIAS=bias is not None, HAS_G_LP=g_lp is not None, HAS_G_ENT=g_ent is not None,
            PRECISION=_precision(dtype), UPCAST=_upcast(dtype), FROM_BUFFER=from_buffer, BLOCK_N=bn, BLOCK_V=bv,
            BLOCK_K=bk, **triton_cap_flag(softcap), num_warps=warps, num_stages=stages)
        if d.device.type == "cpu" and d.stride(0) != d.shape[1]:
            # (CPU tensors: Triton's interpreter, tests) torch 2.13's CPU bf16 GEMM reads a strided operand's row
            # past its last column (the buffer's padding up to the row stride: poison NaN in the tests) into the
            # product: a contiguous copy. cuBLAS reads only the view.
            d = d.contiguous()
        if want_w:  # every token's share of these rows in one GEMM: written once, in the weight's dtype
            torch.mm(d.t(), hidden, out=d_weight[v0:v1])
        if want_h:
            _add_d_hidden(d, weight[v0:v1], d_hidden, acc, c == 0)
        if want_b:
            torch.sum(d, 0, dtype=torch.float32, out=d_bias[v0:v1])
    if acc is not None:
        d_hidden.copy_(acc)
    return d_hidden, d_weight, None if d_bias is None else d_bias.to(dtype)


def _add_d_hidden(d, w_c, d_hidden, acc, first: bool) -> None:
    """``d hidden (+)= d @ w_c``, summed over the chunks in float32: float32 inputs straight into ``d_hidden``
    (cuBLAS's beta = 1 epilogue); 16-bit ones on CUDA into the float32 ``acc`` by ``addmm`` with ``out_dtype``
    (bf16/fp16 operands, float32 result and accumulator: no temporary, no per-chunk rounding); elsewhere (CPU
    tensors under the interpreter, for tests) the chunk's product rounded in ``d_hidden`` and added to ``acc``.
    ``acc`` is None with one chunk: the product goes straight into ``d_hidden``."""
    beta = 0 if first else 1  # (beta 0: the buffer's old contents, poison included, are ignored)
    if acc is None:
        if first:
            torch.mm(d, w_c, out=d_hidden)
        else:
            d_hidden.addmm_(d, w_c, beta=beta)
    elif d.device.type == "cuda":
        torch.ops.aten.addmm.dtype_out(acc, d, w_c, torch.float32, beta=beta, out=acc)
    else:
        torch.mm(d, w_c, out=d_hidden)
        if first:
            acc.copy_(d_hidden)
        else:
            acc += d_hidden


class FusedLinearTokenLogprobs(torch.autograd.Function):
    """``apply(hidden [N, H], weight [V, H], bias [V] | None, labels [N], counted [N] bool, temperature,
    want_entropy, ref_hidden=None, ref_weight=None, ref_bias=None, softcap=0.0)`` (``temperature`` and ``softcap``
    in kernel units: ``kl_kernels.vocab_rows.logit_transform``; the reference takes the same) ->
    ``(log_probs [N], entropy [N] or [0],
    lse [N], ref_log_probs [N] or [0])``, float32, as ``linear.py``'s ``_LinearTokenLogprobs`` returns them;
    gradients to ``hidden``, ``weight`` and ``bias`` (none to the reference's tensors; the backward's recompute is
    ``RECOMPUTE`` as it was at the forward)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, counted, temperature, want_entropy, ref_hidden=None,
                ref_weight=None, ref_bias=None, softcap=0.0):
        lp, ent, lse = forward_rows(hidden, weight, bias, labels, counted, temperature, want_entropy, softcap)
        if ref_hidden is not None:
            ref_lp = forward_rows(ref_hidden.detach(), ref_weight.detach(),
                                  None if ref_bias is None else ref_bias.detach(), labels, counted, temperature,
                                  False, softcap)[0]
        else:
            ref_lp = lp.new_empty(0)
        ctx.save_for_backward(hidden, weight, bias, labels, counted, lse, ent)
        ctx.temperature, ctx.want_entropy, ctx.recompute, ctx.softcap = temperature, want_entropy, RECOMPUTE, softcap
        ctx.mark_non_differentiable(lse, ref_lp)
        return lp, ent, lse, ref_lp

    @staticmethod
    def backward(ctx, grad_lp, grad_ent, _grad_lse, _grad_ref_lp):
        hidden, weight, bias, labels, counted, lse, ent = ctx.saved_tensors
        needs = ctx.needs_input_grad[:3]
        grads = backward_rows(grad_lp, grad_ent if ctx.want_entropy else None, hidden, weight, bias, labels, counted,
                              ctx.temperature, lse, ent, needs, ctx.recompute, ctx.softcap)
        return (*grads, None, None, None, None, None, None, None, None)
