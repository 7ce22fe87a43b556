// Walking the samples of a lazily stacked TensorDict to their per-sample entries, and storing one
// value per sample, in one C pass each
// (kl_kernels/torchrl/_io.py's sample_leaves; see tensordict_samples.cpp).
#pragma once

#include <pybind11/pybind11.h>

namespace kl {

// See tensordict_samples.cpp.
pybind11::object sample_leaves(pybind11::handle samples, pybind11::handle container_type, pybind11::handle paths);
bool put_entries(pybind11::handle entries, pybind11::handle name, pybind11::handle values);

}  // namespace kl
