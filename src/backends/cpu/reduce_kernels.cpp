// CPU kernels of the plain reductions: sum, mean, prod, amax/amin (and max/min of all elements),
// any/all, var/std/var_mean, norm, logsumexp. The loops live in reduce_loops.h; each kernel picks
// the element type, the accumulation type and the op, and writes the finished value.
#include <cmath>

#include "backends/cpu/loops.h"
#include "backends/cpu/reduce_loops.h"
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

template <class T>
const T* data_of(const Tensor& x) {
  return static_cast<const T*>(x.impl().data());
}

// out[o] = fin(reduce(op) of output o). out is contiguous and has element type Out.
template <class T, class Out, class Op, class Fin>
void reduce_into(const Tensor& x, const std::vector<bool>& mask, const Op& op, Tensor& out, const Fin& fin) {
  ReducePlan plan = make_plan(x, mask);
  ReduceLoop<T> loop(data_of<T>(x), plan);
  Out* o = static_cast<Out*>(out.impl().data());
  loop.run(op, [&](int64_t i, typename Op::acc_t a) { o[i] = store_as<Out>(fin(a)); });
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
  Tensor target = od == kInt64 ? out : kiln::detail::make_empty(out.sizes().vec(), kInt64, out.device());
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
  if (c.has_attr(0) && x.dim() > 0) mask[kiln::detail::wrap_dim(c.int_attr(0), x.dim(), "prod")] = true;
  into_contiguous(outs[0], [&](Tensor& out) { sum_like<ProdOp>("prod", x, mask, out); });
}

void mean_kernel(const OpCall& c, std::span<Tensor> outs) {
  const Tensor& x = c.input(0);
  auto mask = mask_of(c, x, 0);
  int64_t n = reduced_count(x, mask);
  into_contiguous(outs[0], [&](Tensor& out) {
    KILN_DISPATCH_FLOATING(x.dtype(), "mean", [&] {
      using A = acc_t<scalar_t>;
      reduce_into<scalar_t, scalar_t>(x, mask, SumOp<A>{}, out, [n](A a) { return a / static_cast<A>(n); });
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
      if (out.dtype() == kUInt8) reduce_into<scalar_t, uint8_t>(x, mask, Op{}, out, kIdentity);
      else reduce_into<scalar_t, bool>(x, mask, Op{}, out, kIdentity);
    });
  });
}

// var, std, var_mean: two passes per output (the mean, then the squared deviations from it).
enum class Moments { var, std, var_mean };

