// kl_reward's eager fast lane for lists of per-sequence CPU tensors (kl_kernels/kl_reward/fast.py):
// one C call that checks a list call and fills the kernel's arguments, the per-sequence addresses
// included, reading each sequence's tensors together.
//
// A lazily stacked TorchRL batch hands kl_reward one tensor per sample and input. The general path
// reads each list in its own pass (ragged.SequenceList.of), then classifies the reward, normalizes
// the coefficient and fills the argument struct field by field in Python: on the 2-core CI VM,
// right after TorchRL's own call has evicted the caches, ~0.35 ms of a ~0.9 ms KLComputation call
// at B = 256, against ~0.1 ms for the kernel. Here the sequences are read in one interleaved pass
// (log-probs, reference, reward and mask of sample i, then of sample i + 1) and the struct is filled
// in C.
//
// Two facts are read later, while the kernel runs (kl_reward_list_readable): the negative bit of
// every tensor and, when autograd would record, requires_grad of the log-probs. They cost ~40 ns a
// read through torch's Python API (~0.2 ms at B = 1024, three tensors a sample) and are all but
// never set, so the kernel runs on the addresses read here and the flags are read next to it: when
// one is set, the outputs are dropped unseen and the general path runs (the kernel only read the
// inputs' memory, which is valid whatever the flags say).
//
// Like the dense lane (dense_plan.cpp) it never reports an error: anything it does not fully
// understand, every invalid input included, makes it return None and the general path runs and
// reports. tests/test_kl_reward_fast.py holds it to giving bitwise what the general path gives for
// everything it takes.
#include "cpu/list_plan.h"

#include <cstdint>
#include <cstring>

#include "common/kl_reward_args.h"
#include "cpu/dlpack_exchange.h"
#include "cpu/plan_reads.h"
#include "cpu/py_tensor.h"

namespace py = pybind11;

