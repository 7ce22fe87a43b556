// Fused CPU token_logprobs: per counted row of the logits, the formulas of common/row_math.h (shared with
// cuda/token_logprobs_cuda.cu). The forward reads a row once (online max and sums, row_math.h): per
// 1024-entry run its max, then its terms while the run sits in L1. Sums: 16 float lanes over 256 entries,
// then float64, in a fixed order: deterministic for any thread count. No [N, V] temporary.
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

template <int32_t DT, class Cap>
KL_ROW_CLONES void forward_rows(const TokenLogprobsArgs& a, int64_t r0, int64_t r1, Cap cap) {
  const int64_t V = a.vocab;
  using Bits = BitsOf<DT>;
  for (int64_t r = r0; r < r1; ++r) {
    if (!row_counted(a, r)) {
      row_store_all(a, r, 0.0f);
      continue;
    }
    const Bits* row = logits_row<DT>(a, r);
    // one pass: per 1024-entry run (vocab_rows.h: kRowRun) its max (a +inf shows there) and NaN flag, the
    // sums moved onto the running max (row_math.h), then the run's terms of S and W while it sits in L1;
    // 16 float lanes (selects and sums: both vectorize) over 256-entry spans, spans added in float64
    LogprobSums sums = logprob_sums_start();
    float nan_seen[kRowLanes];
    for (int l = 0; l < kRowLanes; ++l) nan_seen[l] = 0.0f;
    for (int64_t s0 = 0; s0 < V; s0 += kRowRun) {
      const int64_t s1 = s0 + kRowRun < V ? s0 + kRowRun : V;
      float mx[kRowLanes];
      for (int l = 0; l < kRowLanes; ++l) mx[l] = -kInf;
      int64_t j = s0;
      for (; j + kRowLanes <= s1; j += kRowLanes) {
        for (int l = 0; l < kRowLanes; ++l) {
          const float z = cap.z(from_bits<DT>(row[j + l]));
          mx[l] = z > mx[l] ? z : mx[l];
          nan_seen[l] = z != z ? 1.0f : nan_seen[l];
        }
      }
      for (; j < s1; ++j) {
        const float z = cap.z(from_bits<DT>(row[j]));
        mx[0] = z > mx[0] ? z : mx[0];
        nan_seen[0] = z != z ? 1.0f : nan_seen[0];
      }
      const float m = logprob_rebase(sums, lanes_max(mx));
      for (int64_t q0 = s0; q0 < s1; q0 += kRowSpan) {
        const int64_t q1 = q0 + kRowSpan < s1 ? q0 + kRowSpan : s1;
        float se[kRowLanes], sw[kRowLanes];
        for (int l = 0; l < kRowLanes; ++l) se[l] = 0.0f, sw[l] = 0.0f;
        int64_t k = q0;
        for (; k + kRowLanes <= q1; k += kRowLanes) {
          for (int l = 0; l < kRowLanes; ++l) {
            float e, w;
            logprob_terms(m - cap.z(from_bits<DT>(row[k + l])), e, w);  // d >= 0 (inf at -inf)
            se[l] += e;
            sw[l] += w;
          }
        }
        for (; k < q1; ++k) {
          float e, w;
          logprob_terms(m - cap.z(from_bits<DT>(row[k])), e, w);
          se[0] += e;
          sw[0] += w;
        }
        for (int l = 0; l < kRowLanes; ++l) sums.S += se[l], sums.W += sw[l];
      }
    }
    bool bad = false;
    for (int l = 0; l < kRowLanes; ++l) bad = bad || nan_seen[l] != 0.0f;
    const int64_t y = row_label(a, r);
    if (row_undefined(bad, sums.m) || y < 0 || y >= V) {  // undefined softmax (or a label Python refused)
      row_store_all(a, r, std::numeric_limits<float>::quiet_NaN());
      continue;
    }
    const double log_s = std::log(sums.S);
    const float lse = logprob_lse(sums.m, log_s);
    logprob_store(a, r, cap.z(from_bits<DT>(row[y])) - lse, lse, logprob_entropy(sums.S, sums.W, log_s));
  }
}

template <int32_t DT, class Cap>
KL_ROW_CLONES void backward_rows(const TokenLogprobsArgs& a, int64_t r0, int64_t r1, Cap cap) {
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
    const float xy = in_vocab ? from_bits<DT>(row[y]) : std::numeric_limits<float>::quiet_NaN();
    const float zy = cap.z(xy);
    for (int64_t j = 0; j < V; ++j) {
      const float x = from_bits<DT>(row[j]);
      float g = logprob_grad(lse - cap.z(x), gl, gh, h) * inv_t;
      if constexpr (Cap::kOn) g *= cap.slope(x);
      out[j] = to_bits<DT>(g);
    }
    if (in_vocab) {
      float g = logprob_grad_label(lse - zy, gl, gh, h) * inv_t;
      if constexpr (Cap::kOn) g *= cap.slope(xy);
      out[y] = to_bits<DT>(g);
    }
  }
}

}  // namespace

int token_logprobs_forward_cpu(const TokenLogprobsArgs& a, int num_threads) {
  return with_logits_dtype(a.dtype, [&](auto dt) {
    constexpr int32_t kDt = decltype(dt)::value;
    with_logit_cap(a, [&](auto cap) {
      run_row_tiles(a.rows, a.vocab, num_threads, [&](int64_t r0, int64_t r1) { forward_rows<kDt>(a, r0, r1, cap); });
    });
  });
}

int token_logprobs_backward_cpu(const TokenLogprobsArgs& a, int num_threads) {
  return with_logits_dtype(a.dtype, [&](auto dt) {
    constexpr int32_t kDt = decltype(dt)::value;
    with_logit_cap(a, [&](auto cap) {
      run_row_tiles(a.rows, a.vocab, num_threads, [&](int64_t r0, int64_t r1) { backward_rows<kDt>(a, r0, r1, cap); });
    });
  });
}

}  // namespace kl
