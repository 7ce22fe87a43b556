// Entry points of the fused CPU token_logprobs kernels (token_logprobs_cpu.cpp): per-token log-probs
// and entropy from logits, one row of the vocabulary at a time, and the logits' gradient. Framework
// free: raw addresses, sizes, element strides; 0 on success, 1 for an unsupported dtype.
#pragma once

#include "common/row_args.h"

namespace kl {

// TokenLogprobsArgs: common/row_args.h (shared with the CUDA kernels, cuda/token_logprobs_cuda.cu).
int token_logprobs_forward_cpu(const TokenLogprobsArgs& a, int num_threads);
int token_logprobs_backward_cpu(const TokenLogprobsArgs& a, int num_threads);

}  // namespace kl
