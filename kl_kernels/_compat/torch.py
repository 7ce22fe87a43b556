"""torch's private Python APIs that kl_kernels uses, each with a safe fallback.

Checked on torch 2.11.0, 2.13.0, 2.14.1 and 2.15.0 (CI: the whole suite on 2.13.0, .ci/torch-versions on the
others; each internal below is present on all four). Each lookup happens once, at import; a torch without the
internal gets the fallback, which is always correct and at worst slower:

* ``saved_tensors_hooks_active()``: whether a ``torch.autograd.graph.saved_tensors_hooks`` context is
  active (``torch._C._autograd._top_saved_tensors_default_hooks``). Fallback: ``True`` (assume hooks:
  the loss then never hands its gradient buffer to autograd in place).
* ``graph_keeps_graph()``: whether the running backward retains its graph
  (``torch._C._autograd._get_current_graph_task_keep_graph``). Fallback: ``True`` (same effect).
* ``assert_async(ok, message)``: a device-side assertion without a host sync (``torch._assert_async``).
  Fallback: read ``ok`` on the host and raise ``RuntimeError`` (correct, one synchronization).
* ``assume_constant_result(fn)``: ``torch.compiler.assume_constant_result`` without importing
  ``torch._dynamo`` at import time (1-2 s of ``import kl_kernels``): on the torches checked, that decorator
  only sets dynamo's mark ``fn._dynamo_marked_constant = True``, read when dynamo traces a call to ``fn``
  (tests/test_import.py holds our mark to the decorator's own on the torch it runs). Fallback, on a torch
  older than 2.1 (before that mark): torch's decorator itself (dynamo imported at import time: slower only).
* ``inductor_caches_disabled()``: a context with Inductor's caches off, for cold-compile timing
  (``torch._inductor.config.patch``). Fallback: a no-op context (the bench then reports a warm figure
  as cold, and says so in its notes).
"""

from __future__ import annotations

import contextlib

import torch

CHECKED_ON = ("2.11.0", "2.13.0", "2.14.1", "2.15.0")

_autograd = getattr(torch._C, "_autograd", None)
_TOP_SAVED_TENSORS_HOOKS = getattr(_autograd, "_top_saved_tensors_default_hooks", None)
_KEEP_GRAPH = getattr(_autograd, "_get_current_graph_task_keep_graph", None)
_ASSERT_ASYNC = getattr(torch, "_assert_async", None)
# torch.compiler.assume_constant_result only sets this mark from 2.1 on
_MARKS_CONSTANTS = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 1)


def saved_tensors_hooks_active() -> bool:
    if _TOP_SAVED_TENSORS_HOOKS is None:
        return True
    return _TOP_SAVED_TENSORS_HOOKS(True) is not None


def graph_keeps_graph() -> bool:
    if _KEEP_GRAPH is None:
        return True
    return bool(_KEEP_GRAPH())


def assert_async(ok: torch.Tensor, message: str) -> None:
    if _ASSERT_ASYNC is not None:
        _ASSERT_ASYNC(ok, message)
        return
    if not bool(ok):
        raise RuntimeError(message)


def assume_constant_result(fn):
    if _MARKS_CONSTANTS:
        fn._dynamo_marked_constant = True
        return fn
    return torch.compiler.assume_constant_result(fn)


def inductor_caches_disabled():
    try:
        from torch._inductor import config
        return config.patch(force_disable_caches=True)
    except (ImportError, AttributeError):
        return contextlib.nullcontext()
