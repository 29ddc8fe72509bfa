// nn layers, nn::functional and nn::init against float64 references computed here: Linear,
// Conv2d (padding modes, groups, dilation), BatchNorm (train/eval, running statistics,
// num_batches_tracked), LayerNorm, GroupNorm, Embedding, Dropout, pooling, Flatten, Sequential,
// activations, scaled_dot_product_attention, MultiheadAttention, default initialisation.
#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <random>

#include "reference.h"

using namespace kiln;
using kiln::testing::numel_of;
using kiln::testing::random_tensor;
using kiln::testing::matches;
using kiln::testing::values;
namespace F = kiln::nn::functional;

namespace {

const double kInf = std::numeric_limits<double>::infinity();

void assign(const Tensor& dst, const Tensor& src) {
  NoGradGuard g;
  Tensor d = dst;
  d.copy_(src);
}

// ---- convolution reference on an explicitly padded NCHW input ----
struct Image {
  std::vector<double> v;
  int64_t n, c, h, w;
  double at(int64_t a, int64_t b, int64_t y, int64_t x) const {
    return v[((a * c + b) * h + y) * w + x];
  }
};

Image image_of(const Tensor& t) {
  return {values(t), t.size(0), t.size(1), t.size(2), t.size(3)};
}

// Pads H by (top, bottom) and W by (left, right) with zeros / reflect / replicate / circular.
Image pad_ref(const Image& in, int64_t top, int64_t bottom, int64_t left, int64_t right,
              const std::string& mode) {
  Image out{{}, in.n, in.c, in.h + top + bottom, in.w + left + right};
  out.v.resize(static_cast<size_t>(out.n * out.c * out.h * out.w));
  auto map = [&](int64_t i, int64_t size) -> int64_t {
    if (i >= 0 && i < size) return i;
    if (mode == "zeros") return -1;
    if (mode == "reflect") return i < 0 ? -i : 2 * (size - 1) - i;
    if (mode == "replicate") return std::clamp<int64_t>(i, 0, size - 1);
    return ((i % size) + size) % size;  // circular
  };
  for (int64_t a = 0; a < out.n; ++a)
    for (int64_t b = 0; b < out.c; ++b)
      for (int64_t y = 0; y < out.h; ++y)
        for (int64_t x = 0; x < out.w; ++x) {
          const int64_t sy = map(y - top, in.h), sx = map(x - left, in.w);
          out.v[((a * out.c + b) * out.h + y) * out.w + x] =
              (sy < 0 || sx < 0) ? 0.0 : in.at(a, b, sy, sx);
        }
  return out;
}

std::vector<double> conv_ref(const Image& x, const Tensor& weight, const Tensor& bias, int64_t sh,
                             int64_t sw, int64_t dh, int64_t dw, int64_t groups,
                             std::vector<int64_t>* out_sizes) {
  const auto wv = values(weight);
  const int64_t oc = weight.size(0), cpg = weight.size(1), kh = weight.size(2), kw = weight.size(3);
  const int64_t oh = (x.h - dh * (kh - 1) - 1) / sh + 1, ow = (x.w - dw * (kw - 1) - 1) / sw + 1;
  const auto bv = bias.defined() ? values(bias) : std::vector<double>(static_cast<size_t>(oc), 0.0);
  std::vector<double> out;
  for (int64_t a = 0; a < x.n; ++a)
    for (int64_t o = 0; o < oc; ++o) {
      const int64_t g = o / (oc / groups);
      for (int64_t y = 0; y < oh; ++y)
        for (int64_t z = 0; z < ow; ++z) {
          double s = bv[o];
          for (int64_t ci = 0; ci < cpg; ++ci)
            for (int64_t i = 0; i < kh; ++i)
              for (int64_t j = 0; j < kw; ++j)
                s += x.at(a, g * cpg + ci, y * sh + i * dh, z * sw + j * dw) *
                     wv[((o * cpg + ci) * kh + i) * kw + j];
          out.push_back(s);
        }
    }
  *out_sizes = {x.n, oc, oh, ow};
  return out;
}

// ---- attention reference ----
// q (B, L, E), k (B, S, E), v (B, S, Ev) as row-major values; mask(b, l, s) returns the additive
// bias (-inf masks out). A row with every score -inf gives zeros.
std::vector<double> attention_ref(const std::vector<double>& q, const std::vector<double>& k,
                                  const std::vector<double>& v, int64_t B, int64_t L, int64_t S,
                                  int64_t E, int64_t Ev, double scale,
                                  const std::function<double(int64_t, int64_t, int64_t)>& bias,
                                  std::vector<double>* probs_out = nullptr) {
  std::vector<double> out(static_cast<size_t>(B * L * Ev), 0.0);
  if (probs_out) probs_out->assign(static_cast<size_t>(B * L * S), 0.0);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t l = 0; l < L; ++l) {
      std::vector<double> sc(static_cast<size_t>(S));
      double mx = -kInf;
      for (int64_t s = 0; s < S; ++s) {
        double d = 0;
        for (int64_t e = 0; e < E; ++e) d += q[(b * L + l) * E + e] * k[(b * S + s) * E + e];
        sc[s] = d * scale + bias(b, l, s);
        mx = std::max(mx, sc[s]);
      }
      if (mx == -kInf) continue;  // fully masked: zeros
      double z = 0;
      for (auto& x : sc) z += (x = std::exp(x - mx));
      for (int64_t s = 0; s < S; ++s) {
        const double p = sc[s] / z;
        if (probs_out) (*probs_out)[(b * L + l) * S + s] = p;
        for (int64_t e = 0; e < Ev; ++e) out[(b * L + l) * Ev + e] += p * v[(b * S + s) * Ev + e];
      }
    }
  return out;
}

// x @ W^T + b for rows of x (R, I), W (O, I) starting at row `row0` of the weight.
std::vector<double> affine_ref(const std::vector<double>& x, int64_t R, int64_t I,
                               const std::vector<double>& W, const std::vector<double>& b,
                               int64_t row0, int64_t O) {
  std::vector<double> out(static_cast<size_t>(R * O));
  for (int64_t r = 0; r < R; ++r)
    for (int64_t o = 0; o < O; ++o) {
      double s = b.empty() ? 0.0 : b[row0 + o];
      for (int64_t i = 0; i < I; ++i) s += x[r * I + i] * W[(row0 + o) * I + i];
      out[r * O + o] = s;
    }
  return out;
}

}  // namespace

// ======================= Linear =======================

TEST(NnLinear, ForwardIsTheAffineMapOverTheLastDim) {
  nn::Linear fc(3, 4);
  fc.to(kFloat64);
  Tensor x = random_tensor({2, 5, 3}, kFloat64, 1);
  auto ref = affine_ref(values(x), 10, 3, values(fc.weight), values(fc.bias), 0, 4);
  EXPECT_TRUE(matches(fc.forward(x), {2, 5, 4}, ref));
  EXPECT_TRUE(matches(fc(x), {2, 5, 4}, ref));

  nn::Linear no_bias(3, 2, false);
  Tensor x32 = random_tensor({4, 3}, kFloat32, 2);
  auto ref32 = affine_ref(values(x32), 4, 3, values(no_bias.weight), {}, 0, 2);
  EXPECT_TRUE(matches(no_bias.forward(x32), {4, 2}, ref32));
  EXPECT_EQ(no_bias.weight.sizes().vec(), (std::vector<int64_t>{2, 3}));
}

