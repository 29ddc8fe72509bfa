// Attention layers: MultiheadAttention (torch.nn.MultiheadAttention).
#pragma once

#include <optional>
#include <tuple>

#include "kiln/nn/layers.h"
#include "kiln/nn/module.h"

namespace kiln::nn {

// MultiheadAttention's output projection: a Linear that prints under PyTorch's class name.
class NonDynamicallyQuantizableLinear : public Linear {
 public:
  using Linear::Linear;
};

struct MultiheadAttentionOptions {
  int64_t embed_dim = 0;
  int64_t num_heads = 0;        // must divide embed_dim
  double dropout = 0.0;         // on the attention weights, in training mode
  bool bias = true;             // in_proj_bias and out_proj.bias
  std::optional<int64_t> kdim;  // key features (default embed_dim)
  std::optional<int64_t> vdim;  // value features (default embed_dim)
  bool batch_first = false;     // (N, L, E) instead of (L, N, E)
};

// Multi-head attention with PyTorch's parameters and semantics.
// Parameters: in_proj_weight (3 * embed_dim, embed_dim) — or q_proj_weight, k_proj_weight,
// v_proj_weight when kdim/vdim differ from embed_dim — in_proj_bias (3 * embed_dim),
// out_proj.weight (embed_dim, embed_dim), out_proj.bias (embed_dim).
// Init: xavier_uniform_ projection weights, zero biases, out_proj.weight as Linear's.
class MultiheadAttention : public Module {
 public:
  explicit MultiheadAttention(const MultiheadAttentionOptions& options);
  MultiheadAttention(int64_t embed_dim, int64_t num_heads, double dropout = 0.0, bool bias = true);

  // query (L, N, E) (or (N, L, E) with batch_first, or unbatched (L, E)), key and value
  // (S, N, kdim / vdim). Returns (output like query, weights): the attention weights (N, L, S)
  // averaged over heads, or (N, num_heads, L, S) when average_attn_weights is false, and
  // undefined when need_weights is false.
  //  - key_padding_mask (N, S): true (bool) marks keys to ignore; a float mask is added.
  //  - attn_mask (L, S) or (N * num_heads, L, S): true (bool) marks pairs NOT allowed to attend
  //    (the opposite of scaled_dot_product_attention's bool mask); a float mask is added.
  //  - is_causal: a hint that attn_mask is the causal mask. Kiln builds the causal mask when
  //    attn_mask is not given (PyTorch requires it).
  // Weights are returned after dropout, as in PyTorch.
  std::tuple<Tensor, Tensor> forward(const Tensor& query, const Tensor& key, const Tensor& value,
                                     const Tensor& key_padding_mask = Tensor(),
                                     bool need_weights = true, const Tensor& attn_mask = Tensor(),
                                     bool average_attn_weights = true, bool is_causal = false);
  // Self-attention output only: forward(x, x, x, {}, false) (a Kiln convenience).
  Tensor forward(const Tensor& input) override;
  void reset_parameters();

  MultiheadAttentionOptions options;
  int64_t head_dim;
  Tensor in_proj_weight;                               // undefined when kdim/vdim differ
  Tensor q_proj_weight, k_proj_weight, v_proj_weight;  // defined only when kdim/vdim differ
  Tensor in_proj_bias;                                 // undefined without bias
  std::shared_ptr<NonDynamicallyQuantizableLinear> out_proj;
};

}  // namespace kiln::nn
