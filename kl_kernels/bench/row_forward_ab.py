"""A/B benchmark of the CPU row kernels' forwards (``token_logprobs``, ``full_kl``) across two revisions of
the C++ sources, side by side in one process: for a change to ``csrc/cpu/{token_logprobs,full_kl}_cpu.cpp`` or
the headers they include, where two builds of the extension cannot be loaded into one Python process.

The base revision's sources (``git archive``) are compiled with ``-Dkl=kl_base`` next to the working
tree's, with the flags ``setup.py`` gives these files, into one program that times the two alternately
(one thread, the vocabulary contiguous, every row counted) and reports each one's fastest call of
``--repeats``: alternating calls see the same machine state, which on a shared VM drifts by 20 % or more
between runs a minute apart. Developer tool: needs ``git`` and ``g++`` (x86-64 for the kernels' AVX2 clones).

Run: ``python -m kl_kernels.bench.row_forward_ab --base REV [--rows 256] [--vocab 131072] [--out FILE]``.
Measured for the one-pass forwards (issue 28): ``bench/results/row-forward-one-pass-cpu-2core/``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from .machine import describe

REPO = Path(__file__).resolve().parents[2]
SOURCES = ("cpu/token_logprobs_cpu.cpp", "cpu/full_kl_cpu.cpp")
# setup.py's flags for the CPU kernels (SOURCE_FLAGS aside, which these files do not take)
FLAGS = ("-O3", "-g0", "-std=c++17", "-fwrapv", "-fno-trapping-math", "-fno-math-errno", "-ffp-contract=off")

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
namespace kl {
int token_logprobs_forward_cpu(const TokenLogprobsArgs& a, int num_threads);
int full_kl_forward_cpu(const FullKLArgs& a, int num_threads);
KL_SERIAL_TILES
}  // namespace kl
namespace kl_base {  // the base revision's (its row_args.h is the tree's: build() checks)
struct TokenLogprobsArgs;
struct FullKLArgs;
int token_logprobs_forward_cpu(const TokenLogprobsArgs& a, int num_threads);
int full_kl_forward_cpu(const FullKLArgs& a, int num_threads);
KL_SERIAL_TILES
}  // namespace kl_base

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
"""


def _git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, check=True).stdout.strip()


def build(base: str, work: Path) -> Path:
    """The A/B program: the base revision's row forwards as kl_base::, the working tree's as kl::."""
    base_src = work / "base"
    base_src.mkdir()
    archive = subprocess.run(["git", "-C", str(REPO), "archive", base, "csrc"], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(base_src)], input=archive, check=True)
    # The driver passes the tree's argument structs to both revisions' kernels: same layout required
    if (base_src / "csrc/common/row_args.h").read_text() != (REPO / "csrc/common/row_args.h").read_text():
        raise SystemExit(f"csrc/common/row_args.h differs between {base} and the tree: the driver cannot call both")
    (work / "driver.cpp").write_text(DRIVER)
    objects = []
    for tag, root, extra in (("base", base_src / "csrc", ["-Dkl=kl_base"]), ("head", REPO / "csrc", [])):
        for src in SOURCES:
            obj = work / f"{tag}_{Path(src).stem}.o"
            subprocess.run(["g++", *FLAGS, *extra, f"-I{root}", "-c", str(root / src), "-o", str(obj)], check=True)
            objects.append(str(obj))
    exe = work / "ab"
    subprocess.run(["g++", *FLAGS, f"-I{REPO / 'csrc'}", str(work / "driver.cpp"), *objects, "-o", str(exe)],
                   check=True)
    return exe


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", required=True, help="the revision to compare the working tree's sources with")
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--vocab", type=int, default=131072)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--runs", type=int, default=3, help="programs run one after another (each alternates)")
    p.add_argument("--out", type=Path, default=None, help="write the JSON here")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        exe = build(args.base, Path(tmp))
        runs = [json.loads(subprocess.run([str(exe), str(args.rows), str(args.vocab), str(args.repeats)],
                                          capture_output=True, text=True, check=True).stdout)
                for _ in range(args.runs)]
    result = dict(base=_git("rev-parse", args.base), head=_git("rev-parse", "HEAD"),
                  dirty=bool(_git("status", "--porcelain", "--", "csrc")), rows=args.rows, vocab=args.vocab,
                  repeats=args.repeats, threads=1, machine=describe(torch.device("cpu")), runs=runs)
    print("run | dtype | token_logprobs base / head ms | ratio | full_kl base / head ms | ratio | max rel diff")
    for i, run in enumerate(runs):
        for row in run:
            print(f"{i} | {row['dtype']} | {row['token_logprobs_base_ms']:.1f} / {row['token_logprobs_head_ms']:.1f} | "
                  f"{row['token_logprobs_base_ms'] / row['token_logprobs_head_ms']:.3f} | "
                  f"{row['full_kl_base_ms']:.1f} / {row['full_kl_head_ms']:.1f} | "
                  f"{row['full_kl_base_ms'] / row['full_kl_head_ms']:.3f} | {row['max_rel_diff']:.2g}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
