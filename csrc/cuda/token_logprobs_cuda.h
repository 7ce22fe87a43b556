// Entry points of the fused CUDA token_logprobs kernels (token_logprobs_cuda.cu): per-token log-probs and
// entropy from logits, one block per row of the vocabulary, and the logits' gradient. Framework free: the
// argument struct of raw addresses (common/row_args.h, shared with the CPU kernels) and a cudaStream_t as
// an integer. Each returns 0, 1 (unsupported dtype) or 1000 + a cudaError_t from the launch.
#pragma once

#include <cstdint>

#include "common/row_args.h"

namespace kl {

int token_logprobs_forward_cuda(const TokenLogprobsArgs& args, uintptr_t stream);
int token_logprobs_backward_cuda(const TokenLogprobsArgs& args, uintptr_t stream);

}  // namespace kl
