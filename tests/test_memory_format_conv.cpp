// Channels-last (NHWC) convolutions: conv2d, conv2d_relu, conv2d_bn and convolution_backward on
// channels-last inputs and weights give the contiguous path's values (float32 on oneDNN's NHWC
// kernels, float64 through its NCHW fallback) and return the layouts PyTorch does: the result is
// channels-last when the input or the weight suggests it; the input and weight gradients follow
// the input's and the weight's layouts, the bias gradient is contiguous. Also: mixed and
// non-dense layouts, out= targets of other layouts, gradcheck and gradgradcheck on channels-last
// float64 inputs, empty batches and the ambiguous shapes (one channel, a 1x1 image) that count as
// contiguous.
#include <vector>

#include "kernels/cpu/conv_kernels.h"
#include "reference.h"

using namespace kiln;
using kiln::testing::grad_ok;
using kiln::testing::gradgrad_ok;
using kiln::testing::matches;
using kiln::testing::op;
using kiln::testing::Tolerance;
using kiln::testing::values;

namespace {

struct Conv {
  std::vector<int64_t> stride{1, 1}, padding{0, 0}, dilation{1, 1};
  int64_t groups = 1;
  Tensor operator()(const Tensor& x, const Tensor& w, const Tensor& b = Tensor()) const {
    return conv2d(x, w, b, stride, padding, dilation, groups);
  }
  std::vector<Attr> attrs() const { return {stride, padding, dilation, groups}; }
};

struct Case {
  const char* name;
  Conv conv;
  std::vector<int64_t> x, w;
  bool bias;
};

// Shapes the NHWC kernels see in practice (DenseNet's stem, 1x1 and 3x3 layers) plus every
// parameter: stride, padding, dilation, groups (depthwise too), 7x7 and asymmetric kernels.
const std::vector<Case>& cases() {
  static const std::vector<Case> all = {
      {"3x3", Conv{{1, 1}, {1, 1}, {1, 1}, 1}, {2, 16, 9, 9}, {24, 16, 3, 3}, false},
      {"3x3 bias", Conv{{1, 1}, {1, 1}, {1, 1}, 1}, {2, 16, 9, 9}, {24, 16, 3, 3}, true},
      {"1x1", Conv{}, {2, 40, 8, 8}, {32, 40, 1, 1}, false},
      {"1x1 bias", Conv{}, {2, 40, 8, 8}, {32, 40, 1, 1}, true},
      {"1x1 stride 2", Conv{{2, 2}, {0, 0}, {1, 1}, 1}, {2, 24, 8, 8}, {16, 24, 1, 1}, true},
      {"7x7 stem", Conv{{2, 2}, {3, 3}, {1, 1}, 1}, {2, 3, 32, 32}, {16, 3, 7, 7}, false},
      {"stride padding", Conv{{2, 1}, {1, 2}, {1, 1}, 1}, {2, 8, 10, 9}, {12, 8, 3, 3}, true},
      {"dilation", Conv{{1, 1}, {2, 2}, {2, 3}, 1}, {1, 8, 11, 12}, {8, 8, 3, 3}, true},
      {"asymmetric kernel", Conv{{1, 2}, {1, 0}, {1, 1}, 1}, {2, 6, 7, 8}, {10, 6, 3, 2}, false},
      {"groups", Conv{{1, 1}, {1, 1}, {1, 1}, 4}, {2, 16, 7, 7}, {32, 4, 3, 3}, true},
      {"depthwise", Conv{{1, 1}, {1, 1}, {1, 1}, 16}, {2, 16, 8, 8}, {16, 1, 3, 3}, true},
      {"depthwise stride", Conv{{2, 2}, {1, 1}, {1, 1}, 8}, {2, 8, 9, 9}, {16, 1, 3, 3}, false},
      {"odd channels", Conv{{1, 1}, {1, 1}, {1, 1}, 1}, {3, 5, 6, 6}, {7, 5, 3, 3}, true},
  };
  return all;
}

// The values a tensor holds, whatever its layout, compared with a reference tensor's.
::testing::AssertionResult same_values(const Tensor& got, const Tensor& want, Tolerance tol = {2e-5, 2e-5}) {
  return matches(got, want.sizes().vec(), values(want), tol);
}

Tensor bias_for(const Case& c, DType t = kFloat32) { return c.bias ? randn({c.w[0]}, t) : Tensor(); }

}  // namespace

// ---------------- conv2d ----------------

