"""Hypothesis strategies: random ragged batches over every semantic axis of kl_reward.

Hypothesis draws the structure (lengths, layout, options); the values come from a torch
generator seeded by a drawn integer, so every run sees fresh random numbers.
"""

from __future__ import annotations

import torch
from hypothesis import strategies as st

from batches import Case

NASTY_LENGTHS = [0, 1, 2, 3, 5, 7, 13, 31, 61, 127]
ESTIMATORS = ["k1", "abs", "k2", "k3", "k1+", "abs+", "k2+", "k3+"]
CLAMPS = [None, (-20.0, 20.0), (-0.5, 0.5), (None, 1.0), (-1.0, None)]
OUT_CLAMPS = [None, (-10.0, 10.0), (0.0, 0.25), (None, 2.0), (0.05, 5.0)]  # last: excludes est(0) = 0
HALF_AND_SINGLE = [torch.float32, torch.bfloat16, torch.float16]


def lengths_strategy(max_batch=6):
    one = st.one_of(st.sampled_from(NASTY_LENGTHS), st.integers(0, 40))
    return st.lists(one, min_size=0, max_size=max_batch)


@st.composite
def cases(draw, dtypes=(torch.float32, torch.bfloat16, torch.float16, torch.float64), reward_kinds=None,
          max_batch=6):
    lengths = draw(lengths_strategy(max_batch))
    batch = len(lengths)
    dtype = draw(st.sampled_from(list(dtypes)))
    mixed = draw(st.booleans()) and dtype != torch.float64
    ref_dtype = draw(st.sampled_from(HALF_AND_SINGLE)) if mixed else dtype
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    scale = draw(st.sampled_from([1e-3, 0.1, 1.0, 4.0]))

    def uniform(n, lo, hi):
        return torch.rand(n, generator=g, dtype=torch.float64) * (hi - lo) + lo

    lp, ref = [], []
    for n in lengths:
        a = uniform(n, -12.0, 0.0)
        b = a + torch.randn(n, generator=g, dtype=torch.float64) * scale
        tie = torch.rand(n, generator=g) < 0.1  # d == 0 exactly: abs/k3 edge
        b = torch.where(tie, a, b)
        lp.append(a.to(dtype))
        ref.append(b.to(ref_dtype) if not tie.any() else torch.where(tie, a.to(dtype).to(ref_dtype), b.to(ref_dtype)))

    mask = None
    if draw(st.booleans()):
        p = draw(st.sampled_from([0.3, 0.8, 1.0]))
        mask = [torch.rand(n, generator=g) < p for n in lengths]
    prompt_lens = None
    if draw(st.booleans()):
        prompt_lens = [draw(st.integers(0, n)) for n in lengths]

    coef_kind = draw(st.sampled_from(["float", "scalar_tensor", "per_seq"]))
    coef = [float(c) for c in uniform(batch, 0.0, 2.0)] if coef_kind == "per_seq" else draw(
        st.sampled_from([0.0, 0.05, 1.0, 1.7]))

    kinds = reward_kinds or [None, "token", "token1", "B", "B1", "B11"]
    reward_kind = draw(st.sampled_from(kinds))
    placement = None
    reward_tok = reward_seq = None
    reward_dtype = draw(st.sampled_from([dtype, torch.float32]))
    if reward_kind in ("token", "token1"):
        reward_tok = [uniform(n, -1.0, 1.0).to(reward_dtype) for n in lengths]
        placement = draw(st.sampled_from(["token", "auto"]))
    elif reward_kind is not None:
        reward_seq = uniform(batch, -1.0, 1.0).to(reward_dtype)
        placement = draw(st.sampled_from(["sequence", "last", "last_valid"]))

    return Case(lp=lp, ref=ref, mask=mask, prompt_lens=prompt_lens, estimator=draw(st.sampled_from(ESTIMATORS)),
                clamp_input=draw(st.sampled_from(CLAMPS)), clamp_output=draw(st.sampled_from(OUT_CLAMPS)),
                coef_kind=coef_kind, coef=coef, reward_kind=reward_kind, placement=placement, reward_tok=reward_tok,
                reward_seq=reward_seq, left_pad_extra=draw(st.integers(0, 2)))
