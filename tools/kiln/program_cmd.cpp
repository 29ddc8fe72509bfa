// `kiln export-info` and `kiln run` (program_cmd.h).
#include "program_cmd.h"

#include <filesystem>
#include <iostream>
#include <map>

#include "kiln/kiln.h"

namespace kiln::cli {

namespace {

constexpr const char* kRunUsage =
    "usage: kiln run PACKAGE --inputs IN.safetensors --out OUT.safetensors [--device cpu|cuda[:N]] "
    "[--no-bundled-binaries]\n";

}  // namespace

int run_export_info(const std::vector<std::string>& args) {
  if (args.size() != 1) {
    std::cerr << "usage: kiln export-info PACKAGE\n";
    return 2;
  }
  ExportedProgram p = load_program(args[0]);
  std::cout << "package " << args[0] << " (" << std::filesystem::file_size(args[0]) << " bytes)\n" << p.summary();
  return 0;
}

int run_program(const std::vector<std::string>& args) {
  std::string package, inputs_path, out_path, device;
  LoadOptions load;
  for (size_t i = 0; i < args.size(); ++i) {
    auto value = [&](const char* flag) -> std::string {
      if (i + 1 >= args.size()) throw ValueError(std::string("kiln run: ") + flag + " needs a value.\n" + kRunUsage);
      return args[++i];
    };
    if (args[i] == "--inputs") inputs_path = value("--inputs");
    else if (args[i] == "--out") out_path = value("--out");
    else if (args[i] == "--device") device = value("--device");
    else if (args[i] == "--no-bundled-binaries") load.bundled_binaries = false;
    else if (package.empty() && args[i].rfind("--", 0) != 0) package = args[i];
    else {
      std::cerr << "kiln run: unknown argument '" << args[i] << "'.\n" << kRunUsage;
      return 2;
    }
  }
  if (package.empty() || inputs_path.empty() || out_path.empty()) {
    std::cerr << kRunUsage;
    return 2;
  }
  ExportedProgram p = load_program(package, load);
  NamedTensors given = load_safetensors(inputs_path);
  std::map<std::string, Tensor> by_name(given.begin(), given.end());
  std::vector<Tensor> inputs;
  for (const TensorSpec& spec : p.inputs()) {
    auto it = by_name.find(spec.name);
    if (it == by_name.end()) {
      std::string names;
      for (const TensorSpec& s : p.inputs()) names += (names.empty() ? "" : ", ") + s.name;
      throw ValueError("kiln run: " + inputs_path + " has no tensor '" + spec.name + "'; the program's inputs are: " +
                       names + ".");
    }
    inputs.push_back(it->second.to(device.empty() ? spec.device : Device(device)));
  }
  std::vector<Tensor> outputs = p.run(inputs);
  NamedTensors named;
  for (size_t k = 0; k < outputs.size(); ++k) named.emplace_back(p.outputs()[k].name, outputs[k]);
  save_safetensors(out_path, named);
  std::cout << "ran '" << p.name() << "' on " << inputs.size() << " input" << (inputs.size() == 1 ? "" : "s") << "; wrote "
            << outputs.size() << " output" << (outputs.size() == 1 ? "" : "s") << " to " << out_path << "\n";
  return 0;
}

int run_minify(const std::vector<std::string>& args) {
  std::string repro, out;
  for (size_t i = 0; i < args.size(); ++i) {
    if (args[i] == "--out" && i + 1 < args.size()) out = args[++i];
    else if (repro.empty() && args[i].rfind("--", 0) != 0) repro = args[i];
    else {
      std::cerr << "usage: kiln minify REPRO.kpkg [--out SMALLEST.kpkg]\n";
      return 2;
    }
  }
  if (repro.empty()) {
    std::cerr << "usage: kiln minify REPRO.kpkg [--out SMALLEST.kpkg]\n";
    return 2;
  }
  std::cout << compiler::minify(repro, out).str();
  return 0;
}

}  // namespace kiln::cli
