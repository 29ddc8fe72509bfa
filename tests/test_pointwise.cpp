// Pointwise ops (unary, binary, ternary): values against float64 references computed here with
// std:: functions, dtype rules and type promotion, broadcasting, non-contiguous inputs, in-place
// forms with aliasing, and bad inputs.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "ops/pointwise_list.h"
#include "reference.h"

using namespace kiln;
using kiln::testing::map_ref;
using kiln::testing::matches;
using kiln::testing::Tolerance;
using kiln::testing::values;

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// n values covering [lo, hi] in a scrambled order (so neighbours differ), as dtype.
Tensor spread(int64_t n, double lo, double hi, DType dtype, std::vector<int64_t> sizes = {}) {
  std::vector<double> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    int64_t k = (i * 7919) % n;
    v[i] = lo + (hi - lo) * static_cast<double>(k) / static_cast<double>(std::max<int64_t>(n - 1, 1));
  }
  if (sizes.empty()) sizes = {n};
  return tensor<double>(v, sizes).to(dtype);
}

// Elementwise float64 reference of f over a and b broadcast to `sizes`.
std::vector<double> zip_ref(const Tensor& a, const Tensor& b, const std::vector<int64_t>& sizes,
                            const std::function<double(double, double)>& f) {
  auto va = values(a.expand(sizes)), vb = values(b.expand(sizes));
  std::vector<double> out(va.size());
  for (size_t i = 0; i < va.size(); ++i) out[i] = f(va[i], vb[i]);
  return out;
}

std::vector<double> zip3_ref(const Tensor& a, const Tensor& b, const Tensor& c, const std::vector<int64_t>& sizes,
                             const std::function<double(double, double, double)>& f) {
  auto va = values(a.expand(sizes)), vb = values(b.expand(sizes)), vc = values(c.expand(sizes));
  std::vector<double> out(va.size());
  for (size_t i = 0; i < va.size(); ++i) out[i] = f(va[i], vb[i], vc[i]);
  return out;
}

// Same shape, dtype and bit-identical values.
::testing::AssertionResult same_values(const Tensor& a, const Tensor& b) {
  if (a.sizes().vec() != b.sizes().vec() || a.dtype() != b.dtype()) return ::testing::AssertionFailure() << "meta differs";
  auto va = values(a), vb = values(b);
  for (size_t i = 0; i < va.size(); ++i)
    if (!(va[i] == vb[i] || (std::isnan(va[i]) && std::isnan(vb[i]))))
      return ::testing::AssertionFailure() << "element " << i << ": " << va[i] << " vs " << vb[i];
  return ::testing::AssertionSuccess();
}

double sigmoid_ref(double x) { return 1.0 / (1.0 + std::exp(-x)); }
double gelu_ref(double x) { return x == -kInf ? 0.0 : 0.5 * x * std::erfc(-x / std::sqrt(2.0)); }
double gelu_tanh_ref(double x) {
  if (x == -kInf) return 0.0;
  double u = std::sqrt(2.0 / M_PI) * (x + 0.044715 * x * x * x);
  return x / (1.0 + std::exp(-2.0 * u));  // = x/2 (1 + tanh(u)), without cancellation
}
double silu_ref(double x) { return x == -kInf ? 0.0 : x / (1.0 + std::exp(-x)); }
double py_floor_div(double a, double b) { return std::floor(a / b); }
double py_mod(double a, double b) {
  double m = std::fmod(a, b);
  if (m != 0 && ((b < 0) != (m < 0))) m += b;
  return m;
}

struct UnaryCase {
  const char* name;
  std::function<Tensor(const Tensor&)> op;
  std::function<double(double)> ref;
  double lo, hi;
};

std::vector<UnaryCase> floating_unary_cases() {
  return {
      {"exp", [](const Tensor& x) { return exp(x); }, [](double x) { return std::exp(x); }, -10, 10},
      {"log", [](const Tensor& x) { return log(x); }, [](double x) { return std::log(x); }, 1e-3, 1e3},
      {"log1p", [](const Tensor& x) { return log1p(x); }, [](double x) { return std::log1p(x); }, -0.9, 10},
      {"expm1", [](const Tensor& x) { return expm1(x); }, [](double x) { return std::expm1(x); }, -5, 5},
      {"sin", [](const Tensor& x) { return sin(x); }, [](double x) { return std::sin(x); }, -6, 6},
      {"cos", [](const Tensor& x) { return cos(x); }, [](double x) { return std::cos(x); }, -6, 6},
      {"tan", [](const Tensor& x) { return tan(x); }, [](double x) { return std::tan(x); }, -1.2, 1.2},
      {"tanh", [](const Tensor& x) { return tanh(x); }, [](double x) { return std::tanh(x); }, -10, 10},
      {"sigmoid", [](const Tensor& x) { return sigmoid(x); }, sigmoid_ref, -30, 30},
      {"sqrt", [](const Tensor& x) { return sqrt(x); }, [](double x) { return std::sqrt(x); }, 0, 100},
      {"rsqrt", [](const Tensor& x) { return rsqrt(x); }, [](double x) { return 1 / std::sqrt(x); }, 0.01, 100},
      {"reciprocal", [](const Tensor& x) { return reciprocal(x); }, [](double x) { return 1 / x; }, 0.1, 10},
      {"erf", [](const Tensor& x) { return erf(x); }, [](double x) { return std::erf(x); }, -5, 5},
      {"gelu", [](const Tensor& x) { return gelu(x); }, gelu_ref, -8, 8},
      {"gelu_tanh", [](const Tensor& x) { return gelu(x, "tanh"); }, gelu_tanh_ref, -8, 8},
      {"silu", [](const Tensor& x) { return silu(x); }, silu_ref, -30, 30},
  };
}

}  // namespace

// ======================= unary =======================

TEST(PointwiseUnary, FloatingOpsMatchFloat64ReferenceInEveryFloatDtype) {
  for (const auto& c : floating_unary_cases()) {
    for (DType t : {kFloat32, kFloat64, kFloat16, kBFloat16}) {
      Tensor x = spread(1003, c.lo, c.hi, t);  // odd length: vector body plus a tail
      Tensor y = c.op(x);
      EXPECT_EQ(y.dtype(), t) << c.name;
      EXPECT_TRUE(matches(y, {1003}, map_ref(x, c.ref))) << c.name << " " << dtype_name(t);
    }
  }
}

TEST(PointwiseUnary, Float32TranscendentalsAreWithinAFewUlpOverTheirWholeRange) {
  struct Range {
    const char* name;
    std::function<Tensor(const Tensor&)> op;
    std::function<double(double)> ref;
    double lo, hi;
  };
  std::vector<Range> ranges = {
      {"exp", [](const Tensor& x) { return exp(x); }, [](double x) { return std::exp(x); }, -87, 88.7},
      {"exp_subnormal", [](const Tensor& x) { return exp(x); }, [](double x) { return std::exp(x); }, -103, -87.5},
      {"log", [](const Tensor& x) { return log(x); }, [](double x) { return std::log(x); }, 1e-30, 1e30},
      {"log_near_1", [](const Tensor& x) { return log(x); }, [](double x) { return std::log(x); }, 0.5, 2},
      {"tanh", [](const Tensor& x) { return tanh(x); }, [](double x) { return std::tanh(x); }, -12, 12},
      {"sigmoid", [](const Tensor& x) { return sigmoid(x); }, sigmoid_ref, -80, 40},
      {"erf", [](const Tensor& x) { return erf(x); }, [](double x) { return std::erf(x); }, -4, 4},
      {"silu", [](const Tensor& x) { return silu(x); }, silu_ref, -80, 40},
  };
  for (const auto& r : ranges) {
    Tensor x = spread(20001, r.lo, r.hi, kFloat32);
    // 6e-7 relative: about five float32 ulps.
    auto ref = map_ref(x, r.ref);
    if (std::string(r.name) == "exp_subnormal") {
      EXPECT_TRUE(matches(r.op(x), {20001}, ref, Tolerance{6e-7, 3e-45})) << r.name;
    } else {
      EXPECT_TRUE(matches(r.op(x), {20001}, ref, Tolerance{6e-7, 1e-38})) << r.name;
    }
  }
}

