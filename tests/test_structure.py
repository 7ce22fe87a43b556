"""Design convention 2: the ops are siblings above a shared core.

* The shared modules below the ops (dispatch, self-check machinery, call plans, launching, checks, codes,
  layouts, ragged batches...) import no op, at module level or inside a function (``backends.py`` once
  reached every op through ``selfcheck.py``, an 18-file cycle that function-level imports hid, and
  ``full_estimator.py`` imported ``full_kl``): each op hands its own self-check to the core instead.
* An op imports another op only through that op's public package names (``from ..full_kl import
  full_kl``, ``estimator="full"``'s lower op), never its modules (the Triton loss kernels imported the
  reward kernels' private ``_frame``/``_coef``/``_combine_rows`` until a fresh reader noticed, 2026-11-26),
  and the ops' import graph has no cycle.
* The core has no cycle either, and its lowest modules stand in floors (:data:`FLOORS`): the ground (codes,
  extension loading, torch's internals), the value checks as one layer of three (the error word, where a
  check runs and its deferral, the index checks), then the ragged layouts that validate through them, the
  layout rules, and the launchers and argument checks on top. A module imports only from floors below its
  own (``device_errors`` -> ``value_checks`` -> ``launching`` -> ``ragged`` -> ``device_errors`` was a
  four-file circle of function-level imports until issue 64).

Imports are read with ``ast`` from every module, function-level ones included."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "kl_kernels"
OPS = ("kl_reward", "kl_penalty", "token_logprobs", "full_kl")
# The shared core: modules no op owns, which the ops build on.
CORE = ("backends", "selfcheck", "plans", "launching", "launching_triton", "_checks", "codes", "layouts", "ragged",
        "device_errors", "value_checks", "index_checks",
        "reference_math", "_extensions", "full_estimator", "vocab_rows", "lm_head", "version", "_compat",
        "triton.tiles", "triton.kl_math", "triton.row_math", "triton")
# (not the core: the tools above the ops, which reach every op: cli.py, _info.py, bench/, triton/aot.py)
# The floors of the core's lowest modules, from the ground up: a module imports from these only what stands on
# a lower floor (imports of other modules are not ruled here; the core as a whole must only have no cycle).
FLOORS = (
    ("codes", "_extensions", "version", "_compat"),  # import nothing of kl_kernels
    ("device_errors",),  # the error word a device's kernels record a bad value into, and its messages
    ("value_checks",),  # where and when a value check runs (host, a check kernel, deferred), check_errors
    ("index_checks",),  # the checks of offsets and lengths
    ("ragged",),  # the canonical ragged form and its converters (which validate through index_checks)
    ("layouts",),  # the ops' shared layout rules
    ("launching", "launching_triton", "_checks"),  # the launchers' machinery, the shared argument checks
)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> list[tuple[str, tuple[str, ...], int]]:
    """(module imported, names imported from it, line) of every import in ``path``, relative ones resolved."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(a.name, (), node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")
            if node.level:
                base = base[:len(base) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            names = tuple(a.name for a in node.names)
            found.append((module, names, node.lineno))
            # `from . import x`: x may be a submodule
            found += [(f"{module}.{n}", (), node.lineno) for n in names]
    return found


def _op_of(module: str) -> str | None:
    """The op a module belongs to (its package, or its Triton kernels ``kl_kernels/triton/<op>.py``)."""
    parts = module.split(".")
    if parts[0] != "kl_kernels" or len(parts) < 2:
        return None
    if parts[1] in OPS:
        return parts[1]
    if parts[1] == "triton" and len(parts) > 2 and parts[2] in OPS:
        return parts[2]
    return None


def _modules():
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _core_modules():
    out = {}
    for name, path in _modules().items():
        rel = name.removeprefix("kl_kernels.")
        if any(rel == c or (c == "_compat" and rel.startswith("_compat.")) for c in CORE) and _op_of(name) is None:
            out[name] = path
    return out


def test_the_core_list_names_real_modules():
    names = {n.removeprefix("kl_kernels.") for n in _modules()}
    assert all(c in names or any(n.startswith(c + ".") for n in names) for c in CORE)


@pytest.mark.parametrize("module", sorted(_core_modules()))
def test_a_shared_module_imports_no_op(module):
    path = _core_modules()[module]
    offenders = [f"{path.relative_to(PACKAGE)}:{line}: {imported}" for imported, _, line in _imports(path)
                 if _op_of(imported)]
    assert not offenders, f"{module} (shared, below the ops) imports an op:\n" + "\n".join(offenders)


def _op_edges():
    """{(op, other op): [(file:line, imported module, names)]} over every module of every op."""
    edges = {}
    for name, path in _modules().items():
        op = _op_of(name)
        if op is None:
            continue
        for imported, names, line in _imports(path):
            other = _op_of(imported)
            if other and other != op:
                edges.setdefault((op, other), []).append((f"{path.relative_to(PACKAGE)}:{line}", imported, names))
    return edges


def test_an_op_uses_another_only_through_its_public_package():
    import importlib

    offenders = []
    for (op, other), uses in _op_edges().items():
        public = set(importlib.import_module(f"kl_kernels.{other}").__all__)
        for where, imported, names in uses:
            if imported != f"kl_kernels.{other}" or not set(names) <= public:
                if imported.startswith(f"kl_kernels.{other}.") and imported.rpartition(".")[2] in public:
                    continue  # (the `from ..full_kl import full_kl` pair read as a submodule too)
                offenders.append(f"{where}: {op} imports {imported} {names}")
    assert not offenders, "an op reaches into another op's modules:\n" + "\n".join(offenders)


def test_no_cycle_among_the_ops():
    graph = {op: set() for op in OPS}
    for op, other in _op_edges():
        graph[op].add(other)
    state = {}

    def visit(op, path):
        if state.get(op) == "done":
            return
        assert state.get(op) != "open", f"import cycle among the ops: {' -> '.join(path + [op])}"
        state[op] = "open"
        for other in sorted(graph[op]):
            visit(other, path + [op])
        state[op] = "done"
    for op in OPS:
        visit(op, [])


def _floor_of(module: str) -> int | None:
    rel = module.removeprefix("kl_kernels.")
    top = rel.split(".")[0]
    return next((i for i, floor in enumerate(FLOORS) if rel in floor or top in floor), None)


def test_the_floors_name_real_modules():
    names = {n.removeprefix("kl_kernels.") for n in _modules()}
    assert all(m in names for floor in FLOORS for m in floor)


def test_the_core_floors_import_only_downward():
    """A module of :data:`FLOORS` imports (at module level or in a function) only modules of lower floors
    among them: the value checks stay one layer between the ground and the layouts and launchers."""
    offenders = []
    for name, path in _modules().items():
        floor = _floor_of(name)
        if floor is None:
            continue
        for imported, _, line in _imports(path):
            other = _floor_of(imported)
            if other is not None and other >= floor and imported.split(".")[:2] != name.split(".")[:2]:
                offenders.append(f"{path.relative_to(PACKAGE)}:{line}: {name} (floor {floor}) imports "
                                 f"{imported} (floor {other})")
    assert not offenders, "a core module imports from its own floor or above:\n" + "\n".join(offenders)


def _core_edges():
    """{core module: {core modules it imports}} (function-level imports included)."""
    core = _core_modules()
    edges = {name: set() for name in core}
    for name, path in core.items():
        for imported, _, _ in _imports(path):
            if imported in core and imported != name:
                edges[name].add(imported)
    return edges


def test_no_cycle_among_the_core_modules():
    graph, state = _core_edges(), {}

    def visit(module, path):
        if state.get(module) == "done":
            return
        assert state.get(module) != "open", f"import cycle in the core: {' -> '.join(path + [module])}"
        state[module] = "open"
        for other in sorted(graph[module]):
            visit(other, path + [module])
        state[module] = "done"
    for module in sorted(graph):
        visit(module, [])


def test_the_graph_check_finds_a_cycle_and_a_core_import(tmp_path, monkeypatch):
    """Negative control: the checks above fail on a package that has what they forbid."""
    pkg = tmp_path / "kl_kernels"
    for sub in ("kl_reward", "full_kl"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("__all__ = []\n")
    (pkg / "__init__.py").write_text("")
    (pkg / "kl_reward" / "api.py").write_text("def f():\n    from ..full_kl import api\n")
    (pkg / "full_kl" / "api.py").write_text("from ..kl_reward.api import f\n")
    (pkg / "backends.py").write_text("def g():\n    from .kl_reward import api\n")
    # the circle of issue 64, each import in a function: the floors and the core's cycle check must both see it
    (pkg / "device_errors.py").write_text("def f():\n    from . import value_checks\n")
    (pkg / "value_checks.py").write_text("from . import device_errors\ndef f():\n    from .launching import x\n")
    (pkg / "launching.py").write_text("from . import value_checks\n")
    monkeypatch.setattr(__import__(__name__), "PACKAGE", pkg, raising=False)
    globals_ = globals()
    old = globals_["PACKAGE"]
    globals_["PACKAGE"] = pkg
    try:
        assert ("kl_reward", "full_kl") in _op_edges() and ("full_kl", "kl_reward") in _op_edges()
        with pytest.raises(AssertionError, match="import cycle"):
            test_no_cycle_among_the_ops()
        with pytest.raises(AssertionError, match="imports an op"):
            test_a_shared_module_imports_no_op("kl_kernels.backends")
        with pytest.raises(AssertionError, match="import cycle in the core: kl_kernels.device_errors -> "
                                                 "kl_kernels.value_checks -> kl_kernels.device_errors"):
            test_no_cycle_among_the_core_modules()
        with pytest.raises(AssertionError, match=r"device_errors \(floor 1\) imports kl_kernels.value_checks"):
            test_the_core_floors_import_only_downward()
    finally:
        globals_["PACKAGE"] = old
