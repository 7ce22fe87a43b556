// pybind11 bindings of KLRewardArgs / EstimatorParams (and KLPenaltyArgs), shared by the _C and _cuda modules so both
// expose the same argument object to Python (kl_kernels/kl_reward/launch.py fills it). module_local:
// each module owns its binding of the one C++ type (pybind11 shares a type registry across modules).
#pragma once

#include <pybind11/pybind11.h>

#include "common/kl_penalty_args.h"
#include "common/kl_reward_args.h"
#include "common/row_args.h"

namespace kl {

inline void bind_args(pybind11::module_& m) {
  namespace py = pybind11;
  py::class_<EstimatorParams>(m, "EstimatorParams", py::module_local())
      .def(py::init<>())
      .def_readwrite("estimator", &EstimatorParams::estimator)
      .def_readwrite("straight_through", &EstimatorParams::straight_through)
      .def_readwrite("in_lo_set", &EstimatorParams::in_lo_set)
      .def_readwrite("in_hi_set", &EstimatorParams::in_hi_set)
      .def_readwrite("out_lo_set", &EstimatorParams::out_lo_set)
      .def_readwrite("out_hi_set", &EstimatorParams::out_hi_set)
      .def_readwrite("in_lo", &EstimatorParams::in_lo)
      .def_readwrite("in_hi", &EstimatorParams::in_hi)
      .def_readwrite("out_lo", &EstimatorParams::out_lo)
      .def_readwrite("out_hi", &EstimatorParams::out_hi);
  py::class_<KLRewardArgs> c(m, "KLRewardArgs", py::module_local());
  c.def(py::init<>());
  // A copy of a filled struct, in one call: kl_kernels/plans.py fills one per call signature and copies it.
  c.def("__copy__", [](const KLRewardArgs& self) { return self; });
#define KL_FIELD(name) c.def_readwrite(#name, &KLRewardArgs::name)
  KL_FIELD(layout); KL_FIELD(batch); KL_FIELD(width); KL_FIELD(total); KL_FIELD(offsets); KL_FIELD(lengths);
  KL_FIELD(left_pad); KL_FIELD(prompt_lens); KL_FIELD(dtype); KL_FIELD(reward_dtype); KL_FIELD(lp);
  KL_FIELD(ref); KL_FIELD(mask); KL_FIELD(reward); KL_FIELD(lp_s0); KL_FIELD(lp_s1); KL_FIELD(ref_s0);
  KL_FIELD(ref_s1); KL_FIELD(mask_s0); KL_FIELD(mask_s1); KL_FIELD(rw_s0); KL_FIELD(rw_s1); KL_FIELD(placement);
  KL_FIELD(coef_mode); KL_FIELD(coef_scalar); KL_FIELD(coef); KL_FIELD(est); KL_FIELD(kl); KL_FIELD(reward_out);
  KL_FIELD(ref_out); KL_FIELD(kl_sum); KL_FIELD(count); KL_FIELD(g_kl); KL_FIELD(g_reward); KL_FIELD(g_ref_out);
  KL_FIELD(g_kl_sum); KL_FIELD(g_lp); KL_FIELD(g_ref); KL_FIELD(lp_ptrs); KL_FIELD(ref_ptrs); KL_FIELD(mask_ptrs);
  KL_FIELD(reward_ptrs); KL_FIELD(mask_nan); KL_FIELD(errors); KL_FIELD(check_offsets); KL_FIELD(check_lengths);
  KL_FIELD(check_prompt);
#undef KL_FIELD
}

// KLPenaltyArgs (kl_penalty_loss): `g` is a KLRewardArgs holding the geometry, mask and log-probs.
inline void bind_penalty_args(pybind11::module_& m) {
  namespace py = pybind11;
  py::class_<KLPenaltyArgs> c(m, "KLPenaltyArgs", py::module_local());
  c.def(py::init<>());
  c.def("__copy__", [](const KLPenaltyArgs& self) { return self; });  // (as KLRewardArgs')
#define KL_FIELD(name) c.def_readwrite(#name, &KLPenaltyArgs::name)
  KL_FIELD(g); KL_FIELD(old); KL_FIELD(ref); KL_FIELD(adv); KL_FIELD(ent); KL_FIELD(old_s0); KL_FIELD(old_s1);
  KL_FIELD(ref_s0); KL_FIELD(ref_s1); KL_FIELD(adv_s0); KL_FIELD(adv_s1); KL_FIELD(ent_s0); KL_FIELD(ent_s1);
  KL_FIELD(aux_dtype); KL_FIELD(adv_per_seq); KL_FIELD(beta_mode); KL_FIELD(beta_scalar); KL_FIELD(beta);
  KL_FIELD(clip_lo); KL_FIELD(clip_hi); KL_FIELD(clip_c); KL_FIELD(wt); KL_FIELD(wt_s0); KL_FIELD(wt_s1);
  KL_FIELD(weight_kl); KL_FIELD(entropy_coef); KL_FIELD(seq_loss); KL_FIELD(stats);
  KL_FIELD(count); KL_FIELD(token_out); KL_FIELD(grad); KL_FIELD(totals); KL_FIELD(g_seq); KL_FIELD(g_uniform); KL_FIELD(g_tok); KL_FIELD(g_lp);
  KL_FIELD(g_ent); KL_FIELD(result); KL_FIELD(result_loss); KL_FIELD(result_count); KL_FIELD(result_weight);
  KL_FIELD(agg_scale); KL_FIELD(agg_per_token); KL_FIELD(agg_seq_mean); KL_FIELD(agg_tokens); KL_FIELD(agg_beta);
  KL_FIELD(agg_entropy_coef); KL_FIELD(g_loss); KL_FIELD(seq_lr);
  KL_FIELD(kl_ratio);
#undef KL_FIELD
  // the layouts of the stats, totals and results (kl_kernels/kl_penalty/launch.py mirrors them; a test compares)
  m.attr("KL_PENALTY_STAT_COLUMNS") = kStatColumns;
  m.attr("KL_PENALTY_TOTALS") = kTotals;
  m.attr("KL_PENALTY_RESULTS") = kResults;
}

// TokenLogprobsArgs and FullKLArgs (common/row_args.h), for the row kernels of _C and _cuda.
inline void bind_row_args(pybind11::module_& m) {
  namespace py = pybind11;
  {
    py::class_<TokenLogprobsArgs> c(m, "TokenLogprobsArgs", py::module_local());
    c.def(py::init<>());
#define KL_FIELD(name) c.def_readwrite(#name, &TokenLogprobsArgs::name)
    KL_FIELD(logits); KL_FIELD(dtype); KL_FIELD(rows); KL_FIELD(vocab); KL_FIELD(inner); KL_FIELD(stride_outer);
    KL_FIELD(stride_inner); KL_FIELD(labels); KL_FIELD(counted); KL_FIELD(inv_temperature); KL_FIELD(softcap); KL_FIELD(log_probs);
    KL_FIELD(lse); KL_FIELD(entropy); KL_FIELD(grad_lp); KL_FIELD(grad_entropy); KL_FIELD(grad_logits);
    KL_FIELD(g_stride_outer); KL_FIELD(g_stride_inner);
#undef KL_FIELD
  }
  {
    py::class_<FullKLArgs> c(m, "FullKLArgs", py::module_local());
    c.def(py::init<>());
#define KL_FIELD(name) c.def_readwrite(#name, &FullKLArgs::name)
    KL_FIELD(logits); KL_FIELD(ref_logits); KL_FIELD(dtype); KL_FIELD(rows); KL_FIELD(vocab); KL_FIELD(inner);
    KL_FIELD(stride_outer); KL_FIELD(stride_inner); KL_FIELD(ref_stride_outer); KL_FIELD(ref_stride_inner);
    KL_FIELD(counted); KL_FIELD(inv_temperature); KL_FIELD(softcap); KL_FIELD(kl); KL_FIELD(lse); KL_FIELD(ref_lse); KL_FIELD(grad_kl);
    KL_FIELD(grad_logits); KL_FIELD(g_stride_outer); KL_FIELD(g_stride_inner); KL_FIELD(grad_ref);
    KL_FIELD(gr_stride_outer); KL_FIELD(gr_stride_inner);
#undef KL_FIELD
  }
}

}  // namespace kl
