// pybind11 module kl_kernels._cuda: the CUDA extension.
//
// Compiled by the host compiler; the kernels live in .cu files compiled by nvcc and are
// reached through plain C++ entry points. The CUDA runtime is linked statically, so this
// module imports on machines without a driver; `probe()` then reports why CUDA is unusable.
//
// The same file, with the .cu files compiled as C++ against the host emulation of csrc/emu
// (KL_CUDA_EMULATED), is kl_kernels._cuda_emu: the kernels run on CPU memory, and csrc/emu/bind.h
// adds the emulation's own entry points.
#include <pybind11/pybind11.h>

#include <cuda_runtime_api.h>  // CUDART_VERSION only; no runtime calls from here

#include <string>

#include "common/bind_args.h"
#include "common/build_info.h"
#include "cuda/full_kl_cuda.h"
#include "cuda/kl_penalty_cuda.h"
#include "cuda/kl_reward_cuda.h"
#include "cuda/probe.h"
#include "cuda/ragged_checks.h"
#include "cuda/token_logprobs_cuda.h"
#if defined(KL_CUDA_EMULATED)
#include "emu/bind.h"
#endif

#ifndef KL_CUDA_MODULE
#define KL_CUDA_MODULE _cuda
#endif
#define KL_STR2(x) #x
#define KL_STR(x) KL_STR2(x)

namespace py = pybind11;

namespace {

py::dict probe(bool launch) {
  py::dict info;
  info["extension"] = KL_STR(KL_CUDA_MODULE);
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
  py::list kernels;
  kernels.append("kl_reward_forward");
  kernels.append("kl_reward_backward");
  kernels.append("kl_penalty_forward");
  kernels.append("kl_penalty_backward");
  kernels.append("token_logprobs_forward");
  kernels.append("token_logprobs_backward");
  kernels.append("full_kl_forward");
  kernels.append("full_kl_backward");
  kernels.append("offsets_valid");
  kernels.append("lengths_valid");
  info["kernels"] = kernels;
  return info;
}

}  // namespace

PYBIND11_MODULE(KL_CUDA_MODULE, m) {
  m.doc() = "kl_kernels CUDA extension (framework-free; no libtorch linkage; static cudart)";
  m.def("probe", &probe, py::arg("launch") = false,
        "CUDA build and runtime facts; with launch=True, runs one tiny kernel on device 0.");
  kl::bind_args(m);
  kl::bind_penalty_args(m);
  kl::bind_row_args(m);
  m.attr("KL_REWARD_TILE") = kl::kCudaTile;
  m.def("kl_reward_workspace_bytes", &kl::kl_reward_cuda_workspace_bytes, py::arg("args"),
        "Bytes of device scratch kl_reward_forward needs for these arguments.");
  m.def("kl_reward_forward", &kl::kl_reward_forward_cuda, py::arg("args"), py::arg("workspace"), py::arg("stream"),
        py::call_guard<py::gil_scoped_release>(),
        "Fused kl_reward forward, enqueued on `stream` (a cudaStream_t as an integer); no host sync. Returns 0, "
        "1 (unsupported dtypes), 2 (too many tiles) or 1000 + a cudaError_t.");
  m.def("kl_reward_backward", &kl::kl_reward_backward_cuda, py::arg("args"), py::arg("stream"),
        py::call_guard<py::gil_scoped_release>(),
        "Fused kl_reward backward, enqueued on `stream`; same return codes as the forward.");
  m.def("kl_penalty_workspace_bytes", &kl::kl_penalty_cuda_workspace_bytes, py::arg("args"),
        "Bytes of device scratch kl_penalty_forward needs for these arguments.");
  m.def("kl_penalty_forward", &kl::kl_penalty_forward_cuda, py::arg("args"), py::arg("workspace"), py::arg("stream"),
        py::call_guard<py::gil_scoped_release>(),
        "Fused kl_penalty_loss forward, enqueued on `stream`; no host sync. Returns 0, 1 (unsupported dtypes), "
        "2 (too many tiles) or 1000 + a cudaError_t.");
  m.def("kl_penalty_backward", &kl::kl_penalty_backward_cuda, py::arg("args"), py::arg("stream"),
        py::call_guard<py::gil_scoped_release>(),
        "Fused kl_penalty_loss backward, enqueued on `stream`; same return codes as the forward.");
  m.def("token_logprobs_forward", &kl::token_logprobs_forward_cuda, py::arg("args"), py::arg("stream"),
        py::call_guard<py::gil_scoped_release>(),
        "Fused token_logprobs forward (log-probs, lse, entropy per row), enqueued on `stream`; no host sync. "
        "Returns 0, 1 (unsupported dtype) or 1000 + a cudaError_t.");
  m.def("token_logprobs_backward", &kl::token_logprobs_backward_cuda, py::arg("args"), py::arg("stream"),
        py::call_guard<py::gil_scoped_release>(),
        "Fused token_logprobs backward (the logits' gradient, in place allowed), enqueued on `stream`; same "
        "return codes as the forward.");
  m.def("full_kl_forward", &kl::full_kl_forward_cuda, py::arg("args"), py::arg("stream"),
        py::call_guard<py::gil_scoped_release>(),
        "Fused full_kl forward (KL over the vocabulary, lse, ref_lse per row), enqueued on `stream`; no host "
        "sync. Returns 0, 1 (unsupported dtype) or 1000 + a cudaError_t.");
  m.def("full_kl_backward", &kl::full_kl_backward_cuda, py::arg("args"), py::arg("stream"),
        py::call_guard<py::gil_scoped_release>(),
        "Fused full_kl backward (the gradients to both logits), enqueued on `stream`; same return codes as the "
        "forward.");
  m.def("offsets_valid", &kl::kl_offsets_valid_cuda, py::arg("offsets"), py::arg("batch"), py::arg("total"),
        py::arg("errors"), py::arg("arg"), py::arg("stream"), py::call_guard<py::gil_scoped_release>(),
        "Enqueue the value check of offsets [B + 1] (int64): start at 0, never decrease, end at total; the "
        "first bad value is recorded in the error word `errors` as argument `arg` (no assert). Returns 0 or "
        "1000 + a cudaError_t.");
  m.def("lengths_valid", &kl::kl_lengths_valid_cuda, py::arg("lengths"), py::arg("batch"), py::arg("width"),
        py::arg("offsets"), py::arg("seq_lengths"), py::arg("errors"), py::arg("arg"), py::arg("bound_kind"),
        py::arg("stream"), py::call_guard<py::gil_scoped_release>(),
        "Enqueue the value check of lengths [B] (int64): 0 <= lengths[b] <= the bound of b (offsets[b + 1] - "
        "offsets[b] with offsets, else seq_lengths[b] with seq_lengths, else width); the first bad value is "
        "recorded in the error word `errors` (no assert).");
  m.def("error_word_alloc", [](int device) {
        uintptr_t host = 0, dev = 0;
        kl::kl_error_word_alloc(device, &host, &dev);
        return py::make_tuple(host, dev);
      }, py::arg("device"),
        "A zeroed device error word (kl_kernels.device_errors) in mapped pinned memory: (host address, device "
        "address), (0, 0) on failure. Never freed: one per device per process.");
  m.def("error_string", [](int code) { return std::string(kl_probe_error_string(code)); }, py::arg("code"),
        "The CUDA runtime's message for a cudaError_t.");
#if defined(KL_CUDA_EMULATED)
  kl_emu::bind(m);
#endif
}
