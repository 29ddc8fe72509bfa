// Strided iteration for CPU kernels.
//
// pointwise<T, OutT>(out, f, inputs...) computes out = f(inputs...) elementwise over the
// broadcast shape, in opmath precision (float for float16/bfloat16). Dims are walked in the
// output's memory order, so a dense output of any layout (row-major or channels-last) is written
// front to back; operands dense in that order take a flat loop the compiler vectorizes;
// 0-dim/broadcast scalars are hoisted out of it; anything else walks coalesced strided dims.
// Work is split across OpenMP threads above a grain size.
#pragma once

#include <omp.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <type_traits>
#include <utility>
#include <vector>

#include "core/iteration_space.h"
#include "core/shape.h"
#include "kiln/tensor.h"

namespace kiln::cpu {

template <class T>
using opmath_t = std::conditional_t<std::is_same_v<T, Half> || std::is_same_v<T, BFloat16>, float, T>;

// Elements per thread below which a loop stays single-threaded.
inline constexpr int64_t kGrainSize = 32768;

// The threads a parallel region opened here would get: the pool, or 1 inside another region
// (nested regions run on the calling thread).
inline int max_threads() { return omp_in_parallel() ? 1 : omp_get_max_threads(); }

// Runs f(begin, end) over [0, n) split across threads when n is large.
template <class F>
void parallel_for(int64_t n, int64_t grain, F&& f) {
  if (n <= 0) return;
  int64_t chunks = std::min<int64_t>(max_threads(), (n + grain - 1) / grain);
  if (chunks <= 1) {
    f(int64_t{0}, n);
    return;
  }
#pragma omp parallel for num_threads(static_cast<int>(chunks)) schedule(static)
  for (int64_t c = 0; c < chunks; ++c) {
    int64_t begin = n * c / chunks, end = n * (c + 1) / chunks;
    f(begin, end);
  }
}

// A tensor seen as (outer, size, inner) around one dim: the 3-D shape that scans and softmax
// over `dim` walk.
struct DimSplit {
  int64_t outer = 1, size = 1, inner = 1;
};
inline DimSplit split_around(const Tensor& x, int64_t dim) {
  DimSplit a;
  for (int64_t d = 0; d < x.dim(); ++d) {
    int64_t n = x.sizes()[d];
    if (d < dim) a.outer *= n;
    else if (d == dim) a.size = n;
    else a.inner *= n;
  }
  return a;
}

// N operands (output first) walked over one shape with per-operand element strides, coalesced by
// core/iteration_space.h (DimOrder::operands_in_turn: PyTorch's TensorIterator order). A
// row-major or channels-last dense op thus becomes one flat run. The linear index of run() counts
// in this order, not row-major.
template <size_t N>
struct StridedLoop {
  std::vector<int64_t> sizes;                   // innermost last
  std::vector<std::array<int64_t, N>> strides;  // per dim, per operand
  std::array<char*, N> base{};
  std::array<int64_t, N> itemsizes{};
  int64_t numel = 1;

  StridedLoop(IntArrayRef shape, const std::array<const Tensor*, N>& ops) {
    for (size_t k = 0; k < N; ++k) {
      base[k] = static_cast<char*>(ops[k]->impl().data());
      itemsizes[k] = ops[k]->element_size();
    }
    std::vector<std::vector<int64_t>> bs(N);
    for (size_t k = 0; k < N; ++k)
      bs[k] = detail::broadcast_strides(ops[k]->sizes(), ops[k]->strides(), shape);
    detail::IterationSpace space = detail::coalesce_dims(shape, bs, detail::DimOrder::operands_in_turn);
    numel = space.numel;
    sizes = std::move(space.sizes);
    strides.resize(sizes.size());
    for (size_t d = 0; d < sizes.size(); ++d)
      for (size_t k = 0; k < N; ++k) strides[d][k] = space.strides[k][d];
  }

