// Arguments of the fused kl_reward kernels, shared by the CPU and CUDA implementations.
//
// Framework-free: raw addresses (as integers, so Python can fill them), element strides, dtype
// codes. Every problem is in one of two native layouts, addressed uniformly as (row, col):
//
//   packed  [N]     row = 0, col = token index; offsets[B + 1] give the sequences
//   padded  [B, T]  row = b, col = column; lengths[B] (or none: all T valid) and left_pad
//
// An input X is read at X[row * X_s0 + col * X_s1] (packed: X_s0 = 0, X_s1 = stride), so any
// strides work. Outputs are contiguous in the layout's shape, at index row * T + col (packed:
// the token index). Validation happens in Python before a kernel ever sees these.
//
// List inputs (packed layout, CPU forward only): when X_ptrs is set, sequence b's values live in
// their own buffer (a per-sample tensor) and position p of it is read at X_ptrs[b][p * X_s1];
// X and X_s0 are unused. The offsets still give the lengths and the packed output positions.
#pragma once

#include <cstdint>

#include "common/kl_math.h"

namespace kl {

// Layout, Placement and CoefMode: common/codes.h (generated from kl_kernels/codes.py).

struct KLRewardArgs {
  // geometry
  int32_t layout = kPacked;
  int64_t batch = 0;        // B
  int64_t width = 0;        // padded: T
  int64_t total = 0;        // packed: N; padded: B * T
  uintptr_t offsets = 0;    // packed: int64 [B + 1]
  uintptr_t lengths = 0;    // padded: int64 [B], or 0 (all T columns valid)
  int32_t left_pad = 1;     // padded: valid tokens are the last lengths[b] columns
  uintptr_t prompt_lens = 0;  // int64 [B] or 0

  // inputs
  int32_t dtype = kFloat32;         // log_probs and ref_log_probs
  int32_t reward_dtype = kFloat32;  // reward input and reward output
  uintptr_t lp = 0, ref = 0, mask = 0, reward = 0;  // mask: bool bytes; reward: see placement
  int64_t lp_s0 = 0, lp_s1 = 1, ref_s0 = 0, ref_s1 = 1, mask_s0 = 0, mask_s1 = 1, rw_s0 = 0, rw_s1 = 1;
  int32_t placement = kNoReward;    // token: reward in the layout; sequence/last: reward[b * rw_s0]
  int32_t coef_mode = kCoefScalar;
  float coef_scalar = 1.0f;
  uintptr_t coef = 0;               // float32: [1] (0-d) or [B]
  EstimatorParams est{};
  uintptr_t lp_ptrs = 0, ref_ptrs = 0, mask_ptrs = 0, reward_ptrs = 0;  // list inputs: int64 [B] addresses
  int32_t mask_nan = 0;             // 1: a token where either log-prob is NaN does not count (CPU only)

  // forward outputs (contiguous)
  uintptr_t kl = 0, reward_out = 0, ref_out = 0;  // ref_out may be 0 (return_ref=False)
  uintptr_t kl_sum = 0, count = 0;                // float32 [B], int64 [B]

  // backward: incoming gradients (contiguous, each may be 0 = zero) and outputs
  uintptr_t g_kl = 0, g_reward = 0, g_ref_out = 0, g_kl_sum = 0;
  uintptr_t g_lp = 0, g_ref = 0;