TEST(MemoryFormatConv, ChannelsLastInputMatchesContiguousAndStaysChannelsLast) {
  manual_seed(1);
  for (const Case& c : cases()) {
    SCOPED_TRACE(c.name);
    Tensor x = randn(c.x), w = randn(c.w), b = bias_for(c);
    Tensor want = c.conv(x, w, b);
    EXPECT_TRUE(want.is_contiguous());
    Tensor got = c.conv(x.contiguous(kiln::channels_last), w, b);
    EXPECT_TRUE(got.is_contiguous(kiln::channels_last)) << shape_str(got.strides());
    EXPECT_TRUE(same_values(got, want));
  }
}

TEST(MemoryFormatConv, Float64ChannelsLastMatchesFloat32) {
  manual_seed(2);
  for (const Case& c : cases()) {
    SCOPED_TRACE(c.name);
    Tensor x = randn(c.x), w = randn(c.w), b = bias_for(c);
    Tensor want = c.conv(x.contiguous(kiln::channels_last), w, b);
    Tensor x64 = x.to(kFloat64).contiguous(kiln::channels_last);
    Tensor got = c.conv(x64, w.to(kFloat64), c.bias ? b.to(kFloat64) : Tensor());
    EXPECT_EQ(got.dtype(), kFloat64);
    EXPECT_TRUE(got.is_contiguous(kiln::channels_last));
    EXPECT_TRUE(same_values(got, want, {1e-4, 1e-4}));
  }
}

TEST(MemoryFormatConv, ChannelsLastWeightMakesTheResultChannelsLast) {
  manual_seed(3);
  const Conv conv{{1, 1}, {1, 1}, {1, 1}, 1};
  Tensor x = randn({2, 8, 7, 7}), w = randn({12, 8, 3, 3}), b = randn({12});
  Tensor want = conv(x, w, b);
  Tensor w_cl = w.contiguous(kiln::channels_last);
  // Contiguous input with a channels-last weight, and both channels-last.
  for (const Tensor& input : {x, x.contiguous(kiln::channels_last)}) {
    Tensor got = conv(input, w_cl, b);
    EXPECT_TRUE(got.is_contiguous(kiln::channels_last));
    EXPECT_FALSE(got.is_contiguous());
    EXPECT_TRUE(same_values(got, want));
  }
  // Grouped weights in channels-last.
  const Conv grouped{{1, 1}, {1, 1}, {1, 1}, 2};
  Tensor wg = randn({12, 4, 3, 3});
  Tensor got = grouped(x.contiguous(kiln::channels_last), wg.contiguous(kiln::channels_last), b);
  EXPECT_TRUE(got.is_contiguous(kiln::channels_last));
  EXPECT_TRUE(same_values(got, grouped(x, wg, b)));
}

TEST(MemoryFormatConv, NonDenseAndOtherStridedInputs) {
  manual_seed(4);
  const Conv conv{{1, 1}, {1, 1}, {1, 1}, 1};
  Tensor big = randn({2, 16, 10, 10}).contiguous(kiln::channels_last);
  // Channels-last but not dense: every other channel, and a spatial crop.
  Tensor every_other = big.slice(1, 0, 16, 2);
  Tensor crop = big.narrow(2, 1, 8).narrow(3, 2, 7);
  Tensor w8 = randn({6, 8, 3, 3}), w16 = randn({6, 16, 3, 3});
  for (auto [x, w] : {std::pair{every_other, w8}, std::pair{crop, w16}}) {
    ASSERT_FALSE(x.is_contiguous(kiln::channels_last));
    ASSERT_EQ(x.suggest_memory_format(), kiln::channels_last);
    Tensor got = conv(x, w);
    EXPECT_TRUE(got.is_contiguous(kiln::channels_last));
    EXPECT_TRUE(same_values(got, conv(x.contiguous(), w)));
  }
  // A layout that is neither (H fastest): contiguous result.
  Tensor odd = randn({2, 16, 9, 8}).transpose(2, 3);
  Tensor got = conv(odd, w16);
  EXPECT_TRUE(got.is_contiguous());
  EXPECT_TRUE(same_values(got, conv(odd.contiguous(), w16)));
}

