"""A/B benchmark of the row kernels' forwards (``token_logprobs``, ``full_kl``) across two revisions of the
sources, side by side in one process: for a change to the row kernels (``csrc/cpu/*``, ``csrc/cuda/*`` and
the headers they include, ``kl_kernels/triton/{token_logprobs,full_kl}.py``), where two builds of the
extension cannot be loaded into one Python process.

CPU (``--device cpu``): the base revision's sources (``git archive``) are compiled with ``-Dkl=kl_base``
next to the working tree's, with the flags ``setup.py`` gives these files, into one program that times the
two alternately (one thread, the vocabulary contiguous, every row counted) and reports each one's fastest
call of ``--repeats``: alternating calls see the same machine state, which on a shared VM drifts by 20 % or
more between runs a minute apart. Needs ``git`` and ``g++`` (x86-64 for the kernels' AVX2 clones).

GPU (``--device cuda``): the same for the CUDA C++ forwards (nvcc, this GPU's arch, CUDA events; logits
filled on the device), with a device-to-device copy of the same bytes as the floor (a forward reads its
logits once: half the traffic of that copy), then the Triton forwards: the base revision's kernel modules
loaded next to the tree's and launched by the tree's launchers (unchanged since the one-pass change), timed
alternately the same way.

Run: ``python -m kl_kernels.bench.row_forward_ab --base REV [--device cpu|cuda] [--rows N] [--vocab V]
[--out FILE]``. Measured for the one-pass forwards (issue 28): ``bench/results/row-forward-one-pass-cpu-2core/``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

import torch

from .machine import describe

REPO = Path(__file__).resolve().parents[2]
SOURCES = ("cpu/token_logprobs_cpu.cpp", "cpu/full_kl_cpu.cpp")
# setup.py's flags for the CPU kernels (SOURCE_FLAGS aside, which these files do not take)
FLAGS = ("-O3", "-g0", "-std=c++17", "-fwrapv", "-fno-trapping-math", "-fno-math-errno", "-ffp-contract=off")


def _entry_points(device: str, extra: str = "") -> str:
    """The drivers' declarations of both revisions' row forwards: the tree's in namespace kl, the base
    revision's in kl_base (compiled with -Dkl=kl_base; its row_args.h is the tree's: _base_csrc() checks)."""
    arg = "int num_threads" if device == "cpu" else "uintptr_t stream"
    decl = (f"int token_logprobs_forward_{device}(const TokenLogprobsArgs& a, {arg});\n"
            f"int full_kl_forward_{device}(const FullKLArgs& a, {arg});\n{extra}")
    return (f"namespace kl {{\n{decl}}}  // namespace kl\n"
            f"namespace kl_base {{\nstruct TokenLogprobsArgs;\nstruct FullKLArgs;\n{decl}}}  // namespace kl_base")


DRIVER = r"""
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <functional>
#include <random>
#include <vector>
#include "common/codes.h"
#include "common/row_args.h"

// Both revisions' kernels take their run_tiles from here: one thread, tiles in order.
#define KL_SERIAL_TILES                                                                         \
  void run_tiles(int64_t tiles, int, const std::function<void(int64_t)>& fn) {                \
    for (int64_t t = 0; t < tiles; ++t) fn(t);                                                  \
  }
@ENTRY_POINTS@

// N x V logits ~ N(0, 3^2) as the kernels read them: float32, or bfloat16 (a float's top half).
static std::vector<uint16_t> logits(int64_t count, int dtype, std::mt19937& g) {
  std::normal_distribution<float> nd(0.0f, 3.0f);
  std::vector<uint16_t> out(dtype == kl::kFloat32 ? 2 * count : count);
  for (int64_t i = 0; i < count; ++i) {
    const float f = nd(g);
    uint32_t b;
    std::memcpy(&b, &f, 4);
    if (dtype == kl::kFloat32) std::memcpy(&out[2 * i], &b, 4);
    else out[i] = static_cast<uint16_t>(b >> 16);
  }
  return out;
}

