// sequence_facts: what the CPU kl_reward kernel needs to know about a list of per-sequence
// tensors that it reads in place (kl_kernels.ragged.SequenceList.of), gathered in one pass.
//
// This runs on every call, for every sample of a lazily stacked TorchRL batch (B = 1024, three
// lists). Through torch's Python API each tensor costs five attribute reads (dtype, is_cpu, shape,
// is_contiguous(), data_ptr()): ~0.6 us a tensor on the 2-core CI VM, as much in total as the
// kernel. DLPack's C exchange API (dlpack_exchange.h), which torch puts on its tensor type, fills
// the same facts from the object in one C call with no allocation (~0.06 us): it is used whenever
// the type offers it, and the attribute reads remain for a torch without it.
//
// Two facts are not in a DLTensor and are still read as attributes: the negative bit (is_neg(): a
// real tensor can carry a pending negation, e.g. z.conj().imag, that its memory does not show; such
// a list is packed by torch.cat, which applies it) and, with reject_grad, requires_grad.
#include "cpu/tensor_lists.h"

#include <cstdint>

#include "cpu/dlpack_exchange.h"
#include "cpu/sequence_reads.h"
#include "cpu/py_tensor.h"

namespace py = pybind11;

namespace kl {
namespace {

// One tensor as the kernel reads it: `len` values from `address`.
struct Sequence {
  int64_t len = 0;
  uintptr_t address = 0;
};

// Through the exchange table (sequence_reads.h's read_sequence): false when the kernel cannot read `t`
// in place (not on the CPU, not [L] / [L, 1], not contiguous, another dtype than `*dtype`, set from
// the first tensor), or when the table cannot describe it (its error is cleared: the caller's
// general path reports).
bool read_exchange(const dlpack::ExchangeAPI* api, PyObject* tensor_type, PyObject* t, int32_t rank, bool first,
                   dlpack::DataType* dtype, Sequence* s) {
  seq::View v;
  if (!seq::read_sequence(api, tensor_type, t, rank, &v)) return false;
  if (first) *dtype = v.t.dtype;
  if (!(v.t.dtype == *dtype)) return false;
  s->len = v.size(0);
  s->address = static_cast<uintptr_t>(seq::start_of(v));
  return true;
}

// Through torch's Python API, with the same answers as read_exchange; `*dtype` is the first
// tensor's dtype object (borrowed: torch dtypes are immortal singletons).
bool read_attributes(PyObject* t, int32_t rank, bool first, PyObject** dtype, Sequence* s) {
  static PyObject* const s_dtype = interned("dtype");
  static PyObject* const s_is_cpu = interned("is_cpu");
  static PyObject* const s_shape = interned("shape");
  static PyObject* const s_is_contiguous = interned("is_contiguous");
  static PyObject* const s_data_ptr = interned("data_ptr");
  // Each read is a new reference, released on every path.
  py::object dt = py::reinterpret_steal<py::object>(PyObject_GetAttr(t, s_dtype));
  py::object cpu = py::reinterpret_steal<py::object>(PyObject_GetAttr(t, s_is_cpu));
  py::object shape = py::reinterpret_steal<py::object>(PyObject_GetAttr(t, s_shape));
  py::object contiguous = py::reinterpret_steal<py::object>(PyObject_CallMethodNoArgs(t, s_is_contiguous));
  py::object ptr = py::reinterpret_steal<py::object>(PyObject_CallMethodNoArgs(t, s_data_ptr));
  if (!dt || !cpu || !shape || !contiguous || !ptr || !PyTuple_Check(shape.ptr())) {
    PyErr_Clear();
    return false;
  }
  if (first) *dtype = dt.ptr();
  if (dt.ptr() != *dtype || cpu.ptr() != Py_True || contiguous.ptr() != Py_True || PyTuple_GET_SIZE(shape.ptr()) != rank)
    return false;
  const long long len = PyLong_AsLongLong(PyTuple_GET_ITEM(shape.ptr(), 0));
  const long long width = rank == 2 ? PyLong_AsLongLong(PyTuple_GET_ITEM(shape.ptr(), 1)) : 1;
  const unsigned long long address = PyLong_AsUnsignedLongLong(ptr.ptr());
  if (PyErr_Occurred()) {
    PyErr_Clear();
    return false;
  }
  s->len = len;
  s->address = static_cast<uintptr_t>(address);
  return width == 1;
}

}  // namespace

// Returns None unless `tensors` is a non-empty list or tuple of objects of exactly `tensor_type`
// (subclasses may override attribute access), all of one dtype, on the CPU, contiguous, of shape
// [L] or, with trailing_one, [L, 1], (when `like` is an offsets buffer from an earlier call) of
// the same lengths, without the negative bit, and (with reject_grad) none requiring grad.
// Otherwise returns (dtype, number of tokens, addresses: bytearray of B int64, offsets: bytearray
// of B + 1 int64, the tensors as a tuple: what keeps the addresses valid, whatever happens to the
// list). A Python error raised by a read also gives None: the caller's general path validates
// and reports. `exchange`: use DLPack's exchange table when the type has one (tests turn it off
// to check the attribute path).
py::object sequence_facts(py::handle tensors, py::handle tensor_type, bool trailing_one, py::handle like,
                          bool reject_grad, bool exchange) {
  static PyObject* const s_dtype = interned("dtype");

  PyObject* seq = tensors.ptr();
  // Exactly a list or tuple: a subclass's __len__ and __iter__ may disagree (see the snapshot below).
  if (!PyList_CheckExact(seq) && !PyTuple_CheckExact(seq)) return py::none();
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
  if (n == 0) return py::none();
  const int64_t* like_offsets = nullptr;
  if (!like.is_none()) {
    if (!PyByteArray_Check(like.ptr()) ||
        PyByteArray_GET_SIZE(like.ptr()) != static_cast<Py_ssize_t>((n + 1) * sizeof(int64_t)))
      return py::none();
    like_offsets = reinterpret_cast<const int64_t*>(PyByteArray_AS_STRING(like.ptr()));
  }
  const dlpack::ExchangeAPI* api = exchange ? exchange_api(tensor_type.ptr()) : nullptr;
  py::bytearray addresses(nullptr, n * sizeof(int64_t));
  py::bytearray offsets(nullptr, (n + 1) * sizeof(int64_t));
  int64_t* addr = reinterpret_cast<int64_t*>(PyByteArray_AS_STRING(addresses.ptr()));
  int64_t* off = reinterpret_cast<int64_t*>(PyByteArray_AS_STRING(offsets.ptr()));
  off[0] = 0;

  // A snapshot: an attribute read may run Python code (a TorchFunctionMode), which could resize a list.
  const py::tuple snapshot = py::reinterpret_steal<py::tuple>(PySequence_Tuple(seq));
  if (!snapshot) throw py::error_already_set();
  if (PyTuple_GET_SIZE(snapshot.ptr()) != n) return py::none();  // everything below reads n items
  PyObject** items = &PyTuple_GET_ITEM(snapshot.ptr(), 0);
  const int32_t rank = trailing_one ? 2 : 1;
  PyObject* dtype_object = nullptr;
  dlpack::DataType dtype{};
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* t = items[i];
    if (Py_TYPE(t) != reinterpret_cast<PyTypeObject*>(tensor_type.ptr())) return py::none();
    Sequence s;
    const bool readable = api != nullptr ? read_exchange(api, tensor_type.ptr(), t, rank, i == 0, &dtype, &s)
                                         : read_attributes(t, rank, i == 0, &dtype_object, &s);
    if (!readable || !readable_in_place(t, reject_grad)) return py::none();
    off[i + 1] = off[i] + s.len;
    if (like_offsets != nullptr && off[i + 1] != like_offsets[i + 1]) return py::none();
    addr[i] = static_cast<int64_t>(s.address);
  }
  py::object dtype_out;
  if (api != nullptr) {  // one attribute read for the whole list: the dtype object the caller compares
    dtype_out = py::reinterpret_steal<py::object>(PyObject_GetAttr(items[0], s_dtype));
    if (!dtype_out) {
      PyErr_Clear();
      return py::none();
    }
  } else {
    dtype_out = py::reinterpret_borrow<py::object>(dtype_object);
  }
  return py::make_tuple(dtype_out, off[n], addresses, offsets, snapshot);
}

py::object exchange_api_version(py::handle tensor_type) {
  const dlpack::ExchangeAPI* api = exchange_api(tensor_type.ptr());
  if (api == nullptr) return py::none();
  return py::make_tuple(api->header.version.major, api->header.version.minor);
}

}  // namespace kl
