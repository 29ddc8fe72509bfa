// Range factories: arange, linspace, eye. Sizes, dtype inference and checks follow PyTorch's
// RangeFactories.cpp (including its error messages).
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>

#include "core/shape.h"
#include "core/tensor_factory.h"
#include "kiln/op_table.h"
#include "kiln/ops.h"

namespace kiln {

namespace {

// A Scalar as Python would print it: the shortest decimal that reads back as the value.
std::string scalar_str(const Scalar& s) {
  if (!s.is_floating_point()) return s.str();
  double v = s.to_double();
  char buf[32];
  for (int precision = 1; precision <= 17; ++precision) {
    std::snprintf(buf, sizeof buf, "%.*g", precision, v);
    if (std::strtod(buf, nullptr) == v) break;
  }
  return buf;
}

// A Scalar converted to int64 the way Scalar.to<int64_t>() does, but rejecting values a double
// cannot turn into an int64 (inf, nan, out of range) instead of invoking undefined behaviour.
int64_t checked_to_int(const Scalar& s, const char* what) {
  if (s.is_floating_point()) {
    double d = s.to_double();
    KILN_CHECK(std::isfinite(d) && d >= -9223372036854775808.0 && d < 9223372036854775808.0, ValueError,
               std::string("[kiln::arange] ") + what + " " + scalar_str(s) +
                   " cannot be converted to int64 without overflow. Use a floating dtype.");
  }
  return s.to_int();
}

// The value of s in arange's accumulate type for `t` (double; float for float16/bfloat16).
double acc_value(const Scalar& s, DType t) {
  if (t == DType::float16 || t == DType::bfloat16) return static_cast<float>(s.to_double());
  return s.to_double();
}

// Number of elements of arange(start, end, step) for dtype t, after PyTorch's checks.
int64_t arange_size(const Scalar& start, const Scalar& end, const Scalar& step, DType t) {
  KILN_CHECK(t != DType::bool_, DTypeError,
             "[kiln::arange] arange is not implemented for dtype bool. Use an integer or floating dtype.");
  const std::string range = scalar_str(start) + " -> " + scalar_str(end);
  if (is_integral(t)) {
    int64_t xs = checked_to_int(start, "start"), xe = checked_to_int(end, "end");
    int64_t xst = checked_to_int(step, "step");
    KILN_CHECK(xst != 0, ValueError, "[kiln::arange] step must be nonzero.");
    KILN_CHECK((xst > 0 && xe >= xs) || (xst < 0 && xe <= xs), ValueError,
               "[kiln::arange] upper bound and larger bound inconsistent with step sign (" + range +
                   " with step " + scalar_str(step) + ").");
    if (t == DType::int64) {
      // Exact integer formula: ceil((end - start) / step) without going through double.
      __int128 sgn = xst > 0 ? 1 : -1;
      __int128 n = (static_cast<__int128>(xe) - xs + xst - sgn) / xst;
      KILN_CHECK(n <= std::numeric_limits<int64_t>::max(), ValueError,
                 "[kiln::arange] invalid size, possible overflow? (" + range + " with step " +
                     scalar_str(step) + ").");
      return static_cast<int64_t>(n);
    }
  } else {
    double xs = acc_value(start, t), xe = acc_value(end, t), xst = acc_value(step, t);
    KILN_CHECK(xst > 0 || xst < 0, ValueError, "[kiln::arange] step must be nonzero.");
    KILN_CHECK(std::isfinite(xs) && std::isfinite(xe), ValueError,
               "[kiln::arange] unsupported range: " + range + ". Use finite bounds.");
    KILN_CHECK((xst > 0 && xe >= xs) || (xst < 0 && xe <= xs), ValueError,
               "[kiln::arange] upper bound and larger bound inconsistent with step sign (" + range +
                   " with step " + scalar_str(step) + ").");
  }
  double size_d = std::ceil((end.to_double() - start.to_double()) / step.to_double());
  KILN_CHECK(size_d >= 0 && size_d <= static_cast<double>(std::numeric_limits<int64_t>::max()), ValueError,
             "[kiln::arange] invalid size, possible overflow? (" + range + " with step " + scalar_str(step) + ").");
  return static_cast<int64_t>(size_d);
}

// arange(start, end, step, *, dtype, device): start + i * step for i in [0, ceil((end - start) / step)).
const OpDef& kArange = register_op({
    .name = "arange",
    .schema = "arange.start_step(Scalar start, Scalar end, Scalar step=1, *, ScalarType dtype, "
              "Device device) -> Tensor",
    .kind = OpKind::factory,
    .meta = [](const OpCall& c) -> std::vector<TensorMeta> {
      DType t = c.dtype_attr(3);
      int64_t n = arange_size(c.scalar_attr(0), c.scalar_attr(1), c.scalar_attr(2), t);
      return {TensorMeta{{n}, {}, t, c.device_attr(4)}};
    },
    .lowering = lowering::Extern{},
});

// linspace(start, end, steps, *, dtype, device): steps evenly spaced values from start to end.
const OpDef& kLinspace = register_op({
    .name = "linspace",
    .schema = "linspace(Scalar start, Scalar end, int steps, *, ScalarType dtype, Device device) -> Tensor",
    .kind = OpKind::factory,
    .meta = [](const OpCall& c) -> std::vector<TensorMeta> {
      int64_t steps = c.int_attr(2);
      KILN_CHECK(steps >= 0, ValueError,
                 "[kiln::linspace] number of steps must be non-negative, got " + std::to_string(steps) + ".");
      DType t = c.dtype_attr(3);
      KILN_CHECK(t != DType::bool_, DTypeError,
                 "[kiln::linspace] linspace is not implemented for dtype bool. Use an integer or floating dtype.");
      return {TensorMeta{{steps}, {}, t, c.device_attr(4)}};
    },
    .lowering = lowering::Extern{},
});

// eye(n, m, *, dtype, device): ones on the main diagonal of an n x m matrix.
const OpDef& kEye = register_op({
    .name = "eye",
    .schema = "eye.m(int n, int m, *, ScalarType dtype, Device device) -> Tensor",
    .kind = OpKind::factory,
    .meta = [](const OpCall& c) -> std::vector<TensorMeta> {
      int64_t n = c.int_attr(0), m = c.int_attr(1);
      KILN_CHECK(n >= 0, ValueError, "[kiln::eye] n must be greater or equal to 0, got " + std::to_string(n) + ".");
      KILN_CHECK(m >= 0, ValueError, "[kiln::eye] m must be greater or equal to 0, got " + std::to_string(m) + ".");
      detail::checked_numel({n, m}, "eye");
      return {TensorMeta{{n, m}, {}, c.dtype_attr(2), c.device_attr(3)}};
    },
    .lowering = lowering::Extern{},
});

Tensor finish(Tensor t, const TensorOptions& o) {
  if (o.requires_grad) t.requires_grad_(true);
  return t;
}

}  // namespace

Tensor arange(Scalar end, TensorOptions o) { return arange(0, end, 1, o); }

Tensor arange(Scalar start, Scalar end, Scalar step, TensorOptions o) {
  // PyTorch's inference: integer (or bool) arguments give int64, any floating one the default dtype.
  bool all_integral = !start.is_floating_point() && !end.is_floating_point() && !step.is_floating_point();
  DType t = o.dtype.value_or(all_integral ? DType::int64 : default_dtype());
  return finish(call_op1(kArange, {}, {start, end, step, t, o.device}), o);
}

Tensor linspace(double start, double end, int64_t steps, TensorOptions o) {
  DType t = o.dtype.value_or(default_dtype());
  return finish(call_op1(kLinspace, {}, {Scalar(start), Scalar(end), steps, t, o.device}), o);
}

Tensor eye(int64_t n, std::optional<int64_t> m, TensorOptions o) {
  DType t = o.dtype.value_or(default_dtype());
  return finish(call_op1(kEye, {}, {n, m.value_or(n), t, o.device}), o);
}

}  // namespace kiln
