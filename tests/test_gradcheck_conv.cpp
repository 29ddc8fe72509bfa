// Derivatives of convolution and pooling: autograd::gradcheck (float64 finite differences) for
// conv2d (stride, padding, dilation, groups, bias, 1x1, unbatched), max_pool2d (padding,
// dilation, ceil_mode; both the with-indices and the recomputing path), avg_pool2d
// (count_include_pad, ceil_mode, divisor_override) and adaptive_avg_pool2d; gradgradcheck through
// the backward ops' own derivatives; the float32 (oneDNN) and bfloat16 backward against the
// float64 backward of the same values; and the backward ops' input checks.
#include <cmath>
#include <limits>
#include <tuple>

#include "reference.h"

using namespace kiln;
using kiln::testing::matches;
using kiln::testing::Tolerance;
using kiln::testing::values;
using kiln::testing::grad_ok;
using kiln::testing::gradgrad_ok;
using kiln::testing::close_to;
using kiln::testing::op;

namespace {

Tensor rnd(const std::vector<int64_t>& sizes) { return randn(sizes, kFloat64).requires_grad_(); }

Tensor sq(const Tensor& y) { return y * y; }

struct Conv {
  std::vector<int64_t> stride{1, 1}, padding{0, 0}, dilation{1, 1};
  int64_t groups = 1;
  Tensor operator()(const Tensor& x, const Tensor& w, const Tensor& b = Tensor()) const {
    return conv2d(x, w, b, stride, padding, dilation, groups);
  }
};

// Gradients of sum(conv(x, w, b) * g) for x, w, b of dtype t (made from float64 values).
TensorList conv_grads(const Conv& conv, const Tensor& x64, const Tensor& w64, const Tensor& b64, const Tensor& g64,
                      DType t) {
  Tensor x = x64.to(t, /*copy=*/true).requires_grad_(), w = w64.to(t, /*copy=*/true).requires_grad_();
  Tensor b = b64.defined() ? b64.to(t, /*copy=*/true).requires_grad_() : Tensor();
  conv(x, w, b).backward(g64.to(t));
  return {x.grad(), w.grad(), b.defined() ? b.grad() : Tensor()};
}

}  // namespace

// ---------------- conv2d ----------------

TEST(GradcheckConv, Conv2dStridePaddingDilationGroupsBias) {
  manual_seed(1);
  std::vector<std::pair<Conv, std::vector<int64_t>>> cases = {
      {Conv{}, {3, 2, 3, 3}},                                      // plain 3x3
      {Conv{{2, 2}, {1, 1}, {1, 1}, 1}, {3, 2, 3, 3}},             // stride + padding
      {Conv{{1, 2}, {2, 0}, {2, 1}, 1}, {2, 2, 2, 3}},             // asymmetric, dilation
      {Conv{{1, 1}, {1, 1}, {1, 1}, 2}, {4, 1, 3, 3}},             // groups
      {Conv{}, {3, 2, 1, 1}},                                      // 1x1
      {Conv{{2, 2}, {0, 0}, {1, 1}, 1}, {2, 2, 2, 2}},             // stride leaves input unused
  };
  for (const auto& [conv, wsize] : cases) {
    const int64_t c_in = wsize[1] * conv.groups;
    autograd::Function with_bias = [&](const TensorList& in) { return TensorList{conv(in[0], in[1], in[2])}; };
    EXPECT_TRUE(grad_ok(with_bias, {rnd({2, c_in, 5, 5}), rnd(wsize), rnd({wsize[0]})}));
  }
  // No bias, and a bias that needs no gradient.
  Conv conv{{1, 1}, {1, 1}, {1, 1}, 1};
  autograd::Function no_bias = [&](const TensorList& in) { return TensorList{conv(in[0], in[1])}; };
  EXPECT_TRUE(grad_ok(no_bias, {rnd({1, 2, 4, 4}), rnd({2, 2, 3, 3})}));
  Tensor fixed_bias = randn({2}, kFloat64);
  autograd::Function frozen = [&](const TensorList& in) { return TensorList{conv(in[0], in[1], fixed_bias)}; };
  EXPECT_TRUE(grad_ok(frozen, {rnd({1, 2, 4, 4}), rnd({2, 2, 3, 3})}));
}

