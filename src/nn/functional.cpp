// nn::functional: forwards to the kiln:: ops, plus scaled_dot_product_attention and circular
// padding, which are compositions of ops (so compile() captures them like any other ops).
#include "kiln/nn/functional.h"

#include <cmath>
#include <limits>

namespace kiln::nn::functional {

Tensor relu(const Tensor& input) {
  return kiln::relu(input);
}
Tensor gelu(const Tensor& input, const std::string& approximate) {
  return kiln::gelu(input, approximate);
}
Tensor silu(const Tensor& input) {
  return kiln::silu(input);
}
Tensor tanh(const Tensor& input) {
  return kiln::tanh(input);
}
Tensor sigmoid(const Tensor& input) {
  return kiln::sigmoid(input);
}
Tensor softmax(const Tensor& input, int64_t dim, std::optional<DType> dtype) {
  return kiln::softmax(input, dim, dtype);
}
Tensor log_softmax(const Tensor& input, int64_t dim, std::optional<DType> dtype) {
  return kiln::log_softmax(input, dim, dtype);
}

Tensor linear(const Tensor& input, const Tensor& weight, const Tensor& bias) {
  return kiln::linear(input, weight, bias);
}

Tensor conv2d(const Tensor& input, const Tensor& weight, const Tensor& bias, IntArrayRef stride,
              IntArrayRef padding, IntArrayRef dilation, int64_t groups) {
  return kiln::conv2d(input, weight, bias, stride, padding, dilation, groups);
}

Tensor max_pool2d(const Tensor& input, IntArrayRef kernel_size, IntArrayRef stride,
                  IntArrayRef padding, IntArrayRef dilation, bool ceil_mode) {
  return kiln::max_pool2d(input, kernel_size, stride, padding, dilation, ceil_mode);
}

std::tuple<Tensor, Tensor> max_pool2d_with_indices(const Tensor& input, IntArrayRef kernel_size,
                                                   IntArrayRef stride, IntArrayRef padding,
                                                   IntArrayRef dilation, bool ceil_mode) {
  return kiln::max_pool2d_with_indices(input, kernel_size, stride, padding, dilation, ceil_mode);
}

Tensor avg_pool2d(const Tensor& input, IntArrayRef kernel_size, IntArrayRef stride,
                  IntArrayRef padding, bool ceil_mode, bool count_include_pad,
                  std::optional<int64_t> divisor_override) {
  return kiln::avg_pool2d(input, kernel_size, stride, padding, ceil_mode, count_include_pad,
                          divisor_override);
}

Tensor adaptive_avg_pool2d(const Tensor& input, IntArrayRef output_size) {
  return kiln::adaptive_avg_pool2d(input, output_size);
}

Tensor batch_norm(const Tensor& input, const Tensor& running_mean, const Tensor& running_var,
                  const Tensor& weight, const Tensor& bias, bool training, double momentum,
                  double eps) {
  return kiln::batch_norm(input, running_mean, running_var, weight, bias, training, momentum, eps);
}

Tensor layer_norm(const Tensor& input, IntArrayRef normalized_shape, const Tensor& weight,
                  const Tensor& bias, double eps) {
  return kiln::layer_norm(input, normalized_shape, weight, bias, eps);
}

Tensor group_norm(const Tensor& input, int64_t num_groups, const Tensor& weight, const Tensor& bias,
                  double eps) {
  return kiln::group_norm(input, num_groups, weight, bias, eps);
}

Tensor embedding(const Tensor& input, const Tensor& weight, std::optional<int64_t> padding_idx) {
  return kiln::embedding(weight, input, padding_idx);
}

Tensor one_hot(const Tensor& tensor, int64_t num_classes) {
  return kiln::one_hot(tensor, num_classes);
}

Tensor dropout(const Tensor& input, double p, bool training) {
  return kiln::dropout(input, p, training);
}

Tensor pad(const Tensor& input, IntArrayRef pad, const std::string& mode, double value) {
  if (mode != "circular") return kiln::pad(input, pad, mode, value);
  const char* tag = "[kiln::pad] ";
  KILN_CHECK(pad.size() % 2 == 0, ValueError,
             std::string(tag) + "Padding length must be divisible by 2.");
  KILN_CHECK(static_cast<int64_t>(pad.size()) <= 2 * input.dim(), ValueError,
             std::string(tag) +
                 "Padding length should be less than or equal to two times the input dimension but "
                 "got padding length " +
                 std::to_string(pad.size()) + " and input of dimension " +
                 std::to_string(input.dim()) + ".");
  KILN_CHECK(value == 0.0, ValueError,
             std::string(tag) + "Padding mode \"circular\" doesn't take in value argument.");
  Tensor out = input;
  for (size_t i = 0; i < pad.size() / 2; ++i) {
    const int64_t d = input.dim() - 1 - static_cast<int64_t>(i);
    const int64_t left = pad[2 * i], right = pad[2 * i + 1], n = out.size(d);
    KILN_CHECK(left >= 0 && right >= 0 && left <= n && right <= n, ValueError,
               std::string(tag) + "Padding value causes wrapping around more than once (pads " +
                   std::to_string(left) + " and " + std::to_string(right) + " for a dim of size " +
                   std::to_string(n) +
                   "). Circular pads must be between 0 and the size of their dim.");
    TensorList parts;
    if (left > 0) parts.push_back(out.narrow(d, n - left, left));
    parts.push_back(out);
    if (right > 0) parts.push_back(out.narrow(d, 0, right));
    if (parts.size() > 1) out = cat(parts, d);
  }
  return out;
}

Tensor cross_entropy(const Tensor& input, const Tensor& target, const Tensor& weight,
                     int64_t ignore_index, Reduction reduction, double label_smoothing) {
  return kiln::cross_entropy(input, target, weight, ignore_index, reduction, label_smoothing);
}

Tensor nll_loss(const Tensor& input, const Tensor& target, const Tensor& weight,
                int64_t ignore_index, Reduction reduction) {
  return kiln::nll_loss(input, target, weight, ignore_index, reduction);
}

Tensor mse_loss(const Tensor& input, const Tensor& target, Reduction reduction) {
  return kiln::mse_loss(input, target, reduction);
}

Tensor binary_cross_entropy_with_logits(const Tensor& input, const Tensor& target,
                                        const Tensor& weight, Reduction reduction,
                                        const Tensor& pos_weight) {
  return kiln::binary_cross_entropy_with_logits(input, target, weight, pos_weight, reduction);
}

Tensor scaled_dot_product_attention(const Tensor& query, const Tensor& key, const Tensor& value,
                                    const Tensor& attn_mask, double dropout_p, bool is_causal,
                                    std::optional<double> scale) {
  const std::string tag = "[kiln::scaled_dot_product_attention] ";
  KILN_CHECK(query.dim() >= 2 && key.dim() >= 2 && value.dim() >= 2, ShapeError,
             tag + "query, key and value must have at least 2 dims (..., L, E), but got shapes " +
                 shape_str(query.sizes()) + ", " + shape_str(key.sizes()) + " and " +
                 shape_str(value.sizes()) + ".");
  KILN_CHECK(query.dtype() == key.dtype() && query.dtype() == value.dtype(), DTypeError,
             tag + "Expected query, key, and value to have the same dtype, but got query.dtype: " +
                 std::string(dtype_name(query.dtype())) +
                 " key.dtype: " + std::string(dtype_name(key.dtype())) +
                 " and value.dtype: " + std::string(dtype_name(value.dtype())) + " instead.");
  KILN_CHECK(is_floating_point(query.dtype()), DTypeError,
             tag + "query, key and value must be floating point, but got " +
                 std::string(dtype_name(query.dtype())) + ".");
  KILN_CHECK(query.size(-1) == key.size(-1), ShapeError,
             tag + "query and key must have the same embedding size (last dim), but got shapes " +
                 shape_str(query.sizes()) + " and " + shape_str(key.sizes()) + ".");
  KILN_CHECK(key.size(-2) == value.size(-2), ShapeError,
             tag + "key and value must have the same sequence length (dim -2), but got shapes " +
                 shape_str(key.sizes()) + " and " + shape_str(value.sizes()) + ".");
  KILN_CHECK(dropout_p >= 0.0 && dropout_p <= 1.0, ValueError,
             tag + "dropout_p must be between 0 and 1, but got " + std::to_string(dropout_p) + ".");
  KILN_CHECK(
      !(is_causal && attn_mask.defined()), ValueError,
      tag + "Explicit attn_mask should not be set when is_causal=True. Pass one or the other.");
  KILN_CHECK(
      !attn_mask.defined() || attn_mask.dtype() == kBool || is_floating_point(attn_mask.dtype()),
      DTypeError,
      tag +
          "Expected attn_mask dtype to be bool or float or to match query dtype, but got "
          "attn_mask.dtype: " +
          std::string(dtype_name(attn_mask.dtype())) +
          " and query.dtype: " + std::string(dtype_name(query.dtype())) + " instead.");

  const int64_t L = query.size(-2), S = key.size(-2), E = query.size(-1);
  const double s = scale.value_or(1.0 / std::sqrt(static_cast<double>(E)));
  Tensor scores = kiln::matmul(query, key.transpose(-2, -1)) * s;

  Tensor keep;  // bool: which (query, key) pairs take part
  if (is_causal) {
    const TensorOptions idx(kInt64, query.device());
    keep = ge(arange(L, idx).unsqueeze(1), arange(S, idx).unsqueeze(0));
  } else if (attn_mask.defined() && attn_mask.dtype() == kBool) {
    keep = attn_mask;
  }
  const double neg_inf = -std::numeric_limits<double>::infinity();
  if (keep.defined()) {
    scores = where(keep, scores, neg_inf);
  } else if (attn_mask.defined()) {
    scores = scores + attn_mask.to(query.dtype());
  }
  Tensor attn = kiln::softmax(scores, -1);
  if (attn_mask.defined() || is_causal) {
    // PyTorch's _safe_softmax: a row with every score -inf attends to nothing (zeros, not NaN).
    Tensor fully_masked = all(eq(scores, neg_inf), -1, /*keepdim=*/true);
    attn = where(fully_masked, 0.0, attn);
  }
  if (dropout_p > 0.0) attn = kiln::dropout(attn, dropout_p, /*training=*/true);
  return kiln::matmul(attn, value);
}

}  // namespace kiln::nn::functional
