// Fused kl_reward on the CPU, the templates: one pass over the tokens, forward and backward.
// Each dtype's instantiations live in their own translation unit (kl_reward_cpu_<dtype>.cpp),
// so the build compiles them in parallel; kl_reward_cpu.cpp dispatches to them.
//
// Work is cut into fixed tiles of the flat token space (packed: N tokens; padded: B * T elements
// row-major). Tiles do not depend on the thread count and partial per-sequence sums are combined
// in tile order, so results are bitwise identical run to run and for any number of threads.
// Threads (as many as torch uses, from torch's own OpenMP team when it has one: see parallel.cpp)
// pull tiles from an atomic counter, which balances the load by tokens rather than by sequences.
//
// Within a tile, each run of one sequence's tokens knows its counted range [jlo, jhi) up front
// (validity and the prompt are position ranges), so padding and prompt tokens are filled without
// reading the log-probs, and the hot loop carries no layout logic.
#pragma once

#include <algorithm>
#include <cstring>
#include <functional>
#include <type_traits>
#include <utility>
#include <vector>

#include "common/kl_reward_args.h"
#include "cpu/parallel.h"

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace kl {
namespace cpu_detail {

constexpr int64_t kTile = 16384;

struct Partial {  // one sequence's share of one tile
  int64_t seq = -1;
  double sum = 0.0;
  int64_t count = 0;
  int64_t last = -1;  // position, within the sequence, of the last counted token
};

struct Run {  // consecutive tokens of one sequence inside one tile
  int64_t seq, row, col0, out0, n, pos0;
  SeqGeom geom;
  bool whole;  // this run is the entire sequence (padded: the entire row)
};

// Calls f(run) for each run of the flat range [t0, t1).
template <typename F>
void for_each_run(const KLRewardArgs& a, int64_t t0, int64_t t1, F&& f) {
  for (int64_t b = seq_of(a, t0); t0 < t1 && b < a.batch; ++b) {
    const SeqGeom g = seq_geom(a, b);
    const int64_t begin = a.layout == kPacked ? g.first_col : b * a.width;
    const int64_t end = a.layout == kPacked ? begin + g.length : begin + a.width;
    const int64_t stop = std::min(t1, end);
    if (stop <= t0) continue;  // an empty sequence
    Run r{};
    r.seq = b;
    r.n = stop - t0;
    r.out0 = t0;
    r.geom = g;
    r.whole = t0 == begin && stop == end;
    r.row = a.layout == kPacked ? 0 : b;
    r.col0 = t0 - (a.layout == kPacked ? 0 : begin);
    r.pos0 = a.layout == kPacked ? t0 - begin : r.col0 - g.first_col;
    f(r);
    t0 = stop;
  }
}

// Counted candidates of a run: positions in [prompt, length), as run offsets [jlo, jhi).
inline void counted_range(const Run& r, int64_t* jlo, int64_t* jhi) {
  *jlo = std::clamp<int64_t>(r.geom.prompt - r.pos0, 0, r.n);
  *jhi = std::max(*jlo, std::clamp<int64_t>(r.geom.length - r.pos0, 0, r.n));
}

// Where input X of run r starts (kl_reward_args.h's input_at at the run's first token).
inline InputAt input_at(uintptr_t x, uintptr_t ptrs, int64_t s0, int64_t s1, const Run& r) {
  return kl::input_at(x, ptrs, s0, s1, r.seq, r.pos0, r.row, r.col0);
}

// The same for a contiguous input (X_s1 == 1), as a typed pointer to the run's first element.
template <typename T>
inline const T* contiguous_at(uintptr_t x, uintptr_t ptrs, int64_t s0, const Run& r) {
  const InputAt at = input_at(x, ptrs, s0, 1, r);
  return static_cast<const T*>(at.base) + at.offset;
}

inline int64_t tile_count(const KLRewardArgs& a) { return (a.total + kTile - 1) / kTile; }

// Calls f(run, is_first_run_of_tile) for each run of tile k.
template <typename F>
void for_each_run_in_tile(const KLRewardArgs& a, int64_t k, F&& f) {
  bool first = true;
  for_each_run(a, k * kTile, std::min(a.total, (k + 1) * kTile), [&](const Run& r) {
    f(r, first);
    first = false;
  });
}

// Runs fn(tile_index) for every tile on up to `threads` threads (parallel.cpp).
template <typename F>
void parallel_tiles(const KLRewardArgs& a, int threads, F&& fn) {
  run_tiles(tile_count(a), threads, std::function<void(int64_t)>(std::forward<F>(fn)));
}

// ------------------------------------------------------------------------------ forward

// Contiguous fast path. The counted range is processed in blocks that stay in L1, each as a
// few simple loops (estimate, outputs, reductions) with every choice made outside the loops, so
// the compiler vectorizes them. The sum uses kLanes fixed accumulators: deterministic, and
// vectorizable (a single sequential accumulator is not, without reassociation).
constexpr int64_t kBlock = 256;
static_assert(kBlock <= 65535, "a block's count fits in 16 bits");
constexpr int kLanes = 8;

// The hot functions are compiled twice, for baseline x86-64 (SSE2) and for x86-64-v3 (AVX2, FMA),
// and the loader picks one per machine: the wheel stays portable and AVX2 doubles the width.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define KL_TARGET_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define KL_TARGET_CLONES
#endif

// A problem that touches more than this many bytes (inputs and outputs) cannot keep its outputs in a
// server's last-level cache until the caller reads them: all its per-token outputs are written with
// streaming stores, which skip reading each destination line before overwriting it (without them
// a store-bound pass moves a third more bytes).
constexpr int64_t kStreamBytes = int64_t(32) << 20;

// How many of the first `bytes` bytes at d lie before d's next 64-byte line boundary: the partial
// line that stream_copy and stream_fill write with plain stores.
inline int64_t head_before_line(const void* d, int64_t bytes) {
  return std::min<int64_t>(bytes, static_cast<int64_t>((-reinterpret_cast<uintptr_t>(d)) & 63u));
}

// dst[0, bytes) = src[0, bytes): whole 64-byte lines of dst with non-temporal stores, the partial
// lines at both ends with plain ones. A line written partly each way would cost a write-combining
// flush and a read of the line; callers keep every line on one side. stream_fence() must follow
// before the results are handed to another thread.
inline void stream_copy(void* dst, const void* src, int64_t bytes) {
  char* d = static_cast<char*>(dst);
  const char* s = static_cast<const char*>(src);
#if defined(__SSE2__)
  const int64_t head = head_before_line(d, bytes);
  std::memcpy(d, s, head);
  d += head, s += head, bytes -= head;
  for (; bytes >= 64; bytes -= 64, d += 64, s += 64)
    for (int q = 0; q < 64; q += 16)
      _mm_stream_si128(reinterpret_cast<__m128i*>(d + q), _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + q)));
#endif
  std::memcpy(d, s, bytes);
}

