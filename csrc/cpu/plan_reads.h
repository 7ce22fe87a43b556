// What kl_reward's C fast lanes (dense_plan.cpp, list_plan.cpp) read from Python objects, read one
// way for both: a tensor's facts through DLPack's exchange table, the coefficient, the estimator and
// option strings, in the forms problem.py and launch.py accept for the cpu kernel. The per-sequence
// reader also serves sequence_facts (tensor_lists.cpp).
#pragma once

#include <pybind11/pybind11.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>

#include "common/kl_reward_args.h"
#include "cpu/dlpack_exchange.h"
#include "cpu/py_tensor.h"

namespace kl {
namespace plan {

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
inline int32_t float_code(const View& v) {
  if (v.is(kDLFloat, 32)) return kFloat32;
  if (v.is(kDLBfloat, 16)) return kBFloat16;
  if (v.is(kDLFloat, 16)) return kFloat16;
  return -1;
}

// Reads `obj` when it is exactly a `tensor_type` on the CPU that a kernel may read in place (no
// negative bit; with `reject_grad`, not requiring grad: py_tensor.h's readable_in_place).
inline bool read(const dlpack::ExchangeAPI* api, PyObject* tensor_type, PyObject* obj, bool reject_grad, View* v) {
  return Py_TYPE(obj) == reinterpret_cast<PyTypeObject*>(tensor_type) && read_cpu_dltensor(api, obj, &v->t) &&
         readable_in_place(obj, reject_grad);
}

// The estimator names of kl_kernels/codes.py (common/codes.h's kEstimatorNames, generated from it):
// (estimator code, straight-through).
inline bool parse_estimator(PyObject* s, EstimatorParams* est) {
  if (!PyUnicode_Check(s)) return false;
  for (const EstimatorName& e : kEstimatorNames) {
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
inline int which(PyObject* s, const char* const (&names)[N]) {
  if (!PyUnicode_Check(s)) return -1;
  for (size_t i = 0; i < N; ++i)
    if (PyUnicode_CompareWithASCIIString(s, names[i]) == 0) return static_cast<int>(i);
  return -1;
}

// The coefficient as problem.py's _normalize_coef and launch.py's coefficient() take it: a real
// Python number (not a bool), or a float32 CPU tensor, 0-d or [B] contiguous, read by the kernel in
// place (TorchRL keeps its coefficient as a 0-d tensor). Other dtypes, which launch.py converts to
// float32, take the general path.
inline bool read_coef(const dlpack::ExchangeAPI* api, PyObject* tensor_type, PyObject* c, KLRewardArgs* a) {
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
    // Non-finite values are refused by the general path (_checks.py): decline. B floats at most.
    const float* values = reinterpret_cast<const float*>(t.address());
    for (int64_t i = 0, n = t.ndim() == 0 ? 1 : t.size(0); i < n; ++i)
      if (!std::isfinite(values[i])) return false;
    a->coef = t.address();
    a->coef_scalar = 0.0f;
    return true;
  }
  // A coefficient that is not finite in float32 is refused by the general path (_checks.py): decline.
  if (!(std::fabs(v) <= static_cast<double>(std::numeric_limits<float>::max()))) return false;
  a->coef_mode = kCoefScalar;
  a->coef_scalar = static_cast<float>(v);
  return true;
}

// Sequence i of a list that a kernel reads in place, as ragged.SequenceList.of accepts it but for
// the flags (py_tensor.h's readable_in_place): exactly `tensor_type`, on the CPU, of shape [L]
// (rank 1) or [L, 1] (rank 2), contiguous (consecutive values adjacent), of length `len` unless that
// is negative. Shared by the list lane (list_plan.cpp) and sequence_facts (tensor_lists.cpp).
inline bool read_sequence(const dlpack::ExchangeAPI* api, PyObject* tensor_type, PyObject* obj, int32_t rank,
                          int64_t len, View* v) {
  return Py_TYPE(obj) == reinterpret_cast<PyTypeObject*>(tensor_type) && read_cpu_dltensor(api, obj, &v->t) &&
         v->ndim() == rank && (rank != 2 || v->size(1) == 1) && (len < 0 || v->size(0) == len) &&
         (v->size(0) <= 1 || v->stride(0) == 1);
}

// Where such a sequence starts: its data address, the byte offset included (also for an empty one,
// which View::address() gives as 0): what ragged.SequenceList.addresses holds.
inline int64_t start_of(const View& v) {
  return static_cast<int64_t>(reinterpret_cast<uintptr_t>(v.t.data) + static_cast<uintptr_t>(v.t.byte_offset));
}

// The placement argument as read by read_options (problem.py's PLACEMENTS, in order).
// reward_placement as passed: the index of its name in kPlacementNames (common/codes.h)
enum PlacementArg : int32_t { kAutoArg = 0, kTokenArg = 1, kSequenceArg = 2, kLastArg = 3, kLastValidArg = 4 };

// kl_reward's options, as read by read_options.
struct Options {
  int32_t placement_arg = kAutoArg;
  bool reject_grad = false;  // inputs requiring grad must take the general path (the registered op)
};

// The options every lane reads alike: the estimator (into a->est), padding_side (a->left_pad),
// reward_placement, and return_ref, detach and mask_nan (a->mask_nan), which must be bools; false
// where problem.py raises. With autograd recording (grad_enabled) and detach=False, inputs that
// require grad go the general way, which records the op for autograd. (NaN pads: the general path
// folds mask_nan into the mask only for autograd, a compiled call or another device, none of which
// a lane takes; the cpu kernel skips them itself.)
// Also looks up the exchange table of `tensor_type` (*api): false without one.
inline bool read_options(PyObject* tensor_type, PyObject* estimator, PyObject* padding_side, PyObject* reward_placement,
                         PyObject* return_ref, PyObject* detach, PyObject* mask_nan, bool grad_enabled,
                         const dlpack::ExchangeAPI** api, KLRewardArgs* a, Options* o) {
  static const char* const kSides[] = {"left", "right"};
  *api = exchange_api(tensor_type);
  if (*api == nullptr) return false;
  if (!parse_estimator(estimator, &a->est)) return false;
  const int side = which(padding_side, kSides);
  const int placement_arg = which(reward_placement, kPlacementNames);
  if (side < 0 || placement_arg < 0 || !PyBool_Check(return_ref) || !PyBool_Check(detach) || !PyBool_Check(mask_nan))
    return false;
  a->left_pad = side == 0;
  a->mask_nan = mask_nan == Py_True;
  o->placement_arg = placement_arg;
  o->reject_grad = grad_enabled && detach == Py_False;
  return true;
}

}  // namespace plan
}  // namespace kl
