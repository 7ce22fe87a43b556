// kl_reward's eager fast lane on the CPU: plain dense tensors checked and turned into the kernel's
// arguments in one C call (see dense_plan.cpp).
#pragma once

#include <pybind11/pybind11.h>

namespace kl {

// (KLRewardArgs with every input set, reward dtype code, trailing-dim flag of the reward output)
// for a kl_reward call on dense CPU tensors that kl_reward's general path would run on the cpu
// backend with exactly these arguments, or None for anything else (that path then runs and reports).
// The outputs (kl, reward_out, ref_out, kl_sum, count) are left for the caller to allocate and set.
pybind11::object kl_reward_dense_plan(pybind11::handle tensor_type, pybind11::handle log_probs,
                                      pybind11::handle ref_log_probs, pybind11::handle reward, pybind11::handle mask,
                                      pybind11::handle offsets, pybind11::handle lengths, pybind11::handle coef,
                                      pybind11::handle estimator, pybind11::handle padding_side,
                                      pybind11::handle reward_placement, pybind11::handle return_ref,
                                      pybind11::handle detach, pybind11::handle mask_nan,
                                      bool grad_enabled);

}  // namespace kl
