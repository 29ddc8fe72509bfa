// The kiln backend (DESIGN §2.5, issue 5) against eager (DESIGN §3): every pointwise lowering of
// src/compiler/lower/node_lowering.cpp in every dtype it serves, broadcasting and layouts, fused
// chains, reductions with prologues, fused cat, run-time scalars, nodes left to the dispatcher,
// in-place writes to inputs, whole models, and the KILN_COMPILE_DEBUG dump.
//
// Every test checks compiler::counters().kernel_runs, so a silent eager fallback fails it, and
// where every op of a function has a lowering, that nothing went through the dispatcher.
// Results are compared with matches() below rather than compile_helpers.h's close(): NaN must
// match NaN, int64 must compare exactly, and float64 uses DESIGN §3's rtol 1e-10.
// Tests marked BUG fail because of backend bugs (each comment says which); they stay failing
// until the backend is fixed.
// Each distinct graph costs a system-compiler run, so ops are batched: one compiled function per
// op family returns all of that family's results.
#include <gtest/gtest.h>
#include <stdlib.h>
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <iomanip>
#include <fstream>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "compile_helpers.h"
#include "kernel_cache_dir.h"
#include "op_samples.h"
#include "ops/pointwise_list.h"
#include "kiln/compiler.h"
#include "kiln/kiln.h"
#include "kiln/models.h"
#include "kiln/threading.h"
#include <nlohmann/json.hpp>