TEST(MemoryFormatConv, OutTargetsOfAnyLayoutGetTheValues) {
  manual_seed(5);
  const Conv conv{{1, 1}, {1, 1}, {1, 1}, 1};
  Tensor x = randn({2, 8, 6, 6}), w = randn({10, 8, 3, 3}), b = randn({10});
  Tensor want = conv(x, w, b);
  Tensor x_cl = x.contiguous(kiln::channels_last);
  for (const Tensor& input : {x, x_cl}) {
    // Contiguous, channels-last, and a non-dense view of a bigger tensor.
    Tensor contiguous_out = empty({2, 10, 6, 6});
    Tensor cl_out = empty({2, 10, 6, 6}).contiguous(kiln::channels_last);
    Tensor base = zeros({2, 10, 6, 12});
    Tensor strided_out = base.slice(3, 0, 12, 2);
    for (Tensor out : {contiguous_out, cl_out, strided_out}) {
      const std::vector<int64_t> strides = out.strides().vec();
      std::vector<Tensor> outs{out};
      call_op_out(op("conv2d"), {input, w, b}, conv.attrs(), outs);
      EXPECT_EQ(out.strides().vec(), strides);  // the target keeps its layout
      EXPECT_TRUE(same_values(out, want));
    }
    EXPECT_TRUE(matches(base.slice(3, 1, 12, 2), {2, 10, 6, 6}, std::vector<double>(720, 0.0)));
  }
}

TEST(MemoryFormatConv, EmptyBatchAndAmbiguousShapes) {
  manual_seed(6);
  const Conv conv{{1, 1}, {1, 1}, {1, 1}, 1};
  // Empty batch: a well-formed empty result, and an empty gradient.
  Tensor empty_x = randn({0, 8, 5, 5}).contiguous(kiln::channels_last);
  Tensor y = conv(empty_x, randn({4, 8, 3, 3}));
  EXPECT_EQ(y.sizes().vec(), (std::vector<int64_t>{0, 4, 5, 5}));
  Tensor xe = empty_x.clone().requires_grad_();
  Tensor we = randn({4, 8, 3, 3}).contiguous(kiln::channels_last).requires_grad_();
  TensorList grads = autograd::grad({conv(xe, we).sum()}, {xe, we});
  EXPECT_EQ(grads[0].sizes().vec(), (std::vector<int64_t>{0, 8, 5, 5}));
  EXPECT_TRUE(matches(grads[1], {4, 8, 3, 3}, std::vector<double>(288, 0.0)));
  EXPECT_TRUE(grads[1].is_contiguous(kiln::channels_last));

  // One input channel: channels-last strides are ambiguous, the result contiguous (PyTorch's rule).
  Tensor one_channel = randn({2, 1, 8, 8});
  Tensor one_cl = randn({2, 8, 8, 1}).permute({0, 3, 1, 2});
  Tensor w1 = randn({6, 1, 3, 3});
  EXPECT_EQ(one_cl.suggest_memory_format(), kiln::contiguous_format);
  Tensor got = conv(one_cl, w1);
  EXPECT_TRUE(got.is_contiguous());
  EXPECT_TRUE(same_values(got, conv(one_cl.contiguous(), w1)));
  EXPECT_TRUE(same_values(conv(one_channel.contiguous(kiln::channels_last), w1), conv(one_channel, w1)));

  // A 1x1 image: ambiguous too; a 1x1 output of a channels-last input is channels-last (and
  // contiguous: both layouts are the same memory).
  Tensor pixel = randn({3, 8, 1, 1}).contiguous(kiln::channels_last);
  Tensor w_pixel = randn({5, 8, 1, 1});
  Tensor pixel_out = conv2d(pixel, w_pixel);
  EXPECT_TRUE(pixel_out.is_contiguous());
  EXPECT_TRUE(same_values(pixel_out, conv2d(pixel.contiguous(), w_pixel)));
  Tensor to_pixel = conv2d(randn({2, 8, 3, 3}).contiguous(kiln::channels_last), randn({4, 8, 3, 3}));
  EXPECT_TRUE(to_pixel.is_contiguous(kiln::channels_last));
  EXPECT_TRUE(to_pixel.is_contiguous());
}

TEST(MemoryFormatConv, StringPaddingSameKeepsChannelsLast) {
  manual_seed(7);
  Tensor x = randn({2, 6, 7, 7}), w = randn({4, 6, 4, 4});  // even kernel: one extra row/column
  Tensor got = conv2d(x.contiguous(kiln::channels_last), w, Tensor(), {1, 1}, "same");
  EXPECT_TRUE(got.is_contiguous(kiln::channels_last));
  EXPECT_TRUE(same_values(got, conv2d(x, w, Tensor(), {1, 1}, "same")));
}

