// kiln::compiler::minify (kiln/export.h): shrinks a repro package by delta debugging to the
// smallest graph that still fails, then names the pass that broke it by running the pipeline
// with each pass disabled (KILN_DISABLE_PASSES).
//
// A candidate keeps a subset of the nodes, in order. A value a kept node reads but no kept node
// makes becomes a placeholder holding what that value held when the first kept node that touches
// it ran in the original graph (an op-by-op run records it). Every value a kept node makes and no
// kept node reads is an output, so nothing a kept node computes goes unchecked. "Still fails"
// means: for a compile repro, compiling or running throws; for an accuracy repro, compiling and
// running succeeds and some output differs from eager's beyond the repro tolerance.
#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <sstream>

#include "compiler/capture/capture.h"
#include "compiler/capture/runtime.h"
#include "compiler/export/package.h"
#include "compiler/export/program.h"
#include "compiler/export/repro.h"
#include "compiler/graph/passes.h"
#include "compiler/graph/pipeline.h"
#include "kiln/autograd.h"
#include "kiln/compiler/serialize.h"
#include "kiln/export.h"
#include "kiln/io.h"

namespace kiln::compiler {

namespace {

using exporting::ReproCase;

// The values each node's inputs held just before it ran, from one op-by-op run of the graph.
std::vector<std::vector<Tensor>> record_inputs(const Graph& g, const std::vector<Tensor>& inputs) {
  NoGradGuard no_grad;
  detail::SuspendCapture no_capture;
  std::vector<Tensor> env(g.values.size());
  for (size_t k = 0; k < g.inputs.size(); ++k) env[g.inputs[k]] = kiln::detail::copy_with_layout(inputs[k], g.values[g.inputs[k]]);
  for (const auto& [v, t] : g.constants) env[v] = t;
  std::vector<std::vector<Tensor>> seen(g.nodes.size());
  for (size_t i = 0; i < g.nodes.size(); ++i) {
    const Node& n = g.nodes[i];
    std::vector<Tensor> args;
    for (int v : n.inputs) {
      args.push_back(v >= 0 ? env[v] : Tensor());
      seen[i].push_back(v >= 0 && env[v].defined() ? kiln::detail::copy_with_layout(env[v], g.values[v]) : Tensor());
    }
    for (int v : n.outputs)  // an in-place target's value before the write
      seen[i].push_back(n.inplace && env[v].defined() ? kiln::detail::copy_with_layout(env[v], g.values[v]) : Tensor());
    if (n.inplace) {
      std::vector<Tensor> targets;
      for (int v : n.outputs) targets.push_back(env[v]);
      call_op_out(*n.op, std::move(args), n.attrs, targets);
    } else {
      std::vector<Tensor> outs = call_op(*n.op, std::move(args), n.attrs);
      for (size_t k = 0; k < outs.size() && k < n.outputs.size(); ++k) env[n.outputs[k]] = std::move(outs[k]);
    }
  }
  return seen;
}

struct Candidate {
  Graph graph;
  std::vector<Tensor> inputs;
  std::vector<int> origin;  // per node of `graph`: its index in the original graph
};

// The graph of the kept nodes (sorted indices into g.nodes).
std::optional<Candidate> subgraph(const Graph& g, const std::vector<std::vector<Tensor>>& seen, const std::vector<int>& keep) {
  Candidate c;
  Graph& out = c.graph;
  std::vector<int> map(g.values.size(), -1);
  int next_group = 0;
  auto placeholder = [&](int v, const Tensor& t) {
    if (!t.defined()) return false;
    ValueInfo info = g.values[v];
    info.storage = next_group++;
    map[v] = out.add_input(info);
    c.inputs.push_back(t);
    return true;
  };
  std::set<int> made;  // original values a kept node made
  for (int i : keep) {
    const Node& n = g.nodes[i];
    std::vector<int> inputs;
    for (size_t k = 0; k < n.inputs.size(); ++k) {
      const int v = n.inputs[k];
      if (v < 0) {
        inputs.push_back(-1);
        continue;
      }
      if (map[v] < 0 && !placeholder(v, seen[i][k])) return std::nullopt;
      inputs.push_back(map[v]);
    }
    if (n.inplace)
      for (size_t k = 0; k < n.outputs.size(); ++k) {
        const int v = n.outputs[k];
        if (map[v] < 0 && !placeholder(v, seen[i][n.inputs.size() + k])) return std::nullopt;
      }
    Node& copy = out.add_node(*n.op, inputs, n.attrs);
    copy.inplace = n.inplace;
    c.origin.push_back(i);
    for (int v : n.outputs) {
      if (n.inplace) {
        copy.outputs.push_back(map[v]);
        continue;
      }
      ValueInfo info = g.values[v];
      info.is_input = false;
      info.storage = n.is_view() && !inputs.empty() && inputs[0] >= 0 ? out.values[inputs[0]].storage : next_group++;
      map[v] = out.add_value(info);
      copy.outputs.push_back(map[v]);
      made.insert(v);
    }
  }
  // Outputs: what the kept nodes make that no kept node reads, plus the original outputs among them.
  std::set<int> read;
  for (int i : keep)
    for (int v : g.nodes[i].inputs) read.insert(v);
  for (int v : made)
    if (!read.count(v) || std::find(g.outputs.begin(), g.outputs.end(), v) != g.outputs.end()) out.outputs.push_back(map[v]);
  if (out.outputs.empty()) return std::nullopt;
  try {
    out.validate();
  } catch (const Error&) {
    return std::nullopt;
  }
  return c;
}

enum class Outcome { fails, passes, other_error };

struct Tester {
  const ReproCase& repro;
  int tests = 0;
  std::string last_failure;

