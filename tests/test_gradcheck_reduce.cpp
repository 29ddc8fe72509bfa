// Derivatives of the reductions: autograd::gradcheck (float64 finite differences) for every
// differentiable reduction over several dims / keepdim / negative dims / all dims and on
// non-contiguous inputs; gradgradcheck for the composite formulas (sum, mean, prod incl. zeros,
// softmax, log_softmax, logsumexp, var, std, norm, cumsum); PyTorch's subgradient conventions
// (ties of max/min/amax split evenly, the zero-norm and zero-std gradients, prod with zeros);
// the fused softmax and log_softmax backward kernels in every floating dtype against a float64
// reference
// (rows short and long, columns, sizes split across threads); cross_entropy end to end.
#include <cmath>
#include <limits>

#include "reference.h"

using namespace kiln;
using kiln::testing::matches;
using kiln::testing::values;
using kiln::testing::grad_ok;
using kiln::testing::gradgrad_ok;
using kiln::testing::close_to;

namespace {

Tensor rnd(const std::vector<int64_t>& sizes) { return randn(sizes, kFloat64).requires_grad_(); }

// A (rows, cols) float64 leaf stored transposed (non-contiguous).
Tensor rnd_t(int64_t rows, int64_t cols) { return randn({cols, rows}, kFloat64).t().requires_grad_(); }

// Single-input function from a unary map.
autograd::Function unary(std::function<Tensor(const Tensor&)> f) {
  return [f](const TensorList& in) { return TensorList{f(in[0])}; };
}

// Gradient of sum(f(x) * w) for weights w that vary from element to element (so that every
// output element matters and a row's weights do not nearly cancel).
Tensor grad_of(const Tensor& x0, const std::function<Tensor(const Tensor&)>& f) {
  Tensor x = x0.detach().clone().requires_grad_();
  Tensor y = f(x);
  int64_t n = y.numel();
  Tensor w = sin(linspace(0, 3.0 * static_cast<double>(n), std::max<int64_t>(n, 1), kFloat64)).narrow(0, 0, n);
  y.backward(w.view(y.sizes()).to(y.dtype()));
  return x.grad();
}

using DimsCase = std::pair<std::vector<int64_t>, bool>;
const std::vector<DimsCase> kDimsCases = {
    {{}, false}, {{}, true}, {{0}, false}, {{1}, true}, {{-1}, false}, {{0, 2}, false}, {{-1, 0}, true},
};

}  // namespace

// ---------------- sum, mean ----------------

TEST(GradcheckReduce, SumOverDimsKeepdimNegativeAndAll) {
  manual_seed(1);
  for (const auto& [dims, keep] : kDimsCases) {
    EXPECT_TRUE(grad_ok(unary([&](const Tensor& x) { return x.sum(dims, keep); }), {rnd({2, 3, 2})}))
        << shape_str(dims) << " keepdim " << keep;
  }
  EXPECT_TRUE(grad_ok(unary([](const Tensor& x) { return x.sum({0}); }), {rnd_t(3, 4)}));
  EXPECT_TRUE(grad_ok(unary([](const Tensor& x) { return x.sum(); }), {rnd({})}));
  EXPECT_TRUE(grad_ok(unary([](const Tensor& x) { return x.sum({0}, false, kFloat64); }), {rnd({3, 2})}));
}

TEST(GradcheckReduce, SumGradIsOnesExpandedOverReducedDims) {
  Tensor x = zeros({2, 3}, kFloat32).requires_grad_();
  x.sum({1}).backward(tensor<float>({2.0f, -1.0f}));
  EXPECT_EQ(x.grad().dtype(), kFloat32);
  EXPECT_TRUE(matches(x.grad(), {2, 3}, {2, 2, 2, -1, -1, -1}));
}