TEST(NnLinear, DefaultInitIsKaimingUniformWithinOneOverSqrtFanIn) {
  nn::Linear fc(16, 8);
  const double bound = 1.0 / std::sqrt(16.0);
  double max_abs = 0;
  for (double w : values(fc.weight)) {
    EXPECT_LE(std::abs(w), bound);
    max_abs = std::max(max_abs, std::abs(w));
  }
  EXPECT_GT(max_abs, 0.8 * bound);  // spread over the range, not a constant
  for (double b : values(fc.bias)) EXPECT_LE(std::abs(b), bound);
  EXPECT_EQ(fc.weight.dtype(), kFloat32);
  EXPECT_TRUE(fc.weight.is_leaf());
  EXPECT_THROW(nn::Linear(-1, 2), ValueError);
}

// ======================= Conv2d =======================

TEST(NnConv2d, StridedDilatedGroupedConvMatchesLoops) {
  nn::Conv2d conv(nn::Conv2dOptions{.in_channels = 4,
                                    .out_channels = 6,
                                    .kernel_size = {3, 2},
                                    .stride = 2,
                                    .padding = {1, 0},
                                    .dilation = {1, 2},
                                    .groups = 2});
  conv.to(kFloat64);
  EXPECT_EQ(conv.weight.sizes().vec(), (std::vector<int64_t>{6, 2, 3, 2}));
  Tensor x = random_tensor({2, 4, 5, 6}, kFloat64, 3);
  std::vector<int64_t> sizes;
  auto ref = conv_ref(pad_ref(image_of(x), 1, 1, 0, 0, "zeros"), conv.weight, conv.bias, 2, 2, 1, 2,
                      2, &sizes);
  EXPECT_TRUE(matches(conv.forward(x), sizes, ref));
  // Unbatched (C, H, W) input.
  Tensor y = conv.forward(x.select(0, 1));
  EXPECT_EQ(y.sizes().vec(), (std::vector<int64_t>{6, sizes[2], sizes[3]}));
  EXPECT_TRUE(allclose(y, conv.forward(x).select(0, 1)));
}

TEST(NnConv2d, SamePaddingWithEvenKernelPadsBottomRightMore) {
  nn::Conv2d conv(nn::Conv2dOptions{
      .in_channels = 2, .out_channels = 3, .kernel_size = {4, 3}, .padding = "same"});
  conv.to(kFloat64);
  Tensor x = random_tensor({1, 2, 5, 4}, kFloat64, 4);
  std::vector<int64_t> sizes;
  // total padding 3 (H) -> 1 top, 2 bottom; 2 (W) -> 1 left, 1 right.
  auto ref = conv_ref(pad_ref(image_of(x), 1, 2, 1, 1, "zeros"), conv.weight, conv.bias, 1, 1, 1, 1,
                      1, &sizes);
  EXPECT_EQ(sizes, (std::vector<int64_t>{1, 3, 5, 4}));
  EXPECT_TRUE(matches(conv.forward(x), sizes, ref));

  nn::Conv2d valid(
      nn::Conv2dOptions{.in_channels = 2, .out_channels = 1, .kernel_size = 3, .padding = "valid"});
  EXPECT_EQ(valid.forward(random_tensor({1, 2, 5, 4}, kFloat32, 5)).sizes().vec(),
            (std::vector<int64_t>{1, 1, 3, 2}));
}

TEST(NnConv2d, PaddingModesMatchExplicitPadding) {
  Tensor x = random_tensor({2, 2, 4, 5}, kFloat64, 6);
  struct Case {
    std::string mode;
    nn::Conv2dPadding padding;
    int64_t top, bottom, left, right;
  };
  const std::vector<Case> cases = {{"reflect", 1, 1, 1, 1, 1},
                                   {"replicate", nn::Conv2dPadding(2, 1), 2, 2, 1, 1},
                                   {"circular", nn::Conv2dPadding(1, 2), 1, 1, 2, 2},
                                   {"circular", "same", 1, 1, 0, 1}};
  for (const auto& c : cases) {
    nn::Conv2d conv(nn::Conv2dOptions{.in_channels = 2,
                                      .out_channels = 2,
                                      .kernel_size = {3, 2},
                                      .padding = c.padding,
                                      .padding_mode = c.mode});
    conv.to(kFloat64);
    std::vector<int64_t> sizes;
    auto ref = conv_ref(pad_ref(image_of(x), c.top, c.bottom, c.left, c.right, c.mode), conv.weight,
                        conv.bias, 1, 1, 1, 1, 1, &sizes);
    EXPECT_TRUE(matches(conv.forward(x), sizes, ref)) << c.mode;
  }
}

TEST(NnConv2d, DefaultInitAndBadOptions) {
  nn::Conv2d conv(
      nn::Conv2dOptions{.in_channels = 4, .out_channels = 6, .kernel_size = 3, .groups = 2});
  const double bound = 1.0 / std::sqrt(2.0 * 9.0);  // fan_in = in / groups * kH * kW
  for (double w : values(conv.weight)) EXPECT_LE(std::abs(w), bound);
  for (double b : values(conv.bias)) EXPECT_LE(std::abs(b), bound);
  EXPECT_THROW(nn::Conv2d(nn::Conv2dOptions{
                   .in_channels = 3, .out_channels = 4, .kernel_size = 3, .groups = 2}),
               ValueError);
  EXPECT_THROW(
      nn::Conv2d(nn::Conv2dOptions{
          .in_channels = 2, .out_channels = 4, .kernel_size = 3, .stride = 2, .padding = "same"}),
      ValueError);
  EXPECT_THROW(nn::Conv2d(nn::Conv2dOptions{
                   .in_channels = 2, .out_channels = 4, .kernel_size = 3, .padding = "full"}),
               ValueError);
  EXPECT_THROW(
      nn::Conv2d(nn::Conv2dOptions{
          .in_channels = 2, .out_channels = 4, .kernel_size = 3, .padding_mode = "mirror"}),
      ValueError);
  EXPECT_THROW(nn::Conv2d(nn::Conv2dOptions{.in_channels = 2, .out_channels = 4}),
               ValueError);  // no kernel_size
  nn::Conv2d ok(2, 4, 3);
  EXPECT_THROW(ok.forward(random_tensor({1, 3, 5, 5}, kFloat32, 7)), ShapeError);
}

// ======================= BatchNorm =======================

namespace {
struct ChannelStats {
  std::vector<double> mean, biased_var, unbiased_var;
};
ChannelStats channel_stats(const Tensor& x) {
  const auto v = values(x);
  const int64_t n = x.size(0), c = x.size(1), plane = x.numel() / (n * c), count = n * plane;
  ChannelStats s;
  for (int64_t ch = 0; ch < c; ++ch) {
    double sum = 0, sq = 0;
    for (int64_t i = 0; i < n; ++i)
      for (int64_t p = 0; p < plane; ++p) sum += v[(i * c + ch) * plane + p];
    const double mean = sum / static_cast<double>(count);
    for (int64_t i = 0; i < n; ++i)
      for (int64_t p = 0; p < plane; ++p) sq += std::pow(v[(i * c + ch) * plane + p] - mean, 2);
    s.mean.push_back(mean);
    s.biased_var.push_back(sq / static_cast<double>(count));
    s.unbiased_var.push_back(sq / static_cast<double>(count - 1));
  }
  return s;
}
std::vector<double> normalize_ref(const Tensor& x, const std::vector<double>& mean,
                                  const std::vector<double>& var, const std::vector<double>& w,
                                  const std::vector<double>& b, double eps) {
  auto v = values(x);
  const int64_t n = x.size(0), c = x.size(1), plane = x.numel() / (n * c);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t ch = 0; ch < c; ++ch)
      for (int64_t p = 0; p < plane; ++p) {
        double& e = v[(i * c + ch) * plane + p];
        e = (e - mean[ch]) / std::sqrt(var[ch] + eps) * w[ch] + b[ch];
      }
  return v;
}
}  // namespace

