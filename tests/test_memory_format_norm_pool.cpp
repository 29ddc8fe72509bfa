// Channels-last (NHWC) batch norm and pooling: every op on channels-last input against the same
// op on contiguous input (float32 and float64), the layouts of the results (PyTorch's rule: a 4-D
// result follows its input's suggest_memory_format(), max pooling's indices too), running
// statistics, backward ops and autograd gradients (gradcheck on float64 channels-last input),
// mixed layouts, out= targets of the other layout, channel slices of a wider channels-last
// tensor, and the ambiguous shapes (one channel, 1x1 images, an empty batch).
#include <cmath>
#include <limits>

#include "reference.h"

using namespace kiln;
using kiln::testing::grad_ok;
using kiln::testing::matches;
using kiln::testing::op;
using kiln::testing::values;

namespace {

using Ints = std::vector<int64_t>;

Tensor cl(const Tensor& t) {
  return t.contiguous(kiln::channels_last);
}

// Values of `got` equal to `want`'s (row-major) within the dtype's tolerance (exactly: rtol 0).
::testing::AssertionResult same_values(const Tensor& got, const Tensor& want, bool exact = false) {
  std::optional<kiln::testing::Tolerance> tol;
  if (exact) tol = kiln::testing::Tolerance{0, 0};
  return matches(got, want.sizes().vec(), values(want), tol);
}

// Sums of thousands of float32 terms, added in another order: equal to a few units in the last
// place of the terms' running sums.
::testing::AssertionResult same_sums(const Tensor& got, const Tensor& want) {
  if (got.dtype() != kFloat32) return same_values(got, want);
  return matches(got, want.sizes().vec(), values(want), kiln::testing::Tolerance{1e-5, 1e-4});
}

::testing::AssertionResult is_channels_last(const Tensor& t) {
  if (t.is_contiguous(kiln::channels_last) && !t.is_contiguous())
    return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "strides " << shape_str(t.strides()) << " of shape "
                                       << shape_str(t.sizes()) << " are not channels-last";
}

::testing::AssertionResult is_contiguous(const Tensor& t) {
  if (t.is_contiguous()) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "strides " << shape_str(t.strides()) << " of shape "
                                       << shape_str(t.sizes()) << " are not contiguous";
}

// Weights every output element differently, so gradients of a sum do not vanish.
Tensor weighted(const Tensor& y) {
  Tensor w = linspace(-1, 2, y.numel(), kFloat64).view(y.sizes()).to(y.dtype());
  return y * w;
}

// ---- batch norm through the table ops ----

std::vector<Tensor> bn_forward(const Tensor& x, const Tensor& w, const Tensor& b, const Tensor& rm,
                               const Tensor& rv, bool training) {
  return call_op(op("native_batch_norm"), {x, w, b, rm, rv}, {training, 0.1, 1e-5});
}

std::vector<Tensor> bn_backward(const Tensor& grad, const Tensor& x, const Tensor& w,
                                const Tensor& mean, const Tensor& invstd, bool training,
                                Ints mask = {1, 1, 1}) {
  return call_op(op("native_batch_norm_backward"), {grad, x, w, mean, invstd}, {training, mask});
}

// ---- pooling attrs ----

struct MaxArgs {
  Ints kernel, stride, padding{0}, dilation{1};
  bool ceil_mode = false;
  std::vector<Attr> attrs() const { return {kernel, stride, padding, dilation, ceil_mode}; }
  std::vector<Attr> backward_attrs(const Ints& input_sizes) const {
    return {input_sizes, kernel, stride, padding, dilation, ceil_mode};
  }
};

struct AvgArgs {
  Ints kernel, stride, padding{0};
  bool ceil_mode = false, count_include_pad = true;
  std::optional<int64_t> divisor;
  std::vector<Attr> attrs() const {
    std::vector<Attr> a{kernel, stride, padding, ceil_mode, count_include_pad, Attr()};
    if (divisor) a.back() = *divisor;
    return a;
  }
  std::vector<Attr> backward_attrs(const Ints& input_sizes) const {
    std::vector<Attr> a{input_sizes};
    for (Attr& v : attrs()) a.push_back(v);
    return a;
  }
};

const std::vector<MaxArgs> kMaxCases = {
    {.kernel = {3, 3}, .stride = {2, 2}, .padding = {1, 1}},  // ResNet/DenseNet stem
    {.kernel = {2, 2}, .stride = {2, 2}},
    {.kernel = {3, 2}, .stride = {1, 2}, .padding = {1, 0}},
    {.kernel = {3, 3}, .stride = {2, 2}, .padding = {0, 0}, .dilation = {1, 1}, .ceil_mode = true},
    {.kernel = {2, 3}, .stride = {1, 1}, .padding = {1, 1}, .dilation = {2, 2}},
    {.kernel = {3, 3}, .stride = {3, 2}, .padding = {1, 1}, .dilation = {1, 2}, .ceil_mode = true},
};

const std::vector<AvgArgs> kAvgCases = {
    {.kernel = {2, 2}, .stride = {2, 2}},  // DenseNet transition (the tiled backward)
    {.kernel = {3, 3}, .stride = {2, 2}, .padding = {1, 1}},
    {.kernel = {3, 3}, .stride = {2, 2}, .padding = {1, 1}, .count_include_pad = false},
    {.kernel = {3, 2}, .stride = {2, 1}, .padding = {1, 0}, .ceil_mode = true},
    {.kernel = {3, 3},
     .stride = {2, 2},
     .padding = {1, 1},
     .ceil_mode = true,
     .count_include_pad = true},
    {.kernel = {2, 2}, .stride = {2, 2}, .divisor = 3},
    {.kernel = {2, 3}, .stride = {2, 3}},  // tiled, with uncovered rows and columns (7 x 8 input)
};

const std::vector<DType> kFloatTypes = {kFloat32, kFloat64};

}  // namespace