  // Calls inner(ptrs, inner_strides_in_elements, count) for contiguous runs of the last dim,
  // covering linear indices [begin, end).
  template <class Inner>
  void run(int64_t begin, int64_t end, Inner&& inner) const {
    if (begin >= end) return;
    const int64_t ndim = static_cast<int64_t>(sizes.size());
    if (ndim == 0) {
      inner(base, std::array<int64_t, N>{}, int64_t{1});
      return;
    }
    std::vector<int64_t> idx(ndim);
    int64_t rem = begin;
    for (int64_t d = ndim - 1; d >= 0; --d) {
      idx[d] = rem % sizes[d];
      rem /= sizes[d];
    }
    const std::array<int64_t, N>& inner_strides = strides[ndim - 1];
    int64_t pos = begin;
    while (pos < end) {
      std::array<char*, N> ptrs;
      for (size_t k = 0; k < N; ++k) {
        int64_t off = 0;
        for (int64_t d = 0; d < ndim; ++d) off += idx[d] * strides[d][k];
        ptrs[k] = base[k] + off * itemsizes[k];
      }
      int64_t count = std::min(sizes[ndim - 1] - idx[ndim - 1], end - pos);
      inner(ptrs, inner_strides, count);
      pos += count;
      idx[ndim - 1] += count;
      for (int64_t d = ndim - 1; d > 0 && idx[d] == sizes[d]; --d) {
        idx[d] = 0;
        ++idx[d - 1];
      }
    }
  }
};

namespace detail_loops {

template <class T>
inline opmath_t<T> load(const char* p, int64_t i) {
  return static_cast<opmath_t<T>>(reinterpret_cast<const T*>(p)[i]);
}

// The inner loop. Operands whose bit is set in ScalarMask have stride 0 and are hoisted;
// Contiguous says every other operand has stride 1 (so the loop vectorizes).
template <unsigned ScalarMask, bool Contiguous, class OutT, class T, class F, size_t... I>
inline void inner_loop(const F& f, char* out, const std::array<const char*, sizeof...(I)>& in,
                       int64_t out_stride, const std::array<int64_t, sizeof...(I)>& in_strides,
                       int64_t n, std::index_sequence<I...>) {
  OutT* __restrict o = reinterpret_cast<OutT*>(out);
  std::array<opmath_t<T>, sizeof...(I)> hoisted{};
  ((hoisted[I] = ((ScalarMask >> I) & 1u) ? load<T>(in[I], 0) : opmath_t<T>{}), ...);
  if constexpr (Contiguous) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) {
      o[i] = static_cast<OutT>(
          f((((ScalarMask >> I) & 1u) ? hoisted[I] : load<T>(in[I], i))...));
    }
  } else {
    for (int64_t i = 0; i < n; ++i) {
      o[i * out_stride] = static_cast<OutT>(
          f((((ScalarMask >> I) & 1u) ? hoisted[I] : load<T>(in[I], i * in_strides[I]))...));
    }
  }
}

}  // namespace detail_loops

// Converts `t` to dtype `d` unless it already has it.
Tensor as_dtype(const Tensor& t, DType d);

// out = f(inputs...) elementwise. Inputs are converted to T when their dtype differs; f takes
// and returns opmath_t values (returning something convertible to OutT).
template <class T, class OutT = T, class F, class... Inputs>
void pointwise(Tensor& out, const F& f, const Inputs&... inputs) {
  constexpr size_t kIn = sizeof...(Inputs);
  static_assert(kIn >= 1 && kIn <= 3, "pointwise takes 1 to 3 inputs");
  std::array<Tensor, kIn> ins{as_dtype(inputs, dtype_of_v<T>)...};
  std::array<const Tensor*, kIn + 1> ops;
  ops[0] = &out;
  for (size_t k = 0; k < kIn; ++k) ops[k + 1] = &ins[k];
  StridedLoop<kIn + 1> loop(out.sizes(), ops);
  auto seq = std::make_index_sequence<kIn>();
  auto inner = [&](const std::array<char*, kIn + 1>& ptrs, const std::array<int64_t, kIn + 1>& st,
                   int64_t n) {
    std::array<const char*, kIn> in;
    std::array<int64_t, kIn> in_st;
    unsigned scalar_mask = 0;
    bool contiguous = st[0] == 1;
    for (size_t k = 0; k < kIn; ++k) {
      in[k] = ptrs[k + 1];
      in_st[k] = st[k + 1];
      if (in_st[k] == 0) scalar_mask |= 1u << k;
      else if (in_st[k] != 1) contiguous = false;
    }
    using namespace detail_loops;
    if (contiguous) {
      switch (scalar_mask) {
        case 0: return inner_loop<0, true, OutT, T>(f, ptrs[0], in, st[0], in_st, n, seq);
        case 1: return inner_loop<1, true, OutT, T>(f, ptrs[0], in, st[0], in_st, n, seq);
        case 2: if constexpr (kIn >= 2) return inner_loop<2, true, OutT, T>(f, ptrs[0], in, st[0], in_st, n, seq);
          break;
        default: break;
      }
    }
    inner_loop<0, false, OutT, T>(f, ptrs[0], in, st[0], in_st, n, seq);
  };
  parallel_for(loop.numel, kGrainSize, [&](int64_t b, int64_t e) { loop.run(b, e, inner); });
}

}  // namespace kiln::cpu
