// Repro packages (docs/export.md, "Repro and minify"): what KILN_REPRO writes when a backend fails
// to compile a graph (compile) or a compiled graph's first call disagrees with eager (accuracy),
// and what `kiln minify` reads. A repro package is a package file (package.h) with the sections
// repro.json (what failed, the backend, mode and options, the tolerance), graph.json (the graph,
// its scalars baked into its attrs), constants.safetensors and inputs.safetensors (the graph's
// inputs, before the failing call, as input_0, input_1, ...).
#pragma once

#include <map>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "kiln/compiler.h"

namespace kiln::compiler::exporting {

enum class ReproMode { off, compile, accuracy };

// KILN_REPRO, read on every call: unset or empty -> off; "compile"; "accuracy". Anything else
// throws CompileError listing the values.
ReproMode repro_mode();

// The tolerance an accuracy check uses for a dtype (as torch's repro_tolerance, 1e-3, for
// float32 and wider; 1e-2 for the 16-bit floats).
double repro_tolerance(DType t);

struct ReproCase {
  std::string kind;     // "compile" or "accuracy"
  std::string backend;  // a registered backend name
  std::optional<Mode> mode;
  std::map<std::string, OptionValue> options;
  std::string failure;  // the error text, or which output differed
  Graph graph;          // scalars baked into attrs (graph.scalars is empty)
  std::vector<Tensor> inputs;
};

// Writes `c` to `path`, or when empty to a new file in $KILN_REPRO_DIR (default ./kiln_repro,
// created 0700 when missing), and returns the path.
std::string write_repro(const ReproCase& c, std::string path = "");
// Reads a repro package (every check of load_program's container and graph loader).
ReproCase read_repro(const std::string& path);

// The graph with the call's scalar values written into their attrs and no scalar slots.
Graph with_scalars_baked(const Graph& g, std::span<const Attr> scalars);

// KILN_REPRO=accuracy: `fn` with its first call checked against the eager interpreter on copies
// of the same inputs; a mismatch writes a repro package and logs where. `label` names the graph;
// `options` are the compile's (the repro records its mode and options).
CompiledFn accuracy_checked(CompiledFn fn, const Graph& graph, std::string backend, std::string label,
                            const CompileOptions& options);

// The first output of `actual` that differs from `expected` beyond repro_tolerance, described
// ("output 2 (f32[4, 8]): max abs diff 0.31 at tolerance 0.001"); nullopt when all agree.
std::optional<std::string> first_mismatch(const std::vector<Tensor>& actual, const std::vector<Tensor>& expected);

}  // namespace kiln::compiler::exporting
