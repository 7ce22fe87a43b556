"""Host launcher of the fused kl_reward kernels: allocate outputs, fill the argument struct, launch.

The compiled kernels (``csrc/cpu/kl_reward_cpu.cpp``, ``csrc/cuda/kl_reward_cuda.cu``) take a plain
``KLRewardArgs`` of raw addresses, element strides and dtype codes; this module is the only
place that turns torch tensors into those. Inputs may have any strides; outputs are allocated
contiguous in the layout's shape. Everything here has already been validated by ``problem.py``.
"""

from __future__ import annotations

import threading

import torch

from .. import plans
from .._extensions import raise_for
from ..launching import (DTYPE_CODES, EMULATED, ExtensionLauncher, as_contiguous, coefficient, geometry_args,
                         kernel_module, launch_kernel, ptr, read_as_is, resolved, set_input)


def make_args(module, *, log_probs, ref_log_probs, mask, offsets, lengths, prompt_lens, reward, coef,
              coef_scalar, layout, left_pad, placement, estimator, straight_through, clamp, mask_nan=False):
    """A filled ``KLRewardArgs``: the shared geometry (:func:`~kl_kernels.launching.geometry_args`)
    plus kl_reward's own fields (reference log-probs, reward and its placement, coefficient); returns
    it with the tensors it points into (keep them alive)."""
    a, keep = geometry_args(module, log_probs=log_probs, mask=mask, offsets=offsets, lengths=lengths,
                            prompt_lens=prompt_lens, layout=layout, left_pad=left_pad, estimator=estimator,
                            straight_through=straight_through, clamp=clamp, mask_nan=mask_nan)
    set_input(a, "ref", "ref", ref_log_probs, layout, keep)
    a.placement = placement
    if reward is not None:
        a.reward_dtype = DTYPE_CODES[reward.dtype]
        if placement == 1:
            set_input(a, "reward", "rw", reward, layout, keep)
        else:
            a.reward, a.rw_s0, a.rw_s1 = ptr(reward), reward.stride(0), 0
    else:
        a.reward_dtype = a.dtype
    a.coef_mode, a.coef_scalar, a.coef = coefficient(coef, coef_scalar, keep)
    return a, keep


def forward(log_probs, ref_log_probs, mask, offsets, lengths, prompt_lens, reward, coef, coef_scalar, layout,
            left_pad, placement, estimator, straight_through, clamp, return_ref, reward_dtype, mask_nan=False,
            out=None, ext=None):
    """Run the fused forward; returns (kl, reward_out, ref_out or empty, kl_sum, count). List inputs
    (:class:`~kl_kernels.ragged.SequenceList`) and ``mask_nan`` are for the CPU kernel, outside autograd.
    ``out``: checked result buffers (problem.py's ``_check_out``), written in place where given.
    ``ext``: the extension to run (default: ``_C`` or ``_cuda`` by device).

    A call without ``out`` whose signature (the options and the tensors' facts, kl_kernels/plans.py)
    was seen runs that signature's :class:`ForwardPlan`: this is what the op ``kl_kernels::kl_reward_fwd``
    runs inside a ``torch.compile``d graph and under autograd, where api.py's call plans do not reach
    (CPU, B = 8: ~25 us of host work per call before, ~9 after)."""
    if out is None:
        key = (ext, layout, left_pad, placement, estimator, straight_through, tuple(clamp), return_ref, reward_dtype,
               mask_nan, plans.facts(log_probs, ref_log_probs, mask, offsets, lengths, prompt_lens, reward, coef))
        plan = _PLANS.get(key)
        if plan is None:
            plan = _launch_plan(log_probs, ref_log_probs, mask, offsets, lengths, prompt_lens, reward, coef,
                                layout, left_pad, placement, estimator, straight_through, clamp, return_ref,
                                reward_dtype, mask_nan, ext)
            _PLANS.put(key, plan)
        if type(plan) is ForwardPlan:
            kl, reward_out, ref_out, kl_sum, count = plan(log_probs, ref_log_probs, mask, offsets, lengths,
                                                          prompt_lens, reward, coef_scalar if coef is None else coef)
            if ref_out is None:  # the launchers always return five tensors
                ref_out = torch.empty((0,), dtype=ref_log_probs.dtype, device=log_probs.device)
            return kl, reward_out, ref_out, kl_sum, count
    outputs, args, module, keep = _prepare_forward(
        log_probs, ref_log_probs, mask, offsets, lengths, prompt_lens, reward, coef, coef_scalar, layout, left_pad,
        placement, estimator, straight_through, clamp, return_ref, reward_dtype, mask_nan, out, ext)
    launch_kernel(module, module.kl_reward_forward, args, outputs[0].device, "kl_reward",
                  workspace_bytes=lambda a: module.kl_reward_workspace_bytes(a))
    del keep
    return outputs


