// Value checks of the ragged geometry on the device (offsets, lengths): one launch records the first bad
// value in the device error word `errors` (cuda/errors.cuh, kl_kernels/device_errors.py) as argument `arg`
// (common/codes.h's ArgCode), never asserting, so an eager call checks its inputs without a host
// synchronization and a bad value leaves the CUDA context usable (kl_kernels/ragged.py).
#pragma once

#include <cstdint>

namespace kl {

// offsets [B + 1] (int64, contiguous): start at 0, non-decreasing, end at total.
int kl_offsets_valid_cuda(uintptr_t offsets, int64_t batch, int64_t total, uintptr_t errors, int32_t arg,
                          uintptr_t stream);
// lengths [B] (int64, contiguous): 0 <= lengths[b] <= the bound of sequence b: offsets[b + 1] - offsets[b]
// when offsets is given (a packed batch's prompt_lens), else seq_lengths[b] when given (a padded one's), else
// width (lengths themselves). bound_kind: -1 for lengths (bounded by the width), else the index of the
// prompt_lens' bound in kl_kernels.device_errors.SEQUENCE_BOUNDS.
int kl_lengths_valid_cuda(uintptr_t lengths, int64_t batch, int64_t width, uintptr_t offsets, uintptr_t seq_lengths,
                          uintptr_t errors, int32_t arg, int32_t bound_kind, uintptr_t stream);

// The device error word of `device`: (host address, device address) of kErrorWordSlots zeroed int64 in
// mapped, portable pinned memory, allocated once per call (the Python side keeps one per device); (0, 0)
// when cudaHostAlloc fails.
void kl_error_word_alloc(int device, uintptr_t* host, uintptr_t* dev);

}  // namespace kl
