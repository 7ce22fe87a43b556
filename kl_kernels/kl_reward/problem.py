"""Validate ``kl_reward``'s arguments and normalize them into one :class:`KLRewardProblem`.

Every check happens here, before any backend runs: a backend only ever sees a problem in one
of two native layouts (``"packed"``: ``[N]`` + ``offsets``; ``"padded"``: ``[B, T]`` +
optional ``lengths``), with the reward already classified (per-token or per-sequence ``[B]``)
and every tensor on one device. Lists and nested tensors are packed here (zero-copy for jagged
nested tensors) and :class:`OutputLayout` turns the results back into the caller's layout.

One exception saves the copy: a list of contiguous CPU tensors that needs no autograd becomes
a ``"list"`` problem, packed geometry (``offsets``) whose per-token inputs are
:class:`~kl_kernels.ragged.SequenceList` objects that the CPU kernel reads in place. Only the
``cpu`` backend declares that layout; for any other, :meth:`KLRewardProblem.packed` packs it.

Bad input raises ``TypeError`` (wrong kind or dtype) or ``ValueError`` (wrong shape, value or
device) naming the argument and what was expected. Inputs are never modified.
"""

from __future__ import annotations

import dataclasses
import numbers
from dataclasses import dataclass
from typing import NamedTuple

import torch

from .. import _checks, codes, device_errors, index_checks, ragged, value_checks
# The layout rules both ops share (kl_kernels/layouts.py), under the names this module has always used.
from ..layouts import _FLOAT_DTYPES, NativeLayout, TokenLayout, and_not_nan
from ..layouts import check_device as _check_device
from ..layouts import int_vector as _int_vector
from ..layouts import normalize_layout as _normalize_layout
from ..layouts import pack_ragged_arg as _pack_ragged_arg
from ..layouts import same_device as _same_device

ESTIMATORS = codes.ESTIMATORS  # the one table: kl_kernels/codes.py
STRAIGHT_THROUGH = codes.STRAIGHT_THROUGH
PLACEMENTS = codes.PLACEMENTS


class KLRewardOutput(NamedTuple):
    """Result of :func:`kl_kernels.kl_reward`.

    * ``kl``: per-token KL estimate, caller's layout, log-prob dtype; exactly 0 where not counted.
    * ``reward``: ``reward - coef * kl`` (per the placement), caller's layout; a trailing dim of 1
      when the reward had one.
    * ``ref_log_probs``: reference log-probs with non-counted tokens zeroed (``return_ref=True``),
      else ``None``.
    * ``kl_sum``: ``[B]`` per-sequence sum of ``kl`` (float32; float64 for float64 inputs).
    * ``count``: ``[B]`` int64 number of counted tokens (the final mask).
    """

    kl: object
    reward: object
    ref_log_probs: object
    kl_sum: torch.Tensor
    count: torch.Tensor