// ---------------- batch norm forward ----------------

TEST(MemoryFormatBatchNorm, TrainingOnChannelsLastMatchesContiguousAndKeepsTheLayout) {
  manual_seed(1);
  // Small, multi-threaded (several chunks of rows), and wide-channel shapes.
  for (const Ints& sizes :
       {Ints{4, 6, 5, 7}, Ints{8, 64, 16, 16}, Ints{3, 300, 4, 5}, Ints{2, 1024, 4, 4}}) {
    for (DType t : kFloatTypes) {
      SCOPED_TRACE(shape_str(sizes) + " " + std::string(dtype_name(t)));
      const int64_t c = sizes[1];
      Tensor x = (randn(sizes, t) * 3 + 5);
      Tensor w = randn({c}, t), b = randn({c}, t);
      Tensor rm_a = randn({c}, t), rv_a = rand({c}, t) + 0.5;
      Tensor rm_b = rm_a.clone(), rv_b = rv_a.clone();
      auto want = bn_forward(x, w, b, rm_a, rv_a, true);
      auto got = bn_forward(cl(x), w, b, rm_b, rv_b, true);
      EXPECT_TRUE(is_contiguous(want[0]));
      EXPECT_TRUE(is_channels_last(got[0]));
      EXPECT_TRUE(same_values(got[0], want[0]));
      EXPECT_TRUE(same_values(got[1], want[1]));
      EXPECT_TRUE(same_values(got[2], want[2]));
      EXPECT_TRUE(is_contiguous(got[1]) && got[1].dim() == 1);
      EXPECT_TRUE(same_values(rm_b, rm_a));
      EXPECT_TRUE(same_values(rv_b, rv_a));
    }
  }
}

TEST(MemoryFormatBatchNorm, LowPrecisionOnChannelsLastMatchesContiguous) {
  manual_seed(21);
  for (DType t : {kBFloat16, kFloat16}) {
    Tensor x = randn({4, 40, 6, 5}, kFloat32).to(t), grad = randn({4, 40, 6, 5}, kFloat32).to(t);
    Tensor w = randn({40}, kFloat32).to(t);
    auto want = bn_forward(x, w, Tensor(), Tensor(), Tensor(), true);
    auto got = bn_forward(cl(x), w, Tensor(), Tensor(), Tensor(), true);
    EXPECT_TRUE(is_channels_last(got[0]));
    EXPECT_TRUE(same_values(got[0], want[0]));
    EXPECT_EQ(got[1].dtype(), kFloat32);  // statistics in the accumulation type
    EXPECT_TRUE(matches(got[2], {40}, values(want[2]), kiln::testing::Tolerance{1e-5, 1e-5}));
    auto gwant = bn_backward(grad, x, w, want[1], want[2], true);
    auto ggot = bn_backward(cl(grad), cl(x), w, got[1], got[2], true);
    EXPECT_TRUE(is_channels_last(ggot[0]));
    EXPECT_TRUE(same_values(ggot[0], gwant[0]));
  }
}

TEST(MemoryFormatBatchNorm, ChannelsLastStatisticsMatchFloat64) {
  manual_seed(2);
  // A large mean next to a unit spread: the blocked one-pass statistics must not lose the
  // variance to cancellation.
  Tensor x64 = randn({16, 96, 12, 12}, kFloat64) + 1000;
  Tensor x = cl(x64.to(kFloat32));
  auto got = bn_forward(x, Tensor(), Tensor(), Tensor(), Tensor(), true);
  auto want = bn_forward(x.to(kFloat64).contiguous(), Tensor(), Tensor(), Tensor(), Tensor(), true);
  EXPECT_TRUE(matches(got[1], {96}, values(want[1]), kiln::testing::Tolerance{1e-6, 1e-4}));
  EXPECT_TRUE(matches(got[2], {96}, values(want[2]), kiln::testing::Tolerance{1e-4, 1e-4}));
  EXPECT_TRUE(matches(got[0], want[0].sizes().vec(), values(want[0]),
                      kiln::testing::Tolerance{1e-3, 1e-3}));
}