// Issue 18.17: PyTorch pads the extra row/column of an even kernel's 'same' padding at the
// bottom/right (constant_pad_nd, out of place), and both operands get gradients.
TEST(GradcheckConv, Conv2dSamePaddingWithEvenKernelsReachesInputAndWeight) {
  Tensor x = tensor<double>({1, 2, 3}, {1, 1, 1, 3}).requires_grad_();
  Tensor w = tensor<double>({0.5, -1}, {1, 1, 1, 2}).requires_grad_();
  Tensor y = conv2d(x, w, Tensor(), {1, 1}, "same");
  EXPECT_TRUE(matches(y, {1, 1, 1, 3}, {-1.5, -2, 1.5}));
  y.backward(tensor<double>({1, 2, 3}, {1, 1, 1, 3}));
  ASSERT_TRUE(x.grad().defined());
  EXPECT_TRUE(matches(x.grad(), {1, 1, 1, 3}, {0.5, 0, -0.5}));
  EXPECT_TRUE(matches(w.grad(), {1, 1, 1, 2}, {14, 8}));
  // A 2x2 kernel on 2x3: the extra row at the bottom, the extra column at the right.
  Tensor x2 = tensor<double>({1, 2, 3, 4, 5, 6}, {1, 1, 2, 3}).requires_grad_();
  Tensor w2 = tensor<double>({1, -2, 0.5, 3}, {1, 1, 2, 2}).requires_grad_();
  Tensor y2 = conv2d(x2, w2, Tensor(), {1, 1}, "same");
  EXPECT_TRUE(matches(y2, {1, 1, 2, 3}, {14, 16.5, 6, -6, -7, 6}));
  y2.backward(tensor<double>({1, -1, 2, 0.5, 1, -2}, {1, 1, 2, 3}));
  ASSERT_TRUE(x2.grad().defined());
  EXPECT_TRUE(matches(x2.grad(), {1, 1, 2, 3}, {1, -3, 4, 1, 2.5, -6}));
  EXPECT_TRUE(matches(w2.grad(), {1, 1, 2, 2}, {0, 7.5, 11, -1}));
  // gradcheck: even kernels, with dilation (odd total padding), and a bias.
  using Param = std::pair<std::vector<int64_t>, std::vector<int64_t>>;  // weight sizes, dilation
  for (const auto& [wsize, dilation] : std::vector<Param>{{{2, 3, 2, 2}, {1, 1}}, {{2, 3, 4, 3}, {1, 2}},
                                                          {{2, 3, 2, 2}, {3, 1}}}) {
    autograd::Function f = [&](const TensorList& in) {
      return TensorList{conv2d(in[0], in[1], in[2], std::vector<int64_t>{1, 1}, std::string("same"), dilation)};
    };
    EXPECT_TRUE(grad_ok(f, {rnd({2, 3, 5, 4}), rnd(wsize), rnd({2})})) << shape_str(wsize);
  }
}

TEST(GradcheckConv, Conv2dUnbatchedNonContiguousAndPartialRequirements) {
  manual_seed(2);
  Conv conv{{1, 1}, {1, 1}, {1, 1}, 1};
  autograd::Function f = [&](const TensorList& in) { return TensorList{conv(in[0], in[1], in[2])}; };
  EXPECT_TRUE(grad_ok(f, {rnd({2, 4, 4}), rnd({3, 2, 3, 3}), rnd({3})}));
  // Channels-last-strided input and a transposed weight view.
  Tensor x = randn({1, 4, 4, 2}, kFloat64).permute({0, 3, 1, 2}).requires_grad_();
  Tensor w = randn({3, 3, 2, 3}, kFloat64).permute({3, 2, 0, 1}).requires_grad_();
  EXPECT_TRUE(grad_ok(f, {x, w, rnd({3})}));
  // Only the input, only the weight.
  Tensor w_fixed = randn({3, 2, 3, 3}, kFloat64), x_fixed = randn({1, 2, 4, 4}, kFloat64);
  EXPECT_TRUE(grad_ok([&](const TensorList& in) { return TensorList{conv(in[0], w_fixed)}; }, {rnd({1, 2, 4, 4})}));
  EXPECT_TRUE(grad_ok([&](const TensorList& in) { return TensorList{conv(x_fixed, in[0])}; }, {rnd({3, 2, 3, 3})}));
}

