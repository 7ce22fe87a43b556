// Argument structs of the row-wise kernels (token_logprobs, full_kl), shared by the CPU kernels
// (cpu/token_logprobs_cpu.cpp, cpu/full_kl_cpu.cpp) and the CUDA ones (cuda/token_logprobs_cuda.cu,
// cuda/full_kl_cuda.cu), and bound once for both extensions (bind_row_args below). Framework free: raw
// addresses, sizes, element strides. kl_kernels/<op>/launch.py fills them.
//
// Row r of a logits tensor [*S, V] starts at element (r / inner) * stride_outer + (r % inner) * stride_inner
// (common/row_math.h's row_start; the vocabulary contiguous): an [N, V] view is inner = rows, [B, T, V] slabs
// (logits[:, :-1]) inner = T. Each gradient tensor uses the same map with its own strides (the logits' own for
// token_logprobs' inplace_backward). The Python side of the map is kl_kernels/vocab_rows.py.
#pragma once

#include <cstdint>

namespace kl {

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
  float softcap = 0.0f;  // c > 0: z = c tanh(x / c) / T (common/row_math.h: SoftCap); 0: z = x / T
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

// Both logits tensors have the same shape and dtype, each its own row strides.
struct FullKLArgs {
  uintptr_t logits = 0;
  uintptr_t ref_logits = 0;
  int32_t dtype = 0;  // kFloat32, kBFloat16, kFloat16 (common/codes.h)
  int64_t rows = 0;
  int64_t vocab = 0;
  int64_t inner = 1;
  int64_t stride_outer = 0;
  int64_t stride_inner = 0;
  int64_t ref_stride_outer = 0;
  int64_t ref_stride_inner = 0;
  uintptr_t counted = 0;  // bool [rows]
  float inv_temperature = 1.0f;
  float softcap = 0.0f;  // of both tensors, as TokenLogprobsArgs::softcap
  // forward outputs, float32 [rows]
  uintptr_t kl = 0;
  uintptr_t lse = 0;
  uintptr_t ref_lse = 0;
  // backward: grad_kl float32 [rows] in; the gradients out in the logits' dtype (0: not wanted), each
  // with its own row strides
  uintptr_t grad_kl = 0;
  uintptr_t grad_logits = 0;
  int64_t g_stride_outer = 0;
  int64_t g_stride_inner = 0;
  uintptr_t grad_ref = 0;
  int64_t gr_stride_outer = 0;
  int64_t gr_stride_inner = 0;
};

}  // namespace kl
