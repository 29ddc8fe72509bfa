// Random ops: uniform, normal, randint, bernoulli, bernoulli.p, native_dropout.
//
// Every front-end reserves the Philox counters it needs from the default generator at call time
// and passes (seed, offset) to the op as int64 attrs, so the kernel is a pure function of
// (seed, offset, shape, parameters). The stream is defined in kiln/math/philox.h and docs/random.md.
//
// Autograd, as in PyTorch: native_dropout passes grad * mask * scale to its input; samples carry
// no gradient to their parameters (bernoulli gives zeros, like PyTorch's "self: zeros_like(grad)"),
// and the factories' in-place forms (uniform_, normal_) cut the target's history.
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>

#include "core/generator.h"
#include "core/shape.h"
#include "core/tensor_factory.h"
#include "kiln/math/philox.h"
#include "kiln/op_table.h"
#include "kiln/ops.h"

namespace kiln {

namespace {

// The shortest decimal that reads back as v ("1.5", "0.1", "-1").
std::string num_str(double v) {
  char buf[32];
  for (int precision = 1; precision <= 17; ++precision) {
    std::snprintf(buf, sizeof buf, "%.*g", precision, v);
    if (std::strtod(buf, nullptr) == v) break;
  }
  return buf;
}

void check_floating(DType t, const std::string& op) {
  KILN_CHECK(is_floating_point(t), DTypeError,
             "[kiln::" + op + "] " + op + " is only defined for floating-point dtypes, got " +
                 std::string(dtype_name(t)) + ". Pass a floating dtype (or use randint for integers).");
}

// The largest finite value of a floating dtype.
double largest_finite(DType t) {
  switch (t) {
    case DType::float16: return 65504.0;
    case DType::bfloat16: return 3.3895313892515355e38;
    case DType::float32: return std::numeric_limits<float>::max();
    default: return std::numeric_limits<double>::max();
  }
}

// uniform_/normal_ on a tensor with history: the new values depend on no input.
Derivative no_inputs_derivative() {
  return {.formula = "non-differentiable: no tensor inputs",
          .fn = [](const BackwardContext&) -> TensorList { return {}; }};
}

// bernoulli: a sample, not a function of p; zero gradient, as PyTorch gives.
Derivative zero_sample_derivative() {
  return {.formula = "self: zeros_like(grad)",
          .fn = [](const BackwardContext& c) -> TensorList {
            return {c.needs_grad(0) ? zeros_like(c.grad()) : Tensor()};
          }};
}

TensorMeta factory_meta(const OpCall& c, size_t size_attr, size_t dtype_attr, const std::string& op) {
  IntArrayRef sizes = c.ints_attr(size_attr);
  detail::check_sizes_nonnegative(sizes, op);
  detail::checked_numel(sizes, op);
  return TensorMeta{sizes.vec(), {}, c.dtype_attr(dtype_attr), c.device_attr(dtype_attr + 1)};
}

void check_p(double p, const std::string& op) {
  KILN_CHECK(p >= 0.0 && p <= 1.0, ValueError,
             "[kiln::" + op + "] " + op + " expects p to be in [0, 1], but got p=" + num_str(p) + ".");
}

// uniform(size, from, to, *, seed, offset, dtype, device)
const OpDef& kUniform = register_op({
    .name = "uniform",
    .schema = "uniform(int[] size, float from=0, float to=1, *, int seed, int offset, ScalarType dtype, "
              "Device device) -> Tensor",
    .kind = OpKind::factory,
    .meta = [](const OpCall& c) -> std::vector<TensorMeta> {
      TensorMeta m = factory_meta(c, 0, 5, "uniform_");
      check_floating(m.dtype, "uniform_");
      double from = c.double_attr(1), to = c.double_attr(2);
      const double max = largest_finite(m.dtype);
      const std::string dt(dtype_name(m.dtype));
      KILN_CHECK(from >= -max && from <= max, ValueError,
                 "[kiln::uniform_] from is out of bounds for " + dt + ": got " + num_str(from) + ".");
      KILN_CHECK(to >= -max && to <= max, ValueError,
                 "[kiln::uniform_] to is out of bounds for " + dt + ": got " + num_str(to) + ".");
      KILN_CHECK(from <= to, ValueError,
                 "[kiln::uniform_] uniform_ expects to return a [from, to) range, but found from=" +
                     num_str(from) + " > to=" + num_str(to) + ".");
      KILN_CHECK(to - from <= max, ValueError,
                 "[kiln::uniform_] uniform_ expects to-from <= the largest " + dt + ", but found to=" +
                     num_str(to) + " and from=" + num_str(from) + ". Narrow the range.");
      return {m};
    },
    .pointwise = true,
    .derivative = no_inputs_derivative(),
    .lowering = lowering::Extern{},
    .runtime_attrs = {3, 4},  // seed, offset
});

// normal(size, mean, std, *, seed, offset, dtype, device)
const OpDef& kNormal = register_op({
    .name = "normal",
    .schema = "normal(int[] size, float mean=0, float std=1, *, int seed, int offset, ScalarType dtype, "
              "Device device) -> Tensor",
    .kind = OpKind::factory,
    .meta = [](const OpCall& c) -> std::vector<TensorMeta> {
      TensorMeta m = factory_meta(c, 0, 5, "normal_");
      check_floating(m.dtype, "normal_");
      double std_dev = c.double_attr(2);
      KILN_CHECK(std_dev >= 0.0, ValueError,
                 "[kiln::normal_] normal expects std >= 0.0, but found std " + num_str(std_dev) + ".");
      return {m};
    },
    .pointwise = true,
    .derivative = no_inputs_derivative(),
    .lowering = lowering::Extern{},
    .runtime_attrs = {3, 4},  // seed, offset
});

// The range [lo, hi] a dtype holds exactly (for floats: the integers it represents exactly).
std::pair<double, double> exact_integer_range(DType t) {
  switch (t) {
    case DType::bool_: return {0, 1};
    case DType::uint8: return {0, 255};
    case DType::int8: return {-128, 127};
    case DType::int32: return {-2147483648.0, 2147483647.0};
    case DType::int64: return {-9223372036854775808.0, 9223372036854775807.0};
    case DType::float16: return {-2048, 2048};
    case DType::bfloat16: return {-256, 256};
    case DType::float32: return {-16777216.0, 16777216.0};
    case DType::float64: return {-9007199254740992.0, 9007199254740992.0};
  }
  return {0, 0};
}

// randint(size, low, high, *, seed, offset, dtype, device): integers in [low, high).
const OpDef& kRandint = register_op({
    .name = "randint",
    .schema = "randint.low(int[] size, int low, int high, *, int seed, int offset, ScalarType dtype, "
              "Device device) -> Tensor",
    .kind = OpKind::factory,
    .meta = [](const OpCall& c) -> std::vector<TensorMeta> {
      TensorMeta m = factory_meta(c, 0, 5, "randint");
      int64_t low = c.int_attr(1), high = c.int_attr(2);
      KILN_CHECK(low < high, ValueError,
                 "[kiln::randint] random_ expects 'from' to be less than 'to', but got from=" +
                     std::to_string(low) + " >= to=" + std::to_string(high) + ".");
      auto [lo, hi] = exact_integer_range(m.dtype);
      std::string dt(dtype_name(m.dtype));
      KILN_CHECK(static_cast<double>(low) >= lo && static_cast<double>(low) <= hi, ValueError,
                 "[kiln::randint] from is out of bounds for " + dt + ": got " + std::to_string(low) +
                     ". Pick a wider dtype or a smaller range.");
      KILN_CHECK(static_cast<double>(high - 1) >= lo && static_cast<double>(high - 1) <= hi, ValueError,
                 "[kiln::randint] to - 1 is out of bounds for " + dt + ": got " + std::to_string(high - 1) +
                     ". Pick a wider dtype or a smaller range.");
      return {m};
    },
    .pointwise = true,
    .lowering = lowering::Extern{},
    .runtime_attrs = {3, 4},  // seed, offset
});

// bernoulli(p, *, seed, offset): 1 with probability p[i], else 0; dtype of p.
const OpDef& kBernoulli = register_op({
    .name = "bernoulli",
    .schema = "bernoulli(Tensor self, *, int seed, int offset) -> Tensor",
    .meta = [](const OpCall& c) -> std::vector<TensorMeta> {
      const Tensor& p = c.input(0);
      check_floating(p.dtype(), "bernoulli");
      // Values are checked by the kernel (0 <= p <= 1), before anything is written.
      return {TensorMeta{p.sizes().vec(), {}, p.dtype(), p.device()}};
    },
    .pointwise = true,
    .derivative = zero_sample_derivative(),
    .lowering = lowering::Extern{},
    .runtime_attrs = {0, 1},  // seed, offset
});

// bernoulli.p(self, p, *, seed, offset): self's shape and dtype, 1 with probability p.
const OpDef& kBernoulliP = register_op({
    .name = "bernoulli.p",
    .schema = "bernoulli.p(Tensor self, float p=0.5, *, int seed, int offset) -> Tensor",
    .meta = [](const OpCall& c) -> std::vector<TensorMeta> {
      const Tensor& self = c.input(0);
      check_p(c.double_attr(0), "bernoulli_");
      return {TensorMeta{self.sizes().vec(), {}, self.dtype(), self.device()}};
    },
    .pointwise = true,
    .derivative = zero_sample_derivative(),
    .lowering = lowering::Extern{},
    .runtime_attrs = {1, 2},  // seed, offset
});

// native_dropout(input, p, train, *, seed, offset) -> (output, mask): in training, keeps each
// element with probability 1 - p (mask true) and scales it by 1 / (1 - p); otherwise copies.
const OpDef& kNativeDropout = register_op({
    .name = "native_dropout",
    .schema = "native_dropout(Tensor input, float p, bool? train, *, int seed, int offset) -> (Tensor, Tensor)",
    .meta = [](const OpCall& c) -> std::vector<TensorMeta> {
      const Tensor& x = c.input(0);
      check_floating(x.dtype(), "dropout");
      double p = c.double_attr(0);
      KILN_CHECK(p >= 0.0 && p <= 1.0, ValueError,
                 "[kiln::dropout] dropout probability has to be between 0 and 1, but got " + num_str(p) + ".");
      return {TensorMeta{x.sizes().vec(), {}, x.dtype(), x.device()},
              TensorMeta{x.sizes().vec(), {}, DType::bool_, x.device()}};
    },
    .pointwise = true,
    .derivative = {.formula = "input: grad * mask * (train ? (p == 1 ? 0 : 1 / (1 - p)) : 1)",
                   .save_outputs = {1},
                   .fn = [](const BackwardContext& c) -> TensorList {
                     // The scale the forward applied (the kernel treats a missing `train` as true).
                     bool train = !c.has_attr(1) || c.bool_attr(1);
                     double p = c.double_attr(0);
                     double scale = !train ? 1.0 : (p == 1.0 ? 0.0 : 1.0 / (1.0 - p));
                     return {mul(c.grad() * c.output(1), scale)};
                   }},
    .lowering = lowering::Extern{},
    .runtime_attrs = {2, 3},  // seed, offset
});

// ---- front-end helpers ----

int64_t numel_or_zero(IntArrayRef sizes) {
  int64_t n = 1;
  for (int64_t s : sizes) {
    if (s <= 0) return 0;
    if (__builtin_mul_overflow(n, s, &n)) return 0;  // meta reports it
  }
  return n;
}

int float_draw_bits(DType t) { return t == DType::float64 ? 64 : 32; }

// Reserves the counters for `draws` draws of `bits` bits; returns (seed, offset) as int64 attrs.
std::pair<int64_t, int64_t> reserve(int64_t draws, int bits) {
  auto at = detail::default_generator().reserve(math::philox_counters(static_cast<uint64_t>(draws), bits));
  return {static_cast<int64_t>(at.seed), static_cast<int64_t>(at.offset)};
}

Tensor finish(Tensor t, const TensorOptions& o) {
  if (o.requires_grad) t.requires_grad_(true);
  return t;
}

// _like factories take the device from the tensor unless one other than the default is given.
TensorOptions like_options(const Tensor& t, TensorOptions o) {
  if (!o.dtype) o.dtype = t.dtype();
  if (o.device == kCPU) o.device = t.device();
  return o;
}

Tensor uniform_factory(IntArrayRef sizes, double from, double to, const TensorOptions& o) {
  DType dt = o.dtype.value_or(default_dtype());
  auto [seed, offset] = reserve(numel_or_zero(sizes), float_draw_bits(dt));
  return finish(call_op1(kUniform, {}, {sizes.vec(), from, to, seed, offset, dt, o.device}), o);
}

Tensor normal_factory(IntArrayRef sizes, double mean, double std_dev, const TensorOptions& o) {
  DType dt = o.dtype.value_or(default_dtype());
  auto [seed, offset] = reserve(numel_or_zero(sizes), float_draw_bits(dt));
  return finish(call_op1(kNormal, {}, {sizes.vec(), mean, std_dev, seed, offset, dt, o.device}), o);
}

}  // namespace

Tensor rand(IntArrayRef sizes, TensorOptions o) { return uniform_factory(sizes, 0.0, 1.0, o); }
Tensor randn(IntArrayRef sizes, TensorOptions o) { return normal_factory(sizes, 0.0, 1.0, o); }

Tensor randint(int64_t low, int64_t high, IntArrayRef sizes, TensorOptions o) {
  DType dt = o.dtype.value_or(DType::int64);
  uint64_t range = static_cast<uint64_t>(high) - static_cast<uint64_t>(low);
  auto [seed, offset] = reserve(numel_or_zero(sizes), math::randint_draw_bits(range));
  return finish(call_op1(kRandint, {}, {sizes.vec(), low, high, seed, offset, dt, o.device}), o);
}

Tensor randint(int64_t high, IntArrayRef sizes, TensorOptions o) { return randint(0, high, sizes, o); }

Tensor rand_like(const Tensor& t, TensorOptions o) { return rand(t.sizes(), like_options(t, o)); }
Tensor randn_like(const Tensor& t, TensorOptions o) { return randn(t.sizes(), like_options(t, o)); }

Tensor bernoulli(const Tensor& p) {
  auto [seed, offset] = reserve(p.numel(), 32);
  return call_op1(kBernoulli, {p}, {seed, offset});
}

Tensor bernoulli(const Tensor& t, double p) {
  auto [seed, offset] = reserve(t.numel(), 32);
  return call_op1(kBernoulliP, {t}, {p, seed, offset});
}

Tensor dropout(const Tensor& input, double p, bool training) {
  KILN_CHECK(p >= 0.0 && p <= 1.0, ValueError,
             "[kiln::dropout] dropout probability has to be between 0 and 1, but got " + num_str(p) + ".");
  // Like PyTorch: in eval mode, with p = 0, or with no elements, the input itself comes back.
  if (!training || p == 0.0 || input.numel() == 0) return input;
  auto [seed, offset] = reserve(input.numel(), 32);
  return call_op(kNativeDropout, {input}, {p, true, seed, offset})[0];
}

Tensor& uniform_(Tensor& t, double from, double to) { return t.uniform_(from, to); }
Tensor& normal_(Tensor& t, double mean, double std) { return t.normal_(mean, std); }

Tensor& Tensor::uniform_(double from, double to) {
  auto [seed, offset] = reserve(numel(), float_draw_bits(dtype()));
  Tensor out[1] = {*this};
  call_op_out(kUniform, {}, {sizes().vec(), from, to, seed, offset, dtype(), device()}, out);
  return *this;
}

Tensor& Tensor::normal_(double mean, double std) {
  auto [seed, offset] = reserve(numel(), float_draw_bits(dtype()));
  Tensor out[1] = {*this};
  call_op_out(kNormal, {}, {sizes().vec(), mean, std, seed, offset, dtype(), device()}, out);
  return *this;
}

Tensor& Tensor::bernoulli_(double p) {
  auto [seed, offset] = reserve(numel(), 32);
  Tensor out[1] = {*this};
  call_op_out(kBernoulliP, {*this}, {p, seed, offset}, out);
  return *this;
}

}  // namespace kiln
