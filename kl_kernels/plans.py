"""Call plans: what an op's validator decided about one call signature, reused while its guards hold.

An eager call of an op is validated by its ``problem.py`` (the one place of each argument rule), then
dispatched and launched: ~250-450 Python-level calls, 50-110 us on a 2-core CPU, most of it spent
re-deriving the same decisions for a training loop's identical calls. Like ``torch.compile``'s guards,
an op keeps those decisions per **signature**: the options' values (and the types of those whose
``==`` does not tell types apart: ``True == 1 == 1.0``), and per tensor argument its dtype, device,
shape, strides, ``requires_grad``, negative bit, nestedness and layout (:func:`facts`), plus the
grad mode and the ``KL_KERNELS_BACKEND`` override. The validator builds the plan on first sight, from
a call it has checked in full; a later call with an equal signature runs the plan, which repeats only
what depends on the values (offsets and lengths within bounds, finite coefficients, buffers that do
not overlap: checks of ``problem.py``, called from the plan) and the launch itself.

No plan is made under ``torch.compile`` (the graph is the plan), for tensor subclasses, lists or
nested tensors, or for argument types whose values a signature would not capture (the general path
takes those, every call). :func:`clear` forgets every plan (the self-check verdicts changed, a test
swapped a registry); each plan also remembers the backend registry it was dispatched against and is
ignored once the op's registry object is another.
"""

from __future__ import annotations

import os
import threading

import torch

ENV_VAR = "KL_KERNELS_BACKEND"  # (backends.py's override: read per call, so a change takes effect)
MAX_PLANS = 256  # per op: a loop has a handful of signatures; beyond this the cache starts over

_CACHES: list["PlanCache"] = []
_LOCK = threading.Lock()


def facts(*args) -> tuple:
    """The signature of the arguments ``args``: ``None``, a plain tensor's facts (dtype, device, shape,
    strides, requires_grad, negative bit, nested, layout), or the type of anything else (its value is
    not part of the signature: a plan takes such an argument only when it re-checks its value per
    call, like a float coefficient). Two Python-level calls per tensor."""
    return tuple([None if x is None else
                  (x.dtype, x.device, x.shape, x.stride(), x.requires_grad, x.is_neg(), x.is_nested, x.layout)
                  if type(x) is torch.Tensor and not x.is_nested else type(x) for x in args])


def environment() -> str | None:
    """The backend override as the dispatcher reads it (part of every signature)."""
    return os.environ.get(ENV_VAR)


# The same read in one call where CPython's os.environ keeps its mapping in ``_data`` (updated by every
# os.environ assignment and deletion, monkeypatch.setenv's included): the ops read ENVIRON.get(ENV_KEY)
# per call, 1 Python-level call instead of 5. Elsewhere, os.environ itself.
try:
    ENVIRON, ENV_KEY = os.environ._data, os.environ.encodekey(ENV_VAR)
    if not isinstance(ENVIRON, dict):
        raise AttributeError
except AttributeError:  # pragma: no cover (another Python's os.environ)
    ENVIRON, ENV_KEY = os.environ, ENV_VAR


# What a signature may hold: values and the types of arguments (a plan cache is module state, so whatever
# its keys reference lives as long as the process). An object among the options (a process group, a
# tensor-valued count) would be kept alive by the cache: a ProcessGroup past destroy_process_group, torn
# down at interpreter exit after gloo's threads (std::terminate, seen on torch 2.15.0), or a CUDA tensor.
_PLAIN = (type(None), bool, int, float, str, type, torch.dtype, torch.device, torch.layout)


def plain(key) -> bool:
    """Whether ``key`` holds only plain values (tuples of them included): a key the cache may keep.
    Checked once per signature, when its first call stores a plan (or its absence)."""
    if type(key) in (tuple, torch.Size):
        return all(plain(k) for k in key)
    return type(key) in _PLAIN


class Unplanned:
    """The entry of a signature whose calls take the general path: no plan is attempted for it again
    (while the op's registry is ``registry``)."""

    __slots__ = ("registry",)

    def __init__(self, registry):
        self.registry = registry


class PlanCache:
    """An op's plans by signature (a dict; bounded, thread-safe for its single reads and writes)."""

    def __init__(self, op: str):
        self.op = op
        self.plans: dict = {}
        with _LOCK:
            _CACHES.append(self)

    def get(self, key):
        """The plan of ``key`` or None (also for an unhashable key: such calls are never planned)."""
        try:
            return self.plans[key]
        except (KeyError, TypeError):
            return None

    def put(self, key, plan) -> None:
        """Keep ``plan`` for ``key``, unless the key holds an object (see :func:`plain`): such calls take
        the general path every time."""
        if not plain(key):
            return
        if len(self.plans) >= MAX_PLANS:
            self.plans.clear()
        self.plans[key] = plan

    def clear(self) -> None:
        self.plans.clear()


def clear() -> None:
    """Forget every op's plans (the next call of each signature is validated in full again)."""
    with _LOCK:
        caches = list(_CACHES)
    for cache in caches:
        cache.clear()