def forward_during(during, log_probs, ref_log_probs, mask, offsets, lengths, prompt_lens, reward, coef, coef_scalar,
                   layout, left_pad, placement, estimator, straight_through, clamp, return_ref, reward_dtype,
                   mask_nan=False):
    """:func:`forward` on the CPU, calling ``during(outputs)`` with the outputs *not yet written*
    while the kernel's tiles run on torch's other threads; then this thread joins the tiles. For
    callers with Python work that does not read the outputs (splitting them into per-sample views,
    storing those): it overlaps the kernel instead of following it. Returns the outputs; an
    exception from ``during`` propagates once the kernel is done. An extension without
    ``kl_reward_forward_during`` runs the kernel, then ``during``."""
    outputs, args, module, keep = _prepare_forward(
        log_probs, ref_log_probs, mask, offsets, lengths, prompt_lens, reward, coef, coef_scalar, layout, left_pad,
        placement, estimator, straight_through, clamp, return_ref, reward_dtype, mask_nan)
    run = getattr(module, "kl_reward_forward_during", None)
    if run is None:
        launch_kernel(module, module.kl_reward_forward, args, outputs[0].device, "kl_reward",
                      workspace_bytes=lambda a: module.kl_reward_workspace_bytes(a))
        during(outputs)
    else:
        raise_for(run(args, torch.get_num_threads(), lambda: during(outputs)), module, "kl_reward")
    del keep
    return outputs


def _prepare_forward(log_probs, ref_log_probs, mask, offsets, lengths, prompt_lens, reward, coef, coef_scalar,
                     layout, left_pad, placement, estimator, straight_through, clamp, return_ref, reward_dtype,
                     mask_nan, out=None, ext=None):
    """The forward's outputs (allocated) and filled argument struct, its module, and what it points into."""
    log_probs, ref_log_probs, mask, offsets, lengths, prompt_lens, reward, coef = resolved(
        log_probs, ref_log_probs, mask, offsets, lengths, prompt_lens, reward, coef)
    module = kernel_module(log_probs.device, "kl_reward_forward", "kl_reward", ext)
    args, keep = make_args(module, log_probs=log_probs, ref_log_probs=ref_log_probs, mask=mask, offsets=offsets,
                           lengths=lengths, prompt_lens=prompt_lens, reward=reward, coef=coef,
                           coef_scalar=coef_scalar, layout=layout, left_pad=left_pad, placement=placement,
                           estimator=estimator, straight_through=straight_through, clamp=clamp, mask_nan=mask_nan)
    # The inputs themselves too: resolved() may have made copies that nothing else holds.
    keep += [log_probs, ref_log_probs, mask, reward]
    kl, reward_out, ref_out, kl_sum, count = allocate_outputs(args, log_probs.shape, log_probs.dtype, reward_dtype,
                                                              log_probs.device, return_ref, out)
    if ref_out is None:  # the launchers always return five tensors
        ref_out = torch.empty((0,), dtype=ref_log_probs.dtype, device=log_probs.device)
    return (kl, reward_out, ref_out, kl_sum, count), args, module, keep


def allocate_outputs(args, shape, dtype, reward_dtype, device, return_ref: bool, out=None) -> tuple:
    """The forward's outputs (kl, reward_out, ref_out or None without ``return_ref``, kl_sum, count)
    for a filled ``args`` (``args.batch`` sequences of log-probs ``shape``/``dtype``), allocated (or
    taken from ``out``, the caller's checked buffers, where given) and pointed at by ``args`` (with
    the reward output's dtype code)."""
    given = out if out is not None else (None,) * 5
    kl = given[0] if given[0] is not None else torch.empty(shape, dtype=dtype, device=device)
    reward_out = given[1] if given[1] is not None else torch.empty(shape, dtype=reward_dtype, device=device)
    ref_out = (given[2] if given[2] is not None else torch.empty(shape, dtype=dtype, device=device)) \
        if return_ref else None
    kl_sum = given[3] if given[3] is not None else torch.empty(args.batch, dtype=torch.float32, device=device)
    count = given[4] if given[4] is not None else torch.empty(args.batch, dtype=torch.int64, device=device)
    args.reward_dtype = DTYPE_CODES[reward_dtype]
    args.kl, args.reward_out, args.ref_out = ptr(kl), ptr(reward_out), ptr(ref_out)
    args.kl_sum, args.count = ptr(kl_sum), ptr(count)
    return kl, reward_out, ref_out, kl_sum, count


