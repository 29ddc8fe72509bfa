// kiln::nn::functional — torch.nn.functional in C++: stateless layer math.
//
// Most functions forward to the kiln:: op of the same name (see kiln/ops.h for the full
// semantics), so that `nn::functional::cross_entropy(model->forward(x), y)` reads like PyTorch.
// scaled_dot_product_attention and the "circular" padding mode are compositions of kiln:: ops.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <type_traits>

#include "kiln/ops.h"
#include "kiln/tensor.h"

namespace kiln::nn::functional {

// ---- activations ----
Tensor relu(const Tensor& input);
Tensor gelu(const Tensor& input, const std::string& approximate = "none");  // "none" or "tanh"
Tensor silu(const Tensor& input);
Tensor tanh(const Tensor& input);
Tensor sigmoid(const Tensor& input);
Tensor softmax(const Tensor& input, int64_t dim, std::optional<DType> dtype = {});
Tensor log_softmax(const Tensor& input, int64_t dim, std::optional<DType> dtype = {});

// ---- linear, convolution, pooling ----
Tensor linear(const Tensor& input, const Tensor& weight, const Tensor& bias = Tensor());
Tensor conv2d(const Tensor& input, const Tensor& weight, const Tensor& bias = Tensor(),
              IntArrayRef stride = {1, 1}, IntArrayRef padding = {0, 0},
              IntArrayRef dilation = {1, 1}, int64_t groups = 1);
// padding: "same" or "valid" (a template for the same reason as kiln::conv2d's).
template <class String,
          std::enable_if_t<std::is_convertible_v<const String&, std::string_view>, int> = 0>
Tensor conv2d(const Tensor& input, const Tensor& weight, const Tensor& bias, IntArrayRef stride,
              const String& padding, IntArrayRef dilation = {1, 1}, int64_t groups = 1) {
  return kiln::detail::conv2d_padding_mode(input, weight, bias, stride, std::string_view(padding),
                                           dilation, groups);
}
Tensor max_pool2d(const Tensor& input, IntArrayRef kernel_size, IntArrayRef stride = {},
                  IntArrayRef padding = {0, 0}, IntArrayRef dilation = {1, 1},
                  bool ceil_mode = false);
std::tuple<Tensor, Tensor> max_pool2d_with_indices(const Tensor& input, IntArrayRef kernel_size,
                                                   IntArrayRef stride = {},
                                                   IntArrayRef padding = {0, 0},
                                                   IntArrayRef dilation = {1, 1},
                                                   bool ceil_mode = false);
Tensor avg_pool2d(const Tensor& input, IntArrayRef kernel_size, IntArrayRef stride = {},
                  IntArrayRef padding = {0, 0}, bool ceil_mode = false,
                  bool count_include_pad = true, std::optional<int64_t> divisor_override = {});
Tensor adaptive_avg_pool2d(const Tensor& input, IntArrayRef output_size);

// ---- normalization ----
// Training mode normalizes with the batch statistics and updates running_mean/running_var in
// place (when defined) with `momentum`; eval mode uses the running statistics.
Tensor batch_norm(const Tensor& input, const Tensor& running_mean, const Tensor& running_var,
                  const Tensor& weight = Tensor(), const Tensor& bias = Tensor(),
                  bool training = false, double momentum = 0.1, double eps = 1e-5);
Tensor layer_norm(const Tensor& input, IntArrayRef normalized_shape,
                  const Tensor& weight = Tensor(), const Tensor& bias = Tensor(),
                  double eps = 1e-5);
Tensor group_norm(const Tensor& input, int64_t num_groups, const Tensor& weight = Tensor(),
                  const Tensor& bias = Tensor(), double eps = 1e-5);

// ---- sparse, dropout, shape ----
Tensor embedding(const Tensor& input, const Tensor& weight,
                 std::optional<int64_t> padding_idx = {});
Tensor one_hot(const Tensor& tensor, int64_t num_classes = -1);
// Zeroes each element with probability p and scales the rest by 1 / (1 - p) when training;
// returns the input itself otherwise.
Tensor dropout(const Tensor& input, double p = 0.5, bool training = true);
// pad: (left, right) pairs from the last dim backwards. mode: "constant", "reflect",
// "replicate" or "circular" (wraps around; each pad at most the size of its dim).
Tensor pad(const Tensor& input, IntArrayRef pad, const std::string& mode = "constant",
           double value = 0.0);

// ---- losses (reduction: Reduction::none, mean or sum) ----
using kiln::Reduction;
Tensor cross_entropy(const Tensor& input, const Tensor& target, const Tensor& weight = Tensor(),
                     int64_t ignore_index = -100, Reduction reduction = Reduction::mean,
                     double label_smoothing = 0.0);
Tensor nll_loss(const Tensor& input, const Tensor& target, const Tensor& weight = Tensor(),
                int64_t ignore_index = -100, Reduction reduction = Reduction::mean);
Tensor mse_loss(const Tensor& input, const Tensor& target, Reduction reduction = Reduction::mean);
Tensor binary_cross_entropy_with_logits(const Tensor& input, const Tensor& target,
                                        const Tensor& weight = Tensor(),
                                        Reduction reduction = Reduction::mean,
                                        const Tensor& pos_weight = Tensor());

// ---- attention ----
// softmax(query @ key^T * scale + bias) @ value, like
// torch.nn.functional.scaled_dot_product_attention. query (..., L, E), key (..., S, E), value (...,
// S, Ev) -> (..., L, Ev); batch dims broadcast. attn_mask, broadcastable to (..., L, S): a bool
// mask keeps the positions that are true; a floating mask (query's dtype) is added to the scores.
// is_causal keeps key j for query i when j <= i (top-left aligned) and excludes attn_mask. scale
// defaults to 1 / sqrt(E). dropout_p drops attention weights (always, as in PyTorch: pass 0 in eval
// mode). A query row whose keys are all masked out gives zeros, as PyTorch's reference (math)
// implementation does.
Tensor scaled_dot_product_attention(const Tensor& query, const Tensor& key, const Tensor& value,
                                    const Tensor& attn_mask = Tensor(), double dropout_p = 0.0,
                                    bool is_causal = false,
                                    std::optional<double> scale = std::nullopt);

}  // namespace kiln::nn::functional
