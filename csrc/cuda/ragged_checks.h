// Value checks of the ragged geometry on the device (offsets, lengths): one launch writes ok = 1 when
// every value is valid, else 0, and the caller asserts it on the stream (torch._assert_async), so an
// eager call checks its inputs without a host synchronization (kl_kernels/ragged.py).
#pragma once

#include <cstdint>

namespace kl {

// offsets [B + 1] (int64, contiguous): start at 0, non-decreasing, end at total.
int kl_offsets_valid_cuda(uintptr_t offsets, int64_t batch, int64_t total, uintptr_t ok, uintptr_t stream);
// lengths [B] (int64, contiguous): 0 <= lengths[b] <= the bound of sequence b: offsets[b + 1] - offsets[b]
// when offsets is given (a packed batch's prompt_lens), else seq_lengths[b] when given (a padded one's), else
// width (lengths themselves).
int kl_lengths_valid_cuda(uintptr_t lengths, int64_t batch, int64_t width, uintptr_t offsets, uintptr_t seq_lengths,
                          uintptr_t ok, uintptr_t stream);

}  // namespace kl