def backward(log_probs, ref_log_probs, mask, offsets, lengths, prompt_lens, coef, coef_scalar, layout, left_pad,
             estimator, straight_through, clamp, reward_dtype, g_kl, g_reward, g_ref_out, g_kl_sum, ext=None):
    """Run the fused backward; returns (grad_log_probs, grad_ref_log_probs). ``ext``: as :func:`forward`'s."""
    log_probs, ref_log_probs, mask, offsets, lengths, prompt_lens, coef, g_kl, g_reward, g_ref_out, g_kl_sum = \
        resolved(log_probs, ref_log_probs, mask, offsets, lengths, prompt_lens, coef, g_kl, g_reward, g_ref_out,
                 g_kl_sum)
    module = kernel_module(log_probs.device, "kl_reward_backward", "kl_reward", ext)
    args, keep = make_args(module, log_probs=log_probs, ref_log_probs=ref_log_probs, mask=mask, offsets=offsets,
                           lengths=lengths, prompt_lens=prompt_lens, reward=None, coef=coef,
                           coef_scalar=coef_scalar, layout=layout, left_pad=left_pad, placement=0,
                           estimator=estimator, straight_through=straight_through, clamp=clamp)
    args.reward_dtype = DTYPE_CODES[reward_dtype]
    grads = {}
    for name, g, dtype in (("g_kl", g_kl, log_probs.dtype), ("g_reward", g_reward, reward_dtype),
                           ("g_ref_out", g_ref_out, ref_log_probs.dtype), ("g_kl_sum", g_kl_sum, torch.float32)):
        if g is not None:
            g = as_contiguous(g, dtype)
            grads[name] = g
            setattr(args, name, ptr(g))
    g_lp = torch.empty(log_probs.shape, dtype=log_probs.dtype, device=log_probs.device)
    g_ref = torch.empty(ref_log_probs.shape, dtype=ref_log_probs.dtype, device=log_probs.device)
    args.g_lp, args.g_ref = ptr(g_lp), ptr(g_ref)
    launch_kernel(module, module.kl_reward_backward, args, log_probs.device, "kl_reward")
    del keep, grads
    return g_lp, g_ref


# The launcher's plans (forward without out=), by signature: see forward().
_PLANS = plans.PlanCache("kl_reward launches")


def _launch_plan(log_probs, ref_log_probs, mask, offsets, lengths, prompt_lens, reward, coef, layout, left_pad,
                 placement, estimator, straight_through, clamp, return_ref, reward_dtype, mask_nan, ext):
    """The :class:`ForwardPlan` of a :func:`forward` signature, or an :class:`~kl_kernels.plans.Unplanned`
    where the launcher must fill the struct every call: inputs it would convert (a negative bit, offsets,
    lengths or prompt lengths not int64 contiguous), lists, subclasses (fake tensors: tracing), empty
    tensors, ``mask_nan`` on a device (the conditions of ForwardPlan's docstring, which the signature
    then keeps for every call)."""
    if (not read_as_is((log_probs, ref_log_probs, mask, offsets, lengths, prompt_lens, reward, coef),
                       (offsets, lengths, prompt_lens))
            or (mask_nan and log_probs.device.type != "cpu")
            or (layout == 0 and offsets is None)):
        return plans.Unplanned(None)
    return ForwardPlan(log_probs, ref_log_probs, reward, coef, layout, left_pad, placement, estimator,
                       straight_through, list(clamp), return_ref, reward_dtype, mask_nan=mask_nan, ext=ext)


