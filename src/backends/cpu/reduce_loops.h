// Reduction loops for CPU kernels.
//
// A ReducePlan splits an input's dims into kept dims (one output element per index, row-major)
// and reduced dims, drops size-1 dims and merges dims that are contiguous with each other.
// ReduceLoop<T> then runs an associative reduction (an "Op": identity, map, combine) over it:
//
//  - vertical: the innermost kept dim is contiguous (sum over dim 0 of a (N, C) matrix, NHWC
//    per-channel stats): a block of adjacent outputs is accumulated together, one vector lane per
//    output, walking the reduced rows;
//  - per output: otherwise each output reduces its reduced rows, the innermost reduced dim
//    contiguous in the common case (sum over the last dims, NCHW per-channel stats, sum of all).
//
// Float accumulation is pairwise over chunks of kChunk elements (rows of kLeafRows in the vertical
// case) with kLanes independent accumulators inside a chunk, so float32 sums of millions of
// elements stay within a few ulp of the float64 result. Work is split across threads over outputs
// when there are enough of them, and inside each output otherwise; partial results are combined
// in a fixed order, so results do not depend on timing.
//
// run2 chains two reductions per output (the mean then the squared deviations for var; the max
// then the sum of exponentials for logsumexp): the second sees the first one's result as `param`,
// and runs right after it on the same output while its data is still in cache.
#pragma once

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>

#include "backends/cpu/loops.h"
#include "core/tensor_factory.h"
#include "kiln/math/functors.h"

// Integer and bool inputs.
#define KILN_DISPATCH_INTEGRAL_AND_BOOL(DTYPE, NAME, ...)              \
  KILN_DISPATCH_SWITCH(DTYPE, NAME,                                  \
                       KILN_DTYPE_CASE(bool_, bool, __VA_ARGS__)     \
                       KILN_DTYPE_CASE(uint8, uint8_t, __VA_ARGS__)  \
                       KILN_DTYPE_CASE(int8, int8_t, __VA_ARGS__)    \
                       KILN_DTYPE_CASE(int32, int32_t, __VA_ARGS__)  \
                       KILN_DTYPE_CASE(int64, int64_t, __VA_ARGS__))

