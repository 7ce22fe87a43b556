// sample_leaves: the entry dicts of the samples of a lazily stacked TensorDict, and each sample's
// value under some keys, in one pass; put_entries: one value set into each of those dicts
// (kl_kernels/torchrl/_io.py).
//
// Both hand over and take tuples, which the other C passes of a call use as they are: kl_reward's
// list plan snapshots its list arguments (PySequence_Tuple, free for a tuple) and keeps them alive
// while the kernel reads them. Lists would be copied at every step: ~0.015 ms of a ~0.5 ms
// KLComputation call at B = 256 on the 2-core CI VM, in reference counts of every sample's objects.
//
// A TorchRL transform on a lazy stack of B samples finds its inputs in every sample: for a nested
// key ("log_probs", "full"), sample -> its entry dict -> the sub-TensorDict -> its entry dict -> the
// tensor. In Python that walk is one comprehension per key and level, ~0.1 ms for three keys at
// B = 256 right after another transform's call (every object in it out of the caches), a sixth of
// a KLComputation call. Here it is one C loop over the samples, all keys of a sample together.
//
// The rules are those of _io.py's Python walk (used when the extension is missing, and compared with
// this one by tests/test_torchrl_transforms.py): a sample must be exactly a TensorDict, not locked,
// its entries a dict; a path descends through exactly-TensorDict nodes only; a missing key anywhere
// gives None. No error is raised: None sends the caller down TensorDict's public API.
#include "cpu/tensordict_samples.h"

#include "cpu/compat/tensordict.h"
#include "cpu/py_tensor.h"

namespace py = pybind11;

namespace kl {
namespace {

// The entry dict of `node` when it is exactly `container_type` (borrowed from `holder`, which keeps
// it), else null. No error is left set.
PyObject* entries_of(PyObject* node, PyObject* container_type, py::object* holder) {
  static PyObject* const s_entries = interned(compat::kTensorDictEntries);
  if (Py_TYPE(node) != reinterpret_cast<PyTypeObject*>(container_type)) return nullptr;
  *holder = py::reinterpret_steal<py::object>(PyObject_GetAttr(node, s_entries));
  if (!*holder || !PyDict_CheckExact(holder->ptr())) {
    PyErr_Clear();
    return nullptr;
  }
  return holder->ptr();
}

// `node` (a sample) is not locked: its lock flag (compat::kTensorDictLocked) is false.
bool unlocked(PyObject* node) {
  static PyObject* const s_locked = interned(compat::kTensorDictLocked);
  PyObject* v = PyObject_GetAttr(node, s_locked);
  const int locked = v == nullptr ? -1 : PyObject_IsTrue(v);
  Py_XDECREF(v);
  if (locked < 0) PyErr_Clear();
  return locked == 0;
}

}  // namespace

// (entries, leaves): entries[i] is the entry dict of samples[i] (a list), leaves[k][i] its value
// under paths[k] (a tuple of str per key), all tuples; or None (see the file comment).
py::object sample_leaves(py::handle samples, py::handle container_type, py::handle paths) {
  if (!PyList_Check(samples.ptr()) || !PyTuple_Check(paths.ptr())) return py::none();
  const py::tuple samples_now = py::reinterpret_steal<py::tuple>(PySequence_Tuple(samples.ptr()));
  if (!samples_now) throw py::error_already_set();
  const Py_ssize_t n = PyTuple_GET_SIZE(samples_now.ptr()), keys = PyTuple_GET_SIZE(paths.ptr());
  for (Py_ssize_t k = 0; k < keys; ++k) {
    PyObject* path = PyTuple_GET_ITEM(paths.ptr(), k);
    if (!PyTuple_Check(path) || PyTuple_GET_SIZE(path) == 0) return py::none();
    for (Py_ssize_t d = 0; d < PyTuple_GET_SIZE(path); ++d)
      if (!PyUnicode_CheckExact(PyTuple_GET_ITEM(path, d))) return py::none();
  }
  py::tuple entries(n);
  py::tuple leaves(keys);
  for (Py_ssize_t k = 0; k < keys; ++k) {
    PyObject* values = PyTuple_New(n);  // filled before anything else can see it
    if (values == nullptr) throw py::error_already_set();
    PyTuple_SET_ITEM(leaves.ptr(), k, values);  // steals the reference
  }
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* sample = PyTuple_GET_ITEM(samples_now.ptr(), i);
    py::object held;
    PyObject* top = entries_of(sample, container_type.ptr(), &held);
    if (top == nullptr || !unlocked(sample)) return py::none();
    Py_INCREF(top);
    PyTuple_SET_ITEM(entries.ptr(), i, top);
    for (Py_ssize_t k = 0; k < keys; ++k) {
      PyObject* path = PyTuple_GET_ITEM(paths.ptr(), k);
      PyObject* dict = top;
      py::object nested;  // keeps a nested entry dict alive while it is read
      PyObject* node = nullptr;
      for (Py_ssize_t d = 0; d < PyTuple_GET_SIZE(path); ++d) {
        if (d > 0 && (dict = entries_of(node, container_type.ptr(), &nested)) == nullptr) return py::none();
        node = PyDict_GetItemWithError(dict, PyTuple_GET_ITEM(path, d));  // borrowed
        if (node == nullptr) {
          PyErr_Clear();  // a key missing (or a key whose hash failed: not a str here)
          return py::none();
        }
      }
      Py_INCREF(node);
      PyTuple_SET_ITEM(PyTuple_GET_ITEM(leaves.ptr(), k), i, node);
    }
  }
  return py::make_tuple(entries, leaves);
}

// entries[i][name] = values[i] for every i (entries and values: lists or tuples of one length, the
// entries exact dicts; name an exact str): true; false, with nothing set, for anything else. A
// transform storing its per-sample results.
bool put_entries(py::handle entries, py::handle name, py::handle values) {
  PyObject* v = values.ptr();
  if ((!PyList_Check(entries.ptr()) && !PyTuple_Check(entries.ptr())) || (!PyList_Check(v) && !PyTuple_Check(v)) ||
      !PyUnicode_CheckExact(name.ptr()))
    return false;
  // The entries are held as a tuple (the caller's own tuple, or a snapshot of a list): replacing a
  // value frees the old one, which may run arbitrary code (a finalizer) that could change a list.
  const py::tuple dicts = py::reinterpret_steal<py::tuple>(PySequence_Tuple(entries.ptr()));
  if (!dicts) throw py::error_already_set();
  const Py_ssize_t n = PyTuple_GET_SIZE(dicts.ptr());
  if (PySequence_Fast_GET_SIZE(v) != n) return false;
  for (Py_ssize_t i = 0; i < n; ++i)
    if (!PyDict_CheckExact(PyTuple_GET_ITEM(dicts.ptr(), i))) return false;
  // The values are read in place (the call's own argument keeps the sequence alive), each value held
  // while it is stored; a list changed by such a finalizer is read as it is then, and one that shrank
  // stops the loop with an error.
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (i >= PySequence_Fast_GET_SIZE(v)) throw py::value_error("put_entries: values changed size while being stored");
    const py::object item = py::reinterpret_borrow<py::object>(PySequence_Fast_GET_ITEM(v, i));
    if (PyDict_SetItem(PyTuple_GET_ITEM(dicts.ptr(), i), name.ptr(), item.ptr()) != 0) throw py::error_already_set();
  }
  return true;
}

}  // namespace kl
