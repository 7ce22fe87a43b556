// The CPU kernels' parallelism (parallel.cpp): tiles of work on up to `threads` threads.
#pragma once

#include <cstdint>
#include <functional>

namespace kl {

// Runs fn(k) for k in [0, tiles) on up to `threads` threads (the caller is one of them) and
// returns when all are done. Tiles are handed out dynamically: the result must not depend on
// which thread runs which tile (the kernels combine per-tile results in tile order).
// Runs on the OpenMP runtime torch already loaded (its threads, no second runtime), else on a
// persistent pool of our own.
void run_tiles(int64_t tiles, int threads, const std::function<void(int64_t)>& fn);

// Which of the two run_tiles uses in this process: "openmp (torch's)" or "own thread pool".
const char* parallel_runtime();

}  // namespace kl