namespace kiln::cpu::reduce {

// ---------------------------------------------------------------------------------------------
// Loads in accumulation precision
// ---------------------------------------------------------------------------------------------

// IEEE half to float without branches, so loops over Half vectorize (FP16 library's method).
inline float half_to_float(uint16_t h) {
  uint32_t w = static_cast<uint32_t>(h) << 16;
  uint32_t sign = w & 0x80000000u;
  uint32_t two_w = w + w;
  float normalized = kiln::detail::bits_f32((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
  float denormalized = kiln::detail::bits_f32((two_w >> 17) | (126u << 23)) - 0.5f;
  uint32_t bits = two_w < (1u << 27) ? kiln::detail::f32_bits(denormalized) : kiln::detail::f32_bits(normalized);
  return kiln::detail::bits_f32(sign | bits);
}

template <class A, class T>
inline A load(const T* p) {
  if constexpr (std::is_same_v<T, Half>) return static_cast<A>(half_to_float(p->bits));
  else if constexpr (std::is_same_v<T, BFloat16>) return static_cast<A>(kiln::detail::bits_f32(uint32_t{p->bits} << 16));
  else return static_cast<A>(*p);
}

// Stores an accumulator into an element type (Half/BFloat16 round from float).
template <class T, class A>
inline T store_as(A v) {
  if constexpr (std::is_same_v<T, Half> || std::is_same_v<T, BFloat16>) return T(static_cast<float>(v));
  else return static_cast<T>(v);
}

// Accumulation type: float for float16/bfloat16/float32, double for float64, int64 for integers
// and bool.
template <class T>
using acc_t = std::conditional_t<std::is_same_v<T, double>, double,
                                 std::conditional_t<std::is_floating_point_v<opmath_t<T>>, float, int64_t>>;

// ---------------------------------------------------------------------------------------------
// Ops: identity, map(x, param) applied to each element, combine (associative, commutative)
// ---------------------------------------------------------------------------------------------

template <class A> struct SumOp {
  using acc_t = A;
  A identity() const { return A(0); }
  A map(A x, A) const { return x; }
  A combine(A a, A b) const {
    if constexpr (std::is_integral_v<A>) return math::util::wrapping_add(a, b);
    else return a + b;
  }
};

template <class A> struct ProdOp {
  using acc_t = A;
  A identity() const { return A(1); }
  A map(A x, A) const { return x; }
  A combine(A a, A b) const {
    if constexpr (std::is_integral_v<A>) return math::util::wrapping_mul(a, b);
    else return a * b;
  }
};

template <class A> constexpr A lowest() {
  if constexpr (std::is_floating_point_v<A>) return -std::numeric_limits<A>::infinity();
  else return std::numeric_limits<A>::lowest();
}
template <class A> constexpr A highest() {
  if constexpr (std::is_floating_point_v<A>) return std::numeric_limits<A>::infinity();
  else return std::numeric_limits<A>::max();
}

// NaN-propagating max / min (a != a is false for integers and bool).
template <class A> inline A nan_max(A a, A b) { return (a > b || a != a) ? a : b; }
template <class A> inline A nan_min(A a, A b) { return (a < b || a != a) ? a : b; }

template <class A> struct MaxOp {
  using acc_t = A;
  A identity() const { return lowest<A>(); }
  A map(A x, A) const { return x; }
  A combine(A a, A b) const { return nan_max(a, b); }
};

template <class A> struct MinOp {
  using acc_t = A;
  A identity() const { return highest<A>(); }
  A map(A x, A) const { return x; }
  A combine(A a, A b) const { return nan_min(a, b); }
};

// any / all: elements load as bool (x != 0, NaN is true).
struct AnyOp {
  using acc_t = bool;
  bool identity() const { return false; }
  bool map(bool x, bool) const { return x; }
  bool combine(bool a, bool b) const { return a || b; }
};
struct AllOp {
  using acc_t = bool;
  bool identity() const { return true; }
  bool map(bool x, bool) const { return x; }
  bool combine(bool a, bool b) const { return a && b; }
};

// Vector norms: sum |x|, sum x^2, sum |x|^p, count of non-zeros, max |x|, min |x|.
template <class A> struct AbsSumOp : SumOp<A> {
  A map(A x, A) const { return std::fabs(x); }
};
template <class A> struct SquareSumOp : SumOp<A> {
  A map(A x, A) const { return x * x; }
};
template <class A> struct PowSumOp : SumOp<A> {
  A p;
  A map(A x, A) const { return std::pow(std::fabs(x), p); }
};
template <class A> struct NonzeroCountOp : SumOp<A> {
  A map(A x, A) const { return x != A(0) ? A(1) : A(0); }
};
template <class A> struct AbsMaxOp : MaxOp<A> {
  A map(A x, A) const { return std::fabs(x); }
};
template <class A> struct AbsMinOp : MinOp<A> {
  A map(A x, A) const { return std::fabs(x); }
};

// Second stages: squared deviation from param (var), exp(x - param) (logsumexp).
template <class A> struct SquaredDeviationOp : SumOp<A> {
  A map(A x, A mean) const {
    A d = x - mean;
    return d * d;
  }
};
template <class A> struct ExpShiftOp : SumOp<A> {
  A map(A x, A shift) const { return math::Exp{}(x - shift); }
};

// ---------------------------------------------------------------------------------------------
// The plan
// ---------------------------------------------------------------------------------------------

struct Dim {
  int64_t size, stride;
};

struct ReducePlan {
  std::vector<Dim> kept;     // outer to inner; outputs are row-major over these
  std::vector<Dim> reduced;  // outer to inner; never empty (a size-1 dim when nothing is reduced)
  int64_t num_outputs = 1;
  int64_t reduce_size = 1;
};

inline void coalesce(std::vector<Dim>& dims) {
  std::vector<Dim> out;
  for (const Dim& d : dims) {
    if (!out.empty() && out.back().stride == d.stride * d.size) {
      out.back().size *= d.size;
      out.back().stride = d.stride;
    } else {
      out.push_back(d);
    }
  }
  dims = std::move(out);
}

// mask[d]: whether dim d of x is reduced (x.dim() entries; none for a 0-dim x).
// reorder: whether the reduced dims may be walked in memory order rather than logical order
// (not for arg-reductions, whose index is the logical one).
inline ReducePlan make_plan(const Tensor& x, const std::vector<bool>& mask, bool reorder = true) {
  ReducePlan plan;
  for (int64_t d = 0; d < x.dim(); ++d) {
    int64_t n = x.sizes()[d];
    (mask[d] ? plan.reduce_size : plan.num_outputs) *= n;
    if (n == 1) continue;
    (mask[d] ? plan.reduced : plan.kept).push_back({n, x.strides()[d]});
  }
  if (reorder) {
    std::stable_sort(plan.reduced.begin(), plan.reduced.end(),
                     [](const Dim& a, const Dim& b) { return a.stride > b.stride; });
  }
  coalesce(plan.kept);
  coalesce(plan.reduced);
  if (plan.reduced.empty()) plan.reduced.push_back({1, 1});
  return plan;
}

// Element offset of row-major linear index i over dims.
inline int64_t offset_of(int64_t i, const Dim* dims, size_t n) {
  int64_t off = 0;
  for (size_t d = n; d-- > 0;) {
    off += (i % dims[d].size) * dims[d].stride;
    i /= dims[d].size;
  }
  return off;
}

// Walks the element offsets of consecutive linear indices over dims.
class OffsetWalker {
 public:
  OffsetWalker(const Dim* dims, size_t n, int64_t start) : dims_(dims), idx_(n) {
    for (size_t d = n; d-- > 0;) {
      idx_[d] = start % dims[d].size;
      off_ += idx_[d] * dims[d].stride;
      start /= dims[d].size;
    }
  }
  int64_t offset() const { return off_; }
  void next() {
    for (size_t d = idx_.size(); d-- > 0;) {
      off_ += dims_[d].stride;
      if (++idx_[d] < dims_[d].size) return;
      off_ -= dims_[d].size * dims_[d].stride;
      idx_[d] = 0;
    }
  }

 private:
  const Dim* dims_;
  std::vector<int64_t> idx_;
  int64_t off_ = 0;
};

// Runs f(out') with out' contiguous: `out` itself, or a temporary copied into `out` afterwards
// (outputs of out= and in-place calls may be strided).
template <class F>
void into_contiguous(Tensor& out, const F& f) {
  if (out.is_contiguous()) {
    f(out);
    return;
  }
  Tensor tmp = kiln::detail::make_empty(out.sizes().vec(), out.dtype(), out.device());
  f(tmp);
  out.copy_(tmp);
}

inline int max_threads() { return omp_in_parallel() ? 1 : omp_get_max_threads(); }

// Splits [0, n) into at most max_threads() chunks of >= grain, runs f(begin, end) -> R on each
// (in parallel) and folds the results in chunk order with combine.
template <class R, class F, class C>
R parallel_fold(int64_t n, int64_t grain, const F& f, const C& combine) {
  int64_t chunks = std::min<int64_t>(max_threads(), (n + grain - 1) / std::max<int64_t>(grain, 1));
  if (chunks <= 1) return f(int64_t{0}, n);
  std::unique_ptr<R[]> parts(new R[chunks]);
#pragma omp parallel for num_threads(static_cast<int>(chunks)) schedule(static)
  for (int64_t c = 0; c < chunks; ++c) parts[c] = f(n * c / chunks, n * (c + 1) / chunks);
  R acc = parts[0];
  for (int64_t c = 1; c < chunks; ++c) acc = combine(acc, parts[c]);
  return acc;
}

// ---------------------------------------------------------------------------------------------
// The engine
// ---------------------------------------------------------------------------------------------

inline constexpr int64_t kChunk = 4096;   // elements per pairwise leaf (per output)
inline constexpr int64_t kLeafRows = 64;  // rows per pairwise leaf (vertical)

template <class A> constexpr int64_t lanes() { return sizeof(A) >= 4 ? 128 / sizeof(A) : 64; }
template <class A> constexpr int64_t block() { return sizeof(A) >= 8 ? 32 : 64; }

// The reduction of n contiguous elements: lanes<A>() accumulators inside a kChunk leaf, pairwise
// across leaves.
template <class T, class Op>
typename Op::acc_t contiguous_leaf(const Op& op, const T* p, int64_t n, typename Op::acc_t prm) {
  using A = typename Op::acc_t;
  constexpr int64_t L = lanes<A>();
  if (n < L) {
    A acc = op.identity();
    for (int64_t i = 0; i < n; ++i) acc = op.combine(acc, op.map(load<A>(p + i), prm));
    return acc;
  }
  A acc[L];
  for (int64_t l = 0; l < L; ++l) acc[l] = op.identity();
  int64_t i = 0;
  for (; i + L <= n; i += L) {
#pragma omp simd
    for (int64_t l = 0; l < L; ++l) acc[l] = op.combine(acc[l], op.map(load<A>(p + i + l), prm));
  }
  for (int64_t l = 0; i + l < n; ++l) acc[l] = op.combine(acc[l], op.map(load<A>(p + i + l), prm));
  for (int64_t w = L / 2; w > 0; w /= 2) {
#pragma omp simd
    for (int64_t l = 0; l < w; ++l) acc[l] = op.combine(acc[l], acc[l + w]);
  }
  return acc[0];
}

template <class T, class Op>
typename Op::acc_t contiguous_reduce(const Op& op, const T* p, int64_t n, typename Op::acc_t prm = {}) {
  if (n <= kChunk) return contiguous_leaf(op, p, n, prm);
  int64_t half = (n / 2 + kChunk - 1) / kChunk * kChunk;
  return op.combine(contiguous_reduce(op, p, half, prm), contiguous_reduce(op, p + half, n - half, prm));
}

// Marks a single-stage run.
struct NoStage {
  using acc_t = int;
};

template <class T>
class ReduceLoop {
 public:
  ReduceLoop(const T* base, const ReducePlan& plan) : base_(base), plan_(plan) {
    inner_ = plan.reduced.back();
    nrows_ = plan.reduce_size / std::max<int64_t>(inner_.size, 1);
    vertical_ = !plan.kept.empty() && plan.kept.back().stride == 1;
  }

  // store(o, acc) for every output o.
  template <class Op, class Store>
  void run(const Op& op, const Store& store) const {
    run2(op, NoStage{}, [](auto) { return 0; }, store);
  }

  // Two stages per output: a1 = reduce(op1); a2 = reduce(op2, param = mid(a1)); store(o, a1, a2).
  template <class Op1, class Op2, class Mid, class Store>
  void run2(const Op1& op1, const Op2& op2, const Mid& mid, const Store& store) const {
    if (plan_.num_outputs == 0) return;
    if (plan_.reduce_size == 0) {
      for (int64_t o = 0; o < plan_.num_outputs; ++o) finish(op2, mid, store, o, op1.identity(), nullptr);
      return;
    }
    if (vertical_) run_vertical(op1, op2, mid, store);
    else run_per_output(op1, op2, mid, store);
  }

 private:
  template <class Op2, class Mid, class Store, class A1>
  void finish(const Op2& op2, const Mid& mid, const Store& store, int64_t o, A1 a1, const T* p) const {
    if constexpr (std::is_same_v<Op2, NoStage>) {
      (void)op2, (void)mid, (void)p;
      store(o, a1);
    } else {
      auto prm = mid(a1);
      auto a2 = p ? rows(op2, p, 0, nrows_, prm) : op2.identity();
      store(o, a1, a2);
    }
  }

  template <class Op>
  typename Op::acc_t strided(const Op& op, const T* p, int64_t n, int64_t s, typename Op::acc_t prm) const {
    using A = typename Op::acc_t;
    if (n > kChunk) {
      int64_t half = (n / 2 + kChunk - 1) / kChunk * kChunk;
      return op.combine(strided(op, p, half, s, prm), strided(op, p + half * s, n - half, s, prm));
    }
    A a0 = op.identity(), a1 = a0, a2 = a0, a3 = a0;
    int64_t i = 0;
    for (; i + 4 <= n; i += 4) {
      a0 = op.combine(a0, op.map(load<A>(p + i * s), prm));
      a1 = op.combine(a1, op.map(load<A>(p + (i + 1) * s), prm));
      a2 = op.combine(a2, op.map(load<A>(p + (i + 2) * s), prm));
      a3 = op.combine(a3, op.map(load<A>(p + (i + 3) * s), prm));
    }
    for (; i < n; ++i) a0 = op.combine(a0, op.map(load<A>(p + i * s), prm));
    return op.combine(op.combine(a0, a1), op.combine(a2, a3));
  }

  template <class Op>
  typename Op::acc_t inner(const Op& op, const T* p, int64_t n, typename Op::acc_t prm) const {
    return inner_.stride == 1 ? contiguous_reduce(op, p, n, prm) : strided(op, p, n, inner_.stride, prm);
  }

  const Dim* row_dims() const { return plan_.reduced.data(); }
  size_t num_row_dims() const { return plan_.reduced.size() - 1; }

  // Rows [r0, r1) of the reduced dims outside the innermost one, pairwise.
  template <class Op>
  typename Op::acc_t rows(const Op& op, const T* p, int64_t r0, int64_t r1, typename Op::acc_t prm) const {
    using A = typename Op::acc_t;
    const int64_t len = inner_.size;
    if (r1 - r0 == 1) return inner(op, p + offset_of(r0, row_dims(), num_row_dims()), len, prm);
    if ((r1 - r0) * len <= kChunk) {
      OffsetWalker w(row_dims(), num_row_dims(), r0);
      A acc = op.identity();
      for (int64_t r = r0; r < r1; ++r, w.next()) acc = op.combine(acc, inner(op, p + w.offset(), len, prm));
      return acc;
    }
    int64_t mid = r0 + (r1 - r0) / 2;
    return op.combine(rows(op, p, r0, mid, prm), rows(op, p, mid, r1, prm));
  }

  // One stage of one output, split across threads.
  template <class Op>
  typename Op::acc_t one_output_parallel(const Op& op, const T* p, typename Op::acc_t prm) const {
    using A = typename Op::acc_t;
    auto comb = [&](A a, A b) { return op.combine(a, b); };
    if (nrows_ >= 2) {
      return parallel_fold<A>(nrows_, std::max<int64_t>(1, kGrainSize / inner_.size),
                              [&](int64_t b, int64_t e) { return rows(op, p, b, e, prm); }, comb);
    }
    const int64_t s = inner_.stride;
    return parallel_fold<A>(inner_.size, kGrainSize,
                            [&](int64_t b, int64_t e) {
                              return s == 1 ? contiguous_reduce(op, p + b, e - b, prm) : strided(op, p + b * s, e - b, s, prm);
                            },
                            comb);
  }

  template <class Op1, class Op2, class Mid, class Store>
  void run_per_output(const Op1& op1, const Op2& op2, const Mid& mid, const Store& store) const {
    const int64_t outputs = plan_.num_outputs, size = plan_.reduce_size;
    const Dim* kept = plan_.kept.data();
    const size_t nkept = plan_.kept.size();
    if (outputs >= max_threads() || size < 2 * kGrainSize) {
      parallel_for(outputs, std::max<int64_t>(1, kGrainSize / size), [&](int64_t b, int64_t e) {
        OffsetWalker w(kept, nkept, b);
        for (int64_t o = b; o < e; ++o, w.next()) {
          const T* p = base_ + w.offset();
          finish(op2, mid, store, o, rows(op1, p, 0, nrows_, {}), p);
        }
      });
      return;
    }
    for (int64_t o = 0; o < outputs; ++o) {
      const T* p = base_ + offset_of(o, kept, nkept);
      auto a1 = one_output_parallel(op1, p, {});
      if constexpr (std::is_same_v<Op2, NoStage>) {
        store(o, a1);
      } else {
        auto a2 = one_output_parallel(op2, p, mid(a1));
        store(o, a1, a2);
      }
    }
  }

  // Vertical: acc[b] over reduced rows [r0, r1) for the jn adjacent outputs at p, pairwise.
  // B: the block size (acc and prm hold B entries, jn <= B of them used).
  template <int64_t B, class Op>
  void vertical_rows(const Op& op, const T* p, int64_t r0, int64_t r1, int64_t jn,
                     const typename Op::acc_t* prm, typename Op::acc_t* acc) const {
    using A = typename Op::acc_t;
    if (r1 - r0 > kLeafRows) {
      int64_t mid = r0 + (r1 - r0) / 2;
      vertical_rows<B>(op, p, r0, mid, jn, prm, acc);
      A tmp[B];
      vertical_rows<B>(op, p, mid, r1, jn, prm, tmp);
#pragma omp simd
      for (int64_t b = 0; b < jn; ++b) acc[b] = op.combine(acc[b], tmp[b]);
      return;
    }
    for (int64_t b = 0; b < B; ++b) acc[b] = op.identity();
    OffsetWalker w(plan_.reduced.data(), plan_.reduced.size(), r0);
    if (jn == B) {
      for (int64_t r = r0; r < r1; ++r, w.next()) {
        const T* row = p + w.offset();
#pragma omp simd
        for (int64_t b = 0; b < B; ++b) acc[b] = op.combine(acc[b], op.map(load<A>(row + b), prm[b]));
      }
    } else {
      for (int64_t r = r0; r < r1; ++r, w.next()) {
        const T* row = p + w.offset();
#pragma omp simd
        for (int64_t b = 0; b < jn; ++b) acc[b] = op.combine(acc[b], op.map(load<A>(row + b), prm[b]));
      }
    }
  }

  // Vertical, rows split across threads (few output blocks, long reductions).
  template <int64_t B, class Op>
  void vertical_parallel(const Op& op, const T* p, int64_t jn, const typename Op::acc_t* prm,
                         typename Op::acc_t* acc) const {
    using A = typename Op::acc_t;
    const int64_t R = plan_.reduce_size;
    int64_t chunks = std::min<int64_t>(max_threads(), std::max<int64_t>(1, R * jn / kGrainSize));
    if (chunks <= 1) {
      vertical_rows<B>(op, p, 0, R, jn, prm, acc);
      return;
    }
    std::unique_ptr<A[]> parts(new A[chunks * B]);
#pragma omp parallel for num_threads(static_cast<int>(chunks)) schedule(static)
    for (int64_t c = 0; c < chunks; ++c) vertical_rows<B>(op, p, R * c / chunks, R * (c + 1) / chunks, jn, prm, &parts[c * B]);
    for (int64_t b = 0; b < jn; ++b) acc[b] = parts[b];
    for (int64_t c = 1; c < chunks; ++c)
      for (int64_t b = 0; b < jn; ++b) acc[b] = op.combine(acc[b], parts[c * B + b]);
  }

  template <class Op1, class Op2, class Mid, class Store>
  void run_vertical(const Op1& op1, const Op2& op2, const Mid& mid, const Store& store) const {
    using A1 = typename Op1::acc_t;
    using A2 = typename Op2::acc_t;
    constexpr int64_t B = std::min(block<A1>(), block<A2>());
    const int64_t J = plan_.kept.back().size;
    const int64_t nblocks = (J + B - 1) / B;
    const int64_t tasks = plan_.num_outputs / J * nblocks;
    const Dim* outer = plan_.kept.data();
    const size_t nouter = plan_.kept.size() - 1;
    const int64_t R = plan_.reduce_size;

    auto task = [&](int64_t t, bool split_rows) {
      int64_t ko = t / nblocks, j0 = (t % nblocks) * B, jn = std::min(B, J - j0);
      const T* p = base_ + offset_of(ko, outer, nouter) + j0;
      int64_t o0 = ko * J + j0;
      A1 zero1[B] = {}, acc1[B];
      split_rows ? vertical_parallel<B>(op1, p, jn, zero1, acc1) : vertical_rows<B>(op1, p, 0, R, jn, zero1, acc1);
      if constexpr (std::is_same_v<Op2, NoStage>) {
        (void)op2, (void)mid;
        for (int64_t b = 0; b < jn; ++b) store(o0 + b, acc1[b]);
      } else {
        A2 prm[B] = {}, acc2[B];
        for (int64_t b = 0; b < jn; ++b) prm[b] = mid(acc1[b]);
        split_rows ? vertical_parallel<B>(op2, p, jn, prm, acc2) : vertical_rows<B>(op2, p, 0, R, jn, prm, acc2);
        for (int64_t b = 0; b < jn; ++b) store(o0 + b, acc1[b], acc2[b]);
      }
    };
    if (tasks >= max_threads() || R * J < 2 * kGrainSize) {
      parallel_for(tasks, std::max<int64_t>(1, kGrainSize / (R * B)), [&](int64_t b, int64_t e) {
        for (int64_t t = b; t < e; ++t) task(t, false);
      });
    } else {
      for (int64_t t = 0; t < tasks; ++t) task(t, true);
    }
  }

  const T* base_;
  const ReducePlan& plan_;
  Dim inner_;
  int64_t nrows_;
  bool vertical_;
};

}  // namespace kiln::cpu::reduce
