"""kl_kernels/op_library.py: ops defined on the library directly, and each differentiable op's twin without an
autograd formula, which calls that build no graph take (eager and inside torch.compile)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import kl_kernels  # noqa: F401 - registers the ops
from kl_kernels import op_library

NAME = "op_library_test_scale"


def _scale(x: torch.Tensor, s: float) -> torch.Tensor:
    return x * s


@pytest.fixture(scope="module")
def op():
    if hasattr(torch.ops.kl_kernels, NAME):  # (defined once per process)
        pytest.skip("defined by an earlier run in this process")
    o = op_library.define(f"kl_kernels::{NAME}", _scale, device_types="cpu")
    o.register_fake(lambda x, s: torch.empty_like(x))
    o.register_autograd(lambda ctx, g: (g * ctx.s, None),
                        setup_context=lambda ctx, inputs, output: setattr(ctx, "s", inputs[1]))
    return o


class _Seen(TorchDispatchMode):
    """The ops that reach the dispatcher's Python key (below autograd)."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func).startswith("kl_kernels."):  # (not the aten ops inside it, nor the test's own)
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_calls_that_build_no_graph_take_the_twin(op):
    x = torch.randn(3)
    with _Seen() as seen:
        assert torch.equal(op(x, 2.0), x * 2.0)
    assert seen.ops == [f"kl_kernels.{NAME}_nograd.default"]
    xr = x.clone().requires_grad_()
    with _Seen() as seen:
        y = op(xr, 2.0)
    assert seen.ops == [f"kl_kernels.{NAME}.default"]
    (g,) = torch.autograd.grad(y.sum(), xr)
    assert torch.equal(g, torch.full_like(x, 2.0))
    with torch.no_grad(), _Seen() as seen:
        assert op(xr, 2.0).grad_fn is None
    assert seen.ops == [f"kl_kernels.{NAME}_nograd.default"]


def test_both_pass_opcheck(op):
    x = torch.randn(3)
    torch.library.opcheck(op.default, (x.clone().requires_grad_(), 2.0))
    torch.library.opcheck(op.nograd, (x, 2.0))


def test_a_compiled_graph_without_gradients_calls_the_twin(op):
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm.code)
        return gm

    f = torch.compile(lambda x: op(x, 3.0) + 1, backend=backend, fullgraph=True)
    x = torch.randn(4)
    assert torch.equal(f(x), x * 3.0 + 1)
    assert f"{NAME}_nograd" in graphs[-1]
    xr = x.clone().requires_grad_()
    f(xr).sum().backward()
    assert f"{NAME}_nograd" not in graphs[-1] and NAME in graphs[-1]
    assert torch.equal(xr.grad, torch.full_like(x, 3.0))


def test_every_differentiable_forward_has_its_twin():
    for name in ("kl_reward_fwd", "kl_reward_triton_fwd", "kl_reward_cuda_emu_fwd", "kl_penalty_fwd",
                 "kl_penalty_triton_fwd", "kl_penalty_cuda_emu_fwd", "token_logprobs_fwd", "token_logprobs_cpu_fwd",
                 "token_logprobs_cuda_fwd", "token_logprobs_triton_fwd", "full_kl_fwd"):
        ours, twin = getattr(torch.ops.kl_kernels, name).default, getattr(torch.ops.kl_kernels, f"{name}_nograd").default
        assert str(ours._schema).split("(", 1)[1] == str(twin._schema).split("(", 1)[1], name
        assert torch.Tag.pt2_compliant_tag in ours.tags and torch.Tag.pt2_compliant_tag in twin.tags


def test_only_kl_kernels_ops():
    with pytest.raises(ValueError, match="kl_kernels::<name>"):
        op_library.define("other::scale", _scale)
