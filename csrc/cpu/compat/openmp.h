// The OpenMP runtime torch loaded (libgomp or Intel's libiomp), found among the loaded libraries
// (RTLD_NOLOAD: never loaded or linked by us) and entered through GOMP_parallel, the ABI entry point
// of `#pragma omp parallel` that both export (why: parallel.cpp). Not a versioned API of torch's;
// when no such runtime is loaded, or with KL_KERNELS_COMPAT_FALLBACKS=openmp, this gives null and
// parallel.cpp runs its own thread pool (same results: the tiles are fixed).
#pragma once

#include <dlfcn.h>
#include <link.h>

#include <cstring>

#include "cpu/compat/fallbacks.h"

namespace kl {
namespace compat {

using GompParallel = void (*)(void (*)(void*), void*, unsigned, unsigned);

inline GompParallel loaded_gomp_parallel() {
  static const GompParallel fn = [] {
    GompParallel found = nullptr;
    if (forced_fallback("openmp")) return found;
    dl_iterate_phdr(
        [](dl_phdr_info* info, size_t, void* out) -> int {
          const char* name = info->dlpi_name;
          if (name == nullptr || (std::strstr(name, "libgomp") == nullptr && std::strstr(name, "libiomp") == nullptr))
            return 0;
          void* handle = dlopen(name, RTLD_NOW | RTLD_NOLOAD);
          if (handle == nullptr) return 0;
          void* sym = dlsym(handle, "GOMP_parallel");
          dlclose(handle);  // drops the reference RTLD_NOLOAD took; the library stays loaded
          if (sym == nullptr) return 0;
          *static_cast<GompParallel*>(out) = reinterpret_cast<GompParallel>(sym);
          return 1;
        },
        &found);
    return found;
  }();
  return fn;
}

}  // namespace compat
}  // namespace kl
