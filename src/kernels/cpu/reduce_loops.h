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
// Float accumulation is pairwise over leaves (kChunk elements, kStridedChunk when strided,
// kLeafRows rows in the vertical case) with many independent accumulators inside a leaf, so
// float32 sums of millions of elements stay within a few ulp of the float64 result. Work is split
// across threads over outputs when there are enough of them, and inside each output otherwise;
// partial results are combined in a fixed order, so results do not depend on timing.
#pragma once

#include <omp.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>

#include "kernels/cpu/loops.h"
#include "core/tensor_factory.h"
#include "kiln/math/functors.h"


// On the functions whose loops must vectorize: inlines everything they call (the ops' map and
// combine, math::Exp, the loads), whatever budget the inliner has left in a large file.
#if defined(__GNUC__)
#define KILN_FLATTEN __attribute__((flatten))
#else
#define KILN_FLATTEN
#endif

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
  uint32_t bits = two_w < (1u << 27) ? kiln::detail::f32_bits(denormalized)
                                     : kiln::detail::f32_bits(normalized);
  return kiln::detail::bits_f32(sign | bits);
}

template <class A, class T>
inline A load(const T* p) {
  if constexpr (std::is_same_v<T, Half>)
    return static_cast<A>(half_to_float(p->bits));
  else if constexpr (std::is_same_v<T, BFloat16>)
    return static_cast<A>(kiln::detail::bits_f32(uint32_t{p->bits} << 16));
  else
    return static_cast<A>(*p);
}

// Stores an accumulator into an element type (Half/BFloat16 round from float).
template <class T, class A>
inline T store_as(A v) {
  if constexpr (std::is_same_v<T, Half> || std::is_same_v<T, BFloat16>)
    return T(static_cast<float>(v));
  else
    return static_cast<T>(v);
}

// Accumulation type: float for float16/bfloat16/float32, double for float64, int64 for integers
// and bool.
template <class T>
using acc_t =
    std::conditional_t<std::is_same_v<T, double>, double,
                       std::conditional_t<std::is_floating_point_v<opmath_t<T>>, float, int64_t>>;

// ---------------------------------------------------------------------------------------------
// Leaves: the innermost loops
// ---------------------------------------------------------------------------------------------
//
// An op either reduces element by element (identity, map(x, param), combine) and the loops below
// do the rest, or it sets `custom_leaves` and brings its own leaves: leaf(p, n, s) over <= kChunk
// elements with stride s, and leaf_rows<B>(rows, nrows, jn, acc) over <= kLeafRows rows of jn <= B
// adjacent outputs. Custom leaves let var and logsumexp make their two passes over data that is
// still in cache and merge the leaves' results, so the input is read from memory once.

template <class Op>
concept CustomLeaves = requires {
  requires Op::custom_leaves;
};
// Ops that can also go element by element (all but var's and logsumexp's).
template <class Op>
concept Elementwise = requires(const Op& op, typename Op::acc_t a) {
  op.map(a, a);
};

inline constexpr int64_t kChunk = 4096;        // elements per leaf (per output)
inline constexpr int64_t kStridedChunk = 512;  // per strided leaf: 4 accumulators, 128 adds each
inline constexpr int64_t kLeafRows = 64;       // rows per leaf (vertical)
inline constexpr int64_t kShortRow = 16;       // reductions this short take the short-rows path

template <class A>
constexpr int64_t lanes() {
  return sizeof(A) >= 4 ? 128 / sizeof(A) : 64;
}
template <class A>
constexpr int64_t block() {
  return std::max<int64_t>(64, 1024 / sizeof(A));
}

