// Pooling windows and channels-last views, shared by the forward and backward CPU kernels.
#pragma once

#include <algorithm>
#include <cstdint>
#include <optional>

#include "core/shape.h"
#include "kiln/tensor.h"

namespace kiln::cpu {

// ---------------- channels-last (NHWC) ----------------
//
// Pooling treats each (n, c) plane alike, so channels-last data pools all C channels of a pixel
// at once: loops over output pixels with an inner loop over contiguous channels (vectorized).
// The loops take any strides for N, H and W as long as channels are adjacent, so channel slices
// of a wider channels-last tensor need no copy.

// Element strides of a 4-D tensor's N, H and W dims (channels at stride 1).
struct PixelStrides {
  int64_t n, h, w;
};

inline PixelStrides pixel_strides(const Tensor& t) { return {t.strides()[0], t.strides()[2], t.strides()[3]}; }

// Whether a 4-D tensor's channels are adjacent in memory (any layout when there is one channel).
inline bool channels_adjacent(const Tensor& t) {
  return t.dim() == 4 && (t.sizes()[1] == 1 || t.strides()[1] == 1);
}

// Whether a kernel writing `out` should run the channels-last loops: out is 4-D, not plainly
// contiguous, and laid out like channels-last.
inline bool wants_channels_last(const Tensor& out) {
  return out.dim() == 4 && !out.is_contiguous() && detail::strides_like_channels_last(out.sizes(), out.strides());
}

// Adaptive pooling's window along one axis: [floor(i * in / out), ceil((i + 1) * in / out)).
inline int64_t adaptive_start(int64_t i, int64_t in, int64_t out) { return i * in / out; }
inline int64_t adaptive_end(int64_t i, int64_t in, int64_t out) { return ((i + 1) * in + out - 1) / out; }

// ---------------- average pooling ----------------

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
