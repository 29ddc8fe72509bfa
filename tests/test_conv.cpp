// Convolution and pooling: conv2d (padding, stride, dilation, groups, bias, "same"/"valid"),
// max_pool2d (with indices), avg_pool2d and adaptive_avg_pool2d against float64 loops written here.
#include <cmath>
#include <limits>
#include <random>
#include <thread>

#include "reference.h"

using namespace kiln;
using kiln::testing::numel_of;
using kiln::testing::random_tensor;
using kiln::testing::matches;
using kiln::testing::Tolerance;
using kiln::testing::values;

namespace {

struct ConvArgs {
  std::vector<int64_t> stride{1, 1}, padding{0, 0}, dilation{1, 1};
  int64_t groups = 1;
};

// Direct convolution over float64 values; x (N, C, H, W), w (O, C / groups, kH, kW).
std::vector<double> ref_conv2d(const Tensor& x, const Tensor& w, const Tensor& b, const ConvArgs& a,
                               std::vector<int64_t>* out_sizes) {
  const auto xv = values(x), wv = values(w);
  const std::vector<double> bv = b.defined() ? values(b) : std::vector<double>();
  const int64_t n = x.size(0), c = x.size(1), h = x.size(2), wd = x.size(3);
  const int64_t o = w.size(0), cg = w.size(1), kh = w.size(2), kw = w.size(3), og = o / a.groups;
  const int64_t oh = (h + 2 * a.padding[0] - a.dilation[0] * (kh - 1) - 1) / a.stride[0] + 1;
  const int64_t ow = (wd + 2 * a.padding[1] - a.dilation[1] * (kw - 1) - 1) / a.stride[1] + 1;
  *out_sizes = {n, o, oh, ow};
  std::vector<double> out(static_cast<size_t>(n * o * oh * ow));
  for (int64_t in = 0; in < n; ++in)
    for (int64_t oc = 0; oc < o; ++oc) {
      const int64_t g = oc / og;
      for (int64_t y = 0; y < oh; ++y)
        for (int64_t z = 0; z < ow; ++z) {
          double s = bv.empty() ? 0.0 : bv[oc];
          for (int64_t ic = 0; ic < cg; ++ic)
            for (int64_t i = 0; i < kh; ++i)
              for (int64_t j = 0; j < kw; ++j) {
                const int64_t ih = y * a.stride[0] - a.padding[0] + i * a.dilation[0];
                const int64_t iw = z * a.stride[1] - a.padding[1] + j * a.dilation[1];
                if (ih < 0 || ih >= h || iw < 0 || iw >= wd) continue;
                s += xv[((in * c + g * cg + ic) * h + ih) * wd + iw] * wv[((oc * cg + ic) * kh + i) * kw + j];
              }
          out[((in * o + oc) * oh + y) * ow + z] = s;
        }
    }
  (void)c;
  return out;
}

::testing::AssertionResult conv_matches(const Tensor& x, const Tensor& w, const Tensor& b, const ConvArgs& a,
                                        std::optional<Tolerance> tol = {}) {
  std::vector<int64_t> sizes;
  auto ref = ref_conv2d(x, w, b, a, &sizes);
  return matches(conv2d(x, w, b, a.stride, a.padding, a.dilation, a.groups), sizes, ref, tol);
}

// PyTorch's pooling output size.
int64_t pooled(int64_t in, int64_t k, int64_t p, int64_t s, int64_t d, bool ceil_mode) {
  int64_t num = in + 2 * p - d * (k - 1) - 1 + (ceil_mode ? s - 1 : 0);
  int64_t out = static_cast<int64_t>(std::floor(static_cast<double>(num) / static_cast<double>(s))) + 1;
  if (ceil_mode && (out - 1) * s >= in + p) --out;
  return out;
}

struct PoolArgs {
  std::vector<int64_t> kernel, stride, padding{0, 0}, dilation{1, 1};
  bool ceil_mode = false;
};

// Max pooling over planes of the last two dims; padding never wins (it is -inf).
std::vector<double> ref_max_pool(const Tensor& x, const PoolArgs& a, std::vector<int64_t>* sizes,
                                 std::vector<double>* indices) {
  const auto xv = values(x);
  const int64_t h = x.size(-2), w = x.size(-1), planes = x.numel() / (h * w);
  const std::vector<int64_t> st = a.stride.empty() ? a.kernel : a.stride;
  const int64_t oh = pooled(h, a.kernel[0], a.padding[0], st[0], a.dilation[0], a.ceil_mode);
  const int64_t ow = pooled(w, a.kernel[1], a.padding[1], st[1], a.dilation[1], a.ceil_mode);
  *sizes = x.sizes().vec();
  sizes->at(sizes->size() - 2) = oh;
  sizes->back() = ow;
  std::vector<double> out;
  for (int64_t p = 0; p < planes; ++p)
    for (int64_t y = 0; y < oh; ++y)
      for (int64_t z = 0; z < ow; ++z) {
        double best = -std::numeric_limits<double>::infinity();
        int64_t best_index = -1;
        for (int64_t i = 0; i < a.kernel[0]; ++i)
          for (int64_t j = 0; j < a.kernel[1]; ++j) {
            const int64_t ih = y * st[0] - a.padding[0] + i * a.dilation[0];
            const int64_t iw = z * st[1] - a.padding[1] + j * a.dilation[1];
            if (ih < 0 || ih >= h || iw < 0 || iw >= w) continue;
            const double v = xv[(p * h + ih) * w + iw];
            if (best_index < 0 || v > best || std::isnan(v)) {
              best = v;
              best_index = ih * w + iw;
            }
          }
        out.push_back(best);
        if (indices) indices->push_back(static_cast<double>(best_index));
      }
  return out;
}

std::vector<double> ref_avg_pool(const Tensor& x, const PoolArgs& a, bool count_include_pad,
                                 std::optional<int64_t> divisor, std::vector<int64_t>* sizes) {
  const auto xv = values(x);
  const int64_t h = x.size(-2), w = x.size(-1), planes = x.numel() / (h * w);
  const std::vector<int64_t> st = a.stride.empty() ? a.kernel : a.stride;
  const int64_t oh = pooled(h, a.kernel[0], a.padding[0], st[0], 1, a.ceil_mode);
  const int64_t ow = pooled(w, a.kernel[1], a.padding[1], st[1], 1, a.ceil_mode);
  *sizes = x.sizes().vec();
  sizes->at(sizes->size() - 2) = oh;
  sizes->back() = ow;
  std::vector<double> out;
  for (int64_t p = 0; p < planes; ++p)
    for (int64_t y = 0; y < oh; ++y)
      for (int64_t z = 0; z < ow; ++z) {
        double sum = 0;
        int64_t inside = 0, padded_window = 0;
        for (int64_t i = 0; i < a.kernel[0]; ++i)
          for (int64_t j = 0; j < a.kernel[1]; ++j) {
            const int64_t ih = y * st[0] - a.padding[0] + i, iw = z * st[1] - a.padding[1] + j;
            // The padded window stops at the padding; positions beyond it (ceil_mode) don't count.
            if (ih < h + a.padding[0] && iw < w + a.padding[1]) ++padded_window;
            if (ih < 0 || ih >= h || iw < 0 || iw >= w) continue;
            sum += xv[(p * h + ih) * w + iw];
            ++inside;
          }
        const double d = divisor ? static_cast<double>(*divisor)
                                 : static_cast<double>(count_include_pad ? padded_window : inside);
        out.push_back(sum / d);
      }
  return out;
}

std::vector<double> ref_adaptive_avg(const Tensor& x, int64_t oh, int64_t ow) {
  const auto xv = values(x);
  const int64_t h = x.size(-2), w = x.size(-1), planes = x.numel() / (h * w);
  std::vector<double> out;
  for (int64_t p = 0; p < planes; ++p)
    for (int64_t y = 0; y < oh; ++y)
      for (int64_t z = 0; z < ow; ++z) {
        const int64_t h0 = y * h / oh, h1 = ((y + 1) * h + oh - 1) / oh;
        const int64_t w0 = z * w / ow, w1 = ((z + 1) * w + ow - 1) / ow;
        double s = 0;
        for (int64_t i = h0; i < h1; ++i)
          for (int64_t j = w0; j < w1; ++j) s += xv[(p * h + i) * w + j];
        out.push_back(s / static_cast<double>((h1 - h0) * (w1 - w0)));
      }
  return out;
}

// float32 convolutions reassociate their sums (blocked kernels), so long reductions get a
// tolerance scaled to the reduction length.
const Tolerance kLongSumFloat32{1e-5, 1e-4};

}  // namespace

