"""The public ``kl_penalty_loss`` function: validate, dispatch, aggregate."""

from __future__ import annotations

import torch

from .. import backends as _dispatch
from .. import full_estimator, plans, ragged, value_checks
from ..full_kl import full_kl  # estimator="full": the full_kl op's public function (a lower op)
from ..reference_math import final_mask, token_frame
from .aggregate import KLPenaltyLossOutput, aggregate, device_weight, make_output, on_device, on_host, run_split
from .backends import REGISTRY
from .launch import AggregatedPlan, TotalsPlan
from .ops import (PlannedTotals, _fused_args, _PlannedOnDevice, _PlannedTotal, run_fused, run_fused_aggregated,
                  run_fused_on_device)
from .problem import CallChecks, _num_global_tokens, build_problem

_PLANS = plans.PlanCache("kl_penalty_loss")


def kl_penalty_loss(log_probs, old_log_probs, advantages, *, ref_log_probs=None, beta=1.0, estimator="k1", mask=None,
                    offsets=None, lengths=None, padding_side="left", clip_epsilon=None, entropy=None,
                    entropy_coef=0.0, aggregation="token-mean", num_global_tokens=None, process_group=None,
                    norm_length=None, backend="auto", out=None, dual_clip=None, weights=None,
                    weight_kl=False, clamp_input=None, clamp_output=None,
                    importance_sampling_level="token", kl_times_ratio=False, kl_aggregation=None,
                    entropy_aggregation=None, num_sequences=None, logits=None, ref_logits=None,
                    temperature=1.0, objective="ppo", ratio_cap=None,
                    sapo_temperatures=(1.0, 1.05), logit_scale=1.0, softcap=None) -> KLPenaltyLossOutput:
    r"""PPO policy loss with a KL penalty, on ragged, assistant-masked token batches, fused.

    Per counted token ``t`` of sequence ``b`` (math in float32; float64 for float64 inputs)::

        ratio_t = exp(clamp(r_t, -20, 20))                        (the clamp keeps it finite)
        r_t     = lp_t - old_t                                    (importance_sampling_level "token")
                = s_b = mean of lp_u - old_u over b's counted u   ("sequence": GSPO; d r_t / d lp_t = 1)
        pg_t    = -ratio_t * A_t                                  (no clip_epsilon)
                = -min(ratio_t * A_t, clamp(ratio_t, 1 - eps_lo, 1 + eps_hi) * A_t)   (PPO clip)
        obj_t   = w_t * pg_t, or w_t * min(pg_t, -A_t * c) where A_t < 0   (dual_clip = c)
        kl_t    = est(old_t - lp_t)   KL(old || new), as TorchRL's KLPENPPOLoss
                = est(lp_t - ref_t)   KL(new || ref) when ref_log_probs is given (GRPO-style)
                (times w_t with weight_kl=True; est with kl_reward's clamp_input / clamp_output;
                 times ratio_t, differentiated, with kl_times_ratio=True)
        loss_t  = obj_t + beta_b * kl_t - entropy_coef * entropy_t

    ``w_t`` is the token's weight (``weights``; 1 without). With ``estimator="full"``, ``kl_t`` is the
    exact ``KL(pi || pi_ref)`` over the vocabulary from the two models' logits (:func:`kl_kernels.full_kl`),
    with gradient to ``logits``.

    and ``loss`` aggregates ``loss_t`` over counted tokens (see ``aggregation``). ``est`` is one of
    :data:`kl_kernels.ESTIMATORS` (``"k3"``: ``expm1(-d) + d``; ``"+"`` variants use k2's
    gradient). Counted tokens are the valid ones (layout) that are in ``mask``.

    Layouts, as :func:`kl_kernels.kl_reward`: packed ``[N]`` + ``offsets``, padded ``[B, T]`` (+
    ``lengths``, ``padding_side``), ``torch.nested`` ``[B, j]`` or a list of 1-D tensors. Every
    per-token argument uses the log-probs' layout.

    Args:
        log_probs: the policy's log-probs of the sampled tokens (float32, bfloat16, float16; float64
            with ``backend="torch"``). Gradients flow to it.
        old_log_probs: the behaviour policy's log-probs (data: no gradient).
        advantages: per token (log-probs' layout; padded also ``[B, T, 1]``) or per sequence
            ``[B]`` / ``[B, 1]`` (packed: ``[B, 1]`` only, as a 1-D tensor is per-token ``[N]``). Data.
        ref_log_probs: optional reference-model log-probs: the KL is then to the reference.
        beta: KL coefficient: float, 0-dim or per-sequence ``[B]`` tensor, read on its device (a
            controller's ``beta`` buffer works as is). Default 1.0.
        estimator: KL estimator, default ``"k1"``.
        mask: bool, log-probs' layout: which tokens count (assistant tokens).
        offsets, lengths, padding_side: the layout, as ``kl_reward``.
        clip_epsilon: ``None`` (no clip, TorchRL's ``KLPENPPOLoss``), ``eps`` or ``(eps_low,
            eps_high)`` (asymmetric, DAPO's clip-higher).
        entropy: optional per-token entropy (log-probs' layout); gradients flow to it.
        logits, ref_logits: ``estimator="full"`` only (and then required): the policy's and the
            reference's logits, the log-probs' shape plus the vocabulary (``[N, V]`` packed, ``[B, T, V]``
            padded; not lists or nested tensors, which would be copied into ``[N, V]`` to pack), same
            dtype and device. ``kl_t = KL(softmax(logits_t / T) || softmax(ref_logits_t / T))``, fused
            (no ``[N, V]`` float32 copy), computed for counted tokens only, gradient to ``logits`` (and to
            ``ref_logits`` if it requires it). ``ref_log_probs``, ``clamp_input`` and ``kl_times_ratio``
            have no meaning then and raise; ``clamp_output``, ``weight_kl``, ``kl_aggregation`` and
            every aggregation apply as for the sampled estimators. The KL term is summed apart from the
            kernel's other terms (as a differently aggregated term is).
        temperature: ``T`` of ``estimator="full"`` (default 1.0; other values need ``"full"``).
        logit_scale, softcap: ``s`` (default 1.0) and ``c`` (default ``None``: no cap) of ``estimator="full"``:
            both models' logits read as ``c tanh(s x / c) / T`` (``s x / T`` without a cap), as
            :func:`kl_kernels.full_kl` takes them (other values need ``"full"``).
        entropy_coef: weight of the entropy bonus (the loss subtracts ``entropy_coef * entropy``).
        dual_clip: ``None`` (default) or ``c > 1``: dual-clip PPO (Ye et al. 2020; verl's
            ``clip_ratio_c``, default 3.0 there): where ``A_t < 0`` the objective is at most
            ``-A_t * c``, with no gradient where that bound binds.
        weights: optional per-token weights (log-probs' layout; data, no gradient), e.g. a rollout
            importance-sampling correction (verl's ``rollout_is_weights``, TRL's vLLM correction):
            they multiply the policy term ``obj_t`` (and its gradient).
        weight_kl: also multiply the KL term by the weights (default ``False``); ``kl_mean`` is
            then the mean of the weighted KL.
        clamp_input, clamp_output: the KL term's clamps, exactly as :func:`kl_kernels.kl_reward`'s
            (``(lo, hi)``, either may be ``None``): ``est(clamp(d, clamp_input))`` clamped to
            ``clamp_output``. verl's ``low_var_kl`` is ``k3`` with ``(-20, 20)`` and ``(-10, 10)``.
            The guard against overflow: the ratio's log is always clamped to +-20, so with
            ``clamp_input`` bounded (e.g. ``(-20, 20)``) every finite input gives a finite loss and
            gradient; without it, k3 of a diverged token (``d < -88``) is inf.
        importance_sampling_level: ``"token"`` (default, PPO) or ``"sequence"``: GSPO (Zheng et al.
            2025; TRL's ``importance_sampling_level="sequence"``, verl's and OpenRLHF's ``"gspo"``): every
            counted token of sequence ``b`` takes the ratio ``exp(s_b)`` of its sequence, ``s_b`` the mean
            log-ratio over ``b``'s counted tokens, and the clip decision follows it. The gradient is
            GSPO-token's (verl): ``d r_t / d lp_t = 1``. It is exactly the gradient of the returned loss
            (GSPO's, through the mean, as TRL and OpenRLHF differentiate) when the advantages and the
            weights are constant within each sequence (GRPO's per-sequence advantages; no or per-sequence
            ``weights``; every aggregation here weighs a sequence's tokens alike); where they vary inside
            a sequence it is GSPO-token's, by design (the paper's variant for per-token advantages).
            ``s_b`` is computed before the kernels (a few torch ops on the device, no host read); the
            KL term stays per token.
        objective: the policy term ``obj_t`` (default ``"ppo"``, the clipped surrogate above). ``"cispo"``
            (TRL's): ``-min(ratio_t, ratio_cap).detach() * A_t * lp_t``, gradient ``-min(ratio_t, ratio_cap) A_t``
            (REINFORCE weighted by a capped ratio; ``ratio_cap`` is TRL's ``epsilon_high``, e.g. 5.0); its
            ``clip_high_fraction`` / ``seq_clipped_high`` count ``ratio_t > ratio_cap and A_t > 0`` (TRL's
            ``cispo_clip_ratio``). ``"sapo"`` (TRL's): ``-sigmoid(tau (ratio_t - 1)) * 4 / tau * A_t`` with
            ``tau = sapo_temperatures[0]`` where ``A_t > 0``, else ``[1]`` (default ``(1.0, 1.05)``, TRL's),
            differentiated through the ratio. Neither takes ``clip_epsilon`` or ``dual_clip``; ``weights``
            multiply ``obj_t`` as for PPO, and GSPO's sequence ratio applies. So far the torch backend runs
            them (``"auto"`` picks it; the fused backends say they cannot).
        ratio_cap, sapo_temperatures: see ``objective``.
        kl_times_ratio: multiply the KL term by the token's ratio, differentiated through both:
            ``d (ratio_t kl_t) / d lp_t = ratio_t kl_t' + ratio_t kl_t`` (the ratio's part 0 outside its
            +-20 clamp). The unbiased reverse-KL gradient of off-policy samples (DeepSeek-V3.2; TRL's
            ``use_bias_correction_kl``, its default). ``kl_mean`` is then the mean of ``ratio_t kl_t``.
            Default ``False``.
        aggregation: ``"token-mean"`` (default), ``"seq-mean-token-mean"``, ``"seq-mean-token-sum"``,
            ``"seq-mean-token-sum-norm"`` (``1 / (B * norm_length)``), ``"token-sum-norm"``
            (``1 / norm_length``), ``"sum"`` or ``"none"`` (per-token loss, caller's layout, 0 at
            non-counted tokens). Weights: :mod:`kl_kernels.kl_penalty.aggregate`.
        kl_aggregation, entropy_aggregation: the KL and the entropy term's own aggregation (any of
            the above but ``"none"``); ``None`` (default): ``aggregation``'s. OpenRLHF token-means
            both under a sequence-level policy loss; TRL's entropy bonus is a token mean. Such a
            call counts each sequence's tokens before the kernel (one masked torch reduction) and
            takes the generic aggregation path.
        num_sequences: ``B`` of the seq-mean aggregations: ``None`` (default: every sequence of the
            batch, TorchRL and verl <= 0.4), ``"nonempty"`` (sequences with a counted token: verl
            0.9.1) or a count (int or 0-dim tensor: all ranks' sequences under data parallelism).
        num_global_tokens: ``"token-mean"`` over several ranks: the token count of all ranks
            together (int or 0-d tensor), so the ranks' losses sum to the union's token mean.
        process_group: a ``torch.distributed`` group: the token and sequence counts (and the
            diagnostics) are all-reduced over it (one small all-reduce; two with ``kl_aggregation``,
            ``entropy_aggregation`` or ``num_sequences``).
        norm_length: the constant length of ``"seq-mean-token-sum-norm"`` and ``"token-sum-norm"``
            (default: the padded width ``T``; required for the other layouts).
        backend: ``"auto"`` (default; ``KL_KERNELS_BACKEND`` overrides), ``"torch"``, ``"cpu"``,
            ``"cuda"`` or ``"triton"``.
        out: optional float32 buffer for the fused kernels' per-token gradient ``dloss_t / dlp_t``
            (the loss's one token-sized temporary), so a training loop allocates it once: no page
            faults per step on the CPU, a fixed address for CUDA graph capture. Shape: the
            log-probs' (``[N]`` packed, ``[B, T]`` padded; the packed ``[N]`` for lists and nested
            tensors), on their device, contiguous, not requiring grad, sharing no memory with an
            input. The forward writes it; the CPU backward may scale it in place and hand it to
            autograd as the log-probs' gradient (a leaf's ``.grad`` gets a copy, since the caller
            holds the buffer). A call overwrites the previous call's gradient: a backward through
            an earlier call after a later one wrote the buffer raises autograd's "modified by an
            inplace operation" error. Fused backends only (``"torch"`` differentiates by autograd
            and says so), eager calls only (not under ``torch.compile``).

    Returns:
        :class:`KLPenaltyLossOutput` ``(loss, loss_objective, loss_kl, loss_entropy, kl_mean,
        ratio_mean, clip_fraction, num_tokens, clip_low_fraction, clip_high_fraction, entropy_mean,
        seq_num_tokens, seq_clipped_low, seq_clipped_high)``: ``loss`` is differentiable, the rest
        detached; float32 (float64 for float64 inputs), ``num_tokens`` int64, the ``seq_*`` fields
        float32 ``[B]`` (this call's, never all-reduced). ``clip_low_fraction`` /
        ``clip_high_fraction``: the means over counted tokens of TRL's clip flags
        ``[ratio_t < 1 - eps_lo and A_t < 0]`` / ``[ratio_t > 1 + eps_hi and A_t > 0]`` (the unweighted
        ratio); ``entropy_mean``: the entropy's mean over counted tokens (0 without ``entropy``);
        ``kl_mean``: the KL term's mean before beta (with ``kl_times_ratio``, of ``ratio_t kl_t``).

    The fused backends keep one float32 gradient buffer (``dloss_t / dlp_t``, written by the forward
    pass) and nothing else for backward; the backward scales it by the incoming gradient (on the
    CPU, for float32 log-probs and a one-weight aggregation, in place: the buffer becomes the
    gradient, unless the graph is retained). Results are deterministic (fixed-order sums, no float
    atomics).

    Raises:
        TypeError / ValueError: bad input, naming the argument and what was expected, before any
            kernel runs. Inputs are never modified.

    Example::

        >>> import torch
        >>> from kl_kernels import kl_penalty_loss
        >>> lp = torch.tensor([[-1.0, -0.5, -2.0], [-0.3, -0.1, -0.2]], requires_grad=True)
        >>> old = torch.tensor([[-1.0, -0.6, -2.0], [-0.3, -0.1, -0.4]])
        >>> out = kl_penalty_loss(lp, old, torch.tensor([1.0, -1.0]), beta=0.1,
        ...                       lengths=torch.tensor([2, 3]), backend="torch")
        >>> out.num_tokens
        tensor(5)
        >>> round(float(out.loss.detach()), 4)  # (-1.1052 - 1 + 1 + 1 + 1.2214) / 5 + 0.1 * (-0.1 - 0.2) / 5
        0.2172
        >>> out.loss.backward()
        >>> lp.grad[0]  # left padding: no gradient at column 0
        tensor([ 0.0000, -0.2410, -0.2200])
    """
    key = None
    if not torch.compiler.is_compiling():
        # The call's signature (kl_kernels/plans.py; see kl_reward's): options, with the types of those whose
        # == does not tell bool, int and float apart, tensors' facts, grad mode, the backend override.
        try:
            key = (estimator, aggregation, padding_side, clip_epsilon, entropy_coef, dual_clip, weight_kl, clamp_input,
                   clamp_output, importance_sampling_level, kl_times_ratio, kl_aggregation, entropy_aggregation,
                   objective, ratio_cap, type(ratio_cap),
                   tuple(sapo_temperatures) if type(sapo_temperatures) in (tuple, list) else sapo_temperatures,
                   num_sequences, norm_length, num_global_tokens, process_group, backend, temperature,
                   tuple(map(type, clip_epsilon)) if type(clip_epsilon) is tuple else type(clip_epsilon),
                   tuple(map(type, clamp_input)) if type(clamp_input) is tuple else None,
                   tuple(map(type, clamp_output)) if type(clamp_output) is tuple else None,
                   type(entropy_coef), type(dual_clip), type(weight_kl), type(kl_times_ratio), type(norm_length),
                   type(temperature), logit_scale, type(logit_scale), softcap, type(softcap), logits is None,
                   ref_logits is None, torch.is_grad_enabled(),
                   plans.ENVIRON.get(plans.ENV_KEY),
                   plans.facts(log_probs, old_log_probs, advantages, ref_log_probs, mask, offsets, lengths, entropy,
                               weights, beta, out))
        except Exception:  # (e.g. a nested tensor's strides: such calls take the general path)
            key = None
        plan = _PLANS.get(key)
        if plan is not None and plan.registry is REGISTRY:
            if type(plan) is plans.Unplanned:
                key = None  # (seen: no plan for it)
            else:
                return plan(log_probs, old_log_probs, advantages, ref_log_probs, mask, offsets, lengths, beta, out)
    temperature = full_estimator.check_temperature(temperature, estimator, logit_scale, softcap)
    full = estimator == full_estimator.FULL
    if full:
        full_estimator.check_unused(estimator, ref_log_probs=ref_log_probs, clamp_input=clamp_input,
                                    kl_times_ratio=kl_times_ratio)
        if logits is None or ref_logits is None:
            raise ValueError("estimator='full' needs logits= and ref_logits= (the two models' logits [..., V])")
        full_estimator.check_logits("logits", logits)
        full_estimator.check_logits("ref_logits", ref_logits)
    else:
        full_estimator.check_unused(estimator, logits=logits, ref_logits=ref_logits)
    # A list/tuple subclass is read once, here, so that every backend sees the same items.
    log_probs, old_log_probs, advantages, ref_log_probs, mask, entropy, weights = (
        ragged.plain_sequence(x, name) for x, name in (
            (log_probs, "log_probs"), (old_log_probs, "old_log_probs"), (advantages, "advantages"),
            (ref_log_probs, "ref_log_probs"), (mask, "mask"), (entropy, "entropy"), (weights, "weights")))
    problem, kind, offsets_of_kind = build_problem(
        log_probs, old_log_probs, advantages, ref_log_probs=ref_log_probs, beta=beta,
        estimator="k1" if full else estimator, mask=mask,
        offsets=offsets, lengths=lengths, padding_side=padding_side, clip_epsilon=clip_epsilon, entropy=entropy,
        entropy_coef=entropy_coef, aggregation=aggregation, norm_length=norm_length, out=out, dual_clip=dual_clip,
        weights=weights, weight_kl=weight_kl, clamp_input=clamp_input, clamp_output=clamp_output,
        importance_sampling_level=importance_sampling_level, kl_times_ratio=kl_times_ratio, objective=objective,
        ratio_cap=ratio_cap, sapo_temperatures=sapo_temperatures,
        kl_aggregation=kl_aggregation, entropy_aggregation=entropy_aggregation, num_sequences=num_sequences,
        process_group=process_group)
    if full:
        problem.kl_values = _full_kl_term(problem, kind, logits, ref_logits, temperature, backend, logit_scale,
                                          softcap)
    num_global_tokens = _num_global_tokens(num_global_tokens, problem, process_group, problem.device)
    impl = _dispatch.select(REGISTRY, backend, op="kl_penalty_loss", problem=problem)
    if key is not None and impl.name in ("cuda", "cuda-emulated") and on_device(problem, process_group):
        plan = None
        ext = _dispatch.kernel_extension(impl, run_fused)
        if num_global_tokens is None and kind in ("packed", "padded") and ext is not None:
            plan = _DevicePlan.of(problem, ext,
                                  (log_probs, old_log_probs, advantages, ref_log_probs, mask, offsets, lengths, entropy,
                                   weights, beta, logits, ref_logits, num_sequences))
        _PLANS.put(key, plans.Unplanned(REGISTRY) if plan is None else plan)
        key = None
        if plan is not None:
            # The plan checks the same values again (CallChecks), folded into its forward: the validation's
            # deferred checks (value_checks.DEFERRED) are dropped, not launched on their own first.
            value_checks.take_deferred()
            return plan(log_probs, old_log_probs, advantages, ref_log_probs, mask, offsets, lengths, beta, out)
    if key is not None and not (impl.name == "cpu" and on_host(problem, process_group)):
        _PLANS.put(key, plans.Unplanned(REGISTRY))  # (the plans are of the calls the kernels aggregate)
    if problem.split_terms:
        return run_split(problem, impl, kind=kind, offsets=offsets_of_kind, num_global_tokens=num_global_tokens,
                         process_group=process_group)
    if impl.name == "cpu" and on_host(problem, process_group):  # the C++ kernel sums the batch too
        plan = None
        if key is not None and impl.run is run_fused and num_global_tokens is None and kind in ("packed", "padded"):
            plan = _TotalsPlan.of(problem, (log_probs, old_log_probs, advantages, ref_log_probs, mask, offsets,
                                            lengths, entropy, weights, beta, logits, ref_logits, num_sequences))
        if key is not None:
            _PLANS.put(key, plans.Unplanned(REGISTRY) if plan is None else plan)
        if plan is not None:
            return plan(log_probs, old_log_probs, advantages, ref_log_probs, mask, offsets, lengths, beta, out)
        return run_fused_aggregated(problem, num_global_tokens)
    if impl.name in ("cuda", "cuda-emulated", "triton") and on_device(problem, process_group):  # and on a device
        return run_fused_on_device(problem, num_global_tokens, emulated=impl.name == "cuda-emulated",
                                   triton=impl.name == "triton")
    raw = impl.run(problem)
    return aggregate(problem, raw, kind=kind, offsets=offsets_of_kind, num_global_tokens=num_global_tokens,
                     process_group=process_group)


