// Device-side probe of the CUDA extension: reports the runtime/driver state and, when asked,
// launches one tiny kernel so a GPU run proves the embedded cubins/PTX load on that device.
//
// Framework-free: plain CUDA runtime, error codes out, no exceptions cross this boundary.
#include <cuda_runtime.h>

#include "cuda/launch.cuh"
#include "cuda/probe.h"

namespace {

__global__ void probe_kernel(int* out) {
  if (threadIdx.x == 0 && blockIdx.x == 0) *out = 42;
}

}  // namespace

int kl_probe_device_count(int* count) {
  *count = 0;
  return static_cast<int>(cudaGetDeviceCount(count));
}

int kl_probe_driver_version(int* version) {
  *version = 0;
  return static_cast<int>(cudaDriverGetVersion(version));
}

const char* kl_probe_error_string(int code) {
  return cudaGetErrorString(static_cast<cudaError_t>(code));
}

int kl_probe_launch(int device, int* result) {
  *result = 0;
  cudaError_t err = cudaSetDevice(device);
  if (err != cudaSuccess) return static_cast<int>(err);
  int* d_out = nullptr;
  err = cudaMalloc(&d_out, sizeof(int));
  if (err != cudaSuccess) return static_cast<int>(err);
  err = kl::launch(probe_kernel, 1, 32, 0, nullptr, d_out);
  if (err == cudaSuccess) err = cudaMemcpy(result, d_out, sizeof(int), cudaMemcpyDeviceToHost);
  cudaFree(d_out);
  return static_cast<int>(err);
}
