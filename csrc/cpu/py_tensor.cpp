// See py_tensor.h.
#include "cpu/py_tensor.h"

#include "cpu/compat/cpython.h"
#include "cpu/compat/torch_dlpack.h"

namespace py = pybind11;

namespace kl {

PyObject* interned(const char* name) {
  PyObject* s = PyUnicode_InternFromString(name);
  if (s == nullptr) throw py::error_already_set();
  return s;  // kept for the life of the process
}

const dlpack::ExchangeAPI* exchange_api(PyObject* tensor_type) {
  return compat::dlpack_exchange_api(tensor_type);  // torch's table: compat/torch_dlpack.h
}

bool read_cpu_dltensor(const dlpack::ExchangeAPI* api, PyObject* t, dlpack::Tensor* out) {
  if (api->dltensor_from_py_object_no_sync(t, out) != 0) {
    PyErr_Clear();
    return false;
  }
  return out->device.device_type == dlpack::kDeviceCPU;
}

namespace {

// One flag of torch tensors, read through the C function behind the no-argument method (`call`) or
// the property `name` of their type, looked up once per type (and again whenever the type's
// attributes change: its version tag). That skips the generic attribute machinery, about a third of
// a flag read; the function itself still honours torch function modes. Anything else (another
// kind of attribute) is read the generic way.
class FlagReader {
 public:
  FlagReader(const char* name, bool call) : name_(interned(name)), call_(call) {}

  // The flag's value (a new reference), or null with a Python error set.
  PyObject* read(PyObject* t) {
    PyTypeObject* tp = Py_TYPE(t);
    if (tp != type_ || tp->tp_version_tag != version_ || version_ == 0) look_up(tp);
    if (method_ != nullptr) return method_(t, nullptr);
    if (get_ != nullptr) return get_(t, closure_);
    return call_ ? PyObject_CallMethodNoArgs(t, name_) : PyObject_GetAttr(t, name_);
  }

 private:
  void look_up(PyTypeObject* tp) {
    method_ = nullptr;
    get_ = nullptr;
    PyObject* d = compat::type_lookup(tp, name_);  // borrowed (or null: the generic read below)
    if (d != nullptr && call_ && Py_IS_TYPE(d, &PyMethodDescr_Type)) {
      PyMethodDef* m = reinterpret_cast<PyMethodDescrObject*>(d)->d_method;
      if ((m->ml_flags & ~METH_COEXIST) == METH_NOARGS) method_ = m->ml_meth;
    } else if (d != nullptr && !call_ && Py_IS_TYPE(d, &PyGetSetDescr_Type)) {
      PyGetSetDef* g = reinterpret_cast<PyGetSetDescrObject*>(d)->d_getset;
      get_ = g->get;
      closure_ = g->closure;
    }
    type_ = tp;
    version_ = tp->tp_version_tag;
  }

  PyObject* const name_;
  const bool call_;
  PyTypeObject* type_ = nullptr;
  unsigned int version_ = 0;
  PyCFunction method_ = nullptr;
  getter get_ = nullptr;
  void* closure_ = nullptr;
};

// The flag is exactly False; a failed read (error cleared) counts as not False.
bool flag_is_false(FlagReader& flag, PyObject* t) {
  PyObject* v = flag.read(t);
  if (v == nullptr) {
    PyErr_Clear();
    return false;
  }
  const bool no = v == Py_False;
  Py_DECREF(v);
  return no;
}

}  // namespace

bool readable_in_place(PyObject* t, bool reject_grad) {
  static FlagReader is_neg("is_neg", true);  // the GIL is held: one reader per process is safe
  static FlagReader requires_grad("requires_grad", false);
  return flag_is_false(is_neg, t) && (!reject_grad || flag_is_false(requires_grad, t));
}

}  // namespace kl
