// CPU kernels of _softmax_backward_data and _log_softmax_backward_data, which run every training
// step (cross_entropy, attention):
//
//   softmax:      grad_input = y * (g - sum(g * y, dim))
//   log_softmax:  grad_input = g - exp(y) * sum(g, dim)
//
// Fused: one pass per row computes the row's sum, the next writes the row while it is still in
// cache. grad_output and output are made contiguous and seen as (outer, D, inner) around the
// dim. With inner == 1 each row is contiguous (a vectorized reduction, then a vectorized write;
// short rows of log_softmax compute the exponentials of a block of rows in one flat vector loop);
// otherwise `inner` adjacent columns go in vector lanes, a block at a time. Rows or blocks are
// split across threads. Arithmetic in opmath precision (float for float16/bfloat16/float32,
// double for float64).
#include <cmath>

#include "kernels/cpu/loops.h"
#include "core/shape.h"
#include "core/tensor_factory.h"
#include "kiln/math/functors.h"
#include "kiln/op_table.h"

namespace kiln::cpu {

namespace {

template <class T>
inline opmath_t<T> ld(const T* p) {
  return static_cast<opmath_t<T>>(*p);
}

template <class T, class A>
inline T st(A v) {
  if constexpr (std::is_same_v<T, A>)
    return v;
  else
    return T(static_cast<float>(v));
}

// Keeps GCC's unroll-and-jam from fusing two rows of a row loop (which defeats vectorization of
// the inner loop); see reduce_loops.h.
inline void row_barrier() {
#if defined(__GNUC__)
  asm volatile("");
#endif
}

// Rows this short take the blocked path; rows per block.
inline constexpr int64_t kShortRow = 32;
inline constexpr int64_t kRowBlock = 256;

// One contiguous row.
template <class T, bool Log>
inline void backward_row(const T* __restrict g, const T* __restrict y, T* __restrict out, int64_t n) {
  using A = opmath_t<T>;
  A s = 0;
  if constexpr (Log) {
#pragma omp simd reduction(+ : s)
    for (int64_t k = 0; k < n; ++k) s += ld(g + k);
#pragma omp simd
    for (int64_t k = 0; k < n; ++k) out[k] = st<T>(ld(g + k) - math::Exp{}(ld(y + k)) * s);
  } else {
#pragma omp simd reduction(+ : s)
    for (int64_t k = 0; k < n; ++k) s += ld(g + k) * ld(y + k);
#pragma omp simd
    for (int64_t k = 0; k < n; ++k) out[k] = st<T>(ld(y + k) * (ld(g + k) - s));
  }
}

// `rows` short contiguous rows; `buffer` holds rows * n opmath values.
template <class T, bool Log>
void backward_short_rows(const T* g, const T* y, T* out, int64_t rows, int64_t n,
                         opmath_t<T>* __restrict buffer) {
  using A = opmath_t<T>;
  if constexpr (Log) {
    const int64_t total = rows * n;
#pragma omp simd
    for (int64_t i = 0; i < total; ++i) buffer[i] = math::Exp{}(ld(y + i));
    for (int64_t r = 0; r < rows; ++r) {
      const T* gr = g + r * n;
      const A* er = buffer + r * n;
      T* o = out + r * n;
      A s = 0;
      for (int64_t k = 0; k < n; ++k) s += ld(gr + k);
      for (int64_t k = 0; k < n; ++k) o[k] = st<T>(ld(gr + k) - er[k] * s);
      row_barrier();
    }
  } else {
    for (int64_t r = 0; r < rows; ++r) {
      const T* gr = g + r * n;
      const T* yr = y + r * n;
      T* o = out + r * n;
      A s = 0;
      for (int64_t k = 0; k < n; ++k) s += ld(gr + k) * ld(yr + k);
      for (int64_t k = 0; k < n; ++k) o[k] = st<T>(ld(yr + k) * (ld(gr + k) - s));
      row_barrier();
    }
  }
}

template <class T, bool Log>
void backward_rows(const T* g, const T* y, T* out, int64_t rows, int64_t n) {
  using A = opmath_t<T>;
  if (n <= kShortRow) {
    // Buffers allocated here: nothing may throw inside the parallel region.
    const int threads = max_threads();
    std::vector<A> buffers(Log ? static_cast<size_t>(threads) * kRowBlock * n : 0);
    const int64_t blocks = (rows + kRowBlock - 1) / kRowBlock;
    parallel_for(blocks, std::max<int64_t>(1, kGrainSize / (kRowBlock * n)), [&](int64_t b, int64_t e) {
      A* buffer = Log ? buffers.data() + (omp_get_thread_num() % threads) * kRowBlock * n : nullptr;
      for (int64_t blk = b; blk < e; ++blk) {
        const int64_t r0 = blk * kRowBlock, count = std::min(kRowBlock, rows - r0);
        backward_short_rows<T, Log>(g + r0 * n, y + r0 * n, out + r0 * n, count, n, buffer);
      }
    });
    return;
  }
  parallel_for(rows, std::max<int64_t>(1, kGrainSize / n), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) backward_row<T, Log>(g + r * n, y + r * n, out + r * n, n);
  });
}

