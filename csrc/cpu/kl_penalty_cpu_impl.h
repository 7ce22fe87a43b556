// The fused CPU kl_penalty_loss kernels' templates, shared by kl_penalty_cpu.cpp (entry points) and
// kl_penalty_cpu_kr.cpp (the forward with kl_times_ratio; see run_forward). Internal to those two files.
//
// One pass over the tokens writes the per-token gradient of the loss w.r.t. log_probs (the one
// buffer kept for backward) and the per-sequence sums; the backward pass scales that buffer by the
// incoming gradient.
//
// Work is cut into kl_reward's fixed tiles of the flat token space (kl_reward_cpu_impl.h): the same
// runs, the same thread pool, per-sequence partial sums combined in tile order in float64, so the
// results are bitwise identical run to run and for any thread count. Within a run, blocks of
// kBlock tokens are first loaded into float32 scratch (one simple loop per input, the choice of
// source made outside the loop), then one branch-free loop computes every token: both loops
// vectorize, for any layout, dtype and option.
#pragma once

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#include "common/kl_penalty_math.h"
#include "cpu/kl_penalty_cpu.h"
#include "cpu/kl_reward_cpu_impl.h"

namespace kl {
namespace cpu_penalty {

using cpu_detail::counted_range;
using cpu_detail::for_each_run_in_tile;
using cpu_detail::kLanes;
using cpu_detail::parallel_tiles;
using cpu_detail::Run;
using cpu_detail::tile_count;

constexpr int kSums = 1 + kStatColumns;  // the loss, then the stat columns (common/kl_penalty_args.h)
static_assert(kTotals == kSums + 1, "totals: the sums, then the count");
constexpr int64_t kBlock = 256;

struct Sums {
  int64_t seq = -1;
  double v[kSums] = {};
  int64_t count = 0;
};

// x[i] = value i of a strided input as float32 (stride 1 when CONTIG: a vectorizable loop).
template <int32_t T, bool CONTIG>
inline void load_block(float* __restrict x, const void* src, int64_t first, int64_t stride, int64_t n) {
  const BitsOf<T>* s = static_cast<const BitsOf<T>*>(src) + first;
  if constexpr (CONTIG) {
    for (int64_t i = 0; i < n; ++i) x[i] = from_bits<T>(s[i]);
  } else {
    for (int64_t i = 0; i < n; ++i) x[i] = from_bits<T>(s[i * stride]);
  }
}

// x_m[i] = all bits set where mask byte i (at stride `stride`) is set, else 0: the lane masks the
// forward and backward loops AND their values with (a 0/1 select there would compile to masked
// stores or block vectorization).
inline void lane_masks(uint32_t* __restrict x_m, const uint8_t* m, int64_t stride, int64_t n) {
  if (stride == 1) {
    for (int64_t i = 0; i < n; ++i) x_m[i] = m[i] ? ~0u : 0u;
  } else {
    for (int64_t i = 0; i < n; ++i) x_m[i] = m[i * stride] ? ~0u : 0u;
  }
}

// KR: kl_times_ratio, a template parameter (loops of its own): read at run time in the loop, GCC no longer
// vectorized it (4-5x slower, KR off too).
template <int32_t DT, int32_t AT, int32_t EST, bool CONTIG, bool KR>
KL_TARGET_CLONES Sums forward_run(const KLPenaltyArgs& a, const Run& r) {
  const KLRewardArgs& g = a.g;
  const int64_t total = g.total;
  float* G = reinterpret_cast<float*>(a.grad) + r.out0;
  float* tok = a.token_out ? reinterpret_cast<float*>(a.token_out) + r.out0 : nullptr;
  int64_t jlo, jhi;
  counted_range(r, &jlo, &jhi);
  auto zero = [&](int64_t j0, int64_t j1) {  // tokens that cannot count
    if (j1 <= j0) return;
    std::memset(G + j0, 0, (j1 - j0) * sizeof(float));
    if (tok)
      for (int k = 0; k < 4; ++k) std::memset(tok + k * total + j0, 0, (j1 - j0) * sizeof(float));
  };
  zero(0, jlo);
  zero(jhi, r.n);

  const float beta = beta_of(a, r.seq);
  const float sign = a.ref ? 1.0f : -1.0f;
  const bool st = g.est.straight_through != 0;
  // The KL's clamps. Read from their flags in the loop below they kept GCC from vectorizing it (6-7x
  // slower on 2.25M tokens, clamped or not), so the unclamped loop is compiled without them.
  const EstimatorParams est = g.est;
  const bool clamped = (est.in_lo_set | est.in_hi_set | est.out_lo_set | est.out_hi_set) != 0;
  const float clip_lo = a.clip_lo, clip_hi = a.clip_hi, clip_c = a.clip_c, ec = a.entropy_coef;
  const bool clipping = clip_lo > -INFINITY || clip_hi < INFINITY;
  const float adv_seq = a.adv_per_seq ? load<AT>(reinterpret_cast<const void*>(a.adv), r.seq * a.adv_s0) : 0.0f;
  // The log-ratio: lp - old per token, or the sequence's (GSPO), picked with bit masks (a select, even on
  // a loop-invariant flag, can keep GCC from vectorizing the loop): lr = (bits(l - od) & tok) | seq_bits.
  const uint32_t lr_tok = a.seq_lr ? 0u : ~0u;
  const uint32_t lr_seq = a.seq_lr ? f32_bits(reinterpret_cast<const float*>(a.seq_lr)[r.seq]) : 0u;
  const uint32_t kl_ratio = KR ? ~0u : 0u;  // kl_times_ratio as kl::ppo_token reads it (KR: compiled out)
  const void* lp = reinterpret_cast<const void*>(g.lp);
  const void* old = reinterpret_cast<const void*>(a.old);
  const void* ref = reinterpret_cast<const void*>(a.ref);
  const void* adv = reinterpret_cast<const void*>(a.adv);
  const void* ent = reinterpret_cast<const void*>(a.ent);
  const void* wt = reinterpret_cast<const void*>(a.wt);
  const uint8_t* mask = reinterpret_cast<const uint8_t*>(g.mask);
  auto first = [&](int64_t s0, int64_t s1) { return r.row * s0 + r.col0 * s1; };

  alignas(64) float x_lp[kBlock], x_old[kBlock], x_ref[kBlock], x_adv[kBlock], x_ent[kBlock], x_wt[kBlock];
  alignas(64) float x_one[kBlock];  // the weight of every token without weights (and of the KL term without weight_kl)
  alignas(64) uint32_t x_m[kBlock];  // all bits set where the token counts, else 0
  alignas(64) float o[kSums][kBlock];
  double acc[kSums][kLanes] = {};
  int64_t count = 0;
  // Inputs that are constant over the run are expanded once.
  if (a.adv_per_seq) std::fill(x_adv, x_adv + kBlock, adv_seq);
  if (!ent) std::fill(x_ent, x_ent + kBlock, 0.0f);
  std::fill(x_one, x_one + kBlock, 1.0f);
  if (!mask) std::fill(x_m, x_m + kBlock, ~0u);
  // Block jb of an input as float32: contiguous float32 is read in place; anything else is first
  // converted into `scratch`.
  auto block = [&](float* scratch, auto dtype, const void* base, int64_t s0, int64_t s1, int64_t jb,
                   int64_t n) -> const float* {
    constexpr int32_t T = decltype(dtype)::value;
    if constexpr (T == kFloat32 && CONTIG) {
      return static_cast<const float*>(base) + first(s0, s1) + jb;
    } else {
      load_block<T, CONTIG>(scratch, base, first(s0, s1) + jb * s1, s1, n);
      return scratch;
    }
  };
  using D = std::integral_constant<int32_t, DT>;
  using A = std::integral_constant<int32_t, AT>;
  for (int64_t jb = jlo; jb < jhi; jb += kBlock) {
    const int64_t n = std::min(kBlock, jhi - jb);
    const float* __restrict p_lp = block(x_lp, D{}, lp, g.lp_s0, g.lp_s1, jb, n);
    const float* __restrict p_old = block(x_old, D{}, old, a.old_s0, a.old_s1, jb, n);
    // Without a reference model the KL's other side is the old policy.
    const float* __restrict p_ref = ref ? block(x_ref, D{}, ref, a.ref_s0, a.ref_s1, jb, n) : p_old;
    const float* __restrict p_adv = a.adv_per_seq ? x_adv : block(x_adv, A{}, adv, a.adv_s0, a.adv_s1, jb, n);
    const float* __restrict p_ent = ent ? block(x_ent, A{}, ent, a.ent_s0, a.ent_s1, jb, n) : x_ent;
    // Weights as pointers, not flags: the loop below stays free of loop-invariant selects.
    const float* __restrict p_wt = wt ? block(x_wt, A{}, wt, a.wt_s0, a.wt_s1, jb, n) : x_one;
    const float* __restrict p_wk = a.weight_kl ? p_wt : x_one;
    if (mask) lane_masks(x_m, mask + first(g.mask_s0, g.mask_s1) + jb * g.mask_s1, g.mask_s1, n);
    float* __restrict Gb = G + jb;
    auto compute = [&](auto st_tag, auto clamp_tag) {
      constexpr bool ST = decltype(st_tag)::value, CL = decltype(clamp_tag)::value;
      for (int64_t i = 0; i < n; ++i) {
        // Non-counted tokens may hold anything (NaN padding): their inputs are replaced by 0 in
        // registers (selects, not a pass that writes the scratch back: GCC turns that into masked
        // stores, which are microcoded on AMD cores), so that the math yields finite values there,
        // which are then multiplied by the 0/1 mask (exact, and NaN stays NaN where counted).
        const uint32_t mb = x_m[i];
        const float mf = bits_f32(mb & 0x3f800000u);  // 1.0f or 0.0f
        auto keep = [mb](float v) { return bits_f32(f32_bits(v) & mb); };
        const float l = keep(p_lp[i]), od = keep(p_old[i]), rf = keep(p_ref[i]), ad = keep(p_adv[i]);
        const float e = keep(p_ent[i]), wo = keep(p_wt[i]), wk = keep(p_wk[i]);
        const float lr = bits_f32((f32_bits(l - od) & lr_tok) | lr_seq);
        const PPOToken t =
            ppo_token<EST, ST, CL, KR>(l, lr, rf, sign, ad, beta, clip_lo, clip_hi, clip_c, wo, wk, est, kl_ratio);
        o[1][i] = t.obj * mf;
        o[2][i] = t.kl * mf;
        o[3][i] = e;
        o[4][i] = t.ratio * mf;
        o[5][i] = t.clipped * mf;
        o[6][i] = t.low * mf;
        o[7][i] = t.high * mf;
        // The gradient buffer is exactly +0 where the token does not count (a 0/1 product would
        // leave -0 where the finite math gave a negative value), as the backward pass writes it:
        // an eager backward may scale this buffer in place and hand it over (ops._EagerTotal).
        Gb[i] = bits_f32(f32_bits(t.grad) & mb);
      }
    };
    // Four loops: straight-through or not, clamped or not. The unclamped one (the common call) has no
    // clamp compiled in; the clamped one reads the clamps per element. Both vectorize with the inlining
    // budgets setup.py gives this file (SOURCE_FLAGS; without them ppo_token stayed a call here and the
    // clamped loop ran scalar, ~7x slower on 2.25M tokens).
    if (clamped) {
      if (st) compute(std::true_type{}, std::true_type{});
      else compute(std::false_type{}, std::true_type{});
    } else {
      if (st) compute(std::true_type{}, std::false_type{});
      else compute(std::false_type{}, std::false_type{});
    }
    // kLanes fixed accumulators: deterministic and vectorizable. Column 0 (the loss) is not summed
    // per token but assembled from the parts below (beta is constant within a run); entropy and
    // the clip flags' columns are all zero without entropy or clipping.
    for (int k = 1; k < kSums; ++k) {
      if ((k == 1 + kStatEntropy && !ent) || (k > 1 + kStatRatio && !clipping)) continue;
      int64_t i = 0;
      for (; i + kLanes <= n; i += kLanes)
        for (int l = 0; l < kLanes; ++l) acc[k][l] += o[k][i + l];
      for (int l = 0; i < n; ++i, ++l) acc[k][l] += o[k][i];
    }
    int32_t cnt = 0;  // an integer sum vectorizes (a float one would be a serial chain of adds)
    for (int64_t i = 0; i < n; ++i) cnt += x_m[i] & 1u;
    count += cnt;
    if (tok) {
      float* t0 = tok + jb;
      for (int64_t i = 0; i < n; ++i) {
        t0[i] = o[1][i] + beta * o[2][i] - ec * o[3][i];  // 0 where not counted: every part is
        t0[total + i] = o[1][i];
        t0[2 * total + i] = beta * o[2][i];
        t0[3 * total + i] = -ec * o[3][i] + 0.0f;
      }
    }
  }
  Sums s;
  s.seq = r.seq;
  s.count = count;
  for (int k = 1; k < kSums; ++k) {
    double v = 0.0;
    for (int l = 0; l < kLanes; ++l) v += acc[k][l];
    s.v[k] = v;
  }
  s.v[0] = s.v[1] + static_cast<double>(beta) * s.v[2] - static_cast<double>(ec) * s.v[3];
  return s;
}

template <int32_t DT, int32_t AT, int32_t EST, bool CONTIG, bool KR>
void forward(const KLPenaltyArgs& a, int threads) {
  const KLRewardArgs& g = a.g;
  const int64_t tiles = tile_count(g);
  std::vector<Sums> head(tiles), tail(tiles), per_seq(g.batch);
  parallel_tiles(g, threads, [&](int64_t k) {
    for_each_run_in_tile(g, k, [&](const Run& r, bool first) {
      const Sums s = forward_run<DT, AT, EST, CONTIG, KR>(a, r);
      if (r.whole) per_seq[r.seq] = s;    // this tile alone owns the sequence
      else (first ? head : tail)[k] = s;  // shared: combined below, in tile order
    });
  });
  for (int64_t k = 0; k < tiles; ++k) {
    for (const Sums* p : {&head[k], &tail[k]}) {
      if (p->seq < 0) continue;
      Sums& q = per_seq[p->seq];
      for (int c = 0; c < kSums; ++c) q.v[c] += p->v[c];
      q.count += p->count;
    }
  }
  float* seq_loss = reinterpret_cast<float*>(a.seq_loss);
  float* stats = reinterpret_cast<float*>(a.stats);
  int64_t* count = reinterpret_cast<int64_t*>(a.count);
  // (a caller that takes the totals skips the per-sequence losses)
  for (int64_t b = 0; b < g.batch; ++b) {
    if (seq_loss) seq_loss[b] = static_cast<float>(per_seq[b].v[0]);
    if (stats)
      for (int c = 0; c < kStatColumns; ++c) stats[b * kStatColumns + c] = static_cast<float>(per_seq[b].v[c + 1]);
    if (count) count[b] = per_seq[b].count;
  }
  if (a.totals) {  // in float64, in sequence order: deterministic, and no float32 rounding of the parts
    double t[kTotals] = {};
    for (int64_t b = 0; b < g.batch; ++b) {
      for (int c = 0; c < kSums; ++c) t[c] += per_seq[b].v[c];
      t[kSums] += static_cast<double>(per_seq[b].count);
    }
    std::memcpy(reinterpret_cast<double*>(a.totals), t, sizeof(t));
  }
}

// grad_lp = up * G and grad_entropy = -entropy_coef * up at counted tokens (0 elsewhere), where
// up = g_tok + g_seq[b] (g_uniform without g_seq) is the incoming gradient. As in the forward,
// blocks of the mask are first expanded to 32-bit lane masks, so that the loops below are plain
// vector code for every layout.
template <int32_t DT, int32_t AT, bool TOK, bool ENT>
KL_TARGET_CLONES void backward_run(const KLPenaltyArgs& a, const Run& r) {
  const KLRewardArgs& g = a.g;
  const int64_t o = r.out0;
  const float* __restrict G = reinterpret_cast<const float*>(a.grad) + o;
  const float* __restrict gt = TOK ? reinterpret_cast<const float*>(a.g_tok) + o : nullptr;
  const float gs = a.g_seq ? reinterpret_cast<const float*>(a.g_seq)[r.seq] : a.g_uniform;
  BitsOf<DT>* __restrict glp = reinterpret_cast<BitsOf<DT>*>(a.g_lp) + o;
  BitsOf<AT>* __restrict gent = ENT ? reinterpret_cast<BitsOf<AT>*>(a.g_ent) + o : nullptr;
  const uint8_t* mask = g.mask ? reinterpret_cast<const uint8_t*>(g.mask) + r.row * g.mask_s0 + r.col0 * g.mask_s1
                               : nullptr;
  const float ec = a.entropy_coef;
  int64_t jlo, jhi;
  counted_range(r, &jlo, &jhi);
  auto zero = [&](int64_t j0, int64_t j1) {
    if (j1 <= j0) return;
    std::memset(glp + j0, 0, (j1 - j0) * sizeof(BitsOf<DT>));
    if (ENT) std::memset(gent + j0, 0, (j1 - j0) * sizeof(BitsOf<AT>));
  };
  zero(0, jlo);
  zero(jhi, r.n);
  alignas(64) uint32_t x_m[kBlock];
  if (!mask) std::fill(x_m, x_m + kBlock, ~0u);
  for (int64_t jb = jlo; jb < jhi; jb += kBlock) {
    const int64_t n = std::min(kBlock, jhi - jb);
    if (mask) lane_masks(x_m, mask + jb * g.mask_s1, g.mask_s1, n);
    for (int64_t i = 0; i < n; ++i) {
      const float up = (TOK ? gt[jb + i] : 0.0f) + gs;
      glp[jb + i] = to_bits<DT>(bits_f32(f32_bits(up * G[jb + i]) & x_m[i]));
      if constexpr (ENT) gent[jb + i] = to_bits<AT>(bits_f32(f32_bits(-ec * up) & x_m[i]));
    }
  }
}

template <int32_t DT, int32_t AT>
void backward(const KLPenaltyArgs& a, int threads) {
  auto go = [&](auto tok, auto ent) {
    constexpr bool TOK = decltype(tok)::value, ENT = decltype(ent)::value;
    parallel_tiles(a.g, threads, [&](int64_t k) {
      for_each_run_in_tile(a.g, k, [&](const Run& r, bool) { backward_run<DT, AT, TOK, ENT>(a, r); });
    });
  };
  using T = std::true_type;
  using F = std::false_type;
  if (a.g_tok) a.g_ent ? go(T{}, T{}) : go(T{}, F{});
  else a.g_ent ? go(F{}, T{}) : go(F{}, F{});
}

// GSPO's pre-pass (importance_sampling_level "sequence"): the sum of lp - old over a run's counted tokens
// and their count, in float64, with kLanes fixed accumulators (deterministic, vectorizable). A NaN or
// inf stays in its own sequence: runs are combined per sequence, never across.
struct RatioSum {
  int64_t seq = -1;
  double sum = 0.0;
  int64_t count = 0;
};

template <int32_t DT, bool CONTIG>
KL_TARGET_CLONES RatioSum ratio_run(const KLPenaltyArgs& a, const Run& r) {
  const KLRewardArgs& g = a.g;
  const void* lp = reinterpret_cast<const void*>(g.lp);
  const void* old = reinterpret_cast<const void*>(a.old);
  const uint8_t* mask = reinterpret_cast<const uint8_t*>(g.mask);
  auto first = [&](int64_t s0, int64_t s1) { return r.row * s0 + r.col0 * s1; };
  int64_t jlo, jhi;
  counted_range(r, &jlo, &jhi);
  alignas(64) float x_lp[kBlock], x_old[kBlock];
  alignas(64) uint32_t x_m[kBlock];
  if (!mask) std::fill(x_m, x_m + kBlock, ~0u);
  double acc[kLanes] = {};
  int64_t count = 0;
  for (int64_t jb = jlo; jb < jhi; jb += kBlock) {
    const int64_t n = std::min(kBlock, jhi - jb);
    load_block<DT, CONTIG>(x_lp, lp, first(g.lp_s0, g.lp_s1) + jb * g.lp_s1, g.lp_s1, n);
    load_block<DT, CONTIG>(x_old, old, first(a.old_s0, a.old_s1) + jb * a.old_s1, a.old_s1, n);
    if (mask) lane_masks(x_m, mask + first(g.mask_s0, g.mask_s1) + jb * g.mask_s1, g.mask_s1, n);
    // lp - old in float64 (exact for float32 inputs, as the reference's torch ops); not counted: exactly 0
    // (NaN padding included), the inputs masked to +0 through the lane mask
    auto diff = [&](int64_t i) {
      return static_cast<double>(bits_f32(f32_bits(x_lp[i]) & x_m[i])) -
             static_cast<double>(bits_f32(f32_bits(x_old[i]) & x_m[i]));
    };
    int64_t i = 0;
    for (; i + kLanes <= n; i += kLanes)
      for (int l = 0; l < kLanes; ++l) acc[l] += diff(i + l);
    for (int l = 0; i < n; ++i, ++l) acc[l] += diff(i);
    int32_t cnt = 0;
    for (int64_t k = 0; k < n; ++k) cnt += x_m[k] & 1u;
    count += cnt;
  }
  RatioSum s;
  s.seq = r.seq;
  s.count = count;
  for (int l = 0; l < kLanes; ++l) s.sum += acc[l];
  return s;
}

template <int32_t DT, bool CONTIG>
void sequence_log_ratio(const KLPenaltyArgs& a, int threads) {
  const KLRewardArgs& g = a.g;
  const int64_t tiles = tile_count(g);
  std::vector<RatioSum> head(tiles), tail(tiles), per_seq(g.batch);
  parallel_tiles(g, threads, [&](int64_t k) {
    for_each_run_in_tile(g, k, [&](const Run& r, bool first) {
      const RatioSum s = ratio_run<DT, CONTIG>(a, r);
      if (r.whole) per_seq[r.seq] = s;
      else (first ? head : tail)[k] = s;
    });
  });
  for (int64_t k = 0; k < tiles; ++k) {  // shared sequences: in tile order (deterministic)
    for (const RatioSum* p : {&head[k], &tail[k]}) {
      if (p->seq < 0) continue;
      per_seq[p->seq].sum += p->sum;
      per_seq[p->seq].count += p->count;
    }
  }
  float* out = reinterpret_cast<float*>(a.seq_lr);
  for (int64_t b = 0; b < g.batch; ++b)
    out[b] = static_cast<float>(per_seq[b].sum / static_cast<double>(std::max<int64_t>(per_seq[b].count, 1)));
}

inline bool contiguous(const KLPenaltyArgs& a) {
  const KLRewardArgs& g = a.g;
  return g.lp_s1 == 1 && a.old_s1 == 1 && (a.ref == 0 || a.ref_s1 == 1) && (a.adv_per_seq || a.adv_s1 == 1) &&
         (a.ent == 0 || a.ent_s1 == 1) && (a.wt == 0 || a.wt_s1 == 1) && (g.mask == 0 || g.mask_s1 == 1);
}

// The forward for one dtype pair, KR (kl_times_ratio) fixed: kl_penalty_cpu.cpp instantiates KR = false,
// kl_penalty_cpu_kr.cpp KR = true. Two translation units, not one: with both sets of loops in one unit
// GCC's inlining budget for it (--param inline-unit-growth) ran out and the common loop no longer
// vectorized (k3 forward 4.3 -> 19-22 ms on 2.3M tokens); split, the common loop keeps its 4.3 ms. The KR
// loop vectorizes too with the larger inlining budgets setup.py gives both files (SOURCE_FLAGS): before,
// GCC kept ppo_token a call there (35-42 ms against 6.3 ms now on 2.25M tokens, like the clamped loop).
template <int32_t DT, int32_t AT, bool KR>
int run_forward(const KLPenaltyArgs& a, int threads) {
  const bool c = contiguous(a);
  auto go = [&](auto est) {
    constexpr int32_t EST = decltype(est)::value;
    c ? forward<DT, AT, EST, true, KR>(a, threads) : forward<DT, AT, EST, false, KR>(a, threads);
    return 0;
  };
  switch (a.g.est.estimator) {
    case kK1: return go(std::integral_constant<int32_t, kK1>{});
    case kAbs: return go(std::integral_constant<int32_t, kAbs>{});
    case kK2: return go(std::integral_constant<int32_t, kK2>{});
    default: return go(std::integral_constant<int32_t, kK3>{});
  }
}

// f<DT, AT>() for the log-probs dtype and the auxiliary inputs' (the same or float32); 1 if unsupported.
template <typename F>
int with_penalty_dtypes(const KLPenaltyArgs& a, F&& f) {
  auto pair = [&](auto dt) {
    constexpr int32_t DT = decltype(dt)::value;
    if (a.aux_dtype == DT) return f(dt, dt);
    if constexpr (DT != kFloat32) {
      if (a.aux_dtype == kFloat32) return f(dt, std::integral_constant<int32_t, kFloat32>{});
    }
    return 1;
  };
  switch (a.g.dtype) {
    case kFloat32: return pair(std::integral_constant<int32_t, kFloat32>{});
    case kBFloat16: return pair(std::integral_constant<int32_t, kBFloat16>{});
    case kFloat16: return pair(std::integral_constant<int32_t, kFloat16>{});
    default: return 1;
  }
}

template <bool KR>
int forward_dispatch(const KLPenaltyArgs& a, int threads) {
  return with_penalty_dtypes(a, [&](auto dt, auto at) {
    return run_forward<decltype(dt)::value, decltype(at)::value, KR>(a, threads);
  });
}

int forward_with_kl_ratio(const KLPenaltyArgs& a, int threads);  // kl_penalty_cpu_kr.cpp

}  // namespace cpu_penalty
}  // namespace kl
