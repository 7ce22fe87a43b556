"""Host launcher of the fused kl_penalty_loss kernels: allocate outputs, fill the argument struct, launch.

The compiled kernels (``csrc/cpu/kl_penalty_cpu.cpp``, ``csrc/cuda/kl_penalty_cuda.cu``) take a plain
``KLPenaltyArgs`` whose ``g`` member carries the geometry, mask and log-probs every fused kernel
shares (filled by ``launching.geometry_args``); this module adds the loss's own inputs. Inputs may
have any strides; outputs are allocated contiguous in the layout's shape. Everything has been
validated by ``problem.py``.
"""

from __future__ import annotations

import math

import torch

from .. import plans
from .aggregate import RESULT_FIELDS
from .reference import STAT_COLUMNS
from ..launching import (DTYPE_CODES, EMULATED, NO_CLAMP, ExtensionLauncher, as_contiguous, coefficient,
                         geometry_args, kernel_module, launch_kernel, ptr, read_as_is, resolved, strides)

# The layouts the kernels write (csrc/common/kl_penalty_args.h's kStatColumns, kTotals, kResults; the extensions
# export them and tests/test_kl_penalty_diagnostics.py compares): per-sequence stats [B, STATS], the CPU forward's
# batch totals (the loss, the stats' sums, the token count) and the device aggregation's results.
STATS = len(STAT_COLUMNS)
TOTALS = 1 + STATS + 1
RESULTS = len(RESULT_FIELDS)


def _args(module, like, mask, offsets, lengths, layout, left_pad, estimator, straight_through, lp_dtype,
          clamp=NO_CLAMP):
    """KLPenaltyArgs with the geometry of ``like`` (a per-token tensor of the problem's shape) and the
    KL's clamps (``clamp``: [in_lo, in_hi, out_lo, out_hi], missing bounds infinite)."""
    g, keep = geometry_args(module, log_probs=like, mask=mask, offsets=offsets, lengths=lengths, prompt_lens=None,
                            layout=layout, left_pad=left_pad, estimator=estimator, straight_through=straight_through,
                            clamp=clamp)
    g.dtype = DTYPE_CODES[lp_dtype]
    a = module.KLPenaltyArgs()
    a.g = g
    return a, keep


def _prepare_forward(log_probs, old_log_probs, ref_log_probs, advantages, entropy, mask, offsets, lengths, beta,
                     beta_scalar, adv_per_seq, layout, left_pad, estimator, straight_through, clip_lo, clip_hi,
                     entropy_coef, token_out, weights=None, clip_c=math.inf, weight_kl=False, clamp=NO_CLAMP,
                     seq_lr=None, kl_ratio=False, ext=None):
    """(module, args, keep) of a forward: the argument struct filled with the inputs (no outputs yet)."""
    given = (log_probs, old_log_probs, ref_log_probs, advantages, entropy, mask, offsets, lengths, beta, weights,
             seq_lr)
    inputs = resolved(*given)
    log_probs, old_log_probs, ref_log_probs, advantages, entropy, mask, offsets, lengths, beta, weights, seq_lr = inputs
    dev = log_probs.device
    module = kernel_module(dev, "kl_penalty_forward", "kl_penalty_loss", ext)
    a, keep = _args(module, log_probs, mask, offsets, lengths, layout, left_pad, estimator, straight_through,
                    log_probs.dtype, clamp)
    keep.extend(r for r, t in zip(inputs, given) if r is not t)  # copies made by resolved: the struct points there
    for name, t in (("old", old_log_probs), ("ref", ref_log_probs), ("ent", entropy), ("wt", weights)):
        if t is not None:
            setattr(a, name, ptr(t))
            s0, s1 = strides(t, layout)
            setattr(a, f"{name}_s0", s0)
            setattr(a, f"{name}_s1", s1)
    a.adv = ptr(advantages)
    a.adv_per_seq = int(adv_per_seq)
    a.adv_s0, a.adv_s1 = (advantages.stride(0), 0) if adv_per_seq else strides(advantages, layout)
    a.aux_dtype = DTYPE_CODES[advantages.dtype]
    a.beta_mode, a.beta_scalar, a.beta = coefficient(beta, beta_scalar, keep)
    a.clip_lo, a.clip_hi, a.entropy_coef = float(clip_lo), float(clip_hi), float(entropy_coef)
    a.clip_c, a.weight_kl = float(clip_c), int(bool(weight_kl))
    a.seq_lr = ptr(seq_lr) if seq_lr is not None else 0  # float32 [B], contiguous (problem.py)
    a.kl_ratio = int(bool(kl_ratio))
    return module, a, keep


