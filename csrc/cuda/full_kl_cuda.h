// Entry points of the fused CUDA full_kl kernels (full_kl_cuda.cu): the exact KL(pi || pi_ref) over the
// whole vocabulary per token, one block per row, and its gradients to both logits. Framework free: the
// argument struct of raw addresses (common/row_args.h, shared with the CPU kernels) and a cudaStream_t as
// an integer. Each returns 0, 1 (unsupported dtype) or 1000 + a cudaError_t from the launch.
#pragma once

#include <cstdint>

#include "common/row_args.h"

namespace kl {

int full_kl_forward_cuda(const FullKLArgs& args, uintptr_t stream);
int full_kl_backward_cuda(const FullKLArgs& args, uintptr_t stream);

}  // namespace kl