TEST(PointwiseUnary, InfNanAndOverflowEdges) {
  for (DType t : {kFloat32, kFloat64}) {
    Tensor x = tensor<double>({-kInf, kInf, kNaN, 0.0, -1.0, 1000.0, -1000.0}).to(t);
    EXPECT_TRUE(matches(exp(x), {7}, {0, kInf, kNaN, 1, std::exp(-1.0), kInf, 0}));
    EXPECT_TRUE(matches(log(x), {7}, {kNaN, kInf, kNaN, -kInf, kNaN, std::log(1000.0), kNaN}));
    EXPECT_TRUE(matches(tanh(x), {7}, {-1, 1, kNaN, 0, std::tanh(-1.0), 1, -1}));
    EXPECT_TRUE(matches(sigmoid(x), {7}, {0, 1, kNaN, 0.5, sigmoid_ref(-1.0), 1, 0}));
    EXPECT_TRUE(matches(erf(x), {7}, {-1, 1, kNaN, 0, std::erf(-1.0), 1, -1}));
    EXPECT_TRUE(matches(gelu(x), {7}, {0, kInf, kNaN, 0, gelu_ref(-1.0), 1000, 0}));
    EXPECT_TRUE(matches(silu(x), {7}, {0, kInf, kNaN, 0, silu_ref(-1.0), 1000, 0}));
    EXPECT_TRUE(matches(sqrt(x), {7}, {kNaN, kInf, kNaN, 0, kNaN, std::sqrt(1000.0), kNaN}));
    EXPECT_TRUE(matches(rsqrt(x), {7}, {kNaN, 0, kNaN, kInf, kNaN, 1 / std::sqrt(1000.0), kNaN}));
    EXPECT_TRUE(matches(reciprocal(x), {7}, {-0.0, 0, kNaN, kInf, -1, 1e-3, -1e-3}));
  }
  // float32 overflow and underflow thresholds.
  Tensor f = tensor<float>({88.7f, 88.8f, -103.0f, -104.5f, 1e-45f, 3e38f});
  auto e = values(exp(f));
  EXPECT_TRUE(std::isfinite(e[0]));
  EXPECT_EQ(e[1], kInf);
  EXPECT_GT(e[2], 0.0);
  EXPECT_EQ(e[3], 0.0);
  EXPECT_TRUE(matches(log(f).slice(0, 4), {2}, {std::log(1e-45f), std::log(3e38f)}, Tolerance{1e-6, 0}));
}

TEST(PointwiseUnary, IntegerAndBoolInputsPromoteToTheDefaultFloatDtype) {
  Tensor i = tensor<int64_t>({0, 1, 2, 3});
  for (auto& c : floating_unary_cases()) {
    Tensor y = c.op(i);
    EXPECT_EQ(y.dtype(), kFloat32) << c.name;
  }
  EXPECT_TRUE(matches(exp(i), {4}, map_ref(i, [](double v) { return std::exp(v); })));
  EXPECT_TRUE(matches(sqrt(tensor<bool>({true, false})), {2}, {1, 0}));
  EXPECT_EQ(sqrt(tensor<int32_t>({4})).dtype(), kFloat32);
  set_default_dtype(kFloat64);
  EXPECT_EQ(exp(i).dtype(), kFloat64);
  set_default_dtype(kFloat32);
}

TEST(PointwiseUnary, AbsNegSignFloorCeilRoundReluKeepIntegerDtypes) {
  for (DType t : {kInt8, kInt32, kInt64}) {
    Tensor x = tensor<int64_t>({-3, -1, 0, 2, 5}).to(t);
    EXPECT_EQ(abs(x).dtype(), t);
    EXPECT_TRUE(matches(abs(x), {5}, {3, 1, 0, 2, 5}));
    EXPECT_TRUE(matches(neg(x), {5}, {3, 1, 0, -2, -5}));
    EXPECT_TRUE(matches(-x, {5}, {3, 1, 0, -2, -5}));
    EXPECT_TRUE(matches(sign(x), {5}, {-1, -1, 0, 1, 1}));
    EXPECT_TRUE(matches(relu(x), {5}, {0, 0, 0, 2, 5}));
    for (Tensor y : {floor(x), ceil(x), round(x)}) {
      EXPECT_EQ(y.dtype(), t);
      EXPECT_TRUE(matches(y, {5}, {-3, -1, 0, 2, 5}));
    }
  }
  Tensor u = tensor<uint8_t>({0, 7, 255});
  EXPECT_TRUE(matches(abs(u), {3}, {0, 7, 255}));
  EXPECT_TRUE(matches(sign(u), {3}, {0, 1, 1}));
  EXPECT_TRUE(matches(neg(u), {3}, {0, 249, 1}));  // wraps like PyTorch
  // abs(INT64_MIN) wraps to itself instead of overflowing.
  int64_t lowest = std::numeric_limits<int64_t>::min();
  EXPECT_EQ(abs(tensor<int64_t>({lowest})).item<int64_t>(), lowest);
  EXPECT_TRUE(matches(sign(tensor<bool>({true, false})), {2}, {1, 0}));
  EXPECT_EQ(sign(tensor<bool>({true})).dtype(), kBool);
}

TEST(PointwiseUnary, FloatingRoundingSignAbsRelu) {
  for (DType t : {kFloat32, kFloat64, kFloat16, kBFloat16}) {
    Tensor x = tensor<double>({0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 2.25, -2.75, 0.0}).to(t);
    EXPECT_TRUE(matches(round(x), {9}, {0, 2, 2, -0.0, -2, -2, 2, -3, 0})) << dtype_name(t);
    EXPECT_TRUE(matches(floor(x), {9}, {0, 1, 2, -1, -2, -3, 2, -3, 0}));
    EXPECT_TRUE(matches(ceil(x), {9}, {1, 2, 3, -0.0, -1, -2, 3, -2, 0}));
    EXPECT_TRUE(matches(sign(x), {9}, {1, 1, 1, -1, -1, -1, 1, -1, 0}));
    EXPECT_TRUE(matches(abs(x), {9}, {0.5, 1.5, 2.5, 0.5, 1.5, 2.5, 2.25, 2.75, 0}));
    EXPECT_TRUE(matches(relu(x), {9}, {0.5, 1.5, 2.5, 0, 0, 0, 2.25, 0, 0}));
  }
  // Large values are already integers; nan and inf pass through.
  Tensor big = tensor<double>({1e300, -1e300, kInf, -kInf, kNaN});
  for (Tensor y : {floor(big), ceil(big), round(big)}) EXPECT_TRUE(matches(y, {5}, {1e300, -1e300, kInf, -kInf, kNaN}));
  Tensor f = tensor<float>({8388607.5f, -8388607.5f, 16777216.0f, 0.49999997f});
  EXPECT_TRUE(matches(floor(f), {4}, {8388607, -8388608, 16777216, 0}));
  EXPECT_TRUE(matches(ceil(f), {4}, {8388608, -8388607, 16777216, 1}));
  EXPECT_TRUE(matches(relu(tensor<double>({kNaN})), {1}, {kNaN}));
  EXPECT_TRUE(matches(sign(tensor<double>({kNaN})), {1}, {0}));
  EXPECT_TRUE(std::signbit(values(ceil(tensor<double>({-0.5})))[0]));
}

