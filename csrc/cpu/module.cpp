// pybind11 module kl_kernels._C: the CPU extension.
//
// Exposes the fused kl_reward and kl_penalty_loss kernels (forward, backward) over a plain argument struct of raw
// addresses, sizes and strides; kl_kernels/kl_reward/kernels.py is the host launcher that fills
// it from torch tensors. No torch headers here: one build serves every torch version.
#include <pybind11/pybind11.h>

#include <algorithm>

#include "common/bind_args.h"
#include "common/build_info.h"
#include "cpu/kl_penalty_cpu.h"
#include "cpu/kl_reward_cpu.h"
#include "cpu/parallel.h"

namespace py = pybind11;

namespace {

py::dict probe() {
  py::dict info;
  info["extension"] = "_C";
  info["abi_version"] = KL_KERNELS_ABI_VERSION;
#if defined(__VERSION__)
  info["compiler"] = __VERSION__;
#endif
  info["cplusplus"] = static_cast<long>(__cplusplus);
  py::list kernels;
  kernels.append("kl_reward_forward");
  kernels.append("kl_reward_backward");
  kernels.append("kl_penalty_forward");
  kernels.append("kl_penalty_backward");
  info["kernels"] = kernels;
  info["parallel_runtime"] = kl::parallel_runtime();  // decided at first use, after torch is loaded
  return info;
}

// (first, last, min, max, non_decreasing) of an int64 vector of n >= 1 entries in host memory: the
// value checks of kl_kernels.ragged's check_offsets / check_lengths in one call instead of five
// torch ops (they run on every kernel call).
py::tuple int64_facts(uintptr_t ptr, int64_t n) {
  const int64_t* v = reinterpret_cast<const int64_t*>(ptr);
  int64_t lo = v[0], hi = v[0];
  bool sorted = true;
  for (int64_t i = 1; i < n; ++i) {
    lo = std::min(lo, v[i]);
    hi = std::max(hi, v[i]);
    sorted &= v[i] >= v[i - 1];
  }
  return py::make_tuple(v[0], v[n - 1], lo, hi, sorted);
}

PyObject* interned(const char* name) {
  PyObject* s = PyUnicode_InternFromString(name);
  if (s == nullptr) throw py::error_already_set();
  return s;  // kept for the life of the process
}

// The facts the CPU kl_reward kernel needs about a list of per-sequence tensors that it reads in
// place (kl_kernels.ragged.SequenceList.of), gathered in one pass. Each read goes through torch's
// Python API (~0.2 us, more for a cold tensor, from C as from Python), and for a lazily stacked
// batch of 1024 samples and three lists these reads cost about as much as the kernel: so each
// tensor is visited once, with only the reads the kernel needs (requires_grad only with
// reject_grad), and the addresses and offsets are written straight into buffers.
//
// Returns None unless `tensors` is a non-empty list or tuple of objects of exactly `tensor_type`
// (subclasses may override attribute access), all of one dtype, on the CPU, contiguous, of shape
// [L] or, with trailing_one, [L, 1], (when `like` is an offsets buffer from an earlier call) of
// the same lengths, and (with reject_grad) none requiring grad. Otherwise returns (dtype, number
// of tokens, addresses: bytearray of B int64, offsets: bytearray of B + 1 int64, the tensors as a
// tuple: what keeps the addresses valid, whatever happens to the list). A Python error raised by
// an attribute read also gives None: the caller's general path validates and reports.
py::object sequence_facts(py::handle tensors, py::handle tensor_type, bool trailing_one, py::handle like,
                          bool reject_grad) {
  static PyObject* const s_dtype = interned("dtype");
  static PyObject* const s_is_cpu = interned("is_cpu");
  static PyObject* const s_shape = interned("shape");
  static PyObject* const s_requires_grad = interned("requires_grad");
  static PyObject* const s_is_contiguous = interned("is_contiguous");
  static PyObject* const s_data_ptr = interned("data_ptr");

  PyObject* seq = tensors.ptr();
  if (!PyList_Check(seq) && !PyTuple_Check(seq)) return py::none();
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
  if (n == 0) return py::none();
  const int64_t* like_offsets = nullptr;
  if (!like.is_none()) {
    if (!PyByteArray_Check(like.ptr()) ||
        PyByteArray_GET_SIZE(like.ptr()) != static_cast<Py_ssize_t>((n + 1) * sizeof(int64_t)))
      return py::none();
    like_offsets = reinterpret_cast<const int64_t*>(PyByteArray_AS_STRING(like.ptr()));
  }
  py::bytearray addresses(nullptr, n * sizeof(int64_t));
  py::bytearray offsets(nullptr, (n + 1) * sizeof(int64_t));
  int64_t* addr = reinterpret_cast<int64_t*>(PyByteArray_AS_STRING(addresses.ptr()));
  int64_t* off = reinterpret_cast<int64_t*>(PyByteArray_AS_STRING(offsets.ptr()));
  off[0] = 0;

  // A snapshot: the attribute reads may run Python code (a TorchFunctionMode), which could resize a list.
  const py::tuple snapshot = py::reinterpret_steal<py::tuple>(PySequence_Tuple(seq));
  if (!snapshot) throw py::error_already_set();
  PyObject** items = &PyTuple_GET_ITEM(snapshot.ptr(), 0);
  PyObject* dtype = nullptr;  // borrowed: torch dtypes are immortal singletons
  const Py_ssize_t rank = trailing_one ? 2 : 1;
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* t = items[i];
    if (Py_TYPE(t) != reinterpret_cast<PyTypeObject*>(tensor_type.ptr())) return py::none();
    // Each read is a new reference, released before the next check (reclaim on every path).
    py::object dt = py::reinterpret_steal<py::object>(PyObject_GetAttr(t, s_dtype));
    py::object cpu = py::reinterpret_steal<py::object>(PyObject_GetAttr(t, s_is_cpu));
    py::object shape = py::reinterpret_steal<py::object>(PyObject_GetAttr(t, s_shape));
    py::object contiguous = py::reinterpret_steal<py::object>(PyObject_CallMethodNoArgs(t, s_is_contiguous));
    py::object ptr = py::reinterpret_steal<py::object>(PyObject_CallMethodNoArgs(t, s_data_ptr));
    if (!dt || !cpu || !shape || !contiguous || !ptr || !PyTuple_Check(shape.ptr())) {
      PyErr_Clear();
      return py::none();
    }
    if (i == 0) dtype = dt.ptr();
    if (dt.ptr() != dtype || cpu.ptr() != Py_True || contiguous.ptr() != Py_True ||
        PyTuple_GET_SIZE(shape.ptr()) != rank)
      return py::none();
    const long long len = PyLong_AsLongLong(PyTuple_GET_ITEM(shape.ptr(), 0));
    const long long width = trailing_one ? PyLong_AsLongLong(PyTuple_GET_ITEM(shape.ptr(), 1)) : 1;
    const unsigned long long where = PyLong_AsUnsignedLongLong(ptr.ptr());
    if (PyErr_Occurred()) {
      PyErr_Clear();
      return py::none();
    }
    if (width != 1) return py::none();
    off[i + 1] = off[i] + len;
    if (like_offsets != nullptr && off[i + 1] != like_offsets[i + 1]) return py::none();
    addr[i] = static_cast<int64_t>(where);
    if (reject_grad) {
      py::object grad = py::reinterpret_steal<py::object>(PyObject_GetAttr(t, s_requires_grad));
      if (!grad) PyErr_Clear();
      if (grad.ptr() != Py_False) return py::none();
    }
  }
  return py::make_tuple(py::reinterpret_borrow<py::object>(dtype), off[n], addresses, offsets, snapshot);
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "kl_kernels CPU extension (framework-free; no libtorch linkage)";
  m.def("probe", &probe, "Build facts of the CPU extension: compiler, C++ standard, kernels.");
  kl::bind_args(m);
  m.def("int64_facts", &int64_facts, py::arg("ptr"), py::arg("n"),
        "(v[0], v[-1], min, max, non-decreasing) of a contiguous int64 CPU vector of n >= 1 entries.");
  m.def("sequence_facts", &sequence_facts, py::arg("tensors"), py::arg("tensor_type"), py::arg("trailing_one"),
        py::arg("like"), py::arg("reject_grad"),
        "(dtype, tokens, addresses, offsets, tensors as a tuple) of a list of contiguous CPU [L] (or [L, 1])\n"
        "tensors of one dtype read in place by the CPU kernel, or None when the list is not such.");
  m.def("kl_reward_forward", &kl::kl_reward_forward_cpu, py::arg("args"), py::arg("num_threads"),
        py::call_guard<py::gil_scoped_release>(),
        "Fused kl_reward forward on the CPU; returns 0 or an error code (1: unsupported dtypes).");
  m.def("kl_reward_backward", &kl::kl_reward_backward_cpu, py::arg("args"), py::arg("num_threads"),
        py::call_guard<py::gil_scoped_release>(),
        "Fused kl_reward backward on the CPU; returns 0 or an error code (1: unsupported dtypes).");
  kl::bind_penalty_args(m);
  m.def("kl_penalty_forward", &kl::kl_penalty_forward_cpu, py::arg("args"), py::arg("num_threads"),
        py::call_guard<py::gil_scoped_release>(),
        "Fused kl_penalty_loss forward on the CPU; returns 0 or an error code (1: unsupported dtypes).");
  m.def("kl_penalty_backward", &kl::kl_penalty_backward_cpu, py::arg("args"), py::arg("num_threads"),
        py::call_guard<py::gil_scoped_release>(),
        "Fused kl_penalty_loss backward on the CPU; returns 0 or an error code (1: unsupported dtypes).");
}
