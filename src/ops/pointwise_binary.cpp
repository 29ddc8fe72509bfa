// Pointwise binary ops: arithmetic, division, pow, remainder, maximum/minimum, atan2,
// comparisons, logical and bitwise ops; their Tensor methods, in-place forms and operators.
//
// Every op broadcasts its operands and promotes them with detail::result_type (PyTorch's rules,
// wrapped scalars included). Host scalars become 0-dim "wrapped numbers": floating ones are
// wrapped as float64 so that a float64 tensor sees the exact value; promotion still treats them
// as the default float dtype.
//
// Derivatives follow PyTorch's derivatives.yaml, written in Kiln ops so that a create_graph
// backward records them. Comparison, logical and bitwise ops have none: their outputs are bool
// or integer, which autograd never differentiates.
#include <cmath>
#include <optional>
#include <string>

#include "core/shape.h"
#include "core/tensor_factory.h"
#include "kiln/op_table.h"
#include "ops/meta_checks.h"
#include "ops/pointwise_list.h"
#include "ops/pointwise_lowering.h"
#include "kiln/ops.h"

namespace kiln {

namespace {

Tensor wrap(const Scalar& s) {
  return detail::wrap_scalar(s, s.is_floating_point() ? std::optional<DType>(kFloat64) : std::nullopt);
}

using detail::common_device;

using detail::broadcast_inputs;

std::string name_of(DType t) { return std::string(dtype_name(t)); }

// The output dtype from the promoted dtype of the operands; throws for dtypes the op rejects.
using DTypeRule = DType (*)(const OpCall& c, DType common);

MetaFn binary_meta(DTypeRule rule) {
  return [rule](const OpCall& c) -> std::vector<TensorMeta> {
    Device device = common_device(c);
    auto sizes = broadcast_inputs(c);
    DType out = rule(c, detail::result_type(c.inputs));
    auto strides = detail::pointwise_strides(c, sizes);  // channels-last in, channels-last out
    return {TensorMeta{std::move(sizes), std::move(strides), out, device}};
  };
}

OpDef binary_def(std::string name, std::string schema, DTypeRule rule, Derivative derivative, Lowering lowering) {
  return OpDef{.name = name, .schema = schema, .meta = binary_meta(rule), .pointwise = true,
               .derivative = std::move(derivative), .lowering = std::move(lowering)};
}

DType keep(const OpCall&, DType common) { return common; }
DType to_bool(const OpCall&, DType) { return kBool; }
DType to_float(const OpCall&, DType common) {
  return is_integral(common, /*include_bool=*/true) ? default_dtype() : common;
}

void check_alpha(const OpCall& c, DType common) {
  if (!c.has_attr(0)) return;
  const Scalar& alpha = c.scalar_attr(0);
  KILN_CHECK(!alpha.is_boolean() || common == kBool, DTypeError,
             "[kiln::" + c.name() + "] Boolean alpha only supported for Boolean results. Pass an integer alpha.");
  KILN_CHECK(is_floating_point(common) || !alpha.is_floating_point(), DTypeError,
             "[kiln::" + c.name() +
                 "] For integral input tensors, argument alpha must not be a floating point number. "
                 "Convert the inputs to a floating dtype first.");
}

DType add_rule(const OpCall& c, DType common) {
  check_alpha(c, common);
  return common;
}

DType sub_rule(const OpCall& c, DType common) {
  bool a = c.input(0).dtype() == kBool, b = c.input(1).dtype() == kBool;
  KILN_CHECK(!(a && b), DTypeError,
             "[kiln::sub] Subtraction, the `-` operator, with two bool tensors is not supported. "
             "Use the `^` or `logical_xor()` operator instead.");
  KILN_CHECK(!(a || b), DTypeError,
             "[kiln::sub] Subtraction, the `-` operator, with a bool tensor is not supported. "
             "If you are trying to invert a mask, use the `~` or `logical_not()` operator instead.");
  check_alpha(c, common);
  return common;
}

DType div_rule(const OpCall& c, DType common) {
  if (!c.has_attr(0)) return to_float(c, common);
  const std::string& mode = c.string_attr(0);
  KILN_CHECK(mode == "trunc" || mode == "floor", ValueError,
             "[kiln::div] div expected rounding_mode to be one of None, 'trunc', or 'floor' but found '" +
                 mode + "'.");
  KILN_CHECK(common != kBool, DTypeError,
             "[kiln::div] division with rounding_mode='" + mode +
                 "' is not implemented for bool. Convert the inputs to an integer dtype first.");
  return common;
}

DType no_bool_rule(const OpCall& c, DType common) {
  KILN_CHECK(common != kBool, DTypeError,
             "[kiln::" + c.name() + "] not implemented for bool. Convert the inputs to an integer dtype first.");
  return common;
}

// A wrapped host scalar's value, where it has one. Graph passes re-run metas on placeholders that
// carry metadata only (compiler/graph/graph.cpp meta_tensors); there a host scalar is a graph
// input whose value each call brings, and the capture already checked the call's value.
std::optional<Scalar> host_value(const Tensor& t) {
  const detail::TensorImpl& impl = t.impl();
  if (!impl.is_wrapped_number || impl.lazy || !impl.storage || !impl.storage->data) return std::nullopt;
  return t.item();
}

DType pow_rule(const OpCall& c, DType common) {
  no_bool_rule(c, common);
  const Tensor& exponent = c.input(1);
  if (is_integral(common) && is_integral(exponent.dtype())) {
    const std::optional<Scalar> e = host_value(exponent);
    if (e && e->to_int() < 0) {
      throw ValueError("[kiln::pow] Integers to negative integer powers are not allowed. "
                       "Use a floating-point base or exponent.");
    }
  }
  return common;
}

DType bitwise_rule(const OpCall& c, DType common) {
  KILN_CHECK(is_integral(common, /*include_bool=*/true), DTypeError,
             "[kiln::" + c.name() + "] not implemented for " + name_of(common) +
                 ": bitwise ops take integer or bool tensors. Use logical ops for floating-point values.");
  return common;
}

DType shift_rule(const OpCall& c, DType common) {
  KILN_CHECK(is_integral(common), DTypeError,
             "[kiln::" + c.name() + "] not implemented for " + name_of(common) +
                 ": shifts take integer tensors. Convert the inputs with .to(kInt64).");
  return common;
}

// ---- derivatives ----

bool is_wrapped(const Tensor& t) { return t.defined() && t.impl().is_wrapped_number; }

// grad * alpha (or * -alpha), skipping the multiply for alpha == 1.
Tensor times_alpha(const Tensor& grad, const BackwardContext& c, bool negate) {
  Scalar alpha = c.has_attr(0) ? c.scalar_attr(0) : Scalar(1);
  if (alpha.to_double() == 1.0) return negate ? neg(grad) : grad;
  if (!negate) return mul(grad, alpha);
  return mul(grad, alpha.is_floating_point() ? Scalar(-alpha.to_double()) : Scalar(-alpha.to_int()));
}

Derivative add_derivative() {
  return {.formula = "self: grad; other: grad * alpha",
          .fn = [](const BackwardContext& c) -> TensorList {
            return {c.grad(), c.needs_grad(1) ? times_alpha(c.grad(), c, false) : Tensor()};
          }};
}

Derivative sub_derivative() {
  return {.formula = "self: grad; other: -grad * alpha",
          .fn = [](const BackwardContext& c) -> TensorList {
            return {c.grad(), c.needs_grad(1) ? times_alpha(c.grad(), c, true) : Tensor()};
          }};
}

Derivative mul_derivative() {
  return {.formula = "self: grad * other; other: grad * self",
          .save_inputs = {0, 1},
          .fn = [](const BackwardContext& c) -> TensorList {
            const Tensor &self = c.input(0), &other = c.input(1);
            return {c.needs_grad(0) ? c.grad() * other : Tensor(), c.needs_grad(1) ? c.grad() * self : Tensor()};
          }};
}

// True division only; with a rounding mode the result is piecewise constant (zero gradient).
Derivative div_derivative() {
  return {.formula = "self: grad / other; other: -grad * ((self / other) / other)  (rounding_mode: zeros)",
          .save_inputs = {0, 1},
          .fn = [](const BackwardContext& c) -> TensorList {
            if (c.has_attr(0)) {
              TensorList zero(2);
              for (size_t i = 0; i < 2; ++i)
                if (c.needs_grad(i)) zero[i] = zeros_like(c.grad());
              return zero;
            }
            const Tensor &self = c.input(0), &other = c.input(1);
            return {c.needs_grad(0) ? c.grad() / other : Tensor(),
                    c.needs_grad(1) ? neg(c.grad()) * ((self / other) / other) : Tensor()};
          }};
}

// pow_backward_self: where(exponent == 0, 0, grad * exponent * self^(exponent - 1)), with a host
// exponent for wrapped scalars; pow_backward_exponent: grad * result * log(self), zero where
// self == 0 and exponent >= 0 (PyTorch's convention, avoiding 0 * -inf).
Tensor pow_backward_self(const Tensor& grad, const Tensor& self, const Tensor& exponent) {
  if (is_wrapped(exponent)) {
    double e = exponent.item().to_double();
    if (e == 0.0) return zeros_like(grad);
    return grad * (e * pow(self, e - 1.0));
  }
  return where(eq(exponent, 0), 0, grad * (exponent * pow(self, exponent - 1)));
}

Tensor pow_backward_exponent(const Tensor& grad, const Tensor& self, const Tensor& exponent) {
  if (is_wrapped(self)) {
    double base = self.item().to_double();
    Tensor result = pow(self, exponent);
    if (base == 0.0) return grad * where(ge(exponent, 0), 0, result * std::log(base));
    return grad * (result * std::log(base));
  }
  DType promoted = result_type({self, exponent});
  Tensor base = self.dtype() == promoted ? self : self.to(promoted);
  Tensor result = pow(base, exponent);
  return grad * where(logical_and(eq(base, 0), ge(exponent, 0)), 0, result * log(base));
}

Derivative pow_derivative() {
  return {.formula = "self: where(exponent == 0, 0, grad * exponent * self.pow(exponent - 1)); "
                     "exponent: grad * where(self == 0 & exponent >= 0, 0, result * self.log())",
          .save_inputs = {0, 1},
          .fn = [](const BackwardContext& c) -> TensorList {
            const Tensor &self = c.input(0), &exponent = c.input(1);
            return {c.needs_grad(0) ? pow_backward_self(c.grad(), self, exponent) : Tensor(),
                    c.needs_grad(1) ? pow_backward_exponent(c.grad(), self, exponent) : Tensor()};
          }};
}

Derivative remainder_derivative() {
  return {.formula = "self: grad; other: -grad * floor_divide(self, other)",
          .save_inputs = {0, 1},
          .fn = [](const BackwardContext& c) -> TensorList {
            return {c.grad(), c.needs_grad(1) ? neg(c.grad()) * div(c.input(0), c.input(1), "floor") : Tensor()};
          }};
}

// maximum/minimum: ties split the gradient in half between the operands (PyTorch's convention).
// `self_loses` is self < other for maximum, self > other for minimum.
Derivative max_min_derivative(bool is_max) {
  return {.formula = is_max ? "self: where(self == other, grad / 2, grad).masked_fill(self < other, 0); "
                              "other: where(self == other, grad / 2, grad).masked_fill(self > other, 0)"
                            : "self: where(self == other, grad / 2, grad).masked_fill(self > other, 0); "
                              "other: where(self == other, grad / 2, grad).masked_fill(self < other, 0)",
          .save_inputs = {0, 1},
          .fn = [is_max](const BackwardContext& c) -> TensorList {
            const Tensor &self = c.input(0), &other = c.input(1);
            Tensor shared = where(eq(self, other), c.grad() / 2, c.grad());
            Tensor self_lt = lt(self, other), self_gt = gt(self, other);
            const Tensor& self_loses = is_max ? self_lt : self_gt;
            const Tensor& other_loses = is_max ? self_gt : self_lt;
            return {c.needs_grad(0) ? masked_fill(shared, self_loses, 0) : Tensor(),
                    c.needs_grad(1) ? masked_fill(shared, other_loses, 0) : Tensor()};
          }};
}

Derivative maximum_derivative() { return max_min_derivative(true); }
Derivative minimum_derivative() { return max_min_derivative(false); }
Derivative no_derivative() { return {}; }

Derivative hypot_derivative() {
  return {.formula = "self: grad * self / result; other: grad * other / result",
          .save_inputs = {0, 1},
          .save_outputs = {0},
          .fn = [](const BackwardContext& c) -> std::vector<Tensor> {
            const Tensor &self = c.input(0), &other = c.input(1), &result = c.output(0);
            return {c.needs_grad(0) ? c.grad() * self / result : Tensor(),
                    c.needs_grad(1) ? c.grad() * other / result : Tensor()};
          }};
}

Derivative atan2_derivative() {
  return {.formula = "self: grad * other / (self^2 + other^2); other: grad * -self / (self^2 + other^2)",
          .save_inputs = {0, 1},
          .fn = [](const BackwardContext& c) -> TensorList {
            const Tensor &self = c.input(0), &other = c.input(1);
            Tensor recip = reciprocal(self * self + other * other);
            return {c.needs_grad(0) ? c.grad() * other * recip : Tensor(),
                    c.needs_grad(1) ? c.grad() * neg(self) * recip : Tensor()};
          }};
}

// ---- add, sub, div, pow, remainder: attrs or eager shortcuts of their own ----

// a + alpha * b (sub: a - alpha * b); alpha is 1 in most graphs, and 1 * b is exact.
Lowering add_lowering(bool subtract) {
  return lowering::Pointwise{[subtract](ScalarExprBuilder& b) {
    const DType out = b.output_dtype();
    int scaled = b.call(detail::functor_call("Mul", 2), {b.scalar_attr(0, out), b.input(1, out)}, out);
    return b.call(detail::functor_call(subtract ? "Sub" : "Add", 2), {b.input(0, out), scaled}, out);
  }};
}

// Div, TruncDiv or FloorDiv by the rounding mode. Integer division checks for a zero divisor
// first (a ValueError, not SIGFPE), which only the eager kernel does.
Lowering div_lowering() {
  return lowering::Pointwise{[](ScalarExprBuilder& b) {
    const DType out = b.output_dtype();
    if (!is_floating_point(out)) return -1;
    const char* functor = "Div";
    if (const auto* mode = std::get_if<std::string>(&b.attr(0))) {
      if (*mode != "trunc" && *mode != "floor") return -1;
      functor = *mode == "trunc" ? "TruncDiv" : "FloorDiv";
    }
    return b.call(detail::functor_call(functor, 2), {b.input(0, out), b.input(1, out)}, out);
  }};
}

// pow by a host scalar takes eager's shortcuts (0.5 → sqrt, -1 → reciprocal, ...), whose special
// values differ from std::pow's: eager runs it.
Lowering pow_lowering() {
  lowering::Pointwise pow = detail::functor_in_output_dtype("Pow", 2);
  return lowering::Pointwise{[f = std::move(pow.expr)](ScalarExprBuilder& b) {
    return b.input_is_host_scalar(1) ? -1 : f(b);
  }};
}

// Integer remainder checks for a zero divisor first, as integer division does.
Lowering remainder_lowering() {
  lowering::Pointwise remainder = detail::functor_in_output_dtype("Remainder", 2);
  return lowering::Pointwise{[f = std::move(remainder.expr)](ScalarExprBuilder& b) {
    return is_floating_point(b.output_dtype()) ? f(b) : -1;
  }};
}

const OpDef& kAdd = register_op(binary_def("add", "add(Tensor self, Tensor other, *, Scalar alpha=1) -> Tensor",
                                           add_rule, add_derivative(), add_lowering(false)));
const OpDef& kSub = register_op(binary_def("sub", "sub(Tensor self, Tensor other, *, Scalar alpha=1) -> Tensor",
                                           sub_rule, sub_derivative(), add_lowering(true)));
const OpDef& kDiv = register_op(
    binary_def("div", "div(Tensor self, Tensor other, *, str? rounding_mode=None) -> Tensor", div_rule,
               div_derivative(), div_lowering()));
const OpDef& kPow = register_op(
    binary_def("pow", "pow(Tensor self, Tensor exponent) -> Tensor", pow_rule, pow_derivative(), pow_lowering()));
const OpDef& kRemainder =
    register_op(binary_def("remainder", "remainder(Tensor self, Tensor other) -> Tensor", no_bool_rule,
                           remainder_derivative(), remainder_lowering()));

// ---- the ops of KILN_BINARY_POINTWISE_OPS ----

// The `rule` column of pointwise_list.h.
enum class BinaryRule { keep, floating, compare, bitwise, shift };

DTypeRule dtype_rule(BinaryRule rule) {
  switch (rule) {
    case BinaryRule::keep: return keep;
    case BinaryRule::floating: return to_float;
    case BinaryRule::compare: return to_bool;
    case BinaryRule::bitwise: return bitwise_rule;
    case BinaryRule::shift: return shift_rule;
  }
  return keep;
}

OpDef listed_binary_def(const char* name, const char* functor, BinaryRule rule, Derivative derivative) {
  std::string schema = std::string(name) + "(Tensor self, Tensor other) -> Tensor";
  Lowering lowering = rule == BinaryRule::compare ? Lowering(detail::functor_in_common_dtype(functor))
                                                  : Lowering(detail::functor_in_output_dtype(functor, 2));
  return binary_def(name, std::move(schema), dtype_rule(rule), std::move(derivative), std::move(lowering));
}

// k<Functor> for every line of KILN_BINARY_POINTWISE_OPS (kMul, kLogicalAnd, ...).
#define KILN_DEFINE_BINARY(name, Functor, rule, derivative) \
  const OpDef& k##Functor = register_op(listed_binary_def(#name, #Functor, BinaryRule::rule, derivative()));
KILN_BINARY_POINTWISE_OPS(KILN_DEFINE_BINARY)
#undef KILN_DEFINE_BINARY

Attr rounding_attr(const std::optional<std::string>& mode) { return mode ? Attr(*mode) : Attr(); }

// Runs `op` writing into `self` (the in-place forms).
Tensor& in_place(const OpDef& op, Tensor& self, const Tensor& other, std::vector<Attr> attrs = {}) {
  Tensor out[1] = {self};
  call_op_out(op, {self, other}, std::move(attrs), out);
  return self;
}

}  // namespace

// ---------------- free functions ----------------

Tensor add(const Tensor& a, const Tensor& b, Scalar alpha) { return call_op1(kAdd, {a, b}, {alpha}); }
Tensor add(const Tensor& a, Scalar b, Scalar alpha) { return call_op1(kAdd, {a, wrap(b)}, {alpha}); }
Tensor sub(const Tensor& a, const Tensor& b, Scalar alpha) { return call_op1(kSub, {a, b}, {alpha}); }
Tensor sub(const Tensor& a, Scalar b, Scalar alpha) { return call_op1(kSub, {a, wrap(b)}, {alpha}); }
Tensor mul(const Tensor& a, const Tensor& b) { return call_op1(kMul, {a, b}); }
Tensor mul(const Tensor& a, Scalar b) { return call_op1(kMul, {a, wrap(b)}); }
Tensor div(const Tensor& a, const Tensor& b, std::optional<std::string> mode) {
  return call_op1(kDiv, {a, b}, {rounding_attr(mode)});
}
Tensor div(const Tensor& a, Scalar b, std::optional<std::string> mode) {
  return call_op1(kDiv, {a, wrap(b)}, {rounding_attr(mode)});
}
Tensor floor_divide(const Tensor& a, const Tensor& b) { return div(a, b, "floor"); }
Tensor pow(const Tensor& base, const Tensor& exponent) { return call_op1(kPow, {base, exponent}); }
Tensor pow(const Tensor& base, Scalar exponent) { return call_op1(kPow, {base, wrap(exponent)}); }
Tensor pow(Scalar base, const Tensor& exponent) { return call_op1(kPow, {wrap(base), exponent}); }
Tensor remainder(const Tensor& a, const Tensor& b) { return call_op1(kRemainder, {a, b}); }
Tensor remainder(const Tensor& a, Scalar b) { return call_op1(kRemainder, {a, wrap(b)}); }
Tensor maximum(const Tensor& a, const Tensor& b) { return call_op1(kMaximum, {a, b}); }
Tensor minimum(const Tensor& a, const Tensor& b) { return call_op1(kMinimum, {a, b}); }
Tensor hypot(const Tensor& a, const Tensor& b) { return call_op1(kHypot, {a, b}); }
Tensor atan2(const Tensor& a, const Tensor& b) { return call_op1(kAtan2, {a, b}); }
Tensor eq(const Tensor& a, const Tensor& b) { return call_op1(kEq, {a, b}); }
Tensor eq(const Tensor& a, Scalar b) { return call_op1(kEq, {a, wrap(b)}); }
Tensor ne(const Tensor& a, const Tensor& b) { return call_op1(kNe, {a, b}); }
Tensor ne(const Tensor& a, Scalar b) { return call_op1(kNe, {a, wrap(b)}); }
Tensor lt(const Tensor& a, const Tensor& b) { return call_op1(kLt, {a, b}); }
Tensor lt(const Tensor& a, Scalar b) { return call_op1(kLt, {a, wrap(b)}); }
Tensor le(const Tensor& a, const Tensor& b) { return call_op1(kLe, {a, b}); }
Tensor le(const Tensor& a, Scalar b) { return call_op1(kLe, {a, wrap(b)}); }
Tensor gt(const Tensor& a, const Tensor& b) { return call_op1(kGt, {a, b}); }
Tensor gt(const Tensor& a, Scalar b) { return call_op1(kGt, {a, wrap(b)}); }
Tensor ge(const Tensor& a, const Tensor& b) { return call_op1(kGe, {a, b}); }
Tensor ge(const Tensor& a, Scalar b) { return call_op1(kGe, {a, wrap(b)}); }
Tensor logical_and(const Tensor& a, const Tensor& b) { return call_op1(kLogicalAnd, {a, b}); }
Tensor logical_or(const Tensor& a, const Tensor& b) { return call_op1(kLogicalOr, {a, b}); }
Tensor logical_xor(const Tensor& a, const Tensor& b) { return call_op1(kLogicalXor, {a, b}); }
Tensor bitwise_and(const Tensor& a, const Tensor& b) { return call_op1(kBitwiseAnd, {a, b}); }
Tensor bitwise_or(const Tensor& a, const Tensor& b) { return call_op1(kBitwiseOr, {a, b}); }
Tensor bitwise_xor(const Tensor& a, const Tensor& b) { return call_op1(kBitwiseXor, {a, b}); }
Tensor bitwise_left_shift(const Tensor& a, const Tensor& b) { return call_op1(kLeftShift, {a, b}); }
Tensor bitwise_right_shift(const Tensor& a, const Tensor& b) { return call_op1(kRightShift, {a, b}); }

// ---------------- Tensor methods ----------------

Tensor& Tensor::add_(const Tensor& other, Scalar alpha) { return in_place(kAdd, *this, other, {alpha}); }
Tensor& Tensor::add_(Scalar other, Scalar alpha) { return in_place(kAdd, *this, wrap(other), {alpha}); }
Tensor& Tensor::sub_(const Tensor& other, Scalar alpha) { return in_place(kSub, *this, other, {alpha}); }
Tensor& Tensor::sub_(Scalar other, Scalar alpha) { return in_place(kSub, *this, wrap(other), {alpha}); }
Tensor& Tensor::mul_(const Tensor& other) { return in_place(kMul, *this, other); }
Tensor& Tensor::mul_(Scalar other) { return in_place(kMul, *this, wrap(other)); }
Tensor& Tensor::div_(const Tensor& other) { return in_place(kDiv, *this, other, {Attr()}); }
Tensor& Tensor::div_(Scalar other) { return in_place(kDiv, *this, wrap(other), {Attr()}); }
Tensor& Tensor::pow_(Scalar exponent) { return in_place(kPow, *this, wrap(exponent)); }
Tensor& Tensor::maximum_(const Tensor& other) { return in_place(kMaximum, *this, other); }

Tensor Tensor::pow(const Tensor& exponent) const { return kiln::pow(*this, exponent); }
Tensor Tensor::pow(Scalar exponent) const { return kiln::pow(*this, exponent); }
Tensor Tensor::eq(const Tensor& other) const { return kiln::eq(*this, other); }
Tensor Tensor::ne(const Tensor& other) const { return kiln::ne(*this, other); }
Tensor Tensor::lt(const Tensor& other) const { return kiln::lt(*this, other); }
Tensor Tensor::le(const Tensor& other) const { return kiln::le(*this, other); }
Tensor Tensor::gt(const Tensor& other) const { return kiln::gt(*this, other); }
Tensor Tensor::ge(const Tensor& other) const { return kiln::ge(*this, other); }

// ---------------- operators ----------------

Tensor operator+(const Tensor& a, const Tensor& b) { return add(a, b); }
Tensor operator+(const Tensor& a, Scalar b) { return add(a, b); }
Tensor operator+(Scalar a, const Tensor& b) { return add(wrap(a), b); }
Tensor operator-(const Tensor& a, const Tensor& b) { return sub(a, b); }
Tensor operator-(const Tensor& a, Scalar b) { return sub(a, b); }
Tensor operator-(Scalar a, const Tensor& b) { return sub(wrap(a), b); }
Tensor operator*(const Tensor& a, const Tensor& b) { return mul(a, b); }
Tensor operator*(const Tensor& a, Scalar b) { return mul(a, b); }
Tensor operator*(Scalar a, const Tensor& b) { return mul(wrap(a), b); }
Tensor operator/(const Tensor& a, const Tensor& b) { return div(a, b); }
Tensor operator/(const Tensor& a, Scalar b) { return div(a, b); }
Tensor operator/(Scalar a, const Tensor& b) { return div(wrap(a), b); }
Tensor operator%(const Tensor& a, const Tensor& b) { return remainder(a, b); }
Tensor operator%(const Tensor& a, Scalar b) { return remainder(a, b); }
Tensor operator%(Scalar a, const Tensor& b) { return remainder(wrap(a), b); }
Tensor operator==(const Tensor& a, const Tensor& b) { return eq(a, b); }
Tensor operator==(const Tensor& a, Scalar b) { return eq(a, b); }
Tensor operator==(Scalar a, const Tensor& b) { return eq(b, a); }
Tensor operator!=(const Tensor& a, const Tensor& b) { return ne(a, b); }
Tensor operator!=(const Tensor& a, Scalar b) { return ne(a, b); }
Tensor operator!=(Scalar a, const Tensor& b) { return ne(b, a); }
Tensor operator<(const Tensor& a, const Tensor& b) { return lt(a, b); }
Tensor operator<(const Tensor& a, Scalar b) { return lt(a, b); }
Tensor operator<(Scalar a, const Tensor& b) { return gt(b, a); }
Tensor operator<=(const Tensor& a, const Tensor& b) { return le(a, b); }
Tensor operator<=(const Tensor& a, Scalar b) { return le(a, b); }
Tensor operator<=(Scalar a, const Tensor& b) { return ge(b, a); }
Tensor operator>(const Tensor& a, const Tensor& b) { return gt(a, b); }
Tensor operator>(const Tensor& a, Scalar b) { return gt(a, b); }
Tensor operator>(Scalar a, const Tensor& b) { return lt(b, a); }
Tensor operator>=(const Tensor& a, const Tensor& b) { return ge(a, b); }
Tensor operator>=(const Tensor& a, Scalar b) { return ge(a, b); }
Tensor operator>=(Scalar a, const Tensor& b) { return le(b, a); }
Tensor operator&(const Tensor& a, const Tensor& b) { return bitwise_and(a, b); }
Tensor operator&(const Tensor& a, Scalar b) { return bitwise_and(a, wrap(b)); }
Tensor operator&(Scalar a, const Tensor& b) { return bitwise_and(wrap(a), b); }
Tensor operator|(const Tensor& a, const Tensor& b) { return bitwise_or(a, b); }
Tensor operator|(const Tensor& a, Scalar b) { return bitwise_or(a, wrap(b)); }
Tensor operator|(Scalar a, const Tensor& b) { return bitwise_or(wrap(a), b); }
Tensor operator^(const Tensor& a, const Tensor& b) { return bitwise_xor(a, b); }
Tensor operator^(const Tensor& a, Scalar b) { return bitwise_xor(a, wrap(b)); }
Tensor operator^(Scalar a, const Tensor& b) { return bitwise_xor(wrap(a), b); }

Tensor& operator+=(Tensor& a, const Tensor& b) { return a.add_(b); }
Tensor& operator+=(Tensor& a, Scalar b) { return a.add_(b); }
Tensor& operator-=(Tensor& a, const Tensor& b) { return a.sub_(b); }
Tensor& operator-=(Tensor& a, Scalar b) { return a.sub_(b); }
Tensor& operator*=(Tensor& a, const Tensor& b) { return a.mul_(b); }
Tensor& operator*=(Tensor& a, Scalar b) { return a.mul_(b); }
Tensor& operator/=(Tensor& a, const Tensor& b) { return a.div_(b); }
Tensor& operator/=(Tensor& a, Scalar b) { return a.div_(b); }

}  // namespace kiln
