// Running an exported program (docs/export.md): load the package export_resnet wrote and run it at
// two batch sizes. Nothing here knows ResNet: the program brings its graph, weights and kernels,
// and its kernels need no compiler on a machine like the one that exported it.
#include <kiln/kiln.h>

#include <map>

#include "example.h"

using namespace kiln;

KILN_EXAMPLE(run_exported, 51, "Running an exported program in another process") {
  ExportedProgram program = load_program("kiln_export_example/resnet18.kpkg");
  out << "loaded '" << program.name() << "' (dynamic dim: " << program.dynamic_dims()[0].name << ")\n";

  NamedTensors inputs = load_safetensors("kiln_export_example/inputs.safetensors");
  NamedTensors outputs = load_safetensors("kiln_export_example/outputs.safetensors");
  std::map<std::string, Tensor> expected(outputs.begin(), outputs.end());
  for (const auto& [name, x] : inputs) {
    Tensor logits = program.run({x})[0];
    out << name << " batch of " << x.size(0) << ": logits " << shape_str(logits.sizes())
        << ", equal to the exporting program's: " << (equal(logits, expected.at(name)) ? "yes" : "no") << "\n";
  }
  try {
    program.run({randn({3, 3, 64, 64})});
  } catch (const ValueError& e) {
    out << "a 64x64 image: " << e.what() << "\n";
  }
}
