// kiln::models: torchvision's DenseNet / ResNet and nanoGPT's GPT — state_dict keys, order and
// shapes, parameter counts, init, forward checked against float64 references written with loops
// (which read the weights by their key names), GPT's causal property and length check,
// safetensors round trips, and mlp().
#include <filesystem>
#include <functional>
#include <map>
#include <numbers>
#include <numeric>
#include <sstream>

#include <unistd.h>

#include "reference.h"

using namespace kiln;
using kiln::testing::matches;
using kiln::testing::values;
namespace fs = std::filesystem;

namespace {

using Names = std::vector<std::string>;
using StateMap = std::map<std::string, Tensor>;

Names keys_of(const NamedTensors& named) {
  Names out;
  for (const auto& [k, v] : named) out.push_back(k);
  return out;
}

StateMap state_map(const nn::Module& m) {
  StateMap out;
  for (const auto& [k, v] : m.state_dict()) out.emplace(k, v);
  return out;
}

int64_t count_parameters(const nn::Module& m) {
  int64_t n = 0;
  for (const Tensor& p : m.parameters()) n += p.numel();
  return n;
}

const Tensor& entry(const StateMap& sd, const std::string& key) {
  auto it = sd.find(key);
  if (it == sd.end()) throw std::runtime_error("missing state_dict key " + key);
  return it->second;
}

// Random BatchNorm statistics and affine parameters, so that eval-mode forwards exercise them.
void randomize_batch_norms(nn::Module& model) {
  NoGradGuard no_grad;
  for (const auto& m : model.modules()) {
    if (auto* bn = m->as<nn::BatchNorm2d>()) {
      bn->running_mean.normal_(0.0, 0.2);
      bn->running_var.uniform_(0.5, 1.5);
      bn->weight.uniform_(0.5, 1.5);
      bn->bias.normal_(0.0, 0.2);
    }
  }
}

// A fresh file path under the system temp dir, removed at the end of the test.
class TempFile {
 public:
  explicit TempFile(const std::string& name)
      : path_(fs::temp_directory_path() /
              ("kiln_test_models_" + std::to_string(::getpid()) + "_" + name)) {}
  ~TempFile() {
    std::error_code ec;
    fs::remove(path_, ec);
  }
  std::string str() const { return path_.string(); }

