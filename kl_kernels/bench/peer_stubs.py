"""Stand-ins for absent packages while a peer module is imported (verl, OpenRLHF, TRL name ray, vllm,
deepspeed, transformers... at import time; none of them is called by the math we run or compare against).

``stubbed(roots)`` makes the missing ones of ``roots`` importable as stubs while its body runs, then forgets
them: a stub is made only for a top-level package that is NOT importable (a really installed package is always
used as it is), and stubs live in ``sys.modules`` only while the body runs, so the peer keeps the references it
bound while later ``importlib.util.find_spec("ray")`` or ``import transformers`` elsewhere in the process still
see the package absent. Used by ``kl_kernels.bench.hidden_states`` (verl's fused kernel) and the peer tests
(``tests/peers.py``).
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types



class _StubMeta(type):
    """Metaclass of stub classes: any class attribute is another stub class (`ray.actor.ActorHandle`),
    and they survive the class-level expressions that module bodies run on imported names: `X[int]`,
    `X | None`, `Base._FIELDS + [...]` (TRL's GRPOConfig), iteration."""

    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _StubMeta(name, (_Stub,), {"__module__": cls.__module__})

    def __getitem__(cls, item):
        return cls

    def __or__(cls, other):
        return cls

    __ror__ = __or__

    def __add__(cls, other):
        return other

    __radd__ = __add__

    def __iter__(cls):
        return iter(())


class _Stub(metaclass=_StubMeta):
    """A stand-in for any class or function of a stubbed module. It can be subclassed (`class Actor(nn.Module,
    PreTrainedModel)` style bases), instantiated and called with any arguments (decorators such as
    `@ray.remote(...)` run at import time), and its instances are falsy, so `if is_peft_available():` style
    probes that return a stub take the "not installed" branch."""

    def __init__(self, *args, **kwargs):
        pass

    def __call__(self, *args, **kwargs):
        return _Stub()

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Stub()

    def __bool__(self):
        return False


class _StubModule(types.ModuleType):
    """A stubbed (sub)module: every public attribute is a stub class, made once per name so that
    `from x import A` twice gives the same class. It is a package (__path__), so `import x.y.z` works;
    `__version__` is "0.0.0" for the `Version(pkg.__version__) >= ...` checks that module bodies run."""

    def __init__(self, name):
        super().__init__(name)
        self.__path__ = []
        self.__version__ = "0.0.0"

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        stub = _StubMeta(name, (_Stub,), {"__module__": self.__name__})
        setattr(self, name, stub)
        return stub


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves `root` and `root.anything` with a _StubModule, for the given missing roots only."""

    def __init__(self, roots):
        self.roots = frozenset(roots)

    def find_spec(self, fullname, path=None, target=None):
        if fullname.partition(".")[0] in self.roots:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        return _StubModule(spec.name)

    def exec_module(self, module):
        pass


def _missing(roots):
    """The top-level packages among `roots` that cannot be imported here."""
    return [r for r in roots if r not in sys.modules and importlib.util.find_spec(r) is None]


@contextlib.contextmanager
def stubbed(roots):
    """Make the missing ones of `roots` importable as stubs while the body runs, then forget them."""
    missing = _missing(roots)
    if not missing:
        yield
        return
    finder = _StubFinder(missing)
    sys.meta_path.append(finder)  # last: a real finder always wins (none can find these roots anyway)
    try:
        yield
    finally:
        sys.meta_path.remove(finder)
        for name in [n for n in sys.modules if n.partition(".")[0] in finder.roots]:
            del sys.modules[name]
