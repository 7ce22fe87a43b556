// Self-test kernels of the CUDA emulation (selftest.cu), reached from bind.cpp.
#pragma once

#include <cstddef>

namespace kl_emu {

enum ScanVariant { kCorrect = 0, kNoBarrier = 1, kDivergentBarrier = 2, kDivergentShuffle = 3, kPartialMask = 4 };

// Each returns the launch's cudaError_t (0: ran), or -1 for bad arguments (n outside [0, 256]).
int selftest_scan(int variant, const double* in, double* out, int n);
int selftest_shuffles(const double* in, double* out, int n);  // out: 4 n values
int selftest_launch(unsigned grid_x, unsigned grid_y, unsigned block_x, unsigned block_y, unsigned block_z,
                    size_t smem, int* out);

}  // namespace kl_emu