 private:
  fs::path path_;
};

// ======================= float64 references (NCHW loops) =======================

struct Img {
  int64_t n = 0, c = 0, h = 0, w = 0;
  std::vector<double> d;
  Img() = default;
  Img(int64_t n_, int64_t c_, int64_t h_, int64_t w_)
      : n(n_), c(c_), h(h_), w(w_), d(static_cast<size_t>(n_ * c_ * h_ * w_), 0.0) {}
  double& at(int64_t i, int64_t j, int64_t y, int64_t x) { return d[((i * c + j) * h + y) * w + x]; }
  double at(int64_t i, int64_t j, int64_t y, int64_t x) const {
    return d[((i * c + j) * h + y) * w + x];
  }
};

Img img_of(const Tensor& t) {
  Img out(t.size(0), t.size(1), t.size(2), t.size(3));
  out.d = values(t);
  return out;
}

Img conv_ref(const Img& x, const Tensor& weight, int64_t stride, int64_t pad, int64_t groups = 1) {
  const std::vector<double> W = values(weight);
  const int64_t O = weight.size(0), Ig = weight.size(1), KH = weight.size(2), KW = weight.size(3);
  const int64_t Og = O / groups;
  Img y(x.n, O, (x.h + 2 * pad - KH) / stride + 1, (x.w + 2 * pad - KW) / stride + 1);
  for (int64_t i = 0; i < x.n; ++i)
    for (int64_t o = 0; o < O; ++o) {
      const int64_t g = o / Og;
      for (int64_t oy = 0; oy < y.h; ++oy)
        for (int64_t ox = 0; ox < y.w; ++ox) {
          double acc = 0;
          for (int64_t ci = 0; ci < Ig; ++ci)
            for (int64_t ky = 0; ky < KH; ++ky) {
              const int64_t iy = oy * stride - pad + ky;
              if (iy < 0 || iy >= x.h) continue;
              for (int64_t kx = 0; kx < KW; ++kx) {
                const int64_t ix = ox * stride - pad + kx;
                if (ix < 0 || ix >= x.w) continue;
                acc += x.at(i, g * Ig + ci, iy, ix) * W[((o * Ig + ci) * KH + ky) * KW + kx];
              }
            }
          y.at(i, o, oy, ox) = acc;
        }
    }
  return y;
}

// Eval-mode BatchNorm2d with the entries "<prefix>.weight", ".bias", ".running_mean", ".running_var".
Img bn_ref(Img x, const StateMap& sd, const std::string& prefix) {
  const auto w = values(entry(sd, prefix + ".weight")), b = values(entry(sd, prefix + ".bias"));
  const auto rm = values(entry(sd, prefix + ".running_mean"));
  const auto rv = values(entry(sd, prefix + ".running_var"));
  for (int64_t i = 0; i < x.n; ++i)
    for (int64_t j = 0; j < x.c; ++j)
      for (int64_t y = 0; y < x.h; ++y)
        for (int64_t z = 0; z < x.w; ++z) {
          double& v = x.at(i, j, y, z);
          v = (v - rm[j]) / std::sqrt(rv[j] + 1e-5) * w[j] + b[j];
        }
  return x;
}

Img relu_ref(Img x) {
  for (double& v : x.d) v = std::max(v, 0.0);
  return x;
}

Img add_ref(Img a, const Img& b) {
  for (size_t i = 0; i < a.d.size(); ++i) a.d[i] += b.d[i];
  return a;
}

Img max_pool_ref(const Img& x, int64_t k, int64_t s, int64_t p) {
  Img y(x.n, x.c, (x.h + 2 * p - k) / s + 1, (x.w + 2 * p - k) / s + 1);
  for (int64_t i = 0; i < x.n; ++i)
    for (int64_t j = 0; j < x.c; ++j)
      for (int64_t oy = 0; oy < y.h; ++oy)
        for (int64_t ox = 0; ox < y.w; ++ox) {
          double m = -INFINITY;
          for (int64_t ky = 0; ky < k; ++ky)
            for (int64_t kx = 0; kx < k; ++kx) {
              const int64_t iy = oy * s - p + ky, ix = ox * s - p + kx;
              if (iy >= 0 && iy < x.h && ix >= 0 && ix < x.w) m = std::max(m, x.at(i, j, iy, ix));
            }
          y.at(i, j, oy, ox) = m;
        }
  return y;
}

Img avg_pool2_ref(const Img& x) {
  Img y(x.n, x.c, x.h / 2, x.w / 2);
  for (int64_t i = 0; i < x.n; ++i)
    for (int64_t j = 0; j < x.c; ++j)
      for (int64_t oy = 0; oy < y.h; ++oy)
        for (int64_t ox = 0; ox < y.w; ++ox)
          y.at(i, j, oy, ox) = (x.at(i, j, 2 * oy, 2 * ox) + x.at(i, j, 2 * oy, 2 * ox + 1) +
                                x.at(i, j, 2 * oy + 1, 2 * ox) + x.at(i, j, 2 * oy + 1, 2 * ox + 1)) /
                               4.0;
  return y;
}

Img cat_channels_ref(const std::vector<Img>& xs) {
  int64_t c = 0;
  for (const Img& x : xs) c += x.c;
  Img y(xs[0].n, c, xs[0].h, xs[0].w);
  for (int64_t i = 0; i < y.n; ++i) {
    int64_t base = 0;
    for (const Img& x : xs) {
      for (int64_t j = 0; j < x.c; ++j)
        for (int64_t a = 0; a < x.h; ++a)
          for (int64_t b = 0; b < x.w; ++b) y.at(i, base + j, a, b) = x.at(i, j, a, b);
      base += x.c;
    }
  }
  return y;
}

// Global average pool, then the Linear "<prefix>.weight/.bias": (N, classes) row-major.
std::vector<double> pool_linear_ref(const Img& x, const StateMap& sd, const std::string& prefix) {
  const Tensor& weight = entry(sd, prefix + ".weight");
  const auto W = values(weight), b = values(entry(sd, prefix + ".bias"));
  const int64_t classes = weight.size(0);
  std::vector<double> out;
  for (int64_t i = 0; i < x.n; ++i) {
    std::vector<double> pooled(x.c, 0.0);
    for (int64_t j = 0; j < x.c; ++j) {
      for (int64_t a = 0; a < x.h; ++a)
        for (int64_t z = 0; z < x.w; ++z) pooled[j] += x.at(i, j, a, z);
      pooled[j] /= static_cast<double>(x.h * x.w);
    }
    for (int64_t k = 0; k < classes; ++k) {
      double acc = b[k];
      for (int64_t j = 0; j < x.c; ++j) acc += W[k * x.c + j] * pooled[j];
      out.push_back(acc);
    }
  }
  return out;
}

// torchvision's DenseNet.forward in float64, reading the weights by their key names.
std::vector<double> densenet_ref(const Img& x, const StateMap& sd,
                                 const models::DenseNetConfig& cfg) {
  Img y = conv_ref(x, entry(sd, "features.conv0.weight"), 2, 3);
  y = max_pool_ref(relu_ref(bn_ref(y, sd, "features.norm0")), 3, 2, 1);
  for (size_t b = 0; b < cfg.block_config.size(); ++b) {
    std::vector<Img> feats{y};
    for (int64_t l = 0; l < cfg.block_config[b]; ++l) {
      const std::string p = "features.denseblock" + std::to_string(b + 1) + ".denselayer" +
                            std::to_string(l + 1) + ".";
      Img t = relu_ref(bn_ref(cat_channels_ref(feats), sd, p + "norm1"));
      t = conv_ref(t, entry(sd, p + "conv1.weight"), 1, 0);
      t = conv_ref(relu_ref(bn_ref(t, sd, p + "norm2")), entry(sd, p + "conv2.weight"), 1, 1);
      feats.push_back(t);
    }
    y = cat_channels_ref(feats);
    if (b + 1 < cfg.block_config.size()) {
      const std::string p = "features.transition" + std::to_string(b + 1) + ".";
      y = conv_ref(relu_ref(bn_ref(y, sd, p + "norm")), entry(sd, p + "conv.weight"), 1, 0);
      y = avg_pool2_ref(y);
    }
  }
  y = relu_ref(bn_ref(y, sd, "features.norm5"));
  return pool_linear_ref(y, sd, "classifier");
}

// torchvision's ResNet.forward in float64 (v1.5: the stride on the 3x3 conv).
std::vector<double> resnet_ref(const Img& x, const StateMap& sd, models::ResNetBlock block,
                               std::array<int64_t, 4> layers, int64_t groups = 1) {
  Img y = conv_ref(x, entry(sd, "conv1.weight"), 2, 3);
  y = max_pool_ref(relu_ref(bn_ref(y, sd, "bn1")), 3, 2, 1);
  for (int64_t s = 0; s < 4; ++s)
    for (int64_t i = 0; i < layers[s]; ++i) {
      const std::string p = "layer" + std::to_string(s + 1) + "." + std::to_string(i) + ".";
      const int64_t stride = (s > 0 && i == 0) ? 2 : 1;
      Img o;
      if (block == models::ResNetBlock::basic) {
        o = relu_ref(bn_ref(conv_ref(y, entry(sd, p + "conv1.weight"), stride, 1), sd, p + "bn1"));
        o = bn_ref(conv_ref(o, entry(sd, p + "conv2.weight"), 1, 1), sd, p + "bn2");
      } else {
        o = relu_ref(bn_ref(conv_ref(y, entry(sd, p + "conv1.weight"), 1, 0), sd, p + "bn1"));
        o = relu_ref(
            bn_ref(conv_ref(o, entry(sd, p + "conv2.weight"), stride, 1, groups), sd, p + "bn2"));
        o = bn_ref(conv_ref(o, entry(sd, p + "conv3.weight"), 1, 0), sd, p + "bn3");
      }
      const Img identity =
          sd.count(p + "downsample.0.weight")
              ? bn_ref(conv_ref(y, entry(sd, p + "downsample.0.weight"), stride, 0), sd,
                       p + "downsample.1")
              : y;
      y = relu_ref(add_ref(o, identity));
    }
  return pool_linear_ref(y, sd, "fc");
}

// ---- GPT reference: rows of width `in` through "<prefix>.weight" (out, in) and optional bias ----
std::vector<double> linear_ref(const std::vector<double>& x, int64_t rows, const StateMap& sd,
                               const std::string& prefix) {
  const Tensor& weight = entry(sd, prefix + ".weight");
  const auto W = values(weight);
  const int64_t out = weight.size(0), in = weight.size(1);
  std::vector<double> b(out, 0.0);
  if (sd.count(prefix + ".bias")) b = values(entry(sd, prefix + ".bias"));
  std::vector<double> y(rows * out);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t o = 0; o < out; ++o) {
      double acc = b[o];
      for (int64_t i = 0; i < in; ++i) acc += x[r * in + i] * W[o * in + i];
      y[r * out + o] = acc;
    }
  return y;
}