// ---------------- conv2d ----------------

TEST(Conv2d, MatchesNaiveConvolutionForPaddingStrideDilation) {
  for (DType t : {kFloat32, kFloat64}) {
    Tensor x = random_tensor({2, 3, 7, 6}, t, 1);
    Tensor w = random_tensor({4, 3, 3, 3}, t, 2);
    Tensor b = random_tensor({4}, t, 3);
    EXPECT_TRUE(conv_matches(x, w, Tensor(), {}));
    EXPECT_TRUE(conv_matches(x, w, b, {.padding = {1, 1}}));
    EXPECT_TRUE(conv_matches(x, w, b, {.stride = {2, 2}}));
    EXPECT_TRUE(conv_matches(x, w, b, {.stride = {2, 1}, .padding = {2, 1}, .dilation = {2, 1}}));
    Tensor w_rect = random_tensor({5, 3, 2, 3}, t, 4);
    EXPECT_TRUE(conv_matches(x, w_rect, Tensor(), {.stride = {1, 2}, .padding = {0, 1}}));
    Tensor w_1x1 = random_tensor({5, 3, 1, 1}, t, 5);  // runs on plain NCHW in oneDNN
    EXPECT_TRUE(conv_matches(x, w_1x1, random_tensor({5}, t, 6), {}));
  }
}