TEST(PointwiseUnary, PredicatesReturnBool) {
  Tensor x = tensor<double>({0.0, -1.5, kNaN, kInf, -kInf, 2.0});
  EXPECT_EQ(isnan(x).dtype(), kBool);
  EXPECT_TRUE(matches(isnan(x), {6}, {0, 0, 1, 0, 0, 0}));
  EXPECT_TRUE(matches(x.isfinite(), {6}, {1, 1, 0, 0, 0, 1}));
  EXPECT_TRUE(matches(x.logical_not(), {6}, {1, 0, 0, 0, 0, 0}));
  Tensor h = x.to(kFloat16);
  EXPECT_TRUE(matches(isnan(h), {6}, {0, 0, 1, 0, 0, 0}));
  EXPECT_TRUE(matches(isfinite(h), {6}, {1, 1, 0, 0, 0, 1}));
  Tensor i = tensor<int32_t>({0, 3, -1});
  EXPECT_TRUE(matches(isnan(i), {3}, {0, 0, 0}));
  EXPECT_TRUE(matches(isfinite(i), {3}, {1, 1, 1}));
  EXPECT_TRUE(matches(logical_not(i), {3}, {1, 0, 0}));
  EXPECT_TRUE(matches(logical_not(tensor<bool>({true, false})), {2}, {0, 1}));
}

TEST(PointwiseUnary, BitwiseNotOnIntegersAndBool) {
  EXPECT_TRUE(matches(bitwise_not(tensor<int64_t>({0, 5, -1})), {3}, {-1, -6, 0}));
  EXPECT_TRUE(matches(~tensor<uint8_t>({0, 15}), {2}, {255, 240}));
  Tensor b = ~tensor<bool>({true, false});
  EXPECT_EQ(b.dtype(), kBool);
  EXPECT_TRUE(matches(b, {2}, {0, 1}));
  EXPECT_THROW(bitwise_not(tensor<float>({1.0f})), DTypeError);
}

TEST(PointwiseUnary, BadDtypesThrowWithPyTorchsMessages) {
  Tensor b = tensor<bool>({true, false});
  try {
    neg(b);
    FAIL() << "neg(bool) must throw";
  } catch (const DTypeError& e) {
    EXPECT_NE(std::string(e.what()).find("Negation, the `-` operator, on a bool tensor is not supported."),
              std::string::npos);
  }
  EXPECT_THROW(-b, DTypeError);
  EXPECT_THROW(abs(b), DTypeError);
  EXPECT_THROW(relu(b), DTypeError);
  EXPECT_THROW(floor(b), DTypeError);
  EXPECT_THROW(gelu(tensor<float>({1.0f}), "fast"), ValueError);
}

TEST(PointwiseUnary, NonContiguousInputsAndEdgeSizes) {
  Tensor base = spread(24, -3, 3, kFloat32, {4, 6});
  Tensor tr = base.t();  // (6, 4), strides (1, 6)
  EXPECT_TRUE(matches(exp(tr), {6, 4}, map_ref(tr, [](double v) { return std::exp(v); })));
  Tensor stepped = base.slice(1, 0, 6, 2);  // (4, 3)
  EXPECT_TRUE(matches(tanh(stepped), {4, 3}, map_ref(stepped, [](double v) { return std::tanh(v); })));
  EXPECT_TRUE(matches(abs(stepped.to(kInt32)), {4, 3}, map_ref(stepped.to(kInt32), [](double v) { return std::abs(v); })));
  Tensor expanded = tensor<double>({1.0, 4.0}).view({2, 1}).expand({2, 3});
  EXPECT_TRUE(matches(sqrt(expanded), {2, 3}, {1, 1, 1, 2, 2, 2}));
  Tensor empty = full({0, 3}, 1.0f);
  EXPECT_EQ(exp(empty).sizes().vec(), (std::vector<int64_t>{0, 3}));
  EXPECT_EQ(isnan(empty).dtype(), kBool);
  Tensor scalar = full({}, 2.0, kFloat64);
  Tensor e = log(scalar);
  EXPECT_EQ(e.dim(), 0);
  EXPECT_NEAR(e.item<double>(), std::log(2.0), 1e-15);
}

TEST(PointwiseUnary, LargeTensorsSplitAcrossThreadsMatchReference) {
  Tensor x = spread(100003, -10, 10, kFloat32);
  EXPECT_TRUE(matches(exp(x), {100003}, map_ref(x, [](double v) { return std::exp(v); })));
  EXPECT_TRUE(matches(sqrt(abs(x)), {100003}, map_ref(x, [](double v) { return std::sqrt(std::abs(v)); })));
  Tensor d = x.to(kFloat64);
  EXPECT_TRUE(matches(rsqrt(abs(d)), {100003}, map_ref(d, [](double v) { return 1 / std::sqrt(std::abs(v)); })));
}

TEST(PointwiseUnary, InPlaceFormsWriteThroughViewsAndCheckDtypes) {
  Tensor x = spread(12, -2, 2, kFloat32, {3, 4});
  auto ref = values(x);
  Tensor col = x.select(1, 1);  // non-contiguous view
  col.exp_();
  for (int r = 0; r < 3; ++r) ref[r * 4 + 1] = std::exp(ref[r * 4 + 1]);
  EXPECT_TRUE(matches(x, {3, 4}, ref));
  uint64_t v = x.version();
  x.relu_();
  EXPECT_GT(x.version(), v);
  for (auto& e : ref) e = std::max(e, 0.0);
  EXPECT_TRUE(matches(x, {3, 4}, ref));
  x.sqrt_();
  for (auto& e : ref) e = std::sqrt(e);
  EXPECT_TRUE(matches(x, {3, 4}, ref));
  x.sigmoid_();
  for (auto& e : ref) e = sigmoid_ref(e);
  EXPECT_TRUE(matches(x, {3, 4}, ref));
  x.tanh_();
  for (auto& e : ref) e = std::tanh(e);
  EXPECT_TRUE(matches(x, {3, 4}, ref));
  x.neg_();
  for (auto& e : ref) e = -e;
  EXPECT_TRUE(matches(x, {3, 4}, ref));
  Tensor i = tensor<int64_t>({1, -2});
  i.neg_();
  EXPECT_TRUE(matches(i, {2}, {-1, 2}));
  EXPECT_THROW(i.exp_(), DTypeError);  // float result into an int tensor
  EXPECT_THROW(i.sqrt_(), DTypeError);
}

TEST(PointwiseUnary, MethodFormsMatchFreeFunctions) {
  Tensor x = spread(10, 0.1, 3, kFloat64);
  EXPECT_TRUE(same_values(x.abs(), abs(x)));
  EXPECT_TRUE(same_values(x.neg(), neg(x)));
  EXPECT_TRUE(same_values(x.exp(), exp(x)));
  EXPECT_TRUE(same_values(x.log(), log(x)));
  EXPECT_TRUE(same_values(x.sqrt(), sqrt(x)));
  EXPECT_TRUE(same_values(x.rsqrt(), rsqrt(x)));
  EXPECT_TRUE(same_values(x.sin(), sin(x)));
  EXPECT_TRUE(same_values(x.cos(), cos(x)));
  EXPECT_TRUE(same_values(x.tanh(), tanh(x)));
  EXPECT_TRUE(same_values(x.sigmoid(), sigmoid(x)));
  EXPECT_TRUE(same_values(x.relu(), relu(x)));
  EXPECT_TRUE(same_values(x.reciprocal(), reciprocal(x)));
  EXPECT_TRUE(same_values(x.sign(), sign(x)));
  EXPECT_TRUE(same_values(x.floor(), floor(x)));
  EXPECT_TRUE(same_values(x.ceil(), ceil(x)));
  EXPECT_TRUE(same_values(x.round(), round(x)));
}

// ======================= binary =======================

