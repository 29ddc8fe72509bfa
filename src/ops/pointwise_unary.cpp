// Pointwise unary ops and their Tensor methods, in-place forms and operators (unary -, ~).
//
// Dtype rules follow PyTorch: the floating functions (exp, log, sin, sqrt, sigmoid, erf, gelu,
// silu, ...) promote integer and bool inputs to the default float dtype; abs, neg, sign, floor,
// ceil, round and relu keep integer dtypes; logical_not, isnan and isfinite return bool;
// bitwise_not takes integers and bool only.
//
// Derivatives follow PyTorch's derivatives.yaml, written in Kiln ops so that a create_graph
// backward records them; bool-valued ops have none (their outputs are not differentiable).
#include <cmath>
#include <string>

#include "kiln/op_table.h"
#include "kiln/ops.h"
#include "ops/meta_checks.h"
#include "ops/pointwise_list.h"
#include "ops/pointwise_lowering.h"

namespace kiln {

namespace {

// The result of a unary op has x's shape and, for 4-D x, x's memory format.
TensorMeta unary_meta(const OpCall& c, DType dtype) {
  const Tensor& x = c.input(0);
  std::vector<int64_t> sizes = x.sizes().vec();
  std::vector<int64_t> strides = detail::pointwise_strides(c, sizes);
  return TensorMeta{std::move(sizes), std::move(strides), dtype, x.device()};
}

// How the output dtype follows the input's (the `rule` column of pointwise_list.h).
enum class UnaryRule {
  floating,   // integer/bool → default float dtype
  numeric,    // same dtype; bool rejected
  negation,   // as numeric, with the message for `-`
  any,        // same dtype, bool included
  predicate,  // bool result, computed in the input's dtype
  bitwise,    // integers and bool; floating rejected
};

DType unary_dtype(const std::string& name, UnaryRule rule, DType in) {
  switch (rule) {
    case UnaryRule::floating:
      return is_integral(in, /*include_bool=*/true) ? default_dtype() : in;
    case UnaryRule::numeric:
      KILN_CHECK(in != kBool, DTypeError,
                 "[kiln::" + name + "] not implemented for bool. Convert the input with .to(...) first.");
      return in;
    case UnaryRule::negation:
      KILN_CHECK(in != kBool, DTypeError,
                 "[kiln::neg] Negation, the `-` operator, on a bool tensor is not supported. "
                 "If you are trying to invert a mask, use the `~` or `logical_not()` operator instead.");
      return in;
    case UnaryRule::any:
      return in;
    case UnaryRule::predicate:
      return kBool;
    case UnaryRule::bitwise:
      KILN_CHECK(is_integral(in, /*include_bool=*/true), DTypeError,
                 "[kiln::" + name + "] not implemented for " + std::string(dtype_name(in)) +
                     ": bitwise ops take integer or bool tensors. Use logical_not for other dtypes.");
      return in;
  }
  return in;
}

// An op of KILN_UNARY_POINTWISE_OPS: `name(Tensor self) -> Tensor`, out = functor(self).
OpDef unary_def(std::string name, const char* functor, UnaryRule rule, Derivative derivative) {
  std::string schema = name + "(Tensor self) -> Tensor";
  return OpDef{
      .name = name,
      .schema = std::move(schema),
      .meta = [name, rule](const OpCall& c) -> std::vector<TensorMeta> {
        const Tensor& x = c.input(0);
        return {unary_meta(c, unary_dtype(name, rule, x.dtype()))};
      },
      .pointwise = true,
      .derivative = std::move(derivative),
      .lowering = rule == UnaryRule::predicate ? detail::functor_in_input_dtype(functor)
                                               : detail::functor_in_output_dtype(functor, 1),
  };
}

// ---- derivatives ----

// Multi-step formulas run float16/bfloat16 values in float32, as PyTorch's fused backward
// kernels do; the engine casts the gradient back to the input's dtype.
Tensor opmath(const Tensor& t) {
  return t.dtype() == kFloat16 || t.dtype() == kBFloat16 ? t.to(kFloat32) : t;
}

// A derivative reading saved input 0 (`self`).
Derivative of_input(std::string formula, Tensor (*fn)(const Tensor& grad, const Tensor& self)) {
  return {.formula = std::move(formula),
          .save_inputs = {0},
          .fn = [fn](const BackwardContext& c) -> TensorList { return {fn(c.grad(), c.input(0))}; }};
}

// A derivative reading saved output 0 (`result`).
Derivative of_result(std::string formula, Tensor (*fn)(const Tensor& grad, const Tensor& result)) {
  return {.formula = std::move(formula),
          .save_outputs = {0},
          .fn = [fn](const BackwardContext& c) -> TensorList { return {fn(c.grad(), c.output(0))}; }};
}

// floor, ceil, round, sign: piecewise constant, so zero gradient (PyTorch's convention).
Derivative zero_gradient() {
  return {.formula = "self: zeros_like(grad)",
          .fn = [](const BackwardContext& c) -> TensorList { return {zeros_like(c.grad())}; }};
}

// gelu_backward (PyTorch's formulas for approximate = 'none' and 'tanh').
Tensor gelu_backward(const Tensor& grad, const Tensor& self, const std::string& approximate) {
  Tensor x = opmath(self), g = opmath(grad);
  if (approximate == "tanh") {
    const double kBeta = M_SQRT2 * M_2_SQRTPI * 0.5, kKappa = 0.044715;
    Tensor x_sq = x * x;
    Tensor inner = kBeta * (x + kKappa * (x_sq * x));
    Tensor tanh_inner = tanh(inner);
    Tensor left = 0.5 * x;
    Tensor left_derivative = 0.5 * (1 + tanh_inner);
    Tensor tanh_derivative = 1 - tanh_inner * tanh_inner;
    Tensor inner_derivative = kBeta * (1 + (3 * kKappa) * x_sq);
    return g * (left_derivative + left * tanh_derivative * inner_derivative);
  }
  const double kAlpha = M_SQRT1_2, kBeta = M_2_SQRTPI * M_SQRT1_2 * 0.5;
  Tensor cdf = 0.5 * (1 + erf(x * kAlpha));
  Tensor pdf = kBeta * exp(-0.5 * (x * x));
  return g * (cdf + x * pdf);
}

// ---- the derivatives named in KILN_UNARY_POINTWISE_OPS ----

Derivative no_derivative() { return {}; }
Derivative zero_derivative() { return zero_gradient(); }
Derivative neg_derivative() {
  return {.formula = "self: -grad", .fn = [](const BackwardContext& c) -> TensorList { return {neg(c.grad())}; }};
}
Derivative abs_derivative() {
  return of_input("self: grad * self.sign()", [](const Tensor& g, const Tensor& x) { return g * sign(x); });
}
Derivative exp_derivative() {
  return of_result("self: grad * result", [](const Tensor& g, const Tensor& y) { return g * y; });
}
Derivative log_derivative() {
  return of_input("self: grad / self", [](const Tensor& g, const Tensor& x) { return g / x; });
}
Derivative log1p_derivative() {
  return of_input("self: grad / (self + 1)", [](const Tensor& g, const Tensor& x) { return g / (x + 1); });
}
Derivative expm1_derivative() {
  return of_result("self: grad * (result + 1)", [](const Tensor& g, const Tensor& y) { return g * (y + 1); });
}
Derivative sin_derivative() {
  return of_input("self: grad * self.cos()", [](const Tensor& g, const Tensor& x) { return g * cos(x); });
}
Derivative cos_derivative() {
  return of_input("self: grad * -self.sin()", [](const Tensor& g, const Tensor& x) { return g * neg(sin(x)); });
}
Derivative tan_derivative() {
  return of_result("self: grad * (1 + result.pow(2))", [](const Tensor& g, const Tensor& y) { return g * (1 + y * y); });
}
Derivative tanh_derivative() {
  return of_result("self: tanh_backward(grad, result) = grad * (1 - result * result)",
                   [](const Tensor& g, const Tensor& y) { return g * (1 - y * y); });
}
Derivative sigmoid_derivative() {
  return of_result("self: sigmoid_backward(grad, result) = grad * (1 - result) * result",
                   [](const Tensor& g, const Tensor& y) { return g * (1 - y) * y; });
}
Derivative relu_derivative() {
  return of_result("self: threshold_backward(grad, result, 0) = where(result <= 0, 0, grad)",
                   [](const Tensor& g, const Tensor& y) { return where(le(y, 0), 0, g); });
}
Derivative silu_derivative() {
  return of_input("self: silu_backward(grad, self) = grad * sigmoid(self) * (1 + self * (1 - sigmoid(self)))",
                  [](const Tensor& g, const Tensor& self) {
                    Tensor x = opmath(self);
                    Tensor s = sigmoid(x);
                    return opmath(g) * s * (1 + x * (1 - s));
                  });
}
Derivative sqrt_derivative() {
  return of_result("self: grad / (2 * result)", [](const Tensor& g, const Tensor& y) { return g / (2 * y); });
}
Derivative rsqrt_derivative() {
  return of_result("self: -0.5 * grad * result.pow(3)",
                   [](const Tensor& g, const Tensor& y) { return -0.5 * g * (y * y * y); });
}
Derivative reciprocal_derivative() {
  return of_result("self: -grad * (result * result)", [](const Tensor& g, const Tensor& y) { return neg(g) * (y * y); });
}
Derivative erf_derivative() {
  return of_input("self: 2.0 / sqrt(M_PI) * exp(-(self.pow(2))) * grad", [](const Tensor& g, const Tensor& self) {
    Tensor x = opmath(self);
    return M_2_SQRTPI * exp(neg(x * x)) * opmath(g);
  });
}

// ---- the ops ----

// k<Name> for every line of KILN_UNARY_POINTWISE_OPS (kExp, kLogicalNot, ...).
#define KILN_DEFINE_UNARY(name, Functor, rule, derivative) \
  const OpDef& k##Functor = register_op(unary_def(#name, #Functor, UnaryRule::rule, derivative()));
KILN_UNARY_POINTWISE_OPS(KILN_DEFINE_UNARY)
#undef KILN_DEFINE_UNARY

// gelu: Gelu or GeluTanh by its `approximate` attr.
const OpDef& kGelu = register_op(OpDef{
    .name = "gelu",
    .schema = "gelu(Tensor self, *, str approximate='none') -> Tensor",
    .meta = [](const OpCall& c) -> std::vector<TensorMeta> {
      const Tensor& x = c.input(0);
      const std::string& approximate = c.string_attr(0);
      KILN_CHECK(approximate == "none" || approximate == "tanh", ValueError,
                 "[kiln::gelu] approximate argument must be either none or tanh, got '" + approximate + "'.");
      return {unary_meta(c, unary_dtype("gelu", UnaryRule::floating, x.dtype()))};
    },
    .pointwise = true,
    .derivative = {.formula = "self: gelu_backward(grad, self, approximate)",
                   .save_inputs = {0},
                   .fn = [](const BackwardContext& c) -> TensorList {
                     return {gelu_backward(c.grad(), c.input(0), c.string_attr(0))};
                   }},
    .lowering = lowering::Pointwise{[](ScalarExprBuilder& b) {
      const auto* approximate = std::get_if<std::string>(&b.attr(0));
      if (!approximate) return -1;
      const DType out = b.output_dtype();
      return b.call(detail::functor_call(*approximate == "tanh" ? "GeluTanh" : "Gelu", 1), {b.input(0, out)}, out);
    }},
});

Tensor& in_place(const OpDef& op, Tensor& self) {
  Tensor out[1] = {self};
  call_op_out(op, {self}, {}, out);
  return self;
}

}  // namespace

// ---------------- free functions ----------------

Tensor neg(const Tensor& x) { return call_op1(kNeg, {x}); }
Tensor abs(const Tensor& x) { return call_op1(kAbs, {x}); }
Tensor exp(const Tensor& x) { return call_op1(kExp, {x}); }
Tensor log(const Tensor& x) { return call_op1(kLog, {x}); }
Tensor log1p(const Tensor& x) { return call_op1(kLog1p, {x}); }
Tensor expm1(const Tensor& x) { return call_op1(kExpm1, {x}); }
Tensor sin(const Tensor& x) { return call_op1(kSin, {x}); }
Tensor cos(const Tensor& x) { return call_op1(kCos, {x}); }
Tensor tan(const Tensor& x) { return call_op1(kTan, {x}); }
Tensor tanh(const Tensor& x) { return call_op1(kTanh, {x}); }
Tensor sigmoid(const Tensor& x) { return call_op1(kSigmoid, {x}); }
Tensor relu(const Tensor& x) { return call_op1(kRelu, {x}); }
Tensor gelu(const Tensor& x, const std::string& approximate) { return call_op1(kGelu, {x}, {approximate}); }
Tensor silu(const Tensor& x) { return call_op1(kSilu, {x}); }
Tensor sqrt(const Tensor& x) { return call_op1(kSqrt, {x}); }
Tensor rsqrt(const Tensor& x) { return call_op1(kRsqrt, {x}); }
Tensor reciprocal(const Tensor& x) { return call_op1(kReciprocal, {x}); }
Tensor sign(const Tensor& x) { return call_op1(kSign, {x}); }
Tensor floor(const Tensor& x) { return call_op1(kFloor, {x}); }
Tensor ceil(const Tensor& x) { return call_op1(kCeil, {x}); }
Tensor round(const Tensor& x) { return call_op1(kRound, {x}); }
Tensor erf(const Tensor& x) { return call_op1(kErf, {x}); }
Tensor logical_not(const Tensor& x) { return call_op1(kLogicalNot, {x}); }
Tensor isnan(const Tensor& x) { return call_op1(kIsNan, {x}); }
Tensor isfinite(const Tensor& x) { return call_op1(kIsFinite, {x}); }
Tensor bitwise_not(const Tensor& x) { return call_op1(kBitwiseNot, {x}); }

// ---------------- Tensor methods ----------------

Tensor& Tensor::neg_() { return in_place(kNeg, *this); }
Tensor& Tensor::exp_() { return in_place(kExp, *this); }
Tensor& Tensor::sqrt_() { return in_place(kSqrt, *this); }
Tensor& Tensor::relu_() { return in_place(kRelu, *this); }
Tensor& Tensor::sigmoid_() { return in_place(kSigmoid, *this); }
Tensor& Tensor::tanh_() { return in_place(kTanh, *this); }

Tensor Tensor::abs() const { return kiln::abs(*this); }
Tensor Tensor::neg() const { return kiln::neg(*this); }
Tensor Tensor::exp() const { return kiln::exp(*this); }
Tensor Tensor::log() const { return kiln::log(*this); }
Tensor Tensor::sqrt() const { return kiln::sqrt(*this); }
Tensor Tensor::rsqrt() const { return kiln::rsqrt(*this); }
Tensor Tensor::sin() const { return kiln::sin(*this); }
Tensor Tensor::cos() const { return kiln::cos(*this); }
Tensor Tensor::tanh() const { return kiln::tanh(*this); }
Tensor Tensor::sigmoid() const { return kiln::sigmoid(*this); }
Tensor Tensor::relu() const { return kiln::relu(*this); }
Tensor Tensor::reciprocal() const { return kiln::reciprocal(*this); }
Tensor Tensor::sign() const { return kiln::sign(*this); }
Tensor Tensor::floor() const { return kiln::floor(*this); }
Tensor Tensor::ceil() const { return kiln::ceil(*this); }
Tensor Tensor::round() const { return kiln::round(*this); }
Tensor Tensor::logical_not() const { return kiln::logical_not(*this); }
Tensor Tensor::isnan() const { return kiln::isnan(*this); }
Tensor Tensor::isfinite() const { return kiln::isfinite(*this); }

// ---------------- operators ----------------

Tensor operator-(const Tensor& a) { return neg(a); }
Tensor operator~(const Tensor& a) { return bitwise_not(a); }

}  // namespace kiln