TEST(Conv2d, GroupsAndDepthwise) {
  for (DType t : {kFloat32, kFloat64}) {
    Tensor x = random_tensor({2, 4, 6, 6}, t, 7);
    EXPECT_TRUE(conv_matches(x, random_tensor({6, 2, 3, 3}, t, 8), random_tensor({6}, t, 9),
                             {.padding = {1, 1}, .groups = 2}));
    Tensor dw_x = random_tensor({2, 5, 8, 7}, t, 10);
    EXPECT_TRUE(conv_matches(dw_x, random_tensor({5, 1, 3, 3}, t, 11), random_tensor({5}, t, 12),
                             {.stride = {2, 2}, .padding = {1, 1}, .groups = 5}));
    EXPECT_TRUE(conv_matches(dw_x, random_tensor({10, 1, 3, 3}, t, 13), Tensor(), {.groups = 5}));
  }
}

TEST(Conv2d, NonContiguousInputAndWeight) {
  for (DType t : {kFloat32, kFloat64}) {
    Tensor x = random_tensor({2, 6, 5, 3}, t, 14).permute({0, 3, 1, 2});  // NHWC memory
    Tensor w = random_tensor({3, 3, 3, 4}, t, 15).transpose(0, 3);         // (4, 3, 3, 3)
    EXPECT_FALSE(x.is_contiguous());
    EXPECT_TRUE(conv_matches(x, w, Tensor(), {.padding = {1, 1}}));
  }
}

TEST(Conv2d, DenseNetSizedLayersMatch) {
  Tensor x = random_tensor({2, 64, 12, 12}, kFloat32, 16);
  EXPECT_TRUE(conv_matches(x, random_tensor({32, 64, 3, 3}, kFloat32, 17), Tensor(), {.padding = {1, 1}},
                           kLongSumFloat32));
  EXPECT_TRUE(conv_matches(x, random_tensor({48, 64, 1, 1}, kFloat32, 18), Tensor(), {}, kLongSumFloat32));
  Tensor stem = random_tensor({1, 3, 32, 32}, kFloat32, 19);
  EXPECT_TRUE(conv_matches(stem, random_tensor({16, 3, 7, 7}, kFloat32, 20), Tensor(),
                           {.stride = {2, 2}, .padding = {3, 3}}, kLongSumFloat32));
}