// n contiguous elements: lanes<A>() accumulators, four groups of them in the main loop so that
// ops with long dependency chains (the NaN-propagating max) keep enough loads in flight; the lanes
// fold as a tree at the end.
template <class T, class Op>
KILN_FLATTEN typename Op::acc_t contiguous_leaf(const Op& op, const T* p, int64_t n,
                                                typename Op::acc_t prm) {
  using A = typename Op::acc_t;
  constexpr int64_t L = lanes<A>();
  if (n < L) {
    A acc = op.identity();
    for (int64_t i = 0; i < n; ++i) acc = op.combine(acc, op.map(load<A>(p + i), prm));
    return acc;
  }
  A acc[L], acc1[L], acc2[L], acc3[L];
  for (int64_t l = 0; l < L; ++l) acc[l] = acc1[l] = acc2[l] = acc3[l] = op.identity();
  int64_t i = 0;
  for (; i + 4 * L <= n; i += 4 * L) {
#pragma omp simd
    for (int64_t l = 0; l < L; ++l) {
      acc[l] = op.combine(acc[l], op.map(load<A>(p + i + l), prm));
      acc1[l] = op.combine(acc1[l], op.map(load<A>(p + i + L + l), prm));
      acc2[l] = op.combine(acc2[l], op.map(load<A>(p + i + 2 * L + l), prm));
      acc3[l] = op.combine(acc3[l], op.map(load<A>(p + i + 3 * L + l), prm));
    }
  }
  for (; i + L <= n; i += L) {
#pragma omp simd
    for (int64_t l = 0; l < L; ++l) acc[l] = op.combine(acc[l], op.map(load<A>(p + i + l), prm));
  }
  for (int64_t l = 0; i + l < n; ++l) acc[l] = op.combine(acc[l], op.map(load<A>(p + i + l), prm));
#pragma omp simd
  for (int64_t l = 0; l < L; ++l)
    acc[l] = op.combine(op.combine(acc[l], acc1[l]), op.combine(acc2[l], acc3[l]));
  for (int64_t w = L / 2; w > 0; w /= 2) {
#pragma omp simd
    for (int64_t l = 0; l < w; ++l) acc[l] = op.combine(acc[l], acc[l + w]);
  }
  return acc[0];
}

// n elements with stride s: four accumulators.
template <class T, class Op>
KILN_FLATTEN typename Op::acc_t strided_leaf(const Op& op, const T* p, int64_t n, int64_t s,
                                             typename Op::acc_t prm) {
  using A = typename Op::acc_t;
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

// One leaf of an element-by-element op (n <= kChunk).
template <class T, class Op>
typename Op::acc_t elementwise_leaf(const Op& op, const T* p, int64_t n, int64_t s,
                                    typename Op::acc_t prm = {}) {
  return s == 1 ? contiguous_leaf(op, p, n, prm) : strided_leaf(op, p, n, s, prm);
}

// Call at the end of the body of a loop over rows whose inner loop runs along a row. An empty
// volatile asm makes the loop nest imperfect, which keeps GCC's -O3 unroll-and-jam from fusing
// pairs of rows (after which it vectorizes across rows with gathers, several times slower, or
// not at all); unlike a compiler fence it lets accumulators stay in registers.
inline void end_of_row() {
#if defined(__GNUC__)
  asm volatile("");
#endif
}

// Asks for the cache lines of n elements at p (a hint: never faults, whatever the address).
template <class T>
inline void prefetch(const T* p, int64_t n) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t q = 0; q < n * static_cast<int64_t>(sizeof(T)); q += 64) __builtin_prefetch(c + q);
}

// acc[b] = the reduction over r < nrows of rows[r][b], for b < jn (<= B); prm[b] is the param of
// output b (null: none). Full groups of W outputs keep their accumulators in registers across
// the rows (a store and reload per row is slower, and can falsely alias the rows' loads), and
// prefetch their part of each row 8 groups ahead: with many short row segments in flight the
// hardware prefetcher alone leaves a third of the memory bandwidth unused.
template <int64_t B, class T, class Op>
KILN_FLATTEN void rows_leaf(const Op& op, const T* const* rows, int64_t nrows, int64_t jn,
                            typename Op::acc_t* acc, const typename Op::acc_t* prm = nullptr) {
  using A = typename Op::acc_t;
  constexpr int64_t W = std::min<int64_t>(B, 256 / sizeof(A));
  A zero[B] = {};
  if (!prm) prm = zero;
  int64_t j0 = 0;
  for (; j0 + W <= jn; j0 += W) {
    A a[W];
    for (int64_t b = 0; b < W; ++b) a[b] = op.identity();
    for (int64_t r = 0; r < nrows; ++r) {
      const T* row = rows[r] + j0;
      prefetch(row + 8 * W, W);
#pragma omp simd
      for (int64_t b = 0; b < W; ++b)
        a[b] = op.combine(a[b], op.map(load<A>(row + b), prm[j0 + b]));
      end_of_row();
    }
    for (int64_t b = 0; b < W; ++b) acc[j0 + b] = a[b];
  }
  for (int64_t b = j0; b < B; ++b) acc[b] = op.identity();
  if (j0 == jn) return;
  for (int64_t r = 0; r < nrows; ++r) {
    const T* row = rows[r];
#pragma omp simd
    for (int64_t b = j0; b < jn; ++b) acc[b] = op.combine(acc[b], op.map(load<A>(row + b), prm[b]));
    end_of_row();
  }
}

