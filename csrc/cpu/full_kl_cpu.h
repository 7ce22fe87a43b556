// Entry points of the fused CPU full_kl kernels (full_kl_cpu.cpp): the exact KL(pi || pi_ref) over the
// whole vocabulary per token, from the policy's and the reference's logits, one row at a time, and its
// gradients to both. Framework free: raw addresses, sizes, element strides; 0 on success, 1 for an
// unsupported dtype.
#pragma once

#include "common/row_args.h"

namespace kl {

// FullKLArgs: common/row_args.h (shared with the CUDA kernels, cuda/full_kl_cuda.cu).
int full_kl_forward_cpu(const FullKLArgs& a, int num_threads);
int full_kl_backward_cpu(const FullKLArgs& a, int num_threads);

}  // namespace kl