TEST(GradcheckReduce, MeanOverDimsKeepdimNegativeAndAll) {
  manual_seed(2);
  for (const auto& [dims, keep] : kDimsCases) {
    EXPECT_TRUE(grad_ok(unary([&](const Tensor& x) { return x.mean(dims, keep); }), {rnd({2, 3, 2})}))
        << shape_str(dims) << " keepdim " << keep;
  }
  EXPECT_TRUE(grad_ok(unary([](const Tensor& x) { return x.mean({1}); }), {rnd_t(3, 4)}));
  EXPECT_TRUE(grad_ok(unary([](const Tensor& x) { return x.mean(); }), {rnd({})}));
  Tensor x = zeros({2, 4}, kFloat32).requires_grad_();
  x.mean().backward();
  EXPECT_TRUE(matches(x.grad(), {2, 4}, std::vector<double>(8, 0.125)));
}

TEST(GradgradcheckReduce, SumAndMean) {
  manual_seed(3);
  // Squared so that the second derivative is not identically zero.
  EXPECT_TRUE(gradgrad_ok(unary([](const Tensor& x) { return (x * x).sum({1}); }), {rnd({2, 3})}));
  EXPECT_TRUE(gradgrad_ok(unary([](const Tensor& x) { return x.sum({0, -1}, true) * x; }), {rnd({2, 2, 2})}));
  EXPECT_TRUE(gradgrad_ok(unary([](const Tensor& x) { return x.mean({-1}) * x.mean(); }), {rnd({3, 2})}));
  EXPECT_TRUE(gradgrad_ok(unary([](const Tensor& x) { return x.mean({0}, true) * x; }), {rnd_t(2, 3)}));
}

// ---------------- prod ----------------

TEST(GradcheckReduce, ProdWithoutZeros) {
  manual_seed(4);
  auto all = unary([](const Tensor& x) { return x.prod(); });
  EXPECT_TRUE(grad_ok(all, {rnd({2, 3})}));
  EXPECT_TRUE(grad_ok(all, {rnd({})}));
  EXPECT_TRUE(grad_ok(unary([](const Tensor& x) { return x.prod(1); }), {rnd({2, 3})}));
  EXPECT_TRUE(grad_ok(unary([](const Tensor& x) { return x.prod(-1, true); }), {rnd({2, 3})}));
  EXPECT_TRUE(grad_ok(unary([](const Tensor& x) { return x.prod(0); }), {rnd_t(3, 2)}));
  EXPECT_TRUE(grad_ok(unary([](const Tensor& x) { return x.prod({}, true); }), {rnd({2, 2})}));
  EXPECT_TRUE(gradgrad_ok(unary([](const Tensor& x) { return x.prod(1); }), {rnd({2, 3})}));
}

TEST(GradcheckReduce, ProdWithOneAndTwoZerosMatchesPyTorch) {
  // Row 0 has one zero, row 1 two, row 2 none.
  Tensor x = tensor<double>({2, 0, 3, 0, 5, 0, 1.5, -2, 4}, {3, 3}).requires_grad_();
  x.prod(1).backward(tensor<double>({1, 1, 1}));
  EXPECT_TRUE(matches(x.grad(), {3, 3}, {0, 6, 0, 0, 0, 0, -8, 6, -3}));
  Tensor y = tensor<double>({2, 0, 3, 4}).requires_grad_();
  y.prod().backward();
  EXPECT_TRUE(matches(y.grad(), {4}, {0, 24, 0, 0}));
  // Finite differences agree through the zeros (prod is a polynomial), to second order too.
  auto rows = unary([](const Tensor& t) { return t.prod(1); });
  auto cols = unary([](const Tensor& t) { return t.prod(0, true); });
  Tensor z = tensor<double>({2, 0, 3, 0, 5, 0, 1.5, -2, 4, 0.5, 0, 0}, {3, 4}).requires_grad_();
  EXPECT_TRUE(grad_ok(rows, {z}));
  EXPECT_TRUE(grad_ok(cols, {z}));
  EXPECT_TRUE(gradgrad_ok(rows, {z}));
  EXPECT_TRUE(gradgrad_ok(cols, {z}));
  EXPECT_TRUE(gradgrad_ok(unary([](const Tensor& t) { return t.prod(); }),
                          {tensor<double>({1.5, 0, -2, 0.5}).requires_grad_()}));
}

// ---------------- max, min, amax, amin ----------------

