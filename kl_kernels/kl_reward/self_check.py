"""The first-use self-check of ``kl_reward`` (``kl_kernels/selfcheck.py``: the shared machinery; this op's
own check, registered by its ``backends.py``)."""

from __future__ import annotations

import torch

from ..selfcheck import _batches, _compare, _to  # the shared canonical cases and comparison


def check(backend, device) -> list:
    from .api import kl_reward  # (at call time: api imports backends, which registers this)
    failures = []
    for dtype in (torch.float32, torch.bfloat16):
        for layout, kw, coef in _batches(device, dtype):
            for estimator, placement, coef_arg in (("k1", "token", 0.1), ("k3", "last", coef), ("k2", "sequence", 0.3),
                                                   ("abs", "last_valid", 0.0), ("k3+", "token", coef)):
                b = coef.shape[0]
                n_tok = kw["log_probs"].shape
                reward = torch.randn(n_tok) if placement == "token" else torch.randn(b)
                args = _to(dict(kw, reward=reward.to(dtype) if placement == "token" else reward, coef=coef_arg,
                                estimator=estimator, reward_placement=placement,
                                clamp_input=(-20, 20) if estimator == "k3" else None), device)
                lp = args["log_probs"].clone().requires_grad_()
                lp_ref = args["log_probs"].clone().requires_grad_()
                what = f"kl_reward[{backend}] {layout} {str(dtype)[6:]} {estimator}/{placement}"
                try:
                    got = kl_reward(**dict(args, log_probs=lp), detach=False, backend=backend)
                    want = kl_reward(**dict(args, log_probs=lp_ref), detach=False, backend="torch")
                except Exception as exc:  # a crash of the backend is a failure, not an error of ours
                    failures.append(f"{what}: raised {type(exc).__name__}: {exc}")
                    continue
                for field in ("kl", "reward", "kl_sum", "count"):
                    _compare(f"{what} {field}", getattr(got, field), getattr(want, field), dtype, failures)
                weights = torch.linspace(-1, 1, lp.numel(), device=lp.device).reshape(lp.shape)
                g_got = torch.autograd.grad((got.kl.float().nan_to_num(0, 0, 0) * weights).sum(), lp)[0]
                g_want = torch.autograd.grad((want.kl.float().nan_to_num(0, 0, 0) * weights).sum(), lp_ref)[0]
                _compare(f"{what} grad", g_got.nan_to_num(0, 0, 0), g_want.nan_to_num(0, 0, 0), dtype, failures)
    return failures
