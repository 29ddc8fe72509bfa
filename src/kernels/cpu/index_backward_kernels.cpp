// CPU kernels for the backward table ops of the indexing family (embedding_dense_backward), and
// the row accumulation they share with index_put(accumulate=True).
//
// Accumulating rows of values into rows of an output by index (out[idx[j]] += values[j]) is done
// by bucketing: a counting sort of the positions by target row (O(n + rows), stable, so sums run
// in position order and the result does not depend on the thread count), then a parallel pass
// over the target rows, each summing its own positions in opmath precision. No two threads write
// one row, there are no atomics, and the work is O(n * inner + rows * inner) — not O(n * rows).
// Rows are split among threads by their cost (hits + 1), so a few frequent indices do not leave
// the other threads idle.
#include <algorithm>
#include <atomic>
#include <cstring>

#include "kernels/cpu/loops.h"
#include "core/shape.h"
#include "core/tensor_factory.h"
#include "kiln/op_table.h"
#include "kiln/ops.h"

namespace kiln::cpu {

namespace {

// Positions grouped by target row: the positions of row r are order[offsets[r] .. offsets[r+1]).
struct Buckets {
  std::vector<int64_t> offsets;  // rows + 1
  std::vector<int64_t> order;
};

// `skip`: a row whose positions are left out (embedding's padding_idx; -1 for none).
Buckets bucket_by_row(const int64_t* idx, int64_t n, int64_t rows, int64_t skip) {
  Buckets b;
  b.offsets.assign(static_cast<size_t>(rows + 1), 0);
  for (int64_t j = 0; j < n; ++j)
    if (idx[j] != skip) ++b.offsets[idx[j] + 1];
  for (int64_t r = 0; r < rows; ++r) b.offsets[r + 1] += b.offsets[r];
  b.order.resize(static_cast<size_t>(b.offsets[rows]));
  std::vector<int64_t> fill(b.offsets.begin(), b.offsets.end() - 1);
  for (int64_t j = 0; j < n; ++j)
    if (idx[j] != skip) b.order[fill[idx[j]]++] = j;
  return b;
}

// Splits rows [0, rows) into `parts` ranges of about equal cost (hits + 1 per row).
std::vector<int64_t> balanced_bounds(const Buckets& b, int64_t rows, int64_t parts) {
  std::vector<int64_t> bounds{0};
  const int64_t total = b.offsets[rows] + rows;
  for (int64_t k = 1; k < parts; ++k) {
    const int64_t want = total * k / parts;
    // First row r with offsets[r] + r >= want (a monotone sequence).
    int64_t lo = bounds.back(), hi = rows;
    while (lo < hi) {
      int64_t mid = lo + (hi - lo) / 2;
      if (b.offsets[mid] + mid < want) lo = mid + 1;
      else hi = mid;
    }
    if (lo > bounds.back() && lo < rows) bounds.push_back(lo);
  }
  bounds.push_back(rows);
  return bounds;
}

template <class T>
void accumulate_rows_typed(T* out, const T* vals, int64_t outer, int64_t size, int64_t inner, const Buckets& b,
                           const std::vector<int64_t>& bounds, int64_t n, bool zero_init, bool scale_by_freq) {
  using acc_t = opmath_t<T>;
  const int64_t parts = static_cast<int64_t>(bounds.size()) - 1;
  const int64_t items = outer * parts;
  const int64_t work = outer * (static_cast<int64_t>(b.order.size()) + size) * inner;
  const int64_t grain = std::max<int64_t>(1, items * kGrainSize / std::max<int64_t>(work, 1));
  parallel_for(items, grain, [&](int64_t begin, int64_t end) {
    std::vector<acc_t> acc(static_cast<size_t>(inner));
    for (int64_t it = begin; it < end; ++it) {
      const int64_t o = it / parts, part = it % parts;
      for (int64_t r = bounds[part]; r < bounds[part + 1]; ++r) {
        T* dst = out + (o * size + r) * inner;
        const int64_t lo = b.offsets[r], hi = b.offsets[r + 1];
        if (lo == hi) {
          if (zero_init) std::memset(static_cast<void*>(dst), 0, static_cast<size_t>(inner) * sizeof(T));
          continue;
        }
        acc_t* a = acc.data();
        if (zero_init) {
          std::fill(a, a + inner, acc_t(0));
        } else {
#pragma omp simd
          for (int64_t c = 0; c < inner; ++c) a[c] = static_cast<acc_t>(dst[c]);
        }
        const acc_t s = scale_by_freq ? acc_t(1) / static_cast<acc_t>(hi - lo) : acc_t(1);
        for (int64_t q = lo; q < hi; ++q) {
          const T* src = vals + (o * n + b.order[q]) * inner;
          if (scale_by_freq) {
#pragma omp simd
            for (int64_t c = 0; c < inner; ++c) a[c] += static_cast<acc_t>(src[c]) * s;
          } else {
#pragma omp simd
            for (int64_t c = 0; c < inner; ++c) a[c] += static_cast<acc_t>(src[c]);
          }
        }
#pragma omp simd
        for (int64_t c = 0; c < inner; ++c) dst[c] = static_cast<T>(a[c]);
      }
    }
  });
}

}  // namespace

// out[o, idx[j], :] += values[o, j, :] for a contiguous out of shape (outer, size, inner) and
// contiguous values of shape (outer, n, inner); idx holds n checked int64 values in [0, size).
// zero_init: out's previous contents are ignored (rows without hits become 0). Positions whose
// index equals `skip` are left out; scale_by_freq divides each row's sum by its hit count.
void accumulate_rows(Tensor& out, const Tensor& values, int64_t dim, const Tensor& idx, bool zero_init,
                     int64_t skip, bool scale_by_freq) {
  int64_t outer = 1, inner = 1;
  for (int64_t d = 0; d < dim; ++d) outer *= out.sizes()[d];
  for (int64_t d = dim + 1; d < out.dim(); ++d) inner *= out.sizes()[d];
  const int64_t size = out.sizes()[dim], n = idx.numel();
  if (outer == 0 || inner == 0 || size == 0) return;
  const int64_t* ip = n ? static_cast<const int64_t*>(idx.impl().data()) : nullptr;
  if (n == 0 && !zero_init) return;
  Buckets b = bucket_by_row(ip, n, size, skip);
  const int64_t threads = std::max(1, omp_get_max_threads());
  const int64_t parts = std::min<int64_t>(size, outer >= 4 * threads ? 1 : 4 * threads);
  std::vector<int64_t> bounds = balanced_bounds(b, size, std::max<int64_t>(parts, 1));
  KILN_DISPATCH_FLOATING(out.dtype(), "index_put", [&] {
    accumulate_rows_typed<scalar_t>(static_cast<scalar_t*>(out.impl().data()),
                                    static_cast<const scalar_t*>(values.impl().data()), outer, size, inner, b,
                                    bounds, n, zero_init, scale_by_freq);
  });
}

namespace {

// embedding_dense_backward(grad_output, indices, num_weights, padding_idx, scale_grad_by_freq):
// grad_weight[r] = sum of grad_output rows whose index is r (none for padding_idx).
void embedding_dense_backward_kernel(const OpCall& call, std::span<Tensor> outs) {
  Tensor& result = outs[0];
  const int64_t rows = call.int_attr(0);
  const int64_t padding_idx = call.int_attr(1);
  const bool scale = call.bool_attr(2);
  Tensor idx = as_dtype(call.input(1), kInt64).contiguous().reshape({-1});
  const int64_t n = idx.numel();
  const int64_t* ip = n ? static_cast<const int64_t*>(idx.impl().data()) : nullptr;
  std::atomic<bool> bad{false};
  parallel_for(n, kGrainSize, [&](int64_t b, int64_t e) {
    bool any = false;
    for (int64_t i = b; i < e; ++i) any |= ip[i] < 0 || ip[i] >= rows;
    if (any) bad.store(true, std::memory_order_relaxed);
  });
  if (bad.load()) {
    for (int64_t i = 0; i < n; ++i)
      KILN_CHECK(ip[i] >= 0 && ip[i] < rows, IndexError,
                 "[kiln::embedding_dense_backward] index " + std::to_string(ip[i]) +
                     " is out of bounds for dimension 0 with size " + std::to_string(rows) + ".");
  }
  if (result.numel() == 0) return;
  const int64_t cols = result.sizes()[1];
  Tensor out = result.is_contiguous() ? result : detail::make_empty(result.sizes().vec(), result.dtype(), kCPU);
  Tensor grad = call.input(0).contiguous().reshape({n, cols});
  if (is_floating_point(out.dtype())) {
    accumulate_rows(out, grad, 0, idx, /*zero_init=*/true, padding_idx, scale);
  } else {
    throw DTypeError("[kiln::embedding_dense_backward] expected a floating-point gradient.");
  }
  if (!out.same(result)) result.copy_(out);
}

[[maybe_unused]] const bool registered = [] {
  register_kernel("embedding_dense_backward", DeviceType::cpu, embedding_dense_backward_kernel);
  return true;
}();

}  // namespace

}  // namespace kiln::cpu
