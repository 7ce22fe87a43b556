"""The row pass of ``token_logprobs`` by backend name: the launcher pair that the hidden-state path and the
vocabulary-parallel path call on logits they form or hold themselves."""

from __future__ import annotations

from .. import vocab_rows
from . import launch, launch_triton, reference


def row_pass(backend: str):
    """(forward, backward) of the row pass for logits [C, V] (the launchers' signatures, ``launch.py``)."""
    return vocab_rows.row_pass(backend, launch, launch_triton, reference)
