// kl_reward's eager fast lane on the CPU (kl_kernels/kl_reward/fast.py): one C call that checks the
// commonest call, plain dense tensors, and fills the kernel's arguments.
//
// kl_reward's general path validates and builds the arguments in Python: ~50 us a call with warm
// caches and ~300 us right after a model forward (or any large copy) has evicted them, against
// ~30 us for the kernel itself on a B = 256 batch. This reads every tensor's facts through DLPack's
// C exchange table (py_tensor.h) and decides in one pass.
//
// It never reports an error. Anything it does not fully understand, every invalid input included,
// makes it return None, and the general path runs, raising and reporting as always. So it must take
// only what the general path takes, and compute from it exactly the arguments that path computes
// (problem.py's build_problem, launch.py's make_args): tests/test_kl_reward_fast.py checks, over
// generated valid and invalid calls, that whatever it takes the general path returns bitwise the same.
#include "cpu/dense_plan.h"

#include <cstdint>

#include "common/kl_reward_args.h"
#include "cpu/dlpack_exchange.h"
#include "cpu/int64_facts.h"
#include "cpu/plan_reads.h"
#include "cpu/py_tensor.h"

namespace py = pybind11;

namespace kl {
namespace {

using namespace plan;

// int64 values of a contiguous CPU vector.
const int64_t* int64_values(const View& v) { return static_cast<const int64_t*>(v.t.data) + v.t.byte_offset / 8; }

// problem.py's _classify_reward for a dense reward tensor next to log-probs of shape `tok` (the
// `kind` packed or padded, B sequences): the placement and the trailing-dim flag, or false where
// that function raises.
bool classify_reward(const View& r, const View& tok, bool padded, int64_t batch, int placement_arg,
                     int32_t* placement, bool* trailing) {
  const int nd = r.ndim(), td = tok.ndim();
  bool token_plain = r.same_shape(tok);
  bool token_trailing = nd == td + 1 && r.size(nd - 1) == 1;
  for (int d = 0; token_trailing && d < td; ++d) token_trailing = r.size(d) == tok.size(d);
  const bool token_match = token_plain || token_trailing;
  // per-sequence forms: [B] (trailing no, broadcastable no), [B, 1] (no, yes), [B, 1, 1] (yes, yes)
  const bool seq_b = nd == 1 && r.size(0) == batch;
  const bool seq_b1 = nd == 2 && r.size(0) == batch && r.size(1) == 1;
  const bool seq_b11 = nd == 3 && r.size(0) == batch && r.size(1) == 1 && r.size(2) == 1;
  const bool seq_match = seq_b || seq_b1 || seq_b11;
  if (placement_arg == kTokenArg || (placement_arg == kAutoArg && token_match && !seq_match)) {
    if (!token_match) return false;
    *placement = kToken;
    *trailing = !token_plain;
    return true;
  }
  if (placement_arg == kSequenceArg || placement_arg == kLastArg || placement_arg == kLastValidArg) {
    if (!seq_match) return false;
    *placement = placement_arg == kSequenceArg ? kSequence : placement_arg == kLastArg ? kLast : kLastValid;
    *trailing = seq_b11;
    return true;
  }
  // auto: ambiguous, or per-sequence where only padded broadcasting decides: the rest raises
  if (token_match || !seq_match || !padded || seq_b) return false;
  *placement = kSequence;
  *trailing = seq_b11;
  return true;
}

}  // namespace

py::object kl_reward_dense_plan(py::handle tensor_type, py::handle log_probs, py::handle ref_log_probs,
                                py::handle reward, py::handle mask, py::handle offsets, py::handle lengths,
                                py::handle coef, py::handle estimator, py::handle padding_side,
                                py::handle reward_placement, py::handle return_ref, py::handle detach,
                                py::handle mask_nan, bool grad_enabled) {
  const dlpack::ExchangeAPI* api;
  KLRewardArgs a;
  Options o;
  if (!read_options(tensor_type.ptr(), estimator.ptr(), padding_side.ptr(), reward_placement.ptr(), return_ref.ptr(),
                    detach.ptr(), mask_nan.ptr(), grad_enabled, &api, &a, &o))
    return py::none();
  const bool reject_grad = o.reject_grad;

  View lp, ref;
  if (!read(api, tensor_type.ptr(), log_probs.ptr(), reject_grad, &lp) ||
      !read(api, tensor_type.ptr(), ref_log_probs.ptr(), reject_grad, &ref))
    return py::none();
  a.dtype = float_code(lp);
  if (a.dtype < 0 || float_code(ref) != a.dtype || !lp.same_shape(ref)) return py::none();

  const bool padded = lp.ndim() == 2;
  if (lp.ndim() == 1) {  // packed: offsets [B + 1], int64, contiguous, 0 = off[0] <= ... <= off[B] = N
    View off;
    if (offsets.is_none() || !lengths.is_none() || !read(api, tensor_type.ptr(), offsets.ptr(), false, &off) ||
        !off.is(kDLInt, 64) || !off.contiguous_vector() || off.size(0) < 1)
      return py::none();
    const Int64Facts f = int64_facts(int64_values(off), off.size(0));
    if (f.first != 0 || f.last != lp.size(0) || !f.non_decreasing) return py::none();
    a.layout = kPacked;
    a.batch = off.size(0) - 1;
    a.width = 0;
    a.offsets = off.address();
    a.lp_s0 = a.ref_s0 = 0;
    a.lp_s1 = lp.stride(0);
    a.ref_s1 = ref.stride(0);
  } else if (padded) {  // padded: lengths none, or [B] int64, contiguous, 0 <= lengths <= T
    if (!offsets.is_none()) return py::none();
    a.layout = kPadded;
    a.batch = lp.size(0);
    a.width = lp.size(1);
    if (!lengths.is_none()) {
      View len;
      if (!read(api, tensor_type.ptr(), lengths.ptr(), false, &len) || !len.is(kDLInt, 64) ||
          !len.contiguous_vector() || len.size(0) != a.batch)
        return py::none();
      if (a.batch > 0) {
        const Int64Facts f = int64_facts(int64_values(len), a.batch);
        if (f.lo < 0 || f.hi > a.width) return py::none();
      }
      a.lengths = len.address();
    }
    a.lp_s0 = lp.stride(0), a.lp_s1 = lp.stride(1);
    a.ref_s0 = ref.stride(0), a.ref_s1 = ref.stride(1);
  } else {
    return py::none();
  }
  if (!read_coef(api, tensor_type.ptr(), coef.ptr(), &a)) return py::none();
  a.total = lp.numel();
  a.lp = lp.address();
  a.ref = ref.address();

  if (!mask.is_none()) {
    View m;
    if (!read(api, tensor_type.ptr(), mask.ptr(), false, &m) || !m.is(kDLBool, 8) || !m.same_shape(lp))
      return py::none();
    a.mask = m.address();
    a.mask_s0 = padded ? m.stride(0) : 0;
    a.mask_s1 = padded ? m.stride(1) : m.stride(0);
  }

  bool trailing = false;
  a.placement = kNoReward;
  a.reward_dtype = a.dtype;
  if (!reward.is_none()) {
    View r;
    if (!read(api, tensor_type.ptr(), reward.ptr(), false, &r)) return py::none();
    // torch's promotion of the reward with the log-probs must be the reward's own dtype, one the
    // kernel reads next to them (the log-probs' or float32): no conversion
    a.reward_dtype = float_code(r);
    if (a.reward_dtype != a.dtype && a.reward_dtype != kFloat32) return py::none();
    int32_t placement;
    if (!classify_reward(r, lp, padded, a.batch, o.placement_arg, &placement, &trailing)) return py::none();
    a.placement = placement;
    a.reward = r.address();
    if (placement == kToken) {  // read in the layout, a trailing 1 squeezed away
      a.rw_s0 = padded ? r.stride(0) : 0;
      a.rw_s1 = padded ? r.stride(1) : r.stride(0);
    } else {  // [B], [B, 1] or [B, 1, 1] read as [B]
      a.rw_s0 = r.stride(0);
      a.rw_s1 = 0;
    }
  }
  return py::make_tuple(py::cast(a), a.reward_dtype, trailing);
}

}  // namespace kl
