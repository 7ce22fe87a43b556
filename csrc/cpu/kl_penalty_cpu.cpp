// Fused kl_penalty_loss on the CPU: one pass over the tokens writes the per-token gradient of the
// loss w.r.t. log_probs (the one buffer kept for backward) and the per-sequence sums; the backward
// pass scales that buffer by the incoming gradient.
//
// Work is cut into kl_reward's fixed tiles of the flat token space (kl_reward_cpu_impl.h): the same
// runs, the same thread pool, per-sequence partial sums combined in tile order in float64, so the
// results are bitwise identical run to run and for any thread count. Within a run, blocks of
// kBlock tokens are first loaded into float32 scratch (one simple loop per input, the choice of
// source made outside the loop), then one branch-free loop computes every token: both loops
// vectorize, for any layout, dtype and option.
#include "cpu/kl_penalty_cpu.h"

#include "cpu/kl_penalty_cpu_impl.h"

namespace kl {

int kl_penalty_forward_cpu(const KLPenaltyArgs& args, int num_threads) {
  if (args.result) return 4;  // the aggregation on the device is the CUDA forward's (here: totals)
  return args.kl_ratio ? cpu_penalty::forward_with_kl_ratio(args, num_threads)
                       : cpu_penalty::forward_dispatch<false>(args, num_threads);
}

int kl_penalty_sequence_log_ratio_cpu(const KLPenaltyArgs& a, int num_threads) {
  if (a.g.batch == 0) return 0;
  if (!a.seq_lr) return 5;  // no output buffer
  const bool c = a.g.lp_s1 == 1 && a.old_s1 == 1 && (a.g.mask == 0 || a.g.mask_s1 == 1);
  switch (a.g.dtype) {
    case kFloat32: c ? cpu_penalty::sequence_log_ratio<kFloat32, true>(a, num_threads)
                     : cpu_penalty::sequence_log_ratio<kFloat32, false>(a, num_threads); return 0;
    case kBFloat16: c ? cpu_penalty::sequence_log_ratio<kBFloat16, true>(a, num_threads)
                      : cpu_penalty::sequence_log_ratio<kBFloat16, false>(a, num_threads); return 0;
    case kFloat16: c ? cpu_penalty::sequence_log_ratio<kFloat16, true>(a, num_threads)
                     : cpu_penalty::sequence_log_ratio<kFloat16, false>(a, num_threads); return 0;
    default: return 1;
  }
}

int kl_penalty_backward_cpu(const KLPenaltyArgs& args, int num_threads) {
  if (args.g_loss) return 4;
  return cpu_penalty::with_penalty_dtypes(args, [&](auto dt, auto at) {
    cpu_penalty::backward<decltype(dt)::value, decltype(at)::value>(args, num_threads);
    return 0;
  });
}

}  // namespace kl