std::vector<double> layer_norm_ref(const std::vector<double>& x, int64_t rows, int64_t C,
                                   const StateMap& sd, const std::string& prefix) {
  const auto w = values(entry(sd, prefix + ".weight"));
  std::vector<double> b(C, 0.0);
  if (sd.count(prefix + ".bias")) b = values(entry(sd, prefix + ".bias"));
  std::vector<double> y(x.size());
  for (int64_t r = 0; r < rows; ++r) {
    double mean = 0, var = 0;
    for (int64_t i = 0; i < C; ++i) mean += x[r * C + i];
    mean /= static_cast<double>(C);
    for (int64_t i = 0; i < C; ++i) var += (x[r * C + i] - mean) * (x[r * C + i] - mean);
    var /= static_cast<double>(C);
    for (int64_t i = 0; i < C; ++i)
      y[r * C + i] = (x[r * C + i] - mean) / std::sqrt(var + 1e-5) * w[i] + b[i];
  }
  return y;
}

// nanoGPT's GPT.forward in float64: logits (B, T, vocab) row-major.
std::vector<double> gpt_ref(const std::vector<int64_t>& idx, int64_t B, int64_t T,
                            const StateMap& sd, const models::GPTConfig& cfg) {
  const int64_t C = cfg.n_embd, H = cfg.n_head, hs = C / H, rows = B * T;
  const auto wte = values(entry(sd, "transformer.wte.weight"));
  const auto wpe = values(entry(sd, "transformer.wpe.weight"));
  std::vector<double> x(rows * C);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t i = 0; i < C; ++i) x[r * C + i] = wte[idx[r] * C + i] + wpe[(r % T) * C + i];
  for (int64_t l = 0; l < cfg.n_layer; ++l) {
    const std::string p = "transformer.h." + std::to_string(l) + ".";
    const auto qkv = linear_ref(layer_norm_ref(x, rows, C, sd, p + "ln_1"), rows, sd,
                                p + "attn.c_attn");  // (rows, 3C): q | k | v
    std::vector<double> y(rows * C, 0.0);
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t t = 0; t < T; ++t) {
          std::vector<double> scores(t + 1);
          double mx = -INFINITY;
          for (int64_t s = 0; s <= t; ++s) {
            double dot = 0;
            for (int64_t e = 0; e < hs; ++e)
              dot += qkv[(b * T + t) * 3 * C + h * hs + e] * qkv[(b * T + s) * 3 * C + C + h * hs + e];
            scores[s] = dot / std::sqrt(static_cast<double>(hs));
            mx = std::max(mx, scores[s]);
          }
          double z = 0;
          for (double& v : scores) z += (v = std::exp(v - mx));
          for (int64_t s = 0; s <= t; ++s)
            for (int64_t e = 0; e < hs; ++e)
              y[(b * T + t) * C + h * hs + e] +=
                  scores[s] / z * qkv[(b * T + s) * 3 * C + 2 * C + h * hs + e];
        }
    const auto attn = linear_ref(y, rows, sd, p + "attn.c_proj");
    for (size_t i = 0; i < x.size(); ++i) x[i] += attn[i];
    auto m = linear_ref(layer_norm_ref(x, rows, C, sd, p + "ln_2"), rows, sd, p + "mlp.c_fc");
    for (double& v : m) {
      const double k = std::sqrt(2.0 / std::numbers::pi);
      v = 0.5 * v * (1.0 + std::tanh(k * (v + 0.044715 * v * v * v)));
    }
    const auto mlp = linear_ref(m, rows, sd, p + "mlp.c_proj");
    for (size_t i = 0; i < x.size(); ++i) x[i] += mlp[i];
  }
  return linear_ref(layer_norm_ref(x, rows, C, sd, "transformer.ln_f"), rows, sd, "lm_head");
}

// ======================= expected key lists, written from the reference sources =======================

void add_batch_norm_keys(Names& keys, const std::string& prefix) {
  for (const char* k : {"weight", "bias", "running_mean", "running_var", "num_batches_tracked"})
    keys.push_back(prefix + "." + k);
}

// torchvision.models.DenseNet's state_dict keys, in order.
Names torchvision_densenet_keys(const std::vector<int64_t>& block_config) {
  Names keys{"features.conv0.weight"};
  add_batch_norm_keys(keys, "features.norm0");
  for (size_t b = 0; b < block_config.size(); ++b) {
    for (int64_t l = 0; l < block_config[b]; ++l) {
      const std::string p = "features.denseblock" + std::to_string(b + 1) + ".denselayer" +
                            std::to_string(l + 1) + ".";
      add_batch_norm_keys(keys, p + "norm1");
      keys.push_back(p + "conv1.weight");
      add_batch_norm_keys(keys, p + "norm2");
      keys.push_back(p + "conv2.weight");
    }
    if (b + 1 < block_config.size()) {
      const std::string p = "features.transition" + std::to_string(b + 1) + ".";
      add_batch_norm_keys(keys, p + "norm");
      keys.push_back(p + "conv.weight");
    }
  }
  add_batch_norm_keys(keys, "features.norm5");
  keys.push_back("classifier.weight");
  keys.push_back("classifier.bias");
  return keys;
}