  Outcome run(const Graph& g, const std::vector<Tensor>& inputs) {
    ++tests;
    CompileOptions options;
    options.mode = repro.mode;
    options.options = repro.options;
    detail::CompilingOptionsScope scope(&options);
    std::vector<Tensor> compiled_inputs, eager_inputs;
    for (size_t k = 0; k < inputs.size(); ++k) {
      compiled_inputs.push_back(kiln::detail::copy_with_layout(inputs[k], g.values[g.inputs[k]]));
      eager_inputs.push_back(kiln::detail::copy_with_layout(inputs[k], g.values[g.inputs[k]]));
    }
    std::vector<Tensor> results;
    try {
      Graph working = g;
      CompiledFn fn = lookup_backend(repro.backend)(working, Arguments{compiled_inputs, {}});
      NoGradGuard no_grad;
      detail::SuspendCapture no_capture;
      results = fn(Arguments{compiled_inputs, {}});
    } catch (const std::exception& e) {
      last_failure = e.what();
      return repro.kind == "compile" ? Outcome::fails : Outcome::other_error;
    }
    if (repro.kind == "compile") return Outcome::passes;
    std::vector<Tensor> expected;
    try {
      expected = interpreter(g)(Arguments{eager_inputs, {}});
    } catch (const std::exception&) {
      return Outcome::other_error;
    }
    std::optional<std::string> mismatch = exporting::first_mismatch(results, expected);
    if (mismatch) last_failure = *mismatch;
    return mismatch ? Outcome::fails : Outcome::passes;
  }
};

// Zeller's ddmin over the node indices: the smallest subset found that still fails.
std::vector<int> ddmin(std::vector<int> items, const std::function<bool(const std::vector<int>&)>& fails) {
  size_t n = 2;
  while (items.size() >= 2) {
    const size_t chunk = (items.size() + n - 1) / n;
    std::vector<std::vector<int>> parts;
    for (size_t start = 0; start < items.size(); start += chunk)
      parts.emplace_back(items.begin() + start, items.begin() + std::min(items.size(), start + chunk));
    bool reduced = false;
    for (const auto& part : parts)
      if (fails(part)) {
        items = part;
        n = 2;
        reduced = true;
        break;
      }
    if (!reduced && parts.size() > 2)  // (with two parts, the complements are the parts)
      for (size_t p = 0; p < parts.size() && !reduced; ++p) {
        std::vector<int> rest;
        for (size_t q = 0; q < parts.size(); ++q)
          if (q != p) rest.insert(rest.end(), parts[q].begin(), parts[q].end());
        if (fails(rest)) {
          items = std::move(rest);
          n = std::max<size_t>(n - 1, 2);
          reduced = true;
        }
      }
    if (!reduced) {
      if (n >= items.size()) break;
      n = std::min(items.size(), n * 2);
    }
  }
  return items;
}

// Sets KILN_DISABLE_PASSES while alive.
class DisablePass {
 public:
  explicit DisablePass(const std::string& name) {
    if (const char* old = std::getenv("KILN_DISABLE_PASSES")) old_ = old;
    const std::string value = old_ && !old_->empty() ? *old_ + "," + name : name;
    ::setenv("KILN_DISABLE_PASSES", value.c_str(), 1);
  }
  ~DisablePass() {
    if (old_) ::setenv("KILN_DISABLE_PASSES", old_->c_str(), 1);
    else ::unsetenv("KILN_DISABLE_PASSES");
  }

