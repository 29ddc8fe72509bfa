// Dynamic shapes: one compiled graph serves every batch size (docs/compiler.md, "Dynamic shapes").
// A function compiled with the default `dynamic` compiles static for the first batch size; the
// second size makes the batch dimension dynamic and compiles once more, and every later size
// reuses that graph: the kiln backend lowers it for the new size and finds its generated kernels,
// which take the sizes as arguments, in the kernel cache.
#include <kiln/kiln.h>

#include <iomanip>

#include "example.h"

using namespace kiln;

KILN_EXAMPLE(dynamic_shapes, 45, "Dynamic shapes: one compiled graph for every batch size") {
  manual_seed(0);
  Tensor w = randn({16, 8}), b = randn({8});
  auto model = [w, b](const Tensor& x) { return softmax(relu(matmul(x, w) + b), 1) * x.sum(1, true); };

  auto run = [&](const char* title, CompileOptions options) {
    out << "--- " << title << " ---\n";
    auto compiled = compile(model, options);
    compiler::Counters before = compiler::counters();
    bool all_match = true;
    for (int64_t batch = 2; batch <= 17; ++batch) {
      Tensor x = randn({batch, 16});
      all_match &= allclose(compiled(x), model(x), 1e-5, 1e-6);
      compiler::Counters now = compiler::counters();
      if (batch <= 4 || batch == 17) {
        out << "batch " << std::setw(2) << batch << ": graphs compiled " << now.graph_compiles - before.graph_compiles
            << ", new sizes of a dynamic graph " << now.size_specializations - before.size_specializations << "\n";
      } else if (batch == 5) {
        out << "...\n";
      }
    }
    out << "every result matches eager: " << (all_match ? "yes" : "no") << "\n\n";
  };
  run("dynamic unset (automatic dynamic, the default)", {});
  run("dynamic = true", {.dynamic = true});
  run("dynamic = false (a compile per size)", {.dynamic = false, .recompile_limit = 16});
}
