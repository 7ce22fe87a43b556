// Device-side building blocks shared by the CUDA kernels (kl_reward_cuda.cu, kl_penalty_cuda.cu):
// the tile geometry (kCudaTile elements per block of kThreads threads, kPer consecutive elements
// per thread), locating each element in its sequence, and a deterministic block-wide prefix scan.
// Header-only and internal to the .cu files (an anonymous namespace per translation unit).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "common/codes.h"
#include "common/kl_math.h"  // BitsOf, from_bits
#include "common/kl_reward_args.h"
#include "cuda/errors.cuh"  // record_value_error
#include "cuda/kl_reward_cuda.h"  // kCudaTile

// sm_100 and sm_120 (CUDA 13's ptxas): kl_reward's forward_tile sits at 128 registers (2 blocks of kThreads
// per SM) and there ptxas spilled 8-24 bytes per thread to a stack frame in local memory; this lets it spill
// to shared memory instead (PTX ISA 9.0, CUDA 13: up to 6 KB more per block, 2 blocks per SM kept).
// sm_80..sm_90 need no spill: their code is unchanged. (penalty_forward_tile does not take it: ptxas keeps
// its stack frame there, tests/test_cuda_static.py.)
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 1000 && defined(__CUDACC_VER_MAJOR__) && __CUDACC_VER_MAJOR__ >= 13
#define KL_SPILL_TO_SHARED() asm volatile(".pragma \"enable_smem_spilling\";")
#else
#define KL_SPILL_TO_SHARED() ((void)0)
#endif

namespace kl {
namespace {

constexpr int kThreads = 256;
constexpr int kPer = 8;
constexpr int kWarps = kThreads / 32;
static_assert(kThreads * kPer == kCudaTile, "tile = threads x elements per thread");

template <typename T>
struct alignas(sizeof(T) * kPer >= 16 ? 16 : sizeof(T) * kPer) Pack {  // 8 elements, vector-loadable
  T v[kPer];
};

// 8 consecutive elements from flat index i0 as floats: one 128-bit load (64-bit for 16-bit types).
template <int32_t T>
__device__ __forceinline__ void load8(uintptr_t base, int64_t i0, float (&out)[kPer]) {
  const Pack<BitsOf<T>> p = *reinterpret_cast<const Pack<BitsOf<T>>*>(reinterpret_cast<const BitsOf<T>*>(base) + i0);
#pragma unroll
  for (int j = 0; j < kPer; ++j) out[j] = from_bits<T>(p.v[j]);
}

template <typename T>
__device__ __forceinline__ T ld(uintptr_t base, int64_t i) {
  return reinterpret_cast<const T*>(base)[i];
}

// Where one element stands. lo/hi: its sequence's flat range; pos: position in the sequence.
struct Where {
  int64_t seq, col, pos, lo, hi;
  bool inb, counted;
};

// The 8 consecutive elements of this thread, starting at flat index i0 (tile range [t0, t_last]).
__device__ __forceinline__ void locate(const KLRewardArgs& a, int64_t i0, int64_t b_lo, int64_t b_hi,
                                       Where (&w)[kPer]) {
  const int64_t* off = reinterpret_cast<const int64_t*>(a.offsets);  // raw: compared only, never an index
  const int64_t* len = reinterpret_cast<const int64_t*>(a.lengths);
  const int64_t* prompt = reinterpret_cast<const int64_t*>(a.prompt_lens);
  const uint8_t* mask = reinterpret_cast<const uint8_t*>(a.mask);
  int64_t seq;
  if (a.layout == kPacked) {
    const int64_t first = i0 < a.total ? i0 : a.total - 1;
    int64_t lo = b_lo, hi = b_hi;  // last b in [lo, hi] with off[b] <= first
    while (lo < hi) {
      const int64_t mid = lo + (hi - lo + 1) / 2;
      if (off[mid] <= first) lo = mid; else hi = mid - 1;
    }
    seq = lo;
  } else {
    // A thread wholly past the end of the last row (i0 >= total) would get seq >= batch: clamped, so
    // that every per-sequence read (coef, lengths, reward) stays in bounds (its elements are not inb).
    seq = i0 / a.width < a.batch ? i0 / a.width : a.batch - 1;
  }
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    const int64_t i = i0 + j;
    Where& e = w[j];
    e.inb = i < a.total;
    if (a.layout == kPacked) {
      while (e.inb && seq + 1 < a.batch && off[seq + 1] <= i) ++seq;  // skips empty sequences
      e.seq = seq;
      // Raw, as the search reads them: the kernels compare lo and hi with the tile's ends and clamp what they
      // index with (the segment's first and last lanes into [t0, i] and [i, t_last]: first_lane, last_lane_of),
      // so under any offsets the tile's lanes stay in the tile. pos is only compared or recorded (a last position, checked
      // against the clamped length before use: place_last). Widening lo and hi here instead cost sm_120's
      // penalty_forward_tile 8 bytes more stack (40 for 32).
      e.lo = off[seq];
      e.hi = off[seq + 1];
      e.col = i;
      e.pos = i - e.lo;
      e.counted = e.inb;
    } else {
      while (i >= (seq + 1) * a.width && seq + 1 < a.batch) ++seq;
      e.seq = seq;
      e.lo = seq * a.width;
      e.hi = e.lo + a.width;
      e.col = i - e.lo;
      const int64_t length = (e.inb && len) ? clamp_to(len[seq], 0, a.width) : a.width;
      e.pos = a.left_pad ? e.col - (a.width - length) : e.col;
      e.counted = e.inb && e.pos >= 0 && e.pos < length;
    }
    if (e.counted && prompt) e.counted = e.pos >= prompt[e.seq];
    if (e.counted && mask) e.counted = mask[e.seq * a.mask_s0 + e.col * a.mask_s1] != 0;
  }
}

// Bit j set: this thread's element j is in bounds and its sequence's geometry is invalid (geometry_bad,
// common/kl_reward_args.h: its outputs are NaN, the value checks report it through the error word).
// geometry_bad is evaluated once per distinct sequence among the 8 consecutive elements (their sequences
// are non-decreasing: usually one call per thread), each in a branch of its own, and the result is one
// register: evaluated per element, its 8 x 5 loads were in flight next to the tile's values and cost
// sm_100 a stack frame (backward_tile, penalty_backward_tile; the forwards leave it to their combines).
__device__ __forceinline__ unsigned bad_bits(const KLRewardArgs& a, const Where (&w)[kPer]) {
  unsigned bits = 0;
  int64_t seq = -1;
  bool bad = false;
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    if (w[j].inb && w[j].seq != seq) {
      seq = w[j].seq;
      bad = geometry_bad(a, seq);
    }
    bits |= (w[j].inb && bad ? 1u : 0u) << j;
  }
  return bits;
}

