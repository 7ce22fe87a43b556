// Fused kl_reward on CUDA: forward (tile kernel + per-sequence combine) and backward.
//
// The algorithm is the one of the Triton kernels (kl_kernels/triton/kl_reward.py), with the
// per-token math of common/kl_math.h shared with the CPU kernel:
//
// * The flat token space (packed: N tokens; padded: B * T elements, row-major) is cut into
//   tiles of kCudaTile elements, one block of 256 threads each, 8 consecutive elements per
//   thread (16-byte vector loads and stores when the inputs are contiguous and aligned). The
//   grid depends on the token count only: a row of any length spans as many tiles as it needs.
// * Each element finds its sequence (padded: a division; packed: a binary search over offsets
//   narrowed to the tile's range, then a forward walk) and whether it counts, and writes kl,
//   reward_out and the masked ref in place.
// * Per-sequence sums without float atomics: a block-wide segmented scan (fp64 values, restarting
//   at each sequence's first element, so a NaN or inf stays in its own sequence) and a prefix of
//   int counts, in shared memory; a sequence's share of the tile is the segmented sum at its last
//   lane (its count: the count prefix there minus the one before its first lane). Sequences wholly
//   inside the tile are finished there; the tile's first and last segments go to two slots per
//   tile, which the combine kernel adds (one thread per sequence in tile order, the whole block
//   for a row over more than kLongSpan tiles: combine_sequences, tiles.cuh) before applying
//   the "last" placement.
//
// Deterministic (fixed reduction order), no host synchronization, no allocation (the caller
// passes a workspace), launches on the caller's stream: safe under CUDA graph capture.
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "common/kl_reward_args.h"
#include "cuda/kl_reward_cuda.h"
#include "cuda/launch.cuh"
#include "cuda/tiles.cuh"

namespace kl {
namespace {

struct Workspace {  // carved out of the caller's buffer (8-byte aligned pieces)
  double* slot_sum;
  int64_t* slot_count;
  int64_t* slot_last;
  int64_t* last;
  int64_t* checks;  // [2]: the value checks folded into combine (tiles.cuh's record_first_check)
};

__host__ __device__ inline int64_t tiles_of(const KLRewardArgs& a) { return (a.total + kCudaTile - 1) / kCudaTile; }

__host__ __device__ inline Workspace carve(const KLRewardArgs& a, uintptr_t ws) {
  const int64_t slots = 2 * tiles_of(a);
  Workspace w;
  w.slot_sum = reinterpret_cast<double*>(ws);
  w.slot_count = reinterpret_cast<int64_t*>(w.slot_sum + slots);
  w.slot_last = w.slot_count + slots;
  w.last = w.slot_last + slots;
  w.checks = w.last + a.batch;
  return w;
}

template <int32_t DT, int32_t RT, bool VEC>
__global__ void __launch_bounds__(kThreads) forward_tile(KLRewardArgs a, uintptr_t ws) {
  KL_SPILL_TO_SHARED();
  __shared__ double prefix[kCudaTile];  // segmented inclusive sums of the tile's kl values (fp64)
  __shared__ int cprefix[kCudaTile];    // inclusive prefix counts
  __shared__ double wsum[kWarps];
  __shared__ int wflag[kWarps], wcnt[kWarps];
  __shared__ int64_t seq_range[2];

  const int64_t tile = blockIdx.x;
  int64_t t0, t_last, i0;
  Where w[kPer];
  locate_tile(a, seq_range, &t0, &t_last, &i0, w);
  const bool full = i0 + kPer <= a.total;

  // Inputs: raw bits of lp and ref, the reward base.
  BitsOf<DT> lp_raw[kPer], ref_raw[kPer];
  float base[kPer];
  if (VEC && full) {
    const Pack<BitsOf<DT>> lp = *reinterpret_cast<const Pack<BitsOf<DT>>*>(reinterpret_cast<const BitsOf<DT>*>(a.lp) + i0);
    const Pack<BitsOf<DT>> rf = *reinterpret_cast<const Pack<BitsOf<DT>>*>(reinterpret_cast<const BitsOf<DT>*>(a.ref) + i0);
#pragma unroll
    for (int j = 0; j < kPer; ++j) lp_raw[j] = lp.v[j], ref_raw[j] = rf.v[j];
  } else {
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
      lp_raw[j] = w[j].counted ? ld<BitsOf<DT>>(a.lp, w[j].seq * a.lp_s0 + w[j].col * a.lp_s1) : BitsOf<DT>(0);
      ref_raw[j] = w[j].counted ? ld<BitsOf<DT>>(a.ref, w[j].seq * a.ref_s0 + w[j].col * a.ref_s1) : BitsOf<DT>(0);
    }
  }
  if (a.placement == kToken) {
    if (VEC && full) {
      const Pack<BitsOf<RT>> r =
          *reinterpret_cast<const Pack<BitsOf<RT>>*>(reinterpret_cast<const BitsOf<RT>*>(a.reward) + i0);
#pragma unroll
      for (int j = 0; j < kPer; ++j) base[j] = from_bits<RT>(r.v[j]);
    } else {
#pragma unroll
      for (int j = 0; j < kPer; ++j)
        base[j] = w[j].inb ? from_bits<RT>(ld<BitsOf<RT>>(a.reward, w[j].seq * a.rw_s0 + w[j].col * a.rw_s1)) : 0.0f;
    }
  } else {
#pragma unroll
    for (int j = 0; j < kPer; ++j)
      base[j] = (a.placement == kSequence && w[j].inb) ? from_bits<RT>(ld<BitsOf<RT>>(a.reward, w[j].seq * a.rw_s0))
                                                       : 0.0f;
  }

