// CPU kernels of the pointwise binary ops: cpu::pointwise over the functors of kiln/math/functors.h.
//
// Arithmetic ops compute in the output dtype (the meta's promoted dtype); comparisons and logical
// ops compute in the operands' promoted dtype and write bool. Integer division and remainder
// check the divisor for zeros in a serial pass before writing anything.
#include <string>

#include "kernels/cpu/loops.h"
#include "core/tensor_factory.h"
#include "kiln/math/functors.h"
#include "kiln/op_table.h"
#include "ops/pointwise_list.h"

namespace kiln::cpu {

namespace {

namespace m = kiln::math;

// out = F(a, b) computed in out's dtype.
template <class F>
void same_dtype_kernel(const OpCall& c, std::span<Tensor> outs, bool allow_bool) {
  Tensor& out = outs[0];
  if (out.numel() == 0) return;
  auto run = [&]<class T>() { pointwise<T>(out, F{}, c.input(0), c.input(1)); };
  if (allow_bool && out.dtype() == kBool) return run.template operator()<bool>();
  KILN_DISPATCH_NUMERIC(out.dtype(), c.name(), [&] { run.template operator()<scalar_t>(); });
}

// out (bool) = F(a, b) computed in the operands' promoted dtype.
template <class F>
void predicate_kernel(const OpCall& c, std::span<Tensor> outs) {
  Tensor& out = outs[0];
  if (out.numel() == 0) return;
  DType common = detail::result_type(c.inputs);
  KILN_DISPATCH_ALL(common, c.name(), [&] { pointwise<scalar_t, bool>(out, F{}, c.input(0), c.input(1)); });
}

template <class F>
void floating_kernel(const OpCall& c, std::span<Tensor> outs) {
  Tensor& out = outs[0];
  if (out.numel() == 0) return;
  KILN_DISPATCH_FLOATING(out.dtype(), c.name(), [&] { pointwise<scalar_t>(out, F{}, c.input(0), c.input(1)); });
}

template <class F>
void integral_kernel(const OpCall& c, std::span<Tensor> outs, bool allow_bool) {
  Tensor& out = outs[0];
  if (out.numel() == 0) return;
  if (allow_bool) {
    KILN_DISPATCH_INTEGRAL_AND_BOOL(out.dtype(), c.name(),
                                    [&] { pointwise<scalar_t>(out, F{}, c.input(0), c.input(1)); });
  } else {
    KILN_DISPATCH_INTEGRAL(out.dtype(), c.name(), [&] { pointwise<scalar_t>(out, F{}, c.input(0), c.input(1)); });
  }
}

// Whether any element of t, converted to T, is zero (a serial pass: it runs before any write).
template <class T>
bool has_zero(const Tensor& t) {
  Tensor v = as_dtype(t, dtype_of_v<T>);
  StridedLoop<1> loop(v.sizes(), {&v});
  bool zero = false;
  loop.run(0, loop.numel, [&](const std::array<char*, 1>& p, const std::array<int64_t, 1>& st, int64_t n) {
    const T* x = reinterpret_cast<const T*>(p[0]);
    for (int64_t i = 0; i < n && !zero; ++i) zero = x[i * st[0]] == T(0);
  });
  return zero;
}

template <class T>
void check_no_zero_divisor(const OpCall& c) {
  KILN_CHECK(!has_zero<T>(c.input(1)), ValueError,
             "[kiln::" + c.name() + "] ZeroDivisionError: integer division by zero. "
             "Make sure the divisor has no zeros, or divide in a floating dtype.");
}

// add and sub: a + alpha * b (sub negates alpha).
template <bool kSubtract>
void add_kernel(const OpCall& c, std::span<Tensor> outs) {
  Tensor& out = outs[0];
  if (out.numel() == 0) return;
  Scalar alpha = c.has_attr(0) ? c.scalar_attr(0) : Scalar(1);
  KILN_DISPATCH_ALL(out.dtype(), c.name(), [&] {
    using M = opmath_t<scalar_t>;
    const Tensor &a = c.input(0), &b = c.input(1);
    if (alpha.to_double() == 1.0) {
      if constexpr (kSubtract) pointwise<scalar_t>(out, m::Sub{}, a, b);
      else pointwise<scalar_t>(out, m::Add{}, a, b);
    } else {
      M s = alpha.to<M>();
      if constexpr (kSubtract) s = m::Neg{}(s);
      pointwise<scalar_t>(out, m::AddScaled<M>{s}, a, b);
    }
  });
}

void div_kernel(const OpCall& c, std::span<Tensor> outs) {
  Tensor& out = outs[0];
  if (out.numel() == 0) return;
  const Tensor &a = c.input(0), &b = c.input(1);
  if (!c.has_attr(0)) {
    KILN_DISPATCH_FLOATING(out.dtype(), "div", [&] { pointwise<scalar_t>(out, m::Div{}, a, b); });
    return;
  }
  bool floor = c.string_attr(0) == "floor";
  KILN_DISPATCH_NUMERIC(out.dtype(), "div", [&] {
    if constexpr (std::is_integral_v<scalar_t>) check_no_zero_divisor<scalar_t>(c);
    if (floor) pointwise<scalar_t>(out, m::FloorDiv{}, a, b);
    else pointwise<scalar_t>(out, m::TruncDiv{}, a, b);
  });
}

void remainder_kernel(const OpCall& c, std::span<Tensor> outs) {
  Tensor& out = outs[0];
  if (out.numel() == 0) return;
  KILN_DISPATCH_NUMERIC(out.dtype(), "remainder", [&] {
    if constexpr (std::is_integral_v<scalar_t>) check_no_zero_divisor<scalar_t>(c);
    pointwise<scalar_t>(out, m::Remainder{}, c.input(0), c.input(1));
  });
}

// pow. A 0-dim base or exponent is read once in opmath precision (so a float16 tensor raised
// to 2.7 uses 2.7f, not its float16 rounding), with the usual shortcuts for x², √x, 1/√x, 1/x.
void pow_kernel(const OpCall& c, std::span<Tensor> outs) {
  Tensor& out = outs[0];
  if (out.numel() == 0) return;
  const Tensor &base = c.input(0), &exponent = c.input(1);
  KILN_DISPATCH_NUMERIC(out.dtype(), "pow", [&] {
    using M = opmath_t<scalar_t>;
    if (exponent.dim() == 0 && base.dim() != 0) {
      M e = exponent.item().to<M>();
      if constexpr (!std::is_integral_v<scalar_t>) {
        if (e == M(1)) return pointwise<scalar_t>(out, m::Identity{}, base);
        if (e == M(2)) return pointwise<scalar_t>(out, m::Square{}, base);
        if (e == M(0.5)) return pointwise<scalar_t>(out, m::Sqrt{}, base);
        if (e == M(-0.5)) return pointwise<scalar_t>(out, m::Rsqrt{}, base);
        if (e == M(-1)) return pointwise<scalar_t>(out, m::Reciprocal{}, base);
      }
      return pointwise<scalar_t>(out, [e](M x) { return m::Pow{}(x, e); }, base);
    }
    if (base.dim() == 0 && exponent.dim() != 0) {
      M b = base.item().to<M>();
      return pointwise<scalar_t>(out, [b](M x) { return m::Pow{}(b, x); }, exponent);
    }
    pointwise<scalar_t>(out, m::Pow{}, base, exponent);
  });
}

// The kernel of a KILN_BINARY_POINTWISE_OPS line by its dtype rule (pointwise_list.h).
enum class Rule { keep, floating, compare, bitwise, shift };

template <class F, Rule kRule>
Kernel listed_binary_kernel() {
  if constexpr (kRule == Rule::keep) return [](const OpCall& c, std::span<Tensor> o) { same_dtype_kernel<F>(c, o, true); };
  if constexpr (kRule == Rule::floating) return floating_kernel<F>;
  if constexpr (kRule == Rule::compare) return predicate_kernel<F>;
  if constexpr (kRule == Rule::bitwise) return [](const OpCall& c, std::span<Tensor> o) { integral_kernel<F>(c, o, true); };
  if constexpr (kRule == Rule::shift) return [](const OpCall& c, std::span<Tensor> o) { integral_kernel<F>(c, o, false); };
}

[[maybe_unused]] const bool registered = [] {
#define KILN_REGISTER_BINARY(name, Functor, rule, derivative) \
  register_kernel(#name, DeviceType::cpu, listed_binary_kernel<m::Functor, Rule::rule>());
  KILN_BINARY_POINTWISE_OPS(KILN_REGISTER_BINARY)
#undef KILN_REGISTER_BINARY
  auto reg = [](const char* name, Kernel k) { register_kernel(name, DeviceType::cpu, std::move(k)); };
  reg("add", add_kernel<false>);
  reg("sub", add_kernel<true>);
  reg("div", div_kernel);
  reg("remainder", remainder_kernel);
  reg("pow", pow_kernel);
  return true;
}();

}  // namespace

}  // namespace kiln::cpu
