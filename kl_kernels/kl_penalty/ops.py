"""``torch.library`` registration of the fused kl_penalty_loss kernels: ops, fake tensors, autograd.

Two op pairs with one schema: ``kl_kernels::kl_penalty_fwd`` / ``_bwd`` around the C++ kernels
(``launch.py``, ``_C`` or ``_cuda`` by device) and ``kl_kernels::kl_penalty_triton_fwd`` / ``_bwd``
around the Triton kernels (``launch_triton.py``). The forward runs the fused pass: per-sequence sums, counts,
optional per-token outputs and the gradient buffer ``dloss_t / dlp_t``. Its autograd saves only
that buffer (plus the layout's index tensors) and ``kl_kernels::kl_penalty_bwd`` scales it by the
incoming gradients, so no activation is kept for backward. Coefficients (beta scalar, clip bounds,
entropy_coef) are runtime arguments of the schema: changing them never recompiles.
"""

from __future__ import annotations

import array
import math
from typing import Optional, Sequence

import torch
from torch import Tensor

from .. import op_library
from .._compat import torch as torch_compat
from ..launching import ESTIMATOR_CODES, LAYOUT_CODES, clamp_bounds
from . import launch, launch_triton
from .aggregate import KLPenaltyLossOutput, device_weight, make_output, uniform_parts
from .problem import KLPenaltyProblem
from .reference import RawLoss, sequence_log_ratio

_DEVICES = ("cpu", "cuda")
# Private autograd queries (AOTAutograd uses both) live in _compat.torch; a torch without them never
# scales the gradient buffer in place (_may_scale_in_place).


def _setup_context(ctx, inputs, output):
    (log_probs, _old, _ref, advantages, entropy, mask, offsets, lengths, _beta, _bs, _aps, layout, left_pad, _est,
     _st, _clo, _chi, entropy_coef, token_out, _weights, _clip_c, _weight_kl, _clamp, _seq_lr, _kl_ratio) = inputs
    ctx.save_for_backward(output[4], mask, offsets, lengths)  # the gradient buffer: the only float tensor kept
    ctx.params = (layout, left_pad, log_probs.dtype)
    ctx.entropy = (entropy is not None and entropy.requires_grad, advantages.dtype, entropy_coef)
    ctx.token_out = token_out
    ctx.mark_non_differentiable(output[1], output[2], output[4])
    # Outputs the loss does not use get no gradient (None), instead of zeros: autograd would
    # otherwise allocate and fill a zero tensor per output, the size of the batch for the token
    # outputs, on every backward.
    ctx.set_materialize_grads(False)


def _input_grads(ctx, g_seq_loss, g_token_out, bwd):
    """Gradients of the forward's 25 inputs, from the outputs' gradients through ``bwd`` (the op, or
    the launcher in eager mode)."""
    grad, mask, offsets, lengths = ctx.saved_tensors
    g_tok = g_token_out[0] if (ctx.token_out and g_token_out is not None) else None
    entropy_grad, aux_dtype, entropy_coef = ctx.entropy
    g_lp, g_ent = bwd(grad, g_seq_loss, g_tok, mask, offsets, lengths, *ctx.params, entropy_grad, aux_dtype,
                      entropy_coef)
    return (g_lp, None, None, None, g_ent if entropy_grad else None) + (None,) * 20


