// Reading torch tensors from their Python objects without torch headers (tensor_lists.cpp through
// sequence_reads.h): DLPack's C exchange table for address, device, dtype, shape and strides in one C
// call, and Python attribute reads for the flags a DLTensor does not carry.
#pragma once

#include <pybind11/pybind11.h>

#include "cpu/dlpack_exchange.h"

namespace kl {

// An interned Python string, kept for the life of the process (for attribute lookups).
PyObject* interned(const char* name);

// The DLPack 1.x exchange table of `tensor_type` with a tensor reader, or null. Looked up once per
// type (the GIL is held): DLPack requires the table to live as long as the process.
const dlpack::ExchangeAPI* exchange_api(PyObject* tensor_type);

// Fills `out` with the DLTensor of `t` (an object of the type `api` came from) when the table can
// describe it and it lives on the CPU; false otherwise, with any error the table raised cleared (a
// nested, sparse or batched (vmap) tensor: the caller's general path reports).
bool read_cpu_dltensor(const dlpack::ExchangeAPI* api, PyObject* t, dlpack::Tensor* out);

// A tensor object a kernel may read in place: without the negative bit (a pending negation its
// memory does not show, which launch.py resolves with a copy) and, with `reject_grad`, not
// requiring grad. Read failures count as no.
bool readable_in_place(PyObject* t, bool reject_grad);

}  // namespace kl
