"""Test harness: one layout-free description of a batch, built into every input layout.

A :class:`Case` holds the *valid* tokens of each sequence (already in the input dtypes), the
options of the call and the rewards. :func:`build` turns it into ``kl_reward`` arguments for a
layout, with padding poisoned (NaN log-probs, random mask bits, a sentinel reward) so that
reading padding, or leaving an output unwritten, shows up. :func:`check` runs the call and
compares every output with the float64 oracle, per sequence, per token, under the dtype's
tolerance, plus the exact padding values.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from kl_kernels import kl_reward
from oracle import oracle_sequence
from tolerances import assert_close_to_oracle, assert_sum_close

LAYOUTS = ("packed", "padded_left", "padded_right", "padded_mask_only", "list", "nested_jagged", "nested_strided")
PAD_REWARD = 7.0  # sentinel in the padding of per-token rewards: must come back untouched


@dataclass
class Case:
    lp: list                    # per sequence: 1-D tensor of valid tokens (input dtype)
    ref: list
    mask: list | None = None    # per sequence: 1-D bool
    prompt_lens: list | None = None
    estimator: str = "k1"
    clamp_input: tuple | None = None
    clamp_output: tuple | None = None
    coef_kind: str = "float"    # "float", "scalar_tensor", "per_seq"
    coef: list | float = 1.0    # float, or per-sequence list for "per_seq"
    reward_kind: str | None = None  # None, "token", "token1" (trailing 1), "B", "B1", "B11"
    placement: str | None = None    # "token", "sequence", "last", "last_valid" (explicit) or "auto"
    reward_tok: list | None = None  # per sequence 1-D tensors (reward dtype)
    reward_seq: torch.Tensor | None = None  # [B] (reward dtype)
    left_pad_extra: int = 0     # extra padding columns beyond the longest row

    @property
    def batch(self) -> int:
        return len(self.lp)

    @property
    def lengths(self) -> list:
        return [t.shape[0] for t in self.lp]

    @property
    def dtype(self):
        return self.lp[0].dtype if self.lp else torch.float32

    def coef_arg(self, device="cpu"):
        if self.coef_kind == "float":
            return float(self.coef)
        if self.coef_kind == "scalar_tensor":
            return torch.tensor(float(self.coef), device=device)
        return torch.tensor(self.coef, dtype=torch.float32, device=device)

    def coef_of(self, b):
        """The coefficient as the op sees it (tensor coefs are float32 here, so rounded)."""
        if self.coef_kind == "float":
            return float(self.coef)
        return float(self.coef_arg()[b] if self.coef_kind == "per_seq" else self.coef_arg())

    def resolved_placement(self):
        if self.reward_kind is None:
            return None
        if self.reward_kind in ("token", "token1"):
            return "token"
        return self.placement if self.placement in ("sequence", "last", "last_valid") else "sequence"

    def full_rows(self, width: int, side: str) -> "Case":
        """The same batch seen as full rows of ``width`` tokens, padding masked out (mask-only layout)."""
        def grow(t, fill, pad):
            filler = torch.full((pad,), fill, dtype=t.dtype)
            return torch.cat([filler, t] if side == "left" else [t, filler])
        pads = [width - n for n in self.lengths]
        mask = self.mask if self.mask is not None else [torch.ones(n, dtype=torch.bool) for n in self.lengths]
        return replace(
            self,
            lp=[grow(t, float("nan"), p) for t, p in zip(self.lp, pads)],
            ref=[grow(t, float("nan"), p) for t, p in zip(self.ref, pads)],
            mask=[grow(t, False, p) for t, p in zip(mask, pads)],
            prompt_lens=None if self.prompt_lens is None else [
                pl + (p if side == "left" else 0) for pl, p in zip(self.prompt_lens, pads)],
            reward_tok=None if self.reward_tok is None else [grow(t, PAD_REWARD, p) for t, p in zip(self.reward_tok, pads)],
        )


def expected(case: Case):
    placement = case.resolved_placement()
    out = []
    for b in range(case.batch):
        reward = None
        if placement == "token":
            reward = case.reward_tok[b].double().tolist()
        elif placement in ("sequence", "last", "last_valid"):
            reward = float(case.reward_seq[b])
        out.append(oracle_sequence(
            case.lp[b].double().tolist(), case.ref[b].double().tolist(), estimator=case.estimator,
            mask=None if case.mask is None else case.mask[b].tolist(),
            prompt_len=0 if case.prompt_lens is None else case.prompt_lens[b],
            clamp_input=case.clamp_input, clamp_output=case.clamp_output, coef=case.coef_of(b),
            placement=placement, reward=reward))
    return out


# --------------------------------------------------------------------------- building layouts


def _pad(seqs, width, side, fill, dtype):
    out = torch.full((len(seqs), width), fill, dtype=dtype)
    for b, t in enumerate(seqs):
        n = t.shape[0]
        if n:
            if side == "left":
                out[b, width - n:] = t
            else:
                out[b, :n] = t
    return out


def _random_bits(shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(shape, generator=g) < 0.5


class EmptyNestedUnsupported(Exception):
    """The case cannot be expressed in this layout by torch itself (not a kl_kernels limit)."""


@dataclass
class Built:
    kwargs: dict
    layout: str
    width: int | None = None
    side: str | None = None
    case: Case | None = None  # the case the oracle must see (full rows for the mask-only layout)


def build(case: Case, layout: str) -> Built:
    """kl_reward keyword arguments for ``case`` in ``layout`` (padding poisoned)."""
    seq_reward_shapes = {"B": (case.batch,), "B1": (case.batch, 1), "B11": (case.batch, 1, 1)}
    kw = dict(estimator=case.estimator, clamp_input=case.clamp_input, clamp_output=case.clamp_output,
              coef=case.coef_arg(), return_ref=True)
    if case.placement is not None:
        kw["reward_placement"] = case.placement
    if case.prompt_lens is not None:
        kw["prompt_lens"] = torch.tensor(case.prompt_lens, dtype=torch.int64)
    lengths = torch.tensor(case.lengths, dtype=torch.int64)
    offsets = torch.zeros(case.batch + 1, dtype=torch.int64)
    offsets[1:] = lengths.cumsum(0)
    ref_dtype = case.ref[0].dtype if case.ref else case.dtype

    if layout.startswith("padded"):
        side = "right" if layout == "padded_right" else "left"
        width = max(case.lengths, default=0) + case.left_pad_extra
        oracle_case = case
        if layout == "padded_mask_only":
            oracle_case = case.full_rows(width, side)
        kw["log_probs"] = _pad(case.lp, width, side, float("nan"), case.dtype)
        kw["ref_log_probs"] = _pad(case.ref, width, side, float("nan"), ref_dtype)
        kw["padding_side"] = side
        if layout == "padded_mask_only":
            kw["mask"] = _pad(oracle_case.mask, width, side, False, torch.bool)
            if case.prompt_lens is not None:
                kw["prompt_lens"] = torch.tensor(oracle_case.prompt_lens, dtype=torch.int64)
        else:
            kw["lengths"] = lengths
            if case.mask is not None:
                bits = _random_bits((case.batch, width))  # padding mask bits are garbage: must be ignored
                m = _pad(case.mask, width, side, False, torch.bool)
                valid = _pad([torch.ones(n, dtype=torch.bool) for n in case.lengths], width, side, False, torch.bool)
                kw["mask"] = torch.where(valid, m, bits)
        if case.reward_kind in ("token", "token1"):
            r = _pad(case.reward_tok, width, side, PAD_REWARD, case.reward_tok[0].dtype if case.reward_tok else case.dtype)
            kw["reward"] = r.unsqueeze(-1) if case.reward_kind == "token1" else r
        elif case.reward_kind is not None:
            kw["reward"] = case.reward_seq.reshape(seq_reward_shapes[case.reward_kind])
        return Built(kw, layout, width, side, oracle_case)

    if layout == "packed":
        kw["log_probs"] = torch.cat(case.lp) if case.batch else torch.zeros(0, dtype=case.dtype)
        kw["ref_log_probs"] = torch.cat(case.ref) if case.batch else torch.zeros(0, dtype=ref_dtype)
        kw["offsets"] = offsets
        if case.mask is not None:
            kw["mask"] = torch.cat(case.mask) if case.batch else torch.zeros(0, dtype=torch.bool)
        tok = (lambda seqs: torch.cat(seqs)) if case.batch else (lambda seqs: torch.zeros(0))
    elif layout == "list":
        kw["log_probs"], kw["ref_log_probs"] = list(case.lp), list(case.ref)
        if case.mask is not None:
            kw["mask"] = list(case.mask)
        tok = list
    elif layout in ("nested_jagged", "nested_strided"):
        lay = torch.jagged if layout == "nested_jagged" else torch.strided

        def nest(seqs, dtype=case.dtype):
            if not seqs:  # torch cannot build an empty nested tensor from an empty list
                if lay == torch.strided:
                    raise EmptyNestedUnsupported("torch cannot build an empty strided nested tensor")
                return torch.nested.nested_tensor_from_jagged(torch.zeros(0, dtype=dtype), torch.zeros(1, dtype=torch.int64))
            return torch.nested.nested_tensor(list(seqs), layout=lay)
        kw["log_probs"], kw["ref_log_probs"] = nest(case.lp), nest(case.ref)
        if case.mask is not None:
            kw["mask"] = nest(case.mask, torch.bool)
        tok = nest
    else:
        raise AssertionError(layout)
    if case.reward_kind == "token":
        kw["reward"] = tok(case.reward_tok)
    elif case.reward_kind == "token1":
        if layout == "packed":
            kw["reward"] = torch.cat(case.reward_tok).unsqueeze(-1) if case.batch else torch.zeros(0, 1)
        else:
            kw["reward"] = tok([t.unsqueeze(-1) for t in case.reward_tok])
    elif case.reward_kind is not None:
        kw["reward"] = case.reward_seq.reshape(seq_reward_shapes[case.reward_kind])
    return Built(kw, layout, case=case)


# --------------------------------------------------------------------------- reading results


def _per_sequence(x, built: Built, lengths, trailing=False):
    """Split an output in ``built.layout`` into per-sequence valid-token tensors (+ padding values)."""
    layout = built.layout
    if layout == "packed":
        assert x.dim() == 1 + trailing, x.shape
        return list(x.split(lengths)), []
    if layout.startswith("padded"):
        assert x.shape[:2] == (len(lengths), built.width) and x.dim() == 2 + trailing, x.shape
        if layout == "padded_mask_only":
            return list(x.unbind(0)), []
        rows, pads = [], []
        for b, n in enumerate(lengths):
            if built.side == "left":
                rows.append(x[b, built.width - n:])
                pads.append((b, x[b, : built.width - n]))
            else:
                rows.append(x[b, :n])
                pads.append((b, x[b, n:]))
        return rows, pads
    if layout == "list":
        assert isinstance(x, list) and len(x) == len(lengths)
        return x, []
    assert x.is_nested and x.layout == (torch.jagged if layout == "nested_jagged" else torch.strided)
    return list(x.unbind()), []


def snapshot(kwargs):
    """Deep copies of every tensor argument, with their version counters, to prove none is modified."""
    def flat(v):
        if isinstance(v, torch.Tensor):
            return [v]
        if isinstance(v, (list, tuple)):
            return [t for t in v if isinstance(t, torch.Tensor)]
        return []
    return [(name, t, t.clone(), t._version) for name, v in kwargs.items() for t in flat(v)]


def assert_unmodified(snap):
    for name, t, copy, version in snap:
        assert t._version == version, f"{name} was modified in place"
        if t.is_nested:
            for a, b in zip(t.unbind(), copy.unbind()):
                torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
        else:
            torch.testing.assert_close(t, copy, rtol=0, atol=0, equal_nan=True, msg=f"{name} changed")


def backend_accepts(case: Case, backend: str) -> bool:
    """Whether ``backend`` declares support for this case (the fused kernels: one log-prob dtype,
    no float64); cases it declines are checked to be declined, not run."""
    if backend == "torch":
        return True
    dtypes = {case.dtype, case.ref[0].dtype if case.ref else case.dtype}
    if case.reward_tok:
        dtypes.add(torch.promote_types(case.reward_tok[0].dtype, case.dtype))
    if case.reward_seq is not None:
        dtypes.add(torch.promote_types(case.reward_seq.dtype, case.dtype))
    return len({case.dtype, case.ref[0].dtype if case.ref else case.dtype}) == 1 and torch.float64 not in dtypes


def poison_allocator(*numels, device="cpu"):
    """Allocate, NaN-fill and free buffers of the outputs' sizes just before a call, so an output
    a backend allocates but never writes tends to come back as NaN rather than as zeros."""
    for n in numels:
        for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
            torch.full((max(n, 1),), float("nan"), dtype=dtype, device=device)


def to_device(x, device):
    """A tensor, list of tensors, nested tensor or dict of them on ``device`` (others unchanged)."""
    if isinstance(x, dict):
        return {k: to_device(v, device) for k, v in x.items()}
    if isinstance(x, (list, tuple)) and not hasattr(x, "_fields"):
        return type(x)(to_device(v, device) for v in x)
    if hasattr(x, "_fields"):  # a named tuple of outputs
        return type(x)(*(to_device(v, device) for v in x))
    if isinstance(x, torch.Tensor):
        return x.to(device)
    return x


def check(case: Case, layout: str, device="cpu", **call_kwargs):
    """Run kl_reward on ``case`` in ``layout`` (inputs on ``device``) and compare everything with the oracle."""
    built = build(case, layout)
    built.kwargs = to_device(built.kwargs, device)
    snap = snapshot(built.kwargs)
    width = built.width or 0
    poison_allocator(sum(case.lengths), case.batch * width, case.batch, device=device)
    out = to_device(kl_reward(**built.kwargs, **call_kwargs), "cpu")
    assert_unmodified(snap)
    oracle_case = built.case
    exp = expected(oracle_case)
    lengths = oracle_case.lengths
    trailing = case.reward_kind in ("token1", "B11")
    out_dtype = case.dtype
    reward_dtype = out_dtype
    if case.reward_kind is not None:
        given = case.reward_tok[0].dtype if case.reward_kind in ("token", "token1") and case.reward_tok else (
            case.reward_seq.dtype if case.reward_seq is not None else out_dtype)
        reward_dtype = torch.promote_types(given, out_dtype)
    ref_dtype = case.ref[0].dtype if case.ref else out_dtype
    math_dtype = torch.float64 if torch.float64 in (out_dtype, ref_dtype) else torch.float32

    kl_rows, kl_pads = _per_sequence(out.kl, built, lengths)
    rw_rows, rw_pads = _per_sequence(out.reward, built, lengths, trailing=trailing)
    ref_rows, ref_pads = _per_sequence(out.ref_log_probs, built, lengths)
    assert out.kl_sum.shape == (case.batch,) and out.kl_sum.dtype == math_dtype
    assert out.count.shape == (case.batch,) and out.count.dtype == torch.int64
    for b, e in enumerate(exp):
        assert kl_rows[b].dtype == out_dtype and rw_rows[b].dtype == reward_dtype and ref_rows[b].dtype == ref_dtype
        rw = rw_rows[b].squeeze(-1) if trailing else rw_rows[b]
        if trailing:
            assert rw_rows[b].shape[-1] == 1
        assert_close_to_oracle(kl_rows[b], e.kl, f"kl[{b}]")
        assert_close_to_oracle(rw, e.reward, f"reward[{b}]")
        assert_close_to_oracle(ref_rows[b], e.ref_out, f"ref_log_probs[{b}]")
        # Not counted -> exactly zero (not just close), whatever the input held there.
        not_counted = torch.tensor([not c for c in e.counted], dtype=torch.bool)
        assert (kl_rows[b][not_counted] == 0).all() and (ref_rows[b][not_counted] == 0).all()
        assert int(out.count[b]) == e.count
        assert_sum_close(out.kl_sum[b], e.kl_sum, e.kl, math_dtype, f"kl_sum[{b}]")
    placement = case.resolved_placement()
    for (b, pad_kl), (_, pad_rw), (_, pad_ref) in zip(kl_pads, rw_pads, ref_pads):
        assert (pad_kl == 0).all() and (pad_ref == 0).all(), f"padding of row {b} not zero"
        pad_rw = pad_rw.squeeze(-1) if trailing else pad_rw
        want = {"token": PAD_REWARD, "sequence": float(case.reward_seq[b]) if case.reward_seq is not None else 0.0}
        target = torch.tensor(want.get(placement, 0.0), dtype=torch.float64).to(reward_dtype)
        assert (pad_rw == target).all(), f"reward padding of row {b}: {pad_rw} != {target}"
    return out, built, exp