// torchvision.models.ResNet's state_dict keys, in order.
Names torchvision_resnet_keys(bool bottleneck, std::array<int64_t, 4> layers) {
  Names keys{"conv1.weight"};
  add_batch_norm_keys(keys, "bn1");
  for (int s = 0; s < 4; ++s)
    for (int64_t i = 0; i < layers[s]; ++i) {
      const std::string p = "layer" + std::to_string(s + 1) + "." + std::to_string(i) + ".";
      for (int c = 1; c <= (bottleneck ? 3 : 2); ++c) {
        keys.push_back(p + "conv" + std::to_string(c) + ".weight");
        add_batch_norm_keys(keys, p + "bn" + std::to_string(c));
      }
      // The first block of a stage changes the shape (layer1 too, for Bottleneck: 64 -> 256).
      if (i == 0 && (s > 0 || bottleneck)) {
        keys.push_back(p + "downsample.0.weight");
        add_batch_norm_keys(keys, p + "downsample.1");
      }
    }
  keys.push_back("fc.weight");
  keys.push_back("fc.bias");
  return keys;
}

// nanoGPT's GPT state_dict keys (flash attention: no causal-mask buffer), in order.
Names nanogpt_keys(int64_t n_layer, bool bias) {
  Names keys{"transformer.wte.weight", "transformer.wpe.weight"};
  auto add = [&](const std::string& p, bool has_bias) {
    keys.push_back(p + ".weight");
    if (has_bias) keys.push_back(p + ".bias");
  };
  for (int64_t l = 0; l < n_layer; ++l) {
    const std::string p = "transformer.h." + std::to_string(l) + ".";
    for (const char* m : {"ln_1", "attn.c_attn", "attn.c_proj", "ln_2", "mlp.c_fc", "mlp.c_proj"})
      add(p + m, bias);
  }
  add("transformer.ln_f", bias);
  keys.push_back("lm_head.weight");
  return keys;
}

double std_of(const Tensor& t) {
  return t.to(kFloat64).std().item<double>();
}

models::DenseNetConfig small_densenet_config() {
  return {.growth_rate = 4, .block_config = {2, 3}, .num_init_features = 8, .bn_size = 2,
          .num_classes = 5};
}

models::GPTConfig small_gpt_config() {
  return {.vocab_size = 11, .block_size = 8, .n_layer = 2, .n_head = 2, .n_embd = 8};
}

// ======================= DenseNet =======================

TEST(DenseNet, Densenet121StateDictHasTorchvisionKeysInOrder) {
  auto net = models::densenet121();
  const NamedTensors sd = net->state_dict();
  ASSERT_EQ(sd.size(), 727u);
  EXPECT_EQ(keys_of(sd), torchvision_densenet_keys({6, 12, 24, 16}));
  EXPECT_EQ(sd.front().first, "features.conv0.weight");
  EXPECT_EQ(sd[6].first, "features.denseblock1.denselayer1.norm1.weight");
  EXPECT_EQ(sd[sd.size() - 3].first, "features.norm5.num_batches_tracked");
  EXPECT_EQ(sd.back().first, "classifier.bias");

  const StateMap m = state_map(*net);
  auto shape = [&](const std::string& k) { return entry(m, k).sizes().vec(); };
  using V = std::vector<int64_t>;
  EXPECT_EQ(shape("features.conv0.weight"), (V{64, 3, 7, 7}));
  EXPECT_EQ(shape("features.norm0.running_mean"), (V{64}));
  EXPECT_EQ(shape("features.denseblock1.denselayer1.conv1.weight"), (V{128, 64, 1, 1}));
  EXPECT_EQ(shape("features.denseblock1.denselayer1.conv2.weight"), (V{32, 128, 3, 3}));
  EXPECT_EQ(shape("features.denseblock1.denselayer6.norm1.weight"), (V{224}));
  EXPECT_EQ(shape("features.transition1.conv.weight"), (V{128, 256, 1, 1}));
  EXPECT_EQ(shape("features.denseblock4.denselayer16.norm1.weight"), (V{992}));
  EXPECT_EQ(shape("features.norm5.weight"), (V{1024}));
  EXPECT_EQ(shape("classifier.weight"), (V{1000, 1024}));
  const Tensor& nbt = entry(m, "features.norm5.num_batches_tracked");
  EXPECT_EQ(nbt.dtype(), kInt64);
  EXPECT_EQ(nbt.dim(), 0);
}

TEST(DenseNet, ParameterCountsMatchTorchvision) {
  EXPECT_EQ(count_parameters(*models::densenet121()), 7978856);
  EXPECT_EQ(count_parameters(*models::densenet169()), 14149480);
  EXPECT_EQ(count_parameters(*models::densenet201()), 20013928);
  EXPECT_EQ(count_parameters(*models::densenet161()), 28681000);
  EXPECT_EQ(count_parameters(*models::densenet121({.num_classes = 10})), 7978856 - 990 * 1025);
}

TEST(DenseNet, Densenet169KeysFollowItsBlockConfig) {
  auto net = models::densenet169();
  EXPECT_EQ(keys_of(net->state_dict()), torchvision_densenet_keys({6, 12, 32, 32}));
  EXPECT_EQ(net->classifier->weight.sizes().vec(), (std::vector<int64_t>{1000, 1664}));
}

TEST(DenseNet, InitIsKaimingNormalConvsUnitBatchNormsZeroClassifierBias) {
  manual_seed(0);
  auto net = models::densenet121();
  // conv1 of a late dense layer: fan_in = 992 * 1 * 1, std sqrt(2 / fan_in).
  const Tensor& w = net->get_parameter("features.denseblock4.denselayer16.conv1.weight");
  EXPECT_NEAR(std_of(w), std::sqrt(2.0 / 992.0), 0.03 * std::sqrt(2.0 / 992.0));
  EXPECT_NEAR(w.to(kFloat64).mean().item<double>(), 0.0, 0.002);
  const Tensor& conv0 = net->get_parameter("features.conv0.weight");
  EXPECT_NEAR(std_of(conv0), std::sqrt(2.0 / 147.0), 0.1 * std::sqrt(2.0 / 147.0));
  EXPECT_TRUE(equal(net->get_parameter("features.norm5.weight"), ones({1024})));
  EXPECT_TRUE(equal(net->get_parameter("features.norm5.bias"), zeros({1024})));
  EXPECT_TRUE(equal(net->classifier->bias, zeros({1000})));
  // The classifier weight keeps Linear's default U(-1/sqrt(1024), 1/sqrt(1024)).
  EXPECT_LE(net->classifier->weight.abs().max().item<double>(), 1.0 / 32.0);
  EXPECT_GT(net->classifier->weight.abs().max().item<double>(), 0.9 / 32.0);
}

