r"""``linear_kl_penalty_loss``: :func:`kl_penalty_loss` from the policy's hidden states and LM head (and the
reference's) instead of per-token log-probs, without either model's ``[N, V]`` logits (issue 28 item 4, the
front end of Liger-Kernel's ``LigerFusedLinearGRPOLoss``). A composition of two ops (``token_logprobs`` and
``kl_penalty``), so it belongs to neither: ops are siblings that never import each other.

One pass (the default, where the loss allows it: ``one_pass``): per chunk of tokens, the reference's logits
and the policy's are formed once, the row pass gives their log-probs (and the policy's entropy), the
chunk's share of the loss is :func:`kl_penalty_loss` of those tokens (per token, each weighed by its
sequence's aggregation weight), and its gradient goes through the logits into ``d hidden`` and ``d weight``
at once (``token_logprobs.linear.linear_loss_one_pass``); backward only scales them.

Two passes (GSPO and the other losses whose per-token gradient needs the whole batch first):
:func:`kl_kernels.linear_token_logprobs` gives the policy's log-probs (and entropy) and the reference's a
chunk of tokens at a time; the fused loss runs on those ``[*S]`` tensors; in backward the loss's gradient to
the log-probs flows into ``linear_token_logprobs``' chunked backward (logits recomputed per chunk, their
gradient written over them, then ``d hidden`` and ``d weight``).

Peak extra memory either way: one chunk of logits, O(chunk x V), plus the gradients' buffers.
"""

from __future__ import annotations

import inspect

import torch

from .kl_penalty import KLPenaltyLossOutput, kl_penalty_loss
from .kl_penalty import problem as loss_problem
from .kl_penalty.reference import STAT_COLUMNS
from .reference_math import final_mask, token_frame
from .token_logprobs import linear_token_logprobs
from .token_logprobs.linear import linear_loss_one_pass, prepare
from .token_logprobs.sharded import check_group

_LOSS_ARGS = inspect.signature(kl_penalty_loss)
_PROBLEM_ARGS = set(inspect.signature(loss_problem.build_problem).parameters) - {"log_probs", "old_log_probs",
                                                                               "advantages"}