class ForwardPlan:
    """:func:`forward` for the calls of one signature (``kl_kernels/plans.py``): the argument struct is
    filled once per thread by :func:`make_args`, from that thread's first call, and each later call
    rewrites only its addresses (inputs, outputs, a coefficient tensor) and a scalar coefficient. For
    inputs the kernel reads as they are (int64 contiguous offsets, lengths and prompt lengths; no
    negative bit; a non-empty batch), which the plan's signature keeps so: dtypes, strides, shapes
    and flags are the struct's other fields. ``tests/test_plans.py`` holds every field to what
    :func:`make_args` writes for the same tensors."""

    def __init__(self, log_probs, ref_log_probs, reward, coef, layout, left_pad, placement, estimator,
                 straight_through, clamp, return_ref, reward_dtype, mask_nan=False, ext=None):
        self.module = kernel_module(log_probs.device, "kl_reward_forward", "kl_reward", ext)
        self.constants = (layout, left_pad, placement, estimator, straight_through, clamp, mask_nan)
        self.shape, self.dtype, self.device = log_probs.shape, log_probs.dtype, log_probs.device
        self.ref_dtype, self.reward_dtype, self.return_ref = ref_log_probs.dtype, reward_dtype, return_ref
        self.coef_cast = isinstance(coef, torch.Tensor) and not (coef.dtype == torch.float32 and coef.is_contiguous())
        # the CUDA forwards (real or emulated) take a workspace; _C has no such function
        self.workspace_bytes = getattr(self.module, "kl_reward_workspace_bytes", None)
        self.local = threading.local()

    def __call__(self, log_probs, ref_log_probs, mask, offsets, lengths, prompt_lens, reward, coef, out=None):
        """Run the forward: (kl, reward_out, ref_out or None, kl_sum, count). ``coef``: a float or a tensor
        (as the first call's); ``out`` as :func:`forward`'s."""
        tensor_coef = type(coef) is torch.Tensor
        if tensor_coef and self.coef_cast:
            coef = coef.to(torch.float32).contiguous()
        try:
            a = self.local.args
        except AttributeError:  # this thread's first call: the launcher's own filling
            layout, left_pad, placement, estimator, straight_through, clamp, mask_nan = self.constants
            a, _ = make_args(self.module, log_probs=log_probs, ref_log_probs=ref_log_probs, mask=mask,
                             offsets=offsets, lengths=lengths, prompt_lens=prompt_lens, reward=reward,
                             coef=coef if tensor_coef else None, coef_scalar=0.0 if tensor_coef else coef,
                             layout=layout, left_pad=left_pad, placement=placement, estimator=estimator,
                             straight_through=straight_through, clamp=clamp, mask_nan=mask_nan)
            self.local.args = a
        a.lp, a.ref = log_probs.data_ptr(), ref_log_probs.data_ptr()
        if mask is not None:
            a.mask = mask.data_ptr()
        if offsets is not None:
            a.offsets = offsets.data_ptr()
        if lengths is not None:
            a.lengths = lengths.data_ptr()
        if prompt_lens is not None:
            a.prompt_lens = prompt_lens.data_ptr()
        if reward is not None:
            a.reward = reward.data_ptr()
        if tensor_coef:
            a.coef = coef.data_ptr()
        else:
            a.coef_scalar = coef
        kl, reward_out, ref_out, kl_sum, count = out if out is not None else (None,) * 5
        shape, device = self.shape, self.device
        if kl is None:
            kl = torch.empty(shape, dtype=self.dtype, device=device)
        if reward_out is None:
            reward_out = torch.empty(shape, dtype=self.reward_dtype, device=device)
        if self.return_ref:
            if ref_out is None:
                ref_out = torch.empty(shape, dtype=self.ref_dtype, device=device)
            a.ref_out = ref_out.data_ptr()
        if kl_sum is None:
            kl_sum = torch.empty(a.batch, dtype=torch.float32, device=device)
        if count is None:
            count = torch.empty(a.batch, dtype=torch.int64, device=device)
        a.kl, a.reward_out, a.kl_sum, a.count = kl.data_ptr(), reward_out.data_ptr(), kl_sum.data_ptr(), count.data_ptr()
        module = self.module
        launch_kernel(module, module.kl_reward_forward, a, device, "kl_reward",
                      workspace_bytes=self.workspace_bytes)
        return kl, reward_out, ref_out, kl_sum, count


emulated = ExtensionLauncher(EMULATED, forward, backward)
