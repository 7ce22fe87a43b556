// Facts of an int64 vector in host memory that the offsets / lengths checks read: the value checks
// of kl_kernels.ragged's check_offsets / check_lengths (through module.cpp's int64_facts).
#pragma once

#include <algorithm>
#include <cstdint>

namespace kl {

struct Int64Facts {
  int64_t first, last, lo, hi;
  bool non_decreasing;
};

// Of v[0, n), n >= 1.
inline Int64Facts int64_facts(const int64_t* v, int64_t n) {
  Int64Facts f{v[0], v[n - 1], v[0], v[0], true};
  for (int64_t i = 1; i < n; ++i) {
    f.lo = std::min(f.lo, v[i]);
    f.hi = std::max(f.hi, v[i]);
    f.non_decreasing &= v[i] >= v[i - 1];
  }
  return f;
}

}  // namespace kl
