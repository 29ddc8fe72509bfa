// Normalization layers: BatchNorm1d, BatchNorm2d, LayerNorm, GroupNorm.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "kiln/nn/module.h"

namespace kiln::nn {

struct BatchNormOptions {
  int64_t num_features = 0;
  double eps = 1e-5;
  // Weight of the new batch statistic in the running average; nullopt (PyTorch's None) keeps a
  // cumulative average: momentum = 1 / num_batches_tracked.
  std::optional<double> momentum = 0.1;
  bool affine = true;               // learnable weight (ones) and bias (zeros)
  bool track_running_stats = true;  // buffers running_mean, running_var, num_batches_tracked
};

// Batch normalization over the channel dim (dim 1). Training mode normalizes with the batch's
// mean and biased variance and, with track_running_stats, updates running_mean, running_var
// (with the unbiased variance) and num_batches_tracked (an int64 0-dim buffer, +1 per forward).
// Eval mode uses the running statistics (or batch statistics when none are tracked).
class BatchNormBase : public Module {
 public:
  explicit BatchNormBase(const BatchNormOptions& options);
  Tensor forward(const Tensor& input) override;
  std::string extra_repr() const override;
  void reset_running_stats();
  void reset_parameters();

  BatchNormOptions options;
  Tensor weight, bias;                                    // undefined without affine
  Tensor running_mean, running_var, num_batches_tracked;  // undefined without track_running_stats

 protected:
  virtual void check_input_dim(const Tensor& input) const = 0;
};

// Input (N, C) or (N, C, L).
class BatchNorm1d : public BatchNormBase {
 public:
  explicit BatchNorm1d(const BatchNormOptions& options) : BatchNormBase(options) {}
  explicit BatchNorm1d(int64_t num_features, double eps = 1e-5,
                       std::optional<double> momentum = 0.1, bool affine = true,
                       bool track_running_stats = true)
      : BatchNormBase({num_features, eps, momentum, affine, track_running_stats}) {}

 protected:
  void check_input_dim(const Tensor& input) const override;
};

// Input (N, C, H, W).
class BatchNorm2d : public BatchNormBase {
 public:
  explicit BatchNorm2d(const BatchNormOptions& options) : BatchNormBase(options) {}
  explicit BatchNorm2d(int64_t num_features, double eps = 1e-5,
                       std::optional<double> momentum = 0.1, bool affine = true,
                       bool track_running_stats = true)
      : BatchNormBase({num_features, eps, momentum, affine, track_running_stats}) {}

 protected:
  void check_input_dim(const Tensor& input) const override;
};

struct LayerNormOptions {
  std::vector<int64_t> normalized_shape;  // the trailing dims normalized over
  double eps = 1e-5;
  bool elementwise_affine = true;  // weight (ones) of normalized_shape
  bool bias = true;                // bias (zeros), with elementwise_affine only
};

class LayerNorm : public Module {
 public:
  explicit LayerNorm(const LayerNormOptions& options);
  explicit LayerNorm(std::vector<int64_t> normalized_shape, double eps = 1e-5,
                     bool elementwise_affine = true, bool bias = true);
  explicit LayerNorm(int64_t normalized_size, double eps = 1e-5, bool elementwise_affine = true,
                     bool bias = true);
  Tensor forward(const Tensor& input) override;
  std::string extra_repr() const override;
  void reset_parameters();

  LayerNormOptions options;
  Tensor weight, bias;
};

struct GroupNormOptions {
  int64_t num_groups = 0;
  int64_t num_channels = 0;
  double eps = 1e-5;
  bool affine = true;  // per-channel weight (ones) and bias (zeros)
};

// Normalizes (N, C, *) input over groups of C / num_groups channels.
class GroupNorm : public Module {
 public:
  explicit GroupNorm(const GroupNormOptions& options);
  GroupNorm(int64_t num_groups, int64_t num_channels, double eps = 1e-5, bool affine = true);
  Tensor forward(const Tensor& input) override;
  std::string extra_repr() const override;
  void reset_parameters();

  GroupNormOptions options;
  Tensor weight, bias;
};

}  // namespace kiln::nn