// seq_of (common/kl_reward_args.h) for the packed layout, by a whole warp: each step the 32 lanes
// probe 32 evenly spaced offsets of the range left, and the number of probes at or below i (a prefix
// of the lanes: offsets are sorted), summed by shuffles, narrows the range 32-fold. Every lane
// returns the same value. Call with the warp's 32 lanes converged.
__device__ __forceinline__ int64_t warp_seq_of(const KLRewardArgs& a, int64_t i) {
  const int64_t* off = reinterpret_cast<const int64_t*>(a.offsets);
  const int lane = threadIdx.x & 31;
  int64_t lo = 0, hi = a.batch;  // the last b in [lo, hi] with off[b] <= i; off[0] = 0 <= i
  while (lo < hi) {
    const int64_t step = (hi - lo + 31) / 32;
    const int64_t p = lo + (lane + 1) * step;
    int k = (p <= hi && off[p] <= i) ? 1 : 0;
#pragma unroll
    for (int d = 16; d > 0; d >>= 1) k += __shfl_xor_sync(0xffffffffu, k, d);
    const int64_t next_hi = lo + (k + 1) * step - 1;
    lo += k * step;
    hi = next_hi < hi ? next_hi : hi;
  }
  return lo < a.batch ? lo : a.batch - 1;
}

// This block's tile [t0, t_last] and this thread's 8 elements from i0 (seq_range: shared scratch).
__device__ __forceinline__ void locate_tile(const KLRewardArgs& a, int64_t* seq_range, int64_t* t0, int64_t* t_last,
                                            int64_t* i0, Where (&w)[kPer]) {
  *t0 = static_cast<int64_t>(blockIdx.x) * kCudaTile;
  *t_last = (*t0 + kCudaTile < a.total ? *t0 + kCudaTile : a.total) - 1;
  // The tile's first and last sequences, found once per block by warps 0 and 1 side by side, each with
  // a 32-way search (4 dependent reads for a million sequences, where one thread's binary search
  // made 20 in a row, twice, while the whole block waited at the barrier).
  if (a.layout == kPacked && threadIdx.x < 64) {
    const int64_t r = warp_seq_of(a, threadIdx.x < 32 ? *t0 : *t_last);
    if ((threadIdx.x & 31) == 0) seq_range[threadIdx.x >> 5] = r;
  }
  __syncthreads();
  *i0 = *t0 + static_cast<int64_t>(threadIdx.x) * kPer;
  locate(a, *i0, seq_range[0], seq_range[1], w);
}