@dataclass
class KLRewardProblem(NativeLayout):
    """Normalized arguments of one ``kl_reward`` call, in a layout a kernel reads natively.

    ``layout == "packed"``: ``log_probs``/``ref_log_probs``/``mask``/token rewards are ``[N]``
    and ``offsets`` is ``[B + 1]``. ``layout == "padded"``: they are ``[B, T]``; ``lengths``
    (``[B]``, or ``None`` = all ``T`` columns valid) and ``padding_side`` give validity.
    ``reward`` is ``None``, per-token (``placement == "token"``) or ``[B]`` (``"sequence"`` or
    ``"last"``), already in ``reward_dtype``. ``coef`` is a float or a detached 0-d / ``[B]``
    tensor. ``prompt_lens`` is ``None`` or ``[B]`` int64. ``layout == "list"``: as packed, with
    the per-token inputs as :class:`~kl_kernels.ragged.SequenceList` (see the module doc).
    ``mask_nan``: a token where either log-prob is NaN does not count (TorchRL's alignment pads).
    """

    layout: str
    log_probs: torch.Tensor
    ref_log_probs: torch.Tensor
    mask: torch.Tensor | None
    offsets: torch.Tensor | None
    lengths: torch.Tensor | None
    padding_side: str
    prompt_lens: torch.Tensor | None
    reward: torch.Tensor | None
    placement: str | None
    reward_dtype: torch.dtype
    coef: float | torch.Tensor
    estimator: str
    clamp_input: tuple | None
    clamp_output: tuple | None
    return_ref: bool
    mask_nan: bool = False
    out: "RawOutputs | None" = None  # caller-provided result buffers, in this layout (api.py's out=)
    device_free: bool = False  # see NativeLayout

    def packed(self) -> "KLRewardProblem":
        """This problem in the packed layout (``"list"`` problems are packed; others returned as is)."""
        if self.layout != "list":
            return self
        pack = lambda x: x.pack() if isinstance(x, ragged.SequenceList) else x  # noqa: E731
        return dataclasses.replace(self, layout="packed", log_probs=pack(self.log_probs),
                                   ref_log_probs=pack(self.ref_log_probs), mask=pack(self.mask),
                                   reward=pack(self.reward))

    @property
    def math_dtype(self) -> torch.dtype:
        """float32 math, float64 when an input is float64 (the reference's oracle mode)."""
        dtypes = {self.log_probs.dtype, self.ref_log_probs.dtype}
        return torch.float64 if torch.float64 in dtypes else torch.float32

    @property
    def dtypes(self) -> set:
        out = {self.log_probs.dtype, self.ref_log_probs.dtype}
        if self.reward is not None:
            out.add(self.reward.dtype)
        return out


class RawOutputs(NamedTuple):
    """What a backend returns: per-token tensors in the problem's layout, sums ``[B]``."""

    kl: torch.Tensor
    reward: torch.Tensor
    ref_log_probs: torch.Tensor | None
    kl_sum: torch.Tensor
    count: torch.Tensor


@dataclass(frozen=True)
class OutputLayout(TokenLayout):
    """How to hand kl_reward's results back: the caller's token layout and the reward's trailing dim."""

    reward_trailing: bool = False

    def restore(self, raw: RawOutputs) -> KLRewardOutput:
        reward = raw.reward.unsqueeze(-1) if self.reward_trailing else raw.reward
        # lists: the lengths as Python ints once for every output (a lazily stacked batch calls this
        # per step), from the inputs' shapes when known (no device read)
        lengths = None
        if self.kind == "list":
            lengths = list(self.lengths) if self.lengths is not None else \
                ragged.offsets_to_lengths(self.offsets).tolist()
        ref = self._tokens(raw.ref_log_probs, lengths) if raw.ref_log_probs is not None else None
        return KLRewardOutput(self._tokens(raw.kl, lengths), self._tokens(reward, lengths), ref, raw.kl_sum, raw.count)


# --------------------------------------------------------------------------- option checks