TEST(DenseNet, ForwardMatchesFloat64ReferenceInEvalMode) {
  manual_seed(1);
  const auto cfg = small_densenet_config();
  auto net = std::make_shared<models::DenseNet>(cfg);
  randomize_batch_norms(*net);
  net->eval();
  Tensor x = randn({2, 3, 16, 16});
  Tensor y;
  {
    NoGradGuard no_grad;
    y = net->forward(x);
  }
  EXPECT_TRUE(matches(y, {2, 5}, densenet_ref(img_of(x), state_map(*net), cfg),
                      kiln::testing::Tolerance{1e-4, 1e-4}));
}

TEST(DenseNet, Densenet121ForwardShapeOnSmallImages) {
  manual_seed(2);
  auto net = models::densenet121({.num_classes = 10});
  net->eval();
  NoGradGuard no_grad;
  Tensor y = net->forward(randn({1, 3, 32, 32}));
  EXPECT_EQ(y.sizes().vec(), (std::vector<int64_t>{1, 10}));
  EXPECT_TRUE(all(isfinite(y)).item<bool>());
}

TEST(DenseNet, TrainingModeUpdatesRunningStatsAndUsesBatchStatistics) {
  manual_seed(3);
  auto net = std::make_shared<models::DenseNet>(small_densenet_config());
  Tensor x = randn({4, 3, 16, 16});
  NoGradGuard no_grad;
  Tensor y = net->forward(x);
  EXPECT_EQ(y.sizes().vec(), (std::vector<int64_t>{4, 5}));
  EXPECT_EQ(net->get_buffer("features.norm0.num_batches_tracked").item<int64_t>(), 1);
  EXPECT_FALSE(equal(net->get_buffer("features.norm5.running_mean"), zeros({20})));
}

TEST(DenseNet, ModulesPrintUnderTorchvisionClassNames) {
  auto net = std::make_shared<models::DenseNet>(small_densenet_config());
  const std::string s = net->str();
  EXPECT_NE(s.find("DenseNet(\n  (features): Sequential(\n    (conv0): Conv2d(3, 8, kernel_size=(7, 7), "
                   "stride=(2, 2), padding=(3, 3), bias=False)"),
            std::string::npos)
      << s;
  EXPECT_NE(s.find("(denseblock1): _DenseBlock("), std::string::npos);
  EXPECT_NE(s.find("(denselayer1): _DenseLayer("), std::string::npos);
  EXPECT_NE(s.find("(transition1): _Transition("), std::string::npos);
  EXPECT_NE(s.find("(relu1): ReLU(inplace=True)"), std::string::npos);
  EXPECT_NE(s.find("(classifier): Linear(in_features=20, out_features=5, bias=True)"),
            std::string::npos);
}

TEST(DenseNet, BadConfigAndInputThrow) {
  EXPECT_THROW(models::DenseNet({.block_config = {}}), ValueError);
  EXPECT_THROW(models::DenseNet({.block_config = {2, 0}}), ValueError);
  EXPECT_THROW(models::DenseNet({.growth_rate = 0}), ValueError);
  EXPECT_THROW(models::densenet121({.num_classes = 0}), ValueError);
  EXPECT_THROW(models::densenet121({.drop_rate = 1.0}), ValueError);
  auto net = std::make_shared<models::DenseNet>(small_densenet_config());
  EXPECT_THROW(net->forward(randn({3, 16, 16})), ShapeError);
}

// ======================= ResNet =======================

TEST(ResNet, Resnet18And50StateDictsHaveTorchvisionKeysInOrder) {
  auto r18 = models::resnet18();
  const NamedTensors sd18 = r18->state_dict();
  ASSERT_EQ(sd18.size(), 122u);
  EXPECT_EQ(keys_of(sd18), torchvision_resnet_keys(false, {2, 2, 2, 2}));
  auto r50 = models::resnet50();
  const NamedTensors sd50 = r50->state_dict();
  ASSERT_EQ(sd50.size(), 320u);
  EXPECT_EQ(keys_of(sd50), torchvision_resnet_keys(true, {3, 4, 6, 3}));

  const StateMap m = state_map(*r50);
  using V = std::vector<int64_t>;
  EXPECT_EQ(entry(m, "conv1.weight").sizes().vec(), (V{64, 3, 7, 7}));
  EXPECT_EQ(entry(m, "layer1.0.conv1.weight").sizes().vec(), (V{64, 64, 1, 1}));
  EXPECT_EQ(entry(m, "layer1.0.downsample.0.weight").sizes().vec(), (V{256, 64, 1, 1}));
  EXPECT_EQ(entry(m, "layer4.2.conv3.weight").sizes().vec(), (V{2048, 512, 1, 1}));
  EXPECT_EQ(entry(m, "fc.weight").sizes().vec(), (V{1000, 2048}));
}

TEST(ResNet, ParameterCountsMatchTorchvision) {
  EXPECT_EQ(count_parameters(*models::resnet18()), 11689512);
  EXPECT_EQ(count_parameters(*models::resnet34()), 21797672);
  EXPECT_EQ(count_parameters(*models::resnet50()), 25557032);
  EXPECT_EQ(count_parameters(*models::resnet101()), 44549160);
  EXPECT_EQ(count_parameters(*models::resnet152()), 60192808);
  EXPECT_EQ(count_parameters(*models::resnext50_32x4d()), 25028904);
  EXPECT_EQ(count_parameters(*models::wide_resnet50_2()), 68883240);
  EXPECT_EQ(count_parameters(*models::resnet18({.num_classes = 10})), 11689512 - 990 * 513);
}

TEST(ResNet, StrideSitsOnTheThreeByThreeConvOfBottleneck) {
  auto net = models::resnet50();
  auto block = net->layer2->at<models::Bottleneck>(0);
  EXPECT_EQ(block->conv1->options.stride[0], 1);
  EXPECT_EQ(block->conv2->options.stride[0], 2);
  EXPECT_EQ(block->downsample->at<nn::Conv2d>(0)->options.stride[0], 2);
  EXPECT_EQ(net->layer2->at<models::Bottleneck>(1)->downsample, nullptr);
}

