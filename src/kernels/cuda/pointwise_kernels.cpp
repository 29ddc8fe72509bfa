// Eager CUDA kernels of the pointwise ops: one generated elementwise kernel per (op, dtypes),
// over the same functors (kiln/math/functors.h) and with the same dtype rules as the CPU kernels
// in src/kernels/cpu/pointwise_*_kernels.cpp:
//   - arithmetic computes in the output dtype (the meta's promoted dtype), inputs converted to it;
//   - comparisons and logical ops compute in the operands' promoted dtype and write bool;
//   - predicates (isnan, ...) read their input's own dtype;
//   - 0-dim bounds, weights and exponents (clamp, lerp, pow) are read once as host values in the
//     opmath type, as the CPU kernels read them.
#include <string>

#include "kernels/cuda/elementwise.h"
#include "core/dispatch.h"
#include "core/tensor_factory.h"
#include "kiln/op_table.h"
#include "ops/pointwise_list.h"

namespace kiln::cuda::detail {

namespace {

// The C++ opmath type of a dtype: what the functors see.
std::string opmath(DType t) { return cuda_type(opmath_dtype(t)); }

std::string call(const std::string& functor, const std::string& args) { return "kiln::math::" + functor + "{}(" + args + ")"; }

// out = F(a0) in out's dtype.
Kernel unary(std::string functor) {
  return [functor](const OpCall& c, std::span<Tensor> outs) {
    DType types[1] = {outs[0].dtype()};
    launch_elementwise(c.name(), call(functor, "a0"), outs[0], c.inputs.subspan(0, 1), types);
  };
}

// out (bool) = F(a0) in a0's dtype.
Kernel predicate(std::string functor) {
  return [functor](const OpCall& c, std::span<Tensor> outs) {
    DType types[1] = {c.input(0).dtype()};
    launch_elementwise(c.name(), call(functor, "a0"), outs[0], c.inputs.subspan(0, 1), types);
  };
}

// out = F(a0, a1) in out's dtype.
Kernel binary(std::string functor) {
  return [functor](const OpCall& c, std::span<Tensor> outs) {
    DType t = outs[0].dtype();
    DType types[2] = {t, t};
    launch_elementwise(c.name(), call(functor, "a0, a1"), outs[0], c.inputs.subspan(0, 2), types);
  };
}

// out (bool) = F(a0, a1) in the operands' promoted dtype.
Kernel compare(std::string functor) {
  return [functor](const OpCall& c, std::span<Tensor> outs) {
    DType common = kiln::detail::result_type(c.inputs);
    DType types[2] = {common, common};
    launch_elementwise(c.name(), call(functor, "a0, a1"), outs[0], c.inputs.subspan(0, 2), types);
  };
}

// Integer division and remainder raise on a zero divisor before writing anything, as on the CPU.
// The check reads the divisor on the host: integer division on the GPU is rare.
void check_no_zero_divisor(const OpCall& c, DType t) {
  Tensor b = c.input(1).to(kCPU).to(t);
  bool zero = false;
  Tensor flat = b.contiguous();
  KILN_DISPATCH_ALL(t, c.name(), [&] {
    const scalar_t* p = static_cast<const scalar_t*>(flat.impl().data());
    for (int64_t i = 0; i < flat.numel() && !zero; ++i) zero = p[i] == scalar_t(0);
  });
  KILN_CHECK(!zero, ValueError,
             "[kiln::" + c.name() + "] ZeroDivisionError: integer division by zero. "
             "Make sure the divisor has no zeros, or divide in a floating dtype.");
}

template <bool kSubtract>
void add_kernel(const OpCall& c, std::span<Tensor> outs) {
  Tensor& out = outs[0];
  DType t = out.dtype();
  DType types[2] = {t, t};
  Scalar alpha = c.has_attr(0) ? c.scalar_attr(0) : Scalar(1);
  if (alpha.to_double() == 1.0) {
    launch_elementwise(c.name(), call(kSubtract ? "Sub" : "Add", "a0, a1"), out, c.inputs.subspan(0, 2), types);
    return;
  }
  Scalars s;
  std::string a = s.add(alpha, t);
  if (kSubtract) a = call("Neg", a);
  launch_elementwise(c.name(), "kiln::math::AddScaled<" + opmath(t) + ">{" + a + "}(a0, a1)", out, c.inputs.subspan(0, 2),
                     types, s);
}

void div_kernel(const OpCall& c, std::span<Tensor> outs) {
  DType t = outs[0].dtype();
  if (!c.has_attr(0)) return binary("Div")(c, outs);
  if (is_integral(t, true)) check_no_zero_divisor(c, t);
  binary(c.string_attr(0) == "floor" ? "FloorDiv" : "TruncDiv")(c, outs);
}

void remainder_kernel(const OpCall& c, std::span<Tensor> outs) {
  if (is_integral(outs[0].dtype(), true)) check_no_zero_divisor(c, outs[0].dtype());
  binary("Remainder")(c, outs);
}

// pow: a 0-dim exponent or base is a host value in opmath precision, with the CPU's shortcuts.
void pow_kernel(const OpCall& c, std::span<Tensor> outs) {
  Tensor& out = outs[0];
  DType t = out.dtype();
  const Tensor &base = c.input(0), &exponent = c.input(1);
  DType types[1] = {t};
  if (exponent.dim() == 0 && base.dim() != 0) {
    Scalar e = exponent.item();
    if (is_floating_point(t)) {
      double v = e.to<double>();
      // The CPU compares in opmath precision; a float exponent's rounding decides there too.
      if (opmath_dtype(t) == DType::float32) v = static_cast<float>(v);
      const char* shortcut = v == 1 ? "Identity" : v == 2 ? "Square" : v == 0.5 ? "Sqrt" : v == -0.5 ? "Rsqrt"
                           : v == -1 ? "Reciprocal" : nullptr;
      if (shortcut) return launch_elementwise("pow", call(shortcut, "a0"), out, c.inputs.subspan(0, 1), types);
    }
    Scalars s;
    std::string name = s.add(e, t);
    return launch_elementwise("pow", call("Pow", "a0, " + name), out, c.inputs.subspan(0, 1), types, s);
  }
  if (base.dim() == 0 && exponent.dim() != 0) {
    Scalars s;
    std::string name = s.add(base.item(), t);
    return launch_elementwise("pow", call("Pow", name + ", a0"), out, c.inputs.subspan(1, 1), types, s);
  }
  binary("Pow")(c, outs);
}

// out = cond ? a : b with a and b converted to out's dtype (where: inputs cond, a, b;
// masked_fill: self, mask, value).
void select(const OpCall& c, std::span<Tensor> outs, int cond, int a, int b) {
  DType t = outs[0].dtype();
  Tensor in[3] = {c.input(cond), c.input(a), c.input(b)};
  DType types[3] = {DType::bool_, t, t};
  launch_elementwise(c.name(), call("Where", "a0, a1, a2"), outs[0], in, types);
}

void clamp_kernel(const OpCall& c, std::span<Tensor> outs) {
  Tensor& out = outs[0];
  DType t = out.dtype();
  const Tensor &x = c.input(0), &lo = c.input(1), &hi = c.input(2);
  bool lo_scalar = !lo.defined() || lo.dim() == 0, hi_scalar = !hi.defined() || hi.dim() == 0;
  if (lo_scalar && hi_scalar) {
    Scalars s;
    DType types[1] = {t};
    Tensor in[1] = {x};
    if (lo.defined() && hi.defined()) {
      std::string l = s.add(lo.item(), t), h = s.add(hi.item(), t);
      return launch_elementwise("clamp", call("Clamp", "a0, " + l + ", " + h), out, in, types, s);
    }
    if (lo.defined()) return launch_elementwise("clamp", call("ClampMin", "a0, " + s.add(lo.item(), t)), out, in, types, s);
    return launch_elementwise("clamp", call("ClampMax", "a0, " + s.add(hi.item(), t)), out, in, types, s);
  }
  if (lo.defined() && hi.defined()) {
    Tensor in[3] = {x, lo, hi};
    DType types[3] = {t, t, t};
    return launch_elementwise("clamp", call("Clamp", "a0, a1, a2"), out, in, types);
  }
  Tensor in[2] = {x, lo.defined() ? lo : hi};
  DType types[2] = {t, t};
  launch_elementwise("clamp", call(lo.defined() ? "ClampMin" : "ClampMax", "a0, a1"), out, in, types);
}

void lerp_kernel(const OpCall& c, std::span<Tensor> outs) {
  Tensor& out = outs[0];
  DType t = out.dtype();
  const Tensor& weight = c.input(2);
  if (weight.dim() == 0) {
    Scalars s;
    std::string w = s.add(weight.item(), t);
    DType types[2] = {t, t};
    return launch_elementwise("lerp", call("Lerp", "a0, a1, " + w), out, c.inputs.subspan(0, 2), types, s);
  }
  DType types[3] = {t, t, t};
  launch_elementwise("lerp", call("Lerp", "a0, a1, a2"), out, c.inputs.subspan(0, 3), types);
}

template <bool kDivide>
void addc_kernel(const OpCall& c, std::span<Tensor> outs) {
  Tensor& out = outs[0];
  DType t = out.dtype();
  Scalars s;
  std::string v = s.add(c.scalar_attr(0), t);
  DType types[3] = {t, t, t};
  std::string f = std::string("kiln::math::") + (kDivide ? "Addcdiv<" : "Addcmul<") + opmath(t) + ">{" + v + "}(a0, a1, a2)";
  launch_elementwise(c.name(), f, out, c.inputs.subspan(0, 3), types, s);
}

void gelu_kernel(const OpCall& c, std::span<Tensor> outs) {
  unary(c.string_attr(0) == "tanh" ? "GeluTanh" : "Gelu")(c, outs);
}

[[maybe_unused]] const bool registered = [] {
  auto reg = [](const char* name, Kernel k) { register_kernel(name, DeviceType::cuda, std::move(k)); };
  // The ops of pointwise_list.h: predicates compute in their input's dtype, comparisons in the
  // operands' promoted dtype, everything else in the output dtype.
#define KILN_REGISTER_UNARY(name, Functor, rule, derivative) \
  reg(#name, std::string_view(#rule) == "predicate" ? predicate(#Functor) : unary(#Functor));
  KILN_UNARY_POINTWISE_OPS(KILN_REGISTER_UNARY)
#undef KILN_REGISTER_UNARY
#define KILN_REGISTER_BINARY(name, Functor, rule, derivative) \
  reg(#name, std::string_view(#rule) == "compare" ? compare(#Functor) : binary(#Functor));
  KILN_BINARY_POINTWISE_OPS(KILN_REGISTER_BINARY)
#undef KILN_REGISTER_BINARY
  reg("gelu", gelu_kernel);
  reg("add", add_kernel<false>);
  reg("sub", add_kernel<true>);
  reg("div", div_kernel);
  reg("remainder", remainder_kernel);
  reg("pow", pow_kernel);
  reg("where", [](const OpCall& c, std::span<Tensor> o) { select(c, o, 0, 1, 2); });
  reg("masked_fill", [](const OpCall& c, std::span<Tensor> o) { select(c, o, 1, 2, 0); });
  reg("clamp", clamp_kernel);
  reg("lerp", lerp_kernel);
  reg("addcmul", addc_kernel<false>);
  reg("addcdiv", addc_kernel<true>);
  return true;
}();

}  // namespace

}  // namespace kiln::cuda::detail