TEST(GradcheckReduce, MaxMinAllElements) {
  manual_seed(5);
  EXPECT_TRUE(grad_ok(unary([](const Tensor& x) { return x.max(); }), {rnd({3, 4})}));
  EXPECT_TRUE(grad_ok(unary([](const Tensor& x) { return x.min(); }), {rnd_t(3, 4)}));
  EXPECT_TRUE(grad_ok(unary([](const Tensor& x) { return x.max(); }), {rnd({})}));
}

TEST(GradcheckReduce, MaxMinAllElementsSplitTiesEvenly) {
  Tensor x = tensor<double>({1, 3, 3, 2, 3, -1}, {2, 3}).requires_grad_();
  x.max().backward(scalar_tensor(6.0, kFloat64));
  EXPECT_TRUE(matches(x.grad(), {2, 3}, {0, 2, 2, 0, 2, 0}));
  Tensor y = tensor<float>({-1, 3, -1}).requires_grad_();
  y.min().backward();
  EXPECT_EQ(y.grad().dtype(), kFloat32);
  EXPECT_TRUE(matches(y.grad(), {3}, {0.5, 0, 0.5}));
  // A NaN maximum sends the gradient to the NaN elements.
  double nan = std::numeric_limits<double>::quiet_NaN();
  Tensor z = tensor<double>({1, nan, 5}).requires_grad_();
  z.max().backward();
  EXPECT_TRUE(matches(z.grad(), {3}, {0, 1, 0}));
}

TEST(GradcheckReduce, MaxMinDimScatterToIndices) {
  manual_seed(6);
  for (int64_t dim : {0, 1, -1}) {
    for (bool keep : {false, true}) {
      EXPECT_TRUE(grad_ok(unary([&](const Tensor& x) { return std::get<0>(x.max(dim, keep)); }), {rnd({3, 4})}));
      EXPECT_TRUE(grad_ok(unary([&](const Tensor& x) { return std::get<0>(x.min(dim, keep)); }), {rnd_t(3, 4)}));
    }
  }
  EXPECT_TRUE(grad_ok(unary([](const Tensor& x) { return std::get<0>(x.max(0)); }), {rnd({})}));
  EXPECT_TRUE(grad_ok(unary([](const Tensor& x) { return std::get<0>(x.max(1)); }), {rnd({2, 3, 2})}));
  EXPECT_TRUE(gradgrad_ok(unary([](const Tensor& x) { return std::get<0>(x.min(1)) * x.sum({1}); }), {rnd({2, 3})}));
  // Ties: the whole gradient goes to the returned index (the first one, as in PyTorch's CPU max).
  Tensor x = tensor<double>({2, 2, 1, 0, 4, 4}, {2, 3}).requires_grad_();
  auto [values_, indices] = x.max(1);
  EXPECT_FALSE(indices.requires_grad());
  values_.backward(tensor<double>({1, 1}));
  std::vector<double> expected(6, 0.0);
  auto idx = indices.to_vector<int64_t>();
  expected[idx[0]] = 1;
  expected[3 + idx[1]] = 1;
  EXPECT_TRUE(matches(x.grad(), {2, 3}, expected));
}

TEST(GradcheckReduce, AmaxAminOverDims) {
  manual_seed(7);
  for (const auto& [dims, keep] : kDimsCases) {
    EXPECT_TRUE(grad_ok(unary([&](const Tensor& x) { return x.amax(dims, keep); }), {rnd({2, 3, 2})}))
        << shape_str(dims) << " keepdim " << keep;
    EXPECT_TRUE(grad_ok(unary([&](const Tensor& x) { return x.amin(dims, keep); }), {rnd({2, 3, 2})}))
        << shape_str(dims) << " keepdim " << keep;
  }
  EXPECT_TRUE(grad_ok(unary([](const Tensor& x) { return x.amax({0}); }), {rnd_t(3, 2)}));
}

TEST(GradcheckReduce, AmaxAminSplitTiesEvenlyPerSlice) {
  Tensor x = tensor<double>({5, 1, 5, 2, 2, 2}, {2, 3}).requires_grad_();
  x.amax({1}).backward(tensor<double>({1, 3}));
  EXPECT_TRUE(matches(x.grad(), {2, 3}, {0.5, 0, 0.5, 1, 1, 1}));
  Tensor y = tensor<double>({5, 1, 1, 2}, {2, 2}).requires_grad_();
  y.amin().backward();
  EXPECT_TRUE(matches(y.grad(), {2, 2}, {0, 0.5, 0.5, 0}));
}