// acc[b] = the reduction of the L contiguous elements at p + b * L, for b < jn (<= B).
template <int64_t B, class T, class Op>
KILN_FLATTEN void short_rows_leaf(const Op& op, const T* p, int64_t L, int64_t jn,
                                  typename Op::acc_t* acc) {
  using A = typename Op::acc_t;
  for (int64_t b = 0; b < B; ++b) acc[b] = op.identity();
  for (int64_t k = 0; k < L; ++k) {
#pragma omp simd
    for (int64_t b = 0; b < jn; ++b)
      acc[b] = op.combine(acc[b], op.map(load<A>(p + b * L + k), A{}));
    end_of_row();
  }
}

// One leaf (n <= kChunk) of any op: its own leaf when it has one.
template <class T, class Op>
typename Op::acc_t leaf_of(const Op& op, const T* p, int64_t n, int64_t s,
                           typename Op::acc_t prm = {}) {
  if constexpr (CustomLeaves<Op>)
    return op.leaf(p, n, s);
  else
    return elementwise_leaf(op, p, n, s, prm);
}

// The reduction of n elements with stride s, pairwise over leaves of kChunk (kStridedChunk).
template <class T, class Op>
typename Op::acc_t reduce_run(const Op& op, const T* p, int64_t n, int64_t s,
                              typename Op::acc_t prm = {}) {
  const int64_t chunk = s == 1 ? kChunk : kStridedChunk;
  if (n > chunk) {
    int64_t half = (n / 2 + chunk - 1) / chunk * chunk;
    // Left half first (in a call's arguments GCC would run the right one first): descending
    // addresses halve what the hardware prefetcher delivers.
    auto left = reduce_run(op, p, half, s, prm);
    return op.combine(left, reduce_run(op, p + half * s, n - half, s, prm));
  }
  return leaf_of(op, p, n, s, prm);
}

// ---------------------------------------------------------------------------------------------
// Ops: identity, map(x, param) applied to each element, combine (associative, commutative)
// ---------------------------------------------------------------------------------------------

template <class A>
struct SumOp {
  using acc_t = A;
  A identity() const { return A(0); }
  A map(A x, A) const { return x; }
  A combine(A a, A b) const {
    if constexpr (std::is_integral_v<A>)
      return math::util::wrapping_add(a, b);
    else
      return a + b;
  }
};

template <class A>
struct ProdOp {
  using acc_t = A;
  A identity() const { return A(1); }
  A map(A x, A) const { return x; }
  A combine(A a, A b) const {
    if constexpr (std::is_integral_v<A>)
      return math::util::wrapping_mul(a, b);
    else
      return a * b;
  }
};

template <class A>
constexpr A lowest() {
  if constexpr (std::is_floating_point_v<A>)
    return -std::numeric_limits<A>::infinity();
  else
    return std::numeric_limits<A>::lowest();
}
template <class A>
constexpr A highest() {
  if constexpr (std::is_floating_point_v<A>)
    return std::numeric_limits<A>::infinity();
  else
    return std::numeric_limits<A>::max();
}

// NaN-propagating max / min (a != a is false for integers and bool). Bitwise | rather than ||:
// no branch to mispredict in scalar code.
template <class A>
inline A nan_max(A a, A b) {
  return ((a > b) | (a != a)) ? a : b;
}
template <class A>
inline A nan_min(A a, A b) {
  return ((a < b) | (a != a)) ? a : b;
}

