// The pass pipelines of the compile backends (DESIGN §2.5): what happens to a captured graph before
// it is scheduled, in order, one pass a line, in pipeline.cpp. Every pass runs through one runner
// that
//   - logs it under KILN_LOGS=passes (compiler::LogOptions::passes):
//       [kiln:passes] fuse_conv_bn 0.21 ms, 85 -> 83 nodes
//   - skips it when KILN_DISABLE_PASSES (comma-separated pass names, read at each compile) names
//     it, for bisecting a wrong result or a crash to one pass; an unknown name is a CompileError
//     that lists the valid ones. Skipping a pass the code generator relies on (functionalize) may
//     make the compile itself fail, with the generator's error;
//   - validates the graph after it (Graph::validate: every node's meta re-run) in debug builds, or
//     in any build under KILN_VALIDATE_PASSES=1, and names the pass when the graph broke.
// The passes' time together is the backend's share of compile_times().
#pragma once

#include <string>
#include <vector>

#include "kiln/compiler/graph.h"

namespace kiln::compiler::passes {

struct PipelineOptions {
  // Convolutions on channels-last activations (compile option "layout_optimization").
  bool layout_optimization = true;
};

// aot_eager: validation, then the clean-ups every backend builds on (the graph machinery without
// the code generator, to bisect a wrong result to the passes).
void run_aot_eager_pipeline(Graph& graph);

// kiln: functionalization, epilogue fusions and layout choice, decompositions into pointwise ops,
// clean-ups, and concatenation into slices; the scheduler takes the result.
void run_kiln_pipeline(Graph& graph, const PipelineOptions& options);

// The names of every pass the pipelines run, in pipeline order (what KILN_DISABLE_PASSES takes).
const std::vector<std::string>& pipeline_pass_names();

}  // namespace kiln::compiler::passes