def forward(log_probs, old_log_probs, ref_log_probs, advantages, entropy, mask, offsets, lengths, beta, beta_scalar,
            adv_per_seq, layout, left_pad, estimator, straight_through, clip_lo, clip_hi, entropy_coef, token_out,
            weights=None, clip_c=math.inf, weight_kl=False, clamp=NO_CLAMP, seq_lr=None, kl_ratio=False, ext=None,
            grad_out=None):
    """Run the fused forward; returns (seq_loss [B], stats [B, STATS], count [B], token_out [4, *shape] or
    empty, grad [*shape]), all float32 but count (int64). ``ext``: the extension to run (default:
    ``_C`` or ``_cuda`` by device). ``grad_out``: the caller's float32 buffer for ``grad`` (checked by
    ``problem.py``), written in place and returned. ``weights`` (per token, the aux dtype, or None),
    ``clip_c`` (dual clip, inf: none), ``weight_kl``, ``clamp`` (the KL's [in_lo, in_hi, out_lo,
    out_hi], infinite: none), ``seq_lr`` (float32 [B] sequence log-ratios, GSPO; None: per token) and
    ``kl_ratio`` (kl_times_ratio): see ``kl_penalty_loss``.

    A call without ``grad_out`` whose signature (the options and the tensors' facts, kl_kernels/plans.py)
    was seen runs that signature's :class:`ForwardPlan`: what the op ``kl_kernels::kl_penalty_fwd`` runs
    inside a ``torch.compile``d graph, where api.py's plans do not reach."""
    if grad_out is None:
        key = (ext, adv_per_seq, layout, left_pad, estimator, straight_through, clip_lo, clip_hi, entropy_coef,
               token_out, clip_c, weight_kl, tuple(clamp), kl_ratio,
               plans.facts(log_probs, old_log_probs, ref_log_probs, advantages, entropy, mask, offsets, lengths, beta,
                           weights, seq_lr))
        plan = _PLANS.get(key)
        if plan is None:
            plan = ForwardPlan.of(
                (log_probs, old_log_probs, ref_log_probs, advantages, entropy, mask, offsets, lengths, beta,
                 beta_scalar, adv_per_seq, layout, left_pad, estimator, straight_through, clip_lo, clip_hi,
                 entropy_coef, token_out, weights, clip_c, weight_kl, clamp, seq_lr, kl_ratio), ext)
            _PLANS.put(key, plan)
        if type(plan) is ForwardPlan:
            return plan(log_probs, old_log_probs, ref_log_probs, advantages, entropy, mask, offsets, lengths, beta,
                        beta_scalar, weights, seq_lr)
    module, a, keep = _prepare_forward(
        log_probs, old_log_probs, ref_log_probs, advantages, entropy, mask, offsets, lengths, beta, beta_scalar,
        adv_per_seq, layout, left_pad, estimator, straight_through, clip_lo, clip_hi, entropy_coef, token_out, weights,
        clip_c, weight_kl, clamp, seq_lr, kl_ratio, ext)
    dev, batch, shape = log_probs.device, a.g.batch, log_probs.shape
    seq_loss = torch.empty(batch, dtype=torch.float32, device=dev)
    stats = torch.empty(batch, STATS, dtype=torch.float32, device=dev)
    count = torch.empty(batch, dtype=torch.int64, device=dev)
    tok = torch.empty((4, *shape) if token_out else (0,), dtype=torch.float32, device=dev)
    grad = torch.empty(shape, dtype=torch.float32, device=dev) if grad_out is None else grad_out
    a.seq_loss, a.stats, a.count, a.grad = ptr(seq_loss), ptr(stats), ptr(count), ptr(grad)
    a.token_out = ptr(tok) if token_out else 0
    launch_kernel(module, module.kl_penalty_forward, a, dev, "kl_penalty_loss",
                  workspace_bytes=lambda a: module.kl_penalty_workspace_bytes(a))
    del keep
    return seq_loss, stats, count, tok, grad


