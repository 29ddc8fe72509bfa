// Training a tiny GPT (nanoGPT's architecture) on a toy sequence task: every sequence counts up
// from a random start in a random step of 1 to 4, modulo 16 ("3 5 7 9 11 13 15 1 ..."). To predict
// the next token the model must read the step off the earlier tokens, which attention does.
// AdamW with nanoGPT's parameter groups (weight decay on matrices only); the loss falls, and the
// trained model continues prompts it has never seen.
#include <kiln/kiln.h>

#include <iomanip>
#include <sstream>
#include <string>

#include "example.h"

using namespace kiln;

namespace {

std::string fixed4(double v) {
  std::ostringstream s;
  s << std::fixed << std::setprecision(4) << v;
  return s.str();
}

constexpr int64_t kVocab = 16, kLength = 16;

// (batch, kLength + 1) sequences: start + step * t (mod kVocab), step in [1, 4].
Tensor make_sequences(int64_t batch) {
  Tensor start = randint(kVocab, {batch, 1});
  Tensor step = randint(1, 5, {batch, 1});
  return remainder(start + step * arange(kLength + 1), kVocab);
}

std::string tokens_str(const Tensor& row) {
  std::string s;
  for (int64_t v : row.to_vector<int64_t>()) {
    if (!s.empty()) s += ' ';
    s += std::to_string(v);
  }
  return s;
}

}  // namespace

KILN_EXAMPLE(train_gpt, 90, "Training a tiny GPT with AdamW") {
  manual_seed(0);
  const models::GPTConfig config{.vocab_size = kVocab, .block_size = kLength, .n_layer = 2,
                                 .n_head = 2, .n_embd = 32, .dropout = 0.0, .bias = true};
  auto model = models::gpt(config);
  out << "GPT: " << config.n_layer << " layers, " << config.n_head << " heads, " << config.n_embd
      << " channels, vocab " << config.vocab_size << ", context " << config.block_size << "; "
      << model->num_parameters() << " parameters\n";

  // nanoGPT's configure_optimizers: decay the matrices (dim >= 2), not biases and LayerNorms.
  std::vector<Tensor> decay, no_decay;
  for (const Tensor& p : model->parameters()) (p.dim() >= 2 ? decay : no_decay).push_back(p);
  std::vector<optim::ParamGroup<optim::AdamWOptions>> groups{
      {decay, {.lr = 3e-3, .weight_decay = 0.1}}, {no_decay, {.lr = 3e-3, .weight_decay = 0.0}}};
  optim::AdamW optimizer(groups);

  const int64_t steps = 300, batch = 32;
  model->train();
  for (int64_t step = 1; step <= steps; ++step) {
    Tensor seq = make_sequences(batch);
    Tensor inputs = seq.narrow(1, 0, kLength), targets = seq.narrow(1, 1, kLength);
    auto [logits, loss] = model->forward(inputs, targets);
    optimizer.zero_grad();
    loss.backward();
    optimizer.step();
    if (step == 1 || step % 50 == 0)
      out << "step " << std::setw(3) << step << "  loss " << fixed4(loss.item<double>()) << "\n";
  }

  // Accuracy on fresh sequences, from the second prediction on (the first cannot know the step).
  model->eval();
  NoGradGuard no_grad;
  Tensor seq = make_sequences(256);
  Tensor predicted = model->forward(seq.narrow(1, 0, kLength)).argmax(-1);
  Tensor correct = eq(predicted, seq.narrow(1, 1, kLength)).narrow(1, 1, kLength - 1);
  const double accuracy = correct.to(kFloat64).mean().item<double>();
  std::ostringstream percent;
  percent << std::fixed << std::setprecision(1) << 100.0 * accuracy << "%";
  out << "next-token accuracy on 256 new sequences: " << percent.str() << "\n";

  // Greedy continuation of a few prompts.
  for (const auto& prompt : {std::vector<int64_t>{3, 5}, std::vector<int64_t>{14, 15},
                             std::vector<int64_t>{0, 4, 8}}) {
    Tensor idx = tensor<int64_t>(prompt).unsqueeze(0);
    Tensor generated = model->generate(idx, 10);
    out << "prompt " << tokens_str(idx[0]) << "  ->  " << tokens_str(generated[0]) << "\n";
  }
}
