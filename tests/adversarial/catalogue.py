"""A generated catalogue of odd or wrong calls to ``kl_reward`` and ``kl_penalty_loss``.

Each :class:`Call` names one call (``op``, a base batch in one layout and dtype, and a mutation of
it) and what a correct library must do with it:

* ``expect="ok"``: return results that agree with the float64 torch reference (the inputs converted
  to float64, ``backend="torch"``) within the tolerance table; gradients too where the call has them;
* ``expect=("error", "name")``: raise ``ValueError`` or ``TypeError`` whose message names ``name``,
  before any kernel runs;
* ``expect=("unavailable", "word")``: raise ``BackendUnavailableError`` mentioning ``word``
  (documented: e.g. meta tensors, which hold no values, run on no backend).

In every case the inputs must be bit for bit unchanged afterwards. The catalogue is built the same
way in the test process and in the worker processes (``worker.py``), so a call crosses the process
boundary as its name only. Calls are deterministic: each seeds its own generator from its name.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Callable

import torch

LAYOUTS = ("packed", "padded-left", "padded-right", "list", "nested")
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}
LENGTHS = (0, 1, 5, 3)  # an empty and a one-token sequence in every base batch


@dataclass(frozen=True)
class Call:
    name: str
    op: str  # "kl_reward" or "kl_penalty_loss"
    build: Callable[[], dict]
    expect: object  # "ok" | ("error", arg) | ("unavailable", word)
    grad: bool = False  # also compare the gradient of log_probs


def _gen(name: str) -> torch.Generator:
    return torch.Generator().manual_seed(int(hashlib.sha256(name.encode()).hexdigest()[:12], 16))


# ---------------------------------------------------------------- base batches


def _tokens(g, lengths, dtype):
    return [(-3 * torch.rand(n, generator=g, dtype=torch.float64)).to(dtype) for n in lengths]


def _pad(seqs, side, fill, dtype):
    width = max((len(s) for s in seqs), default=0)
    rows = []
    for s in seqs:
        pad = torch.full((width - len(s),), fill, dtype=s.dtype)
        rows.append(torch.cat([pad, s]) if side == "left" else torch.cat([s, pad]))
    return torch.stack(rows) if rows else torch.zeros(0, 0, dtype=dtype)


def _layout(seqs, layout, dtype, fill=0.0):
    """Per-sequence tensors of `dtype` -> (value in `layout`, layout kwargs)."""
    lengths = [len(s) for s in seqs]
    if layout == "packed":
        offsets = torch.tensor([0, *torch.tensor(lengths, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int64)
        return torch.cat(seqs) if seqs else torch.zeros(0, dtype=dtype), {"offsets": offsets}
    if layout.startswith("padded"):
        side = layout.split("-")[1]
        return _pad(seqs, side, fill, dtype), {"lengths": torch.tensor(lengths, dtype=torch.int64), "padding_side": side}
    if layout == "list":
        return list(seqs), {}
    return torch.nested.nested_tensor(list(seqs), layout=torch.jagged), {}


def base_reward(name, layout, dtype, lengths=LENGTHS) -> dict:
    """A valid kl_reward call: per-token reward, a mask with holes, coef 0.1, k3."""
    g = _gen(name)
    lp, ref = _tokens(g, lengths, dtype), _tokens(g, lengths, dtype)
    rw = [torch.randn(n, generator=g, dtype=torch.float64).to(dtype) for n in lengths]
    mk = [torch.rand(n, generator=g) < 0.8 for n in lengths]
    kw = {}
    kw["log_probs"], geo = _layout(lp, layout, dtype)
    kw["ref_log_probs"], _ = _layout(ref, layout, dtype)
    kw["reward"], _ = _layout(rw, layout, dtype)
    kw["mask"], _ = _layout(mk, layout, torch.bool, fill=False)
    kw.update(geo, coef=0.1, estimator="k3")
    return kw


def base_loss(name, layout, dtype, lengths=LENGTHS) -> dict:
    """A valid kl_penalty_loss call: per-sequence advantages, a mask, PPO clip, k3 to a reference."""
    g = _gen(name)
    lp, old, ref = (_tokens(g, lengths, dtype) for _ in range(3))
    mk = [torch.rand(n, generator=g) < 0.8 for n in lengths]
    kw = {}
    kw["log_probs"], geo = _layout(lp, layout, dtype)
    kw["old_log_probs"], _ = _layout(old, layout, dtype)
    kw["ref_log_probs"], _ = _layout(ref, layout, dtype)
    kw["mask"], _ = _layout(mk, layout, torch.bool, fill=False)
    adv = torch.randn(len(lengths), generator=g, dtype=torch.float64).to(dtype)
    kw["advantages"] = adv.unsqueeze(1) if layout == "packed" else adv
    kw.update(geo, beta=0.05, estimator="k3", clip_epsilon=0.2)
    return kw


# ---------------------------------------------------------------- helpers for mutations


def _map_tokens(kw, key, fn):
    """Apply fn to the token tensor(s) of argument `key` in whatever layout it is."""
    v = kw[key]
    if isinstance(v, list):
        kw[key] = [fn(t) for t in v]
    elif isinstance(v, torch.Tensor) and v.is_nested:
        kw[key] = torch.nested.nested_tensor([fn(t) for t in v.unbind()], layout=torch.jagged)
    else:
        kw[key] = fn(v)
    return kw


def _first_counted(kw):
    """(sequence, position) of a token that counts in the base batch (sequence 2 has 5 tokens)."""
    return 2, 2


def _poke(kw, key, value):
    """Set one token of sequence 2 (position 2) of argument `key` to `value`, in any layout, and
    make sure it counts."""
    def set_in(t, pos):
        t = t.clone()
        t.reshape(-1)[pos] = value
        return t

    def seq_pos(layout_kw, v):
        if "offsets" in layout_kw:
            return int(layout_kw["offsets"][2]) + 2
        return None

    v = kw[key]
    if isinstance(v, list):
        v = list(v)
        v[2] = set_in(v[2], 2)
        kw[key] = v
    elif isinstance(v, torch.Tensor) and v.is_nested:
        parts = list(v.unbind())
        parts[2] = set_in(parts[2], 2)
        kw[key] = torch.nested.nested_tensor(parts, layout=torch.jagged)
    elif v.dim() == 1:
        kw[key] = set_in(v, seq_pos(kw, v))
    else:
        t = v.clone()
        width = t.shape[1]
        col = 2 if kw.get("padding_side") == "right" else width - 5 + 2
        t[2, col] = value
        kw[key] = t
    if kw.get("mask") is not None:
        m = kw["mask"]
        if isinstance(m, list):
            m = list(m)
            m[2] = m[2].clone()
            m[2][2] = True
        elif m.is_nested:
            parts = [p.clone() for p in m.unbind()]
            parts[2][2] = True
            m = torch.nested.nested_tensor(parts, layout=torch.jagged)
        elif m.dim() == 1:
            m = m.clone()
            m[int(kw["offsets"][2]) + 2] = True
        else:
            m = m.clone()
            width = m.shape[1]
            m[2, 2 if kw.get("padding_side") == "right" else width - 5 + 2] = True
        kw["mask"] = m
    return kw


class ShortIter(list):
    """A list whose iteration yields one item fewer than its len()."""

    def __iter__(self):
        return iter(list.__getitem__(self, slice(0, max(0, list.__len__(self) - 1))))


class LongLen(list):
    """A list whose len() claims one item more than it holds."""

    def __len__(self):
        return list.__len__(self) + 1


class LyingGetitem(list):
    """A list whose __getitem__ always returns its first item (iteration is honest)."""

    def __getitem__(self, i):
        return list.__getitem__(self, 0) if isinstance(i, int) else list.__getitem__(self, i)


class TaggedTuple(tuple):
    """An honest tuple subclass: must be read like a tuple."""


def _neg(t):
    """Same logical values, stored negated with torch's negative bit set."""
    return torch._neg_view(-t)