TEST(NnBatchNorm, TrainingNormalizesWithBatchStatsAndUpdatesRunningStats) {
  nn::BatchNorm2d bn(3);
  bn.to(kFloat64);
  assign(bn.weight, tensor<double>({1.5, -0.5, 2.0}));
  assign(bn.bias, tensor<double>({0.1, 0.2, -0.3}));
  const std::vector<double> w{1.5, -0.5, 2.0}, b{0.1, 0.2, -0.3};
  Tensor x1 = random_tensor({4, 3, 2, 2}, kFloat64, 11, -2, 3);
  Tensor x2 = random_tensor({4, 3, 2, 2}, kFloat64, 12, -1, 1);
  auto s1 = channel_stats(x1), s2 = channel_stats(x2);

  EXPECT_TRUE(
      matches(bn.forward(x1), {4, 3, 2, 2}, normalize_ref(x1, s1.mean, s1.biased_var, w, b, 1e-5)));
  std::vector<double> rm(3), rv(3);
  for (int c = 0; c < 3; ++c) {
    rm[c] = 0.9 * 0.0 + 0.1 * s1.mean[c];
    rv[c] = 0.9 * 1.0 + 0.1 * s1.unbiased_var[c];
  }
  EXPECT_TRUE(matches(bn.running_mean, {3}, rm));
  EXPECT_TRUE(matches(bn.running_var, {3}, rv));
  EXPECT_EQ(bn.num_batches_tracked.item<int64_t>(), 1);

  bn.forward(x2);
  for (int c = 0; c < 3; ++c) {
    rm[c] = 0.9 * rm[c] + 0.1 * s2.mean[c];
    rv[c] = 0.9 * rv[c] + 0.1 * s2.unbiased_var[c];
  }
  EXPECT_TRUE(matches(bn.running_mean, {3}, rm));
  EXPECT_TRUE(matches(bn.running_var, {3}, rv));
  EXPECT_EQ(bn.num_batches_tracked.item<int64_t>(), 2);

  // Eval uses the running statistics and changes nothing.
  bn.eval();
  EXPECT_TRUE(matches(bn.forward(x1), {4, 3, 2, 2}, normalize_ref(x1, rm, rv, w, b, 1e-5)));
  EXPECT_TRUE(matches(bn.running_mean, {3}, rm));
  EXPECT_EQ(bn.num_batches_tracked.item<int64_t>(), 2);
}

TEST(NnBatchNorm, MomentumNoneKeepsACumulativeAverage) {
  nn::BatchNorm1d bn(nn::BatchNormOptions{.num_features = 2, .momentum = std::nullopt});
  bn.to(kFloat64);
  Tensor x1 = random_tensor({5, 2}, kFloat64, 21), x2 = random_tensor({5, 2}, kFloat64, 22),
         x3 = random_tensor({5, 2}, kFloat64, 23);
  auto s1 = channel_stats(x1), s2 = channel_stats(x2), s3 = channel_stats(x3);
  bn.forward(x1);
  bn.forward(x2);
  bn.forward(x3);
  std::vector<double> rm(2), rv(2);
  for (int c = 0; c < 2; ++c) {
    rm[c] = (s1.mean[c] + s2.mean[c] + s3.mean[c]) / 3.0;
    rv[c] = (s1.unbiased_var[c] + s2.unbiased_var[c] + s3.unbiased_var[c]) / 3.0;
  }
  EXPECT_TRUE(matches(bn.running_mean, {2}, rm));
  EXPECT_TRUE(matches(bn.running_var, {2}, rv));
  EXPECT_EQ(bn.num_batches_tracked.item<int64_t>(), 3);
}

TEST(NnBatchNorm, BatchNorm1dTakesNCAndNCLInput) {
  nn::BatchNorm1d bn(3);
  bn.to(kFloat64);
  const std::vector<double> ones3(3, 1.0), zeros3(3, 0.0);
  Tensor x = random_tensor({4, 3, 5}, kFloat64, 24);
  auto s = channel_stats(x);
  EXPECT_TRUE(matches(bn.forward(x), {4, 3, 5},
                      normalize_ref(x, s.mean, s.biased_var, ones3, zeros3, 1e-5)));
  Tensor x2 = random_tensor({6, 3}, kFloat64, 25);
  auto s2 = channel_stats(x2);
  EXPECT_TRUE(matches(bn.forward(x2), {6, 3},
                      normalize_ref(x2, s2.mean, s2.biased_var, ones3, zeros3, 1e-5)));
  EXPECT_THROW(bn.forward(random_tensor({2, 3, 4, 4}, kFloat64, 26)), ShapeError);
  nn::BatchNorm2d bn2(3);
  EXPECT_THROW(bn2.forward(random_tensor({2, 3, 4}, kFloat32, 27)), ShapeError);
}

TEST(NnBatchNorm, WithoutRunningStatsEvalUsesBatchStatistics) {
  nn::BatchNorm2d bn(
      nn::BatchNormOptions{.num_features = 2, .affine = false, .track_running_stats = false});
  bn.to(kFloat64);
  EXPECT_FALSE(bn.running_mean.defined());
  EXPECT_FALSE(bn.num_batches_tracked.defined());
  bn.eval();
  Tensor x = random_tensor({3, 2, 2, 2}, kFloat64, 28);
  auto s = channel_stats(x);
  EXPECT_TRUE(matches(bn.forward(x), {3, 2, 2, 2},
                      normalize_ref(x, s.mean, s.biased_var, {1.0, 1.0}, {0.0, 0.0}, 1e-5)));
}

TEST(NnBatchNorm, DefaultInitIsOnesAndZeros) {
  nn::BatchNorm2d bn(4);
  EXPECT_TRUE(matches(bn.weight, {4}, {1, 1, 1, 1}));
  EXPECT_TRUE(matches(bn.bias, {4}, {0, 0, 0, 0}));
  EXPECT_TRUE(matches(bn.running_mean, {4}, {0, 0, 0, 0}));
  EXPECT_TRUE(matches(bn.running_var, {4}, {1, 1, 1, 1}));
  EXPECT_EQ(bn.num_batches_tracked.item<int64_t>(), 0);
}

// ======================= LayerNorm, GroupNorm =======================

TEST(NnLayerNorm, NormalizesTrailingDimsWithAffine) {
  nn::LayerNorm ln(std::vector<int64_t>{3, 4}, 1e-5);
  ln.to(kFloat64);
  Tensor w = random_tensor({3, 4}, kFloat64, 31), b = random_tensor({3, 4}, kFloat64, 32);
  assign(ln.weight, w);
  assign(ln.bias, b);
  Tensor x = random_tensor({2, 3, 4}, kFloat64, 33);
  auto xv = values(x), wv = values(w), bv = values(b);
  std::vector<double> ref(xv.size());
  for (int r = 0; r < 2; ++r) {
    double mean = 0, var = 0;
    for (int i = 0; i < 12; ++i) mean += xv[r * 12 + i] / 12.0;
    for (int i = 0; i < 12; ++i) var += std::pow(xv[r * 12 + i] - mean, 2) / 12.0;
    for (int i = 0; i < 12; ++i)
      ref[r * 12 + i] = (xv[r * 12 + i] - mean) / std::sqrt(var + 1e-5) * wv[i] + bv[i];
  }
  EXPECT_TRUE(matches(ln.forward(x), {2, 3, 4}, ref));
  nn::LayerNorm no_bias(4, 1e-5, true, false);
  EXPECT_TRUE(no_bias.weight.defined());
  EXPECT_FALSE(no_bias.bias.defined());
  EXPECT_THROW(ln.forward(random_tensor({2, 4, 3}, kFloat64, 34)), ShapeError);
}

