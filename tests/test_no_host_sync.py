"""No host synchronization on accelerators: an eager call with CUDA tensors reads no value on the host.

Proved on a machine without a GPU: under ``FakeTensorMode`` the inputs are fake CUDA tensors (shapes,
dtypes and devices, no data), and any data-dependent read (``.tolist()``, ``.item()``, ``bool(t)``,
``torch.equal``) raises ``DataDependentOutputException``. Each call must get through validation,
dispatch and the launcher's argument building to the kernel launch, which is replaced by a recorder
(there is no GPU to launch on). The value checks of offsets, lengths, prompt_lens and ragged
structure run on the device instead (``torch._assert_async``; ``value_checks.checks_on_host``).

A host-to-device copy (``torch.tensor(x, device="cuda")``, ``t.to("cuda")`` of a CPU tensor) is a
synchronization too (a copy from pageable host memory blocks the host until the stream has drained; the
H200 run of ``.ci/gpu_checks.py nosync`` caught one in the loss aggregation): ``_no_transfers`` fails any
copy between CPU and CUDA while the call runs.

A negative control: with ``KL_KERNELS_SYNC_CHECKS=1`` (host checks, opt-in) the same call must fail
here, so the test cannot pass while a host read is in the path.
"""

from __future__ import annotations

import dataclasses
import sys

import pytest
import torch
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode, ShapeEnv
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from kl_kernels import _extensions, codes, device_errors, kl_penalty_loss, kl_reward, launching, ragged, value_checks
from kl_kernels.kl_penalty import backends as loss_backends
from kl_kernels.kl_penalty import launch as loss_launch
from kl_kernels.kl_reward import backends as reward_backends
from kl_kernels.kl_reward import launch as reward_launch


@pytest.fixture
def launches(monkeypatch):
    """Make the ``cuda`` backend runnable with fake tensors and record its kernel launches."""
    recorded = []
    module = _extensions.load("_C")[0]  # the same argument structs as _cuda's
    if module is None:
        pytest.skip("kl_kernels._C is not built")

    def record(module, kernel, args, device, what, workspace_bytes=None):
        assert device.type == "cuda"
        if value_checks.DEFERRED.pending:  # as launching.launch_kernel: the forwards take over the value checks
            launching.fold_value_checks(kernel, args)
        recorded.append(kernel.__name__)

    class CudaLike:  # _C's argument structs and kernels, plus the workspace functions only _cuda has
        def __getattr__(self, name):
            return getattr(module, name)

        kl_reward_workspace_bytes = kl_penalty_workspace_bytes = staticmethod(lambda args: 0)

    for launch in (reward_launch, loss_launch):
        monkeypatch.setattr(launch, "launch_kernel", record)
        monkeypatch.setattr(launch, "kernel_module", lambda device, *a, **k: CudaLike())
    for backends in (reward_backends, loss_backends):
        rows = [dataclasses.replace(b, availability=lambda: []) if b.name == "cuda" else b for b in backends.REGISTRY]
        monkeypatch.setattr(backends, "REGISTRY", rows)
    monkeypatch.setattr(sys.modules["kl_kernels.kl_reward.api"], "REGISTRY", reward_backends.REGISTRY)
    monkeypatch.setattr(sys.modules["kl_kernels.kl_penalty.api"], "REGISTRY", loss_backends.REGISTRY)
    monkeypatch.delenv("KL_KERNELS_SYNC_CHECKS", raising=False)
    monkeypatch.setattr(ragged, "host_ints", _fake_host_ints)

    def value_check(kernel, values, batch, bound, *per_sequence, name, bound_kind=-1):  # without a device: recorded
        recorded.append(kernel)
        return True

    monkeypatch.setattr(value_checks, "kernel_check", value_check)
    monkeypatch.setattr(value_checks, "deferrable", lambda kernel, *tensors: True)  # (as with _cuda on a GPU)
    # the error word of a fake CUDA device, made once as on a GPU (device_errors.word makes one per call there);
    # its tensor (a fake one, for the records made with torch operations, e.g. a nested argument's lengths
    # mismatch) only when one is read, so that the launch counts see no allocation of it
    word = device_errors.word

    class FakeWord(device_errors.ErrorWord):
        __slots__ = ()

        @property
        def tensor(self):
            return torch.zeros(codes.ERROR_WORD_SLOTS, dtype=torch.int64, device="cuda")

        @tensor.setter
        def tensor(self, value):
            pass

    fake_word = FakeWord(torch.device("cuda"), 0, 0, None)
    monkeypatch.setattr(device_errors, "word", lambda device: fake_word if torch.device(device).type == "cuda"
                        else word(device))
    return recorded