def _check_options(estimator, reward_placement, padding_side, clamp_input, clamp_output, return_ref, detach):
    if estimator not in ESTIMATORS:
        raise ValueError(f"estimator must be one of {', '.join(map(repr, ESTIMATORS))}; got {estimator!r}")
    if reward_placement not in PLACEMENTS:
        raise ValueError(f"reward_placement must be one of {', '.join(map(repr, PLACEMENTS))}; "
                         f"got {reward_placement!r}")
    if padding_side not in ragged.PADDING_SIDES:
        raise ValueError(f"padding_side must be 'left' or 'right', got {padding_side!r}")
    for name, flag in (("return_ref", return_ref), ("detach", detach)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
    return _checks.clamp_bounds("clamp_input", clamp_input), _checks.clamp_bounds("clamp_output", clamp_output)


# --------------------------------------------------------------------------- kl_dtype

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def widened(kl_dtype, **inputs):
    """``kl_reward``'s ``kl_dtype``: each log-probs input (a tensor, a nested tensor or a list of
    tensors) in ``kl_dtype`` where its floating dtype is narrower; a value exactly representable in
    both, so the kernels' float32 math sees the same numbers. Anything else is left for the layout
    checks to judge (an integer tensor is not converted into an accepted one)."""
    if not isinstance(kl_dtype, torch.dtype):
        raise TypeError(f"kl_dtype must be None or a torch floating dtype, got {type(kl_dtype).__name__}")
    if kl_dtype not in _FLOATS:
        raise ValueError(f"kl_dtype must be one of float16, bfloat16, float32, float64; got {kl_dtype}")

    def widen(name, t):
        if not isinstance(t, torch.Tensor) or t.dtype not in _FLOATS:
            return t
        if torch.promote_types(t.dtype, kl_dtype) != kl_dtype:  # narrower, or neither wider (bf16 / fp16)
            raise ValueError(f"kl_dtype ({kl_dtype}) must be {name}'s dtype ({t.dtype}) or wider: the results "
                             "are never narrowed")
        return t if t.dtype == kl_dtype else t.to(kl_dtype)

    out = []
    for name, x in inputs.items():
        if isinstance(x, (list, tuple)):
            out.append(type(x)(widen(f"{name}[{i}]", t) for i, t in enumerate(x)))
        else:
            out.append(widen(name, x))
    return out


# --------------------------------------------------------------------------- tensor checks


# --------------------------------------------------------------------------- layouts


# --------------------------------------------------------------------------- reward


def _pack_token_reward(reward, offsets, kind, lp_lengths=None) -> tuple[torch.Tensor, bool]:
    """A per-token reward (list or nested, [L] or [L, 1] per sequence) -> (packed [N], trailing-dim flag)."""
    if isinstance(reward, (list, tuple)):
        for i, t in enumerate(reward):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"reward[{i}] must be a tensor, got {type(t).__name__}")
    ndims = {t.dim() for t in reward} if isinstance(reward, (list, tuple)) else {reward.dim() - 1}
    if ndims not in (set(), {1}, {2}):  # set(): an empty batch
        raise ValueError("a per-token reward must be [L] or [L, 1] per sequence, consistently")
    trailing = ndims == {2}
    values = _pack_ragged_arg(reward, "reward", offsets, kind, lp_lengths=lp_lengths)
    if trailing:
        if values.dim() != 2 or values.shape[1] != 1:
            raise ValueError(f"a per-token reward must be [L] or [L, 1] per sequence, got a trailing dim of "
                             f"{list(values.shape[1:])}")
        values = values.squeeze(-1)
    return values, trailing