namespace {

using namespace kiln;
using namespace kiln::testing;  // compile_helpers.h
namespace fs = std::filesystem;

// ================================ environment ================================

KILN_TEST_KERNEL_CACHE_DIR("kiln_test_kiln_backend");

// ================================ helpers ================================

CompileOptions kiln_backend() {
  CompileOptions options;
  options.backend = std::string("kiln");
  return options;
}

template <class F>
auto compile_kiln(F fn) {
  return kiln::compile(std::move(fn), kiln_backend());
}

struct Tol {
  double rtol, atol;
};

// DESIGN §3: the generated code and the eager kernels share kiln/math/functors.h, so pointwise
// results differ at most by contraction into FMAs (a few ulp).
Tol exact_tol(DType t) { return t == kFloat64 ? Tol{1e-10, 1e-12} : Tol{1.3e-6, 1e-5}; }
// Reductions reassociate: the generated code accumulates float32 sums in double, in SIMD lanes
// and OpenMP chunks, while eager sums pairwise in float32, so float32 results agree to the
// rounding of the partial sums, not to the last ulp.
Tol reduction_tol(DType t) { return t == kFloat64 ? Tol{1e-10, 1e-12} : Tol{1e-5, 1e-5}; }

// Same shape and dtype; floats within `tol` (NaN matches NaN, infinities must be equal); other
// dtypes exactly equal.
::testing::AssertionResult matches(const Tensor& got, const Tensor& want, Tol tol) {
  if (!got.defined() || !want.defined())
    return ::testing::AssertionFailure() << "undefined tensor (compiled " << got.defined() << ", eager "
                                         << want.defined() << ")";
  if (!(got.sizes() == want.sizes()))
    return ::testing::AssertionFailure() << "shape " << shape_str(got.sizes()) << " != eager "
                                         << shape_str(want.sizes());
  if (got.dtype() != want.dtype())
    return ::testing::AssertionFailure() << "dtype " << dtype_name(got.dtype()) << " != eager "
                                         << dtype_name(want.dtype());
  auto mismatch = [&](size_t i, auto a, auto e) {
    return ::testing::AssertionFailure() << std::setprecision(17) << "element " << i << " (of "
                                         << shape_str(want.sizes()) << ", " << dtype_name(want.dtype())
                                         << "): compiled " << a << ", eager " << e;
  };
  if (!is_floating_point(want.dtype())) {  // int64 beyond 2^53 is not a double
    const std::vector<int64_t> g = got.to_vector<int64_t>(), w = want.to_vector<int64_t>();
    for (size_t i = 0; i < g.size(); ++i)
      if (g[i] != w[i]) return mismatch(i, g[i], w[i]);
    return ::testing::AssertionSuccess();
  }
  const std::vector<double> g = got.to_vector<double>(), w = want.to_vector<double>();
  for (size_t i = 0; i < g.size(); ++i) {
    const double a = g[i], e = w[i];
    if (a == e || (std::isnan(a) && std::isnan(e))) continue;
    if (std::abs(a - e) <= tol.atol + tol.rtol * std::abs(e)) continue;
    return mismatch(i, a, e);
  }
  return ::testing::AssertionSuccess();
}

::testing::AssertionResult matches(const Tensor& got, const Tensor& want) {
  return matches(got, want, exact_tol(want.defined() ? want.dtype() : kFloat32));
}

// Output by output, named; `tol` per dtype.
::testing::AssertionResult all_match(const std::vector<Tensor>& got, const std::vector<Tensor>& want,
                                     const std::vector<std::string>& names, Tol (*tol)(DType) = exact_tol) {
  if (got.size() != want.size())
    return ::testing::AssertionFailure() << got.size() << " outputs, eager " << want.size();
  std::ostringstream failures;
  for (size_t i = 0; i < got.size(); ++i) {
    auto r = matches(got[i], want[i], tol(want[i].defined() ? want[i].dtype() : kFloat32));
    if (!r) failures << "\n  " << (i < names.size() ? names[i] : "output " + std::to_string(i)) << ": " << r.message();
  }
  if (failures.str().empty()) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "outputs differ from eager:" << failures.str();
}

// Values the math must agree on at the edges: NaN, infinities, signed zeros, halves, tiny and
// large magnitudes (in that order, so that small tensors get the first ones), then random normal
// values scaled by 3.
Tensor special_values(IntArrayRef sizes, DType dtype) {
  const double inf = std::numeric_limits<double>::infinity(), nan = std::numeric_limits<double>::quiet_NaN();
  std::vector<double> v = {nan, inf, -inf, -0.0, 0.0, -3.5, -1.0, -0.5, 0.25,
                           0.5, 1.0, 2.5,  3.0,  1e-8, -1e-8, 30.0, -30.0, 2.0};
  const size_t specials = v.size();
  int64_t n = 1;
  for (int64_t s : sizes) n *= s;
  const std::vector<double> r = randn({n}, kFloat64).to_vector<double>();
  v.resize(static_cast<size_t>(n));
  for (size_t i = specials; i < v.size(); ++i) v[i] = 3 * r[i];
  return tensor<double>(v, sizes).to(dtype);
}

// Half-integers in [-4, 4]: exact in every float dtype, with many ties for the comparisons.
Tensor halves(IntArrayRef sizes, DType dtype) { return (randint(-8, 9, sizes).to(kFloat64) * 0.5).to(dtype); }

class KilnBackend : public CompilerTest {
 protected:
  void SetUp() override {
    CompilerTest::SetUp();
    manual_seed(0);
  }
};

// ================================ the op table ================================

// Walks the op table: every op with a pointwise or reduction lowering, called in one compiled
// function per dtype, matches eager. In float32 and float64 every one of them runs inside generated
// kernels (no node goes through the dispatcher); in int64 and bool some lowerings leave a case to
// eager on purpose (integer division and remainder check for zero divisors), so those dtypes check
// the values only. A new pointwise op is covered here by being in the table (op_samples.h).
TEST_F(KilnBackend, EveryOpWithAFusedLoweringInTheTableFusesAndMatchesEager) {
  std::vector<const OpDef*> ops;
  for (const OpDef* op : OpTable::instance().all())
    if (has_fused_lowering(*op)) ops.push_back(op);
  ASSERT_GE(ops.size(), 60u) << "the pointwise and reduction ops of the table";
  // Input 0 with special values (NaN, infinities, signed zeros), the others half-integers with ties.
  auto floats = [](IntArrayRef sizes, DType t, size_t index) {
    return index == 0 ? special_values(sizes, t) : halves(sizes, t);
  };
  std::set<std::string> covered;
  for (DType t : {kFloat32, kFloat64, kInt64, kBool}) {
    SCOPED_TRACE(dtype_name(t));
    const SampleBatch batch = sample_batch(ops, t, kCPU, floats);
    EXPECT_TRUE(batch.unknown.empty()) << "no sample arguments for " << batch.unknown.front();
    for (const auto& [op, call] : batch.calls) covered.insert(op->name);
    auto compiled = compile_kiln([&batch](const std::vector<Tensor>& in) { return batch.run(in); });
    Delta d;
    std::vector<Tensor> got = compiled(batch.inputs);
    if (is_floating_point(t)) {
      EXPECT_EQ(d.now().dispatched_nodes, 0) << "every lowered op runs in generated code";
    }
    EXPECT_GT(d.now().kernel_runs, 0);
    ASSERT_EQ(got.size(), batch.eager.size());
    for (size_t i = 0; i < got.size(); ++i) {
      const OpDef* op = batch.producer[i];
      const Tol tol = std::holds_alternative<lowering::Reduction>(op->lowering) ? reduction_tol(t) : exact_tol(t);
      EXPECT_TRUE(matches(got[i], batch.eager[i], tol)) << op->name;
    }
  }
  for (const OpDef* op : ops) EXPECT_TRUE(covered.count(op->name)) << op->name << " ran in no dtype";
}

// compiler::counters().kernel_builds counts kernel sources the system compiler built: a kernel the
// cache lacks builds once; the same kernels compiled again (a second compile() of the function, as
// after a recompile) come from the cache and build nothing.
TEST_F(KilnBackend, KernelBuildsCountsWhatTheSystemCompilerBuilt) {
  auto f = [](const Tensor& x) { return hypot(sin(x), cos(x)) * x - 0.5; };
  Tensor x = randn({7, 13});
  Delta cold;
  auto first = compile_kiln(f);
  EXPECT_TRUE(matches(first(x), f(x), exact_tol(kFloat32)));
  EXPECT_EQ(cold.now().graph_compiles, 1);
  EXPECT_GE(cold.now().kernel_builds, 1) << "this binary's fresh cache has no such kernel";
  Delta warm;
  auto second = compile_kiln(f);
  EXPECT_TRUE(matches(second(x), f(x), exact_tol(kFloat32)));
  EXPECT_EQ(warm.now().graph_compiles, 1);
  EXPECT_EQ(warm.now().kernel_builds, 0) << "the same kernels come from the cache";
}

// ================================ pointwise: unary ================================

using Unary = std::pair<const char*, Tensor (*)(const Tensor&)>;

// Every unary op of src/ops/pointwise_list.h that takes floats (bitwise_not takes integers), and
// gelu in both approximations.
const std::vector<Unary>& unary_ops() {
  static const std::vector<Unary> ops = [] {
    std::vector<Unary> v;
#define KILN_TEST_UNARY(name, Functor, rule, derivative) \
  if (std::string_view(#rule) != "bitwise") v.push_back({#name, [](const Tensor& x) { return kiln::name(x); }});
    KILN_UNARY_POINTWISE_OPS(KILN_TEST_UNARY)
#undef KILN_TEST_UNARY
    v.push_back({"gelu", [](const Tensor& x) { return gelu(x); }});
    v.push_back({"gelu_tanh", [](const Tensor& x) { return gelu(x, "tanh"); }});
    return v;
  }();
  return ops;
}

template <class Ops>
std::vector<std::string> names_of(const Ops& ops) {
  std::vector<std::string> names;
  for (const auto& op : ops) names.emplace_back(op.first);
  return names;
}

std::vector<Tensor> all_unary(const Tensor& x) {
  std::vector<Tensor> out;
  for (const auto& [name, op] : unary_ops()) out.push_back(op(x));
  return out;
}

TEST_F(KilnBackend, UnaryOpsMatchEagerInFloat32AndFloat64) {
  auto compiled = compile_kiln(all_unary);
  for (DType t : {kFloat32, kFloat64}) {
    SCOPED_TRACE(dtype_name(t));
    Tensor x = special_values({4, 16}, t);
    Delta d;
    std::vector<Tensor> got = compiled(x);
    EXPECT_EQ(d.now().kernel_runs, 1) << "one fused kernel computes every unary op";
    EXPECT_EQ(d.now().dispatched_nodes, 0) << "every unary op has a lowering";
    EXPECT_TRUE(all_match(got, all_unary(x), names_of(unary_ops())));
  }
}

// ================================ pointwise: binary ================================

using Binary = std::pair<const char*, Tensor (*)(const Tensor&, const Tensor&)>;

// Every binary lowering: add/sub with alpha 1, a float alpha and an integer alpha; div in its three
// rounding modes; comparisons and logical ops.
const std::vector<Binary>& binary_ops() {
  static const std::vector<Binary> ops = [] {
    std::vector<Binary> v = {
        {"add", [](const Tensor& a, const Tensor& b) { return add(a, b); }},
        {"add_alpha_2.5", [](const Tensor& a, const Tensor& b) { return add(a, b, 2.5); }},
        {"add_alpha_-3", [](const Tensor& a, const Tensor& b) { return add(a, b, -3); }},
        {"sub", [](const Tensor& a, const Tensor& b) { return sub(a, b); }},
        {"sub_alpha_0.5", [](const Tensor& a, const Tensor& b) { return sub(a, b, 0.5); }},
        {"div", [](const Tensor& a, const Tensor& b) { return div(a, b); }},
        {"div_trunc", [](const Tensor& a, const Tensor& b) { return div(a, b, "trunc"); }},
        {"div_floor", [](const Tensor& a, const Tensor& b) { return div(a, b, "floor"); }},
        {"pow", [](const Tensor& a, const Tensor& b) { return pow(a, b); }},
    };
    // The ops of src/ops/pointwise_list.h that take floats (bitwise ops and shifts take integers).
#define KILN_TEST_BINARY(name, Functor, rule, derivative)                      \
  if (std::string_view(#rule) != "bitwise" && std::string_view(#rule) != "shift") \
    v.push_back({#name, [](const Tensor& a, const Tensor& b) { return kiln::name(a, b); }});
    KILN_BINARY_POINTWISE_OPS(KILN_TEST_BINARY)
#undef KILN_TEST_BINARY
    return v;
  }();
  return ops;
}

std::vector<Tensor> all_binary(const Tensor& a, const Tensor& b) {
  std::vector<Tensor> out;
  for (const auto& [name, op] : binary_ops()) out.push_back(op(a, b));
  return out;
}

TEST_F(KilnBackend, BinaryOpsBroadcastAndMatchEagerInFloat32AndFloat64) {
  auto compiled = compile_kiln(all_binary);
  for (DType t : {kFloat32, kFloat64}) {
    SCOPED_TRACE(dtype_name(t));
    // [4, 1, 5] with [3, 1] broadcasts to [4, 3, 5]. Half of `a` and all but one of `b` are
    // half-integers (exact ties for the comparisons and the rounding divisions), `b` has a zero
    // (division by zero, 0 ** 0) and `a` has specials (inf, NaN, signed zeros).
    Tensor a = cat({halves({2, 1, 5}, t), special_values({2, 1, 5}, t)}, 0);
    Tensor b = tensor<double>({-1.5, 0.0, 2.0}, {3, 1}).to(t);
    Delta d;
    std::vector<Tensor> got = compiled(a, b);
    EXPECT_GT(d.now().kernel_runs, 0);
    EXPECT_EQ(d.now().dispatched_nodes, 0) << "every binary op has a lowering";
    EXPECT_TRUE(all_match(got, all_binary(a, b), names_of(binary_ops())));
    ASSERT_EQ(got[0].sizes().vec(), (std::vector<int64_t>{4, 3, 5}));
  }
}

// Host scalars become 0-dim wrapped-number inputs (x < 0 compares in x's dtype).
std::vector<Tensor> scalar_operand_ops(const Tensor& x, const Tensor& zero_dim) {
  return {x < 0,          x <= 0.5,       x == 1,         x != 0,         x > -1,         x >= 2,
          0.5 < x,        x + 1.5,        x - 2,          3 - x,          x * 0.1,        x / 3,
          2 / x,          add(x, 2.0, 3), sub(x, 1, 0.5), x.pow(2),       x.pow(3.5),     x.pow(-1),
          x.pow(1),       pow(2.0, x),    maximum(x, zero_dim), x * zero_dim};
}
const std::vector<std::string> kScalarOperandNames = {
    "x < 0",  "x <= 0.5", "x == 1",   "x != 0",         "x > -1",   "x >= 2",   "0.5 < x",   "x + 1.5",
    "x - 2",  "3 - x",    "x * 0.1",  "x / 3",          "2 / x",    "add(x, 2.0, alpha=3)", "sub(x, 1, alpha=0.5)",
    "x ** 2", "x ** 3.5", "x ** -1",  "x ** 1",   "2.0 ** x",       "maximum(x, 0-dim)", "x * 0-dim"};

TEST_F(KilnBackend, WrappedHostScalarsMatchEager) {
  auto compiled = compile_kiln(scalar_operand_ops);
  for (DType t : {kFloat32, kFloat64}) {
    SCOPED_TRACE(dtype_name(t));
    Tensor x = special_values({3, 12}, t);  // x ** -1 of 0 is inf, 2 ** inf is inf, ...
    Tensor zero_dim = scalar_tensor(0.5, t);  // a 0-dim tensor (not a wrapped number)
    Delta d;
    std::vector<Tensor> got = compiled(x, zero_dim);
    EXPECT_GT(d.now().kernel_runs, 0);
    // The four powers by a host scalar run through the dispatcher (eager's pow takes shortcuts
    // for 0-dim exponents whose special values std::pow does not reproduce); every other scalar
    // operand is a load.
    EXPECT_EQ(d.now().dispatched_nodes, 4);
    EXPECT_TRUE(all_match(got, scalar_operand_ops(x, zero_dim), kScalarOperandNames));
  }
}

std::vector<Tensor> half_powers(const Tensor& x) { return {x.pow(0.5), x.pow(-0.5)}; }

// x ** 0.5 and x ** -0.5 with a host-scalar exponent. Eager's pow kernel takes PyTorch's shortcuts
// for a 0-dim exponent (0.5: sqrt, -0.5: rsqrt, 2: square, -1: reciprocal), so (-inf) ** 0.5 and
// (-inf) ** -0.5 are NaN and (-0.0) ** -0.5 is -inf, as in PyTorch, where std::pow gives +inf,
// +0 and +inf: the kiln backend runs these through the dispatcher.
TEST_F(KilnBackend, PowByPlusOrMinusAHalfMatchesEagerSqrt) {
  auto compiled = compile_kiln(half_powers);
  for (DType t : {kFloat32, kFloat64}) {
    SCOPED_TRACE(dtype_name(t));
    Tensor x = special_values({3, 12}, t);  // -inf and -0.0 among them
    Delta d;
    std::vector<Tensor> got = compiled(x);
    EXPECT_EQ(d.now().dispatched_nodes, 2);
    EXPECT_TRUE(all_match(got, half_powers(x), {"x ** 0.5", "x ** -0.5"}));
  }
}

// ================================ pointwise: ternary and friends ================================

std::vector<Tensor> ternary_ops(const Tensor& x, const Tensor& y, const Tensor& z, const Tensor& cond,
                                const Tensor& lo, const Tensor& hi, const Tensor& w, const Tensor& fill) {
  return {where(cond, x, y),
          where(cond, x, 0.5),
          where(cond, -1, y),
          clamp(x, -0.5, 0.5),
          clamp(x, lo, hi),
          clamp(x, lo, Tensor()),
          clamp(x, Tensor(), hi),
          clamp(x, std::nullopt, 0.3),
          x.clamp(0.1),
          lerp(x, y, 0.3),
          lerp(x, y, 0.8),
          lerp(x, y, w),
          addcmul(x, y, z),
          addcmul(x, y, z, 0.5),
          addcdiv(x, y, z),
          addcdiv(x, y, z, -2),
          masked_fill(x, cond, -1.5),
          masked_fill(x, cond, fill),
          x.masked_fill(cond, std::numeric_limits<double>::infinity())};
}
const std::vector<std::string> kTernaryNames = {
    "where",           "where(c, x, 0.5)", "where(c, -1, y)", "clamp(x, -0.5, 0.5)", "clamp(x, lo, hi)",
    "clamp(x, lo, None)", "clamp(x, None, hi)", "clamp(x, None, 0.3)", "clamp(x, 0.1)", "lerp 0.3",
    "lerp 0.8",        "lerp tensor",      "addcmul",         "addcmul value 0.5", "addcdiv",
    "addcdiv value -2", "masked_fill -1.5", "masked_fill 0-dim", "masked_fill inf"};

TEST_F(KilnBackend, TernaryOpsMatchEagerInFloat32AndFloat64) {
  auto compiled = compile_kiln(ternary_ops);
  for (DType t : {kFloat32, kFloat64}) {
    SCOPED_TRACE(dtype_name(t));
    Tensor x = special_values({4, 5}, t), y = randn({4, 5}, t), z = randn({4, 5}, t);
    Tensor cond = randn({5}) > 0;                                   // broadcast over rows
    Tensor lo = tensor<double>({-1.0, -0.2, 0.0, 0.5, 0.4}).to(t);  // lo > hi in the last two
    Tensor hi = tensor<double>({1.0, 0.2, 0.0, 0.1, -0.4}).to(t);
    Tensor w = rand({4, 5}, t) * 2 - 0.5;  // both of lerp's branches, and weights outside [0, 1]
    Tensor fill = scalar_tensor(2.0, t);
    Delta d;
    std::vector<Tensor> got = compiled(x, y, z, cond, lo, hi, w, fill);
    EXPECT_GT(d.now().kernel_runs, 0);
    EXPECT_EQ(d.now().dispatched_nodes, 0) << "every ternary op has a lowering";
    EXPECT_TRUE(all_match(got, ternary_ops(x, y, z, cond, lo, hi, w, fill), kTernaryNames));
  }
}

// ================================ casts and type promotion ================================

std::vector<Tensor> cast_ops(const Tensor& f, const Tensor& finite, const Tensor& d, const Tensor& i64,
                             const Tensor& i32, const Tensor& u8, const Tensor& b) {
  return {f.to(kBool),       f.to(kFloat64),      d.to(kFloat32),     d.to(kBool),        i64.to(kFloat32),
          i32.to(kFloat64),  u8.to(kFloat32),     b.to(kFloat32),     i64.to(kInt32),     i32.to(kInt64),
          u8.to(kInt64),     b.to(kInt64),        i64.to(kBool),      finite.to(kInt64),  finite.to(kInt32),
          abs(finite).to(kUInt8), i64 + finite,   finite + d,         i32 * 2.5,          i64 / i32,
          u8 + i64,          b + b,               b * i32,            where(b, i64, 2.5), clamp(i32, 0.5, 2.5)};
}
const std::vector<std::string> kCastNames = {
    "f32->bool", "f32->f64", "f64->f32", "f64->bool", "i64->f32", "i32->f64", "u8->f32", "bool->f32",
    "i64->i32",  "i32->i64", "u8->i64",  "bool->i64", "i64->bool", "f32->i64", "f32->i32", "f32->u8",
    "i64 + f32", "f32 + f64", "i32 * 2.5", "i64 / i32", "u8 + i64", "bool + bool", "bool * i32",
    "where(b, i64, 2.5)", "clamp(i32, 0.5, 2.5)"};

TEST_F(KilnBackend, DtypeCastsAndPromotionMatchEager) {
  auto compiled = compile_kiln(cast_ops);
  Tensor f = special_values({3, 7}, kFloat32);               // NaN and -0.0 -> bool
  Tensor finite = (rand({3, 7}) * 2 - 1) * 200;             // float -> int truncates toward zero
  Tensor d = special_values({3, 7}, kFloat64);
  Tensor i64 = randint(-100, 100, {3, 7});
  Tensor i32 = randint(1, 9, {3, 7}).to(kInt32) * tensor<int32_t>({1, -1, 1, -1, 1, -1, 1});
  Tensor u8 = randint(0, 256, {3, 7}).to(kUInt8);
  Tensor b = randn({3, 7}) > 0;
  Delta d0;
  std::vector<Tensor> got = compiled(f, finite, d, i64, i32, u8, b);
  EXPECT_GT(d0.now().kernel_runs, 0);
  EXPECT_EQ(d0.now().dispatched_nodes, 0) << "casts and mixed-dtype arithmetic have lowerings";
  EXPECT_TRUE(all_match(got, cast_ops(f, finite, d, i64, i32, u8, b), kCastNames));
}

// ================================ integer ops ================================

std::vector<Tensor> int_ops(const Tensor& a, const Tensor& b, const Tensor& lo, const Tensor& hi) {
  const bool is_unsigned = a.dtype() == kUInt8;
  Tensor exponent = clamp(b, 0, 3);
  return {abs(a),           neg(a),           sign(a),           relu(a),           floor(a),
          ceil(a),          round(a),         exp(a),            sqrt(a),           sigmoid(a),
          logical_not(a),   isnan(a),         isfinite(a),       add(a, b),         add(a, b, 3),
          sub(a, b),        sub(a, b, 2),     mul(a, b),         div(a, b),         div(a, b, "trunc"),
          div(a, b, "floor"), maximum(a, b),  minimum(a, b),     pow(a, exponent),  atan2(a, b),
          eq(a, b),         ne(a, b),         lt(a, b),          le(a, b),          gt(a, b),
          ge(a, b),         logical_and(a, b), logical_or(a, b), logical_xor(a, b), where(a > b, a, b),
          is_unsigned ? clamp(a, 3, 200) : clamp(a, -3, 7),      clamp(a, lo, hi),  masked_fill(a, a > 2, 9),
          addcmul(a, a, b, 2), a * 3,         a + 2,             5 - a,             a < 3,
          a == 0};
}
const std::vector<std::string> kIntNames = {
    "abs",  "neg",  "sign", "relu", "floor", "ceil", "round", "exp", "sqrt", "sigmoid", "logical_not",
    "isnan", "isfinite", "add", "add alpha 3", "sub", "sub alpha 2", "mul", "div", "div trunc", "div floor",
    "maximum", "minimum", "pow", "atan2", "eq", "ne", "lt", "le", "gt", "ge", "logical_and", "logical_or",
    "logical_xor", "where", "clamp scalars", "clamp tensors", "masked_fill", "addcmul value 2", "a * 3",
    "a + 2", "5 - a", "a < 3", "a == 0"};

TEST_F(KilnBackend, IntegerOpsMatchEagerForInt64Int32AndUint8) {
  auto compiled = compile_kiln(int_ops);
  for (DType t : {kInt64, kInt32, kUInt8}) {
    SCOPED_TRACE(dtype_name(t));
    const bool is_unsigned = t == kUInt8;
    // [3, 1, 4] with [5, 4]. Divisors never 0 (eager throws); signed ones of both signs, so the
    // rounding modes differ; uint8 sums and differences wrap around.
    Tensor a = is_unsigned ? randint(0, 256, {3, 1, 4}).to(t) : randint(-20, 21, {3, 1, 4}).to(t);
    Tensor b = randint(1, 6, {5, 4});
    if (!is_unsigned) b = b * (randint(0, 2, {5, 4}) * 2 - 1);
    b = b.to(t);
    Tensor lo = tensor<int64_t>({0, 2, 5, 9}).to(t), hi = tensor<int64_t>({4, 3, 5, 1}).to(t);
    Delta d;
    std::vector<Tensor> got = compiled(a, b, lo, hi);
    EXPECT_GT(d.now().kernel_runs, 0);
    // Integer divisions (div, trunc, floor) run through the dispatcher, which checks for a zero
    // divisor before dividing; every other integer op is lowered.
    EXPECT_EQ(d.now().dispatched_nodes, 2);
    EXPECT_TRUE(all_match(got, int_ops(a, b, lo, hi), kIntNames));
  }
}

// Regression (fixed): integer division by zero. Eager throws ValueError
// ("ZeroDivisionError: integer division by zero") before writing anything; the generated kernel
// divides without a check and the process dies of SIGFPE. Runs in a child process
// (a death-test re-run of this binary) so that the crash cannot take the other tests with it.
TEST_F(KilnBackend, IntegerDivisionByZeroThrowsLikeEager) {
  auto divide = [](const Tensor& a, const Tensor& b) { return div(a, b, "trunc"); };
  Tensor a = tensor<int64_t>({1, 2, 3}), b = tensor<int64_t>({1, 0, 1});
  EXPECT_THROW(divide(a, b), ValueError);
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        auto compiled = compile_kiln(divide);
        int code = 1;
        try {
          Tensor r = compiled(a, b);
          (void)r.to_vector<int64_t>();
        } catch (const ValueError&) {
          code = 0;
        } catch (...) {
          code = 2;
        }
        std::_Exit(code);
      },
      ::testing::ExitedWithCode(0), "")
      << "compiled integer division by zero must throw ValueError like eager (exit 1: no error, "
         "2: another error, a signal: the kernel crashed)";
}

// ================================ layouts ================================

// Non-contiguous, 0-dim, empty, size-1 and broadcast operands, each in its own kernel.
std::vector<Tensor> layout_ops(const Tensor& xt, const Tensor& y, const Tensor& stepped_cols,
                               const Tensor& stepped_rows, const Tensor& scalar, const Tensor& empty_rows,
                               const Tensor& empty_mid, const Tensor& one, const Tensor& wide,
                               const Tensor& expanded, const Tensor& narrowed, const Tensor& it) {
  return {sin(xt) * y + xt,                   // transposed + contiguous
          exp(stepped_cols) - stepped_cols,   // [6, 20][:, 1::3]
          stepped_rows * 2 + 1,               // [12, 7][::2]
          stepped_rows.t() * stepped_cols.t(),  // views inside the graph
          y + scalar,                         // 0-dim tensor operand
          scalar * scalar + 1,                // 0-dim result
          empty_rows * 2 + 1,                 // [0, 3]
          exp(empty_mid) - empty_mid,         // [3, 0, 2]
          one.relu() * 3,                     // [3, 1, 4]
          one + wide,                         // [3, 1, 4] with [3, 5, 4]
          expanded * y,                       // stride-0 input
          narrowed.tanh(),                    // storage offset
          it * 2 - it,                        // transposed int64
          (y * 2).t(),                        // a view of a kernel's output, returned
          (y + 1).reshape({35}) * 3};         // a kernel reading a view of another's output
}

TEST_F(KilnBackend, NonContiguousZeroDimEmptyAndSizeOneInputsMatchEager) {
  auto compiled = compile_kiln(layout_ops);
  Tensor xt = randn({7, 5}).t();
  Tensor y = randn({5, 7});
  Tensor stepped_cols = randn({6, 20}).slice(1, 1, std::nullopt, 3);  // [6, 7], strides (20, 3)
  Tensor stepped_rows = randn({12, 7}).slice(0, 0, std::nullopt, 2);  // [6, 7], strides (14, 1)
  Tensor scalar = scalar_tensor(1.5, kFloat32);
  Tensor empty_rows = randn({0, 3}), empty_mid = randn({3, 0, 2});
  Tensor one = randn({3, 1, 4}), wide = randn({3, 5, 4});
  Tensor expanded = randn({1, 7}).expand({5, 7});
  Tensor narrowed = randn({9, 4}).narrow(0, 3, 5);
  Tensor it = randint(-50, 50, {6, 3}).t();
  ASSERT_FALSE(xt.is_contiguous());
  ASSERT_FALSE(stepped_cols.is_contiguous());
  ASSERT_FALSE(stepped_rows.is_contiguous());
  Delta d;
  std::vector<Tensor> got =
      compiled(xt, y, stepped_cols, stepped_rows, scalar, empty_rows, empty_mid, one, wide, expanded, narrowed, it);
  EXPECT_GT(d.now().kernel_runs, 0);
  std::vector<Tensor> want =
      layout_ops(xt, y, stepped_cols, stepped_rows, scalar, empty_rows, empty_mid, one, wide, expanded, narrowed, it);
  EXPECT_TRUE(all_match(got, want,
                        {"transposed", "column steps", "row steps", "steps with a view inside", "0-dim operand",
                         "0-dim result", "empty [0, 3]", "empty [3, 0, 2]", "size-1 dim", "size-1 broadcast",
                         "expanded", "narrowed", "transposed int64",
                         "view of a kernel output", "kernel over a view of a kernel output"}));
}

// ================================ fusion ================================

TEST_F(KilnBackend, SixOpChainIsOneKernel) {
  auto chain = [](const Tensor& x, const Tensor& y) { return ((x * y + 1).sin().exp() - y).relu() * 0.5; };
  auto compiled = compile_kiln(chain);
  Tensor x = randn({8, 33}), y = randn({8, 33});
  Delta d;
  Tensor got = compiled(x, y);
  EXPECT_EQ(d.now().kernel_runs, 1) << "mul, add, sin, exp, sub, relu, mul fuse into one kernel";
  EXPECT_EQ(d.now().dispatched_nodes, 0);
  EXPECT_TRUE(matches(got, chain(x, y)));
}

// A value used inside the chain and returned, another used after it, several outputs.
std::vector<Tensor> shared_values(const Tensor& x, const Tensor& y) {
  Tensor t = x * y;         // used by u, v, w and returned
  Tensor u = t.exp();       // internal only
  Tensor v = u + t;         // used by w and returned
  Tensor w = v.tanh() - t;  // returned
  Tensor s = w * v + y;     // after the chain, reads two of its outputs
  return {w, t, v, s};
}

TEST_F(KilnBackend, ChainWithReturnedIntermediatesAndSeveralOutputs) {
  auto compiled = compile_kiln(shared_values);
  Tensor x = randn({5, 6}), y = randn({5, 6});
  Delta d;
  std::vector<Tensor> got = compiled(x, y);
  EXPECT_EQ(d.now().kernel_runs, 1) << "one kernel stores all four outputs";
  EXPECT_EQ(d.now().dispatched_nodes, 0);
  EXPECT_TRUE(all_match(got, shared_values(x, y), {"w", "t (intermediate)", "v (intermediate)", "s"}));
}

// A chain broken by an extern node (matmul) in the middle: values of the first kernel are stored
// for the second.
TEST_F(KilnBackend, ChainAroundAnExternNode) {
  auto fn = [](const Tensor& x, const Tensor& w) {
    Tensor a = (x * 2).sigmoid();
    Tensor m = a.matmul(w);
    return std::make_tuple(m.relu() + a.sum({1}, true), a);
  };
  auto compiled = compile_kiln(fn);
  Tensor x = randn({4, 6}), w = randn({6, 6});
  Delta d;
  auto [got, got_a] = compiled(x, w);
  auto [want, want_a] = fn(x, w);
  EXPECT_GE(d.now().kernel_runs, 2);
  EXPECT_EQ(d.now().dispatched_nodes, 1) << "only the matmul is dispatched";
  EXPECT_TRUE(matches(got, want, reduction_tol(kFloat32)));
  EXPECT_TRUE(matches(got_a, want_a));
}

// ================================ reductions ================================

std::vector<Tensor> reductions(const Tensor& x) {
  Tensor xt = x.transpose(0, 2);  // a view node inside the graph: a non-contiguous reduction input
  Tensor e = (x * 0.5).exp();     // a pointwise prologue
  return {x.sum(),
          x.sum({-1}),
          x.sum({0}),
          x.sum({1}),
          x.sum({0, 2}),
          x.sum({1, 2}, true),
          x.sum({-1}, true),
          x.mean(),
          x.mean({0}),
          x.mean({1}, true),
          x.mean({-1}),
          x.amax(),
          x.amax({-1}),
          x.amax({0}, true),
          x.amax({1}),
          x.amin(),
          x.amin({-1}, true),
          x.amin({0, 1}),
          xt.sum({0}),
          xt.amax({-1}),
          xt.mean({1, 2}),
          e.sum({-1}),
          e.mean({0, 1}, true),
          (x - 1).abs().amax({2}),
          x.sum({1}, false, kFloat64)};
}
const std::vector<std::string> kReductionNames = {
    "sum()",         "sum(-1)",          "sum(0)",          "sum(1)",        "sum(0, 2)",  "sum(1, 2, keepdim)",
    "sum(-1, keepdim)", "mean()",        "mean(0)",         "mean(1, keepdim)", "mean(-1)", "amax()",
    "amax(-1)",      "amax(0, keepdim)", "amax(1)",         "amin()",        "amin(-1, keepdim)", "amin(0, 1)",
    "transposed sum(0)", "transposed amax(-1)", "transposed mean(1, 2)", "exp prologue sum(-1)",
    "exp prologue mean(0, 1, keepdim)", "abs prologue amax(2)", "sum(1, dtype=float64)"};

TEST_F(KilnBackend, ReductionsOverEveryDimChoiceMatchEager) {
  auto compiled = compile_kiln(reductions);
  for (DType t : {kFloat32, kFloat64}) {
    SCOPED_TRACE(dtype_name(t));
    Tensor x = randn({4, 5, 6}, t);
    Delta d;
    std::vector<Tensor> got = compiled(x);
    EXPECT_GE(d.now().kernel_runs, 24);
    EXPECT_LE(d.now().dispatched_nodes, 1) << "at most the transpose view is dispatched";
    EXPECT_TRUE(all_match(got, reductions(x), kReductionNames, reduction_tol));
  }
}

// amax/amin vectorize as OpenMP max/min reductions with a NaN flag (cpp_codegen.cpp): a NaN
// anywhere in a row (the first element, the vector body, the scalar tail, alone or beside
// infinities) must still make the row's result NaN, as eager's Maximum / Minimum do.
std::vector<Tensor> extremum_reductions(const Tensor& x) {
  return {x.amax({-1}), x.amin({-1}, true), x.amax({0}), x.amin({1}), x.amax(), x.amin(),
          x.transpose(1, 2).amax({-1}), (x * 2).amin({-1})};
}

TEST_F(KilnBackend, VectorizedMaxAndMinPropagateNaNLikeEager) {
  const double nan = std::numeric_limits<double>::quiet_NaN(), inf = std::numeric_limits<double>::infinity();
  auto compiled = compile_kiln(extremum_reductions);
  const std::vector<std::string> names = {"amax(-1)", "amin(-1, keepdim)", "amax(0)", "amin(1)", "amax()",
                                          "amin()", "transposed amax(-1)", "x*2 amin(-1)"};
  for (DType t : {kFloat32, kFloat64}) {
    SCOPED_TRACE(dtype_name(t));
    const int64_t rows = 6, cols = 5, len = 37;  // 37: two 16-wide vectors and a tail of 5
    std::vector<double> v = randn({rows * cols * len}, kFloat64).to_vector<double>();
    auto at = [&](int64_t r, int64_t c, int64_t k) -> double& { return v[static_cast<size_t>((r * cols + c) * len + k)]; };
    at(0, 0, 0) = nan;                       // first element
    at(1, 1, 20) = nan;                      // vector body
    at(2, 2, 36) = nan;                      // tail
    at(3, 3, 5) = inf;
    at(3, 3, 30) = nan;                      // beside +inf
    at(4, 4, 7) = -inf;
    at(4, 4, 8) = nan;                       // beside -inf
    at(5, 0, 3) = inf;                       // infinities without NaN
    at(5, 1, 4) = -inf;
    Tensor x = tensor<double>(v, {rows, cols, len}).to(t);
    Delta d;
    std::vector<Tensor> got = compiled(x);
    EXPECT_GE(d.now().kernel_runs, 8);
    EXPECT_TRUE(all_match(got, extremum_reductions(x), names));
  }
}

// Large enough (>= 32768 elements) for the generated loops to run in parallel.
std::vector<Tensor> large_reductions(const Tensor& x) {
  return {x.sum(), x.sum({1}), x.mean({0}), x.amax({1}), x.amin(), (x * x).sum({0}, true)};
}

TEST_F(KilnBackend, ParallelReductionsMatchEager) {
  auto compiled = compile_kiln(large_reductions);
  Tensor x = randn({96, 1024});
  Delta d;
  std::vector<Tensor> got = compiled(x);
  EXPECT_GE(d.now().kernel_runs, 6);
  EXPECT_TRUE(all_match(got, large_reductions(x), {"sum()", "sum(1)", "mean(0)", "amax(1)", "amin()", "x*x sum(0)"},
                        reduction_tol));
}

Tensor softmax_by_hand(const Tensor& x) {
  Tensor m = x.amax({-1}, true);
  Tensor e = (x - m).exp();
  return e / e.sum({-1}, true);
}

Tensor layer_norm_by_hand(const Tensor& x, const Tensor& w, const Tensor& b) {
  Tensor mu = x.mean({-1}, true);
  Tensor xc = x - mu;
  Tensor var = (xc * xc).mean({-1}, true);
  return xc * (var + 1e-5).rsqrt() * w + b;
}

TEST_F(KilnBackend, SoftmaxAndLayerNormWrittenByHandMatchEager) {
  auto fn = [](const Tensor& x, const Tensor& w, const Tensor& b) {
    return std::make_tuple(softmax_by_hand(x), layer_norm_by_hand(x, w, b));
  };
  auto compiled = compile_kiln(fn);
  for (DType t : {kFloat32, kFloat64}) {
    SCOPED_TRACE(dtype_name(t));
    Tensor x = randn({6, 40}, t) * 4, w = randn({40}, t), b = randn({40}, t);
    Delta d;
    auto [sm, ln] = compiled(x, w, b);
    EXPECT_GE(d.now().kernel_runs, 4);
    EXPECT_EQ(d.now().dispatched_nodes, 0) << "reductions with prologues, no dispatched node";
    auto [want_sm, want_ln] = fn(x, w, b);
    EXPECT_TRUE(matches(sm, want_sm, reduction_tol(t)));
    EXPECT_TRUE(matches(ln, want_ln, reduction_tol(t)));
    EXPECT_TRUE(matches(sm, softmax(x, -1), reduction_tol(t))) << "and the library's softmax";
  }
}

std::vector<Tensor> library_normalizations(const Tensor& x, const Tensor& w, const Tensor& b, const Tensor& img,
                                           const Tensor& mean, const Tensor& var) {
  return {softmax(x, -1), softmax(x, 0), log_softmax(x, 1), layer_norm(x, {40}, w, b),
          batch_norm(img, mean, var, mean.exp(), var, /*training=*/false)};
}

// The library's softmax, log_softmax, layer_norm and eval-mode batch_norm compiled (the backend
// may decompose them into reductions and pointwise kernels).
TEST_F(KilnBackend, LibrarySoftmaxLayerNormAndBatchNormMatchEager) {
  auto compiled = compile_kiln(library_normalizations);
  for (DType t : {kFloat32, kFloat64}) {
    SCOPED_TRACE(dtype_name(t));
    Tensor x = randn({6, 40}, t) * 4, w = randn({40}, t), b = randn({40}, t);
    Tensor img = randn({2, 3, 4, 5}, t), mean = randn({3}, t), var = rand({3}, t) + 0.5;
    Delta d;
    std::vector<Tensor> got = compiled(x, w, b, img, mean, var);
    EXPECT_GT(d.now().kernel_runs, 0);
    EXPECT_TRUE(all_match(got, library_normalizations(x, w, b, img, mean, var),
                          {"softmax(-1)", "softmax(0)", "log_softmax(1)", "layer_norm", "batch_norm eval"},
                          reduction_tol));
  }
}

std::vector<Tensor> int_reductions(const Tensor& i64, const Tensor& i32, const Tensor& u8) {
  return {i64.sum(), i64.sum({0}), i64.sum({1}, true), i32.sum(), i32.sum({1}), u8.sum({1}), u8.sum(),
          i64.amax({1}), i32.amin({0}), u8.amax(), u8.amin({1}, true), (i64 * 3 - 1).sum({0})};
}

TEST_F(KilnBackend, IntegerSumsAndExtremaAreExact) {
  auto compiled = compile_kiln(int_reductions);
  Tensor i64 = randint(-1000000000000LL, 1000000000000LL, {5, 7});
  Tensor i32 = randint(-100000, 100000, {5, 7}).to(kInt32);
  Tensor u8 = randint(0, 256, {5, 7}).to(kUInt8);  // sums past 255: int64 results
  Delta d;
  std::vector<Tensor> got = compiled(i64, i32, u8);
  EXPECT_GE(d.now().kernel_runs, 12);
  EXPECT_EQ(d.now().dispatched_nodes, 0);
  EXPECT_TRUE(all_match(got, int_reductions(i64, i32, u8),
                        {"i64 sum()", "i64 sum(0)", "i64 sum(1, keepdim)", "i32 sum()", "i32 sum(1)", "u8 sum(1)",
                         "u8 sum()", "i64 amax(1)", "i32 amin(0)", "u8 amax()", "u8 amin(1, keepdim)",
                         "prologue sum(0)"}));
  EXPECT_EQ(got[3].dtype(), kInt64) << "int32 sums to int64";
  EXPECT_EQ(got[5].dtype(), kInt64) << "uint8 sums to int64";
}

std::vector<Tensor> nan_reductions(const Tensor& x) {
  return {x.amax({1}), x.amin({1}), x.amax(), x.amin({0}, true), x.sum({1}), x.mean({0})};
}

TEST_F(KilnBackend, ReductionsPropagateNaN) {
  auto compiled = compile_kiln(nan_reductions);
  Tensor x = randn({3, 4});
  const double nan = std::numeric_limits<double>::quiet_NaN();
  x.index_put_({0, 1}, nan);
  x.index_put_({2, 3}, nan);
  Delta d;
  std::vector<Tensor> got = compiled(x);
  EXPECT_GE(d.now().kernel_runs, 6);
  EXPECT_TRUE(all_match(got, nan_reductions(x), {"amax(1)", "amin(1)", "amax()", "amin(0, keepdim)", "sum(1)", "mean(0)"},
                        reduction_tol));
  EXPECT_TRUE(std::isnan(got[0].to_vector<double>()[0])) << "NaN is the maximum of a row holding one";
}

std::vector<Tensor> size_one_reductions(const Tensor& x, const Tensor& ones, const Tensor& zero_dim) {
  return {x.sum({1}),  x.amax({1}, true), x.mean({1}),      x.amin({1}), (x * 2).sum({1}, true),
          ones.sum(),  ones.amax({0}),    zero_dim.sum(),   zero_dim.amax({0})};
}

TEST_F(KilnBackend, ReductionOverASizeOneDimAndOverAZeroDimTensor) {
  auto compiled = compile_kiln(size_one_reductions);
  Tensor x = randn({4, 1, 5}), ones = randn({1, 1}), zero_dim = scalar_tensor(-2.5, kFloat32);
  Delta d;
  std::vector<Tensor> got = compiled(x, ones, zero_dim);
  EXPECT_GE(d.now().kernel_runs, 8);  // amax(0) of a 0-dim tensor may go to the dispatcher
  EXPECT_TRUE(all_match(got, size_one_reductions(x, ones, zero_dim),
                        {"sum(1)", "amax(1, keepdim)", "mean(1)", "amin(1)", "prologue sum(1, keepdim)",
                         "[1, 1] sum()", "[1, 1] amax(0)", "0-dim sum()", "0-dim amax(0)"},
                        reduction_tol));
}

std::vector<Tensor> empty_reductions(const Tensor& x, const Tensor& rows, const Tensor& i) {
  return {x.sum({1}), x.mean({1}), x.sum(), rows.sum({0}), rows.sum({1}), i.sum({1}), (x + 1).sum({1}, true)};
}

// Regression (fixed): a reduction over an empty dim must give its identity (sum 0,
// mean NaN) like eager. The generated loop nest returns early when the iteration space has no
// elements (emit_nest: `if (total == 0) return;`), so nothing writes the freshly allocated
// result, and the outputs hold whatever the allocator returned.
TEST_F(KilnBackend, ReductionOverAnEmptyDimGivesTheIdentity) {
  auto compiled = compile_kiln(empty_reductions);
  Tensor x = randn({3, 0}), rows = randn({0, 4}), i = randint(0, 5, {2, 0});
  Delta d;
  std::vector<Tensor> got = compiled(x, rows, i);
  EXPECT_GT(d.now().kernel_runs, 0);
  EXPECT_TRUE(all_match(got, empty_reductions(x, rows, i),
                        {"[3, 0] sum(1)", "[3, 0] mean(1)", "[3, 0] sum()", "[0, 4] sum(0)", "[0, 4] sum(1)",
                         "int64 [2, 0] sum(1)", "prologue [3, 0] sum(1, keepdim)"},
                        reduction_tol));
}

// ================================ cat ================================

// relu(cat(...)) * 2 (DenseNet's pattern) along dims 0, 1 and the last, 2 to 5 inputs of
// different sizes along the cat dim, some non-contiguous.
std::vector<Tensor> cats(const std::vector<Tensor>& d0, const std::vector<Tensor>& d1, const std::vector<Tensor>& last,
                         const Tensor& a, const Tensor& b, const Tensor& ia, const Tensor& ib) {
  return {relu(cat(d0, 0)) * 2, relu(cat(d1, 1)) * 2, relu(cat(last, -1)) * 2, cat({a, b}, 0) + 1,
          cat({ia, ib, ia}, 1) * 3};
}

TEST_F(KilnBackend, FusedCatAlongEveryDimMatchesEager) {
  auto compiled = compile_kiln(cats);
  std::vector<Tensor> d0 = {randn({2, 4}), randn({4, 3}).t(), randn({1, 4})};  // 3 inputs, one transposed
  std::vector<Tensor> d1 = {randn({3, 1, 5}), randn({3, 2, 5}), randn({3, 8, 5}).slice(1, 0, std::nullopt, 2),
                            randn({3, 3, 5})};  // 4 inputs, one sliced with a step
  std::vector<Tensor> last;                       // 5 inputs of widths 1..5, every other transposed
  for (int64_t k = 1; k <= 5; ++k) last.push_back(k % 2 ? randn({2, 3, k}) : randn({2, k, 3}).transpose(1, 2));
  Tensor a = randn({2, 6}), b = randn({5, 6});  // 2 inputs
  Tensor ia = randint(-9, 9, {3, 2}), ib = randint(-9, 9, {3, 4});
  ASSERT_FALSE(d0[1].is_contiguous());
  ASSERT_FALSE(d1[2].is_contiguous());
  ASSERT_FALSE(last[1].is_contiguous());
  Delta d;
  std::vector<Tensor> got = compiled(d0, d1, last, a, b, ia, ib);
  EXPECT_EQ(d.now().kernel_runs, 5) << "each cat and the pointwise ops after it are one kernel";
  EXPECT_EQ(d.now().dispatched_nodes, 0) << "cat is fused, not dispatched";
  EXPECT_TRUE(all_match(got, cats(d0, d1, last, a, b, ia, ib),
                        {"relu(cat dim 0) * 2", "relu(cat dim 1) * 2", "relu(cat dim -1) * 2", "cat 2 + 1",
                         "int64 cat * 3"}));
}

// Reduction epilogues: pointwise work on a reduction's result runs in the reduction's kernel,
// once per result element after the reduced loops.
struct EpilogueCase {
  const char* what;
  std::function<std::vector<Tensor>(const Tensor&, const Tensor&)> fn;
  Tensor x, b;
  int64_t kernels;  // kernel runs per call
};

TEST_F(KilnBackend, ReductionEpiloguesFuseAndMatchEager) {
  std::vector<EpilogueCase> cases = {
      {"(sum(1) * 2 + 1).sqrt()", [](const Tensor& x, const Tensor&) { return std::vector<Tensor>{(x.sum({1}) * 2 + 1).sqrt()}; },
       rand({64, 48}), Tensor(), 1},
      {"the sum is returned too (stored) beside its epilogue",
       [](const Tensor& x, const Tensor&) {
         Tensor s = x.sum({1});
         return std::vector<Tensor>{s, s.exp() - 1};
       },
       randn({16, 33}), Tensor(), 1},
      {"mean(keepdim) + eps, rsqrt", [](const Tensor& x, const Tensor&) { return std::vector<Tensor>{(x.mean({1}, true) + 1e-5).rsqrt()}; },
       rand({8, 100}), Tensor(), 1},
      {"full sum * 3 + 1", [](const Tensor& x, const Tensor&) { return std::vector<Tensor>{x.sum() * 3 + 1}; }, randn({1000}), Tensor(), 1},
      {"amax(1) - b, b read in the epilogue", [](const Tensor& x, const Tensor& b) { return std::vector<Tensor>{x.amax({1}) - b}; },
       randn({32, 17}), randn({32}), 1},
      {"sum over dim 0 (kept dim innermost) * b", [](const Tensor& x, const Tensor& b) { return std::vector<Tensor>{x.sum({0}) * b}; },
       randn({40, 24}), randn({24}), 1},
      {"channels-last sum over H, W, then relu", [](const Tensor& x, const Tensor&) { return std::vector<Tensor>{(x.sum({2, 3}) - 1).relu()}; },
       randn({2, 8, 5, 6}).contiguous(channels_last), Tensor(), 1},
      {"int64 sum * 2", [](const Tensor& x, const Tensor&) { return std::vector<Tensor>{x.sum({1}) * 2}; },
       randint(-50, 50, {6, 7}), Tensor(), 1},
      {"a reduced dim of size 1 (no reduced loop)", [](const Tensor& x, const Tensor&) { return std::vector<Tensor>{x.sum({1}) * 2 - 1}; },
       randn({5, 1}), Tensor(), 1},
      {"float64 mean, then tanh", [](const Tensor& x, const Tensor&) { return std::vector<Tensor>{x.mean({1}).tanh()}; },
       randn({12, 20}).to(kFloat64), Tensor(), 1},
      {"two reductions, then their ratio (not an epilogue of either)",
       [](const Tensor& x, const Tensor&) { return std::vector<Tensor>{x.sum({1}) / x.abs().amax({1})}; }, randn({9, 13}), Tensor(),
       3},
      {"an empty reduced dim keeps the unfused path", [](const Tensor& x, const Tensor&) { return std::vector<Tensor>{x.sum({1}) * 2 + 1}; },
       randn({4, 0}), Tensor(), 2},
      {"x - mean(keepdim) is not an epilogue (the input's shape)",
       [](const Tensor& x, const Tensor&) { return std::vector<Tensor>{x - x.mean({1}, true)}; }, randn({8, 9}), Tensor(), 2},
  };
  for (EpilogueCase& c : cases) {
    SCOPED_TRACE(c.what);
    auto compiled = compile_kiln(c.fn);
    compiled(c.x, c.b);
    Delta d;
    std::vector<Tensor> got = compiled(c.x, c.b);
    EXPECT_EQ(d.now().kernel_runs, c.kernels);
    EXPECT_EQ(d.now().dispatched_nodes, 0);
    std::vector<Tensor> want = c.fn(c.x, c.b);
    ASSERT_EQ(got.size(), want.size());
    for (size_t k = 0; k < got.size(); ++k) EXPECT_TRUE(matches(got[k], want[k], reduction_tol(c.x.dtype()))) << k;
  }
}

// A run-time scalar read in an epilogue changes between calls without a recompile.
TEST_F(KilnBackend, ReductionEpilogueReadsRunTimeScalars) {
  auto fn = [](const Tensor& x, double scale) { return (x.sum({1}) * scale).exp(); };
  auto compiled = compile_kiln(fn);
  Tensor x = rand({8, 16}) * 0.1;
  EXPECT_TRUE(matches(compiled(x, 0.5), fn(x, 0.5), reduction_tol(kFloat32)));
  Delta d;
  Tensor got = compiled(x, -2.0);
  EXPECT_EQ(d.now().graph_compiles, 0);
  EXPECT_EQ(d.now().kernel_runs, 1);
  EXPECT_TRUE(matches(got, fn(x, -2.0), reduction_tol(kFloat32)));
}

// Cat sharing a kernel with pointwise work before it, an operand broadcast along the cat dim,
// and a reduction after it.
std::vector<Tensor> cat_neighbours(const std::vector<Tensor>& d0, const Tensor& big, const std::vector<Tensor>& d1,
                                   const Tensor& w1) {
  Tensor u = big.exp();       // [6, 4], opens the kernel the cat joins
  Tensor r = cat(d0, 0) - u;  // [6, 4]
  return {r, u, cat(d1, 1) * w1, r.sum({1})};
}

TEST_F(KilnBackend, CatNextToPointwiseAndReductionMatchesEager) {
  auto compiled = compile_kiln(cat_neighbours);
  std::vector<Tensor> d0 = {randn({2, 4}), randn({4, 3}).t(), randn({1, 4})};
  std::vector<Tensor> d1 = {randn({3, 1, 5}), randn({3, 6, 5}), randn({3, 3, 5})};
  Tensor big = randn({6, 4}), w1 = randn({10, 1});  // w1 broadcasts along the cat dim
  Delta d;
  std::vector<Tensor> got = compiled(d0, big, d1, w1);
  EXPECT_EQ(d.now().kernel_runs, 3) << "exp, cat and sub; cat and mul; the sum";
  EXPECT_EQ(d.now().dispatched_nodes, 0);
  EXPECT_TRUE(all_match(got, cat_neighbours(d0, big, d1, w1),
                        {"cat - exp(big)", "exp(big)", "cat * w1 (broadcast along the cat dim)", "sum(1) after cat"},
                        reduction_tol));
}

// The DenseNet block: every layer reads the concatenation of all earlier feature maps.
TEST_F(KilnBackend, DenseNetStyleGrowingCatMatchesEager) {
  auto block = [](const Tensor& x, const Tensor& w) {
    std::vector<Tensor> features = {x};
    for (int layer = 0; layer < 3; ++layer) {
      Tensor input = relu(cat(features, 1)) * 2;
      features.push_back((input.sum({1}, true) * w).tanh());
    }
    return cat(features, 1);
  };
  auto compiled = compile_kiln(block);
  Tensor x = randn({2, 3, 4, 4}), w = randn({1, 1, 4, 4});
  Delta d;
  Tensor got = compiled(x, w);
  EXPECT_GT(d.now().kernel_runs, 0);
  EXPECT_EQ(d.now().dispatched_nodes, 0);
  EXPECT_TRUE(matches(got, block(x, w), reduction_tol(kFloat32)));
}

// When convolutions read the concatenations (they must be in memory), the chain shares one buffer
// (passes::cat_into_slices): no cat kernel runs, each feature is copied into the buffer once, and
// the forward and the gradients match eager.
TEST_F(KilnBackend, GrowingCatReadByConvolutionsSharesOneBufferAndMatchesEager) {
  std::vector<Tensor> w;
  for (int layer = 0; layer < 3; ++layer) w.push_back((randn({4, 4 + 4 * layer, 3, 3}) * 0.2).requires_grad_());
  auto block = [&](const Tensor& x) {
    std::vector<Tensor> features = {x};
    for (int layer = 0; layer < 3; ++layer) features.push_back(relu(conv2d(cat(features, 1), w[layer], {}, {1, 1}, {1, 1})));
    Tensor loss = (cat(features, 1) * cat(features, 1)).mean();
    loss.backward();
    return loss;
  };
  auto compiled = compile_kiln(block);
  Tensor x = randn({2, 4, 6, 6}).contiguous(channels_last);
  Tensor want = block(x);
  std::vector<Tensor> want_grads;
  for (Tensor& t : w) {
    want_grads.push_back(t.grad().clone());
    t.grad().zero_();  // the compiled backward accumulates into it
  }
  Delta d;
  reset_op_profile();
  set_op_profiling(true);
  Tensor got = compiled(x);
  set_op_profiling(false);
  const std::string profile = op_profile_report();
  EXPECT_GT(d.now().kernel_runs, 0);
  EXPECT_EQ(profile.find("cat"), std::string::npos) << "no cat kernel and no dispatched cat\n" << profile;
  EXPECT_NE(profile.find("copy_"), std::string::npos) << "features copied into the shared buffer\n" << profile;
  EXPECT_TRUE(matches(got, want, reduction_tol(kFloat32)));
  for (size_t k = 0; k < w.size(); ++k) EXPECT_TRUE(matches(w[k].grad(), want_grads[k], Tol{1e-4, 1e-5})) << "w" << k;
}

std::vector<Tensor> cat_of_fused_inputs(const Tensor& x, const Tensor& none) {
  return {cat({relu(x)}, 0) * 2, cat({relu(x), none}, 1) + 1};
}

// Regression (fixed): a cat whose input is computed in the same kernel. When a cat's
// output has the shape of one of its inputs (a single input, or the others empty along the cat
// dim), the scheduler puts the cat into the kernel that computes that input, and the cat reads
// the input's buffer instead of its value. If nothing outside the kernel reads the input, the
// buffer is never allocated and the run throws "the tensor is undefined"; if something does (as
// here: both cats read relu(x)), the cat loads the buffer before the kernel stores it and returns
// uninitialized memory.
TEST_F(KilnBackend, CatOfAValueComputedInTheSameKernelMatchesEager) {
  auto compiled = compile_kiln(cat_of_fused_inputs);
  Tensor x = randn({3, 4}), none = randn({3, 0});
  Delta d;
  std::vector<Tensor> got;
  ASSERT_NO_THROW(got = compiled(x, none));
  EXPECT_GT(d.now().kernel_runs, 0);
  EXPECT_TRUE(all_match(got, cat_of_fused_inputs(x, none), {"cat({relu(x)}) * 2", "cat({relu(x), empty}) + 1"}));
}

// ================================ run-time scalars ================================

std::vector<Tensor> scaled(const Tensor& x, const Tensor& y, double lr, double alpha, double alpha2) {
  return {x * lr, add(x, y, alpha), sub(x, y, alpha), add(x, y, alpha2), addcmul(x, x, y, lr), lerp(x, y, lr),
          x.clamp(-lr, lr)};
}

TEST_F(KilnBackend, RunTimeScalarsCompileOnceAndStayRight) {
  auto compiled = compile_kiln(scaled);
  Tensor x = randn({4, 9}), y = randn({4, 9});
  // alpha == alpha2 in the first call: their nodes must stay two (run-time values may differ).
  const std::vector<std::tuple<double, double, double>> calls = {
      {0.1, 1.5, 1.5}, {0.5, -1.0, 3.0}, {-2.0, 0.25, 1.5}, {1e-3, 2.0, -7.0}};
  Delta d;
  for (auto [lr, alpha, alpha2] : calls) {
    SCOPED_TRACE("lr " + std::to_string(lr) + ", alpha " + std::to_string(alpha) + ", alpha2 " + std::to_string(alpha2));
    Delta call;
    std::vector<Tensor> got = compiled(x, y, lr, alpha, alpha2);
    EXPECT_GT(call.now().kernel_runs, 0);
    EXPECT_EQ(call.now().dispatched_nodes, 0);
    EXPECT_TRUE(all_match(got, scaled(x, y, lr, alpha, alpha2),
                          {"x * lr", "add alpha", "sub alpha", "add alpha2", "addcmul value lr", "lerp lr",
                           "clamp(-lr, lr)"}));
  }
  EXPECT_EQ(d.now().graph_compiles, 1) << "new scalar values reuse the compiled graph";
  EXPECT_EQ(d.now().frame_compiles, 1);
}

TEST_F(KilnBackend, IntegerRunTimeScalarsStayRight) {
  auto fn = [](const Tensor& x, int64_t k) { return std::make_tuple(x * k, add(x, x, k), x + k); };
  auto compiled = compile_kiln(fn);
  Tensor x = randint(-50, 50, {3, 5});
  Delta total;
  for (int64_t k : {2, -3, 7}) {
    SCOPED_TRACE("k " + std::to_string(k));
    Delta d;
    auto [a, b, c] = compiled(x, k);
    auto [ea, eb, ec] = fn(x, k);
    EXPECT_GT(d.now().kernel_runs, 0);
    EXPECT_TRUE(matches(a, ea));
    EXPECT_TRUE(matches(b, eb));
    EXPECT_TRUE(matches(c, ec));
  }
  EXPECT_EQ(total.now().graph_compiles, 1) << "a changing integer (a step count) does not recompile";
}

// int64 run-time scalars beyond 2^53 (alpha, addcmul's value) must keep all their bits.
// Regression (fixed): kernels receive run-time scalars as `const double* scalars`
// (kiln_backend.cpp converts every slot with to_double), so an int64 alpha of 2^53 + 1 reaches
// the kernel as 2^53 and the result is silently off by one; eager uses the exact integer.
TEST_F(KilnBackend, Int64RunTimeScalarsKeepAllTheirBits) {
  auto fn = [](const Tensor& x, int64_t k) { return std::make_tuple(add(x, x, k), addcmul(x, x, x, k)); };
  auto compiled = compile_kiln(fn);
  Tensor x = tensor<int64_t>({1, 3, -1});
  const int64_t k = (int64_t{1} << 53) + 1;  // not a double
  Delta d;
  auto [a, b] = compiled(x, k);
  auto [ea, eb] = fn(x, k);
  EXPECT_GT(d.now().kernel_runs, 0);
  EXPECT_TRUE(matches(a, ea)) << "add(x, x, alpha=2^53 + 1)";
  EXPECT_TRUE(matches(b, eb)) << "addcmul(x, x, x, value=2^53 + 1)";
}

// ================================ nodes left to the dispatcher ================================

std::vector<Tensor> extern_ops(const Tensor& x, const Tensor& w, const Tensor& img, const Tensor& k,
                               const Tensor& idx, const Tensor& half) {
  return {matmul(x, w).relu() + 1,
          conv2d(img, k, Tensor(), {1, 1}, {1, 1}).sigmoid(),
          max_pool2d(img, {2, 2}) * 2,
          index_select(x, 0, idx) - 1,
          x + randn({5, 4}),
          (x * 2).matmul(w).sum({1}),
          half.sin() * 2};  // float16: no code generation for it, the dispatcher computes it
}

TEST_F(KilnBackend, OpsWithoutLoweringsRunThroughTheDispatcher) {
  auto compiled = compile_kiln(extern_ops);
  Tensor x = randn({5, 4}), w = randn({4, 3}), img = randn({2, 3, 6, 6}), k = randn({4, 3, 3, 3});
  Tensor idx = tensor<int64_t>({4, 0, 2, 2});
  Tensor half = randn({6}).to(kFloat16);
  manual_seed(11);
  std::vector<Tensor> want = extern_ops(x, w, img, k, idx, half);
  manual_seed(11);  // randn inside the compiled function draws the same numbers
  Delta d;
  std::vector<Tensor> got = compiled(x, w, img, k, idx, half);
  EXPECT_GT(d.now().kernel_runs, 0);
  EXPECT_GE(d.now().dispatched_nodes, 6) << "matmul x2, conv2d, max_pool2d, index_select, randn";
  EXPECT_TRUE(all_match(got, want, {"relu(matmul) + 1", "sigmoid(conv2d)", "max_pool2d * 2", "index_select - 1",
                                    "x + randn", "sum(matmul(x * 2))", "float16 sin * 2"},
                        reduction_tol));
}

// ================================ in-place ops on inputs ================================

TEST_F(KilnBackend, InPlaceOpsMutateTheCallersTensorsLikeEager) {
  auto fn = [](Tensor x, const Tensor& y, Tensor z) {
    Tensor before = x * 2;  // reads x before the writes: must not be merged with `after`
    x.add_(1);
    x.mul_(y);
    Tensor after = x * 2;
    Tensor t = (x - 3).exp();
    t.relu_();
    t.add_(y);
    z.mul_(2);  // a transposed view of the caller's tensor
    z.add_(y.unsqueeze(1));
    return std::make_tuple(before, after, t, x, z + 1);
  };
  auto compiled = compile_kiln(fn);
  Tensor y = randn({5});  // broadcast over x's rows
  Tensor xc = randn({4, 5}), zc = randn({6, 5});
  Tensor xe = xc.clone(), ze = zc.clone();
  for (int call = 0; call < 2; ++call) {
    SCOPED_TRACE("call " + std::to_string(call));
    Delta d;
    auto [before, after, t, x, z1] = compiled(xc, y, zc.t());
    auto [want_before, want_after, want_t, want_x, want_z1] = fn(xe, y, ze.t());
    EXPECT_GT(d.now().kernel_runs, 0);
    EXPECT_TRUE(matches(xc, xe)) << "the caller's x after add_ and mul_";
    EXPECT_TRUE(matches(zc, ze)) << "the caller's z, written through a transposed view";
    EXPECT_TRUE(matches(before, want_before));
    EXPECT_TRUE(matches(after, want_after));
    EXPECT_TRUE(matches(t, want_t));
    EXPECT_TRUE(matches(x, want_x)) << "the mutated input, returned";
    EXPECT_TRUE(matches(z1, want_z1));
  }
}

// An optimizer-style update of graph inputs: the kernel stores the new values straight into the
// caller's tensors (no copy-back nodes run), and the results are eager's.
TEST_F(KilnBackend, UpdatesOfInputsAreStoredInPlaceWithoutCopyBacks) {
  auto fn = [](Tensor p, Tensor m, const Tensor& g) {
    m.mul_(0.9).add_(g);
    p.sub_(m * 0.1);
  };
  auto compiled = compile_kiln(fn);
  Tensor g = randn({64, 32});
  Tensor pc = randn({64, 32}), mc = randn({64, 32});
  Tensor pe = pc.clone(), me = mc.clone();
  const void* p_data = pc.raw_data_ptr();
  for (int call = 0; call < 2; ++call) {
    SCOPED_TRACE("call " + std::to_string(call));
    Delta d;
    compiled(pc, mc, g);
    fn(pe, me, g);
    EXPECT_GT(d.now().kernel_runs, 0);
    EXPECT_EQ(d.now().dispatched_nodes, 0) << "the copy-backs into p and m are elided";
    EXPECT_TRUE(matches(pc, pe));
    EXPECT_TRUE(matches(mc, me));
  }
  EXPECT_EQ(pc.raw_data_ptr(), p_data) << "the caller's tensor is updated, not replaced";
}

// Inputs over one memory: the update of one is visible through the other, as in eager.
TEST_F(KilnBackend, UpdatesOfAnInputSeenThroughAnAliasedInput) {
  auto fn = [](Tensor p, const Tensor& q) {
    Tensor before = q * 3;
    p.mul_(0.5).add_(1);
    return std::make_tuple(before, q + 1);
  };
  auto compiled = compile_kiln(fn);
  Tensor pc = randn({16, 8});
  Tensor pe = pc.clone();
  for (int call = 0; call < 2; ++call) {
    SCOPED_TRACE("call " + std::to_string(call));
    auto [before_c, after_c] = compiled(pc, pc.t());
    auto [before_e, after_e] = fn(pe, pe.t());
    EXPECT_TRUE(matches(before_c, before_e));
    EXPECT_TRUE(matches(after_c, after_e)) << "q reads p's new values";
    EXPECT_TRUE(matches(pc, pe));
  }
}

// ================================ models ================================

// Deep models compare at rtol 1e-4: the backend folds each eval-mode batch norm into the
// convolution before it and decomposes normalizations, so float32 results differ from eager by
// a few ulp per layer (other rounding of the folded weights, FMA contraction in the generated
// kernels), and dozens of convolutions and normalizations in a row amplify that; ResNet-18's
// logits differ by about 1e-5 relative.
constexpr Tol kDeepModelTol{1e-4, 1e-5};

// A model's forward compiled with the kiln backend runs generated kernels and equals its eager
// forward within `tol`.
template <class M>
void expect_compiled_forward(const std::shared_ptr<M>& net, const Tensor& x, Tol tol) {
  Tensor want = net->forward(x);
  auto compiled = kiln::compile(net, kiln_backend());
  Delta d;
  Tensor got = compiled(x);
  EXPECT_GT(d.now().kernel_runs, 0);
  EXPECT_TRUE(matches(got, want, tol));
}

// An eval-mode convolution + batch norm compiles to conv2d_bn, whose folded weights are cached by
// the parameters' versions: calls leave the running statistics' versions alone, so later calls
// reuse the folded weights.
TEST_F(KilnBackend, EvalBatchNormLeavesRunningStatisticsVersionsAlone) {
  manual_seed(4);
  auto bn = std::make_shared<nn::BatchNorm2d>(8);
  auto net = std::make_shared<nn::Sequential>(std::make_shared<nn::Conv2d>(3, 8, 3), bn, std::make_shared<nn::ReLU>());
  net->eval();
  Tensor x = randn({2, 3, 8, 8});
  Tensor want = net->forward(x);
  auto compiled = kiln::compile(net, kiln_backend());
  NoGradGuard no_grad;
  compiled(x);
  const uint64_t version = bn->running_mean.version();
  for (int call = 0; call < 3; ++call) EXPECT_TRUE(matches(compiled(x), want, kDeepModelTol));
  EXPECT_EQ(bn->running_mean.version(), version);
}

TEST_F(KilnBackend, DenseNet121EvalForwardMatchesEager) {
  auto net = models::densenet121({.num_classes = 10});
  net->eval();
  NoGradGuard no_grad;
  Tensor x = randn({2, 3, 32, 32});
  expect_compiled_forward(net, x, kDeepModelTol);
}

TEST_F(KilnBackend, ResNet18EvalForwardMatchesEager) {
  auto net = models::resnet18({.num_classes = 10});
  net->eval();
  NoGradGuard no_grad;
  Tensor x = randn({2, 3, 32, 32});
  expect_compiled_forward(net, x, kDeepModelTol);
}

TEST_F(KilnBackend, MlpForwardMatchesEager) {
  auto net = models::mlp({16, 32, 32, 4}, "gelu");
  Tensor x = randn({8, 16});
  expect_compiled_forward(net, x, reduction_tol(kFloat32));
}

TEST_F(KilnBackend, GptForwardMatchesEager) {
  auto net = models::gpt(models::GPTConfig::tiny());
  net->eval();
  NoGradGuard no_grad;
  Tensor idx = randint(0, 64, {2, 8});
  expect_compiled_forward(net, idx, kDeepModelTol);
}

TEST_F(KilnBackend, MlpTrainingStepMatchesEager) {
  manual_seed(3);
  auto model_c = models::mlp({4, 16, 3});
  auto model_e = models::mlp({4, 16, 3});
  model_e->load_state_dict(model_c->state_dict());
  const optim::SGDOptions options{.lr = 0.1, .momentum = 0.9};
  auto opt_c = std::make_shared<optim::SGD>(model_c->parameters(), options);
  auto opt_e = std::make_shared<optim::SGD>(model_e->parameters(), options);
  auto step_c = compile_kiln(training_step(model_c, opt_c));
  auto step_e = training_step(model_e, opt_e);
  Tensor x = randn({8, 4});
  Tensor y = tensor<int64_t>({0, 1, 2, 1, 0, 2, 2, 1});
  Delta d;
  for (int i = 0; i < 2; ++i) {
    SCOPED_TRACE("step " + std::to_string(i));
    Tensor lc = step_c(x, y);
    Tensor le = step_e(x, y);
    EXPECT_TRUE(matches(lc, le, reduction_tol(kFloat32)));
  }
  EXPECT_GT(d.now().kernel_runs, 0);
  auto pc = model_c->named_parameters();
  auto pe = model_e->named_parameters();
  ASSERT_EQ(pc.size(), pe.size());
  for (size_t i = 0; i < pc.size(); ++i)
    EXPECT_TRUE(matches(pc[i].second, pe[i].second, reduction_tol(kFloat32))) << pc[i].first << " after 2 steps";
}

// ================================ KILN_COMPILE_DEBUG ================================


TEST_F(KilnBackend, CompileDebugWritesGraphLoopIrAndSources) {
  std::string pattern = (fs::temp_directory_path() / "kiln_compile_debug_XXXXXX").string();
  ASSERT_NE(::mkdtemp(pattern.data()), nullptr);
  const fs::path root = pattern;
  {
    ScopedEnv debug("KILN_COMPILE_DEBUG", "1");
    ScopedEnv dir("KILN_COMPILE_DEBUG_DIR", root.string());
    LogCapture logs;  // the dump's path is logged; keep it out of the test output
    auto compiled = compile_kiln([](const Tensor& x) { return (x.cos() + 1).sum({1}); });
    Tensor x = randn({3, 4});
    Delta d;
    Tensor got = compiled(x);
    EXPECT_GT(d.now().kernel_runs, 0);
    EXPECT_TRUE(matches(got, (x.cos() + 1).sum({1}), reduction_tol(kFloat32)));
  }
  std::vector<fs::path> dumps;
  for (const auto& entry : fs::directory_iterator(root))
    if (entry.is_directory()) dumps.push_back(entry.path());
  ASSERT_EQ(dumps.size(), 1u) << "one folder per compiled graph in " << root;
  for (const char* file : {"graph.txt", "loop_ir.txt", "kernels_0.cpp"}) {
    const fs::path path = dumps[0] / file;
    EXPECT_TRUE(fs::exists(path)) << path;
    EXPECT_GT(fs::exists(path) ? fs::file_size(path) : 0, 0u) << path << " is empty";
  }
  std::error_code ec;
  fs::remove_all(root, ec);
}

}  // namespace

namespace {

// The passes logged in `log`, in order: "name" for a run, "name skipped" for a skip. Every
// [kiln:passes] line must have the documented form.
std::vector<std::string> logged_passes(const std::string& log, bool* validated = nullptr) {
  static const std::regex run(R"(^\[kiln:passes\] (\w+) [0-9]+\.[0-9]{3} ms, [0-9]+ -> [0-9]+ nodes( \(validated\))?$)");
  static const std::regex skip(R"(^\[kiln:passes\] (\w+) skipped \(KILN_DISABLE_PASSES\)$)");
  std::vector<std::string> out;
  std::istringstream lines(log);
  bool all_validated = true;
  for (std::string line; std::getline(lines, line);) {
    if (line.rfind("[kiln:passes]", 0) != 0) continue;
    std::smatch m;
    if (std::regex_match(line, m, run)) {
      out.push_back(m[1]);
      all_validated = all_validated && m[2].matched;
    } else if (std::regex_match(line, m, skip)) {
      out.push_back(std::string(m[1]) + " skipped");
    } else {
      ADD_FAILURE() << "malformed pass log line: " << line;
    }
  }
  if (validated) *validated = all_validated;
  return out;
}

}  // namespace

// Issue 19: the kiln backend's passes run from one pipeline (compiler/graph/pipeline.cpp):
// KILN_LOGS=passes prints one line per pass in pipeline order, KILN_DISABLE_PASSES skips passes by
// name (and rejects unknown names with the valid ones), KILN_VALIDATE_PASSES=1 validates the graph
// after each; aot_eager's passes go through the same runner.
TEST_F(KilnBackend, PassesRunFromOnePipelineThatLogsSkipsAndValidatesThem) {
  auto fn = [](const Tensor& x, const Tensor& w) {
    return cat({relu(conv2d(x, w, Tensor(), {1, 1}, {1, 1})), x.narrow(1, 0, 2)}, 1).sum();
  };
  Tensor x = randn({1, 3, 6, 6}), w = randn({2, 3, 3, 3});
  const Tensor want = fn(x, w);
  const std::vector<std::string> kiln_order = {
      "functionalize",    "pool_before_pointwise_conv",   "fuse_conv_bn",   "fuse_batch_norm_relu",
      "fuse_gemm_epilogue", "channels_last_convolutions", "decompose",      "functionalize_decompositions",
      "fold_constants",   "eliminate_dead_code",          "eliminate_common_subexpressions", "cat_into_slices"};
  {
    LogCapture log({.passes = true});
    auto f = kiln::compile(fn, {.backend = std::string("kiln")});
    Delta d;
    EXPECT_TRUE(close(f(x, w), want));
    EXPECT_EQ(d.now().graph_runs, 1);
    EXPECT_EQ(logged_passes(log.str()), kiln_order) << log.str();
  }
  {
    ScopedEnv disable("KILN_DISABLE_PASSES", "fuse_conv_bn, cat_into_slices");
    ScopedEnv validate("KILN_VALIDATE_PASSES", "1");
    LogCapture log({.passes = true});
    auto f = kiln::compile(fn, {.backend = std::string("kiln")});
    EXPECT_TRUE(close(f(x, w), want));
    std::vector<std::string> expected = kiln_order;
    expected[2] = "fuse_conv_bn skipped";
    expected.back() = "cat_into_slices skipped";
    bool validated = false;
    EXPECT_EQ(logged_passes(log.str(), &validated), expected) << log.str();
    EXPECT_TRUE(validated) << "every pass line ends with (validated)";
  }
  {
    LogCapture log({.passes = true});
    auto f = kiln::compile(fn, {.backend = std::string("aot_eager")});
    EXPECT_TRUE(close(f(x, w), want));
    EXPECT_EQ(logged_passes(log.str()),
              (std::vector<std::string>{"validate", "eliminate_dead_code", "eliminate_common_subexpressions"}));
  }
  ScopedEnv bogus("KILN_DISABLE_PASSES", "fuse_conv_bn,bogus");
  auto f = kiln::compile(fn, {.backend = std::string("kiln")});
  try {
    f(x, w);
    ADD_FAILURE() << "an unknown pass name was accepted";
  } catch (const CompileError& e) {
    EXPECT_NE(std::string(e.what()).find("KILN_DISABLE_PASSES names an unknown pass 'bogus'. Valid names: validate, "
                                         "functionalize, "),
              std::string::npos)
        << e.what();
  }
}

// ============================ module-style training ============================

namespace {

// A small convolution network with batch norms and relus (the layers DenseNet and ResNet repeat).
struct ConvBlockNet : nn::Module {
  ConvBlockNet() {
    conv1 = register_module("conv1", std::make_shared<nn::Conv2d>(nn::Conv2dOptions{.in_channels = 3, .out_channels = 8, .kernel_size = 3, .padding = 1}));
    bn1 = register_module("bn1", std::make_shared<nn::BatchNorm2d>(8));
    conv2 = register_module("conv2", std::make_shared<nn::Conv2d>(nn::Conv2dOptions{.in_channels = 8, .out_channels = 8, .kernel_size = 3, .padding = 1}));
    bn2 = register_module("bn2", std::make_shared<nn::BatchNorm2d>(8));
    fc = register_module("fc", std::make_shared<nn::Linear>(8, 5));
  }
  Tensor features(const Tensor& x) {
    Tensor h = nn::functional::relu(bn1->forward(conv1->forward(x)));
    return nn::functional::relu(bn2->forward(conv2->forward(h)));
  }
  Tensor forward(const Tensor& x) override { return fc->forward(features(x).mean({2, 3})); }
  std::shared_ptr<nn::Conv2d> conv1, conv2;
  std::shared_ptr<nn::BatchNorm2d> bn1, bn2;
  std::shared_ptr<nn::Linear> fc;
};

// The "pass" events of a compile trace, per graph id: name -> (nodes before, nodes after).
std::map<std::string, std::map<std::string, std::pair<int, int>>> passes_in(const std::string& trace) {
  std::map<std::string, std::map<std::string, std::pair<int, int>>> out;
  std::ifstream in(trace);
  for (std::string line; std::getline(in, line);) {
    const auto e = nlohmann::json::parse(line);
    if (e.value("event", "") == "pass" && !e.value("skipped", false))
      out[e.value("graph", "")][e.value("name", "")] = {e.value("nodes_before", 0), e.value("nodes_after", 0)};
  }
  return out;
}

}  // namespace

// The common pattern `loss(m(x), y).backward()` with only the module compiled: the activations the
// compiled forward saves for the backward stay channels-last (only autograd holds them, so no
// copy back to row-major), the backward that runs after the call is captured and compiled with
// the same passes (its batch norm + relu backward fused), and every gradient matches eager.
TEST_F(KilnBackend, ModuleStyleTrainingKeepsSavedActivationsChannelsLastAndMatchesEager) {
  auto net = std::make_shared<ConvBlockNet>();
  auto twin = std::make_shared<ConvBlockNet>();
  twin->load_state_dict(net->state_dict());
  Tensor x = randn({4, 3, 12, 12});
  Tensor y = tensor({0, 3, 1, 4}, kInt64);
  std::string dir = (std::filesystem::temp_directory_path() / "kiln_module_style_XXXXXX").string();
  ASSERT_NE(::mkdtemp(dir.data()), nullptr);
  const std::string trace = compiler::set_trace_dir(dir);
  auto compiled = compile(net, kiln_backend());
  for (int step = 0; step < 2; ++step) {
    net->zero_grad();
    twin->zero_grad();
    const int64_t runs = compiler::counters().graph_runs;
    nn::functional::cross_entropy(compiled(x), y).backward();
    EXPECT_GE(compiler::counters().graph_runs - runs, 2) << "forward and backward ran compiled";
    nn::functional::cross_entropy(twin->forward(x), y).backward();
    const auto params = net->named_parameters(), twin_params = twin->named_parameters();
    for (size_t i = 0; i < params.size(); ++i)
      EXPECT_TRUE(matches(params[i].second.grad(), twin_params[i].second.grad(), Tol{1e-4, 1e-5}))
          << params[i].first << ", step " << step;
  }
  compiler::set_trace_dir("");
  const auto passes = passes_in(trace);
  const auto forward = passes.find("0/0"), backward = passes.find("0/1");
  ASSERT_NE(forward, passes.end());
  ASSERT_NE(backward, passes.end());
  // One conversion of the input to channels-last, and no copies of saved activations back.
  const auto [before, after] = forward->second.at("channels_last_convolutions");
  EXPECT_EQ(after - before, 1);
  // The backward's two batch norm + relu backwards: where and le fold into each (4 nodes fewer).
  const auto [bn_before, bn_after] = backward->second.at("fuse_batch_norm_relu");
  EXPECT_EQ(bn_before - bn_after, 4);
  std::filesystem::remove_all(dir);
}

// A 4-D activation the caller holds keeps eager's layout even when the network runs channels-last.
TEST_F(KilnBackend, ModuleStyleActivationsTheCallerHoldsKeepEagersLayout) {
  auto net = std::make_shared<ConvBlockNet>();
  Tensor x = randn({2, 3, 8, 8});
  auto compiled = compile([&](const Tensor& input) { return net->features(input); }, kiln_backend());
  Tensor h = compiled(x);
  Tensor want = net->features(x);
  EXPECT_EQ(h.strides().vec(), want.strides().vec());
  EXPECT_TRUE(matches(h, want, Tol{1e-4, 1e-5}));
  h.sum().backward();
}
