// The class-index check of the CPU nll_loss kernels (forward and backward).
#pragma once

#include <atomic>
#include <string>

#include "kernels/cpu/loops.h"

namespace kiln::cpu {

// Throws IndexError naming the first of the `positions` targets at `tp` outside [0, classes) that
// is not ignore_index. A parallel scan first: the serial pass runs only when one is bad.
inline void check_targets(const int64_t* tp, int64_t positions, int64_t classes, int64_t ignore_index,
                          const char* op) {
  std::atomic<bool> bad{false};
  parallel_for(positions, kGrainSize, [&](int64_t b, int64_t e) {
    bool any = false;
    for (int64_t p = b; p < e; ++p) any |= tp[p] != ignore_index && (tp[p] < 0 || tp[p] >= classes);
    if (any) bad.store(true, std::memory_order_relaxed);
  });
  if (!bad.load()) return;
  for (int64_t p = 0; p < positions; ++p) {
    KILN_CHECK(tp[p] == ignore_index || (tp[p] >= 0 && tp[p] < classes), IndexError,
               std::string("[kiln::") + op + "] Target " + std::to_string(tp[p]) + " is out of bounds (" +
                   std::to_string(classes) + " classes).");
  }
}

}  // namespace kiln::cpu