// Block-wide exclusive scan over threads, in thread order, of two things at once:
// * a segmented fp64 sum: each thread gives (v, starts), v the sum of its elements after its last
//   segment start (all of them when it has none) and starts whether a segment starts among them;
//   *carry is the sum of the v of the threads before this one back to the nearest one that starts a
//   segment (that one included), i.e. what this thread's first segment inherits from earlier threads.
//   Sums never cross a segment start, so a NaN or inf stays in its segment (its sequence);
// * a plain int count prefix (*before_c: the counts of all earlier threads; ints are exact, so the
//   count of a segment may be taken as a difference of prefixes).
// The operator on (value, starts) pairs, (a, fa) + (b, fb) = (fb ? b : a + b, fa | fb), is associative:
// warp shuffles, then the warps' totals in shared memory (wsum, wflag, wcnt), fixed order throughout.
__device__ __forceinline__ void block_segmented_scan(double v, bool starts, int c, double* wsum, int* wflag, int* wcnt,
                                                     double* carry, int* before_c) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  double iv = v;
  int iflag = starts, ic = c;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const double ov = __shfl_up_sync(0xffffffffu, iv, d);
    const int of = __shfl_up_sync(0xffffffffu, iflag, d);
    const int oc = __shfl_up_sync(0xffffffffu, ic, d);
    if (lane >= d) {
      if (!iflag) iv = ov + iv;
      iflag |= of;
      ic += oc;
    }
  }
  if (lane == 31) wsum[warp] = iv, wflag[warp] = iflag, wcnt[warp] = ic;
  __syncthreads();
  if (warp == 0) {
    double sv = lane < kWarps ? wsum[lane] : 0.0;
    int sf = lane < kWarps ? wflag[lane] : 0;
    int sc = lane < kWarps ? wcnt[lane] : 0;
#pragma unroll
    for (int d = 1; d < kWarps; d <<= 1) {
      const double ov = __shfl_up_sync(0xffffffffu, sv, d);
      const int of = __shfl_up_sync(0xffffffffu, sf, d);
      const int oc = __shfl_up_sync(0xffffffffu, sc, d);
      if (lane >= d) {
        if (!sf) sv = ov + sv;
        sf |= of;
        sc += oc;
      }
    }
    if (lane < kWarps) wsum[lane] = sv, wflag[lane] = sf, wcnt[lane] = sc;  // inclusive over warps
  }
  __syncthreads();
  const double wv = warp > 0 ? wsum[warp - 1] : 0.0;
  const int wc = warp > 0 ? wcnt[warp - 1] : 0;
  const double ev = __shfl_up_sync(0xffffffffu, iv, 1);  // exclusive within the warp
  const int ef = __shfl_up_sync(0xffffffffu, iflag, 1);
  const int ec = __shfl_up_sync(0xffffffffu, ic, 1);
  *carry = lane > 0 ? (ef ? ev : wv + ev) : wv;
  *before_c = lane > 0 ? wc + ec : wc;
}

// The first and last lanes of element i's segment in the tile [t0, t_last] (lanes from t0), clamped to hold
// i's own lane: under invalid offsets (raw lo/hi, locate) they stay in [0, i - t0] and [i - t0, t_last - t0].
__device__ __forceinline__ int first_lane(const Where& e, int64_t i, int64_t t0) {
  const int64_t f = e.lo > t0 ? e.lo : t0;
  return static_cast<int>((f < i ? f : i) - t0);
}
__device__ __forceinline__ int last_lane_of(const Where& e, int64_t i, int64_t t_last, int64_t t0) {
  const int64_t l = e.hi - 1 < t_last ? e.hi - 1 : t_last;
  return static_cast<int>((l > i ? l : i) - t0);
}

// Whether flat element i starts a segment of the tile's segmented sums: its sequence's first element.
// (The tile's first element needs no flag: nothing comes before it in the tile.)
__device__ __forceinline__ bool starts_segment(const Where& e, int64_t i) { return e.lo == i; }

