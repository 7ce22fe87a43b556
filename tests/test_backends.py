"""Backend declarations, dispatch, the KL_KERNELS_BACKEND override, info(), extension loading."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import kl_kernels
from kl_kernels import BackendUnavailableError, kl_reward
from kl_kernels.kl_reward.backends import REGISTRY

LP = -torch.rand(2, 4)
REF = -torch.rand(2, 4)


def test_info_reports_every_backend_with_reasons():
    info = kl_kernels.info()
    assert set(info["backends"]) == {"torch", "cpu", "cuda", "triton", "cuda-emulated"}
    for name, b in info["backends"].items():
        assert isinstance(b["available"], bool)
        assert (b["reason"] is None) == b["available"], name  # unavailable always says why
    assert info["backends"]["torch"]["available"]
    assert info["version"] == kl_kernels.__version__ and info["torch"] == torch.__version__
    json.dumps(info)  # plain data: the CLI prints it


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the explanation on a machine without CUDA")
def test_info_explains_why_cuda_is_unavailable_here():
    reason = kl_kernels.info()["backends"]["cuda"]["reason"]
    assert "CPU-only build" in reason or "no CUDA device" in reason


def test_compiled_extension_loads_and_probes():
    report = kl_kernels.info()["extensions"]["_C"]
    assert report["loaded"], report
    assert report["cplusplus"] >= 201703 and report["abi_version"] == 1


@pytest.mark.parametrize("name", ["cpu", "cuda", "triton"])
def test_explicit_unavailable_backend_raises_with_every_reason(name):
    backend = next(b for b in REGISTRY if b.name == name)
    reasons = backend.unavailable_reasons()
    if not reasons and name != "cuda":
        pytest.skip(f"{name} is available in this build")
    with pytest.raises(BackendUnavailableError) as err:
        kl_reward(LP, REF, backend=name)
    for reason in reasons:
        assert reason in str(err.value)
    if name in ("cuda", "triton"):
        assert "inputs are on cpu" in str(err.value)


def test_float64_is_declared_for_torch_only():
    for backend in REGISTRY:
        assert (torch.float64 in backend.dtypes) == (backend.name == "torch")
    out = kl_reward(LP.double(), REF.double())  # auto falls through to torch
    assert out.kl.dtype == torch.float64


def test_auto_falls_back_to_torch_and_explicit_torch_works():
    a = kl_reward(LP, REF)
    b = kl_reward(LP, REF, backend="torch")
    assert torch.equal(a.kl, b.kl)


def test_accepts_agrees_with_the_reasons():
    """"auto" asks Backend.accepts (no messages built); the reasons it stands for must agree on
    every backend, for problems each backend runs and declines (dtype, mixed dtypes, lists, mask_nan,
    a token limit, the device)."""
    from dataclasses import replace

    from kl_kernels.kl_reward.problem import build_problem
    lists = [-torch.rand(n) for n in (3, 0, 5)]
    cases = [((LP, REF), {}), ((LP.double(), REF.double()), {}), ((LP, REF.half()), {}),
             ((lists, [t.clone() for t in lists]), {}), ((LP, REF), {"mask_nan": True}),
             ((lists, lists), {"mask_nan": True})]
    problems = []
    for args, kw in cases:
        options = dict(coef=1.0, estimator="k1", mask=None, offsets=None, lengths=None, padding_side="left",
                       prompt_lens=None, reward_placement="auto", clamp_input=None, clamp_output=None,
                       return_ref=False, detach=True, mask_nan=False)
        problems.append(build_problem(*args, None, **{**options, **kw})[0])
    assert {p.layout for p in problems} == {"padded", "list"}
    meta = replace(problems[0], log_probs=LP.to("meta"))  # a device no backend runs
    for backend in REGISTRY + [replace(REGISTRY[-1], max_tokens=5)]:
        for problem in problems + [meta]:
            assert backend.accepts(problem) == (not backend.rejection_reasons(problem)), (backend.name, problem)
            assert backend.accepts(problem, auto=True) == (not backend.auto_rejection_reasons(problem))


def test_env_override(monkeypatch):
    monkeypatch.setenv("KL_KERNELS_BACKEND", "torch")
    kl_reward(LP, REF)
    monkeypatch.setenv("KL_KERNELS_BACKEND", "cuda")
    with pytest.raises(BackendUnavailableError, match=r"backend 'cuda' \(from KL_KERNELS_BACKEND\)"):
        kl_reward(LP, REF)
    kl_reward(LP, REF, backend="torch")  # an explicit argument beats the environment
    monkeypatch.setenv("KL_KERNELS_BACKEND", "fortran")
    with pytest.raises(ValueError, match="environment variable KL_KERNELS_BACKEND must be one of"):
        kl_reward(LP, REF)


_BLOCKER = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name in {names!r}:
            {action}
        return None
sys.meta_path.insert(0, Block())
import kl_kernels, json, torch
out = kl_kernels.kl_reward(torch.zeros(1, 2), torch.zeros(1, 2))
print(json.dumps({{k: v["reason"] for k, v in kl_kernels.info()["backends"].items()}}))
"""