TEST(GradcheckReduce, IndexAndBoolReductionsAreNotDifferentiable) {
  Tensor x = rnd({2, 3});
  EXPECT_FALSE(x.argmax().requires_grad());
  EXPECT_FALSE(x.argmin(1).requires_grad());
  EXPECT_FALSE(any(x).requires_grad());
  EXPECT_FALSE(all(x, 0).requires_grad());
}

// ---------------- var, std, var_mean ----------------

TEST(GradcheckReduce, VarStdOverDimsAndCorrections) {
  manual_seed(8);
  for (const auto& [dims, keep] : kDimsCases) {
    for (int64_t corr : {0, 1, 2}) {
      EXPECT_TRUE(grad_ok(unary([&](const Tensor& x) { return x.var(dims, corr, keep); }), {rnd({3, 3, 3})}))
          << shape_str(dims) << " correction " << corr << " keepdim " << keep;
      EXPECT_TRUE(grad_ok(unary([&](const Tensor& x) { return x.std(dims, corr, keep); }), {rnd({3, 3, 3})}))
          << shape_str(dims) << " correction " << corr << " keepdim " << keep;
    }
  }
  EXPECT_TRUE(grad_ok(unary([](const Tensor& x) { return x.var({0}); }), {rnd_t(4, 3)}));
  EXPECT_TRUE(grad_ok(unary([](const Tensor& x) { return x.std({1}, 0, true); }), {rnd_t(4, 3)}));
}

// Issue 18.19: PyTorch's var_mean_backward skips the variance term when only the mean is used:
// with correction = N its factor 2 / (N - correction) is infinite and inf * 0 would be NaN.
TEST(GradcheckReduce, VarMeanTermsOnlyForOutputsThatGetAGradient) {
  for (std::vector<int64_t> dims : {std::vector<int64_t>{0}, std::vector<int64_t>{}}) {
    Tensor x = tensor<double>({1, 2, 3, 4, 5}).requires_grad_();
    auto [v, m] = var_mean(x, dims, /*correction=*/5);
    m.backward();
    EXPECT_TRUE(matches(x.grad(), {5}, {0.2, 0.2, 0.2, 0.2, 0.2})) << shape_str(dims);
  }
  Tensor f = tensor<float>({1, 2, 3, 4, 5}).requires_grad_();
  std::get<1>(var_mean(f, {0}, 5, /*keepdim=*/true)).sum().backward();
  EXPECT_TRUE(matches(f.grad(), {5}, {0.2, 0.2, 0.2, 0.2, 0.2}));
  // Only the variance used: 2 / (N - 1) * (x - mean); the mean's term is not added.
  Tensor y = tensor<double>({1, 2, 3, 4, 5}).requires_grad_();
  std::get<0>(var_mean(y, {0}, 1)).backward();
  EXPECT_TRUE(matches(y.grad(), {5}, {-1, -0.5, 0, 0.5, 1}));
}

TEST(GradcheckReduce, VarMeanBothOutputs) {
  manual_seed(9);
  autograd::Function f = [](const TensorList& in) {
    auto [v, m] = var_mean(in[0], {1}, 1, false);
    return TensorList{v, m};
  };
  autograd::Function g = [](const TensorList& in) {
    auto [v, m] = var_mean(in[0], {}, 0, true);
    return TensorList{v * m};
  };
  EXPECT_TRUE(grad_ok(f, {rnd({3, 4})}));
  EXPECT_TRUE(grad_ok(g, {rnd_t(2, 3)}));
  EXPECT_TRUE(gradgrad_ok(f, {rnd({2, 3})}));
}

TEST(GradgradcheckReduce, VarAndStd) {
  manual_seed(10);
  EXPECT_TRUE(gradgrad_ok(unary([](const Tensor& x) { return x.var({1}); }), {rnd({2, 4})}));
  EXPECT_TRUE(gradgrad_ok(unary([](const Tensor& x) { return x.var({}, 0); }), {rnd({3, 2})}));
  EXPECT_TRUE(gradgrad_ok(unary([](const Tensor& x) { return x.std({0}, 1, true); }), {rnd({3, 2})}));
}

