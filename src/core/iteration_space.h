// Dim coalescing: the one iteration-space simplifier behind the eager CPU loops
// (kernels/cpu/loops.h), the eager CUDA elementwise kernels (kernels/cuda/elementwise.cpp) and
// both code generators (compiler/codegen/cpp, compiler/codegen/cuda).
//
// Operands (inputs and outputs) walk one shape, each with its own strides (0 where broadcast).
// coalesce_dims drops size-1 dims, orders the rest outermost first, and merges neighbours that
// every operand walks contiguously (and that are both reduced or both kept), so that a dense op in
// row-major or channels-last layout becomes one flat run.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "kiln/array_ref.h"

namespace kiln::detail {

enum class DimOrder : uint8_t {
  // PyTorch's TensorIterator::reorder_dimensions: by operand 0's strides, a later operand where
  // operand 0 is broadcast (an insertion sort that steps over undecided pairs, so row-major stays
  // as it is). The eager kernels' order.
  operands_in_turn,
  // By the strides of operand `lead`, largest outermost; dims it broadcasts keep their place (a
  // stable sort). Generated kernels: a channels-last store is walked N, H, W, C.
  lead_operand,
  // As given.
  as_given,
};

struct IterationSpace {
  std::vector<int64_t> sizes;                 // outermost first
  std::vector<bool> reduced;                  // per dim
  std::vector<std::vector<int64_t>> strides;  // per operand, per dim (the callers' units)
  int64_t numel = 1;                          // of the shape given (0 if any size is 0)
};

// `strides[k]`: operand k's strides over `sizes`, one per dim. `reduced` (optional): per dim,
// whether a reduction sums it; reduced and kept dims never merge. `lead`: the operand that decides
// the order for DimOrder::lead_operand (ignored, order kept, when out of range).
IterationSpace coalesce_dims(IntArrayRef sizes, const std::vector<std::vector<int64_t>>& strides,
                             DimOrder order, size_t lead = 0, const std::vector<bool>& reduced = {});

}  // namespace kiln::detail
