// kl_reward CPU kernels instantiated for f16 log-probs (one translation unit per dtype, built in parallel).
#include "cpu/kl_reward_cpu_impl.h"

namespace kl {
template int run_for_dtype<kFloat16>(const KLRewardArgs&, int, bool);
}  // namespace kl
