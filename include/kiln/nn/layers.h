// Basic layers: Linear, Embedding, Dropout, Flatten, Identity and the activations.
#pragma once

#include <memory>
#include <optional>
#include <string>

#include "kiln/nn/module.h"

namespace kiln::nn {

struct LinearOptions {
  int64_t in_features = 0;
  int64_t out_features = 0;
  bool bias = true;
};

// y = x @ weight^T + bias over the last dim of x.
// Parameters: weight (out_features, in_features), bias (out_features).
// Init (PyTorch's): weight kaiming_uniform_(a = sqrt(5)), i.e. U(-1/sqrt(in), 1/sqrt(in)); bias
// U(-1/sqrt(in), 1/sqrt(in)).
class Linear : public Module {
 public:
  explicit Linear(const LinearOptions& options);
  Linear(int64_t in_features, int64_t out_features, bool bias = true);
  Tensor forward(const Tensor& input) override;
  std::string extra_repr() const override;
  void reset_parameters();

  LinearOptions options;
  Tensor weight;
  Tensor bias;  // undefined when options.bias is false
};

struct EmbeddingOptions {
  int64_t num_embeddings = 0;
  int64_t embedding_dim = 0;
  // A row whose entry gets no gradient and is initialised to zeros; negative counts from the
  // end (stored normalised, as PyTorch does).
  std::optional<int64_t> padding_idx;
};

// A lookup table: indices (any shape, int64 or int32) -> rows of weight (num_embeddings,
// embedding_dim), initialised N(0, 1).
class Embedding : public Module {
 public:
  explicit Embedding(const EmbeddingOptions& options);
  Embedding(int64_t num_embeddings, int64_t embedding_dim,
            std::optional<int64_t> padding_idx = std::nullopt);
  // An Embedding holding `embeddings` (2-D; shared, not copied); freeze: requires_grad = false.
  static std::shared_ptr<Embedding> from_pretrained(
      const Tensor& embeddings, bool freeze = true,
      std::optional<int64_t> padding_idx = std::nullopt);
  Tensor forward(const Tensor& input) override;
  std::string extra_repr() const override;
  void reset_parameters();

  EmbeddingOptions options;
  Tensor weight;

 private:
  Embedding(const EmbeddingOptions& options, const Tensor& weight, bool requires_grad);
};

// Zeroes elements with probability p in training mode (scaling the rest by 1 / (1 - p));
// the identity in eval mode.
class Dropout : public Module {
 public:
  explicit Dropout(double p = 0.5);
  Tensor forward(const Tensor& input) override;
  std::string extra_repr() const override;

  double p;
};

// Flattens dims start_dim..end_dim into one.
class Flatten : public Module {
 public:
  explicit Flatten(int64_t start_dim = 1, int64_t end_dim = -1);
  Tensor forward(const Tensor& input) override;
  std::string extra_repr() const override;

  int64_t start_dim, end_dim;
};

class Identity : public Module {
 public:
  Tensor forward(const Tensor& input) override { return input; }
};

// ---- activations ----
class ReLU : public Module {
 public:
  explicit ReLU(bool inplace = false) : inplace(inplace) {}
  Tensor forward(const Tensor& input) override;
  std::string extra_repr() const override;

  bool inplace;  // overwrite the input instead of allocating the result
};

class GELU : public Module {
 public:
  explicit GELU(std::string approximate = "none");  // "none" (erf) or "tanh"
  Tensor forward(const Tensor& input) override;
  std::string extra_repr() const override;

  std::string approximate;
};

class SiLU : public Module {
 public:
  Tensor forward(const Tensor& input) override;
};

class Tanh : public Module {
 public:
  Tensor forward(const Tensor& input) override;
};

class Sigmoid : public Module {
 public:
  Tensor forward(const Tensor& input) override;
};

class Softmax : public Module {
 public:
  explicit Softmax(int64_t dim) : dim(dim) {}
  Tensor forward(const Tensor& input) override;
  std::string extra_repr() const override;

  int64_t dim;
};

}  // namespace kiln::nn