TEST(NnGroupNorm, NormalizesGroupsOfChannels) {
  nn::GroupNorm gn(2, 4);
  gn.to(kFloat64);
  assign(gn.weight, tensor<double>({1, 2, 3, 4}));
  assign(gn.bias, tensor<double>({0, -1, 1, 0.5}));
  Tensor x = random_tensor({2, 4, 3}, kFloat64, 35);
  auto xv = values(x);
  const std::vector<double> wv{1, 2, 3, 4}, bv{0, -1, 1, 0.5};
  std::vector<double> ref(xv.size());
  for (int n = 0; n < 2; ++n)
    for (int g = 0; g < 2; ++g) {
      const int base = n * 12 + g * 6;  // 2 channels x 3 positions per group
      double mean = 0, var = 0;
      for (int i = 0; i < 6; ++i) mean += xv[base + i] / 6.0;
      for (int i = 0; i < 6; ++i) var += std::pow(xv[base + i] - mean, 2) / 6.0;
      for (int i = 0; i < 6; ++i) {
        const int ch = g * 2 + i / 3;
        ref[base + i] = (xv[base + i] - mean) / std::sqrt(var + 1e-5) * wv[ch] + bv[ch];
      }
    }
  EXPECT_TRUE(matches(gn.forward(x), {2, 4, 3}, ref));
  EXPECT_THROW(nn::GroupNorm(3, 4), ValueError);
}

// ======================= Embedding, Dropout, Flatten, activations =======================

TEST(NnEmbedding, LooksUpRowsAndZeroesThePaddingRow) {
  nn::Embedding emb(6, 3, /*padding_idx=*/1);
  EXPECT_TRUE(matches(emb.weight.select(0, 1), {3}, {0, 0, 0}));
  const auto table = values(emb.weight);
  Tensor idx = tensor<int64_t>({4, 1, 0, 5, 5, 2}, {2, 3});
  std::vector<double> ref;
  for (int64_t i : {4, 1, 0, 5, 5, 2})
    for (int d = 0; d < 3; ++d) ref.push_back(table[i * 3 + d]);
  EXPECT_TRUE(matches(emb.forward(idx), {2, 3, 3}, ref));
  EXPECT_EQ(nn::Embedding(6, 3, -1).options.padding_idx, 5);
  EXPECT_THROW(nn::Embedding(6, 3, 6), IndexError);
  EXPECT_THROW(emb.forward(tensor<int64_t>({6})), IndexError);

  auto frozen = nn::Embedding::from_pretrained(tensor<float>({1, 2, 3, 4}, {2, 2}));
  EXPECT_FALSE(frozen->weight.requires_grad());
  EXPECT_TRUE(matches(frozen->forward(tensor<int64_t>({1})), {1, 2}, {3, 4}));
}

TEST(NnEmbedding, DefaultInitIsStandardNormal) {
  nn::Embedding emb(1000, 8);
  const auto v = values(emb.weight);
  double mean = 0, var = 0;
  for (double x : v) mean += x / static_cast<double>(v.size());
  for (double x : v) var += (x - mean) * (x - mean) / static_cast<double>(v.size());
  EXPECT_LT(std::abs(mean), 0.05);
  EXPECT_LT(std::abs(std::sqrt(var) - 1.0), 0.05);
}

TEST(NnDropout, EvalIsIdentityAndTrainingScalesSurvivors) {
  nn::Dropout drop(0.5);
  Tensor x = random_tensor({1000}, kFloat32, 41, 0.5, 1.5);
  const auto xv = values(x);
  auto y = values(drop.forward(x));
  int zeros = 0;
  for (size_t i = 0; i < y.size(); ++i) {
    if (y[i] == 0.0) {
      ++zeros;
    } else {
      EXPECT_NEAR(y[i], 2.0 * xv[i], 1e-6);
    }
  }
  EXPECT_GT(zeros, 400);
  EXPECT_LT(zeros, 600);
  drop.eval();
  EXPECT_TRUE(drop.forward(x).same(x));
  EXPECT_THROW(nn::Dropout(1.5), ValueError);
}

TEST(NnFlatten, FlattensTheGivenDimRange) {
  Tensor x = random_tensor({2, 3, 4}, kFloat32, 42);
  EXPECT_EQ(nn::Flatten().forward(x).sizes().vec(), (std::vector<int64_t>{2, 12}));
  EXPECT_EQ(nn::Flatten(0, 1).forward(x).sizes().vec(), (std::vector<int64_t>{6, 4}));
  EXPECT_TRUE(matches(nn::Flatten().forward(x), {2, 12}, values(x)));
}

TEST(NnActivations, MatchTheirFormulas) {
  Tensor x = random_tensor({7}, kFloat64, 43, -3, 3);
  auto map = [&](const std::function<double(double)>& f) { return kiln::testing::map_ref(x, f); };
  EXPECT_TRUE(matches(nn::ReLU().forward(x), {7}, map([](double v) { return v > 0 ? v : 0; })));
  EXPECT_TRUE(matches(nn::Tanh().forward(x), {7}, map([](double v) { return std::tanh(v); })));
  EXPECT_TRUE(
      matches(nn::Sigmoid().forward(x), {7}, map([](double v) { return 1 / (1 + std::exp(-v)); })));
  EXPECT_TRUE(
      matches(nn::SiLU().forward(x), {7}, map([](double v) { return v / (1 + std::exp(-v)); })));
  EXPECT_TRUE(matches(nn::GELU().forward(x), {7},
                      map([](double v) { return 0.5 * v * (1 + std::erf(v / std::sqrt(2.0))); })));
  EXPECT_TRUE(matches(nn::GELU("tanh").forward(x), {7}, map([](double v) {
                        return 0.5 * v *
                               (1 + std::tanh(std::sqrt(2 / M_PI) * (v + 0.044715 * v * v * v)));
                      })));
  EXPECT_THROW(nn::GELU("fast"), ValueError);
  Tensor s = nn::Softmax(0).forward(x);
  auto xv = values(x);
  double z = 0;
  for (double v : xv) z += std::exp(v);
  EXPECT_TRUE(matches(s, {7}, map([&](double v) { return std::exp(v) / z; })));
  // ReLU(inplace) writes into its input.
  Tensor y = x.clone();
  Tensor r = nn::ReLU(true).forward(y);
  EXPECT_TRUE(r.is_alias_of(y));
  EXPECT_TRUE(matches(y, {7}, map([](double v) { return v > 0 ? v : 0; })));
}

// ======================= pooling =======================

