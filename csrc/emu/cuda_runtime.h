// Host emulation of the slice of CUDA that csrc/cuda uses, so that the unchanged .cu sources compile
// with g++ (-x c++ -Icsrc/emu) and run on the CPU: the kl_kernels._cuda_emu extension behind the
// "cuda-emulated" backend, the CUDA kernels' tests in CI and their sanitizer lane.
//
// What is emulated, and how faithfully:
// * Launches (kl::launch in cuda/launch.cuh, kl_emu::launch here) check the limits the driver
//   checks (grid.x in [1, 2^31 - 1], grid.y/z <= 65535, block dims in [1, 1024] x [1, 1024] x [1, 64]
//   with at most 1024 threads, dynamic shared memory <= 48 KiB) and return the launch's own error.
//   A launch runs its blocks one after another, synchronously, on the calling thread; launches are
//   serialized process-wide (a mutex), since the emulated shared memory is static.
// * Every CUDA thread of a block is a fiber with its own stack; the scheduler switches fibers only
//   at barriers, so each thread's registers and locals are private and ordering between threads is
//   established only by __syncthreads and shuffles, as on a GPU. Between barriers the fibers run in
//   a random order, a new one per sweep (KL_EMU_SCHEDULE, KL_EMU_SEED: see emu.cpp), so a thread
//   that runs ahead of a missing barrier reads shared memory its peers have not written yet: a
//   removed __syncthreads gives wrong results here, as it would on a GPU.
// * __syncthreads is a barrier of the whole block; __shfl_*_sync exchanges values between the 32
//   lanes of a warp through a per-warp barrier. Only full warps and the full mask are emulated
//   (what the kernels use); anything else aborts with a message. A barrier that not every thread of
//   the block (or lane of the warp) reaches is a deadlock on a GPU: here it aborts the process with
//   a message naming the block and where its threads wait, instead of hanging.
// * __shared__ variables are function-local statics: one copy per kernel, shared by the block's
//   fibers. Not poisoned between blocks (GCC ignores section attributes on statics of templates), so
//   a read of shared memory no thread of the block wrote sees the previous block's values.
// * Device memory is host memory: the kernels read and write the CPU tensors they are given.
// * The runtime keeps a per-thread last error (cudaGetLastError resets it, cudaPeekAtLastError does
//   not); a failed launch records its error there too, as the CUDA runtime does.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <utility>

#define KL_CUDA_EMULATED 1
#define CUDART_VERSION 0  // no CUDA runtime: the emulation

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline __attribute__((always_inline))
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
#define __shared__ static
#define __restrict__ __restrict

struct uint3 {
  unsigned x, y, z;
};

struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned vx = 1, unsigned vy = 1, unsigned vz = 1) : x(vx), y(vy), z(vz) {}
};

typedef struct CUstream_st* cudaStream_t;

enum cudaError_t : int {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorMemoryAllocation = 2,
  cudaErrorInvalidConfiguration = 9,
  cudaErrorInvalidDeviceFunction = 98,
  cudaErrorNoDevice = 100,
  cudaErrorInvalidDevice = 101,
  cudaErrorLaunchOutOfResources = 701,
  cudaErrorUnknown = 999,
};

enum cudaMemcpyKind {
  cudaMemcpyHostToHost = 0,
  cudaMemcpyHostToDevice = 1,
  cudaMemcpyDeviceToHost = 2,
  cudaMemcpyDeviceToDevice = 3,
  cudaMemcpyDefault = 4,
};

// The running CUDA thread's coordinates: set by the scheduler before it resumes a fiber (launches
// are serialized, so one set per process).
extern uint3 threadIdx;
extern uint3 blockIdx;
extern dim3 blockDim;
extern dim3 gridDim;
constexpr int warpSize = 32;

