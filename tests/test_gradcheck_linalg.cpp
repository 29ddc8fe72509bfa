// Derivatives of the linear-algebra ops: autograd::gradcheck (float64 finite differences) for mm,
// bmm, addmm (beta/alpha, broadcast self), dot and the matmul/linear/outer front-ends over them
// (1-D operands, folded and broadcast batch dims), gradgradcheck for each (their derivatives are
// built of the same GEMM ops), and direct checks of gradient values, layouts and dtypes.
#include "reference.h"

using namespace kiln;
using kiln::testing::matches;
using kiln::testing::values;
using kiln::testing::grad_ok;
using kiln::testing::gradgrad_ok;

namespace {

// Backpropagates ones from y (the gradient of y.sum(), without needing sum's derivative).
void backward_ones(const Tensor& y) { y.backward(ones_like(y)); }

Tensor rnd(const std::vector<int64_t>& sizes) { return randn(sizes, kFloat64).requires_grad_(); }

// y * y: makes a bilinear op's gradient depend on its own inputs, so that gradgradcheck also
// exercises the derivative of the derivative's products.
Tensor sq(const Tensor& y) { return y * y; }

// Both checks for a function of two inputs.
void check_binary(const std::function<Tensor(const Tensor&, const Tensor&)>& f, const Tensor& a, const Tensor& b) {
  autograd::Function fn = [&](const TensorList& in) { return TensorList{f(in[0], in[1])}; };
  autograd::Function fn_sq = [&](const TensorList& in) { return TensorList{sq(f(in[0], in[1]))}; };
  EXPECT_TRUE(grad_ok(fn, {a, b}));
  EXPECT_TRUE(gradgrad_ok(fn_sq, {a, b}));
}

}  // namespace

TEST(GradcheckLinalg, MmIncludingTransposedOperands) {
  manual_seed(1);
  auto f = [](const Tensor& a, const Tensor& b) { return mm(a, b); };
  check_binary(f, rnd({3, 4}), rnd({4, 2}));
  // Column-major operands take the transposed-product branch of the derivative.
  check_binary(f, rnd({4, 3}).t(), rnd({2, 4}).t());
  // A row-sliced (strided) operand and a 1 x n product.
  check_binary(f, rnd({1, 5}), rnd({10, 3}).slice(0, 0, std::nullopt, 2));
}

TEST(GradcheckLinalg, MmGradientValuesAndLayout) {
  // d(sum(a @ b))/da = ones @ b^T, d/db = a^T @ ones.
  Tensor a = tensor<float>({1, 2, 3, 4, 5, 6}, {2, 3}).requires_grad_();
  Tensor b = tensor<float>({1, -1, 2, 0, 3, 1}, {3, 2}).requires_grad_();
  backward_ones(mm(a, b));
  EXPECT_EQ(a.grad().dtype(), kFloat32);
  EXPECT_TRUE(matches(a.grad(), {2, 3}, {0, 2, 4, 0, 2, 4}));
  EXPECT_TRUE(matches(b.grad(), {3, 2}, {5, 5, 7, 7, 9, 9}));
  // The gradient of a transposed leaf view comes out laid out like the view (contiguous after
  // the transpose back), as aten's mm_mat2_backward arranges.
  Tensor w = randn({4, 3}).requires_grad_();
  Tensor x = randn({5, 3});
  backward_ones(mm(x, w.t()));
  EXPECT_TRUE(w.grad().is_contiguous());
  EXPECT_TRUE(matches(w.grad(), {4, 3}, values(x.sum({0}).unsqueeze(0).expand({4, 3}))));
}

TEST(GradcheckLinalg, Bmm) {
  manual_seed(2);
  auto f = [](const Tensor& a, const Tensor& b) { return bmm(a, b); };
  check_binary(f, rnd({2, 3, 4}), rnd({2, 4, 2}));
  check_binary(f, rnd({2, 4, 3}).transpose(1, 2), rnd({3, 2, 4}).permute({1, 2, 0}));
}

TEST(GradcheckLinalg, AddmmWithBetaAlphaAndBroadcastSelf) {
  manual_seed(3);
  for (auto [beta, alpha] : {std::pair{1.0, 1.0}, std::pair{0.5, 2.0}, std::pair{-1.5, 0.25}}) {
    autograd::Function full = [&](const TensorList& in) { return TensorList{addmm(in[0], in[1], in[2], beta, alpha)}; };
    EXPECT_TRUE(grad_ok(full, {rnd({3, 2}), rnd({3, 4}), rnd({4, 2})}));
    // A 1-D bias broadcast over rows (linear's case) and a (3, 1) column.
    EXPECT_TRUE(grad_ok(full, {rnd({2}), rnd({3, 4}), rnd({2, 4}).t()}));
    EXPECT_TRUE(grad_ok(full, {rnd({3, 1}), rnd({4, 3}).t(), rnd({4, 2})}));
    autograd::Function squared = [&](const TensorList& in) {
      return TensorList{sq(addmm(in[0], in[1], in[2], beta, alpha))};
    };
    EXPECT_TRUE(gradgrad_ok(squared, {rnd({2}), rnd({3, 4}), rnd({4, 2})}));
  }
}