TEST(MemoryFormatBatchNorm, EvalOnChannelsLastMatchesContiguous) {
  manual_seed(3);
  for (DType t : kFloatTypes) {
    Tensor x = randn({3, 5, 4, 6}, t);
    Tensor w = randn({5}, t), b = randn({5}, t), rm = randn({5}, t), rv = rand({5}, t) + 0.5;
    Tensor rm_before = rm.clone(), rv_before = rv.clone();
    auto want = bn_forward(x, w, b, rm, rv, false);
    auto got = bn_forward(cl(x), w, b, rm, rv, false);
    EXPECT_TRUE(is_channels_last(got[0]));
    EXPECT_TRUE(same_values(got[0], want[0]));
    EXPECT_TRUE(same_values(rm, rm_before, true));  // evaluation leaves the running stats alone
    EXPECT_TRUE(same_values(rv, rv_before, true));
    // The public front-end too.
    Tensor y = batch_norm(cl(x), rm, rv, w, b, false, 0.1, 1e-5);
    EXPECT_TRUE(is_channels_last(y));
    EXPECT_TRUE(same_values(y, want[0]));
  }
}

TEST(MemoryFormatBatchNorm, ChannelSliceOfAWiderChannelsLastTensorIsReadInPlace) {
  manual_seed(4);
  // DenseNet-style: a layer normalizes the first channels of a wider channels-last buffer.
  Tensor wide = cl(randn({4, 12, 5, 6}));
  Tensor x = wide.narrow(1, 2, 7);
  ASSERT_FALSE(x.is_contiguous(kiln::channels_last));
  ASSERT_EQ(x.suggest_memory_format(), kiln::channels_last);
  Tensor w = randn({7}), b = randn({7});
  auto want = bn_forward(x.contiguous(), w, b, Tensor(), Tensor(), true);
  auto got = bn_forward(x, w, b, Tensor(), Tensor(), true);
  EXPECT_TRUE(is_channels_last(got[0]));
  EXPECT_TRUE(same_values(got[0], want[0]));
  EXPECT_TRUE(same_values(got[2], want[2]));
  Tensor grad = randn(x.sizes());
  auto gwant = bn_backward(grad, x.contiguous(), w, want[1], want[2], true);
  auto ggot = bn_backward(cl(grad), x, w, got[1], got[2], true);
  EXPECT_TRUE(is_channels_last(ggot[0]));
  for (int i = 0; i < 3; ++i) EXPECT_TRUE(same_values(ggot[i], gwant[i])) << i;
}

TEST(MemoryFormatBatchNorm, NonDenseAndOddlyStridedInputsStayCorrect) {
  manual_seed(5);
  Tensor base = randn({3, 4, 10, 6});
  // Every other row of a channels-last tensor: channels-last order, not dense.
  Tensor strided = cl(base).slice(2, 0, 10, 2);
  // N and C swapped in memory: neither layout.
  Tensor odd = randn({4, 3, 5, 6}).transpose(0, 1);
  for (const Tensor& x : {strided, odd}) {
    auto want = bn_forward(x.contiguous(), Tensor(), Tensor(), Tensor(), Tensor(), true);
    auto got = bn_forward(x, Tensor(), Tensor(), Tensor(), Tensor(), true);
    EXPECT_TRUE(same_values(got[0], want[0]));
    EXPECT_EQ(got[0].suggest_memory_format(), x.suggest_memory_format());
    Tensor grad = randn(x.sizes());
    auto gwant = bn_backward(grad, x.contiguous(), Tensor(), want[1], want[2], true);
    auto ggot = bn_backward(grad, x, Tensor(), got[1], got[2], true);
    for (int i = 0; i < 3; ++i) EXPECT_TRUE(same_values(ggot[i], gwant[i])) << i;
  }
}

TEST(MemoryFormatBatchNorm, OutTargetsOfTheOtherLayout) {
  manual_seed(6);
  Tensor x = randn({2, 5, 4, 3}), w = randn({5}), b = randn({5});
  auto want = bn_forward(x, w, b, Tensor(), Tensor(), true);
  // Channels-last input into contiguous outputs, and contiguous input into a channels-last one.
  for (bool input_cl : {true, false}) {
    std::vector<Tensor> outs{input_cl ? empty({2, 5, 4, 3}) : cl(empty({2, 5, 4, 3})), empty({5}),
                             empty({5})};
    call_op_out(op("native_batch_norm"), {input_cl ? cl(x) : x, w, b, Tensor(), Tensor()},
                {true, 0.1, 1e-5}, outs);
    EXPECT_TRUE(input_cl ? is_contiguous(outs[0]) : is_channels_last(outs[0]));
    for (int i = 0; i < 3; ++i) EXPECT_TRUE(same_values(outs[i], want[i])) << i;
  }
  // A channel slice of a wider channels-last tensor as the target (written in place).
  Tensor wide = cl(zeros({2, 9, 4, 3}));
  std::vector<Tensor> outs{wide.narrow(1, 3, 5), empty({5}), empty({5})};
  call_op_out(op("native_batch_norm"), {cl(x), w, b, Tensor(), Tensor()}, {true, 0.1, 1e-5}, outs);
  EXPECT_TRUE(same_values(wide.narrow(1, 3, 5), want[0]));
  EXPECT_TRUE(same_values(wide.narrow(1, 0, 3), zeros({2, 3, 4, 3}), true));

  // The backward op's grad_input.
  Tensor grad = randn({2, 5, 4, 3});
  auto gwant = bn_backward(grad, x, w, want[1], want[2], true);
  std::vector<Tensor> gouts{empty({2, 5, 4, 3}), empty({5}), empty({5})};
  call_op_out(op("native_batch_norm_backward"), {cl(grad), cl(x), w, want[1], want[2]},
              {true, Ints{1, 1, 1}}, gouts);
  for (int i = 0; i < 3; ++i) EXPECT_TRUE(same_values(gouts[i], gwant[i])) << i;
}