TEST(GradcheckReduce, StdOfConstantSliceHasZeroGradAndVarOfOneElementNaN) {
  // PyTorch: std == 0 gives 0 (masked), var over all elements with N <= correction gives NaN
  // where x == mean.
  Tensor x = tensor<double>({2, 2, 2, 1, 3, 5}, {2, 3}).requires_grad_();
  x.std({1}).backward(tensor<double>({1, 1}));
  EXPECT_TRUE(matches(x.grad(), {2, 3}, {0, 0, 0, -0.5, 0, 0.5}));
  Tensor y = tensor<double>({4}).requires_grad_();
  y.var().backward();
  EXPECT_TRUE(std::isnan(y.grad().item<double>()));
}

// ---------------- norm ----------------

TEST(GradcheckReduce, NormForEveryOrder) {
  manual_seed(11);
  const double inf = std::numeric_limits<double>::infinity();
  for (double p : {2.0, 1.0, inf, -inf, 3.0, 1.5, 0.5, 4.0}) {
    for (const auto& [dims, keep] : std::vector<DimsCase>{{{}, false}, {{1}, false}, {{-1, 0}, true}}) {
      EXPECT_TRUE(grad_ok(unary([&](const Tensor& x) { return x.norm(p, dims, keep); }), {rnd({2, 3})}))
          << "p " << p << " dims " << shape_str(dims) << " keepdim " << keep;
    }
    EXPECT_TRUE(grad_ok(unary([&](const Tensor& x) { return x.norm(p, {0}); }), {rnd_t(3, 2)})) << "p " << p;
  }
  EXPECT_TRUE(gradgrad_ok(unary([](const Tensor& x) { return x.norm(2, {1}); }), {rnd({2, 3})}));
  EXPECT_TRUE(gradgrad_ok(unary([](const Tensor& x) { return x.norm(3); }), {rnd({2, 2})}));
}

TEST(GradcheckReduce, NormSubgradientsAtZero) {
  // p = 2: 0 where the norm is 0; p = 1: sign(0) = 0; p = 0: zero gradient; p = 3 with a zero
  // norm: 0; inf: the gradient split among the maxima of |x|, with their signs.
  Tensor x = tensor<double>({0, 0, 0, 3, -4, 0}, {2, 3}).requires_grad_();
  x.norm(2, {1}).backward(tensor<double>({1, 1}));
  EXPECT_TRUE(matches(x.grad(), {2, 3}, {0, 0, 0, 0.6, -0.8, 0}));
  for (double p : {1.0, 0.0, 3.0}) {
    Tensor z = zeros({3}, kFloat64).requires_grad_();
    z.norm(p).backward();
    EXPECT_TRUE(matches(z.grad(), {3}, {0, 0, 0})) << "p " << p;
  }
  Tensor y = tensor<double>({-2, 2, 1}).requires_grad_();
  y.norm(std::numeric_limits<double>::infinity()).backward();
  EXPECT_TRUE(matches(y.grad(), {3}, {-0.5, 0.5, 0}));
}

// ---------------- logsumexp, cumsum ----------------

TEST(GradcheckReduce, LogsumexpOverDims) {
  manual_seed(12);
  for (const auto& [dims, keep] : std::vector<DimsCase>{{{0}, false}, {{-1}, true}, {{0, 2}, false}, {{1, 0, 2}, true}}) {
    EXPECT_TRUE(grad_ok(unary([&](const Tensor& x) { return x.logsumexp(dims, keep); }), {rnd({2, 3, 2})}))
        << shape_str(dims) << " keepdim " << keep;
  }
  EXPECT_TRUE(grad_ok(unary([](const Tensor& x) { return x.logsumexp({1}); }), {rnd_t(3, 4)}));
  EXPECT_TRUE(gradgrad_ok(unary([](const Tensor& x) { return x.logsumexp({1}); }), {rnd({2, 3})}));
  EXPECT_TRUE(gradgrad_ok(unary([](const Tensor& x) { return x.logsumexp({0, 1}, true); }), {rnd({2, 2})}));
}