TEST(GradcheckConv, Conv2dDoubleBackwardThroughConvolutionBackward) {
  manual_seed(3);
  for (const Conv& conv : {Conv{}, Conv{{2, 1}, {1, 1}, {1, 2}, 2}}) {
    const int64_t groups = conv.groups;
    autograd::Function f = [&](const TensorList& in) { return TensorList{sq(conv(in[0], in[1], in[2]))}; };
    EXPECT_TRUE(gradgrad_ok(f, {rnd({1, 2, 4, 4}), rnd({2, 2 / groups, 2, 2}), rnd({2})}));
  }
  // Mixed second derivatives: d/dw of grad_x and d/dx of grad_w.
  Conv conv{{1, 1}, {1, 1}, {1, 1}, 1};
  autograd::Function gx = [&](const TensorList& in) {
    EnableGradGuard grad_mode;  // gradcheck evaluates the function under NoGradGuard too
    Tensor y = conv(in[0], in[1]);
    return TensorList{autograd::grad({y}, {in[0]}, {ones_like(y)}, true, true)[0]};
  };
  EXPECT_TRUE(grad_ok(gx, {rnd({1, 2, 3, 3}), rnd({2, 2, 3, 3})}));
}

TEST(GradcheckConv, ConvolutionBackwardHonoursOutputMask) {
  manual_seed(4);
  Tensor g = randn({2, 3, 4, 4}, kFloat64), x = randn({2, 2, 4, 4}, kFloat64), w = randn({3, 2, 3, 3}, kFloat64);
  std::vector<Attr> attrs{std::vector<int64_t>{1}, std::vector<int64_t>{1}, std::vector<int64_t>{1}, int64_t{1},
                          std::vector<int64_t>{1, 1, 1}};
  TensorList all = call_op(op("convolution_backward"), {g, x, w}, attrs);
  // The bias gradient is the sum of the gradient over N, H, W.
  EXPECT_TRUE(matches(all[2], {3}, values(g.sum({0, 2, 3}))));
  attrs[4] = std::vector<int64_t>{0, 1, 0};
  TensorList weight_only = call_op(op("convolution_backward"), {g, x, w}, attrs);
  EXPECT_EQ(weight_only[0].numel(), 0);
  EXPECT_EQ(weight_only[2].numel(), 0);
  EXPECT_TRUE(matches(weight_only[1], {3, 2, 3, 3}, values(all[1])));
  attrs[4] = std::vector<int64_t>{1, 0, 0};
  EXPECT_TRUE(matches(call_op(op("convolution_backward"), {g, x, w}, attrs)[0], {2, 2, 4, 4}, values(all[0])));
}

