// Exporting a model (docs/export.md): ResNet-18 captured as one graph with a dynamic batch, saved
// with its weights and kernels as one package file. The next example (run_exported) loads and runs
// it; built as two programs (example_export_resnet, then example_run_exported) that is another
// process with no access to this one's model, source or compiler:
//
//   ./example_export_resnet && PATH= ./example_run_exported
//
// Files go to ./kiln_export_example/: the package, two input batches, and this program's outputs
// for them (which run_exported compares with its own).
#include <kiln/kiln.h>

#include <filesystem>

#include "example.h"

using namespace kiln;

KILN_EXAMPLE(export_resnet, 50, "Exporting a model: one package with the graph, weights and kernels") {
  manual_seed(0);
  auto model = models::resnet18({.num_classes = 10});
  model->eval();  // inference: batch norm uses its running statistics

  ExportOptions options;
  options.dynamic = {{.arg = 0, .dim = 0, .name = "batch"}};
  ExportedProgram program = export_program(model, randn({2, 3, 32, 32}), options);

  out << "exported '" << program.name() << "': " << program.inputs().size() << " input, "
      << program.outputs().size() << " output, " << program.weights().size() << " weights\n";
  auto describe = [&](const TensorSpec& s) {
    std::string dims;
    for (const auto& d : s.dims) dims += (dims.empty() ? "" : ", ") + d;
    return s.name + " " + std::string(dtype_name(s.dtype)) + "[" + dims + "]";
  };
  out << "input:  " << describe(program.inputs()[0]) << "\n";
  out << "output: " << describe(program.outputs()[0]) << "\n";

  std::filesystem::create_directories("kiln_export_example");
  program.save("kiln_export_example/resnet18.kpkg");
  Tensor small = randn({3, 3, 32, 32}), large = randn({5, 3, 32, 32});
  save_safetensors("kiln_export_example/inputs.safetensors", {{"small", small}, {"large", large}});
  save_safetensors("kiln_export_example/outputs.safetensors",
                   {{"small", program.run({small})[0]}, {"large", program.run({large})[0]}});
  const auto bytes = std::filesystem::file_size("kiln_export_example/resnet18.kpkg");
  out << "wrote kiln_export_example/resnet18.kpkg (" << bytes / (1 << 20) << " MiB)\n";
}
