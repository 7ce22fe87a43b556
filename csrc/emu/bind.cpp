// Python entry points of the emulated CUDA extension (see bind.h).
#include "emu/bind.h"

#include <cuda_runtime.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "common/kl_penalty_args.h"
#include "common/kl_reward_args.h"
#include "common/row_args.h"
#include "common/row_math.h"
#include "cuda/full_kl_cuda.h"
#include "cuda/kl_penalty_cuda.h"
#include "cuda/kl_reward_cuda.h"
#include "cuda/token_logprobs_cuda.h"
#include "emu/selftest.h"

namespace py = pybind11;

namespace kl_emu {
namespace {

int64_t element_bytes(int32_t dtype) { return dtype == kl::kFloat32 ? 4 : 2; }

// Outputs: all bytes 0xFF (a NaN in fp32/bf16/fp16, -1 as an int64 count), so an element a kernel
// fails to write shows up as a NaN or a count of -1.
void poison(uintptr_t p, int64_t bytes) {
  if (p != 0 && bytes > 0) std::memset(reinterpret_cast<void*>(p), 0xff, static_cast<size_t>(bytes));
}

// The workspace (fp64 sums and int64 counts/positions): each 8-byte word a quiet NaN as a double and
// a huge positive index as an int64 (0xFF bytes would read as -1, a valid "no position" there).
void poison_workspace(uintptr_t p, int64_t bytes) {
  if (p == 0) return;
  const uint64_t word = 0x7ff4a5a5a5a5a5a5ull;
  for (int64_t i = 0; i + 8 <= bytes; i += 8) std::memcpy(reinterpret_cast<char*>(p) + i, &word, 8);
}

int reward_forward(const kl::KLRewardArgs& a, uintptr_t workspace, uintptr_t stream) {
  poison(a.kl, a.total * element_bytes(a.dtype));
  poison(a.reward_out, a.total * element_bytes(a.reward_dtype));
  poison(a.ref_out, a.total * element_bytes(a.dtype));
  poison(a.kl_sum, a.batch * 4);
  poison(a.count, a.batch * 8);
  poison_workspace(workspace, kl::kl_reward_cuda_workspace_bytes(a));
  return kl::kl_reward_forward_cuda(a, workspace, stream);
}

int reward_backward(const kl::KLRewardArgs& a, uintptr_t stream) {
  poison(a.g_lp, a.total * element_bytes(a.dtype));
  poison(a.g_ref, a.total * element_bytes(a.dtype));
  return kl::kl_reward_backward_cuda(a, stream);
}

int penalty_forward(const kl::KLPenaltyArgs& a, uintptr_t workspace, uintptr_t stream) {
  const int64_t n = a.g.total, b = a.g.batch;
  poison(a.seq_loss, b * 4);
  poison(a.stats, b * 4 * kl::kStatColumns);
  poison(a.count, b * 8);
  poison(a.token_out, 4 * n * 4);
  poison(a.grad, n * 4);
  poison_workspace(workspace, kl::kl_penalty_cuda_workspace_bytes(a));
  return kl::kl_penalty_forward_cuda(a, workspace, stream);
}

int penalty_backward(const kl::KLPenaltyArgs& a, uintptr_t stream) {
  poison(a.g_lp, a.g.total * element_bytes(a.g.dtype));
  poison(a.g_ent, a.g.total * element_bytes(a.aux_dtype));
  return kl::kl_penalty_backward_cuda(a, stream);
}

// The V elements of each of `rows` rows of a row-kernel output (the row map of common/row_args.h):
// only the rows' own elements, so that a slab layout's gaps stay as they were.
void poison_rows(uintptr_t p, int32_t dtype, int64_t rows, int64_t vocab, int64_t inner, int64_t so, int64_t si) {
  if (p == 0) return;
  const int64_t eb = element_bytes(dtype);
  for (int64_t r = 0; r < rows; ++r) poison(p + kl::row_start(r, inner, so, si) * eb, vocab * eb);
}

int logprobs_forward(const kl::TokenLogprobsArgs& a, uintptr_t stream) {
  poison(a.log_probs, a.rows * 4);
  poison(a.lse, a.rows * 4);
  poison(a.entropy, a.rows * 4);
  return kl::token_logprobs_forward_cuda(a, stream);
}

int logprobs_backward(const kl::TokenLogprobsArgs& a, uintptr_t stream) {
  // (inplace_backward writes the gradient over the logits it reads: those are not poisoned)
  if (a.grad_logits != a.logits)
    poison_rows(a.grad_logits, a.dtype, a.rows, a.vocab, a.inner, a.g_stride_outer, a.g_stride_inner);
  return kl::token_logprobs_backward_cuda(a, stream);
}

int full_kl_forward(const kl::FullKLArgs& a, uintptr_t stream) {
  poison(a.kl, a.rows * 4);
  poison(a.lse, a.rows * 4);
  poison(a.ref_lse, a.rows * 4);
  return kl::full_kl_forward_cuda(a, stream);
}

int full_kl_backward(const kl::FullKLArgs& a, uintptr_t stream) {
  // (linear_full_kl writes the gradients over the chunk's logits they are computed from: those not)
  auto input = [&](uintptr_t p) { return p == a.logits || p == a.ref_logits; };
  if (!input(a.grad_logits))
    poison_rows(a.grad_logits, a.dtype, a.rows, a.vocab, a.inner, a.g_stride_outer, a.g_stride_inner);
  if (!input(a.grad_ref)) poison_rows(a.grad_ref, a.dtype, a.rows, a.vocab, a.inner, a.gr_stride_outer, a.gr_stride_inner);
  return kl::full_kl_backward_cuda(a, stream);
}

template <typename F, typename... Extra>
void replace(py::module_& m, const char* name, F f, Extra&&... extra) {
  // m.def would add an overload behind the original entry point; this replaces it.
  m.attr(name) = py::cpp_function(f, py::name(name), py::scope(m), std::forward<Extra>(extra)...);
}

}  // namespace

void bind(py::module_& m) {
  const char* poisoned = " (emulated: outputs and workspace are poisoned first, then the kernels run on the CPU)";
  replace(m, "kl_reward_forward", &reward_forward, py::arg("args"), py::arg("workspace"), py::arg("stream"),
          py::call_guard<py::gil_scoped_release>(), (std::string("Fused kl_reward forward") + poisoned).c_str());
  replace(m, "kl_reward_backward", &reward_backward, py::arg("args"), py::arg("stream"),
          py::call_guard<py::gil_scoped_release>(), (std::string("Fused kl_reward backward") + poisoned).c_str());
  replace(m, "kl_penalty_forward", &penalty_forward, py::arg("args"), py::arg("workspace"), py::arg("stream"),
          py::call_guard<py::gil_scoped_release>(), (std::string("Fused kl_penalty_loss forward") + poisoned).c_str());
  replace(m, "kl_penalty_backward", &penalty_backward, py::arg("args"), py::arg("stream"),
          py::call_guard<py::gil_scoped_release>(), (std::string("Fused kl_penalty_loss backward") + poisoned).c_str());
  replace(m, "token_logprobs_forward", &logprobs_forward, py::arg("args"), py::arg("stream"),
          py::call_guard<py::gil_scoped_release>(), (std::string("Fused token_logprobs forward") + poisoned).c_str());
  replace(m, "token_logprobs_backward", &logprobs_backward, py::arg("args"), py::arg("stream"),
          py::call_guard<py::gil_scoped_release>(),
          (std::string("Fused token_logprobs backward") + poisoned + "; not the logits under inplace_backward").c_str());
  replace(m, "full_kl_forward", &full_kl_forward, py::arg("args"), py::arg("stream"),
          py::call_guard<py::gil_scoped_release>(), (std::string("Fused full_kl forward") + poisoned).c_str());
  replace(m, "full_kl_backward", &full_kl_backward, py::arg("args"), py::arg("stream"),
          py::call_guard<py::gil_scoped_release>(), (std::string("Fused full_kl backward") + poisoned + "; not gradients written over their logits").c_str());
  m.attr("EMULATED") = true;

  m.def("emu_counters", [] {
    const Counters c = counters();
    py::dict d;
    d["launches"] = c.launches;
    d["blocks"] = c.blocks;
    d["threads"] = c.threads;
    d["barriers"] = c.barriers;
    d["shuffles"] = c.shuffles;
    return d;
  }, "Launches, blocks, CUDA threads, __syncthreads and shuffles emulated so far in this process.");
  m.def("emu_record_error", [](int code) { record_error(static_cast<cudaError_t>(code)); }, py::arg("code"),
        "Leave `code` as the runtime's last error, as an unrelated failed runtime call would.");
  m.def("emu_peek_last_error", [] { return static_cast<int>(cudaPeekAtLastError()); },
        "The runtime's last error, not reset (cudaPeekAtLastError).");
  m.def("emu_get_last_error", [] { return static_cast<int>(cudaGetLastError()); },
        "The runtime's last error, reset (cudaGetLastError).");
  m.def("emu_fail_next_launch", [](int code) { fail_next_launch(static_cast<cudaError_t>(code)); }, py::arg("code"),
        "Make the next kernel launch fail with cudaError_t `code`.");
  m.def("emu_scan", [](int variant, const std::vector<double>& values) {
    std::vector<double> out(values.size(), -1.0);
    int err;
    {
      py::gil_scoped_release release;
      err = selftest_scan(variant, values.data(), out.data(), static_cast<int>(values.size()));
    }
    return py::make_tuple(err, out);
  }, py::arg("variant"), py::arg("values"),
        "Self-test: a block-wide inclusive scan of <= 256 values; variant 0 correct, 1 without its "
        "__syncthreads, 2 a __syncthreads thread 0 skips, 3 shuffles half a warp skips, 4 a partial shuffle "
        "mask (2-4 abort the process). Returns (cudaError_t, outputs).");
  m.def("emu_shuffles", [](const std::vector<double>& values) {
    std::vector<double> out(4 * values.size(), -1.0);
    const int err = selftest_shuffles(values.data(), out.data(), static_cast<int>(values.size()));
    return py::make_tuple(err, out);
  }, py::arg("values"), "Self-test: per thread t of 256, shuffles of values[t]: up 3, down 5, xor 7, "
                        "from lane (7 lane + 3) % 32. Returns (cudaError_t, outputs).");
  m.def("emu_launch", [](unsigned gx, unsigned gy, unsigned bx, unsigned by, unsigned bz, size_t smem) {
    int ran = 0;
    const int err = selftest_launch(gx, gy, bx, by, bz, smem, &ran);
    return py::make_tuple(err, ran);
  }, py::arg("grid_x"), py::arg("grid_y"), py::arg("block_x"), py::arg("block_y"), py::arg("block_z"),
        py::arg("shared_bytes"), "Self-test: launch an empty kernel; returns (cudaError_t, whether it ran).");
}

}  // namespace kl_emu
