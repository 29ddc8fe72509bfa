// CPU kernels of the ops that reduce along one dim but keep its shape: cumsum, softmax,
// log_softmax. The input is made contiguous and seen as (outer, D, inner) around the dim; with
// inner == 1 each row is contiguous, otherwise `inner` adjacent columns run in vector lanes.
#include <cmath>

#include "kernels/cpu/loops.h"
#include "kernels/cpu/reduce_loops.h"
#include "core/shape.h"
#include "core/tensor_factory.h"
#include "kiln/op_table.h"

namespace kiln::cpu {

namespace {

using namespace reduce;

// ---------------------------------------------------------------------------------------------
// cumsum: sequential per row, accumulated in double for float32/float64 (as PyTorch's CPU kernel
// does), float for float16/bfloat16, int64 (wrapping) for integers.
// ---------------------------------------------------------------------------------------------

template <class T, class A, class Out>
void cumsum_impl(const Tensor& x, Tensor& out, int64_t dim) {
  const DimSplit g = split_around(x, dim);
  if (x.numel() == 0) return;
  const T* in = static_cast<const T*>(x.impl().data());
  Out* o = static_cast<Out*>(out.impl().data());
  auto add = [](A a, A b) {
    if constexpr (std::is_integral_v<A>)
      return math::util::wrapping_add(a, b);
    else
      return a + b;
  };
  if (g.inner == 1) {
    parallel_for(g.outer, std::max<int64_t>(1, kGrainSize / g.size), [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) {
        const T* p = in + r * g.size;
        Out* q = o + r * g.size;
        A acc = 0;
        for (int64_t k = 0; k < g.size; ++k) {
          acc = add(acc, load<A>(p + k));
          q[k] = store_as<Out>(acc);
        }
      }
    });
    return;
  }
  constexpr int64_t B = block<A>();
  const int64_t nblocks = (g.inner + B - 1) / B;
  parallel_for(g.outer * nblocks, std::max<int64_t>(1, kGrainSize / (g.size * B)),
               [&](int64_t b0, int64_t e0) {
                 for (int64_t t = b0; t < e0; ++t) {
                   int64_t ko = t / nblocks, j0 = (t % nblocks) * B, jn = std::min(B, g.inner - j0);
                   int64_t base = ko * g.size * g.inner + j0;
                   A acc[B] = {};
                   for (int64_t k = 0; k < g.size; ++k) {
                     const T* p = in + base + k * g.inner;
                     Out* q = o + base + k * g.inner;
#pragma omp simd
                     for (int64_t j = 0; j < jn; ++j) {
                       acc[j] = add(acc[j], load<A>(p + j));
                       q[j] = store_as<Out>(acc[j]);
                     }
                     end_of_row();
                   }
                 }
               });
}

void cumsum_kernel(const OpCall& c, std::span<Tensor> outs) {
  const Tensor& x_in = c.input(0);
  int64_t dim = x_in.dim() == 0 ? 0 : kiln::detail::wrap_dim(c.int_attr(0), x_in.dim(), "cumsum");
  into_contiguous(outs[0], [&](Tensor& out) {
    DType od = out.dtype();
    if (is_floating_point(od)) {
      Tensor x = as_dtype(x_in, od).contiguous();
      KILN_DISPATCH_FLOATING(od, "cumsum", [&] {
        using A = std::conditional_t<std::is_same_v<opmath_t<scalar_t>, scalar_t>, double, float>;
        cumsum_impl<scalar_t, A, scalar_t>(x, out, dim);
      });
      return;
    }
    Tensor x = (is_floating_point(x_in.dtype()) ? x_in.to(od) : x_in).contiguous();
    Tensor target =
        od == kInt64 ? out : kiln::detail::make_empty(out.sizes().vec(), kInt64, out.device());
    KILN_DISPATCH_INTEGRAL_AND_BOOL(
        x.dtype(), "cumsum", [&] { cumsum_impl<scalar_t, int64_t, int64_t>(x, target, dim); });
    if (od != kInt64) out.copy_(target);
  });
}

// ---------------------------------------------------------------------------------------------
// softmax / log_softmax: m = max, s = sum(exp(x - m)); softmax = exp(x - m) / s,
// log_softmax = (x - m) - log s. Computed in float for float16/bfloat16/float32.
// ---------------------------------------------------------------------------------------------

// Short rows (10 classes, a few heads) go a block of rows at a time: the exponentials of the
// whole block are one flat vector loop, where one row's would be mostly loop overhead.
inline constexpr int64_t kShortSoftmaxRow = 32;
inline constexpr int64_t kShortSoftmaxBlock = 256;  // rows per block

template <class T, bool Log>
void softmax_short_rows(const T* in, T* out, int64_t rows, int64_t n, opmath_t<T>* buffer) {
  using A = opmath_t<T>;
  A m[kShortSoftmaxBlock];
  for (int64_t r = 0; r < rows; ++r) {
    const T* p = in + r * n;
    A mr = lowest<A>();
    for (int64_t k = 0; k < n; ++k) mr = nan_max(mr, load<A>(p + k));
    for (int64_t k = 0; k < n; ++k) buffer[r * n + k] = load<A>(p + k) - mr;
    m[r] = mr;
  }
#pragma omp simd
  for (int64_t i = 0; i < rows * n; ++i) buffer[i] = math::Exp{}(buffer[i]);
  for (int64_t r = 0; r < rows; ++r) {
    const A* ex = buffer + r * n;
    A sum = 0;
    for (int64_t k = 0; k < n; ++k) sum += ex[k];
    T* q = out + r * n;
    if constexpr (Log) {
      const A log_sum = std::log(sum);
      for (int64_t k = 0; k < n; ++k)
        q[k] = store_as<T>((load<A>(in + r * n + k) - m[r]) - log_sum);
    } else {
      const A inv = A(1) / sum;
      for (int64_t k = 0; k < n; ++k) q[k] = store_as<T>(ex[k] * inv);
    }
  }
}

template <class T, bool Log>
void softmax_rows(const T* in, T* out, int64_t rows, int64_t n) {
  using A = opmath_t<T>;
  // float16/bfloat16 rows hold their exponentials in a float buffer per thread, allocated here:
  // nothing may throw inside the parallel region.
  const int threads = max_threads();
  if (n <= kShortSoftmaxRow) {
    std::vector<A> buffers(threads * kShortSoftmaxBlock * n);
    const int64_t blocks = (rows + kShortSoftmaxBlock - 1) / kShortSoftmaxBlock;
    parallel_for(blocks, std::max<int64_t>(1, kGrainSize / (kShortSoftmaxBlock * n)),
                 [&](int64_t b, int64_t e) {
                   A* buffer =
                       buffers.data() + (omp_get_thread_num() % threads) * kShortSoftmaxBlock * n;
                   for (int64_t blk = b; blk < e; ++blk) {
                     const int64_t r0 = blk * kShortSoftmaxBlock,
                                   count = std::min(kShortSoftmaxBlock, rows - r0);
                     softmax_short_rows<T, Log>(in + r0 * n, out + r0 * n, count, n, buffer);
                   }
                 });
    return;
  }
  std::vector<A> buffers(std::is_same_v<T, A> || Log ? 0 : threads * n);
  parallel_for(rows, std::max<int64_t>(1, kGrainSize / n), [&](int64_t b, int64_t e) {
    A* buffer = buffers.data() + (omp_get_thread_num() % threads) * n;
    for (int64_t r = b; r < e; ++r) {
      const T* p = in + r * n;
      T* q = out + r * n;
      const A m = reduce_run(MaxOp<A>{}, p, n, 1);
      if constexpr (Log) {
        // (x - m) - log s: exact x - m first, as PyTorch does (m + log s would round at |m|).
        const A log_sum = std::log(reduce_run(ExpShiftOp<A>{}, p, n, 1, m));
#pragma omp simd
        for (int64_t k = 0; k < n; ++k) q[k] = store_as<T>((load<A>(p + k) - m) - log_sum);
      } else {
        A* ex;
        if constexpr (std::is_same_v<T, A>)
          ex = q;
        else
          ex = buffer;
#pragma omp simd
        for (int64_t k = 0; k < n; ++k) ex[k] = math::Exp{}(load<A>(p + k) - m);
        const A inv = A(1) / reduce_run(SumOp<A>{}, static_cast<const A*>(ex), n, 1);
#pragma omp simd
        for (int64_t k = 0; k < n; ++k) q[k] = store_as<T>(ex[k] * inv);
      }
    }
  });
}

template <class T, bool Log>
void softmax_columns(const T* in, T* out, const DimSplit& g) {
  using A = opmath_t<T>;
  using S = std::conditional_t<std::is_same_v<A, float>, double, A>;  // the sum over the dim
  constexpr int64_t B = block<A>();
  const int64_t nblocks = (g.inner + B - 1) / B;
  parallel_for(
      g.outer * nblocks, std::max<int64_t>(1, kGrainSize / (g.size * B)),
      [&](int64_t b0, int64_t e0) {
        for (int64_t t = b0; t < e0; ++t) {
          int64_t ko = t / nblocks, j0 = (t % nblocks) * B, jn = std::min(B, g.inner - j0);
          const T* p = in + ko * g.size * g.inner + j0;
          T* q = out + ko * g.size * g.inner + j0;
          A m[B], shift[B];
          S s[B] = {};
          for (int64_t j = 0; j < B; ++j) m[j] = lowest<A>();
          for (int64_t k = 0; k < g.size; ++k) {
#pragma omp simd
            for (int64_t j = 0; j < jn; ++j) m[j] = nan_max(m[j], load<A>(p + k * g.inner + j));
            end_of_row();
          }
          for (int64_t k = 0; k < g.size; ++k) {
#pragma omp simd
            for (int64_t j = 0; j < jn; ++j)
              s[j] += static_cast<S>(math::Exp{}(load<A>(p + k * g.inner + j) - m[j]));
            end_of_row();
          }
          for (int64_t j = 0; j < jn; ++j)
            shift[j] = static_cast<A>(Log ? std::log(s[j]) : S(1) / s[j]);
          for (int64_t k = 0; k < g.size; ++k) {
            const T* pk = p + k * g.inner;
            T* qk = q + k * g.inner;
#pragma omp simd
            for (int64_t j = 0; j < jn; ++j) {
              A v = load<A>(pk + j);
              qk[j] = store_as<T>(Log ? (v - m[j]) - shift[j] : math::Exp{}(v - m[j]) * shift[j]);
            }
            end_of_row();
          }
        }
      });
}

template <bool Log>
void softmax_kernel(const OpCall& c, std::span<Tensor> outs) {
  const Tensor& x_in = c.input(0);
  int64_t dim = x_in.dim() == 0 ? 0 : kiln::detail::wrap_dim(c.int_attr(0), x_in.dim(), c.name());
  into_contiguous(outs[0], [&](Tensor& out) {
    Tensor x = as_dtype(x_in, out.dtype()).contiguous();
    if (x.numel() == 0) return;
    const DimSplit g = split_around(x, dim);
    KILN_DISPATCH_FLOATING(x.dtype(), c.name(), [&] {
      const scalar_t* in = static_cast<const scalar_t*>(x.impl().data());
      scalar_t* o = static_cast<scalar_t*>(out.impl().data());
      if (g.inner == 1)
        softmax_rows<scalar_t, Log>(in, o, g.outer, g.size);
      else
        softmax_columns<scalar_t, Log>(in, o, g);
    });
  });
}

[[maybe_unused]] const bool registered = [] {
  register_kernel("cumsum", DeviceType::cpu, cumsum_kernel);
  register_kernel("softmax", DeviceType::cpu, softmax_kernel<false>);
  register_kernel("log_softmax", DeviceType::cpu, softmax_kernel<true>);
  return true;
}();

}  // namespace

}  // namespace kiln::cpu
