"""The first-use self-check of ``full_kl`` (``kl_kernels/selfcheck.py``: the shared machinery; this op's
own check, registered by its ``backends.py``)."""

from __future__ import annotations

import math

import torch

from ..selfcheck import _compare, _logits_cases  # the shared canonical cases and comparison


def check(backend, device) -> list:
    from .api import full_kl  # (at call time: see kl_reward's)
    failures = []
    g = torch.Generator().manual_seed(8765)
    for dtype in (torch.float32, torch.bfloat16):
        for name, x, _y, mask in _logits_cases(dtype):
            # the reference: the policy's logits shifted by a constant (cancels in the KL) plus noise, with
            # the policy's -inf entries and a -inf of its own where the policy has mass (KL = +inf)
            r = x.double() + 3.0 + torch.randn(x.shape, generator=g, dtype=torch.float64)
            if x.shape[-1] > 1:
                r[0, 1, 0] = -math.inf
            x, r, mask = x.to(device), r.to(dtype).to(device), mask.to(device)
            what = f"full_kl[{backend}] {name} {str(dtype)[6:]}"
            leaves = [t.clone().requires_grad_() for t in (x, r, x, r)]
            try:
                got = full_kl(leaves[0], leaves[1], temperature=0.7, mask=mask, backend=backend)
                want = full_kl(leaves[2], leaves[3], temperature=0.7, mask=mask, backend="torch")
            except Exception as exc:
                failures.append(f"{what}: raised {type(exc).__name__}: {exc}")
                continue
            _compare(f"{what} kl", got, want, torch.float32, failures)
            up = torch.linspace(-1, 1, got.numel(), device=device).reshape(got.shape)
            g_got = torch.autograd.grad((got.nan_to_num(0, 0, 0) * up).sum(), leaves[:2])
            g_want = torch.autograd.grad((want.nan_to_num(0, 0, 0) * up).sum(), leaves[2:])
            _compare(f"{what} grad logits", g_got[0], g_want[0], dtype, failures)
            _compare(f"{what} grad ref_logits", g_got[1], g_want[1], dtype, failures)
    return failures
