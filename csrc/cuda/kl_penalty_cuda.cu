// Fused kl_penalty_loss on CUDA: forward (tile kernel + per-sequence combine) and backward.
//
// The algorithm of the Triton kernels (kl_kernels/triton/kl_penalty.py) with the geometry of the
// kl_reward CUDA kernel (cuda/tiles.cuh) and the per-token math of common/kl_penalty_math.h,
// shared with the CPU kernel:
//
// * Tiles of kCudaTile elements of the flat token space, one block each, kPer consecutive
//   elements per thread; the grid depends on the token count only.
// * Each counted token writes d loss / d lp to the gradient buffer (the one float tensor kept for
//   backward) and, for aggregation "none", its four per-token parts.
// * Six per-sequence sums (loss, objective, kl, entropy, ratio, clipped) and the count without
//   float atomics: for each sum in turn, a block-wide fp64 segmented scan (restarting at each
//   sequence's first element, so a NaN or inf stays in its sequence) into one shared array, read
//   at each segment's last lane. Sequences inside the tile finish there; the tile's first and
//   last segments go to two slots per tile, which combine adds in tile order.
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

constexpr int kSums = 6;       // loss, objective, kl, entropy, ratio, clipped
constexpr int kSlotStride = 8;  // doubles per slot

__host__ __device__ inline int64_t penalty_tiles(const KLPenaltyArgs& a) {
  return (a.g.total + kCudaTile - 1) / kCudaTile;
}

struct PenaltyWorkspace {
  double* slot_sum;     // [2 * tiles, kSlotStride]
  int64_t* slot_count;  // [2 * tiles]
};

__host__ __device__ inline PenaltyWorkspace carve_penalty(const KLPenaltyArgs& a, uintptr_t ws) {
  const int64_t slots = 2 * penalty_tiles(a);
  PenaltyWorkspace w;
  w.slot_sum = reinterpret_cast<double*>(ws);
  w.slot_count = reinterpret_cast<int64_t*>(w.slot_sum + slots * kSlotStride);
  return w;
}

template <int32_t T>
__device__ __forceinline__ float read(uintptr_t base, int64_t s0, int64_t s1, const Where& e) {
  return load<T>(reinterpret_cast<const void*>(base), e.seq * s0 + e.col * s1);
}

template <int32_t DT, int32_t AT, int32_t EST, bool ST>
__global__ void __launch_bounds__(kThreads) penalty_forward_tile(KLPenaltyArgs a, uintptr_t ws) {
  __shared__ double prefix[kCudaTile];  // segmented inclusive sums of one of the six values (fp64)
  __shared__ int cprefix[kCudaTile];    // inclusive prefix counts
  __shared__ double wsum[kWarps];
  __shared__ int wflag[kWarps], wcnt[kWarps];
  __shared__ int64_t seq_range[2];

  const KLRewardArgs& g = a.g;
  const int64_t tile = blockIdx.x;
  int64_t t0, t_last, i0;
  Where w[kPer];
  locate_tile(g, seq_range, &t0, &t_last, &i0, w);

  const float sign = a.ref ? 1.0f : -1.0f;
  const float ec = a.entropy_coef;
  float vals[kSums][kPer];
  float* grad = reinterpret_cast<float*>(a.grad);
  float* tok = reinterpret_cast<float*>(a.token_out);
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    const Where& e = w[j];
    float loss = 0.0f, obj = 0.0f, kl = 0.0f, ent = 0.0f, ratio = 0.0f, clipped = 0.0f, gr = 0.0f, beta = 0.0f;
    if (e.counted) {
      const float lp = read<DT>(g.lp, g.lp_s0, g.lp_s1, e);
      const float old = read<DT>(a.old, a.old_s0, a.old_s1, e);
      const float other = a.ref ? read<DT>(a.ref, a.ref_s0, a.ref_s1, e) : old;
      const float adv = a.adv_per_seq ? load<AT>(reinterpret_cast<const void*>(a.adv), e.seq * a.adv_s0)
                                      : read<AT>(a.adv, a.adv_s0, a.adv_s1, e);
      ent = a.ent ? read<AT>(a.ent, a.ent_s0, a.ent_s1, e) : 0.0f;
      beta = beta_of(a, e.seq);
      const PPOToken t = ppo_token<EST, ST>(lp, old, other, sign, adv, beta, a.clip_lo, a.clip_hi);
      obj = t.obj, kl = t.kl, ratio = t.ratio, clipped = t.clipped, gr = t.grad;
      loss = obj + beta * kl - ec * ent;
    }
    vals[0][j] = loss, vals[1][j] = obj, vals[2][j] = kl, vals[3][j] = ent, vals[4][j] = ratio, vals[5][j] = clipped;
    if (e.inb) {
      const int64_t i = i0 + j;
      grad[i] = gr;
      if (tok) {
        tok[i] = loss;
        tok[g.total + i] = obj;
        tok[2 * g.total + i] = beta * kl;
        tok[3 * g.total + i] = -ec * ent + 0.0f;
      }
    }
  }

  PenaltyWorkspace wsp = carve_penalty(a, ws);
  float* seq_loss = reinterpret_cast<float*>(a.seq_loss);
  float* stats = reinterpret_cast<float*>(a.stats);
  int64_t* count = reinterpret_cast<int64_t*>(a.count);
  const int lane0 = threadIdx.x * kPer;
  bool starts[kPer];
