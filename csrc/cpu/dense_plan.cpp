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
#include "cpu/py_tensor.h"

namespace py = pybind11;

namespace kl {
namespace {

// DLPack type codes (DLDataTypeCode) of the dtypes read here.
constexpr uint8_t kDLInt = 0, kDLFloat = 2, kDLBfloat = 4, kDLBool = 6;

// One tensor's facts, from the exchange table.
struct View {
  dlpack::Tensor t{};
  int32_t ndim() const { return t.ndim; }
  int64_t size(int d) const { return t.shape[d]; }
  int64_t numel() const {
    int64_t n = 1;
    for (int d = 0; d < t.ndim; ++d) n *= t.shape[d];
    return n;
  }
  int64_t stride(int d) const {  // null strides: compact row-major
    if (t.strides != nullptr) return t.strides[d];
    int64_t s = 1;
    for (int e = t.ndim - 1; e > d; --e) s *= t.shape[e];
    return s;
  }
  // launch.py's _ptr: 0 for an empty tensor
  uintptr_t address() const {
    return numel() == 0 ? 0 : reinterpret_cast<uintptr_t>(t.data) + static_cast<uintptr_t>(t.byte_offset);
  }
  bool is(uint8_t code, uint8_t bits) const {
    return t.dtype.code == code && t.dtype.bits == bits && t.dtype.lanes == 1;
  }
  bool contiguous_vector() const { return t.ndim == 1 && (t.shape[0] <= 1 || stride(0) == 1); }
  bool same_shape(const View& o) const {
    if (t.ndim != o.t.ndim) return false;
    for (int d = 0; d < t.ndim; ++d)
      if (t.shape[d] != o.t.shape[d]) return false;
    return true;
  }
};

// The kernels' dtype code of a log-prob / reward tensor, or -1.
int32_t float_code(const View& v) {
  if (v.is(kDLFloat, 32)) return kFloat32;
  if (v.is(kDLBfloat, 16)) return kBFloat16;
  if (v.is(kDLFloat, 16)) return kFloat16;
  return -1;
}

// Reads `obj` when it is exactly a `tensor_type` on the CPU that a kernel may read in place (no
// negative bit; with `reject_grad`, not requiring grad: py_tensor.h's readable_in_place).
bool read(const dlpack::ExchangeAPI* api, PyObject* tensor_type, PyObject* obj, bool reject_grad, View* v) {
  return Py_TYPE(obj) == reinterpret_cast<PyTypeObject*>(tensor_type) && read_cpu_dltensor(api, obj, &v->t) &&
         readable_in_place(obj, reject_grad);
}

// problem.py's ESTIMATORS: (estimator code, straight-through).
bool parse_estimator(PyObject* s, EstimatorParams* est) {
  struct Entry {
    const char* name;
    int32_t code, straight_through;
  };
  static const Entry table[] = {{"k1", kK1, 0}, {"abs", kAbs, 0}, {"k2", kK2, 0}, {"k3", kK3, 0},
                                {"k1+", kK1, 1}, {"abs+", kAbs, 1}, {"k3+", kK3, 1}};
  if (!PyUnicode_Check(s)) return false;
  for (const Entry& e : table) {
    if (PyUnicode_CompareWithASCIIString(s, e.name) == 0) {
      est->estimator = e.code;
      est->straight_through = e.straight_through;
      return true;
    }
  }
  return false;
}

// Which of `names` the str `s` is, or -1.
template <size_t N>
int which(PyObject* s, const char* const (&names)[N]) {
  if (!PyUnicode_Check(s)) return -1;
  for (size_t i = 0; i < N; ++i)
    if (PyUnicode_CompareWithASCIIString(s, names[i]) == 0) return static_cast<int>(i);
  return -1;
}

// The coefficient as problem.py's _normalize_coef and launch.py's coefficient() take it: a real
// Python number (not a bool), or a float32 CPU tensor, 0-d or [B] contiguous, read by the kernel in
// place (TorchRL keeps its coefficient as a 0-d tensor). Other dtypes, which launch.py converts to
// float32, take the general path.
bool read_coef(const dlpack::ExchangeAPI* api, PyObject* tensor_type, PyObject* c, KLRewardArgs* a) {
  double v;
  if (PyFloat_Check(c)) {
    v = PyFloat_AS_DOUBLE(c);
  } else if (PyLong_Check(c) && !PyBool_Check(c)) {
    v = PyLong_AsDouble(c);
    if (v == -1.0 && PyErr_Occurred()) {
      PyErr_Clear();
      return false;
    }
  } else {
    View t;
    if (!read(api, tensor_type, c, false, &t) || !t.is(kDLFloat, 32)) return false;
    if (t.ndim() == 0) {
      a->coef_mode = kCoefTensor0d;
    } else if (t.contiguous_vector() && t.size(0) == a->batch) {
      a->coef_mode = kCoefPerSeq;
    } else {
      return false;
    }
    a->coef = t.address();
    a->coef_scalar = 0.0f;
    return true;
  }
  a->coef_mode = kCoefScalar;
  a->coef_scalar = static_cast<float>(v);
  return true;
}

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
  enum { kAuto = 0, kTokenArg = 1, kSequenceArg = 2, kLastArg = 3 };
  if (placement_arg == kTokenArg || (placement_arg == kAuto && token_match && !seq_match)) {
    if (!token_match) return false;
    *placement = kToken;
    *trailing = !token_plain;
    return true;
  }
  if (placement_arg == kSequenceArg || placement_arg == kLastArg) {
    if (!seq_match) return false;
    *placement = placement_arg == kSequenceArg ? kSequence : kLast;
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
                                bool grad_enabled) {
  static const char* const kSides[] = {"left", "right"};
  static const char* const kPlacements[] = {"auto", "token", "sequence", "last"};
  const dlpack::ExchangeAPI* api = exchange_api(tensor_type.ptr());
  if (api == nullptr) return py::none();
  KLRewardArgs a;
  if (!parse_estimator(estimator.ptr(), &a.est)) return py::none();
  const int side = which(padding_side.ptr(), kSides);
  const int placement_arg = which(reward_placement.ptr(), kPlacements);
  if (side < 0 || placement_arg < 0 || !PyBool_Check(return_ref.ptr()) || !PyBool_Check(detach.ptr()))
    return py::none();
  // With autograd recording, inputs that require grad take the general path (the registered op).
  const bool reject_grad = grad_enabled && detach.ptr() == Py_False;

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
  a.left_pad = side == 0;
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
    if (!classify_reward(r, lp, padded, a.batch, placement_arg, &placement, &trailing)) return py::none();
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