def _overlapping(t):
    """A view of `t`'s values through a storage whose rows overlap (stride 1 along a 2-D [B, T])."""
    if t.dim() != 2 or t.numel() == 0:
        return t
    batch, width = t.shape
    storage = torch.empty(batch + width - 1, dtype=t.dtype)
    storage[:width] = t[0]
    storage[width:] = t[1:, -1] if batch > 1 else storage[width:]
    return storage.as_strided((batch, width), (1, 1))


# ---------------------------------------------------------------- mutations
#
# (name, layouts it applies to or None for all, function kw -> kw, expectation, ops it applies to)

DENSE = ("packed", "padded-left", "padded-right")
PADDED = ("padded-left", "padded-right")
RAGGED = ("list", "nested")
BOTH = ("kl_reward", "kl_penalty_loss")
RW = ("kl_reward",)
LOSS = ("kl_penalty_loss",)


def _second(op):
    return "ref_log_probs" if op == "kl_reward" else "old_log_probs"


def _set(**values):
    def f(kw):
        kw.update(values)
        return kw
    return f


def _with(key, fn):
    def f(kw):
        kw[key] = fn(kw[key])
        return kw
    return f


def _offsets(fn):
    return _with("offsets", fn)


def _lengths(fn):
    return _with("lengths", fn)