// ---------------------------------------------------------------- combine: rows spanning tiles
// A sequence spanning tiles k0..k1 is finished by the combine kernels from the tiles' boundary
// slots: the tail slot of its first tile (2 * k0 + 1), then the head slot (2 * t) of each later
// tile. Up to kLongSpan later tiles one thread adds them in tile order. A longer row (a 32k-token
// response spans 16 tiles; one 8M-token row 4,096) is summed by the whole block: thread i adds
// tiles k0 + 1 + i, k0 + 1 + i + kThreads, ... in order, then a tree of fixed shape over the
// threads. Its dependent chain is span / kThreads + log2(kThreads) steps instead of span (4,096
// L2 round trips, ~0.8 ms, for the 8M-token row: bench/gpu_model.md), and the result depends on
// the row alone, never on timing (deterministic, no atomics).
constexpr int64_t kLongSpan = 16;
static_assert((kThreads & (kThreads - 1)) == 0, "the tree halves kThreads");

template <int N>
struct SlotTotals {  // N float64 sums, a count and the largest last position (-1: none)
  double sum[N];
  int64_t count;
  int64_t last;
};

template <int N>
__device__ __forceinline__ SlotTotals<N> no_totals() {
  SlotTotals<N> r;
#pragma unroll
  for (int v = 0; v < N; ++v) r.sum[v] = 0.0;
  r.count = 0;
  r.last = -1;
  return r;
}

template <int N>
__device__ __forceinline__ void add_totals(SlotTotals<N>& acc, const SlotTotals<N>& x) {
#pragma unroll
  for (int v = 0; v < N; ++v) acc.sum[v] += x.sum[v];
  acc.count += x.count;
  acc.last = x.last > acc.last ? x.last : acc.last;
}

// The head slots of tiles k0 + 1 .. k1, summed by every thread of the block (block-uniform k0, k1).
template <int N, class Slot>
__device__ SlotTotals<N> block_slot_sum(int64_t k0, int64_t k1, const Slot& slot) {
  __shared__ double s_sum[N][kThreads];
  __shared__ int64_t s_count[kThreads], s_last[kThreads];
  SlotTotals<N> acc = no_totals<N>();
  for (int64_t t = k0 + 1 + threadIdx.x; t <= k1; t += kThreads) add_totals(acc, slot(2 * t));
  const int i = threadIdx.x;
#pragma unroll
  for (int v = 0; v < N; ++v) s_sum[v][i] = acc.sum[v];
  s_count[i] = acc.count;
  s_last[i] = acc.last;
  __syncthreads();
  for (int half = kThreads / 2; half > 0; half >>= 1) {
    if (i < half) {
#pragma unroll
      for (int v = 0; v < N; ++v) s_sum[v][i] += s_sum[v][i + half];
      s_count[i] += s_count[i + half];
      s_last[i] = s_last[i + half] > s_last[i] ? s_last[i + half] : s_last[i];
    }
    __syncthreads();
  }
  SlotTotals<N> r;
#pragma unroll
  for (int v = 0; v < N; ++v) r.sum[v] = s_sum[v][0];
  r.count = s_count[0];
  r.last = s_last[0];
  __syncthreads();  // the arrays are rewritten by the next row
  return r;
}

// The combine kernels' walk: for each sequence b (flat range [lo, hi) from range(b, &lo, &hi)),
// finish(b, lo, hi, spans, totals), `spans` when the row crosses a tile boundary and `totals` then
// its slots' sums. slot(index) reads one slot as SlotTotals<N>. Every thread of the block runs the
// same iterations (one sequence per thread each), so that the block can sum a long row together.
template <int N, class Range, class Slot, class Finish>
__device__ void combine_sequences(int64_t batch, const Range& range, const Slot& slot, const Finish& finish) {
  __shared__ int64_t long_k0[kThreads], long_k1[kThreads];
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * kThreads; base < batch; base += stride) {
    const int64_t b = base + threadIdx.x;
    int64_t lo = 0, hi = 0;
    if (b < batch) range(b, &lo, &hi);
    const int64_t k0 = lo / kCudaTile, k1 = hi > lo ? (hi - 1) / kCudaTile : k0;
    const bool spans = k1 > k0, long_row = k1 - k0 > kLongSpan;
    SlotTotals<N> totals = spans ? slot(2 * k0 + 1) : no_totals<N>();
    if (spans && !long_row)
      for (int64_t t = k0 + 1; t <= k1; ++t) add_totals(totals, slot(2 * t));
    long_k0[threadIdx.x] = k0;
    long_k1[threadIdx.x] = long_row ? k1 : -1;
    __syncthreads();
    for (int i = 0; i < kThreads; ++i) {
      if (long_k1[i] < 0) continue;  // the same for every thread of the block
      const SlotTotals<N> part = block_slot_sum<N>(long_k0[i], long_k1[i], slot);
      if (static_cast<int>(threadIdx.x) == i) add_totals(totals, part);
    }
    if (b < batch) finish(b, lo, hi, spans, totals);
    __syncthreads();  // long_k0/long_k1 are rewritten by the next iteration
  }
}

