// Average-pooling windows, shared by the forward and backward CPU kernels.
#pragma once

#include <algorithm>
#include <cstdint>
#include <optional>

namespace kiln::cpu {

// One axis of the window of output position `out`: the input range [start, end) it reads
// (clamped to the input) and its length counting the padding (count_include_pad's divisor).
struct AvgSpan {
  int64_t start, end, padded;
};

inline AvgSpan avg_span(int64_t out, int64_t kernel, int64_t stride, int64_t pad, int64_t size) {
  const int64_t start = out * stride - pad;
  const int64_t end = std::min(start + kernel, size + pad);
  return {std::max<int64_t>(start, 0), std::min(end, size), end - start};
}

// What the window's sum is divided by, as PyTorch's avg_pool2d does.
inline int64_t avg_divisor(const AvgSpan& h, const AvgSpan& w, bool count_include_pad,
                           std::optional<int64_t> divisor_override) {
  if (divisor_override) return *divisor_override;
  return count_include_pad ? h.padded * w.padded : (h.end - h.start) * (w.end - w.start);
}

}  // namespace kiln::cpu
