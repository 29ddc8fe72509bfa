// The torch.compile tutorial's DenseNet-121 graphs: the whole forward captured as one graph,
// printed by a custom backend, and compiled with fullgraph=true (it has no graph break).
//
// Sizes: a batch of 16 images 3x128x128; with KILN_EXAMPLE_QUICK=1 (set by the tests) 2 images
// 3x32x32. The graph has the same nodes at both sizes (only shapes in attributes differ);
// examples/expected/compile_tutorial_densenet.txt holds the quick-mode output. It is a separate
// example from compile_tutorial because its table runs to some 1,800 lines.
#include <kiln/kiln.h>

#include <cstdlib>
#include <string>
#include <utility>

#include "example.h"

using namespace kiln;

namespace {

}  // namespace

KILN_EXAMPLE(compile_tutorial_densenet, 31, "kiln::compile tutorial: DenseNet-121's captured graph") {
  const int64_t batch = examples::quick_mode() ? 2 : 16, image = examples::quick_mode() ? 32 : 128;
  compiler::reset();
  manual_seed(0);
  auto generate_data = [&](int64_t b) { return std::make_pair(randn({b, 3, image, image}), randint(1000, {b})); };
  auto init_model = [] { return models::densenet121(); };

  out << "--- A custom backend prints the captured graph ---\n";
  auto custom_backend = [&out](compiler::Graph& graph, const compiler::Arguments&) {
    out << "custom backend called with graph:\n";
    graph.print_tabular(out);
    return compiler::interpreter(graph);
  };
  {
    // Under no_grad: with autograd on, every value saved for the backward pass is a graph output
    // too, and the output row alone would be thousands of characters wide.
    NoGradGuard no_grad;
    auto opt_model = compile(init_model(), {.backend = custom_backend});
    opt_model(generate_data(batch).first);
  }

  out << "\n--- fullgraph=true: DenseNet-121's forward has no graph break ---\n";
  auto opt_model = compile(init_model(), {.fullgraph = true});
  out << opt_model(generate_data(batch).first) << "\n";
}
