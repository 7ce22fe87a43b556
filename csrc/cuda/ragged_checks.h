// Value checks of the ragged geometry on the device (offsets, lengths): one launch writes ok = 1 when
// every value is valid, else 0, and the caller asserts it on the stream (torch._assert_async), so an
// eager call checks its inputs without a host synchronization (kl_kernels/ragged.py).
#pragma once

#include <cstdint>

namespace kl {

// offsets [B + 1] (int64, contiguous): start at 0, non-decreasing, end at total.
int kl_offsets_valid_cuda(uintptr_t offsets, int64_t batch, int64_t total, uintptr_t ok, uintptr_t stream);
// lengths [B] (int64, contiguous): 0 <= lengths[b] <= width.
int kl_lengths_valid_cuda(uintptr_t lengths, int64_t batch, int64_t width, uintptr_t ok, uintptr_t stream);

}  // namespace kl