// dst[0, n) = value, with the same split as stream_copy: whole lines streamed, partial ones plain.
template <typename T>
inline void stream_fill(T* dst, T value, int64_t n) {
  static_assert(sizeof(T) == 2 || sizeof(T) == 4, "a 2- or 4-byte element");
  char* d = reinterpret_cast<char*>(dst);
  int64_t bytes = n * static_cast<int64_t>(sizeof(T));
#if defined(__SSE2__)
  const int64_t head = head_before_line(d, bytes);
  std::fill(reinterpret_cast<T*>(d), reinterpret_cast<T*>(d + head), value);  // head: whole elements (d is T-aligned)
  d += head, bytes -= head;
  uint32_t word;
  if constexpr (sizeof(T) == 4) std::memcpy(&word, &value, 4);
  else {
    uint16_t half;
    std::memcpy(&half, &value, 2);
    word = half | (static_cast<uint32_t>(half) << 16);
  }
  const __m128i v = _mm_set1_epi32(static_cast<int>(word));
  for (; bytes >= 64; bytes -= 64, d += 64)
    for (int q = 0; q < 64; q += 16) _mm_stream_si128(reinterpret_cast<__m128i*>(d + q), v);
#endif
  std::fill(reinterpret_cast<T*>(d), reinterpret_cast<T*>(d + bytes), value);
}

