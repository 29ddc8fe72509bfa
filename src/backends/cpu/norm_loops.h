// Loop helpers shared by the batch-norm forward (norm_kernels.cpp) and backward
// (norm_backward_kernels.cpp) kernels.
#pragma once

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "backends/cpu/loops.h"

namespace kiln::cpu {

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

}  // namespace kiln::cpu
