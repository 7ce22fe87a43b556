// The emulated CUDA extension's own Python entry points (kl_kernels._cuda_emu), added by
// csrc/cuda/module.cpp when it is compiled against the emulation (KL_CUDA_EMULATED).
#pragma once

#include <pybind11/pybind11.h>

namespace kl_emu {

// Wraps the four kernel entry points so that every output and the workspace are poisoned before the
// kernels run (NaN floats, -1 counts, a NaN / huge-index pattern in the workspace), and adds the
// emulation's counters, error hooks and self-test kernels (emu_* functions).
void bind(pybind11::module_& m);

}  // namespace kl_emu
