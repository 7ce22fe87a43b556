// kl_reward's eager fast lane for lists of per-sequence CPU tensors: checked and turned into the
// kernel's arguments in one C call (see list_plan.cpp).
#pragma once

#include <pybind11/pybind11.h>

namespace kl {

// For a kl_reward call on lists of per-sequence CPU tensors (no offsets, lengths, prompt_lens or
// clamps: the caller checks) that kl_reward's general path would read in place on the cpu backend
// with exactly these arguments: (KLRewardArgs with every input set, log-prob dtype code, reward
// dtype code, trailing-dim flag of the reward output, the sequence lengths as a list of ints, what
// keeps the addresses valid). None for anything else (that path then runs and reports). The outputs
// (kl, reward_out, ref_out, kl_sum, count) are left for the caller to allocate and set. The flags
// the kernel's reads do not depend on are left to kl_reward_list_readable: the lane holds only if
// it says true.
pybind11::object kl_reward_list_plan(pybind11::handle tensor_type, pybind11::handle log_probs,
                                     pybind11::handle ref_log_probs, pybind11::handle reward, pybind11::handle mask,
                                     pybind11::handle coef, pybind11::handle estimator, pybind11::handle padding_side,
                                     pybind11::handle reward_placement, pybind11::handle return_ref,
                                     pybind11::handle detach, pybind11::handle mask_nan, bool grad_enabled);

// For the `keep` of a plan: whether every tensor it read may be read in place (no negative bit)
// and, where autograd would record, no log-prob tensor requires grad. False: the general path runs.
bool kl_reward_list_readable(pybind11::handle keep);

}  // namespace kl