def _full_kl_term(problem, kind, logits, ref_logits, temperature, backend, logit_scale=1.0, softcap=None):
    """``estimator="full"``'s ``kl_t`` per token in the problem's layout: the exact KL of counted tokens
    (the others are never computed: NaN there stays out of the gradients), then ``clamp_output`` and
    (``weight_kl``) the weights, as the kernels apply them to a sampled estimate."""
    if kind not in ("packed", "padded"):
        raise TypeError("logits: estimator='full' takes dense logits with dense log-probs, packed [N, V] with "
                        f"offsets or padded [B, T, V]; log_probs is a {kind.replace('_', ' ')} batch (its logits "
                        "would be copied into [N, V] to pack them)")
    full_estimator.check_logits("logits", logits, problem.log_probs.shape, problem.device)
    full_estimator.check_logits("ref_logits", ref_logits, problem.log_probs.shape, problem.device)
    counted = final_mask(problem, *token_frame(problem)[:3])
    kl = full_kl(logits, ref_logits, temperature=temperature, mask=counted, backend=backend, logit_scale=logit_scale,
                 softcap=softcap)
    if problem.clamp_output is not None:
        lo, hi = problem.clamp_output
        kl = kl.clamp(min=lo, max=hi)
    if problem.weight_kl:
        kl = torch.where(counted, kl * problem.weights.to(kl.dtype), torch.zeros((), dtype=kl.dtype, device=kl.device))
    return kl


