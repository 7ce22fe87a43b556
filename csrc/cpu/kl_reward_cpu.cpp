// Entry points of the fused CPU kl_reward kernels: dispatch on the log-prob dtype to the
// instantiations in kl_reward_cpu_<dtype>.cpp (the templates are in kl_reward_cpu_impl.h).
#include "cpu/kl_reward_cpu.h"

namespace kl {

template <int32_t DT>
int run_for_dtype(const KLRewardArgs& a, int threads, bool backward_pass);  // kl_reward_cpu_<dtype>.cpp

namespace {

// The dtype pairs the kernels are instantiated for (kl_reward_cpu_<dtype>.cpp, run_for_dtype):
// log-probs fp32, bf16 or fp16, the reward in the log-prob dtype or fp32. dispatch and
// kl_reward_forward_check both ask this, so the two cannot disagree.
bool supported_dtypes(const KLRewardArgs& a) {
  const bool lp_ok = a.dtype == kFloat32 || a.dtype == kBFloat16 || a.dtype == kFloat16;
  return lp_ok && (a.reward_dtype == a.dtype || a.reward_dtype == kFloat32);
}

int dispatch(const KLRewardArgs& a, int threads, bool backward_pass) {
  if (!supported_dtypes(a)) return 1;
  switch (a.dtype) {
    case kFloat32: return run_for_dtype<kFloat32>(a, threads, backward_pass);
    case kBFloat16: return run_for_dtype<kBFloat16>(a, threads, backward_pass);
    case kFloat16: return run_for_dtype<kFloat16>(a, threads, backward_pass);
    default: return 1;
  }
}

}  // namespace

int kl_reward_forward_cpu(const KLRewardArgs& args, int num_threads) { return dispatch(args, num_threads, false); }

int kl_reward_forward_check(const KLRewardArgs& a) { return supported_dtypes(a) ? 0 : 1; }

int kl_reward_backward_cpu(const KLRewardArgs& args, int num_threads) { return dispatch(args, num_threads, true); }

}  // namespace kl
