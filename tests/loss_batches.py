"""Test harness of kl_penalty_loss: one layout-free batch, built into every input layout.

A :class:`LossCase` holds each sequence's *valid* tokens (input dtypes) and the call's options.
:func:`build` turns it into ``kl_penalty_loss`` arguments for a layout, with poisoned padding
(NaN log-probs, advantages and entropy, garbage mask bits) so that reading padding shows up, and
:func:`check_loss` runs the call and compares the loss, its parts, the diagnostics and the
gradients with the float64 oracle.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from hypothesis import strategies as st

from batches import _pad
from kl_kernels import kl_penalty_loss
from oracle_kl_penalty import Seq, oracle_loss, oracle_weights
from tolerances import TOLERANCES

LOSS_LAYOUTS = ("packed", "padded_left", "padded_right", "list", "nested_jagged")
AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm", "token-sum-norm",
                "sum", "none")
NORM_AGGREGATIONS = ("seq-mean-token-sum-norm", "token-sum-norm")


@dataclass
class LossCase:
    lp: list
    old: list
    adv: list                 # per sequence: 1-D per token, or a float (per-sequence advantage)
    mask: list | None = None
    ref: list | None = None
    ent: list | None = None
    beta_kind: str = "float"  # "float", "scalar_tensor", "per_seq"
    beta: list | float = 0.1
    estimator: str = "k1"
    clip: float | tuple | None = None
    entropy_coef: float = 0.0
    aggregation: str = "token-mean"
    pad_extra: int = 0
    dual_clip: float | None = None
    weights: list | None = None  # per sequence, per token
    weight_kl: bool = False
    clamp_input: tuple | None = None
    clamp_output: tuple | None = None
    importance_sampling_level: str = "token"
    kl_times_ratio: bool = False
    objective: str = "ppo"                  # "ppo", "cispo" (with ratio_cap) or "sapo" (with sapo_temperatures)
    ratio_cap: float | None = None
    sapo_temperatures: tuple = (1.0, 1.05)
    kl_aggregation: str | None = None       # None: as aggregation
    entropy_aggregation: str | None = None
    num_sequences: object = None            # None, "nonempty" or an int

    @property
    def aggregations(self):
        return (self.aggregation, self.kl_aggregation or self.aggregation,
                self.entropy_aggregation or self.aggregation)

    @property
    def normed(self):
        """Whether a term divides by norm_length."""
        return any(a in NORM_AGGREGATIONS for a in self.aggregations)

    @property
    def batch(self):
        return len(self.lp)

    @property
    def lengths(self):
        return [t.shape[0] for t in self.lp]

    @property
    def dtype(self):
        return self.lp[0].dtype if self.lp else torch.float32

    @property
    def adv_per_seq(self):
        return bool(self.adv) and not isinstance(self.adv[0], torch.Tensor)

    def beta_arg(self, device="cpu"):
        if self.beta_kind == "float":
            return float(self.beta)
        if self.beta_kind == "scalar_tensor":
            return torch.tensor(float(self.beta), device=device)
        return torch.tensor(self.beta, dtype=torch.float32, device=device)

    def beta_of(self, b):
        if self.beta_kind == "float":
            return float(self.beta)
        return float(self.beta_arg()[b] if self.beta_kind == "per_seq" else self.beta_arg())

    def clip_bounds(self):
        if self.clip is None:
            return None
        lo, hi = self.clip if isinstance(self.clip, tuple) else (self.clip, self.clip)
        return 1.0 - lo, 1.0 + hi


@st.composite
def loss_cases(draw, dtypes=(torch.float32, torch.bfloat16, torch.float16, torch.float64), max_batch=6,
               aggregations=AGGREGATIONS, split=False):
    """Random loss cases. ``split``: also draw the KL and entropy terms' own aggregations and
    ``num_sequences`` (every aggregation then but ``"none"``)."""
    lengths = draw(st.lists(st.one_of(st.sampled_from([0, 1, 2, 3, 7, 13, 31]), st.integers(0, 40)),
                            min_size=0, max_size=max_batch))
    dtype = draw(st.sampled_from(list(dtypes)))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    scale = draw(st.sampled_from([1e-3, 0.1, 0.5, 3.0]))
    lp, old, ref, ent, adv, mask, wts = [], [], [], [], [], [], []
    adv_seq = draw(st.booleans())
    for n in lengths:
        a = -torch.rand(n, generator=g, dtype=torch.float64) * 8
        lp.append(a.to(dtype))
        o = a + torch.randn(n, generator=g, dtype=torch.float64) * scale
        o = torch.where(torch.rand(n, generator=g) < 0.1, a, o)  # ratio exactly 1
        old.append(o.to(dtype))
        ref.append((a + torch.randn(n, generator=g, dtype=torch.float64) * scale).to(dtype))
        ent.append((torch.rand(n, generator=g, dtype=torch.float64) * 2).to(dtype))
        wts.append((torch.rand(n, generator=g, dtype=torch.float64) * 2).to(dtype))
        adv.append(float(torch.randn((), generator=g).to(dtype)) if adv_seq else torch.randn(n, generator=g, dtype=torch.float64).to(dtype))
        mask.append(torch.rand(n, generator=g) < draw(st.sampled_from([0.5, 0.9, 1.0])))
    beta_kind = draw(st.sampled_from(["float", "scalar_tensor", "per_seq"]))
    beta = [float(x) for x in torch.rand(len(lengths), generator=g) * 2] if beta_kind == "per_seq" else draw(
        st.sampled_from([0.0, 0.05, 1.0]))
    case = LossCase(
        lp=lp, old=old, adv=adv, mask=mask if draw(st.booleans()) else None, ref=ref if draw(st.booleans()) else None,
        ent=ent if draw(st.booleans()) else None, beta_kind=beta_kind, beta=beta,
        estimator=draw(st.sampled_from(["k1", "abs", "k2", "k3", "k1+", "abs+", "k2+", "k3+"])),
        clip=draw(st.sampled_from([None, 0.2, (0.2, 0.28), 0.0])),
        dual_clip=draw(st.sampled_from([None, None, 3.0, 1.5])), weights=wts if (with_w := draw(st.booleans())) else None,
        weight_kl=with_w and draw(st.booleans()),
        clamp_input=draw(st.sampled_from([None, None, (-20.0, 20.0), (-0.5, None), (None, 0.3)])),
        clamp_output=draw(st.sampled_from([None, None, (-10.0, 10.0), (None, 0.01)])),
        entropy_coef=draw(st.sampled_from([0.0, 0.01, 1.0])), aggregation=draw(st.sampled_from(list(aggregations))),
        pad_extra=draw(st.integers(0, 2)), importance_sampling_level=draw(st.sampled_from(["token", "token", "sequence"])),
        kl_times_ratio=draw(st.sampled_from([False, False, True])))
    if split:
        terms = [a for a in aggregations if a != "none"]
        case.aggregation = draw(st.sampled_from(terms))
        case.kl_aggregation = draw(st.sampled_from([None] + terms))
        case.entropy_aggregation = draw(st.sampled_from([None] + terms))
        if any(a.startswith("seq-mean") for a in case.aggregations):
            case.num_sequences = draw(st.sampled_from([None, "nonempty", len(lengths) + 3]))
        if case.ent is None and draw(st.booleans()):  # the entropy term is what entropy_aggregation weighs
            case.ent = ent
            case.entropy_coef = draw(st.sampled_from([0.01, 1.0]))
    return case


@dataclass
class BuiltLoss:
    kwargs: dict
    layout: str
    width: int = 0
    side: str = "left"


def build(case: LossCase, layout: str, *, requires_grad=True) -> BuiltLoss:
    """kl_penalty_loss arguments for ``case`` in ``layout`` (padding poisoned; leaves need grad)."""
    B = case.batch
    kw = dict(beta=case.beta_arg(), estimator=case.estimator, clip_epsilon=case.clip,
              entropy_coef=case.entropy_coef, aggregation=case.aggregation)
    if case.dual_clip is not None:
        kw["dual_clip"] = case.dual_clip
    if case.weight_kl:
        kw["weight_kl"] = True
    if case.clamp_input is not None:
        kw["clamp_input"] = case.clamp_input
    if case.clamp_output is not None:
        kw["clamp_output"] = case.clamp_output
    if case.importance_sampling_level != "token":
        kw["importance_sampling_level"] = case.importance_sampling_level
    if case.kl_times_ratio:
        kw["kl_times_ratio"] = True
    if case.objective != "ppo":
        kw.update(objective=case.objective, ratio_cap=case.ratio_cap, sapo_temperatures=case.sapo_temperatures)
    for name in ("kl_aggregation", "entropy_aggregation", "num_sequences"):
        if getattr(case, name) is not None:
            kw[name] = getattr(case, name)
    adv_tok = None if case.adv_per_seq else case.adv
    adv_seq = torch.tensor(case.adv, dtype=case.dtype) if case.adv_per_seq else None
    if layout.startswith("padded"):
        side = "right" if layout == "padded_right" else "left"
        width = max(case.lengths, default=0) + case.pad_extra
        pad = lambda seqs, dtype=case.dtype: _pad(seqs, width, side, float("nan"), dtype)  # noqa: E731
        kw.update(log_probs=pad(case.lp), old_log_probs=pad(case.old), lengths=torch.tensor(case.lengths,
                  dtype=torch.int64), padding_side=side)
        if case.mask is not None:
            garbage = torch.rand(B, width, generator=torch.Generator().manual_seed(1)) < 0.5
            valid = _pad([torch.ones(n, dtype=torch.bool) for n in case.lengths], width, side, False, torch.bool)
            kw["mask"] = torch.where(valid, _pad(case.mask, width, side, False, torch.bool), garbage)
        if case.ref is not None:
            kw["ref_log_probs"] = pad(case.ref)
        if case.ent is not None:
            kw["entropy"] = pad(case.ent)
        if case.weights is not None:
            kw["weights"] = pad(case.weights)
        kw["advantages"] = pad(adv_tok) if adv_tok is not None else adv_seq
        if case.normed and width == 0:
            kw["norm_length"] = 5
        built = BuiltLoss(kw, layout, width, side)
    else:
        lengths = torch.tensor(case.lengths, dtype=torch.int64)
        if layout == "packed":
            cat = lambda seqs, dtype=case.dtype: torch.cat(seqs) if seqs else torch.zeros(0, dtype=dtype)  # noqa: E731
            kw.update(offsets=torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]))
            adv_seq = adv_seq.unsqueeze(1) if adv_seq is not None else None  # [B, 1]: never ambiguous
        elif layout == "list":
            cat = lambda seqs, dtype=None: list(seqs)  # noqa: E731
        else:
            def cat(seqs, dtype=case.dtype):
                if not seqs:
                    return torch.nested.nested_tensor_from_jagged(torch.zeros(0, dtype=dtype),
                                                                  torch.zeros(1, dtype=torch.int64))
                return torch.nested.nested_tensor(list(seqs), layout=torch.jagged)
        kw.update(log_probs=cat(case.lp), old_log_probs=cat(case.old))
        if case.mask is not None:
            kw["mask"] = cat(case.mask, torch.bool)
        if case.ref is not None:
            kw["ref_log_probs"] = cat(case.ref)
        if case.ent is not None:
            kw["entropy"] = cat(case.ent)
        if case.weights is not None:
            kw["weights"] = cat(case.weights)
        kw["advantages"] = cat(adv_tok) if adv_tok is not None else adv_seq
        if case.normed:
            kw["norm_length"] = max(case.lengths, default=0) + 3
        built = BuiltLoss(kw, layout)
    if requires_grad:
        for name in ("log_probs", "entropy"):
            v = kw.get(name)
            if isinstance(v, list):
                kw[name] = [t.clone().requires_grad_() for t in v]
            elif isinstance(v, torch.Tensor) and not v.is_nested:
                kw[name] = v.clone().requires_grad_()
    return built


def norm_length_of(case: LossCase, built: BuiltLoss):
    return built.kwargs.get("norm_length", built.width)


def oracle_seqs(case: LossCase) -> list:
    out = []
    for b in range(case.batch):
        n = case.lengths[b]
        adv = [case.adv[b]] * n if case.adv_per_seq else case.adv[b].double().tolist()
        out.append(Seq(lp=case.lp[b].double().tolist(), old=case.old[b].double().tolist(), adv=adv,
                       mask=[True] * n if case.mask is None else case.mask[b].tolist(),
                       ref=None if case.ref is None else case.ref[b].double().tolist(),
                       ent=None if case.ent is None else case.ent[b].double().tolist(), beta=case.beta_of(b),
                       w=None if case.weights is None else case.weights[b].double().tolist()))
    return out


def rows_of(x, built: BuiltLoss, lengths):
    """Per-sequence valid values, and the padding values, of a per-token result in the built layout."""
    if isinstance(x, list):
        return x, []
    if x.is_nested:
        return list(x.unbind()), []
    if built.layout == "packed":
        return list(torch.split(x, lengths)), []
    rows, pads = [], []
    for b, n in enumerate(lengths):
        if built.side == "left":
            rows.append(x[b, built.width - n:]), pads.append(x[b, :built.width - n])
        else:
            rows.append(x[b, :n]), pads.append(x[b, n:])
    return rows, pads


def assert_close_sum(got, want: float, scale: float, dtype, what):
    """A sum of many terms: the bound grows with the sum of |terms| (math in ``dtype``)."""
    tol = TOLERANCES[dtype]
    got = float(got)
    if not math.isfinite(want):
        assert (math.isnan(want) and math.isnan(got)) or got == want, f"{what}: {got} != {want}"
        return
    bound = tol.atol + tol.rtol * 16 * scale
    assert abs(got - want) <= bound, f"{what}: {got} vs oracle {want} (bound {bound})"


def check_diagnostics(out, exp, case: LossCase, md):
    """TRL's metrics from the output (issue 62): the per-sequence counts of counted, low- and high-clipped
    tokens (exact, a flag within float32 rounding of its bound either way), the clip fractions over counted
    tokens, and the entropy's mean (0 without entropy)."""
    n_tok = exp.num_tokens
    for name in ("seq_clipped_low", "seq_clipped_high"):
        t = getattr(out, name)
        assert t.dtype == torch.float32 and t.shape == (case.batch,) and not t.requires_grad, (name, t)
    assert out.seq_num_tokens.dtype == torch.int64 and out.sequence_stats.shape == (case.batch, 7)
    assert out.seq_num_tokens.cpu().tolist() == exp.seq_num_tokens
    for name, want, frac in (("seq_clipped_low", exp.seq_low, "clip_low_fraction"),
                             ("seq_clipped_high", exp.seq_high, "clip_high_fraction")):
        got = getattr(out, name).cpu().tolist()
        assert all(s <= g <= s + near and g == int(g) for g, (s, near) in zip(got, want)), (name, got, want)
        f = getattr(out, frac)
        assert f.shape == () and f.dtype == md and not f.requires_grad, frac
        # the fraction is the counts' sum over the counted tokens (the same float32 counts, summed in float64)
        assert_close_sum(f.cpu(), sum(got) / max(n_tok, 1), 1.0, md, frac)
    assert out.entropy_mean.shape == () and out.entropy_mean.dtype == md and not out.entropy_mean.requires_grad
    if case.ent is None:
        assert float(out.entropy_mean) == 0.0, "entropy_mean without entropy is 0"
    else:
        want = exp.entropy_mean
        assert_close_sum(out.entropy_mean.cpu(), want, abs(want) + 1.0, md, "entropy_mean")


