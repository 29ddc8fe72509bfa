// Dim coalescing (see iteration_space.h).
#include "core/iteration_space.h"

#include <algorithm>
#include <utility>

namespace kiln::detail {

namespace {

// TensorIterator's insertion sort: +1 when dim a (now outside b) belongs inside it, -1 when it
// belongs outside, 0 when no operand knows (both broadcast, or equal strides).
void order_operands_in_turn(std::vector<size_t>& order, const std::vector<std::vector<int64_t>>& strides) {
  auto compare = [&](size_t a, size_t b) {
    for (const std::vector<int64_t>& s : strides) {
      const int64_t sa = s[a], sb = s[b];
      if (sa == 0 || sb == 0 || sa == sb) continue;
      return sa < sb ? 1 : -1;
    }
    return 0;
  };
  for (size_t i = 1; i < order.size(); ++i) {
    size_t moving = i;
    for (size_t j = i; j-- > 0;) {
      const int c = compare(order[j], order[moving]);
      if (c > 0) {
        std::swap(order[j], order[moving]);
        moving = j;
      } else if (c < 0) {
        break;
      }
    }
  }
}

void order_by_lead(std::vector<size_t>& order, const std::vector<int64_t>& lead) {
  std::vector<size_t> placed;  // dims with a stride in the lead operand, to be sorted
  for (size_t d : order)
    if (lead[d] != 0) placed.push_back(d);
  std::stable_sort(placed.begin(), placed.end(), [&](size_t a, size_t b) { return lead[a] > lead[b]; });
  for (size_t i = 0, j = 0; i < order.size(); ++i)
    if (lead[order[i]] != 0) order[i] = placed[j++];
}

}  // namespace

IterationSpace coalesce_dims(IntArrayRef sizes, const std::vector<std::vector<int64_t>>& strides,
                             DimOrder order_kind, size_t lead, const std::vector<bool>& reduced) {
  IterationSpace s;
  std::vector<size_t> order;  // dims of size > 1
  for (size_t d = 0; d < sizes.size(); ++d) {
    s.numel *= sizes[d];
    if (sizes[d] != 1) order.push_back(d);
  }
  if (order_kind == DimOrder::operands_in_turn) order_operands_in_turn(order, strides);
  if (order_kind == DimOrder::lead_operand && lead < strides.size()) order_by_lead(order, strides[lead]);

  // Merge, outermost first: dim d joins the dim before it when every operand steps over the
  // earlier one exactly as far as it walks d.
  s.strides.resize(strides.size());
  for (size_t d : order) {
    const bool red = d < reduced.size() && reduced[d];
    bool merge = !s.sizes.empty() && s.reduced.back() == red;
    for (size_t k = 0; merge && k < strides.size(); ++k) merge = s.strides[k].back() == strides[k][d] * sizes[d];
    if (merge) {
      s.sizes.back() *= sizes[d];
      for (size_t k = 0; k < strides.size(); ++k) s.strides[k].back() = strides[k][d];
      continue;
    }
    s.sizes.push_back(sizes[d]);
    s.reduced.push_back(red);
    for (size_t k = 0; k < strides.size(); ++k) s.strides[k].push_back(strides[k][d]);
  }
  return s;
}

}  // namespace kiln::detail