TEST(NnPooling, MaxAndAvgPoolMatchWindows) {
  Tensor x = random_tensor({1, 2, 5, 5}, kFloat64, 51);
  const Image im = image_of(x);
  // MaxPool2d(3, stride 2, padding 1): windows over the -inf padded input.
  std::vector<double> max_ref, avg_ref;
  for (int c = 0; c < 2; ++c)
    for (int oy = 0; oy < 3; ++oy)
      for (int ox = 0; ox < 3; ++ox) {
        double m = -kInf, s = 0;
        for (int i = 0; i < 3; ++i)
          for (int j = 0; j < 3; ++j) {
            const int y = oy * 2 - 1 + i, z = ox * 2 - 1 + j;
            if (y < 0 || y >= 5 || z < 0 || z >= 5) continue;
            m = std::max(m, im.at(0, c, y, z));
            s += im.at(0, c, y, z);
          }
        max_ref.push_back(m);
        avg_ref.push_back(s / 9.0);  // count_include_pad
      }
  EXPECT_TRUE(matches(nn::MaxPool2d(3, 2, 1).forward(x), {1, 2, 3, 3}, max_ref));
  EXPECT_TRUE(matches(nn::AvgPool2d(3, 2, 1).forward(x), {1, 2, 3, 3}, avg_ref));

  auto [out, idx] = nn::MaxPool2d(3, 2, 1).forward_with_indices(x);
  EXPECT_EQ(idx.dtype(), kInt64);
  EXPECT_TRUE(matches(out, {1, 2, 3, 3}, max_ref));

  // Default stride = kernel_size.
  std::vector<double> max2;
  for (int c = 0; c < 2; ++c)
    for (int oy = 0; oy < 2; ++oy)
      for (int ox = 0; ox < 2; ++ox) {
        double m = -kInf;
        for (int i = 0; i < 2; ++i)
          for (int j = 0; j < 2; ++j) m = std::max(m, im.at(0, c, oy * 2 + i, ox * 2 + j));
        max2.push_back(m);
      }
  EXPECT_TRUE(matches(nn::MaxPool2d(2).forward(x), {1, 2, 2, 2}, max2));
}

TEST(NnPooling, AdaptiveAvgPoolUsesFloorCeilWindows) {
  Tensor x = random_tensor({1, 2, 5, 7}, kFloat64, 52);
  const Image im = image_of(x);
  std::vector<double> ref;
  const int oh = 2, ow = 3;
  for (int c = 0; c < 2; ++c)
    for (int i = 0; i < oh; ++i)
      for (int j = 0; j < ow; ++j) {
        const int y0 = (i * 5) / oh, y1 = ((i + 1) * 5 + oh - 1) / oh;
        const int x0 = (j * 7) / ow, x1 = ((j + 1) * 7 + ow - 1) / ow;
        double s = 0;
        for (int y = y0; y < y1; ++y)
          for (int z = x0; z < x1; ++z) s += im.at(0, c, y, z);
        ref.push_back(s / ((y1 - y0) * (x1 - x0)));
      }
  EXPECT_TRUE(matches(nn::AdaptiveAvgPool2d(nn::Size2(2, 3)).forward(x), {1, 2, 2, 3}, ref));
  std::vector<double> global;
  for (int c = 0; c < 2; ++c) {
    double s = 0;
    for (int y = 0; y < 5; ++y)
      for (int z = 0; z < 7; ++z) s += im.at(0, c, y, z);
    global.push_back(s / 35.0);
  }
  EXPECT_TRUE(matches(nn::AdaptiveAvgPool2d(1).forward(x), {1, 2, 1, 1}, global));
}

// ======================= Sequential =======================

TEST(NnSequential, ChainsChildrenInOrder) {
  auto fc1 = std::make_shared<nn::Linear>(3, 4);
  auto fc2 = std::make_shared<nn::Linear>(4, 2);
  nn::Sequential seq(fc1, std::make_shared<nn::ReLU>(), fc2);
  seq.to(kFloat64);
  Tensor x = random_tensor({5, 3}, kFloat64, 61);
  auto h = affine_ref(values(x), 5, 3, values(fc1->weight), values(fc1->bias), 0, 4);
  for (auto& v : h) v = std::max(v, 0.0);
  auto ref = affine_ref(h, 5, 4, values(fc2->weight), values(fc2->bias), 0, 2);
  EXPECT_TRUE(matches(seq.forward(x), {5, 2}, ref));
  EXPECT_TRUE(matches(nn::Sequential().forward(x), {5, 3}, values(x)));  // empty: identity
}

// ======================= functional =======================

TEST(NnFunctional, CircularPadWrapsAround) {
  Tensor x = tensor<double>({1, 2, 3, 4, 5, 6}, {1, 2, 3});
  // pad last dim by (2, 1): [.., 2, 3 | 1, 2, 3 | 1]
  EXPECT_TRUE(
      matches(F::pad(x, {2, 1}, "circular"), {1, 2, 6}, {2, 3, 1, 2, 3, 1, 5, 6, 4, 5, 6, 4}));
  EXPECT_TRUE(matches(F::pad(x, {0, 0, 1, 0}, "circular"), {1, 3, 3}, {4, 5, 6, 1, 2, 3, 4, 5, 6}));
  EXPECT_THROW(F::pad(x, {4, 0}, "circular"), ValueError);
  EXPECT_TRUE(matches(F::pad(x, {1, 0}, "constant", 9.0), {1, 2, 4}, {9, 1, 2, 3, 9, 4, 5, 6}));
}

TEST(NnFunctional, LossesAndActivationsForwardToTheOps) {
  Tensor logits = tensor<double>({1.0, 2.0, 0.5, -1.0, 0.0, 3.0}, {2, 3});
  Tensor target = tensor<int64_t>({1, 2});
  const double l0 = -std::log(std::exp(2.0) / (std::exp(1.0) + std::exp(2.0) + std::exp(0.5)));
  const double l1 = -std::log(std::exp(3.0) / (std::exp(-1.0) + std::exp(0.0) + std::exp(3.0)));
  EXPECT_TRUE(matches(F::cross_entropy(logits, target), {}, {(l0 + l1) / 2}));
  EXPECT_TRUE(matches(F::cross_entropy(logits, target, {}, -100, nn::functional::Reduction::none),
                      {2}, {l0, l1}));
  EXPECT_TRUE(matches(F::mse_loss(tensor<double>({1, 2}), tensor<double>({0, 4})), {}, {2.5}));
  EXPECT_TRUE(matches(F::one_hot(tensor<int64_t>({2, 0}), 3), {2, 3}, {0, 0, 1, 1, 0, 0}));
  EXPECT_TRUE(matches(F::relu(tensor<double>({-1, 2})), {2}, {0, 2}));
}

// ======================= scaled_dot_product_attention =======================

TEST(NnAttention, SdpaMatchesSoftmaxQKtV) {
  const int64_t B = 2, L = 3, S = 4, E = 5, Ev = 2;
  Tensor q = random_tensor({B, L, E}, kFloat64, 71), k = random_tensor({B, S, E}, kFloat64, 72),
         v = random_tensor({B, S, Ev}, kFloat64, 73);
  auto none = [](int64_t, int64_t, int64_t) { return 0.0; };
  auto ref =
      attention_ref(values(q), values(k), values(v), B, L, S, E, Ev, 1 / std::sqrt(5.0), none);
  EXPECT_TRUE(matches(F::scaled_dot_product_attention(q, k, v), {B, L, Ev}, ref));
  auto ref_scaled = attention_ref(values(q), values(k), values(v), B, L, S, E, Ev, 0.3, none);
  EXPECT_TRUE(matches(F::scaled_dot_product_attention(q, k, v, {}, 0.0, false, 0.3), {B, L, Ev},
                      ref_scaled));
  // float32 with float32 tolerance.
  auto ref32 = attention_ref(values(q.to(kFloat32)), values(k.to(kFloat32)), values(v.to(kFloat32)),
                             B, L, S, E, Ev, 1 / std::sqrt(5.0), none);
  EXPECT_TRUE(
      matches(F::scaled_dot_product_attention(q.to(kFloat32), k.to(kFloat32), v.to(kFloat32)),
              {B, L, Ev}, ref32, kiln::testing::Tolerance{1e-5, 1e-5}));
}