def check_loss(case: LossCase, layout: str, backend: str, device="cpu", grads=True):
    """Run kl_penalty_loss and compare value, parts, diagnostics and gradients with the oracle."""
    built = build(case, layout, requires_grad=grads)
    kw = {k: (v.to(device) if isinstance(v, torch.Tensor) else
              [t.to(device) for t in v] if isinstance(v, list) else v) for k, v in built.kwargs.items()}
    if device != "cpu" and grads:  # leaves on the device
        for name in ("log_probs", "entropy"):
            v = kw.get(name)
            if isinstance(v, torch.Tensor) and not v.is_nested:
                kw[name] = v.detach().requires_grad_()
            elif isinstance(v, list):  # each a leaf again: `.to(device)` of a leaf is not one
                kw[name] = [t.detach().requires_grad_() for t in v]
        built.kwargs.update({k: kw[k] for k in ("log_probs", "entropy") if k in kw})
    out = kl_penalty_loss(**kw, backend=backend)
    norm = norm_length_of(case, built) if case.normed else None
    exp = oracle_loss(oracle_seqs(case), estimator=case.estimator, clip=case.clip_bounds(),
                      entropy_coef=case.entropy_coef, aggregation=case.aggregation, norm_length=norm,
                      dual_clip=case.dual_clip, weight_kl=case.weight_kl, clamp_input=case.clamp_input,
                      clamp_output=case.clamp_output, importance_sampling_level=case.importance_sampling_level,
                      kl_times_ratio=case.kl_times_ratio, kl_aggregation=case.kl_aggregation,
                      objective=case.objective, ratio_cap=case.ratio_cap, sapo_temperatures=case.sapo_temperatures,
                      entropy_aggregation=case.entropy_aggregation, num_sequences=case.num_sequences)
    md = torch.float64 if case.dtype == torch.float64 else torch.float32
    lengths = case.lengths
    n_tok = exp.num_tokens
    assert int(out.num_tokens) == n_tok
    term_scale = sum(abs(v) for rows in exp.token_loss for v in rows) + 1.0
    if case.aggregation == "none":
        rows, pads = rows_of(out.loss.detach() if not isinstance(out.loss, list) else out.loss, built, lengths)
        for b, row in enumerate(rows):
            assert row.dtype == md
            for t, v in enumerate(row.detach().cpu().double().tolist()):
                want = exp.token_loss[b][t]
                assert_close_sum(v, want, abs(want) + 1.0, md, f"loss[{b}][{t}]")
        for pad in pads:
            assert (pad == 0).all(), "per-token loss must be 0 in the padding"
    else:
        assert out.loss.shape == () and out.loss.dtype == md
        # The bound scales with the largest weight of any term (a token-mean's 1 / N, ...).
        counts = [len(r) if case.mask is None else int(case.mask[b].sum()) for b, r in enumerate(exp.token_loss)]
        w_max = max((oracle_weights(counts, agg, norm_length=norm, num_sequences=case.num_sequences)(b)
                     for agg in case.aggregations for b in range(case.batch)), default=1.0)
        scale = term_scale * w_max
        assert_close_sum(out.loss.detach().cpu(), exp.loss, scale, md, "loss")
        assert_close_sum(out.loss_objective.cpu(), exp.loss_objective, scale, md, "loss_objective")
        assert_close_sum(out.loss_kl.cpu(), exp.loss_kl, scale, md, "loss_kl")
        assert_close_sum(out.loss_entropy.cpu(), exp.loss_entropy, scale, md, "loss_entropy")
    for name in ("kl_mean", "ratio_mean", "clip_fraction"):
        assert not getattr(out, name).requires_grad
        # A mean's error is relative to its own terms: ratios reach e^20 while the loss terms stay small.
        want = getattr(exp, name)
        own = abs(want) if math.isfinite(want) else 0.0
        assert_close_sum(getattr(out, name).cpu(), want, term_scale / max(n_tok, 1) + own + 1.0, md, name)
    check_diagnostics(out, exp, case, md)

    if grads:
        loss = out.loss
        if case.aggregation == "none":
            # A fixed random upstream gradient per token: checks the per-token backward scaling.
            up = [torch.linspace(-1, 1, n, dtype=torch.float64) for n in lengths]
            if isinstance(loss, list):
                total = sum((l_.double() * u.to(device)).sum() for l_, u in zip(loss, up))
            elif built.layout == "packed":
                total = (loss.double() * (torch.cat(up) if up else torch.zeros(0)).to(device)).sum()
            else:
                full = torch.zeros(loss.shape, dtype=torch.float64)
                for b, n in enumerate(lengths):
                    if built.side == "left":
                        full[b, built.width - n:] = up[b]
                    else:
                        full[b, :n] = up[b]
                total = (loss.double() * full.to(device)).sum()
            exp_grads = [[g * u for g, u in zip(exp.grad_lp[b], up[b].tolist())] for b in range(case.batch)]
            exp_grads_ent = [[g * u for g, u in zip(exp.grad_ent[b], up[b].tolist())] for b in range(case.batch)]
            exp_mags = [[m * abs(u) for m, u in zip(exp.grad_mag[b], up[b].tolist())] for b in range(case.batch)]
        else:
            total = loss
            exp_grads, exp_grads_ent, exp_mags = exp.grad_lp, exp.grad_ent, exp.grad_mag
        leaves = [(built.kwargs["log_probs"], exp_grads, "log_probs", exp_mags)]
        if case.ent is not None:
            leaves.append((built.kwargs["entropy"], exp_grads_ent, "entropy", exp_grads_ent))
        if isinstance(total, torch.Tensor) and total.requires_grad:
            total.backward()
        for leaf, want, name, want_mag in leaves:
            if isinstance(leaf, list):
                got_rows, got_pads = [t.grad if t.grad is not None else torch.zeros_like(t) for t in leaf], []
            else:
                grad = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
                got_rows, got_pads = rows_of(grad.cpu(), built, lengths)
            dt = case.dtype
            tol = TOLERANCES[dt]
            for b, row in enumerate(got_rows):
                assert row.dtype == dt
                w = torch.tensor(want[b], dtype=torch.float64)
                # the scale of the terms summed, not only of the sum (they may cancel: ratio * kl's product rule)
                mag = torch.maximum(w.abs(), torch.tensor(want_mag[b], dtype=torch.float64).abs())
                bound = tol.atol + tol.rtol * 4 * (mag + 1e-6) + TOLERANCES[md].rtol * 64 * mag
                got = row.cpu().double()
                # the oracle rounded to the gradient's dtype, overflow to inf included, is always right
                bad = ~((got - w).abs() <= bound) & ~(got.isnan() & w.isnan()) & ~(got == w.to(dt).double())
                assert not bad.any(), (f"grad of {name}[{b}] differs from the oracle at {bad.nonzero().flatten().tolist()}:"
                                       f" {got[bad].tolist()} vs {w[bad].tolist()}")
            for pad in got_pads:
                assert (pad == 0).all(), f"grad of {name} must be 0 in the padding"
    return out, exp