def _define(name: str, launcher):
    """Register ``kl_kernels::<name>_fwd`` / ``<name>_bwd`` around ``launcher``'s forward and backward
    (``launch`` or ``launch_triton``: same signatures), with fake implementations and autograd."""

    @op_library.define(f"kl_kernels::{name}_fwd", device_types=_DEVICES)
    def fwd(log_probs: Tensor, old_log_probs: Tensor, ref_log_probs: Optional[Tensor], advantages: Tensor,
            entropy: Optional[Tensor], mask: Optional[Tensor], offsets: Optional[Tensor], lengths: Optional[Tensor],
            beta: Optional[Tensor], beta_scalar: float, adv_per_seq: bool, layout: int, left_pad: bool,
            estimator: int, straight_through: bool, clip_lo: float, clip_hi: float, entropy_coef: float,
            token_out: bool, weights: Optional[Tensor], clip_c: float, weight_kl: bool,
            clamp: Sequence[float], seq_lr: Optional[Tensor],
            kl_ratio: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        """Fused forward: (seq_loss [B], stats [B, S], count [B], token_out [4, *shape] or [0], grad [*shape])
        (S: len(reference.STAT_COLUMNS))."""
        return launcher.forward(log_probs, old_log_probs, ref_log_probs, advantages, entropy, mask, offsets, lengths,
                                beta, beta_scalar, adv_per_seq, layout, left_pad, estimator, straight_through, clip_lo,
                                clip_hi, entropy_coef, token_out, weights, clip_c, weight_kl, clamp, seq_lr, kl_ratio)

    @fwd.register_fake
    def _(log_probs, old_log_probs, ref_log_probs, advantages, entropy, mask, offsets, lengths, beta, beta_scalar,
          adv_per_seq, layout, left_pad, estimator, straight_through, clip_lo, clip_hi, entropy_coef, token_out,
          weights, clip_c, weight_kl, clamp, seq_lr, kl_ratio):
        batch = offsets.shape[0] - 1 if layout == 0 else log_probs.shape[0]
        shape = log_probs.shape
        f32 = dict(dtype=torch.float32)
        return (log_probs.new_empty((batch,), **f32), log_probs.new_empty((batch, launch.STATS), **f32),
                log_probs.new_empty((batch,), dtype=torch.int64),
                log_probs.new_empty((4, *shape) if token_out else (0,), **f32), log_probs.new_empty(shape, **f32))

    @op_library.define(f"kl_kernels::{name}_bwd", device_types=_DEVICES)
    def bwd(grad: Tensor, g_seq: Optional[Tensor], g_tok: Optional[Tensor], mask: Optional[Tensor],
            offsets: Optional[Tensor], lengths: Optional[Tensor], layout: int, left_pad: bool, lp_dtype: torch.dtype,
            entropy_grad: bool, aux_dtype: torch.dtype, entropy_coef: float) -> tuple[Tensor, Tensor]:
        """Fused backward: (grad_log_probs, grad_entropy or [0]) from the saved buffer and the incoming grads."""
        return launcher.backward(grad, g_seq, g_tok, mask, offsets, lengths, layout, left_pad, lp_dtype,
                                 entropy_grad, aux_dtype, entropy_coef)

    @bwd.register_fake
    def _(grad, g_seq, g_tok, mask, offsets, lengths, layout, left_pad, lp_dtype, entropy_grad, aux_dtype,
          entropy_coef):
        return grad.new_empty(grad.shape, dtype=lp_dtype), grad.new_empty(grad.shape if entropy_grad else (0,),
                                                                          dtype=aux_dtype)

    def backward(ctx, g_seq_loss, _g_stats, _g_count, g_token_out, _g_grad):
        return _input_grads(ctx, g_seq_loss, g_token_out, bwd)

    fwd.register_autograd(backward, setup_context=_setup_context)
    return fwd, bwd


kl_penalty_fwd, kl_penalty_bwd = _define("kl_penalty", launch)
kl_penalty_triton_fwd, kl_penalty_triton_bwd = _define("kl_penalty_triton", launch_triton)
kl_penalty_cuda_emu_fwd, kl_penalty_cuda_emu_bwd = _define("kl_penalty_cuda_emu", launch.emulated)


class _EagerFused(torch.autograd.Function):
    """The same forward/backward as the registered ops, called directly in eager mode: the custom
    op's dispatch (argument normalization, schema checks) costs more than the backward kernel at
    RLHF batch sizes. ``torch.compile`` always goes through the ops."""

    @staticmethod
    def forward(ctx, launcher, grad_out, *args):
        out = launcher.forward(*args, grad_out=grad_out)
        _claim(grad_out)
        _setup_context(ctx, args, out)
        ctx.launcher = launcher
        return out

    @staticmethod
    def backward(ctx, g_seq_loss, _g_stats, _g_count, g_token_out, _g_grad):
        return (None, None) + _input_grads(ctx, g_seq_loss, g_token_out, ctx.launcher.backward)


def _claim(grad_out) -> None:
    """Mark the caller's gradient buffer (``out=``) as written: its version counter moves, so the
    backward of an earlier call that saved it, and whose gradient this call has just overwritten,
    raises autograd's "modified by an inplace operation" error instead of returning this call's
    gradient. (The kernels write it through a raw pointer, which autograd cannot see.)"""
    if grad_out is not None:
        torch.autograd.graph.increment_version(grad_out)


def _fused_args(p: KLPenaltyProblem, cpu_kernel: bool = False) -> tuple:
    """The 25 arguments of ``kl_kernels::kl_penalty_fwd`` (and of the launchers' forward) for ``p``.
    GSPO's sequence log-ratios come from the CPU kernel's pre-pass for the CPU kernel (``cpu_kernel``,
    eager), else from the reference's torch ops (on the device, no host read; traceable)."""
    lp = p.log_probs
    # Advantages, entropy and weights are read in the log-probs' dtype or in float32 (the kernels' aux dtype).
    aux = lp.dtype if all(t is None or t.dtype == lp.dtype for t in (p.advantages, p.entropy, p.weights)) \
        else torch.float32
    adv = p.advantages if p.advantages.dtype == aux else p.advantages.to(aux)
    ent = p.entropy if p.entropy is None or p.entropy.dtype == aux else p.entropy.to(aux)
    wts = p.weights if p.weights is None or p.weights.dtype == aux else p.weights.to(aux)
    beta_t = p.beta if isinstance(p.beta, torch.Tensor) else None
    clip_lo, clip_hi = p.clip if p.clip is not None else (float("-inf"), float("inf"))
    return (lp, p.old_log_probs, p.ref_log_probs, adv, ent, p.mask, p.offsets, p.lengths, beta_t,
            0.0 if beta_t is not None else float(p.beta), p.adv_per_seq, LAYOUT_CODES[p.layout],
            p.padding_side == "left", ESTIMATOR_CODES[p.estimator.rstrip("+")], p.estimator.endswith("+"),
            clip_lo, clip_hi, p.entropy_coef, p.aggregation == "none", wts,
            p.dual_clip if p.dual_clip is not None else math.inf, p.weight_kl,
            [*clamp_bounds(p.clamp_input), *clamp_bounds(p.clamp_output)], _sequence_log_ratio(p, cpu_kernel),
            p.kl_times_ratio)


def _sequence_log_ratio(p: KLPenaltyProblem, cpu_kernel: bool):
    if p.importance_sampling_level != "sequence":
        return None
    if cpu_kernel and not torch.compiler.is_compiling():
        return launch.sequence_log_ratio(p.log_probs, p.old_log_probs, p.mask, p.offsets, p.lengths,
                                         LAYOUT_CODES[p.layout], p.padding_side == "left")
    return sequence_log_ratio(p)


def run_fused(p: KLPenaltyProblem, triton: bool = False, emulated: bool = False) -> RawLoss:
    """The fused backends' entry point: a normalized problem through ``kl_kernels::kl_penalty_fwd``
    (C++ kernels), ``kl_kernels::kl_penalty_triton_fwd`` (``triton=True``) or
    ``kl_kernels::kl_penalty_cuda_emu_fwd`` (``emulated=True``: the CUDA kernels on CPU tensors)."""
    args = _fused_args(p, cpu_kernel=not (triton or emulated) and p.device.type == "cpu")
    lp, ent, token_out = args[0], args[4], args[18]
    needs_graph = torch.is_grad_enabled() and (lp.requires_grad or (ent is not None and ent.requires_grad))
    launcher = launch_triton if triton else launch.emulated if emulated else launch
    if torch.compiler.is_compiling():  # (no out= here: problem.py refuses it under compile)
        op = kl_penalty_triton_fwd if triton else kl_penalty_cuda_emu_fwd if emulated else kl_penalty_fwd
        seq_loss, stats, count, tok, _ = op(*args)
    elif needs_graph:
        seq_loss, stats, count, tok, _ = _EagerFused.apply(launcher, p.grad_out, *args)
    else:
        seq_loss, stats, count, tok, _ = launcher.forward(*args, grad_out=p.grad_out)
        _claim(p.grad_out)
    return RawLoss(seq_loss, stats, count, tok if token_out else None)


def _save_folded(ctx, args, saved, kernel_args, keep) -> None:
    """What the backward of a folded forward (:class:`_EagerTotal`, :class:`_EagerOnDevice`) needs:
    ``saved`` (the gradient buffer first) and the geometry tensors that ``kernel_args``, the
    forward's argument struct reused by the backward, points into (kept alive with ``keep``), and
    the dtypes of log_probs, entropy (when it takes a gradient) and advantages."""
    lp, ent, mask, offsets, lengths = args[0], args[4], args[5], args[6], args[7]
    ctx.save_for_backward(*saved, mask, offsets, lengths)
    ctx.kernel_args, ctx.keep = kernel_args, keep
    ctx.dtypes = (lp.dtype, ent is not None and ent.requires_grad, args[3].dtype)
    ctx.set_materialize_grads(False)


class _EagerTotal(torch.autograd.Function):
    """The CPU kernel with the aggregation folded in, for eager calls that aggregate on the host
    (:func:`~kl_kernels.kl_penalty.aggregate.on_host`): the kernel also returns the batch totals, the
    loss ``w * sum_b S_b`` is built from them, and its backward hands ``g_loss * w`` to the backward
    kernel through the forward's own argument struct. One autograd node and a few torch calls per
    step instead of a node per aggregation op and a second argument struct: measured on the 2-core
    CI VM, a step's fixed cost went from ~650 to ~490 us (of ~1.3 ms at B=256, 137k tokens)."""

    @staticmethod
    def forward(ctx, p, num_global_tokens, planned, *args):
        return _total_forward(ctx, p, planned, None, args, num_global_tokens)

    @staticmethod
    def backward(ctx, g_loss, _g_rest, _g_count, _g_stats, _g_seq_count):
        lp_dtype, entropy_grad, aux_dtype = ctx.dtypes
        g_lp = g_ent = None
        if g_loss is not None:
            grad = ctx.saved_tensors[0]
            scale = float(g_loss) * ctx.w
            if _may_scale_in_place(ctx, lp_dtype, entropy_grad, scale):
                g_lp = grad.mul_(scale)
            else:
                g_lp, g_ent = launch.backward_with_args(ctx.kernel_args, grad, scale, lp_dtype, entropy_grad,
                                                        aux_dtype)
        if ctx.planned:  # _PlannedTotal: (p, planned, log_probs, args)
            return None, None, g_lp, None
        return (None, None, None, g_lp, None, None, None, g_ent) + (None,) * 20


def _total_forward(ctx, p, planned, log_probs, args, num_global_tokens=None):
    """:class:`_EagerTotal`'s forward, and :class:`_PlannedTotal`'s itself (one Python-level call less
    per planned call): ``args`` the fused forward's arguments, ``planned`` a call plan's launcher
    (launch.TotalsPlan, kl_kernels/plans.py) or None for the launcher's full filling; ``log_probs`` is
    ``args[0]`` (unused here: _PlannedTotal's differentiable input)."""
    ctx.planned = planned is not None
    if planned is None:
        grad, totals, stats, seq_count, kernel_args, keep = launch.forward_with_totals(*args, grad_out=p.grad_out)
    else:
        grad, totals, stats, seq_count, kernel_args, keep = planned(
            *args[:8], args[9] if args[8] is None else args[8], args[19], grad_out=p.grad_out)
    if p.grad_out is not None:  # (tested here: no call per step without out=)
        _claim(p.grad_out)
    w, parts = uniform_parts(p, totals[1:], num_global_tokens)
    _save_folded(ctx, args, (grad,), kernel_args, keep)
    ctx.w = w
    # Saved-tensor hooks (offloading, checkpointing tools) may keep the buffer they were handed:
    # then the backward must not write into it.
    ctx.plain_saved = not torch_compat.saved_tensors_hooks_active()
    # scalar_tensor and frombuffer: half the cost of torch.tensor, which parses a Python list
    loss = torch.scalar_tensor(totals[0] * w, dtype=torch.float32)
    rest = torch.frombuffer(array.array("f", parts), dtype=torch.float32)  # rounded as torch.tensor would
    count = torch.scalar_tensor(int(totals[-1]), dtype=torch.int64)  # the last total: the token count
    ctx.mark_non_differentiable(rest, count, stats, seq_count)
    return loss, rest, count, stats, seq_count


def _may_scale_in_place(ctx, lp_dtype, entropy_grad, scale: float) -> bool:
    """Whether :class:`_EagerTotal`'s backward may return its gradient buffer scaled in place
    instead of a new tensor from the backward kernel: the same values bit for bit (the buffer is
    +0 at non-counted tokens, as the kernel writes them, and a finite ``scale`` with a + sign keeps
    them +0), one buffer less and no pass writing fresh memory; autograd then takes the buffer as
    ``.grad`` without a copy (a caller's ``out=`` buffer too: then autograd copies it into a leaf's
    ``.grad``, as the caller still holds it, and hands it on through a non-leaf). Only when nothing
    can read the buffer again: this backward is the graph's last (no ``retain_graph``: the saved
    buffer is released right after) and no saved-tensor hook may hold it. Float32 log-probs only (the buffer is float32)."""
    # finite with a + sign: 0 < scale < inf, or +0.0 (copysign only then: two builtin calls less per call)
    return (lp_dtype == torch.float32 and not entropy_grad and ctx.plain_saved
            and (0.0 < scale < math.inf or (scale == 0.0 and math.copysign(1.0, scale) > 0))
            and not torch_compat.graph_keeps_graph())


def run_fused_aggregated(p: KLPenaltyProblem, num_global_tokens) -> KLPenaltyLossOutput:
    """``kl_penalty_loss``'s result for an eager CPU call that aggregates on the host
    (:func:`~kl_kernels.kl_penalty.aggregate.on_host`), through the C++ kernel with the aggregation
    folded in (:class:`_EagerTotal`). Same values as ``aggregate(p, run_fused(p))`` up to the
    rounding of the per-sequence sums (summed in float64 here, float32 there)."""
    return make_output(*_EagerTotal.apply(p, num_global_tokens, None, *_fused_args(p, cpu_kernel=True)))


class _PlannedTotal(torch.autograd.Function):
    """:class:`_EagerTotal` for a call plan, its 25 arguments handed over as one tuple next to the
    log-probs (the only input a plan's call differentiates: no entropy): autograd's ``apply`` then
    walks 4 arguments instead of 28 (~60 Python-level calls less per call). Applied by api.py's
    ``_TotalsPlan`` as ``_PlannedTotal.apply(PlannedTotals(...), planned, log_probs, args)``: ``args`` the 25
    arguments of the fused forward (no entropy), ``planned`` the plan's launcher (launch.TotalsPlan)."""

    forward = staticmethod(_total_forward)  # (ctx, p, planned, log_probs, args)

    backward = _EagerTotal.backward  # (its gradients, in this forward's argument positions: see _plan_grads)


class PlannedTotals:
    """What :func:`~kl_kernels.kl_penalty.aggregate.uniform_parts` and :class:`_EagerTotal` read of a
    problem, for one planned call: the plan's constants and this call's beta and gradient buffer."""

    __slots__ = ("aggregation", "norm_length", "batch_size", "entropy_coef", "beta", "grad_out")

    def __init__(self, constants: tuple, beta, grad_out):
        self.aggregation, self.norm_length, self.batch_size, self.entropy_coef = constants
        self.beta, self.grad_out = beta, grad_out

    @staticmethod
    def constants(p: KLPenaltyProblem) -> tuple:
        return p.aggregation, p.norm_length, p.batch_size, p.entropy_coef


class _EagerOnDevice(torch.autograd.Function):
    """The CUDA (or Triton) kernels with the aggregation folded in, for eager calls
    (:func:`~kl_kernels.kl_penalty.aggregate.on_device`): the forward's totals kernel writes the
    loss, its parts, the count and the weight ``w`` on the device, and the backward kernel reads the
    loss's gradient, ``w`` and (seq-mean-token-mean) the sequences' counts there. One autograd
    node, the kernels' launches and a few allocations per step, nothing read on the host: on a GPU
    the generic aggregation's ~40 small launches per step cost more than the kernels
    (bench/results/gpu-h200-2026-11-26-third)."""

    @staticmethod
    def forward(ctx, p, agg, launcher, ext, *args):
        loss, rest, count, weight, grad, stats, seq_count, kernel_args, keep = launcher.forward_aggregated(
            args, *agg, ext=ext, grad_out=p.grad_out)
        _claim(p.grad_out)
        _save_folded(ctx, args, (grad, weight), kernel_args, keep)
        ctx.launcher, ctx.ext = launcher, ext
        ctx.mark_non_differentiable(rest, count, stats, seq_count)
        return loss, rest, count, stats, seq_count

    @staticmethod
    def backward(ctx, g_loss, _g_rest, _g_count, _g_stats, _g_seq_count):
        lp_dtype, entropy_grad, aux_dtype = ctx.dtypes
        g_lp = g_ent = None
        if g_loss is not None:
            grad, weight = ctx.saved_tensors[:2]
            g_lp, g_ent = ctx.launcher.backward_aggregated(ctx.kernel_args, grad, weight, g_loss, lp_dtype,
                                                           entropy_grad, aux_dtype, ext=ctx.ext)
        return (None, None, None, None, g_lp, None, None, None, g_ent) + (None,) * 20


class _PlannedOnDevice(torch.autograd.Function):
    """:class:`_EagerOnDevice` for a call plan on a device (api.py's ``_DevicePlan``): the launcher's
    :class:`~kl_kernels.kl_penalty.launch.AggregatedPlan` (``planned``) with the call's inputs as one
    tuple ``args`` = (log_probs, old_log_probs, ref_log_probs, advantages, mask, offsets, lengths, beta,
    agg_beta) next to the log-probs, the only input it differentiates; ``grad_out`` the caller's buffer
    (``out=``) or None."""

    @staticmethod
    def forward(ctx, grad_out, planned, log_probs, args):
        loss, rest, count, weight, grad, stats, seq_count, kernel_args, keep = planned(*args, grad_out=grad_out)
        if grad_out is not None:
            _claim(grad_out)
        # (as _save_folded: what the struct points into stays alive, and modified in place it fails loudly)
        ctx.save_for_backward(grad, weight, args[4], args[5], args[6])
        ctx.kernel_args, ctx.keep, ctx.planned = kernel_args, keep, planned
        ctx.dtypes = (log_probs.dtype, args[3].dtype)
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(rest, count, stats, seq_count)
        return loss, rest, count, stats, seq_count

    @staticmethod
    def backward(ctx, g_loss, _g_rest, _g_count, _g_stats, _g_seq_count):
        if g_loss is None:
            return None, None, None, None
        grad, weight = ctx.saved_tensors[:2]
        return None, None, ctx.planned.backward(ctx.kernel_args, grad, weight, g_loss, *ctx.dtypes), None


def run_fused_on_device(p: KLPenaltyProblem, num_global_tokens, emulated: bool = False,
                        triton: bool = False) -> KLPenaltyLossOutput:
    """``kl_penalty_loss``'s result for an eager call of the CUDA kernels (``emulated``: under host
    emulation, on CPU tensors; ``triton``: the Triton kernels) that they aggregate themselves
    (:func:`~kl_kernels.kl_penalty.aggregate.on_device`), through :class:`_EagerOnDevice`. Same
    formulas and float64 sums as ``aggregate(p, run_fused(p))``, in another order."""
    scale, per_token, seq_mean, tokens = device_weight(p, num_global_tokens)
    beta = 0.0 if isinstance(p.beta, torch.Tensor) else float(p.beta)
    agg = (scale, per_token, seq_mean, tokens, beta, float(p.entropy_coef))
    launcher, ext = (launch_triton, None) if triton else (launch, launch.EMULATED if emulated else None)
    return make_output(*_EagerOnDevice.apply(p, agg, launcher, ext, *_fused_args(p)))