 private:
  std::optional<std::string> old_;
};

}  // namespace

std::string MinifyResult::str() const {
  std::ostringstream os;
  os << "kiln minify: " << (kind == "accuracy" ? "an " : "a ") << kind << " failure, " << original_nodes << " nodes -> " << graph.nodes.size() << " ("
     << tests << " graphs tried)\n";
  os << "failure: " << failure << "\n";
  os << "failing op: " << (failing_op.empty() ? "(none found)" : failing_op) << "\n";
  if (breaking_passes.empty()) {
    os << "pass that broke it: none alone (with each pass disabled it still fails: look at lowering and code "
          "generation)\n";
  } else {
    os << "pass that broke it: ";
    for (size_t i = 0; i < breaking_passes.size(); ++i) os << (i ? ", " : "") << breaking_passes[i];
    os << " (with KILN_DISABLE_PASSES=" << breaking_passes[0] << " the graph " << (kind == "compile" ? "compiles" : "is correct")
       << ")\n";
  }
  if (!minimized_path.empty()) os << "the smallest graph, as a repro package: " << minimized_path << "\n";
  const std::string text = graph.str();
  os << "graph:\n" << text << (text.empty() || text.back() != '\n' ? "\n" : "");
  return os.str();
}

MinifyResult minify(const std::string& repro_path, const std::string& out_path) {
  ReproCase repro = exporting::read_repro(repro_path);
  lookup_backend(repro.backend);  // "Invalid backend" now: a custom backend must be registered here
  Tester tester{repro};
  const Graph& g = repro.graph;
  KILN_CHECK(tester.run(g, repro.inputs) == Outcome::fails, CompileError,
             "[kiln::compiler::minify] " + repro_path + ": the graph does not fail here (" +
                 (repro.kind == "compile" ? std::string("it compiles and runs") : std::string("it agrees with eager")) +
                 "), so there is nothing to minify. The original failure was: " + repro.failure);
  const std::vector<std::vector<Tensor>> seen = record_inputs(g, repro.inputs);

  std::optional<Candidate> best;
  auto fails = [&](const std::vector<int>& keep) {
    std::optional<Candidate> c = subgraph(g, seen, keep);
    if (!c || tester.run(c->graph, c->inputs) != Outcome::fails) return false;
    best = std::move(c);
    return true;
  };
  std::vector<int> all(g.nodes.size());
  for (size_t i = 0; i < all.size(); ++i) all[i] = static_cast<int>(i);
  std::vector<int> kept = ddmin(all, fails);
  if (!best || best->origin != kept) {  // ddmin ended on the whole graph: use it as a candidate
    best = subgraph(g, seen, kept);
    if (!best) best = Candidate{g, repro.inputs, all};
  }

  MinifyResult result;
  result.kind = repro.kind;
  result.original_nodes = static_cast<int>(g.nodes.size());
  result.graph = best->graph;
  tester.run(best->graph, best->inputs);
  result.failure = tester.last_failure;
  // The failing op: the node that makes the first output that differs (accuracy), else every op.
  if (repro.kind == "accuracy") {
    const std::string& f = result.failure;
    if (f.rfind("output ", 0) == 0) {
      const size_t k = std::stoul(f.substr(7));
      if (k < best->graph.outputs.size()) {
        const int v = best->graph.outputs[k];
        for (const Node& n : best->graph.nodes)
          if (std::find(n.outputs.begin(), n.outputs.end(), v) != n.outputs.end())
            result.failing_op = n.op->name + " (node %" + n.name + ")";
      }
    }
  }
  if (result.failing_op.empty()) {
    std::set<std::string> ops;
    for (const Node& n : best->graph.nodes) ops.insert(n.op->name);
    for (const auto& op : ops) result.failing_op += (result.failing_op.empty() ? "" : ", ") + op;
  }
  // The pass that broke it: with that pass disabled, the smallest graph compiles (and is right).
  for (const std::string& pass : passes::pipeline_pass_names()) {
    if (pass == "validate") continue;
    DisablePass off(pass);
    if (tester.run(best->graph, best->inputs) == Outcome::passes) result.breaking_passes.push_back(pass);
  }
  result.tests = tester.tests;
  if (!out_path.empty()) {
    ReproCase small = repro;
    small.graph = best->graph;
    small.inputs = best->inputs;
    small.failure = result.failure;
    result.minimized_path = exporting::write_repro(small, out_path);
  }
  return result;
}

}  // namespace kiln::compiler