  // The value checks of offsets / lengths / prompt_lens folded into the CUDA forwards (their combine kernels,
  // which read every sequence's bounds anyway; cuda/tiles.cuh): each field the ArgCode (common/codes.h) the
  // first bad value is recorded under in the device error word `errors` (cuda/errors.cuh), 0 for a check not
  // asked for. What ragged_checks.cu's separate launches check, with the same findings (kl_kernels/launching.py).
  uintptr_t errors = 0;
  int32_t check_offsets = 0, check_lengths = 0, check_prompt = 0;
};

// Whether a uses what only the CPU forward implements (list inputs, NaN pads): the CUDA kernels
// and the CPU backward refuse such arguments (error code 3); Python never passes them there.
KL_HD bool cpu_forward_only(const KLRewardArgs& a) {
  return a.lp_ptrs || a.ref_ptrs || a.mask_ptrs || a.reward_ptrs || a.mask_nan;
}

// Where input X of sequence b is read at position pos, which is (row, col) in a shared buffer, as
// (buffer, element offset): a list input (X_ptrs set) is read in the sequence's own buffer.
struct InputAt {
  const void* base;
  int64_t offset;
};

KL_HD InputAt input_at(uintptr_t x, uintptr_t ptrs, int64_t s0, int64_t s1, int64_t b, int64_t pos, int64_t row,
                       int64_t col) {
  if (ptrs) return {reinterpret_cast<const void*>(reinterpret_cast<const int64_t*>(ptrs)[b]), pos * s1};
  return {reinterpret_cast<const void*>(x), row * s0 + col * s1};
}

// The coefficient of sequence b.
KL_HD float coef_of(const KLRewardArgs& a, int64_t b) {
  if (a.coef_mode == kCoefScalar) return a.coef_scalar;
  const float* c = reinterpret_cast<const float*>(a.coef);
  return a.coef_mode == kCoefPerSeq ? c[b] : c[0];
}

// ---------------------------------------------------------------- geometry under any values
// On the CPU the host checks offsets / lengths / prompt_lens before a kernel runs. On a GPU they are checked
// on the device while the kernels already run (kl_kernels/device_errors.py: a bad value is recorded, never
// asserted), so every index the kernels derive from them is clamped into the buffers (offsets into [0, total],
// lengths into [0, width]; in the CUDA tiles, a segment's first and last lanes into the tile: tiles.cuh's
// first_lane / last_lane_of): memory-safe under any values, and for valid ones the same numbers.

KL_HD int64_t clamp_to(int64_t v, int64_t lo, int64_t hi) { return v < lo ? lo : (v > hi ? hi : v); }

// offsets[b] clamped into [0, total].
KL_HD int64_t offset_at(const KLRewardArgs& a, int64_t b) {
  return clamp_to(reinterpret_cast<const int64_t*>(a.offsets)[b], 0, a.total);
}

// The length of padded row b clamped into [0, width] (all T without lengths).
KL_HD int64_t length_at(const KLRewardArgs& a, int64_t b) {
  const int64_t* len = reinterpret_cast<const int64_t*>(a.lengths);
  return len ? clamp_to(len[b], 0, a.width) : a.width;
}

// Whether sequence b's geometry is invalid (what the value checks report): its outputs are then NaN.
KL_HD bool geometry_bad(const KLRewardArgs& a, int64_t b) {
  int64_t length = a.width;
  bool bad = false;
  if (a.layout == kPacked) {
    const int64_t* off = reinterpret_cast<const int64_t*>(a.offsets);
    const int64_t lo = off[b], hi = off[b + 1];
    bad = lo < 0 || hi > a.total || hi < lo || (b == 0 && lo != 0) || (b == a.batch - 1 && hi != a.total);
    // a decrease next to it moves tokens in or out of its range too
    bad = bad || (b > 0 && off[b - 1] > lo) || (b + 1 < a.batch && off[b + 2] < hi);
    length = hi - lo;
  } else if (a.lengths) {
    length = reinterpret_cast<const int64_t*>(a.lengths)[b];
    bad = length < 0 || length > a.width;
  }
  const int64_t* pl = reinterpret_cast<const int64_t*>(a.prompt_lens);
  return bad || (pl && (pl[b] < 0 || pl[b] > length));
}

// Geometry of sequence b: its length and, for padded rows, the column of its first valid token.
struct SeqGeom {
  int64_t length;
  int64_t first_col;   // padded: column of position 0; packed: token index of position 0
  int64_t prompt;      // tokens at positions < prompt never count
};

KL_HD SeqGeom seq_geom(const KLRewardArgs& a, int64_t b) {
  SeqGeom g{};
  const int64_t* pl = reinterpret_cast<const int64_t*>(a.prompt_lens);
  g.prompt = pl ? pl[b] : 0;
  if (a.layout == kPacked) {  // (clamped: a negative length when the offsets decrease)
    g.first_col = offset_at(a, b);
    g.length = offset_at(a, b + 1) - g.first_col;
  } else {
    g.length = length_at(a, b);
    g.first_col = a.left_pad ? a.width - g.length : 0;
  }
  return g;
}

// Flat range [*lo, *hi) of sequence b's row (packed: its tokens; padded: the whole row, padding included).
KL_HD void flat_range(const KLRewardArgs& a, int64_t b, int64_t* lo, int64_t* hi) {
  if (a.layout == kPacked) {  // clamped, and empty where the offsets decrease
    *lo = offset_at(a, b);
    *hi = offset_at(a, b + 1);
    *hi = *hi < *lo ? *lo : *hi;
  } else {
    *lo = b * a.width;
    *hi = *lo + a.width;
  }
}

// Sequence containing flat index i (packed token, or padded element): binary search / division.
KL_HD int64_t seq_of(const KLRewardArgs& a, int64_t i) {
  if (a.layout == kPadded) return a.width > 0 ? i / a.width : 0;
  const int64_t* off = reinterpret_cast<const int64_t*>(a.offsets);
  int64_t lo = 0, hi = a.batch;  // find the last b with off[b] <= i (skips empty sequences)
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo + 1) / 2;
    if (off[mid] <= i) lo = mid; else hi = mid - 1;
  }
  return lo < a.batch ? lo : a.batch - 1;
}