def kernels_run(launches) -> list:
    """The recorded launches but the value checks' (``*_valid``, see ``value_checks.kernel_check``)."""
    return [k for k in launches if not k.endswith("_valid")]


def _reward_calls():
    """kl_reward calls (built inside the fake mode): every layout, prompt_lens, rewards, tensor coefs."""
    d = "cuda"
    lens = [3, 0, 5, 1]
    n = sum(lens)
    lp_packed, ref_packed = torch.randn(n, device=d), torch.randn(n, device=d)
    offsets = torch.tensor([0, 3, 3, 8, 9], device=d)
    lp_pad, ref_pad = torch.randn(4, 5, device=d), torch.randn(4, 5, device=d)
    lengths = torch.tensor(lens, device=d)
    lists = [torch.randn(k, device=d) for k in lens]
    jag = [torch.randn(k, device=d) for k in (3, 2, 5)]
    return {
        "packed": dict(log_probs=lp_packed, ref_log_probs=ref_packed, reward=torch.randn(n, device=d), offsets=offsets,
                       mask=torch.ones(n, dtype=torch.bool, device=d), coef=torch.full((4,), 0.1, device=d),
                       prompt_lens=torch.tensor([1, 0, 2, 0], device=d), estimator="k3"),
        "padded-last": dict(log_probs=lp_pad, ref_log_probs=ref_pad, reward=torch.randn(4, device=d),
                            reward_placement="last", lengths=lengths, padding_side="right", coef=torch.tensor(0.2, device=d),
                            clamp_input=(-20, 20), clamp_output=(-10, 10), estimator="k3"),
        "padded-prompt": dict(log_probs=lp_pad, ref_log_probs=ref_pad, lengths=lengths,
                              prompt_lens=torch.tensor([1, 0, 2, 0], device=d), return_ref=True),
        "list": dict(log_probs=lists, ref_log_probs=[t + 1 for t in lists], reward=[t * 0 for t in lists],
                     mask=[torch.ones(t.shape[0], dtype=torch.bool, device=d) for t in lists]),
        "nested": dict(log_probs=torch.nested.nested_tensor(jag, layout=torch.jagged),
                       ref_log_probs=torch.nested.nested_tensor([t + 1 for t in jag], layout=torch.jagged),
                       reward=torch.nested.nested_tensor([t * 0 for t in jag], layout=torch.jagged)),
    }


def _loss_calls():
    d = "cuda"
    lens = [3, 0, 5, 1]
    n = sum(lens)
    offsets = torch.tensor([0, 3, 3, 8, 9], device=d)
    return {
        "packed": dict(log_probs=torch.randn(n, device=d), old_log_probs=torch.randn(n, device=d),
                       advantages=torch.randn(4, 1, device=d), ref_log_probs=torch.randn(n, device=d), offsets=offsets,
                       beta=torch.full((4,), 0.1, device=d), clip_epsilon=0.2, estimator="k3"),
        "padded": dict(log_probs=torch.randn(4, 5, device=d), old_log_probs=torch.randn(4, 5, device=d),
                       advantages=torch.randn(4, device=d), lengths=torch.tensor(lens, device=d),
                       aggregation="seq-mean-token-mean", entropy=torch.rand(4, 5, device=d), entropy_coef=0.01),
        "list": dict(log_probs=[torch.randn(k, device=d) for k in lens],
                     old_log_probs=[torch.randn(k, device=d) for k in lens], advantages=torch.randn(4, device=d),
                     aggregation="seq-mean-token-sum"),
        # GSPO: the sequences' log-ratios from torch ops on the device before the kernel. Packed layouts sum
        # them with index_add_, which a CPU-only torch cannot run on fake CUDA tensors (it refuses the device):
        # .ci/gpu_checks.py nosync and graphs cover that on a GPU (their options include GSPO)
        "padded-gspo": dict(log_probs=torch.randn(4, 5, device=d), old_log_probs=torch.randn(4, 5, device=d),
                            advantages=torch.randn(4, device=d), lengths=torch.tensor(lens, device=d),
                            importance_sampling_level="sequence", aggregation="seq-mean-token-mean"),
    }


def _fake_mode():
    # a shape environment: jagged nested tensors carry a symbolic ragged size even when fake
    return FakeTensorMode(allow_non_fake_inputs=False, shape_env=ShapeEnv())


def _fake_host_ints(values, device):
    """ragged.host_ints as it runs on a GPU (a non-blocking copy), in a form a CPU-only torch's fake
    mode can run: Tensor.to("cuda") refuses before dispatch there, the aten op does not. The real
    function (pinned memory) runs in .ci/gpu_checks.py nosync on a GPU."""
    return torch.ops.aten._to_copy.default(torch.tensor(values, dtype=torch.int64), device=torch.device(device),
                                           non_blocking=True)