namespace kl {
namespace {

using namespace plan;

// A list or tuple argument as a tuple of n items in `*out` (a snapshot: reading a tensor's flags may
// run Python code, a TorchFunctionMode, that could change the caller's list); false when it is not
// exactly a list or tuple of n. Subclasses are declined: their __len__ and __iter__ may disagree
// (api.py reads them once, through ragged.plain_sequence, before any lane); the snapshot's size
// is checked all the same, as everything below indexes it up to n.
bool snapshot(py::handle list, Py_ssize_t n, py::tuple* out) {
  PyObject* l = list.ptr();
  if ((!PyList_CheckExact(l) && !PyTuple_CheckExact(l)) || PySequence_Fast_GET_SIZE(l) != n) return false;
  PyObject* t = PySequence_Tuple(l);
  if (t == nullptr) {
    PyErr_Clear();
    return false;
  }
  *out = py::reinterpret_steal<py::tuple>(t);
  return PyTuple_GET_SIZE(t) == n;
}

}  // namespace

py::object kl_reward_list_plan(py::handle tensor_type, py::handle log_probs, py::handle ref_log_probs,
                               py::handle reward, py::handle mask, py::handle coef, py::handle estimator,
                               py::handle padding_side, py::handle reward_placement, py::handle return_ref,
                               py::handle detach, py::handle mask_nan, bool grad_enabled) {
  const dlpack::ExchangeAPI* api;
  KLRewardArgs a;
  Options o;
  if (!read_options(tensor_type.ptr(), estimator.ptr(), padding_side.ptr(), reward_placement.ptr(), return_ref.ptr(),
                    detach.ptr(), mask_nan.ptr(), grad_enabled, &api, &a, &o))
    return py::none();
  if (!PyList_CheckExact(log_probs.ptr()) && !PyTuple_CheckExact(log_probs.ptr())) return py::none();
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(log_probs.ptr());
  if (n == 0) return py::none();  // an empty batch has no dtype to read: the general path packs it
  py::tuple lps, refs, rewards, masks;  // empty unless given
  if (!snapshot(log_probs, n, &lps) || !snapshot(ref_log_probs, n, &refs)) return py::none();
  const bool has_reward = !reward.is_none(), has_mask = !mask.is_none();
  // A per-token reward only: a list next to lists (a tensor reward takes the general path), placed
  // on the tokens, as problem.py's _classify_reward requires of a list.
  if (has_reward && o.placement_arg != kAutoArg && o.placement_arg != kTokenArg) return py::none();
  if ((has_reward && !snapshot(reward, n, &rewards)) || (has_mask && !snapshot(mask, n, &masks))) return py::none();

  // One buffer for the offsets [B + 1] and the four address vectors [B] (lp, ref, reward, mask).
  py::bytearray buffer(nullptr, static_cast<Py_ssize_t>((5 * n + 1) * sizeof(int64_t)));
  int64_t* off = reinterpret_cast<int64_t*>(PyByteArray_AS_STRING(buffer.ptr()));
  int64_t* lp_at = off + n + 1;
  int64_t* ref_at = lp_at + n;
  int64_t* reward_at = ref_at + n;
  int64_t* mask_at = reward_at + n;
  py::list lengths(n);
  off[0] = 0;
  int32_t reward_rank = 0;  // that of the first reward; every reward has the same
  for (Py_ssize_t i = 0; i < n; ++i) {
    View lp, ref;
    if (!read_sequence(api, tensor_type.ptr(), PyTuple_GET_ITEM(lps.ptr(), i), 1, -1, &lp))
      return py::none();
    const int64_t len = lp.size(0);
    if (!read_sequence(api, tensor_type.ptr(), PyTuple_GET_ITEM(refs.ptr(), i), 1, len, &ref))
      return py::none();
    const int32_t dtype = float_code(lp);
    if (i == 0) a.dtype = dtype;
    // One dtype for every log-prob tensor (mixed pairs go to the reference backend)
    if (dtype < 0 || dtype != a.dtype || float_code(ref) != dtype) return py::none();
    lp_at[i] = start_of(lp);
    ref_at[i] = start_of(ref);
    if (has_reward) {
      PyObject* r = PyTuple_GET_ITEM(rewards.ptr(), i);
      View rv;
      if (i == 0) {  // [L, 1] or [L] per sequence, the same for all (problem.py tries [L, 1] first)
        if (Py_TYPE(r) != reinterpret_cast<PyTypeObject*>(tensor_type.ptr()) || !read_cpu_dltensor(api, r, &rv.t))
          return py::none();
        reward_rank = rv.ndim();
        a.reward_dtype = float_code(rv);
        if ((reward_rank != 1 && reward_rank != 2) || a.reward_dtype < 0) return py::none();
      }
      if (!read_sequence(api, tensor_type.ptr(), r, reward_rank, len, &rv) ||
          float_code(rv) != a.reward_dtype)
        return py::none();
      reward_at[i] = start_of(rv);
    }
    if (has_mask) {
      View mv;
      if (!read_sequence(api, tensor_type.ptr(), PyTuple_GET_ITEM(masks.ptr(), i), 1, len, &mv) ||
          !mv.is(kDLBool, 8))
        return py::none();
      mask_at[i] = start_of(mv);
    }
    off[i + 1] = off[i] + len;
    PyObject* length = PyLong_FromLongLong(len);
    if (length == nullptr) throw py::error_already_set();
    PyList_SET_ITEM(lengths.ptr(), i, length);  // steals the reference
  }

  a.layout = kPacked;
  a.batch = n;
  a.width = 0;
  a.total = off[n];
  a.offsets = reinterpret_cast<uintptr_t>(off);
  // List inputs: one address per sequence, contiguous values (launch.py's _set_input)
  a.lp_ptrs = reinterpret_cast<uintptr_t>(lp_at);
  a.ref_ptrs = reinterpret_cast<uintptr_t>(ref_at);
  a.lp_s0 = a.ref_s0 = 0;
  a.lp_s1 = a.ref_s1 = 1;
  if (has_mask) {
    a.mask_ptrs = reinterpret_cast<uintptr_t>(mask_at);
    a.mask_s0 = 0;
    a.mask_s1 = 1;
  }
  a.placement = kNoReward;
  if (has_reward) {
    // torch's promotion of the reward with the log-probs must be the reward's own dtype, one the
    // kernel reads next to them (the log-probs' or float32): no conversion
    if (a.reward_dtype != a.dtype && a.reward_dtype != kFloat32) return py::none();
    a.placement = kToken;
    a.reward_ptrs = reinterpret_cast<uintptr_t>(reward_at);
    a.rw_s0 = 0;
    a.rw_s1 = 1;
  } else {
    a.reward_dtype = a.dtype;
  }
  if (!read_coef(api, tensor_type.ptr(), coef.ptr(), &a)) return py::none();
  // What keeps the addresses valid while the kernel runs (the buffer and every tensor read), and
  // what kl_reward_list_readable checks.
  py::tuple keep = py::make_tuple(buffer, lps, refs, rewards, masks, o.reject_grad);
  return py::make_tuple(py::cast(a), a.dtype, a.reward_dtype, reward_rank == 2, lengths, keep);
}

bool kl_reward_list_readable(py::handle keep) {
  PyObject* k = keep.ptr();
  if (!PyTuple_Check(k) || PyTuple_GET_SIZE(k) != 6) return false;
  PyObject* lists[4];
  for (int j = 0; j < 4; ++j) {
    lists[j] = PyTuple_GET_ITEM(k, j + 1);
    if (!PyTuple_Check(lists[j])) return false;
  }
  const bool reject_grad = PyTuple_GET_ITEM(k, 5) == Py_True;
  const Py_ssize_t n = PyTuple_GET_SIZE(lists[0]);
  for (Py_ssize_t i = 0; i < n; ++i) {  // sample by sample, as the plan read them
    for (int j = 0; j < 4; ++j) {
      if (i >= PyTuple_GET_SIZE(lists[j])) continue;  // no reward, or no mask: an empty tuple
      // gradients matter for the log-probs only: the reward and the mask are data
      if (!readable_in_place(PyTuple_GET_ITEM(lists[j], i), reject_grad && j < 2)) return false;
    }
  }
  return true;
}

}  // namespace kl
