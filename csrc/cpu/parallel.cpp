// Parallel tiles for the CPU kernels (see parallel.h): on torch's own OpenMP team when the
// process has one, else on a persistent thread pool of our own.
#include "cpu/parallel.h"

#include "cpu/compat/openmp.h"

#include <dlfcn.h>
#include <link.h>
#include <unistd.h>

#include <cstring>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <vector>

namespace kl {
namespace {

// A persistent pool of worker threads: spawning threads on every call costs more than a
// medium-sized batch takes. Calls are serialized (the GIL is released, so two Python threads may
// call at once). After fork() the child gets a fresh pool; the parent's, whose threads do not
// exist in the child, is deliberately leaked rather than destroyed.
class Pool {
 public:
  void run(int helpers, const std::function<void()>& job) {
    std::lock_guard<std::mutex> call(call_mu_);
    {
      std::lock_guard<std::mutex> lock(mu_);
      while (static_cast<int>(threads_.size()) < helpers) {
        const int index = static_cast<int>(threads_.size());
        threads_.emplace_back([this, index] { loop(index); });
      }
      job_ = &job;
      wanted_ = helpers;
      finished_ = 0;
      ++generation_;
    }
    start_cv_.notify_all();
    job();
    std::unique_lock<std::mutex> lock(mu_);
    done_cv_.wait(lock, [&] { return finished_ == wanted_; });
    job_ = nullptr;
  }

 private:
  void loop(int index) {
    uint64_t seen = 0;
    for (;;) {
      const std::function<void()>* job;
      {
        std::unique_lock<std::mutex> lock(mu_);
        start_cv_.wait(lock, [&] { return generation_ != seen && index < wanted_; });
        seen = generation_;
        job = job_;
      }
      (*job)();
      std::lock_guard<std::mutex> lock(mu_);
      if (++finished_ == wanted_) done_cv_.notify_one();
    }
  }

  std::mutex call_mu_, mu_;
  std::condition_variable start_cv_, done_cv_;
  std::vector<std::thread> threads_;
  const std::function<void()>* job_ = nullptr;
  uint64_t generation_ = 0;
  int wanted_ = 0, finished_ = 0;
};

Pool& pool() {
  static std::mutex mu;
  static Pool* instance = nullptr;
  static pid_t owner = 0;
  std::lock_guard<std::mutex> lock(mu);
  if (instance == nullptr || owner != getpid()) {  // first use, or first use in a forked child
    instance = new Pool();                        // never deleted: see the class comment
    owner = getpid();
  }
  return *instance;
}

// torch's CPU build runs its intra-op parallelism on an OpenMP runtime it loads itself (a bundled
// libgomp on Linux wheels). After each parallel region its worker threads spin for a while before
// sleeping; threads of our own started then share the cores with those spinners. On the 2-core CI
// machine that made a kernel launched right after any torch op run 2x slower on 2 threads than on 1.
// Running our tiles as a parallel region of *that* runtime (through GOMP_parallel, the ABI entry
// point of `#pragma omp parallel`, which libgomp and Intel's libiomp both export) hands the work to
// the very threads that are spinning. The runtime is looked up among the libraries already loaded
// (RTLD_NOLOAD): we never load or link an OpenMP runtime of our own.
// (The lookup: compat/openmp.h.)
using compat::GompParallel;
using compat::loaded_gomp_parallel;

// GNU OpenMP is not fork-safe: in a child forked after the parent's OpenMP team exists, the next
// parallel region hangs (torch's own ops do too). The process that loaded this module keeps using
// torch's runtime; a forked child (another pid) uses our own pool, which it starts afresh.
const pid_t loading_process = getpid();

struct TileJob {
  std::atomic<int64_t> next{0};
  int64_t tiles = 0;
  const std::function<void(int64_t)>* fn = nullptr;
};

// The calling thread's work for its next run_tiles (run_with_caller_work). Thread-local, so in a
// parallel region only the thread that set it (the region's caller, thread 0) sees it.
thread_local const std::function<void()>* caller_work = nullptr;

// Runs this thread's caller work, if any, once.
void run_caller_work() {
  if (caller_work == nullptr) return;
  const std::function<void()>* work = caller_work;
  caller_work = nullptr;  // before running it: the work may itself launch a kernel
  (*work)();
}

void tile_worker(void* data) {
  run_caller_work();
  TileJob* job = static_cast<TileJob*>(data);
  for (int64_t k = job->next.fetch_add(1); k < job->tiles; k = job->next.fetch_add(1)) (*job->fn)(k);
}

}  // namespace

const char* parallel_runtime() {
  return getpid() == loading_process && loaded_gomp_parallel() ? "openmp (torch's)" : "own thread pool";
}

void run_tiles(int64_t tiles, int threads, const std::function<void(int64_t)>& fn) {
  threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(threads, tiles)));
  if (threads == 1) {
    run_caller_work();
    for (int64_t k = 0; k < tiles; ++k) fn(k);
    return;
  }
  TileJob job;
  job.tiles = tiles;
  job.fn = &fn;
  GompParallel gomp = getpid() == loading_process ? loaded_gomp_parallel() : nullptr;
  if (gomp != nullptr) {
    gomp(&tile_worker, &job, static_cast<unsigned>(threads), 0);  // returns when the team is done
    return;
  }
  const std::function<void()> worker = [&job]() { tile_worker(&job); };
  pool().run(threads - 1, worker);
}

int run_with_caller_work(const std::function<void()>& work, const std::function<int()>& body) {
  caller_work = &work;
  int code;
  try {
    code = body();
  } catch (...) {
    caller_work = nullptr;
    throw;
  }
  run_caller_work();  // body returned before any run_tiles
  return code;
}

}  // namespace kl
