// pybind11 module kl_kernels._C: the CPU extension.
//
// Exposes the fused kl_reward and kl_penalty_loss kernels (forward, backward) over a plain argument struct of raw
// addresses, sizes and strides; kl_kernels/kl_reward/kernels.py is the host launcher that fills
// it from torch tensors. No torch headers here: one build serves every torch version.
#include <pybind11/pybind11.h>

#include "common/bind_args.h"
#include "common/build_info.h"
#include "cpu/kl_penalty_cpu.h"
#include "cpu/kl_reward_cpu.h"
#include "cpu/parallel.h"

namespace py = pybind11;

namespace {

py::dict probe() {
  py::dict info;
  info["extension"] = "_C";
  info["abi_version"] = KL_KERNELS_ABI_VERSION;
#if defined(__VERSION__)
  info["compiler"] = __VERSION__;
#endif
  info["cplusplus"] = static_cast<long>(__cplusplus);
  py::list kernels;
  kernels.append("kl_reward_forward");
  kernels.append("kl_reward_backward");
  kernels.append("kl_penalty_forward");
  kernels.append("kl_penalty_backward");
  info["kernels"] = kernels;
  info["parallel_runtime"] = kl::parallel_runtime();  // decided at first use, after torch is loaded
  return info;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "kl_kernels CPU extension (framework-free; no libtorch linkage)";
  m.def("probe", &probe, "Build facts of the CPU extension: compiler, C++ standard, kernels.");
  kl::bind_args(m);
  m.def("kl_reward_forward", &kl::kl_reward_forward_cpu, py::arg("args"), py::arg("num_threads"),
        py::call_guard<py::gil_scoped_release>(),
        "Fused kl_reward forward on the CPU; returns 0 or an error code (1: unsupported dtypes).");
  m.def("kl_reward_backward", &kl::kl_reward_backward_cpu, py::arg("args"), py::arg("num_threads"),
        py::call_guard<py::gil_scoped_release>(),
        "Fused kl_reward backward on the CPU; returns 0 or an error code (1: unsupported dtypes).");
  kl::bind_penalty_args(m);
  m.def("kl_penalty_forward", &kl::kl_penalty_forward_cpu, py::arg("args"), py::arg("num_threads"),
        py::call_guard<py::gil_scoped_release>(),
        "Fused kl_penalty_loss forward on the CPU; returns 0 or an error code (1: unsupported dtypes).");
  m.def("kl_penalty_backward", &kl::kl_penalty_backward_cpu, py::arg("args"), py::arg("num_threads"),
        py::call_guard<py::gil_scoped_release>(),
        "Fused kl_penalty_loss backward on the CPU; returns 0 or an error code (1: unsupported dtypes).");
}
