// Fused kl_penalty_loss on CUDA: forward (tile kernel + per-sequence combine, + batch totals for the
// one-weight aggregations) and backward.
//
// The algorithm of the Triton kernels (kl_kernels/triton/kl_penalty.py) with the geometry of the
// kl_reward CUDA kernel (cuda/tiles.cuh) and the per-token math of common/kl_penalty_math.h,
// shared with the CPU kernel:
//
// * Tiles of kCudaTile elements of the flat token space, one block each, kPer consecutive
//   elements per thread; the grid depends on the token count only.
// * Each counted token writes d loss / d lp to the gradient buffer (the one float tensor kept for
//   backward) and, for aggregation "none", its four per-token parts.
// * Eight per-sequence sums (the loss and the stat columns of common/kl_penalty_args.h: objective, kl,
//   entropy, ratio, and the clipped, low- and high-clipped flags) and the count without float atomics:
//   for each sum in turn, a block-wide fp64 segmented scan (restarting at each sequence's first
//   element, so a NaN or inf stays in its sequence) into one shared array, read at each segment's
//   last lane. The three flags share one scan: a tile's count of each is below kFlagBase, so
//   clipped + kFlagBase * low + kFlagBase^2 * high sums exactly in fp64 and is taken apart at the
//   segment's end (six scans, as before the low / high flags; and the flags ride in one 32-bit
//   register, not an array of floats). Sequences inside the tile finish there; the tile's first and
//   last segments go to two slots per tile, which combine adds (combine_sequences, tiles.cuh).
//
// Inputs are read with their strides (no vector loads: the loss reads five inputs per token in
// three dtypes, and the math, not the loads, dominates). Deterministic, no host synchronization,
// no allocation (caller's workspace), caller's stream: safe under CUDA graph capture.
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "common/kl_penalty_args.h"
#include "common/kl_penalty_math.h"
#include "cuda/kl_penalty_cuda.h"
#include "cuda/launch.cuh"
#include "cuda/tiles.cuh"