TEST(MemoryFormatBatchNorm, AmbiguousShapesAndEmptyBatch) {
  manual_seed(7);
  // One channel, and 1x1 images: both layouts order memory alike, so results are contiguous.
  for (const Ints& sizes : {Ints{4, 1, 3, 5}, Ints{6, 7, 1, 1}}) {
    Tensor x = randn(sizes);
    Tensor x_cl = cl(x);
    auto want = bn_forward(x, Tensor(), Tensor(), Tensor(), Tensor(), true);
    auto got = bn_forward(x_cl, Tensor(), Tensor(), Tensor(), Tensor(), true);
    EXPECT_TRUE(is_contiguous(got[0]));
    EXPECT_TRUE(same_values(got[0], want[0]));
    Tensor grad = randn(sizes);
    auto gwant = bn_backward(grad, x, Tensor(), want[1], want[2], true);
    auto ggot = bn_backward(cl(grad), x_cl, Tensor(), got[1], got[2], true);
    for (int i = 0; i < 3; ++i) EXPECT_TRUE(same_values(ggot[i], gwant[i])) << i;
  }
  // An empty batch: no values, no error; eval mode normalizes nothing.
  Tensor empty_cl = cl(empty({0, 3, 4, 4}));
  Tensor rm = zeros({3}), rv = ones({3});
  auto y = bn_forward(empty_cl, Tensor(), Tensor(), rm, rv, false);
  EXPECT_EQ(y[0].sizes().vec(), (Ints{0, 3, 4, 4}));
  auto t = bn_forward(empty_cl, Tensor(), Tensor(), rm, rv, true);
  EXPECT_EQ(t[0].numel(), 0);
  EXPECT_TRUE(same_values(rm, zeros({3}), true));
  auto g = bn_backward(empty_cl, empty_cl, Tensor(), t[1], t[2], true);
  EXPECT_EQ(g[0].numel(), 0);
  EXPECT_TRUE(same_values(g[2], zeros({3}), true));
}

// ---------------- batch norm backward ----------------

TEST(MemoryFormatBatchNorm, BackwardOpOnChannelsLastMatchesContiguous) {
  manual_seed(8);
  for (const Ints& sizes : {Ints{4, 6, 5, 7}, Ints{8, 64, 16, 16}, Ints{2, 600, 3, 3}}) {
    for (DType t : kFloatTypes) {
      for (bool training : {true, false}) {
        SCOPED_TRACE(shape_str(sizes) + " " + std::string(dtype_name(t)) +
                     (training ? " train" : " eval"));
        const int64_t c = sizes[1];
        Tensor x = randn(sizes, t), grad = randn(sizes, t), w = randn({c}, t);
        Tensor rm = randn({c}, t), rv = rand({c}, t) + 0.5;
        auto fwd = bn_forward(x, w, Tensor(), rm, rv, training);
        auto want = bn_backward(grad, x, w, fwd[1], fwd[2], training);
        auto got = bn_backward(cl(grad), cl(x), w, fwd[1], fwd[2], training);
        EXPECT_TRUE(is_contiguous(want[0]));
        EXPECT_TRUE(is_channels_last(got[0]));
        for (int i = 0; i < 3; ++i) EXPECT_TRUE(same_sums(got[i], want[i])) << i;
        // Mixed layouts: grad_input follows the input, whatever grad_output's layout.
        auto mixed = bn_backward(grad, cl(x), w, fwd[1], fwd[2], training);
        EXPECT_TRUE(is_channels_last(mixed[0]));
        for (int i = 0; i < 3; ++i) EXPECT_TRUE(same_sums(mixed[i], want[i])) << i;
        auto mixed2 = bn_backward(cl(grad), x, w, fwd[1], fwd[2], training);
        EXPECT_TRUE(is_contiguous(mixed2[0]));
        for (int i = 0; i < 3; ++i) EXPECT_TRUE(same_sums(mixed2[i], want[i])) << i;
        // Only the parameter gradients.
        auto params = bn_backward(cl(grad), cl(x), w, fwd[1], fwd[2], training, {0, 1, 1});
        EXPECT_EQ(params[0].numel(), 0);
        EXPECT_TRUE(same_sums(params[1], want[1]));
        EXPECT_TRUE(same_sums(params[2], want[2]));
      }
    }
  }
}

