"""The first-use self-check of ``token_logprobs`` (``kl_kernels/selfcheck.py``: the shared machinery; this op's
own check, registered by its ``backends.py``)."""

from __future__ import annotations

import torch

from ..selfcheck import _compare, _logits_cases  # the shared canonical cases and comparison


def check(backend, device) -> list:
    from .api import token_logprobs  # (at call time: see kl_reward's)
    failures = []
    for dtype in (torch.float32, torch.bfloat16):
        for name, x, y, mask in _logits_cases(dtype):
            x, y, mask = x.to(device), y.to(device), mask.to(device)
            what = f"token_logprobs[{backend}] {name} {str(dtype)[6:]}"
            leaf, leaf_ref = x.clone().requires_grad_(), x.clone().requires_grad_()
            try:
                got = token_logprobs(leaf, y, temperature=0.7, return_entropy=True, mask=mask, backend=backend)
                want = token_logprobs(leaf_ref, y, temperature=0.7, return_entropy=True, mask=mask, backend="torch")
            except Exception as exc:
                failures.append(f"{what}: raised {type(exc).__name__}: {exc}")
                continue
            _compare(f"{what} log_probs", got.log_probs, want.log_probs, torch.float32, failures)
            _compare(f"{what} entropy", got.entropy, want.entropy, torch.float32, failures)
            up = torch.linspace(-1, 1, y.numel(), device=device).reshape(y.shape)

            def total(out):
                return ((out.log_probs.nan_to_num(0, 0, 0) + 0.5 * out.entropy.nan_to_num(0, 0, 0)) * up).sum()
            g_got = torch.autograd.grad(total(got), leaf)[0]
            g_want = torch.autograd.grad(total(want), leaf_ref)[0]
            _compare(f"{what} grad", g_got, g_want, dtype, failures)
    return failures
