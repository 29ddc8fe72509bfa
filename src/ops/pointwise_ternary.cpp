// Pointwise ternary ops: where, clamp, lerp, addcmul, addcdiv, masked_fill; their Tensor methods
// and in-place forms. All broadcast their tensor operands; host scalars become 0-dim wrapped
// numbers (floating ones as float64, promoted like Python numbers).
//
// Derivatives follow PyTorch's derivatives.yaml, written in Kiln ops so that a create_graph
// backward records them. Bool inputs (where's condition, masked_fill's mask) get no gradient.
#include <optional>
#include <string>

#include "core/shape.h"
#include "core/tensor_factory.h"
#include "kiln/op_table.h"
#include "ops/pointwise_lowering.h"
#include "ops/meta_checks.h"
#include "kiln/ops.h"

namespace kiln {

namespace {

Tensor wrap(const Scalar& s) {
  return detail::wrap_scalar(s, s.is_floating_point() ? std::optional<DType>(kFloat64) : std::nullopt);
}

std::string name_of(DType t) { return std::string(dtype_name(t)); }

using detail::common_device;

using detail::broadcast_inputs;

// The broadcast shape, laid out like the first full-shaped operand (channels-last stays so).
TensorMeta broadcast_meta(const OpCall& c, DType dtype) {
  Device device = common_device(c);
  std::vector<int64_t> sizes = broadcast_inputs(c);
  std::vector<int64_t> strides = detail::pointwise_strides(c, sizes);
  return TensorMeta{std::move(sizes), std::move(strides), dtype, device};
}

// where(condition, self, other)
const OpDef& kWhere = register_op(OpDef{
    .name = "where",
    .schema = "where(Tensor condition, Tensor self, Tensor other) -> Tensor",
    .meta = [](const OpCall& c) -> std::vector<TensorMeta> {
      const Tensor& cond = c.input(0);
      KILN_CHECK(cond.dtype() == kBool, DTypeError,
                 "[kiln::where] where expected condition to be a boolean tensor, but got a tensor with dtype " +
                     name_of(cond.dtype()) + ". Compare it (x != 0) or convert it with .to(kBool).");
      const Tensor values[2] = {c.input(1), c.input(2)};
      return {broadcast_meta(c, detail::result_type(values))};
    },
    .pointwise = true,
    .derivative = {.formula = "condition: none; self: where(condition, grad, 0); other: where(condition, 0, grad)",
                   .save_inputs = {0},
                   .fn = [](const BackwardContext& c) -> TensorList {
                     const Tensor& cond = c.input(0);
                     return {Tensor(), c.needs_grad(1) ? where(cond, c.grad(), 0) : Tensor(),
                             c.needs_grad(2) ? where(cond, 0, c.grad()) : Tensor()};
                   }},
    .lowering = lowering::Pointwise{[](ScalarExprBuilder& b) {
      const DType out = b.output_dtype();
      return b.call(detail::functor_call("Where", 3), {b.input(0, DType::bool_), b.input(1, out), b.input(2, out)}, out);
    }},
});

// clamp_backward and clamp_backward_min_max (PyTorch): self gets the gradient where
// min <= self <= max; a bound gets it where it is the active one (min only while min < max, as
// clamp returns max when min > max).
TensorList clamp_backward(const BackwardContext& c) {
  const Tensor &grad = c.grad(), &self = c.input(0), &min = c.input(1), &max = c.input(2);
  TensorList result(3);
  if (c.needs_grad(0)) {
    Tensor keep = !min.defined() ? le(self, max)
                  : !max.defined() ? ge(self, min)
                                   : logical_and(ge(self, min), le(self, max));
    result[0] = where(keep, grad, 0);
  }
  if (c.needs_grad(1) && min.defined()) {
    Tensor active = max.defined() ? logical_and(lt(self, min), lt(min, max)) : lt(self, min);
    result[1] = where(active, grad, 0);
  }
  if (c.needs_grad(2) && max.defined()) {
    Tensor active = min.defined() ? logical_or(gt(self, max), lt(max, min)) : gt(self, max);
    result[2] = where(active, grad, 0);
  }
  return result;
}

// clamp(self, min, max): min and max are tensors (0-dim for scalar bounds) or undefined (None).
const OpDef& kClamp = register_op(OpDef{
    .name = "clamp",
    .schema = "clamp(Tensor self, Tensor? min=None, Tensor? max=None) -> Tensor",
    .meta = [](const OpCall& c) -> std::vector<TensorMeta> {
      KILN_CHECK(c.input(1).defined() || c.input(2).defined(), ValueError,
                 "[kiln::clamp] At least one of 'min' or 'max' must not be None. Pass a bound.");
      DType out = detail::result_type(c.inputs);
      KILN_CHECK(out != kBool, DTypeError,
                 "[kiln::clamp] clamp is not implemented for bool. Convert the input with .to(...) first.");
      return {broadcast_meta(c, out)};
    },
    .pointwise = true,
    .derivative = {.formula = "self: where(min <= self <= max, grad, 0); "
                              "min: where(self < min & min < max, grad, 0); "
                              "max: where(self > max | max < min, grad, 0)",
                   .save_inputs = {0, 1, 2},
                   .fn = clamp_backward},
    .lowering = lowering::Pointwise{[](ScalarExprBuilder& b) {
      const DType out = b.output_dtype();
      const int x = b.input(0, out);
      const bool lo = b.has_input(1), hi = b.num_inputs() > 2 && b.has_input(2);
      if (lo && hi) return b.call(detail::functor_call("Clamp", 3), {x, b.input(1, out), b.input(2, out)}, out);
      if (lo) return b.call(detail::functor_call("ClampMin", 2), {x, b.input(1, out)}, out);
      if (hi) return b.call(detail::functor_call("ClampMax", 2), {x, b.input(2, out)}, out);
      return x;
    }},
});

// lerp(self, end, weight): weight is a tensor or a wrapped scalar.
const OpDef& kLerp = register_op(OpDef{
    .name = "lerp",
    .schema = "lerp(Tensor self, Tensor end, Tensor weight) -> Tensor",
    .meta = [](const OpCall& c) -> std::vector<TensorMeta> {
      const Tensor &start = c.input(0), &end = c.input(1), &weight = c.input(2);
      KILN_CHECK(is_floating_point(start.dtype()), DTypeError,
                 "[kiln::lerp] lerp is not implemented for " + name_of(start.dtype()) +
                     ". Use floating-point tensors.");
      KILN_CHECK(end.dtype() == start.dtype(), DTypeError,
                 "[kiln::lerp] expected dtype " + name_of(start.dtype()) + " for `end` but got dtype " +
                     name_of(end.dtype()) + ". Convert it with .to(...).");
      KILN_CHECK(weight.impl().is_wrapped_number || weight.dtype() == start.dtype(), DTypeError,
                 "[kiln::lerp] expected dtype " + name_of(start.dtype()) + " for `weight` but got dtype " +
                     name_of(weight.dtype()) + ". Convert it with .to(...).");
      return {broadcast_meta(c, start.dtype())};
    },
    .pointwise = true,
    .derivative = {.formula = "self: grad * (1 - weight); end: grad * weight; weight: grad * (end - self)",
                   .save_inputs = {0, 1, 2},
                   .fn = [](const BackwardContext& c) -> TensorList {
                     const Tensor& weight = c.input(2);
                     if (weight.impl().is_wrapped_number) {
                       double w = weight.item().to_double();
                       return {c.needs_grad(0) ? mul(c.grad(), 1.0 - w) : Tensor(),
                               c.needs_grad(1) ? mul(c.grad(), w) : Tensor()};
                     }
                     return {c.needs_grad(0) ? c.grad() * (1 - weight) : Tensor(),
                             c.needs_grad(1) ? c.grad() * weight : Tensor(),
                             c.needs_grad(2) ? c.grad() * (c.input(1) - c.input(0)) : Tensor()};
                   }},
    .lowering = detail::functor_in_output_dtype("Lerp", 3),
});

DType addc_dtype(const OpCall& c) {
  DType out = detail::result_type(c.inputs);
  KILN_CHECK(out != kBool, DTypeError,
             "[kiln::" + c.name() + "] not implemented for bool. Convert the inputs with .to(...) first.");
  // An integer result takes `value` converted to its dtype, a floating value truncated toward zero
  // (aten: value.to<scalar_t>(), so addcmul(i, i, i, 2.7) adds 2 * i * i); a value that does not
  // fit throws ValueError, as PyTorch's checked conversion does.
  if (!is_floating_point(out)) KILN_DISPATCH_ALL(out, c.name(), [&] { (void)c.scalar_attr(0).checked_to<scalar_t>(); });
  return out;
}

const OpDef& kAddcmul = register_op(OpDef{
    .name = "addcmul",
    .schema = "addcmul(Tensor self, Tensor tensor1, Tensor tensor2, *, Scalar value=1) -> Tensor",
    .meta = [](const OpCall& c) -> std::vector<TensorMeta> { return {broadcast_meta(c, addc_dtype(c))}; },
    .pointwise = true,
    .derivative = {.formula = "self: grad; tensor1: grad * (tensor2 * value); tensor2: grad * (tensor1 * value)",
                   .save_inputs = {1, 2},
                   .fn = [](const BackwardContext& c) -> TensorList {
                     const Scalar& value = c.scalar_attr(0);
                     return {c.grad(), c.needs_grad(1) ? c.grad() * (c.input(2) * value) : Tensor(),
                             c.needs_grad(2) ? c.grad() * (c.input(1) * value) : Tensor()};
                   }},
    .lowering = lowering::Pointwise{[](ScalarExprBuilder& b) {
      const DType out = b.output_dtype();
      std::string code = std::string("kiln::math::Addcmul<") + detail::c_type_name(out) + ">{$0}($1, $2, $3)";
      return b.call(std::move(code), {b.scalar_attr(0, out), b.input(0, out), b.input(1, out), b.input(2, out)}, out);
    }},
});

const OpDef& kAddcdiv = register_op(OpDef{
    .name = "addcdiv",
    .schema = "addcdiv(Tensor self, Tensor tensor1, Tensor tensor2, *, Scalar value=1) -> Tensor",
    .meta = [](const OpCall& c) -> std::vector<TensorMeta> {
      KILN_CHECK(!(is_integral(c.input(1).dtype(), true) && is_integral(c.input(2).dtype(), true)), DTypeError,
                 "[kiln::addcdiv] Integer division with addcdiv is no longer supported, and in a future release "
                 "addcdiv will perform a true division of tensor1 and tensor2. The historic addcdiv behavior can "
                 "be implemented as (input + value * trunc(tensor1 / tensor2)).to(input.dtype) for integer inputs "
                 "and as (input + value * tensor1 / tensor2) for float inputs. The future addcdiv behavior is just "
                 "the latter implementation: (input + value * tensor1 / tensor2), for all dtypes.");
      return {broadcast_meta(c, addc_dtype(c))};
    },
    .pointwise = true,
    .derivative = {.formula = "self: grad; tensor1: grad * (value / tensor2); "
                              "tensor2: -grad * (value * tensor1 / (tensor2 * tensor2))",
                   .save_inputs = {1, 2},
                   .fn = [](const BackwardContext& c) -> TensorList {
                     const Scalar& value = c.scalar_attr(0);
                     const Tensor &t1 = c.input(1), &t2 = c.input(2);
                     return {c.grad(), c.needs_grad(1) ? c.grad() * (value / t2) : Tensor(),
                             c.needs_grad(2) ? neg(c.grad()) * (value * t1 / (t2 * t2)) : Tensor()};
                   }},
    .lowering = lowering::Pointwise{[](ScalarExprBuilder& b) {
      const DType out = b.output_dtype();
      std::string code = std::string("kiln::math::Addcdiv<") + detail::c_type_name(out) + ">{$0}($1, $2, $3)";
      return b.call(std::move(code), {b.scalar_attr(0, out), b.input(0, out), b.input(1, out), b.input(2, out)}, out);
    }},
});

// masked_fill(self, mask, value): value is a 0-dim tensor (a wrapped scalar for the Scalar form).
const OpDef& kMaskedFill = register_op(OpDef{
    .name = "masked_fill",
    .schema = "masked_fill(Tensor self, Tensor mask, Tensor value) -> Tensor",
    .meta = [](const OpCall& c) -> std::vector<TensorMeta> {
      const Tensor &x = c.input(0), &mask = c.input(1), &value = c.input(2);
      KILN_CHECK(mask.dtype() == kBool, DTypeError,
                 "[kiln::masked_fill] masked_fill_ only supports boolean masks, but got mask with dtype " +
                     name_of(mask.dtype()) + ". Compare it (m != 0) or convert it with .to(kBool).");
      KILN_CHECK(value.dim() == 0, ShapeError,
                 "[kiln::masked_fill] masked_fill_ only supports a 0-dimensional value tensor, but got tensor "
                 "with " + std::to_string(value.dim()) + " dimension(s). Pass a scalar or a 0-dim tensor.");
      return {broadcast_meta(c, x.dtype())};
    },
    .pointwise = true,
    .derivative = {.formula = "self: grad.masked_fill(mask, 0); mask: none; value: where(mask, grad, 0).sum()",
                   .save_inputs = {1},
                   .fn = [](const BackwardContext& c) -> TensorList {
                     const Tensor& mask = c.input(1);
                     return {c.needs_grad(0) ? masked_fill(c.grad(), mask, 0) : Tensor(), Tensor(),
                             c.needs_grad(2) ? where(mask, c.grad(), 0).sum() : Tensor()};
                   }},
    .lowering = lowering::Pointwise{[](ScalarExprBuilder& b) {
      const DType out = b.output_dtype();
      return b.call(detail::functor_call("Where", 3), {b.input(1, DType::bool_), b.input(2, out), b.input(0, out)}, out);
    }},
});

Tensor bound(const std::optional<Scalar>& s) { return s ? wrap(*s) : Tensor(); }

Tensor& in_place(const OpDef& op, Tensor& self, std::vector<Tensor> inputs, std::vector<Attr> attrs = {}) {
  Tensor out[1] = {self};
  call_op_out(op, std::move(inputs), std::move(attrs), out);
  return self;
}

}  // namespace

// ---------------- free functions ----------------

Tensor where(const Tensor& condition, const Tensor& a, const Tensor& b) {
  return call_op1(kWhere, {condition, a, b});
}
Tensor where(const Tensor& condition, const Tensor& a, Scalar b) { return call_op1(kWhere, {condition, a, wrap(b)}); }
Tensor where(const Tensor& condition, Scalar a, const Tensor& b) { return call_op1(kWhere, {condition, wrap(a), b}); }

Tensor clamp(const Tensor& x, std::optional<Scalar> min, std::optional<Scalar> max) {
  return call_op1(kClamp, {x, bound(min), bound(max)});
}
Tensor clamp(const Tensor& x, const Tensor& min, const Tensor& max) { return call_op1(kClamp, {x, min, max}); }

Tensor lerp(const Tensor& start, const Tensor& end, Scalar weight) {
  return call_op1(kLerp, {start, end, wrap(weight)});
}
Tensor lerp(const Tensor& start, const Tensor& end, const Tensor& weight) {
  return call_op1(kLerp, {start, end, weight});
}

Tensor addcmul(const Tensor& self, const Tensor& t1, const Tensor& t2, Scalar value) {
  return call_op1(kAddcmul, {self, t1, t2}, {value});
}
Tensor addcdiv(const Tensor& self, const Tensor& t1, const Tensor& t2, Scalar value) {
  return call_op1(kAddcdiv, {self, t1, t2}, {value});
}

Tensor masked_fill(const Tensor& x, const Tensor& mask, Scalar value) {
  return call_op1(kMaskedFill, {x, mask, wrap(value)});
}
Tensor masked_fill(const Tensor& x, const Tensor& mask, const Tensor& value) {
  return call_op1(kMaskedFill, {x, mask, value});
}

// ---------------- Tensor methods ----------------

Tensor& Tensor::clamp_(std::optional<Scalar> min, std::optional<Scalar> max) {
  return in_place(kClamp, *this, {*this, bound(min), bound(max)});
}
Tensor& Tensor::lerp_(const Tensor& end, Scalar weight) { return in_place(kLerp, *this, {*this, end, wrap(weight)}); }
Tensor& Tensor::addcmul_(const Tensor& t1, const Tensor& t2, Scalar value) {
  return in_place(kAddcmul, *this, {*this, t1, t2}, {value});
}
Tensor& Tensor::addcdiv_(const Tensor& t1, const Tensor& t2, Scalar value) {
  return in_place(kAddcdiv, *this, {*this, t1, t2}, {value});
}
Tensor& Tensor::masked_fill_(const Tensor& mask, Scalar value) {
  return in_place(kMaskedFill, *this, {*this, mask, wrap(value)});
}

Tensor Tensor::clamp(std::optional<Scalar> min, std::optional<Scalar> max) const {
  return kiln::clamp(*this, min, max);
}
Tensor Tensor::masked_fill(const Tensor& mask, Scalar value) const { return kiln::masked_fill(*this, mask, value); }

}  // namespace kiln