TEST(Conv2d, RepeatedAndConcurrentCallsAgree) {
  Tensor x = random_tensor({2, 8, 9, 9}, kFloat32, 21), w = random_tensor({8, 8, 3, 3}, kFloat32, 22);
  std::vector<int64_t> sizes;
  const auto ref = ref_conv2d(x, w, Tensor(), {.padding = {1, 1}}, &sizes);
  for (int i = 0; i < 3; ++i) EXPECT_TRUE(matches(conv2d(x, w, Tensor(), {1, 1}, {1, 1}), sizes, ref));
  std::vector<int> ok(4, 0);
  std::vector<std::thread> threads;
  for (int i = 0; i < 4; ++i)
    threads.emplace_back([&, i] {
      bool all = true;
      for (int r = 0; r < 5; ++r) all = all && matches(conv2d(x, w, Tensor(), {1, 1}, {1, 1}), sizes, ref);
      ok[i] = all;
    });
  for (auto& th : threads) th.join();
  for (int i = 0; i < 4; ++i) EXPECT_TRUE(ok[i]) << "thread " << i;
}

TEST(Conv2d, UnbatchedInputAndStringPadding) {
  Tensor x = random_tensor({3, 6, 5}, kFloat64, 23), w = random_tensor({2, 3, 3, 3}, kFloat64, 24);
  std::vector<int64_t> sizes;
  auto ref = ref_conv2d(x.unsqueeze(0), w, Tensor(), {.padding = {1, 1}}, &sizes);
  EXPECT_TRUE(matches(conv2d(x, w, Tensor(), {1, 1}, {1, 1}), {2, 6, 5}, ref));
  EXPECT_TRUE(matches(conv2d(x.unsqueeze(0), w, Tensor(), {1}, "same"), sizes, ref));
  auto valid = ref_conv2d(x.unsqueeze(0), w, Tensor(), {}, &sizes);
  EXPECT_TRUE(matches(conv2d(x.unsqueeze(0), w, Tensor(), {1, 1}, "valid"), sizes, valid));
  // Even kernels: PyTorch puts the extra padding row/column at the bottom/right.
  for (DType t : {kFloat32, kFloat64}) {
    Tensor xe = random_tensor({1, 2, 5, 6}, t, 25), we = random_tensor({3, 2, 2, 4}, t, 26);
    Tensor padded = zeros({1, 2, 6, 9}, t);
    padded.narrow(2, 0, 5).narrow(3, 1, 6).copy_(xe);  // top 0 / bottom 1, left 1 / right 2
    auto same_ref = ref_conv2d(padded, we, Tensor(), {}, &sizes);
    Tensor y = conv2d(xe, we, Tensor(), std::vector<int64_t>{1, 1}, std::string("same"));
    EXPECT_TRUE(matches(y, {1, 3, 5, 6}, same_ref)) << dtype_name(t);
  }
}

TEST(Conv2d, ReducedPrecisionDtypes) {
  for (DType t : {kBFloat16, kFloat16}) {
    Tensor x = random_tensor({2, 4, 6, 6}, t, 27), w = random_tensor({3, 4, 3, 3}, t, 28), b = random_tensor({3}, t, 29);
    Tensor y = conv2d(x, w, b, {1, 1}, {1, 1});
    EXPECT_EQ(y.dtype(), t);
    const double tol = t == kBFloat16 ? 6e-2 : 1e-2;
    EXPECT_TRUE(conv_matches(x, w, b, {.padding = {1, 1}}, Tolerance{tol, tol})) << dtype_name(t);
  }
}

TEST(Conv2d, EmptyBatchAndZeroInputChannels) {
  Tensor y = conv2d(zeros({0, 3, 5, 5}), zeros({4, 3, 3, 3}));
  EXPECT_EQ(y.sizes().vec(), (std::vector<int64_t>{0, 4, 3, 3}));
  Tensor bias = tensor<float>({1.5f, -2.0f});
  Tensor z = conv2d(zeros({1, 0, 4, 4}), zeros({2, 0, 3, 3}), bias);
  std::vector<double> expect;
  for (double b : {1.5, -2.0}) expect.insert(expect.end(), 4, b);
  EXPECT_TRUE(matches(z, {1, 2, 2, 2}, expect));
}

