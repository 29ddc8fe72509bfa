// kiln::models — a model zoo with the module structure, state_dict key names, forward and
// initialisation of the reference implementations, so that their checkpoints load as they are:
//   - DenseNet-121/161/169/201 and ResNet-18/34/50/101/152, ResNeXt-50 32x4d, Wide ResNet-50-2
//     as in torchvision.models (no pretrained weights are bundled; load a converted
//     safetensors file with load_state_dict);
//   - GPT, a GPT-2-style decoder as in nanoGPT (key names of its model.py);
//   - mlp(), a Linear / activation stack.
//
//   auto net = models::densenet121({.num_classes = 10});
//   net->eval();
//   Tensor logits = net->forward(randn({1, 3, 224, 224}));   // (1, 10)
//   net->load_state_dict(load_safetensors("densenet121.safetensors"));
//
// Class names print as the reference's (`_DenseLayer`, `Bottleneck`, `Block`). Semantics and
// examples: docs/models.md.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "kiln/nn/modules.h"
#include "kiln/tensor.h"

namespace kiln::models {

// ======================= DenseNet (torchvision.models.densenet) =======================

// The full architecture. densenet121() etc. fill in the first four fields.
struct DenseNetConfig {
  int64_t growth_rate = 32;                         // channels each dense layer adds
  std::vector<int64_t> block_config = {6, 12, 24, 16};  // dense layers per block
  int64_t num_init_features = 64;                   // channels of conv0
  int64_t bn_size = 4;                              // bottleneck width: bn_size * growth_rate
  double drop_rate = 0.0;                           // dropout after each dense layer (training)
  int64_t num_classes = 1000;
};

// What the named constructors (densenet121, ...) let a caller choose.
struct DenseNetOptions {
  int64_t num_classes = 1000;
  double drop_rate = 0.0;
};

// torchvision's _DenseLayer: norm1 -> relu1 -> conv1 (1x1, bn_size * growth_rate channels) ->
// norm2 -> relu2 -> conv2 (3x3, growth_rate channels) [-> dropout], applied to the channel-wise
// concatenation of every earlier feature map of its block.
class DenseLayer : public nn::Module {
 public:
  DenseLayer(int64_t num_input_features, int64_t growth_rate, int64_t bn_size, double drop_rate);
  // The new features (N, growth_rate, H, W) from the feature maps so far (concatenated on dim 1).
  Tensor forward(const TensorList& prev_features);
  Tensor forward(const Tensor& input) override;
  std::string name() const override { return "_DenseLayer"; }

  std::shared_ptr<nn::BatchNorm2d> norm1;
  std::shared_ptr<nn::ReLU> relu1;
  std::shared_ptr<nn::Conv2d> conv1;
  std::shared_ptr<nn::BatchNorm2d> norm2;
  std::shared_ptr<nn::ReLU> relu2;
  std::shared_ptr<nn::Conv2d> conv2;
  double drop_rate;
};

// torchvision's _DenseBlock (a ModuleDict of denselayer1, denselayer2, ...): returns its input
// and every layer's new features concatenated on dim 1.
class DenseBlock : public nn::ModuleDict {
 public:
  DenseBlock(int64_t num_layers, int64_t num_input_features, int64_t bn_size, int64_t growth_rate,
             double drop_rate);
  Tensor forward(const Tensor& init_features) override;
  std::string name() const override { return "_DenseBlock"; }

  std::vector<std::shared_ptr<DenseLayer>> layers;
};

// torchvision's _Transition (a Sequential): norm -> relu -> conv (1x1) -> pool (2x2 average).
class Transition : public nn::Sequential {
 public:
  Transition(int64_t num_input_features, int64_t num_output_features);
  std::string name() const override { return "_Transition"; }
};

// features (conv0, norm0, relu0, pool0, denseblock1, transition1, ..., denseblock4, norm5) ->
// relu -> adaptive_avg_pool2d to 1x1 -> flatten -> classifier.
// Init: kaiming_normal_ conv weights, BatchNorm weight 1 / bias 0, classifier bias 0 (its weight
// keeps Linear's default).
class DenseNet : public nn::Module {
 public:
  explicit DenseNet(const DenseNetConfig& config = {});
  // (N, 3, H, W) -> (N, num_classes) logits.
  Tensor forward(const Tensor& x) override;

