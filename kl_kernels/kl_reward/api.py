"""The public ``kl_reward`` function: validate, normalize the layout, dispatch, restore."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Callable

import torch

from .. import backends as _dispatch
from .. import plans, ragged, value_checks
from .. import full_estimator
from ..full_kl import full_kl  # estimator="full": the full_kl op's public function (a lower op)
from ..reference_math import final_mask, token_frame
from .backends import REGISTRY
from .launch import ForwardPlan
from .ops import forward_args, run_fused, run_fused_list
from .problem import CallChecks, KLRewardOutput, RawOutputs, build_problem, widened

_PLANS = plans.PlanCache("kl_reward")


def kl_reward(log_probs, ref_log_probs, reward=None, *, coef=1.0, estimator="k1", mask=None,
              offsets=None, lengths=None, padding_side="left", prompt_lens=None,
              reward_placement="auto", clamp_input=None, clamp_output=None, return_ref=False,
              detach=True, mask_nan=False, backend="auto", out=None, kl_dtype=None,
              temperature=1.0, logit_scale=1.0, softcap=None) -> KLRewardOutput:
    r"""Assistant-masked, ragged-batch KL estimate and KL-penalized reward, in one call.

    Per token ``t`` of sequence ``b``, with ``d = log_probs - ref_log_probs`` (math in float32,
    float64 for float64 inputs)::

        kl_t     = m_t * est(clamp(d_t, *clamp_input))        (then clamped by clamp_output)
        reward_t = R_t - coef_b * kl_t

    where ``m_t`` is the final mask (valid, in ``mask``, past ``prompt_lens[b]``) and ``est`` is
    ``"k1"`` ``d``, ``"abs"`` ``|d|``, ``"k2"`` ``d^2/2`` or ``"k3"`` ``expm1(-d) + d``.
    ``"k1+"``, ``"abs+"``, ``"k3+"`` give the estimator's value with the gradient of k2
    (straight-through, as verl). ``"full"`` is the exact ``KL(pi || pi_ref)`` over the vocabulary
    (:func:`kl_kernels.full_kl`): then ``log_probs`` and ``ref_log_probs`` are the two models' logits
    ``[..., V]`` (verl's convention for its ``"full"`` mode). Masked and padding tokens have ``kl``
    exactly 0.

    Layouts (read from the inputs; outputs come back in the same layout):

    * packed: ``log_probs [N]`` with ``offsets [B + 1]`` (int64 cu_seqlens);
    * padded: ``log_probs [B, T]``; ``lengths [B]`` (optional, else all ``T`` columns are valid)
      with ``padding_side`` ``"left"`` (valid tokens are the last ``lengths[b]``) or ``"right"``;
    * ``torch.nested`` tensors (jagged or strided) ``[B, j]``;
    * a list of ``B`` 1-D tensors (contiguous CPU tensors needing no autograd are read in place
      by the ``cpu`` backend; otherwise they are concatenated).

    Args:
        log_probs: policy log-probs of the sampled tokens (float32, bfloat16, float16; float64
            with ``backend="torch"``).
        ref_log_probs: reference-model log-probs, same layout and shape (any of those dtypes).
        reward: ``None`` (``reward = -coef * kl``); per-token, in the log-probs layout, optionally
            with a trailing dim of 1 that is kept (TorchRL's ``[..., T, 1]``); or per-sequence
            ``[B]``, ``[B, 1]`` or ``[B, 1, 1]``.
        coef: KL coefficient: float, 0-dim tensor or per-sequence ``[B]`` tensor (tensors are read
            on their device: no host sync).
        estimator: ``"k1"`` (default), ``"abs"``, ``"k2"``, ``"k3"``, ``"k1+"``, ``"abs+"``, ``"k3+"``,
            or ``"full"``: the exact KL from the logits. Then ``log_probs`` is the policy's logits and
            ``ref_log_probs`` the reference's, ``[N, V]`` packed (with ``offsets``) or ``[B, T, V]``
            padded, same shape, dtype and device (fp32/bf16/fp16/fp64); ``kl`` is float32 (float64
            for float64 logits; ``kl_dtype`` may widen it), gradients (``detach=False``) flow to the
            logits, fused, with no ``[N, V]`` float32 copy. ``clamp_input``, ``mask_nan`` and
            ``return_ref`` have no meaning for it (there is no log-ratio) and raise; lists and nested
            tensors of logits raise too (packing them would copy ``[N, V]``).
        mask: assistant mask, bool, same layout; ``None`` counts every valid token.
        offsets: packed layout only.
        lengths: padded layout only; ints or int tensor ``[B]``, ``0 <= lengths <= T``.
        padding_side: ``"left"`` (default, as TorchRL) or ``"right"``.
        prompt_lens: ``[B]`` ints: the first ``prompt_lens[b]`` valid tokens of ``b`` never count.
        reward_placement: ``"token"`` (per-token reward), ``"sequence"`` (per-sequence reward
            broadcast to every position of the row, TorchRL's expand), ``"last"`` (per-sequence
            reward on the last counted token, else the last valid token; OpenRLHF's EOS index),
            ``"last_valid"`` (per-sequence reward on the last valid token, counted or not: where
            verl's reward managers put a response's score, at ``valid_response_length - 1``), or
            ``"auto"`` (default): per-token shapes give ``"token"``, padded ``[B, 1]``/``[B, 1, 1]``
            broadcast as ``"sequence"``; anything ambiguous raises, asking for a placement.
        clamp_input: ``(lo, hi)`` bounds for ``d`` (either may be ``None``); verl's k3 uses
            ``(-20, 20)``.
        clamp_output: ``(lo, hi)`` bounds for the estimate; verl and OpenRLHF use ``(-10, 10)``.
        return_ref: also return ``ref_log_probs`` with non-counted tokens zeroed (TorchRL's third
            output).
        detach: ``True`` (default, as TorchRL) returns tensors without autograd history;
            ``False`` lets gradients flow to ``log_probs`` and ``ref_log_probs``. The reward and
            ``coef`` are data: they never receive gradients.
        mask_nan: also leave out tokens where either log-prob is NaN (TorchRL's
            ``KLComputation`` marks alignment pads that way): their ``kl`` is 0. Default ``False``.
        backend: ``"auto"`` (default; ``KL_KERNELS_BACKEND`` overrides it), ``"torch"``, ``"cpu"``,
            ``"cuda"`` or ``"triton"``. An explicit backend that cannot run raises
            :class:`~kl_kernels.BackendUnavailableError` with every reason.
        kl_dtype: ``None`` (default: the log-probs' dtype) or a wider floating dtype for the per-token
            results, e.g. ``torch.float32`` from bfloat16 log-probs (OpenRLHF returns float32 KL). The
            math is float32 either way; with ``kl_dtype`` no result is rounded to the narrower dtype:
            ``kl`` and ``ref_log_probs`` come in ``kl_dtype``, ``reward`` in its promotion with the
            reward's dtype; gradients flow back in the inputs' dtypes. The inputs are widened before
            the kernel (exact: every bfloat16/float16 value is a float32 value), which costs one more
            pass over them than the default.
        out: optional buffers for the results, so a training loop can reuse its memory (no page
            faults on the CPU; fixed addresses for CUDA graph capture): a :class:`KLRewardOutput` or
            5-tuple ``(kl, reward, ref_log_probs, kl_sum, count)`` of tensors shaped, typed and placed
            exactly as the results would be (each entry may be ``None``: allocated as usual;
            ``ref_log_probs`` must be ``None`` without ``return_ref``), contiguous, overlapping
            neither each other nor the inputs. Packed and padded layouts only, and no autograd
            (``detach=True`` or no input requiring grad). The fused ``cpu`` and ``cuda`` kernels
            write into them; the other backends copy. The result holds these very tensors.
        temperature: ``estimator="full"`` only: both models' logits are divided by it (default 1.0).
        logit_scale, softcap: ``estimator="full"`` only: ``s`` (default 1.0) and ``c`` (default ``None``: no cap),
            both models' logits read as ``c tanh(s x / c) / T`` (``s x / T`` without a cap), as
            :func:`kl_kernels.full_kl` takes them (Gemma's ``final_logit_softcapping``, a model's logit scale).

    Returns:
        :class:`KLRewardOutput` ``(kl, reward, ref_log_probs, kl_sum, count)``: ``kl`` in the
        log-probs dtype (or ``kl_dtype``); ``reward`` in the promotion of the reward's and the log-probs' dtypes
        (so a float32 reward is never rounded to bfloat16); ``ref_log_probs`` (or ``None``) in
        its dtype; ``kl_sum [B]`` float32 (float64 for float64 inputs); ``count [B]`` int64.

    NaN or inf in a *counted* token propagates to ``kl``, ``reward`` and ``kl_sum`` of that
    sequence (it is never hidden); in non-counted tokens it is ignored. ``k3`` of ``d = -inf`` is
    NaN (``inf - inf``): bound it with ``clamp_input``.

    Raises:
        TypeError / ValueError: bad input, naming the argument and what was expected, before any
            kernel runs. Inputs are never modified.

    Example::

        >>> import torch
        >>> from kl_kernels import kl_reward
        >>> lp = torch.tensor([[-1.0, -0.5, -2.0], [-0.3, -0.1, -0.2]])
        >>> ref = torch.tensor([[-1.2, -0.5, -1.0], [-0.3, -0.4, -0.2]])
        >>> out = kl_reward(lp, ref, torch.tensor([[1.0], [0.0]]), coef=0.1,
        ...                 lengths=torch.tensor([2, 3]), padding_side="left")
        >>> out.kl
        tensor([[ 0.0000,  0.0000, -1.0000],
                [ 0.0000,  0.3000,  0.0000]])
        >>> out.reward
        tensor([[ 1.0000,  1.0000,  1.1000],
                [ 0.0000, -0.0300,  0.0000]])
        >>> out.count
        tensor([2, 3])
    """
    key = None
    if not torch.compiler.is_compiling():
        # The call's signature (kl_kernels/plans.py): the options (with the types of those whose == does
        # not tell bool, int and float apart), the tensors' facts, the grad mode and the backend override.
        try:
            key = (estimator, reward_placement, padding_side, clamp_input, clamp_output, return_ref, detach, mask_nan,
                   type(return_ref), type(detach), type(mask_nan), backend, kl_dtype, temperature, type(temperature),
                   logit_scale, type(logit_scale), softcap, type(softcap),
                   tuple(map(type, clamp_input)) if type(clamp_input) is tuple else None,
                   tuple(map(type, clamp_output)) if type(clamp_output) is tuple else None,
                   type(out), torch.is_grad_enabled(), plans.ENVIRON.get(plans.ENV_KEY),
                   plans.facts(log_probs, ref_log_probs, reward, mask, offsets, lengths, prompt_lens, coef,
                               *(out if type(out) in (tuple, KLRewardOutput) else ())))
        except Exception:  # (e.g. a nested tensor's strides: such calls take the general path)
            key = None
        plan = _PLANS.get(key)
        if plan is not None and plan.registry is REGISTRY:
            if type(plan) is plans.Unplanned:
                key = None  # (seen: no plan for it)
            else:
                return plan(log_probs, ref_log_probs, reward, coef, mask, offsets, lengths, prompt_lens, out)
    return _kl_reward(log_probs, ref_log_probs, reward, coef=coef, estimator=estimator, mask=mask, offsets=offsets,
                      lengths=lengths, padding_side=padding_side, prompt_lens=prompt_lens,
                      reward_placement=reward_placement, clamp_input=clamp_input, clamp_output=clamp_output,
                      return_ref=return_ref, detach=detach, mask_nan=mask_nan, backend=backend, out=out,
                      kl_dtype=kl_dtype, temperature=temperature, logit_scale=logit_scale, softcap=softcap,
                      plan_key=key)


def kl_reward_storing(store: Callable[[KLRewardOutput], None], log_probs, ref_log_probs, reward=None, *, coef=1.0,
                      estimator="k1", mask=None, offsets=None, lengths=None, padding_side="left", prompt_lens=None,
                      reward_placement="auto", clamp_input=None, clamp_output=None, return_ref=False, detach=True,
                      mask_nan=False, backend="auto") -> KLRewardOutput:
    """:func:`kl_reward` (same arguments), calling ``store(out)`` with its outputs before returning
    them, possibly while the kernel is still writing them: ``store`` may put the output tensors
    somewhere (a transform setting per-sample views into the samples' TensorDicts) but must not read
    their values. For list inputs on the CPU that work overlaps the kernel. An exception from
    ``store`` propagates once the kernel is done."""
    return _kl_reward(log_probs, ref_log_probs, reward, coef=coef, estimator=estimator, mask=mask, offsets=offsets,
                      lengths=lengths, padding_side=padding_side, prompt_lens=prompt_lens,
                      reward_placement=reward_placement, clamp_input=clamp_input, clamp_output=clamp_output,
                      return_ref=return_ref, detach=detach, mask_nan=mask_nan, backend=backend, store=store)


def _kl_reward(log_probs, ref_log_probs, reward=None, *, coef=1.0, estimator="k1", mask=None, offsets=None,
               lengths=None, padding_side="left", prompt_lens=None, reward_placement="auto", clamp_input=None,
               clamp_output=None, return_ref=False, detach=True, mask_nan=False, backend="auto",
               store=None, out=None, kl_dtype=None, temperature=1.0, logit_scale=1.0, softcap=None,
               plan_key=None) -> KLRewardOutput:
    temperature = full_estimator.check_temperature(temperature, estimator, logit_scale, softcap)
    if estimator == full_estimator.FULL:
        return _full(log_probs, ref_log_probs, reward, coef=coef, mask=mask, offsets=offsets, lengths=lengths,
                     padding_side=padding_side, prompt_lens=prompt_lens, reward_placement=reward_placement,
                     clamp_input=clamp_input, clamp_output=clamp_output, return_ref=return_ref, detach=detach,
                     mask_nan=mask_nan, backend=backend, store=store, out=out, kl_dtype=kl_dtype,
                     temperature=temperature, logit_scale=logit_scale, softcap=softcap)
    # A list/tuple subclass is read once, here, so that every backend sees the same items.
    log_probs = ragged.plain_sequence(log_probs, "log_probs")
    ref_log_probs = ragged.plain_sequence(ref_log_probs, "ref_log_probs")
    if kl_dtype is not None:
        log_probs, ref_log_probs = widened(kl_dtype, log_probs=log_probs, ref_log_probs=ref_log_probs)
    reward = ragged.plain_sequence(reward, "reward")
    mask = ragged.plain_sequence(mask, "mask")
    return _general(log_probs, ref_log_probs, reward, coef=coef, estimator=estimator, mask=mask, offsets=offsets,
                    lengths=lengths, padding_side=padding_side, prompt_lens=prompt_lens,
                    reward_placement=reward_placement, clamp_input=clamp_input, clamp_output=clamp_output,
                    return_ref=return_ref, detach=detach, mask_nan=mask_nan, backend=backend, store=store, out=out,
                    plan_key=plan_key if kl_dtype is None and store is None else None)


def _general(log_probs, ref_log_probs, reward=None, *, coef=1.0, estimator="k1", mask=None, offsets=None,
             lengths=None, padding_side="left", prompt_lens=None, reward_placement="auto", clamp_input=None,
             clamp_output=None, return_ref=False, detach=True, mask_nan=False, backend="auto",
             store=None, out=None, plan_key=None) -> KLRewardOutput:
    """kl_reward's general path: validate and normalize (problem.py), dispatch, run, restore the layout."""
    problem, layout = build_problem(
        log_probs, ref_log_probs, reward, coef=coef, estimator=estimator, mask=mask, offsets=offsets,
        lengths=lengths, padding_side=padding_side, prompt_lens=prompt_lens, reward_placement=reward_placement,
        clamp_input=clamp_input, clamp_output=clamp_output, return_ref=return_ref, detach=detach, mask_nan=mask_nan,
        out=out)
    try:
        impl = _dispatch.select(REGISTRY, backend, op="kl_reward", problem=problem)
    except _dispatch.BackendUnavailableError:
        if problem.layout != "list":
            raise
        # Lists read in place: only the cpu backend takes them; any other choice gets them packed.
        problem = problem.packed()
        impl = _dispatch.select(REGISTRY, backend, op="kl_reward", problem=problem)
    if problem.layout == "list":
        # Only the cpu backend reads lists in place (select chose it), always without autograd.
        # Its kernel writes the outputs while this thread splits them into per-sequence views.
        done = []
        run_fused_list(problem, lambda raw: done.append(_restore(layout, raw, store)))
        return done[0]
    if plan_key is not None:
        plan = _DirectPlan.of(problem, layout, impl, detach, (log_probs, ref_log_probs, reward, mask, offsets, lengths,
                                                              prompt_lens, coef), out)
        _PLANS.put(plan_key, plans.Unplanned(REGISTRY) if plan is None else plan)
        if plan is not None:
            # The plan checks the same values again (CallChecks), folded into its forward on a device: the
            # validation's deferred checks (value_checks.DEFERRED) are dropped, not launched on their own first.
            value_checks.take_deferred()
            return plan(log_probs, ref_log_probs, reward, coef, mask, offsets, lengths, prompt_lens, out)
    with torch.no_grad() if detach else nullcontext():
        raw = impl.run(problem)
    if problem.out is None:
        return _restore(layout, raw, store)
    result = layout.restore(_into(problem.out, raw))
    # the caller's own tensors (not views of them, e.g. a reward with its trailing dim restored)
    return KLRewardOutput(*(r if o is None else o for o, r in zip(out, result)))


def _full(logits, ref_logits, reward, *, coef, mask, offsets, lengths, padding_side, prompt_lens, reward_placement,
          clamp_input, clamp_output, return_ref, detach, mask_nan, backend, store, out, kl_dtype,
          temperature, logit_scale, softcap) -> KLRewardOutput:
    """``estimator="full"``: the exact KL per counted token from the logits (full_kl), then the same
    call with ``k1`` of ``d = KL - 0`` (exactly ``KL``; gradient 1 to it): masks, ``clamp_output``,
    ``coef``, the reward and its placement as for every estimator."""
    full_estimator.check_unused(full_estimator.FULL, clamp_input=clamp_input, mask_nan=mask_nan,
                                return_ref=return_ref)
    full_estimator.check_logits("log_probs", logits)
    full_estimator.check_logits("ref_log_probs", ref_logits)
    # Which tokens count (every argument checked here, before any kernel runs), on a placeholder of
    # the tokens' shape: the KL of the others is never computed, so NaN there stays out of the
    # gradients too.
    tokens = torch.zeros(logits.shape[:-1], dtype=torch.float32, device=logits.device)
    problem, _ = build_problem(
        tokens, tokens, reward, coef=coef, estimator="k1", mask=mask, offsets=offsets, lengths=lengths,
        padding_side=padding_side, prompt_lens=prompt_lens, reward_placement=reward_placement, clamp_input=None,
        clamp_output=clamp_output, return_ref=False, detach=detach, mask_nan=False, out=None)
    counted = final_mask(problem, *token_frame(problem)[:3]).reshape(tokens.shape)
    with torch.no_grad() if detach else nullcontext():
        kl = full_kl(logits, ref_logits, temperature=temperature, mask=counted, backend=backend,
                     logit_scale=logit_scale, softcap=softcap)
    return _kl_reward(kl, torch.zeros_like(kl), reward, coef=coef, estimator="k1", mask=mask, offsets=offsets,
                      lengths=lengths, padding_side=padding_side, prompt_lens=prompt_lens,
                      reward_placement=reward_placement, clamp_output=clamp_output, detach=detach, backend=backend,
                      store=store, out=out, kl_dtype=kl_dtype)


def _into(out: RawOutputs, raw: RawOutputs) -> RawOutputs:
    """The results in the caller's ``out`` buffers: those a kernel wrote in place are already there;
    the rest (the torch and triton backends, ``None`` entries) are copied or kept."""
    return RawOutputs(*(r if o is None else (o if o is r else o.copy_(r)) for o, r in zip(out, raw)))


def _restore(layout, raw, store):
    out = layout.restore(raw)
    if store is not None:
        store(out)
    return out


def _widened(t) -> bool:
    """Whether the caller's index argument ``t`` is an int32 tensor, which the checks widen to int64 (a new
    tensor per call: the plan passes the checks' result to the kernel, never ``t``)."""
    return type(t) is torch.Tensor and t.dtype == torch.int32


class _DirectPlan:
    """A plan (kl_kernels/plans.py) for eager calls of one signature that the C++ kernels run without
    autograd: the value checks of problem.py (:class:`~kl_kernels.kl_reward.problem.CallChecks`), then
    the launcher's :class:`~kl_kernels.kl_reward.launch.ForwardPlan`; the results in the caller's
    (packed or padded) layout, in its ``out=`` buffers where given. ~35 Python-level calls instead of
    ~250 (tests/test_plans.py holds the budget)."""

    __slots__ = ("registry", "checks", "launch", "trailing", "cast", "return_ref", "given")

    @classmethod
    def of(cls, problem, layout, impl, detach, args, out) -> "_DirectPlan | None":
        """The plan of the call just validated into ``problem`` and dispatched to ``impl``, or None where
        the call takes the general path every time: other backends than the C++ kernels' ``cpu``, ``cuda``
        and ``cuda-emulated`` rows (backends.kernel_extension: not a row a test swapped in), autograd, lists
        and nested tensors, tensor subclasses, negative bits, inputs the launcher would convert, empty
        batches."""
        lp, ref = problem.log_probs, problem.ref_log_probs
        graph = not detach and torch.is_grad_enabled() and (lp.requires_grad or ref.requires_grad)
        tensors = [t for t in args if isinstance(t, torch.Tensor)]
        ext = _dispatch.kernel_extension(impl, run_fused)
        if (ext is None or graph or problem.layout not in ("packed", "padded")
                or problem.device_free or problem.batch_size == 0 or problem.num_tokens == 0
                or any(type(t) is not torch.Tensor or t.is_neg() or t.is_nested for t in tensors)
                or any(t is not None and type(t) is not torch.Tensor for t in args[:7])
                or type(args[7]) not in (float, int, torch.Tensor)
                or (problem.mask_nan and ext != "_C")
                or any(t is not None and not (t.dtype == torch.int64 and t.is_contiguous())
                       for t in (problem.offsets, problem.lengths, problem.prompt_lens))
                or (problem.lengths is not None and problem.lengths is not args[5] and not _widened(args[5]))
                or (problem.prompt_lens is not None and problem.prompt_lens is not args[6]
                    and not _widened(args[6]))):
            return None
        plan = cls()
        plan.registry = REGISTRY
        plan.checks = CallChecks(problem)
        fa = forward_args(problem)
        plan.launch = ForwardPlan(fa[0], fa[1], fa[6], problem.coef, *fa[9:], mask_nan=problem.mask_nan, ext=ext)
        plan.trailing = layout.reward_trailing
        reward = args[2]
        plan.cast = None if reward is None or reward.dtype == problem.reward_dtype else problem.reward_dtype
        plan.return_ref = problem.return_ref
        plan.given = out is not None
        return plan

    def __call__(self, log_probs, ref_log_probs, reward, coef, mask, offsets, lengths, prompt_lens, out):
        inputs = ()
        if out is not None:
            inputs = (("log_probs", log_probs), ("ref_log_probs", ref_log_probs), ("mask", mask), ("reward", reward),
                      ("offsets", offsets), ("lengths", lengths), ("prompt_lens", prompt_lens), ("coef", coef))
        # the index tensors as the kernel reads them: int64 (an int32 argument widened by the checks)
        offsets, lengths, prompt_lens, coef = self.checks(offsets, lengths, prompt_lens, coef, out, inputs)
        if self.cast is not None:
            reward = reward.to(self.cast)
        kl, reward_out, ref_out, kl_sum, count = self.launch(log_probs, ref_log_probs, mask, offsets, lengths,
                                                             prompt_lens, reward, coef, out)
        if out is not None:  # the caller's own tensors (a reward buffer keeps its trailing dim)
            return KLRewardOutput(*(r if o is None else o for o, r in zip(out, (kl, reward_out, ref_out, kl_sum,
                                                                                count))))
        return KLRewardOutput(kl, reward_out.unsqueeze(-1) if self.trailing else reward_out, ref_out, kl_sum, count)