def sequence_log_ratio(log_probs, old_log_probs, mask, offsets, lengths, layout, left_pad):
    """GSPO's pre-pass on the CPU (``kl_penalty_sequence_log_ratio`` in ``_C``): float32 ``[B]``, the mean
    of ``lp - old`` over each sequence's counted tokens (float64 sums; 0 without any). ``log_probs`` and
    ``old_log_probs`` in one of the kernels' dtypes, on the CPU."""
    log_probs, old_log_probs, mask, offsets, lengths = resolved(log_probs, old_log_probs, mask, offsets, lengths)
    module = kernel_module(log_probs.device, "kl_penalty_sequence_log_ratio", "kl_penalty_loss")
    a, keep = _args(module, log_probs, mask, offsets, lengths, layout, left_pad, 0, False, log_probs.dtype)
    a.old = ptr(old_log_probs)
    a.old_s0, a.old_s1 = strides(old_log_probs, layout)
    out = torch.empty(a.g.batch, dtype=torch.float32)
    if a.g.batch == 0:  # (an empty tensor's address is 0: nothing to write)
        return out
    a.seq_lr = ptr(out)
    launch_kernel(module, module.kl_penalty_sequence_log_ratio, a, log_probs.device, "kl_penalty_loss")
    del keep
    return out


def forward_with_totals(*forward_args, grad_out=None):
    """The CPU forward (``forward``'s arguments, without per-token outputs) that sums the batch
    instead of writing the per-sequence losses: returns (grad, totals, stats, count, args, keep).
    ``grad`` is the gradient buffer (as ``forward``'s; ``grad_out`` when given). ``totals`` are host
    floats: the loss, the sums of the stats columns and the token count, summed in float64 in
    sequence order by the kernel. ``stats`` [B, STATS] and ``count`` [B]: the per-sequence stats
    and counts (the output's per-sequence fields).
    ``args`` (the filled argument struct) and ``keep`` (the tensors it points into besides the
    inputs) are for :func:`backward_with_args`."""
    if forward_args[18]:  # token_out
        raise ValueError("forward_with_totals: per-token outputs (token_out) are not summed")
    module, a, keep = _prepare_forward(*forward_args)
    grad = torch.empty(forward_args[0].shape, dtype=torch.float32) if grad_out is None else grad_out
    totals = torch.empty(TOTALS, dtype=torch.float64)
    stats = torch.empty(a.g.batch, STATS, dtype=torch.float32)
    count = torch.empty(a.g.batch, dtype=torch.int64)
    a.grad, a.totals, a.stats, a.count = ptr(grad), ptr(totals), ptr(stats), ptr(count)  # seq_loss stays 0
    launch_kernel(module, module.kl_penalty_forward, a, grad.device, "kl_penalty_loss",
                  workspace_bytes=lambda a: module.kl_penalty_workspace_bytes(a))
    a.totals = a.stats = a.count = 0
    return grad, totals.tolist(), stats, count, a, keep


def backward_with_args(args, grad, g_uniform, lp_dtype, entropy_grad, aux_dtype):
    """The backward of a ``forward_with_totals`` call through its argument struct ``args`` (nothing
    to rebuild): every sequence's loss gets the incoming gradient ``g_uniform`` (a float), so
    grad_lp = g_uniform * grad at counted tokens and (``entropy_grad``) grad_ent = -entropy_coef *
    g_uniform. The inputs ``args`` points into (mask, offsets, lengths, ``grad``) must be alive.
    Returns (grad_lp, grad_ent or None)."""
    dev = grad.device
    args.g_seq, args.g_tok, args.g_uniform = 0, 0, float(g_uniform)
    g_lp = torch.empty(grad.shape, dtype=lp_dtype, device=dev)
    g_ent = torch.empty(grad.shape, dtype=aux_dtype, device=dev) if entropy_grad else None
    args.g_lp = ptr(g_lp)
    args.g_ent = ptr(g_ent)
    module = kernel_module(dev, "kl_penalty_backward", "kl_penalty_loss")
    launch_kernel(module, module.kl_penalty_backward, args, dev, "kl_penalty_loss")
    return g_lp, g_ent