def _drop(*keys):
    def f(kw):
        for k in keys:
            kw.pop(k, None)
        return kw
    return f


def _all_float(kw, fn):
    for key in ("log_probs", "ref_log_probs", "old_log_probs"):
        if key in kw:
            _map_tokens(kw, key, fn)
    return kw


def _container(kind):
    def f(kw):
        for key in ("log_probs", "ref_log_probs", "old_log_probs", "reward", "mask"):
            if isinstance(kw.get(key), list):
                kw[key] = kind(kw[key])
        return kw
    return f


def _mutations(op):
    s = _second(op)
    m = []
    add = m.append
    # ---- valid but odd: must give the reference's answers
    add(("plain", None, lambda kw: kw, "ok", BOTH))
    add(("nan-token", None, lambda kw: _poke(kw, "log_probs", math.nan), "ok", BOTH))
    add(("neg-inf-ref-token", None, lambda kw: _poke(kw, s, -math.inf), "ok", BOTH))
    add(("pos-inf-token", None, lambda kw: _poke(kw, "log_probs", math.inf), "ok", RW))
    add(("huge-token", None, lambda kw: _poke(kw, "log_probs", -1e4), "ok", BOTH))
    add(("no-mask", None, _drop("mask"), "ok", BOTH))
    add(("neg-bit-log-probs", DENSE, _with("log_probs", _neg), "ok", BOTH))
    add(("neg-bit-second", DENSE, _with(s, _neg), "ok", BOTH))
    add(("neg-bit-offsets", ("packed",), _offsets(_neg), "ok", BOTH))
    add(("neg-bit-lengths", PADDED, _lengths(_neg), "ok", BOTH))
    add(("int32-lengths", PADDED, _lengths(lambda t: t.to(torch.int32)), "ok", BOTH))
    add(("list-lengths", PADDED, _lengths(lambda t: t.tolist()), "ok", BOTH))
    add(("zero-stride-second", PADDED, _with(s, lambda t: t[:1].expand_as(t) if len(t) else t), "ok", BOTH))
    add(("overlapping-log-probs", PADDED, _with("log_probs", _overlapping), "ok", BOTH))
    add(("transposed-log-probs", PADDED, _with("log_probs", lambda t: t.t().contiguous().t()), "ok", BOTH))
    add(("strided-packed", ("packed",), _with("log_probs", lambda t: torch.stack([t, t], 1)[:, 0]), "ok", BOTH))
    add(("misaligned-packed", ("packed",),
         lambda kw: _with("log_probs", lambda t: torch.cat([t.new_zeros(1), t])[1:])(kw), "ok", BOTH))
    add(("tuple-container", RAGGED[:1], _container(tuple), "ok", BOTH))
    add(("tuple-subclass", RAGGED[:1], _container(TaggedTuple), "ok", BOTH))
    # kl_reward detaches by default (detach=True): its gradient case is "detach-false" below
    add(("lp-requires-grad", None, lambda kw: _map_tokens(kw, "log_probs", lambda t: t.requires_grad_()), "ok", RW))
    add(("lp-requires-grad", None, lambda kw: _map_tokens(kw, "log_probs", lambda t: t.requires_grad_()), "grad",
         LOSS))
    add(("second-requires-grad", None, lambda kw: _map_tokens(kw, s, lambda t: t.requires_grad_()), "ok", BOTH))
    add(("one-sequence", None, lambda kw: kw, "ok-lengths-5", BOTH))
    add(("all-empty", None, lambda kw: kw, "ok-lengths-000", BOTH))
    add(("empty-batch", DENSE + ("list",), lambda kw: kw, "ok-lengths-none", BOTH))
    # kl_reward options
    add(("estimator-k1+", None, _set(estimator="k1+"), "ok", RW))
    add(("estimator-abs", None, _set(estimator="abs"), "ok", RW))
    add(("clamps", None, _set(clamp_input=(-20, 20), clamp_output=(-10, 10)), "ok", RW))
    add(("clamp-one-sided", None, _set(clamp_input=(None, 0.5)), "ok", RW))
    add(("coef-zero", None, _set(coef=0.0), "ok", RW))
    add(("coef-tensor-0d", None, _set(coef=torch.tensor(0.3)), "ok", RW))
    add(("coef-per-seq", None, _set(coef=torch.tensor([0.1, 0.2, 0.3, 0.4])), "ok", RW))
    add(("coef-int-tensor", None, _set(coef=torch.tensor([1, 2, 3, 4])), "ok", RW))
    add(("no-reward", None, _drop("reward"), "ok", RW))
    add(("return-ref", None, _set(return_ref=True), "ok", RW))
    add(("mask-nan", None, _set(mask_nan=True), "ok", RW))
    add(("prompt-lens", DENSE, _set(prompt_lens=torch.tensor([0, 1, 2, 3])), "ok", RW))
    add(("seq-reward-last", DENSE, lambda kw: _set(reward=torch.tensor([1.0, -1.0, 2.0, 0.5]),
                                                     reward_placement="last")(kw), "ok", RW))
    add(("seq-reward-broadcast", PADDED, lambda kw: _set(reward=torch.tensor([[1.0], [-1.0], [2.0], [0.5]]))(kw),
         "ok", RW))
    add(("int-reward", DENSE, _with("reward", lambda t: (t * 4).to(torch.int64)), "ok", RW))
    add(("detach-false", None, lambda kw: _map_tokens(_set(detach=False)(kw), "log_probs",
                                                      lambda t: t.requires_grad_()), "grad", RW))
    # kl_penalty_loss options
    add(("no-clip", None, _set(clip_epsilon=None), "ok", LOSS))
    add(("clip-asym", None, _set(clip_epsilon=(0.2, 0.28)), "ok", LOSS))
    add(("kl-to-old", None, _drop("ref_log_probs"), "ok", LOSS))
    add(("beta-per-seq", None, _set(beta=torch.tensor([0.1, 0.2, 0.3, 0.4])), "ok", LOSS))
    for agg in ("seq-mean-token-mean", "seq-mean-token-sum", "sum"):
        add((f"agg-{agg}", None, _set(aggregation=agg), "ok", LOSS))
    add(("agg-norm", PADDED, _set(aggregation="seq-mean-token-sum-norm"), "ok", LOSS))
    add(("agg-none", None, _set(aggregation="none"), "ok", LOSS))
    add(("agg-token-sum-norm", PADDED, _set(aggregation="token-sum-norm"), "ok", LOSS))
    add(("split-terms", None, _set(aggregation="seq-mean-token-mean", kl_aggregation="token-mean",
                                   num_sequences="nonempty"), "ok", LOSS))
    add(("entropy", None, lambda kw: _set(entropy=_map_tokens({"e": kw["log_probs"]}, "e", lambda t: -t.detach())["e"],
                                          entropy_coef=0.01)(kw), "ok", LOSS))
    add(("global-tokens", None, _set(num_global_tokens=20), "ok", LOSS))
    add(("per-token-adv", DENSE, lambda kw: _set(advantages=_map_tokens({"a": kw["log_probs"]}, "a",
                                                                          lambda t: t.detach() * 0 + 0.5)["a"])(kw),
         "ok", LOSS))

    # ---- wrong: a ValueError/TypeError naming the argument
    for dt in ("int32", "int64", "bool", "complex64"):
        add((f"log-probs-{dt}", None, lambda kw, dt=dt: _map_tokens(kw, "log_probs",
                                                                     lambda t: t.to(getattr(torch, dt))),
             ("error", "log_probs"), BOTH))
    add(("second-int", DENSE, _with(s, lambda t: t.to(torch.int32)), ("error", s), BOTH))
    add(("second-longer", ("packed",), _with(s, lambda t: torch.cat([t, t[:1]])), ("error", s), BOTH))
    add(("second-wider", PADDED, _with(s, lambda t: torch.cat([t, t[:, :1]], 1)), ("error", s), BOTH))
    add(("second-missing-seq", ("list",), _with(s, lambda t: t[:-1]), ("error", s), BOTH))
    add(("second-other-lengths", ("list",), _with(s, lambda t: [t[0], t[1], t[2][:-1], t[3]]), ("error", s), BOTH))
    add(("second-dense-vs-list", ("list",), _with(s, lambda t: torch.cat(t)), ("error", s), BOTH))
    add(("log-probs-3d", PADDED, _with("log_probs", lambda t: t.unsqueeze(-1)), ("error", "log_probs"), BOTH))
    add(("log-probs-0d", ("packed",), _with("log_probs", lambda t: t.sum()), ("error", "log_probs"), BOTH))
    add(("log-probs-str", None, _set(log_probs="lp"), ("error", "log_probs"), BOTH))
    add(("list-of-non-tensors", ("list",), _with("log_probs", lambda t: [1.0] * len(t)), ("error", "log_probs"), BOTH))
    add(("list-2d-elements", ("list",), _with("log_probs", lambda t: [x.unsqueeze(1) for x in t]),
         ("error", "log_probs"), BOTH))
    add(("list-0d-element", ("list",), _with("log_probs", lambda t: [t[0], t[1], t[2][0], t[3]]),
         ("error", "log_probs"), BOTH))
    add(("list-mixed-dtypes", ("list",), _with("log_probs", lambda t: [t[0], t[1].double(), t[2], t[3]]),
         ("error", "log_probs"), BOTH))
    add(("short-iter-list", ("list",), _container(ShortIter), ("error", "log_probs"), BOTH))
    add(("long-len-list", ("list",), _container(LongLen), ("error", "log_probs"), BOTH))
    add(("lying-getitem-list", ("list",), _container(LyingGetitem), "ok", BOTH))  # read through iteration
    add(("sparse-log-probs", DENSE, _with("log_probs", lambda t: t.to_sparse()), ("error", "log_probs"), BOTH))
    add(("sparse-mask", DENSE, _with("mask", lambda t: t.to_sparse()), ("error", "mask"), BOTH))
    add(("meta-log-probs", DENSE, lambda kw: {k: (v.to("meta") if isinstance(v, torch.Tensor) else v)
                                                for k, v in kw.items()}, ("unavailable", "meta"), BOTH))
    add(("mask-float", None, lambda kw: _map_tokens(kw, "mask", lambda t: t.float()), ("error", "mask"), BOTH))
    add(("mask-shorter", ("packed",), _with("mask", lambda t: t[:-1]), ("error", "mask"), BOTH))
    add(("mask-wider", PADDED, _with("mask", lambda t: torch.cat([t, t[:, :1]], 1)), ("error", "mask"), BOTH))
    add(("mask-list-vs-dense", ("list",), _with("mask", lambda t: torch.cat(t)), ("error", "mask"), BOTH))
    # offsets of every wrong kind
    add(("offsets-int32", ("packed",), _offsets(lambda t: t.to(torch.int32)), "ok", BOTH))  # cu_seqlens as int32
    add(("offsets-int16", ("packed",), _offsets(lambda t: t.to(torch.int16)), ("error", "offsets"), BOTH))
    add(("offsets-float", ("packed",), _offsets(lambda t: t.double()), ("error", "offsets"), BOTH))
    add(("offsets-list", ("packed",), _offsets(lambda t: t.tolist()), ("error", "offsets"), BOTH))
    add(("offsets-2d", ("packed",), _offsets(lambda t: t.unsqueeze(0)), ("error", "offsets"), BOTH))
    add(("offsets-empty", ("packed",), _offsets(lambda t: t[:0]), ("error", "offsets"), BOTH))
    add(("offsets-start-1", ("packed",), _offsets(lambda t: t + 1), ("error", "offsets"), BOTH))
    add(("offsets-end-short", ("packed",), _offsets(lambda t: torch.cat([t[:-1], t[-1:] - 1])), ("error", "offsets"),
         BOTH))
    add(("offsets-end-long", ("packed",), _offsets(lambda t: torch.cat([t[:-1], t[-1:] + 1])), ("error", "offsets"),
         BOTH))
    add(("offsets-decreasing", ("packed",), _offsets(lambda t: torch.tensor([0, 6, 1, 9], dtype=torch.int64)[:0]
                                                      if False else torch.tensor([0, 3, 1, 6, 9])),
         ("error", "offsets"), BOTH))
    add(("offsets-huge", ("packed",), _offsets(lambda t: torch.tensor([0, 2 ** 62, 0, 0, 9])), ("error", "offsets"),
         BOTH))
    add(("offsets-negative", ("packed",), _offsets(lambda t: torch.tensor([0, -5, 3, 6, 9])), ("error", "offsets"),
         BOTH))
    add(("offsets-neg-bit-invalid", ("packed",), _offsets(lambda t: _neg(-t)), ("error", "offsets"), BOTH))
    add(("offsets-with-padded", PADDED, _set(offsets=torch.tensor([0, 9])), ("error", "offsets"), BOTH))
    add(("offsets-with-list", RAGGED, _set(offsets=torch.tensor([0, 9])), ("error", "offsets"), BOTH))
    add(("offsets-missing", ("packed",), _drop("offsets"), ("error", "offsets"), BOTH))
    # lengths of every wrong kind
    add(("lengths-too-long", PADDED, _lengths(lambda t: t + 1), ("error", "lengths"), BOTH))
    add(("lengths-negative", PADDED, _lengths(lambda t: t - 1), ("error", "lengths"), BOTH))
    add(("lengths-huge", PADDED, _lengths(lambda t: t + 2 ** 62), ("error", "lengths"), BOTH))
    add(("lengths-float", PADDED, _lengths(lambda t: t.float()), ("error", "lengths"), BOTH))
    add(("lengths-bool", PADDED, _lengths(lambda t: t > 0), ("error", "lengths"), BOTH))
    add(("lengths-short", PADDED, _lengths(lambda t: t[:-1]), ("error", "lengths"), BOTH))
    add(("lengths-2d", PADDED, _lengths(lambda t: t.unsqueeze(0)), ("error", "lengths"), BOTH))
    add(("lengths-neg-bit-invalid", PADDED, _lengths(lambda t: _neg(-t - 1)), ("error", "lengths"), BOTH))
    add(("lengths-with-packed", ("packed",), _set(lengths=torch.tensor([9])), ("error", "lengths"), BOTH))
    add(("lengths-with-list", RAGGED, _set(lengths=torch.tensor([0, 1, 5, 3])), ("error", "lengths"), BOTH))
    add(("padding-side", PADDED, _set(padding_side="center"), ("error", "padding_side"), BOTH))
    add(("estimator-name", None, _set(estimator="k4"), ("error", "estimator"), BOTH))
    add(("estimator-none", None, _set(estimator=None), ("error", "estimator"), BOTH))
    add(("backend-name", None, _set(backend="gpu"), ("error", "backend"), BOTH))
    # kl_reward's scalars and options
    for c in (math.nan, math.inf, -math.inf, 2.0 ** 200):
        add((f"coef-{c}", None, _set(coef=c), ("error", "coef"), RW))
    add(("coef-nan-tensor", None, _set(coef=torch.tensor([0.1, math.nan, 0.1, 0.1])), ("error", "coef"), RW))
    add(("coef-str", None, _set(coef="0.1"), ("error", "coef"), RW))
    add(("coef-bool", None, _set(coef=True), ("error", "coef"), RW))
    add(("coef-wrong-b", None, _set(coef=torch.tensor([0.1, 0.2])), ("error", "coef"), RW))
    add(("coef-complex", None, _set(coef=torch.tensor(1j)), ("error", "coef"), RW))
    add(("clamp-reversed", None, _set(clamp_input=(5, -5)), ("error", "clamp_input"), RW))
    add(("clamp-nan", None, _set(clamp_output=(math.nan, 1)), ("error", "clamp_output"), RW))
    add(("clamp-triple", None, _set(clamp_input=(1, 2, 3)), ("error", "clamp_input"), RW))
    add(("placement-name", None, _set(reward_placement="first"), ("error", "reward_placement"), RW))
    add(("placement-token-with-seq-reward", DENSE, _set(reward=torch.ones(4), reward_placement="token"),
         ("error", "reward_placement"), RW))
    add(("reward-shape", DENSE, _set(reward=torch.ones(7)), ("error", "reward"), RW))
    add(("reward-complex", DENSE, _with("reward", lambda t: t.to(torch.complex64)), ("error", "reward"), RW))
    add(("reward-list-vs-dense", DENSE, _with("reward", lambda t: [t]), ("error", "reward"), RW))
    add(("return-ref-int", None, _set(return_ref=1), ("error", "return_ref"), RW))
    add(("detach-str", None, _set(detach="no"), ("error", "detach"), RW))
    add(("mask-nan-int", None, _set(mask_nan=1), ("error", "mask_nan"), RW))
    add(("prompt-lens-negative", DENSE, _set(prompt_lens=torch.tensor([0, -1, 0, 0])), ("error", "prompt_lens"), RW))
    add(("prompt-lens-float", DENSE, _set(prompt_lens=torch.tensor([0.0, 1.0, 0.0, 0.0])), ("error", "prompt_lens"), RW))
    add(("prompt-lens-short", DENSE, _set(prompt_lens=torch.tensor([0, 1])), ("error", "prompt_lens"), RW))
    # kl_penalty_loss's scalars and options
    for b in (math.nan, math.inf, 2.0 ** 200):
        add((f"beta-{b}", None, _set(beta=b), ("error", "beta"), LOSS))
    add(("beta-nan-tensor", None, _set(beta=torch.tensor([0.1, math.nan, 0.1, 0.1])), ("error", "beta"), LOSS))
    add(("beta-int-tensor", None, _set(beta=torch.tensor([1, 2, 3, 4])), ("error", "beta"), LOSS))
    add(("clip-negative", None, _set(clip_epsilon=-0.1), ("error", "clip_epsilon"), LOSS))
    add(("clip-nan", None, _set(clip_epsilon=math.nan), ("error", "clip_epsilon"), LOSS))
    add(("clip-triple", None, _set(clip_epsilon=(0.1, 0.2, 0.3)), ("error", "clip_epsilon"), LOSS))
    add(("entropy-coef-inf", None, _set(entropy_coef=math.inf), ("error", "entropy_coef"), LOSS))
    add(("aggregation-name", None, _set(aggregation="mean"), ("error", "aggregation"), LOSS))
    add(("advantages-shape", DENSE, _set(advantages=torch.ones(7)), ("error", "advantages"), LOSS))
    add(("advantages-str", None, _set(advantages="a"), ("error", "advantages"), LOSS))
    add(("global-tokens-negative", None, _set(num_global_tokens=-1), ("error", "num_global_tokens"), LOSS))
    add(("global-tokens-float", None, _set(num_global_tokens=2.5), ("error", "num_global_tokens"), LOSS))
    add(("process-group-str", None, _set(process_group="world"), ("error", "process_group"), LOSS))
    add(("entropy-shape", DENSE, _set(entropy=torch.ones(7)), ("error", "entropy"), LOSS))
    add(("num-sequences-str", None, _set(aggregation="seq-mean-token-sum", num_sequences="all"),
         ("error", "num_sequences"), LOSS))
    add(("kl-aggregation-none", None, _set(kl_aggregation="none"), ("error", "kl_aggregation"), LOSS))
    add(("norm-length-packed", ("packed",), _set(aggregation="seq-mean-token-sum-norm"), ("error", "norm_length"),
         LOSS))
    return m