namespace kl {
namespace {

constexpr int kSums = 1 + kStatColumns;  // the loss, then the stat columns: the slots' and combine's sums
constexpr int kScans = 6;                 // the tile's scans: loss, objective, kl, entropy, ratio, the 3 flags
constexpr int kSlotStride = 8;            // doubles per slot
static_assert(kSums <= kSlotStride, "a slot holds every sum");
static_assert(kStatClipped == kScans - 2 && kStatClippedLow == kStatClipped + 1 &&
              kStatClippedHigh == kStatClipped + 2, "the flags' scan writes the last three stat columns");
// A tile's count of one flag is at most kCudaTile < kFlagBase: the packed flag sum below is exact in fp64.
constexpr double kFlagBase = 4096.0;
constexpr int kFlagBits = 12;
static_assert(kCudaTile < 4096, "kFlagBase bounds a tile's count");

__host__ __device__ inline int64_t penalty_tiles(const KLPenaltyArgs& a) {
  return (a.g.total + kCudaTile - 1) / kCudaTile;
}

struct PenaltyWorkspace {
  double* slot_sum;     // [2 * tiles, kSlotStride]
  int64_t* slot_count;  // [2 * tiles]
  int64_t* checks;      // [2]: the value checks folded into penalty_combine (tiles.cuh's record_first_check)
};

__host__ __device__ inline PenaltyWorkspace carve_penalty(const KLPenaltyArgs& a, uintptr_t ws) {
  const int64_t slots = 2 * penalty_tiles(a);
  PenaltyWorkspace w;
  w.slot_sum = reinterpret_cast<double*>(ws);
  w.slot_count = reinterpret_cast<int64_t*>(w.slot_sum + slots * kSlotStride);
  w.checks = w.slot_count + slots;
  return w;
}

inline bool aligned16(uintptr_t p) { return p % 16 == 0; }

template <int32_t T>
__device__ __forceinline__ float read(uintptr_t base, int64_t s0, int64_t s1, const Where& e) {
  return load<T>(reinterpret_cast<const void*>(base), e.seq * s0 + e.col * s1);
}

// The estimator and its straight-through flag are read at run time (g.est), as in kl_reward's kernels: a
// uniform branch per token, where template parameters made 8x the instantiations of this kernel.
template <int32_t DT, int32_t AT, bool VEC>
__global__ void __launch_bounds__(kThreads, 2) penalty_forward_tile(KLPenaltyArgs a, uintptr_t ws) {
  __shared__ double prefix[kCudaTile];  // segmented inclusive sums of one of the kScans values (fp64)
  __shared__ int cprefix[kCudaTile];    // inclusive prefix counts
  __shared__ double wsum[kWarps];
  __shared__ int wflag[kWarps], wcnt[kWarps];
  __shared__ int64_t seq_range[2];
  // Per element, written and read by its own thread only (no barrier needed): registers would not hold
  // them next to the six scans without spilling.
  __shared__ int16_t first_of[kCudaTile];  // its segment's first lane
  __shared__ int32_t seq_rel[kCudaTile];   // its sequence minus the tile's first element's

  const KLRewardArgs& g = a.g;
  const int64_t tile = blockIdx.x;
  int64_t t0, t_last, i0;
  Where w[kPer];
  locate_tile(g, seq_range, &t0, &t_last, &i0, w);
  const int lane0 = threadIdx.x * kPer;
  // What the rest of the kernel needs of each element, compacted right away so that the 8 Where
  // (five 64-bit fields each) are dead before the loads and the six scans (kept whole, they took
  // 151-156 registers: one block per SM): whether it starts a segment, ends one (the last lane of its
  // sequence in this tile), the segment's first lane, where its sum goes (the whole sequence is in
  // the tile; it continues from the previous tile; into the next), whether it is counted and in
  // bounds, and its sequence relative to the tile's first.
  // (Invalid geometry is not tested here: penalty_combine writes its NaN, as kl_reward's combine does. Tested
  // per element, it pushed sm_120's vector variants from the 32-byte stack frame allowed to 40-56 bytes.)
  uint64_t bits = 0;  // per element j, 7 bits from 7 * j: starts, ends, whole, head, tail, counted, inb
  const int64_t seq0 = w[0].seq;
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    const Where& e = w[j];
    const int lane = lane0 + j;
    const int last_lane = last_lane_of(e, i0 + j, t_last, t0);
    first_of[lane] = static_cast<int16_t>(first_lane(e, i0 + j, t0));  // <= lane
    seq_rel[lane] = static_cast<int32_t>(e.seq - seq0);
    const uint64_t f = (starts_segment(e, i0 + j) ? 1u : 0u) | ((e.inb && lane == last_lane) ? 2u : 0u) |
                       ((e.lo >= t0 && e.hi - 1 <= t_last) ? 4u : 0u) | (e.lo <= t0 ? 8u : 0u) |
                       (e.hi - 1 >= t_last ? 16u : 0u) | (e.counted ? 32u : 0u) | (e.inb ? 64u : 0u);
    bits |= f << (7 * j);
  }

