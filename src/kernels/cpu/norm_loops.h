// Loop helpers shared by the batch-norm forward (norm_kernels.cpp) and backward
// (norm_backward_kernels.cpp) kernels.
//
// Batch norm walks its (N, C, spatial...) data in one of two layouts: planar (NCHW, contiguous:
// N * C runs of one channel's plane) or channel rows (channels-last, NHWC: N * plane rows of C
// contiguous channels, a fixed stride apart). Each kernel reads the layout its input already has,
// so a channels-last network never reorders.
#pragma once

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "kernels/cpu/loops.h"
#include "core/tensor_factory.h"

namespace kiln::cpu {

// Whether the affine maps below round once (fma): where the CPU has fused multiply-add.
#if defined(__FMA__) || defined(__aarch64__)
#define KILN_NORM_FMA 1
#else
#define KILN_NORM_FMA 0
#endif

// Below this plane size batch_norm works on "columns": the C * plane values of one sample, which
// all samples share. Sums run down the columns (vectorized across them) and per-channel values
// are expanded to one per column, so no loop runs over a handful of values at a time.
inline constexpr int64_t kSmallPlane = 32;

// Per-channel value repeated for each of the channel's `plane` columns.
template <class V>
std::vector<V> expand_to_columns(const std::vector<V>& per_channel, int64_t plane) {
  std::vector<V> out(per_channel.size() * static_cast<size_t>(plane));
  for (size_t c = 0; c < per_channel.size(); ++c)
    std::fill_n(out.begin() + static_cast<std::ptrdiff_t>(c * plane), plane, per_channel[c]);
  return out;
}

// Column sums over rows [0, n) of an (n, columns) array, split by rows across threads:
// accumulate(chunk_sums, row) adds one row into a chunk's `width` partial sums. Returns the total
// per partial slot.
template <class Accumulate>
std::vector<double> sum_rows(int64_t n, int64_t columns, int64_t width, Accumulate&& accumulate) {
  const int64_t chunks = std::max<int64_t>(1, std::min<int64_t>({omp_get_max_threads(), n, n * columns / kGrainSize}));
  std::vector<double> partial(static_cast<size_t>(chunks * width), 0.0);
  parallel_for(chunks, 1, [&](int64_t cb, int64_t ce) {
    for (int64_t chunk = cb; chunk < ce; ++chunk)
      for (int64_t i = n * chunk / chunks; i < n * (chunk + 1) / chunks; ++i)
        accumulate(partial.data() + chunk * width, i);
  });
  for (int64_t chunk = 1; chunk < chunks; ++chunk)
    for (int64_t k = 0; k < width; ++k) partial[k] += partial[chunk * width + k];
  partial.resize(static_cast<size_t>(width));
  return partial;
}

// The stride between rows when t (N, C, spatial...) is channel rows: channels adjacent and all
// (n, spatial) positions one uniform stride apart (channels-last, dense or a channel slice of a
// wider channels-last tensor). nullopt otherwise.
inline std::optional<int64_t> channel_row_stride(const Tensor& t) {
  if (t.dim() < 2 || (t.sizes()[1] > 1 && t.strides()[1] != 1)) return std::nullopt;
  std::optional<int64_t> row_stride;
  int64_t expected = 0;
  for (int64_t d = t.dim() - 1; d >= 0; --d) {  // the last dim varies fastest, dim 0 slowest
    if (d == 1 || t.sizes()[d] == 1) continue;
    if (!row_stride) {
      row_stride = t.strides()[d];
      expected = *row_stride;
    }
    if (t.strides()[d] != expected) return std::nullopt;
    expected *= t.sizes()[d];
  }
  return row_stride.value_or(t.sizes()[1]);
}

// Dense channel-rows strides for `sizes`: channels fastest, then the last dim, ..., dim 2, dim 0
// (channels-last for a 4-D shape).
inline std::vector<int64_t> channel_rows_strides(IntArrayRef sizes) {
  std::vector<int64_t> strides(sizes.size());
  int64_t step = 1;
  auto place = [&](size_t d) {
    strides[d] = step;
    step *= std::max<int64_t>(sizes[d], 1);
  };
  place(1);
  for (size_t d = sizes.size(); d-- > 2;) place(d);
  place(0);
  return strides;
}

// An (N, C, spatial...) tensor as a batch-norm kernel reads it.
struct ChannelView {
  Tensor t;                // the tensor itself, or a copy in the layout asked for
  bool rows = false;       // channel rows (else planar: contiguous)
  int64_t row_stride = 0;  // rows only
};

// t in the given layout: itself when it has it, else a copy.
inline ChannelView channel_view_as(const Tensor& t, bool rows) {
  if (!rows) return {t.contiguous(), false, 0};
  if (auto stride = channel_row_stride(t)) return {t, true, *stride};
  Tensor copy = detail::make_empty_strided(t.sizes().vec(), channel_rows_strides(t.sizes()), t.dtype(), t.device());
  copy.copy_(t);
  return {copy, true, t.sizes()[1]};
}

// t in its own layout when it has one of the two (`prefer_rows` breaks the tie of a tensor that
// is both), else copied into channel rows when `prefer_rows`, planar otherwise.
inline ChannelView channel_view(const Tensor& t, bool prefer_rows) {
  const bool has_rows = channel_row_stride(t).has_value();
  return channel_view_as(t, prefer_rows ? has_rows || !t.is_contiguous() : has_rows && !t.is_contiguous());
}

// Per-channel mean and biased variance of `rows` rows of `channels` values, `row_stride` apart,
// in one pass over memory. Each thread takes a range of rows in blocks; within a block it sums
// x - k and (x - k)^2 per channel in opmath precision (vectorized across channels, four rows per
// step to save accumulator traffic), where the shift k is the thread's running mean (the block's
// first row at first), so the sums stay small and the block's squared deviations come out
// without cancellation. Blocks merge into the thread's statistics with Chan's formula in double.
template <class T>
void channel_rows_stats(const T* in, int64_t rows, int64_t channels, int64_t row_stride, std::vector<double>& mean,
                        std::vector<double>& var) {
  using Acc = opmath_t<T>;
  if (rows == 0 || channels == 0) return;
  const int64_t block = std::clamp<int64_t>(32768 / channels, 4, 1024);
  const int64_t chunks =
      std::max<int64_t>(1, std::min<int64_t>({omp_get_max_threads(), rows, rows * channels / kGrainSize}));
  const size_t width = static_cast<size_t>(channels);
  std::vector<double> counts(static_cast<size_t>(chunks), 0.0), mu(chunks * width, 0.0), m2(chunks * width, 0.0);
  parallel_for(chunks, 1, [&](int64_t cb, int64_t ce) {
    std::vector<Acc> shift_v(width), sum_v(width), square_v(width);
    for (int64_t chunk = cb; chunk < ce; ++chunk) {
      double* __restrict cmu = mu.data() + chunk * channels;
      double* __restrict cm2 = m2.data() + chunk * channels;
      double& count = counts[chunk];
      const int64_t end = rows * (chunk + 1) / chunks;
      for (int64_t r0 = rows * chunk / chunks; r0 < end; r0 += block) {
        const int64_t n = std::min(block, end - r0);
        Acc* __restrict k = shift_v.data();
        Acc* __restrict s = sum_v.data();
        Acc* __restrict q = square_v.data();
        for (int64_t c = 0; c < channels; ++c) {
          k[c] = count > 0 ? static_cast<Acc>(cmu[c]) : static_cast<Acc>(in[r0 * row_stride + c]);
          s[c] = q[c] = Acc(0);
        }
        int64_t r = r0;
        for (; r + 4 <= r0 + n; r += 4) {
          const T* __restrict x = in + r * row_stride;
          const int64_t rs = row_stride;
#pragma omp simd
          for (int64_t c = 0; c < channels; ++c) {
            const Acc d0 = static_cast<Acc>(x[c]) - k[c], d1 = static_cast<Acc>(x[c + rs]) - k[c];
            const Acc d2 = static_cast<Acc>(x[c + 2 * rs]) - k[c], d3 = static_cast<Acc>(x[c + 3 * rs]) - k[c];
            s[c] += (d0 + d1) + (d2 + d3);
            q[c] += (d0 * d0 + d1 * d1) + (d2 * d2 + d3 * d3);
          }
        }
        for (; r < r0 + n; ++r) {
          const T* __restrict x = in + r * row_stride;
#pragma omp simd
          for (int64_t c = 0; c < channels; ++c) {
            const Acc d = static_cast<Acc>(x[c]) - k[c];
            s[c] += d;
            q[c] += d * d;
          }
        }
        const double total = count + static_cast<double>(n);
        const double inv_n = 1.0 / static_cast<double>(n), weight = static_cast<double>(n) / total,
                     cross = count * static_cast<double>(n) / total;
#pragma omp simd
        for (int64_t c = 0; c < channels; ++c) {
          const double block_sum = static_cast<double>(s[c]);
          const double block_m2 = std::max(0.0, static_cast<double>(q[c]) - block_sum * block_sum * inv_n);
          const double delta = static_cast<double>(k[c]) + block_sum * inv_n - cmu[c];
          cmu[c] += delta * weight;
          cm2[c] += block_m2 + delta * delta * cross;
        }
        count = total;
      }
    }
  });
  for (int64_t chunk = 1; chunk < chunks; ++chunk) {
    const double total = counts[0] + counts[chunk];
    if (counts[chunk] == 0) continue;
    const double weight = counts[chunk] / total, cross = counts[0] * counts[chunk] / total;
    for (int64_t c = 0; c < channels; ++c) {
      const double delta = mu[chunk * channels + c] - mu[c];
      mu[c] += delta * weight;
      m2[c] += m2[chunk * channels + c] + delta * delta * cross;
    }
    counts[0] = total;
  }
  for (int64_t c = 0; c < channels; ++c) {
    mean[c] = mu[c];
    var[c] = m2[c] / counts[0];
  }
}

// x * scale + shift rounded to T, then relu'd when Relu (after the rounding, as a separate relu
// would; NaN stays NaN). One rounding (fma) where the CPU has fused multiply-add, spelled out
// rather than left to the compiler's contraction: batch_norm_relu_backward_recompute recomputes
// batch_norm_relu's result with this function and must round exactly as the forward did.
template <bool Relu, class T, class Acc>
inline T affine_value(T x, Acc scale, Acc shift) {
#if KILN_NORM_FMA
  const T y = static_cast<T>(std::fma(static_cast<Acc>(x), scale, shift));
#else
  const T y = static_cast<T>(static_cast<Acc>(x) * scale + shift);
#endif
  if constexpr (Relu) return static_cast<Acc>(y) < Acc(0) ? T(0) : y;
  return y;
}

// y = x * scale + shift (relu'd when Relu) over n contiguous values.
template <bool Relu = false, class T, class Acc = opmath_t<T>>
inline void affine_row(const T* __restrict x, T* __restrict y, int64_t n, Acc scale, Acc shift) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] = affine_value<Relu>(x[i], scale, shift);
}