_LENGTH_VARIANTS = {"ok-lengths-5": (5,), "ok-lengths-000": (0, 0, 0), "ok-lengths-none": ()}


def _fix_per_sequence(kw, batch):
    """Per-sequence arguments of the base (B = 4) resized for a variant with another B."""
    for key in ("coef", "beta", "prompt_lens"):
        v = kw.get(key)
        if isinstance(v, torch.Tensor) and v.dim() == 1 and v.shape[0] == 4:
            kw[key] = v[:batch]
    adv = kw.get("advantages")
    if isinstance(adv, torch.Tensor) and not adv.is_nested and adv.shape[0] == 4 and adv.dim() <= 2 and \
            (adv.dim() == 1 or adv.shape[1] == 1):
        kw["advantages"] = adv[:batch]
    return kw


def build_catalogue() -> dict[str, Call]:
    calls = {}
    for op in BOTH:
        base = base_reward if op == "kl_reward" else base_loss
        for mname, layouts, fn, expect, ops in _mutations(op):
            if op not in ops:
                continue
            for layout in (layouts or LAYOUTS):
                # The valid calls run in every dtype; the wrong ones in float32 and bfloat16.
                dtypes = DTYPES if (expect in ("ok", "grad") or str(expect).startswith("ok")) else ("f32", "bf16")
                for dname in dtypes:
                    name = f"{op}/{mname}/{layout}/{dname}"
                    lengths = _LENGTH_VARIANTS.get(expect, LENGTHS) if isinstance(expect, str) else LENGTHS

                    def build(base=base, name=name, layout=layout, dname=dname, fn=fn, lengths=lengths):
                        kw = base(name, layout, DTYPES[dname], lengths)
                        if lengths != LENGTHS:
                            kw = _fix_per_sequence(kw, len(lengths))
                        return fn(kw)

                    final = "ok" if isinstance(expect, str) and expect.startswith("ok") else expect
                    calls[name] = Call(name, op, build, "ok" if final == "grad" else final, grad=final == "grad")
    return calls
