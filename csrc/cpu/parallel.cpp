// A persistent thread pool for the CPU kernels (see parallel.h).
#include "cpu/parallel.h"

#include <unistd.h>

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

}  // namespace

void run_tiles(int64_t tiles, int threads, const std::function<void(int64_t)>& fn) {
  threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(threads, tiles)));
  if (threads == 1) {
    for (int64_t k = 0; k < tiles; ++k) fn(k);
    return;
  }
  std::atomic<int64_t> next{0};
  const std::function<void()> worker = [&]() {
    for (int64_t k = next.fetch_add(1); k < tiles; k = next.fetch_add(1)) fn(k);
  };
  pool().run(threads - 1, worker);
}

}  // namespace kl