inline void stream_fence() {
#if defined(__SSE2__)
  _mm_sfence();
#endif
}

// The estimate of a block: k (fp32, kept in L1 for the reward and the sums), the kl output and,
// with NANPAD only, m (the final mask: a NaN log-prob makes its token not counted, mask_nan), all in
// one vectorizable loop. Without NANPAD the final mask is the mask input itself, which the later
// loops read directly: packing lane masks back into bytes is dear. (Writing the masked reference
// output in this loop too was faster on cached data but 20-40% slower on large streamed problems.)
template <int32_t DT, int32_t EST, bool MASK, bool CLAMP, bool NANPAD>
inline void estimate_block(const KLRewardArgs& a, const BitsOf<DT>* lp, const BitsOf<DT>* ref, const uint8_t* mask,
                           int64_t n, float* __restrict k, uint8_t* __restrict m, BitsOf<DT>* __restrict kl) {
  const EstimatorParams e = a.est;
  for (int64_t i = 0; i < n; ++i) {
    // Unconditional loads, then a select: a load under a condition cannot be vectorized.
    const float l = load<DT>(lp, i), rf = load<DT>(ref, i);
    const bool mi = (MASK ? mask[i] != 0 : true) && (NANPAD ? (l == l) & (rf == rf) : true);
    const float diff = l - rf;
    const float d = mi ? diff : 0.0f;
    const float x = CLAMP ? clamp_lo_hi(d, e.in_lo_set, e.in_lo, e.in_hi_set, e.in_hi) : d;
    float v;
    if constexpr (EST == kK1) v = x;
    else if constexpr (EST == kAbs) v = fabsf(x);
    else if constexpr (EST == kK2) v = 0.5f * x * x;
    else v = expm1_vec(-x) + x;
    if constexpr (CLAMP) v = clamp_lo_hi(v, e.out_lo_set, e.out_lo, e.out_hi_set, e.out_hi);
    const float ki = mi ? v : 0.0f;
    k[i] = ki;
    if constexpr (NANPAD) m[i] = mi;
    kl[i] = to_bits<DT>(ki);
  }
}