namespace {

// Runs y = f(x) and backpropagates an upstream gradient in y's layout (as the next layer of a
// channels-last network passes it). Returns y, the gradient reaching x (seen by a hook, before
// accumulation into .grad(), which owns its memory layout), and x.grad().
std::vector<Tensor> forward_backward(const Tensor& input,
                                     const std::function<Tensor(const Tensor&)>& f) {
  Tensor x = input.detach().requires_grad_();
  Tensor reaching;
  x.register_hook([&](const Tensor& g) {
    reaching = g;
    return Tensor();
  });
  Tensor y = f(x);
  Tensor upstream = linspace(-1, 2, y.numel(), kFloat64).view(y.sizes()).sin().to(y.dtype());
  y.backward(upstream.contiguous(y.suggest_memory_format()));
  return {y, reaching, x.grad()};
}

}  // namespace

TEST(MemoryFormatBatchNorm, AutogradGradientsOnChannelsLastInput) {
  manual_seed(9);
  Tensor x0 = randn({3, 4, 5, 3}, kFloat64), w0 = randn({4}, kFloat64), b0 = randn({4}, kFloat64);
  Tensor w_grad[2], b_grad[2];
  std::vector<Tensor> results[2];
  for (int layout = 0; layout < 2; ++layout) {
    Tensor w = w0.clone().requires_grad_(), b = b0.clone().requires_grad_();
    results[layout] = forward_backward(layout ? cl(x0) : x0, [&](const Tensor& x) {
      return batch_norm(x, Tensor(), Tensor(), w, b, true, 0.1, 1e-5);
    });
    w_grad[layout] = w.grad();
    b_grad[layout] = b.grad();
  }
  EXPECT_TRUE(is_channels_last(results[1][0]));
  EXPECT_TRUE(is_channels_last(results[1][1]));
  for (int i = 0; i < 3; ++i) EXPECT_TRUE(same_values(results[1][i], results[0][i])) << i;
  EXPECT_TRUE(same_values(w_grad[1], w_grad[0]));
  EXPECT_TRUE(same_values(b_grad[1], b_grad[0]));

  autograd::Function train = [](const TensorList& in) {
    return TensorList{
        weighted(batch_norm(in[0], Tensor(), Tensor(), in[1], in[2], true, 0.1, 1e-5))};
  };
  EXPECT_TRUE(grad_ok(
      train, {cl(randn({2, 3, 3, 2}, kFloat64)).requires_grad_(),
              randn({3}, kFloat64).requires_grad_(), randn({3}, kFloat64).requires_grad_()}));
  Tensor rm = randn({3}, kFloat64), rv = rand({3}, kFloat64) + 0.5;
  autograd::Function eval = [&](const TensorList& in) {
    return TensorList{weighted(batch_norm(in[0], rm, rv, in[1], Tensor(), false, 0.1, 1e-5))};
  };
  EXPECT_TRUE(grad_ok(eval, {cl(randn({2, 3, 3, 2}, kFloat64)).requires_grad_(),
                             randn({3}, kFloat64).requires_grad_()}));
}

// ---------------- pooling forward ----------------

TEST(MemoryFormatPool, MaxPoolOnChannelsLastMatchesContiguousIndicesIncluded) {
  manual_seed(10);
  for (DType t : {kFloat32, kFloat64, kInt32, kBFloat16}) {
    for (const Ints& sizes : {Ints{2, 5, 9, 8}, Ints{3, 70, 7, 6}}) {
      // Integers and bfloat16: many ties.
      Tensor x = t == kInt32 ? randint(-3, 4, sizes, kInt32) : randn(sizes, kFloat32).to(t);
      for (const MaxArgs& a : kMaxCases) {
        SCOPED_TRACE(shape_str(sizes) + " " + std::string(dtype_name(t)) + " kernel " +
                     shape_str(a.kernel) + " stride " + shape_str(a.stride) +
                     (a.ceil_mode ? " ceil" : ""));
        auto want = call_op(op("max_pool2d_with_indices"), {x}, a.attrs());
        auto got = call_op(op("max_pool2d_with_indices"), {cl(x)}, a.attrs());
        EXPECT_TRUE(is_channels_last(got[0]));
        EXPECT_TRUE(is_channels_last(got[1]));
        EXPECT_TRUE(same_values(got[0], want[0], true));
        EXPECT_TRUE(same_values(got[1], want[1], true));
        Tensor plain = call_op1(op("max_pool2d"), {cl(x)}, a.attrs());
        EXPECT_TRUE(is_channels_last(plain));
        EXPECT_TRUE(same_values(plain, want[0], true));
      }
    }
  }
}

TEST(MemoryFormatPool, MaxPoolNaNAndInfinityRulesHoldOnChannelsLast) {
  Tensor x = randn({1, 3, 4, 4});
  x.index_put_({0, 1, 1, 2}, std::numeric_limits<double>::quiet_NaN());
  x.index_put_({0, 2}, -std::numeric_limits<double>::infinity());
  MaxArgs a{.kernel = {2, 2}, .stride = {1, 1}};
  auto want = call_op(op("max_pool2d_with_indices"), {x}, a.attrs());
  auto got = call_op(op("max_pool2d_with_indices"), {cl(x)}, a.attrs());
  EXPECT_TRUE(same_values(got[0], want[0], true));
  EXPECT_TRUE(same_values(got[1], want[1], true));
  EXPECT_TRUE(std::isnan(got[0].index({0, 1, 0, 1}).item<float>()));
}