// "last" placement: the reward of sequence b goes on its last counted token (position
// last_counted), else on its last valid one; an empty sequence has no slot. Writes reward_out there:
// reward[b] - coef_b * kl of that token (0 when it is not counted). Shared by the CPU and CUDA kernels.
template <int32_t DT, int32_t RT>
KL_HD void place_last(const KLRewardArgs& a, int64_t b, int64_t last_counted) {
  const SeqGeom g = seq_geom(a, b);
  const int64_t pos = last_counted >= 0 ? last_counted : g.length - 1;
  if (pos < 0 || pos >= g.length) return;  // (>=: only under invalid geometry, whose outputs are NaN)
  const int64_t row = a.layout == kPacked ? 0 : b, col = g.first_col + pos;
  const int64_t out = a.layout == kPacked ? col : b * a.width + col;
  float k = 0.0f;
  if (last_counted >= 0) {
    const InputAt lp = input_at(a.lp, a.lp_ptrs, a.lp_s0, a.lp_s1, b, pos, row, col);
    const InputAt ref = input_at(a.ref, a.ref_ptrs, a.ref_s0, a.ref_s1, b, pos, row, col);
    k = kl_value(load<DT>(lp.base, lp.offset) - load<DT>(ref.base, ref.offset), a.est);
  }
  const float rb = load<RT>(reinterpret_cast<const void*>(a.reward), b * a.rw_s0);
  store<RT>(reinterpret_cast<void*>(a.reward_out), out, rb - coef_of(a, b) * k);
}

// The per-sequence reward of the "last" (last counted token) and "last_valid" (last valid token,
// counted or not) placements, given the position of b's last counted token (-1: none): the last valid
// token is counted exactly when it is the last counted one.
template <int32_t DT, int32_t RT>
KL_HD void place_sequence_reward(const KLRewardArgs& a, int64_t b, int64_t last_counted) {
  if (a.placement == kLastValid) {
    const int64_t end = seq_geom(a, b).length - 1;
    last_counted = last_counted == end ? end : -1;
  }
  place_last<DT, RT>(a, b, last_counted);
}

}  // namespace kl