def forward_aggregated(forward_args, agg_scale, agg_per_token, agg_seq_mean, agg_tokens, agg_beta, agg_entropy_coef,
                       ext=None, grad_out=None):
    """The CUDA forward (``forward``'s arguments as a tuple, without per-token outputs) with the
    aggregation folded in (the totals kernel, ``finalize_aggregation`` in
    csrc/common/kl_penalty_args.h): sequence b's loss weighs ``w * u_b``,
    ``w = agg_scale / (agg_per_token ? max(N, 1) : 1)`` with ``N`` the value of ``agg_tokens`` (a
    float64 one-element device tensor: all ranks' token count) or, when it is None, the batch's own
    count, and ``u_b = 1 / max(n_b, 1)`` with ``agg_seq_mean``, else 1. ``agg_beta`` and
    ``agg_entropy_coef``: beta (a float beta; a tensor beta is read on the device) and entropy_coef
    of the parts, in float64. Nothing is read on the host.

    Returns ``(loss, rest, count, weight, grad, stats, seq_count, args, keep)`` on the device: ``loss``
    float32 0-d, ``rest`` float32 [RESULTS] (aggregate.RESULT_FIELDS), ``count`` int64 0-d,
    ``weight`` float64 [1] (``w``), ``grad`` the gradient buffer, ``stats`` [B, STATS] and ``seq_count``
    [B] the per-sequence stats and counts; ``args`` (the filled struct) and
    ``keep`` (what it points into besides the inputs: the per-sequence counts the backward reads
    with ``agg_seq_mean``) are for :func:`backward_aggregated`."""
    if forward_args[18]:  # token_out
        raise ValueError("forward_aggregated: per-token outputs (token_out) are not aggregated")
    module, a, keep = _prepare_forward(*forward_args, ext=ext)
    dev, batch, shape = forward_args[0].device, a.g.batch, forward_args[0].shape
    f32 = dict(dtype=torch.float32, device=dev)
    # the per-sequence sums: written by the forward, read by its totals kernel (the counts by the
    # backward too), not returned
    seq_loss, stats = torch.empty(batch, **f32), torch.empty(batch, STATS, **f32)
    seq_count = torch.empty(batch, dtype=torch.int64, device=dev)
    keep.append(seq_count)
    grad = torch.empty(shape, **f32) if grad_out is None else grad_out
    loss, rest = torch.empty((), **f32), torch.empty(RESULTS, **f32)
    n = torch.empty((), dtype=torch.int64, device=dev)
    weight = torch.empty(1, dtype=torch.float64, device=dev)
    a.seq_loss, a.stats, a.count, a.grad = ptr(seq_loss), ptr(stats), ptr(seq_count), ptr(grad)
    a.result, a.result_loss, a.result_count, a.result_weight = ptr(rest), ptr(loss), ptr(n), ptr(weight)
    a.agg_scale, a.agg_per_token, a.agg_seq_mean = float(agg_scale), int(bool(agg_per_token)), int(bool(agg_seq_mean))
    a.agg_beta, a.agg_entropy_coef = float(agg_beta), float(agg_entropy_coef)
    if agg_tokens is not None:
        agg_tokens = as_contiguous(agg_tokens, torch.float64)
        keep.append(agg_tokens)
        a.agg_tokens = ptr(agg_tokens)
    launch_kernel(module, module.kl_penalty_forward, a, dev, "kl_penalty_loss",
                  workspace_bytes=lambda a: module.kl_penalty_workspace_bytes(a))
    # The struct's other per-sequence and result pointers are dead from here (the backward reads the
    # geometry, the mask, the gradient buffer, the counts and w): cleared so that nothing reads them.
    a.seq_loss = a.stats = a.result = a.result_loss = a.result_count = a.agg_tokens = 0
    return loss, rest, n, weight, grad, stats, seq_count, a, keep


