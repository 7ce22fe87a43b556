// pybind11 module kl_kernels._C: the CPU extension.
//
// At this stage it exposes only `probe()`, which proves that the extension was compiled,
// links and loads. The fused kl_reward kernels are registered here by the kernel work
// (issue 3); the Python side detects them by name (`hasattr(_C, "kl_reward_forward")`),
// so a build without them is reported as "not implemented", never used by accident.
#include <pybind11/pybind11.h>

#include "common/build_info.h"

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
  info["kernels"] = py::list();  // names of the fused kernels compiled in (none yet)
  return info;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "kl_kernels CPU extension (framework-free; no libtorch linkage)";
  m.def("probe", &probe, "Build facts of the CPU extension: compiler, C++ standard, kernels.");
}
