// Entry points of the fused CUDA kl_penalty_loss kernels (see kl_penalty_cuda.cu). Framework-free:
// the argument struct of raw addresses, a caller-allocated workspace and a cudaStream_t as an
// integer. Each returns 0, 1 (unsupported dtype combination or estimator), 2 (too many tiles) or
// 1000 + a cudaError_t from the launch.
#pragma once

#include <cstdint>

#include "common/kl_penalty_args.h"

namespace kl {

// Bytes of scratch the forward needs: two boundary slots per tile (six fp64 sums and a count).
int64_t kl_penalty_cuda_workspace_bytes(const KLPenaltyArgs& args);

int kl_penalty_forward_cuda(const KLPenaltyArgs& args, uintptr_t workspace, uintptr_t stream);
int kl_penalty_backward_cuda(const KLPenaltyArgs& args, uintptr_t stream);

}  // namespace kl