TEST(PointwiseBinary, ArithmeticMatchesReferenceWithBroadcasting) {
  struct Case {
    const char* name;
    std::function<Tensor(const Tensor&, const Tensor&)> op;
    std::function<double(double, double)> ref;
  };
  std::vector<Case> cases = {
      {"add", [](const Tensor& a, const Tensor& b) { return a + b; }, [](double a, double b) { return a + b; }},
      {"sub", [](const Tensor& a, const Tensor& b) { return a - b; }, [](double a, double b) { return a - b; }},
      {"mul", [](const Tensor& a, const Tensor& b) { return a * b; }, [](double a, double b) { return a * b; }},
      {"maximum", [](const Tensor& a, const Tensor& b) { return maximum(a, b); },
       [](double a, double b) { return std::max(a, b); }},
      {"minimum", [](const Tensor& a, const Tensor& b) { return minimum(a, b); },
       [](double a, double b) { return std::min(a, b); }},
  };
  for (const auto& c : cases) {
    for (DType t : {kFloat32, kFloat64, kFloat16, kBFloat16, kInt32, kInt64, kInt8}) {
      Tensor a = spread(12, -6, 5, t, {3, 1, 4});
      Tensor b = spread(10, -4, 5, t, {2, 1, 5, 1});
      Tensor y = c.op(a, b);
      EXPECT_EQ(y.dtype(), t) << c.name;
      EXPECT_TRUE(matches(y, {2, 3, 5, 4}, zip_ref(a, b, {2, 3, 5, 4}, c.ref))) << c.name << " " << dtype_name(t);
    }
  }
}

TEST(PointwiseBinary, TrueDivisionAndAtan2ReturnFloat) {
  for (DType t : {kFloat32, kFloat64, kFloat16, kBFloat16}) {
    Tensor a = spread(20, -5, 5, t, {4, 5});
    Tensor b = spread(5, 0.5, 3, t, {5});
    EXPECT_TRUE(matches(a / b, {4, 5}, zip_ref(a, b, {4, 5}, [](double x, double y) { return x / y; })));
    EXPECT_TRUE(matches(atan2(a, b), {4, 5}, zip_ref(a, b, {4, 5}, [](double x, double y) { return std::atan2(x, y); })));
  }
  Tensor i = tensor<int64_t>({7, -7, 1});
  Tensor j = tensor<int32_t>({2, 2, 3});
  EXPECT_EQ((i / j).dtype(), kFloat32);
  EXPECT_TRUE(matches(i / j, {3}, {3.5, -3.5, 1.0 / 3}));
  EXPECT_EQ(atan2(i, j).dtype(), kFloat32);
  EXPECT_TRUE(matches(i / 0, {3}, {kInf, -kInf, kInf}));  // true division by zero is IEEE
  EXPECT_TRUE(matches(tensor<float>({0.0f}) / 0.0, {1}, {kNaN}));
}

// hypot: sqrt(a² + b²) without overflow or underflow in the squares; integers promote to float.
TEST(PointwiseBinary, HypotAgainstAFloat64ReferenceWithoutOverflow) {
  for (DType t : {kFloat32, kFloat64, kFloat16, kBFloat16}) {
    SCOPED_TRACE(dtype_name(t));
    Tensor a = spread(20, -5, 5, t, {4, 5});
    Tensor b = spread(5, -3, 3, t, {5});
    EXPECT_TRUE(matches(hypot(a, b), {4, 5}, zip_ref(a, b, {4, 5}, [](double x, double y) { return std::hypot(x, y); })));
  }
  // The squares of 1e30 overflow float32; hypot does not. inf wins over NaN, as in C.
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  Tensor big = tensor<float>({1e30f, 3e-30f, inf, nan, 0.0f});
  Tensor other = tensor<float>({1e30f, 4e-30f, nan, 1.0f, -0.0f});
  EXPECT_TRUE(matches(hypot(big, other), {5}, {std::hypot(1e30f, 1e30f), 5e-30, kInf, kNaN, 0.0}));
  EXPECT_EQ(hypot(tensor<int64_t>({3}), tensor<int32_t>({4})).dtype(), kFloat32);
  EXPECT_TRUE(matches(hypot(tensor<int64_t>({3}), tensor<int32_t>({4})), {1}, {5.0}));
  EXPECT_THROW(hypot(randn({2, 3}), randn({4})), ShapeError);
}

TEST(PointwiseBinary, RoundingDivisionAndRemainderFollowPython) {
  std::vector<double> av = {7, -7, 7, -7, 0, 9, -9, 1};
  std::vector<double> bv = {2, 2, -2, -2, 3, 3, 4, -5};
  for (DType t : {kInt64, kInt32, kInt8, kFloat32, kFloat64}) {
    Tensor a = tensor<double>(av).to(t), b = tensor<double>(bv).to(t);
    Tensor f = div(a, b, "floor"), tr = div(a, b, "trunc"), r = remainder(a, b);
    EXPECT_EQ(f.dtype(), t);
    std::vector<double> ef, et, er;
    for (size_t k = 0; k < av.size(); ++k) {
      ef.push_back(py_floor_div(av[k], bv[k]));
      et.push_back(std::trunc(av[k] / bv[k]));
      er.push_back(py_mod(av[k], bv[k]));
    }
    EXPECT_TRUE(matches(f, {8}, ef)) << dtype_name(t);
    EXPECT_TRUE(matches(floor_divide(a, b), {8}, ef)) << dtype_name(t);
    EXPECT_TRUE(matches(tr, {8}, et)) << dtype_name(t);
    EXPECT_TRUE(matches(r, {8}, er)) << dtype_name(t);
    EXPECT_TRUE(matches(a % b, {8}, er)) << dtype_name(t);
  }
  Tensor x = tensor<double>({5.5, -5.5, 1.0, -1.0});
  EXPECT_TRUE(matches(remainder(x, 2.0), {4}, {1.5, 0.5, 1.0, 1.0}));
  EXPECT_TRUE(matches(remainder(x, 0.0), {4}, {kNaN, kNaN, kNaN, kNaN}));
  EXPECT_TRUE(matches(div(x, 0.0, "floor"), {4}, {kInf, -kInf, kInf, -kInf}));
  EXPECT_TRUE(matches(remainder(tensor<uint8_t>({7, 200}), 3), {2}, {1, 2}));
  // INT64_MIN // -1 wraps instead of trapping.
  int64_t lowest = std::numeric_limits<int64_t>::min();
  EXPECT_EQ(div(tensor<int64_t>({lowest}), -1, "floor").item<int64_t>(), lowest);
  EXPECT_EQ(remainder(tensor<int64_t>({lowest}), -1).item<int64_t>(), 0);
}

TEST(PointwiseBinary, IntegerDivisionByZeroThrowsInsteadOfCrashing) {
  Tensor a = tensor<int64_t>({1, 2, 3});
  Tensor b = tensor<int64_t>({1, 0, 1});
  try {
    div(a, b, "trunc");
    FAIL() << "integer division by zero must throw";
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("ZeroDivisionError"), std::string::npos);
  }
  EXPECT_THROW(div(a, 0, "floor"), ValueError);
  EXPECT_THROW(remainder(a, b), ValueError);
  EXPECT_THROW(a % 0, ValueError);
  // An int64 divisor that becomes 0 in int32 arithmetic is caught too.
  EXPECT_THROW(div(tensor<int32_t>({5}), int64_t{1} << 32, "trunc"), ValueError);
  Tensor c = a.clone();
  EXPECT_THROW(c.div_(tensor<int64_t>({0, 0, 0})), DTypeError);  // true division: float result
  EXPECT_TRUE(matches(c, {3}, {1, 2, 3}));  // untouched
  EXPECT_THROW(div(a, b, "round"), ValueError);
  EXPECT_THROW(div(tensor<bool>({true}), tensor<bool>({true}), "floor"), DTypeError);
}

TEST(PointwiseBinary, AlphaScalesTheSecondOperand) {
  Tensor a = tensor<double>({1, 2, 3}), b = tensor<double>({10, 20, 30});
  EXPECT_TRUE(matches(add(a, b, 2), {3}, {21, 42, 63}));
  EXPECT_TRUE(matches(sub(a, b, 0.5), {3}, {-4, -8, -12}));
  EXPECT_TRUE(matches(add(a, 1.5, -2), {3}, {-2, -1, 0}));
  Tensor i = tensor<int64_t>({1, 2}), j = tensor<int64_t>({3, 4});
  EXPECT_TRUE(matches(add(i, j, 3), {2}, {10, 14}));
  EXPECT_TRUE(matches(sub(i, j, -1), {2}, {4, 6}));
  try {
    add(i, j, 2.5);
    FAIL() << "a float alpha with integer tensors must throw";
  } catch (const DTypeError& e) {
    EXPECT_NE(std::string(e.what()).find("alpha must not be a floating point number"), std::string::npos);
  }
  EXPECT_THROW(add(i, j, true), DTypeError);
  Tensor bb = tensor<bool>({true, false});
  EXPECT_TRUE(matches(add(bb, bb, true), {2}, {1, 0}));
  EXPECT_EQ(add(bb, bb).dtype(), kBool);
}

