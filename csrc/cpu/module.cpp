// pybind11 module kl_kernels._C: the CPU extension.
//
// Exposes the fused kl_reward and kl_penalty_loss kernels (forward, backward) over a plain argument struct of raw
// addresses, sizes and strides; kl_kernels/kl_reward/launch.py and kl_kernels/kl_penalty/launch.py
// are the host launchers that fill them from torch tensors. No torch headers here: one build serves every torch version.
#include <pybind11/pybind11.h>

#include <exception>
#include <functional>

#include "common/bind_args.h"
#include "common/build_info.h"
#include "cpu/compat/cpython.h"
#include "cpu/compat/openmp.h"
#include "cpu/compat/torch_dlpack.h"
#include "cpu/int64_facts.h"
#include "cpu/kl_penalty_cpu.h"
#include "cpu/kl_reward_cpu.h"
#include "cpu/parallel.h"
#include "cpu/tensor_lists.h"
#include "cpu/tensordict_samples.h"
#include "cpu/full_kl_cpu.h"
#include "cpu/token_logprobs_cpu.h"

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
  kernels.append("kl_reward_forward_during");
  kernels.append("kl_reward_list_readable");
  kernels.append("kl_penalty_forward");
  kernels.append("kl_penalty_backward");
  kernels.append("kl_penalty_sequence_log_ratio");
  kernels.append("token_logprobs_forward");
  kernels.append("token_logprobs_backward");
  kernels.append("full_kl_forward");
  kernels.append("full_kl_backward");
  info["kernels"] = kernels;
  info["parallel_runtime"] = kl::parallel_runtime();  // decided at first use, after torch is loaded
  return info;
}

// (first, last, min, max, non_decreasing) of an int64 vector of n >= 1 entries in host memory: the
// value checks of kl_kernels.ragged's check_offsets / check_lengths in one call instead of five
// torch ops (they run on every kernel call).
py::tuple int64_facts(uintptr_t ptr, int64_t n) {
  const kl::Int64Facts f = kl::int64_facts(reinterpret_cast<const int64_t*>(ptr), n);
  return py::make_tuple(f.first, f.last, f.lo, f.hi, f.non_decreasing);
}

// The fused forward, calling the Python callable `during` on this thread while the kernel's tiles
// run on the others (kl::run_with_caller_work): Python splits the outputs into per-sample views and
// stores them meanwhile, and then joins the tiles. `during` must not read the outputs. A Python
// exception in it propagates (after the kernel finished); dtypes the kernel refuses are refused
// before `during` runs, so outputs it handed out are never left unwritten.
int kl_reward_forward_during(const kl::KLRewardArgs& args, int num_threads, py::function during) {
  const int refused = kl::kl_reward_forward_check(args);
  if (refused != 0) return refused;
  std::exception_ptr failure;
  const std::function<void()> work = [&] {
    py::gil_scoped_acquire gil;
    try {
      during();
    } catch (...) {  // never through the OpenMP runtime's frames: rethrown below, with the GIL
      failure = std::current_exception();
    }
  };
  int code;
  {
    py::gil_scoped_release release;
    code = kl::run_with_caller_work(work, [&] { return kl::kl_reward_forward_cpu(args, num_threads); });
  }
  if (failure) std::rethrow_exception(failure);
  return code;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "kl_kernels CPU extension (framework-free; no libtorch linkage)";
  m.def("probe", &probe, "Build facts of the CPU extension: compiler, C++ standard, kernels.");
  kl::bind_args(m);
  m.def("int64_facts", &int64_facts, py::arg("ptr"), py::arg("n"),
        "(v[0], v[-1], min, max, non-decreasing) of a contiguous int64 CPU vector of n >= 1 entries.");
  m.def("sequence_facts", &kl::sequence_facts, py::arg("tensors"), py::arg("tensor_type"), py::arg("trailing_one"),
        py::arg("like"), py::arg("reject_grad"), py::arg("exchange") = true,
        "(dtype, tokens, addresses, offsets, tensors as a tuple) of a list of contiguous CPU [L] (or [L, 1])\n"
        "tensors of one dtype read in place by the CPU kernel, or None when the list is not such.");
  m.def("sample_leaves", &kl::sample_leaves, py::arg("samples"), py::arg("container_type"), py::arg("paths"),
        "(entry dicts, values under each path), as tuples, of a list of plain TensorDict samples in one pass, or None\n"
        "(a sample not exactly container_type, locked, or lacking a key; see kl_kernels/torchrl/_io.py).");
  m.def("put_entries", &kl::put_entries, py::arg("entries"), py::arg("name"), py::arg("values"),
        "entries[i][name] = values[i] for two lists or tuples of one length (exact dicts, a str name): True;\n"
        "False, with nothing set, for anything else.");
  m.def("exchange_api_version", &kl::exchange_api_version, py::arg("tensor_type"),
        "(major, minor) of the DLPack exchange table sequence_facts reads tensor_type through, or None.");
  m.def(
      "compat_paths",
      [](py::handle tensor_type) {
        py::dict d;
        d["cpython_type_lookup"] = kl::compat::type_lookup_active();
        d["dlpack_exchange"] = kl::compat::dlpack_exchange_api(tensor_type.ptr()) != nullptr;
        d["openmp_gomp_parallel"] = kl::compat::loaded_gomp_parallel() != nullptr;
        return d;
      },
      py::arg("tensor_type"),
      "Which private paths of csrc/cpu/compat/ are in use (False: their fallback), for tests and info.");
  m.def("kl_reward_forward", &kl::kl_reward_forward_cpu, py::arg("args"), py::arg("num_threads"),
        py::call_guard<py::gil_scoped_release>(),
        "Fused kl_reward forward on the CPU; returns 0 or an error code (1: unsupported dtypes).");
  m.def("kl_reward_forward_during", &kl_reward_forward_during, py::arg("args"), py::arg("num_threads"),
        py::arg("during"),
        "Fused kl_reward forward on the CPU, calling during() on this thread while the other threads start\n"
        "on the tiles (it must not read the outputs); returns 0 or an error code.");
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
  m.def("kl_penalty_sequence_log_ratio", &kl::kl_penalty_sequence_log_ratio_cpu, py::arg("args"),
        py::arg("num_threads"), py::call_guard<py::gil_scoped_release>(),
        "GSPO's pre-pass on the CPU: args.seq_lr[b] = mean of lp - old over sequence b's counted tokens; 0 or an "
        "error code.");
  kl::bind_row_args(m);
  m.def("token_logprobs_forward", &kl::token_logprobs_forward_cpu, py::arg("args"), py::arg("num_threads"),
        py::call_guard<py::gil_scoped_release>(),
        "Fused token_logprobs forward on the CPU (log-probs, lse, entropy per row); 0 or an error code.");
  m.def("token_logprobs_backward", &kl::token_logprobs_backward_cpu, py::arg("args"), py::arg("num_threads"),
        py::call_guard<py::gil_scoped_release>(),
        "Fused token_logprobs backward on the CPU (the logits' gradient, in place allowed); 0 or an error code.");
  m.def("full_kl_forward", &kl::full_kl_forward_cpu, py::arg("args"), py::arg("num_threads"),
        py::call_guard<py::gil_scoped_release>(),
        "Fused full_kl forward on the CPU (KL over the vocabulary, lse, ref_lse per row); 0 or an error code.");
  m.def("full_kl_backward", &kl::full_kl_backward_cpu, py::arg("args"), py::arg("num_threads"),
        py::call_guard<py::gil_scoped_release>(),
        "Fused full_kl backward on the CPU (the gradients to both logits); 0 or an error code.");
}