def _classify_reward(reward, kind, tok_shape, batch, placement, offsets, lp=None, lp_lengths=None):
    """Return (reward tensor in problem layout, placement, trailing-dim flag). ``lp``: the
    normalized log-probs (a list reward stays unpacked next to unpacked log-probs); ``lp_lengths``:
    a list's sequence lengths as Python ints (compared on the host)."""
    per_token_given = isinstance(reward, (list, tuple)) or (isinstance(reward, torch.Tensor) and reward.is_nested)
    if per_token_given:
        if kind not in ("list", "nested_jagged", "nested_strided"):
            raise TypeError(f"reward is a {'list' if isinstance(reward, (list, tuple)) else 'nested tensor'} "
                            "but log_probs is a dense tensor: give the reward as a tensor")
        values = trailing = None
        if isinstance(lp, ragged.SequenceList) and isinstance(reward, (list, tuple)):
            # Next to log-probs read in place, a reward of [L, 1] (or [L]) per sequence is too, its
            # shape checked by the same pass; anything else gets the checks below.
            # (A SequenceList is read flat: [L, 1] and [L] are the same memory; nothing to squeeze.)
            for trailing in (True, False):
                values = ragged.SequenceList.of(reward, _FLOAT_DTYPES, trailing_one=trailing, like=lp)
                if values is not None:
                    break
        if values is None:
            values, trailing = _pack_token_reward(reward, offsets, kind, lp_lengths)
        if placement not in ("auto", "token"):
            raise ValueError(f"reward_placement={placement!r} needs a per-sequence reward [B], [B, 1] or [B, 1, 1]; "
                             "a per-token reward (list or nested) takes 'token' or 'auto'")
        return values, "token", trailing

    if not isinstance(reward, torch.Tensor):
        raise TypeError(f"reward must be None, a tensor, a nested tensor or a list of tensors, got {type(reward).__name__}")
    shape = tuple(reward.shape)
    tok_shape = tuple(tok_shape)
    token_matches = []
    if kind in ("packed", "padded"):
        if shape == tok_shape:
            token_matches.append(False)
        if shape == tok_shape + (1,):
            token_matches.append(True)
    seq_forms = {(batch,): (False, False), (batch, 1): (False, True), (batch, 1, 1): (True, True)}
    seq_match = seq_forms.get(shape)  # (trailing, broadcastable against the padded shape)
    accepted = (f"per-token {list(tok_shape)} or {list(tok_shape + (1,))}, or per-sequence [B], [B, 1] or "
                f"[B, 1, 1] with B = {batch}") if kind in ("packed", "padded") else (
        f"per-token (a {kind.replace('_', ' ')} like log_probs) or per-sequence [B], [B, 1] or [B, 1, 1] with B = {batch}")

    if placement == "token":
        if not token_matches:
            raise ValueError(f"reward_placement='token' needs a per-token reward ({accepted.split(', or')[0]}), "
                             f"got shape {list(shape)}")
        trailing = token_matches[0]
        return (reward.squeeze(-1) if trailing else reward), "token", trailing
    if placement in ("sequence", "last", "last_valid"):
        if seq_match is None:
            raise ValueError(f"reward_placement={placement!r} needs a per-sequence reward [B], [B, 1] or [B, 1, 1] "
                             f"with B = {batch}, got shape {list(shape)}")
        return reward.reshape(batch), placement, seq_match[0]
    # auto
    if token_matches and seq_match is not None and reward.numel():
        # (an empty reward of an empty batch, N = B = 0, means the same either way: taken per token)
        raise ValueError(f"reward of shape {list(shape)} is ambiguous: it fits both a per-token reward and a "
                         "per-sequence one; pass reward_placement='token', 'sequence', 'last' or 'last_valid'")
    if token_matches:
        trailing = token_matches[0]
        return (reward.squeeze(-1) if trailing else reward), "token", trailing
    if seq_match is not None:
        trailing, broadcastable = seq_match
        if kind == "padded" and broadcastable:
            # [B, 1] / [B, 1, 1] against [B, T] / [B, T, 1] is plain broadcasting: TorchRL's expand.
            return reward.reshape(batch), "sequence", trailing
        raise ValueError(f"a per-sequence reward of shape {list(shape)} can be broadcast to every token "
                         "(reward_placement='sequence', as TorchRL), put on the last counted token "
                         "(reward_placement='last', as OpenRLHF) or on the last valid token, counted or not "
                         "(reward_placement='last_valid', as verl's reward managers): pass one explicitly")
    raise ValueError(f"reward must be {accepted}; got shape {list(shape)}")


def _reward_dtype(reward, lp_dtype):
    if reward.dtype.is_complex:
        raise TypeError(f"reward must be a real tensor, got {reward.dtype}")
    if reward.dtype.is_floating_point:
        # An fp32 reward is not rounded to bf16 log-prob precision: torch's type promotion.
        return torch.promote_types(reward.dtype, lp_dtype)
    return lp_dtype  # integer / bool scores


def _normalize_coef(coef, batch, device):
    if isinstance(coef, torch.Tensor):
        if coef.dtype == torch.bool or coef.dtype.is_complex:
            raise TypeError(f"coef must be a real tensor, got {coef.dtype}")
        if coef.dim() != 0 and tuple(coef.shape) != (batch,):
            raise ValueError(f"coef must be a float, a 0-dim tensor or a per-sequence [B] tensor (B = {batch}); "
                             f"got shape {list(coef.shape)}")
        _check_device("coef", coef.device, device)
        coef = _checks.finite_coefficient_tensor("coef", coef.detach())
        return coef if coef.dtype.is_floating_point else coef.to(torch.float32)
    if isinstance(coef, bool) or not isinstance(coef, numbers.Real):
        raise TypeError(f"coef must be a float, a 0-dim tensor or a per-sequence [B] tensor, got {type(coef).__name__}")
    return _checks.finite_scalar("coef", float(coef))


