"""The ops' ``torch.library`` registration: each op's forward and backward defined on the ``kl_kernels``
library from a typed Python function, as ``torch.library.custom_op`` defines them (the schema inferred from the
annotations by ``torch.library.infer_schema``, no mutated arguments, ``pt2_compliant``), with the function
registered directly at the dispatch keys of its devices, its fake implementation and its autograd formula
through ``torch.library.register_fake`` / ``register_autograd``.

Why not ``custom_op`` itself: its Python layers around the kernel (argument binding, per-call output checks)
cost more than the launch they wrap. Measured on the 2-core CI VM (torch 2.13.0+cpu, one thread), a call of an
op with kl_reward's 17 arguments whose kernel takes 5.0 us: 16.8 us through ``custom_op``, 9.1 us registered
this way (``python -m kl_kernels.bench.per_call``'s rows inside ``torch.compile`` pay it on every call; issue 49
item 3). Shared machinery: it imports no op; each op's ``ops.py`` defines its ops here.

Example::

    def scale(x: Tensor, s: float) -> Tensor:
        return x * s
    op = define("kl_kernels::scale_example", scale, device_types=("cpu", "cuda"))
    op.register_fake(lambda x, s: torch.empty_like(x))
    op(torch.ones(2), 3.0)  # torch.ops.kl_kernels.scale_example.default
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

LIB = torch.library.Library("kl_kernels", "FRAGMENT")
_KEYS = {"cpu": "CPU", "cuda": "CUDA"}


class Op:
    """A defined op: call it as the function it wraps (through the dispatcher: ``torch.ops.kl_kernels.<name>``),
    and give it a fake implementation and an autograd formula as a ``custom_op`` takes them.

    An op with an autograd formula has a twin without one, ``<name>_nograd`` (the same function, devices and
    fake), which a call takes when no tensor argument requires grad or grad mode is off: the Python autograd
    layer of ``register_autograd`` (a redispatch below autograd, ~5 us a call with 17 arguments on the CI VM)
    then runs for the calls that build a graph only. Inside ``torch.compile`` the choice is made while tracing
    (dynamo guards on ``requires_grad``), so a compiled graph without gradients calls the twin."""

    def __init__(self, qualname: str, fn: Callable, device_types: str | Sequence[str] | None = None):
        namespace, name = qualname.split("::")
        if namespace != "kl_kernels":
            raise ValueError(f"{qualname}: the ops of this library are kl_kernels::<name>")
        self.qualname, self.fn, self.device_types = qualname, fn, device_types
        self.default = _define(name, fn, device_types)
        self.nograd = self.default  # until an autograd formula is registered
        self.fake = None

    def __call__(self, *args):
        if self.nograd is not self.default and torch.is_grad_enabled():
            for a in args:  # (a loop, not any(): no generator frame per call)
                if type(a) is torch.Tensor and a.requires_grad:
                    return self.default(*args)
        return self.nograd(*args)

    def register_fake(self, fn: Callable) -> Callable:
        """``fn`` gives the outputs' shapes, dtypes and devices without running anything (usable as a decorator)."""
        torch.library.register_fake(self.qualname, fn, lib=LIB)
        if self.nograd is not self.default:
            torch.library.register_fake(self.qualname + "_nograd", fn, lib=LIB)
        self.fake = fn
        return fn

    def register_autograd(self, backward: Callable, *, setup_context: Callable) -> None:
        """The op's backward formula, as ``torch.library.register_autograd`` takes it (and the twin without it)."""
        if self.nograd is self.default:
            self.nograd = _define(self.qualname.split("::")[1] + "_nograd", self.fn, self.device_types)
            if self.fake is not None:
                torch.library.register_fake(self.qualname + "_nograd", self.fake, lib=LIB)
        torch.library.register_autograd(self.qualname, backward, setup_context=setup_context, lib=LIB)


def _define(name: str, fn: Callable, device_types):
    """The op `kl_kernels::<name>` around `fn` at its devices' dispatch keys; its default overload."""
    LIB.define(name + torch.library.infer_schema(fn, mutates_args=()), tags=(torch.Tag.pt2_compliant_tag,))
    if device_types is None:  # every device: as custom_op with device_types=None
        keys = ["CompositeExplicitAutograd"]
    else:
        keys = [_KEYS[d] for d in ((device_types,) if isinstance(device_types, str) else device_types)]
    for key in keys:
        LIB.impl(name, fn, key)
    return getattr(torch.ops.kl_kernels, name).default


def define(qualname: str, fn: Callable | None = None, *, device_types: str | Sequence[str] | None = None):
    """:class:`Op` ``qualname`` around ``fn``; without ``fn``, a decorator (as ``torch.library.custom_op``)."""
    if fn is None:
        return lambda f: Op(qualname, f, device_types)
    return Op(qualname, fn, device_types)