TEST(Conv2dErrors, ChannelAndGroupMismatchesThrowShapeError) {
  try {
    conv2d(zeros({1, 4, 5, 5}), zeros({2, 3, 3, 3}));
    FAIL() << "expected ShapeError";
  } catch (const ShapeError& e) {
    EXPECT_NE(std::string(e.what()).find("to have 3 channels, but got 4 channels instead"), std::string::npos)
        << e.what();
  }
  EXPECT_THROW(conv2d(zeros({1, 4, 5, 5}), zeros({3, 2, 3, 3}), Tensor(), {1, 1}, {0, 0}, {1, 1}, 2), ShapeError);
  EXPECT_THROW(conv2d(zeros({4, 5}), zeros({3, 4, 3, 3})), ShapeError);
  EXPECT_THROW(conv2d(zeros({1, 1, 4, 5, 5}), zeros({3, 1, 3, 3})), ShapeError);
  EXPECT_THROW(conv2d(zeros({1, 3, 5, 5}), zeros({3, 3, 3})), ShapeError);
  EXPECT_THROW(conv2d(zeros({1, 3, 2, 2}), zeros({2, 3, 3, 3})), ShapeError);  // kernel larger than input
  EXPECT_THROW(conv2d(zeros({1, 3, 4, 4}), zeros({2, 3, 3, 3}), Tensor(), {1, 1}, {0, 0}, {3, 3}), ShapeError);
  EXPECT_THROW(conv2d(zeros({1, 3, 5, 5}), zeros({2, 3, 3, 3}), zeros({3})), ShapeError);
}

TEST(Conv2dErrors, BadParameterValuesThrowValueError) {
  Tensor x = zeros({1, 2, 5, 5}), w = zeros({2, 2, 3, 3});
  EXPECT_THROW(conv2d(x, w, Tensor(), {0, 1}), ValueError);
  EXPECT_THROW(conv2d(x, w, Tensor(), {1, 1}, {-1, 0}), ValueError);
  EXPECT_THROW(conv2d(x, w, Tensor(), {1, 1}, {0, 0}, {0, 1}), ValueError);
  EXPECT_THROW(conv2d(x, w, Tensor(), {1, 1}, {0, 0}, {1, 1}, 0), ValueError);
  EXPECT_THROW(conv2d(x, w, Tensor(), {1, 1, 1}), ValueError);
  EXPECT_THROW(conv2d(x, w, Tensor(), {2, 2}, "same"), ValueError);
  EXPECT_THROW(conv2d(x, w, Tensor(), {1, 1}, "full"), ValueError);
}

TEST(Conv2dErrors, DtypeAndDeviceMismatches) {
  EXPECT_THROW(conv2d(zeros({1, 2, 5, 5}), zeros({2, 2, 3, 3}, kFloat64)), DTypeError);
  EXPECT_THROW(conv2d(zeros({1, 2, 5, 5}), zeros({2, 2, 3, 3}), zeros({2}, kFloat64)), DTypeError);
  EXPECT_THROW(conv2d(zeros({1, 2, 5, 5}, kInt64), zeros({2, 2, 3, 3}, kInt64)), DTypeError);
  static float storage[36] = {};
  Tensor w_cuda = from_blob(storage, {2, 2, 3, 3}, {}, kFloat32, cuda_device(0));
  EXPECT_THROW(conv2d(zeros({1, 2, 5, 5}), w_cuda), DeviceError);
}

// ---------------- pooling ----------------