def _check_prompt_lens(prompt_lens, kind, offsets, lengths, width, batch, device):
    prompt_lens = _int_vector(prompt_lens, "prompt_lens", batch, device)
    if batch and value_checks.values_checkable(prompt_lens):
        padded = kind == "padded"
        # what bounds them, as an index into device_errors.SEQUENCE_BOUNDS (one message for host and device)
        bound_kind = (1 if lengths is not None else 2) if padded else 0

        def seq_lengths():  # the bounds as a tensor: the torch operations' check (the kernel reads them itself)
            if padded:
                return lengths if lengths is not None else torch.full((batch,), width, device=device)
            return ragged.offsets_to_lengths(offsets)
        if not value_checks.checks_on_host(prompt_lens):
            # (packed: the kernel bounds each sequence by its offsets and reads no width; the binding takes an int)
            if not value_checks.value_check("lengths_valid", prompt_lens, batch, width if padded else 0,
                                             None if padded else offsets, lengths if padded else None,
                                             name="prompt_lens", bound_kind=bound_kind):
                device_errors.record_where(prompt_lens.lt(0), prompt_lens, "below_zero", "prompt_lens", 0)
                bound = seq_lengths()
                device_errors.record_where(prompt_lens.gt(bound), prompt_lens, "above_sequence", "prompt_lens",
                                           bound, bound_kind)
            return prompt_lens
        seq_len = seq_lengths()
        negative, too_long = torch.stack([(prompt_lens < 0).any(), (prompt_lens > seq_len).any()]).tolist()
        if negative:
            raise ValueError(device_errors.value_error_message("below_zero", "prompt_lens", int(prompt_lens.min())))
        if too_long:
            b = int((prompt_lens > seq_len).nonzero()[0, 0])
            raise ValueError(device_errors.value_error_message("above_sequence", "prompt_lens", int(prompt_lens[b]),
                                                               int(seq_len[b]), bound_kind, b))
    return prompt_lens


# --------------------------------------------------------------------------- entry point


def _check_out(out, kind, lp, ref, reward_dtype, trailing, batch, return_ref, graph, inputs):
    """The caller's ``out=`` buffers as :class:`RawOutputs` in the problem's layout (a reward's
    trailing dim dropped), after every check: the layout, entries, shapes, dtypes, device,
    contiguity, no autograd, no overlap with each other or with the inputs."""
    names = KLRewardOutput._fields
    if not isinstance(out, tuple) or len(out) != 5:
        raise TypeError(f"out must be a KLRewardOutput or a 5-tuple {names} of tensors or None, "
                        f"got {type(out).__name__}")
    if kind not in ("packed", "padded"):
        raise TypeError(f"out= takes the packed or padded layout, not a {kind.replace('_', ' ')} (results of "
                        "those layouts are views into one buffer: pass out= with the packed tensors)")
    if graph:
        raise ValueError("out= does not record autograd: pass detach=True, or inputs that do not require grad")
    tok = tuple(lp.shape)
    want = {"kl": (tok, lp.dtype), "reward": (tok + ((1,) if trailing else ()), reward_dtype),
            "ref_log_probs": (tok, ref.dtype), "kl_sum": ((batch,), torch.float32),
            "count": ((batch,), torch.int64)}
    if torch.float64 in (lp.dtype, ref.dtype):  # the reference's float64 mode sums in float64
        want["kl_sum"] = ((batch,), torch.float64)
    given = []
    for name, t in zip(names, out):
        if t is None:
            given.append(None)
            continue
        if name == "ref_log_probs" and not return_ref and isinstance(t, torch.Tensor):
            raise ValueError("out.ref_log_probs must be None without return_ref=True")
        shape, dtype = want[name]
        given.append(_checks.result_buffer(f"out.{name}", t, shape, dtype, lp.device))
    _checks.no_overlap([(f"out.{n}", t) for n, t in zip(names, given)], inputs)
    kl, reward, ref_out, kl_sum, count = given
    if reward is not None and trailing:
        reward = reward.squeeze(-1)
    return RawOutputs(kl, reward, ref_out, kl_sum, count)