template <int32_t DT, int32_t RT, int32_t EST, bool MASK, bool CLAMP, bool NANPAD>
KL_TARGET_CLONES Partial forward_run_contiguous(const KLRewardArgs& a, const Run& r) {
  using LB = BitsOf<DT>;
  using RB = BitsOf<RT>;
  const LB* lp = contiguous_at<LB>(a.lp, a.lp_ptrs, a.lp_s0, r);
  const LB* ref = contiguous_at<LB>(a.ref, a.ref_ptrs, a.ref_s0, r);
  const uint8_t* mask = MASK ? contiguous_at<uint8_t>(a.mask, a.mask_ptrs, a.mask_s0, r) : nullptr;
  const RB* reward = a.placement == kToken ? contiguous_at<RB>(a.reward, a.reward_ptrs, a.rw_s0, r) : nullptr;
  LB* kl = reinterpret_cast<LB*>(a.kl) + r.out0;
  RB* rw = reinterpret_cast<RB*>(a.reward_out) + r.out0;
  LB* ro = a.ref_out ? reinterpret_cast<LB*>(a.ref_out) + r.out0 : nullptr;
  const bool token = a.placement == kToken;
  const float rseq = a.placement == kSequence ? load<RT>(reinterpret_cast<const void*>(a.reward), r.seq * a.rw_s0) : 0.0f;
  const float c = coef_of(a, r.seq);
  const bool want_last = a.placement == kLast || a.placement == kLastValid;
  // Streaming: every output (kl, reward, masked ref) is written with streaming stores: each block
  // goes to L1 scratch first, then out whole lines at a time; blocks after the first start at a
  // multiple of 16 tokens of the output, so that a 64-byte line of a 4-byte output never straddles
  // two blocks. Partial lines at the ends of any range are written plain (see stream_copy).
  const int64_t touched = a.total * static_cast<int64_t>(2 * sizeof(LB) + (MASK ? 1 : 0) + sizeof(LB) + 2 * sizeof(RB) +
                                                         (ro ? sizeof(LB) : 0));
  const bool stream = touched > kStreamBytes;

  int64_t jlo, jhi;
  counted_range(r, &jlo, &jhi);
  // Tokens that cannot count (padding, prompt): kl 0, ref 0, reward untouched.
  auto fill = [&](int64_t j0, int64_t j1) {
    if (j1 <= j0) return;
    const int64_t nf = j1 - j0;
    if (stream) {
      stream_fill<LB>(kl + j0, LB(0), nf);
      if (ro) stream_fill<LB>(ro + j0, LB(0), nf);
      if (token) stream_copy(rw + j0, reward + j0, nf * static_cast<int64_t>(sizeof(RB)));
      else stream_fill<RB>(rw + j0, to_bits<RT>(rseq), nf);
      return;
    }
    std::memset(kl + j0, 0, nf * sizeof(LB));
    if (ro) std::memset(ro + j0, 0, nf * sizeof(LB));
    if (token) std::memcpy(rw + j0, reward + j0, nf * sizeof(RB));
    else std::fill(rw + j0, rw + j1, to_bits<RT>(rseq));
  };
  fill(0, jlo);
  double acc[kLanes] = {0};
  int64_t count = 0, last = -1;
  alignas(64) float k[kBlock];
  alignas(64) uint8_t m[kBlock];
  alignas(64) LB kl_s[kBlock];
  alignas(64) RB rw_s[kBlock];
  alignas(64) LB ro_s[kBlock];
  for (int64_t jb = jlo, n = 0; jb < jhi; jb += n) {
    n = std::min(kBlock, jhi - jb);
    if (stream && jb + n < jhi) n = ((r.out0 + jb + n) & ~int64_t(15)) - (r.out0 + jb);  // > 0: kBlock >= 32
    estimate_block<DT, EST, MASK, CLAMP, NANPAD>(a, lp + jb, ref + jb, MASK ? mask + jb : nullptr, n, k, m,
                                                 stream ? kl_s : kl + jb);
    RB* __restrict rwb = stream ? rw_s : rw + jb;
    if (token) {
      const RB* __restrict rin = reward + jb;
      for (int64_t i = 0; i < n; ++i) rwb[i] = to_bits<RT>(load<RT>(rin, i) - c * k[i]);
    } else {
      for (int64_t i = 0; i < n; ++i) rwb[i] = to_bits<RT>(rseq - c * k[i]);
    }
    // The final mask of this block: m (NANPAD), else the mask input; with neither, every token counts.
    const uint8_t* __restrict mb = NANPAD ? m : MASK ? mask + jb : nullptr;
    if (ro) {  // the reference's own bits where counted (unconditional load, then select)
      LB* __restrict rob = stream ? ro_s : ro + jb;
      const LB* __restrict src = ref + jb;
      if (MASK || NANPAD) {
        for (int64_t i = 0; i < n; ++i) {
          const LB v = src[i];
          rob[i] = mb[i] != 0 ? v : LB(0);
        }
      } else {
        std::memcpy(rob, src, n * sizeof(LB));
      }
    }
    if (stream) {
      stream_copy(kl + jb, kl_s, n * static_cast<int64_t>(sizeof(LB)));
      stream_copy(rw + jb, rw_s, n * static_cast<int64_t>(sizeof(RB)));
      if (ro) stream_copy(ro + jb, ro_s, n * static_cast<int64_t>(sizeof(LB)));
    }
    int64_t i = 0;
    for (; i + kLanes <= n; i += kLanes)
      for (int l = 0; l < kLanes; ++l) acc[l] += k[i + l];
    for (int l = 0; i < n; ++i, ++l) acc[l] += k[i];
    if constexpr (MASK || NANPAD) {
      // 16-bit lanes (a block counts at most kBlock <= 65535 tokens): with an int64 counter the
      // compiler widened every mask byte to 64 bits.
      uint16_t cnt = 0;
      for (int64_t q = 0; q < n; ++q) cnt = static_cast<uint16_t>(cnt + (mb[q] != 0));
      count += cnt;
      // The last counted token matters only to the "last" placement. The byte-by-byte scan back is
      // serial: done for every block, it took a quarter of the pass on masked batches.
      if (want_last && cnt > 0) {
        int64_t lst = n - 1;
        while (!mb[lst]) --lst;  // stops: this block counts a token
        last = r.pos0 + jb + lst;
      }
    } else {
      count += n;
      last = r.pos0 + jb + n - 1;
    }
  }
  fill(jhi, r.n);
  if (stream) stream_fence();
  double sum = 0.0;
  for (int l = 0; l < kLanes; ++l) sum += acc[l];
  return Partial{r.seq, sum, count, last};
}