  DenseNetConfig config;
  std::shared_ptr<nn::Sequential> features;
  std::shared_ptr<nn::Linear> classifier;
};

// growth 32, blocks (6, 12, 24, 16), 64 initial features: 7,978,856 parameters (1000 classes).
std::shared_ptr<DenseNet> densenet121(const DenseNetOptions& options = {});
// growth 48, blocks (6, 12, 36, 24), 96 initial features: 28,681,000 parameters.
std::shared_ptr<DenseNet> densenet161(const DenseNetOptions& options = {});
// growth 32, blocks (6, 12, 32, 32), 64 initial features: 14,149,480 parameters.
std::shared_ptr<DenseNet> densenet169(const DenseNetOptions& options = {});
// growth 32, blocks (6, 12, 48, 32), 64 initial features: 20,013,928 parameters.
std::shared_ptr<DenseNet> densenet201(const DenseNetOptions& options = {});

// ======================= ResNet (torchvision.models.resnet) =======================

enum class ResNetBlock { basic, bottleneck };

struct ResNetOptions {
  int64_t num_classes = 1000;
  // Zero the last BatchNorm weight of each residual branch, so every block starts as the identity.
  bool zero_init_residual = false;
  int64_t groups = 1;            // grouped 3x3 convolutions in Bottleneck (ResNeXt)
  int64_t width_per_group = 64;  // Bottleneck width = planes * width_per_group / 64 * groups
};

// conv1 (3x3, stride) -> bn1 -> relu -> conv2 (3x3) -> bn2, plus the shortcut (downsample(x) or
// x), then relu. expansion 1.
class BasicBlock : public nn::Module {
 public:
  static constexpr int64_t expansion = 1;
  BasicBlock(int64_t inplanes, int64_t planes, int64_t stride = 1,
             std::shared_ptr<nn::Sequential> downsample = nullptr, int64_t groups = 1,
             int64_t base_width = 64);
  Tensor forward(const Tensor& x) override;

  std::shared_ptr<nn::Conv2d> conv1;
  std::shared_ptr<nn::BatchNorm2d> bn1;
  std::shared_ptr<nn::ReLU> relu;
  std::shared_ptr<nn::Conv2d> conv2;
  std::shared_ptr<nn::BatchNorm2d> bn2;
  std::shared_ptr<nn::Sequential> downsample;  // null when the shortcut is the identity
  int64_t stride;
};

// conv1 (1x1) -> bn1 -> relu -> conv2 (3x3, stride: ResNet v1.5) -> bn2 -> relu -> conv3 (1x1,
// planes * 4) -> bn3, plus the shortcut, then relu. expansion 4.
class Bottleneck : public nn::Module {
 public:
  static constexpr int64_t expansion = 4;
  Bottleneck(int64_t inplanes, int64_t planes, int64_t stride = 1,
             std::shared_ptr<nn::Sequential> downsample = nullptr, int64_t groups = 1,
             int64_t base_width = 64);
  Tensor forward(const Tensor& x) override;

  std::shared_ptr<nn::Conv2d> conv1;
  std::shared_ptr<nn::BatchNorm2d> bn1;
  std::shared_ptr<nn::Conv2d> conv2;
  std::shared_ptr<nn::BatchNorm2d> bn2;
  std::shared_ptr<nn::Conv2d> conv3;
  std::shared_ptr<nn::BatchNorm2d> bn3;
  std::shared_ptr<nn::ReLU> relu;
  std::shared_ptr<nn::Sequential> downsample;  // null when the shortcut is the identity
  int64_t stride;
};

// conv1 (7x7, stride 2) -> bn1 -> relu -> maxpool (3x3, stride 2) -> layer1..layer4 (Sequentials
// of blocks; layer2..4 halve the resolution in their first block) -> avgpool (1x1) -> flatten ->
// fc. A block's shortcut is downsample = Sequential(conv 1x1 with stride, BatchNorm2d) when the
// shape changes.
// Init: kaiming_normal_(mode fan_out, relu) conv weights, BatchNorm weight 1 / bias 0, fc keeps
// Linear's default.
class ResNet : public nn::Module {
 public:
  ResNet(ResNetBlock block, std::array<int64_t, 4> layers, const ResNetOptions& options = {});
  // (N, 3, H, W) -> (N, num_classes) logits.
  Tensor forward(const Tensor& x) override;