TEST(GradcheckConv, Float32OneDnnBackwardMatchesFloat64) {
  manual_seed(5);
  struct Case {
    Conv conv;
    std::vector<int64_t> x, w;
  };
  const std::vector<Case> cases = {
      {Conv{{1, 1}, {1, 1}, {1, 1}, 1}, {2, 16, 9, 9}, {24, 16, 3, 3}},  // DenseNet 3x3
      {Conv{}, {2, 32, 8, 8}, {16, 32, 1, 1}},                            // 1x1 (plain NCHW path)
      {Conv{{2, 2}, {3, 3}, {1, 1}, 1}, {2, 3, 20, 20}, {16, 3, 7, 7}},   // stem: 7x7 stride 2
      {Conv{{1, 1}, {2, 2}, {2, 2}, 1}, {1, 8, 10, 10}, {8, 8, 3, 3}},    // dilation
      {Conv{{1, 1}, {1, 1}, {1, 1}, 4}, {2, 16, 6, 6}, {16, 4, 3, 3}},    // groups
      {Conv{{2, 2}, {0, 0}, {1, 1}, 1}, {2, 5, 7, 7}, {6, 5, 2, 2}},      // odd channel counts
  };
  for (const auto& c : cases) {
    Tensor x = randn(c.x, kFloat64), w = randn(c.w, kFloat64), b = randn({c.w[0]}, kFloat64);
    std::vector<int64_t> out_sizes = c.conv(x, w).sizes().vec();
    Tensor g = randn(out_sizes, kFloat64);
    TensorList g32 = conv_grads(c.conv, x, w, b, g, kFloat32), g64 = conv_grads(c.conv, x, w, b, g, kFloat64);
    for (int i = 0; i < 3; ++i) {
      EXPECT_EQ(g32[i].dtype(), kFloat32);
      EXPECT_TRUE(close_to(g32[i], g64[i], 1e-5)) << "case x " << shape_str(c.x) << " grad " << i;
    }
    // The weight gradient alone (input not requiring grad) takes another plan.
    Tensor w32 = w.to(kFloat32, /*copy=*/true).requires_grad_();
    c.conv(x.to(kFloat32), w32, Tensor()).backward(g.to(kFloat32));
    EXPECT_TRUE(close_to(w32.grad(), g64[1], 1e-5));
  }
}

TEST(GradcheckConv, ReducedPrecisionBackwardMatchesFloat64) {
  manual_seed(6);
  Conv conv{{1, 1}, {1, 1}, {1, 1}, 1};
  Tensor x = randn({2, 16, 6, 6}, kFloat64), w = randn({16, 16, 3, 3}, kFloat64), b = randn({16}, kFloat64);
  Tensor g = randn({2, 16, 6, 6}, kFloat64);
  TensorList g64 = conv_grads(conv, x, w, b, g, kFloat64);
  for (DType t : {kBFloat16, kFloat16}) {
    TensorList gt = conv_grads(conv, x, w, b, g, t);
    for (int i = 0; i < 3; ++i) {
      EXPECT_EQ(gt[i].dtype(), t);
      EXPECT_TRUE(close_to(gt[i], g64[i], 3e-2)) << dtype_name(t) << " grad " << i;
    }
  }
}

TEST(GradcheckConv, SavedInputModifiedInPlaceIsDetected) {
  Tensor w = randn({2, 2, 3, 3}).requires_grad_();
  Tensor x = randn({1, 2, 4, 4}).requires_grad_() * 1.0f;
  Tensor y = conv2d(x, w);
  x.mul_(2.0f);
  EXPECT_THROW(y.backward(ones_like(y)), Error);
}

TEST(GradcheckConv, ConvolutionBackwardRejectsBadInputs) {
  Tensor x = randn({1, 2, 4, 4}), w = randn({3, 2, 3, 3});
  std::vector<Attr> attrs{std::vector<int64_t>{1}, std::vector<int64_t>{0}, std::vector<int64_t>{1}, int64_t{1},
                          std::vector<int64_t>{1, 1, 1}};
  EXPECT_THROW(call_op(op("convolution_backward"), {randn({1, 3, 3, 3}), x, w}, attrs), ShapeError);
  EXPECT_THROW(call_op(op("convolution_backward"), {randn({1, 3, 2, 2}, kFloat64), x, w}, attrs), DTypeError);
  attrs[4] = std::vector<int64_t>{1, 1};
  EXPECT_THROW(call_op(op("convolution_backward"), {randn({1, 3, 2, 2}), x, w}, attrs), ValueError);
}

// ---------------- max_pool2d ----------------