  const float sign = a.ref ? 1.0f : -1.0f;
  const float ec = a.entropy_coef;
  float vals[kScans - 1][kPer];  // loss, objective, kl, entropy, ratio
  uint32_t flags = 0;            // per element j, 3 bits from 3 * j: clipped, low, high
  float* grad = reinterpret_cast<float*>(a.grad);
  float* tok = reinterpret_cast<float*>(a.token_out);
  // The inputs: on the vector path (a whole 8-element run, every per-token stream flat and 16-byte
  // aligned) one wide load per stream, values at tokens that are not counted loaded and ignored;
  // else element by element, counted tokens only.
  const bool full = VEC && i0 + kPer <= g.total;
  float lpv[kPer], oldv[kPer], otherv[kPer], advv[kPer], entv[kPer];
  if (full) {
    load8<DT>(g.lp, i0, lpv);
    load8<DT>(a.old, i0, oldv);
    if (a.ref) load8<DT>(a.ref, i0, otherv);
    if (!a.adv_per_seq) load8<AT>(a.adv, i0, advv);
    if (a.ent) load8<AT>(a.ent, i0, entv);
  }
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    const Where& e = w[j];  // (read only on the scalar path)
    const bool counted = (bits >> (7 * j + 5)) & 1u, inb = (bits >> (7 * j + 6)) & 1u;
    const int64_t seq = seq0 + seq_rel[lane0 + j];
    if (!full && counted) {
      lpv[j] = read<DT>(g.lp, g.lp_s0, g.lp_s1, e);
      oldv[j] = read<DT>(a.old, a.old_s0, a.old_s1, e);
      if (a.ref) otherv[j] = read<DT>(a.ref, a.ref_s0, a.ref_s1, e);
      if (!a.adv_per_seq) advv[j] = read<AT>(a.adv, a.adv_s0, a.adv_s1, e);
      if (a.ent) entv[j] = read<AT>(a.ent, a.ent_s0, a.ent_s1, e);
    }
    float loss = 0.0f, obj = 0.0f, kl = 0.0f, ent = 0.0f, ratio = 0.0f, gr = 0.0f, beta = 0.0f;
    if (counted) {
      const float other = a.ref ? otherv[j] : oldv[j];
      const float adv = a.adv_per_seq ? load<AT>(reinterpret_cast<const void*>(a.adv), seq * a.adv_s0) : advv[j];
      ent = a.ent ? entv[j] : 0.0f;
      beta = beta_of(a, seq);
      // Weights (an optional stream) are read here, element by element and through the element's
      // Where on both paths, not into a register array like the others: an array, or a flat read on
      // the vector path, pushed variants over the 128-register budget (8-byte stack frames).
      const float wo = !a.wt ? 1.0f : read<AT>(a.wt, a.wt_s0, a.wt_s1, e);
      const float wk = a.weight_kl ? wo : 1.0f;
      // the log-ratio: per token, or the sequence's (GSPO: seq_lr, read like a per-sequence advantage)
      const float lr = a.seq_lr ? reinterpret_cast<const float*>(a.seq_lr)[seq] : lpv[j] - oldv[j];
      const PPOToken t = ppo_token<kEstimatorAtRunTime, false>(lpv[j], lr, other, sign, adv, beta, a.clip_lo,
                                                               a.clip_hi, a.clip_c, wo, wk, g.est,
                                                               a.kl_ratio ? ~0u : 0u);
      obj = t.obj, kl = t.kl, ratio = t.ratio, gr = t.grad;
      flags |= ((t.clipped != 0.0f ? 1u : 0u) | (t.low != 0.0f ? 2u : 0u) | (t.high != 0.0f ? 4u : 0u)) << (3 * j);
      loss = obj + beta * kl - ec * ent;
    }
    vals[0][j] = loss, vals[1][j] = obj, vals[2][j] = kl, vals[3][j] = ent, vals[4][j] = ratio;
    if (!full && inb) grad[i0 + j] = gr;
    if (inb && tok) {
      const int64_t i = i0 + j;
      tok[i] = loss;
      tok[g.total + i] = obj;
      tok[2 * g.total + i] = beta * kl;
      tok[3 * g.total + i] = -ec * ent + 0.0f;
    }
    lpv[j] = gr;  // lpv is dead from here: it holds the gradient for the vector store
  }
  if (full) {
    Pack<float> p;  // 8 floats: two 128-bit stores
#pragma unroll
    for (int j = 0; j < kPer; ++j) p.v[j] = lpv[j];
    *reinterpret_cast<Pack<float>*>(grad + i0) = p;
  }