// The dim is not innermost: blocks of B adjacent columns, one vector lane per column.
template <class T, bool Log>
void backward_columns(const T* g, const T* y, T* out, const DimSplit& a) {
  using A = opmath_t<T>;
  constexpr int64_t B = std::max<int64_t>(64, 1024 / sizeof(A));
  const int64_t nblocks = (a.inner + B - 1) / B;
  parallel_for(a.outer * nblocks, std::max<int64_t>(1, kGrainSize / (a.size * B)), [&](int64_t b0, int64_t e0) {
    for (int64_t t = b0; t < e0; ++t) {
      const int64_t ko = t / nblocks, j0 = (t % nblocks) * B, jn = std::min(B, a.inner - j0);
      const int64_t base = ko * a.size * a.inner + j0;
      A s[B] = {};
      for (int64_t k = 0; k < a.size; ++k) {
        const T* __restrict gk = g + base + k * a.inner;
        const T* __restrict yk = y + base + k * a.inner;
#pragma omp simd
        for (int64_t j = 0; j < jn; ++j) {
          if constexpr (Log)
            s[j] += ld(gk + j);
          else
            s[j] += ld(gk + j) * ld(yk + j);
        }
        row_barrier();
      }
      for (int64_t k = 0; k < a.size; ++k) {
        const T* __restrict gk = g + base + k * a.inner;
        const T* __restrict yk = y + base + k * a.inner;
        T* __restrict ok = out + base + k * a.inner;
#pragma omp simd
        for (int64_t j = 0; j < jn; ++j) {
          if constexpr (Log)
            ok[j] = st<T>(ld(gk + j) - math::Exp{}(ld(yk + j)) * s[j]);
          else
            ok[j] = st<T>(ld(yk + j) * (ld(gk + j) - s[j]));
        }
        row_barrier();
      }
    }
  });
}

template <bool Log>
void softmax_backward_kernel(const OpCall& c, std::span<Tensor> outs) {
  const Tensor& y_in = c.input(1);
  const DType t = y_in.dtype();
  Tensor g = as_dtype(c.input(0), t).contiguous();
  Tensor y = y_in.contiguous();
  const int64_t dim = y.dim() == 0 ? 0 : kiln::detail::wrap_dim(c.int_attr(0), y.dim(), c.name());
  Tensor& out = outs[0];
  // The result is computed in the output's dtype; a temporary when the forward input's dtype
  // (the result's) differs or the result is strided.
  const bool direct = out.dtype() == t && out.is_contiguous();
  Tensor o = direct ? out : kiln::detail::make_empty(out.sizes().vec(), t, out.device());
  if (y.numel() > 0) {
    const DimSplit a = split_around(y, dim);
    KILN_DISPATCH_FLOATING(t, c.name(), [&] {
      const scalar_t* gp = static_cast<const scalar_t*>(g.impl().data());
      const scalar_t* yp = static_cast<const scalar_t*>(y.impl().data());
      scalar_t* op = static_cast<scalar_t*>(o.impl().data());
      if (a.inner == 1)
        backward_rows<scalar_t, Log>(gp, yp, op, a.outer, a.size);
      else
        backward_columns<scalar_t, Log>(gp, yp, op, a);
    });
  }
  if (!direct) out.copy_(o);
}

[[maybe_unused]] const bool registered = [] {
  register_kernel("_softmax_backward_data", DeviceType::cpu, softmax_backward_kernel<false>);
  register_kernel("_log_softmax_backward_data", DeviceType::cpu, softmax_backward_kernel<true>);
  return true;
}();

}  // namespace

}  // namespace kiln::cpu
