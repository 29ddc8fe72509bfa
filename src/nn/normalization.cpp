// BatchNorm1d/2d, LayerNorm, GroupNorm.
#include "kiln/nn/normalization.h"

#include "kiln/autograd.h"
#include "kiln/nn/functional.h"
#include "kiln/nn/init.h"
#include "kiln/ops.h"

namespace kiln::nn {

namespace F = functional;

namespace {
// Python's repr of a tuple of ints: "(8,)", "(4, 8)".
std::string tuple_repr(const std::vector<int64_t>& v) {
  std::string s = "(";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s + (v.size() == 1 ? ",)" : ")");
}
}  // namespace

// ---------------- BatchNorm ----------------

BatchNormBase::BatchNormBase(const BatchNormOptions& opts) : options(opts) {
  KILN_CHECK(options.num_features >= 0, ValueError,
             "[kiln::nn::BatchNorm] num_features must be non-negative, but got " +
                 std::to_string(options.num_features) + ".");
  const int64_t c = options.num_features;
  weight = register_parameter("weight", options.affine ? empty({c}) : Tensor());
  bias = register_parameter("bias", options.affine ? empty({c}) : Tensor());
  const bool track = options.track_running_stats;
  running_mean = register_buffer("running_mean", track ? zeros({c}) : Tensor());
  running_var = register_buffer("running_var", track ? ones({c}) : Tensor());
  num_batches_tracked =
      register_buffer("num_batches_tracked", track ? zeros({}, kInt64) : Tensor());
  reset_parameters();
}

void BatchNormBase::reset_running_stats() {
  if (!options.track_running_stats) return;
  NoGradGuard no_grad;
  running_mean.zero_();
  running_var.fill_(1);
  num_batches_tracked.zero_();
}

void BatchNormBase::reset_parameters() {
  reset_running_stats();
  if (options.affine) {
    init::ones_(weight);
    init::zeros_(bias);
  }
}

Tensor BatchNormBase::forward(const Tensor& input) {
  check_input_dim(input);
  double factor = options.momentum.value_or(0.0);
  if (is_training() && options.track_running_stats && num_batches_tracked.defined()) {
    {
      NoGradGuard no_grad;
      num_batches_tracked.add_(1);
    }
    // momentum=None: a cumulative moving average (reads the counter, a host read).
    if (!options.momentum) factor = 1.0 / static_cast<double>(num_batches_tracked.item<int64_t>());
  }
  const bool use_batch_stats = is_training() || (!running_mean.defined() && !running_var.defined());
  const bool pass_running = !is_training() || options.track_running_stats;
  return F::batch_norm(input, pass_running ? running_mean : Tensor(),
                       pass_running ? running_var : Tensor(), weight, bias, use_batch_stats, factor,
                       options.eps);
}

std::string BatchNormBase::extra_repr() const {
  return std::to_string(options.num_features) + ", eps=" + python_float_repr(options.eps) +
         ", momentum=" +
         (options.momentum ? python_float_repr(*options.momentum) : std::string("None")) +
         ", affine=" + python_bool_repr(options.affine) +
         ", track_running_stats=" + python_bool_repr(options.track_running_stats);
}

void BatchNorm1d::check_input_dim(const Tensor& input) const {
  KILN_CHECK(input.dim() == 2 || input.dim() == 3, ShapeError,
             "[kiln::nn::BatchNorm1d] expected 2D or 3D input (got " + std::to_string(input.dim()) +
                 "D input).");
}

void BatchNorm2d::check_input_dim(const Tensor& input) const {
  KILN_CHECK(input.dim() == 4, ShapeError,
             "[kiln::nn::BatchNorm2d] expected 4D input (got " + std::to_string(input.dim()) +
                 "D input).");
}

// ---------------- LayerNorm ----------------

LayerNorm::LayerNorm(const LayerNormOptions& opts) : options(opts) {
  for (int64_t s : options.normalized_shape)
    KILN_CHECK(s >= 0, ValueError,
               "[kiln::nn::LayerNorm] normalized_shape must be non-negative, but got " +
                   tuple_repr(options.normalized_shape) + ".");
  const bool affine = options.elementwise_affine;
  weight = register_parameter("weight", affine ? kiln::empty(options.normalized_shape) : Tensor());
  bias = register_parameter(
      "bias", affine && options.bias ? kiln::empty(options.normalized_shape) : Tensor());
  reset_parameters();
}

LayerNorm::LayerNorm(std::vector<int64_t> normalized_shape, double eps, bool elementwise_affine,
                     bool bias)
    : LayerNorm(LayerNormOptions{std::move(normalized_shape), eps, elementwise_affine, bias}) {}

LayerNorm::LayerNorm(int64_t normalized_size, double eps, bool elementwise_affine, bool bias)
    : LayerNorm(LayerNormOptions{{normalized_size}, eps, elementwise_affine, bias}) {}

void LayerNorm::reset_parameters() {
  if (weight.defined()) init::ones_(weight);
  if (bias.defined()) init::zeros_(bias);
}

Tensor LayerNorm::forward(const Tensor& input) {
  return F::layer_norm(input, options.normalized_shape, weight, bias, options.eps);
}

std::string LayerNorm::extra_repr() const {
  return tuple_repr(options.normalized_shape) + ", eps=" + python_float_repr(options.eps) +
         ", elementwise_affine=" + python_bool_repr(options.elementwise_affine);
}

// ---------------- GroupNorm ----------------

GroupNorm::GroupNorm(const GroupNormOptions& opts) : options(opts) {
  KILN_CHECK(options.num_groups > 0, ValueError,
             "[kiln::nn::GroupNorm] num_groups must be positive, but got " +
                 std::to_string(options.num_groups) + ".");
  KILN_CHECK(options.num_channels % options.num_groups == 0, ValueError,
             "[kiln::nn::GroupNorm] num_channels must be divisible by num_groups (num_channels=" +
                 std::to_string(options.num_channels) +
                 ", num_groups=" + std::to_string(options.num_groups) + ").");
  weight = register_parameter("weight", options.affine ? empty({options.num_channels}) : Tensor());
  bias = register_parameter("bias", options.affine ? empty({options.num_channels}) : Tensor());
  reset_parameters();
}

GroupNorm::GroupNorm(int64_t num_groups, int64_t num_channels, double eps, bool affine)
    : GroupNorm(GroupNormOptions{num_groups, num_channels, eps, affine}) {}

void GroupNorm::reset_parameters() {
  if (weight.defined()) init::ones_(weight);
  if (bias.defined()) init::zeros_(bias);
}

Tensor GroupNorm::forward(const Tensor& input) {
  return F::group_norm(input, options.num_groups, weight, bias, options.eps);
}

std::string GroupNorm::extra_repr() const {
  return std::to_string(options.num_groups) + ", " + std::to_string(options.num_channels) +
         ", eps=" + python_float_repr(options.eps) + ", affine=" + python_bool_repr(options.affine);
}

}  // namespace kiln::nn