void moments_kernel(const OpCall& c, std::span<Tensor> outs, Moments kind) {
  const Tensor& x = c.input(0);
  auto mask = mask_of(c, x, 0);
  const int64_t n = reduced_count(x, mask);
  const int64_t correction = c.int_attr(1);
  const int64_t dof = std::max<int64_t>(0, n - correction);
  Tensor mean_out = kind == Moments::var_mean ? outs[1] : Tensor();
  bool temp_mean = mean_out.defined() && !mean_out.is_contiguous();
  if (temp_mean) mean_out = kiln::detail::make_empty(mean_out.sizes().vec(), mean_out.dtype(), mean_out.device());
  into_contiguous(outs[0], [&](Tensor& out) {
    KILN_DISPATCH_FLOATING(x.dtype(), c.name(), [&] {
      using A = acc_t<scalar_t>;
      ReducePlan plan = make_plan(x, mask);
      ReduceLoop<scalar_t> loop(data_of<scalar_t>(x), plan);
      scalar_t* o = static_cast<scalar_t*>(out.impl().data());
      scalar_t* m = mean_out.defined() ? static_cast<scalar_t*>(mean_out.impl().data()) : nullptr;
      const A count = static_cast<A>(n), divisor = static_cast<A>(dof);
      const bool take_sqrt = kind == Moments::std;
      loop.run2(SumOp<A>{}, SquaredDeviationOp<A>{}, [count](A sum) { return sum / count; },
                [&](int64_t i, A sum, A squares) {
                  A var = squares / divisor;
                  o[i] = store_as<scalar_t>(take_sqrt ? std::sqrt(var) : var);
                  if (m) m[i] = store_as<scalar_t>(sum / count);
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
      if (p == 2) reduce_into<T, T>(x, mask, SquareSumOp<A>{}, out, [](A a) { return std::sqrt(a); });
      else if (p == 1) reduce_into<T, T>(x, mask, AbsSumOp<A>{}, out, kIdentity);
      else if (p == 0) reduce_into<T, T>(x, mask, NonzeroCountOp<A>{}, out, kIdentity);
      else if (std::isinf(p) && p > 0) reduce_into<T, T>(x, mask, AbsMaxOp<A>{}, out, kIdentity);
      else if (std::isinf(p)) reduce_into<T, T>(x, mask, AbsMinOp<A>{}, out, kIdentity);
      else {
        const A pa = static_cast<A>(p), inv = static_cast<A>(1.0 / p);
        reduce_into<T, T>(x, mask, PowSumOp<A>{{}, pa}, out, [inv](A a) { return std::pow(a, inv); });
      }
    });
  });
}

// logsumexp = m + log(sum(exp(x - m))) with m the max (0 when infinite, so all -inf gives -inf and
// a +inf gives +inf rather than nan).
void logsumexp_kernel(const OpCall& c, std::span<Tensor> outs) {
  auto mask = mask_of(c, c.input(0), 0);
  into_contiguous(outs[0], [&](Tensor& out) {
    Tensor x = as_dtype(c.input(0), out.dtype());
    KILN_DISPATCH_FLOATING(x.dtype(), "logsumexp", [&] {
      using A = acc_t<scalar_t>;
      ReducePlan plan = make_plan(x, mask);
      ReduceLoop<scalar_t> loop(data_of<scalar_t>(x), plan);
      scalar_t* o = static_cast<scalar_t*>(out.impl().data());
      auto shift = [](A m) { return std::isinf(m) ? A(0) : m; };
      loop.run2(MaxOp<A>{}, ExpShiftOp<A>{}, shift,
                [&](int64_t i, A m, A s) { o[i] = store_as<scalar_t>(std::log(s) + shift(m)); });
    });
  });
}

[[maybe_unused]] const bool registered = [] {
  register_kernel("sum", DeviceType::cpu, sum_kernel);
  register_kernel("prod", DeviceType::cpu, prod_kernel);
  register_kernel("mean", DeviceType::cpu, mean_kernel);
  register_kernel("amax", DeviceType::cpu,
                  [](const OpCall& c, std::span<Tensor> o) { extremum_kernel<MaxOp>(c, o, false); });
  register_kernel("amin", DeviceType::cpu,
                  [](const OpCall& c, std::span<Tensor> o) { extremum_kernel<MinOp>(c, o, false); });
  register_kernel("max", DeviceType::cpu,
                  [](const OpCall& c, std::span<Tensor> o) { extremum_kernel<MaxOp>(c, o, true); });
  register_kernel("min", DeviceType::cpu,
                  [](const OpCall& c, std::span<Tensor> o) { extremum_kernel<MinOp>(c, o, true); });
  register_kernel("any", DeviceType::cpu, any_all_kernel<AnyOp>);
  register_kernel("all", DeviceType::cpu, any_all_kernel<AllOp>);
  register_kernel("var", DeviceType::cpu,
                  [](const OpCall& c, std::span<Tensor> o) { moments_kernel(c, o, Moments::var); });
  register_kernel("std", DeviceType::cpu,
                  [](const OpCall& c, std::span<Tensor> o) { moments_kernel(c, o, Moments::std); });
  register_kernel("var_mean", DeviceType::cpu,
                  [](const OpCall& c, std::span<Tensor> o) { moments_kernel(c, o, Moments::var_mean); });
  register_kernel("norm", DeviceType::cpu, norm_kernel);
  register_kernel("logsumexp", DeviceType::cpu, logsumexp_kernel);
  return true;
}();

}  // namespace

}  // namespace kiln::cpu
