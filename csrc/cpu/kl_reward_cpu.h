// Entry points of the fused CPU kl_reward kernels (see kl_reward_cpu.cpp). Return 0 on success,
// or an error code (1: unsupported dtype combination).
#pragma once

#include "common/kl_reward_args.h"

namespace kl {

int kl_reward_forward_cpu(const KLRewardArgs& args, int num_threads);
int kl_reward_backward_cpu(const KLRewardArgs& args, int num_threads);

// The error code kl_reward_forward_cpu would return before touching memory (0: it would run), so
// an overlapped run (kl_reward_forward_during) is refused before its outputs are handed out.
int kl_reward_forward_check(const KLRewardArgs& args);

}  // namespace kl