// ---------------------------------------------------------------- value checks folded into the combines
// The checks of ragged_checks.cu (offsets: start at 0, non-decreasing, end at total; lengths in [0, width];
// prompt_lens in [0, their sequence's bound]) made by the combine kernels, which visit every sequence anyway,
// instead of launches of their own (a.check_*: the ArgCode of each check asked for, 0 for none). The same
// findings: the first in the separate launches' order (offsets, then lengths, then prompt_lens; within each,
// the kernel's ranks, then the lowest index), whatever the grid: each thread keeps its sequences' first key,
// each block its smallest (a fixed tree), an integer atomicMin takes the grid's, and the last block to
// finish (a counter in the workspace, set by the tile kernel's block 0 before the combine starts) records it
// in the device error word. No float is involved: deterministic.
constexpr int64_t kNoCheckFinding = INT64_MAX;

// Checks folded into a's forward: every index the kernels derive from these values is clamped regardless.
__host__ __device__ __forceinline__ bool checks_folded(const KLRewardArgs& a) {
  return a.errors != 0 && (a.check_offsets | a.check_lengths | a.check_prompt) != 0;
}

// The bound of prompt_lens[b] (the lengths_valid check's hi) and its kind (device_errors.SEQUENCE_BOUNDS' index).
__device__ __forceinline__ int64_t prompt_bound(const KLRewardArgs& a, int64_t b) {
  const int64_t* off = reinterpret_cast<const int64_t*>(a.offsets);
  const int64_t* len = reinterpret_cast<const int64_t*>(a.lengths);
  return a.layout == kPacked ? off[b + 1] - off[b] : len ? len[b] : a.width;
}
__device__ __forceinline__ int32_t prompt_bound_kind(const KLRewardArgs& a) {
  return a.layout == kPacked ? 0 : a.lengths ? 1 : 2;
}

// Sequence b's first finding as a key, rank << kCheckRankShift | index (kNoCheckFinding: none): rank first,
// then the index, with no 64-bit division to take it apart (a called subroutine, whose frame cost the combines
// a stack). Ranks: 0-2 offsets (start, decrease at index b + 1, end), 3-4 lengths (below 0, above width), 5-6
// prompt_lens (below 0, above their bound).
constexpr int kCheckRankShift = 56;  // indices are below 2^56 (batch + 1 elements of int64: beyond any memory)
__device__ __forceinline__ int64_t check_key(const KLRewardArgs& a, int64_t b) {
  int64_t key = kNoCheckFinding;
  auto take = [&](int64_t rank, int64_t index) {
    const int64_t k = rank << kCheckRankShift | index;
    key = k < key ? k : key;
  };
  if (a.check_offsets) {
    const int64_t* off = reinterpret_cast<const int64_t*>(a.offsets);
    if (b == 0 && off[0] != 0) take(0, 0);
    if (off[b + 1] < off[b]) take(1, b + 1);
    if (b == a.batch - 1 && off[a.batch] != a.total) take(2, a.batch);
  }
  if (a.check_lengths) {
    const int64_t v = reinterpret_cast<const int64_t*>(a.lengths)[b];
    if (v < 0) take(3, b);
    if (v > a.width) take(4, b);
  }
  if (a.check_prompt) {
    const int64_t v = reinterpret_cast<const int64_t*>(a.prompt_lens)[b];
    if (v < 0) take(5, b);
    if (v > prompt_bound(a, b)) take(6, b);
  }
  return key;
}

