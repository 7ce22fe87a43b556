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
