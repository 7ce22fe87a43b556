"""Triton kernels of kl_kernels (optional: needs the ``triton`` extra).

* ``kl_math.py``: the per-token math (estimators, clamps, derivatives, expm1), the Triton twin
  of ``csrc/common/kl_math.h``.
* ``kl_reward.py``: the ``kl_reward`` kernels (forward tiles, per-sequence combine, backward).
* ``kl_penalty.py``: the ``kl_penalty_loss`` kernels (same structure; one gradient buffer).
* ``token_logprobs.py``: the ``token_logprobs`` row kernels (one program per row of the logits).
* ``linear_rows.py``: log-probs and entropy from hidden states and an LM head, logits tiles formed on chip
  (``tl.dot``) and never stored; the backward's recomputed logits-gradient tiles (``linear_fused.py`` launches).

Nothing here is imported by ``import kl_kernels``: the ``triton`` backend imports this package
the first time it runs, so a machine without Triton loses only that backend. With
``TRITON_INTERPRET=1`` set before Triton is imported, the kernels run on CPU tensors under
Triton's interpreter (slow; for tests on machines without a GPU).
"""

from __future__ import annotations

import os


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")
