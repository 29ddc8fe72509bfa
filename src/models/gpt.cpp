// A GPT-2-style decoder with nanoGPT's module tree, key names, forward and GPT-2's init.
#include <cmath>
#include <string>

#include "kiln/autograd.h"
#include "kiln/models.h"
#include "kiln/nn/functional.h"
#include "kiln/nn/init.h"
#include "kiln/ops.h"

namespace kiln::models {

namespace F = nn::functional;

namespace {

void check_config(const GPTConfig& c) {
  const std::string tag = "[kiln::models::GPT] ";
  KILN_CHECK(c.vocab_size > 0 && c.block_size > 0 && c.n_layer > 0 && c.n_head > 0 && c.n_embd > 0,
             ValueError,
             tag + "vocab_size, block_size, n_layer, n_head and n_embd must be positive, but got " +
                 std::to_string(c.vocab_size) + ", " + std::to_string(c.block_size) + ", " +
                 std::to_string(c.n_layer) + ", " + std::to_string(c.n_head) + " and " +
                 std::to_string(c.n_embd) + ".");
  KILN_CHECK(c.n_embd % c.n_head == 0, ValueError,
             tag + "n_embd (" + std::to_string(c.n_embd) + ") must be divisible by n_head (" +
                 std::to_string(c.n_head) + ").");
  KILN_CHECK(c.dropout >= 0.0 && c.dropout < 1.0, ValueError,
             tag + "dropout must be in [0, 1), but got " + std::to_string(c.dropout) + ".");
}

std::shared_ptr<nn::Linear> linear(int64_t in, int64_t out, bool bias) {
  return std::make_shared<nn::Linear>(in, out, bias);
}

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

}  // namespace

// ---- CausalSelfAttention ----

CausalSelfAttention::CausalSelfAttention(const GPTConfig& config)
    : n_head(config.n_head), n_embd(config.n_embd), dropout(config.dropout) {
  c_attn = register_module("c_attn", linear(n_embd, 3 * n_embd, config.bias));
  c_proj = register_module("c_proj", linear(n_embd, n_embd, config.bias));
  attn_dropout = register_module("attn_dropout", std::make_shared<nn::Dropout>(dropout));
  resid_dropout = register_module("resid_dropout", std::make_shared<nn::Dropout>(dropout));
}

Tensor CausalSelfAttention::forward(const Tensor& x) {
  KILN_CHECK(x.dim() == 3 && x.size(2) == n_embd, ShapeError,
             "[kiln::models::CausalSelfAttention] expected input (B, T, " + std::to_string(n_embd) +
                 "), but got a " + std::to_string(x.dim()) + "-D input.");
  const int64_t B = x.size(0), T = x.size(1), C = n_embd, hs = C / n_head;
  std::vector<Tensor> qkv = c_attn->forward(x).split(n_embd, 2);
  // (B, T, C) -> (B, nh, T, hs)
  Tensor q = qkv[0].view({B, T, n_head, hs}).transpose(1, 2);
  Tensor k = qkv[1].view({B, T, n_head, hs}).transpose(1, 2);
  Tensor v = qkv[2].view({B, T, n_head, hs}).transpose(1, 2);
  Tensor y = F::scaled_dot_product_attention(q, k, v, Tensor(), is_training() ? dropout : 0.0,
                                             /*is_causal=*/true);
  y = y.transpose(1, 2).contiguous().view({B, T, C});
  return resid_dropout->forward(c_proj->forward(y));
}

// ---- MLP ----

GPTMLP::GPTMLP(const GPTConfig& config) {
  c_fc = register_module("c_fc", linear(config.n_embd, 4 * config.n_embd, config.bias));
  gelu = register_module("gelu", std::make_shared<nn::GELU>("tanh"));
  c_proj = register_module("c_proj", linear(4 * config.n_embd, config.n_embd, config.bias));
  dropout = register_module("dropout", std::make_shared<nn::Dropout>(config.dropout));
}

Tensor GPTMLP::forward(const Tensor& x) {
  return dropout->forward(c_proj->forward(gelu->forward(c_fc->forward(x))));
}

// ---- Block ----

GPTBlock::GPTBlock(const GPTConfig& config) {
  ln_1 = register_module("ln_1", std::make_shared<nn::LayerNorm>(config.n_embd, 1e-5, true,
                                                                  config.bias));
  attn = register_module("attn", std::make_shared<CausalSelfAttention>(config));
  ln_2 = register_module("ln_2", std::make_shared<nn::LayerNorm>(config.n_embd, 1e-5, true,
                                                                  config.bias));
  mlp = register_module("mlp", std::make_shared<GPTMLP>(config));
}

Tensor GPTBlock::forward(const Tensor& x) {
  Tensor out = x + attn->forward(ln_1->forward(x));
  return out + mlp->forward(ln_2->forward(out));
}

// ---- GPT ----

GPT::GPT(const GPTConfig& config_) : config(config_) {
  check_config(config);
  transformer = register_module("transformer", std::make_shared<nn::ModuleDict>());
  wte = transformer->insert("wte", std::make_shared<nn::Embedding>(config.vocab_size,
                                                                   config.n_embd));
  wpe = transformer->insert("wpe", std::make_shared<nn::Embedding>(config.block_size,
                                                                   config.n_embd));
  drop = transformer->insert("drop", std::make_shared<nn::Dropout>(config.dropout));
  h = transformer->insert("h", std::make_shared<nn::ModuleList>());
  for (int64_t i = 0; i < config.n_layer; ++i)
    blocks.push_back(h->push_back(std::make_shared<GPTBlock>(config)));
  ln_f = transformer->insert("ln_f", std::make_shared<nn::LayerNorm>(config.n_embd, 1e-5, true,
                                                                     config.bias));
  lm_head = register_module("lm_head", linear(config.n_embd, config.vocab_size, false));
  // Weight tying (nanoGPT: transformer.wte.weight = lm_head.weight): one tensor in both slots.
  wte->weight = wte->register_parameter("weight", lm_head->weight);

  // GPT-2's init, in nanoGPT's order: apply() visits children before parents.
  apply([](nn::Module& m) {
    if (auto* fc = m.as<nn::Linear>()) {
      nn::init::normal_(fc->weight, 0.0, 0.02);
      if (fc->bias.defined()) nn::init::zeros_(fc->bias);
    } else if (auto* emb = m.as<nn::Embedding>()) {
      nn::init::normal_(emb->weight, 0.0, 0.02);
    }
  });
  const double proj_std = 0.02 / std::sqrt(2.0 * static_cast<double>(config.n_layer));
  for (auto& [name, p] : named_parameters())
    if (ends_with(name, "c_proj.weight")) nn::init::normal_(p, 0.0, proj_std);
}

Tensor GPT::forward(const Tensor& idx) {
  const std::string tag = "[kiln::models::GPT] ";
  KILN_CHECK(idx.dim() == 2, ShapeError,
             tag + "expected token ids of shape (B, T), but got a " + std::to_string(idx.dim()) +
                 "-D input. Add a batch dim with unsqueeze(0).");
  KILN_CHECK(idx.dtype() == kInt64 || idx.dtype() == kInt32, DTypeError,
             tag + "expected int64 (or int32) token ids, but got " +
                 std::string(dtype_name(idx.dtype())) + ".");
  const int64_t t = idx.size(1);
  KILN_CHECK(t <= config.block_size, ShapeError,
             tag + "Cannot forward sequence of length " + std::to_string(t) +
                 ", block size is only " + std::to_string(config.block_size) +
                 ". Crop the input to its last " + std::to_string(config.block_size) + " tokens.");
  Tensor pos = arange(t, TensorOptions(kInt64, idx.device()));
  Tensor tok_emb = wte->forward(idx);  // (B, T, n_embd)
  Tensor pos_emb = wpe->forward(pos);  // (T, n_embd)
  Tensor x = drop->forward(tok_emb + pos_emb);
  for (const auto& block : blocks) x = block->forward(x);
  x = ln_f->forward(x);
  return lm_head->forward(x);
}

std::tuple<Tensor, Tensor> GPT::forward(const Tensor& idx, const Tensor& targets) {
  KILN_CHECK(targets.sizes() == idx.sizes(), ShapeError,
             "[kiln::models::GPT] targets must have the shape of idx (B, T), but got " +
                 shape_str(targets.sizes()) + " and " + shape_str(idx.sizes()) + ".");
  Tensor logits = forward(idx);
  Tensor loss = F::cross_entropy(logits.reshape({-1, logits.size(-1)}), targets.reshape({-1}),
                                 Tensor(), /*ignore_index=*/-1);
  return {logits, loss};
}

Tensor GPT::generate(const Tensor& idx, int64_t max_new_tokens) {
  KILN_CHECK(max_new_tokens >= 0, ValueError,
             "[kiln::models::GPT::generate] max_new_tokens must be non-negative, but got " +
                 std::to_string(max_new_tokens) + ".");
  KILN_CHECK(idx.dim() == 2 && idx.size(1) > 0, ShapeError,
             "[kiln::models::GPT::generate] expected a non-empty prompt of shape (B, T), T >= 1.");
  NoGradGuard no_grad;
  Tensor seq = idx;
  for (int64_t i = 0; i < max_new_tokens; ++i) {
    const int64_t t = seq.size(1);
    Tensor context = t <= config.block_size ? seq : seq.narrow(1, t - config.block_size,
                                                               config.block_size);
    Tensor logits = forward(context).select(1, -1);  // (B, vocab)
    Tensor next = logits.argmax(-1, /*keepdim=*/true).to(seq.dtype());
    seq = cat({seq, next}, 1);
  }
  return seq;
}

int64_t GPT::num_parameters(bool non_embedding) const {
  int64_t n = 0;
  for (const Tensor& p : parameters()) n += p.numel();
  if (non_embedding) n -= wpe->weight.numel();
  return n;
}

std::shared_ptr<GPT> gpt(const GPTConfig& config) {
  return std::make_shared<GPT>(config);
}

}  // namespace kiln::models