TEST(ResNet, InitIsKaimingNormalFanOut) {
  manual_seed(4);
  auto net = models::resnet18();
  // layer4.0.conv2: (512, 512, 3, 3), fan_out = 512 * 9.
  const Tensor& w = net->get_parameter("layer4.0.conv2.weight");
  EXPECT_NEAR(std_of(w), std::sqrt(2.0 / (512.0 * 9.0)), 0.02 * std::sqrt(2.0 / (512.0 * 9.0)));
  EXPECT_TRUE(equal(net->get_parameter("layer4.1.bn2.weight"), ones({512})));
  auto zero_init = models::resnet50({.zero_init_residual = true});
  EXPECT_TRUE(equal(zero_init->get_parameter("layer3.5.bn3.weight"), zeros({1024})));
  EXPECT_TRUE(equal(zero_init->get_parameter("layer3.5.bn2.weight"), ones({256})));
}

TEST(ResNet, Resnet18ForwardMatchesFloat64ReferenceInEvalMode) {
  manual_seed(5);
  auto net = models::resnet18({.num_classes = 7});
  randomize_batch_norms(*net);
  net->eval();
  Tensor x = randn({1, 3, 32, 32});
  NoGradGuard no_grad;
  Tensor y = net->forward(x);
  EXPECT_TRUE(matches(y, {1, 7},
                      resnet_ref(img_of(x), state_map(*net), models::ResNetBlock::basic, {2, 2, 2, 2}),
                      kiln::testing::Tolerance{1e-4, 1e-4}));
}

TEST(ResNet, GroupedBottleneckForwardMatchesFloat64ReferenceInEvalMode) {
  manual_seed(6);
  auto net = std::make_shared<models::ResNet>(models::ResNetBlock::bottleneck,
                                              std::array<int64_t, 4>{1, 1, 1, 1},
                                              models::ResNetOptions{.num_classes = 3, .groups = 4,
                                                                    .width_per_group = 8});
  randomize_batch_norms(*net);
  net->eval();
  Tensor x = randn({2, 3, 32, 32});
  NoGradGuard no_grad;
  Tensor y = net->forward(x);
  EXPECT_TRUE(matches(y, {2, 3},
                      resnet_ref(img_of(x), state_map(*net), models::ResNetBlock::bottleneck,
                                 {1, 1, 1, 1}, 4),
                      kiln::testing::Tolerance{1e-4, 1e-4}));
}

TEST(ResNet, Resnet50ForwardShapeOnSmallImages) {
  manual_seed(7);
  auto net = models::resnet50();
  net->eval();
  NoGradGuard no_grad;
  EXPECT_EQ(net->forward(randn({2, 3, 32, 32})).sizes().vec(), (std::vector<int64_t>{2, 1000}));
}

TEST(ResNet, ModulesPrintUnderTorchvisionClassNames) {
  const std::string s = models::resnet18()->str();
  EXPECT_EQ(s.rfind("ResNet(\n  (conv1): Conv2d(3, 64, kernel_size=(7, 7), stride=(2, 2), "
                    "padding=(3, 3), bias=False)",
                    0),
            0u)
      << s;
  EXPECT_NE(s.find("(0): BasicBlock("), std::string::npos);
  EXPECT_NE(s.find("(downsample): Sequential("), std::string::npos);
  EXPECT_NE(models::resnet50()->str().find("(0): Bottleneck("), std::string::npos);
}

TEST(ResNet, BadConfigAndInputThrow) {
  EXPECT_THROW(models::ResNet(models::ResNetBlock::basic, {2, 0, 2, 2}), ValueError);
  EXPECT_THROW(models::ResNet(models::ResNetBlock::basic, {2, 2, 2, 2}, {.groups = 2}), ValueError);
  EXPECT_THROW(models::resnet18({.num_classes = -1}), ValueError);
  EXPECT_THROW(models::resnet18()->forward(randn({3, 32, 32})), ShapeError);
}

// ======================= GPT =======================

TEST(GPT, Gpt2SmallHasNanoGptKeysTiedWeightsAndParameterCount) {
  auto model = models::gpt(models::GPTConfig::gpt2_small());
  EXPECT_EQ(count_parameters(*model), 124439808);
  EXPECT_EQ(model->num_parameters(), 124439808);
  EXPECT_EQ(model->num_parameters(/*non_embedding=*/true), 124439808 - 1024 * 768);
  const NamedTensors sd = model->state_dict();
  EXPECT_EQ(sd.size(), 149u);
  EXPECT_EQ(keys_of(sd), nanogpt_keys(12, true));
  EXPECT_TRUE(model->lm_head->weight.is_alias_of(model->wte->weight));
  EXPECT_TRUE(model->get_parameter("lm_head.weight").same(model->get_parameter("transformer.wte.weight")));
  const StateMap m = state_map(*model);
  using V = std::vector<int64_t>;
  EXPECT_EQ(entry(m, "transformer.wte.weight").sizes().vec(), (V{50257, 768}));
  EXPECT_EQ(entry(m, "transformer.wpe.weight").sizes().vec(), (V{1024, 768}));
  EXPECT_EQ(entry(m, "transformer.h.0.attn.c_attn.weight").sizes().vec(), (V{2304, 768}));
  EXPECT_EQ(entry(m, "transformer.h.11.mlp.c_fc.weight").sizes().vec(), (V{3072, 768}));
  EXPECT_EQ(entry(m, "transformer.h.11.mlp.c_proj.weight").sizes().vec(), (V{768, 3072}));
  // GPT-2's init: N(0, 0.02), residual projections N(0, 0.02 / sqrt(2 * n_layer)).
  EXPECT_NEAR(std_of(entry(m, "transformer.h.3.mlp.c_fc.weight")), 0.02, 0.0005);
  EXPECT_NEAR(std_of(entry(m, "transformer.h.3.mlp.c_proj.weight")), 0.02 / std::sqrt(24.0),
              0.0002);
  EXPECT_NEAR(std_of(entry(m, "transformer.wte.weight")), 0.02, 0.0005);
  EXPECT_TRUE(equal(entry(m, "transformer.h.3.attn.c_attn.bias"), zeros({2304})));
  EXPECT_TRUE(equal(entry(m, "transformer.ln_f.weight"), ones({768})));
}