int main(int argc, char** argv) {
  const int64_t N = std::atoll(argv[1]), V = std::atoll(argv[2]);
  const int repeats = std::atoi(argv[3]);
  std::printf("[");
  for (int dtype : {int(kl::kBFloat16), int(kl::kFloat32)}) {
    std::mt19937 g(0);
    const std::vector<uint16_t> x = logits(N * V, dtype, g), r = logits(N * V, dtype, g);
    std::vector<int64_t> labels(N);
    for (int64_t i = 0; i < N; ++i) labels[i] = (i * 7919) % V;
    std::vector<char> counted(N, 1);
    std::vector<float> lp(N), lse(N), ent(N), kl_out(N), klse(N), kref(N), out[2][3];
    kl::TokenLogprobsArgs a;
    a.logits = reinterpret_cast<uintptr_t>(x.data()); a.dtype = dtype; a.rows = N; a.vocab = V; a.stride_outer = V;
    a.labels = reinterpret_cast<uintptr_t>(labels.data()); a.counted = reinterpret_cast<uintptr_t>(counted.data());
    a.log_probs = reinterpret_cast<uintptr_t>(lp.data()); a.lse = reinterpret_cast<uintptr_t>(lse.data());
    a.entropy = reinterpret_cast<uintptr_t>(ent.data());
    kl::FullKLArgs f;
    f.logits = reinterpret_cast<uintptr_t>(x.data()); f.ref_logits = reinterpret_cast<uintptr_t>(r.data());
    f.dtype = dtype; f.rows = N; f.vocab = V; f.stride_outer = V; f.ref_stride_outer = V;
    f.counted = reinterpret_cast<uintptr_t>(counted.data()); f.kl = reinterpret_cast<uintptr_t>(kl_out.data());
    f.lse = reinterpret_cast<uintptr_t>(klse.data()); f.ref_lse = reinterpret_cast<uintptr_t>(kref.data());
    double best[2][2] = {{1e30, 1e30}, {1e30, 1e30}};  // [revision: base, head][op]
    double worst_diff = 0.0;
    for (int rep = 0; rep < repeats; ++rep) {
      for (int rev = 0; rev < 2; ++rev) {
        const auto t0 = std::chrono::steady_clock::now();
        if (rev) kl::token_logprobs_forward_cpu(a, 1);
        else kl_base::token_logprobs_forward_cpu(reinterpret_cast<const kl_base::TokenLogprobsArgs&>(a), 1);
        const auto t1 = std::chrono::steady_clock::now();
        if (rev) kl::full_kl_forward_cpu(f, 1);
        else kl_base::full_kl_forward_cpu(reinterpret_cast<const kl_base::FullKLArgs&>(f), 1);
        const auto t2 = std::chrono::steady_clock::now();
        const double ms[2] = {std::chrono::duration<double, std::milli>(t1 - t0).count(),
                              std::chrono::duration<double, std::milli>(t2 - t1).count()};
        for (int op = 0; op < 2; ++op) best[rev][op] = ms[op] < best[rev][op] ? ms[op] : best[rev][op];
        if (rep == 0) {
          out[rev][0] = lp; out[rev][1] = ent; out[rev][2] = kl_out;
        }
      }
    }
    for (int k = 0; k < 3; ++k)
      for (int64_t i = 0; i < N; ++i) {
        const double d = std::abs(double(out[0][k][i]) - double(out[1][k][i])) / (1.0 + std::abs(double(out[0][k][i])));
        worst_diff = d > worst_diff ? d : worst_diff;
      }
    std::printf("%s{\"dtype\": \"%s\", \"token_logprobs_base_ms\": %.2f, \"token_logprobs_head_ms\": %.2f, "
                "\"full_kl_base_ms\": %.2f, \"full_kl_head_ms\": %.2f, \"max_rel_diff\": %.3g}",
                dtype == kl::kBFloat16 ? "" : ", ", dtype == kl::kBFloat16 ? "bfloat16" : "float32", best[0][0],
                best[1][0], best[0][1], best[1][1], worst_diff);
  }
  std::printf("]\n");
}
""".replace("@ENTRY_POINTS@", _entry_points("cpu", "KL_SERIAL_TILES\n"))


def _git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, check=True).stdout.strip()


def build(base: str, work: Path) -> Path:
    """The CPU A/B program: the base revision's row forwards as kl_base::, the working tree's as kl::."""
    base_csrc = _base_csrc(base, work)
    (work / "driver.cpp").write_text(DRIVER)
    objects = _objects(base_csrc, work, SOURCES, ["g++", *FLAGS])
    exe = work / "ab"
    subprocess.run(["g++", *FLAGS, f"-I{REPO / 'csrc'}", str(work / "driver.cpp"), *objects, "-o", str(exe)],
                   check=True)
    return exe


CUDA_SOURCES = ("cuda/token_logprobs_cuda.cu", "cuda/full_kl_cuda.cu")
# setup.py's nvcc flags (no fast math), for this GPU's arch alone
NVCC_FLAGS = ("-std=c++17", "-O3")

CUDA_DRIVER = r"""
#include <cuda_runtime.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>
#include "common/codes.h"
#include "common/row_args.h"

