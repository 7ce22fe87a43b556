"""The row pass of ``token_logprobs`` by backend name: the launcher pair that the hidden-state path and the
vocabulary-parallel path call on logits they form or hold themselves."""

from __future__ import annotations

from . import launch, launch_triton, reference


def row_pass(backend: str):
    """(forward, backward) of the row pass for logits [C, V] (the launchers' signatures, ``launch.py``)."""
    if backend in ("cpu", "cuda"):  # the launcher picks _C or _cuda by the logits' device
        return launch.forward, launch.backward
    if backend == "cuda-emulated":
        return launch.emulated.forward, launch.emulated.backward
    if backend == "triton":
        return launch_triton.forward, launch_triton.backward
    return reference.forward, reference.backward