// max / min. For floating types the contiguous leaf keeps the NaN check off the max's dependency
// chain (a NaN flag per lane, the max itself one instruction), twice as fast from memory.
template <class A, bool IsMax>
struct ExtremumOp {
  using acc_t = A;
  static constexpr bool custom_leaves = std::is_floating_point_v<A>;
  A identity() const { return IsMax ? lowest<A>() : highest<A>(); }
  A map(A x, A) const { return x; }
  A combine(A a, A b) const { return IsMax ? nan_max(a, b) : nan_min(a, b); }

  template <class T>
  KILN_FLATTEN A leaf(const T* p, int64_t n, int64_t s) const {
    constexpr int64_t L = lanes<A>();
    if (s != 1 || n < 2 * L) return elementwise_leaf(*this, p, n, s);
    A m0[L], m1[L], nan[L];
    for (int64_t l = 0; l < L; ++l) m0[l] = m1[l] = identity(), nan[l] = 0;
    int64_t i = 0;
    for (; i + 2 * L <= n; i += 2 * L) {
#pragma omp simd
      for (int64_t l = 0; l < L; ++l) {
        A x0 = load<A>(p + i + l), x1 = load<A>(p + i + L + l);
        m0[l] = (IsMax ? x0 > m0[l] : x0 < m0[l]) ? x0 : m0[l];  // NaN x: false, keeps m
        m1[l] = (IsMax ? x1 > m1[l] : x1 < m1[l]) ? x1 : m1[l];
        nan[l] = ((x0 != x0) | (x1 != x1)) ? A(1) : nan[l];
      }
    }
    A m = elementwise_leaf(*this, p + i, n - i, 1);
    bool any_nan = false;
    for (int64_t l = 0; l < L; ++l) {
      m = combine(m, combine(m0[l], m1[l]));
      any_nan |= nan[l] != 0;
    }
    return any_nan ? std::numeric_limits<A>::quiet_NaN() : m;
  }
  template <int64_t B, class T>
  void leaf_rows(const T* const* rows, int64_t nrows, int64_t jn, A* acc) const {
    rows_leaf<B>(*this, rows, nrows, jn, acc);
  }
};
template <class A>
using MaxOp = ExtremumOp<A, true>;
template <class A>
using MinOp = ExtremumOp<A, false>;

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
template <class A>
struct AbsSumOp : SumOp<A> {
  A map(A x, A) const { return std::fabs(x); }
};
template <class A>
struct SquareSumOp : SumOp<A> {
  A map(A x, A) const { return x * x; }
};
template <class A>
struct PowSumOp : SumOp<A> {
  A p;
  A map(A x, A) const { return std::pow(std::fabs(x), p); }
};
template <class A>
struct NonzeroCountOp : SumOp<A> {
  A map(A x, A) const { return x != A(0) ? A(1) : A(0); }
};
template <class A>
struct AbsMaxOp {
  using acc_t = A;
  A identity() const { return A(0); }
  A map(A x, A) const { return std::fabs(x); }
  A combine(A a, A b) const { return nan_max(a, b); }
};
template <class A>
struct AbsMinOp {
  using acc_t = A;
  A identity() const { return highest<A>(); }
  A map(A x, A) const { return std::fabs(x); }
  A combine(A a, A b) const { return nan_min(a, b); }
};

// With a per-output param: squared deviation from a mean (var), exp(x - shift) (logsumexp,
// softmax).
template <class A>
struct SquaredDeviationOp : SumOp<A> {
  A map(A x, A mean) const {
    A d = x - mean;
    return d * d;
  }
};
template <class A>
struct ExpShiftOp : SumOp<A> {
  A map(A x, A shift) const { return math::Exp{}(x - shift); }
};

// ---------------------------------------------------------------------------------------------
// The plan
// ---------------------------------------------------------------------------------------------

struct Dim {
  int64_t size, stride;
};

// Dims that do not merge with their neighbours, at most, per kind (kept / reduced).
inline constexpr size_t kMaxPlanDims = 16;

