// The pass pipelines, top to bottom (pipeline.h says what the runner does with each line).
#include "compiler/graph/pipeline.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string_view>
#include <variant>

#include "compiler/capture/compile_trace.h"
#include "compiler/capture/runtime.h"
#include "compiler/graph/passes.h"
#include "kiln/error.h"

namespace kiln::compiler::passes {
namespace {

// Names a pipeline may run; each run() checks its name is here, so this list and the pipelines
// below cannot drift apart silently.
const std::vector<std::string> kPassNames = {
    "validate",
    "functionalize",
    "pool_before_pointwise_conv",
    "fuse_conv_bn",
    "fuse_batch_norm_relu",
    "fuse_gemm_epilogue",
    "channels_last_convolutions",
    "decompose",
    "functionalize_decompositions",
    "fold_constants",
    "eliminate_dead_code",
    "eliminate_common_subexpressions",
    "cat_into_slices",
    "test_miscompile",  // KILN_TEST_MISCOMPILE only (below)
};

// KILN_DISABLE_PASSES, read at each compile; unknown names throw.
std::vector<std::string> disabled_passes() {
  std::vector<std::string> out;
  const char* env = std::getenv("KILN_DISABLE_PASSES");
  if (!env) return out;
  std::string_view text(env);
  while (!text.empty()) {
    const size_t comma = text.find(',');
    std::string name(text.substr(0, comma));
    name.erase(0, name.find_first_not_of(' '));
    name.erase(name.find_last_not_of(' ') + 1);
    if (!name.empty()) {
      if (std::find(kPassNames.begin(), kPassNames.end(), name) == kPassNames.end()) {
        std::string valid;
        for (const auto& n : kPassNames) valid += (valid.empty() ? "" : ", ") + n;
        throw CompileError("[kiln::compile] KILN_DISABLE_PASSES names an unknown pass '" + name +
                           "'. Valid names: " + valid + ".");
      }
      out.push_back(std::move(name));
    }
    if (comma == std::string_view::npos) break;
    text.remove_prefix(comma + 1);
  }
  return out;
}

bool validate_after_each_pass() {
#ifndef NDEBUG
  return true;
#else
  const char* env = std::getenv("KILN_VALIDATE_PASSES");
  return env && *env && std::string_view(env) != "0";
#endif
}

// Runs the passes of one pipeline on one graph: skips, times, validates and logs each.
class PassRunner {
 public:
  explicit PassRunner(Graph& graph)
      : graph_(graph), disabled_(disabled_passes()), validate_(validate_after_each_pass()) {}

  template <class Pass>
  void run(const std::string& name, Pass&& pass) {
    KILN_CHECK(std::find(kPassNames.begin(), kPassNames.end(), name) != kPassNames.end(), Error,
               "[kiln::compile] the pipeline runs a pass '" + name + "' missing from kPassNames. This is a Kiln bug.");
    const bool log = detail::log_options().passes;
    if (std::find(disabled_.begin(), disabled_.end(), name) != disabled_.end()) {
      if (log) detail::log_stream() << "[kiln:passes] " << name << " skipped (KILN_DISABLE_PASSES)\n";
      if (detail::compile_trace_on()) detail::trace_event("pass", {{"name", name}, {"skipped", true}});
      return;
    }
    const size_t before = graph_.nodes.size();
    const auto start = std::chrono::steady_clock::now();
    pass(graph_);
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    if (validate_) {
      try {
        graph_.validate();
      } catch (const Error& e) {
        throw CompileError("[kiln::compile] the graph is invalid after the pass '" + name + "': " + e.what() +
                           "\nThis is a Kiln bug; KILN_DISABLE_PASSES=" + name + " skips the pass.");
      }
    }
    if (detail::compile_trace_on())
      detail::trace_event("pass", {{"name", name}, {"ms", ms}, {"nodes_before", before}, {"nodes_after", graph_.nodes.size()}});
    if (log) {
      char time[32];
      std::snprintf(time, sizeof time, "%.3f", ms);
      detail::log_stream() << "[kiln:passes] " << name << " " << time << " ms, " << before << " -> "
                           << graph_.nodes.size() << " nodes" << (validate_ ? " (validated)" : "") << "\n";
    }
  }

 private:
  Graph& graph_;
  std::vector<std::string> disabled_;
  bool validate_;
};

// KILN_TEST_MISCOMPILE=<op>: a deliberate miscompile, for testing the repro and minify tools
// (docs/export.md, "Repro and minify") against a known bug. Each node of <op> computes a different
// function of the same shape (tanh <-> sigmoid, sin <-> cos, exp -> expm1). Never set it otherwise.
const char* miscompiled_op() {
  const char* env = std::getenv("KILN_TEST_MISCOMPILE");
  return env && *env ? env : nullptr;
}

void test_miscompile(Graph& g) {
  static const std::pair<const char*, const char*> kSwaps[] = {
      {"tanh", "sigmoid"}, {"sigmoid", "tanh"}, {"sin", "cos"}, {"cos", "sin"}, {"exp", "expm1"}};
  const std::string target = miscompiled_op();
  const OpDef* wrong = nullptr;
  for (const auto& [from, to] : kSwaps)
    if (target == from) wrong = &internal::registered_op(to);
  KILN_CHECK(wrong != nullptr, CompileError,
             "[kiln::compile] KILN_TEST_MISCOMPILE=" + target + " is not one of tanh, sigmoid, sin, cos, exp.");
  for (Node& n : g.nodes)
    if (n.op->name == target && !n.inplace) n.op = wrong;
}

}  // namespace

void run_aot_eager_pipeline(Graph& graph) {
  PassRunner p(graph);
  p.run("validate", [](Graph& g) { g.validate(); });
  p.run("eliminate_dead_code", eliminate_dead_code);
  p.run("eliminate_common_subexpressions", eliminate_common_subexpressions);
}

void run_kiln_pipeline(Graph& graph, const PipelineOptions& options) {
  PassRunner p(graph);
  if (miscompiled_op()) p.run("test_miscompile", test_miscompile);
  p.run("functionalize", functionalize);
  p.run("pool_before_pointwise_conv", pool_before_pointwise_conv);
  p.run("fuse_conv_bn", fuse_conv_bn);
  p.run("fuse_batch_norm_relu", fuse_batch_norm_relu);
  p.run("fuse_gemm_epilogue", fuse_gemm_epilogue);
  if (options.layout_optimization) p.run("channels_last_convolutions", channels_last_convolutions);
  p.run("decompose", [](Graph& g) { decompose(g, decomposition_applies); });
  p.run("functionalize_decompositions", functionalize);  // decompositions write running statistics in place
  p.run("fold_constants", [](Graph& g) { fold_constants(g); });
  p.run("eliminate_dead_code", eliminate_dead_code);
  p.run("eliminate_common_subexpressions", eliminate_common_subexpressions);
  // Growing concatenations (DenseNet blocks) share one buffer: each input is copied into it once.
  // Last: the in-place copies fix the order of the nodes around them.
  p.run("cat_into_slices", cat_into_slices);
}

const std::vector<std::string>& pipeline_pass_names() { return kPassNames; }

}  // namespace kiln::compiler::passes