TEST(GradcheckReduce, CumsumAlongEachDim) {
  manual_seed(13);
  for (int64_t dim : {0, 1, 2, -1, -3}) {
    EXPECT_TRUE(grad_ok(unary([&](const Tensor& x) { return x.cumsum(dim); }), {rnd({3, 2, 4})})) << dim;
  }
  EXPECT_TRUE(grad_ok(unary([](const Tensor& x) { return x.cumsum(0); }), {rnd_t(4, 3)}));
  EXPECT_TRUE(grad_ok(unary([](const Tensor& x) { return x.cumsum(0); }), {rnd({})}));
  EXPECT_TRUE(grad_ok(unary([](const Tensor& x) { return x.cumsum(1); }), {rnd({3, 1})}));
  EXPECT_TRUE(gradgrad_ok(unary([](const Tensor& x) { return x.cumsum(1) * x; }), {rnd({2, 3})}));
  // The reversed cumulative sum of the gradient.
  Tensor x = zeros({4}, kFloat32).requires_grad_();
  x.cumsum(0).backward(tensor<float>({1, 2, 3, 4}));
  EXPECT_TRUE(matches(x.grad(), {4}, {10, 9, 7, 4}));
}

// ---------------- softmax, log_softmax ----------------

TEST(GradcheckReduce, SoftmaxAndLogSoftmaxAlongEachDim) {
  manual_seed(14);
  for (int64_t dim : {0, 1, 2, -1}) {
    EXPECT_TRUE(grad_ok(unary([&](const Tensor& x) { return softmax(x, dim); }), {rnd({2, 3, 4})})) << dim;
    EXPECT_TRUE(grad_ok(unary([&](const Tensor& x) { return log_softmax(x, dim); }), {rnd({2, 3, 4})})) << dim;
  }
  EXPECT_TRUE(grad_ok(unary([](const Tensor& x) { return softmax(x, 0); }), {rnd_t(3, 4)}));
  EXPECT_TRUE(grad_ok(unary([](const Tensor& x) { return log_softmax(x, 1); }), {rnd_t(3, 4)}));
  EXPECT_TRUE(grad_ok(unary([](const Tensor& x) { return softmax(x, 0); }), {rnd({})}));
  EXPECT_TRUE(grad_ok(unary([](const Tensor& x) { return log_softmax(x, -1); }), {rnd({})}));
  // A long row (the non-blocked row path).
  EXPECT_TRUE(grad_ok(unary([](const Tensor& x) { return log_softmax(x, 1); }), {rnd({1, 40})}));
  EXPECT_TRUE(grad_ok(unary([](const Tensor& x) { return softmax(x, 1); }), {rnd({1, 40})}));
}

TEST(GradgradcheckReduce, SoftmaxAndLogSoftmax) {
  manual_seed(15);
  for (int64_t dim : {1, 0}) {
    EXPECT_TRUE(gradgrad_ok(unary([&](const Tensor& x) { return softmax(x, dim); }), {rnd({2, 3})})) << dim;
    EXPECT_TRUE(gradgrad_ok(unary([&](const Tensor& x) { return log_softmax(x, dim); }), {rnd({2, 3})})) << dim;
  }
  EXPECT_TRUE(gradgrad_ok(unary([](const Tensor& x) { return softmax(x, -1); }), {rnd_t(2, 3)}));
  // Third order: gradcheck of the backward table ops' own derivatives, both inputs.
  autograd::Function sb = [](const TensorList& in) {
    const OpDef* op = OpTable::instance().find("_softmax_backward_data");
    return TensorList{call_op1(*op, {in[0], in[1]}, {int64_t{1}, kFloat64})};
  };
  autograd::Function lsb = [](const TensorList& in) {
    const OpDef* op = OpTable::instance().find("_log_softmax_backward_data");
    return TensorList{call_op1(*op, {in[0], in[1]}, {int64_t{0}, kFloat64})};
  };
  EXPECT_TRUE(grad_ok(sb, {rnd({2, 3}), rnd({2, 3})}));
  EXPECT_TRUE(grad_ok(lsb, {rnd({3, 2}), rnd({3, 2})}));
  EXPECT_TRUE(gradgrad_ok(sb, {rnd({2, 3}), rnd({2, 3})}));
  EXPECT_TRUE(gradgrad_ok(lsb, {rnd({3, 2}), rnd({3, 2})}));
}