TEST(MemoryFormatPool, AvgPoolOnChannelsLastMatchesContiguous) {
  manual_seed(11);
  for (DType t : {kFloat32, kFloat64, kBFloat16}) {
    for (const Ints& sizes : {Ints{2, 5, 9, 8}, Ints{3, 70, 7, 8}}) {
      Tensor x = randn(sizes, kFloat32).to(t);
      for (const AvgArgs& a : kAvgCases) {
        SCOPED_TRACE(shape_str(sizes) + " " + std::string(dtype_name(t)) + " kernel " +
                     shape_str(a.kernel));
        Tensor want = call_op1(op("avg_pool2d"), {x}, a.attrs());
        Tensor got = call_op1(op("avg_pool2d"), {cl(x)}, a.attrs());
        EXPECT_TRUE(is_channels_last(got));
        EXPECT_TRUE(same_values(got, want));
      }
    }
  }
}

TEST(MemoryFormatPool, AdaptiveAvgPoolOnChannelsLastMatchesContiguous) {
  manual_seed(12);
  for (DType t : kFloatTypes) {
    Tensor x = randn({3, 66, 7, 9}, t);
    for (const Ints& out : {Ints{1, 1}, Ints{3, 4}, Ints{7, 9}, Ints{5, 2}}) {
      Tensor want = adaptive_avg_pool2d(x, out);
      Tensor got = adaptive_avg_pool2d(cl(x), out);
      EXPECT_TRUE(same_values(got, want));
      // (N, C, 1, 1) is ambiguous: its channels-last strides are contiguous ones.
      EXPECT_TRUE(got.is_contiguous(kiln::channels_last));
      if (out != Ints{1, 1}) {
        EXPECT_TRUE(is_channels_last(got));
      }
    }
  }
}

TEST(MemoryFormatPool, ChannelSlicesAndStridedInputs) {
  manual_seed(13);
  Tensor wide = cl(randn({2, 10, 8, 7}));
  Tensor slice = wide.narrow(1, 3, 5);               // channels adjacent, not dense
  Tensor strided = wide.slice(3, 0, 7, 2);           // every other column
  Tensor odd = randn({5, 2, 8, 7}).transpose(0, 1);  // neither layout
  MaxArgs m{.kernel = {3, 3}, .stride = {2, 2}, .padding = {1, 1}};
  AvgArgs v{.kernel = {3, 3}, .stride = {2, 2}, .padding = {1, 1}};
  for (const Tensor& x : {slice, strided, odd}) {
    auto want = call_op(op("max_pool2d_with_indices"), {x.contiguous()}, m.attrs());
    auto got = call_op(op("max_pool2d_with_indices"), {x}, m.attrs());
    EXPECT_EQ(got[0].suggest_memory_format(), x.suggest_memory_format());
    EXPECT_TRUE(same_values(got[0], want[0], true));
    EXPECT_TRUE(same_values(got[1], want[1], true));
    EXPECT_TRUE(same_values(call_op1(op("avg_pool2d"), {x}, v.attrs()),
                            call_op1(op("avg_pool2d"), {x.contiguous()}, v.attrs())));
    EXPECT_TRUE(
        same_values(adaptive_avg_pool2d(x, {3, 2}), adaptive_avg_pool2d(x.contiguous(), {3, 2})));
  }
}

TEST(MemoryFormatPool, OutTargetsOfTheOtherLayout) {
  manual_seed(14);
  Tensor x = randn({2, 6, 7, 7});
  MaxArgs m{.kernel = {3, 3}, .stride = {2, 2}, .padding = {1, 1}};
  AvgArgs v{.kernel = {3, 3}, .stride = {2, 2}, .padding = {1, 1}};
  auto want = call_op(op("max_pool2d_with_indices"), {x}, m.attrs());
  Tensor want_avg = call_op1(op("avg_pool2d"), {x}, v.attrs());
  const Ints out_sizes{2, 6, 4, 4};
  for (bool input_cl : {true, false}) {
    auto target = [&](DType t) { return input_cl ? empty(out_sizes, t) : cl(empty(out_sizes, t)); };
    const Tensor input = input_cl ? cl(x) : x;
    std::vector<Tensor> outs{target(kFloat32), target(kInt64)};
    call_op_out(op("max_pool2d_with_indices"), {input}, m.attrs(), outs);
    EXPECT_TRUE(same_values(outs[0], want[0], true));
    EXPECT_TRUE(same_values(outs[1], want[1], true));
    std::vector<Tensor> avg{target(kFloat32)};
    call_op_out(op("avg_pool2d"), {input}, v.attrs(), avg);
    EXPECT_TRUE(same_values(avg[0], want_avg));
    std::vector<Tensor> adaptive{target(kFloat32)};
    call_op_out(op("adaptive_avg_pool2d"), {input}, {Ints{4, 4}}, adaptive);
    EXPECT_TRUE(same_values(adaptive[0], adaptive_avg_pool2d(x, {4, 4})));
  }
  // Mismatched layouts between the two outputs, and a channel slice as the target.
  Tensor wide = cl(zeros({2, 9, 4, 4}));
  std::vector<Tensor> outs{wide.narrow(1, 2, 6), empty(out_sizes, kInt64)};
  call_op_out(op("max_pool2d_with_indices"), {cl(x)}, m.attrs(), outs);
  EXPECT_TRUE(same_values(outs[0], want[0], true));
  EXPECT_TRUE(same_values(outs[1], want[1], true));
  EXPECT_TRUE(same_values(wide.narrow(1, 0, 2), zeros({2, 2, 4, 4}), true));
}

