// MultiheadAttention: torch.nn.functional.multi_head_attention_forward's math path in Kiln ops.
#include "kiln/nn/attention.h"

#include <cmath>
#include <limits>

#include "kiln/nn/functional.h"
#include "kiln/nn/init.h"
#include "kiln/ops.h"

namespace kiln::nn {

namespace F = functional;

namespace {
const char* const kTag = "[kiln::nn::MultiheadAttention] ";
std::string dim_str(const Tensor& t) {
  return std::to_string(t.dim()) + "-D";
}
}  // namespace

MultiheadAttention::MultiheadAttention(const MultiheadAttentionOptions& opts) : options(opts) {
  const int64_t E = options.embed_dim, H = options.num_heads;
  KILN_CHECK(E > 0 && H > 0, ValueError,
             std::string(kTag) + "embed_dim and num_heads must be greater than 0, got embed_dim=" +
                 std::to_string(E) + " and num_heads=" + std::to_string(H) + " instead.");
  head_dim = E / H;
  KILN_CHECK(head_dim * H == E, ValueError,
             std::string(kTag) + "embed_dim must be divisible by num_heads (embed_dim=" +
                 std::to_string(E) + ", num_heads=" + std::to_string(H) + ").");
  KILN_CHECK(options.dropout >= 0.0 && options.dropout <= 1.0, ValueError,
             std::string(kTag) + "dropout probability has to be between 0 and 1, but got " +
                 python_float_repr(options.dropout) + ".");
  const int64_t kdim = options.kdim.value_or(E), vdim = options.vdim.value_or(E);
  KILN_CHECK(kdim > 0 && vdim > 0, ValueError,
             std::string(kTag) + "kdim and vdim must be positive, got kdim=" +
                 std::to_string(kdim) + " and vdim=" + std::to_string(vdim) + ".");
  if (kdim == E && vdim == E) {
    in_proj_weight = register_parameter("in_proj_weight", empty({3 * E, E}));
    q_proj_weight = register_parameter("q_proj_weight", Tensor());
    k_proj_weight = register_parameter("k_proj_weight", Tensor());
    v_proj_weight = register_parameter("v_proj_weight", Tensor());
  } else {
    q_proj_weight = register_parameter("q_proj_weight", empty({E, E}));
    k_proj_weight = register_parameter("k_proj_weight", empty({E, kdim}));
    v_proj_weight = register_parameter("v_proj_weight", empty({E, vdim}));
    in_proj_weight = register_parameter("in_proj_weight", Tensor());
  }
  in_proj_bias = register_parameter("in_proj_bias", options.bias ? empty({3 * E}) : Tensor());
  out_proj = register_module("out_proj",
                             std::make_shared<NonDynamicallyQuantizableLinear>(E, E, options.bias));
  reset_parameters();
}

MultiheadAttention::MultiheadAttention(int64_t embed_dim, int64_t num_heads, double dropout,
                                       bool bias)
    : MultiheadAttention(MultiheadAttentionOptions{embed_dim, num_heads, dropout, bias}) {}

void MultiheadAttention::reset_parameters() {
  if (in_proj_weight.defined()) {
    init::xavier_uniform_(in_proj_weight);
  } else {
    init::xavier_uniform_(q_proj_weight);
    init::xavier_uniform_(k_proj_weight);
    init::xavier_uniform_(v_proj_weight);
  }
  if (in_proj_bias.defined()) {
    init::constant_(in_proj_bias, 0.0);
    init::constant_(out_proj->bias, 0.0);
  }
}

Tensor MultiheadAttention::forward(const Tensor& input) {
  return std::get<0>(forward(input, input, input, Tensor(), /*need_weights=*/false));
}

std::tuple<Tensor, Tensor> MultiheadAttention::forward(const Tensor& query, const Tensor& key,
                                                       const Tensor& value,
                                                       const Tensor& key_padding_mask,
                                                       bool need_weights, const Tensor& attn_mask,
                                                       bool average_attn_weights, bool is_causal) {
  const std::string tag = kTag;
  const int64_t E = options.embed_dim, H = options.num_heads, hd = head_dim;
  const Tensor& kpm_in = key_padding_mask;
  // ---- shape checks (PyTorch's _mha_shape_check) ----
  const bool batched = query.dim() == 3;
  if (batched) {
    KILN_CHECK(key.dim() == 3 && value.dim() == 3, ShapeError,
               tag + "For batched (3-D) `query`, expected `key` and `value` to be 3-D but found " +
                   dim_str(key) + " and " + dim_str(value) + " tensors respectively.");
    KILN_CHECK(!kpm_in.defined() || kpm_in.dim() == 2, ShapeError,
               tag +
                   "For batched (3-D) `query`, expected `key_padding_mask` to be `None` or 2-D but "
                   "found " +
                   dim_str(kpm_in) + " tensor instead.");
    KILN_CHECK(
        !attn_mask.defined() || attn_mask.dim() == 2 || attn_mask.dim() == 3, ShapeError,
        tag +
            "For batched (3-D) `query`, expected `attn_mask` to be `None`, 2-D or 3-D but found " +
            dim_str(attn_mask) + " tensor instead.");
  } else {
    KILN_CHECK(query.dim() == 2, ShapeError,
               tag + "query should be unbatched 2D or batched 3D tensor but received " +
                   dim_str(query) + " query tensor.");
    KILN_CHECK(key.dim() == 2 && value.dim() == 2, ShapeError,
               tag +
                   "For unbatched (2-D) `query`, expected `key` and `value` to be 2-D but found " +
                   dim_str(key) + " and " + dim_str(value) + " tensors respectively.");
    KILN_CHECK(!kpm_in.defined() || kpm_in.dim() == 1, ShapeError,
               tag +
                   "For unbatched (2-D) `query`, expected `key_padding_mask` to be `None` or 1-D "
                   "but found " +
                   dim_str(kpm_in) + " tensor instead.");
    KILN_CHECK(!attn_mask.defined() || attn_mask.dim() == 2 || attn_mask.dim() == 3, ShapeError,
               tag +
                   "For unbatched (2-D) `query`, expected `attn_mask` to be `None`, 2-D or 3-D but "
                   "found " +
                   dim_str(attn_mask) + " tensor instead.");
  }

  // ---- to (L, N, E) ----
  Tensor q = query, k = key, v = value, kpm = kpm_in;
  if (!batched) {
    q = q.unsqueeze(1);
    k = k.unsqueeze(1);
    v = v.unsqueeze(1);
    if (kpm.defined()) kpm = kpm.unsqueeze(0);
  } else if (options.batch_first) {
    q = q.transpose(0, 1);
    k = k.transpose(0, 1);
    v = v.transpose(0, 1);
  }
  const int64_t L = q.size(0), N = q.size(1), S = k.size(0);
  KILN_CHECK(q.size(2) == E, ShapeError,
             tag + "was expecting embedding dimension of " + std::to_string(E) + ", but got " +
                 std::to_string(q.size(2)) + ".");
  const bool packed = in_proj_weight.defined();
  if (packed) {
    KILN_CHECK(key.sizes() == value.sizes(), ShapeError,
               tag + "key shape " + shape_str(key.sizes()) + " does not match value shape " +
                   shape_str(value.sizes()) + ".");
  } else {
    KILN_CHECK(k.size(0) == v.size(0) && k.size(1) == v.size(1), ShapeError,
               tag + "key's sequence and batch dims " + shape_str(key.sizes()) +
                   " do not match value's " + shape_str(value.sizes()) + ".");
  }
  KILN_CHECK(k.size(1) == N, ShapeError,
             tag + "key batch size " + std::to_string(k.size(1)) +
                 " does not match query batch size " + std::to_string(N) + ".");
  const int64_t kdim = options.kdim.value_or(E), vdim = options.vdim.value_or(E);
  KILN_CHECK(k.size(2) == kdim && v.size(2) == vdim, ShapeError,
             tag + "expected key features " + std::to_string(kdim) + " and value features " +
                 std::to_string(vdim) + ", but got key " + shape_str(key.sizes()) + " and value " +
                 shape_str(value.sizes()) + ".");

  // ---- masks: bool (true = masked out) becomes a float mask with -inf ----
  const double neg_inf = -std::numeric_limits<double>::infinity();
  auto canonical = [&](const Tensor& m, const char* what) -> Tensor {
    if (!m.defined()) return m;
    if (m.dtype() == kBool)
      return zeros(m.sizes(), TensorOptions(q.dtype(), q.device())).masked_fill(m, neg_inf);
    KILN_CHECK(is_floating_point(m.dtype()), DTypeError,
               tag + "only bool and floating types of " + what + " are supported, but got " +
                   std::string(dtype_name(m.dtype())) + ".");
    return m.to(q.dtype());
  };
  Tensor mask = attn_mask;
  if (is_causal && !mask.defined()) {
    const TensorOptions idx(kInt64, q.device());
    mask = gt(arange(S, idx).unsqueeze(0), arange(L, idx).unsqueeze(1));  // key after query: masked
  }
  mask = canonical(mask, "attn_mask");
  if (mask.defined()) {
    if (mask.dim() == 2) {
      KILN_CHECK(mask.size(0) == L && mask.size(1) == S, ShapeError,
                 tag + "The shape of the 2D attn_mask is " + shape_str(mask.sizes()) +
                     ", but should be " + shape_str(std::vector<int64_t>{L, S}) + ".");
      mask = mask.unsqueeze(0);
    } else {
      KILN_CHECK(mask.size(0) == N * H && mask.size(1) == L && mask.size(2) == S, ShapeError,
                 tag + "The shape of the 3D attn_mask is " + shape_str(mask.sizes()) +
                     ", but should be " + shape_str(std::vector<int64_t>{N * H, L, S}) + ".");
    }
  }
  if (kpm.defined()) {
    KILN_CHECK(kpm.size(0) == N && kpm.size(1) == S, ShapeError,
               tag + "expecting key_padding_mask shape of " +
                   shape_str(std::vector<int64_t>{N, S}) + ", but got " + shape_str(kpm.sizes()) +
                   ".");
    Tensor kpm_f = canonical(kpm, "key_padding_mask")
                       .view({N, 1, 1, S})
                       .expand({N, H, 1, S})
                       .reshape({N * H, 1, S});
    mask = mask.defined() ? mask + kpm_f : kpm_f;
  }

  // ---- in-projection and heads: (N * H, len, head_dim) ----
  Tensor bq, bk, bv;
  if (in_proj_bias.defined()) {
    auto b = in_proj_bias.chunk(3);
    bq = b[0], bk = b[1], bv = b[2];
  }
  Tensor qp, kp, vp;
  if (packed) {
    auto w = in_proj_weight.chunk(3);
    qp = F::linear(q, w[0], bq), kp = F::linear(k, w[1], bk), vp = F::linear(v, w[2], bv);
  } else {
    qp = F::linear(q, q_proj_weight, bq), kp = F::linear(k, k_proj_weight, bk),
    vp = F::linear(v, v_proj_weight, bv);
  }
  Tensor qh = qp.reshape({L, N * H, hd}).transpose(0, 1);
  Tensor kh = kp.reshape({S, N * H, hd}).transpose(0, 1);
  Tensor vh = vp.reshape({S, N * H, hd}).transpose(0, 1);
  const double dropout_p = is_training() ? options.dropout : 0.0;

  Tensor out, weights;
  if (need_weights) {
    Tensor scores = matmul(qh * std::sqrt(1.0 / static_cast<double>(hd)), kh.transpose(-2, -1));
    if (mask.defined()) scores = mask + scores;
    weights = F::softmax(scores, -1);
    if (dropout_p > 0.0) weights = F::dropout(weights, dropout_p, true);
    out = matmul(weights, vh);  // (N * H, L, hd)
    out = out.transpose(0, 1).reshape({L * N, E});
    out = F::linear(out, out_proj->weight, out_proj->bias).view({L, N, E});
    weights = weights.view({N, H, L, S});
    if (average_attn_weights) weights = weights.mean({1});
    if (!batched) {
      out = out.squeeze(1);
      weights = weights.squeeze(0);
    }
  } else {
    if (mask.defined()) mask = mask.size(0) == 1 ? mask.unsqueeze(0) : mask.reshape({N, H, L, S});
    Tensor o = F::scaled_dot_product_attention(qh.reshape({N, H, L, hd}), kh.reshape({N, H, S, hd}),
                                               vh.reshape({N, H, S, hd}), mask, dropout_p, false);
    out = o.permute({2, 0, 1, 3}).reshape({L * N, E});
    out = F::linear(out, out_proj->weight, out_proj->bias).view({L, N, E});
    if (!batched) out = out.squeeze(1);
  }
  if (batched && options.batch_first) out = out.transpose(0, 1);
  return {out, weights};
}

}  // namespace kiln::nn