TEST(PointwiseBinary, TypePromotionFollowsPyTorch) {
  Tensor i32 = tensor<int32_t>({1, 2, 3});
  Tensor y = i32 + 2.5;
  EXPECT_EQ(y.dtype(), kFloat32);
  EXPECT_TRUE(matches(y, {3}, {3.5, 4.5, 5.5}));
  EXPECT_EQ((i32 * 2).dtype(), kInt32);  // an int scalar does not widen an int tensor
  EXPECT_TRUE(matches(i32 * 2, {3}, {2, 4, 6}));
  Tensor h = tensor<float>({1.0f, 2.0f}).to(kFloat16);
  Tensor d0 = full({}, 0.25, kFloat64);
  EXPECT_EQ((h + d0).dtype(), kFloat16);  // a 0-dim tensor does not widen within a category
  EXPECT_TRUE(matches(h + d0, {2}, {1.25, 2.25}));
  EXPECT_EQ((i32 + d0).dtype(), kFloat64);  // ... but raises the category to its own dtype
  EXPECT_EQ((i32 + tensor<double>({1, 1, 1})).dtype(), kFloat64);
  EXPECT_EQ((tensor<float>({1}) + tensor<double>({1})).dtype(), kFloat64);
  EXPECT_EQ((tensor<int8_t>({1}) + tensor<uint8_t>({1})).dtype(), kInt32);
  EXPECT_EQ((h + tensor<float>({1}).to(kBFloat16)).dtype(), kFloat32);
  Tensor b = tensor<bool>({true, false});
  EXPECT_EQ((b + 1).dtype(), kInt64);
  EXPECT_EQ((b + 1.0).dtype(), kFloat32);
  EXPECT_EQ((b * b).dtype(), kBool);
  EXPECT_TRUE(matches(b * b, {2}, {1, 0}));
  Tensor u8 = tensor<uint8_t>({250});
  EXPECT_EQ((u8 + 10).dtype(), kUInt8);
  EXPECT_TRUE(matches(u8 + 10, {1}, {4}));  // wraps like PyTorch
  // float64 tensors see Python floats exactly.
  Tensor d = tensor<double>({0.0});
  EXPECT_EQ((d + 0.1).item<double>(), 0.1);
  // The same rules in the other operand order.
  EXPECT_EQ((2.5 + i32).dtype(), kFloat32);
  EXPECT_TRUE(matches(1 - i32, {3}, {0, -1, -2}));
  EXPECT_TRUE(matches(6 / i32, {3}, {6, 3, 2}));
  EXPECT_TRUE(matches(7 % i32, {3}, {0, 1, 1}));
}

TEST(PointwiseBinary, PowForScalarAndTensorExponents) {
  for (DType t : {kFloat32, kFloat64, kFloat16}) {
    Tensor x = spread(30, 0.1, 4, t);
    for (double e : {2.0, 0.5, -0.5, -1.0, 1.0, 3.0, 2.7, -1.3}) {
      EXPECT_TRUE(matches(pow(x, e), {30}, map_ref(x, [e](double v) { return std::pow(v, e); })))
          << dtype_name(t) << " ** " << e;
    }
    Tensor e = spread(30, -2, 2, t);
    EXPECT_TRUE(matches(x.pow(e), {30}, zip_ref(x, e, {30}, [](double a, double b) { return std::pow(a, b); })));
    EXPECT_TRUE(matches(pow(2.0, e), {30}, map_ref(e, [](double b) { return std::pow(2.0, b); })));
  }
  Tensor i = tensor<int64_t>({-3, -1, 0, 1, 2, 5});
  EXPECT_EQ(i.pow(2).dtype(), kInt64);
  EXPECT_TRUE(matches(i.pow(2), {6}, {9, 1, 0, 1, 4, 25}));
  EXPECT_TRUE(matches(i.pow(3), {6}, {-27, -1, 0, 1, 8, 125}));
  EXPECT_TRUE(matches(i.pow(0), {6}, {1, 1, 1, 1, 1, 1}));
  EXPECT_EQ(i.pow(0.5).dtype(), kFloat32);
  try {
    i.pow(-1);
    FAIL() << "int ** negative int must throw";
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("Integers to negative integer powers are not allowed."), std::string::npos);
  }
  // With a tensor exponent, negative powers of integers follow PyTorch's kernel: 0 unless |base| is 1.
  Tensor base = tensor<int64_t>({2, 1, -1, -1, 3});
  Tensor ex = tensor<int64_t>({-1, -5, -1, -2, 4});
  EXPECT_TRUE(matches(pow(base, ex), {5}, {0, 1, -1, 1, 81}));
  EXPECT_TRUE(matches(pow(2, tensor<int64_t>({0, 3, 10})), {3}, {1, 8, 1024}));
  EXPECT_THROW(pow(tensor<bool>({true}), tensor<bool>({true})), DTypeError);
  Tensor f = tensor<float>({4.0f, 9.0f});
  f.pow_(0.5);
  EXPECT_TRUE(matches(f, {2}, {2, 3}));
  EXPECT_TRUE(matches(pow(tensor<double>({-8.0, 0.0}), 1.0 / 3), {2}, {kNaN, 0}));
}

TEST(PointwiseBinary, MaximumAndMinimumPropagateNan) {
  Tensor a = tensor<double>({1, kNaN, 3, kNaN, -kInf});
  Tensor b = tensor<double>({kNaN, 2, 1, kNaN, 0});
  EXPECT_TRUE(matches(maximum(a, b), {5}, {kNaN, kNaN, 3, kNaN, 0}));
  EXPECT_TRUE(matches(minimum(a, b), {5}, {kNaN, kNaN, 1, kNaN, -kInf}));
  EXPECT_TRUE(matches(maximum(a.to(kFloat32), b.to(kFloat32)), {5}, {kNaN, kNaN, 3, kNaN, 0}));
  Tensor m = tensor<bool>({true, false});
  EXPECT_TRUE(matches(maximum(m, tensor<bool>({false, false})), {2}, {1, 0}));
  Tensor x = tensor<int64_t>({1, 5});
  x.maximum_(tensor<int64_t>({3, 2}));
  EXPECT_TRUE(matches(x, {2}, {3, 5}));
}