TEST(NnAttention, SdpaCausalKeepsKeysUpToTheQuery) {
  const int64_t B = 1, L = 3, S = 4, E = 2;
  Tensor q = random_tensor({B, L, E}, kFloat64, 74), k = random_tensor({B, S, E}, kFloat64, 75),
         v = random_tensor({B, S, E}, kFloat64, 76);
  auto causal = [](int64_t, int64_t l, int64_t s) { return s <= l ? 0.0 : -kInf; };
  auto ref =
      attention_ref(values(q), values(k), values(v), B, L, S, E, E, 1 / std::sqrt(2.0), causal);
  EXPECT_TRUE(matches(F::scaled_dot_product_attention(q, k, v, {}, 0.0, true), {B, L, E}, ref));
  EXPECT_THROW(F::scaled_dot_product_attention(q, k, v, ones({L, S}, kBool), 0.0, true),
               ValueError);
}

TEST(NnAttention, SdpaBoolMaskKeepsTrueAndFloatMaskIsAdded) {
  const int64_t B = 2, L = 2, S = 3, E = 4;
  Tensor q = random_tensor({B, L, E}, kFloat64, 77), k = random_tensor({B, S, E}, kFloat64, 78),
         v = random_tensor({B, S, E}, kFloat64, 79);
  // (L, S) bool mask broadcast over the batch; row 1 fully masked -> zeros.
  const std::vector<bool> keep{true, false, true, false, false, false};
  Tensor mask = tensor<int64_t>({1, 0, 1, 0, 0, 0}, {L, S}).to(kBool);
  auto bool_bias = [&](int64_t, int64_t l, int64_t s) { return keep[l * S + s] ? 0.0 : -kInf; };
  auto ref = attention_ref(values(q), values(k), values(v), B, L, S, E, E, 0.5, bool_bias);
  Tensor out = F::scaled_dot_product_attention(q, k, v, mask);
  EXPECT_TRUE(matches(out, {B, L, E}, ref));
  EXPECT_TRUE(matches(out.select(1, 1), {B, E}, std::vector<double>(B * E, 0.0)));

  Tensor fmask = random_tensor({B, L, S}, kFloat64, 80);
  const auto fm = values(fmask);
  auto float_bias = [&](int64_t b, int64_t l, int64_t s) { return fm[(b * L + l) * S + s]; };
  auto fref = attention_ref(values(q), values(k), values(v), B, L, S, E, E, 0.5, float_bias);
  EXPECT_TRUE(matches(F::scaled_dot_product_attention(q, k, v, fmask), {B, L, E}, fref));
}

TEST(NnAttention, SdpaBroadcastsBatchAndHeadDims) {
  Tensor q = random_tensor({2, 3, 4, 8}, kFloat64, 81), k = random_tensor({2, 3, 5, 8}, kFloat64, 82),
         v = random_tensor({1, 3, 5, 6}, kFloat64, 83);
  Tensor out = F::scaled_dot_product_attention(q, k, v);
  EXPECT_EQ(out.sizes().vec(), (std::vector<int64_t>{2, 3, 4, 6}));
  auto vv = values(v.expand({2, 3, 5, 6}).contiguous());
  auto ref = attention_ref(values(q), values(k), vv, 6, 4, 5, 8, 6, 1 / std::sqrt(8.0),
                           [](int64_t, int64_t, int64_t) { return 0.0; });
  EXPECT_TRUE(matches(out, {2, 3, 4, 6}, ref));
}

TEST(NnAttention, SdpaRejectsBadInputs) {
  Tensor q = random_tensor({1, 2, 4}, kFloat64, 84), k = random_tensor({1, 3, 4}, kFloat64, 85),
         v = random_tensor({1, 3, 4}, kFloat64, 86);
  EXPECT_THROW(F::scaled_dot_product_attention(q, k.to(kFloat32), v), DTypeError);
  EXPECT_THROW(F::scaled_dot_product_attention(q, random_tensor({1, 3, 5}, kFloat64, 87), v), ShapeError);
  EXPECT_THROW(F::scaled_dot_product_attention(q, k, random_tensor({1, 2, 4}, kFloat64, 88)), ShapeError);
  EXPECT_THROW(F::scaled_dot_product_attention(q, k, v, zeros({2, 3}, kInt64)), DTypeError);
  EXPECT_THROW(F::scaled_dot_product_attention(q, k, v, {}, 1.5), ValueError);
  EXPECT_THROW(F::scaled_dot_product_attention(random_tensor({4}, kFloat64, 89), k, v), ShapeError);
}

// ======================= MultiheadAttention =======================

namespace {
// PyTorch's math path, by hand: query (L, N, E), key/value (S, N, E) row-major values.
struct MhaRef {
  std::vector<double> out;      // (L, N, E)
  std::vector<double> weights;  // (N, H, L, S)
};
MhaRef mha_ref(
    const nn::MultiheadAttention& mha, const std::vector<double>& query,
    const std::vector<double>& key, const std::vector<double>& value, int64_t L, int64_t S,
    int64_t N,
    const std::function<double(int64_t, int64_t, int64_t, int64_t)>& bias /* (n, h, l, s) */) {
  const int64_t E = mha.options.embed_dim, H = mha.options.num_heads, hd = E / H;
  const auto W = values(mha.in_proj_weight), b = values(mha.in_proj_bias);
  const auto Wo = values(mha.out_proj->weight), bo = values(mha.out_proj->bias);
  // Projections of all rows (row r = position * N + n).
  auto qp = affine_ref(query, L * N, E, W, b, 0, E);
  auto kp = affine_ref(key, S * N, E, W, b, E, E);
  auto vp = affine_ref(value, S * N, E, W, b, 2 * E, E);
  MhaRef r;
  r.weights.assign(static_cast<size_t>(N * H * L * S), 0.0);
  std::vector<double> concat(static_cast<size_t>(L * N * E), 0.0);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t h = 0; h < H; ++h) {
      std::vector<double> qh, kh, vh;
      for (int64_t l = 0; l < L; ++l)
        for (int64_t d = 0; d < hd; ++d) qh.push_back(qp[(l * N + n) * E + h * hd + d]);
      for (int64_t s = 0; s < S; ++s)
        for (int64_t d = 0; d < hd; ++d) {
          kh.push_back(kp[(s * N + n) * E + h * hd + d]);
          vh.push_back(vp[(s * N + n) * E + h * hd + d]);
        }
      std::vector<double> probs;
      auto o = attention_ref(
          qh, kh, vh, 1, L, S, hd, hd, 1 / std::sqrt(static_cast<double>(hd)),
          [&](int64_t, int64_t l, int64_t s) { return bias(n, h, l, s); }, &probs);
      for (int64_t l = 0; l < L; ++l) {
        for (int64_t s = 0; s < S; ++s) r.weights[((n * H + h) * L + l) * S + s] = probs[l * S + s];
        for (int64_t d = 0; d < hd; ++d) concat[(l * N + n) * E + h * hd + d] = o[l * hd + d];
      }
    }
  r.out = affine_ref(concat, L * N, E, Wo, bo, 0, E);
  return r;
}

