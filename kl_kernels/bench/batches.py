"""Realistic RLHF-shaped batches for the benchmarks.

Distribution (documented here, reproduced by ``seed``):

* ``B`` sequences; total length ``L_b ~ U{lo, ..., hi}``.
* A prompt (system + user) of ``P_b = round(L_b * U(0.2, 0.6))`` tokens, never counted.
* The rest is a multi-turn response: ``k_b ~ U{1, 2, 3}`` assistant turns separated by
  ``k_b - 1`` tool/user turns, segment sizes from sorted uniform cut points. Only assistant
  tokens are in the mask, as TorchRL's ``("masks", "all_assistant_mask")``.
* Policy log-probs of sampled tokens ``lp = -8 u^3`` (``u ~ U(0, 1)``: most tokens confident,
  a tail of unlikely ones); reference ``ref = -|lp + N(0, 0.1^2)|``.
* One scalar score per sequence ``~ N(0, 1)``.

Each batch comes in the packed layout (values + offsets) and the padded layout TorchRL uses
(left padding, ``[B, T]``, ``T = max L_b``), from the same tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import ragged


@dataclass(frozen=True)
class Size:
    name: str
    batch: int
    min_len: int
    max_len: int


SIZES = {
    "tiny": Size("tiny", 8, 4, 32),
    "small": Size("small", 64, 32, 256),
    "medium": Size("medium", 256, 100, 1000),
    "large": Size("large", 1024, 256, 4096),
}


@dataclass
class RLHFBatch:
    size: Size
    lengths: torch.Tensor     # [B] int64
    offsets: torch.Tensor     # [B + 1] int64
    lp: torch.Tensor          # packed [N]
    ref: torch.Tensor         # packed [N]
    mask: torch.Tensor        # packed [N] bool (assistant tokens)
    score: torch.Tensor       # [B] float32
    lp_padded: torch.Tensor   # [B, T], left-padded
    ref_padded: torch.Tensor
    mask_padded: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())


_CACHE: dict = {}


def cached_batch(name: str, dtype=torch.float32, device="cpu", seed: int = 0) -> RLHFBatch:
    """:func:`make_batch` of ``SIZES[name]``, made once per process (the bench's tasks share it; never written)."""
    key = (name, dtype, str(device), seed)
    if key not in _CACHE:
        _CACHE[key] = make_batch(SIZES[name], dtype=dtype, device=device, seed=seed)
    return _CACHE[key]


def make_batch(size: Size, *, dtype=torch.float32, device="cpu", seed: int = 0) -> RLHFBatch:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(size.min_len, size.max_len + 1, (size.batch,), generator=g)
    offsets = ragged.lengths_to_offsets(lengths)
    n = int(lengths.sum())
    u = torch.rand(n, generator=g)
    lp = -8.0 * u ** 3
    ref = -(lp + 0.1 * torch.randn(n, generator=g)).abs()
    mask = torch.zeros(n, dtype=torch.bool)
    # Multi-turn assistant masks: a short per-sequence loop at set-up time (not timed).
    for b, length in enumerate(lengths.tolist()):
        start = int(offsets[b])
        prompt = round(length * float(torch.empty(1).uniform_(0.2, 0.6, generator=g)))
        turns = int(torch.randint(1, 4, (1,), generator=g))
        rest = length - prompt
        cuts = sorted(torch.randint(0, rest + 1, (2 * turns - 2,), generator=g).tolist())
        bounds = [0, *cuts, rest]
        for seg in range(0, len(bounds) - 1, 2):  # even segments are assistant turns
            mask[start + prompt + bounds[seg]: start + prompt + bounds[seg + 1]] = True
    score = torch.randn(size.batch, generator=g)
    width = int(lengths.max()) if size.batch else 0
    pad = lambda x, v: ragged.to_padded(x, offsets, padding_side="left", width=width, padding_value=v)  # noqa: E731
    to = lambda x: x.to(device)  # noqa: E731
    lp, ref = lp.to(dtype), ref.to(dtype)
    return RLHFBatch(size, to(lengths), to(offsets), to(lp), to(ref), to(mask), to(score),
                     to(pad(lp, 0.0)), to(pad(ref, 0.0)), to(pad(mask, False)))
