// Launching the CUDA kernels the kiln backend generates (codegen/cuda/cuda_codegen.h): how many
// threads a block and how many blocks.
//
// Default shape: 256 threads a block (the kernels' __launch_bounds__), one block per 256 elements
// (pointwise) or per kept position (reductions, one block each), at most 16 (pointwise) or 32
// (reductions) blocks per SM; grid-stride loops cover the rest. Under max_autotune the first
// launch of each generated function, outside a CUDA graph recording, times the other shapes
// (128 threads; 4, 16 or unbounded blocks per SM; reductions also 32 and 64 threads) on the real
// inputs, writing copies of the buffers the kernel writes, and keeps the fastest for the
// process's lifetime (cuda::detail::fastest: the default stays unless beaten by 3%).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "kiln/tensor.h"

namespace kiln::compiler::runtime {

struct GeneratedKernel {
  void* function = nullptr;  // CUfunction
  int device = 0;
  int64_t numel = 0;         // work items: elements, or a reduction's kept positions
  bool per_block = false;    // a reduction: one block per kept position
  std::vector<size_t> written;  // the buffer slots the kernel stores into
};

// Launches `k` on the device's current stream with the parameter block `params` (8-byte slots,
// buffer pointers first). With `tune`, its shape is max_autotune's; buffer slot s holds the
// tensor env[bindings[s]] (timing writes copies of those in `k.written`).
void launch_generated(const GeneratedKernel& k, std::vector<uint64_t>& params, bool tune,
                      const std::vector<Tensor>& env, const std::vector<int>& bindings);

// Generated functions whose launch shape max_autotune chose by timing since the process began.
int64_t generated_launches_timed();

// Tests: every generated kernel launches with `block` threads (a power of two up to 256) and at
// most `per_sm` blocks per SM (0: unbounded), tuned or not; block 0 restores the usual shapes.
void force_launch_shape_for_test(int block, int per_sm);
// Tests: forgets max_autotune's choices, so that the next tuned launches time again.
void forget_tuned_launch_shapes_for_test();

}  // namespace kiln::compiler::runtime
