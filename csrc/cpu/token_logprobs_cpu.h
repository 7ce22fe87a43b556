// Entry points of the fused CPU token_logprobs kernels (token_logprobs_cpu.cpp): per-token log-probs
// and entropy from logits, one row of the vocabulary at a time, and the logits' gradient. Framework
// free: raw addresses, sizes, element strides; 0 on success, 1 for an unsupported dtype.
#pragma once

#include <cstdint>

namespace kl {

// Row r of the logits [*S, V] starts at element (r / inner) * stride_outer + (r % inner) * stride_inner
// (the vocabulary contiguous): an [N, V] view is inner = rows, [B, T, V] slabs (logits[:, :-1]) inner = T.
// The gradient rows use the same map with their own strides (the logits' own for inplace_backward).
struct TokenLogprobsArgs {
  uintptr_t logits = 0;
  int32_t dtype = 0;  // kFloat32, kBFloat16, kFloat16 (common/codes.h)
  int64_t rows = 0;
  int64_t vocab = 0;
  int64_t inner = 1;
  int64_t stride_outer = 0;
  int64_t stride_inner = 0;
  uintptr_t labels = 0;   // int64 [rows]
  uintptr_t counted = 0;  // bool [rows]: mask and not ignore_index
  float inv_temperature = 1.0f;
  // forward outputs, float32 [rows]; entropy 0 when not wanted
  uintptr_t log_probs = 0;
  uintptr_t lse = 0;
  uintptr_t entropy = 0;
  // backward inputs (float32 [rows]; 0: no gradient reaches that output) and output (logits' dtype)
  uintptr_t grad_lp = 0;
  uintptr_t grad_entropy = 0;
  uintptr_t grad_logits = 0;
  int64_t g_stride_outer = 0;
  int64_t g_stride_inner = 0;
};

int token_logprobs_forward_cpu(const TokenLogprobsArgs& a, int num_threads);
int token_logprobs_backward_cpu(const TokenLogprobsArgs& a, int num_threads);

}  // namespace kl
