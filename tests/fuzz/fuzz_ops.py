#!/usr/bin/env python3
"""Coverage-guided fuzzing of ``kl_reward`` and ``kl_penalty_loss`` with atheris.

Each input (bytes) is decoded by atheris' FuzzedDataProvider into one call: the op, a layout, the
sequence lengths, dtypes, and then arbitrary values where callers go wrong (offsets and lengths from
fuzzed integers, coefficients from fuzzed floats, clamp bounds, estimator and placement names, the
negative bit, lists or tuples, requires_grad). The call runs through ``backend="auto"`` and
``backend="torch"``; what must hold (else an AssertionError, which atheris reports as a finding
and saves the input):

* nothing but ValueError / TypeError / BackendUnavailableError escapes (and nothing crashes: a
  segfault or a sanitizer report ends the run with the input saved);
* both backends agree on whether the call is valid;
* where both return, the results agree within a loose bound (per-token values exactly where both
  compute the same formula in float32; the oracle tests hold the precision);
* the inputs are unchanged.

Coverage: ``atheris.instrument_imports`` instruments kl_kernels' Python code (the validation, the
layouts, the dispatch), so inputs reaching new branches are kept and the corpus grows. The C++
extension is not instrumented for coverage (that would take a clang -fsanitize=fuzzer build; the
sanitizer lane runs this harness on an ASan/UBSan build of it for memory errors instead).

Usage: ``python tests/fuzz/fuzz_ops.py CORPUS_DIR -max_total_time=60`` (libFuzzer flags), or
``python tests/fuzz/fuzz_ops.py --replay FILE...`` to run saved inputs once (the regression tests).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import atheris

with atheris.instrument_imports(include=["kl_kernels"]):
    import torch

    from kl_kernels import kl_penalty_loss, kl_reward
    from kl_kernels.backends import BackendUnavailableError

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the shared result flattening
from adversarial.results import flat  # noqa: E402

ESTIMATORS = ("k1", "abs", "k2", "k3", "k1+", "abs+", "k2+", "k3+", "k4", "", "K1")
PLACEMENTS = ("auto", "token", "sequence", "last", "first")
AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm", "sum",
                "none", "mean", "token-sum-norm")
NUM_SEQUENCES = ("nonempty", "all", -1, 0, 3, 2 ** 40)
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int32)
SPECIAL_FLOATS = (0.0, -0.0, 1.0, -1.0, math.nan, math.inf, -math.inf, 1e-45, 3.5e38, 2.0 ** 200, -88.0, 20.0)
EXPECTED = (ValueError, TypeError, BackendUnavailableError)


def _float(fdp):
    if fdp.ConsumeBool():
        return SPECIAL_FLOATS[fdp.ConsumeIntInRange(0, len(SPECIAL_FLOATS) - 1)]
    return fdp.ConsumeRegularFloat()


def _int(fdp):
    choice = fdp.ConsumeIntInRange(0, 3)
    if choice == 0:
        return fdp.ConsumeIntInRange(-3, 12)
    if choice == 1:
        return fdp.ConsumeIntInRange(-(2 ** 63), 2 ** 63 - 1)
    return fdp.ConsumeIntInRange(0, 8)


def _values(fdp, n, dtype):
    base = torch.linspace(-3.0, 0.0, n, dtype=torch.float64) if n else torch.zeros(0, dtype=torch.float64)
    if n and fdp.ConsumeBool():
        base[fdp.ConsumeIntInRange(0, n - 1)] = _float(fdp)
    return base.to(dtype) if dtype.is_floating_point else base.to(torch.int64).to(dtype)


def _maybe_neg(fdp, t):
    return torch._neg_view(-t) if fdp.ConsumeIntInRange(0, 7) == 0 and t.dtype != torch.bool else t


def build(fdp):
    """(op function, kwargs) decoded from the fuzzer's bytes."""
    op = kl_reward if fdp.ConsumeBool() else kl_penalty_loss
    layout = fdp.ConsumeIntInRange(0, 3)  # packed, padded, list, nested
    batch = fdp.ConsumeIntInRange(0, 5)
    lengths = [fdp.ConsumeIntInRange(0, 6) for _ in range(batch)]
    dtype = DTYPES[fdp.ConsumeIntInRange(0, len(DTYPES) - 1)] if fdp.ConsumeBool() else torch.float32
    seqs = [[_values(fdp, n, dtype) for n in lengths] for _ in range(3)]
    masks = [torch.tensor([fdp.ConsumeBool() for _ in range(n)], dtype=torch.bool) for n in lengths]
    kw = {}
    if layout == 0:
        offsets = [0]
        for n in lengths:
            offsets.append(offsets[-1] + n)
        if fdp.ConsumeIntInRange(0, 5) == 0:
            offsets[fdp.ConsumeIntInRange(0, len(offsets) - 1)] = _int(fdp)
        off = torch.tensor(offsets, dtype=torch.int64 if fdp.ConsumeIntInRange(0, 9) else torch.int32)
        kw["offsets"] = _maybe_neg(fdp, off)
        tensors = [torch.cat(s) if s else torch.zeros(0, dtype=dtype) for s in seqs]
        mask = torch.cat(masks) if masks else torch.zeros(0, dtype=torch.bool)
    elif layout == 1:
        width = max(lengths, default=0) + fdp.ConsumeIntInRange(0, 2)
        side = "left" if fdp.ConsumeBool() else ("right" if fdp.ConsumeIntInRange(0, 9) else "up")
        ls = list(lengths)
        if fdp.ConsumeIntInRange(0, 5) == 0 and ls:
            ls[fdp.ConsumeIntInRange(0, len(ls) - 1)] = _int(fdp)
        kw["lengths"] = _maybe_neg(fdp, torch.tensor(ls, dtype=torch.int64))
        kw["padding_side"] = side

        def pad(parts, fill, dt):
            rows = [torch.cat([torch.full((width - len(p),), fill, dtype=dt), p]) if side == "left" else
                    torch.cat([p, torch.full((width - len(p),), fill, dtype=dt)]) for p in parts]
            return torch.stack(rows) if rows else torch.zeros(0, width, dtype=dt)

        tensors = [pad(s, 0, dtype) for s in seqs]
        mask = pad(masks, False, torch.bool)
    elif layout == 2:
        container = list if fdp.ConsumeBool() else tuple
        tensors = [container(s) for s in seqs]
        mask = container(masks)
    else:
        if not batch or not all(lengths):
            return None
        tensors = [torch.nested.nested_tensor(list(s), layout=torch.jagged) for s in seqs]
        mask = torch.nested.nested_tensor(masks, layout=torch.jagged)
    if layout in (0, 1) and fdp.ConsumeIntInRange(0, 7) == 0:
        tensors[0] = _maybe_neg(fdp, tensors[0])
    if fdp.ConsumeBool():
        kw["mask"] = mask
    if op is kl_reward:
        kw.update(log_probs=tensors[0], ref_log_probs=tensors[1])
        if fdp.ConsumeBool():
            kw["reward"] = tensors[2]
        elif fdp.ConsumeBool():
            kw["reward"] = torch.ones(batch)
            kw["reward_placement"] = PLACEMENTS[fdp.ConsumeIntInRange(0, len(PLACEMENTS) - 1)]
        kw["coef"] = _float(fdp) if fdp.ConsumeBool() else torch.full((batch,), _float(fdp))
        kw["estimator"] = ESTIMATORS[fdp.ConsumeIntInRange(0, len(ESTIMATORS) - 1)]
        if fdp.ConsumeBool():
            kw["clamp_input"] = (_float(fdp), _float(fdp))
        if fdp.ConsumeBool():
            kw["clamp_output"] = (None, _float(fdp))
        if fdp.ConsumeBool():
            kw["return_ref"] = True
        if fdp.ConsumeBool():
            kw["mask_nan"] = True
    else:
        kw.update(log_probs=tensors[0], old_log_probs=tensors[1],
                  advantages=torch.ones(batch, 1) if layout == 0 else torch.ones(batch))
        if fdp.ConsumeBool():
            kw["ref_log_probs"] = tensors[2]
        kw["beta"] = _float(fdp) if fdp.ConsumeBool() else torch.full((batch,), _float(fdp))
        kw["estimator"] = ESTIMATORS[fdp.ConsumeIntInRange(0, len(ESTIMATORS) - 1)]
        kw["aggregation"] = AGGREGATIONS[fdp.ConsumeIntInRange(0, len(AGGREGATIONS) - 1)]
        if fdp.ConsumeBool():
            kw["clip_epsilon"] = _float(fdp)
        if fdp.ConsumeBool():
            kw["norm_length"] = fdp.ConsumeIntInRange(-1, 8)
        # consumed last, so the saved inputs of earlier options keep their meaning
        if fdp.ConsumeBool():
            kw["kl_aggregation"] = AGGREGATIONS[fdp.ConsumeIntInRange(0, len(AGGREGATIONS) - 1)]
        if fdp.ConsumeBool():
            kw["num_sequences"] = NUM_SEQUENCES[fdp.ConsumeIntInRange(0, len(NUM_SEQUENCES) - 1)]
    return op, kw