def linear_kl_penalty_loss(hidden, weight, labels, old_log_probs, advantages, *, bias=None, ref_hidden=None,
                           ref_weight=None, ref_bias=None, temperature=1.0, mask=None, ignore_index=-100,
                           chunk_size=None, logprobs_backend="auto", one_pass=None, vocab_process_group=None,
                           logit_scale=1.0, softcap=None, **loss_kwargs) -> KLPenaltyLossOutput:
    r"""The PPO/GRPO policy loss with a KL penalty, :func:`kl_kernels.kl_penalty_loss`, from hidden states:
    the log-probs of ``labels`` under ``softmax((hidden @ weight.T + bias) / T)`` are computed chunk by
    chunk (:func:`kl_kernels.linear_token_logprobs`), so the ``[N, V]`` logits never exist.

    Args:
        hidden: ``[*S, H]`` the policy's final hidden states (``[B, T, H]`` padded or ``[N, H]`` packed: the
            layout of ``kl_penalty_loss``' log-probs); gradients flow to it.
        weight: ``[V, H]`` the policy's LM head; gradients flow. ``bias``: optional ``[V]``.
        labels: ``[*S]`` the sampled token ids (``ignore_index`` where there is none: they do not count).
        old_log_probs, advantages: as :func:`kl_kernels.kl_penalty_loss`.
        ref_hidden, ref_weight, ref_bias: the reference model's hidden states ``[*S, H_ref]`` and LM head
            ``[V, H_ref]`` (``ref_bias`` optional): its log-probs are computed the same way, without
            gradients, for the KL term. Or pass ``ref_log_probs=`` (per token) among the loss' arguments.
        temperature: applied to both models' logits (default 1.0).
        logit_scale, softcap: applied to both models' logits before the temperature (default 1.0 and None:
            the plain logits): ``c tanh(s logits / c) / T`` as :func:`kl_kernels.linear_token_logprobs`
            (TRL's fused LM head, Gemma's ``final_logit_softcapping``); gradients through it.
        mask: ``[*S]`` bool, the counted (assistant) tokens, for both the log-probs and the loss.
        ignore_index: labels that do not count (default -100).
        chunk_size: tokens per chunk of logits (default: about 16M logits a chunk on the CPU, 128M on a
            GPU; :func:`kl_kernels.linear_token_logprobs`).
        logprobs_backend: the row pass's backend (``linear_token_logprobs``' ``backend``).
        one_pass: ``None`` (default: on the CPU when the loss allows it; on a GPU two passes), ``True``
            (raise if the loss does not allow it) or ``False``.
            One pass (Liger-Kernel's scheme): each chunk's logits are formed once, and the loss's gradient
            to its tokens, known chunk by chunk, goes into ``d hidden`` and ``d weight`` at once; three
            matmuls of the policy's head per chunk instead of four (the two-pass route forms the logits
            again in backward). The gradients wait in memory for backward (``d hidden [N, H]`` and the
            head's in float32: what the two-pass backward allocates too). It needs a loss whose gradient to
            a token is known from that token and counts known beforehand: not GSPO
            (``importance_sampling_level="sequence"``: a sequence's mean first), not ``aggregation="none"``
            or a ``kl_aggregation``/``entropy_aggregation`` of its own, not ``process_group``, ``out``, a
            caller's ``entropy=`` (its gradient would flow to the caller's tensor) or ``estimator="full"``.
            Same values and gradients as two passes, up to the order of float64 sums. Not the GPU's default:
            one pass needs the head's gradient in a float32 ``[V, H]`` accumulator that every chunk adds
            into (1.96 GiB at H = 4096, V = 128k, and a pass over it per chunk), where two passes walk the
            vocabulary in backward and write each slice of the head's gradient once, in its dtype, from one
            GEMM over all tokens (:mod:`kl_kernels.lm_head`): one more GEMM of the head, far less memory.
        vocab_process_group: a ``torch.distributed`` group over which the vocabulary is split (tensor
            parallelism): ``weight``/``bias`` and ``ref_weight``/``ref_bias`` are this rank's rows, as
            :func:`kl_kernels.linear_token_logprobs`' ``process_group`` (every rank gets the full log-probs
            and the same loss; ``hidden``'s gradient is **this rank's share**: all-reduce it over the
            group). Named apart from ``process_group``, which is :func:`kl_kernels.kl_penalty_loss`' data-
            parallel group (the ranks whose token counts are summed), passed through to it. Two passes.
        **loss_kwargs: every other argument of :func:`kl_kernels.kl_penalty_loss` (``beta``, ``estimator``,
            ``clip_epsilon``, ``aggregation``, ``offsets``/``lengths``, ``entropy_coef``, ``backend``, ...).
            With ``entropy_coef != 0`` and no ``entropy=``, the policy's entropy comes from the same pass.

    Returns:
        :class:`~kl_kernels.KLPenaltyLossOutput`, as :func:`kl_kernels.kl_penalty_loss`.

    Example::

        >>> import torch
        >>> from kl_kernels import linear_kl_penalty_loss
        >>> h, head = torch.randn(2, 5, 16, requires_grad=True), torch.randn(40, 16, requires_grad=True)
        >>> labels = torch.randint(0, 40, (2, 5))
        >>> out = linear_kl_penalty_loss(h, head, labels, torch.full((2, 5), -3.7), torch.tensor([1.0, -1.0]),
        ...                              ref_hidden=h.detach(), ref_weight=head.detach() * 0.9, beta=0.05,
        ...                              estimator="k3", clip_epsilon=0.2)
        >>> out.loss.backward()
        >>> h.grad.shape, head.grad.shape
        (torch.Size([2, 5, 16]), torch.Size([40, 16]))
    """
    if ref_hidden is not None and loss_kwargs.get("ref_log_probs") is not None:
        raise ValueError("pass the reference either as ref_hidden/ref_weight or as ref_log_probs, not both")
    if one_pass not in (None, True, False):
        raise TypeError(f"one_pass must be None, True or False, got {one_pass!r}")
    if vocab_process_group is not None and isinstance(hidden, torch.Tensor):
        check_group(vocab_process_group, hidden.device, "vocab_process_group")
    want_entropy = loss_kwargs.get("entropy_coef", 0.0) not in (0, 0.0) and loss_kwargs.get("entropy") is None
    counted = labels != ignore_index  # the loss counts the tokens the log-probs count
    if mask is not None:
        counted = counted & mask
    # on a GPU two passes by default: the docstring says why
    on_gpu = isinstance(hidden, torch.Tensor) and hidden.device.type != "cpu"
    if one_pass or (one_pass is None and not on_gpu and vocab_process_group is None):
        args = _loss_arguments(old_log_probs, advantages, loss_kwargs)
        blockers = _one_pass_blockers(args)
        if vocab_process_group is not None:
            blockers.append("vocab_process_group: the ranks' statistics are merged after the chunk loop")
        if not blockers:
            return _one_pass(hidden, weight, labels, counted, args, bias=bias, ref_hidden=ref_hidden,
                             ref_weight=ref_weight, ref_bias=ref_bias, temperature=temperature, mask=mask,
                             ignore_index=ignore_index, chunk_size=chunk_size, logprobs_backend=logprobs_backend,
                             want_entropy=want_entropy, logit_scale=logit_scale, softcap=softcap)
        if one_pass:
            raise ValueError("one_pass=True: this loss needs two passes: " + "; ".join(blockers))
    common = dict(temperature=temperature, mask=mask, ignore_index=ignore_index, chunk_size=chunk_size,
                  backend=logprobs_backend, process_group=vocab_process_group, logit_scale=logit_scale,
                  softcap=softcap)
    # (the reference pair's rules, lm_head.check_ref_head, are linear_token_logprobs' own)
    policy = linear_token_logprobs(hidden, weight, labels, bias=bias, return_entropy=want_entropy,
                                   ref_hidden=ref_hidden, ref_weight=ref_weight, ref_bias=ref_bias, **common)
    if ref_hidden is not None:
        loss_kwargs["ref_log_probs"] = policy.ref_log_probs
    if want_entropy:
        loss_kwargs["entropy"] = policy.entropy
    return kl_penalty_loss(policy.log_probs, old_log_probs, advantages, mask=counted, **loss_kwargs)


