// Whole-tensor comparisons (allclose, equal) and the shape/dtype helpers broadcast_shapes and
// result_type.
#include <cstdio>

#include "core/shape.h"
#include "core/tensor_factory.h"
#include "kiln/op_table.h"
#include "kiln/ops.h"

namespace kiln {

namespace {

void check_same_device(const Tensor& a, const Tensor& b, const std::string& op) {
  KILN_CHECK(a.device() == b.device(), DeviceError,
             "[kiln::" + op + "] Cannot compare two tensors on different devices. Got: " + a.device().str() +
                 " and " + b.device().str() + ". Move them to one device.");
}

// allclose(a, b, rtol, atol, equal_nan) -> 0-dim bool: isclose(a, b).all() without the bool tensor.
const OpDef& kAllclose = register_op({
    .name = "allclose",
    .schema = "allclose(Tensor self, Tensor other, float rtol=1e-05, float atol=1e-08, bool equal_nan=False) -> bool",
    .meta = [](const OpCall& c) -> std::vector<TensorMeta> {
      const Tensor& a = c.input(0);
      const Tensor& b = c.input(1);
      check_same_device(a, b, "allclose");
      KILN_CHECK(a.dtype() == b.dtype(), DTypeError,
                 "[kiln::allclose] " + std::string(dtype_name(a.dtype())) + " did not match " +
                     std::string(dtype_name(b.dtype())) + ". Convert one input with .to(...) first.");
      double rtol = c.double_attr(0), atol = c.double_attr(1);
      KILN_CHECK(rtol >= 0, ValueError,
                 "[kiln::allclose] rtol must be greater than or equal to zero, but got " + std::to_string(rtol) + ".");
      KILN_CHECK(atol >= 0, ValueError,
                 "[kiln::allclose] atol must be greater than or equal to zero, but got " + std::to_string(atol) + ".");
      detail::broadcast_sizes(a.sizes(), b.sizes(), "allclose");
      return {TensorMeta{{}, {}, DType::bool_, a.device()}};
    },
    .lowering = lowering::Extern{},
});

// equal(a, b) -> 0-dim bool: same sizes and values (after type promotion).
const OpDef& kEqual = register_op({
    .name = "equal",
    .schema = "equal(Tensor self, Tensor other) -> bool",
    .meta = [](const OpCall& c) -> std::vector<TensorMeta> {
      check_same_device(c.input(0), c.input(1), "equal");
      return {TensorMeta{{}, {}, DType::bool_, c.input(0).device()}};
    },
    .lowering = lowering::Extern{},
});

}  // namespace

bool allclose(const Tensor& a, const Tensor& b, double rtol, double atol, bool equal_nan) {
  return call_op1(kAllclose, {a, b}, {rtol, atol, equal_nan}).cpu().item<bool>();
}

bool equal(const Tensor& a, const Tensor& b) { return call_op1(kEqual, {a, b}).cpu().item<bool>(); }

std::vector<int64_t> broadcast_shapes(const std::vector<std::vector<int64_t>>& shapes) {
  std::vector<int64_t> out;
  for (const auto& s : shapes) {
    for (int64_t d : s) {
      KILN_CHECK(d >= 0, ValueError,
                 "[kiln::broadcast_shapes] Trying to create tensor with negative dimension " +
                     std::to_string(d) + ": " + shape_str(s) + ". Sizes must be non-negative.");
    }
    out = detail::broadcast_sizes(out, s, "broadcast_shapes");
  }
  return out;
}

DType result_type(const TensorList& tensors) {
  KILN_CHECK(!tensors.empty(), ValueError, "[kiln::result_type] needs at least one tensor.");
  for (const Tensor& t : tensors)
    KILN_CHECK(t.defined(), ValueError, "[kiln::result_type] got an undefined tensor. Pass defined tensors only.");
  return detail::result_type(tensors);
}

}  // namespace kiln