// Batch norm's per-channel affine map, y = x * scale + shift with scale = invstd * weight and
// shift = bias - mean * scale (rounded once, as affine_value rounds). The forward and the backward
// that recomputes its relu mask both derive it here from the same saved values.
template <class Acc>
std::pair<std::vector<Acc>, std::vector<Acc>> batch_norm_affine(const std::vector<Acc>& mean,
                                                                const std::vector<Acc>& invstd,
                                                                const std::vector<Acc>& weight,
                                                                const std::vector<Acc>& bias) {
  std::vector<Acc> scale(mean.size()), shift(mean.size());
  for (size_t c = 0; c < mean.size(); ++c) {
    scale[c] = invstd[c] * weight[c];
#if KILN_NORM_FMA
    shift[c] = std::fma(-mean[c], scale[c], bias[c]);
#else
    shift[c] = bias[c] - mean[c] * scale[c];
#endif
  }
  return {std::move(scale), std::move(shift)};
}

// y = x * scale[c] + shift[c] (relu'd when Relu) over `rows` rows of `channels` values (channel rows).
template <bool Relu, class T, class Acc = opmath_t<T>>
void affine_channel_rows(const T* in, int64_t in_stride, T* out, int64_t out_stride, int64_t rows, int64_t channels,
                         const std::vector<Acc>& scale, const std::vector<Acc>& shift) {
  parallel_for(rows, std::max<int64_t>(1, kGrainSize / std::max<int64_t>(1, channels)), [&](int64_t b, int64_t e) {
    const Acc* __restrict sc = scale.data();
    const Acc* __restrict sh = shift.data();
    for (int64_t r = b; r < e; ++r) {
      const T* __restrict x = in + r * in_stride;
      T* __restrict y = out + r * out_stride;
#pragma omp simd
      for (int64_t c = 0; c < channels; ++c) y[c] = affine_value<Relu>(x[c], sc[c], sh[c]);
    }
  });
}

