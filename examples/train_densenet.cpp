// Training DenseNet-121 eagerly: one fixed random batch with random labels, Adam (lr 1e-3) and
// cross-entropy for 20 steps. The network memorises the batch, so the loss falls.
//
// Sizes: batch 16 of 3x128x128 images (about a second per step on two cores). With the
// environment variable KILN_EXAMPLE_QUICK=1 it trains on a batch of 4 images of 3x32x32 instead
// and prints the same lines; the tests set it, and examples/expected/train_densenet.txt holds the
// quick-mode output (losses after the first step as {num}: their later digits depend on
// summation order).
#include <kiln/kiln.h>

#include <cstdlib>
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

bool quick_mode() {
  const char* v = std::getenv("KILN_EXAMPLE_QUICK");
  return v != nullptr && std::string(v) == "1";
}

}  // namespace

KILN_EXAMPLE(train_densenet, 80, "Training DenseNet-121 with Adam") {
  const bool quick = quick_mode();
  const int64_t batch = quick ? 4 : 16, size = quick ? 32 : 128, steps = 20;
  manual_seed(0);

  auto model = models::densenet121({.num_classes = 10});
  model->train();
  int64_t num_params = 0;
  for (const Tensor& p : model->parameters()) num_params += p.numel();
  out << "DenseNet-121, " << num_params << " parameters; batch of " << batch << " images 3x"
      << size << "x" << size << ", 10 classes\n";

  // One fixed batch with random labels: the model has to memorise it.
  Tensor images = randn({batch, 3, size, size});
  Tensor labels = randint(10, {batch});

  optim::Adam optimizer(model->parameters(), {.lr = 1e-3});
  double first = 0.0, last = 0.0;
  for (int64_t step = 1; step <= steps; ++step) {
    optimizer.zero_grad();
    Tensor loss = nn::functional::cross_entropy(model->forward(images), labels);
    loss.backward();
    optimizer.step();
    last = loss.item<double>();
    if (step == 1) first = last;
    out << "step " << std::setw(2) << step << "  loss " << fixed4(last) << "\n";
  }
  out << "loss " << (last < first ? "fell" : "did not fall") << " from " << fixed4(first) << " to "
      << fixed4(last) << "\n";
}
