"""Validate ``kl_penalty_loss``'s arguments and normalize them into one :class:`KLPenaltyProblem`.

The loss reuses ``kl_reward``'s layout machinery: lists and nested tensors are packed (zero-copy
for jagged nested tensors), dense inputs stay packed ``[N]`` + ``offsets`` or padded ``[B, T]``
+ ``lengths``, so a backend only ever sees one of the two native layouts. Every check happens here,
before any backend runs; bad input raises ``TypeError``/``ValueError`` naming the argument and what
was expected. Inputs are never modified.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch

from .. import _checks, codes, index_checks, ragged, value_checks
from ..codes import ESTIMATORS
from ..layouts import NativeLayout, check_device, check_logprob_tensor, normalize_layout, pack_ragged_arg, same_device

IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
# The policy term's formula (reference.py): PPO's clipped surrogate, TRL's cispo (a capped, detached ratio times
# A times the log-prob) and sapo (a soft, sigmoid-gated ratio).
OBJECTIVES = ("ppo", "cispo", "sapo")
AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm",
                "token-sum-norm", "sum", "none")
# The aggregations whose weight divides by a sequence count B (num_sequences applies to them) and those
# that divide by the constant length norm_length.
SEQUENCE_AGGREGATIONS = ("seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
NORM_AGGREGATIONS = ("seq-mean-token-sum-norm", "token-sum-norm")
# The log-ratio log_probs - old_log_probs is clamped to +-LOG_RATIO_BOUND before exp: exp(20) ~ 4.9e8
# keeps the ratio (and ratio * advantage) finite in float32 where a diverged token would give inf.
LOG_RATIO_BOUND = codes.LOG_RATIO_BOUND  # the one table: kl_kernels/codes.py


@dataclass
class KLPenaltyProblem(NativeLayout):
    """Normalized arguments of one ``kl_penalty_loss`` call, in a layout a kernel reads natively.

    Per-token tensors (``log_probs``, ``old_log_probs``, ``ref_log_probs``, ``entropy``, ``mask``,
    per-token ``advantages``) are ``[N]`` (``layout == "packed"``, with ``offsets [B + 1]``) or
    ``[B, T]`` (``"padded"``, with ``lengths`` or ``None`` and ``padding_side``). Per-sequence
    advantages are ``[B]`` (``adv_per_seq``). ``beta`` is a float or a detached float32 0-d / ``[B]``
    tensor. ``clip`` is ``(1 - eps_low, 1 + eps_high)`` or ``None``; ``dual_clip`` ``None`` or ``c > 1``.
    ``weights`` is ``None`` or a per-token floating tensor (detached), applied to the policy term
    (and, ``weight_kl``, to the KL term). ``grad_out`` is ``None`` or a
    float32 tensor of ``log_probs``' (native) shape for the fused kernels' gradient buffer.
    """

    layout: str
    log_probs: torch.Tensor
    old_log_probs: torch.Tensor
    ref_log_probs: torch.Tensor | None
    advantages: torch.Tensor
    adv_per_seq: bool
    entropy: torch.Tensor | None
    entropy_coef: float
    mask: torch.Tensor | None
    offsets: torch.Tensor | None
    lengths: torch.Tensor | None
    padding_side: str
    beta: float | torch.Tensor
    estimator: str
    clip: tuple | None
    aggregation: str
    norm_length: float | None
    device_free: bool = False  # see NativeLayout
    weights: torch.Tensor | None = None  # per-token weights (data), this layout
    weight_kl: bool = False              # the weights multiply the KL term too
    dual_clip: float | None = None       # c > 1: for A < 0 the objective is at most -A * c
    clamp_input: tuple | None = None     # the KL's clamps, as kl_reward's (lo, hi; either None)
    clamp_output: tuple | None = None
    grad_out: torch.Tensor | None = None  # the caller's float32 gradient buffer (api.py's out=), this layout
    # "sequence" (GSPO): each counted token takes its sequence's mean log-ratio; each backend computes those
    # means its way (reference.sequence_log_ratio, or the CPU kernel's pre-pass) and its kernels read them
    importance_sampling_level: str = "token"
    kl_times_ratio: bool = False         # the KL term times the (differentiable) ratio (TRL's use_bias_correction_kl)
    objective: str = "ppo"               # OBJECTIVES: the policy term's formula
    ratio_cap: float | None = None       # cispo: the cap of the detached ratio (TRL's epsilon_high)
    sapo_temperatures: tuple = (1.0, 1.05)  # sapo: (tau for A > 0, tau otherwise) (TRL's defaults)
    # The KL and entropy terms' own aggregations (None: the policy term's, ``aggregation``), and the sequence
    # count B of the seq-mean aggregations: None (every sequence), "nonempty" (those with a counted token),
    # or the caller's count (int or 0-d tensor: data parallel's global count).
    kl_aggregation: str | None = None
    entropy_aggregation: str | None = None
    num_sequences: object = None
    # estimator="full": the KL term's per-token values, this layout, 0 at non-counted tokens, already
    # clamped and weighted (api.py computes them from the logits); differentiable. The kernels then run
    # without a KL term and run_split adds this one.
    kl_values: torch.Tensor | None = None

    @property
    def split_terms(self) -> bool:
        """Whether the terms are not all weighed alike, B is not the batch's, or the KL term comes
        from the logits: then the call takes :func:`kl_kernels.kl_penalty.aggregate.run_split`
        (counts before the kernel)."""
        return (self.kl_values is not None or self.kl_aggregation not in (None, self.aggregation)
                or self.entropy_aggregation not in (None, self.aggregation) or self.num_sequences is not None)

    prompt_lens = None  # the loss has no prompt region: the mask says which tokens count

    @property
    def dtypes(self) -> set:
        out = {self.log_probs.dtype, self.old_log_probs.dtype, self.advantages.dtype}
        for t in (self.ref_log_probs, self.entropy, self.weights):
            if t is not None:
                out.add(t.dtype)
        return out

    @property
    def math_dtype(self) -> torch.dtype:
        """float32 math; float64 when a log-prob input is float64 (the reference's oracle mode)."""
        return torch.float64 if torch.float64 in self.dtypes else torch.float32


def _real(name, value, *, lo=None, lo_open=False):
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    value = float(value)
    if math.isnan(value) or math.isinf(value):
        raise ValueError(f"{name} must be finite, got {value}")
    if lo is not None and (value < lo or (lo_open and value == lo)):
        raise ValueError(f"{name} must be {'>' if lo_open else '>='} {lo}, got {value}")
    return value


def _check_clip(clip_epsilon):
    """``None``, ``eps`` or ``(eps_low, eps_high)`` -> ``(1 - eps_low, 1 + eps_high)`` or ``None``."""
    if clip_epsilon is None:
        return None
    if isinstance(clip_epsilon, (tuple, list)):
        if len(clip_epsilon) != 2:
            raise ValueError(f"clip_epsilon must be a float or a pair (eps_low, eps_high), got {clip_epsilon!r}")
        low, high = (_real("clip_epsilon", e, lo=0.0) for e in clip_epsilon)
    else:
        low = high = _real("clip_epsilon", clip_epsilon, lo=0.0)
    if low >= 1.0:
        raise ValueError(f"clip_epsilon's lower epsilon must be < 1 (the ratio is clipped to 1 - eps), got {low}")
    return 1.0 - low, 1.0 + high


def _token_tensor(x, name, kind, lp, offsets, lp_lengths=None, *, floating=True):
    """A per-token argument in log_probs' layout -> a tensor in the problem's native layout
    (``lp_lengths``: a list's sequence lengths as Python ints, see ``pack_ragged_arg``)."""
    if kind in ("list", "nested_jagged", "nested_strided"):
        return pack_ragged_arg(x, name, offsets, kind, lp.dtype, lp_lengths)
    if not isinstance(x, torch.Tensor) or x.is_nested:
        raise TypeError(f"{name} must be a regular tensor like log_probs, got "
                        f"{'a nested tensor' if isinstance(x, torch.Tensor) else type(x).__name__}")
    if tuple(x.shape) != tuple(lp.shape):
        raise ValueError(f"{name} must have the shape of log_probs {list(lp.shape)}, got {list(x.shape)}")
    check_device(name, x.device, lp.device)
    return x


def _check_float(x, name):
    if not x.dtype.is_floating_point:
        raise TypeError(f"{name} must be a floating tensor (float32, bfloat16, float16 or float64), got {x.dtype}")


def _advantages(advantages, kind, lp, offsets, batch, lp_lengths=None):
    """Per-token (the log-probs' layout, or padded ``[B, T, 1]``) or per-sequence (``[B]``, ``[B, 1]``)."""
    if isinstance(advantages, (list, tuple)) or (isinstance(advantages, torch.Tensor) and advantages.is_nested):
        if kind not in ("list", "nested_jagged", "nested_strided"):
            raise TypeError("advantages is a list or nested tensor but log_probs is a dense tensor: give a tensor")
        values = pack_ragged_arg(advantages, "advantages", offsets, kind, lp.dtype, lp_lengths)
        if values.dim() != 1:
            raise ValueError("per-token advantages must be [L] per sequence, like log_probs")
        _check_float(values, "advantages")
        return values, False
    if not isinstance(advantages, torch.Tensor):
        raise TypeError(f"advantages must be a tensor, a nested tensor or a list of tensors, "
                        f"got {type(advantages).__name__}")
    _check_float(advantages, "advantages")
    check_device("advantages", advantages.device, lp.device)
    shape, tok = tuple(advantages.shape), tuple(lp.shape)
    if kind == "padded":
        # [B, T] first: with T == 1 the per-token and per-sequence readings are the same numbers.
        if shape == tok:
            return advantages, False
        if shape == tok + (1,):
            return advantages.reshape(tok), False
        if shape in ((batch,), (batch, 1)):
            return advantages.reshape(batch), True
    elif kind == "packed":
        # [N] is per-token; per-sequence is [B, 1] only: [B] could be read either way when N == B.
        if shape == tok:
            return advantages, False
        if shape == (batch, 1):
            return advantages.reshape(batch), True
        if shape == (batch,):
            raise ValueError(f"advantages of shape [B] = {list(shape)} with packed log_probs: pass per-sequence "
                             "advantages as [B, 1] (a 1-D tensor is read as per-token [N])")
    elif shape in ((batch,), (batch, 1)):
        return advantages.reshape(batch), True
    forms = {"padded": f"per-token {list(tok)} or {list(tok + (1,))}, or per-sequence [B] or [B, 1]",
             "packed": f"per-token {list(tok)} or per-sequence [B, 1]"}
    form = forms.get(kind, f"per-token (a {kind.replace('_', ' ')} like log_probs), or per-sequence [B] or [B, 1]")
    raise ValueError(f"advantages must be {form} with B = {batch}; got shape {list(shape)}")


def _beta(beta, batch, device):
    if isinstance(beta, torch.Tensor):
        if not beta.dtype.is_floating_point:
            raise TypeError(f"beta must be a float, a 0-dim or a per-sequence [B] floating tensor, got {beta.dtype}")
        if beta.dim() != 0 and tuple(beta.shape) != (batch,):
            raise ValueError(f"beta must be a float, a 0-dim tensor or a per-sequence [B] tensor (B = {batch}); "
                             f"got shape {list(beta.shape)}")
        check_device("beta", beta.device, device)
        # a coefficient, read on device (values checked on the CPU only: no host sync), no gradient
        return _checks.finite_coefficient_tensor("beta", beta.detach())
    return _checks.finite_scalar("beta", _real("beta", beta))


def _check_objective(objective, ratio_cap, sapo_temperatures, clip, dual_clip):
    """``(ratio_cap, sapo_temperatures)`` checked against ``objective``: cispo needs ``ratio_cap`` (> 0), sapo
    two temperatures > 0; the clip and the dual clip are PPO's (the other objectives refuse them)."""
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {', '.join(map(repr, OBJECTIVES))}; got {objective!r}")
    if objective != "ppo":
        for name, value in (("clip_epsilon", clip), ("dual_clip", dual_clip)):
            if value is not None:
                raise ValueError(f"{name} is PPO's clip; objective={objective!r} has none (cispo caps the ratio at "
                                 "ratio_cap, sapo gates it softly): pass None")
    if objective == "cispo":
        if ratio_cap is None:
            raise ValueError("objective='cispo' needs ratio_cap (the cap of the detached ratio: TRL's epsilon_high, "
                             "e.g. 5.0)")
        ratio_cap = _real("ratio_cap", ratio_cap, lo=0.0, lo_open=True)
    elif ratio_cap is not None:
        raise ValueError(f"ratio_cap is cispo's cap; objective={objective!r} (pass None)")
    if not isinstance(sapo_temperatures, (tuple, list)) or len(sapo_temperatures) != 2:
        raise ValueError(f"sapo_temperatures must be a pair (tau for A > 0, tau for A <= 0); got {sapo_temperatures!r}")
    taus = tuple(_real("sapo_temperatures", t, lo=0.0, lo_open=True) for t in sapo_temperatures)
    return ratio_cap, taus


def _check_process_group(process_group) -> None:
    """None, or a torch.distributed ProcessGroup (e.g. ``torch.distributed.group.WORLD``)."""
    if process_group is None:
        return
    import torch.distributed as dist

    group_type = getattr(dist, "ProcessGroup", None) if dist.is_available() else None
    if group_type is None or not isinstance(process_group, group_type):
        raise TypeError("process_group must be None or a torch.distributed.ProcessGroup (e.g. "
                        f"torch.distributed.group.WORLD), got {type(process_group).__name__}")


def _aggregations(p) -> tuple:
    """The aggregations of a problem's three terms (policy, KL, entropy)."""
    return (p.aggregation, p.kl_aggregation or p.aggregation, p.entropy_aggregation or p.aggregation)


def _num_global_tokens(n, problem, process_group, device):
    if n is not None and process_group is not None:
        raise ValueError("pass num_global_tokens or process_group, not both")
    _check_process_group(process_group)
    if n is None:
        return None
    if "token-mean" not in _aggregations(problem):
        raise ValueError(f"num_global_tokens applies to aggregation='token-mean' only (of the policy, KL or entropy "
                         f"term), got {problem.aggregation!r} (use num_sequences or process_group for the sequence "
                         "count of the seq-mean aggregations)")
    return _global_count(n, "num_global_tokens", "an integer >= 0", "token", device)


def _global_count(n, name: str, expected: str, what: str, device):
    """A caller's count of every rank's tokens or sequences: an int >= 0 or a 0-dim real tensor on the
    inputs' device."""
    if isinstance(n, torch.Tensor):
        if n.dim() != 0 or n.dtype.is_complex or n.dtype == torch.bool:
            raise ValueError(f"{name} must be an int or a 0-dim real tensor, got {n.dtype} {list(n.shape)}")
        check_device(name, n.device, device)
        return n
    if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 0:
        raise ValueError(f"{name} must be {expected} (the {what} count of every rank together), got {n!r}")
    return int(n)


def _term_aggregation(value, name, aggregation):
    """``kl_aggregation`` / ``entropy_aggregation``: None (the policy term's) or an aggregation but
    ``"none"``; with ``aggregation="none"`` (per-token output) only None or ``"none"``."""
    if value is None or value == aggregation:
        return None
    if value not in AGGREGATIONS or value == "none":
        choices = ", ".join(repr(a) for a in AGGREGATIONS if a != "none")
        raise ValueError(f"{name} must be None (the policy term's aggregation) or one of {choices}; got {value!r}")
    if aggregation == "none":
        raise ValueError(f"{name}={value!r} cannot combine with aggregation='none' (per-token losses): pass None")
    return value


def _num_sequences(n, aggregations, process_group, device):
    """``num_sequences``: None, ``"nonempty"``, an int >= 0 or a 0-d real tensor on the inputs' device."""
    if n is None:
        return None
    if not any(a in SEQUENCE_AGGREGATIONS for a in aggregations):
        raise ValueError(f"num_sequences applies to the seq-mean aggregations ({', '.join(SEQUENCE_AGGREGATIONS)}) "
                         f"only, got aggregations {sorted(set(aggregations))}")
    if isinstance(n, str):
        if n != "nonempty":
            raise ValueError(f"num_sequences must be None, 'nonempty', an int >= 0 or a 0-dim tensor; got {n!r}")
        return n
    if process_group is not None:
        raise ValueError("pass a count in num_sequences or process_group, not both (num_sequences='nonempty' "
                         "combines with process_group: the non-empty sequences of every rank are counted)")
    return _global_count(n, "num_sequences", "None, 'nonempty' or an integer >= 0", "sequence", device)


def _check_out(out, lp, inputs) -> torch.Tensor:
    """The caller's gradient buffer (``out=``), checked: float32, ``lp``'s native shape (packed
    ``[N]`` for lists and nested tensors), device, contiguous, no grad, sharing no memory with an
    input. Eager calls only: under ``torch.compile`` the compiler plans the buffers."""
    if torch.compiler.is_compiling():
        raise ValueError("out= is for eager calls: under torch.compile the compiled graph plans the gradient "
                         "buffer itself (call without out=)")
    out = _checks.result_buffer("out", out, tuple(lp.shape), torch.float32, lp.device)
    _checks.no_overlap([("out", out)], inputs)
    return out


class CallChecks:
    """The checks of :func:`build_problem` that read values, for the later calls of a plan (one call
    signature, ``kl_kernels/plans.py``): offsets and lengths within bounds, a finite beta, a gradient
    buffer that overlaps no input; by the same functions (a float beta build_problem would accept is
    taken as it is; any other goes through :func:`_beta`, for its exact error)."""

    __slots__ = ("num_tokens", "batch", "width", "device")

    def __init__(self, problem: KLPenaltyProblem):
        self.device, self.num_tokens, self.batch = problem.device, problem.num_tokens, problem.batch_size
        self.width = problem.log_probs.shape[1] if problem.layout == "padded" else None

    def __call__(self, offsets, lengths, beta, out=None, inputs=()):
        """``(offsets, lengths, beta)`` as build_problem normalizes them (int32 index tensors widened to
        int64: what the kernel must read), or its error."""
        # (the structure checks of ragged.check_offsets / check_lengths hold by the equal signature: type,
        # dtype, shape, device; only the values are checked again. plain: the plan is made only for
        # int64 contiguous index tensors (int32 ones widened into those) without the negative bit and a
        # non-empty batch: api.py's plan builder)
        # (their device checks deferred to the plan's launch, whose combine kernel makes them:
        # value_checks.defer_checks, written out: no Python-level call on a path whose calls tests/test_plans.py counts)
        deferred = value_checks.DEFERRED
        if deferred.pending:
            value_checks.flush_deferred()
        deferred.active = True
        try:
            if offsets is not None:
                offsets = index_checks.check_offset_values(offsets, self.num_tokens, plain=True)
            if lengths is not None:
                lengths = index_checks.check_length_values(lengths, self.batch, self.width, plain=True)
        finally:
            deferred.active = False
        if type(beta) is not float or not -_checks.FLOAT32_MAX <= beta <= _checks.FLOAT32_MAX:
            beta = _beta(beta, self.batch, self.device)
        if out is not None:
            _checks.no_overlap([("out", out)], inputs)
        return offsets, lengths, beta


def build_problem(*args, **kwargs):
    """Validate everything; return ``(KLPenaltyProblem, kind, offsets_of_kind)``. (:func:`_build_problem`'s arguments.)

    The value checks of accelerator tensors (offsets, lengths) are deferred to the launch that
    follows (kl_kernels.ragged's ``defer_checks``): the CUDA forward checks them in its own combine kernel instead
    of launches of their own; anything else launches them first. A validation that fails launches them at once."""
    return value_checks.deferring(_build_problem, *args, **kwargs)


def _build_problem(log_probs, old_log_probs, advantages, *, ref_log_probs, beta, estimator, mask, offsets, lengths,
                  padding_side, clip_epsilon, entropy, entropy_coef, aggregation, norm_length, out=None,
                  dual_clip=None, weights=None, weight_kl=False, clamp_input=None, clamp_output=None,
                  importance_sampling_level="token", kl_times_ratio=False, kl_aggregation=None,
                  entropy_aggregation=None, num_sequences=None, process_group=None, objective="ppo", ratio_cap=None,
                  sapo_temperatures=(1.0, 1.05)):
    """Validate everything; return ``(KLPenaltyProblem, kind, offsets_of_kind)``.

    ``kind`` is the caller's layout (``"packed"``, ``"padded"``, ``"list"``, ``"nested_jagged"``,
    ``"nested_strided"``): per-token results go back in it.
    """
    if estimator not in ESTIMATORS:
        raise ValueError(f"estimator must be one of {', '.join(map(repr, ESTIMATORS))}; got {estimator!r}")
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {', '.join(map(repr, AGGREGATIONS))}; got {aggregation!r}")
    kl_aggregation = _term_aggregation(kl_aggregation, "kl_aggregation", aggregation)
    entropy_aggregation = _term_aggregation(entropy_aggregation, "entropy_aggregation", aggregation)
    aggregations = (aggregation, kl_aggregation or aggregation, entropy_aggregation or aggregation)
    if padding_side not in ragged.PADDING_SIDES:
        raise ValueError(f"padding_side must be 'left' or 'right', got {padding_side!r}")
    if importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
        raise ValueError(f"importance_sampling_level must be 'token' or 'sequence', got {importance_sampling_level!r}")
    clip = _check_clip(clip_epsilon)
    entropy_coef = _real("entropy_coef", entropy_coef)
    if dual_clip is not None:
        dual_clip = _real("dual_clip", dual_clip, lo=1.0, lo_open=True)
    clamp_input = _checks.clamp_bounds("clamp_input", clamp_input)
    clamp_output = _checks.clamp_bounds("clamp_output", clamp_output)
    if not isinstance(weight_kl, bool):
        raise TypeError(f"weight_kl must be a bool, got {type(weight_kl).__name__}")
    if not isinstance(kl_times_ratio, bool):
        raise TypeError(f"kl_times_ratio must be a bool, got {type(kl_times_ratio).__name__}")
    ratio_cap, sapo_temperatures = _check_objective(objective, ratio_cap, sapo_temperatures, clip, dual_clip)
    if weight_kl and weights is None:
        raise ValueError("weight_kl=True weights the KL term by `weights`: pass weights too")
    if isinstance(log_probs, (list, tuple)) != isinstance(old_log_probs, (list, tuple)):
        raise TypeError("log_probs and old_log_probs must use the same layout (both lists, both nested or both dense)")
    if isinstance(log_probs, torch.Tensor) and log_probs.is_nested and not (
            isinstance(old_log_probs, torch.Tensor) and old_log_probs.is_nested):
        raise TypeError("old_log_probs must be a nested tensor like log_probs")
    if not isinstance(log_probs, (list, tuple, torch.Tensor)):
        raise TypeError(f"log_probs must be a tensor, a nested tensor or a list of tensors, got {type(log_probs).__name__}")

    device = _checks.device_of(log_probs, advantages=advantages, mask=mask, beta=beta)
    device_free, device = device is None, device or torch.device("cpu")
    _checks.dense_layouts(log_probs=log_probs, old_log_probs=old_log_probs, ref_log_probs=ref_log_probs,
                          advantages=advantages, entropy=entropy, mask=mask, offsets=offsets, lengths=lengths,
                          beta=beta, weights=weights)
    same_device(device, old_log_probs=old_log_probs, ref_log_probs=ref_log_probs, advantages=advantages,
                 entropy=entropy, mask=mask, offsets=offsets, lengths=lengths, beta=beta, weights=weights)
    kind, lp, old, mask, offsets, lengths = normalize_layout(log_probs, old_log_probs, mask, offsets, lengths,
                                                              padding_side, second="old_log_probs",
                                                              empty_device=device)
    device = lp.device
    if kind != "list":
        check_device("old_log_probs", old.device, device)
    layout = "padded" if kind == "padded" else "packed"
    batch = lp.shape[0] if layout == "padded" else offsets.shape[0] - 1

    host_lengths = [t.shape[0] for t in log_probs] if kind == "list" else None  # compared on the host
    ref = None
    if ref_log_probs is not None:
        ref = _token_tensor(ref_log_probs, "ref_log_probs", kind, lp, offsets, host_lengths)
        check_logprob_tensor(ref, "ref_log_probs")
    ent = None
    if entropy is not None:
        ent = _token_tensor(entropy, "entropy", kind, lp, offsets, host_lengths)
        _check_float(ent, "entropy")
    adv, adv_per_seq = _advantages(advantages, kind, lp, offsets, batch, host_lengths)
    wts = None
    if weights is not None:
        wts = _token_tensor(weights, "weights", kind, lp, offsets, host_lengths)
        _check_float(wts, "weights")

    normed = next((a for a in aggregations if a in NORM_AGGREGATIONS), None)
    if norm_length is not None:
        norm_length = _real("norm_length", norm_length, lo=0.0, lo_open=True)
        if normed is None:
            raise ValueError(f"norm_length applies to the aggregations {' and '.join(map(repr, NORM_AGGREGATIONS))} "
                             f"only, got {sorted(set(aggregations))}")
    elif normed is not None:
        if layout != "padded":
            raise ValueError(f"aggregation {normed!r} divides by a constant length: pass norm_length (e.g. the "
                             "maximum response length) for packed, list or nested inputs")
        if lp.shape[1] == 0:
            raise ValueError(f"aggregation {normed!r} needs norm_length when the padded width T is 0")
        norm_length = float(lp.shape[1])
    num_sequences = _num_sequences(num_sequences, aggregations, process_group, device)
    if entropy is None or entropy_coef == 0.0:  # no entropy term: nothing for its own aggregation to weigh
        entropy_aggregation = None

    beta = _beta(beta, batch, device)
    if out is not None:
        out = _check_out(out, lp, [("log_probs", lp), ("old_log_probs", old), ("ref_log_probs", ref),
                                   ("advantages", adv), ("entropy", ent), ("weights", wts), ("mask", mask),
                                   ("offsets", offsets), ("lengths", lengths), ("beta", beta)])

    problem = KLPenaltyProblem(
        layout=layout, log_probs=lp, old_log_probs=old.detach(), ref_log_probs=None if ref is None else ref.detach(),
        advantages=adv.detach(), adv_per_seq=adv_per_seq, entropy=ent, entropy_coef=entropy_coef, mask=mask,
        offsets=offsets if layout == "packed" else None, lengths=lengths, padding_side=padding_side,
        beta=beta, estimator=estimator, clip=clip, aggregation=aggregation,
        norm_length=norm_length, device_free=device_free, grad_out=out,
        weights=None if wts is None else wts.detach(), weight_kl=weight_kl, dual_clip=dual_clip,
        clamp_input=clamp_input, clamp_output=clamp_output)
    problem.importance_sampling_level = importance_sampling_level
    problem.kl_times_ratio = kl_times_ratio
    problem.objective, problem.ratio_cap, problem.sapo_temperatures = objective, ratio_cap, sapo_temperatures
    problem.kl_aggregation = kl_aggregation
    problem.entropy_aggregation = entropy_aggregation
    problem.num_sequences = num_sequences
    return problem, kind, offsets


# (its signature: inspect.signature follows __wrapped__; linear_loss.py reads it)
build_problem.__wrapped__ = _build_problem
