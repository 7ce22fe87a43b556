// Rows of a [*S, V] tensor of logits, shared by the row-wise CPU kernels (token_logprobs_cpu.cpp,
// full_kl_cpu.cpp): where row r starts, the loop shape of the row sums and how rows are split over
// threads. The Python side of the same row map is kl_kernels/vocab_rows.py.
#pragma once

#include <cstdint>
#include <type_traits>

#include "common/codes.h"
#include "cpu/parallel.h"

namespace kl {

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define KL_ROW_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define KL_ROW_CLONES
#endif

constexpr int kRowLanes = 16;       // vector lanes of the row loops
constexpr int64_t kRowSpan = 256;   // entries summed in float before the float64 accumulators
// lse - z beyond this has e^(z - lse) == 0 in float32 (exp_vec flushes below e^-87.3): clamping keeps
// 0 * inf (a -inf logit) out of the terms weighted by a probability.
constexpr float kRowFar = 88.0f;

// Row r of the logits starts at element (r / inner) * stride_outer + (r % inner) * stride_inner (the
// vocabulary contiguous): an [N, V] view is inner = rows, [B, T, V] slabs (logits[:, :-1]) inner = T.
inline int64_t row_start(int64_t r, int64_t inner, int64_t so, int64_t si) { return (r / inner) * so + (r % inner) * si; }

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

// fn(std::integral_constant<int32_t, DT>{}) for a logits dtype code DT of kFloat32, kBFloat16, kFloat16;
// 0, or 1 for any other code (the kernels' "unsupported dtype").
template <class Fn>
int with_logits_dtype(int32_t dtype, Fn&& fn) {
  switch (dtype) {
    case kFloat32: fn(std::integral_constant<int32_t, kFloat32>{}); return 0;
    case kBFloat16: fn(std::integral_constant<int32_t, kBFloat16>{}); return 0;
    case kFloat16: fn(std::integral_constant<int32_t, kFloat16>{}); return 0;
    default: return 1;
  }
}

}  // namespace kl