// Float64 reference of the backward table ops, by hand over (outer, D, inner).
std::vector<double> softmax_backward_ref(const Tensor& g, const Tensor& y, int64_t dim, bool log) {
  auto gv = values(g), yv = values(y);
  int64_t outer = 1, n = y.size(dim), inner = 1;
  for (int64_t d = 0; d < dim; ++d) outer *= y.size(d);
  for (int64_t d = dim + 1; d < y.dim(); ++d) inner *= y.size(d);
  std::vector<double> out(gv.size());
  for (int64_t o = 0; o < outer; ++o) {
    for (int64_t j = 0; j < inner; ++j) {
      auto at = [&](int64_t k) { return static_cast<size_t>((o * n + k) * inner + j); };
      double s = 0;
      for (int64_t k = 0; k < n; ++k) s += log ? gv[at(k)] : gv[at(k)] * yv[at(k)];
      for (int64_t k = 0; k < n; ++k)
        out[at(k)] = log ? gv[at(k)] - std::exp(yv[at(k)]) * s : yv[at(k)] * (gv[at(k)] - s);
    }
  }
  return out;
}

TEST(GradcheckReduce, SoftmaxBackwardKernelsMatchFloat64Reference) {
  manual_seed(16);
  // Short rows (blocked), long rows, columns (dim not innermost), and sizes that split across
  // threads.
  const std::vector<std::pair<std::vector<int64_t>, int64_t>> cases = {
      {{7, 10}, 1}, {{300, 10}, 1}, {{5, 1000}, 1}, {{64, 2000}, 1}, {{4, 9, 5}, 1},
      {{3, 50, 700}, 1}, {{600, 3}, 0}, {{2, 3, 4, 5}, 2}, {{1, 1}, 0},
  };
  for (const auto& [sizes, dim] : cases) {
    for (bool log : {false, true}) {
      const OpDef* op = OpTable::instance().find(log ? "_log_softmax_backward_data" : "_softmax_backward_data");
      for (DType t : {kFloat64, kFloat32, kBFloat16, kFloat16}) {
        Tensor x = (randn(sizes, kFloat64) * 3).to(t);
        Tensor y = log ? log_softmax(x, dim) : softmax(x, dim);
        Tensor g = randn(sizes, kFloat64).to(t);
        Tensor got = call_op1(*op, {g, y}, {dim, t});
        EXPECT_EQ(got.dtype(), t);
        Tensor want = tensor<double>(softmax_backward_ref(g, y, dim, log), sizes);
        double rel = t == kFloat64 ? 1e-12 : t == kFloat32 ? 2e-6 : t == kFloat16 ? 2e-3 : 1e-2;
        EXPECT_TRUE(close_to(got, want, rel)) << shape_str(sizes) << " dim " << dim << " log " << log << " "
                                             << dtype_name(t);
      }
      // Non-contiguous operands (the transposed layout of the same values).
      Tensor x = randn(sizes, kFloat32);
      Tensor y = (log ? log_softmax(x, dim) : softmax(x, dim)).transpose(0, -1).contiguous().transpose(0, -1);
      Tensor g = randn(sizes, kFloat32).transpose(0, -1).contiguous().transpose(0, -1);
      Tensor got = call_op1(*op, {g, y}, {dim, kFloat32});
      EXPECT_TRUE(close_to(got, tensor<double>(softmax_backward_ref(g, y, dim, log), sizes), 2e-6));
    }
  }
}

TEST(GradcheckReduce, SoftmaxFloat32GradientsMatchFloat64) {
  manual_seed(19);
  for (const auto& [sizes, dim] : std::vector<std::pair<std::vector<int64_t>, int64_t>>{
           {{300, 10}, 1}, {{8, 700}, -1}, {{3, 40, 20}, 1}}) {
    Tensor x = randn(sizes, kFloat64) * 3;
    for (bool log : {false, true}) {
      auto f = [&, d = dim](const Tensor& t) { return log ? log_softmax(t, d) : softmax(t, d); };
      Tensor want = grad_of(x, f);
      Tensor got = grad_of(x.to(kFloat32), f);
      EXPECT_EQ(got.dtype(), kFloat32);
      // The float32 forward output enters the backward: a few float32 ulp of the scale.
      EXPECT_TRUE(close_to(got, want, 2e-5)) << shape_str(sizes) << " dim " << dim << " log " << log;
    }
  }
}

