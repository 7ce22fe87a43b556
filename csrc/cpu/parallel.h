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

// Runs body() (a kernel) and, on the calling thread, `work` while the kernel's first run_tiles
// call runs: the calling thread does `work` first, then joins the other threads on the tiles
// they have not taken yet. So the kernel overlaps work the caller would otherwise do after it
// (Python bookkeeping on outputs that need not be written yet), and every thread still ends on
// the tiles. `work` runs exactly once, also when body never reaches run_tiles (after it, then).
// Returns body's result.
int run_with_caller_work(const std::function<void()>& work, const std::function<int()>& body);

}  // namespace kl
