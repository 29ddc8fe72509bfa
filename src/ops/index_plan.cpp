#include "ops/index_plan.h"

#include <algorithm>

#include "core/shape.h"

namespace kiln::detail {

IndexPlan plan_index(const Tensor& self, std::span<const Tensor> indices, const std::string& op,
                     const std::function<Tensor(const Tensor& index, int64_t size, int64_t dim)>& check) {
  IndexPlan plan;
  bool adjacent = true;
  for (size_t i = 0; i < indices.size(); ++i) {
    if (!indices[i].defined()) continue;
    int64_t d = static_cast<int64_t>(i);
    if (!plan.dims.empty() && plan.dims.back() != d - 1) adjacent = false;
    plan.dims.push_back(d);
    plan.idx.push_back(check(indices[i], self.sizes()[d], d));
  }
  std::vector<int64_t> bshape;
  for (const Tensor& t : plan.idx) bshape = broadcast_sizes(bshape, t.sizes(), op);
  const int64_t nb = static_cast<int64_t>(bshape.size());
  auto is_indexed = [&](int64_t d) { return std::find(plan.dims.begin(), plan.dims.end(), d) != plan.dims.end(); };
  int64_t bpos = 0;
  if (plan.dims.empty()) {
    for (int64_t d = 0; d < self.dim(); ++d) plan.self_dim_of.push_back(d);
  } else if (adjacent) {
    for (int64_t d = 0; d < plan.dims.front(); ++d) plan.self_dim_of.push_back(d);
    bpos = static_cast<int64_t>(plan.self_dim_of.size());
    for (int64_t b = 0; b < nb; ++b) plan.self_dim_of.push_back(-1);
    for (int64_t d = plan.dims.back() + 1; d < self.dim(); ++d) plan.self_dim_of.push_back(d);
  } else {
    for (int64_t b = 0; b < nb; ++b) plan.self_dim_of.push_back(-1);
    for (int64_t d = 0; d < self.dim(); ++d)
      if (!is_indexed(d)) plan.self_dim_of.push_back(d);
  }
  const int64_t nr = static_cast<int64_t>(plan.self_dim_of.size());
  for (int64_t r = 0; r < nr; ++r)
    plan.result_sizes.push_back(plan.self_dim_of[r] >= 0 ? self.sizes()[plan.self_dim_of[r]] : bshape[r - bpos]);
  for (const Tensor& t : plan.idx) {
    std::vector<int64_t> bs = broadcast_strides(t.sizes(), t.strides(), bshape);
    std::vector<int64_t> st(nr, 0);
    for (int64_t b = 0; b < nb; ++b) st[bpos + b] = bs[b];
    plan.idx_strides.push_back(std::move(st));
  }
  return plan;
}

}  // namespace kiln::detail
