// Fused CPU token_logprobs: per counted row of the logits, the formulas of common/row_math.h (shared with
// cuda/token_logprobs_cuda.cu). The forward reads a row twice (its max, then the sums), while it sits in the
// core's cache (V = 152k bf16 is 304 KB): the logits cross the memory bus once. Sums: 16 float lanes over 256
// entries, then float64, in a fixed order: deterministic for any thread count. No [N, V] temporary.
#include "cpu/token_logprobs_cpu.h"

#include <cmath>
#include <cstdint>
#include <limits>

#include "common/codes.h"
#include "common/kl_math.h"
#include "cpu/vocab_rows.h"

namespace kl {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

template <int32_t DT>
KL_ROW_CLONES void forward_rows(const TokenLogprobsArgs& a, int64_t r0, int64_t r1) {
  const int64_t V = a.vocab;
  const float inv_t = a.inv_temperature;
  using Bits = BitsOf<DT>;
  for (int64_t r = r0; r < r1; ++r) {
    if (!row_counted(a, r)) {
      row_store_all(a, r, 0.0f);
      continue;
    }
    const Bits* row = logits_row<DT>(a, r);
    // pass 1: the max (a +inf shows there), and whether a NaN is there (selects: both vectorize)
    float mx[kRowLanes], nan_seen[kRowLanes];
    for (int l = 0; l < kRowLanes; ++l) mx[l] = -kInf, nan_seen[l] = 0.0f;
    int64_t j = 0;
    for (; j + kRowLanes <= V; j += kRowLanes) {
      for (int l = 0; l < kRowLanes; ++l) {
        const float z = from_bits<DT>(row[j + l]) * inv_t;
        mx[l] = z > mx[l] ? z : mx[l];
        nan_seen[l] = z != z ? 1.0f : nan_seen[l];
      }
    }
    for (; j < V; ++j) {
      const float z = from_bits<DT>(row[j]) * inv_t;
      mx[0] = z > mx[0] ? z : mx[0];
      nan_seen[0] = z != z ? 1.0f : nan_seen[0];
    }
    float m = -kInf;
    bool bad = false;
    for (int l = 0; l < kRowLanes; ++l) m = mx[l] > m ? mx[l] : m, bad = bad || nan_seen[l] != 0.0f;
    const int64_t y = row_label(a, r);
    if (row_undefined(bad, m) || y < 0 || y >= V) {  // undefined softmax (or a label Python refused)
      row_store_all(a, r, std::numeric_limits<float>::quiet_NaN());
      continue;
    }
    // pass 2: S and W, 16 float lanes over each 256-entry span, spans added in float64
    double S = 0.0, W = 0.0;
    for (int64_t s0 = 0; s0 < V; s0 += kRowSpan) {
      const int64_t s1 = s0 + kRowSpan < V ? s0 + kRowSpan : V;
      float se[kRowLanes], sw[kRowLanes];
      for (int l = 0; l < kRowLanes; ++l) se[l] = 0.0f, sw[l] = 0.0f;
      int64_t k = s0;
      for (; k + kRowLanes <= s1; k += kRowLanes) {
        for (int l = 0; l < kRowLanes; ++l) {
          float e, w;
          logprob_terms(m - from_bits<DT>(row[k + l]) * inv_t, e, w);  // d >= 0 (inf at -inf)
          se[l] += e;
          sw[l] += w;
        }
      }
      for (; k < s1; ++k) {
        float e, w;
        logprob_terms(m - from_bits<DT>(row[k]) * inv_t, e, w);
        se[0] += e;
        sw[0] += w;
      }
      for (int l = 0; l < kRowLanes; ++l) S += se[l], W += sw[l];
    }
    const double log_s = std::log(S);
    const float lse = logprob_lse(m, log_s);
    logprob_store(a, r, from_bits<DT>(row[y]) * inv_t - lse, lse, logprob_entropy(S, W, log_s));
  }
}

template <int32_t DT>
KL_ROW_CLONES void backward_rows(const TokenLogprobsArgs& a, int64_t r0, int64_t r1) {
  const int64_t V = a.vocab;
  const float inv_t = a.inv_temperature;
  using Bits = BitsOf<DT>;
  for (int64_t r = r0; r < r1; ++r) {
    const Bits* row = logits_row<DT>(a, r);
    Bits* out = grad_logits_row<DT>(a, r);
    if (!row_counted(a, r)) {
      for (int64_t j = 0; j < V; ++j) out[j] = to_bits<DT>(0.0f);
      continue;
    }
    const LogprobGradRow in = logprob_grad_row(a, r);
    const float gl = in.g_lp, gh = in.g_h, lse = in.lse, h = in.h;
    const int64_t y = row_label(a, r);
    const bool in_vocab = y >= 0 && y < V;
    // the label's logit, read before the loop: with inplace_backward `out` is `row`
    const float zy = in_vocab ? from_bits<DT>(row[y]) * inv_t : std::numeric_limits<float>::quiet_NaN();
    for (int64_t j = 0; j < V; ++j) {
      out[j] = to_bits<DT>(logprob_grad(lse - from_bits<DT>(row[j]) * inv_t, gl, gh, h) * inv_t);
    }
    if (in_vocab) out[y] = to_bits<DT>(logprob_grad_label(lse - zy, gl, gh, h) * inv_t);
  }
}

}  // namespace

int token_logprobs_forward_cpu(const TokenLogprobsArgs& a, int num_threads) {
  return with_logits_dtype(a.dtype, [&](auto dt) {
    constexpr int32_t kDt = decltype(dt)::value;
    run_row_tiles(a.rows, a.vocab, num_threads, [&](int64_t r0, int64_t r1) { forward_rows<kDt>(a, r0, r1); });
  });
}

int token_logprobs_backward_cpu(const TokenLogprobsArgs& a, int num_threads) {
  return with_logits_dtype(a.dtype, [&](auto dt) {
    constexpr int32_t kDt = decltype(dt)::value;
    run_row_tiles(a.rows, a.vocab, num_threads, [&](int64_t r0, int64_t r1) { backward_rows<kDt>(a, r0, r1); });
  });
}

}  // namespace kl
