// Entry points of the fused CUDA kl_reward kernels (see kl_reward_cuda.cu). Framework-free: the
// argument struct of raw addresses, a caller-allocated workspace and a cudaStream_t as an integer.
// Each returns 0, 1 (unsupported dtype combination) or 1000 + a cudaError_t from the launch.
#pragma once

#include <cstdint>

#include "common/kl_reward_args.h"

namespace kl {

// Elements per forward tile (one thread block); the workspace is sized from it.
constexpr int64_t kCudaTile = 2048;

// Bytes of scratch the forward needs: per tile two boundary slots (sum, count, last), and one
// last-counted position per sequence. Allocated by the caller (torch's caching allocator).
int64_t kl_reward_cuda_workspace_bytes(const KLRewardArgs& args);

int kl_reward_forward_cuda(const KLRewardArgs& args, uintptr_t workspace, uintptr_t stream);
int kl_reward_backward_cuda(const KLRewardArgs& args, uintptr_t stream);

}  // namespace kl