  ResNetBlock block;
  std::array<int64_t, 4> layers;
  ResNetOptions options;
  std::shared_ptr<nn::Conv2d> conv1;
  std::shared_ptr<nn::BatchNorm2d> bn1;
  std::shared_ptr<nn::ReLU> relu;
  std::shared_ptr<nn::MaxPool2d> maxpool;
  std::shared_ptr<nn::Sequential> layer1, layer2, layer3, layer4;
  std::shared_ptr<nn::AdaptiveAvgPool2d> avgpool;
  std::shared_ptr<nn::Linear> fc;

 private:
  std::shared_ptr<nn::Sequential> make_layer(int64_t planes, int64_t blocks, int64_t stride);
  int64_t inplanes_ = 64;
};

// BasicBlock (2, 2, 2, 2): 11,689,512 parameters (1000 classes).
std::shared_ptr<ResNet> resnet18(const ResNetOptions& options = {});
// BasicBlock (3, 4, 6, 3): 21,797,672 parameters.
std::shared_ptr<ResNet> resnet34(const ResNetOptions& options = {});
// Bottleneck (3, 4, 6, 3): 25,557,032 parameters.
std::shared_ptr<ResNet> resnet50(const ResNetOptions& options = {});
// Bottleneck (3, 4, 23, 3): 44,549,160 parameters.
std::shared_ptr<ResNet> resnet101(const ResNetOptions& options = {});
// Bottleneck (3, 8, 36, 3): 60,192,808 parameters.
std::shared_ptr<ResNet> resnet152(const ResNetOptions& options = {});
// Bottleneck (3, 4, 6, 3), 32 groups of width 4 (options.groups / width_per_group are set):
// 25,028,904 parameters.
std::shared_ptr<ResNet> resnext50_32x4d(ResNetOptions options = {});
// Bottleneck (3, 4, 6, 3), twice as wide inside each block (width_per_group 128):
// 68,883,240 parameters.
std::shared_ptr<ResNet> wide_resnet50_2(ResNetOptions options = {});

// ======================= GPT (nanoGPT's model.py) =======================

struct GPTConfig {
  int64_t vocab_size = 50257;
  int64_t block_size = 1024;  // the longest sequence (context) the model accepts
  int64_t n_layer = 12;
  int64_t n_head = 12;
  int64_t n_embd = 768;  // a multiple of n_head
  double dropout = 0.0;  // on embeddings, attention weights and residual branches (training)
  bool bias = true;      // biases in the Linears and LayerNorms

  // GPT-2 (124M): 50257, 1024, 12, 12, 768 — 124,439,808 parameters (wte tied with lm_head).
  static GPTConfig gpt2_small() { return {50257, 1024, 12, 12, 768, 0.0, true}; }
  static GPTConfig gpt2_medium() { return {50257, 1024, 24, 16, 1024, 0.0, true}; }  // 350M
  static GPTConfig gpt2_large() { return {50257, 1024, 36, 20, 1280, 0.0, true}; }   // 774M
  static GPTConfig gpt2_xl() { return {50257, 1024, 48, 25, 1600, 0.0, true}; }      // 1558M
  // A toy model for tests and examples: vocab 64, context 32, 2 layers, 2 heads, 32 channels.
  static GPTConfig tiny() { return {64, 32, 2, 2, 32, 0.0, true}; }
};

// Multi-head causal self-attention: c_attn (n_embd -> 3 * n_embd: q, k, v) -> per-head
// scaled_dot_product_attention(is_causal = true) -> c_proj -> resid_dropout.
class CausalSelfAttention : public nn::Module {
 public:
  explicit CausalSelfAttention(const GPTConfig& config);
  // (B, T, n_embd) -> (B, T, n_embd).
  Tensor forward(const Tensor& x) override;