TEST(GradcheckLinalg, AddmmBetaZeroGivesSelfAZeroGradient) {
  Tensor self = randn({2, 2}, kFloat64).requires_grad_();
  Tensor a = randn({2, 3}, kFloat64).requires_grad_();
  Tensor b = randn({3, 2}, kFloat64).requires_grad_();
  backward_ones(addmm(self, a, b, 0.0, 3.0));
  EXPECT_TRUE(matches(self.grad(), {2, 2}, {0, 0, 0, 0}));
  // alpha scales the matrix gradients: d/da = alpha * ones @ b^T.
  EXPECT_TRUE(matches(a.grad(), {2, 3}, values(mm(ones({2, 2}, kFloat64), b.detach().t()) * 3.0)));
  // An input that needs no gradient gets none, and the others are still right.
  Tensor frozen = randn({3, 2}, kFloat64);
  Tensor a2 = randn({2, 3}, kFloat64).requires_grad_();
  backward_ones(addmm(self.detach(), a2, frozen));
  EXPECT_TRUE(matches(a2.grad(), {2, 3}, values(mm(ones({2, 2}, kFloat64), frozen.t()))));
}

TEST(GradcheckLinalg, Dot) {
  manual_seed(4);
  auto f = [](const Tensor& a, const Tensor& b) { return dot(a, b); };
  check_binary(f, rnd({5}), rnd({5}));
  check_binary(f, rnd({10}).slice(0, 0, std::nullopt, 2), rnd({5}));
}

TEST(GradcheckLinalg, MatmulAllRankCombinations) {
  manual_seed(5);
  auto f = [](const Tensor& a, const Tensor& b) { return matmul(a, b); };
  check_binary(f, rnd({3}), rnd({3}));              // dot
  check_binary(f, rnd({2, 3}), rnd({3}));           // matrix-vector
  check_binary(f, rnd({3}), rnd({3, 2}));           // vector-matrix
  check_binary(f, rnd({2, 3, 4}), rnd({4, 2}));     // batch dims folded into one mm
  check_binary(f, rnd({2, 3, 4}), rnd({4}));        // folded, vector on the right
  check_binary(f, rnd({3}), rnd({2, 3, 2}));        // vector on the left of a batch
  check_binary(f, rnd({2, 1, 2, 3}), rnd({3, 3, 2}));  // broadcast batch dims
  check_binary(f, rnd({1, 2, 3}), rnd({2, 3, 2}));  // size-1 batch broadcast
}

TEST(GradcheckLinalg, LinearWithAndWithoutBias) {
  manual_seed(6);
  autograd::Function with_bias = [](const TensorList& in) { return TensorList{linear(in[0], in[1], in[2])}; };
  autograd::Function no_bias = [](const TensorList& in) { return TensorList{linear(in[0], in[1])}; };
  EXPECT_TRUE(grad_ok(with_bias, {rnd({4, 3}), rnd({2, 3}), rnd({2})}));
  EXPECT_TRUE(grad_ok(with_bias, {rnd({2, 2, 3}), rnd({2, 3}), rnd({2})}));
  EXPECT_TRUE(grad_ok(with_bias, {rnd({3}), rnd({2, 3}), rnd({2})}));
  EXPECT_TRUE(grad_ok(no_bias, {rnd({4, 3}), rnd({2, 3})}));
  autograd::Function squared = [](const TensorList& in) { return TensorList{sq(linear(in[0], in[1], in[2]))}; };
  EXPECT_TRUE(gradgrad_ok(squared, {rnd({3, 3}), rnd({2, 3}), rnd({2})}));
}

TEST(GradcheckLinalg, Outer) {
  manual_seed(7);
  check_binary([](const Tensor& a, const Tensor& b) { return outer(a, b); }, rnd({3}), rnd({4}));
}

TEST(GradcheckLinalg, Float32InputsGetFloat32GradientsMatchingFloat64) {
  manual_seed(8);
  Tensor a64 = randn({6, 5}, kFloat64), b64 = randn({5, 4}, kFloat64), bias64 = randn({4}, kFloat64);
  Tensor g = randn({6, 4}, kFloat64);
  auto grads = [&](DType t) {
    Tensor a = a64.to(t, /*copy=*/true).requires_grad_();
    Tensor b = b64.to(t, /*copy=*/true).requires_grad_();
    Tensor bias = bias64.to(t, /*copy=*/true).requires_grad_();
    linear(a, b.t(), bias).backward(g.to(t));
    return TensorList{a.grad(), b.grad(), bias.grad()};
  };
  TensorList g32 = grads(kFloat32), g64 = grads(kFloat64);
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(g32[i].dtype(), kFloat32);
    EXPECT_TRUE(matches(g32[i], g64[i].sizes().vec(), values(g64[i]), kiln::testing::Tolerance{1e-5, 1e-5}));
  }
}

TEST(GradcheckLinalg, IntegerProductsRecordNoGraph) {
  Tensor a = ones({2, 2}, kInt64), b = ones({2, 2}, kInt64);
  Tensor y = mm(a, b);
  EXPECT_FALSE(y.requires_grad());
}