TEST(MaxPool2d, MatchesNaivePoolingWithPaddingDilationAndCeilMode) {
  for (DType t : {kFloat32, kFloat64, kBFloat16}) {
    Tensor x = random_tensor({2, 3, 9, 8}, t, 30);
    for (const PoolArgs& a : {PoolArgs{.kernel = {3, 3}, .stride = {2, 2}, .padding = {1, 1}},
                              PoolArgs{.kernel = {2, 2}},  // stride defaults to the kernel size
                              PoolArgs{.kernel = {3, 2}, .stride = {2, 1}, .padding = {1, 0}, .ceil_mode = true},
                              PoolArgs{.kernel = {2, 2}, .stride = {2, 2}, .ceil_mode = true},
                              PoolArgs{.kernel = {2, 3}, .stride = {1, 2}, .padding = {1, 1}, .dilation = {2, 2}}}) {
      std::vector<int64_t> sizes;
      std::vector<double> idx;
      auto ref = ref_max_pool(x, a, &sizes, &idx);
      EXPECT_TRUE(matches(max_pool2d(x, a.kernel, a.stride, a.padding, a.dilation, a.ceil_mode), sizes, ref))
          << dtype_name(t) << " kernel " << shape_str(a.kernel);
      auto [y, indices] = max_pool2d_with_indices(x, a.kernel, a.stride, a.padding, a.dilation, a.ceil_mode);
      EXPECT_EQ(indices.dtype(), kInt64);
      EXPECT_TRUE(matches(y, sizes, ref));
      EXPECT_TRUE(matches(indices, sizes, idx)) << dtype_name(t) << " kernel " << shape_str(a.kernel);
    }
  }
}

TEST(MaxPool2d, IntegerInputsNanAndUnbatched) {
  Tensor ints = tensor<int64_t>({3, -1, 7, 2, 0, 5, -4, 9, 1}, {1, 3, 3});
  auto [y, idx] = max_pool2d_with_indices(ints, {2, 2}, {1, 1});
  EXPECT_EQ(y.dtype(), kInt64);
  EXPECT_TRUE(matches(y, {1, 2, 2}, {3, 7, 9, 9}));
  EXPECT_TRUE(matches(idx, {1, 2, 2}, {0, 2, 7, 7}));
  // NaN wins its windows, as in PyTorch, on every path (oneDNN's max pooling would skip it).
  for (DType t : {kFloat64, kFloat32, kBFloat16}) {
    Tensor with_nan = tensor<double>({1, std::nan(""), 3, 4, 5, 6, 7, 8, 9}, {1, 1, 3, 3}).to(t);
    Tensor m = max_pool2d(with_nan, {2, 2}, {1, 1});
    auto mv = values(m);
    EXPECT_TRUE(std::isnan(mv[0]) && std::isnan(mv[1])) << dtype_name(t);
    EXPECT_EQ(mv[2], 8);
    EXPECT_EQ(mv[3], 9);
    auto [v, i] = max_pool2d_with_indices(with_nan, {2, 2}, {1, 1});
    EXPECT_TRUE(matches(i, {1, 1, 2, 2}, {1, 1, 7, 8})) << dtype_name(t);
  }
  Tensor chw = random_tensor({3, 6, 6}, kFloat32, 31);
  std::vector<int64_t> sizes;
  auto ref = ref_max_pool(chw, {.kernel = {3, 3}, .stride = {2, 2}, .padding = {1, 1}}, &sizes, nullptr);
  EXPECT_TRUE(matches(max_pool2d(chw, {3, 3}, {2, 2}, {1, 1}), sizes, ref));
}

TEST(MaxPool2d, NonContiguousInput) {
  Tensor x = random_tensor({2, 7, 7, 3}, kFloat32, 32).permute({0, 3, 1, 2});
  std::vector<int64_t> sizes;
  auto ref = ref_max_pool(x, {.kernel = {3, 3}, .stride = {2, 2}, .padding = {1, 1}}, &sizes, nullptr);
  EXPECT_TRUE(matches(max_pool2d(x, {3, 3}, {2, 2}, {1, 1}), sizes, ref));
}