  // Per-token outputs.
  float k[kPer];
  BitsOf<DT> kl_out[kPer], ref_out[kPer];
  BitsOf<RT> rw_out[kPer];
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    const float d = from_bits<DT>(lp_raw[j]) - from_bits<DT>(ref_raw[j]);
    k[j] = w[j].counted ? kl_value(d, a.est) : 0.0f;  // exactly 0 where not counted
    kl_out[j] = to_bits<DT>(k[j]);
    ref_out[j] = w[j].counted ? ref_raw[j] : BitsOf<DT>(0);
    rw_out[j] = to_bits<RT>(base[j] - coef_of(a, w[j].seq) * k[j]);
  }
  if (VEC && full) {
    Pack<BitsOf<DT>> p;
    Pack<BitsOf<RT>> r;
#pragma unroll
    for (int j = 0; j < kPer; ++j) p.v[j] = kl_out[j], r.v[j] = rw_out[j];
    *reinterpret_cast<Pack<BitsOf<DT>>*>(reinterpret_cast<BitsOf<DT>*>(a.kl) + i0) = p;
    *reinterpret_cast<Pack<BitsOf<RT>>*>(reinterpret_cast<BitsOf<RT>*>(a.reward_out) + i0) = r;
    if (a.ref_out) {
#pragma unroll
      for (int j = 0; j < kPer; ++j) p.v[j] = ref_out[j];
      *reinterpret_cast<Pack<BitsOf<DT>>*>(reinterpret_cast<BitsOf<DT>*>(a.ref_out) + i0) = p;
    }
  } else {
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
      if (!w[j].inb) continue;
      reinterpret_cast<BitsOf<DT>*>(a.kl)[i0 + j] = kl_out[j];
      reinterpret_cast<BitsOf<RT>*>(a.reward_out)[i0 + j] = rw_out[j];
      if (a.ref_out) reinterpret_cast<BitsOf<DT>*>(a.ref_out)[i0 + j] = ref_out[j];
    }
  }

  // Segmented sums (restarting at each sequence's first element) and prefix counts of the tile:
  // within the thread, then across the block.
  double own[kPer];
  int cown[kPer];
  bool started[kPer];
  double tv = 0.0;
  int tc = 0;
  bool ts = false;
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    const bool st = starts_segment(w[j], i0 + j);
    tv = st ? static_cast<double>(k[j]) : tv + static_cast<double>(k[j]);
    ts = ts || st;
    tc += w[j].counted;
    own[j] = tv, cown[j] = tc, started[j] = ts;
  }
  double carry;
  int cbefore;
  block_segmented_scan(tv, ts, tc, wsum, wflag, wcnt, &carry, &cbefore);
  const int lane0 = threadIdx.x * kPer;
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    prefix[lane0 + j] = started[j] ? own[j] : carry + own[j];
    cprefix[lane0 + j] = cbefore + cown[j];
  }
  __syncthreads();

  // Read each segment at its last lane: whole sequences finish here, boundary ones go to slots.
  Workspace wsp = carve(a, ws);
  float* kl_sum = reinterpret_cast<float*>(a.kl_sum);
  int64_t* count = reinterpret_cast<int64_t*>(a.count);
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    const Where& e = w[j];
    if (!e.inb) continue;
    const int lane = lane0 + j;
    const int first = first_lane(e, t0 + lane, t0);
    const int last_lane = last_lane_of(e, t0 + lane, t_last, t0);
    const bool end = lane == last_lane;
    const bool last_counted = e.counted && cprefix[last_lane] == cprefix[lane];
    if (!end && !last_counted) continue;
    const double seg_sum = prefix[lane];  // the segment's own sum: nothing of another sequence in it
    const int seg_count = cprefix[lane] - (first > 0 ? cprefix[first - 1] : 0);
    const bool whole = e.lo >= t0 && e.hi - 1 <= t_last;
    const bool head = e.lo <= t0, tail = e.hi - 1 >= t_last;
    if (whole) {
      if (end) {
        kl_sum[e.seq] = static_cast<float>(seg_sum);
        count[e.seq] = seg_count;
        if (seg_count == 0) wsp.last[e.seq] = -1;
      }
      if (last_counted) wsp.last[e.seq] = e.pos;
    }
    for (int s = 0; s < 2; ++s) {
      if (!(s == 0 ? head : tail)) continue;
      const int64_t slot = 2 * tile + s;
      if (end) {
        wsp.slot_sum[slot] = seg_sum;
        wsp.slot_count[slot] = seg_count;
        if (seg_count == 0) wsp.slot_last[slot] = -1;
      }
      if (last_counted) wsp.slot_last[slot] = e.pos;
    }
  }
  reset_checks(a, wsp.checks);  // (last: no register of the tile's work is live here)
}

