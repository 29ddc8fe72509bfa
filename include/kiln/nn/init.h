// kiln::nn::init — torch.nn.init in C++: in-place initialisation of parameters.
//
// Every function fills its argument in place under no-grad (so it works on parameters that
// require grad), draws from Kiln's random stream (kiln::manual_seed makes it reproducible) and
// returns the same tensor handle. Tensors are handles: pass `fc->weight` directly.
#pragma once

#include <optional>
#include <string>
#include <utility>

#include "kiln/tensor.h"

namespace kiln::nn::init {

// The recommended gain for a nonlinearity: "linear", "conv1d", "conv2d", "conv3d",
// "conv_transpose1d/2d/3d", "sigmoid" -> 1; "tanh" -> 5/3; "relu" -> sqrt(2);
// "leaky_relu" -> sqrt(2 / (1 + slope^2)) (slope = param, default 0.01); "selu" -> 3/4.
// Throws ValueError for other names.
double calculate_gain(const std::string& nonlinearity, std::optional<double> param = std::nullopt);

// (fan_in, fan_out) of a weight: size(1) * receptive field and size(0) * receptive field, where
// the receptive field is the product of sizes from dim 2 on. Throws ShapeError below 2 dims.
std::pair<int64_t, int64_t> calculate_fan_in_and_fan_out(const Tensor& tensor);

Tensor uniform_(Tensor tensor, double a = 0.0, double b = 1.0);
Tensor normal_(Tensor tensor, double mean = 0.0, double std = 1.0);
Tensor constant_(Tensor tensor, double value);
Tensor ones_(Tensor tensor);
Tensor zeros_(Tensor tensor);
// The identity in a 2-D tensor (ShapeError otherwise).
Tensor eye_(Tensor tensor);

// U(-a, a) with a = gain * sqrt(6 / (fan_in + fan_out)).
Tensor xavier_uniform_(Tensor tensor, double gain = 1.0);
// N(0, std^2) with std = gain * sqrt(2 / (fan_in + fan_out)).
Tensor xavier_normal_(Tensor tensor, double gain = 1.0);
// U(-bound, bound) with bound = gain * sqrt(3 / fan), gain = calculate_gain(nonlinearity, a),
// fan = fan_in or fan_out (mode "fan_in" / "fan_out"). A tensor with no elements is left as is.
Tensor kaiming_uniform_(Tensor tensor, double a = 0.0, const std::string& mode = "fan_in",
                        const std::string& nonlinearity = "leaky_relu");
// N(0, std^2) with std = gain / sqrt(fan).
Tensor kaiming_normal_(Tensor tensor, double a = 0.0, const std::string& mode = "fan_in",
                       const std::string& nonlinearity = "leaky_relu");
// N(mean, std^2) truncated to [a, b] (inverse-CDF sampling, like PyTorch's).
Tensor trunc_normal_(Tensor tensor, double mean = 0.0, double std = 1.0, double a = -2.0,
                     double b = 2.0);

}  // namespace kiln::nn::init