  std::shared_ptr<nn::Linear> c_attn;
  std::shared_ptr<nn::Linear> c_proj;
  std::shared_ptr<nn::Dropout> attn_dropout;  // applied inside attention (dropout_p)
  std::shared_ptr<nn::Dropout> resid_dropout;
  int64_t n_head, n_embd;
  double dropout;
};

// nanoGPT's MLP: c_fc (n_embd -> 4 * n_embd) -> gelu (tanh approximation) -> c_proj -> dropout.
class GPTMLP : public nn::Module {
 public:
  explicit GPTMLP(const GPTConfig& config);
  Tensor forward(const Tensor& x) override;
  std::string name() const override { return "MLP"; }

  std::shared_ptr<nn::Linear> c_fc;
  std::shared_ptr<nn::GELU> gelu;
  std::shared_ptr<nn::Linear> c_proj;
  std::shared_ptr<nn::Dropout> dropout;
};

// A pre-LayerNorm transformer block: x + attn(ln_1(x)), then x + mlp(ln_2(x)).
class GPTBlock : public nn::Module {
 public:
  explicit GPTBlock(const GPTConfig& config);
  Tensor forward(const Tensor& x) override;
  std::string name() const override { return "Block"; }

  std::shared_ptr<nn::LayerNorm> ln_1;
  std::shared_ptr<CausalSelfAttention> attn;
  std::shared_ptr<nn::LayerNorm> ln_2;
  std::shared_ptr<GPTMLP> mlp;
};

// transformer (ModuleDict: wte, wpe, drop, h (ModuleList of blocks), ln_f) and lm_head (no bias),
// whose weight IS transformer.wte.weight (tied: one tensor, counted once by parameters(), listed
// under both names by state_dict()).
// Init (GPT-2's): every Linear and Embedding weight N(0, 0.02), Linear biases 0, and the
// c_proj weights (the residual projections) N(0, 0.02 / sqrt(2 * n_layer)).
class GPT : public nn::Module {
 public:
  // Throws ValueError for a non-positive size or n_embd not divisible by n_head, or a dropout
  // outside [0, 1).
  explicit GPT(const GPTConfig& config);

  // idx: int64 (or int32) token ids (B, T) with T <= block_size -> logits (B, T, vocab_size).
  // Throws ShapeError when idx is not 2-D or T exceeds block_size, DTypeError for a non-integer
  // idx, IndexError for a token id outside [0, vocab_size).
  Tensor forward(const Tensor& idx) override;
  // (logits, loss): loss = cross_entropy over every position, targets (B, T) int64, target -1
  // ignored (nanoGPT's forward(idx, targets)).
  std::tuple<Tensor, Tensor> forward(const Tensor& idx, const Tensor& targets);
  // Greedy decoding: appends max_new_tokens tokens to idx (B, T), each the argmax of the logits at
  // the last position, feeding at most the last block_size tokens. Runs under no-grad.
  Tensor generate(const Tensor& idx, int64_t max_new_tokens);
  // Parameters counted once (tied weights once); without the position embeddings when
  // non_embedding, like nanoGPT's get_num_params.
  int64_t num_parameters(bool non_embedding = false) const;

  GPTConfig config;
  std::shared_ptr<nn::ModuleDict> transformer;
  std::shared_ptr<nn::Embedding> wte;  // transformer.wte
  std::shared_ptr<nn::Embedding> wpe;  // transformer.wpe
  std::shared_ptr<nn::Dropout> drop;   // transformer.drop
  std::shared_ptr<nn::ModuleList> h;   // transformer.h
  std::vector<std::shared_ptr<GPTBlock>> blocks;  // the children of h
  std::shared_ptr<nn::LayerNorm> ln_f;  // transformer.ln_f
  std::shared_ptr<nn::Linear> lm_head;
};

std::shared_ptr<GPT> gpt(const GPTConfig& config = GPTConfig::gpt2_small());

// ======================= MLP =======================

// Sequential(Linear(sizes[0], sizes[1]), act, Linear(sizes[1], sizes[2]), act, ...,
// Linear(sizes[n-2], sizes[n-1])): no activation after the last Linear. Keys "0.weight",
// "0.bias", "2.weight", ... as PyTorch's nn.Sequential of the same layers. activation: "relu",
// "gelu", "tanh", "sigmoid" or "silu". Throws ValueError for fewer than 2 sizes, a size below 1
// or an unknown activation.
std::shared_ptr<nn::Sequential> mlp(const std::vector<int64_t>& sizes,
                                    const std::string& activation = "relu", bool bias = true);

}  // namespace kiln::models