template <int32_t DT, int32_t RT>
__global__ void __launch_bounds__(kThreads) combine(KLRewardArgs a, uintptr_t ws) {
  const Workspace wsp = carve(a, ws);
  float* kl_sum = reinterpret_cast<float*>(a.kl_sum);
  int64_t* count = reinterpret_cast<int64_t*>(a.count);
  auto range = [&](int64_t b, int64_t* lo, int64_t* hi) { flat_range(a, b, lo, hi); };
  auto slot = [&](int64_t i) {
    SlotTotals<1> s;
    s.sum[0] = wsp.slot_sum[i];
    s.count = wsp.slot_count[i];
    s.last = wsp.slot_last[i];
    return s;
  };
  auto finish = [&](int64_t b, int64_t lo, int64_t hi, bool spans, const SlotTotals<1>& t) {
    int64_t last = -1;
    if (hi == lo) {  // no element: no tile saw it
      kl_sum[b] = 0.0f;
      count[b] = 0;
    } else if (spans) {  // the last segment of its first tile, then the first segment of the others
      kl_sum[b] = static_cast<float>(t.sum[0]);
      count[b] = t.count;
      last = t.last;
    } else {
      last = wsp.last[b];
    }
    if (a.placement == kLast || a.placement == kLastValid) place_sequence_reward<DT, RT>(a, b, last);
    if (geometry_bad(a, b)) {
      // Invalid geometry (reported through the error word): NaN over the sequence's outputs, written here
      // on that path alone rather than tested per element in forward_tile (whose registers are full)
      kl_sum[b] = NAN;
      for (int64_t i = lo; i < hi; ++i) {
        store<DT>(reinterpret_cast<void*>(a.kl), i, NAN);
        store<RT>(reinterpret_cast<void*>(a.reward_out), i, NAN);
        if (a.ref_out) store<DT>(reinterpret_cast<void*>(a.ref_out), i, NAN);
      }
    }
  };
  combine_sequences<1>(a.batch, range, slot, finish);
  if (checks_folded(a)) record_first_check(a, first_check_of_sequences(a), wsp.checks);
}