TEST(MemoryFormatConv, BFloat16ChannelsLastMatchesContiguous) {
  manual_seed(8);
  const Conv conv{{1, 1}, {1, 1}, {1, 1}, 1};
  Tensor x = randn({2, 16, 8, 8}).to(kBFloat16), w = randn({16, 16, 3, 3}).to(kBFloat16);
  Tensor got = conv(x.contiguous(kiln::channels_last), w);
  EXPECT_TRUE(got.is_contiguous(kiln::channels_last));
  EXPECT_TRUE(same_values(got, conv(x, w), {2e-2, 5e-2}));
}

// ---------------- fused conv2d_relu / conv2d_bn ----------------

TEST(MemoryFormatConv, Conv2dReluAndConv2dBnFollowTheSameLayoutRule) {
  manual_seed(9);
  const Conv conv{{1, 1}, {1, 1}, {1, 1}, 1};
  Tensor x = randn({2, 8, 6, 6}), w = randn({12, 8, 3, 3}), b = randn({12});
  Tensor bn_w = rand({12}) + 0.5, bn_b = randn({12}), mean = randn({12}), var = rand({12}) + 0.5;
  const double eps = 1e-5;
  Tensor relu_want = relu(conv(x, w, b));
  Tensor bn_want = relu((conv(x, w, b) - mean.view({1, 12, 1, 1})) / sqrt(var.view({1, 12, 1, 1}) + eps) *
                            bn_w.view({1, 12, 1, 1}) +
                        bn_b.view({1, 12, 1, 1}));
  std::vector<Attr> bn_attrs = conv.attrs();
  bn_attrs.push_back(eps);
  bn_attrs.push_back(true);
  struct Layouts {
    Tensor x, w;
    bool channels_last;
  };
  Tensor x_cl = x.contiguous(kiln::channels_last), w_cl = w.contiguous(kiln::channels_last);
  for (const auto& l :
       {Layouts{x, w, false}, Layouts{x_cl, w, true}, Layouts{x, w_cl, true}, Layouts{x_cl, w_cl, true}}) {
    Tensor r = call_op1(op("conv2d_relu"), {l.x, l.w, b}, conv.attrs());
    EXPECT_EQ(r.is_contiguous(kiln::channels_last), l.channels_last);
    EXPECT_TRUE(same_values(r, relu_want));
    Tensor f = call_op1(op("conv2d_bn"), {l.x, l.w, b, bn_w, bn_b, mean, var}, bn_attrs);
    EXPECT_EQ(f.is_contiguous(kiln::channels_last), l.channels_last);
    EXPECT_TRUE(same_values(f, bn_want, {1e-4, 1e-4}));
    // Into a contiguous out= target.
    std::vector<Tensor> outs{empty({2, 12, 6, 6})};
    call_op_out(op("conv2d_bn"), {l.x, l.w, b, bn_w, bn_b, mean, var}, bn_attrs, outs);
    EXPECT_TRUE(outs[0].is_contiguous());
    EXPECT_TRUE(same_values(outs[0], bn_want, {1e-4, 1e-4}));
  }
}

// ---------------- convolution_backward ----------------

TEST(MemoryFormatConv, BackwardGradientsMatchContiguousWithTheirLayouts) {
  manual_seed(10);
  for (const Case& c : cases()) {
    SCOPED_TRACE(c.name);
    Tensor x = randn(c.x), w = randn(c.w);
    Tensor g = randn(c.conv(x, w).sizes());
    std::vector<Attr> attrs = c.conv.attrs();
    attrs.push_back(std::vector<int64_t>{1, 1, 1});
    TensorList want = call_op(op("convolution_backward"), {g, x, w}, attrs);
    Tensor x_cl = x.contiguous(kiln::channels_last), g_cl = g.contiguous(kiln::channels_last);
    const bool weight_can_be_cl = c.w[1] > 1 && c.w[2] * c.w[3] > 1;
    for (bool weight_cl : {false, true}) {
      SCOPED_TRACE(weight_cl ? "channels-last weight" : "contiguous weight");
      Tensor wl = weight_cl ? w.contiguous(kiln::channels_last) : w;
      TensorList got = call_op(op("convolution_backward"), {g_cl, x_cl, wl}, attrs);
      EXPECT_TRUE(got[0].is_contiguous(kiln::channels_last));
      EXPECT_TRUE(got[1].is_contiguous(weight_cl && weight_can_be_cl ? kiln::channels_last : kiln::contiguous_format));
      EXPECT_TRUE(got[2].is_contiguous());
      EXPECT_TRUE(same_values(got[0], want[0], {1e-4, 1e-4}));
      EXPECT_TRUE(same_values(got[1], want[1], {1e-4, 2e-4}));
      EXPECT_TRUE(same_values(got[2], want[2], {1e-4, 2e-4}));
    }
    // Only some of the gradients, and a gradient that is not channels-last.
    for (std::vector<int64_t> mask : {std::vector<int64_t>{1, 0, 0}, {0, 1, 0}, {0, 1, 1}, {1, 0, 1}}) {
      attrs.back() = mask;
      TensorList got = call_op(op("convolution_backward"), {g, x_cl, w}, attrs);
      for (int i = 0; i < 3; ++i) {
        if (mask[i]) EXPECT_TRUE(same_values(got[i], want[i], {1e-4, 2e-4})) << "gradient " << i;
        else EXPECT_EQ(got[i].numel(), 0);
      }
    }
  }
}