struct ReducePlan {
  const void* data = nullptr;  // the first element walked
  Tensor copy;                 // a re-laid-out copy of the input, when the plan walks one
  std::vector<Dim> kept;       // outer to inner; outputs are row-major over these
  std::vector<Dim> reduced;    // outer to inner; never empty (a size-1 dim when nothing is reduced)
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
    // Memory order, outermost first; broadcast (stride 0) dims outermost of all, so that the
    // innermost reduced dim is a real one.
    auto key = [](const Dim& d) {
      return d.stride == 0 ? std::numeric_limits<int64_t>::max() : d.stride;
    };
    std::stable_sort(plan.reduced.begin(), plan.reduced.end(),
                     [&](const Dim& a, const Dim& b) { return key(a) > key(b); });
  }
  coalesce(plan.kept);
  coalesce(plan.reduced);
  if (plan.reduced.empty()) plan.reduced.push_back({1, 1});
  plan.data = x.impl().data();
  if (plan.kept.size() > kMaxPlanDims || plan.reduced.size() > kMaxPlanDims) {
    // Kept and reduced dims interleave too much to merge: walk a copy with the kept dims first and
    // the reduced dims last (each in logical order), where each kind merges into one dim.
    std::vector<int64_t> order;
    for (int64_t d = 0; d < x.dim(); ++d)
      if (!mask[d]) order.push_back(d);
    const size_t nkept = order.size();
    for (int64_t d = 0; d < x.dim(); ++d)
      if (mask[d]) order.push_back(d);
    Tensor copy = x.permute(order).contiguous();
    std::vector<bool> copy_mask(x.dim(), false);
    for (size_t d = nkept; d < copy_mask.size(); ++d) copy_mask[d] = true;
    ReducePlan merged = make_plan(copy, copy_mask, reorder);
    merged.copy = std::move(copy);
    return merged;
  }
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
// No allocation: it runs inside parallel regions, which exceptions must not leave.
class OffsetWalker {
 public:
  OffsetWalker(const Dim* dims, size_t n, int64_t start) : dims_(dims), n_(n) {
    for (size_t d = n; d-- > 0;) {
      idx_[d] = start % dims[d].size;
      off_ += idx_[d] * dims[d].stride;
      start /= dims[d].size;
    }
  }
  int64_t offset() const { return off_; }
  void next() {
    for (size_t d = n_; d-- > 0;) {
      off_ += dims_[d].stride;
      if (++idx_[d] < dims_[d].size) return;
      off_ -= dims_[d].size * dims_[d].stride;
      idx_[d] = 0;
    }
  }

 private:
  const Dim* dims_;
  size_t n_;
  std::array<int64_t, kMaxPlanDims> idx_{};
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

// Splits [0, n) into at most max_threads() chunks of >= grain, runs f(begin, end) -> R on each
// (in parallel) and folds the results in chunk order with combine.
template <class R, class F, class C>
R parallel_fold(int64_t n, int64_t grain, const F& f, const C& combine) {
  int64_t chunks = std::min<int64_t>(max_threads(), (n + grain - 1) / std::max<int64_t>(grain, 1));
  if (chunks <= 1) return f(int64_t{0}, n);
  std::unique_ptr<R[]> parts(new R[chunks]);
#pragma omp parallel for num_threads(static_cast <int>(chunks)) schedule(static)
  for (int64_t c = 0; c < chunks; ++c) parts[c] = f(n * c / chunks, n * (c + 1) / chunks);
  R acc = parts[0];
  for (int64_t c = 1; c < chunks; ++c) acc = combine(acc, parts[c]);
  return acc;
}

// ---------------------------------------------------------------------------------------------
// The engine
// ---------------------------------------------------------------------------------------------

template <class T>
class ReduceLoop {
 public:
  explicit ReduceLoop(const ReducePlan& plan)
      : base_(static_cast<const T*>(plan.data)), plan_(plan) {
    inner_ = plan.reduced.back();
    nrows_ = inner_.size > 0 ? plan.reduce_size / inner_.size : 0;
    vertical_ = !plan.kept.empty() && plan.kept.back().stride == 1;
  }