// A minimum of blocks per SM, per arch: without one, CUDA 13's ptxas held sm_100's vector variants at 80 registers
// with an 8-byte stack frame (74-78 and no stack at 2 blocks, a 128 cap). At 2, sm_80..sm_89 took 80-103 registers
// (2 blocks); at 3 (an 80 cap) they take 78-80 and no stack, as before the invalid-geometry NaN (72-78, 3 blocks),
// where sm_90's vector variants (79-80) and sm_100's scalar ones (80) spill 8-24 bytes: those stay at 2.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
#define KL_BACKWARD_MIN_BLOCKS 3
#else
#define KL_BACKWARD_MIN_BLOCKS 2
#endif
template <int32_t DT, int32_t RT, bool VEC>
__global__ void __launch_bounds__(kThreads, KL_BACKWARD_MIN_BLOCKS) backward_tile(KLRewardArgs a) {
  __shared__ int64_t seq_range[2];
  int64_t t0, t_last, i0;
  Where w[kPer];
  locate_tile(a, seq_range, &t0, &t_last, &i0, w);
  const unsigned bad = bad_bits(a, w);  // invalid geometry: NaN
  const void* lp = reinterpret_cast<const void*>(a.lp);
  const void* ref = reinterpret_cast<const void*>(a.ref);
  const float* g_sum = reinterpret_cast<const float*>(a.g_kl_sum);
  // The vector path (whole 8-element run, every per-token stream flat and 16-byte aligned): one
  // 128-bit access per stream; values at tokens that are not counted are loaded and ignored.
  const bool full = VEC && i0 + kPer <= a.total;
  float d[kPer], gkl[kPer] = {}, grw[kPer] = {}, gro[kPer] = {};
  if (full) {
    float l[kPer], r[kPer];
    load8<DT>(a.lp, i0, l);
    load8<DT>(a.ref, i0, r);
#pragma unroll
    for (int j = 0; j < kPer; ++j) d[j] = l[j] - r[j];
    if (a.g_kl) load8<DT>(a.g_kl, i0, gkl);
    if (a.g_reward) load8<RT>(a.g_reward, i0, grw);
    if (a.g_ref_out) load8<DT>(a.g_ref_out, i0, gro);
  } else {
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
      const Where& e = w[j];
      const int64_t i = i0 + j;
      d[j] = e.counted ? load<DT>(lp, e.seq * a.lp_s0 + e.col * a.lp_s1) - load<DT>(ref, e.seq * a.ref_s0 + e.col * a.ref_s1)
                       : 0.0f;
      gkl[j] = (e.counted && a.g_kl) ? load<DT>(reinterpret_cast<const void*>(a.g_kl), i) : 0.0f;
      grw[j] = (e.counted && a.g_reward) ? load<RT>(reinterpret_cast<const void*>(a.g_reward), i) : 0.0f;
      gro[j] = (e.counted && a.g_ref_out) ? load<DT>(reinterpret_cast<const void*>(a.g_ref_out), i) : 0.0f;
    }
  }
  float glp[kPer], gref[kPer];
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    const Where& e = w[j];
    glp[j] = 0.0f, gref[j] = 0.0f;
    if (e.counted) {
      float g = g_sum ? g_sum[e.seq] : 0.0f;
      if (a.g_kl) g += gkl[j];
      if (a.g_reward) g -= coef_of(a, e.seq) * grw[j];
      glp[j] = g * kl_grad(d[j], a.est);
      gref[j] = (a.g_ref_out ? gro[j] : 0.0f) - glp[j];
    }
    if ((bad >> j) & 1u) glp[j] = gref[j] = NAN;
  }
  if (full) {
    Pack<BitsOf<DT>> pl, pr;
#pragma unroll
    for (int j = 0; j < kPer; ++j) pl.v[j] = to_bits<DT>(glp[j]), pr.v[j] = to_bits<DT>(gref[j]);
    *reinterpret_cast<Pack<BitsOf<DT>>*>(reinterpret_cast<BitsOf<DT>*>(a.g_lp) + i0) = pl;
    *reinterpret_cast<Pack<BitsOf<DT>>*>(reinterpret_cast<BitsOf<DT>*>(a.g_ref) + i0) = pr;
  } else {
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
      if (!w[j].inb) continue;
      store<DT>(reinterpret_cast<void*>(a.g_lp), i0 + j, glp[j]);
      store<DT>(reinterpret_cast<void*>(a.g_ref), i0 + j, gref[j]);
    }
  }
}

bool aligned(uintptr_t p, uintptr_t n) { return p % n == 0; }

