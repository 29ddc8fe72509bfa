// Random programs from a seed: 1-4 data inputs whose shapes broadcast (size-1 dims, 0-dim),
// mostly float32 with some float64, int64 and bool, non-contiguous layouts, some requiring grad;
// then 3-15 ops, each checked with infer() as it is added, so that programs are valid by
// construction. Weights, biases and running statistics are extra inputs created for the op that
// needs them. Three flavors steer the op mix: pointwise chains over broadcast shapes, dense
// layers over (batch, features), and convolutions over (N, C, H, W).
#pragma once

#include <cstdint>

#include "program.h"

namespace kiln::differential {

struct GeneratorOptions {
  int min_ops = 3;
  int max_ops = 15;
};

Program generate_program(uint64_t seed, const GeneratorOptions& options = {});

}  // namespace kiln::differential
