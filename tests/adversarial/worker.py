"""Runs catalogue calls in a separate process and judges them; see ``pool.py`` for the parent side.

Protocol: one call name per line on stdin; one JSON line per call on stdout
(``{"name", "verdict": "pass" | "fail", "detail"}``), written only once the call is judged, so a
call that crashes this process (or hangs) is the one the parent was waiting for.

A call is run through ``backend="auto"``, ``"cpu"``, ``"torch"`` (``KL_ADVERSARIAL_BASE`` may name fewer:
the sanitizer lane leaves out ``torch``, which runs no code of ours that ``auto`` does not) and every other
registered backend that is available here (``triton`` in its interpreter on the CPU, the emulated CUDA
backend when built; ``KL_ADVERSARIAL_BACKENDS`` names them); see ``catalogue.py`` for what each
expectation requires. A backend named explicitly may decline a valid call (BackendUnavailableError,
e.g. float64 on ``cpu``) but must then say why.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ (tolerances.py)

import torch  # noqa: E402

from kl_kernels import kl_penalty_loss, kl_reward  # noqa: E402
from kl_kernels.backends import BackendUnavailableError  # noqa: E402

from adversarial.catalogue import build_catalogue  # noqa: E402
from adversarial.results import flat  # noqa: E402
from tolerances import TOLERANCES  # noqa: E402

OPS = {"kl_reward": kl_reward, "kl_penalty_loss": kl_penalty_loss}
PER_TOKEN = {"kl", "reward", "ref_log_probs"}  # kl_reward's per-token outputs; the rest are reductions


def _backends(op: str) -> list[str]:
    if op == "kl_reward":
        from kl_kernels.kl_reward.backends import REGISTRY
    else:
        from kl_kernels.kl_penalty.backends import REGISTRY
    names = [n for n in os.environ.get("KL_ADVERSARIAL_BASE", "auto,cpu,torch").split(",") if n]
    extra = os.environ.get("KL_ADVERSARIAL_BACKENDS", "triton,cuda-emulated").split(",")
    for b in REGISTRY:
        if b.name in extra and not b.unavailable_reasons():
            names.append(b.name)
    return names


# ---------------------------------------------------------------- inputs: copies and fingerprints


def _tensors(x):
    """Every tensor inside an argument (lists and nested tensors opened)."""
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        items = list.__iter__(x) if isinstance(x, list) else tuple.__iter__(x)  # not the subclass's own
        return [t for v in items for t in _tensors(v)]
    return []


def _fingerprint(t: torch.Tensor):
    """What "unchanged" compares: the logical values bit for bit (NaN payloads included), the
    flags, and the view geometry."""
    meta = (t.dtype, t.layout, t.device.type, t.is_neg(), t.requires_grad, t.is_nested)
    if t.device.type == "meta":
        return meta
    if t.is_nested:
        return meta, [_fingerprint(u) for u in t.unbind()]
    if t.layout != torch.strided:
        return meta, _fingerprint(t.to_dense())
    geometry = (tuple(t.shape), t.stride(), t.storage_offset())
    values = t.detach().resolve_neg().resolve_conj().contiguous().reshape(-1)
    raw = values.view(torch.uint8) if values.dtype != torch.bool else values
    return meta, geometry, raw.flatten().tolist() if raw.numel() <= 4096 else bytes(raw.flatten().numpy())


def _snapshot(kw):
    return {k: [_fingerprint(t) for t in _tensors(v)] for k, v in kw.items()}


def _to_float64(x):
    if isinstance(x, torch.Tensor):
        if x.is_floating_point():
            y = (x.detach().to_dense() if x.layout != torch.strided and not x.is_nested else x.detach())
            y = y.to(torch.float64)
            return y.requires_grad_() if x.requires_grad else y
        return x
    if isinstance(x, tuple) and type(x) is not tuple:  # honest subclasses: read as the op does
        return tuple(_to_float64(v) for v in x)
    if isinstance(x, list):
        return [_to_float64(v) for v in x]
    return x


def _dtype_of(x):
    if isinstance(x, (list, tuple)):
        return x[0].dtype if x else torch.float32
    return x.dtype


def _compare(name, got, want, per_token: bool):
    g, w = flat(got), flat(want)
    if (g is None) != (w is None):
        return f"{name}: one of result/reference is None"
    if g is None:
        return None
    if g.shape != w.shape:
        return f"{name}: shape {list(g.shape)} vs reference {list(w.shape)}"
    dtype = _dtype_of(got)
    if per_token and dtype in TOLERANCES:
        tol = TOLERANCES[dtype]
        w = w.to(dtype).double()  # the reference rounded to the output dtype, as the table says
        rtol, atol = tol.rtol, tol.atol
    else:  # reductions: float32 accumulation over a few tokens
        rtol, atol = 1e-4, 1e-4
    same = (g == w) | (g.isnan() & w.isnan()) | ((g - w).abs() <= atol + rtol * w.abs())
    if not bool(same.all()):
        bad = (~same).nonzero().flatten()[:4].tolist()
        return f"{name}: differs from the float64 reference at {bad}: {g[bad].tolist()} vs {w[bad].tolist()}"
    return None


def _grad_inputs(kw):
    lp = kw["log_probs"]
    return [t for t in _tensors(lp) if t.requires_grad]


def _scalar(op, out):
    if op == "kl_reward":
        total = flat(out.kl).nan_to_num(0.0, 0.0, 0.0).sum()
        parts = [out.kl, out.reward]
        return sum((torch.cat([v.reshape(-1) for v in p]) if isinstance(p, (list, tuple)) else
                    (torch.cat([v.reshape(-1) for v in p.unbind()]) if p.is_nested else p.reshape(-1))
                    ).nan_to_num(0.0, 0.0, 0.0).sum() for p in parts if p is not None and len(p) > 0) + 0 * total
    loss = out.loss
    if isinstance(loss, (list, tuple)):
        return sum(v.sum() for v in loss)
    return (loss.values() if loss.is_nested else loss).nan_to_num(0.0, 0.0, 0.0).sum()


def _grads(op, call_kwargs, out):
    inputs = _grad_inputs(call_kwargs)
    if not inputs:
        return None
    scalar = _scalar(op, out)
    if not scalar.requires_grad:
        return "no gradient: the result is not connected to log_probs"
    got = torch.autograd.grad(scalar, inputs, allow_unused=True)
    return [torch.zeros_like(i) if g is None else g for i, g in zip(inputs, got)]


def judge(call) -> str | None:
    """None when the call behaves, else what went wrong."""
    fn = OPS[call.op]
    expect = call.expect
    want = want_grads = None
    if expect == "ok":
        ref_kw = {k: _to_float64(v) for k, v in call.build().items()}
        ref_kw["backend"] = "torch"
        try:
            want = fn(**ref_kw)
        except Exception as exc:  # the reference must run a valid call
            return f"the float64 reference raised {type(exc).__name__}: {exc}"
        if call.grad:
            want_grads = _grads(call.op, ref_kw, want)
    problems = []
    auto_ok = None
    for backend in _backends(call.op):
        kw = call.build()
        if "backend" in kw and backend != "auto":
            continue  # a call about the backend argument itself
        before = _snapshot({k: v for k, v in kw.items() if k != "backend"})
        if "backend" not in kw:
            kw["backend"] = backend
        where = f"[{backend}]"
        try:
            out = fn(**kw)
        except (ValueError, TypeError) as exc:
            out, err = None, exc
        except BackendUnavailableError as exc:
            out, err = None, exc
        except Exception as exc:
            out, err = None, exc
        after = _snapshot({k: v for k, v in kw.items() if k != "backend"})
        if after != {k: v for k, v in before.items()}:
            changed = [k for k in before if before[k] != after.get(k)]
            problems.append(f"{where} modified its inputs: {changed}")
        if out is None:
            msg = f"{type(err).__name__}: {err}"
            if expect == "ok":
                if isinstance(err, BackendUnavailableError) and backend != "auto" and str(err):
                    continue  # an explicit backend may decline, saying why
                problems.append(f"{where} raised on a valid call: {msg}")
            elif expect[0] == "error":
                if not isinstance(err, (ValueError, TypeError)) or isinstance(err, BackendUnavailableError):
                    problems.append(f"{where} expected ValueError/TypeError naming {expect[1]!r}, got {msg}")
                elif expect[1] not in str(err):
                    problems.append(f"{where} error does not name {expect[1]!r}: {msg}")
            elif expect[0] == "unavailable":
                ok_types = (BackendUnavailableError, ValueError, TypeError)
                if not isinstance(err, ok_types) or expect[1] not in str(err):
                    problems.append(f"{where} expected an error mentioning {expect[1]!r}, got {msg}")
            continue
        if expect != "ok":
            problems.append(f"{where} returned a result; expected {expect}")
            continue
        if backend == "auto":
            auto_ok = True
        for field in out._fields:
            got_v, want_v = getattr(out, field), getattr(want, field)
            if isinstance(got_v, torch.Tensor) and not got_v.is_nested and got_v.dim() == 0 and \
                    not got_v.is_floating_point():
                if int(got_v) != int(want_v):
                    problems.append(f"{where} {field}: {int(got_v)} vs reference {int(want_v)}")
                continue
            d = _compare(field, got_v, want_v, per_token=call.op == "kl_reward" and field in PER_TOKEN or (
                call.op == "kl_penalty_loss" and kw.get("aggregation") == "none" and field == "loss"))
            if d:
                problems.append(f"{where} {d}")
        if call.grad and want_grads is not None:
            got_grads = _grads(call.op, kw, out)
            if isinstance(got_grads, str) or isinstance(want_grads, str):
                problems.append(f"{where} gradient: {got_grads if isinstance(got_grads, str) else want_grads}")
            else:
                for i, (g, w) in enumerate(zip(got_grads, want_grads)):
                    d = _compare(f"grad[{i}]", g, w, per_token=True)
                    if d:
                        problems.append(f"{where} {d}")
    if expect == "ok" and not auto_ok:
        problems.append("backend='auto' did not return a result")
    return "; ".join(problems) or None


def main() -> None:
    import resource

    # A crash on purpose (selftest/abort) or by a bug must not write a core file: dumping a process
    # that holds a CUDA context takes long enough to look like a hang.
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    torch.set_num_threads(int(os.environ.get("KL_ADVERSARIAL_THREADS", "2")))
    calls = build_catalogue()
    print(json.dumps({"ready": True}), flush=True)  # the per-call clock starts after the imports
    for line in sys.stdin:
        name = line.strip()
        if not name:
            continue
        if name.startswith("selftest/"):  # the pool's own tests: a crash and a hang on demand
            if name == "selftest/abort":
                os.abort()
            if name == "selftest/hang":
                import time

                time.sleep(3600)
        try:
            problem = judge(calls[name])
        except Exception:
            problem = "the harness itself failed: " + traceback.format_exc(limit=4)
        print(json.dumps({"name": name, "verdict": "pass" if problem is None else "fail", "detail": problem or ""}),
              flush=True)


if __name__ == "__main__":
    main()
