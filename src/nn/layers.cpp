// Linear, Embedding, Dropout, Flatten and the activation modules.
#include "kiln/nn/layers.h"

#include <cmath>

#include "kiln/autograd.h"
#include "kiln/nn/functional.h"
#include "kiln/nn/init.h"
#include "kiln/ops.h"

namespace kiln::nn {

namespace F = functional;

// ---------------- Linear ----------------

Linear::Linear(const LinearOptions& opts) : options(opts) {
  KILN_CHECK(
      options.in_features >= 0 && options.out_features >= 0, ValueError,
      "[kiln::nn::Linear] in_features and out_features must be non-negative, but got in_features=" +
          std::to_string(options.in_features) +
          ", out_features=" + std::to_string(options.out_features) + ".");
  weight = register_parameter("weight", empty({options.out_features, options.in_features}));
  bias = register_parameter("bias", options.bias ? empty({options.out_features}) : Tensor());
  reset_parameters();
}

Linear::Linear(int64_t in_features, int64_t out_features, bool bias)
    : Linear(LinearOptions{in_features, out_features, bias}) {}

void Linear::reset_parameters() {
  init::kaiming_uniform_(weight, std::sqrt(5.0));
  if (bias.defined()) {
    const double bound =
        options.in_features > 0 ? 1.0 / std::sqrt(static_cast<double>(options.in_features)) : 0.0;
    init::uniform_(bias, -bound, bound);
  }
}

Tensor Linear::forward(const Tensor& input) {
  return F::linear(input, weight, bias);
}

std::string Linear::extra_repr() const {
  return "in_features=" + std::to_string(options.in_features) +
         ", out_features=" + std::to_string(options.out_features) +
         ", bias=" + python_bool_repr(bias.defined());
}

// ---------------- Embedding ----------------

namespace {
std::optional<int64_t> normalize_padding_idx(std::optional<int64_t> padding_idx,
                                             int64_t num_embeddings) {
  if (!padding_idx) return padding_idx;
  KILN_CHECK(*padding_idx < num_embeddings && *padding_idx >= -num_embeddings, IndexError,
             "[kiln::nn::Embedding] Padding_idx must be within num_embeddings (got padding_idx=" +
                 std::to_string(*padding_idx) + " for " + std::to_string(num_embeddings) +
                 " embeddings).");
  return *padding_idx < 0 ? *padding_idx + num_embeddings : *padding_idx;
}
}  // namespace

Embedding::Embedding(const EmbeddingOptions& opts) : options(opts) {
  KILN_CHECK(
      options.num_embeddings >= 0 && options.embedding_dim >= 0, ValueError,
      "[kiln::nn::Embedding] num_embeddings and embedding_dim must be non-negative, but got " +
          std::to_string(options.num_embeddings) + " and " + std::to_string(options.embedding_dim) +
          ".");
  options.padding_idx = normalize_padding_idx(options.padding_idx, options.num_embeddings);
  weight = register_parameter("weight", empty({options.num_embeddings, options.embedding_dim}));
  reset_parameters();
}

Embedding::Embedding(int64_t num_embeddings, int64_t embedding_dim,
                     std::optional<int64_t> padding_idx)
    : Embedding(EmbeddingOptions{num_embeddings, embedding_dim, padding_idx}) {}

Embedding::Embedding(const EmbeddingOptions& opts, const Tensor& pretrained, bool requires_grad)
    : options(opts) {
  options.padding_idx = normalize_padding_idx(options.padding_idx, options.num_embeddings);
  weight = register_parameter("weight", pretrained, requires_grad);
}

std::shared_ptr<Embedding> Embedding::from_pretrained(const Tensor& embeddings, bool freeze,
                                                      std::optional<int64_t> padding_idx) {
  KILN_CHECK(
      embeddings.defined() && embeddings.dim() == 2, ShapeError,
      "[kiln::nn::Embedding::from_pretrained] Embeddings parameter is expected to be "
      "2-dimensional" +
          std::string(embeddings.defined() ? ", got shape " + shape_str(embeddings.sizes()) : "") +
          ".");
  EmbeddingOptions opts{embeddings.size(0), embeddings.size(1), padding_idx};
  return std::shared_ptr<Embedding>(new Embedding(opts, embeddings, /*requires_grad=*/!freeze));
}

void Embedding::reset_parameters() {
  init::normal_(weight);
  if (options.padding_idx) {
    NoGradGuard no_grad;
    weight.select(0, *options.padding_idx).fill_(0);
  }
}

Tensor Embedding::forward(const Tensor& input) {
  return F::embedding(input, weight, options.padding_idx);
}

std::string Embedding::extra_repr() const {
  std::string s =
      std::to_string(options.num_embeddings) + ", " + std::to_string(options.embedding_dim);
  if (options.padding_idx) s += ", padding_idx=" + std::to_string(*options.padding_idx);
  return s;
}

// ---------------- Dropout, Flatten ----------------

Dropout::Dropout(double p_) : p(p_) {
  KILN_CHECK(p >= 0.0 && p <= 1.0, ValueError,
             "[kiln::nn::Dropout] dropout probability has to be between 0 and 1, but got " +
                 python_float_repr(p) + ".");
}

Tensor Dropout::forward(const Tensor& input) {
  return F::dropout(input, p, is_training());
}

std::string Dropout::extra_repr() const {
  return "p=" + python_float_repr(p) + ", inplace=False";
}

Flatten::Flatten(int64_t start, int64_t end) : start_dim(start), end_dim(end) {}

Tensor Flatten::forward(const Tensor& input) {
  return input.flatten(start_dim, end_dim);
}

std::string Flatten::extra_repr() const {
  return "start_dim=" + std::to_string(start_dim) + ", end_dim=" + std::to_string(end_dim);
}

// ---------------- activations ----------------

Tensor ReLU::forward(const Tensor& input) {
  if (!inplace) return F::relu(input);
  Tensor out = input;
  out.relu_();
  return out;
}

std::string ReLU::extra_repr() const {
  return inplace ? "inplace=True" : "";
}

GELU::GELU(std::string approx) : approximate(std::move(approx)) {
  KILN_CHECK(approximate == "none" || approximate == "tanh", ValueError,
             "[kiln::nn::GELU] approximate must be \"none\" or \"tanh\", but got \"" + approximate +
                 "\".");
}

Tensor GELU::forward(const Tensor& input) {
  return F::gelu(input, approximate);
}

std::string GELU::extra_repr() const {
  return "approximate='" + approximate + "'";
}

Tensor SiLU::forward(const Tensor& input) {
  return F::silu(input);
}
Tensor Tanh::forward(const Tensor& input) {
  return F::tanh(input);
}
Tensor Sigmoid::forward(const Tensor& input) {
  return F::sigmoid(input);
}

Tensor Softmax::forward(const Tensor& input) {
  return F::softmax(input, dim);
}
std::string Softmax::extra_repr() const {
  return "dim=" + std::to_string(dim);
}

}  // namespace kiln::nn
