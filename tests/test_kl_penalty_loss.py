"""kl_penalty_loss against the float64 oracle: every layout, aggregation, dtype and option, values
and gradients, for each backend that can run here."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kl_kernels import kl_penalty_loss
from loss_batches import AGGREGATIONS, LOSS_LAYOUTS, LossCase, check_loss, loss_cases

BACKENDS = ["torch", "cpu"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", LOSS_LAYOUTS)
@given(case=loss_cases())
def test_matches_oracle(case, layout, backend):
    if backend != "torch" and case.dtype == torch.float64:
        return
    grads = layout != "nested_jagged"  # nested leaves: values only (grads are checked in the other layouts)
    check_loss(case, layout, backend, grads=grads)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@given(case=loss_cases(dtypes=(torch.float32,)), layout=st.sampled_from(["packed", "padded_left", "list"]))
@settings(max_examples=15)
def test_every_aggregation(case, layout, aggregation, backend):
    case.aggregation = aggregation
    check_loss(case, layout, backend)