@pytest.mark.parametrize("action, expect", [
    ("raise ModuleNotFoundError(name, name=name)", "is not built"),
    ("raise OSError('libcudart.so.13: cannot open shared object file')", "failed to load: OSError"),
], ids=["missing", "broken"])
def test_import_survives_missing_or_broken_extensions(action, expect):
    """`import kl_kernels` never fails because _C or _cuda is missing or cannot load."""
    code = _BLOCKER.format(names={"kl_kernels._C", "kl_kernels._cuda"}, action=action)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    reasons = json.loads(res.stdout.strip().splitlines()[-1])
    assert expect in reasons["cpu"] and expect in reasons["cuda"] and reasons["torch"] is None


@pytest.fixture
def cpu_as_gpu_only():
    """The cpu backend (available here) declared GPU-only for one test, in both ops' registries: a
    stand-in for cuda and triton on a machine where those cannot run."""
    import dataclasses

    from kl_kernels.kl_penalty.backends import REGISTRY as LOSS_REGISTRY

    if any(b.name == "cpu" and b.unavailable_reasons() for b in REGISTRY):
        pytest.skip("the cpu backend (kl_kernels._C) is not built")
    saved = []
    for registry in (REGISTRY, LOSS_REGISTRY):
        i = next(i for i, b in enumerate(registry) if b.name == "cpu")
        saved.append((registry, i, registry[i]))
        registry[i] = dataclasses.replace(registry[i], devices=frozenset({"cuda"}))
    yield
    for registry, i, row in saved:
        registry[i] = row


def test_an_empty_list_without_a_device_runs_on_a_gpu_backend(cpu_as_gpu_only):
    """An empty list and no other tensor: no device and nothing to compute. A GPU backend named for
    it answers with empty CPU outputs (the H200 run: kl_reward([], [], backend="cuda") raised
    "inputs are on cpu"); the same backend still refuses CPU tensors that hold a sequence."""
    from kl_kernels import kl_penalty_loss

    out = kl_reward([], [], backend="cpu", return_ref=True)
    assert out.kl == [] and out.kl_sum.shape == (0,) and out.count.shape == (0,) and out.kl_sum.device.type == "cpu"
    loss = kl_penalty_loss([], [], [], backend="cpu")
    assert loss.num_tokens == 0
    # (with clamp_input too, as when a C fast path took the plain calls past the registry)
    with pytest.raises(BackendUnavailableError, match="inputs are on cpu"):
        kl_reward([torch.zeros(2)], [torch.zeros(2)], clamp_input=(-50, 50), backend="cpu")
    with pytest.raises(BackendUnavailableError, match="inputs are on cpu"):
        kl_reward(torch.zeros(0), torch.zeros(0), offsets=torch.zeros(1, dtype=torch.int64), clamp_input=(-50, 50),
                  backend="cpu")
    with pytest.raises(BackendUnavailableError, match="inputs are on cpu"):
        kl_penalty_loss(torch.zeros(0), torch.zeros(0), torch.zeros(0), offsets=torch.zeros(1, dtype=torch.int64),
                        backend="cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the explanation on a machine without CUDA")
def test_an_empty_list_still_needs_an_available_backend():
    with pytest.raises(BackendUnavailableError, match="CUDA"):
        kl_reward([], [], backend="cuda")


LOSS_DEFAULTS = dict(ref_log_probs=None, beta=0.0, estimator="k1", mask=None, offsets=None, lengths=None,
                     padding_side="left", clip_epsilon=None, entropy=None, entropy_coef=0.0, aggregation="token-mean",
                     norm_length=None)


def test_an_empty_list_takes_the_device_of_the_other_arguments():
    """kl_reward([], [], reward on the GPU) is a problem on the GPU, not a device-free one (shown
    with fake CUDA tensors: the problem is built, no kernel runs)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from kl_kernels.kl_penalty.problem import build_problem as loss_problem
    from kl_kernels.kl_reward.problem import build_problem as reward_problem

    with FakeTensorMode():
        problem, _ = reward_problem([], [], torch.zeros(0, device="cuda"), coef=1.0, estimator="k1", mask=None,
                                    offsets=None, lengths=None, padding_side="left", prompt_lens=None,
                                    reward_placement="sequence", clamp_input=None, clamp_output=None,
                                    return_ref=False, detach=True)
        assert problem.device.type == "cuda" and not problem.device_free
        assert problem.offsets.device.type == "cuda"
        problem, _, _ = loss_problem([], [], torch.zeros(0, device="cuda"), **LOSS_DEFAULTS)
        assert problem.device.type == "cuda" and not problem.device_free
    problem, _, _ = loss_problem([], [], [], **LOSS_DEFAULTS)
    assert problem.device.type == "cpu" and problem.device_free