TEST(GradcheckConv, MaxPool2dPaddingDilationCeilMode) {
  manual_seed(7);
  struct Case {
    std::vector<int64_t> kernel, stride, padding, dilation;
    bool ceil_mode;
    std::vector<int64_t> x;
  };
  const std::vector<Case> cases = {
      {{2, 2}, {2, 2}, {0, 0}, {1, 1}, false, {2, 2, 4, 4}},
      {{3, 3}, {2, 2}, {1, 1}, {1, 1}, false, {1, 2, 5, 5}},  // DenseNet's stem pool (overlapping)
      {{2, 2}, {2, 2}, {0, 0}, {1, 1}, true, {1, 2, 5, 5}},   // ceil_mode: partial windows
      {{2, 3}, {1, 2}, {1, 1}, {2, 1}, true, {1, 1, 5, 6}},   // dilation + asymmetric
      {{3, 3}, {1, 1}, {1, 1}, {1, 1}, false, {2, 4, 4}},     // unbatched
  };
  for (const auto& c : cases) {
    autograd::Function f = [&](const TensorList& in) {
      return TensorList{max_pool2d(in[0], c.kernel, c.stride, c.padding, c.dilation, c.ceil_mode)};
    };
    autograd::Function with_indices = [&](const TensorList& in) {
      return TensorList{std::get<0>(max_pool2d_with_indices(in[0], c.kernel, c.stride, c.padding, c.dilation,
                                                            c.ceil_mode))};
    };
    // The table op without indices (its derivative recomputes them).
    autograd::Function recompute = [&](const TensorList& in) {
      return TensorList{call_op1(op("max_pool2d"), {in[0]}, {c.kernel, c.stride, c.padding, c.dilation, c.ceil_mode})};
    };
    Tensor x = rnd(c.x);
    EXPECT_TRUE(grad_ok(f, {x}));
    EXPECT_TRUE(grad_ok(with_indices, {x}));
    EXPECT_TRUE(grad_ok(recompute, {x}));
    autograd::Function f_sq = [&](const TensorList& in) { return TensorList{sq(f(in)[0])}; };
    EXPECT_TRUE(gradgrad_ok(f_sq, {x}));
  }
}

TEST(GradcheckConv, MaxPool2dTrainingRecordsIndicesAndAccumulatesOverlaps) {
  // One large value shared by four overlapping windows receives all four gradients.
  Tensor x = zeros({1, 1, 3, 3}).requires_grad_();
  {
    NoGradGuard ng;
    x.view({-1}).select(0, 4).fill_(5.0);
  }
  Tensor y = max_pool2d(x, {2, 2}, {1, 1});
  EXPECT_EQ(y.grad_fn_name(), "MaxPool2dWithIndicesBackward0");
  y.backward(tensor<float>({1, 2, 3, 4}, {1, 1, 2, 2}));
  EXPECT_TRUE(matches(x.grad(), {1, 1, 3, 3}, {0, 0, 0, 0, 10, 0, 0, 0, 0}));
  // Inference still returns the same values.
  NoGradGuard ng;
  EXPECT_TRUE(matches(max_pool2d(x, {2, 2}, {1, 1}), {1, 1, 2, 2}, values(y)));
}

// PyTorch's argmax: the first position (row-major over the window, padding skipped) holding a
// strictly greater value than all earlier ones.
std::vector<double> naive_argmax(const Tensor& x, int64_t k, int64_t s, int64_t p, int64_t d, int64_t oh, int64_t ow) {
  const auto v = values(x);
  const int64_t planes = x.size(0) * x.size(1), h = x.size(2), w = x.size(3);
  std::vector<double> out;
  for (int64_t pl = 0; pl < planes; ++pl)
    for (int64_t i = 0; i < oh; ++i)
      for (int64_t j = 0; j < ow; ++j) {
        int64_t best = -1;
        double best_v = 0;
        for (int64_t a = 0; a < k; ++a)
          for (int64_t b = 0; b < k; ++b) {
            const int64_t ih = i * s - p + a * d, iw = j * s - p + b * d;
            if (ih < 0 || ih >= h || iw < 0 || iw >= w) continue;
            const double val = v[(pl * h + ih) * w + iw];
            if (best < 0 || val > best_v) {
              best = ih * w + iw;
              best_v = val;
            }
          }
        out.push_back(static_cast<double>(best));
      }
  return out;
}

