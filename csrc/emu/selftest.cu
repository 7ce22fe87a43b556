// Kernels that test the CUDA emulation itself (compiled only into kl_kernels._cuda_emu): a block-wide
// scan built like the real kernels' (tiles.cuh: warp shuffles, warp totals in shared memory, a
// barrier), once correct and once each with a barrier or a shuffle wrong, so tests can show that the
// emulation catches what such a mistake would do on a GPU; the shuffle variants against their
// definitions; and a trivial kernel for the launch checks.
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/launch.cuh"
#include "emu/selftest.h"

namespace kl_emu {
namespace {

constexpr int kBlock = 256;
constexpr int kWarpsPerBlock = kBlock / 32;

// Inclusive scan of in[0, n) (n <= 256, one element per thread) into out.
template <int V>
__global__ void scan_kernel(const double* in, double* out, int n) {
  __shared__ double warp_total[kWarpsPerBlock];
  const int t = static_cast<int>(threadIdx.x), lane = t & 31, warp = t >> 5;
  double v = t < n ? in[t] : 0.0;
  if (V == kDivergentShuffle && lane >= 16) {
    // half the warp skips the shuffles: the other half waits for lanes that never come
  } else {
    for (int d = 1; d < 32; d <<= 1) {
      const double o = __shfl_up_sync(0xffffffffu, v, d);
      if (lane >= d) v += o;
    }
  }
  if (lane == 31) warp_total[warp] = v;
  if (V == kDivergentBarrier) {
    if (t != 0) __syncthreads();  // thread 0 never arrives
  } else if (V != kNoBarrier) {
    __syncthreads();
  }
  double before = 0.0;
  for (int w = 0; w < warp; ++w) before += warp_total[w];
  if (t < n) out[t] = v + before;
}

// out[4 * t + k]: shuffles of in[t] by the four kinds (up 3, down 5, xor 7, from lane (7 lane + 3) % 32).
__global__ void shuffle_kernel(const double* in, double* out, int n) {
  const int t = static_cast<int>(threadIdx.x), lane = t & 31;
  const double v = t < n ? in[t] : -1.0;
  const double up = __shfl_up_sync(0xffffffffu, v, 3);
  const double down = __shfl_down_sync(0xffffffffu, v, 5);
  const double x = __shfl_xor_sync(0xffffffffu, v, 7);
  const double idx = __shfl_sync(0xffffffffu, v, (7 * lane + 3) % 32);
  if (t < n) {
    out[4 * t] = up;
    out[4 * t + 1] = down;
    out[4 * t + 2] = x;
    out[4 * t + 3] = idx;
  }
}

__global__ void partial_mask_kernel(double* out) {
  out[threadIdx.x] = __shfl_up_sync(0x0000ffffu, 1.0, 1);
}

__global__ void empty_kernel(int* out) {
  if (threadIdx.x == 0 && blockIdx.x == 0) *out = 1;
}

}  // namespace

int selftest_scan(int variant, const double* in, double* out, int n) {
  if (n < 0 || n > kBlock) return -1;
  cudaError_t err;
  switch (variant) {
    case kCorrect: err = kl::launch(scan_kernel<kCorrect>, 1, kBlock, 0, nullptr, in, out, n); break;
    case kNoBarrier: err = kl::launch(scan_kernel<kNoBarrier>, 1, kBlock, 0, nullptr, in, out, n); break;
    case kDivergentBarrier: err = kl::launch(scan_kernel<kDivergentBarrier>, 1, kBlock, 0, nullptr, in, out, n); break;
    case kDivergentShuffle: err = kl::launch(scan_kernel<kDivergentShuffle>, 1, kBlock, 0, nullptr, in, out, n); break;
    case kPartialMask: err = kl::launch(partial_mask_kernel, 1, 32, 0, nullptr, out); break;
    default: return -1;
  }
  return static_cast<int>(err);
}

int selftest_shuffles(const double* in, double* out, int n) {
  if (n < 0 || n > kBlock) return -1;
  return static_cast<int>(kl::launch(shuffle_kernel, 1, kBlock, 0, nullptr, in, out, n));
}

int selftest_launch(unsigned grid_x, unsigned grid_y, unsigned block_x, unsigned block_y, unsigned block_z,
                    size_t smem, int* out) {
  return static_cast<int>(
      kl::launch(empty_kernel, dim3(grid_x, grid_y), dim3(block_x, block_y, block_z), smem, nullptr, out));
}

}  // namespace kl_emu
