// CPython's private _PyType_Lookup: a type's attribute without the instance machinery, used by
// py_tensor.cpp's FlagReader to call a tensor flag's C function directly (~1/3 of a flag read).
// Version-gated to the CPythons it was checked on (3.10-3.14); elsewhere, or with
// KL_KERNELS_COMPAT_FALLBACKS=cpython, it answers null and the reader uses the generic attribute
// read (same values, slower).
#pragma once

#include <Python.h>

#include "cpu/compat/fallbacks.h"

namespace kl {
namespace compat {

inline PyObject* type_lookup(PyTypeObject* tp, PyObject* name) {  // borrowed, or null
#if PY_VERSION_HEX >= 0x030A0000 && PY_VERSION_HEX < 0x030F0000
  static const bool off = forced_fallback("cpython");
  if (!off) return _PyType_Lookup(tp, name);
#endif
  (void)tp;
  (void)name;
  return nullptr;
}

inline bool type_lookup_active() {
#if PY_VERSION_HEX >= 0x030A0000 && PY_VERSION_HEX < 0x030F0000
  return !forced_fallback("cpython");
#else
  return false;
#endif
}

}  // namespace compat
}  // namespace kl