  // Calls store(o, acc) for every output o (from several threads, each o once).
  template <class Op, class Store>
  void run(const Op& op, const Store& store) const {
    if (plan_.num_outputs == 0) return;
    if (plan_.reduce_size == 0) {
      for (int64_t o = 0; o < plan_.num_outputs; ++o) store(o, op.identity());
      return;
    }
    if (vertical_)
      run_vertical(op, store);
    else
      run_per_output(op, store);
  }

 private:
  // Rows [r0, r1) of the reduced dims outside the innermost one, pairwise.
  template <class Op>
  typename Op::acc_t rows(const Op& op, const T* p, int64_t r0, int64_t r1) const {
    using A = typename Op::acc_t;
    const Dim* dims = plan_.reduced.data();
    const size_t ndims = plan_.reduced.size() - 1;
    if (r1 - r0 == 1)
      return reduce_run(op, p + offset_of(r0, dims, ndims), inner_.size, inner_.stride);
    if ((r1 - r0) * inner_.size <= kChunk && r1 - r0 <= kLeafRows) {
      OffsetWalker w(dims, ndims, r0);
      A acc = op.identity();
      for (int64_t r = r0; r < r1; ++r, w.next())
        acc = op.combine(acc, reduce_run(op, p + w.offset(), inner_.size, inner_.stride));
      return acc;
    }
    int64_t mid = r0 + (r1 - r0) / 2;
    auto left = rows(op, p, r0, mid);  // first: see reduce_run
    return op.combine(left, rows(op, p, mid, r1));
  }

  // Short contiguous reductions of adjacent outputs (sum over a last dim of 4): a block of outputs
  // in vector lanes, one strided load per reduced element, instead of one short loop per output.
  bool short_rows() const {
    return nrows_ == 1 && inner_.stride == 1 && inner_.size <= kShortRow && !plan_.kept.empty() &&
           plan_.kept.back().stride == inner_.size;
  }

  template <class Op, class Store>
  void run_short_rows(const Op& op, const Store& store) const {
    using A = typename Op::acc_t;
    constexpr int64_t B = 64;
    const int64_t L = inner_.size, J = plan_.kept.back().size, nblocks = (J + B - 1) / B;
    const Dim* outer = plan_.kept.data();
    const size_t nouter = plan_.kept.size() - 1;
    parallel_for(plan_.num_outputs / J * nblocks, std::max<int64_t>(1, kGrainSize / (B * L)),
                 [&](int64_t t0, int64_t t1) {
                   for (int64_t t = t0; t < t1; ++t) {
                     const int64_t ko = t / nblocks, j0 = (t % nblocks) * B;
                     const int64_t jn = std::min(B, J - j0);
                     A acc[B];
                     short_rows_leaf<B>(op, base_ + offset_of(ko, outer, nouter) + j0 * L, L, jn,
                                        acc);
                     for (int64_t b = 0; b < jn; ++b) store(ko * J + j0 + b, acc[b]);
                   }
                 });
  }

  template <class Op, class Store>
  void run_per_output(const Op& op, const Store& store) const {
    using A = typename Op::acc_t;
    if constexpr (Elementwise<Op>) {
      if (short_rows()) return run_short_rows(op, store);
    }
    const int64_t outputs = plan_.num_outputs, size = plan_.reduce_size;
    const Dim* kept = plan_.kept.data();
    const size_t nkept = plan_.kept.size();
    if (outputs >= max_threads() || size < 2 * kGrainSize) {
      parallel_for(outputs, std::max<int64_t>(1, kGrainSize / size), [&](int64_t b, int64_t e) {
        OffsetWalker w(kept, nkept, b);
        for (int64_t o = b; o < e; ++o, w.next()) store(o, rows(op, base_ + w.offset(), 0, nrows_));
      });
      return;
    }
    // Few outputs with long reductions: split each one across threads.
    auto combine = [&](const A& a, const A& b) { return op.combine(a, b); };
    for (int64_t o = 0; o < outputs; ++o) {
      const T* p = base_ + offset_of(o, kept, nkept);
      if (nrows_ >= 2) {
        store(o, parallel_fold<A>(
                     nrows_, std::max<int64_t>(1, kGrainSize / inner_.size),
                     [&](int64_t b, int64_t e) { return rows(op, p, b, e); }, combine));
      } else {
        const int64_t s = inner_.stride;
        store(o, parallel_fold<A>(
                     inner_.size, kGrainSize,
                     [&](int64_t b, int64_t e) { return reduce_run(op, p + b * s, e - b, s); },
                     combine));
      }
    }
  }

