// How the row-wise CPU kernels (token_logprobs_cpu.cpp, full_kl_cpu.cpp) walk the rows of a [*S, V] tensor
// of logits: the loop shape of the row sums and how rows are split over threads. Where a row starts and the
// math of its entries are common/row_math.h's (shared with the CUDA kernels).
#pragma once

#include <cstdint>

#include "common/row_math.h"
#include "cpu/parallel.h"

namespace kl {

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define KL_ROW_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define KL_ROW_CLONES
#endif

constexpr int kRowLanes = 16;       // vector lanes of the row loops
constexpr int64_t kRowSpan = 256;   // entries summed in float before the float64 accumulators
// Entries of a run of the one-pass forwards: its max, then its spans' sums while it sits in L1 (4 KB of
// float32, 8 KB for full_kl's two rows). Measured against 256, 512, 2048 and 4096 (one core, 256 x 131072
// bf16, both in one process): the two-pass forwards' speed or better for both ops; 256 cost token_logprobs
// ~3 % (the max's lanes reduced 4x as often), 2048+ cost full_kl ~3 %.
constexpr int64_t kRowRun = 1024;

// The max of the lanes v[0..kRowLanes) (none NaN), as a tree of halves (4 levels of selects, which
// vectorize) rather than a chain of 15 dependent ones: it runs once per run of the one-pass forwards.
// Overwrites v.
inline float lanes_max(float (&v)[kRowLanes]) {
  for (int w = kRowLanes / 2; w > 0; w /= 2) {
    for (int l = 0; l < w; ++l) v[l] = v[l + w] > v[l] ? v[l + w] : v[l];
  }
  return v[0];
}

// fn(r0, r1) over tiles of ~64k logits (whole rows), on num_threads threads; each row is one thread's.
template <class Fn>
int run_row_tiles(int64_t rows, int64_t vocab, int num_threads, Fn&& fn) {
  if (rows <= 0) return 0;
  const int64_t per_tile = vocab >= 65536 ? 1 : 65536 / vocab;
  const int64_t tiles = (rows + per_tile - 1) / per_tile;
  run_tiles(tiles, num_threads, [&](int64_t t) {
    const int64_t r0 = t * per_tile;
    fn(r0, r0 + per_tile < rows ? r0 + per_tile : rows);
  });
  return 0;
}

}  // namespace kl