def backward_aggregated(args, grad, weight, g_loss, lp_dtype, entropy_grad, aux_dtype, ext=None):
    """The backward of a ``forward_aggregated`` call through its argument struct ``args`` (the
    forward's ``keep`` alive): sequence b's incoming gradient is ``g_loss * w * u_b`` (``g_loss``:
    the loss's gradient, a 0-d device tensor; ``w`` at ``weight``), read by the kernel, so grad_lp =
    g_loss * w * u_b * grad at counted tokens and (``entropy_grad``) grad_ent = -entropy_coef *
    g_loss * w * u_b. Returns (grad_lp, grad_ent or None)."""
    dev = grad.device
    g_loss = as_contiguous(g_loss, torch.float32)
    args.g_seq, args.g_tok = 0, 0
    args.g_loss, args.result_weight, args.grad = ptr(g_loss), ptr(weight), ptr(grad)
    g_lp = torch.empty(grad.shape, dtype=lp_dtype, device=dev)
    g_ent = torch.empty(grad.shape, dtype=aux_dtype, device=dev) if entropy_grad else None
    args.g_lp, args.g_ent = ptr(g_lp), ptr(g_ent)
    module = kernel_module(dev, "kl_penalty_backward", "kl_penalty_loss", ext)
    launch_kernel(module, module.kl_penalty_backward, args, dev, "kl_penalty_loss")
    args.g_loss = args.g_lp = args.g_ent = 0
    return g_lp, g_ent


def backward(grad, g_seq, g_tok, mask, offsets, lengths, layout, left_pad, lp_dtype, entropy_grad, aux_dtype,
             entropy_coef, ext=None):
    """Scale the saved gradient buffer: grad_lp = (g_tok + g_seq[b]) * grad at counted tokens, and
    (``entropy_grad``) grad_entropy = -entropy_coef * (g_tok + g_seq[b]). Returns (grad_lp, grad_ent or empty).
    A call whose signature was seen runs that signature's :class:`BackwardPlan` (see :func:`forward`)."""
    key = (ext, layout, left_pad, lp_dtype, entropy_grad, aux_dtype, entropy_coef,
           plans.facts(grad, g_seq, g_tok, mask, offsets, lengths))
    plan = _PLANS.get(key)
    if plan is None:
        plan = BackwardPlan.of((grad, g_seq, g_tok, mask, offsets, lengths, layout, left_pad, lp_dtype, entropy_grad,
                                aux_dtype, entropy_coef), ext)
        _PLANS.put(key, plan)
    if type(plan) is BackwardPlan:
        return plan(grad, g_seq, g_tok, mask, offsets, lengths)
    grad, g_seq, g_tok, mask, offsets, lengths = resolved(grad, g_seq, g_tok, mask, offsets, lengths)
    dev = grad.device
    module = kernel_module(dev, "kl_penalty_backward", "kl_penalty_loss", ext)
    a, keep = _args(module, grad, mask, offsets, lengths, layout, left_pad, 0, False, lp_dtype)
    a.aux_dtype = DTYPE_CODES[aux_dtype]
    a.entropy_coef = float(entropy_coef)
    a.grad = ptr(grad)
    for name, t in (("g_seq", g_seq), ("g_tok", g_tok)):
        if t is not None:
            t = as_contiguous(t, torch.float32)
            keep.append(t)
            setattr(a, name, ptr(t))
    g_lp = torch.empty(grad.shape, dtype=lp_dtype, device=dev)
    g_ent = torch.empty(grad.shape if entropy_grad else (0,), dtype=aux_dtype, device=dev)
    a.g_lp = ptr(g_lp)
    a.g_ent = ptr(g_ent) if entropy_grad else 0
    launch_kernel(module, module.kl_penalty_backward, a, dev, "kl_penalty_loss")
    del keep
    return g_lp, g_ent


# The launcher's plans (forward without grad_out, backward), by signature: see forward().
_PLANS = plans.PlanCache("kl_penalty launches")


