"""The CUDA emulation itself (csrc/emu), through the self-test kernels compiled into kl_kernels._cuda_emu
(csrc/emu/selftest.cu): a kernel whose barrier or shuffle is wrong must fail here as on a GPU (wrong
results, or an abort with a message where a GPU would hang), and the shuffles, launch checks and
scheduling must be those of CUDA. Aborting cases run in a subprocess."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys

import pytest

from conftest import REPO

pytestmark = pytest.mark.cuda_emulated

CORRECT, NO_BARRIER, DIVERGENT_BARRIER, DIVERGENT_SHUFFLE, PARTIAL_MASK = range(5)


@pytest.fixture(scope="module")
def emu():
    from kl_kernels import _extensions

    return _extensions.load("_cuda_emu")[0]


def _values(seed, n=256):
    import random

    rng = random.Random(seed)
    return [float(rng.randint(-1000, 1000)) for _ in range(n)]  # integers: exact sums in any order


@pytest.mark.parametrize("n", [256, 200, 33, 1, 0])
def test_block_scan_is_right(emu, n):
    for seed in range(3):
        values = _values(seed, n)
        err, out = emu.emu_scan(CORRECT, values)
        assert err == 0 and out == list(itertools.accumulate(values))


def test_block_scan_without_its_barrier_is_wrong(emu):
    """The same kernel with its __syncthreads removed: threads read the warp totals of shared memory
    before the warps that write them ran (the emulation runs threads in a random order between
    barriers), so sums come out wrong, as on a GPU. Every one of several runs must be wrong somewhere."""
    for seed in range(5):
        values = _values(100 + seed)
        err, out = emu.emu_scan(NO_BARRIER, values)
        assert err == 0
        assert out != list(itertools.accumulate(values)), seed


def test_shuffles_follow_cuda(emu):
    values = [float(i * i) for i in range(256)]
    err, out = emu.emu_shuffles(values)
    assert err == 0
    for t in range(256):
        lane, base = t % 32, t - t % 32
        want = [values[t - 3] if lane >= 3 else values[t],  # up: lanes below delta keep their own value
                values[t + 5] if lane + 5 < 32 else values[t],  # down: likewise at the top
                values[base + (lane ^ 7)],
                values[base + (7 * lane + 3) % 32]]
        assert out[4 * t:4 * t + 4] == want, t


@pytest.mark.parametrize("grid_x, grid_y, block_x, block_y, block_z, smem, err", [
    (1, 1, 1024, 1, 1, 0, 0),
    (3, 2, 32, 2, 2, 48 * 1024, 0),
    (0, 1, 256, 1, 1, 0, 9),          # empty grid: cudaErrorInvalidConfiguration
    (1, 65536, 32, 1, 1, 0, 9),       # grid.y > 65535
    (1, 1, 1025, 1, 1, 0, 9),         # more than 1024 threads
    (1, 1, 512, 2, 2, 0, 9),          # 2048 threads in three dimensions
    (1, 1, 1, 1, 65, 0, 9),           # block.z > 64
    (1, 1, 0, 1, 1, 0, 9),            # empty block
    (1, 1, 32, 1, 1, 48 * 1024 + 1, 1),  # dynamic shared memory beyond 48 KiB: cudaErrorInvalidValue
])
def test_launch_limits(emu, grid_x, grid_y, block_x, block_y, block_z, smem, err):
    got, ran = emu.emu_launch(grid_x, grid_y, block_x, block_y, block_z, smem)
    assert got == err and ran == (err == 0)
    if err:
        assert emu.emu_get_last_error() == err  # recorded as the runtime's last error, as CUDA does
        assert emu.emu_get_last_error() == 0


def _load(emu) -> str:
    """Python code that loads this very extension file as ``m``, without importing kl_kernels (and torch:
    the extension links neither), so a subprocess starts in a fraction of a second, also under ASan."""
    return ("import importlib.util as u; s = u.spec_from_file_location('kl_kernels._cuda_emu', "
            f"{emu.__file__!r}); m = u.module_from_spec(s); s.loader.exec_module(m); ")


def _abort_run(emu, variant):
    code = _load(emu) + f"m.emu_scan({variant}, [1.0] * 256); print('returned')"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          cwd=REPO / "tests", env={**os.environ, "PYTHONFAULTHANDLER": ""})


def test_divergent_barrier_aborts_with_a_message(emu):
    """Thread 0 skips the __syncthreads the other 255 wait at: a hang on a GPU, a report and an abort here."""
    proc = _abort_run(emu, DIVERGENT_BARRIER)
    assert proc.returncode != 0 and "returned" not in proc.stdout
    assert "kl_emu: deadlock" in proc.stderr and "255 of 256 threads at __syncthreads, 1 exited" in proc.stderr, \
        proc.stderr[-2000:]


def test_divergent_shuffle_aborts_with_a_message(emu):
    proc = _abort_run(emu, DIVERGENT_SHUFFLE)
    assert proc.returncode != 0 and "returned" not in proc.stdout
    assert "kl_emu: deadlock" in proc.stderr and "16 of 32 lanes at a shuffle" in proc.stderr, proc.stderr[-2000:]


def test_partial_shuffle_mask_is_refused(emu):
    proc = _abort_run(emu, PARTIAL_MASK)
    assert proc.returncode != 0 and "only full warps with the full mask are emulated" in proc.stderr, \
        proc.stderr[-2000:]


def test_schedules_are_reproducible_and_selectable(emu):
    """KL_EMU_SCHEDULE picks the order of threads between barriers and KL_EMU_SEED the random one's
    seed: the missing barrier shows under the random and the reverse order; the same seed gives the
    same (wrong) results."""
    code = _load(emu) + ("import itertools; v = [float(i % 7) for i in range(256)]; "
                         "out = m.emu_scan(1, v)[1]; print(out == list(itertools.accumulate(v)), hash(tuple(out)))")

    def run(**env):
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                              cwd=REPO / "tests", env={**os.environ, **env})
        assert proc.returncode == 0, proc.stderr[-2000:]
        return proc.stdout.split()

    first, again = run(KL_EMU_SEED="7"), run(KL_EMU_SEED="7")
    assert first == again and first[0] == "False"
    assert run(KL_EMU_SCHEDULE="reverse")[0] == "False"
    bad = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         cwd=REPO / "tests", env={**os.environ, "KL_EMU_SCHEDULE": "sideways"})
    assert bad.returncode != 0 and "KL_EMU_SCHEDULE must be" in bad.stderr