def _plannable(problem, args, fa) -> bool:
    """Whether a call plan (:class:`_TotalsPlan`, :class:`_DevicePlan`) may take the call just validated
    into ``problem`` (``args``: the caller's arguments as api.py passes them, ``fa``: the fused forward's):
    only the common call (no entropy, weights, logits, GSPO, sequence count; dense plain tensors that no
    launcher converts, none requiring grad but the log-probs, a float or float32 0-d beta)."""
    lp, old, adv, ref, mask, offsets, lengths, entropy, weights, beta, logits, ref_logits, num_sequences = args
    tensors = [t for t in (lp, old, adv, ref, mask, offsets, lengths) if t is not None]
    return not (any(x is not None for x in (entropy, weights, logits, ref_logits, num_sequences))
                or problem.importance_sampling_level != "token" or problem.batch_size == 0
                or problem.num_tokens == 0 or problem.device_free
                or any(type(t) is not torch.Tensor or t.is_neg() for t in tensors)
                or any(t.requires_grad for t in (old, adv, ref) if t is not None)
                or fa[3].dtype != adv.dtype
                or any(t is not None and not (t.dtype == torch.int64 and t.is_contiguous())
                       for t in (problem.offsets, problem.lengths))
                or (problem.lengths is not None and problem.lengths is not lengths
                    and not (type(lengths) is torch.Tensor and lengths.dtype == torch.int32))
                or not (type(beta) in (float, int) or (type(beta) is torch.Tensor and beta.dtype == torch.float32
                                                       and beta.dim() == 0)))


