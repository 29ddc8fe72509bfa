// The layout of advanced indexing (index / index_put), shared by the CPU and CUDA kernels: which
// dims the index tensors select, where their broadcast dims land in the result (in place of the
// indexed dims when those are adjacent, else first, as in PyTorch), and each index's strides over
// the result's dims.
#pragma once

#include <functional>
#include <span>
#include <string>
#include <vector>

#include "kiln/tensor.h"

namespace kiln::detail {

struct IndexPlan {
  std::vector<int64_t> dims;                       // the indexed dims of self
  std::vector<Tensor> idx;                         // the checked indices (int64), one per indexed dim
  std::vector<int64_t> result_sizes;
  std::vector<int64_t> self_dim_of;                // per result dim: self's dim, or -1 for an index dim
  std::vector<std::vector<int64_t>> idx_strides;   // per index, per result dim
};

// `check(index, size, dim)` validates an index tensor against a dim of `size` and returns it as
// the device's kernels read it (int64, negatives wrapped); it throws for indices out of range.
IndexPlan plan_index(const Tensor& self, std::span<const Tensor> indices, const std::string& op,
                     const std::function<Tensor(const Tensor& index, int64_t size, int64_t dim)>& check);

}  // namespace kiln::detail
