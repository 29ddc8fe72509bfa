// DenseNet as torchvision.models.densenet builds it (module tree, key names, forward, init).
#include <string>

#include "kiln/autograd.h"
#include "kiln/models.h"
#include "kiln/nn/functional.h"
#include "kiln/nn/init.h"
#include "kiln/ops.h"

namespace kiln::models {

namespace F = nn::functional;

namespace {

void check_config(const DenseNetConfig& c) {
  const std::string tag = "[kiln::models::DenseNet] ";
  KILN_CHECK(c.growth_rate > 0 && c.num_init_features > 0 && c.bn_size > 0, ValueError,
             tag + "growth_rate, num_init_features and bn_size must be positive, but got " +
                 std::to_string(c.growth_rate) + ", " + std::to_string(c.num_init_features) +
                 " and " + std::to_string(c.bn_size) + ".");
  KILN_CHECK(!c.block_config.empty(), ValueError,
             tag + "block_config must list at least one dense block.");
  for (int64_t n : c.block_config)
    KILN_CHECK(n > 0, ValueError,
               tag + "every block in block_config needs at least one layer, but got " +
                   std::to_string(n) + ".");
  KILN_CHECK(c.drop_rate >= 0.0 && c.drop_rate < 1.0, ValueError,
             tag + "drop_rate must be in [0, 1), but got " + std::to_string(c.drop_rate) + ".");
  KILN_CHECK(c.num_classes > 0, ValueError,
             tag + "num_classes must be positive, but got " + std::to_string(c.num_classes) + ".");
}

std::shared_ptr<nn::Conv2d> conv(int64_t in, int64_t out, int64_t kernel, int64_t stride,
                                 int64_t padding) {
  return std::make_shared<nn::Conv2d>(nn::Conv2dOptions{.in_channels = in,
                                                        .out_channels = out,
                                                        .kernel_size = kernel,
                                                        .stride = stride,
                                                        .padding = padding,
                                                        .bias = false});
}

std::shared_ptr<DenseNet> make_densenet(int64_t growth_rate, std::vector<int64_t> block_config,
                                        int64_t num_init_features,
                                        const DenseNetOptions& options) {
  return std::make_shared<DenseNet>(DenseNetConfig{.growth_rate = growth_rate,
                                                   .block_config = std::move(block_config),
                                                   .num_init_features = num_init_features,
                                                   .bn_size = 4,
                                                   .drop_rate = options.drop_rate,
                                                   .num_classes = options.num_classes});
}

}  // namespace

// ---- _DenseLayer ----

DenseLayer::DenseLayer(int64_t num_input_features, int64_t growth_rate, int64_t bn_size,
                       double drop_rate_)
    : drop_rate(drop_rate_) {
  norm1 = register_module("norm1", std::make_shared<nn::BatchNorm2d>(num_input_features));
  relu1 = register_module("relu1", std::make_shared<nn::ReLU>(true));
  conv1 = register_module("conv1", conv(num_input_features, bn_size * growth_rate, 1, 1, 0));
  norm2 = register_module("norm2", std::make_shared<nn::BatchNorm2d>(bn_size * growth_rate));
  relu2 = register_module("relu2", std::make_shared<nn::ReLU>(true));
  conv2 = register_module("conv2", conv(bn_size * growth_rate, growth_rate, 3, 1, 1));
}

Tensor DenseLayer::forward(const TensorList& prev_features) {
  Tensor concated = cat(prev_features, 1);
  Tensor bottleneck = conv1->forward(relu1->forward(norm1->forward(concated)));
  Tensor out = conv2->forward(relu2->forward(norm2->forward(bottleneck)));
  if (drop_rate > 0) out = F::dropout(out, drop_rate, is_training());
  return out;
}

Tensor DenseLayer::forward(const Tensor& input) {
  return forward(TensorList{input});
}

// ---- _DenseBlock ----

DenseBlock::DenseBlock(int64_t num_layers, int64_t num_input_features, int64_t bn_size,
                       int64_t growth_rate, double drop_rate) {
  for (int64_t i = 0; i < num_layers; ++i) {
    layers.push_back(insert(
        "denselayer" + std::to_string(i + 1),
        std::make_shared<DenseLayer>(num_input_features + i * growth_rate, growth_rate, bn_size,
                                     drop_rate)));
  }
}

Tensor DenseBlock::forward(const Tensor& init_features) {
  TensorList features{init_features};
  features.reserve(layers.size() + 1);
  for (const auto& layer : layers) features.push_back(layer->forward(features));
  return cat(features, 1);
}

// ---- _Transition ----

Transition::Transition(int64_t num_input_features, int64_t num_output_features)
    : nn::Sequential(nn::NamedModules{
          {"norm", std::make_shared<nn::BatchNorm2d>(num_input_features)},
          {"relu", std::make_shared<nn::ReLU>(true)},
          {"conv", conv(num_input_features, num_output_features, 1, 1, 0)},
          {"pool", std::make_shared<nn::AvgPool2d>(2, 2)},
      }) {}

// ---- DenseNet ----

DenseNet::DenseNet(const DenseNetConfig& config_) : config(config_) {
  check_config(config);
  features = register_module(
      "features",
      std::make_shared<nn::Sequential>(nn::NamedModules{
          {"conv0", conv(3, config.num_init_features, 7, 2, 3)},
          {"norm0", std::make_shared<nn::BatchNorm2d>(config.num_init_features)},
          {"relu0", std::make_shared<nn::ReLU>(true)},
          {"pool0", std::make_shared<nn::MaxPool2d>(3, 2, 1)},
      }));
  int64_t num_features = config.num_init_features;
  const size_t num_blocks = config.block_config.size();
  for (size_t i = 0; i < num_blocks; ++i) {
    const int64_t num_layers = config.block_config[i];
    features->register_module("denseblock" + std::to_string(i + 1),
                              std::make_shared<DenseBlock>(num_layers, num_features,
                                                           config.bn_size, config.growth_rate,
                                                           config.drop_rate));
    num_features += num_layers * config.growth_rate;
    if (i + 1 != num_blocks) {
      features->register_module("transition" + std::to_string(i + 1),
                                std::make_shared<Transition>(num_features, num_features / 2));
      num_features /= 2;
    }
  }
  features->register_module("norm5", std::make_shared<nn::BatchNorm2d>(num_features));
  classifier = register_module("classifier",
                               std::make_shared<nn::Linear>(num_features, config.num_classes));

  for (const auto& m : modules()) {
    if (auto* c = m->as<nn::Conv2d>()) {
      nn::init::kaiming_normal_(c->weight);
    } else if (auto* bn = m->as<nn::BatchNorm2d>()) {
      nn::init::constant_(bn->weight, 1.0);
      nn::init::constant_(bn->bias, 0.0);
    } else if (auto* fc = m->as<nn::Linear>()) {
      nn::init::constant_(fc->bias, 0.0);
    }
  }
}

Tensor DenseNet::forward(const Tensor& x) {
  KILN_CHECK(x.dim() == 4, ShapeError,
             "[kiln::models::DenseNet] expected a batch of images (N, 3, H, W), but got a " +
                 std::to_string(x.dim()) + "-D input. Add a batch dim with unsqueeze(0).");
  Tensor out = features->forward(x);
  out = F::relu(out);
  out = F::adaptive_avg_pool2d(out, {1, 1});
  out = out.flatten(1);
  return classifier->forward(out);
}

std::shared_ptr<DenseNet> densenet121(const DenseNetOptions& options) {
  return make_densenet(32, {6, 12, 24, 16}, 64, options);
}
std::shared_ptr<DenseNet> densenet161(const DenseNetOptions& options) {
  return make_densenet(48, {6, 12, 36, 24}, 96, options);
}
std::shared_ptr<DenseNet> densenet169(const DenseNetOptions& options) {
  return make_densenet(32, {6, 12, 32, 32}, 64, options);
}
std::shared_ptr<DenseNet> densenet201(const DenseNetOptions& options) {
  return make_densenet(32, {6, 12, 48, 32}, 64, options);
}

}  // namespace kiln::models