TEST(GPT, ForwardMatchesFloat64Reference) {
  manual_seed(8);
  for (bool bias : {true, false}) {
    auto cfg = small_gpt_config();
    cfg.bias = bias;
    auto model = models::gpt(cfg);
    EXPECT_EQ(keys_of(model->state_dict()), nanogpt_keys(cfg.n_layer, bias));
    {
      // Non-trivial LayerNorm parameters.
      NoGradGuard no_grad;
      for (const auto& m : model->modules())
        if (auto* ln = m->as<nn::LayerNorm>()) {
          ln->weight.uniform_(0.5, 1.5);
          if (ln->bias.defined()) ln->bias.normal_(0.0, 0.1);
        }
    }
    const int64_t B = 2, T = 7;
    Tensor idx = randint(cfg.vocab_size, {B, T});
    Tensor logits = model->forward(idx);
    EXPECT_TRUE(matches(logits, {B, T, cfg.vocab_size},
                        gpt_ref(idx.to_vector<int64_t>(), B, T, state_map(*model), cfg),
                        kiln::testing::Tolerance{1e-4, 1e-5}))
        << "bias=" << bias;
  }
}

TEST(GPT, EarlierLogitsDoNotDependOnLaterTokens) {
  manual_seed(9);
  auto model = models::gpt(models::GPTConfig::tiny());
  model->eval();
  NoGradGuard no_grad;
  Tensor idx = randint(64, {2, 12});
  Tensor before = model->forward(idx);
  Tensor changed = idx.clone();
  changed.index_put_({Slice(), 8}, remainder(idx.select(1, 8) + 1, 64));
  Tensor after = model->forward(changed);
  EXPECT_TRUE(allclose(before.narrow(1, 0, 8), after.narrow(1, 0, 8), 0.0, 1e-6));
  EXPECT_FALSE(allclose(before.narrow(1, 8, 4), after.narrow(1, 8, 4), 1e-3, 1e-3));
}

TEST(GPT, SequenceLongerThanBlockSizeThrowsShapeError) {
  auto model = models::gpt(small_gpt_config());  // block_size 8
  EXPECT_EQ(model->forward(zeros({1, 8}, kInt64)).sizes().vec(), (std::vector<int64_t>{1, 8, 11}));
  try {
    model->forward(zeros({1, 9}, kInt64));
    FAIL() << "no error";
  } catch (const ShapeError& e) {
    EXPECT_NE(std::string(e.what()).find("Cannot forward sequence of length 9, block size is only 8"),
              std::string::npos)
        << e.what();
  }
  EXPECT_THROW(model->forward(zeros({8}, kInt64)), ShapeError);
  EXPECT_THROW(model->forward(zeros({1, 4})), DTypeError);
  EXPECT_THROW(model->forward(full({1, 4}, 11, kInt64)), IndexError);
  EXPECT_THROW(model->generate(zeros({1, 0}, kInt64), 2), ShapeError);
}

TEST(GPT, LossForwardAndGreedyGenerate) {
  manual_seed(10);
  auto model = models::gpt(small_gpt_config());
  model->eval();
  Tensor idx = randint(11, {3, 5});
  Tensor targets = randint(11, {3, 5});
  auto [logits, loss] = model->forward(idx, targets);
  EXPECT_TRUE(allclose(loss, cross_entropy(logits.reshape({15, 11}), targets.reshape({15}))));
  // Random init: the loss is near log(vocab).
  EXPECT_NEAR(loss.item<double>(), std::log(11.0), 0.3);

  // Greedy decoding past block_size crops the context to the last 8 tokens.
  Tensor out = model->generate(idx.narrow(0, 0, 1), 6);
  ASSERT_EQ(out.sizes().vec(), (std::vector<int64_t>{1, 11}));
  EXPECT_TRUE(equal(out.narrow(1, 0, 5), idx.narrow(0, 0, 1)));
  NoGradGuard no_grad;
  Tensor context = out.narrow(1, 2, 8);  // the last block_size tokens before the final one
  Tensor expected_last = model->forward(context).select(1, -1).argmax(-1);
  EXPECT_EQ(out.select(1, 10).item<int64_t>(), expected_last.item<int64_t>());
}

TEST(GPT, TiedWeightsStayTiedThroughDtypeConversion) {
  manual_seed(18);
  auto model = models::gpt(small_gpt_config());
  Tensor idx = randint(11, {2, 5});
  Tensor before = model->forward(idx);
  model->to(kFloat64);
  EXPECT_TRUE(model->lm_head->weight.is_alias_of(model->wte->weight));
  EXPECT_EQ(model->lm_head->weight.dtype(), kFloat64);
  Tensor after = model->forward(idx);
  EXPECT_EQ(after.dtype(), kFloat64);
  EXPECT_TRUE(allclose(after.to(kFloat32), before, 1e-5, 1e-6));
  EXPECT_THROW(model->forward(idx, randint(11, {2, 4})), ShapeError);
}

TEST(GPT, BadConfigThrowsValueError) {
  EXPECT_THROW(models::gpt({.vocab_size = 10, .block_size = 8, .n_layer = 1, .n_head = 3, .n_embd = 8}),
               ValueError);
  EXPECT_THROW(models::gpt({.vocab_size = 0}), ValueError);
  EXPECT_THROW(models::gpt({.vocab_size = 10, .block_size = 8, .n_layer = 1, .n_head = 2,
                            .n_embd = 8, .dropout = 1.0}),
               ValueError);
}

TEST(GPT, ModulesPrintUnderNanoGptClassNames) {
  const std::string s = models::gpt(small_gpt_config())->str();
  EXPECT_NE(s.find("GPT(\n  (transformer): ModuleDict(\n    (wte): Embedding(11, 8)"),
            std::string::npos)
      << s;
  EXPECT_NE(s.find("(0-1): 2 x Block("), std::string::npos) << s;
  EXPECT_NE(s.find("(attn): CausalSelfAttention("), std::string::npos);
  EXPECT_NE(s.find("(mlp): MLP("), std::string::npos);
  EXPECT_NE(s.find("(gelu): GELU(approximate='tanh')"), std::string::npos);
  EXPECT_NE(s.find("(lm_head): Linear(in_features=8, out_features=11, bias=False)"),
            std::string::npos);
}

