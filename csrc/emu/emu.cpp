// The engine of the CUDA emulation declared in cuda_runtime.h: fibers per CUDA thread, block and
// warp barriers, shuffles, launch checks, the runtime's last error.
//
// Scheduling: a block's fibers run round-robin on the launching OS thread, each until it blocks at a
// barrier or exits. A fiber whose barrier has not completed is skipped without a switch. A sweep in
// which no fiber can run while some have not exited is a deadlock (a barrier that not every thread
// reaches): the process aborts with a report, as a hung GPU kernel would never report anything.
#include "cuda_runtime.h"

#include <dlfcn.h>
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <utility>
#include <mutex>
#include <string>
#include <vector>

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#define KL_EMU_ASAN 1
#endif

uint3 threadIdx{0, 0, 0};
uint3 blockIdx{0, 0, 0};
dim3 blockDim;
dim3 gridDim;

namespace kl_emu {
namespace {

thread_local cudaError_t last_error = cudaSuccess;
cudaError_t injected_launch_error = cudaSuccess;  // fail_next_launch (guarded by the launch mutex)
Counters totals{0, 0, 0, 0, 0};

std::mutex& launch_mutex() {
  static std::mutex m;
  return m;
}

constexpr size_t kStackBytes = 256 * 1024;  // per fiber; ASan's redzones need the room
constexpr int kMaxThreads = 1024;

// Fiber stacks, kept across launches, each with a PROT_NONE guard page below it (an overflow faults
// instead of corrupting a neighbour). Pages are touched lazily: ~2 pages per fiber in practice.
struct Stacks {
  std::vector<char*> bases;
  char* get(size_t i) {
    while (bases.size() <= i) {
      const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
      void* p = mmap(nullptr, kStackBytes + page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (p == MAP_FAILED) return nullptr;
      mprotect(p, page, PROT_NONE);
      bases.push_back(static_cast<char*>(p) + page);
    }
    return bases[i];
  }
};

struct Barrier {
  int expected = 0, arrived = 0;
  int64_t generation = 0;
};

struct Fiber {
  ucontext_t context;
  char* stack = nullptr;
  Barrier* waiting = nullptr;  // the barrier this fiber waits at (nullptr: runnable)
  int64_t generation = 0;      // the generation it waits to complete
  const char* where = nullptr;
  bool done = false;
#if defined(KL_EMU_ASAN)
  void* fake_stack = nullptr;
#endif
};

struct Warp {
  Barrier barrier;
  uint64_t slot[2][32];
  int64_t round = 0;  // shuffles completed: slot[round & 1] is the current exchange
};

// The block being run (one at a time, under the launch mutex).
struct Block {
  const LaunchConfig* config = nullptr;
  void (*body)(void*) = nullptr;
  void* closure = nullptr;
  std::vector<Fiber> fibers;
  std::vector<Warp> warps;
  std::vector<unsigned> order;  // of the current sweep
  Barrier block_barrier;
  int current = -1;
  ucontext_t scheduler;
#if defined(KL_EMU_ASAN)
  void* scheduler_fake_stack = nullptr;
  const void* scheduler_stack_bottom = nullptr;
  size_t scheduler_stack_size = 0;
#endif
};

Block* running = nullptr;
Stacks stacks;

[[noreturn]] void fail(const std::string& message) {
  std::fprintf(stderr, "kl_emu: %s\n", message.c_str());
  std::fflush(stderr);
  std::abort();
}

// The order in which a sweep resumes the runnable fibers. Between two barriers a GPU runs the threads
// of a block in no defined order; a fixed order here would hide a missing barrier whenever writers
// happen to run before readers. KL_EMU_SCHEDULE: "random" (default: a new permutation per sweep, from
// a generator seeded with KL_EMU_SEED, so a process's runs are reproducible), "forward", "reverse".
enum class Schedule { kRandom, kForward, kReverse };

struct Scheduling {
  Schedule kind = Schedule::kRandom;
  uint64_t state = 0x9e3779b97f4a7c15ull;
  Scheduling() {
    const char* k = std::getenv("KL_EMU_SCHEDULE");
    if (k && std::strcmp(k, "forward") == 0) kind = Schedule::kForward;
    else if (k && std::strcmp(k, "reverse") == 0) kind = Schedule::kReverse;
    else if (k && *k && std::strcmp(k, "random") != 0) fail(std::string("KL_EMU_SCHEDULE must be random, forward or reverse, got ") + k);
    if (const char* seed = std::getenv("KL_EMU_SEED")) state ^= std::strtoull(seed, nullptr, 0) * 0xbf58476d1ce4e5b9ull;
    if (state == 0) state = 1;
  }
  uint64_t next() {  // xorshift64*
    state ^= state >> 12;
    state ^= state << 25;
    state ^= state >> 27;
    return state * 0x2545f4914f6cdd1dull;
  }
};

Scheduling& scheduling() {
  static Scheduling s;
  return s;
}

void next_sweep(std::vector<unsigned>& order) {
  Scheduling& s = scheduling();
  const size_t n = order.size();
  if (s.kind == Schedule::kForward) return;  // order stays 0..n-1
  if (s.kind == Schedule::kReverse) {
    for (size_t t = 0; t < n; ++t) order[t] = static_cast<unsigned>(n - 1 - t);
    return;
  }
  for (size_t i = n; i > 1; --i) std::swap(order[i - 1], order[s.next() % i]);  // Fisher-Yates
}

std::string kernel_name(const void* kernel) {
  Dl_info info{};
  char buf[512];
  if (kernel && dladdr(kernel, &info) && info.dli_fname) {
    const uintptr_t offset = reinterpret_cast<uintptr_t>(kernel) - reinterpret_cast<uintptr_t>(info.dli_fbase);
    std::snprintf(buf, sizeof buf, "%s at %s+0x%zx (addr2line -Cfe %s 0x%zx)", info.dli_sname ? info.dli_sname : "kernel",
                  info.dli_fname, static_cast<size_t>(offset), info.dli_fname, static_cast<size_t>(offset));
    return buf;
  }
  std::snprintf(buf, sizeof buf, "kernel at %p", kernel);
  return buf;
}

Fiber& self() {
  if (running == nullptr || running->current < 0) fail("a barrier or shuffle was called outside a kernel");
  return running->fibers[static_cast<size_t>(running->current)];
}

// Back to the scheduler until `barrier` completes its current generation (the caller arrived).
void block_on(Barrier& barrier, const char* where) {
  Fiber& f = self();
  f.waiting = &barrier;
  f.generation = barrier.generation;
  f.where = where;
#if defined(KL_EMU_ASAN)
  __sanitizer_start_switch_fiber(&f.fake_stack, running->scheduler_stack_bottom, running->scheduler_stack_size);
#endif
  swapcontext(&f.context, &running->scheduler);
#if defined(KL_EMU_ASAN)
  __sanitizer_finish_switch_fiber(f.fake_stack, &running->scheduler_stack_bottom, &running->scheduler_stack_size);
#endif
}

void arrive(Barrier& barrier, const char* where) {
  if (++barrier.arrived == barrier.expected) {  // the last one releases the others and goes on
    barrier.arrived = 0;
    ++barrier.generation;
    return;
  }
  block_on(barrier, where);
}

void fiber_main() {
  Block* b = running;
#if defined(KL_EMU_ASAN)
  __sanitizer_finish_switch_fiber(nullptr, &b->scheduler_stack_bottom, &b->scheduler_stack_size);
#endif
  b->body(b->closure);
  Fiber& f = b->fibers[static_cast<size_t>(b->current)];
  f.done = true;
  f.waiting = nullptr;
#if defined(KL_EMU_ASAN)
  __sanitizer_start_switch_fiber(nullptr, b->scheduler_stack_bottom, b->scheduler_stack_size);  // never back
#endif
  setcontext(&b->scheduler);
}

[[noreturn]] void report_deadlock(const Block& b) {
  const unsigned n = static_cast<unsigned>(b.fibers.size());
  unsigned exited = 0, at_block = 0;
  std::string warps;
  for (unsigned t = 0; t < n; ++t) {
    const Fiber& f = b.fibers[t];
    if (f.done) ++exited;
    else if (f.waiting == &b.block_barrier) ++at_block;
  }
  for (size_t w = 0; w < b.warps.size(); ++w) {
    if (b.warps[w].barrier.arrived > 0)
      warps += " warp " + std::to_string(w) + ": " + std::to_string(b.warps[w].barrier.arrived) + " of " +
               std::to_string(b.warps[w].barrier.expected) + " lanes at a shuffle;";
  }
  std::string first_waiting;
  for (unsigned t = 0; t < n; ++t) {
    if (!b.fibers[t].done) {
      first_waiting = "thread " + std::to_string(t) + " waits at " + b.fibers[t].where;
      break;
    }
  }
  fail("deadlock: a barrier that not every thread reaches (divergent __syncthreads or shuffle) in " +
       kernel_name(b.config->kernel) + ", block " + std::to_string(blockIdx.x) + " of " + std::to_string(gridDim.x) +
       ": " + std::to_string(at_block) + " of " + std::to_string(n) + " threads at __syncthreads, " +
       std::to_string(exited) + " exited;" + warps + " " + first_waiting);
}

void run_block(Block& b) {
  const size_t n = b.fibers.size();
  for (size_t t = 0; t < n; ++t) {
    Fiber& f = b.fibers[t];
    f = Fiber{};
    f.stack = stacks.get(t);
    if (f.stack == nullptr) fail("out of memory for fiber stacks");
#if defined(KL_EMU_ASAN)
    ASAN_UNPOISON_MEMORY_REGION(f.stack, kStackBytes);  // left poisoned by an earlier fiber's frames
#endif
    getcontext(&f.context);
    f.context.uc_stack.ss_sp = f.stack;
    f.context.uc_stack.ss_size = kStackBytes;
    f.context.uc_link = nullptr;
    makecontext(&f.context, fiber_main, 0);
  }
  size_t live = n;
  std::vector<unsigned>& order = b.order;
  order.resize(n);
  for (size_t t = 0; t < n; ++t) order[t] = static_cast<unsigned>(t);
  while (live > 0) {
    bool ran = false;
    next_sweep(order);
    for (const unsigned t : order) {
      Fiber& f = b.fibers[t];
      if (f.done || (f.waiting != nullptr && f.waiting->generation == f.generation)) continue;
      f.waiting = nullptr;
      b.current = static_cast<int>(t);
      threadIdx = uint3{static_cast<unsigned>(t) % blockDim.x, static_cast<unsigned>(t) / blockDim.x % blockDim.y,
                        static_cast<unsigned>(t) / (blockDim.x * blockDim.y)};
#if defined(KL_EMU_ASAN)
      __sanitizer_start_switch_fiber(&b.scheduler_fake_stack, f.stack, kStackBytes);
#endif
      swapcontext(&b.scheduler, &f.context);
#if defined(KL_EMU_ASAN)
      __sanitizer_finish_switch_fiber(b.scheduler_fake_stack, nullptr, nullptr);
#endif
      b.current = -1;
      ran = true;
      if (f.done) --live;
    }
    if (!ran) report_deadlock(b);
  }
}

cudaError_t check(const LaunchConfig& c) {
  const uint64_t threads = static_cast<uint64_t>(c.block.x) * c.block.y * c.block.z;
  if (c.grid.x == 0 || c.grid.y == 0 || c.grid.z == 0 || c.grid.x > 0x7fffffffu || c.grid.y > 65535 ||
      c.grid.z > 65535)
    return cudaErrorInvalidConfiguration;
  if (threads == 0 || threads > kMaxThreads || c.block.x > 1024 || c.block.y > 1024 || c.block.z > 64)
    return cudaErrorInvalidConfiguration;
  if (c.shared_bytes > 48 * 1024) return cudaErrorInvalidValue;  // dynamic shared memory without the opt-in
  return cudaSuccess;
}

}  // namespace

cudaError_t run(const LaunchConfig& config, void (*body)(void*), void* closure) {
  std::lock_guard<std::mutex> guard(launch_mutex());
  cudaError_t err = check(config);
  if (err == cudaSuccess && injected_launch_error != cudaSuccess) {
    err = injected_launch_error;
    injected_launch_error = cudaSuccess;
  }
  if (err != cudaSuccess) {
    last_error = err;
    return err;
  }
  const unsigned n = config.block.x * config.block.y * config.block.z;
  Block b;
  b.config = &config;
  b.body = body;
  b.closure = closure;
  b.fibers.resize(n);
  b.warps.resize((n + 31) / 32);
  for (size_t w = 0; w < b.warps.size(); ++w) {
    b.warps[w].barrier.expected = static_cast<int>(n - 32 * w < 32 ? n - 32 * w : 32);
  }
  b.block_barrier.expected = static_cast<int>(n);
  Block* const outer = running;
  if (outer != nullptr) fail("a kernel launched from inside a kernel (dynamic parallelism is not emulated)");
  running = &b;
  gridDim = config.grid;
  blockDim = config.block;
  ++totals.launches;
  for (unsigned z = 0; z < config.grid.z; ++z) {
    for (unsigned y = 0; y < config.grid.y; ++y) {
      for (unsigned x = 0; x < config.grid.x; ++x) {
        blockIdx = uint3{x, y, z};
        run_block(b);
        ++totals.blocks;
        totals.threads += n;
      }
    }
  }
  running = nullptr;
  return cudaSuccess;
}

void syncthreads() {
  ++totals.barriers;
  arrive(running->block_barrier, "__syncthreads");
}

uint64_t shuffle(Shuffle kind, uint64_t bits, int arg, unsigned mask, int width) {
  Fiber& f = self();
  (void)f;
  const unsigned t = static_cast<unsigned>(running->current);
  Warp& w = running->warps[t / 32];
  if (mask != 0xffffffffu || width != 32 || w.barrier.expected != 32)
    fail("shuffle with mask 0x" + [&] { char s[16]; std::snprintf(s, sizeof s, "%x", mask); return std::string(s); }() +
         ", width " + std::to_string(width) + " in a warp of " + std::to_string(w.barrier.expected) +
         " threads: only full warps with the full mask are emulated");
  ++totals.shuffles;
  const int lane = static_cast<int>(t % 32);
  const int parity = static_cast<int>(w.round & 1);
  w.slot[parity][lane] = bits;
  // The last lane to arrive completes the round; every lane reads the slots of this round, which no
  // lane overwrites before the next round's barrier (the other parity is written in between).
  if (++w.barrier.arrived == w.barrier.expected) {
    w.barrier.arrived = 0;
    ++w.barrier.generation;
    ++w.round;
  } else {
    block_on(w.barrier, "a warp shuffle");
  }
  int src = lane;
  switch (kind) {
    case Shuffle::kUp: src = lane - arg >= 0 ? lane - arg : lane; break;
    case Shuffle::kDown: src = lane + arg < 32 ? lane + arg : lane; break;
    case Shuffle::kXor: src = (lane ^ arg) & 31; break;
    case Shuffle::kIdx: src = arg & 31; break;
  }
  return w.slot[parity][src];
}

void record_error(cudaError_t code) { last_error = code; }

void fail_next_launch(cudaError_t code) {
  std::lock_guard<std::mutex> guard(launch_mutex());
  injected_launch_error = code;
}

Counters counters() {
  std::lock_guard<std::mutex> guard(launch_mutex());
  return totals;
}

}  // namespace kl_emu

cudaError_t cudaGetLastError() {
  const cudaError_t e = kl_emu::last_error;
  kl_emu::last_error = cudaSuccess;
  return e;
}

cudaError_t cudaPeekAtLastError() { return kl_emu::last_error; }

const char* cudaGetErrorString(cudaError_t error) {
  switch (error) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorMemoryAllocation: return "out of memory";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument";
    case cudaErrorInvalidDeviceFunction: return "invalid device function";
    case cudaErrorNoDevice: return "no CUDA-capable device is detected";
    case cudaErrorInvalidDevice: return "invalid device ordinal";
    case cudaErrorLaunchOutOfResources: return "too many resources requested for launch";
    default: return "unknown error";
  }
}

cudaError_t cudaGetDeviceCount(int* count) {
  *count = 1;
  return cudaSuccess;
}

cudaError_t cudaDriverGetVersion(int* version) {
  *version = 0;  // no driver
  return cudaSuccess;
}

cudaError_t cudaSetDevice(int device) {
  if (device == 0) return cudaSuccess;
  kl_emu::last_error = cudaErrorInvalidDevice;
  return cudaErrorInvalidDevice;
}

cudaError_t cudaMalloc(void** ptr, size_t bytes) {
  *ptr = std::malloc(bytes ? bytes : 1);
  if (*ptr == nullptr) return kl_emu::last_error = cudaErrorMemoryAllocation;
  std::memset(*ptr, 0xff, bytes);  // fresh device memory holds garbage: NaN here
  return cudaSuccess;
}

cudaError_t cudaFree(void* ptr) {
  std::free(ptr);
  return cudaSuccess;
}

cudaError_t cudaMemcpy(void* dst, const void* src, size_t bytes, cudaMemcpyKind) {
  std::memcpy(dst, src, bytes);
  return cudaSuccess;
}