class CallChecks:
    """The checks of :func:`build_problem` that read values, for the later calls of a plan (one call
    signature, ``kl_kernels/plans.py``): everything else it decided holds for them by their equal
    signature. The same functions as build_problem's: offsets (start at 0, non-decreasing, end at N),
    lengths and prompt_lens within bounds, a finite coefficient, result buffers that overlap nothing."""

    __slots__ = ("num_tokens", "batch", "width", "layout", "device")

    def __init__(self, problem: KLRewardProblem):
        self.layout, self.device, self.num_tokens = problem.layout, problem.device, problem.num_tokens
        self.batch = problem.batch_size
        self.width = problem.log_probs.shape[1] if problem.layout == "padded" else None

    def __call__(self, offsets, lengths, prompt_lens, coef, out=None, inputs=()):
        """``(offsets, lengths, prompt_lens, coef)`` as build_problem normalizes them (int32 index tensors
        widened to int64: what the kernel must read), or its error."""
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
            if prompt_lens is not None:
                prompt_lens = _check_prompt_lens(prompt_lens, self.layout, offsets, lengths, self.width, self.batch,
                                                 self.device)
        finally:
            deferred.active = False
        coef = _checks.finite_scalar("coef", coef) if type(coef) is float else \
            _normalize_coef(coef, self.batch, self.device)
        if out is not None:
            _checks.no_overlap([(f"out.{n}", t) for n, t in zip(KLRewardOutput._fields, out)], inputs)
        return offsets, lengths, prompt_lens, coef


def build_problem(*args, **kwargs):
    """Validate everything and return ``(KLRewardProblem, OutputLayout)``. (:func:`_build_problem`'s arguments.)

    The value checks of accelerator tensors (offsets, lengths, prompt_lens) are deferred to the launch that
    follows (kl_kernels.ragged's ``defer_checks``): the CUDA forward checks them in its own combine kernel instead
    of launches of their own; anything else launches them first. A validation that fails launches them at once."""
    return value_checks.deferring(_build_problem, *args, **kwargs)