TEST(PointwiseBinary, ComparisonsReturnBoolAndCompareInThePromotedDtype) {
  Tensor a = tensor<double>({1, 2, 3, kNaN});
  Tensor b = tensor<double>({3, 2, 1, kNaN});
  EXPECT_EQ(eq(a, b).dtype(), kBool);
  EXPECT_TRUE(matches(a == b, {4}, {0, 1, 0, 0}));
  EXPECT_TRUE(matches(a != b, {4}, {1, 0, 1, 1}));
  EXPECT_TRUE(matches(a < b, {4}, {1, 0, 0, 0}));
  EXPECT_TRUE(matches(a <= b, {4}, {1, 1, 0, 0}));
  EXPECT_TRUE(matches(a > b, {4}, {0, 0, 1, 0}));
  EXPECT_TRUE(matches(a >= b, {4}, {0, 1, 1, 0}));
  EXPECT_TRUE(matches(a.eq(b), {4}, {0, 1, 0, 0}));
  EXPECT_TRUE(matches(a.ne(b), {4}, {1, 0, 1, 1}));
  EXPECT_TRUE(matches(a.lt(b), {4}, {1, 0, 0, 0}));
  EXPECT_TRUE(matches(a.le(b), {4}, {1, 1, 0, 0}));
  EXPECT_TRUE(matches(a.gt(b), {4}, {0, 0, 1, 0}));
  EXPECT_TRUE(matches(a.ge(b), {4}, {0, 1, 1, 0}));
  Tensor i = tensor<int64_t>({1, 2, 3});
  EXPECT_TRUE(matches(i == 2.5, {3}, {0, 0, 0}));  // compared as float, not truncated
  EXPECT_TRUE(matches(i < 2.5, {3}, {1, 1, 0}));
  EXPECT_TRUE(matches(eq(i, 2), {3}, {0, 1, 0}));
  EXPECT_TRUE(matches(ne(i, 2), {3}, {1, 0, 1}));
  EXPECT_TRUE(matches(lt(i, 2), {3}, {1, 0, 0}));
  EXPECT_TRUE(matches(le(i, 2), {3}, {1, 1, 0}));
  EXPECT_TRUE(matches(gt(i, 2), {3}, {0, 0, 1}));
  EXPECT_TRUE(matches(ge(i, 2), {3}, {0, 1, 1}));
  EXPECT_TRUE(matches(2 < i, {3}, {0, 0, 1}));
  EXPECT_TRUE(matches(2 >= i, {3}, {1, 1, 0}));
  EXPECT_TRUE(matches(2 == i, {3}, {0, 1, 0}));
  // Broadcasting, mixed dtypes and non-contiguous operands.
  Tensor m = spread(12, -3, 3, kFloat32, {3, 4}).t();
  Tensor row = spread(3, -1, 1, kInt32, {3});
  EXPECT_TRUE(matches(m > row, {4, 3}, zip_ref(m, row, {4, 3}, [](double x, double y) { return double(x > y); })));
  Tensor h = tensor<double>({0.1, 0.2}).to(kFloat16);
  EXPECT_TRUE(matches(h == h, {2}, {1, 1}));
}

TEST(PointwiseBinary, LogicalOpsTakeAnyDtype) {
  Tensor a = tensor<double>({0, 1, 0, 2.5});
  Tensor b = tensor<int64_t>({0, 0, 3, -1});
  EXPECT_TRUE(matches(logical_and(a, b), {4}, {0, 0, 0, 1}));
  EXPECT_TRUE(matches(logical_or(a, b), {4}, {0, 1, 1, 1}));
  EXPECT_TRUE(matches(logical_xor(a, b), {4}, {0, 1, 1, 0}));
  EXPECT_EQ(logical_xor(a, b).dtype(), kBool);
}

TEST(PointwiseBinary, BitwiseOpsOnIntegersAndBool) {
  Tensor a = tensor<int64_t>({12, -1, 5});
  Tensor b = tensor<int64_t>({10, 7, 0});
  EXPECT_TRUE(matches(bitwise_and(a, b), {3}, {8, 7, 0}));
  EXPECT_TRUE(matches(a | b, {3}, {14, -1, 5}));
  EXPECT_TRUE(matches(a ^ b, {3}, {6, -8, 5}));
  EXPECT_TRUE(matches(a & 4, {3}, {4, 4, 4}));
  EXPECT_TRUE(matches(3 | tensor<int32_t>({4}), {1}, {7}));
  Tensor t = tensor<bool>({true, true, false}), f = tensor<bool>({true, false, false});
  EXPECT_EQ((t & f).dtype(), kBool);
  EXPECT_TRUE(matches(t & f, {3}, {1, 0, 0}));
  EXPECT_TRUE(matches(t | f, {3}, {1, 1, 0}));
  EXPECT_TRUE(matches(t ^ f, {3}, {0, 1, 0}));
  EXPECT_TRUE(matches(bitwise_left_shift(tensor<int64_t>({1, 3, 1, 1}), tensor<int64_t>({4, 1, 64, -1})), {4},
                      {16, 6, 0, 0}));
  EXPECT_TRUE(matches(bitwise_right_shift(tensor<int64_t>({256, -8, -8, 5}), tensor<int64_t>({4, 1, 70, 70})), {4},
                      {16, -4, -1, 0}));
  EXPECT_TRUE(matches(bitwise_left_shift(tensor<uint8_t>({200}), tensor<uint8_t>({1})), {1}, {144}));
  try {
    bitwise_and(tensor<float>({1.0f}), tensor<float>({1.0f}));
    FAIL() << "bitwise ops on float must throw";
  } catch (const DTypeError& e) {
    EXPECT_NE(std::string(e.what()).find("[kiln::bitwise_and]"), std::string::npos);
  }
  EXPECT_THROW(tensor<int64_t>({1}) & 1.5, DTypeError);
  EXPECT_THROW(bitwise_left_shift(t, f), DTypeError);
}

TEST(PointwiseBinary, BoolSubtractionIsRejectedWithPyTorchsMessage) {
  Tensor b = tensor<bool>({true, false});
  try {
    sub(b, b);
    FAIL() << "bool - bool must throw";
  } catch (const DTypeError& e) {
    EXPECT_NE(std::string(e.what()).find("Subtraction, the `-` operator, with two bool tensors is not supported. "
                                         "Use the `^` or `logical_xor()` operator instead."),
              std::string::npos);
  }
  EXPECT_THROW(b - 1, DTypeError);
  EXPECT_THROW(tensor<float>({1.0f}) - b, DTypeError);
}

TEST(PointwiseBinary, IncompatibleShapesThrowShapeError) {
  Tensor a = full({2, 3}, 1.0f), b = full({4}, 1.0f);
  EXPECT_THROW(a + b, ShapeError);
  EXPECT_THROW(a == b, ShapeError);
  EXPECT_THROW(maximum(a, full({3, 3}, 1.0f)), ShapeError);
  EXPECT_EQ((a + full({1, 3}, 1.0f)).sizes().vec(), (std::vector<int64_t>{2, 3}));
}

TEST(PointwiseBinary, NonContiguousAndEdgeSizes) {
  Tensor base = spread(30, -5, 5, kFloat64, {5, 6});
  Tensor a = base.t();                    // (6, 5)
  Tensor b = base.slice(1, 0, 6, 2).t();  // (3, 5)... broadcast needs (1, 5) or (6, 5)
  Tensor c = base.slice(0, 0, 5, 2);      // (3, 6)
  EXPECT_TRUE(matches(a * a, {6, 5}, zip_ref(a, a, {6, 5}, [](double x, double y) { return x * y; })));
  EXPECT_TRUE(matches(c - c.slice(0, 1, 2), {3, 6}, zip_ref(c, c.slice(0, 1, 2), {3, 6}, [](double x, double y) { return x - y; })));
  EXPECT_TRUE(matches(b + 1.0, {3, 5}, map_ref(b, [](double x) { return x + 1; })));
  Tensor e = full({0, 4}, 1.0f);
  EXPECT_EQ((e + full({4}, 1.0f)).sizes().vec(), (std::vector<int64_t>{0, 4}));
  EXPECT_EQ((e < 1).dtype(), kBool);
  Tensor s = full({}, 3.0) * full({}, 4.0);
  EXPECT_EQ(s.dim(), 0);
  EXPECT_EQ(s.item<double>(), 12.0);
  Tensor big = spread(100003, -3, 3, kFloat32);
  EXPECT_TRUE(matches(big * big + 1, {100003}, map_ref(big, [](double x) { return x * x + 1; })));
}