  // Vertical: acc[b] over reduced rows [r0, r1) for the jn <= B adjacent outputs at p, pairwise.
  template <int64_t B, class Op>
  void vertical_rows(const Op& op, const T* p, int64_t r0, int64_t r1, int64_t jn,
                     typename Op::acc_t* acc) const {
    using A = typename Op::acc_t;
    if (r1 - r0 > kLeafRows) {
      int64_t mid = r0 + (r1 - r0) / 2;
      vertical_rows<B>(op, p, r0, mid, jn, acc);
      A tmp[B];
      vertical_rows<B>(op, p, mid, r1, jn, tmp);
      for (int64_t b = 0; b < jn; ++b) acc[b] = op.combine(acc[b], tmp[b]);
      return;
    }
    const T* row_ptrs[kLeafRows];
    OffsetWalker w(plan_.reduced.data(), plan_.reduced.size(), r0);
    for (int64_t r = r0; r < r1; ++r, w.next()) row_ptrs[r - r0] = p + w.offset();
    if constexpr (CustomLeaves<Op>)
      op.template leaf_rows<B>(row_ptrs, r1 - r0, jn, acc);
    else
      rows_leaf<B>(op, row_ptrs, r1 - r0, jn, acc);
  }

  // Vertical with the rows split across threads (few output blocks, long reductions).
  template <int64_t B, class Op>
  void vertical_parallel(const Op& op, const T* p, int64_t jn, typename Op::acc_t* acc) const {
    using A = typename Op::acc_t;
    const int64_t R = plan_.reduce_size;
    int64_t chunks = std::min<int64_t>(max_threads(), std::max<int64_t>(1, R * jn / kGrainSize));
    if (chunks <= 1) {
      vertical_rows<B>(op, p, 0, R, jn, acc);
      return;
    }
    std::unique_ptr<A[]> parts(new A[chunks * B]);
#pragma omp parallel for num_threads(static_cast <int>(chunks)) schedule(static)
    for (int64_t c = 0; c < chunks; ++c)
      vertical_rows<B>(op, p, R * c / chunks, R * (c + 1) / chunks, jn, &parts[c * B]);
    for (int64_t b = 0; b < jn; ++b) acc[b] = parts[b];
    for (int64_t c = 1; c < chunks; ++c)
      for (int64_t b = 0; b < jn; ++b) acc[b] = op.combine(acc[b], parts[c * B + b]);
  }

  // Vertical with few adjacent outputs over adjacent rows (sum over dim 0 of an (N, 4) matrix):
  // the rows form one contiguous run, reduced with plain vector lanes; lane l holds output
  // l % J, as J divides the lane count.
  template <class A>
  bool periodic() const {
    const int64_t J = plan_.kept.back().size;
    return J <= kShortRow && lanes<A>() % J == 0 && plan_.reduced.size() == 1 &&
           plan_.reduced[0].stride == J;
  }

  template <class A>
  using Period = std::array<A, kShortRow>;

  // out[j] for j < J over n (a multiple of J) contiguous elements at p, n <= kChunk.
  template <class Op>
  KILN_FLATTEN Period<typename Op::acc_t> periodic_leaf(const Op& op, const T* p, int64_t n,
                                                        int64_t J) const {
    using A = typename Op::acc_t;
    constexpr int64_t L = lanes<A>();
    A acc[L], acc1[L];
    for (int64_t l = 0; l < L; ++l) acc[l] = acc1[l] = op.identity();
    int64_t i = 0;
    for (; i + 2 * L <= n; i += 2 * L) {
#pragma omp simd
      for (int64_t l = 0; l < L; ++l) {
        acc[l] = op.combine(acc[l], op.map(load<A>(p + i + l), A{}));
        acc1[l] = op.combine(acc1[l], op.map(load<A>(p + i + L + l), A{}));
      }
    }
    for (; i + L <= n; i += L) {
#pragma omp simd
      for (int64_t l = 0; l < L; ++l) acc[l] = op.combine(acc[l], op.map(load<A>(p + i + l), A{}));
    }
    for (int64_t l = 0; i + l < n; ++l)
      acc[l] = op.combine(acc[l], op.map(load<A>(p + i + l), A{}));
    Period<A> out;
    for (int64_t j = 0; j < J; ++j) out[j] = op.identity();
    for (int64_t l = 0; l < L; ++l)
      out[l % J] = op.combine(out[l % J], op.combine(acc[l], acc1[l]));
    return out;
  }