class _no_transfers(TorchDispatchMode):
    """Fail on any copy between the host and the device (a synchronizing transfer) while active."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is not torch.ops.prim.device.default:
            into = {t.device.type for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
            outof = {t.device.type for t in tree_leaves(out) if isinstance(t, torch.Tensor)}
            # A non-blocking copy is allowed: ragged.host_ints sends host-known ints that way, from pinned
            # memory on a real GPU (.ci/gpu_checks.py nosync covers list inputs there).
            crossing = ("cpu" in into and "cuda" in outof) or ("cuda" in into and outof == {"cpu"})
            if crossing and not kwargs.get("non_blocking", False):
                raise AssertionError(f"{func} copies between host and device ({sorted(into)} -> {sorted(outof)}): "
                                     "a synchronizing transfer in the eager path")
        return out


def test_no_transfers_catches_a_host_to_device_copy():
    """The guard itself: a blocking copy of a CPU tensor to the device fails it; torch.full is no
    copy, and ragged.host_ints copies without blocking.

    ``torch.tensor(x, device="cuda")`` is such a copy too, and the guard sees it on a CPU-only torch
    (CI). A CUDA build of torch copies below the Python dispatch key, where no dispatch mode looks
    (the H200 run of 2026-11-26): there ``.ci/gpu_checks.py nosync`` (CUDA's sync debug mode) is
    the check."""
    with _fake_mode():
        with _no_transfers():
            torch.full((), 2.0, device="cuda")
            assert _fake_host_ints([1, 2], "cuda").device.type == "cuda"
        with _no_transfers(), pytest.raises(AssertionError, match="between host and device"):
            torch.ops.aten._to_copy.default(torch.ones(2), device=torch.device("cuda"))
        if not torch.cuda.is_available():
            with _no_transfers(), pytest.raises(AssertionError, match="between host and device"):
                torch.tensor(2.0, device="cuda")


REWARD_CASES = ["packed", "padded-last", "padded-prompt", "list", "nested"]
LOSS_CASES = ["packed", "padded", "list", "padded-gspo"]


@pytest.mark.parametrize("case", REWARD_CASES)
def test_kl_reward_reaches_the_launch_without_a_host_read(launches, case):
    with _fake_mode():
        kwargs = _reward_calls()[case]
        with _no_transfers():
            out = kl_reward(**kwargs, backend="cuda")
    assert kernels_run(launches) == ["kl_reward_forward"]
    kl = out.kl[0] if isinstance(out.kl, list) else out.kl
    assert kl.device.type == "cuda"


@pytest.mark.parametrize("case", LOSS_CASES)
def test_kl_penalty_loss_without_a_host_read(launches, case):
    # Forward without autograd: a CPU-only torch aborts in autograd's CUDA device guard on fake CUDA
    # tensors (torch's limitation, not ours), so the autograd path is not exercised here. It adds
    # no host read of ours: _EagerFused wraps the same launcher, and the aggregation below is shared.
    with _fake_mode():
        kwargs = _loss_calls()[case]
        with _no_transfers():
            out = kl_penalty_loss(**kwargs, backend="cuda")
    assert kernels_run(launches) == ["kl_penalty_forward"]
    assert out.loss.device.type == "cuda"


@pytest.mark.parametrize("case", ["packed", "padded-prompt"])
def test_host_checks_opt_in_is_a_host_read(launches, monkeypatch, case):
    """The negative control: KL_KERNELS_SYNC_CHECKS=1 reads the offsets/lengths on the host, and the
    fake mode catches it: a host read in the eager path cannot go unnoticed by the tests above."""
    monkeypatch.setenv("KL_KERNELS_SYNC_CHECKS", "1")
    with _fake_mode():
        with pytest.raises((DataDependentOutputException, GuardOnDataDependentSymNode)):
            kl_reward(**_reward_calls()[case], backend="cuda")
    assert launches == []


def test_device_checks_catch_bad_values_on_cpu_tensors_too():
    """The device-side form of the checks is the same predicate: run on CPU tensors (where
    _assert_async raises at once) it rejects what the host checks reject."""
    bad = torch.tensor([0, 3, 2, 5])
    with pytest.raises(RuntimeError, match="offsets must start at 0, be non-decreasing"):
        value_checks.device_check((bad[1:] >= bad[:-1]).all(),
                                  "offsets must start at 0, be non-decreasing and end at N = 5")