TEST(GradcheckConv, MaxPoolIndicesBreakTiesAndInfinitiesLikePyTorch) {
  manual_seed(11);
  // Values in {0, 1, 2}: most windows hold ties. Float32 takes oneDNN's argmax, float64 the loop.
  Tensor x = randint(0, 3, {2, 4, 11, 11}).to(kFloat32);
  for (DType t : {kFloat32, kFloat64, kBFloat16}) {
    for (auto [k, s, p, d] : {std::tuple{3L, 2L, 1L, 1L}, std::tuple{2L, 1L, 0L, 2L}, std::tuple{3L, 3L, 1L, 1L}}) {
      auto [y, idx] = max_pool2d_with_indices(x.to(t), {k, k}, {s, s}, {p, p}, {d, d});
      EXPECT_TRUE(matches(idx, idx.sizes().vec(), naive_argmax(x, k, s, p, d, idx.size(2), idx.size(3))))
          << dtype_name(t) << " kernel " << k << " stride " << s << " dilation " << d;
    }
  }
  // A window of -inf only: the first position, as in PyTorch.
  Tensor inf = full({1, 1, 4, 4}, -std::numeric_limits<double>::infinity(), kFloat32);
  auto [y, idx] = max_pool2d_with_indices(inf, {2, 2});
  EXPECT_TRUE(matches(idx, {1, 1, 2, 2}, {0, 2, 8, 10}));
}

TEST(GradcheckConv, MaxPoolBackwardRejectsBadIndices) {
  std::vector<Attr> attrs{std::vector<int64_t>{1, 1, 4, 4}, std::vector<int64_t>{2}, std::vector<int64_t>{},
                          std::vector<int64_t>{0}, std::vector<int64_t>{1}, false};
  Tensor g = ones({1, 1, 2, 2});
  EXPECT_THROW(call_op1(op("max_pool2d_with_indices_backward"), {g, tensor<int64_t>({0, 1, 2, 16}, {1, 1, 2, 2})}, attrs),
               IndexError);
  EXPECT_THROW(call_op1(op("max_pool2d_with_indices_backward"), {g, tensor<int64_t>({0, -1, 2, 3}, {1, 1, 2, 2})}, attrs),
               IndexError);
  EXPECT_THROW(call_op1(op("max_pool2d_with_indices_backward"), {g, zeros({1, 1, 2, 2}, kInt32)}, attrs), DTypeError);
  EXPECT_THROW(call_op1(op("max_pool2d_with_indices_backward"), {ones({1, 1, 3, 3}), zeros({1, 1, 3, 3}, kInt64)}, attrs),
               ShapeError);
}

// ---------------- avg_pool2d ----------------

