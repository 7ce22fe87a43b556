// Kernel launches of the CUDA sources: kl::launch(kernel, grid, block, smem, stream, args...) instead
// of kernel<<<grid, block, smem, stream>>>(args...), so that the same .cu files compile with nvcc
// and, as C++ against the host emulation of csrc/emu (g++ -x c++ -Icsrc/emu), with g++.
//
// It returns the launch's own error: cudaLaunchKernel's result with nvcc, the emulator's launch
// checks without. Not cudaGetLastError after a launch, which also returns an error left behind by
// any earlier runtime call of this thread (a failed probe, say) and would blame it on this launch.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <tuple>
#include <type_traits>
#include <utility>

namespace kl {

#if !defined(KL_CUDA_EMULATED)
namespace detail {
template <typename... P, std::size_t... I>
cudaError_t launch_params(void (*kernel)(P...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                          std::tuple<P...>& params, std::index_sequence<I...>) {
  void* argv[sizeof...(P) > 0 ? sizeof...(P) : 1] = {static_cast<void*>(&std::get<I>(params))...};
  return cudaLaunchKernel(reinterpret_cast<const void*>(kernel), grid, block, argv, smem, stream);
}
}  // namespace detail
#endif

// Launch `kernel` with `args` converted to its parameter types; the launch's error (cudaSuccess when
// it was enqueued).
template <typename... P, typename... A>
cudaError_t launch(void (*kernel)(P...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream, A&&... args) {
  static_assert(sizeof...(P) == sizeof...(A), "a kernel launch needs one argument per parameter");
#if defined(KL_CUDA_EMULATED)
  return kl_emu::launch(kernel, grid, block, smem, stream, std::forward<A>(args)...);
#else
  std::tuple<P...> params(std::forward<A>(args)...);
  return detail::launch_params(kernel, grid, block, smem, stream, params, std::index_sequence_for<P...>{});
#endif
}

// 0, or 1000 + a launch's error. A failed launch also left its error as the runtime's last error;
// it is taken out there (the caller reports it), so that no later check sees it again. A sticky error
// (a faulted context) stays, as it must.
inline int launch_status(cudaError_t err) {
  if (err == cudaSuccess) return 0;
  if (cudaPeekAtLastError() == err) (void)cudaGetLastError();
  return 1000 + static_cast<int>(err);
}

}  // namespace kl