// Issue 18.23: oneDNN's jit 1x1 backward-weights writes past its scratchpad for NHWC activations,
// a strided 1x1 kernel without padding and fewer than 16 (or not a multiple of 16) input channels:
// Kiln builds that primitive on blocked activations.
TEST(MemoryFormatConv, StridedPointwiseBackwardWeightsAvoidsOneDnnNhwcOverrun) {
  EXPECT_EQ(cpu::onednn_backward_weights_activation_layout({2, 3, 8, 8}, {4, 3, 1, 1}, {1, 2}, {0, 0}, {2, 1}, 1, true),
            "blocked");
  EXPECT_EQ(cpu::onednn_backward_weights_activation_layout({1, 15, 16, 16}, {16, 15, 1, 1}, {2, 2}, {0, 0}, {1, 1}, 1,
                                                           true),
            "blocked");
  // Unaffected configurations keep their NHWC plan: 32 channels; a 3x3 kernel.
  EXPECT_EQ(cpu::onednn_backward_weights_activation_layout({2, 32, 8, 8}, {16, 32, 1, 1}, {2, 2}, {0, 0}, {1, 1}, 1,
                                                           true),
            "nhwc");
  EXPECT_EQ(cpu::onednn_backward_weights_activation_layout({2, 3, 8, 8}, {4, 3, 3, 3}, {1, 2}, {1, 1}, {2, 1}, 1, true),
            "nhwc");
  // End to end, the report's configuration on several threads (under valgrind, this was the
  // invalid write): a channels-last input view, a transposed weight, stride (1, 2), dilation (2, 1).
  const int threads = get_num_threads();
  set_num_threads(4);
  manual_seed(14);
  for (const std::vector<int64_t>& size : {std::vector<int64_t>{2, 8, 8, 3}, std::vector<int64_t>{1, 16, 16, 15}}) {
    const int64_t c = size[3];
    Tensor x = randn(size).permute({0, 3, 1, 2});          // (N, C, H, W) view of NHWC memory
    Tensor w = randn({1, 1, c, 4}).permute({3, 2, 0, 1});  // (4, C, 1, 1), transposed
    Tensor g = randn({size[0], 4, size[1], size[2] / 2});
    std::vector<Attr> attrs{std::vector<int64_t>{1, 2}, std::vector<int64_t>{0, 0}, std::vector<int64_t>{2, 1},
                            int64_t{1}, std::vector<int64_t>{1, 1, 1}};
    TensorList want = call_op(op("convolution_backward"), {g.to(kFloat64), x.to(kFloat64), w.to(kFloat64)}, attrs);
    for (int i = 0; i < 10; ++i) {
      TensorList got = call_op(op("convolution_backward"), {g, x, w}, attrs);
      for (int k = 0; k < 3; ++k) EXPECT_TRUE(same_values(got[k], want[k], {1e-4, 2e-4})) << "gradient " << k;
    }
  }
  set_num_threads(threads);
}

