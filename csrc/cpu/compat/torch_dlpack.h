// torch's DLPack C exchange table (`__dlpack_c_exchange_api__` on its tensor type, torch >= 2.13):
// a tensor's address, dtype, shape and strides in one C call instead of five attribute reads. The
// table's layout is DLPack's (dlpack_exchange.h), gated on its major version (1); a torch without
// it, another major version, or KL_KERNELS_COMPAT_FALLBACKS=dlpack gives null, and every reader then
// uses the tensors' Python attributes (sequence_facts).
#pragma once

#include <Python.h>

#include "cpu/compat/fallbacks.h"
#include "cpu/dlpack_exchange.h"

namespace kl {
namespace compat {

inline const dlpack::ExchangeAPI* dlpack_exchange_api(PyObject* tensor_type) {
  static const bool off = forced_fallback("dlpack");
  static PyObject* cached_type = nullptr;  // a strong reference: the address cannot be reused
  static const dlpack::ExchangeAPI* cached = nullptr;
  if (off) return nullptr;
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

}  // namespace compat
}  // namespace kl
