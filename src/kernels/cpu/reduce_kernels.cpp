// CPU kernels of the plain reductions: sum, mean, prod, amax/amin (and max/min of all elements),
// any/all, var/std/var_mean, norm, logsumexp. The loops live in reduce_loops.h; each kernel picks
// the element type, the accumulation type and the op, and writes the finished value.
#include <cmath>
#include <limits>

#include "kernels/cpu/loops.h"
#include "kernels/cpu/reduce_loops.h"
#include "core/shape.h"
#include "core/tensor_factory.h"
#include "kiln/op_table.h"

namespace kiln::cpu {

namespace {

using namespace reduce;

std::vector<bool> mask_of(const OpCall& c, const Tensor& x, size_t attr) {
  return kiln::detail::dim_mask(c.ints_attr(attr), x.dim(), c.name());
}

// How many elements each output reduces.
int64_t reduced_count(const Tensor& x, const std::vector<bool>& mask) {
  int64_t n = 1;
  for (int64_t d = 0; d < x.dim(); ++d)
    if (mask[d]) n *= x.sizes()[d];
  return n;
}

// out[o] = fin(reduce(op) of output o). out is contiguous and has element type Out.
template <class T, class Out, class Op, class Fin>
void reduce_into(const Tensor& x, const std::vector<bool>& mask, const Op& op, Tensor& out,
                 const Fin& fin) {
  ReducePlan plan = make_plan(x, mask);
  ReduceLoop<T> loop(plan);
  Out* o = static_cast<Out*>(out.impl().data());
  loop.run(op, [&](int64_t i, const typename Op::acc_t& a) { o[i] = store_as<Out>(fin(a)); });
}

constexpr auto kIdentity = [](auto a) { return a; };

// sum and prod: floating outputs accumulate in float/double over the input converted to the
// output dtype; integral outputs accumulate in int64 (wrapping) and are converted at the end.
template <template <class> class Op>
void sum_like(const char* name, const Tensor& x_in, const std::vector<bool>& mask, Tensor& out) {
  DType od = out.dtype();
  if (is_floating_point(od)) {
    Tensor x = as_dtype(x_in, od);
    KILN_DISPATCH_FLOATING(od, name, [&] {
      reduce_into<scalar_t, scalar_t>(x, mask, Op<acc_t<scalar_t>>{}, out, kIdentity);
    });
    return;
  }
  Tensor x = is_floating_point(x_in.dtype()) ? x_in.to(od) : x_in;
  Tensor target =
      od == kInt64 ? out : kiln::detail::make_empty(out.sizes().vec(), kInt64, out.device());
  KILN_DISPATCH_INTEGRAL_AND_BOOL(x.dtype(), name, [&] {
    reduce_into<scalar_t, int64_t>(x, mask, Op<int64_t>{}, target, kIdentity);
  });
  if (od != kInt64) out.copy_(target);
}

void sum_kernel(const OpCall& c, std::span<Tensor> outs) {
  const Tensor& x = c.input(0);
  auto mask = mask_of(c, x, 0);
  into_contiguous(outs[0], [&](Tensor& out) { sum_like<SumOp>("sum", x, mask, out); });
}

void prod_kernel(const OpCall& c, std::span<Tensor> outs) {
  const Tensor& x = c.input(0);
  std::vector<bool> mask(x.dim(), !c.has_attr(0));
  if (c.has_attr(0) && x.dim() > 0)
    mask[kiln::detail::wrap_dim(c.int_attr(0), x.dim(), "prod")] = true;
  into_contiguous(outs[0], [&](Tensor& out) { sum_like<ProdOp>("prod", x, mask, out); });
}

void mean_kernel(const OpCall& c, std::span<Tensor> outs) {
  const Tensor& x = c.input(0);
  auto mask = mask_of(c, x, 0);
  int64_t n = reduced_count(x, mask);
  into_contiguous(outs[0], [&](Tensor& out) {
    KILN_DISPATCH_FLOATING(x.dtype(), "mean", [&] {
      using A = acc_t<scalar_t>;
      reduce_into<scalar_t, scalar_t>(x, mask, SumOp<A>{}, out,
                                      [n](A a) { return a / static_cast<A>(n); });
    });
  });
}

// amax, amin, and max/min of all elements (the meta function rejects empty reductions).
template <template <class> class Op>
void extremum_kernel(const OpCall& c, std::span<Tensor> outs, bool all_dims) {
  const Tensor& x = c.input(0);
  auto mask = all_dims ? std::vector<bool>(x.dim(), true) : mask_of(c, x, 0);
  into_contiguous(outs[0], [&](Tensor& out) {
    KILN_DISPATCH_ALL(x.dtype(), c.name(), [&] {
      reduce_into<scalar_t, scalar_t>(x, mask, Op<opmath_t<scalar_t>>{}, out, kIdentity);
    });
  });
}

// any / all: bool results (uint8 for uint8 inputs, like PyTorch).
template <class Op>
void any_all_kernel(const OpCall& c, std::span<Tensor> outs) {
  const Tensor& x = c.input(0);
  auto mask = mask_of(c, x, 0);
  into_contiguous(outs[0], [&](Tensor& out) {
    KILN_DISPATCH_ALL(x.dtype(), c.name(), [&] {
      if (out.dtype() == kUInt8)
        reduce_into<scalar_t, uint8_t>(x, mask, Op{}, out, kIdentity);
      else
        reduce_into<scalar_t, bool>(x, mask, Op{}, out, kIdentity);
    });
  });
}

// var, std, var_mean: each leaf (a chunk of elements or of rows, in cache) takes its mean and
// then its sum of squared deviations from it; leaves merge with Chan et al.'s pairwise update.
// Accurate however far the mean is from zero, and one read of the input from memory.
template <class A>
struct Moments {
  A mean = 0, m2 = 0;
  int64_t n = 0;
};

template <class A>
struct MomentsOp {
  using acc_t = Moments<A>;
  static constexpr bool custom_leaves = true;
  acc_t identity() const { return {}; }
  acc_t combine(const acc_t& a, const acc_t& b) const {
    if (a.n == 0) return b;
    if (b.n == 0) return a;
    const int64_t n = a.n + b.n;
    const A wb = static_cast<A>(b.n) / static_cast<A>(n), d = b.mean - a.mean;
    return {a.mean + d * wb, a.m2 + b.m2 + d * d * static_cast<A>(a.n) * wb, n};
  }
  template <class T>
  acc_t leaf(const T* p, int64_t n, int64_t s) const {
    if (n == 0) return {};
    const A mean = elementwise_leaf(SumOp<A>{}, p, n, s) / static_cast<A>(n);
    return {mean, elementwise_leaf(SquaredDeviationOp<A>{}, p, n, s, mean), n};
  }
  template <int64_t B, class T>
  void leaf_rows(const T* const* rows, int64_t nrows, int64_t jn, acc_t* acc) const {
    A sum[B], mean[B], m2[B];
    rows_leaf<B>(SumOp<A>{}, rows, nrows, jn, sum);
    for (int64_t b = 0; b < B; ++b) mean[b] = sum[b] / static_cast<A>(nrows);
    rows_leaf<B>(SquaredDeviationOp<A>{}, rows, nrows, jn, m2, mean);
    for (int64_t b = 0; b < jn; ++b) acc[b] = {mean[b], m2[b], nrows};
  }
};

enum class MomentsKind { var, std, var_mean };

void moments_kernel(const OpCall& c, std::span<Tensor> outs, MomentsKind kind) {
  const Tensor& x = c.input(0);
  auto mask = mask_of(c, x, 0);
  const int64_t dof = std::max<int64_t>(0, reduced_count(x, mask) - c.int_attr(1));
  Tensor mean_out = kind == MomentsKind::var_mean ? outs[1] : Tensor();
  const bool temp_mean = mean_out.defined() && !mean_out.is_contiguous();
  if (temp_mean)
    mean_out =
        kiln::detail::make_empty(mean_out.sizes().vec(), mean_out.dtype(), mean_out.device());
  into_contiguous(outs[0], [&](Tensor& out) {
    KILN_DISPATCH_FLOATING(x.dtype(), c.name(), [&] {
      using A = acc_t<scalar_t>;
      ReducePlan plan = make_plan(x, mask);
      ReduceLoop<scalar_t> loop(plan);
      scalar_t* o = static_cast<scalar_t*>(out.impl().data());
      scalar_t* m = mean_out.defined() ? static_cast<scalar_t*>(mean_out.impl().data()) : nullptr;
      const A divisor = static_cast<A>(dof);
      const bool take_sqrt = kind == MomentsKind::std;
      loop.run(MomentsOp<A>{}, [&](int64_t i, const Moments<A>& r) {
        A var = r.m2 / divisor;  // 0 / 0 = nan for an empty reduction
        o[i] = store_as<scalar_t>(take_sqrt ? std::sqrt(var) : var);
        if (m) m[i] = store_as<scalar_t>(r.n > 0 ? r.mean : std::numeric_limits<A>::quiet_NaN());
      });
    });
  });
  if (temp_mean) outs[1].copy_(mean_out);
}

void norm_kernel(const OpCall& c, std::span<Tensor> outs) {
  const Tensor& x = c.input(0);
  const double p = c.scalar_attr(0).to_double();
  auto mask = mask_of(c, x, 1);
  into_contiguous(outs[0], [&](Tensor& out) {
    KILN_DISPATCH_FLOATING(x.dtype(), "norm", [&] {
      using T = scalar_t;
      using A = acc_t<T>;
      if (p == 2)
        reduce_into<T, T>(x, mask, SquareSumOp<A>{}, out, [](A a) { return std::sqrt(a); });
      else if (p == 1)
        reduce_into<T, T>(x, mask, AbsSumOp<A>{}, out, kIdentity);
      else if (p == 0)
        reduce_into<T, T>(x, mask, NonzeroCountOp<A>{}, out, kIdentity);
      else if (std::isinf(p) && p > 0)
        reduce_into<T, T>(x, mask, AbsMaxOp<A>{}, out, kIdentity);
      else if (std::isinf(p))
        reduce_into<T, T>(x, mask, AbsMinOp<A>{}, out, kIdentity);
      else {
        const A pa = static_cast<A>(p), inv = static_cast<A>(1.0 / p);
        reduce_into<T, T>(x, mask, PowSumOp<A>{{}, pa}, out,
                          [inv](A a) { return std::pow(a, inv); });
      }
    });
  });
}

// logsumexp = shift + log(sum(exp(x - shift))) with shift the max (0 when it is infinite, so all
// -inf gives -inf and a +inf gives +inf rather than nan). Each leaf takes its max and then its sum
// of exponentials while in cache; leaves merge by rescaling to the larger shift.
template <class A>
struct ShiftedSum {
  A shift = 0, sum = 0;  // the value is log(sum) + shift
};

template <class A>
struct LogSumExpOp {
  using acc_t = ShiftedSum<A>;
  static constexpr bool custom_leaves = true;
  static A shift_of(A max) { return std::isinf(max) ? A(0) : max; }
  acc_t identity() const { return {}; }
  acc_t combine(const acc_t& a, const acc_t& b) const {
    if (a.sum == 0) return b;  // empty, or all -inf
    if (b.sum == 0) return a;
    if (std::isnan(a.sum) || std::isnan(b.sum)) return {0, std::numeric_limits<A>::quiet_NaN()};
    if (std::isinf(a.sum) || std::isinf(b.sum)) return {0, std::numeric_limits<A>::infinity()};
    const A m = std::max(a.shift, b.shift);
    return {m, a.sum * std::exp(a.shift - m) + b.sum * std::exp(b.shift - m)};
  }
  template <class T>
  acc_t leaf(const T* p, int64_t n, int64_t s) const {
    const A shift = shift_of(leaf_of(MaxOp<A>{}, p, n, s));
    return {shift, elementwise_leaf(ExpShiftOp<A>{}, p, n, s, shift)};
  }
  template <int64_t B, class T>
  void leaf_rows(const T* const* rows, int64_t nrows, int64_t jn, acc_t* acc) const {
    A shift[B], sum[B];
    rows_leaf<B>(MaxOp<A>{}, rows, nrows, jn, shift);
    for (int64_t b = 0; b < B; ++b) shift[b] = shift_of(shift[b]);
    rows_leaf<B>(ExpShiftOp<A>{}, rows, nrows, jn, sum, shift);
    for (int64_t b = 0; b < jn; ++b) acc[b] = {shift[b], sum[b]};
  }
};

void logsumexp_kernel(const OpCall& c, std::span<Tensor> outs) {
  auto mask = mask_of(c, c.input(0), 0);
  into_contiguous(outs[0], [&](Tensor& out) {
    Tensor x = as_dtype(c.input(0), out.dtype());
    KILN_DISPATCH_FLOATING(x.dtype(), "logsumexp", [&] {
      using A = acc_t<scalar_t>;
      reduce_into<scalar_t, scalar_t>(x, mask, LogSumExpOp<A>{}, out, [](const ShiftedSum<A>& r) {
        return std::log(r.sum) + r.shift;
      });
    });
  });
}

[[maybe_unused]] const bool registered = [] {
  register_kernel("sum", DeviceType::cpu, sum_kernel);
  register_kernel("prod", DeviceType::cpu, prod_kernel);
  register_kernel("mean", DeviceType::cpu, mean_kernel);
  register_kernel("amax", DeviceType::cpu, [](const OpCall& c, std::span<Tensor> o) {
    extremum_kernel<MaxOp>(c, o, false);
  });
  register_kernel("amin", DeviceType::cpu, [](const OpCall& c, std::span<Tensor> o) {
    extremum_kernel<MinOp>(c, o, false);
  });
  register_kernel("max", DeviceType::cpu,
                  [](const OpCall& c, std::span<Tensor> o) { extremum_kernel<MaxOp>(c, o, true); });
  register_kernel("min", DeviceType::cpu,
                  [](const OpCall& c, std::span<Tensor> o) { extremum_kernel<MinOp>(c, o, true); });
  register_kernel("any", DeviceType::cpu, any_all_kernel<AnyOp>);
  register_kernel("all", DeviceType::cpu, any_all_kernel<AllOp>);
  register_kernel("var", DeviceType::cpu, [](const OpCall& c, std::span<Tensor> o) {
    moments_kernel(c, o, MomentsKind::var);
  });
  register_kernel("std", DeviceType::cpu, [](const OpCall& c, std::span<Tensor> o) {
    moments_kernel(c, o, MomentsKind::std);
  });
  register_kernel("var_mean", DeviceType::cpu, [](const OpCall& c, std::span<Tensor> o) {
    moments_kernel(c, o, MomentsKind::var_mean);
  });
  register_kernel("norm", DeviceType::cpu, norm_kernel);
  register_kernel("logsumexp", DeviceType::cpu, logsumexp_kernel);
  return true;
}();

}  // namespace

}  // namespace kiln::cpu