def _build_problem(log_probs, ref_log_probs, reward, *, coef, estimator, mask, offsets, lengths, padding_side,
                  prompt_lens, reward_placement, clamp_input, clamp_output, return_ref, detach, mask_nan=False,
                  out=None):
    """Validate everything and return ``(KLRewardProblem, OutputLayout)``."""
    if not isinstance(mask_nan, bool):
        raise TypeError(f"mask_nan must be a bool, got {type(mask_nan).__name__}")
    clamp_input, clamp_output = _check_options(estimator, reward_placement, padding_side, clamp_input,
                                               clamp_output, return_ref, detach)
    if isinstance(log_probs, (list, tuple)) != isinstance(ref_log_probs, (list, tuple)):
        raise TypeError("log_probs and ref_log_probs must use the same layout (both lists, both nested or both dense)")
    if isinstance(log_probs, torch.Tensor) and log_probs.is_nested:
        if not (isinstance(ref_log_probs, torch.Tensor) and ref_log_probs.is_nested):
            raise TypeError("ref_log_probs must be a nested tensor like log_probs")
    if not isinstance(log_probs, (list, tuple, torch.Tensor)):
        raise TypeError(f"log_probs must be a tensor, a nested tensor or a list of tensors, got {type(log_probs).__name__}")

    device = _checks.device_of(log_probs, reward=reward, mask=mask, prompt_lens=prompt_lens, coef=coef)
    device_free, device = device is None, device or torch.device("cpu")
    _checks.dense_layouts(log_probs=log_probs, ref_log_probs=ref_log_probs, reward=reward, mask=mask, offsets=offsets,
                          lengths=lengths, prompt_lens=prompt_lens, coef=coef)
    _same_device(device, ref_log_probs=ref_log_probs, mask=mask, offsets=offsets, lengths=lengths,
                 prompt_lens=prompt_lens, reward=reward, coef=coef)
    eager = not torch.compiler.is_compiling()
    # Lists may be read in place by an eager call that needs no gradient of them (checked with the
    # other per-sequence facts: ``in_place`` says whether gradients would be fine anyway).
    in_place = (detach or not torch.is_grad_enabled()) if eager and isinstance(log_probs, (list, tuple)) and \
        isinstance(ref_log_probs, (list, tuple)) else None
    kind, lp, ref, mask, offsets, lengths = _normalize_layout(log_probs, ref_log_probs, mask, offsets, lengths,
                                                              padding_side, in_place=in_place, empty_device=device)
    layout = "list" if isinstance(lp, ragged.SequenceList) else "padded" if kind == "padded" else "packed"
    batch = lp.shape[0] if layout == "padded" else offsets.shape[0] - 1
    width = lp.shape[1] if layout == "padded" else None
    if prompt_lens is not None:
        prompt_lens = _check_prompt_lens(prompt_lens, layout, offsets, lengths, width, batch, device)

    placement, trailing, reward_dtype = None, False, lp.dtype
    if reward is not None:
        host_lengths = [t.shape[0] for t in log_probs] if kind == "list" else None
        reward, placement, trailing = _classify_reward(reward, kind, lp.shape, batch, reward_placement, offsets, lp,
                                                       host_lengths)
        reward_dtype = _reward_dtype(reward, lp.dtype)
        if isinstance(reward, ragged.SequenceList):
            if reward.dtype != reward_dtype:
                reward = reward.pack().to(reward_dtype)  # the kernel also reads a packed reward
        else:
            # The reward is data, not a parameter: gradients flow to the log-probs only.
            reward = reward.detach().to(reward_dtype)

    if mask_nan:
        # The fused CPU forward masks NaN pads itself; for autograd, compilation or another device
        # the NaN test becomes part of the mask here, which every backend reads.
        graph = torch.is_grad_enabled() and not detach and (lp.requires_grad or ref.requires_grad)
        if not eager or graph or device.type != "cpu":
            mask, mask_nan = and_not_nan(mask, lp, ref), False

    if out is not None:
        graph = torch.is_grad_enabled() and not detach and (lp.requires_grad or ref.requires_grad)
        out = _check_out(out, kind, lp, ref, reward_dtype, trailing, batch, return_ref, graph,
                         [("log_probs", lp), ("ref_log_probs", ref), ("mask", mask), ("reward", reward),
                          ("offsets", offsets), ("lengths", lengths), ("prompt_lens", prompt_lens),
                          ("coef", coef)])

    problem = KLRewardProblem(
        layout=layout, log_probs=lp, ref_log_probs=ref, mask=mask, offsets=offsets if layout != "padded" else None,
        lengths=lengths, padding_side=padding_side, prompt_lens=prompt_lens, reward=reward, placement=placement,
        reward_dtype=reward_dtype, coef=_normalize_coef(coef, batch, device), estimator=estimator,
        clamp_input=clamp_input, clamp_output=clamp_output, return_ref=return_ref, mask_nan=mask_nan, out=out,
        device_free=device_free)
    host_lengths = tuple(t.shape[0] for t in log_probs) if kind == "list" else None
    return problem, OutputLayout(kind, offsets if kind not in ("packed", "padded") else None, lengths=host_lengths,
                                  reward_trailing=trailing)


# (its signature: inspect.signature follows __wrapped__; linear_loss.py reads it)
build_problem.__wrapped__ = _build_problem