  PenaltyWorkspace wsp = carve_penalty(a, ws);
  float* seq_loss = reinterpret_cast<float*>(a.seq_loss);
  float* stats = reinterpret_cast<float*>(a.stats);
  int64_t* count = reinterpret_cast<int64_t*>(a.count);
  // Element j's value in scan v: vals[v][j], or (the last scan) its three flags packed (see kFlagBase)
  auto value = [&](int v, int j) -> double {
    if (v < kScans - 1) return static_cast<double>(vals[v][j]);
    const uint32_t f = flags >> (3 * j);
    return static_cast<double>(f & 1u) + kFlagBase * static_cast<double>((f >> 1) & 1u) +
           (kFlagBase * kFlagBase) * static_cast<double>((f >> 2) & 1u);
  };
#pragma unroll
  for (int v = 0; v < kScans; ++v) {  // unrolled: vals[v] stays in registers
    double own[kPer];
    int cown[kPer];
    bool started[kPer];
    double tv = 0.0;
    int tc = 0;
    bool ts = false;
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
      const bool st = (bits >> (7 * j)) & 1u;
      tv = st ? value(v, j) : tv + value(v, j);
      ts = ts || st;
      tc += (bits >> (7 * j + 5)) & 1u;
      own[j] = tv, cown[j] = tc, started[j] = ts;
    }
    double carry;
    int cbefore;
    block_segmented_scan(tv, ts, tc, wsum, wflag, wcnt, &carry, &cbefore);
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
      prefix[lane0 + j] = started[j] ? own[j] : carry + own[j];
      if (v == 0) cprefix[lane0 + j] = cbefore + cown[j];
    }
    __syncthreads();
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
      const unsigned f = static_cast<unsigned>(bits >> (7 * j));
      if (!(f & 2u)) continue;  // not the last lane of its sequence in this tile
      const int lane = lane0 + j;
      const int first = first_of[lane];
      const int64_t seq = seq0 + seq_rel[lane];
      const double seg = prefix[lane];  // the segment's own sum
      const int seg_count = cprefix[lane] - (first > 0 ? cprefix[first - 1] : 0);
      // the sums this scan finishes: its own, or (the flags' scan) the three flags' counts taken apart
      double sums[3] = {seg, 0.0, 0.0};
      if (v == kScans - 1) {
        const int64_t packed = static_cast<int64_t>(seg);  // an exact integer
        const int64_t field = (int64_t{1} << kFlagBits) - 1;
        sums[0] = static_cast<double>(packed & field);
        sums[1] = static_cast<double>((packed >> kFlagBits) & field);
        sums[2] = static_cast<double>(packed >> (2 * kFlagBits));
      }
      const int n_sums = v == kScans - 1 ? 3 : 1;
      if (f & 4u) {  // the whole sequence is in this tile
        if (v == 0) {
          seq_loss[seq] = static_cast<float>(seg);
          count[seq] = seg_count;
        } else {
#pragma unroll
          for (int k = 0; k < n_sums; ++k) stats[seq * kStatColumns + (v - 1 + k)] = static_cast<float>(sums[k]);
        }
      }
      for (int s = 0; s < 2; ++s) {
        if (!(f & (s == 0 ? 8u : 16u))) continue;
        const int64_t slot = 2 * tile + s;
#pragma unroll
        for (int k = 0; k < n_sums; ++k) wsp.slot_sum[slot * kSlotStride + v + k] = sums[k];
        if (v == 0) wsp.slot_count[slot] = seg_count;
      }
    }
    __syncthreads();  // prefix is reused by the next sum
  }
  reset_checks(g, wsp.checks);  // (last: no register of the tile's work is live here)
}