TEST(MemoryFormatPool, AmbiguousShapesEmptyBatchAndUnbatchedInput) {
  manual_seed(15);
  MaxArgs m{.kernel = {2, 2}, .stride = {2, 2}};
  AvgArgs v{.kernel = {2, 2}, .stride = {2, 2}};
  // One channel: channels-last strides are contiguous ones, results contiguous.
  Tensor one = randn({3, 1, 6, 4});
  auto want = call_op(op("max_pool2d_with_indices"), {one}, m.attrs());
  auto got = call_op(op("max_pool2d_with_indices"), {cl(one)}, m.attrs());
  EXPECT_TRUE(is_contiguous(got[0]));
  EXPECT_TRUE(same_values(got[1], want[1], true));
  // 1x1 images.
  Tensor pixel = randn({2, 5, 1, 1});
  Tensor y =
      call_op1(op("max_pool2d"), {cl(pixel)}, MaxArgs{.kernel = {1, 1}, .stride = {1, 1}}.attrs());
  EXPECT_TRUE(same_values(y, pixel, true));
  EXPECT_TRUE(same_values(adaptive_avg_pool2d(cl(pixel), {1, 1}), pixel));
  // A channels-last input pooled to 1x1, then its gradient (DenseNet's global pooling).
  Tensor x = randn({2, 5, 4, 4});
  Tensor g = randn({2, 5, 1, 1});
  Tensor dx_want = call_op1(op("adaptive_avg_pool2d_backward"), {g}, {Ints{2, 5, 4, 4}});
  Tensor dx_got = call_op1(op("adaptive_avg_pool2d_backward"), {cl(g)}, {Ints{2, 5, 4, 4}});
  EXPECT_TRUE(same_values(dx_got, dx_want));
  // An empty batch.
  Tensor none = cl(empty({0, 4, 6, 6}));
  auto e = call_op(op("max_pool2d_with_indices"), {none}, m.attrs());
  EXPECT_EQ(e[0].sizes().vec(), (Ints{0, 4, 3, 3}));
  EXPECT_EQ(call_op1(op("avg_pool2d"), {none}, v.attrs()).numel(), 0);
  EXPECT_EQ(adaptive_avg_pool2d(none, {2, 2}).numel(), 0);
  Tensor de = call_op1(op("max_pool2d_with_indices_backward"), {e[0], e[1]},
                       m.backward_attrs({0, 4, 6, 6}));
  EXPECT_EQ(de.sizes().vec(), (Ints{0, 4, 6, 6}));
  EXPECT_EQ(call_op1(op("avg_pool2d_backward"), {e[0]}, v.backward_attrs({0, 4, 6, 6})).numel(), 0);
  // Unbatched (C, H, W) input: 3-D results stay contiguous.
  Tensor chw = randn({3, 6, 6});
  EXPECT_TRUE(is_contiguous(max_pool2d(chw, {2, 2})));
}

// ---------------- pooling backward ----------------

TEST(MemoryFormatPool, MaxPoolBackwardOnChannelsLastMatchesContiguous) {
  manual_seed(16);
  for (DType t : kFloatTypes) {
    for (const MaxArgs& a : kMaxCases) {
      const Ints sizes{2, 70, 9, 8};
      Tensor x = randn(sizes, t);
      auto fwd = call_op(op("max_pool2d_with_indices"), {x}, a.attrs());
      auto fwd_cl = call_op(op("max_pool2d_with_indices"), {cl(x)}, a.attrs());
      Tensor grad = randn(fwd[0].sizes(), t);
      Tensor want =
          call_op1(op("max_pool2d_with_indices_backward"), {grad, fwd[1]}, a.backward_attrs(sizes));
      Tensor got = call_op1(op("max_pool2d_with_indices_backward"), {cl(grad), fwd_cl[1]},
                            a.backward_attrs(sizes));
      EXPECT_TRUE(is_channels_last(got));
      EXPECT_TRUE(same_values(got, want));
      // Mixed: channels-last indices (the input's layout) with a contiguous grad_output.
      Tensor mixed = call_op1(op("max_pool2d_with_indices_backward"), {grad, fwd_cl[1]},
                              a.backward_attrs(sizes));
      EXPECT_TRUE(is_channels_last(mixed));
      EXPECT_TRUE(same_values(mixed, want));
      // And into a contiguous out= target.
      std::vector<Tensor> outs{empty(sizes, t)};
      call_op_out(op("max_pool2d_with_indices_backward"), {cl(grad), fwd_cl[1]},
                  a.backward_attrs(sizes), outs);
      EXPECT_TRUE(same_values(outs[0], want));
    }
  }
  // Out-of-range indices are a clear error on this path too.
  Tensor bad = cl(full({1, 3, 2, 2}, 99, kInt64));
  EXPECT_THROW(call_op1(op("max_pool2d_with_indices_backward"), {cl(ones({1, 3, 2, 2})), bad},
                        MaxArgs{.kernel = {2, 2}, .stride = {2, 2}}.backward_attrs({1, 3, 4, 4})),
               IndexError);
}

