// The pointwise ops that are one functor of kiln/math/functors.h applied to their inputs: one line
// each, expanded by
//   - the op definitions (src/ops/pointwise_unary.cpp, pointwise_binary.cpp): schema, dtype rule,
//     derivative and the op's lowering::Pointwise, which both code generators read;
//   - the CPU kernels (src/kernels/cpu/pointwise_unary_kernels.cpp, pointwise_binary_kernels.cpp);
//   - the CUDA kernels (src/kernels/cuda/pointwise_kernels.cpp).
// A new op of this kind is its functor, one line here, its derivative and its front-end function
// (docs/op_table.md, "Adding an op"). Ops with attrs or extra rules (add's alpha, div's rounding
// mode, pow's host-scalar shortcuts, gelu, clamp, where, ...) are defined by hand next to these,
// with their own lowering.
#pragma once

// X(name, Functor, rule, derivative)
//   rule: how the output dtype follows the input's (UnaryRule in pointwise_unary.cpp):
//     floating   integer and bool inputs give the default float dtype
//     numeric    the input's dtype; bool rejected
//     negation   as numeric, with the message for `-` on a bool tensor
//     any        the input's dtype, bool included
//     predicate  bool, computed in the input's dtype
//     bitwise    the input's dtype; integers and bool only
//   derivative: a function of pointwise_unary.cpp returning the Derivative (no_derivative: none)
#define KILN_UNARY_POINTWISE_OPS(X)                                                                                     \
  X(abs, Abs, numeric, abs_derivative) X(neg, Neg, negation, neg_derivative)                                            \
  X(exp, Exp, floating, exp_derivative) X(log, Log, floating, log_derivative)                                           \
  X(log1p, Log1p, floating, log1p_derivative) X(expm1, Expm1, floating, expm1_derivative)                               \
  X(sin, Sin, floating, sin_derivative) X(cos, Cos, floating, cos_derivative) X(tan, Tan, floating, tan_derivative)     \
  X(tanh, Tanh, floating, tanh_derivative) X(sigmoid, Sigmoid, floating, sigmoid_derivative)                            \
  X(relu, Relu, numeric, relu_derivative) X(silu, Silu, floating, silu_derivative)                                      \
  X(sqrt, Sqrt, floating, sqrt_derivative) X(rsqrt, Rsqrt, floating, rsqrt_derivative)                                  \
  X(reciprocal, Reciprocal, floating, reciprocal_derivative)                                                            \
  X(sign, Sign, any, zero_derivative) X(floor, Floor, numeric, zero_derivative) X(ceil, Ceil, numeric, zero_derivative) \
  X(round, Round, numeric, zero_derivative) X(erf, Erf, floating, erf_derivative)                                       \
  X(logical_not, LogicalNot, predicate, no_derivative) X(isnan, IsNan, predicate, no_derivative)                        \
  X(isfinite, IsFinite, predicate, no_derivative) X(bitwise_not, BitwiseNot, bitwise, no_derivative)

// X(name, Functor, rule, derivative): `name(Tensor self, Tensor other) -> Tensor`
//   rule (BinaryRule in pointwise_binary.cpp):
//     keep      the operands' promoted dtype, computed in it
//     floating  as keep, integer and bool results give the default float dtype
//     compare   bool, computed in the operands' promoted dtype
//     bitwise   as keep; integers and bool only
//     shift     as keep; integers only
//   derivative: a function of pointwise_binary.cpp returning the Derivative (no_derivative: none)
#define KILN_BINARY_POINTWISE_OPS(X)                                                                              \
  X(mul, Mul, keep, mul_derivative)                                                                               \
  X(maximum, Maximum, keep, maximum_derivative) X(minimum, Minimum, keep, minimum_derivative)                     \
  X(atan2, Atan2, floating, atan2_derivative) X(hypot, Hypot, floating, hypot_derivative)                         \
  X(eq, Eq, compare, no_derivative) X(ne, Ne, compare, no_derivative) X(lt, Lt, compare, no_derivative)           \
  X(le, Le, compare, no_derivative) X(gt, Gt, compare, no_derivative) X(ge, Ge, compare, no_derivative)           \
  X(logical_and, LogicalAnd, compare, no_derivative) X(logical_or, LogicalOr, compare, no_derivative)             \
  X(logical_xor, LogicalXor, compare, no_derivative)                                                              \
  X(bitwise_and, BitwiseAnd, bitwise, no_derivative) X(bitwise_or, BitwiseOr, bitwise, no_derivative)             \
  X(bitwise_xor, BitwiseXor, bitwise, no_derivative)                                                              \
  X(bitwise_left_shift, LeftShift, shift, no_derivative) X(bitwise_right_shift, RightShift, shift, no_derivative)