def _loss_arguments(old_log_probs, advantages, loss_kwargs) -> dict:
    """Every argument of :func:`kl_penalty_loss` for this call, its defaults filled in (a misspelt one is
    kl_penalty_loss' own TypeError)."""
    bound = _LOSS_ARGS.bind(None, old_log_probs, advantages, **loss_kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


def _one_pass_blockers(args: dict) -> list:
    """Why a loss's gradient to a token is not known from that chunk's tokens alone (empty: it is)."""
    reasons = []
    if args["importance_sampling_level"] != "token":
        reasons.append("importance_sampling_level='sequence' (GSPO) needs each sequence's mean log-ratio first")
    if args["aggregation"] == "none":
        reasons.append("aggregation='none' returns per-token losses, each with its own gradient")
    for name in ("kl_aggregation", "entropy_aggregation"):
        if args[name] not in (None, args["aggregation"]):
            reasons.append(f"{name} weighs its term apart")
    for name, why in (("process_group", "the ranks' diagnostics are all-reduced after the kernels"),
                      ("out", "the fused kernels' gradient buffer is for the two-pass route"),
                      ("entropy", "a caller's entropy tensor takes its gradient through autograd")):
        if args[name] is not None:
            reasons.append(f"{name}: {why}")
    if args["estimator"] == "full":
        reasons.append("estimator='full' reads logits, not log-probs")
    return reasons


def _one_pass(hidden, weight, labels, counted, args, *, bias, ref_hidden, ref_weight, ref_bias, temperature, mask,
              ignore_index, chunk_size, logprobs_backend, want_entropy, logit_scale, softcap) -> KLPenaltyLossOutput:
    """The loss in one pass (``linear_loss_one_pass``): each chunk's share is ``sum_t W_t loss_t`` of
    ``kl_penalty_loss``' per-token losses (``aggregation="none"``, every token its own sequence), ``W_t`` the
    weight of token t's sequence in the aggregation: the gradient to each token's log-prob of the batch's
    ``kl_penalty_loss`` with advantages -1 at ratio 1 (the op's own weights, counts and options, no formula
    restated here)."""
    rows = prepare(hidden, weight, labels, bias=bias, temperature=temperature, return_entropy=want_entropy, mask=mask,
                   ignore_index=ignore_index, chunk_size=chunk_size, backend=logprobs_backend, ref_hidden=ref_hidden,
                   ref_weight=ref_weight, ref_bias=ref_bias, caller="linear_kl_penalty_loss", logit_scale=logit_scale,
                   softcap=softcap)
    old, advantages = args["old_log_probs"], args["advantages"]
    if isinstance(old, torch.Tensor) and old.device != rows.hidden.device:
        raise ValueError(f"old_log_probs must be on hidden's device {rows.hidden.device}, got {old.device}")
    args = dict(args, mask=counted)
    # kl_penalty_loss' checks of every loss argument (old_log_probs standing in for the log-probs), before
    # any matmul; the problem gives the native layout ([N] packed or [B, T] padded) and its token frame
    p, kind, _ = loss_problem.build_problem(old, old, advantages,
                                            **{k: v for k, v in args.items() if k in _PROBLEM_ARGS})
    if tuple(p.log_probs.shape) != tuple(rows.shape):
        raise ValueError(f"old_log_probs must have the token shape of hidden {list(rows.shape)} (the loss' layout), "
                         f"got {list(p.log_probs.shape)}")
    valid, pos, per_seq, seq = token_frame(p)
    shape = p.log_probs.shape

    def per_token(x):  # a per-sequence [B] vector at every token, flat
        return per_seq(x).expand(shape).reshape(-1)

    m = final_mask(p, valid, pos, per_seq).reshape(-1)
    adv = per_token(p.advantages.reshape(-1)) if p.adv_per_seq else p.advantages.reshape(-1)
    beta = p.beta
    if isinstance(beta, torch.Tensor) and beta.dim() == 1:
        beta = per_token(beta)
    flat_old = p.old_log_probs.reshape(-1)
    flat_ref = None if p.ref_log_probs is None else p.ref_log_probs.reshape(-1)
    flat_w = None if p.weights is None else p.weights.reshape(-1)
    w_tok = _token_weights(old, args).reshape(-1)
    per_token_args = {k: args[k] for k in ("estimator", "clip_epsilon", "dual_clip", "weight_kl", "clamp_input",
                                           "clamp_output", "kl_times_ratio", "entropy_coef", "backend", "objective",
                                           "ratio_cap", "sapo_temperatures")}

    def chunk_loss(c0, c1, lp, ent, ref_lp, extras):
        beta_c = beta[c0:c1] if isinstance(beta, torch.Tensor) and beta.dim() == 1 else beta
        ref = ref_lp if ref_lp is not None else (None if flat_ref is None else flat_ref[c0:c1])
        out = kl_penalty_loss(lp, flat_old[c0:c1], adv[c0:c1], offsets=torch.arange(c1 - c0 + 1, device=lp.device),
                              mask=m[c0:c1], beta=beta_c, ref_log_probs=ref, entropy=ent, aggregation="none",
                              weights=None if flat_w is None else flat_w[c0:c1], **per_token_args)
        w = w_tok[c0:c1].to(torch.float64)
        parts = torch.stack([(t.to(torch.float64) * w).sum() for t in (out.loss_objective, out.loss_kl,
                                                                          out.loss_entropy)])
        n = out.num_tokens.to(torch.float64)
        means = (out.kl_mean, out.ratio_mean, out.clip_fraction, out.clip_low_fraction, out.clip_high_fraction,
                 out.entropy_mean)
        # (each token its own sequence: the per-sequence flags are per token here, summed per sequence below)
        extras.append((parts, torch.stack(means).to(torch.float64) * n, out.num_tokens, out.loss.dtype,
                       out.sequence_stats, out.seq_num_tokens))
        return (out.loss.to(torch.float64) * w).sum()

    loss, extras = linear_loss_one_pass(rows, want_entropy, chunk_loss)
    md = extras[0][3] if extras else torch.float32
    parts = sum((e[0] for e in extras), torch.zeros(3, dtype=torch.float64, device=hidden.device))
    diag = sum((e[1] for e in extras), torch.zeros(6, dtype=torch.float64, device=hidden.device))
    count = sum((e[2] for e in extras), torch.zeros((), dtype=torch.int64, device=hidden.device))
    means = (diag / count.clamp_min(1).to(torch.float64)).to(md).unbind()
    # the per-token stats and counts (kl_penalty_loss' per-sequence fields of one-token sequences), summed per
    # sequence
    if extras:
        stats, counts = torch.cat([e[4] for e in extras]), torch.cat([e[5] for e in extras])
    else:
        stats = torch.zeros(0, len(STAT_COLUMNS), device=hidden.device)
        counts = torch.zeros(0, dtype=torch.int64, device=hidden.device)
    if p.layout == "padded":
        stats, counts = stats.reshape(*shape, -1).sum(1), counts.reshape(shape).sum(1)
    else:
        stats = torch.zeros(p.batch_size, stats.shape[1], dtype=stats.dtype, device=stats.device).index_add_(
            0, seq, stats)
        counts = torch.zeros(p.batch_size, dtype=torch.int64, device=counts.device).index_add_(0, seq, counts)
    return KLPenaltyLossOutput(loss.to(md), *parts.to(md).unbind(), *means[:3], count, *means[3:], counts, stats)


def _token_weights(old, args) -> torch.Tensor:
    """``W_t``: each counted token's weight in the loss' aggregation (its sequence's ``w_b``), 0 elsewhere:
    the gradient to the log-probs of ``kl_penalty_loss`` at ratio 1 with advantages -1 (``pg_t = ratio_t``),
    no clip, KL or entropy term, so that the op's own aggregation code says it."""
    probe = torch.zeros(old.shape, dtype=torch.float32, device=old.device, requires_grad=True)
    layout = {k: args[k] for k in ("mask", "offsets", "lengths", "padding_side", "aggregation", "norm_length",
                                   "num_global_tokens", "num_sequences", "backend")}
    with torch.enable_grad():
        out = kl_penalty_loss(probe, probe.detach(), torch.full(old.shape, -1.0, device=old.device), beta=0.0,
                              **layout)
        (w,) = torch.autograd.grad(out.loss, [probe])
    return w
