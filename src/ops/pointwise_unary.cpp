// Pointwise unary ops and their Tensor methods, in-place forms and operators (unary -, ~).
//
// Dtype rules follow PyTorch: the floating functions (exp, log, sin, sqrt, sigmoid, erf, gelu,
// silu, ...) promote integer and bool inputs to the default float dtype; abs, neg, sign, floor,
// ceil, round and relu keep integer dtypes; logical_not, isnan and isfinite return bool;
// bitwise_not takes integers and bool only.
#include <string>

#include "kiln/op_table.h"
#include "kiln/ops.h"

namespace kiln {

namespace {

enum class UnaryRule {
  floating,      // integer/bool → default float dtype
  keep_numeric,  // same dtype; bool rejected
  keep_all,      // same dtype, bool included
  to_bool,       // bool result
  bitwise,       // integers and bool; floating rejected
};

DType unary_dtype(const std::string& name, UnaryRule rule, DType in) {
  switch (rule) {
    case UnaryRule::floating:
      return is_integral(in, /*include_bool=*/true) ? default_dtype() : in;
    case UnaryRule::keep_numeric:
      KILN_CHECK(in != kBool, DTypeError,
                 "[kiln::" + name + "] not implemented for bool. Convert the input with .to(...) first.");
      return in;
    case UnaryRule::keep_all:
      return in;
    case UnaryRule::to_bool:
      return kBool;
    case UnaryRule::bitwise:
      KILN_CHECK(is_integral(in, /*include_bool=*/true), DTypeError,
                 "[kiln::" + name + "] not implemented for " + std::string(dtype_name(in)) +
                     ": bitwise ops take integer or bool tensors. Use logical_not for other dtypes.");
      return in;
  }
  return in;
}

OpDef unary_def(std::string name, UnaryRule rule) {
  std::string schema = name + "(Tensor self) -> Tensor";
  return OpDef{
      .name = name,
      .schema = std::move(schema),
      .meta = [name, rule](const OpCall& c) -> std::vector<TensorMeta> {
        const Tensor& x = c.input(0);
        return {TensorMeta{x.sizes().vec(), {}, unary_dtype(name, rule, x.dtype()), x.device()}};
      },
      .pointwise = true,
      .lowering = "pointwise",
  };
}

const OpDef& kNeg = register_op(OpDef{
    .name = "neg",
    .schema = "neg(Tensor self) -> Tensor",
    .meta = [](const OpCall& c) -> std::vector<TensorMeta> {
      const Tensor& x = c.input(0);
      KILN_CHECK(x.dtype() != kBool, DTypeError,
                 "[kiln::neg] Negation, the `-` operator, on a bool tensor is not supported. "
                 "If you are trying to invert a mask, use the `~` or `logical_not()` operator instead.");
      return {TensorMeta{x.sizes().vec(), {}, x.dtype(), x.device()}};
    },
    .pointwise = true,
    .lowering = "pointwise",
});

const OpDef& kGelu = register_op(OpDef{
    .name = "gelu",
    .schema = "gelu(Tensor self, *, str approximate='none') -> Tensor",
    .meta = [](const OpCall& c) -> std::vector<TensorMeta> {
      const Tensor& x = c.input(0);
      const std::string& approximate = c.string_attr(0);
      KILN_CHECK(approximate == "none" || approximate == "tanh", ValueError,
                 "[kiln::gelu] approximate argument must be either none or tanh, got '" + approximate + "'.");
      return {TensorMeta{x.sizes().vec(), {}, unary_dtype("gelu", UnaryRule::floating, x.dtype()), x.device()}};
    },
    .pointwise = true,
    .lowering = "pointwise",
});

const OpDef& kAbs = register_op(unary_def("abs", UnaryRule::keep_numeric));
const OpDef& kExp = register_op(unary_def("exp", UnaryRule::floating));
const OpDef& kLog = register_op(unary_def("log", UnaryRule::floating));
const OpDef& kLog1p = register_op(unary_def("log1p", UnaryRule::floating));
const OpDef& kExpm1 = register_op(unary_def("expm1", UnaryRule::floating));
const OpDef& kSin = register_op(unary_def("sin", UnaryRule::floating));
const OpDef& kCos = register_op(unary_def("cos", UnaryRule::floating));
const OpDef& kTan = register_op(unary_def("tan", UnaryRule::floating));
const OpDef& kTanh = register_op(unary_def("tanh", UnaryRule::floating));
const OpDef& kSigmoid = register_op(unary_def("sigmoid", UnaryRule::floating));
const OpDef& kRelu = register_op(unary_def("relu", UnaryRule::keep_numeric));
const OpDef& kSilu = register_op(unary_def("silu", UnaryRule::floating));
const OpDef& kSqrt = register_op(unary_def("sqrt", UnaryRule::floating));
const OpDef& kRsqrt = register_op(unary_def("rsqrt", UnaryRule::floating));
const OpDef& kReciprocal = register_op(unary_def("reciprocal", UnaryRule::floating));
const OpDef& kSign = register_op(unary_def("sign", UnaryRule::keep_all));
const OpDef& kFloor = register_op(unary_def("floor", UnaryRule::keep_numeric));
const OpDef& kCeil = register_op(unary_def("ceil", UnaryRule::keep_numeric));
const OpDef& kRound = register_op(unary_def("round", UnaryRule::keep_numeric));
const OpDef& kErf = register_op(unary_def("erf", UnaryRule::floating));
const OpDef& kLogicalNot = register_op(unary_def("logical_not", UnaryRule::to_bool));
const OpDef& kIsNan = register_op(unary_def("isnan", UnaryRule::to_bool));
const OpDef& kIsFinite = register_op(unary_def("isfinite", UnaryRule::to_bool));
const OpDef& kBitwiseNot = register_op(unary_def("bitwise_not", UnaryRule::bitwise));

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