TEST(GradcheckReduce, SoftmaxWithDtypeGivesGradInInputDtype) {
  manual_seed(17);
  Tensor x = randn({3, 5}, kFloat32);
  for (bool log : {false, true}) {
    auto f64 = [log](const Tensor& t) { return log ? log_softmax(t, 1, kFloat64) : softmax(t, 1, kFloat64); };
    Tensor got = grad_of(x, f64);
    EXPECT_EQ(got.dtype(), kFloat32);
    auto plain = [log](const Tensor& t) { return log ? log_softmax(t, 1) : softmax(t, 1); };
    EXPECT_TRUE(close_to(got, grad_of(x.to(kFloat64), plain), 1e-6));
  }
  EXPECT_TRUE(grad_ok(unary([](const Tensor& x) { return softmax(x, 0, kFloat64); }), {rnd({3, 2})}));
}

TEST(GradcheckReduce, SoftmaxBackwardOnEmptyInput) {
  Tensor x = zeros({0, 4}, kFloat32).requires_grad_();
  softmax(x, 1).sum().backward();
  EXPECT_EQ(x.grad().sizes().vec(), (std::vector<int64_t>{0, 4}));
  Tensor y = zeros({3, 0}, kFloat32).requires_grad_();
  log_softmax(y, 0).sum().backward();
  EXPECT_EQ(y.grad().sizes().vec(), (std::vector<int64_t>{3, 0}));
}

TEST(GradcheckReduce, SoftmaxBackwardOpRejectsBadInputs) {
  const OpDef* op = OpTable::instance().find("_softmax_backward_data");
  ASSERT_NE(op, nullptr);
  Tensor y = rand({2, 3});
  EXPECT_THROW(call_op1(*op, {rand({2, 3}, kFloat64), y}, {int64_t{1}, kFloat32}), DTypeError);
  EXPECT_THROW(call_op1(*op, {rand({3, 2}), y}, {int64_t{1}, kFloat32}), ShapeError);
  EXPECT_THROW(call_op1(*op, {rand({2, 3}), y}, {int64_t{2}, kFloat32}), IndexError);
  EXPECT_THROW(call_op1(*op, {rand({2, 3}), y}, {int64_t{1}, kInt64}), DTypeError);
}

// ---------------- cross_entropy ----------------

TEST(GradcheckReduce, CrossEntropyEndToEnd) {
  manual_seed(18);
  Tensor target = tensor<int64_t>({0, 2, 1, 2});
  for (Reduction r : {Reduction::mean, Reduction::sum, Reduction::none}) {
    EXPECT_TRUE(grad_ok(unary([&](const Tensor& x) { return cross_entropy(x, target, Tensor(), -100, r); }),
                        {rnd({4, 3})}));
  }
  // Label smoothing, ignore_index, a class weight, a spatial (N, C, d) input.
  EXPECT_TRUE(grad_ok(unary([&](const Tensor& x) { return cross_entropy(x, target, Tensor(), 1, Reduction::mean, 0.1); }),
                      {rnd({4, 3})}));
  Tensor w = tensor<double>({0.5, 2.0, 1.0});
  EXPECT_TRUE(grad_ok(unary([&](const Tensor& x) { return cross_entropy(x, target, w); }), {rnd({4, 3})}));
  Tensor t2 = tensor<int64_t>({0, 2, 1, 1}, {2, 2});
  EXPECT_TRUE(grad_ok(unary([&](const Tensor& x) { return cross_entropy(x, t2); }), {rnd({2, 3, 2})}));
  // softmax(x) - onehot, averaged: the classic closed form.
  Tensor x = randn({4, 3}, kFloat32).requires_grad_();
  cross_entropy(x, target).backward();
  Tensor want = (softmax(x.detach().to(kFloat64), 1) - one_hot(target, 3).to(kFloat64)) / 4.0;
  EXPECT_TRUE(close_to(x.grad(), want, 1e-6));
}
