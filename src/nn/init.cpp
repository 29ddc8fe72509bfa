// nn::init: PyTorch's initialisers, in place under no-grad.
#include "kiln/nn/init.h"

#include <cmath>
#include <limits>
#include <vector>

#include "kiln/autograd.h"
#include "kiln/ops.h"

namespace kiln::nn::init {

namespace {

std::string num_str(double v) {
  std::string s = std::to_string(v);
  return s;
}

void check_defined(const Tensor& t, const char* fn) {
  KILN_CHECK(
      t.defined(), ValueError,
      std::string("[kiln::nn::init::") + fn + "] the tensor is undefined (an absent parameter?).");
}

double fan_for(const Tensor& t, const std::string& mode, const char* fn) {
  KILN_CHECK(mode == "fan_in" || mode == "fan_out", ValueError,
             std::string("[kiln::nn::init::") + fn + "] Mode " + mode +
                 " not supported, please use one of fan_in, fan_out.");
  auto [fan_in, fan_out] = calculate_fan_in_and_fan_out(t);
  return static_cast<double>(mode == "fan_in" ? fan_in : fan_out);
}

// Inverse error function: Giles' single-precision approximation refined by two Newton steps.
double erfinv(double y) {
  if (y <= -1.0) return -std::numeric_limits<double>::infinity();
  if (y >= 1.0) return std::numeric_limits<double>::infinity();
  double w = -std::log((1.0 - y) * (1.0 + y)), p;
  if (w < 5.0) {
    w -= 2.5;
    p = 2.81022636e-08;
    p = 3.43273939e-07 + p * w;
    p = -3.5233877e-06 + p * w;
    p = -4.39150654e-06 + p * w;
    p = 0.00021858087 + p * w;
    p = -0.00125372503 + p * w;
    p = -0.00417768164 + p * w;
    p = 0.246640727 + p * w;
    p = 1.50140941 + p * w;
  } else {
    w = std::sqrt(w) - 3.0;
    p = -0.000200214257;
    p = 0.000100950558 + p * w;
    p = 0.00134934322 + p * w;
    p = -0.00367342844 + p * w;
    p = 0.00573950773 + p * w;
    p = -0.0076224613 + p * w;
    p = 0.00943887047 + p * w;
    p = 1.00167406 + p * w;
    p = 2.83297682 + p * w;
  }
  double x = p * y;
  const double two_over_sqrt_pi = 2.0 / std::sqrt(M_PI);
  for (int i = 0; i < 2; ++i) {
    const double d = two_over_sqrt_pi * std::exp(-x * x);
    if (d == 0.0) break;
    x -= (std::erf(x) - y) / d;
  }
  return x;
}

double norm_cdf(double x) {
  return (1.0 + std::erf(x / std::sqrt(2.0))) / 2.0;
}

}  // namespace

double calculate_gain(const std::string& nonlinearity, std::optional<double> param) {
  static const char* const kLinear[] = {"linear",           "conv1d",           "conv2d",
                                        "conv3d",           "conv_transpose1d", "conv_transpose2d",
                                        "conv_transpose3d", "sigmoid"};
  for (const char* n : kLinear)
    if (nonlinearity == n) return 1.0;
  if (nonlinearity == "tanh") return 5.0 / 3.0;
  if (nonlinearity == "relu") return std::sqrt(2.0);
  if (nonlinearity == "leaky_relu") {
    const double slope = param.value_or(0.01);
    return std::sqrt(2.0 / (1.0 + slope * slope));
  }
  if (nonlinearity == "selu") return 3.0 / 4.0;
  throw ValueError("[kiln::nn::init::calculate_gain] Unsupported nonlinearity " + nonlinearity +
                   ". Use linear, conv1d/2d/3d, conv_transpose1d/2d/3d, sigmoid, tanh, relu, "
                   "leaky_relu or selu.");
}

std::pair<int64_t, int64_t> calculate_fan_in_and_fan_out(const Tensor& tensor) {
  check_defined(tensor, "calculate_fan_in_and_fan_out");
  KILN_CHECK(tensor.dim() >= 2, ShapeError,
             "[kiln::nn::init] Fan in and fan out can not be computed for tensor with fewer than 2 "
             "dimensions "
             "(got shape " +
                 shape_str(tensor.sizes()) + ").");
  int64_t receptive_field = 1;
  for (int64_t d = 2; d < tensor.dim(); ++d) receptive_field *= tensor.size(d);
  return {tensor.size(1) * receptive_field, tensor.size(0) * receptive_field};
}

Tensor uniform_(Tensor tensor, double a, double b) {
  check_defined(tensor, "uniform_");
  NoGradGuard no_grad;
  tensor.uniform_(a, b);
  return tensor;
}

Tensor normal_(Tensor tensor, double mean, double std) {
  check_defined(tensor, "normal_");
  NoGradGuard no_grad;
  tensor.normal_(mean, std);
  return tensor;
}

Tensor constant_(Tensor tensor, double value) {
  check_defined(tensor, "constant_");
  NoGradGuard no_grad;
  tensor.fill_(value);
  return tensor;
}

Tensor ones_(Tensor tensor) {
  return constant_(std::move(tensor), 1.0);
}
Tensor zeros_(Tensor tensor) {
  return constant_(std::move(tensor), 0.0);
}

Tensor eye_(Tensor tensor) {
  check_defined(tensor, "eye_");
  KILN_CHECK(tensor.dim() == 2, ShapeError,
             "[kiln::nn::init::eye_] Only tensors with 2 dimensions are supported (got shape " +
                 shape_str(tensor.sizes()) + ").");
  NoGradGuard no_grad;
  tensor.copy_(eye(tensor.size(0), tensor.size(1), TensorOptions(tensor.dtype(), tensor.device())));
  return tensor;
}

Tensor xavier_uniform_(Tensor tensor, double gain) {
  auto [fan_in, fan_out] = calculate_fan_in_and_fan_out(tensor);
  const double std = gain * std::sqrt(2.0 / static_cast<double>(fan_in + fan_out));
  const double a = std::sqrt(3.0) * std;
  return uniform_(std::move(tensor), -a, a);
}

Tensor xavier_normal_(Tensor tensor, double gain) {
  auto [fan_in, fan_out] = calculate_fan_in_and_fan_out(tensor);
  const double std = gain * std::sqrt(2.0 / static_cast<double>(fan_in + fan_out));
  return normal_(std::move(tensor), 0.0, std);
}

Tensor kaiming_uniform_(Tensor tensor, double a, const std::string& mode,
                        const std::string& nonlinearity) {
  check_defined(tensor, "kaiming_uniform_");
  if (tensor.numel() == 0)
    return tensor;  // PyTorch warns "Initializing zero-element tensors is a no-op"
  const double fan = fan_for(tensor, mode, "kaiming_uniform_");
  const double std = calculate_gain(nonlinearity, a) / std::sqrt(fan);
  const double bound = std::sqrt(3.0) * std;
  return uniform_(std::move(tensor), -bound, bound);
}

Tensor kaiming_normal_(Tensor tensor, double a, const std::string& mode,
                       const std::string& nonlinearity) {
  check_defined(tensor, "kaiming_normal_");
  if (tensor.numel() == 0) return tensor;
  const double fan = fan_for(tensor, mode, "kaiming_normal_");
  const double std = calculate_gain(nonlinearity, a) / std::sqrt(fan);
  return normal_(std::move(tensor), 0.0, std);
}

Tensor trunc_normal_(Tensor tensor, double mean, double std, double a, double b) {
  check_defined(tensor, "trunc_normal_");
  KILN_CHECK(std > 0 && a < b, ValueError,
             "[kiln::nn::init::trunc_normal_] need std > 0 and a < b, but got std=" + num_str(std) +
                 ", a=" + num_str(a) + ", b=" + num_str(b) + ".");
  NoGradGuard no_grad;
  // Inverse-CDF sampling: u ~ U(2l - 1, 2u - 1), x = mean + std * sqrt(2) * erfinv(u), clamped.
  const double lo = norm_cdf((a - mean) / std), hi = norm_cdf((b - mean) / std);
  Tensor u = empty(tensor.sizes(), kFloat64);
  u.uniform_(2.0 * lo - 1.0, 2.0 * hi - 1.0);
  std::vector<double> v = u.to_vector<double>();
  for (double& x : v) x = std::min(std::max(mean + std * std::sqrt(2.0) * erfinv(x), a), b);
  tensor.copy_(kiln::tensor<double>(v, tensor.sizes()));
  return tensor;
}

}  // namespace kiln::nn::init