class ForwardPlan:
    """:func:`forward` (without ``grad_out``) for the calls of one signature: the argument struct filled
    once by :func:`_prepare_forward` and copied per call, the inputs' addresses and a scalar beta
    rewritten. For inputs the launcher reads as they are (:func:`~kl_kernels.launching.read_as_is`, a float32
    contiguous beta tensor), which the signature keeps so; ``tests/test_plans.py`` holds its results to the
    launcher's own."""

    @classmethod
    def of(cls, forward_args, ext) -> "ForwardPlan | plans.Unplanned":
        lp, old, ref, adv, ent, mask, offsets, lengths, beta = forward_args[:9]
        weights, seq_lr = forward_args[19], forward_args[23]
        if (not read_as_is((lp, old, ref, adv, ent, mask, offsets, lengths, beta, weights, seq_lr),
                           (offsets, lengths))
                or (beta is not None and not (beta.dtype == torch.float32 and beta.is_contiguous()))
                or (forward_args[11] == 0 and offsets is None)):
            return plans.Unplanned(None)
        plan = cls()
        module, a, _ = _prepare_forward(*forward_args, ext=ext)
        a.g.lp = a.g.mask = a.g.offsets = a.g.lengths = a.old = a.ref = a.adv = a.ent = a.wt = a.beta = a.seq_lr = 0
        plan.module, plan.template = module, a  # (no address of the first call's tensors is kept)
        plan.shape, plan.device, plan.token_out = lp.shape, lp.device, bool(forward_args[18])
        plan.workspace_bytes = getattr(module, "kl_penalty_workspace_bytes", None)  # (the CUDA forwards' only)
        return plan

    def __call__(self, log_probs, old_log_probs, ref_log_probs, advantages, entropy, mask, offsets, lengths, beta,
                 beta_scalar, weights, seq_lr):
        """(seq_loss, stats, count, tok, grad) as :func:`forward`'s."""
        a = self.template.__copy__()
        g = a.g
        g.lp, a.old, a.adv = log_probs.data_ptr(), old_log_probs.data_ptr(), advantages.data_ptr()
        if ref_log_probs is not None:
            a.ref = ref_log_probs.data_ptr()
        if entropy is not None:
            a.ent = entropy.data_ptr()
        if weights is not None:
            a.wt = weights.data_ptr()
        if seq_lr is not None:
            a.seq_lr = seq_lr.data_ptr()
        if mask is not None:
            g.mask = mask.data_ptr()
        if offsets is not None:
            g.offsets = offsets.data_ptr()
        if lengths is not None:
            g.lengths = lengths.data_ptr()
        if beta is not None:
            a.beta = beta.data_ptr()
        else:
            a.beta_scalar = float(beta_scalar)
        dev, batch, shape = self.device, g.batch, self.shape
        seq_loss = torch.empty(batch, dtype=torch.float32, device=dev)
        stats = torch.empty(batch, STATS, dtype=torch.float32, device=dev)
        count = torch.empty(batch, dtype=torch.int64, device=dev)
        tok = torch.empty((4, *shape) if self.token_out else (0,), dtype=torch.float32, device=dev)
        grad = torch.empty(shape, dtype=torch.float32, device=dev)
        a.seq_loss, a.stats, a.count, a.grad = seq_loss.data_ptr(), stats.data_ptr(), count.data_ptr(), grad.data_ptr()
        if self.token_out:
            a.token_out = tok.data_ptr()
        module = self.module
        launch_kernel(module, module.kl_penalty_forward, a, dev, "kl_penalty_loss",
                      workspace_bytes=self.workspace_bytes)
        return seq_loss, stats, count, tok, grad


class BackwardPlan:
    """:func:`backward` for the calls of one signature, as :class:`ForwardPlan` is :func:`forward`'s: for
    incoming gradients the launcher reads as they are (float32 and contiguous, or absent)."""

    @classmethod
    def of(cls, backward_args, ext) -> "BackwardPlan | plans.Unplanned":
        grad, g_seq, g_tok, mask, offsets, lengths, layout = backward_args[:7]
        if (not read_as_is((grad, g_seq, g_tok, mask, offsets, lengths), (offsets, lengths))
                or any(t is not None and not (t.dtype == torch.float32 and t.is_contiguous()) for t in (g_seq, g_tok))
                or (layout == 0 and offsets is None)):
            return plans.Unplanned(None)
        *_, lp_dtype, entropy_grad, aux_dtype, entropy_coef = backward_args
        plan = cls()
        module = kernel_module(grad.device, "kl_penalty_backward", "kl_penalty_loss", ext)
        a, _ = _args(module, grad, mask, offsets, lengths, layout, backward_args[7], 0, False, lp_dtype)
        a.aux_dtype = DTYPE_CODES[aux_dtype]
        a.entropy_coef = float(entropy_coef)
        a.g.lp = a.g.mask = a.g.offsets = a.g.lengths = 0
        plan.module, plan.template = module, a
        plan.entropy_grad, plan.lp_dtype, plan.aux_dtype = entropy_grad, lp_dtype, aux_dtype
        return plan

    def __call__(self, grad, g_seq, g_tok, mask, offsets, lengths):
        a = self.template.__copy__()
        g = a.g
        g.lp = a.grad = grad.data_ptr()  # (the geometry's "log-probs" are the gradient buffer: _args' like)
        if mask is not None:
            g.mask = mask.data_ptr()
        if offsets is not None:
            g.offsets = offsets.data_ptr()
        if lengths is not None:
            g.lengths = lengths.data_ptr()
        if g_seq is not None:
            a.g_seq = g_seq.data_ptr()
        if g_tok is not None:
            a.g_tok = g_tok.data_ptr()
        dev = grad.device
        g_lp = torch.empty(grad.shape, dtype=self.lp_dtype, device=dev)
        g_ent = torch.empty(grad.shape if self.entropy_grad else (0,), dtype=self.aux_dtype, device=dev)
        a.g_lp = g_lp.data_ptr()
        if self.entropy_grad:
            a.g_ent = g_ent.data_ptr()
        module = self.module
        launch_kernel(module, module.kl_penalty_backward, a, dev, "kl_penalty_loss")
        return g_lp, g_ent