@ENTRY_POINTS@

#define CHECK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { \
  std::fprintf(stderr, "%s: %s\n", #x, cudaGetErrorString(e_)); std::exit(2); } } while (0)

__device__ uint64_t mix(uint64_t z) {  // splitmix64's finalizer
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// logits ~ N(0, 3^2) (Box-Muller on a counter hash) as the kernels read them: float32 or bfloat16
__global__ void fill(void* out, int64_t count, uint64_t seed, int dtype) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < count; i += int64_t{gridDim.x} * blockDim.x) {
    const uint64_t h = mix(seed * 0x9e3779b97f4a7c15ull + uint64_t(i));
    const float u1 = (float((h >> 40) & 0xffffff) + 1.0f) * (1.0f / 16777217.0f);
    const float u2 = float((h >> 16) & 0xffffff) * (1.0f / 16777216.0f);
    const float v = 3.0f * sqrtf(-2.0f * logf(u1)) * cospif(2.0f * u2);
    if (dtype == kl::kFloat32) static_cast<float*>(out)[i] = v;
    else static_cast<uint16_t*>(out)[i] = uint16_t(__float_as_uint(v) >> 16);
  }
}

struct Timing { double best = 1e30; std::vector<double> all; };

int main(int argc, char** argv) {
  const int64_t N = std::atoll(argv[1]), V = std::atoll(argv[2]);
  const int repeats = std::atoi(argv[3]);
  cudaEvent_t t0, t1;
  CHECK(cudaEventCreate(&t0));
  CHECK(cudaEventCreate(&t1));
  std::printf("[");
  for (int dtype : {int(kl::kBFloat16), int(kl::kFloat32)}) {
    const size_t bytes = size_t(N) * size_t(V) * (dtype == kl::kFloat32 ? 4 : 2);
    void *x, *r, *dst, *labels, *counted, *outs;
    CHECK(cudaMalloc(&x, bytes)); CHECK(cudaMalloc(&r, bytes)); CHECK(cudaMalloc(&dst, bytes));
    CHECK(cudaMalloc(&labels, N * 8)); CHECK(cudaMalloc(&counted, N)); CHECK(cudaMalloc(&outs, 2 * 6 * N * 4));
    fill<<<4096, 256>>>(x, N * V, 1, dtype);
    fill<<<4096, 256>>>(r, N * V, 2, dtype);
    std::vector<int64_t> lab(N);
    for (int64_t i = 0; i < N; ++i) lab[i] = (i * 7919) % V;
    CHECK(cudaMemcpy(labels, lab.data(), N * 8, cudaMemcpyHostToDevice));
    CHECK(cudaMemset(counted, 1, N));
    float* o = static_cast<float*>(outs);  // [revision][lp, lse, entropy, kl, lse, ref_lse][N]
    kl::TokenLogprobsArgs a[2];
    kl::FullKLArgs f[2];
    for (int rev = 0; rev < 2; ++rev) {
      float* base = o + rev * 6 * N;
      a[rev].logits = uintptr_t(x); a[rev].dtype = dtype; a[rev].rows = N; a[rev].vocab = V; a[rev].stride_outer = V;
      a[rev].labels = uintptr_t(labels); a[rev].counted = uintptr_t(counted);
      a[rev].log_probs = uintptr_t(base); a[rev].lse = uintptr_t(base + N); a[rev].entropy = uintptr_t(base + 2 * N);
      f[rev].logits = uintptr_t(x); f[rev].ref_logits = uintptr_t(r); f[rev].dtype = dtype; f[rev].rows = N;
      f[rev].vocab = V; f[rev].stride_outer = V; f[rev].ref_stride_outer = V; f[rev].counted = uintptr_t(counted);
      f[rev].kl = uintptr_t(base + 3 * N); f[rev].lse = uintptr_t(base + 4 * N);
      f[rev].ref_lse = uintptr_t(base + 5 * N);
    }
    Timing tm[2][2], copy;  // [revision: base, head][op: token_logprobs, full_kl]
    auto timed = [&](Timing& t, auto&& call) {
      CHECK(cudaEventRecord(t0));
      const int status = call();
      CHECK(cudaEventRecord(t1));
      CHECK(cudaEventSynchronize(t1));
      if (status != 0) { std::fprintf(stderr, "kernel status %d\n", status); std::exit(3); }
      float ms = 0.0f;
      CHECK(cudaEventElapsedTime(&ms, t0, t1));
      t.best = std::min(t.best, double(ms));
      t.all.push_back(ms);
    };
    for (int rep = -1; rep < repeats; ++rep) {  // rep -1: the warm-up, not counted
      Timing scratch;
      for (int rev = 0; rev < 2; ++rev) {
        timed(rep < 0 ? scratch : tm[rev][0], [&] {
          using BaseArgs = kl_base::TokenLogprobsArgs;
          return rev ? kl::token_logprobs_forward_cuda(a[1], 0)
                     : kl_base::token_logprobs_forward_cuda(reinterpret_cast<const BaseArgs&>(a[0]), 0);
        });
        timed(rep < 0 ? scratch : tm[rev][1], [&] {
          return rev ? kl::full_kl_forward_cuda(f[1], 0)
                     : kl_base::full_kl_forward_cuda(reinterpret_cast<const kl_base::FullKLArgs&>(f[0]), 0);
        });
      }
      timed(rep < 0 ? scratch : copy, [&] { return int(cudaMemcpyAsync(dst, x, bytes, cudaMemcpyDeviceToDevice)); });
    }
    std::vector<float> h(2 * 6 * N);
    CHECK(cudaMemcpy(h.data(), outs, h.size() * 4, cudaMemcpyDeviceToHost));
    double worst = 0.0;
    for (int k : {0, 2, 3})  // log-probs, entropy, KL
      for (int64_t i = 0; i < N; ++i) {
        const double b = h[k * N + i], d = h[6 * N + k * N + i];
        worst = std::max(worst, std::abs(b - d) / (1.0 + std::abs(b)));
      }
    auto med = [](std::vector<double> v) { std::sort(v.begin(), v.end()); return v[v.size() / 2]; };
    std::printf("%s{\"dtype\": \"%s\", \"gib\": %.3f, "
                "\"token_logprobs_base_ms\": %.4f, \"token_logprobs_head_ms\": %.4f, "
                "\"full_kl_base_ms\": %.4f, \"full_kl_head_ms\": %.4f, \"copy_ms\": %.4f, "
                "\"token_logprobs_base_median_ms\": %.4f, \"token_logprobs_head_median_ms\": %.4f, "
                "\"full_kl_base_median_ms\": %.4f, \"full_kl_head_median_ms\": %.4f, \"max_rel_diff\": %.3g}",
                dtype == kl::kBFloat16 ? "" : ", ", dtype == kl::kBFloat16 ? "bfloat16" : "float32",
                double(bytes) / (1 << 30), tm[0][0].best, tm[1][0].best, tm[0][1].best, tm[1][1].best, copy.best,
                med(tm[0][0].all), med(tm[1][0].all), med(tm[0][1].all), med(tm[1][1].all), worst);
    CHECK(cudaFree(x)); CHECK(cudaFree(r)); CHECK(cudaFree(dst));
    CHECK(cudaFree(labels)); CHECK(cudaFree(counted)); CHECK(cudaFree(outs));
  }
  std::printf("]\n");
}
""".replace("@ENTRY_POINTS@", _entry_points("cuda"))


def _objects(base_csrc: Path, work: Path, sources, compiler: list) -> list[str]:
    """Both revisions' ``sources`` compiled with ``compiler`` (its flags included), side by side: the base
    revision's with ``-Dkl=kl_base``, the tree's as they are; the object files, base first."""
    jobs, objects = [], []
    for tag, root, extra in (("base", base_csrc, ["-Dkl=kl_base"]), ("head", REPO / "csrc", [])):
        for src in sources:
            obj = work / f"{tag}_{Path(src).stem}.o"
            jobs.append(subprocess.Popen([*compiler, *extra, f"-I{root}", "-c", str(root / src), "-o", str(obj)]))
            objects.append(str(obj))
    if any(j.wait() != 0 for j in jobs):
        raise SystemExit(f"{compiler[0]} failed (above)")
    return objects


def _base_csrc(base: str, work: Path) -> Path:
    """The base revision's csrc/ under ``work``/base, refused when its argument structs differ from the tree's
    (the drivers pass the tree's structs to both revisions' kernels)."""
    base_src = work / "base"
    base_src.mkdir()
    archive = subprocess.run(["git", "-C", str(REPO), "archive", base, "csrc"], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(base_src)], input=archive, check=True)
    if (base_src / "csrc/common/row_args.h").read_text() != (REPO / "csrc/common/row_args.h").read_text():
        raise SystemExit(f"csrc/common/row_args.h differs between {base} and the tree: the driver cannot call both")
    return base_src / "csrc"


def build_cuda(base: str, work: Path, arch: str, nvcc: str = "nvcc") -> Path:
    """The CUDA A/B program: the base revision's row forwards as kl_base::, the working tree's as kl::,
    compiled for sm_``arch`` in parallel."""
    base_csrc = _base_csrc(base, work)
    (work / "driver.cu").write_text(CUDA_DRIVER)
    gencode = f"-gencode=arch=compute_{arch},code=sm_{arch}"
    driver = work / "driver.o"
    driver_job = subprocess.Popen([nvcc, *NVCC_FLAGS, gencode, f"-I{REPO / 'csrc'}", "-c", str(work / "driver.cu"),
                                   "-o", str(driver)])  # next to the kernels
    objects = _objects(base_csrc, work, CUDA_SOURCES, [nvcc, *NVCC_FLAGS, gencode])
    if driver_job.wait() != 0:
        raise SystemExit("nvcc failed on the driver (above)")
    exe = work / "ab_cuda"
    subprocess.run([nvcc, gencode, str(driver), *objects, "-o", str(exe)], check=True)
    return exe


TRITON_MODULES = ("token_logprobs", "full_kl")


def _timed(call, dev: torch.device):
    """(milliseconds, result) of one ``call()``: CUDA events on a GPU, the wall clock elsewhere."""
    if dev.type != "cuda":
        t0 = time.perf_counter()
        got = call()
        return (time.perf_counter() - t0) * 1e3, got
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    got = call()
    stop.record()
    torch.cuda.synchronize()
    return start.elapsed_time(stop), got


def triton_ab(base: str, rows: int, vocab: int, repeats: int, device: str = "cuda") -> list[dict]:
    """The Triton forwards of ``base`` (its kernel modules and row_math, loaded as siblings of the tree's, reading
    the tree's kl_math/codes, unchanged since, through base's launchers) against the tree's, alternately on
    the current GPU; best and median of ``repeats`` CUDA-event timings each (``device="cpu"``: under the
    Triton interpreter, wall-clock: a test of this tool, not a measurement)."""
    here = REPO / "kl_kernels" / "triton"
    written = []
    try:
        # base's row_math too (the kernels' shared helpers change with them), and base's launchers (they pass
        # the kernels' own arguments: BLOCK, or LANES/CHUNK/ALIGNED/BLOCK since issue 48), each base module
        # importing base's siblings
        path = here / "_ab_base_row_math.py"
        path.write_text(_git("show", f"{base}:kl_kernels/triton/row_math.py") + "\n")
        written.append(path)
        kernels, launch = {}, {}
        for name in TRITON_MODULES:
            path = here / f"_ab_base_{name}.py"
            path.write_text(_git("show", f"{base}:kl_kernels/triton/{name}.py").replace(
                "from .row_math import", "from ._ab_base_row_math import") + "\n")
            written.append(path)
            old = importlib.import_module(f"kl_kernels.triton._ab_base_{name}")
            new = importlib.import_module(f"kl_kernels.triton.{name}")
            kernels[name] = {"base": (getattr(old, f"{name}_fwd_kernel"), getattr(old, f"{name}_bwd_kernel")),
                             "head": (getattr(new, f"{name}_fwd_kernel"), getattr(new, f"{name}_bwd_kernel"))}
            path = REPO / "kl_kernels" / name / "_ab_base_launch_triton.py"
            path.write_text(_git("show", f"{base}:kl_kernels/{name}/launch_triton.py") + "\n")
            written.append(path)
            launch[name] = {"base": importlib.import_module(f"kl_kernels.{name}._ab_base_launch_triton"),
                            "head": importlib.import_module(f"kl_kernels.{name}.launch_triton")}
        dev = torch.device(device)
        out = []
        for dtype in (torch.bfloat16, torch.float32):
            g = torch.Generator(device=dev).manual_seed(0)
            x = (torch.randn(rows, vocab, generator=g, device=dev) * 3).to(dtype)
            r = (torch.randn(rows, vocab, generator=g, device=dev) * 3).to(dtype)
            labels = torch.arange(rows, device=dev) * 7919 % vocab
            counted = torch.ones(rows, dtype=torch.bool, device=dev)
            calls = {"token_logprobs": lambda m: m.forward(x, labels, counted, 0.7, True)[:2],
                     "full_kl": lambda m: m.forward(x, r, counted, 0.7)[:1]}
            times = {(rev, op): [] for rev in ("base", "head") for op in TRITON_MODULES}
            results = {}
            for rep in range(-1, repeats):  # -1: the warm-up (compiles), not counted
                for rev in ("base", "head"):
                    for op in TRITON_MODULES:
                        with mock.patch.object(launch[op][rev], "_kernels", lambda k=kernels[op][rev]: k):
                            ms, got = _timed(lambda op=op, rev=rev: calls[op](launch[op][rev]), dev)
                        if rep >= 0:
                            times[rev, op].append(ms)
                        results[rev, op] = got
            diff = max(((results["base", op][k] - results["head", op][k]).abs()
                        / (1 + results["base", op][k].abs())).max().item()
                       for op in TRITON_MODULES for k in range(len(results["base", op])))
            row = dict(dtype=str(dtype).replace("torch.", ""), max_rel_diff=diff)
            for (rev, op), ts in times.items():
                row[f"{op}_{rev}_ms"] = round(min(ts), 4)
                row[f"{op}_{rev}_median_ms"] = round(statistics.median(ts), 4)
            out.append(row)
            del x, r
        return out
    finally:
        for path in written:
            path.unlink()
            sys.modules.pop(f"kl_kernels.{path.parent.name}.{path.stem}", None)


def _table(runs: list) -> None:
    print("run | dtype | token_logprobs base / head ms | ratio | full_kl base / head ms | ratio | max rel diff")
    for i, run in enumerate(runs):
        for row in run:
            print(f"{i} | {row['dtype']} | {row['token_logprobs_base_ms']:.3f} / {row['token_logprobs_head_ms']:.3f} | "
                  f"{row['token_logprobs_base_ms'] / row['token_logprobs_head_ms']:.3f} | "
                  f"{row['full_kl_base_ms']:.3f} / {row['full_kl_head_ms']:.3f} | "
                  f"{row['full_kl_base_ms'] / row['full_kl_head_ms']:.3f} | {row['max_rel_diff']:.2g}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", required=True, help="the revision to compare the working tree's sources with")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--rows", type=int, default=None, help="default 256 on the CPU, 8192 on a GPU")
    p.add_argument("--vocab", type=int, default=131072)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--runs", type=int, default=3, help="programs run one after another (each alternates)")
    p.add_argument("--out", type=Path, default=None, help="write the JSON here")
    args = p.parse_args(argv)
    rows = args.rows or (256 if args.device == "cpu" else 8192)
    with tempfile.TemporaryDirectory() as tmp:
        if args.device == "cpu":
            exe = build(args.base, Path(tmp))
        else:
            major, minor = torch.cuda.get_device_capability()
            exe = build_cuda(args.base, Path(tmp), f"{major}{minor}")
        runs = [json.loads(subprocess.run([str(exe), str(rows), str(args.vocab), str(args.repeats)],
                                          capture_output=True, text=True, check=True).stdout)
                for _ in range(args.runs)]
    dev = torch.device(args.device)
    result = dict(base=_git("rev-parse", args.base), head=_git("rev-parse", "HEAD"),
                  dirty=bool(_git("status", "--porcelain", "--", "csrc", "kl_kernels/triton")), device=args.device,
                  rows=rows, vocab=args.vocab, repeats=args.repeats, machine=describe(dev), runs=runs)
    if args.device == "cpu":
        result["threads"] = 1
    print(f"{'CUDA C++' if args.device == 'cuda' else 'CPU'} forwards, N = {rows}, V = {args.vocab}, "
          f"fastest of {args.repeats} alternating calls")
    _table(runs)
    if args.device == "cuda":
        print("same-bytes copy (device to device) ms: " + ", ".join(f"{row['dtype']} {row['copy_ms']:.3f}"
                                                                  for run in runs for row in run))
        result["triton"] = triton_ab(args.base, rows, args.vocab, args.repeats)
        print("Triton forwards, the same")
        _table([result["triton"]])
        print("JSON", json.dumps(result))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0

if __name__ == "__main__":
    sys.exit(main())