std::vector<double> average_heads(const std::vector<double>& w, int64_t N, int64_t H, int64_t L,
                                  int64_t S) {
  std::vector<double> out(static_cast<size_t>(N * L * S), 0.0);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t i = 0; i < L * S; ++i)
        out[n * L * S + i] += w[(n * H + h) * L * S + i] / static_cast<double>(H);
  return out;
}

// Row-major values of x.transpose(0, 1) for a 3-D tensor.
std::vector<double> swap01(const Tensor& x) {
  return values(x.transpose(0, 1).contiguous());
}
}  // namespace

TEST(NnMultiheadAttention, ParametersHavePyTorchNamesShapesAndInit) {
  nn::MultiheadAttention mha(8, 2);
  std::vector<std::string> names;
  for (const auto& [n, p] : mha.named_parameters()) names.push_back(n + shape_str(p.sizes()));
  EXPECT_EQ(names, (std::vector<std::string>{"in_proj_weight(24, 8)", "in_proj_bias(24)",
                                             "out_proj.weight(8, 8)", "out_proj.bias(8)"}));
  const double xavier = std::sqrt(6.0 / (8 + 24));
  for (double w : values(mha.in_proj_weight)) EXPECT_LE(std::abs(w), xavier);
  EXPECT_TRUE(matches(mha.in_proj_bias, {24}, std::vector<double>(24, 0.0)));
  EXPECT_TRUE(matches(mha.out_proj->bias, {8}, std::vector<double>(8, 0.0)));
  EXPECT_EQ(mha.head_dim, 4);

  nn::MultiheadAttention cross(nn::MultiheadAttentionOptions{
      .embed_dim = 4, .num_heads = 1, .bias = false, .kdim = 3, .vdim = 5});
  names.clear();
  for (const auto& [n, p] : cross.named_parameters()) names.push_back(n + shape_str(p.sizes()));
  EXPECT_EQ(names, (std::vector<std::string>{"q_proj_weight(4, 4)", "k_proj_weight(4, 3)",
                                             "v_proj_weight(4, 5)", "out_proj.weight(4, 4)"}));
  auto [cross_out, cross_w] =
      cross.forward(random_tensor({2, 1, 4}, kFloat32, 90), random_tensor({3, 1, 3}, kFloat32, 91),
                    random_tensor({3, 1, 5}, kFloat32, 92));
  EXPECT_EQ(cross_out.sizes().vec(), (std::vector<int64_t>{2, 1, 4}));
  EXPECT_EQ(cross_w.sizes().vec(), (std::vector<int64_t>{1, 2, 3}));
  EXPECT_THROW(nn::MultiheadAttention(6, 4), ValueError);
  EXPECT_THROW(nn::MultiheadAttention(0, 1), ValueError);
}

TEST(NnMultiheadAttention, OutputAndWeightsMatchHandComputation) {
  const int64_t E = 4, H = 2, L = 3, S = 5, N = 2;
  nn::MultiheadAttention mha(E, H);
  mha.to(kFloat64);
  assign(mha.in_proj_bias, random_tensor({3 * E}, kFloat64, 93));  // make the biases matter
  assign(mha.out_proj->bias, random_tensor({E}, kFloat64, 94));
  Tensor q = random_tensor({L, N, E}, kFloat64, 95), k = random_tensor({S, N, E}, kFloat64, 96),
         v = random_tensor({S, N, E}, kFloat64, 97);
  auto ref = mha_ref(mha, values(q), values(k), values(v), L, S, N,
                     [](int64_t, int64_t, int64_t, int64_t) { return 0.0; });
  auto [out, w] = mha.forward(q, k, v);
  EXPECT_TRUE(matches(out, {L, N, E}, ref.out));
  EXPECT_TRUE(matches(w, {N, L, S}, average_heads(ref.weights, N, H, L, S)));

  auto [out2, w2] = mha.forward(q, k, v, {}, true, {}, /*average_attn_weights=*/false);
  EXPECT_TRUE(matches(out2, {L, N, E}, ref.out));
  EXPECT_TRUE(matches(w2, {N, H, L, S}, ref.weights));

  auto [out3, w3] = mha.forward(q, k, v, {}, /*need_weights=*/false);
  EXPECT_TRUE(matches(out3, {L, N, E}, ref.out));
  EXPECT_FALSE(w3.defined());

  // Self-attention through the one-tensor forward.
  auto self_ref = mha_ref(mha, values(q), values(q), values(q), L, L, N,
                          [](int64_t, int64_t, int64_t, int64_t) { return 0.0; });
  EXPECT_TRUE(matches(mha.forward(q), {L, N, E}, self_ref.out));
}

TEST(NnMultiheadAttention, BatchFirstAndUnbatchedInputs) {
  const int64_t E = 4, H = 2, L = 2, S = 3, N = 2;
  nn::MultiheadAttention mha(
      nn::MultiheadAttentionOptions{.embed_dim = E, .num_heads = H, .batch_first = true});
  mha.to(kFloat64);
  assign(mha.in_proj_bias, random_tensor({3 * E}, kFloat64, 98));
  Tensor q = random_tensor({N, L, E}, kFloat64, 99), k = random_tensor({N, S, E}, kFloat64, 100),
         v = random_tensor({N, S, E}, kFloat64, 101);
  auto ref = mha_ref(mha, swap01(q), swap01(k), swap01(v), L, S, N,
                     [](int64_t, int64_t, int64_t, int64_t) { return 0.0; });
  auto [out, w] = mha.forward(q, k, v);
  EXPECT_TRUE(matches(out.transpose(0, 1), {L, N, E}, ref.out));
  EXPECT_TRUE(matches(w, {N, L, S}, average_heads(ref.weights, N, H, L, S)));

  // Unbatched (L, E): batch_first does not apply.
  Tensor q1 = q.select(0, 1), k1 = k.select(0, 1), v1 = v.select(0, 1);
  auto ref1 = mha_ref(mha, values(q1), values(k1), values(v1), L, S, 1,
                      [](int64_t, int64_t, int64_t, int64_t) { return 0.0; });
  auto [o1, w1] = mha.forward(q1, k1, v1);
  EXPECT_TRUE(matches(o1, {L, E}, ref1.out));
  EXPECT_TRUE(matches(w1, {L, S}, average_heads(ref1.weights, 1, H, L, S)));
}