TEST(AvgPool2d, CountIncludePadCeilModeAndDivisorOverride) {
  for (DType t : {kFloat32, kFloat64, kBFloat16}) {
    Tensor x = random_tensor({2, 3, 7, 8}, t, 33);
    const std::vector<PoolArgs> cases = {PoolArgs{.kernel = {2, 2}},
                                         PoolArgs{.kernel = {3, 3}, .stride = {2, 2}, .padding = {1, 1}},
                                         PoolArgs{.kernel = {3, 2}, .stride = {2, 3}, .padding = {1, 1}, .ceil_mode = true},
                                         PoolArgs{.kernel = {2, 2}, .stride = {2, 2}, .ceil_mode = true}};
    for (const PoolArgs& a : cases) {
      for (bool include : {true, false}) {
        for (std::optional<int64_t> divisor : {std::optional<int64_t>(), std::optional<int64_t>(5)}) {
          std::vector<int64_t> sizes;
          auto ref = ref_avg_pool(x, a, include, divisor, &sizes);
          Tensor y = avg_pool2d(x, a.kernel, a.stride, a.padding, a.ceil_mode, include, divisor);
          EXPECT_TRUE(matches(y, sizes, ref)) << dtype_name(t) << " kernel " << shape_str(a.kernel) << " include "
                                              << include << " divisor " << divisor.value_or(0);
        }
      }
    }
  }
}

TEST(AdaptiveAvgPool2d, DivisibleUnevenAndGlobal) {
  for (DType t : {kFloat32, kFloat64, kFloat16}) {
    Tensor x = random_tensor({2, 3, 6, 7}, t, 34);
    EXPECT_TRUE(matches(adaptive_avg_pool2d(x, {1, 1}), {2, 3, 1, 1}, ref_adaptive_avg(x, 1, 1)));
    EXPECT_TRUE(matches(adaptive_avg_pool2d(x, {3, 4}), {2, 3, 3, 4}, ref_adaptive_avg(x, 3, 4)));
    EXPECT_TRUE(matches(adaptive_avg_pool2d(x, {6, 7}), {2, 3, 6, 7}, ref_adaptive_avg(x, 6, 7)));
    EXPECT_TRUE(matches(adaptive_avg_pool2d(x, {4}), {2, 3, 4, 4}, ref_adaptive_avg(x, 4, 4)));
  }
  Tensor chw = random_tensor({4, 5, 5}, kFloat32, 35).transpose(1, 2);
  EXPECT_TRUE(matches(adaptive_avg_pool2d(chw, {2, 2}), {4, 2, 2}, ref_adaptive_avg(chw, 2, 2)));
  EXPECT_EQ(adaptive_avg_pool2d(zeros({0, 3, 4, 4}), {2, 2}).sizes().vec(), (std::vector<int64_t>{0, 3, 2, 2}));
}

TEST(PoolErrors, BadInputsThrowTheirErrorKinds) {
  Tensor x = zeros({1, 2, 4, 4});
  EXPECT_THROW(max_pool2d(zeros({1, 2, 2, 2}), {3, 3}), ShapeError);  // output size <= 0
  EXPECT_THROW(avg_pool2d(zeros({1, 2, 2, 2}), {3, 3}), ShapeError);
  EXPECT_THROW(max_pool2d(zeros({4, 4}), {2, 2}), ShapeError);
  EXPECT_THROW(max_pool2d(zeros({1, 0, 4, 4}), {2, 2}), ShapeError);
  EXPECT_THROW(adaptive_avg_pool2d(zeros({4}), {2, 2}), ShapeError);
  EXPECT_THROW(max_pool2d(x, {0, 2}), ValueError);
  EXPECT_THROW(max_pool2d(x, {2, 2}, {0, 1}), ValueError);
  EXPECT_THROW(max_pool2d(x, {2, 2}, {2, 2}, {2, 2}), ValueError);  // pad > half the kernel
  EXPECT_THROW(max_pool2d(x, {2, 2}, {2, 2}, {0, 0}, {0, 1}), ValueError);
  EXPECT_THROW(max_pool2d(x, {2, 2, 2}), ValueError);
  EXPECT_THROW(avg_pool2d(x, {2, 2}, {}, {0, 0}, false, true, 0), ValueError);
  EXPECT_THROW(adaptive_avg_pool2d(x, {-1, 2}), ValueError);
  EXPECT_THROW(max_pool2d(zeros({1, 2, 4, 4}, kBool), {2, 2}), DTypeError);
  EXPECT_THROW(avg_pool2d(zeros({1, 2, 4, 4}, kInt64), {2, 2}), DTypeError);
  EXPECT_THROW(adaptive_avg_pool2d(zeros({1, 2, 4, 4}, kInt32), {1, 1}), DTypeError);
}