__global__ void __launch_bounds__(kThreads) penalty_combine(KLPenaltyArgs a, uintptr_t ws) {
  const KLRewardArgs& g = a.g;
  const PenaltyWorkspace wsp = carve_penalty(a, ws);
  float* seq_loss = reinterpret_cast<float*>(a.seq_loss);
  float* stats = reinterpret_cast<float*>(a.stats);
  int64_t* count = reinterpret_cast<int64_t*>(a.count);
  const bool checks = checks_folded(g);
  int64_t first_finding = kNoCheckFinding;  // this thread's sequences' first value-check finding
  auto range = [&](int64_t b, int64_t* lo, int64_t* hi) { flat_range(g, b, lo, hi); };
  // Two walks over the sequences: the loss and the first stat columns with the count (kFirstSums), then the
  // low / high flags' columns. One walk of all eight sums took sm_90's combine to a 24-byte stack frame (66
  // bytes of spill stores, ptxas -v); the second walk re-reads only the spanning rows' slots.
  constexpr int kFirstSums = 1 + kStatClippedLow;
  auto slot = [&](int64_t i) {
    SlotTotals<kFirstSums> s;
#pragma unroll
    for (int v = 0; v < kFirstSums; ++v) s.sum[v] = wsp.slot_sum[i * kSlotStride + v];
    s.count = wsp.slot_count[i];
    s.last = -1;
    return s;
  };
  // A row inside one tile was finished by its tile; an empty one gets zeros.
  combine_sequences<kFirstSums>(g.batch, range, slot, [&](int64_t b, int64_t lo, int64_t hi, bool spans,
                                                          const SlotTotals<kFirstSums>& t) {
    const bool bad = geometry_bad(g, b);
    if (checks) {
      const int64_t key = check_key(g, b);
      first_finding = key < first_finding ? key : first_finding;
    }
    if (hi > lo && !spans) {
      if (bad) seq_loss[b] = NAN;
    } else {
      seq_loss[b] = bad ? NAN : static_cast<float>(t.sum[0]);
#pragma unroll
      for (int v = 1; v < kFirstSums; ++v) stats[b * kStatColumns + (v - 1)] = static_cast<float>(t.sum[v]);
      count[b] = t.count;
    }
    if (bad) {
      // Invalid geometry (reported through the error word): NaN in the loss, the objective and KL sums and
      // over the sequence's per-token outputs (its loss, objective and KL terms, the gradient), written here
      // on that path alone rather than tested per element in penalty_forward_tile (whose registers are full)
      stats[b * kStatColumns + 0] = stats[b * kStatColumns + 1] = NAN;
      float* grad = reinterpret_cast<float*>(a.grad);
      float* tok = reinterpret_cast<float*>(a.token_out);
      for (int64_t i = lo; i < hi; ++i) {
        grad[i] = NAN;
        if (tok) tok[i] = tok[g.total + i] = tok[2 * g.total + i] = NAN;
      }
    }
  });
  constexpr int kFlagSums = kSums - kFirstSums;
  static_assert(kFlagSums == 2, "the second walk: the low and high flags");
  auto flag_slot = [&](int64_t i) {
    SlotTotals<kFlagSums> s;
#pragma unroll
    for (int v = 0; v < kFlagSums; ++v) s.sum[v] = wsp.slot_sum[i * kSlotStride + kFirstSums + v];
    s.count = 0;
    s.last = -1;
    return s;
  };
  combine_sequences<kFlagSums>(g.batch, range, flag_slot, [&](int64_t b, int64_t lo, int64_t hi, bool spans,
                                                              const SlotTotals<kFlagSums>& t) {
    if (hi > lo && !spans) return;  // finished by its tile
#pragma unroll
    for (int v = 0; v < kFlagSums; ++v) stats[b * kStatColumns + kStatClippedLow + v] = static_cast<float>(t.sum[v]);
  });
  if (checks) record_first_check(g, first_finding, wsp.checks);
}

