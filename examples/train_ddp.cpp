// Data-parallel training with nn::DistributedDataParallel: the tiny GPT of train_gpt, one replica
// per rank, each rank training on its own sequences; DDP averages the gradients during the
// backward, so every replica takes the same step. Run on several ranks with
//   kiln launch --nproc 2 build/examples/example_train_ddp
// In `kiln tour` (no RANK in the environment) it runs as a group of one.
#include <kiln/distributed.h>
#include <kiln/kiln.h>

#include <cstdlib>
#include <iomanip>
#include <sstream>

#include "example.h"

using namespace kiln;
namespace dist = kiln::distributed;

namespace {

constexpr int64_t kVocab = 16, kLength = 16;

// Sequences that count up from a random start in a random step of 1 to 4 (mod 16), as in train_gpt.
Tensor make_sequences(int64_t batch) {
  Tensor start = randint(kVocab, {batch, 1});
  Tensor step = randint(1, 5, {batch, 1});
  return remainder(start + step * arange(kLength + 1), kVocab);
}

std::string fixed4(double v) {
  std::ostringstream s;
  s << std::fixed << std::setprecision(4) << v;
  return s.str();
}

}  // namespace

KILN_EXAMPLE(train_ddp, 95, "Data-parallel training with DistributedDataParallel") {
  const bool launched = std::getenv("RANK") != nullptr;
  if (launched) dist::init_process_group({.backend = "gloo"});
  else dist::init_process_group({.backend = "gloo", .rank = 0, .world_size = 1});
  const int rank = dist::get_rank(), world = dist::get_world_size();

  // Each rank builds the model from its own seed: DDP's constructor broadcasts rank 0's weights.
  manual_seed(uint64_t(rank));
  auto model = models::gpt({.vocab_size = kVocab, .block_size = kLength, .n_layer = 2, .n_head = 2,
                            .n_embd = 32, .dropout = 0.0, .bias = true});
  auto ddp = std::make_shared<nn::DistributedDataParallel>(model);
  optim::AdamW optimizer(ddp->parameters(), {.lr = 3e-3, .weight_decay = 0.0});
  if (rank == 0)
    out << "DistributedDataParallel over " << world << " rank" << (world > 1 ? "s" : "") << " (gloo): "
        << model->num_parameters() << " parameters in " << ddp->buckets().size() << " gradient bucket"
        << (ddp->buckets().size() > 1 ? "s" : "") << "\n";

  manual_seed(1000 + uint64_t(rank));  // each rank its own data
  const int64_t steps = 150, batch = 32 / world;
  for (int64_t step = 1; step <= steps; ++step) {
    Tensor seq = make_sequences(batch);
    Tensor logits = ddp->forward(seq.narrow(1, 0, kLength));
    Tensor loss = cross_entropy(logits.reshape({-1, kVocab}), seq.narrow(1, 1, kLength).reshape({-1}));
    optimizer.zero_grad();
    loss.backward();  // gradients averaged over the ranks here
    optimizer.step();
    Tensor mean_loss = loss.detach().clone();
    dist::all_reduce(mean_loss, dist::ReduceOp::avg);
    if (rank == 0 && (step == 1 || step % 50 == 0))
      out << "step " << std::setw(3) << step << "  loss over all ranks " << fixed4(mean_loss.item<double>()) << "\n";
  }

  // Every replica took the same steps: the largest difference from rank 0's weights is zero.
  double largest = 0;
  for (const Tensor& p : model->parameters()) {
    Tensor mine = p.detach().clone(), reference = p.detach().clone();
    dist::broadcast(reference, 0);
    Tensor diff = (mine - reference).abs().max();
    dist::all_reduce(diff, dist::ReduceOp::max);
    largest = std::max(largest, diff.item<double>());
  }
  if (rank == 0) {
    out << "largest weight difference between replicas: " << largest << "\n";
    if (!launched) out << "on two ranks: kiln launch --nproc 2 build/examples/example_train_ddp\n";
  }
  dist::destroy_process_group();
}