// Records the finding of `key` as ragged_checks.cu's kernels do (same kind, argument, index, value, bound, extra):
// one call of the recorder with its fields chosen, rather than one per kind (fewer registers in the combines).
__device__ __forceinline__ void record_check(const KLRewardArgs& a, int64_t key) {
  const int64_t rank = key >> kCheckRankShift, i = key & ((int64_t{1} << kCheckRankShift) - 1);
  const bool offsets = rank <= 2, lengths = rank == 3 || rank == 4;
  const int64_t* values = reinterpret_cast<const int64_t*>(offsets ? a.offsets : lengths ? a.lengths : a.prompt_lens);
  const int32_t kind = rank == 0   ? kErrOffsetsStart
                       : rank == 1 ? kErrOffsetsDecreasing
                       : rank == 2 ? kErrOffsetsEnd
                       : rank == 4 ? kErrAboveBound
                       : rank == 6 ? kErrAboveSequence
                                   : kErrBelowZero;
  const int32_t arg = offsets ? a.check_offsets : lengths ? a.check_lengths : a.check_prompt;
  const int64_t bound = offsets ? a.total : lengths ? a.width : prompt_bound(a, i);
  record_value_error(a.errors, kind, arg, i, values[i], bound, rank >= 5 ? prompt_bound_kind(a) : 0);
}

// The check state in the workspace (2 int64: the grid's first key, the blocks done), reset by the tile kernel's
// block 0 (stream order puts it before the combine).
__device__ __forceinline__ void reset_checks(const KLRewardArgs& a, int64_t* state) {
  if (checks_folded(a) && blockIdx.x == 0 && threadIdx.x == 0) {
    state[0] = kNoCheckFinding;
    state[1] = 0;
  }
}

// The first finding of the sequences combine_sequences gives this thread (b = blockIdx.x * kThreads +
// threadIdx.x, then a grid's stride on), checked after its walk: kl_reward's combine, where checking them in
// the walk cost sm_100/sm_120 a stack frame (penalty_combine checks them in its walk: there this one did).
__device__ __forceinline__ int64_t first_check_of_sequences(const KLRewardArgs& a) {
  int64_t key = kNoCheckFinding;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t b = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; b < a.batch; b += stride) {
    const int64_t k = check_key(a, b);
    key = k < key ? k : key;
  }
  return key;
}

// The block's smallest key in a fixed tree (`keys`: shared [kThreads]); every thread gets it. Finds the value
// checks' first finding: at the end of a combine (below) and in ragged_checks.cu's check kernels.
__device__ __forceinline__ int64_t block_first(int64_t key, int64_t* keys) {
  keys[threadIdx.x] = key;
  __syncthreads();
  for (int half = kThreads / 2; half > 0; half >>= 1) {
    if (static_cast<int>(threadIdx.x) < half && keys[threadIdx.x + half] < keys[threadIdx.x])
      keys[threadIdx.x] = keys[threadIdx.x + half];
    __syncthreads();
  }
  return keys[0];
}

// End of a combine kernel (every thread of every block, `key` the first finding of the sequences the combine
// gave it: check_key in its walk): the grid's first finding, recorded by the last block. Call only when
// checks_folded(a) (block-uniform).
__device__ __forceinline__ void record_first_check(const KLRewardArgs& a, int64_t key, int64_t* state) {
  __shared__ int64_t keys[kThreads];
  key = block_first(key, keys);
  if (threadIdx.x != 0) return;
  long long* first = reinterpret_cast<long long*>(state);
  if (key != kNoCheckFinding) atomicMin(first, static_cast<long long>(key));
  __threadfence();  // this block's minimum is in before it counts itself done
  const unsigned long long done = atomicAdd(reinterpret_cast<unsigned long long*>(state + 1), 1ull);
  if (done != gridDim.x - 1ull) return;
  __threadfence();
  const long long found = atomicMin(first, static_cast<long long>(kNoCheckFinding));  // (an atomic read)
  if (found != kNoCheckFinding) record_check(a, found);
}

// Calls f(DT, AT) (std::integral_constant dtype codes) for a half/single main dtype and a second
// dtype that is the same or float32; returns 1 (unsupported) for anything else.
template <typename F>
int with_dtypes(int32_t dtype, int32_t second, F&& f) {
  auto with_second = [&](auto dt) {
    constexpr int32_t DT = decltype(dt)::value;
    if (second == DT) return f(std::integral_constant<int32_t, DT>{}, std::integral_constant<int32_t, DT>{});
    if (second == kFloat32) return f(std::integral_constant<int32_t, DT>{}, std::integral_constant<int32_t, kFloat32>{});
    return 1;
  };
  switch (dtype) {
    case kFloat32: return with_second(std::integral_constant<int32_t, kFloat32>{});
    case kBFloat16: return with_second(std::integral_constant<int32_t, kBFloat16>{});
    case kFloat16: return with_second(std::integral_constant<int32_t, kFloat16>{});
    default: return 1;
  }
}

}  // namespace
}  // namespace kl
