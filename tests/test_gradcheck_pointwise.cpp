// Derivatives of the pointwise ops (unary, binary, ternary) and the random ops: every
// differentiable op is gradchecked in float64 against finite differences (broadcast and
// non-contiguous inputs where the op allows), composite formulas are gradgradchecked, and
// PyTorch's subgradient conventions, dtype behaviour and in-place forms are checked directly.
#include <functional>
#include <string>

#include "reference.h"

using namespace kiln;
using kiln::testing::matches;
using kiln::testing::grad_ok;
using kiln::testing::gradgrad_ok;

namespace {

Tensor leaf(Tensor t) {
  t.requires_grad_();
  return t;
}

// Standard normal float64 values pushed at least 0.2 away from 0 (and so from relu/abs/sign kinks).
Tensor away_from_zero(IntArrayRef sizes) {
  Tensor t = randn(sizes, kFloat64);
  return t.sign() * (t.abs() + 0.2);
}

Tensor positive(IntArrayRef sizes) { return rand(sizes, kFloat64) + 0.5; }  // in [0.5, 1.5)
Tensor unit(IntArrayRef sizes) { return rand(sizes, kFloat64) * 1.6 - 0.8; }  // in [-0.8, 0.8)

// A (2, 3) leaf and a non-contiguous one: the transpose of a (3, 2) tensor.
TensorList contiguous_and_transposed(const std::function<Tensor(IntArrayRef)>& make) {
  return {leaf(make({2, 3})), leaf(make({3, 2}).t())};
}

class GradcheckPointwise : public ::testing::Test {
 protected:
  void SetUp() override { manual_seed(20240611); }
};

// ---------------- unary ----------------

struct UnaryCase {
  const char* name;
  std::function<Tensor(const Tensor&)> op;
  std::function<Tensor(IntArrayRef)> domain;
};

std::vector<UnaryCase> unary_cases() {
  return {
      {"neg", [](const Tensor& x) { return neg(x); }, away_from_zero},
      {"abs", [](const Tensor& x) { return abs(x); }, away_from_zero},
      {"exp", [](const Tensor& x) { return exp(x); }, away_from_zero},
      {"log", [](const Tensor& x) { return log(x); }, positive},
      {"log1p", [](const Tensor& x) { return log1p(x); }, unit},
      {"expm1", [](const Tensor& x) { return expm1(x); }, away_from_zero},
      {"sin", [](const Tensor& x) { return sin(x); }, away_from_zero},
      {"cos", [](const Tensor& x) { return cos(x); }, away_from_zero},
      {"tan", [](const Tensor& x) { return tan(x); }, unit},
      {"tanh", [](const Tensor& x) { return tanh(x); }, away_from_zero},
      {"sigmoid", [](const Tensor& x) { return sigmoid(x); }, away_from_zero},
      {"relu", [](const Tensor& x) { return relu(x); }, away_from_zero},
      {"gelu", [](const Tensor& x) { return gelu(x); }, away_from_zero},
      {"gelu_tanh", [](const Tensor& x) { return gelu(x, "tanh"); }, away_from_zero},
      {"silu", [](const Tensor& x) { return silu(x); }, away_from_zero},
      {"sqrt", [](const Tensor& x) { return sqrt(x); }, positive},
      {"rsqrt", [](const Tensor& x) { return rsqrt(x); }, positive},
      {"reciprocal", [](const Tensor& x) { return reciprocal(x); }, away_from_zero},
      {"sign", [](const Tensor& x) { return sign(x); }, away_from_zero},
      {"floor", [](const Tensor& x) { return floor(x); }, away_from_zero},
      {"ceil", [](const Tensor& x) { return ceil(x); }, away_from_zero},
      {"round", [](const Tensor& x) { return round(x); }, away_from_zero},
      {"erf", [](const Tensor& x) { return erf(x); }, away_from_zero},
  };
}

TEST_F(GradcheckPointwise, UnaryOpsMatchFiniteDifferencesOnContiguousAndTransposedInputs) {
  for (const auto& c : unary_cases()) {
    SCOPED_TRACE(c.name);
    auto op = c.op;
    for (const Tensor& x : contiguous_and_transposed(c.domain))
      EXPECT_TRUE(grad_ok([op](const TensorList& in) { return TensorList{op(in[0])}; }, {x}));
  }
}

TEST_F(GradcheckPointwise, UnarySecondDerivativesMatchFiniteDifferences) {
  for (const auto& c : unary_cases()) {
    SCOPED_TRACE(c.name);
    auto op = c.op;
    EXPECT_TRUE(gradgrad_ok([op](const TensorList& in) { return TensorList{op(in[0])}; }, {leaf(c.domain({2, 3}))}));
  }
}

TEST_F(GradcheckPointwise, UnaryDerivativesAreNamedAfterTheirOps) {
  Tensor x = leaf(positive({3}));
  EXPECT_EQ(exp(x).grad_fn_name(), "ExpBackward0");
  EXPECT_EQ(gelu(x, "tanh").grad_fn_name(), "GeluBackward0");
  EXPECT_EQ(x.sqrt().grad_fn_name(), "SqrtBackward0");
  EXPECT_FALSE(isnan(x).requires_grad());  // bool outputs get no node
  EXPECT_FALSE(isfinite(x).requires_grad());
}

TEST_F(GradcheckPointwise, ReluAbsAndSignFollowPyTorchSubgradientsAtZero) {
  Tensor x = leaf(tensor<double>({-1.5, 0.0, 2.0}));
  relu(x).backward(ones({3}, kFloat64));
  EXPECT_TRUE(matches(x.grad(), {3}, {0, 0, 1}));  // relu'(0) = 0
  x.set_grad(Tensor());
  abs(x).backward(ones({3}, kFloat64));
  EXPECT_TRUE(matches(x.grad(), {3}, {-1, 0, 1}));  // abs'(0) = 0
  x.set_grad(Tensor());
  (sign(x) + floor(x) + ceil(x) + round(x)).backward(ones({3}, kFloat64));
  EXPECT_TRUE(matches(x.grad(), {3}, {0, 0, 0}));
}

TEST_F(GradcheckPointwise, GeluBackwardMatchesPyTorchsFormulas) {
  std::vector<double> xs = {-2.0, -0.5, 0.0, 0.3, 1.7};
  Tensor x = leaf(tensor<double>(xs));
  gelu(x).backward(ones({5}, kFloat64));
  auto exact = [](double v) {
    return 0.5 * (1 + std::erf(v * M_SQRT1_2)) + v * std::exp(-0.5 * v * v) / std::sqrt(2 * M_PI);
  };
  std::vector<double> expected;
  for (double v : xs) expected.push_back(exact(v));
  EXPECT_TRUE(matches(x.grad(), {5}, expected));

  x.set_grad(Tensor());
  gelu(x, "tanh").backward(ones({5}, kFloat64));
  auto approx = [](double v) {
    const double k = std::sqrt(2 / M_PI), kappa = 0.044715;
    double t = std::tanh(k * (v + kappa * v * v * v));
    return 0.5 * (1 + t) + 0.5 * v * (1 - t * t) * k * (1 + 3 * kappa * v * v);
  };
  expected.clear();
  for (double v : xs) expected.push_back(approx(v));
  EXPECT_TRUE(matches(x.grad(), {5}, expected));
}

// ---------------- binary ----------------

TEST_F(GradcheckPointwise, AddAndSubPassAlphaToOtherWithBroadcasting) {
  Tensor a = leaf(randn({2, 3}, kFloat64)), b = leaf(randn({3}, kFloat64));
  EXPECT_TRUE(grad_ok([](const TensorList& in) { return TensorList{add(in[0], in[1], 2.5)}; }, {a, b}));
  EXPECT_TRUE(grad_ok([](const TensorList& in) { return TensorList{sub(in[0], in[1], 3)}; }, {a, b}));
  EXPECT_TRUE(grad_ok([](const TensorList& in) { return TensorList{in[0] - in[1]}; }, {b, a}));
  EXPECT_TRUE(grad_ok([](const TensorList& in) { return TensorList{add(in[0], 2.0) + (1.5 - in[0])}; }, {a}));

  Tensor x = leaf(randn({2}, kFloat64)), y = leaf(randn({2}, kFloat64));
  sub(x, y, 2).backward(ones({2}, kFloat64));
  EXPECT_TRUE(matches(x.grad(), {2}, {1, 1}));
  EXPECT_TRUE(matches(y.grad(), {2}, {-2, -2}));
}

TEST_F(GradcheckPointwise, MulDivAndAtan2MatchFiniteDifferences) {
  Tensor a = leaf(away_from_zero({2, 1})), b = leaf(away_from_zero({1, 3}));
  Tensor t = leaf(away_from_zero({3, 2}).t());
  auto check = [&](std::function<Tensor(const Tensor&, const Tensor&)> op) {
    EXPECT_TRUE(grad_ok([op](const TensorList& in) { return TensorList{op(in[0], in[1])}; }, {a, b}));
    EXPECT_TRUE(grad_ok([op](const TensorList& in) { return TensorList{op(in[0], in[1])}; }, {t, a}));
    EXPECT_TRUE(gradgrad_ok([op](const TensorList& in) { return TensorList{op(in[0], in[1])}; },
                            {leaf(away_from_zero({2, 3})), leaf(away_from_zero({2, 3}))}));
  };
  {
    SCOPED_TRACE("mul");
    check([](const Tensor& x, const Tensor& y) { return x * y; });
  }
  {
    SCOPED_TRACE("div");
    check([](const Tensor& x, const Tensor& y) { return x / y; });
  }
  {
    SCOPED_TRACE("atan2");
    check([](const Tensor& x, const Tensor& y) { return atan2(x, y); });
  }
  {
    SCOPED_TRACE("hypot");
    check([](const Tensor& x, const Tensor& y) { return hypot(x, y); });
  }
  // Scalar operands (wrapped numbers) on either side.
  EXPECT_TRUE(grad_ok([](const TensorList& in) { return TensorList{in[0] * 3, 2.5 * in[0], in[0] / 4, 2.0 / in[0]}; },
                      {t}));
}

TEST_F(GradcheckPointwise, DivWithARoundingModeHasZeroGradient) {
  Tensor x = leaf(tensor<double>({7.5, -3.2})), y = leaf(tensor<double>({2.0, 1.5}));
  (div(x, y, "floor") + div(x, y, "trunc")).backward(ones({2}, kFloat64));
  EXPECT_TRUE(matches(x.grad(), {2}, {0, 0}));
  EXPECT_TRUE(matches(y.grad(), {2}, {0, 0}));
}

TEST_F(GradcheckPointwise, PowMatchesFiniteDifferencesInAllThreeForms) {
  Tensor base = leaf(positive({2, 3})), exponent = leaf(randn({3}, kFloat64));
  EXPECT_TRUE(grad_ok([](const TensorList& in) { return TensorList{pow(in[0], in[1])}; }, {base, exponent}));
  EXPECT_TRUE(gradgrad_ok([](const TensorList& in) { return TensorList{pow(in[0], in[1])}; },
                          {leaf(positive({2, 3})), leaf(randn({2, 3}, kFloat64))}));
  // Tensor ^ scalar: integer exponents on signed bases, fractional ones on positive bases.
  Tensor x = leaf(away_from_zero({3, 2}).t());
  EXPECT_TRUE(grad_ok([](const TensorList& in) { return TensorList{pow(in[0], 3), in[0].pow(-2), pow(in[0], 1)}; }, {x}));
  EXPECT_TRUE(grad_ok([](const TensorList& in) { return TensorList{pow(in[0], 2.5), pow(in[0], -0.5)}; },
                      {leaf(positive({2, 3}))}));
  EXPECT_TRUE(gradgrad_ok([](const TensorList& in) { return TensorList{pow(in[0], 3), pow(in[0], 0.5)}; },
                          {leaf(positive({2, 3}))}));
  // Scalar ^ tensor.
  EXPECT_TRUE(grad_ok([](const TensorList& in) { return TensorList{pow(2.0, in[0]), pow(0.5, in[0])}; }, {x}));
  EXPECT_TRUE(gradgrad_ok([](const TensorList& in) { return TensorList{pow(3.0, in[0])}; }, {leaf(randn({4}, kFloat64))}));
}

TEST_F(GradcheckPointwise, PowAtBaseZeroFollowsPyTorch) {
  // d/dexponent of 0^e is 0 (not nan) where e >= 0; d/dbase of x^0 is 0 even at x = 0.
  Tensor base = leaf(tensor<double>({0.0, 0.0, 0.0, 2.0}));
  Tensor exponent = leaf(tensor<double>({2.0, 0.0, -1.0, 3.0}));
  pow(base, exponent).backward(ones({4}, kFloat64));
  auto g = exponent.grad().to_vector<double>();
  EXPECT_EQ(g[0], 0.0);
  EXPECT_EQ(g[1], 0.0);
  EXPECT_EQ(g[2], -INFINITY);  // 0^-1 * log(0) = inf * -inf, as in PyTorch
  EXPECT_NEAR(g[3], 8.0 * std::log(2.0), 1e-12);
  auto gb = base.grad().to_vector<double>();
  EXPECT_EQ(gb[0], 0.0);  // 2 * 0^1
  EXPECT_EQ(gb[1], 0.0);  // exponent 0: zero, not 0 * 0^-1
  EXPECT_EQ(gb[3], 12.0);

  Tensor x = leaf(tensor<double>({0.0, 1.5}));
  pow(x, 0).backward(ones({2}, kFloat64));
  EXPECT_TRUE(matches(x.grad(), {2}, {0, 0}));

  Tensor e = leaf(tensor<double>({0.0, 1.0, 2.0}));
  pow(0.0, e).backward(ones({3}, kFloat64));
  EXPECT_TRUE(matches(e.grad(), {3}, {0, 0, 0}));
}

TEST_F(GradcheckPointwise, RemainderMatchesFiniteDifferencesAwayFromItsJumps) {
  // self = other * (k + f) with f in [0.2, 0.8]: far from the jumps at integer quotients.
  Tensor other = positive({2, 3}) + 1.0;
  Tensor k = randint(-2, 3, {2, 3}).to(kFloat64);
  Tensor self = leaf(other * (k + rand({2, 3}, kFloat64) * 0.6 + 0.2));
  Tensor divisor = leaf(other);
  EXPECT_TRUE(grad_ok([](const TensorList& in) { return TensorList{remainder(in[0], in[1])}; }, {self, divisor}));
  EXPECT_TRUE(gradgrad_ok([](const TensorList& in) { return TensorList{remainder(in[0], in[1])}; }, {self, divisor}));
  EXPECT_TRUE(grad_ok([](const TensorList& in) { return TensorList{remainder(in[0], 100.0)}; }, {self}));
}

TEST_F(GradcheckPointwise, MaximumAndMinimumMatchFiniteDifferencesAwayFromTies) {
  Tensor a = leaf(randn({2, 3}, kFloat64)), b = leaf(randn({3}, kFloat64));
  EXPECT_TRUE(grad_ok([](const TensorList& in) { return TensorList{maximum(in[0], in[1]), minimum(in[0], in[1])}; },
                      {a, b}));
  EXPECT_TRUE(gradgrad_ok([](const TensorList& in) { return TensorList{maximum(in[0], in[1]), minimum(in[1], in[0])}; },
                          {leaf(randn({2, 3}, kFloat64)), leaf(randn({2, 3}, kFloat64))}));
}

TEST_F(GradcheckPointwise, MaximumAndMinimumSplitTiesInHalf) {
  Tensor a = leaf(tensor<double>({1, 2, 3})), b = leaf(tensor<double>({1, 5, 0}));
  maximum(a, b).backward(tensor<double>({4, 4, 4}));
  EXPECT_TRUE(matches(a.grad(), {3}, {2, 0, 4}));
  EXPECT_TRUE(matches(b.grad(), {3}, {2, 4, 0}));
  a.set_grad(Tensor());
  b.set_grad(Tensor());
  minimum(a, b).backward(tensor<double>({4, 4, 4}));
  EXPECT_TRUE(matches(a.grad(), {3}, {2, 4, 0}));
  EXPECT_TRUE(matches(b.grad(), {3}, {2, 0, 4}));
}

TEST_F(GradcheckPointwise, ComparisonLogicalAndBitwiseOutputsAreNotDifferentiable) {
  Tensor a = leaf(randn({3}, kFloat64)), b = leaf(randn({3}, kFloat64));
  EXPECT_FALSE(lt(a, b).requires_grad());
  EXPECT_FALSE(eq(a, 0.5).requires_grad());
  EXPECT_FALSE(logical_and(a, b).requires_grad());
  EXPECT_FALSE(div(a, b, "floor").to(kInt64).requires_grad());
}

// ---------------- ternary ----------------

TEST_F(GradcheckPointwise, WhereRoutesTheGradientByConditionWithBroadcasting) {
  Tensor cond = tensor<bool>({true, false, true, false, false, true}).view({2, 3});
  Tensor a = leaf(randn({3}, kFloat64)), b = leaf(randn({3, 2}, kFloat64).t());
  EXPECT_TRUE(grad_ok([cond](const TensorList& in) { return TensorList{where(cond, in[0], in[1])}; }, {a, b}));
  EXPECT_TRUE(grad_ok([cond](const TensorList& in) { return TensorList{where(cond, in[0], 2.0), where(cond, 1, in[0])}; },
                      {b}));
  EXPECT_TRUE(gradgrad_ok([cond](const TensorList& in) { return TensorList{where(cond, in[0] * in[1], in[1])}; },
                          {leaf(randn({2, 3}, kFloat64)), leaf(randn({2, 3}, kFloat64))}));
  where(cond, a, b).backward(ones({2, 3}, kFloat64));
  EXPECT_TRUE(matches(a.grad(), {3}, {1, 0, 2}));
  EXPECT_TRUE(matches(b.grad(), {2, 3}, {0, 1, 0, 1, 1, 0}));
}

TEST_F(GradcheckPointwise, ClampWithScalarBoundsMatchesFiniteDifferences) {
  Tensor x = leaf(tensor<double>({-2.0, -0.3, 0.1, 0.7, 2.0, 0.45}).view({3, 2}).t());
  EXPECT_TRUE(grad_ok(
      [](const TensorList& in) {
        return TensorList{clamp(in[0], -0.5, 0.5), clamp(in[0], 0.0), clamp(in[0], std::nullopt, 0.2)};
      },
      {x}));
  EXPECT_TRUE(gradgrad_ok([](const TensorList& in) { return TensorList{clamp(in[0] * in[0], -0.5, 0.5)}; }, {x}));
}

TEST_F(GradcheckPointwise, ClampPassesTheGradientOnTheClosedIntervalLikePyTorch) {
  Tensor x = leaf(tensor<double>({5.0, -1.0, 0.0, 1.0}));
  clamp(x, -1.0, 1.0).backward(ones({4}, kFloat64));
  EXPECT_TRUE(matches(x.grad(), {4}, {0, 1, 1, 1}));
}

TEST_F(GradcheckPointwise, ClampWithTensorBoundsGivesTheActiveBoundTheGradient) {
  // Elements below min, inside, above max, and two where min > max (the result is max).
  Tensor x = leaf(tensor<double>({-2.0, 0.1, 0.9, 2.0, 0.2, -3.0}));
  Tensor lo = leaf(tensor<double>({-1.0, -0.5, 0.3, -1.0, 1.0, 1.0}));
  Tensor hi = leaf(tensor<double>({1.0, 0.5, 0.8, 1.0, -1.0, -1.0}));
  EXPECT_TRUE(grad_ok([](const TensorList& in) { return TensorList{clamp(in[0], in[1], in[2])}; }, {x, lo, hi}));
  EXPECT_TRUE(gradgrad_ok([](const TensorList& in) { return TensorList{clamp(in[0] * in[0], in[1], in[2])}; },
                          {x, lo, hi}));
  clamp(x, lo, hi).backward(ones({6}, kFloat64));
  EXPECT_TRUE(matches(x.grad(), {6}, {0, 1, 0, 0, 0, 0}));
  EXPECT_TRUE(matches(lo.grad(), {6}, {1, 0, 0, 0, 0, 0}));
  EXPECT_TRUE(matches(hi.grad(), {6}, {0, 0, 1, 1, 1, 1}));
  // One bound only, broadcast.
  Tensor m = leaf(tensor<double>({0.0}));
  EXPECT_TRUE(grad_ok([](const TensorList& in) { return TensorList{clamp(in[0], in[1], Tensor())}; }, {x, m}));
  EXPECT_TRUE(grad_ok([](const TensorList& in) { return TensorList{clamp(in[0], Tensor(), in[1])}; }, {x, m}));
}

TEST_F(GradcheckPointwise, LerpMatchesFiniteDifferencesWithScalarAndTensorWeights) {
  Tensor start = leaf(randn({2, 3}, kFloat64)), end = leaf(randn({3}, kFloat64));
  Tensor weight = leaf(rand({2, 1}, kFloat64));
  EXPECT_TRUE(grad_ok([](const TensorList& in) { return TensorList{lerp(in[0], in[1], 0.3)}; }, {start, end}));
  EXPECT_TRUE(grad_ok([](const TensorList& in) { return TensorList{lerp(in[0], in[1], in[2])}; },
                      {start, end, weight}));
  EXPECT_TRUE(gradgrad_ok([](const TensorList& in) { return TensorList{lerp(in[0], in[1], in[2])}; },
                          {leaf(randn({2, 3}, kFloat64)), leaf(randn({2, 3}, kFloat64)), leaf(rand({2, 3}, kFloat64))}));
}

TEST_F(GradcheckPointwise, AddcmulAndAddcdivMatchFiniteDifferences) {
  Tensor self = leaf(randn({2, 3}, kFloat64)), t1 = leaf(randn({3}, kFloat64));
  Tensor t2 = leaf(away_from_zero({3, 2}).t());
  EXPECT_TRUE(grad_ok([](const TensorList& in) { return TensorList{addcmul(in[0], in[1], in[2], 0.5)}; },
                      {self, t1, t2}));
  EXPECT_TRUE(grad_ok([](const TensorList& in) { return TensorList{addcdiv(in[0], in[1], in[2], -2)}; },
                      {self, t1, t2}));
  TensorList same = {leaf(randn({2, 3}, kFloat64)), leaf(randn({2, 3}, kFloat64)), leaf(away_from_zero({2, 3}))};
  EXPECT_TRUE(gradgrad_ok([](const TensorList& in) { return TensorList{addcmul(in[0], in[1], in[2], 0.5)}; }, same));
  EXPECT_TRUE(gradgrad_ok([](const TensorList& in) { return TensorList{addcdiv(in[0], in[1], in[2], 1.5)}; }, same));
}

TEST_F(GradcheckPointwise, MaskedFillZeroesSelfsGradientAndSumsItIntoATensorValue) {
  Tensor mask = tensor<bool>({true, false, false, true, true, false}).view({2, 3});
  Tensor x = leaf(randn({3, 2}, kFloat64).t());
  Tensor value = leaf(scalar_tensor(0.7, kFloat64));
  EXPECT_TRUE(grad_ok([mask](const TensorList& in) { return TensorList{masked_fill(in[0], mask, 2.5)}; }, {x}));
  EXPECT_TRUE(grad_ok([mask](const TensorList& in) { return TensorList{masked_fill(in[0], mask, in[1])}; },
                      {x, value}));
  EXPECT_TRUE(gradgrad_ok([mask](const TensorList& in) { return TensorList{masked_fill(in[0] * in[0], mask, 1.0)}; },
                          {x}));
  masked_fill(x, mask, value).backward(tensor<double>({1, 2, 3, 4, 5, 6}).view({2, 3}));
  EXPECT_TRUE(matches(x.grad(), {2, 3}, {0, 2, 3, 0, 0, 6}));
  EXPECT_TRUE(matches(value.grad(), {}, {1 + 4 + 5}));
}

// ---------------- random ----------------

TEST_F(GradcheckPointwise, DropoutScalesTheGradientOfKeptElements) {
  Tensor x = leaf(away_from_zero({4, 5}));
  EXPECT_TRUE(grad_ok(
      [](const TensorList& in) {
        manual_seed(7);  // the same mask on every evaluation
        return TensorList{dropout(in[0], 0.4, true)};
      },
      {leaf(away_from_zero({2, 3}))}));
  Tensor y = dropout(x, 0.25, true);
  EXPECT_EQ(y.grad_fn_name(), "NativeDropoutBackward0");
  y.backward(ones({4, 5}, kFloat64));
  auto kept = (y != 0).to(kFloat64).to_vector<double>();
  std::vector<double> expected;
  for (double k : kept) expected.push_back(k / 0.75);
  EXPECT_TRUE(matches(x.grad(), {4, 5}, expected));
  // p = 1 drops everything: zero gradient, not nan.
  Tensor z = leaf(randn({3}, kFloat64));
  dropout(z, 1.0, true).backward(ones({3}, kFloat64));
  EXPECT_TRUE(matches(z.grad(), {3}, {0, 0, 0}));
}

TEST_F(GradcheckPointwise, BernoulliSamplesGiveZeroGradientToTheirProbabilities) {
  Tensor p = leaf(rand({4}, kFloat64));
  Tensor s = bernoulli(p);
  EXPECT_TRUE(s.requires_grad());
  s.backward(ones({4}, kFloat64));
  EXPECT_TRUE(matches(p.grad(), {4}, {0, 0, 0, 0}));

  Tensor x = leaf(randn({3}, kFloat64));
  Tensor y = x * 2;
  y.bernoulli_(0.5);
  y.backward(ones({3}, kFloat64));
  EXPECT_TRUE(matches(x.grad(), {3}, {0, 0, 0}));
}

TEST_F(GradcheckPointwise, UniformAndNormalInPlaceCutTheTargetsHistory) {
  Tensor x = leaf(randn({3}, kFloat64));
  Tensor y = x * 2;
  y.uniform_();
  EXPECT_EQ(y.grad_fn_name(), "UniformBackward0");
  EXPECT_NO_THROW(y.backward(ones({3}, kFloat64)));
  EXPECT_TRUE(!x.grad().defined() || matches(x.grad(), {3}, {0, 0, 0}));
  Tensor z = x * 3;
  z.normal_();
  EXPECT_NO_THROW(z.backward(ones({3}, kFloat64)));
  EXPECT_TRUE(!x.grad().defined() || matches(x.grad(), {3}, {0, 0, 0}));
  Tensor w = leaf(randn({2}, kFloat64));
  EXPECT_THROW(w.uniform_(), Error);  // a leaf that requires grad
}

TEST_F(GradcheckPointwise, FactoriesWithRequiresGradAreLeaves) {
  Tensor r = rand({3}, TensorOptions(kFloat64, kCPU, /*requires_grad=*/true));
  Tensor a = arange(0.0, 3.0, 1.0, TensorOptions(kFloat64, kCPU, /*requires_grad=*/true));
  EXPECT_TRUE(r.is_leaf() && r.requires_grad());
  EXPECT_TRUE(a.is_leaf() && a.requires_grad());
  (r * a).backward(ones({3}, kFloat64));
  EXPECT_TRUE(matches(r.grad(), {3}, {0, 1, 2}));
}

// ---------------- dtypes ----------------

TEST_F(GradcheckPointwise, GradientsTakeTheDtypeOfTheirInput) {
  Tensor x = leaf(tensor<float>({0.5f, -1.0f, 2.0f}));
  Tensor w = leaf(tensor<double>({2.0, 3.0, 4.0}));
  (exp(x) * w).backward(ones({3}, kFloat64));
  EXPECT_EQ(x.grad().dtype(), kFloat32);
  EXPECT_EQ(w.grad().dtype(), kFloat64);
  EXPECT_TRUE(matches(x.grad(), {3}, {2 * std::exp(0.5), 3 * std::exp(-1.0), 4 * std::exp(2.0)}));
  EXPECT_TRUE(matches(w.grad(), {3}, {std::exp(0.5), std::exp(-1.0), std::exp(2.0)}, kiln::testing::Tolerance{1e-6, 1e-6}));
}

TEST_F(GradcheckPointwise, HalfPrecisionGeluAndSiluGradientsAreAccurate) {
  std::vector<double> xs = {-2.0, -0.5, 0.25, 1.5};
  for (DType t : {kFloat16, kBFloat16}) {
    SCOPED_TRACE(dtype_name(t));
    Tensor x = leaf(tensor<double>(xs).to(t));
    (gelu(x) + silu(x)).backward(ones({4}, t));
    EXPECT_EQ(x.grad().dtype(), t);
    std::vector<double> expected;
    for (double v : x.to_vector<double>()) {
      double gelu_d = 0.5 * (1 + std::erf(v * M_SQRT1_2)) + v * std::exp(-0.5 * v * v) / std::sqrt(2 * M_PI);
      double s = 1 / (1 + std::exp(-v));
      expected.push_back(gelu_d + s * (1 + v * (1 - s)));
    }
    EXPECT_TRUE(matches(x.grad(), {4}, expected));
  }
}

// ---------------- in-place forms ----------------

TEST_F(GradcheckPointwise, InPlaceMulOnANonLeafGivesBothOperandsTheirGradients) {
  Tensor x = leaf(randn({3}, kFloat64)), w = leaf(randn({3}, kFloat64));
  Tensor y = x * 1;
  y.mul_(w);
  EXPECT_EQ(y.grad_fn_name(), "MulBackward0");
  y.backward(ones({3}, kFloat64));
  EXPECT_TRUE(matches(x.grad(), {3}, w.detach().to_vector<double>()));
  EXPECT_TRUE(matches(w.grad(), {3}, x.detach().to_vector<double>()));
}

TEST_F(GradcheckPointwise, InPlaceOpOnItselfSavesThePreWriteValue) {
  Tensor x = leaf(tensor<double>({1.5, -2.0}));
  Tensor y = x.clone();
  y.mul_(y);  // y = x^2: both operands alias the target
  y.backward(ones({2}, kFloat64));
  EXPECT_TRUE(matches(x.grad(), {2}, {3.0, -4.0}));
}

TEST_F(GradcheckPointwise, ModifyingASavedResultInPlaceMakesBackwardThrow) {
  // exp saves its result; add_ changes it, so backward must refuse (as PyTorch does).
  Tensor x = leaf(randn({3}, kFloat64));
  Tensor y = x.exp();
  y.add_(1);
  EXPECT_EQ(y.grad_fn_name(), "AddBackward0");
  EXPECT_THROW(y.backward(ones({3}, kFloat64)), Error);
  // mul saves its inputs, not its result: changing the result is fine.
  Tensor z = x * 2;
  z.add_(1);
  z.backward(ones({3}, kFloat64));
  EXPECT_TRUE(matches(x.grad(), {3}, {2, 2, 2}));
}

TEST_F(GradcheckPointwise, InPlaceOnALeafThatRequiresGradThrows) {
  Tensor x = leaf(randn({3}, kFloat64));
  EXPECT_THROW(x.mul_(2), Error);
  EXPECT_THROW(x.exp_(), Error);
  EXPECT_THROW(x.clamp_(0, 1), Error);
}

TEST_F(GradcheckPointwise, InPlaceChainsMatchFiniteDifferences) {
  Tensor x = leaf(positive({2, 3})), w = leaf(positive({3})), v = leaf(away_from_zero({2, 3}));
  Tensor mask = tensor<bool>({false, true, false, false, false, true}).view({2, 3});
  // In-place ops that save their result (exp_, sqrt_, sigmoid_, tanh_, relu_) end a chain: a
  // later in-place op on that result would make backward throw, as in PyTorch.
  auto chain = [mask](const TensorList& in) {
    Tensor y = in[0] * 1;
    y.mul_(in[1]);
    y.add_(in[2], 0.5);
    y.sub_(in[1], 2);
    y.div_(in[1]);
    y.pow_(2);
    y.neg_();
    y.addcmul_(in[2], in[1], 0.25);
    y.addcdiv_(in[0], in[1], -1.5);
    y.lerp_(in[2], 0.3);
    y.masked_fill_(mask, 0.5);
    y.maximum_(in[2]);
    y.clamp_(-1.5, 1.5);
    y.mul_(3);
    y.tanh_();
    Tensor a = in[0] * in[1];
    a.exp_();
    Tensor b = in[0] + 1;
    b.sqrt_();
    Tensor c = in[2] - in[1];
    c.sigmoid_();
    Tensor d = in[2] * 2;
    d.relu_();
    return TensorList{y, a, b, c, d};
  };
  EXPECT_TRUE(grad_ok(chain, {x, w, v}));  // w broadcast along dim 0
  EXPECT_TRUE(gradgrad_ok(chain, {x, leaf(positive({2, 3})), v}));
}

TEST_F(GradcheckPointwise, InPlaceWithAFloat64OperandKeepsTheTargetsFloat32Gradient) {
  Tensor x = leaf(tensor<float>({1.0f, 2.0f}));
  Tensor w = leaf(tensor<double>({3.0, 4.0}));
  Tensor y = x * 1;
  y.mul_(w);  // float64 result written into the float32 target
  EXPECT_EQ(y.dtype(), kFloat32);
  y.backward(ones({2}, kFloat32));
  EXPECT_EQ(x.grad().dtype(), kFloat32);
  EXPECT_EQ(w.grad().dtype(), kFloat64);
  EXPECT_TRUE(matches(x.grad(), {2}, {3, 4}));
  EXPECT_TRUE(matches(w.grad(), {2}, {1, 2}));
}

}  // namespace
