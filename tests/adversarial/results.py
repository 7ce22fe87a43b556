"""Result fields of either op, flattened for comparison (shared by the adversarial worker and the fuzz
harness)."""

from __future__ import annotations

import torch


def flat(x):
    """An output field as one float64 vector (lists concatenated, nested tensors' values), or None."""
    if x is None:
        return None
    if isinstance(x, (list, tuple)):
        return torch.cat([v.detach().reshape(-1).double() for v in x]) if x else torch.zeros(0, dtype=torch.float64)
    if x.is_nested:
        parts = x.unbind()
        return torch.cat([v.detach().reshape(-1).double() for v in parts]) if parts else \
            torch.zeros(0, dtype=torch.float64)
    return x.detach().reshape(-1).double()