namespace kl_emu {

struct LaunchConfig {
  dim3 grid, block;
  size_t shared_bytes;
  cudaStream_t stream;
  const void* kernel;  // for diagnostics: the kernel's address
};

// Runs body(closure) once per CUDA thread of every block of the grid; returns the launch's error
// (and records it as the last error) without running anything when the configuration is invalid.
cudaError_t run(const LaunchConfig& config, void (*body)(void*), void* closure);

void syncthreads();

enum class Shuffle { kUp, kDown, kXor, kIdx };
uint64_t shuffle(Shuffle kind, uint64_t bits, int arg, unsigned mask, int width);

// Launches a kernel with arguments converted to its parameter types (by value, as a CUDA launch:
// each thread gets its own copy of the parameters).
template <typename... P, typename... A>
cudaError_t launch(void (*kernel)(P...), dim3 grid, dim3 block, size_t shared_bytes, cudaStream_t stream,
                   A&&... args) {
  static_assert(sizeof...(P) == sizeof...(A), "a kernel launch needs one argument per parameter");
  struct Closure {
    void (*kernel)(P...);
    std::tuple<std::decay_t<P>...> params;
  };
  Closure closure{kernel, std::tuple<std::decay_t<P>...>(std::forward<A>(args)...)};
  auto body = [](void* p) {
    Closure* c = static_cast<Closure*>(p);
    std::apply(c->kernel, c->params);  // copies the parameters into this thread's frame
  };
  return run(LaunchConfig{grid, block, shared_bytes, stream, reinterpret_cast<const void*>(kernel)}, body, &closure);
}

// Hooks for the emulation's own tests (csrc/emu/bind.cpp): record an error as if an unrelated runtime
// call had failed, or make the next launch fail with `code`.
void record_error(cudaError_t code);
void fail_next_launch(cudaError_t code);

struct Counters {
  int64_t launches, blocks, threads, barriers, shuffles;
};
Counters counters();

}  // namespace kl_emu

inline void __syncthreads() { kl_emu::syncthreads(); }

// Integer atomics and fences (the device error word, cuda/errors.cuh). Launches are serialized and a
// block's fibers switch only at barriers, so a compare-and-swap needs no more; the builtins keep it
// honest against another OS thread reading the word (the host side of kl_kernels.device_errors).
inline unsigned long long atomicCAS(unsigned long long* address, unsigned long long compare,
                                    unsigned long long value) {
  __atomic_compare_exchange_n(address, &compare, value, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
  return compare;  // the old value (compare_exchange wrote it there when it differed)
}
inline void __threadfence_system() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
inline void __threadfence() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
// (the value checks folded into the combine kernels: a grid-wide first finding, cuda/tiles.cuh)
inline long long atomicMin(long long* address, long long value) {
  long long old = __atomic_load_n(address, __ATOMIC_SEQ_CST);
  while (value < old && !__atomic_compare_exchange_n(address, &old, value, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {
  }
  return old;
}
inline unsigned long long atomicAdd(unsigned long long* address, unsigned long long value) {
  return __atomic_fetch_add(address, value, __ATOMIC_SEQ_CST);
}

template <typename T>
inline uint64_t kl_emu_bits(T v) {
  static_assert(sizeof(T) <= 8 && std::is_trivially_copyable_v<T>, "shuffles move register-sized values");
  uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof(T));
  return bits;
}

template <typename T>
inline T kl_emu_from_bits(uint64_t bits) {
  T v;
  std::memcpy(&v, &bits, sizeof(T));
  return v;
}

template <typename T>
inline T __shfl_up_sync(unsigned mask, T v, unsigned delta, int width = warpSize) {
  return kl_emu_from_bits<T>(kl_emu::shuffle(kl_emu::Shuffle::kUp, kl_emu_bits(v), static_cast<int>(delta), mask, width));
}

template <typename T>
inline T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = warpSize) {
  return kl_emu_from_bits<T>(kl_emu::shuffle(kl_emu::Shuffle::kDown, kl_emu_bits(v), static_cast<int>(delta), mask, width));
}

template <typename T>
inline T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = warpSize) {
  return kl_emu_from_bits<T>(kl_emu::shuffle(kl_emu::Shuffle::kXor, kl_emu_bits(v), lane_mask, mask, width));
}

template <typename T>
inline T __shfl_sync(unsigned mask, T v, int src_lane, int width = warpSize) {
  return kl_emu_from_bits<T>(kl_emu::shuffle(kl_emu::Shuffle::kIdx, kl_emu_bits(v), src_lane, mask, width));
}

// The runtime API the sources call (probe.cu, cuda/launch.cuh). One emulated device, number 0.
cudaError_t cudaGetLastError();
cudaError_t cudaPeekAtLastError();
const char* cudaGetErrorString(cudaError_t error);
cudaError_t cudaGetDeviceCount(int* count);
cudaError_t cudaDriverGetVersion(int* version);
cudaError_t cudaSetDevice(int device);
cudaError_t cudaMalloc(void** ptr, size_t bytes);
template <typename T>
inline cudaError_t cudaMalloc(T** ptr, size_t bytes) {
  return cudaMalloc(reinterpret_cast<void**>(ptr), bytes);
}
cudaError_t cudaFree(void* ptr);
cudaError_t cudaMemcpy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind);
// (No cudaLaunchKernel: its void** arguments cannot be typed here; cuda/launch.cuh calls kl_emu::launch.)