inline bool has_clamp(const KLRewardArgs& a) {
  return a.est.in_lo_set || a.est.in_hi_set || a.est.out_lo_set || a.est.out_hi_set;
}

inline bool has_mask(const KLRewardArgs& a) { return a.mask != 0 || a.mask_ptrs != 0; }

template <int32_t DT, int32_t RT, int32_t EST>
Partial forward_run_est(const KLRewardArgs& a, const Run& r) {
  const bool clamp = has_clamp(a);
  if (has_mask(a))
    return clamp ? forward_run_contiguous<DT, RT, EST, true, true, false>(a, r)
                 : forward_run_contiguous<DT, RT, EST, true, false, false>(a, r);
  return clamp ? forward_run_contiguous<DT, RT, EST, false, true, false>(a, r)
               : forward_run_contiguous<DT, RT, EST, false, false, false>(a, r);
}

template <int32_t DT, int32_t RT>
Partial forward_run_strided(const KLRewardArgs& a, const Run& r);

template <int32_t DT, int32_t RT>
Partial forward_run_fast(const KLRewardArgs& a, const Run& r) {
  if (a.mask_nan) {
    // NaN pads are TorchRL's KLComputation convention: k1, no clamps. Only that case has a
    // vectorized instantiation (each one costs compile time); the rest takes the generic loop.
    if (a.est.estimator != kK1 || has_clamp(a)) return forward_run_strided<DT, RT>(a, r);
    return has_mask(a) ? forward_run_contiguous<DT, RT, kK1, true, false, true>(a, r)
                       : forward_run_contiguous<DT, RT, kK1, false, false, true>(a, r);
  }
  switch (a.est.estimator) {
    case kK1: return forward_run_est<DT, RT, kK1>(a, r);
    case kAbs: return forward_run_est<DT, RT, kAbs>(a, r);
    case kK2: return forward_run_est<DT, RT, kK2>(a, r);
    default: return forward_run_est<DT, RT, kK3>(a, r);
  }
}

