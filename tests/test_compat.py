"""Private internals sit in one compat module per library (kl_kernels/_compat/, csrc/cpu/compat/),
each with a fallback that is tested here, and nowhere else in the package."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from kl_kernels import kl_penalty_loss
from kl_kernels._compat import torch as torch_compat

PACKAGE = Path(__file__).resolve().parents[1] / "kl_kernels"


def test_private_torch_apis_only_in_the_compat_module():
    pattern = re.compile(r"torch\._(?!dynamo\b|_version__)[A-Za-z]\w*")  # torch._C, torch._assert_async, ...
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        if path.parts[-2] == "_compat":
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if pattern.search(code) and not code.lstrip().startswith((">>>", "``")) and "``torch._" not in code:
                offenders.append(f"{path.relative_to(PACKAGE)}:{i}: {line.strip()}")
    assert not offenders, "private torch API outside kl_kernels/_compat:\n" + "\n".join(offenders)


def test_the_lookups_succeed_on_the_torch_under_test():
    assert torch_compat._TOP_SAVED_TENSORS_HOOKS is not None and torch_compat._KEEP_GRAPH is not None
    assert torch_compat._ASSERT_ASYNC is not None
    assert torch_compat.saved_tensors_hooks_active() is False
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        assert torch_compat.saved_tensors_hooks_active() is True


def _loss_grad():
    lp = torch.randn(3, 7, requires_grad=True)
    out = kl_penalty_loss(lp, torch.randn(3, 7), torch.randn(3), beta=0.1, clip_epsilon=0.2,
                          lengths=torch.tensor([7, 3, 0]))
    out.loss.backward()
    return lp.grad


@pytest.mark.parametrize("missing", ["_TOP_SAVED_TENSORS_HOOKS", "_KEEP_GRAPH"])
def test_autograd_fallbacks_give_the_same_gradient(monkeypatch, missing):
    torch.manual_seed(0)
    want = _loss_grad()
    monkeypatch.setattr(torch_compat, missing, None)
    assert (torch_compat.saved_tensors_hooks_active() if missing == "_TOP_SAVED_TENSORS_HOOKS"
            else torch_compat.graph_keeps_graph()) is True  # the safe answer
    torch.manual_seed(0)
    assert torch.equal(_loss_grad(), want)


def test_assert_async_fallback(monkeypatch):
    monkeypatch.setattr(torch_compat, "_ASSERT_ASYNC", None)
    torch_compat.assert_async(torch.tensor(True), "fine")
    with pytest.raises(RuntimeError, match="broken rule"):
        torch_compat.assert_async(torch.tensor(False), "broken rule")


def test_assume_constant_result_mark_and_fallback(monkeypatch):
    """The mark set without dynamo equals torch's own decorator's; without the mark (a torch before 2.1) the
    fallback is that decorator itself."""
    def probe():
        return []

    def probe2():
        return []

    want = {k: v for k, v in vars(torch.compiler.assume_constant_result(probe)).items() if not k.startswith("__")}
    assert want and torch_compat._MARKS_CONSTANTS
    ours = torch_compat.assume_constant_result(probe2)
    assert ours is probe2 and all(getattr(ours, k, None) == v for k, v in want.items())
    monkeypatch.setattr(torch_compat, "_MARKS_CONSTANTS", False)

    def probe3():
        return []

    marked = torch_compat.assume_constant_result(probe3)
    assert all(getattr(marked, k, None) == v for k, v in want.items())


def test_inductor_fallback(monkeypatch):
    import builtins
    real_import = builtins.__import__

    def no_inductor(name, *args, **kwargs):
        if name.startswith("torch._inductor"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_inductor)
    with torch_compat.inductor_caches_disabled():
        pass


# ---------------------------------------------------------------- tensordict

TD_PRIVATE = re.compile(r"\._(tensordict|is_locked|new_unsafe|maybe_names|td_dim_name)\b")


def test_private_tensordict_internals_only_in_the_compat_module():
    offenders = [f"{path.relative_to(PACKAGE)}:{i}: {line.strip()}"
                 for path in PACKAGE.rglob("*.py") if path.parts[-2] != "_compat"
                 for i, line in enumerate(path.read_text().splitlines(), 1)
                 if TD_PRIVATE.search(line.split("#", 1)[0]) and "``" not in line]
    assert not offenders, "private tensordict internal outside kl_kernels/_compat:\n" + "\n".join(offenders)


def test_tensordict_internals_and_their_fallbacks(monkeypatch):
    pytest.importorskip("tensordict")  # the `torchrl` extra
    from tensordict import LazyStackedTensorDict, TensorDict

    from kl_kernels._compat import tensordict as td_compat
    from kl_kernels.torchrl import _io

    assert td_compat.SUPPORTED  # on the tensordict CI installs (0.14.x)
    samples = [TensorDict({"lp": torch.randn(n), ("m", "a"): torch.ones(n, dtype=torch.bool)}) for n in (3, 0, 5)]
    stack = LazyStackedTensorDict(*samples, stack_dim_name="batch")
    fast = (_io.shallow_copy(stack), _io.read(stack, "lp").values, _io.sample_leaves(stack, ["lp"]))
    monkeypatch.setattr(td_compat, "SUPPORTED", False)
    assert td_compat.entries(samples[0]) is None and td_compat.entries_of(samples) is None
    assert td_compat.all_plain_unlocked(samples) and not td_compat.all_plain_unlocked([samples[0].clone().lock_()])
    assert td_compat.names_or_none(samples[0]) is None and td_compat.stack_dim_name(stack) == "batch"
    made = td_compat.new_tensordict({"x": torch.zeros(2)}, torch.Size([2]), None, None)
    assert torch.equal(made["x"], torch.zeros(2)) and made.batch_size == (2,)
    copy, values, leaves = _io.shallow_copy(stack), _io.read(stack, "lp").values, _io.sample_leaves(stack, ["lp"])
    assert leaves is None and fast[2] is not None  # the fast walk needs the internals; callers take the public API
    assert torch.equal(values, fast[1])
    for a, b in zip(copy.tensordicts, fast[0].tensordicts):
        assert a is not b and torch.equal(a["lp"], b["lp"]) and a["lp"] is b["lp"]


# ---------------------------------------------------------------- TorchRL

TRL_IMPORT = re.compile(r"from torchrl[\w.]* import (.*)")
TRL_MODULE_PRIVATE = re.compile(r"\b_(?:ppo|trl)\._[a-z]")  # a private name of an imported TorchRL module


def _imports_a_private_name(line: str) -> bool:
    m = TRL_IMPORT.search(line)
    names = [part.split(" as ")[0].strip(" ()") for part in m.group(1).split(",")] if m else []
    return any(n.startswith("_") for n in names) or bool(TRL_MODULE_PRIVATE.search(line))


def test_private_torchrl_helpers_only_in_the_compat_module():
    offenders = [f"{path.relative_to(PACKAGE)}:{i}: {line.strip()}"
                 for path in PACKAGE.rglob("*.py") if path.parts[-2] != "_compat"
                 for i, line in enumerate(path.read_text().splitlines(), 1)
                 if _imports_a_private_name(line.split("#", 1)[0])]
    assert not offenders, "private TorchRL helper outside kl_kernels/_compat:\n" + "\n".join(offenders)


def test_torchrl_lookups_succeed_and_the_fallbacks_agree(monkeypatch):
    pytest.importorskip("torchrl")  # the `torchrl` extra
    import warnings

    from tensordict import TensorDict
    from torchrl.objectives import KLPENPPOLoss

    from kl_kernels._compat import torchrl as trl_compat

    names = ("_WARN_MC_KL", "_MAYBE_GET_OR_SELECT", "_SUM_TD_FEATURES", "_BROADCAST_ADVANTAGE", "_CHECK_ADVANTAGE")
    assert all(getattr(trl_compat, n) is not None for n in names)  # on the TorchRL CI installs (0.14.1)
    assert trl_compat.missing_base_methods(KLPENPPOLoss) == []
    adv, lw = torch.randn(4, 1), torch.randn(4, 3, 1)
    td = TensorDict({"a": torch.randn(4, 2), "b": torch.randn(4)}, [4])
    feats = TensorDict({"x_log_prob": torch.randn(4), "y_log_prob": torch.randn(4)}, [4])
    want = (trl_compat.broadcast_advantage_to_log_weight(adv, lw), trl_compat.maybe_get_or_select(td, "a"),
            trl_compat.maybe_get_or_select(td, ["a", "b"]), trl_compat.sum_td_features(feats))
    for n in names:
        monkeypatch.setattr(trl_compat, n, None)
    got = (trl_compat.broadcast_advantage_to_log_weight(adv, lw), trl_compat.maybe_get_or_select(td, "a"),
           trl_compat.maybe_get_or_select(td, ["a", "b"]), trl_compat.sum_td_features(feats))
    assert torch.equal(got[0], want[0]) and got[0].shape == (4, 3, 1) and torch.equal(got[1], want[1])
    assert set(got[2].keys()) == set(want[2].keys()) == {"a", "b"} and torch.equal(got[3], want[3])
    assert trl_compat.broadcast_advantage_to_log_weight(adv, torch.randn(4, 1)) is adv
    trl_compat.check_advantage_broadcast(adv, torch.randn(4, 1))
    with pytest.raises(ValueError, match="outer product"):
        trl_compat.check_advantage_broadcast(torch.randn(4), torch.randn(4, 1))
    p, q = torch.distributions.Normal(0.0, 1.0), torch.distributions.Laplace(0.0, 1.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trl_compat.warn_mc_kl(p, q)
        trl_compat.warn_mc_kl(p, q)  # once per pair of types
    assert len([w for w in caught if "Monte Carlo" in str(w.message)]) == 1


def test_torchrl_gate_names_what_a_torchrl_lacks():
    from kl_kernels._compat import torchrl as trl_compat

    class Lacking:
        def _log_weight(self):
            pass

    missing = trl_compat.missing_base_methods(Lacking)
    assert "_log_weight" not in missing and "_get_cur_log_prob" in missing and "_AcceptedKeys" in missing


# ---------------------------------------------------------------- the C++ extension's compat headers

CSRC = PACKAGE.parent / "csrc"
_CPP_PRIVATE = ("_PyType_Lookup", "__dlpack_c_exchange_api__", "GOMP_parallel", "dl_iterate_phdr", '"_tensordict"',
                '"_is_locked"')


def test_private_cpp_internals_only_in_the_compat_folder():
    offenders = []
    for path in CSRC.rglob("*"):
        if path.suffix not in (".h", ".cpp", ".cu", ".cuh") or "compat" in path.parts:
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("//", 1)[0]
            offenders += [f"{path.relative_to(CSRC)}:{i}: {name}" for name in _CPP_PRIVATE if name in code]
    assert not offenders, "private internals outside csrc/cpu/compat/:\n" + "\n".join(offenders)


def test_private_cpp_paths_are_in_use_here():
    from kl_kernels import _extensions
    module = _extensions.load("_C")[0]
    if module is None:
        pytest.skip("kl_kernels._C is not built")
    paths = module.compat_paths(torch.Tensor)
    assert paths == {"cpython_type_lookup": True, "dlpack_exchange": True, "openmp_gomp_parallel": True}, paths


_FALLBACK_RUN = """
import torch
from kl_kernels import _extensions, kl_reward, kl_penalty_loss
paths = _extensions.load("_C")[0].compat_paths(torch.Tensor)
assert not any(paths.values()), paths
g = torch.Generator().manual_seed(0)
lists = [torch.randn(n, generator=g) for n in (0, 1, 700, 33)]
refs = [torch.randn(n, generator=g) for n in (0, 1, 700, 33)]
dense = torch.randn(4, 50, generator=g), torch.randn(4, 50, generator=g)
for threads in (1, 2):
    torch.set_num_threads(threads)
    got = kl_reward(lists, refs, [t * 0 + 1 for t in lists], coef=0.1, estimator="k3")
    want = kl_reward(lists, refs, [t * 0 + 1 for t in lists], coef=0.1, estimator="k3", backend="torch")
    for a, b in zip(got.kl + got.reward, want.kl + want.reward):
        torch.testing.assert_close(a, b)
    got = kl_reward(*dense, lengths=torch.tensor([50, 0, 7, 1]), coef=torch.tensor(0.2))
    want = kl_reward(*dense, lengths=torch.tensor([50, 0, 7, 1]), coef=torch.tensor(0.2), backend="torch")
    torch.testing.assert_close(got.kl, want.kl)
    lp = dense[0].clone().requires_grad_()
    out = kl_penalty_loss(lp, dense[1], torch.randn(4), clip_epsilon=0.2, lengths=torch.tensor([50, 0, 7, 1]))
    out.loss.backward()
print("FALLBACKS OK")
"""


def test_cpp_fallbacks_give_the_same_answers():
    """With every private path off (KL_KERNELS_COMPAT_FALLBACKS), the list reads and the thread pool
    still give the reference's answers."""
    import os
    import subprocess
    import sys
    from kl_kernels import _extensions
    if _extensions.load("_C")[0] is None:
        pytest.skip("kl_kernels._C is not built")
    env = dict(os.environ, KL_KERNELS_COMPAT_FALLBACKS="cpython,dlpack,openmp")
    proc = subprocess.run([sys.executable, "-c", _FALLBACK_RUN], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "FALLBACKS OK" in proc.stdout, proc.stderr[-3000:]
