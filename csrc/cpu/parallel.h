// The CPU kernels' thread pool (parallel.cpp): tiles of work on up to `threads` threads.
#pragma once

#include <cstdint>
#include <functional>

namespace kl {

// Runs fn(k) for k in [0, tiles) on up to `threads` threads (the caller is one of them) and
// returns when all are done. Tiles are handed out dynamically: the result must not depend on
// which thread runs which tile (the kernels combine per-tile results in tile order).
void run_tiles(int64_t tiles, int threads, const std::function<void(int64_t)>& fn);

}  // namespace kl
