// ResNet as torchvision.models.resnet builds it (v1.5: the stride sits on the 3x3 conv of
// Bottleneck), with its module tree, key names, forward and init.
#include <string>

#include "kiln/models.h"
#include "kiln/nn/functional.h"
#include "kiln/nn/init.h"
#include "kiln/ops.h"

namespace kiln::models {

namespace {

std::shared_ptr<nn::Conv2d> conv3x3(int64_t in_planes, int64_t out_planes, int64_t stride = 1,
                                    int64_t groups = 1) {
  return std::make_shared<nn::Conv2d>(nn::Conv2dOptions{.in_channels = in_planes,
                                                        .out_channels = out_planes,
                                                        .kernel_size = 3,
                                                        .stride = stride,
                                                        .padding = 1,
                                                        .groups = groups,
                                                        .bias = false});
}

std::shared_ptr<nn::Conv2d> conv1x1(int64_t in_planes, int64_t out_planes, int64_t stride = 1) {
  return std::make_shared<nn::Conv2d>(nn::Conv2dOptions{.in_channels = in_planes,
                                                        .out_channels = out_planes,
                                                        .kernel_size = 1,
                                                        .stride = stride,
                                                        .bias = false});
}

// out += shortcut; relu(out) — torchvision's in-place tail of both blocks.
Tensor residual_tail(Tensor out, const Tensor& identity, nn::ReLU& relu) {
  out.add_(identity);
  return relu.forward(out);
}

}  // namespace

// ---- BasicBlock ----

BasicBlock::BasicBlock(int64_t inplanes, int64_t planes, int64_t stride_,
                       std::shared_ptr<nn::Sequential> downsample_, int64_t groups,
                       int64_t base_width)
    : stride(stride_) {
  KILN_CHECK(groups == 1 && base_width == 64, ValueError,
             "[kiln::models::BasicBlock] BasicBlock only supports groups=1 and base_width=64, but "
             "got groups=" +
                 std::to_string(groups) + ", base_width=" + std::to_string(base_width) +
                 ". Use Bottleneck for grouped or wide blocks.");
  conv1 = register_module("conv1", conv3x3(inplanes, planes, stride));
  bn1 = register_module("bn1", std::make_shared<nn::BatchNorm2d>(planes));
  relu = register_module("relu", std::make_shared<nn::ReLU>(true));
  conv2 = register_module("conv2", conv3x3(planes, planes));
  bn2 = register_module("bn2", std::make_shared<nn::BatchNorm2d>(planes));
  // PyTorch keeps a None downsample as a plain attribute, not a child: register only a real one.
  if (downsample_) downsample = register_module("downsample", std::move(downsample_));
}

Tensor BasicBlock::forward(const Tensor& x) {
  Tensor out = relu->forward(bn1->forward(conv1->forward(x)));
  out = bn2->forward(conv2->forward(out));
  const Tensor identity = downsample ? downsample->forward(x) : x;
  return residual_tail(std::move(out), identity, *relu);
}

// ---- Bottleneck ----

Bottleneck::Bottleneck(int64_t inplanes, int64_t planes, int64_t stride_,
                       std::shared_ptr<nn::Sequential> downsample_, int64_t groups,
                       int64_t base_width)
    : stride(stride_) {
  // int(planes * (base_width / 64.0)) * groups, in integers.
  const int64_t width = planes * base_width / 64 * groups;
  conv1 = register_module("conv1", conv1x1(inplanes, width));
  bn1 = register_module("bn1", std::make_shared<nn::BatchNorm2d>(width));
  conv2 = register_module("conv2", conv3x3(width, width, stride, groups));
  bn2 = register_module("bn2", std::make_shared<nn::BatchNorm2d>(width));
  conv3 = register_module("conv3", conv1x1(width, planes * expansion));
  bn3 = register_module("bn3", std::make_shared<nn::BatchNorm2d>(planes * expansion));
  relu = register_module("relu", std::make_shared<nn::ReLU>(true));
  if (downsample_) downsample = register_module("downsample", std::move(downsample_));
}

Tensor Bottleneck::forward(const Tensor& x) {
  Tensor out = relu->forward(bn1->forward(conv1->forward(x)));
  out = relu->forward(bn2->forward(conv2->forward(out)));
  out = bn3->forward(conv3->forward(out));
  const Tensor identity = downsample ? downsample->forward(x) : x;
  return residual_tail(std::move(out), identity, *relu);
}

// ---- ResNet ----

ResNet::ResNet(ResNetBlock block_, std::array<int64_t, 4> layers_, const ResNetOptions& options_)
    : block(block_), layers(layers_), options(options_) {
  const std::string tag = "[kiln::models::ResNet] ";
  for (int64_t n : layers)
    KILN_CHECK(n > 0, ValueError,
               tag + "every stage needs at least one block, but got " + std::to_string(n) + ".");
  KILN_CHECK(options.num_classes > 0, ValueError,
             tag + "num_classes must be positive, but got " + std::to_string(options.num_classes) +
                 ".");
  KILN_CHECK(options.groups > 0 && options.width_per_group > 0, ValueError,
             tag + "groups and width_per_group must be positive, but got " +
                 std::to_string(options.groups) + " and " +
                 std::to_string(options.width_per_group) + ".");
  KILN_CHECK(block == ResNetBlock::bottleneck ||
                 (options.groups == 1 && options.width_per_group == 64),
             ValueError,
             tag + "BasicBlock only supports groups=1 and width_per_group=64. Use "
                   "ResNetBlock::bottleneck for grouped or wide blocks.");

  conv1 = register_module("conv1", std::make_shared<nn::Conv2d>(nn::Conv2dOptions{
                                       .in_channels = 3,
                                       .out_channels = inplanes_,
                                       .kernel_size = 7,
                                       .stride = 2,
                                       .padding = 3,
                                       .bias = false}));
  bn1 = register_module("bn1", std::make_shared<nn::BatchNorm2d>(inplanes_));
  relu = register_module("relu", std::make_shared<nn::ReLU>(true));
  maxpool = register_module("maxpool", std::make_shared<nn::MaxPool2d>(3, 2, 1));
  layer1 = register_module("layer1", make_layer(64, layers[0], 1));
  layer2 = register_module("layer2", make_layer(128, layers[1], 2));
  layer3 = register_module("layer3", make_layer(256, layers[2], 2));
  layer4 = register_module("layer4", make_layer(512, layers[3], 2));
  avgpool = register_module("avgpool", std::make_shared<nn::AdaptiveAvgPool2d>(nn::Size2(1, 1)));
  const int64_t expansion = block == ResNetBlock::basic ? BasicBlock::expansion
                                                        : Bottleneck::expansion;
  fc = register_module("fc", std::make_shared<nn::Linear>(512 * expansion, options.num_classes));

  for (const auto& m : modules()) {
    if (auto* c = m->as<nn::Conv2d>()) {
      nn::init::kaiming_normal_(c->weight, 0.0, "fan_out", "relu");
    } else if (auto* bn = m->as<nn::BatchNorm2d>()) {
      nn::init::constant_(bn->weight, 1.0);
      nn::init::constant_(bn->bias, 0.0);
    }
  }
  if (options.zero_init_residual) {
    for (const auto& m : modules()) {
      if (auto* b = m->as<Bottleneck>()) nn::init::constant_(b->bn3->weight, 0.0);
      if (auto* b = m->as<BasicBlock>()) nn::init::constant_(b->bn2->weight, 0.0);
    }
  }
}

std::shared_ptr<nn::Sequential> ResNet::make_layer(int64_t planes, int64_t blocks,
                                                   int64_t stride) {
  const int64_t expansion = block == ResNetBlock::basic ? BasicBlock::expansion
                                                        : Bottleneck::expansion;
  auto make_block = [&](int64_t stride_, std::shared_ptr<nn::Sequential> downsample) {
    if (block == ResNetBlock::basic)
      return nn::ModulePtr(std::make_shared<BasicBlock>(inplanes_, planes, stride_,
                                                        std::move(downsample)));
    return nn::ModulePtr(std::make_shared<Bottleneck>(inplanes_, planes, stride_,
                                                      std::move(downsample), options.groups,
                                                      options.width_per_group));
  };
  std::shared_ptr<nn::Sequential> downsample;
  if (stride != 1 || inplanes_ != planes * expansion) {
    downsample = std::make_shared<nn::Sequential>(
        conv1x1(inplanes_, planes * expansion, stride),
        std::make_shared<nn::BatchNorm2d>(planes * expansion));
  }
  auto layer = std::make_shared<nn::Sequential>();
  layer->push_back(make_block(stride, std::move(downsample)));
  inplanes_ = planes * expansion;
  for (int64_t i = 1; i < blocks; ++i) layer->push_back(make_block(1, nullptr));
  return layer;
}

Tensor ResNet::forward(const Tensor& x) {
  KILN_CHECK(x.dim() == 4, ShapeError,
             "[kiln::models::ResNet] expected a batch of images (N, 3, H, W), but got a " +
                 std::to_string(x.dim()) + "-D input. Add a batch dim with unsqueeze(0).");
  Tensor out = maxpool->forward(relu->forward(bn1->forward(conv1->forward(x))));
  out = layer1->forward(out);
  out = layer2->forward(out);
  out = layer3->forward(out);
  out = layer4->forward(out);
  out = avgpool->forward(out).flatten(1);
  return fc->forward(out);
}

std::shared_ptr<ResNet> resnet18(const ResNetOptions& options) {
  return std::make_shared<ResNet>(ResNetBlock::basic, std::array<int64_t, 4>{2, 2, 2, 2}, options);
}
std::shared_ptr<ResNet> resnet34(const ResNetOptions& options) {
  return std::make_shared<ResNet>(ResNetBlock::basic, std::array<int64_t, 4>{3, 4, 6, 3}, options);
}
std::shared_ptr<ResNet> resnet50(const ResNetOptions& options) {
  return std::make_shared<ResNet>(ResNetBlock::bottleneck, std::array<int64_t, 4>{3, 4, 6, 3},
                                  options);
}
std::shared_ptr<ResNet> resnet101(const ResNetOptions& options) {
  return std::make_shared<ResNet>(ResNetBlock::bottleneck, std::array<int64_t, 4>{3, 4, 23, 3},
                                  options);
}
std::shared_ptr<ResNet> resnet152(const ResNetOptions& options) {
  return std::make_shared<ResNet>(ResNetBlock::bottleneck, std::array<int64_t, 4>{3, 8, 36, 3},
                                  options);
}
std::shared_ptr<ResNet> resnext50_32x4d(ResNetOptions options) {
  options.groups = 32;
  options.width_per_group = 4;
  return resnet50(options);
}
std::shared_ptr<ResNet> wide_resnet50_2(ResNetOptions options) {
  options.width_per_group = 64 * 2;
  return resnet50(options);
}

}  // namespace kiln::models