TEST(GradcheckConv, AvgPool2dCeilModePaddingDivisor) {
  manual_seed(8);
  struct Case {
    std::vector<int64_t> kernel, stride, padding;
    bool ceil_mode, count_include_pad;
    std::optional<int64_t> divisor;
    std::vector<int64_t> x;
  };
  const std::vector<Case> cases = {
      {{2, 2}, {2, 2}, {0, 0}, false, true, std::nullopt, {2, 2, 4, 4}},  // DenseNet transition
      {{3, 3}, {2, 2}, {1, 1}, false, true, std::nullopt, {1, 2, 5, 5}},
      {{3, 3}, {2, 2}, {1, 1}, false, false, std::nullopt, {1, 2, 5, 5}},
      {{2, 2}, {2, 2}, {1, 1}, true, true, std::nullopt, {1, 1, 5, 6}},   // windows past the padding
      {{2, 2}, {2, 2}, {0, 0}, true, false, std::nullopt, {1, 1, 5, 5}},
      {{3, 2}, {1, 2}, {1, 0}, false, true, 5, {1, 2, 4, 5}},             // divisor_override
      {{2, 2}, {1, 1}, {0, 0}, false, true, std::nullopt, {2, 3, 3}},     // unbatched
  };
  for (const auto& c : cases) {
    autograd::Function f = [&](const TensorList& in) {
      return TensorList{avg_pool2d(in[0], c.kernel, c.stride, c.padding, c.ceil_mode, c.count_include_pad, c.divisor)};
    };
    Tensor x = rnd(c.x);
    EXPECT_TRUE(grad_ok(f, {x}));
    autograd::Function f_sq = [&](const TensorList& in) { return TensorList{sq(f(in)[0])}; };
    EXPECT_TRUE(gradgrad_ok(f_sq, {x}));
  }
}

// ---------------- adaptive_avg_pool2d ----------------

TEST(GradcheckConv, AdaptiveAvgPool2dUnevenOverlappingAndGlobal) {
  manual_seed(9);
  const std::vector<std::pair<std::vector<int64_t>, std::vector<int64_t>>> cases = {
      {{1, 2, 5, 7}, {3, 4}},  // uneven, overlapping windows
      {{2, 3, 4, 4}, {1, 1}},  // global average (DenseNet's head)
      {{1, 1, 3, 3}, {5, 4}},  // more outputs than inputs
      {{2, 4, 6}, {2, 3}},     // unbatched
  };
  for (const auto& [xs, out] : cases) {
    autograd::Function f = [&](const TensorList& in) { return TensorList{adaptive_avg_pool2d(in[0], out)}; };
    Tensor x = rnd(xs);
    EXPECT_TRUE(grad_ok(f, {x}));
    autograd::Function f_sq = [&](const TensorList& in) { return TensorList{sq(f(in)[0])}; };
    EXPECT_TRUE(gradgrad_ok(f_sq, {x}));
  }
}

// ---------------- all pools: float32 (parallel paths) against float64 ----------------

TEST(GradcheckConv, PoolingBackwardInFloat32AndBfloat16MatchesFloat64) {
  manual_seed(10);
  Tensor x64 = randn({4, 16, 32, 32}, kFloat64);
  auto grads = [&](DType t, const std::function<Tensor(const Tensor&)>& f) {
    Tensor x = x64.to(t, /*copy=*/true).requires_grad_();
    Tensor y = f(x);
    Tensor g = linspace(-1, 1, y.numel(), kFloat64).view(y.sizes());
    y.backward(g.to(t));
    return x.grad();
  };
  const std::vector<std::function<Tensor(const Tensor&)>> pools = {
      [](const Tensor& x) { return max_pool2d(x, {3, 3}, {2, 2}, {1, 1}); },
      [](const Tensor& x) { return avg_pool2d(x, {2, 2}, {2, 2}); },
      [](const Tensor& x) { return avg_pool2d(x, {3, 3}, {2, 2}, {1, 1}, true, false); },
      [](const Tensor& x) { return adaptive_avg_pool2d(x, {1, 1}); },
      [](const Tensor& x) { return adaptive_avg_pool2d(x, {5, 3}); },
  };
  for (size_t i = 0; i < pools.size(); ++i) {
    Tensor want = grads(kFloat64, pools[i]);
    Tensor got = grads(kFloat32, pools[i]);
    EXPECT_EQ(got.dtype(), kFloat32);
    EXPECT_TRUE(close_to(got, want, 1e-6)) << "pool " << i;
    Tensor bf = grads(kBFloat16, pools[i]);
    EXPECT_EQ(bf.dtype(), kBFloat16);
    if (i != 0) {  // bf16 rounding creates max-pool ties that pick other positions
      EXPECT_TRUE(close_to(bf, want, 2e-2)) << "pool " << i;
    }
  }
}