// Generic path for any strides (non-contiguous inputs): one scalar loop.
template <int32_t DT, int32_t RT>
Partial forward_run_strided(const KLRewardArgs& a, const Run& r) {
  const InputAt lp_at = input_at(a.lp, a.lp_ptrs, a.lp_s0, a.lp_s1, r);
  const InputAt ref_at = input_at(a.ref, a.ref_ptrs, a.ref_s0, a.ref_s1, r);
  const InputAt m_at = input_at(a.mask, a.mask_ptrs, a.mask_s0, a.mask_s1, r);
  const bool token = a.placement == kToken;
  const InputAt rw_at = token ? input_at(a.reward, a.reward_ptrs, a.rw_s0, a.rw_s1, r)
                        : InputAt{reinterpret_cast<const void*>(a.reward), 0};
  const void* lp = lp_at.base;
  const void* ref = ref_at.base;
  const uint8_t* mask = static_cast<const uint8_t*>(m_at.base);
  const void* reward = rw_at.base;
  void* kl = reinterpret_cast<void*>(a.kl);
  void* rw = reinterpret_cast<void*>(a.reward_out);
  void* ro = reinterpret_cast<void*>(a.ref_out);
  const int64_t o = r.out0;
  const int64_t lp0 = lp_at.offset, ref0 = ref_at.offset, m0 = m_at.offset, rw0 = rw_at.offset;
  const bool nan_pad = a.mask_nan != 0;
  const int64_t lps = a.lp_s1, refs = a.ref_s1, ms = a.mask_s1, rws = a.rw_s1;
  const float rseq = a.placement == kSequence ? load<RT>(reward, r.seq * a.rw_s0) : 0.0f;
  const float c = coef_of(a, r.seq);
  const EstimatorParams est = a.est;

  int64_t jlo, jhi;
  counted_range(r, &jlo, &jhi);
  auto fill = [&](int64_t j0, int64_t j1) {  // tokens that cannot count: kl 0, reward untouched
    for (int64_t j = j0; j < j1; ++j) {
      store_zero<DT>(kl, o + j);
      if (ro) store_zero<DT>(ro, o + j);
      store<RT>(rw, o + j, token ? load<RT>(reward, rw0 + j * rws) : rseq);
    }
  };
  fill(0, jlo);
  double sum = 0.0;
  int64_t count = 0, last = -1;
  for (int64_t j = jlo; j < jhi; ++j) {
    bool m = mask == nullptr || mask[m0 + j * ms] != 0;
    float d = 0.0f;
    if (m) {
      const float l = load<DT>(lp, lp0 + j * lps), rf = load<DT>(ref, ref0 + j * refs);
      m = !nan_pad || (l == l && rf == rf);
      d = m ? l - rf : 0.0f;
    }
    const float k = m ? kl_value(d, est) : 0.0f;
    store<DT>(kl, o + j, k);
    store<RT>(rw, o + j, (token ? load<RT>(reward, rw0 + j * rws) : rseq) - c * k);
    if (ro) {
      if (m) copy_elem<DT>(ro, o + j, ref, ref0 + j * refs);
      else store_zero<DT>(ro, o + j);
    }
    sum += k;
    count += m;
    last = m ? r.pos0 + j : last;
  }
  fill(jhi, r.n);
  return Partial{r.seq, sum, count, last};
}

template <int32_t DT, int32_t RT, bool CONTIG>
Partial forward_run(const KLRewardArgs& a, const Run& r) {
  if constexpr (CONTIG) return forward_run_fast<DT, RT>(a, r);
  else return forward_run_strided<DT, RT>(a, r);
}

template <int32_t DT, int32_t RT, bool CONTIG>
void forward(const KLRewardArgs& a, int threads) {
  const int64_t tiles = tile_count(a);
  std::vector<Partial> head(tiles), tail(tiles);
  std::vector<double> sums(a.batch, 0.0);
  std::vector<int64_t> last(a.batch, -1);
  int64_t* count = reinterpret_cast<int64_t*>(a.count);
  std::fill(count, count + a.batch, 0);
  parallel_tiles(a, threads, [&](int64_t k) {
    for_each_run_in_tile(a, k, [&](const Run& r, bool first) {
      const Partial p = forward_run<DT, RT, CONTIG>(a, r);
      if (r.whole) {  // this tile alone owns the sequence
        sums[r.seq] = p.sum;
        count[r.seq] = p.count;
        last[r.seq] = p.last;
      } else {        // shared with a neighbouring tile: combined below, in tile order
        (first ? head : tail)[k] = p;
      }
    });
  });
  for (int64_t k = 0; k < tiles; ++k) {
    for (const Partial* p : {&head[k], &tail[k]}) {
      if (p->seq < 0) continue;
      sums[p->seq] += p->sum;
      count[p->seq] += p->count;
      last[p->seq] = std::max(last[p->seq], p->last);
    }
  }
  float* kl_sum = reinterpret_cast<float*>(a.kl_sum);
  for (int64_t b = 0; b < a.batch; ++b) kl_sum[b] = static_cast<float>(sums[b]);
  if (a.placement == kLast || a.placement == kLastValid)
    for (int64_t b = 0; b < a.batch; ++b) place_sequence_reward<DT, RT>(a, b, last[b]);
}

// ------------------------------------------------------------------------------ backward

