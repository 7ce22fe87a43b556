// The fused CPU loss forward with kl_times_ratio (the KL term times the ratio, TRL's use_bias_correction_kl):
// its own translation unit, so that the common loops keep GCC's inlining budget (kl_penalty_cpu_impl.h, run_forward).
#include "cpu/kl_penalty_cpu_impl.h"

namespace kl {
namespace cpu_penalty {

int forward_with_kl_ratio(const KLPenaltyArgs& a, int threads) { return forward_dispatch<true>(a, threads); }

}  // namespace cpu_penalty
}  // namespace kl