// The planar (NCHW) output pass: one affine map per column of a sample for small planes, per
// (n, c) run otherwise.
template <bool Relu, class T, class Acc = opmath_t<T>>
void affine_planar(const T* in, T* o, int64_t n, int64_t channels, int64_t plane, const std::vector<Acc>& scale,
                   const std::vector<Acc>& shift) {
  if (plane < kSmallPlane) {
    const int64_t columns = channels * plane;
    const std::vector<Acc> column_scale = expand_to_columns(scale, plane);
    const std::vector<Acc> column_shift = expand_to_columns(shift, plane);
    parallel_for(n, std::max<int64_t>(1, kGrainSize / std::max<int64_t>(1, columns)), [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) {
        const T* __restrict x = in + i * columns;
        T* __restrict out = o + i * columns;
        const Acc* __restrict sc = column_scale.data();
        const Acc* __restrict sh = column_shift.data();
#pragma omp simd
        for (int64_t k = 0; k < columns; ++k) out[k] = affine_value<Relu>(x[k], sc[k], sh[k]);
      }
    });
    return;
  }
  parallel_for(n * channels, std::max<int64_t>(1, kGrainSize / std::max<int64_t>(1, plane)), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const int64_t c = r % channels;
      affine_row<Relu>(in + r * plane, o + r * plane, plane, scale[c], shift[c]);
    }
  });
}

}  // namespace kiln::cpu