class _TotalsPlan:
    """A plan (kl_kernels/plans.py) for eager calls of one signature that the CPU kernel aggregates itself
    (:func:`~kl_kernels.kl_penalty.aggregate.on_host`): problem.py's value checks
    (:class:`~kl_kernels.kl_penalty.problem.CallChecks`), then the folded forward
    (:class:`~kl_kernels.kl_penalty.ops._EagerTotal`) through the launcher's
    :class:`~kl_kernels.kl_penalty.launch.TotalsPlan`. tests/test_plans.py holds its call budget."""

    __slots__ = ("registry", "checks", "launch", "constants", "agg")

    @classmethod
    def of(cls, problem, args) -> "_TotalsPlan | None":
        """The plan of the call just validated into ``problem``, or None (the general path every time):
        only the common call (no entropy, weights, logits, GSPO, sequence count; dense plain tensors
        that no launcher converts, none requiring grad but the log-probs, a float or float32 0-d beta)."""
        fa = _fused_args(problem, cpu_kernel=True)
        if not _plannable(problem, args, fa):
            return None
        launcher = TotalsPlan(fa)
        if not hasattr(launcher.template, "__copy__"):  # (an extension built before it had one)
            return None
        plan = cls()
        plan.registry = REGISTRY
        plan.checks = CallChecks(problem)
        plan.launch = launcher
        plan.constants = fa[10:]
        plan.agg = PlannedTotals.constants(problem)
        return plan

    def __call__(self, log_probs, old_log_probs, advantages, ref_log_probs, mask, offsets, lengths, beta, out):
        inputs = ()
        if out is not None:
            inputs = (("log_probs", log_probs), ("old_log_probs", old_log_probs), ("ref_log_probs", ref_log_probs),
                      ("advantages", advantages), ("mask", mask), ("offsets", offsets), ("lengths", lengths),
                      ("beta", beta))
        # the index tensors as the kernel reads them: int64 (an int32 argument widened by the checks)
        offsets, lengths, beta = self.checks(offsets, lengths, beta, out, inputs)
        tensor_beta = type(beta) is torch.Tensor
        args = (log_probs, old_log_probs, ref_log_probs, advantages, None, mask, offsets, lengths,
                beta if tensor_beta else None, 0.0 if tensor_beta else beta, *self.constants)
        # (ops._PlannedTotal applied here, not through a helper: one Python-level call less per step)
        loss, rest, n, stats, count = _PlannedTotal.apply(PlannedTotals(self.agg, beta, out), self.launch, log_probs,
                                                          args)
        r = rest.unbind()  # (aggregate.make_output's fields, written out: one Python-level call less per call)
        return KLPenaltyLossOutput(loss, *r[:6], n, *r[6:], count, stats)