#pragma unroll
  for (int j = 0; j < kPer; ++j) starts[j] = starts_segment(w[j], i0 + j);
#pragma unroll
  for (int v = 0; v < kSums; ++v) {  // unrolled: vals[v] stays in registers
    double own[kPer];
    int cown[kPer];
    bool started[kPer];
    double tv = 0.0;
    int tc = 0;
    bool ts = false;
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
      tv = starts[j] ? static_cast<double>(vals[v][j]) : tv + static_cast<double>(vals[v][j]);
      ts = ts || starts[j];
      tc += w[j].counted;
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
      const Where& e = w[j];
      if (!e.inb) continue;
      const int lane = lane0 + j;
      const int first = static_cast<int>((e.lo > t0 ? e.lo : t0) - t0);
      const int last_lane = static_cast<int>((e.hi - 1 < t_last ? e.hi - 1 : t_last) - t0);
      if (lane != last_lane) continue;
      const double seg = prefix[lane];  // the segment's own sum
      const int seg_count = cprefix[lane] - (first > 0 ? cprefix[first - 1] : 0);
      if (e.lo >= t0 && e.hi - 1 <= t_last) {  // the whole sequence is in this tile
        if (v == 0) {
          seq_loss[e.seq] = static_cast<float>(seg);
          count[e.seq] = seg_count;
        } else {
          stats[e.seq * kStatColumns + (v - 1)] = static_cast<float>(seg);
        }
      }
      for (int s = 0; s < 2; ++s) {
        if (!(s == 0 ? e.lo <= t0 : e.hi - 1 >= t_last)) continue;
        const int64_t slot = 2 * tile + s;
        wsp.slot_sum[slot * kSlotStride + v] = seg;
        if (v == 0) wsp.slot_count[slot] = seg_count;
      }
    }
    __syncthreads();  // prefix is reused by the next sum
  }
}

__global__ void __launch_bounds__(kThreads) penalty_combine(KLPenaltyArgs a, uintptr_t ws) {
  const KLRewardArgs& g = a.g;
  const PenaltyWorkspace wsp = carve_penalty(a, ws);
  float* seq_loss = reinterpret_cast<float*>(a.seq_loss);
  float* stats = reinterpret_cast<float*>(a.stats);
  int64_t* count = reinterpret_cast<int64_t*>(a.count);
  for (int64_t b = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; b < g.batch;
       b += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    int64_t lo, hi;
    flat_range(g, b, &lo, &hi);
    double sum[kSums] = {0, 0, 0, 0, 0, 0};
    int64_t cnt = 0;
    if (hi > lo) {
      const int64_t k0 = lo / kCudaTile, k1 = (hi - 1) / kCudaTile;
      if (k1 == k0) continue;  // finished by its tile
      // The last segment of its first tile, then the first segment of the others, in tile order.
      for (int64_t t = k0; t <= k1; ++t) {
        const int64_t slot = t == k0 ? 2 * k0 + 1 : 2 * t;
        for (int v = 0; v < kSums; ++v) sum[v] += wsp.slot_sum[slot * kSlotStride + v];
        cnt += wsp.slot_count[slot];
      }
    }
    seq_loss[b] = static_cast<float>(sum[0]);
    for (int v = 1; v < kSums; ++v) stats[b * kStatColumns + (v - 1)] = static_cast<float>(sum[v]);
    count[b] = cnt;
  }
}

