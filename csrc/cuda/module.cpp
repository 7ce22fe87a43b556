// pybind11 module kl_kernels._cuda: the CUDA extension.
//
// Compiled by the host compiler; the kernels live in .cu files compiled by nvcc and are
// reached through plain C++ entry points. The CUDA runtime is linked statically, so this
// module imports on machines without a driver; `probe()` then reports why CUDA is unusable.
#include <pybind11/pybind11.h>

#include <cuda_runtime_api.h>  // CUDART_VERSION only; no runtime calls from here

#include <string>

#include "common/build_info.h"
#include "cuda/probe.h"

namespace py = pybind11;

namespace {

py::dict probe(bool launch) {
  py::dict info;
  info["extension"] = "_cuda";
  info["abi_version"] = KL_KERNELS_ABI_VERSION;
  info["cuda_archs"] = std::string(KL_KERNELS_CUDA_ARCHS);
  info["cuda_runtime_compiled"] = CUDART_VERSION;
  int count = 0;
  int err = kl_probe_device_count(&count);
  info["device_count"] = count;
  info["error"] = err == 0 ? py::object(py::none()) : py::object(py::str(kl_probe_error_string(err)));
  int driver = 0;
  if (kl_probe_driver_version(&driver) == 0) info["driver_version"] = driver;
  if (launch && err == 0 && count > 0) {
    int result = 0;
    int launch_err = kl_probe_launch(0, &result);
    info["launch_ok"] = launch_err == 0 && result == 42;
    if (launch_err != 0) info["launch_error"] = std::string(kl_probe_error_string(launch_err));
  }
  info["kernels"] = py::list();  // names of the fused kernels compiled in (none yet)
  return info;
}

}  // namespace

PYBIND11_MODULE(_cuda, m) {
  m.doc() = "kl_kernels CUDA extension (framework-free; no libtorch linkage; static cudart)";
  m.def("probe", &probe, py::arg("launch") = false,
        "CUDA build and runtime facts; with launch=True, runs one tiny kernel on device 0.");
}