TEST(MemoryFormatPool, AvgPoolBackwardOnChannelsLastMatchesContiguous) {
  manual_seed(17);
  for (DType t : kFloatTypes) {
    for (const AvgArgs& a : kAvgCases) {
      const Ints sizes{2, 70, 7, 8};
      Tensor grad = randn(call_op1(op("avg_pool2d"), {zeros(sizes, t)}, a.attrs()).sizes(), t);
      Tensor want = call_op1(op("avg_pool2d_backward"), {grad}, a.backward_attrs(sizes));
      Tensor got = call_op1(op("avg_pool2d_backward"), {cl(grad)}, a.backward_attrs(sizes));
      EXPECT_TRUE(is_channels_last(got));
      EXPECT_TRUE(same_values(got, want));
      std::vector<Tensor> outs{empty(sizes, t)};
      call_op_out(op("avg_pool2d_backward"), {cl(grad)}, a.backward_attrs(sizes), outs);
      EXPECT_TRUE(same_values(outs[0], want));
      std::vector<Tensor> outs_cl{cl(empty(sizes, t))};
      call_op_out(op("avg_pool2d_backward"), {grad}, a.backward_attrs(sizes), outs_cl);
      EXPECT_TRUE(same_values(outs_cl[0], want));
    }
  }
}

TEST(MemoryFormatPool, AdaptiveAvgPoolBackwardOnChannelsLastMatchesContiguous) {
  manual_seed(18);
  for (DType t : kFloatTypes) {
    const Ints sizes{3, 66, 7, 9};
    for (const Ints& out : {Ints{3, 4}, Ints{7, 9}, Ints{5, 2}, Ints{2, 1}}) {
      Tensor grad = randn({3, 66, out[0], out[1]}, t);
      Tensor want = call_op1(op("adaptive_avg_pool2d_backward"), {grad}, {sizes});
      Tensor got = call_op1(op("adaptive_avg_pool2d_backward"), {cl(grad)}, {sizes});
      EXPECT_TRUE(is_channels_last(got));
      EXPECT_TRUE(same_values(got, want));
    }
    // Global pooling into a channels-last target.
    Tensor grad = randn({3, 66, 1, 1}, t);
    std::vector<Tensor> outs{cl(empty(sizes, t))};
    call_op_out(op("adaptive_avg_pool2d_backward"), {grad}, {sizes}, outs);
    EXPECT_TRUE(
        same_values(outs[0], call_op1(op("adaptive_avg_pool2d_backward"), {grad}, {sizes})));
  }
}

TEST(MemoryFormatPool, AutogradGradientsOnChannelsLastInput) {
  manual_seed(19);
  Tensor x0 = randn({2, 4, 7, 6}, kFloat64);
  const std::vector<std::function<Tensor(const Tensor&)>> fns = {
      [](const Tensor& x) {
        return max_pool2d(x, {3, 3}, {2, 2}, {1, 1});
      },
      [](const Tensor& x) {
        return max_pool2d(x, {2, 3}, {1, 2}, {1, 1}, {1, 1}, true);
      },
      [](const Tensor& x) {
        return avg_pool2d(x, {3, 3}, {2, 2}, {1, 1}, true, false);
      },
      [](const Tensor& x) {
        return avg_pool2d(x, {2, 2});
      },
      [](const Tensor& x) {
        return adaptive_avg_pool2d(x, {3, 2});
      },
      [](const Tensor& x) {
        return adaptive_avg_pool2d(x, {1, 1});
      },
  };
  for (size_t i = 0; i < fns.size(); ++i) {
    SCOPED_TRACE("case " + std::to_string(i));
    auto want = forward_backward(x0, fns[i]);
    auto got = forward_backward(cl(x0), fns[i]);
    for (int k = 0; k < 3; ++k) EXPECT_TRUE(same_values(got[k], want[k])) << k;
    if (i != 5) {  // a 1x1 output (and its gradient) is ambiguous
      EXPECT_TRUE(is_channels_last(got[0]));
      EXPECT_TRUE(is_channels_last(got[1]));
    }
    autograd::Function f = [&](const TensorList& in) {
      return TensorList{weighted(fns[i](in[0]))};
    };
    EXPECT_TRUE(grad_ok(f, {cl(randn({2, 3, 5, 4}, kFloat64)).requires_grad_()}));
  }
}