template <int32_t DT, int32_t RT, bool CONTIG>
void backward_run(const KLRewardArgs& a, const Run& r) {
  const void* lp = reinterpret_cast<const void*>(a.lp);
  const void* ref = reinterpret_cast<const void*>(a.ref);
  const uint8_t* mask = reinterpret_cast<const uint8_t*>(a.mask);
  const void* g_kl = reinterpret_cast<const void*>(a.g_kl);
  const void* g_rw = reinterpret_cast<const void*>(a.g_reward);
  const void* g_ro = reinterpret_cast<const void*>(a.g_ref_out);
  const float* g_sum = reinterpret_cast<const float*>(a.g_kl_sum);
  void* g_lp = reinterpret_cast<void*>(a.g_lp);
  void* g_ref = reinterpret_cast<void*>(a.g_ref);
  const int64_t o = r.out0;
  const int64_t lp0 = r.row * a.lp_s0 + r.col0 * a.lp_s1, ref0 = r.row * a.ref_s0 + r.col0 * a.ref_s1;
  const int64_t m0 = r.row * a.mask_s0 + r.col0 * a.mask_s1;
  const int64_t lps = CONTIG ? 1 : a.lp_s1, refs = CONTIG ? 1 : a.ref_s1, ms = CONTIG ? 1 : a.mask_s1;
  const float c = coef_of(a, r.seq);
  const float gs = g_sum ? g_sum[r.seq] : 0.0f;
  const EstimatorParams est = a.est;

  int64_t jlo, jhi;
  counted_range(r, &jlo, &jhi);
  for (int64_t j = 0; j < jlo; ++j) store_zero<DT>(g_lp, o + j), store_zero<DT>(g_ref, o + j);
  for (int64_t j = jlo; j < jhi; ++j) {
    const bool m = mask == nullptr || mask[m0 + j * ms] != 0;
    if (!m) {
      store_zero<DT>(g_lp, o + j);
      store_zero<DT>(g_ref, o + j);
      continue;
    }
    const float d = load<DT>(lp, lp0 + j * lps) - load<DT>(ref, ref0 + j * refs);
    float g = gs;
    if (g_kl) g += load<DT>(g_kl, o + j);
    if (g_rw) g -= c * load<RT>(g_rw, o + j);
    const float glp = g * kl_grad(d, est);
    store<DT>(g_lp, o + j, glp);
    store<DT>(g_ref, o + j, (g_ro ? load<DT>(g_ro, o + j) : 0.0f) - glp);
  }
  for (int64_t j = jhi; j < r.n; ++j) store_zero<DT>(g_lp, o + j), store_zero<DT>(g_ref, o + j);
}

template <int32_t DT, int32_t RT, bool CONTIG>
void backward(const KLRewardArgs& a, int threads) {
  parallel_tiles(a, threads, [&](int64_t k) {
    for_each_run_in_tile(a, k, [&](const Run& r, bool) { backward_run<DT, RT, CONTIG>(a, r); });
  });
}

inline bool contiguous(const KLRewardArgs& a) {
  return a.lp_s1 == 1 && a.ref_s1 == 1 && (a.mask == 0 || a.mask_s1 == 1) &&
         (a.placement != kToken || a.rw_s1 == 1);
}

}  // namespace cpu_detail

// Forward (or backward) for log-prob dtype DT; the reward dtype is DT or float32.
template <int32_t DT>
int run_for_dtype(const KLRewardArgs& a, int threads, bool backward_pass) {
  using namespace cpu_detail;
  if (backward_pass && cpu_forward_only(a)) return 3;  // list inputs, NaN pads: the no-autograd forward only
  const bool c = contiguous(a);
  auto go = [&](auto rt) {
    constexpr int32_t RT = decltype(rt)::value;
    if (backward_pass) c ? backward<DT, RT, true>(a, threads) : backward<DT, RT, false>(a, threads);
    else c ? forward<DT, RT, true>(a, threads) : forward<DT, RT, false>(a, threads);
    return 0;
  };
  if (a.reward_dtype == DT) return go(std::integral_constant<int32_t, DT>{});
  if (a.reward_dtype == kFloat32) return go(std::integral_constant<int32_t, kFloat32>{});
  return 1;
}

}  // namespace kl
