// See py_tensor.h.
#include "cpu/py_tensor.h"

namespace py = pybind11;

namespace kl {

PyObject* interned(const char* name) {
  PyObject* s = PyUnicode_InternFromString(name);
  if (s == nullptr) throw py::error_already_set();
  return s;  // kept for the life of the process
}

const dlpack::ExchangeAPI* exchange_api(PyObject* tensor_type) {
  static PyObject* cached_type = nullptr;  // a strong reference: the address cannot be reused
  static const dlpack::ExchangeAPI* cached = nullptr;
  if (tensor_type == cached_type) return cached;
  const dlpack::ExchangeAPI* found = nullptr;
  PyObject* capsule = PyObject_GetAttrString(tensor_type, "__dlpack_c_exchange_api__");
  if (capsule == nullptr) {
    PyErr_Clear();
  } else {
    if (PyCapsule_IsValid(capsule, "dlpack_exchange_api")) {
      auto* header = static_cast<dlpack::ExchangeAPIHeader*>(PyCapsule_GetPointer(capsule, "dlpack_exchange_api"));
      // A newer major version chains the older tables it still offers.
      while (header != nullptr && header->version.major > dlpack::kMajorVersion) header = header->prev_api;
      if (header != nullptr && header->version.major == dlpack::kMajorVersion) {
        auto* api = reinterpret_cast<const dlpack::ExchangeAPI*>(header);
        if (api->dltensor_from_py_object_no_sync != nullptr) found = api;
      }
    }
    Py_DECREF(capsule);
  }
  Py_INCREF(tensor_type);
  Py_XDECREF(cached_type);
  cached_type = tensor_type;
  cached = found;
  return found;
}

bool read_cpu_dltensor(const dlpack::ExchangeAPI* api, PyObject* t, dlpack::Tensor* out) {
  if (api->dltensor_from_py_object_no_sync(t, out) != 0) {
    PyErr_Clear();
    return false;
  }
  return out->device.device_type == dlpack::kDeviceCPU;
}

bool is_false(PyObject* t, PyObject* attribute, bool call) {
  PyObject* v = call ? PyObject_CallMethodNoArgs(t, attribute) : PyObject_GetAttr(t, attribute);
  if (v == nullptr) {
    PyErr_Clear();
    return false;
  }
  const bool no = v == Py_False;
  Py_DECREF(v);
  return no;
}

bool readable_in_place(PyObject* t, bool reject_grad) {
  static PyObject* const s_is_neg = interned("is_neg");
  static PyObject* const s_requires_grad = interned("requires_grad");
  return is_false(t, s_is_neg, true) && (!reject_grad || is_false(t, s_requires_grad, false));
}

}  // namespace kl