def _fingerprints(kw):
    out = {}
    for k, v in kw.items():
        items = v if type(v) in (list, tuple) else [v]
        prints = []
        for t in items:
            if isinstance(t, torch.Tensor):
                parts = t.unbind() if t.is_nested else [t]
                prints.append([(p.dtype, p.is_neg(), p.resolve_neg().reshape(-1).view(torch.uint8).tolist()
                                if p.dtype != torch.bool else p.tolist()) for p in parts])
            else:
                prints.append(repr(t))
        out[k] = prints
    return out


def check(op, kw):
    before = _fingerprints(kw)
    results = {}
    for backend in ("auto", "torch"):
        try:
            results[backend] = op(**kw, backend=backend)
        except EXPECTED as exc:
            results[backend] = exc
        assert _fingerprints(kw) == before, f"{backend} modified its inputs"
    auto, ref = results["auto"], results["torch"]
    if isinstance(auto, Exception) or isinstance(ref, Exception):
        # an explicit torch backend may decline what auto ran elsewhere (never the other way here:
        # every backend sees the same validation)
        assert isinstance(auto, Exception) == isinstance(ref, Exception) or isinstance(ref, BackendUnavailableError), \
            f"auto {auto!r} vs torch {ref!r}"
        return
    for field in auto._fields:
        a, r = flat(getattr(auto, field)), flat(getattr(ref, field))
        if a is None or r is None:
            assert a is None and r is None, field
            continue
        assert a.shape == r.shape, (field, a.shape, r.shape)
        close = (a == r) | (a.isnan() & r.isnan()) | ((a - r).abs() <= 1e-2 + 1e-2 * r.abs())
        assert bool(close.all()), f"{field}: auto {a.tolist()} vs torch {r.tolist()}"


def test_one_input(data: bytes) -> None:
    fdp = atheris.FuzzedDataProvider(data)
    try:
        built = build(fdp)
    except (ValueError, RuntimeError, OverflowError):
        return  # the harness could not build tensors from these bytes (e.g. a length torch rejects)
    if built is None:
        return
    check(*built)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--replay":
        for path in sys.argv[2:]:
            with open(path, "rb") as f:
                test_one_input(f.read())
        print(f"replayed {len(sys.argv) - 2} inputs")
        return
    atheris.Setup(sys.argv, test_one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
