// How the CPU extension reads a per-sequence CPU tensor in place, through DLPack's exchange table
// (dlpack_exchange.h): its facts (View), whether a kernel may read it (read_sequence) and where it
// starts (start_of). Used by sequence_facts (tensor_lists.cpp), which gives ragged.SequenceList the
// facts of a list of tensors; every rule on what a kl_reward call accepts lives in problem.py.
#pragma once

#include <pybind11/pybind11.h>

#include <cstddef>
#include <cstdint>

#include "cpu/dlpack_exchange.h"
#include "cpu/py_tensor.h"

namespace kl {
namespace seq {

// One tensor's facts, from the exchange table.
struct View {
  dlpack::Tensor t{};
  int32_t ndim() const { return t.ndim; }
  int64_t size(int d) const { return t.shape[d]; }
  int64_t stride(int d) const {  // null strides: compact row-major
    if (t.strides != nullptr) return t.strides[d];
    int64_t s = 1;
    for (int e = t.ndim - 1; e > d; --e) s *= t.shape[e];
    return s;
  }
};

// Sequence i of a list that a kernel reads in place, as ragged.SequenceList.of accepts it but for
// the flags (py_tensor.h's readable_in_place): exactly `tensor_type`, on the CPU, of shape [L]
// (rank 1) or [L, 1] (rank 2), contiguous (consecutive values adjacent).
inline bool read_sequence(const dlpack::ExchangeAPI* api, PyObject* tensor_type, PyObject* obj, int32_t rank,
                          View* v) {
  return Py_TYPE(obj) == reinterpret_cast<PyTypeObject*>(tensor_type) && read_cpu_dltensor(api, obj, &v->t) &&
         v->ndim() == rank && (rank != 2 || v->size(1) == 1) && (v->size(0) <= 1 || v->stride(0) == 1);
}

// Where such a sequence starts: its data address, the byte offset included (also for an empty one,
// whose address a kernel never reads): what ragged.SequenceList.addresses holds.
inline int64_t start_of(const View& v) {
  return static_cast<int64_t>(reinterpret_cast<uintptr_t>(v.t.data) + static_cast<uintptr_t>(v.t.byte_offset));
}

}  // namespace seq
}  // namespace kl