class _DevicePlan:
    """A plan (kl_kernels/plans.py) for eager calls of one signature that the CUDA kernels (real or
    emulated) aggregate themselves (:func:`~kl_kernels.kl_penalty.aggregate.on_device`): problem.py's
    value checks (:class:`~kl_kernels.kl_penalty.problem.CallChecks`), then the kernels through the
    launcher's :class:`~kl_kernels.kl_penalty.launch.AggregatedPlan` and one autograd node
    (:class:`~kl_kernels.kl_penalty.ops._PlannedOnDevice`): the GPU's eager call without ~380 of its
    ~500 Python-level calls (tests/test_plans.py holds its budget, through the emulated kernels)."""

    __slots__ = ("registry", "checks", "launch")

    @classmethod
    def of(cls, problem, ext: str, args) -> "_DevicePlan | None":
        """The plan of the call just validated into ``problem`` (the inputs :func:`_plannable` takes, an
        aggregation with the batch's own token count) for the kernels of extension ``ext``, or None."""
        fa = _fused_args(problem)
        if not _plannable(problem, args, fa):
            return None
        scale, per_token, seq_mean, tokens = device_weight(problem, None)
        plan = cls()
        plan.registry = REGISTRY
        plan.checks = CallChecks(problem)
        plan.launch = AggregatedPlan(fa, scale, per_token, seq_mean, problem.entropy_coef,
                                     ext=ext)
        return plan

    def __call__(self, log_probs, old_log_probs, advantages, ref_log_probs, mask, offsets, lengths, beta, out):
        inputs = ()
        if out is not None:
            inputs = (("log_probs", log_probs), ("old_log_probs", old_log_probs), ("ref_log_probs", ref_log_probs),
                      ("advantages", advantages), ("mask", mask), ("offsets", offsets), ("lengths", lengths),
                      ("beta", beta))
        # the index tensors as the kernel reads them: int64 (an int32 argument widened by the checks)
        offsets, lengths, beta = self.checks(offsets, lengths, beta, out, inputs)
        tensor_beta = type(beta) is torch.Tensor
        args = (log_probs, old_log_probs, ref_log_probs, advantages, mask, offsets, lengths, beta,
                0.0 if tensor_beta else float(beta))
        loss, rest, n, stats, count = _PlannedOnDevice.apply(out, self.launch, log_probs, args)
        r = rest.unbind()  # (aggregate.make_output's fields, written out: one Python-level call less per call)
        return KLPenaltyLossOutput(loss, *r[:6], n, *r[6:], count, stats)
