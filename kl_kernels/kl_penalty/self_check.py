"""The first-use self-check of ``kl_penalty_loss`` (``kl_kernels/selfcheck.py``: the shared machinery; this op's
own check, registered by its ``backends.py``)."""

from __future__ import annotations

import torch

from ..selfcheck import _batches, _compare, _to  # the shared canonical cases and comparison


def check(backend, device) -> list:
    from .api import kl_penalty_loss  # (at call time: see kl_reward's)
    failures = []
    for dtype in (torch.float32, torch.bfloat16):
        for layout, kw, coef in _batches(device, dtype):
            b = coef.shape[0]
            old = kw["ref_log_probs"]
            for aggregation, estimator, options in (
                    ("token-mean", "k3", {}), ("seq-mean-token-mean", "k1", {}), ("sum", "k2", {}),
                    # dual clip, per-token weights (on both terms) and verl's clamped k3; ratios far from 1
                    # so the cap binds
                    ("token-mean", "k3", {"dual_clip": 1.5, "weight_kl": True, "clamp_input": (-20.0, 20.0),
                                          "clamp_output": (-10.0, 10.0)}),
                    # GSPO: the sequence's log-ratio for every token (a pre-pass the kernels read)
                    ("seq-mean-token-mean", "k1", {"importance_sampling_level": "sequence"})):
                adv = torch.linspace(-1, 1, b)
                if options:
                    options = dict(options, weights=torch.linspace(0.5, 1.5, old.numel()).reshape(old.shape))
                    old = (old.double() - 1.0).to(dtype)
                args = _to(dict(kw, old_log_probs=old, advantages=adv.unsqueeze(1) if layout == "packed" else adv,
                                beta=coef, estimator=estimator, aggregation=aggregation, clip_epsilon=0.2, **options),
                           device)
                del args["ref_log_probs"]
                # the NaN batch: a NaN log-prob makes the loss NaN everywhere alike; compare all the same
                lp = args["log_probs"].clone().requires_grad_()
                lp_ref = args["log_probs"].clone().requires_grad_()
                what = f"kl_penalty_loss[{backend}] {layout} {str(dtype)[6:]} {aggregation}/{estimator}"
                try:
                    got = kl_penalty_loss(**dict(args, log_probs=lp), backend=backend)
                    want = kl_penalty_loss(**dict(args, log_probs=lp_ref), backend="torch")
                except Exception as exc:
                    failures.append(f"{what}: raised {type(exc).__name__}: {exc}")
                    continue
                for field in got._fields:
                    _compare(f"{what} {field}", getattr(got, field), getattr(want, field), torch.float32, failures)
                if got.loss.requires_grad and want.loss.requires_grad:
                    g_got = torch.autograd.grad(got.loss, lp)[0]
                    g_want = torch.autograd.grad(want.loss, lp_ref)[0]
                    _compare(f"{what} grad", g_got, g_want, dtype, failures)
    return failures