  template <class Op>
  Period<typename Op::acc_t> periodic_run(const Op& op, const T* p, int64_t n, int64_t J) const {
    if (n <= kChunk) return periodic_leaf(op, p, n, J);
    const int64_t half = (n / 2 + kChunk - 1) / kChunk * kChunk;  // a multiple of J
    auto out = periodic_run(op, p, half, J);
    auto right = periodic_run(op, p + half, n - half, J);
    for (int64_t j = 0; j < J; ++j) out[j] = op.combine(out[j], right[j]);
    return out;
  }

  template <class Op, class Store>
  void run_periodic(const Op& op, const Store& store) const {
    using A = typename Op::acc_t;
    const int64_t J = plan_.kept.back().size, R = plan_.reduce_size;
    const int64_t outer_count = plan_.num_outputs / J;
    const Dim* outer = plan_.kept.data();
    const size_t nouter = plan_.kept.size() - 1;
    auto write = [&](int64_t ko, const Period<A>& r) {
      for (int64_t j = 0; j < J; ++j) store(ko * J + j, r[j]);
    };
    if (outer_count >= max_threads() || R * J < 2 * kGrainSize) {
      parallel_for(outer_count, std::max<int64_t>(1, kGrainSize / (R * J)),
                   [&](int64_t b, int64_t e) {
                     for (int64_t ko = b; ko < e; ++ko)
                       write(ko, periodic_run(op, base_ + offset_of(ko, outer, nouter), R * J, J));
                   });
      return;
    }
    auto combine = [&](const Period<A>& a, const Period<A>& b) {
      Period<A> r;
      for (int64_t j = 0; j < J; ++j) r[j] = op.combine(a[j], b[j]);
      return r;
    };
    for (int64_t ko = 0; ko < outer_count; ++ko) {
      const T* p = base_ + offset_of(ko, outer, nouter);
      // Split at multiples of kChunk rows' worth of elements so every part starts on output 0.
      const int64_t parts = (R * J + kChunk - 1) / kChunk;
      write(ko, parallel_fold<Period<A>>(
                    parts, std::max<int64_t>(1, kGrainSize / kChunk),
                    [&](int64_t b, int64_t e) {
                      const int64_t begin = b * kChunk, end = std::min(R * J, e * kChunk);
                      return periodic_run(op, p + begin, end - begin, J);
                    },
                    combine));
    }
  }

  template <class Op, class Store>
  void run_vertical(const Op& op, const Store& store) const {
    using A = typename Op::acc_t;
    if constexpr (Elementwise<Op>) {
      if (periodic<A>()) return run_periodic(op, store);
    }
    constexpr int64_t B = block<A>();
    const int64_t J = plan_.kept.back().size;
    const int64_t nblocks = (J + B - 1) / B;
    const int64_t tasks = plan_.num_outputs / J * nblocks;
    const Dim* outer = plan_.kept.data();
    const size_t nouter = plan_.kept.size() - 1;
    const int64_t R = plan_.reduce_size;
    auto task = [&](int64_t t, bool split_rows) {
      int64_t ko = t / nblocks, j0 = (t % nblocks) * B, jn = std::min(B, J - j0);
      const T* p = base_ + offset_of(ko, outer, nouter) + j0;
      A acc[B];
      if (split_rows)
        vertical_parallel<B>(op, p, jn, acc);
      else
        vertical_rows<B>(op, p, 0, R, jn, acc);
      for (int64_t b = 0; b < jn; ++b) store(ko * J + j0 + b, acc[b]);
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