// ======================= training =======================

TEST(Training, SmallDenseNetResNetAndGptMemoriseABatchUnderAdam) {
  manual_seed(19);
  auto check = [](nn::Module& model, const Tensor& input, const Tensor& labels,
                  const std::function<Tensor(const Tensor&, const Tensor&)>& loss_fn) {
    optim::Adam optimizer(model.parameters(), {.lr = 1e-2});
    double first = 0, last = 0;
    for (int step = 0; step < 15; ++step) {
      optimizer.zero_grad();
      Tensor loss = loss_fn(model.forward(input), labels);
      loss.backward();
      optimizer.step();
      last = loss.item<double>();
      if (step == 0) first = last;
    }
    for (const Tensor& p : model.parameters()) EXPECT_TRUE(p.grad().defined());
    EXPECT_LT(last, 0.7 * first) << model.name();
  };
  auto ce = [](const Tensor& logits, const Tensor& y) { return cross_entropy(logits, y); };
  auto dense = std::make_shared<models::DenseNet>(small_densenet_config());
  check(*dense, randn({4, 3, 16, 16}), randint(5, {4}), ce);
  auto res = std::make_shared<models::ResNet>(models::ResNetBlock::basic,
                                              std::array<int64_t, 4>{1, 1, 1, 1},
                                              models::ResNetOptions{.num_classes = 5});
  check(*res, randn({4, 3, 32, 32}), randint(5, {4}), ce);
  auto gpt = models::gpt(small_gpt_config());
  Tensor tokens = randint(11, {4, 8});  // learn to echo each token
  check(*gpt, tokens, tokens, [](const Tensor& logits, const Tensor& y) {
    return cross_entropy(logits.reshape({-1, 11}), y.reshape({-1}));
  });
  // Tied weights: one parameter, one gradient (from both the embedding and the head).
  EXPECT_TRUE(gpt->lm_head->weight.grad().same(gpt->wte->weight.grad()));
}

// ======================= save / load round trips =======================

template <class MakeModel>
void expect_round_trip(MakeModel make, const Tensor& input, const std::string& file) {
  manual_seed(11);
  auto source = make();
  randomize_batch_norms(*source);
  source->eval();
  TempFile path(file);
  save_safetensors(path.str(), source->state_dict());

  manual_seed(12);  // different weights
  auto target = make();
  target->eval();
  NoGradGuard no_grad;
  EXPECT_FALSE(equal(source->forward(input), target->forward(input)));
  const auto loaded = load_safetensors(path.str());
  EXPECT_EQ(loaded.size(), source->state_dict().size());
  EXPECT_TRUE(target->load_state_dict(loaded).empty());
  EXPECT_TRUE(equal(source->forward(input), target->forward(input)));
}

TEST(RoundTrip, DenseNetThroughSafetensorsGivesIdenticalOutputs) {
  manual_seed(13);
  expect_round_trip([] { return std::make_shared<models::DenseNet>(small_densenet_config()); },
                    randn({2, 3, 16, 16}), "densenet.safetensors");
}

TEST(RoundTrip, Densenet121ThroughSafetensorsGivesIdenticalOutputs) {
  manual_seed(14);
  expect_round_trip([] { return models::densenet121({.num_classes = 10}); }, randn({1, 3, 32, 32}),
                    "densenet121.safetensors");
}

TEST(RoundTrip, Resnet18ThroughSafetensorsGivesIdenticalOutputs) {
  manual_seed(15);
  expect_round_trip([] { return models::resnet18({.num_classes = 10}); }, randn({1, 3, 32, 32}),
                    "resnet18.safetensors");
}

TEST(RoundTrip, TiedGptThroughSafetensorsGivesIdenticalOutputsAndStaysTied) {
  manual_seed(16);
  std::shared_ptr<models::GPT> target;
  expect_round_trip(
      [&] {
        target = models::gpt(models::GPTConfig::tiny());
        return target;
      },
      randint(64, {2, 10}), "gpt.safetensors");
  EXPECT_TRUE(target->lm_head->weight.is_alias_of(target->wte->weight));
}

// ======================= mlp =======================

TEST(Mlp, BuildsLinearActivationStackWithSequentialKeys) {
  manual_seed(17);
  auto net = models::mlp({4, 6, 5, 3});
  EXPECT_EQ(keys_of(net->state_dict()),
            (Names{"0.weight", "0.bias", "2.weight", "2.bias", "4.weight", "4.bias"}));
  EXPECT_EQ(net->size(), 5u);
  EXPECT_NE(net->at<nn::ReLU>(1), nullptr);
  EXPECT_EQ(net->at<nn::Linear>(4)->weight.sizes().vec(), (std::vector<int64_t>{3, 5}));
  EXPECT_EQ(count_parameters(*net), 4 * 6 + 6 + 6 * 5 + 5 + 5 * 3 + 3);

  // Forward against a float64 reference.
  Tensor x = randn({2, 4});
  const StateMap sd = state_map(*net);
  auto h = linear_ref(values(x), 2, sd, "0");
  for (double& v : h) v = std::max(v, 0.0);
  h = linear_ref(h, 2, sd, "2");
  for (double& v : h) v = std::max(v, 0.0);
  EXPECT_TRUE(matches(net->forward(x), {2, 3}, linear_ref(h, 2, sd, "4")));

  auto tanh_net = models::mlp({3, 2}, "tanh", /*bias=*/false);
  EXPECT_EQ(keys_of(tanh_net->state_dict()), (Names{"0.weight"}));
  EXPECT_NE(models::mlp({3, 4, 2}, "gelu")->at<nn::GELU>(1), nullptr);
}

TEST(Mlp, BadArgumentsThrowValueError) {
  EXPECT_THROW(models::mlp({4}), ValueError);
  EXPECT_THROW(models::mlp({4, 0, 2}), ValueError);
  EXPECT_THROW(models::mlp({4, 2}, "swish"), ValueError);
}

}  // namespace