// The vector path: every per-token input and output contiguous in the layout's shape, 16-byte
// aligned (the mask is read per element: 8 bytes per thread gain little).
bool vectorizable(const KLRewardArgs& a) {
  auto flat = [&](int64_t s0, int64_t s1) { return s1 == 1 && (a.layout == kPacked || s0 == a.width); };
  bool ok = flat(a.lp_s0, a.lp_s1) && flat(a.ref_s0, a.ref_s1) && aligned(a.lp, 16) && aligned(a.ref, 16) &&
            aligned(a.kl, 16) && aligned(a.reward_out, 16) && (a.ref_out == 0 || aligned(a.ref_out, 16));
  if (a.placement == kToken) ok = ok && flat(a.rw_s0, a.rw_s1) && aligned(a.reward, 16);
  return ok;
}

template <int32_t DT, int32_t RT>
int forward_typed(const KLRewardArgs& a, uintptr_t ws, cudaStream_t stream) {
  const int64_t tiles = tiles_of(a);
  if (tiles > 0) {
    const dim3 grid(static_cast<unsigned>(tiles));
    const cudaError_t err = vectorizable(a) ? launch(forward_tile<DT, RT, true>, grid, kThreads, 0, stream, a, ws)
                                            : launch(forward_tile<DT, RT, false>, grid, kThreads, 0, stream, a, ws);
    if (int s = launch_status(err)) return s;
  }
  if (a.batch > 0) {
    const int64_t blocks = (a.batch + kThreads - 1) / kThreads;
    const cudaError_t err =
        launch(combine<DT, RT>, static_cast<unsigned>(blocks < 65535 ? blocks : 65535), kThreads, 0, stream, a, ws);
    if (int s = launch_status(err)) return s;
  }
  return 0;
}

// The backward's vector path: lp and ref flat and 16-byte aligned, and every flat per-token stream
// (incoming gradients, the gradients written) 16-byte aligned.
bool vectorizable_backward(const KLRewardArgs& a) {
  auto flat = [&](int64_t s0, int64_t s1) { return s1 == 1 && (a.layout == kPacked || s0 == a.width); };
  auto ok_ptr = [](uintptr_t p) { return p == 0 || aligned(p, 16); };
  return flat(a.lp_s0, a.lp_s1) && flat(a.ref_s0, a.ref_s1) && aligned(a.lp, 16) && aligned(a.ref, 16) &&
         aligned(a.g_lp, 16) && aligned(a.g_ref, 16) && ok_ptr(a.g_kl) && ok_ptr(a.g_reward) && ok_ptr(a.g_ref_out);
}

template <int32_t DT, int32_t RT>
int backward_typed(const KLRewardArgs& a, cudaStream_t stream) {
  const int64_t tiles = tiles_of(a);
  if (tiles == 0) return 0;
  const dim3 grid(static_cast<unsigned>(tiles));
  return launch_status(vectorizable_backward(a) ? launch(backward_tile<DT, RT, true>, grid, kThreads, 0, stream, a)
                                                : launch(backward_tile<DT, RT, false>, grid, kThreads, 0, stream, a));
}

}  // namespace

int64_t kl_reward_cuda_workspace_bytes(const KLRewardArgs& a) {
  return (3 * 2 * tiles_of(a) + a.batch + 2) * 8;
}

int kl_reward_forward_cuda(const KLRewardArgs& a, uintptr_t workspace, uintptr_t stream) {
  if (cpu_forward_only(a)) return 3;
  // The 2^31 - 1 block limit of grid x: 4.4e12 tokens, beyond any memory; checked anyway.
  if (tiles_of(a) > 0x7fffffff) return 2;
  return with_dtypes(a.dtype, a.reward_dtype, [&](auto dt, auto rt) {
    return forward_typed<decltype(dt)::value, decltype(rt)::value>(a, workspace, reinterpret_cast<cudaStream_t>(stream));
  });
}

int kl_reward_backward_cuda(const KLRewardArgs& a, uintptr_t stream) {
  if (cpu_forward_only(a)) return 3;
  if (tiles_of(a) > 0x7fffffff) return 2;
  return with_dtypes(a.dtype, a.reward_dtype, [&](auto dt, auto rt) {
    return backward_typed<decltype(dt)::value, decltype(rt)::value>(a, reinterpret_cast<cudaStream_t>(stream));
  });
}

}  // namespace kl
