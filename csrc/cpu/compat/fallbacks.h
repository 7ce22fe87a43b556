// Every private internal of another library that the CPU extension uses sits in this folder, one
// header per library (cpython.h, torch_dlpack.h, openmp.h), each version-gated where the library
// has versions we can see at compile time, and each with a safe fallback that the tests run:
// KL_KERNELS_COMPAT_FALLBACKS=cpython,dlpack,openmp (a comma-separated subset, read once per process)
// turns the private paths off. tests/test_compat.py checks that nothing outside csrc/cpu/compat/
// uses them.
#pragma once

#include <cstdlib>
#include <cstring>

namespace kl {
namespace compat {

// Whether the fallback of `name` is forced by KL_KERNELS_COMPAT_FALLBACKS.
inline bool forced_fallback(const char* name) {
  const char* list = std::getenv("KL_KERNELS_COMPAT_FALLBACKS");
  if (list == nullptr) return false;
  const size_t n = std::strlen(name);
  for (const char* p = list; (p = std::strstr(p, name)) != nullptr; p += n) {
    const bool starts = p == list || p[-1] == ',';
    const bool ends = p[n] == '\0' || p[n] == ',';
    if (starts && ends) return true;
  }
  return false;
}

}  // namespace compat
}  // namespace kl