TEST(PointwiseBinary, InPlaceFormsHandleAliasing) {
  Tensor x = spread(9, -4, 4, kFloat32, {3, 3});
  auto v = values(x);
  Tensor y = x.clone();
  y.add_(y);
  EXPECT_TRUE(matches(y, {3, 3}, map_ref(x, [](double e) { return 2 * e; })));
  Tensor z = x.clone();
  z.mul_(z.t());  // reads elements it has already overwritten unless the dispatcher copies
  std::vector<double> ref(9);
  for (int r = 0; r < 3; ++r)
    for (int c = 0; c < 3; ++c) ref[r * 3 + c] = v[r * 3 + c] * v[c * 3 + r];
  EXPECT_TRUE(matches(z, {3, 3}, ref));
  Tensor w = x.clone();
  w.sub_(w.slice(0, 0, 1));  // broadcast row of itself
  for (int r = 0; r < 3; ++r)
    for (int c = 0; c < 3; ++c) ref[r * 3 + c] = v[r * 3 + c] - v[c];
  EXPECT_TRUE(matches(w, {3, 3}, ref));
  Tensor q = x.clone();
  q.select(1, 0).div_(2);  // write through a strided view
  for (int r = 0; r < 3; ++r)
    for (int c = 0; c < 3; ++c) ref[r * 3 + c] = c == 0 ? v[r * 3] / 2 : v[r * 3 + c];
  EXPECT_TRUE(matches(q, {3, 3}, ref));
  uint64_t before = q.version();
  q.add_(1.0, 2);
  EXPECT_GT(q.version(), before);
}

TEST(PointwiseBinary, InPlaceFormsCheckShapeAndDtype) {
  Tensor x = full({3}, 1.0f);
  EXPECT_THROW(x.add_(full({2, 3}, 1.0f)), ShapeError);  // would need to broadcast self
  Tensor i = tensor<int64_t>({1, 2});
  try {
    i.mul_(2.5);
    FAIL() << "int.mul_(2.5) must throw";
  } catch (const DTypeError& e) {
    EXPECT_NE(std::string(e.what()).find("can't be cast"), std::string::npos);
  }
  EXPECT_THROW(i.div_(2), DTypeError);
  EXPECT_THROW(i /= 2, DTypeError);
  i.mul_(3);
  EXPECT_TRUE(matches(i, {2}, {3, 6}));
  Tensor h = tensor<float>({1.0f, 2.0f}).to(kFloat16);
  h.add_(tensor<double>({0.5, 0.25}));  // float64 result cast back to float16
  EXPECT_EQ(h.dtype(), kFloat16);
  EXPECT_TRUE(matches(h, {2}, {1.5, 2.25}));
  Tensor f = tensor<float>({1.0f, 2.0f});
  f.add_(tensor<int64_t>({1, 1}), 3);
  EXPECT_TRUE(matches(f, {2}, {4, 5}));
  f.sub_(tensor<float>({1.0f, 1.0f}), 0.5);
  EXPECT_TRUE(matches(f, {2}, {3.5, 4.5}));
  f.sub_(1);
  f.mul_(tensor<float>({2.0f, 2.0f}));
  f.div_(tensor<float>({5.0f, 7.0f}));
  EXPECT_TRUE(matches(f, {2}, {1, 1}));
  f += 1;
  f -= tensor<float>({0.5f, 0.5f});
  f *= 4;
  f /= tensor<float>({3.0f, 6.0f});
  EXPECT_TRUE(matches(f, {2}, {2, 1}));
  f += f;
  f -= 1;
  f *= f;
  f /= 3;
  EXPECT_TRUE(matches(f, {2}, {3, 1.0 / 3}));
}

// ======================= ternary =======================

TEST(PointwiseTernary, WhereSelectsWithBroadcastingAndPromotion) {
  Tensor cond = tensor<bool>({true, false, true}).view({3, 1});
  Tensor a = spread(12, -5, 5, kFloat32, {3, 4});
  Tensor b = spread(4, 10, 20, kFloat64, {4});
  Tensor y = where(cond, a, b);
  EXPECT_EQ(y.dtype(), kFloat64);
  EXPECT_TRUE(matches(y, {3, 4}, zip3_ref(cond, a, b, {3, 4}, [](double c, double x, double z) { return c ? x : z; })));
  Tensor i = tensor<int32_t>({1, 2, 3});
  Tensor c3 = tensor<bool>({false, true, false});
  Tensor s = where(c3, i, 2.5);
  EXPECT_EQ(s.dtype(), kFloat32);
  EXPECT_TRUE(matches(s, {3}, {2.5, 2, 2.5}));
  EXPECT_EQ(where(c3, 0, i).dtype(), kInt32);
  EXPECT_TRUE(matches(where(c3, 0, i), {3}, {1, 0, 3}));
  Tensor big = spread(70001, -1, 1, kFloat32);
  Tensor pos = big > 0;
  EXPECT_TRUE(matches(where(pos, big, 0.0), {70001}, map_ref(big, [](double v) { return v > 0 ? v : 0; })));
  Tensor nc = a.t();  // (4, 3), non-contiguous
  Tensor ncond = (nc > 0);
  EXPECT_TRUE(matches(where(ncond, nc, -nc), {4, 3}, map_ref(nc, [](double v) { return std::abs(v); })));
  Tensor h = where(tensor<bool>({true, false}), tensor<double>({1, 2}).to(kBFloat16), tensor<double>({3, 4}).to(kBFloat16));
  EXPECT_EQ(h.dtype(), kBFloat16);
  EXPECT_TRUE(matches(h, {2}, {1, 4}));
  EXPECT_THROW(where(tensor<float>({1.0f}), a, b), DTypeError);
  EXPECT_THROW(where(tensor<bool>({true, false}), a, b), ShapeError);
}

TEST(PointwiseTernary, ClampWithScalarAndTensorBounds) {
  for (DType t : {kFloat32, kFloat64, kFloat16, kInt32, kInt64}) {
    Tensor x = spread(21, -10, 10, t);
    EXPECT_EQ(clamp(x, -3, 4).dtype(), t);
    EXPECT_TRUE(matches(clamp(x, -3, 4), {21}, map_ref(x, [](double v) { return std::clamp(v, -3.0, 4.0); })));
    EXPECT_TRUE(matches(x.clamp(-3), {21}, map_ref(x, [](double v) { return std::max(v, -3.0); })));
    EXPECT_TRUE(matches(clamp(x, std::nullopt, 4), {21}, map_ref(x, [](double v) { return std::min(v, 4.0); })));
  }
  Tensor x = tensor<double>({kNaN, -5, 5, 1});
  EXPECT_TRUE(matches(clamp(x, -1, 1), {4}, {kNaN, -1, 1, 1}));
  EXPECT_TRUE(matches(clamp(x, 2, 1), {4}, {kNaN, 1, 1, 1}));  // min > max gives max
  Tensor i = tensor<int64_t>({-2, 0, 2});
  EXPECT_EQ(clamp(i, 0.5).dtype(), kFloat32);
  EXPECT_TRUE(matches(clamp(i, 0.5), {3}, {0.5, 0.5, 2}));
  Tensor lo = tensor<double>({-1, 0, 1}).view({3, 1});
  Tensor hi = tensor<double>({0, 1});
  Tensor m = spread(6, -3, 3, kFloat64, {3, 2});
  EXPECT_TRUE(matches(clamp(m, lo, hi), {3, 2}, zip3_ref(m, lo, hi, {3, 2}, [](double v, double l, double h) {
                        return std::min(std::max(v, l), h);
                      })));
  EXPECT_TRUE(matches(clamp(m, Tensor(), hi), {3, 2}, zip_ref(m, hi, {3, 2}, [](double v, double h) { return std::min(v, h); })));
  Tensor y = spread(8, -4, 4, kFloat32, {2, 4});
  Tensor col = y.select(1, 2);
  auto ref = values(y);
  col.clamp_(-1, 1);
  for (int r = 0; r < 2; ++r) ref[r * 4 + 2] = std::clamp(ref[r * 4 + 2], -1.0, 1.0);
  EXPECT_TRUE(matches(y, {2, 4}, ref));
  EXPECT_THROW(clamp(x, std::nullopt, std::nullopt), ValueError);
  EXPECT_THROW(i.clamp_(0.5), DTypeError);
  EXPECT_THROW(clamp(tensor<bool>({true}), true, false), DTypeError);
}