class TotalsPlan:
    """:func:`forward_with_totals` for the calls of one signature (``kl_kernels/plans.py``): the argument
    struct filled once by :func:`_prepare_forward` from the first call and copied per call (its
    ``__copy__``: the backward keeps each call's own), with the addresses (inputs, gradient buffer,
    totals, a beta tensor) and a scalar beta rewritten. For inputs the kernel reads as they are (int64
    contiguous offsets and lengths, no negative bit, a float32 contiguous beta tensor, a non-empty
    batch), which the plan's signature keeps so. ``tests/test_plans.py`` holds every field to what
    :func:`_prepare_forward` writes for the same tensors."""

    def __init__(self, forward_args):
        module, a, _ = _prepare_forward(*forward_args)
        a.g.lp = a.g.mask = a.g.offsets = a.g.lengths = a.old = a.ref = a.adv = a.ent = a.wt = a.beta = 0
        self.module, self.template = module, a  # (no address of the first call's tensors is kept)
        self.shape, self.batch = forward_args[0].shape, a.g.batch

    def __call__(self, log_probs, old_log_probs, ref_log_probs, advantages, entropy, mask, offsets, lengths, beta,
                 weights, grad_out=None):
        """(grad, totals, stats, count, args, keep) as :func:`forward_with_totals`; ``beta`` a float or a float32
        tensor."""
        a = self.template.__copy__()
        g = a.g
        g.lp, a.old, a.adv = log_probs.data_ptr(), old_log_probs.data_ptr(), advantages.data_ptr()
        if ref_log_probs is not None:
            a.ref = ref_log_probs.data_ptr()
        if entropy is not None:
            a.ent = entropy.data_ptr()
        if weights is not None:
            a.wt = weights.data_ptr()
        if mask is not None:
            g.mask = mask.data_ptr()
        if offsets is not None:
            g.offsets = offsets.data_ptr()
        if lengths is not None:
            g.lengths = lengths.data_ptr()
        if type(beta) is torch.Tensor:
            a.beta = beta.data_ptr()
        else:
            a.beta_scalar = beta
        grad = torch.empty(self.shape, dtype=torch.float32) if grad_out is None else grad_out
        totals = torch.empty(TOTALS, dtype=torch.float64)
        stats = torch.empty(self.batch, STATS, dtype=torch.float32)
        count = torch.empty(self.batch, dtype=torch.int64)
        a.grad, a.totals, a.stats, a.count = grad.data_ptr(), totals.data_ptr(), stats.data_ptr(), count.data_ptr()
        module = self.module
        launch_kernel(module, module.kl_penalty_forward, a, grad.device, "kl_penalty_loss")
        a.totals = a.stats = a.count = 0
        return grad, totals.tolist(), stats, count, a, [beta]