// The aggregation's sums and outputs (add_agg_terms, finalize_aggregation), after combine, in one
// block: thread i sums sequences i, i + kThreads, ... in order, then a tree of fixed shape over the
// threads. Deterministic; float64 throughout, as the torch aggregation's sums of the same
// per-sequence values.
__global__ void __launch_bounds__(kThreads) penalty_totals(KLPenaltyArgs a) {
  // (the tree halves kThreads, a power of two: tiles.cuh asserts it)
  __shared__ double part[kAggSums][kThreads];
  const float* seq_loss = reinterpret_cast<const float*>(a.seq_loss);
  const float* stats = reinterpret_cast<const float*>(a.stats);
  const int64_t* count = reinterpret_cast<const int64_t*>(a.count);
  double s[kAggSums] = {};
  for (int64_t b = threadIdx.x; b < a.g.batch; b += kThreads) {
    add_agg_terms(a, b, static_cast<double>(seq_loss[b]), stats + b * kStatColumns, count[b], s);
  }
  for (int c = 0; c < kAggSums; ++c) part[c][threadIdx.x] = s[c];
  __syncthreads();
  for (int half = kThreads / 2; half > 0; half >>= 1) {
    if (static_cast<int>(threadIdx.x) < half) {
      for (int c = 0; c < kAggSums; ++c) part[c][threadIdx.x] += part[c][threadIdx.x + half];
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    double t[kAggSums];
    for (int c = 0; c < kAggSums; ++c) t[c] = part[c][0];
    finalize_aggregation(a, t);
  }
}

// At least 3 blocks per SM: a register cap (80) that it fits in. Without one, CUDA 13's ptxas aimed sm_100 and
// sm_120 at full occupancy (64 registers) and spilled 8 bytes per thread to a stack frame; at 3 it takes
// 66-67 registers and no stack there, and sm_80/sm_90 (54-60 registers) are below the cap anyway.
template <int32_t DT, int32_t AT, bool VEC>
__global__ void __launch_bounds__(kThreads, 3) penalty_backward_tile(KLPenaltyArgs a) {
  __shared__ int64_t seq_range[2];
  const KLRewardArgs& g = a.g;
  int64_t t0, t_last, i0;
  Where w[kPer];
  locate_tile(g, seq_range, &t0, &t_last, &i0, w);
  const unsigned bad = bad_bits(g, w);  // invalid geometry: NaN
  const float* grad = reinterpret_cast<const float*>(a.grad);
  const float* g_seq = reinterpret_cast<const float*>(a.g_seq);
  const float* g_tok = reinterpret_cast<const float*>(a.g_tok);
  // The aggregated loss's gradient times the forward's weight w (and u_b per sequence below), in
  // float64 as torch's autograd of the float64 aggregation
  const double g_all = a.g_loss ? static_cast<double>(*reinterpret_cast<const float*>(a.g_loss)) *
                                      *reinterpret_cast<const double*>(a.result_weight)
                                : static_cast<double>(a.g_uniform);
  const int64_t* seq_count = reinterpret_cast<const int64_t*>(a.count);
  // Every stream here is flat [total]; the vector path (a whole 8-element run, 16-byte aligned
  // pointers) reads and writes them 128 bits at a time.
  const bool full = VEC && i0 + kPer <= g.total;
  float gr[kPer], gt[kPer];
  if (full) {
    const Pack<float> p = *reinterpret_cast<const Pack<float>*>(grad + i0);
#pragma unroll
    for (int j = 0; j < kPer; ++j) gr[j] = p.v[j], gt[j] = 0.0f;
    if (g_tok) {
      const Pack<float> q = *reinterpret_cast<const Pack<float>*>(g_tok + i0);
#pragma unroll
      for (int j = 0; j < kPer; ++j) gt[j] = q.v[j];
    }
  } else {
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
      gr[j] = w[j].counted ? grad[i0 + j] : 0.0f;
      gt[j] = (w[j].counted && g_tok) ? g_tok[i0 + j] : 0.0f;
    }
  }
  float glp[kPer], gent[kPer];
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    glp[j] = 0.0f, gent[j] = 0.0f;
    if (w[j].counted) {
      const float gs = g_seq ? g_seq[w[j].seq]
                             : a.agg_seq_mean ? static_cast<float>(g_all * seq_weight(a, seq_count[w[j].seq]))
                                              : static_cast<float>(g_all);
      const float gin = gs + gt[j];
      glp[j] = gin * gr[j];
      gent[j] = -a.entropy_coef * gin;
    }
    if ((bad >> j) & 1u) glp[j] = gent[j] = NAN;
  }
  if (full) {
    Pack<BitsOf<DT>> pl;
#pragma unroll
    for (int j = 0; j < kPer; ++j) pl.v[j] = to_bits<DT>(glp[j]);
    *reinterpret_cast<Pack<BitsOf<DT>>*>(reinterpret_cast<BitsOf<DT>*>(a.g_lp) + i0) = pl;
    if (a.g_ent) {
      Pack<BitsOf<AT>> pe;
#pragma unroll
      for (int j = 0; j < kPer; ++j) pe.v[j] = to_bits<AT>(gent[j]);
      *reinterpret_cast<Pack<BitsOf<AT>>*>(reinterpret_cast<BitsOf<AT>*>(a.g_ent) + i0) = pe;
    }
  } else {
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
      if (!w[j].inb) continue;
      store<DT>(reinterpret_cast<void*>(a.g_lp), i0 + j, glp[j]);
      if (a.g_ent) store<AT>(reinterpret_cast<void*>(a.g_ent), i0 + j, gent[j]);
    }
  }
}