TEST(PointwiseTernary, LerpWithScalarAndTensorWeights) {
  for (DType t : {kFloat32, kFloat64, kFloat16}) {
    Tensor s = spread(12, -3, 3, t, {3, 4});
    Tensor e = spread(4, 5, 9, t, {4});
    EXPECT_TRUE(matches(lerp(s, e, 0.3), {3, 4}, zip_ref(s, e, {3, 4}, [](double a, double b) { return a + 0.3 * (b - a); })));
    EXPECT_TRUE(matches(lerp(s, e, 0.8), {3, 4}, zip_ref(s, e, {3, 4}, [](double a, double b) { return a + 0.8 * (b - a); })));
    Tensor w = spread(3, -0.5, 1.5, t, {3, 1});
    EXPECT_TRUE(matches(lerp(s, e, w), {3, 4}, zip3_ref(s, e, w, {3, 4}, [](double a, double b, double c) {
                          return a + c * (b - a);
                        })));
  }
  Tensor a = tensor<double>({0, 10});
  a.lerp_(tensor<double>({10, 20}), 0.25);
  EXPECT_TRUE(matches(a, {2}, {2.5, 12.5}));
  EXPECT_THROW(lerp(tensor<float>({1}), tensor<double>({1}), 0.5), DTypeError);
  EXPECT_THROW(lerp(tensor<float>({1}), tensor<float>({1}), tensor<double>({0.5})), DTypeError);
  EXPECT_THROW(lerp(tensor<int64_t>({1}), tensor<int64_t>({1}), 0.5), DTypeError);
}

TEST(PointwiseTernary, AddcmulAndAddcdiv) {
  for (DType t : {kFloat32, kFloat64, kBFloat16}) {
    Tensor s = spread(6, -1, 1, t, {2, 3});
    Tensor t1 = spread(3, 1, 3, t, {3});
    Tensor t2 = spread(2, 0.5, 2, t, {2, 1});
    EXPECT_TRUE(matches(addcmul(s, t1, t2, 0.5), {2, 3}, zip3_ref(s, t1, t2, {2, 3}, [](double a, double b, double c) {
                          return a + 0.5 * b * c;
                        })));
    EXPECT_TRUE(matches(addcdiv(s, t1, t2, -2), {2, 3}, zip3_ref(s, t1, t2, {2, 3}, [](double a, double b, double c) {
                          return a - 2 * b / c;
                        })));
  }
  Tensor i = tensor<int64_t>({1, 2});
  EXPECT_TRUE(matches(addcmul(i, i, i, 2), {2}, {3, 10}));
  EXPECT_EQ(addcmul(i, i, i).dtype(), kInt64);
  // Issue 18.22: a floating value with integer tensors is truncated toward zero (PyTorch 1.13 to
  // today: value.to<int64_t>()); one that does not fit throws.
  EXPECT_TRUE(matches(addcmul(i, i, i, 0.5), {2}, {1, 2}));
  EXPECT_TRUE(matches(addcmul(i, i, i, 2.9), {2}, {3, 10}));
  EXPECT_TRUE(matches(addcmul(i, i, i, -1.7), {2}, {0, -2}));
  EXPECT_EQ(addcmul(i, i, i, 0.5).dtype(), kInt64);
  Tensor j = i.clone();
  j.addcmul_(i, i, 2.5);
  EXPECT_TRUE(matches(j, {2}, {3, 10}));
  EXPECT_THROW(addcmul(i, i, i, 1e30), ValueError);
  try {
    addcdiv(tensor<float>({1.0f}), i, i);
    FAIL() << "integer addcdiv must throw";
  } catch (const DTypeError& e) {
    EXPECT_NE(std::string(e.what()).find("Integer division with addcdiv is no longer supported"), std::string::npos);
  }
  Tensor x = tensor<double>({1, 2});
  x.addcmul_(x, x, 1);  // aliasing: x + x*x
  EXPECT_TRUE(matches(x, {2}, {2, 6}));
  x.addcdiv_(tensor<double>({2, 3}), x, 2);  // x + 2 * [2, 3] / x
  EXPECT_TRUE(matches(x, {2}, {4, 7}));
  EXPECT_THROW(x.addcmul_(x, full({3, 2}, 1.0)), ShapeError);
}

TEST(PointwiseTernary, MaskedFillWithScalarAndTensorValues) {
  Tensor x = spread(12, -6, 6, kFloat32, {3, 4});
  Tensor mask = tensor<bool>({true, false, false, true});
  Tensor y = masked_fill(x, mask, -1.5);
  EXPECT_EQ(y.dtype(), kFloat32);
  EXPECT_TRUE(matches(y, {3, 4}, zip_ref(x, mask, {3, 4}, [](double v, double m) { return m ? -1.5 : v; })));
  EXPECT_TRUE(matches(x.masked_fill(mask, 7), {3, 4}, zip_ref(x, mask, {3, 4}, [](double v, double m) { return m ? 7 : v; })));
  EXPECT_TRUE(matches(masked_fill(x, mask, full({}, 2.0, kFloat64)), {3, 4},
                      zip_ref(x, mask, {3, 4}, [](double v, double m) { return m ? 2 : v; })));
  Tensor i = tensor<int64_t>({1, 2, 3});
  EXPECT_TRUE(matches(masked_fill(i, tensor<bool>({false, true, false}), 9), {3}, {1, 9, 3}));
  // The mask may broadcast the result beyond self out of place, but not in place.
  Tensor row = tensor<double>({1, 2});
  Tensor m2 = tensor<bool>({true, false}).view({2, 1});
  EXPECT_TRUE(matches(masked_fill(row, m2, 0.0), {2, 2}, {0, 0, 1, 2}));
  EXPECT_THROW(row.masked_fill_(m2, 0.0), ShapeError);
  // In place through a transposed view.
  Tensor z = spread(6, 1, 6, kFloat64, {2, 3});
  auto ref = values(z);
  z.t().masked_fill_(tensor<bool>({true, false}), 0.0);  // first column of z.t() is row 0 of z
  for (int c = 0; c < 3; ++c) ref[c] = 0;
  EXPECT_TRUE(matches(z, {2, 3}, ref));
  EXPECT_THROW(masked_fill(x, tensor<int64_t>({1, 0, 0, 1}), 0.0), DTypeError);
  EXPECT_THROW(masked_fill(x, mask, tensor<float>({1.0f})), ShapeError);
  EXPECT_THROW(masked_fill(x, tensor<bool>({true, false}), 0.0), ShapeError);
}

// ======================= devices and the op table =======================

TEST(PointwiseOps, TensorsOnDifferentDevicesThrowDeviceError) {
  if (!cuda::is_available()) GTEST_SKIP() << "needs a CUDA device";
  Tensor a = full({2}, 1.0f);
  Tensor b = a.to(cuda_device());
  EXPECT_THROW(a + b, DeviceError);
  EXPECT_THROW(where(tensor<bool>({true, false}), a, b), DeviceError);
  EXPECT_THROW(clamp(a, full({2}, 0.0f).to(cuda_device()), Tensor()), DeviceError);
}

// Every op the table lowers pointwise is elementwise (OpDef::pointwise), has a schema under its
// own name and a CPU kernel; and every op of pointwise_list.h lowers pointwise.
TEST(PointwiseOps, EveryOpIsATablePointwiseEntryWithASchema) {
  int pointwise = 0;
  for (const OpDef* op : OpTable::instance().all()) {
    if (!op->is_fusible()) continue;
    ++pointwise;
    EXPECT_TRUE(op->pointwise) << op->name;
    EXPECT_EQ(op->schema.rfind(op->name + "(", 0), 0u) << op->name;
    EXPECT_TRUE(op->has_kernel(DeviceType::cpu)) << op->name;
  }
  EXPECT_GE(pointwise, 57);
#define KILN_EXPECT_LOWERED(name, Functor, rule, derivative) \
  EXPECT_TRUE(OpTable::instance().find(#name)->is_fusible()) << #name;
  KILN_UNARY_POINTWISE_OPS(KILN_EXPECT_LOWERED)
  KILN_BINARY_POINTWISE_OPS(KILN_EXPECT_LOWERED)
#undef KILN_EXPECT_LOWERED
}
