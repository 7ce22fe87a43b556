"""tests/triton_interpreter.py: the vectorized scan the suite installs in Triton's interpreter gives
what the interpreter's own element-by-element scan gives, on the scans our kernels use (the segmented
fp64 sum of kl_kernels/triton/kl_math.py, NaN and inf included) and on multi-value, reversed and 2-D
scans."""

from __future__ import annotations

import pytest
import torch

import triton_interpreter
from conftest import triton_device

pytestmark = pytest.mark.triton

triton = pytest.importorskip("triton")
tl = triton.language


@pytest.fixture(autouse=True)
def _interpreter():
    if triton_device() != "cpu":
        pytest.skip("the patch is for Triton's interpreter (TRITON_INTERPRET=1)")
    if not triton_interpreter.install():
        pytest.skip(f"the vectorized scan is not installed: {triton_interpreter.why_not()}")


def _both(run):
    """run() with the vectorized scan, then with the interpreter's own."""
    from triton.runtime import interpreter

    fast = run()
    patched = interpreter.ScanOps.generic_scan
    interpreter.ScanOps.generic_scan = triton_interpreter.original_scan()
    try:
        slow = run()
    finally:
        interpreter.ScanOps.generic_scan = patched
    return fast, slow


@triton.jit
def _segmented(v_ptr, first_ptr, out_ptr, N: tl.constexpr):
    from kl_kernels.triton.kl_math import segment_sum

    o = tl.arange(0, N)
    tl.store(out_ptr + o, segment_sum(tl.load(v_ptr + o), tl.load(first_ptr + o)))


@pytest.mark.parametrize("n", [1, 2, 5, 64, 256])
def test_the_segmented_sum_is_the_interpreters(n):
    g = torch.Generator().manual_seed(n)
    N = triton.next_power_of_2(n)
    v = torch.randn(N, generator=g) * 10
    v[::7] = v[::7].round()  # some exact values too
    if n >= 5:
        v[3], v[n - 1] = float("nan"), float("inf")
    starts = torch.sort(torch.randint(0, N, (max(1, N // 6),), generator=g)).values
    first = torch.zeros(N, dtype=torch.int32)
    for s in starts.tolist():
        first[s:] = s

    def run():
        out = torch.full((N,), float("nan"), dtype=torch.float64)
        _segmented[(1,)](v, first, out, N)
        return out

    fast, slow = _both(run)
    assert torch.equal(fast.isnan(), slow.isnan())
    ok = ~slow.isnan()
    torch.testing.assert_close(fast[ok], slow[ok], rtol=1e-15, atol=1e-12)
    # the NaN and inf stay in their own segments, as the interpreter's own scan has them
    assert torch.equal(fast.isinf(), slow.isinf())


@triton.jit
def _combine3(a0, a1, a2, b0, b1, b2):
    return a0 + b0, tl.maximum(a1, b1), a2 * 0 + b2 + a2


@triton.jit
def _three_reversed_2d(x_ptr, y_ptr, z_ptr, o0, o1, o2, R: tl.constexpr, C: tl.constexpr, REVERSE: tl.constexpr,
                       AXIS: tl.constexpr):
    r = tl.arange(0, R)[:, None]
    c = tl.arange(0, C)[None, :]
    i = r * C + c
    a, b, d = tl.associative_scan((tl.load(x_ptr + i), tl.load(y_ptr + i), tl.load(z_ptr + i)), AXIS, _combine3,
                                  reverse=REVERSE)
    tl.store(o0 + i, a)
    tl.store(o1 + i, b)
    tl.store(o2 + i, d)


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("axis", [0, 1])
def test_multi_value_reversed_and_2d_scans_are_the_interpreters(reverse, axis):
    g = torch.Generator().manual_seed(1)
    R, C = 4, 32
    x = torch.randint(-50, 50, (R, C), generator=g, dtype=torch.int64)  # exact sums
    y = torch.randn(R, C, generator=g)
    z = torch.randint(0, 9, (R, C), generator=g, dtype=torch.int32)

    def run():
        outs = (torch.empty_like(x), torch.empty_like(y), torch.empty_like(z))
        _three_reversed_2d[(1,)](x, y, z, *outs, R, C, reverse, axis)
        return outs

    fast, slow = _both(run)
    for a, b in zip(fast, slow):
        assert torch.equal(a, b)


def test_the_builtin_walk_patches_what_the_interpreters_walk_patches():
    """The cached walk (install()) patches the same members, in the same order, as the interpreter's
    inspect.getmembers walk: from a clean language, and nothing when an enclosing launch has patched it."""
    from triton.runtime import interpreter

    assert interpreter._patch_builtin is not triton_interpreter.original_patch_builtin()

    def patched_names(walk, pkg, inside_a_launch):
        outer = interpreter._LangPatchScope()
        if inside_a_launch:
            triton_interpreter.original_patch_builtin()(pkg, interpreter.interpreter_builder, outer)
        scope = interpreter._LangPatchScope()
        try:
            walk(pkg, interpreter.interpreter_builder, scope)
            return [name for _, name, _ in scope._changes]
        finally:
            scope.restore()
            outer.restore()

    for pkg in triton_interpreter._packages():
        for inside in (False, True):
            fast = patched_names(interpreter._patch_builtin, pkg, inside)
            slow = patched_names(triton_interpreter.original_patch_builtin(), pkg, inside)
            assert fast == slow, (pkg, inside)
            assert bool(fast) is not inside, (pkg, inside, fast)  # every package has builtins to patch
        assert all(tl.core.is_builtin(getattr(pkg, n)) for n in triton_interpreter.builtin_names(pkg))  # restored