template <int32_t DT, int32_t AT>
__global__ void __launch_bounds__(kThreads) penalty_backward_tile(KLPenaltyArgs a) {
  __shared__ int64_t seq_range[2];
  const KLRewardArgs& g = a.g;
  int64_t t0, t_last, i0;
  Where w[kPer];
  locate_tile(g, seq_range, &t0, &t_last, &i0, w);
  const float* grad = reinterpret_cast<const float*>(a.grad);
  const float* g_seq = reinterpret_cast<const float*>(a.g_seq);
  const float* g_tok = reinterpret_cast<const float*>(a.g_tok);
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    const Where& e = w[j];
    if (!e.inb) continue;
    const int64_t i = i0 + j;
    float glp = 0.0f, gent = 0.0f;
    if (e.counted) {
      const float gin = (g_seq ? g_seq[e.seq] : a.g_uniform) + (g_tok ? g_tok[i] : 0.0f);
      glp = gin * grad[i];
      gent = -a.entropy_coef * gin;
    }
    store<DT>(reinterpret_cast<void*>(a.g_lp), i, glp);
    if (a.g_ent) store<AT>(reinterpret_cast<void*>(a.g_ent), i, gent);
  }
}

template <int32_t DT, int32_t AT, int32_t EST, bool ST>
int forward_typed(const KLPenaltyArgs& a, uintptr_t ws, cudaStream_t stream) {
  const int64_t tiles = penalty_tiles(a);
  if (tiles > 0) {
    const cudaError_t err =
        launch(penalty_forward_tile<DT, AT, EST, ST>, static_cast<unsigned>(tiles), kThreads, 0, stream, a, ws);
    if (int s = launch_status(err)) return s;
  }
  if (a.g.batch > 0) {
    const int64_t blocks = (a.g.batch + kThreads - 1) / kThreads;
    const cudaError_t err =
        launch(penalty_combine, static_cast<unsigned>(blocks < 65535 ? blocks : 65535), kThreads, 0, stream, a, ws);
    if (int s = launch_status(err)) return s;
  }
  return 0;
}

// The estimator and straight-through flag as template parameters (branch-free per-token math).
template <int32_t DT, int32_t AT>
int forward_estimator(const KLPenaltyArgs& a, uintptr_t ws, cudaStream_t stream) {
  const bool st = a.g.est.straight_through != 0;
  switch (a.g.est.estimator) {
    case kK1: return st ? forward_typed<DT, AT, kK1, true>(a, ws, stream) : forward_typed<DT, AT, kK1, false>(a, ws, stream);
    case kAbs: return st ? forward_typed<DT, AT, kAbs, true>(a, ws, stream) : forward_typed<DT, AT, kAbs, false>(a, ws, stream);
    case kK2: return forward_typed<DT, AT, kK2, false>(a, ws, stream);
    case kK3: return st ? forward_typed<DT, AT, kK3, true>(a, ws, stream) : forward_typed<DT, AT, kK3, false>(a, ws, stream);
    default: return 1;
  }
}

}  // namespace

int64_t kl_penalty_cuda_workspace_bytes(const KLPenaltyArgs& a) {
  return 2 * penalty_tiles(a) * (kSlotStride + 1) * 8;
}

int kl_penalty_forward_cuda(const KLPenaltyArgs& a, uintptr_t workspace, uintptr_t stream) {
  if (a.totals) return 3;  // batch totals are the CPU forward's (the host reads them right away)
  if (penalty_tiles(a) > 0x7fffffff) return 2;
  return with_dtypes(a.g.dtype, a.aux_dtype, [&](auto dt, auto at) {
    return forward_estimator<decltype(dt)::value, decltype(at)::value>(a, workspace,
                                                                      reinterpret_cast<cudaStream_t>(stream));
  });
}

int kl_penalty_backward_cuda(const KLPenaltyArgs& a, uintptr_t stream) {
  const int64_t tiles = penalty_tiles(a);
  if (tiles > 0x7fffffff) return 2;
  if (tiles == 0) return 0;
  return with_dtypes(a.g.dtype, a.aux_dtype, [&](auto dt, auto at) {
    return launch_status(launch(penalty_backward_tile<decltype(dt)::value, decltype(at)::value>,
                                static_cast<unsigned>(tiles), kThreads, 0, reinterpret_cast<cudaStream_t>(stream), a));
  });
}

}  // namespace kl
