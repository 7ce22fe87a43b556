// Fused CPU full_kl: per counted row, the policy's logits x and the reference's r, the formulas of
// common/row_math.h (shared with cuda/full_kl_cuda.cu). Subtracting each row's own max before the difference (v_j -
// u_j, not z_j - w_j) keeps a constant shift between the two models' logits, which cancels in the KL, out of the
// float32 arithmetic. The policy putting mass where the reference has none (w_j = -inf, p_j > 0 against the row's
// final max) gives KL = +inf; a row whose KL is not finite has NaN gradients. The forward reads each row once
// (online maxima and sums, row_math.h: per 1024-entry run its maxima, then its terms while it sits in L1). Sums: 16
// float lanes over 256 entries, then float64, in a fixed order: deterministic for any thread count. No [N, V]
// temporary.
#include "cpu/full_kl_cpu.h"

#include <cmath>
#include <cstdint>
#include <limits>

#include "common/codes.h"
#include "common/kl_math.h"
#include "cpu/vocab_rows.h"

namespace kl {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

template <int32_t DT, class Cap>
KL_ROW_CLONES void forward_rows(const FullKLArgs& a, int64_t r0, int64_t r1, Cap cap) {
  const int64_t V = a.vocab;
  using Bits = BitsOf<DT>;
  for (int64_t r = r0; r < r1; ++r) {
    if (!row_counted(a, r)) {
      row_store_all(a, r, 0.0f);
      continue;
    }
    const Bits* x = logits_row<DT>(a, r);
    const Bits* y = ref_logits_row<DT>(a, r);
    // one pass: per 1024-entry run (vocab_rows.h: kRowRun) both maxima (a +inf shows there) and a NaN flag
    // for either row, the sums moved onto the running maxima (row_math.h), then the run's terms of S, R and A
    // while it sits in L1; 16 float lanes over 256-entry spans, spans added in float64
    FullKLSums sums = full_kl_sums_start();
    float nan_seen[kRowLanes];
    for (int l = 0; l < kRowLanes; ++l) nan_seen[l] = 0.0f;
    for (int64_t s0 = 0; s0 < V; s0 += kRowRun) {
      const int64_t s1 = s0 + kRowRun < V ? s0 + kRowRun : V;
      float mz[kRowLanes], mw[kRowLanes], ml[kRowLanes];
      for (int l = 0; l < kRowLanes; ++l) mz[l] = -kInf, mw[l] = -kInf, ml[l] = -kInf;
      int64_t j = s0;
      for (; j + kRowLanes <= s1; j += kRowLanes) {
        for (int l = 0; l < kRowLanes; ++l) {
          const float z = cap.z(from_bits<DT>(x[j + l])), w = cap.z(from_bits<DT>(y[j + l]));
          mz[l] = z > mz[l] ? z : mz[l];
          mw[l] = w > mw[l] ? w : mw[l];
          const float lost = full_kl_lost(z, w);
          ml[l] = lost > ml[l] ? lost : ml[l];
          nan_seen[l] = (z != z) | (w != w) ? 1.0f : nan_seen[l];
        }
      }
      for (; j < s1; ++j) {
        const float z = cap.z(from_bits<DT>(x[j])), w = cap.z(from_bits<DT>(y[j]));
        mz[0] = z > mz[0] ? z : mz[0];
        mw[0] = w > mw[0] ? w : mw[0];
        const float lost = full_kl_lost(z, w);
        ml[0] = lost > ml[0] ? lost : ml[0];
        nan_seen[0] = (z != z) | (w != w) ? 1.0f : nan_seen[0];
      }
      float m, n;
      full_kl_rebase(sums, lanes_max(mz), lanes_max(mw), lanes_max(ml), m, n);
      for (int64_t q0 = s0; q0 < s1; q0 += kRowSpan) {
        const int64_t q1 = q0 + kRowSpan < s1 ? q0 + kRowSpan : s1;
        float se[kRowLanes], sf[kRowLanes], sr[kRowLanes], sa[kRowLanes];
        for (int l = 0; l < kRowLanes; ++l) se[l] = 0.0f, sf[l] = 0.0f, sr[l] = 0.0f, sa[l] = 0.0f;
        int64_t k = q0;
        for (; k + kRowLanes <= q1; k += kRowLanes) {
          for (int l = 0; l < kRowLanes; ++l) {
            float e, f, q, t;
            full_kl_terms(m - cap.z(from_bits<DT>(x[k + l])), n - cap.z(from_bits<DT>(y[k + l])), e, f, q, t);
            se[l] += e;
            sf[l] += f;
            sr[l] += q;
            sa[l] += t;
          }
        }
        for (; k < q1; ++k) {
          float e, f, q, t;
          full_kl_terms(m - cap.z(from_bits<DT>(x[k])), n - cap.z(from_bits<DT>(y[k])), e, f, q, t);
          se[0] += e;
          sf[0] += f;
          sr[0] += q;
          sa[0] += t;
        }
        for (int l = 0; l < kRowLanes; ++l) sums.S += se[l], sums.F += sf[l], sums.R += sr[l], sums.A += sa[l];
      }
    }
    bool bad = false;
    for (int l = 0; l < kRowLanes; ++l) bad = bad || nan_seen[l] != 0.0f;
    if (row_undefined(bad, sums.m) || row_undefined(bad, sums.n)) {  // a softmax is undefined
      row_store_all(a, r, kNaN);
      continue;
    }
    const double log_s = std::log(sums.S), log_r = std::log(sums.R);
    full_kl_store(a, r, full_kl_value(sums.S, sums.A, log_s, log_r, sums.m, sums.lost), logprob_lse(sums.m, log_s),
                  logprob_lse(sums.n, log_r));
  }
}

template <int32_t DT, class Cap>
KL_ROW_CLONES void backward_rows(const FullKLArgs& a, int64_t r0, int64_t r1, Cap cap) {
  const int64_t V = a.vocab;
  using Bits = BitsOf<DT>;
  for (int64_t r = r0; r < r1; ++r) {
    const Bits* x = logits_row<DT>(a, r);
    const Bits* y = ref_logits_row<DT>(a, r);
    Bits* gx = grad_logits_row<DT>(a, r);
    Bits* gr = grad_ref_row<DT>(a, r);
    const bool counted = row_counted(a, r);
    const FullKLGradRow in = full_kl_grad_row(a, r);
    if (!counted || !full_kl_grad_defined(in.kl)) {  // 0, or NaN: the gradient of an infinite or undefined KL
      const Bits fill = to_bits<DT>(counted ? kNaN : 0.0f);
      for (int64_t j = 0; gx && j < V; ++j) gx[j] = fill;
      for (int64_t j = 0; gr && j < V; ++j) gr[j] = fill;
      continue;
    }
    const float g = in.g, kl = in.kl, lse = in.lse, ref_lse = in.ref_lse;
    for (int64_t j = 0; j < V; ++j) {
      const float xj = from_bits<DT>(x[j]), yj = from_bits<DT>(y[j]);
      const float u = lse - cap.z(xj), v = ref_lse - cap.z(yj);
      if constexpr (Cap::kOn) {  // the inputs read before the outputs are written (inplace gradients)
        if (gx) gx[j] = to_bits<DT>(full_kl_grad_policy(g, u, v, kl) * cap.slope(xj));
        if (gr) gr[j] = to_bits<DT>(full_kl_grad_ref(g, u, v) * cap.slope(yj));
      } else {
        if (gx) gx[j] = to_bits<DT>(full_kl_grad_policy(g, u, v, kl));
        if (gr) gr[j] = to_bits<DT>(full_kl_grad_ref(g, u, v));
      }
    }
  }
}

}  // namespace

int full_kl_forward_cpu(const FullKLArgs& a, int num_threads) {
  return with_logits_dtype(a.dtype, [&](auto dt) {
    constexpr int32_t kDt = decltype(dt)::value;
    with_logit_cap(a, [&](auto cap) {
      run_row_tiles(a.rows, a.vocab, num_threads, [&](int64_t r0, int64_t r1) { forward_rows<kDt>(a, r0, r1, cap); });
    });
  });
}

int full_kl_backward_cpu(const FullKLArgs& a, int num_threads) {
  return with_logits_dtype(a.dtype, [&](auto dt) {
    constexpr int32_t kDt = decltype(dt)::value;
    with_logit_cap(a, [&](auto cap) {
      run_row_tiles(a.rows, a.vocab, num_threads, [&](int64_t r0, int64_t r1) { backward_rows<kDt>(a, r0, r1, cap); });
    });
  });
}

}  // namespace kl