TEST(MemoryFormatConv, BackwardMixedLayoutsAndOutTargets) {
  manual_seed(11);
  const Conv conv{{1, 1}, {1, 1}, {1, 1}, 1};
  Tensor x = randn({2, 8, 6, 6}), w = randn({10, 8, 3, 3}), g = randn({2, 10, 6, 6});
  std::vector<Attr> attrs = conv.attrs();
  attrs.push_back(std::vector<int64_t>{1, 1, 1});
  TensorList want = call_op(op("convolution_backward"), {g, x, w}, attrs);
  // Contiguous input, channels-last weight: the convolution runs NHWC, grad_input stays contiguous.
  TensorList got = call_op(op("convolution_backward"), {g, x, w.contiguous(kiln::channels_last)}, attrs);
  EXPECT_TRUE(got[0].is_contiguous());
  EXPECT_TRUE(got[1].is_contiguous(kiln::channels_last));
  for (int i = 0; i < 3; ++i) EXPECT_TRUE(same_values(got[i], want[i], {1e-4, 2e-4})) << "gradient " << i;
  // Gradients written into out= targets of other layouts.
  std::vector<Tensor> outs{empty({2, 8, 6, 6}), empty({10, 8, 3, 3}).contiguous(kiln::channels_last),
                           zeros({20}).slice(0, 0, 20, 2)};
  call_op_out(op("convolution_backward"), {g.contiguous(kiln::channels_last), x.contiguous(kiln::channels_last), w},
              attrs, outs);
  EXPECT_TRUE(outs[0].is_contiguous());
  EXPECT_TRUE(outs[1].is_contiguous(kiln::channels_last));
  for (int i = 0; i < 3; ++i) EXPECT_TRUE(same_values(outs[i], want[i], {1e-4, 2e-4})) << "gradient " << i;
}

TEST(MemoryFormatConv, AutogradThroughChannelsLastConvolutions) {
  manual_seed(12);
  // Two stacked convolutions (3x3 then 1x1), as in a dense layer, trained on NHWC and NCHW.
  Tensor x = randn({2, 16, 8, 8}), w1 = randn({24, 16, 3, 3}), b1 = randn({24}), w2 = randn({8, 24, 1, 1});
  auto run = [&](bool channels_last) {
    Tensor xi = (channels_last ? x.contiguous(kiln::channels_last) : x.clone()).requires_grad_();
    Tensor a = w1.clone().requires_grad_(), b = b1.clone().requires_grad_(), c = w2.clone().requires_grad_();
    Tensor h = conv2d(xi, a, b, {1, 1}, {1, 1});
    Tensor y = conv2d(h * h, c);
    EXPECT_EQ(y.is_contiguous(kiln::channels_last), channels_last);
    // autograd::grad: the gradients as the backward ops return them (.grad() may re-lay them out).
    return autograd::grad({(y * y).sum()}, {xi, a, b, c});
  };
  TensorList want = run(false), got = run(true);
  EXPECT_TRUE(got[0].is_contiguous(kiln::channels_last));
  for (int i = 0; i < 4; ++i) {
    const double scale = values(want[i].abs().max())[0];
    EXPECT_TRUE(same_values(got[i], want[i], {1e-4, 1e-5 * scale})) << "gradient " << i;
  }
}

TEST(MemoryFormatConv, GradcheckOnChannelsLastFloat64) {
  manual_seed(13);
  auto rnd_cl = [](std::vector<int64_t> sizes) {
    return randn(sizes, kFloat64).contiguous(kiln::channels_last).requires_grad_();
  };
  auto rnd = [](std::vector<int64_t> sizes) { return randn(sizes, kFloat64).requires_grad_(); };
  const std::vector<std::pair<Conv, std::vector<int64_t>>> small = {
      {Conv{{1, 1}, {1, 1}, {1, 1}, 1}, {3, 2, 3, 3}},  // 3x3 padded
      {Conv{{2, 1}, {1, 0}, {1, 2}, 1}, {2, 3, 2, 2}},  // stride, dilation
      {Conv{{1, 1}, {1, 1}, {1, 1}, 2}, {4, 2, 3, 3}},  // groups
      {Conv{}, {3, 4, 1, 1}},                           // 1x1
  };
  for (const auto& [conv, wsize] : small) {
    const int64_t c_in = wsize[1] * conv.groups;
    autograd::Function f = [&](const TensorList& in) { return TensorList{conv(in[0], in[1], in[2])}; };
    EXPECT_TRUE(grad_ok(f, {rnd_cl({2, c_in, 4, 4}), rnd(wsize), rnd({wsize[0]})}));
    EXPECT_TRUE(grad_ok(f, {rnd({2, c_in, 4, 4}), rnd_cl(wsize), rnd({wsize[0]})}));
  }
  // Double backward: convolution_backward's own derivative on channels-last operands.
  const Conv conv{{1, 1}, {1, 1}, {1, 1}, 1};
  autograd::Function squared = [&](const TensorList& in) {
    Tensor y = conv(in[0], in[1], in[2]);
    return TensorList{y * y};
  };
  EXPECT_TRUE(gradgrad_ok(squared, {rnd_cl({1, 2, 4, 4}), rnd_cl({2, 2, 2, 2}), rnd({2})}));
}