class AggregatedPlan:
    """:func:`forward_aggregated` (and its :func:`backward_aggregated`) for the calls of one signature
    (``kl_kernels/plans.py``) on a device (``_cuda``, or ``_cuda_emu`` with ``ext``): the argument struct
    filled once by :func:`_prepare_forward`, with the aggregation's constants, and copied per call (the
    backward keeps each call's own), with the addresses (inputs, outputs, a beta tensor), a scalar beta
    and the parts' beta rewritten. For the inputs :class:`TotalsPlan` takes. ``tests/test_plans.py``
    holds every field to what :func:`forward_aggregated` writes for the same tensors."""

    def __init__(self, forward_args, agg_scale, agg_per_token, agg_seq_mean, agg_entropy_coef, ext=None):
        module, a, _ = _prepare_forward(*forward_args, ext=ext)
        a.g.lp = a.g.mask = a.g.offsets = a.g.lengths = a.old = a.ref = a.adv = a.ent = a.wt = a.beta = 0
        a.agg_scale = float(agg_scale)
        a.agg_per_token, a.agg_seq_mean = int(bool(agg_per_token)), int(bool(agg_seq_mean))
        a.agg_entropy_coef, a.agg_tokens = float(agg_entropy_coef), 0
        self.module, self.template, self.ext = module, a, ext  # (no address of the first call's tensors is kept)
        self.shape, self.device, self.batch = forward_args[0].shape, forward_args[0].device, a.g.batch
        self.workspace_bytes = module.kl_penalty_workspace_bytes

    def __call__(self, log_probs, old_log_probs, ref_log_probs, advantages, mask, offsets, lengths, beta, agg_beta,
                 grad_out=None):
        """(loss, rest, count, weight, grad, stats, seq_count, args, keep) as :func:`forward_aggregated`; ``beta``
        a float or a
        float32 tensor (as the first call's), ``agg_beta`` the parts' beta (0.0 for a tensor beta)."""
        a = self.template.__copy__()
        g = a.g
        g.lp, a.old, a.adv = log_probs.data_ptr(), old_log_probs.data_ptr(), advantages.data_ptr()
        if ref_log_probs is not None:
            a.ref = ref_log_probs.data_ptr()
        if mask is not None:
            g.mask = mask.data_ptr()
        if offsets is not None:
            g.offsets = offsets.data_ptr()
        if lengths is not None:
            g.lengths = lengths.data_ptr()
        if type(beta) is torch.Tensor:
            a.beta = beta.data_ptr()
        else:
            a.beta_scalar = beta
        a.agg_beta = agg_beta
        dev, batch = self.device, self.batch
        seq_loss = torch.empty(batch, dtype=torch.float32, device=dev)
        stats = torch.empty(batch, STATS, dtype=torch.float32, device=dev)
        seq_count = torch.empty(batch, dtype=torch.int64, device=dev)
        grad = torch.empty(self.shape, dtype=torch.float32, device=dev) if grad_out is None else grad_out
        loss = torch.empty((), dtype=torch.float32, device=dev)
        rest = torch.empty(RESULTS, dtype=torch.float32, device=dev)
        n = torch.empty((), dtype=torch.int64, device=dev)
        weight = torch.empty(1, dtype=torch.float64, device=dev)
        a.seq_loss, a.stats = seq_loss.data_ptr(), stats.data_ptr()
        a.count, a.grad = seq_count.data_ptr(), grad.data_ptr()
        a.result, a.result_loss, a.result_count, a.result_weight = (rest.data_ptr(), loss.data_ptr(), n.data_ptr(),
                                                                    weight.data_ptr())
        module = self.module
        launch_kernel(module, module.kl_penalty_forward, a, dev, "kl_penalty_loss",
                      workspace_bytes=self.workspace_bytes)
        a.seq_loss = a.stats = a.result = a.result_loss = a.result_count = 0  # (dead from here: forward_aggregated)
        return loss, rest, n, weight, grad, stats, seq_count, a, [seq_count, beta]

    def backward(self, args, grad, weight, g_loss, lp_dtype, aux_dtype):
        """:func:`backward_aggregated` of a call of this plan (no entropy gradient: the plan takes no entropy)."""
        return backward_aggregated(args, grad, weight, g_loss, lp_dtype, False, aux_dtype, ext=self.ext)[0]


emulated = ExtensionLauncher(EMULATED, forward, backward)  # the cuda-emulated backend's launcher (ops.py)
