// Entry points of the fused CPU full_kl kernels (full_kl_cpu.cpp): the exact KL(pi || pi_ref) over the
// whole vocabulary per token, from the policy's and the reference's logits, one row at a time, and its
// gradients to both. Framework free: raw addresses, sizes, element strides; 0 on success, 1 for an
// unsupported dtype.
#pragma once

#include <cstdint>

namespace kl {

// Row r of either logits tensor starts at element (r / inner) * stride_outer + (r % inner) * stride_inner
// with that tensor's strides (cpu/vocab_rows.h); both tensors have the same shape and dtype.
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

int full_kl_forward_cpu(const FullKLArgs& a, int num_threads);
int full_kl_backward_cpu(const FullKLArgs& a, int num_threads);

}  // namespace kl
