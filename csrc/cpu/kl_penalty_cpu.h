// Entry points of the fused CPU kl_penalty_loss kernels (kl_penalty_cpu.cpp). Return 0 on success,
// or an error code (1: unsupported dtype combination).
#pragma once

#include "common/kl_penalty_args.h"

namespace kl {

int kl_penalty_forward_cpu(const KLPenaltyArgs& args, int num_threads);
int kl_penalty_backward_cpu(const KLPenaltyArgs& args, int num_threads);
// GSPO's pre-pass: args.seq_lr[b] (float32, written) = the mean of lp - old over sequence b's counted tokens
// (float64 sums, 0 without any); reads the geometry, mask, lp and old only.
int kl_penalty_sequence_log_ratio_cpu(const KLPenaltyArgs& args, int num_threads);

}  // namespace kl