// The forward's vector path: every per-token input flat in the layout's shape and 16-byte aligned,
// and the gradient buffer aligned (the per-token outputs of aggregation "none" stay scalar: their
// rows start at multiples of total).
bool vectorizable_forward(const KLPenaltyArgs& a) {
  const KLRewardArgs& g = a.g;
  auto flat = [&](int64_t s0, int64_t s1) { return s1 == 1 && (g.layout == kPacked || s0 == g.width); };
  bool ok = flat(g.lp_s0, g.lp_s1) && aligned16(g.lp) && flat(a.old_s0, a.old_s1) && aligned16(a.old) &&
            aligned16(a.grad);
  if (a.ref) ok = ok && flat(a.ref_s0, a.ref_s1) && aligned16(a.ref);
  if (!a.adv_per_seq) ok = ok && flat(a.adv_s0, a.adv_s1) && aligned16(a.adv);
  if (a.ent) ok = ok && flat(a.ent_s0, a.ent_s1) && aligned16(a.ent);
  if (a.wt) ok = ok && flat(a.wt_s0, a.wt_s1) && aligned16(a.wt);
  return ok;
}

template <int32_t DT, int32_t AT>
int forward_typed(const KLPenaltyArgs& a, uintptr_t ws, cudaStream_t stream) {
  const int64_t tiles = penalty_tiles(a);
  if (tiles > 0) {
    const dim3 grid(static_cast<unsigned>(tiles));
    const cudaError_t err = vectorizable_forward(a)
                                ? launch(penalty_forward_tile<DT, AT, true>, grid, kThreads, 0, stream, a, ws)
                                : launch(penalty_forward_tile<DT, AT, false>, grid, kThreads, 0, stream, a, ws);
    if (int s = launch_status(err)) return s;
  }
  if (a.g.batch > 0) {
    const int64_t blocks = (a.g.batch + kThreads - 1) / kThreads;
    const cudaError_t err =
        launch(penalty_combine, static_cast<unsigned>(blocks < 65535 ? blocks : 65535), kThreads, 0, stream, a, ws);
    if (int s = launch_status(err)) return s;
  }
  if (a.result) return launch_status(launch(penalty_totals, 1, kThreads, 0, stream, a));
  return 0;
}

}  // namespace

int64_t kl_penalty_cuda_workspace_bytes(const KLPenaltyArgs& a) {
  return (2 * penalty_tiles(a) * (kSlotStride + 1) + 2) * 8;
}

int kl_penalty_forward_cuda(const KLPenaltyArgs& a, uintptr_t workspace, uintptr_t stream) {
  if (a.totals) return 3;  // batch totals are the CPU forward's (the host reads them right away)
  // The tile kernel keeps sequence indices relative to its first one in 32 bits (registers):
  // 2^31 sequences would take 16 GB of offsets alone; refused rather than wrapped.
  if (penalty_tiles(a) > 0x7fffffff || a.g.batch > 0x7fffffff) return 2;
  const int32_t est = a.g.est.estimator;
  if (est != kK1 && est != kAbs && est != kK2 && est != kK3) return 1;
  return with_dtypes(a.g.dtype, a.aux_dtype, [&](auto dt, auto at) {
    return forward_typed<decltype(dt)::value, decltype(at)::value>(a, workspace,
                                                                  reinterpret_cast<cudaStream_t>(stream));
  });
}

int kl_penalty_backward_cuda(const KLPenaltyArgs& a, uintptr_t stream) {
  const int64_t tiles = penalty_tiles(a);
  if (tiles > 0x7fffffff) return 2;
  if (tiles == 0) return 0;
  // The flat streams 16-byte aligned (absent ones count as aligned): the vector path.
  const bool vec = aligned16(a.grad) && aligned16(a.g_tok) && aligned16(a.g_lp) && aligned16(a.g_ent);
  return with_dtypes(a.g.dtype, a.aux_dtype, [&](auto dt, auto at) {
    constexpr int32_t DT = decltype(dt)::value, AT = decltype(at)::value;
    const dim3 grid(static_cast<unsigned>(tiles));
    const cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
    return launch_status(vec ? launch(penalty_backward_tile<DT, AT, true>, grid, kThreads, 0, s, a)
                             : launch(penalty_backward_tile<DT, AT, false>, grid, kThreads, 0, s, a));
  });
}

}  // namespace kl