TEST(NnMultiheadAttention, MasksMarkPositionsToIgnore) {
  const int64_t E = 4, H = 2, L = 3, S = 4, N = 2;
  nn::MultiheadAttention mha(E, H);
  mha.to(kFloat64);
  Tensor q = random_tensor({L, N, E}, kFloat64, 102), k = random_tensor({S, N, E}, kFloat64, 103),
         v = random_tensor({S, N, E}, kFloat64, 104);
  // key_padding_mask: batch 0 ignores key 3, batch 1 ignores keys 0 and 1. attn_mask: query 0
  // may not see key 2.
  Tensor kpm = tensor<int64_t>({0, 0, 0, 1, 1, 1, 0, 0}, {N, S}).to(kBool);
  Tensor am = zeros({L, S}, kBool);
  am.index_put_({0, 2}, true);
  auto bias = [](int64_t n, int64_t, int64_t l, int64_t s) {
    const bool padded = (n == 0 && s == 3) || (n == 1 && s < 2);
    return padded || (l == 0 && s == 2) ? -kInf : 0.0;
  };
  auto ref = mha_ref(mha, values(q), values(k), values(v), L, S, N, bias);
  auto [out, w] = mha.forward(q, k, v, kpm, true, am);
  EXPECT_TRUE(matches(out, {L, N, E}, ref.out));
  EXPECT_TRUE(matches(w, {N, L, S}, average_heads(ref.weights, N, H, L, S)));
  EXPECT_TRUE(matches(std::get<0>(mha.forward(q, k, v, kpm, false, am)), {L, N, E}, ref.out));

  // A float attn_mask is added to the scores.
  Tensor fm = random_tensor({L, S}, kFloat64, 105);
  const auto fmv = values(fm);
  auto fref = mha_ref(mha, values(q), values(k), values(v), L, S, N,
                      [&](int64_t, int64_t, int64_t l, int64_t s) { return fmv[l * S + s]; });
  EXPECT_TRUE(matches(std::get<0>(mha.forward(q, k, v, {}, true, fm)), {L, N, E}, fref.out));

  // is_causal without a mask builds the causal mask.
  Tensor x = random_tensor({L, N, E}, kFloat64, 106);
  auto cref = mha_ref(mha, values(x), values(x), values(x), L, L, N,
                      [](int64_t, int64_t, int64_t l, int64_t s) { return s <= l ? 0.0 : -kInf; });
  EXPECT_TRUE(matches(std::get<0>(mha.forward(x, x, x, {}, false, {}, true, /*is_causal=*/true)),
                      {L, N, E}, cref.out));
}

TEST(NnMultiheadAttention, RejectsMisshapedInputs) {
  nn::MultiheadAttention mha(4, 2);
  Tensor q = random_tensor({3, 2, 4}, kFloat32, 107), kv = random_tensor({5, 2, 4}, kFloat32, 108);
  EXPECT_THROW(mha.forward(random_tensor({3, 2, 6}, kFloat32, 109), kv, kv), ShapeError);
  EXPECT_THROW(mha.forward(q, kv, kv, zeros({2, 4}, kBool)), ShapeError);
  EXPECT_THROW(mha.forward(q, kv, kv, {}, true, zeros({3, 4}, kBool)), ShapeError);
  EXPECT_THROW(mha.forward(q, kv, kv, {}, true, zeros({3, 5}, kInt64)), DTypeError);
  EXPECT_THROW(mha.forward(q, kv.select(1, 0), kv), ShapeError);
  EXPECT_THROW(mha.forward(random_tensor({4}, kFloat32, 110), kv, kv), ShapeError);
}

// ======================= nn::init =======================

TEST(NnInit, GainsAndFans) {
  EXPECT_DOUBLE_EQ(nn::init::calculate_gain("linear"), 1.0);
  EXPECT_DOUBLE_EQ(nn::init::calculate_gain("conv2d"), 1.0);
  EXPECT_DOUBLE_EQ(nn::init::calculate_gain("sigmoid"), 1.0);
  EXPECT_DOUBLE_EQ(nn::init::calculate_gain("tanh"), 5.0 / 3.0);
  EXPECT_DOUBLE_EQ(nn::init::calculate_gain("relu"), std::sqrt(2.0));
  EXPECT_DOUBLE_EQ(nn::init::calculate_gain("leaky_relu"), std::sqrt(2.0 / (1 + 0.01 * 0.01)));
  EXPECT_DOUBLE_EQ(nn::init::calculate_gain("leaky_relu", std::sqrt(5.0)), std::sqrt(1.0 / 3.0));
  EXPECT_DOUBLE_EQ(nn::init::calculate_gain("selu"), 0.75);
  EXPECT_THROW(nn::init::calculate_gain("swish"), ValueError);
  auto [fan_in, fan_out] = nn::init::calculate_fan_in_and_fan_out(empty({6, 4, 3, 3}));
  EXPECT_EQ(fan_in, 36);
  EXPECT_EQ(fan_out, 54);
  EXPECT_THROW(nn::init::calculate_fan_in_and_fan_out(empty({5})), ShapeError);
}

TEST(NnInit, FillsStayWithinTheirBoundsAndRecordNoGraph) {
  Tensor w = empty({64, 32}).requires_grad_();
  nn::init::xavier_uniform_(w, 2.0);
  const double xb = 2.0 * std::sqrt(6.0 / (64 + 32));
  for (double v : values(w)) EXPECT_LE(std::abs(v), xb);
  EXPECT_TRUE(w.is_leaf());
  EXPECT_TRUE(w.requires_grad());

  nn::init::kaiming_uniform_(w, 0.0, "fan_out", "relu");
  const double kb = std::sqrt(2.0) * std::sqrt(3.0 / 64.0);
  for (double v : values(w)) EXPECT_LE(std::abs(v), kb);

  Tensor big = empty({200, 100}, kFloat64);
  nn::init::kaiming_normal_(big, 0.0, "fan_in", "relu");
  auto bv = values(big);
  double var = 0;
  for (double v : bv) var += v * v / static_cast<double>(bv.size());
  EXPECT_NEAR(std::sqrt(var), std::sqrt(2.0 / 100.0), 0.01);
  nn::init::xavier_normal_(big);
  bv = values(big);
  var = 0;
  for (double v : bv) var += v * v / static_cast<double>(bv.size());
  EXPECT_NEAR(std::sqrt(var), std::sqrt(2.0 / 300.0), 0.005);

  Tensor t = empty({5000}, kFloat64);
  nn::init::trunc_normal_(t, 1.0, 2.0, -0.5, 2.0);
  auto tv = values(t);
  double lo = kInf, hi = -kInf, mean = 0;
  for (double v : tv) {
    lo = std::min(lo, v);
    hi = std::max(hi, v);
    mean += v / static_cast<double>(tv.size());
  }
  EXPECT_GE(lo, -0.5);
  EXPECT_LE(hi, 2.0);
  EXPECT_LT(lo, -0.4);
  EXPECT_GT(hi, 1.9);
  // Mean of N(1, 4) truncated to [-0.5, 2]: mu + sigma * (phi(a') - phi(b')) / (Phi(b') - Phi(a')).
  auto phi = [](double x) { return std::exp(-x * x / 2) / std::sqrt(2 * M_PI); };
  auto Phi = [](double x) { return 0.5 * (1 + std::erf(x / std::sqrt(2.0))); };
  const double a = (-0.5 - 1.0) / 2.0, b = (2.0 - 1.0) / 2.0;
  EXPECT_NEAR(mean, 1.0 + 2.0 * (phi(a) - phi(b)) / (Phi(b) - Phi(a)), 0.03);

  Tensor e = empty({2, 3});
  nn::init::eye_(e);
  EXPECT_TRUE(matches(e, {2, 3}, {1, 0, 0, 0, 1, 0}));
  nn::init::constant_(e, 0.25);
  EXPECT_TRUE(matches(e, {2, 3}, std::vector<double>(6, 0.25)));
  nn::init::uniform_(e, 2.0, 3.0);
  for (double v : values(e)) EXPECT_TRUE(v >= 2.0 && v <= 3.0);
  EXPECT_THROW(nn::init::eye_(empty({2, 2, 2})), ShapeError);
  EXPECT_THROW(nn::init::kaiming_uniform_(empty({2, 2}), 0.0, "fan_avg"), ValueError);
  EXPECT_THROW(nn::init::zeros_(Tensor()), ValueError);
}
