// interpreter(): runs a graph node by node through the eager dispatcher (the `eager` backend).
//
// Everything that does not change between calls is resolved when the interpreter is built: node
// input/output ids, attr templates, which attrs are scalar slots, and where each value is last
// used (its handle is dropped there, so intermediates free as early as in eager code). A call then
// only moves tensor handles around. Autograd was recorded at capture time, so nodes run under
// NoGradGuard, and with capture suspended so that they run instead of being captured again.
#include <atomic>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "compiler/capture/capture.h"
#include "compiler/graph/format.h"
#include "kiln/autograd.h"
#include "kiln/error.h"

namespace kiln::compiler {

namespace {

struct Step {
  const OpDef* op = nullptr;
  bool inplace = false;
  std::vector<int> inputs;                 // value ids; -1 is None
  std::vector<int> outputs;                // new values, or the in-place targets
  std::vector<Attr> attrs;                 // the node's attrs (slots hold the example value)
  std::vector<std::pair<int, int>> slots;  // (attr index, scalar index)
  std::vector<int> release;                // values last used here
};

struct Program {
  std::vector<Step> steps;
  std::vector<int> inputs;
  std::vector<int> outputs;
  size_t num_values = 0;
  size_t num_scalars = 0;
  std::vector<std::string> slot_names;  // "add_1.alpha", for errors
  std::vector<std::pair<int, Tensor>> constants;

  // One environment reused across calls; a concurrent (or reentrant) call allocates its own.
  std::atomic<bool> busy{false};
  std::vector<Tensor> env;
};

// A runtime scalar in the form the node's attr has (a double for a Scalar slot, ...).
Attr coerce(const Attr& example, const Attr& given, const Program& p, size_t slot) {
  if (std::optional<Attr> a = detail::scalar_in_kind_of(example, given)) return *a;
  throw CompileError("[kiln::compiler::interpreter] scalar " + std::to_string(slot) + " (" +
                     p.slot_names[slot] + ") got a value of the wrong kind (attr alternative " +
                     std::to_string(given.index()) + ", expected " +
                     std::to_string(example.index()) + "). Pass a number.");
}

std::shared_ptr<Program> build(const Graph& g) {
  auto p = std::make_shared<Program>();
  p->inputs = g.inputs;
  p->outputs = g.outputs;
  p->num_values = g.values.size();
  p->num_scalars = g.scalars.size();
  p->constants = g.constants;
  auto check_id = [&](int v, bool allow_none, const std::string& where) {
    if ((allow_none && v == -1) || (v >= 0 && static_cast<size_t>(v) < g.values.size())) return;
    throw CompileError("[kiln::compiler::interpreter] " + where + " refers to value " +
                       std::to_string(v) + ", but the graph has " +
                       std::to_string(g.values.size()) +
                       " values. Run graph.validate() to find the broken rewrite.");
  };
  for (int v : g.inputs) check_id(v, false, "a graph input");
  for (int v : g.outputs) check_id(v, false, "a graph output");
  for (const auto& c : g.constants) check_id(c.first, false, "a graph constant");

  std::vector<int> last_use(g.values.size(), -1);
  p->steps.reserve(g.nodes.size());
  for (size_t i = 0; i < g.nodes.size(); ++i) {
    const Node& n = g.nodes[i];
    if (!n.op)
      throw CompileError("[kiln::compiler::interpreter] node '" + n.name +
                         "' has no op. Run graph.validate() to find the broken rewrite.");
    Step s{.op = n.op,
           .inplace = n.inplace,
           .inputs = n.inputs,
           .outputs = n.outputs,
           .attrs = n.attrs};
    for (int v : n.inputs) check_id(v, true, "node '" + n.name + "'");
    for (int v : n.outputs) check_id(v, false, "node '" + n.name + "'");
    for (int v : n.inputs)
      if (v >= 0) last_use[v] = static_cast<int>(i);
    for (int v : n.outputs) last_use[v] = static_cast<int>(i);
    p->steps.push_back(std::move(s));
  }
  for (size_t k = 0; k < g.scalars.size(); ++k) {
    const ScalarSlot& slot = g.scalars[k];
    if (slot.node == -1 && slot.attr == -1) {  // unused: its node was erased
      p->slot_names.push_back("unused");
      continue;
    }
    if (slot.node < 0 || static_cast<size_t>(slot.node) >= g.nodes.size() || slot.attr < 0 ||
        static_cast<size_t>(slot.attr) >= g.nodes[slot.node].attrs.size())
      throw CompileError(
          "[kiln::compiler::interpreter] scalar slot " + std::to_string(k) + " names node " +
          std::to_string(slot.node) + " attr " + std::to_string(slot.attr) +
          ", which does not exist. Run graph.validate() to find the broken rewrite.");
    p->steps[slot.node].slots.emplace_back(slot.attr, static_cast<int>(k));
    std::vector<std::string> names = detail::attr_names(*g.nodes[slot.node].op);
    std::string attr = static_cast<size_t>(slot.attr) < names.size()
                           ? names[slot.attr]
                           : "attr" + std::to_string(slot.attr);
    p->slot_names.push_back(g.nodes[slot.node].name + "." + attr);
  }
  for (int v : g.outputs) last_use[v] = -1;  // outputs live to the end
  for (size_t v = 0; v < last_use.size(); ++v)
    if (last_use[v] >= 0) p->steps[last_use[v]].release.push_back(static_cast<int>(v));
  return p;
}

std::vector<Tensor> run(Program& p, const Arguments& args) {
  if (args.tensors.size() != p.inputs.size() || args.scalars.size() != p.num_scalars) {
    throw CompileError(
        "[kiln::compiler::interpreter] the graph takes " + std::to_string(p.inputs.size()) +
        " tensors and " + std::to_string(p.num_scalars) + " scalars, but got " +
        std::to_string(args.tensors.size()) + " tensors and " +
        std::to_string(args.scalars.size()) +
        " scalars. Pass one tensor per graph input and one value per scalar slot, in order.");
  }
  NoGradGuard no_grad;
  detail::SuspendCapture no_capture;

  std::vector<Tensor> local;
  const bool own = !p.busy.exchange(true, std::memory_order_acquire);
  std::vector<Tensor>& env = own ? p.env : local;
  // Drops every handle (also when a kernel throws) so that the cached env keeps nothing alive.
  struct Cleanup {
    Program& p;
    std::vector<Tensor>& env;
    bool own;
    ~Cleanup() {
      for (Tensor& t : env) t = Tensor();
      if (own) p.busy.store(false, std::memory_order_release);
    }
  } cleanup{p, env, own};
  env.resize(p.num_values);

  for (size_t k = 0; k < p.inputs.size(); ++k) env[p.inputs[k]] = args.tensors[k];
  for (const auto& [v, t] : p.constants) env[v] = t;
  std::vector<Tensor> targets;
  for (const Step& s : p.steps) {
    std::vector<Tensor> inputs;
    inputs.reserve(s.inputs.size());
    for (int v : s.inputs) inputs.push_back(v >= 0 ? env[v] : Tensor());
    std::vector<Attr> attrs = s.attrs;
    for (auto [attr, k] : s.slots) attrs[attr] = coerce(s.attrs[attr], args.scalars[k], p, k);
    if (s.inplace) {
      if (s.outputs.size() == 1) {
        call_op_out(*s.op, std::move(inputs), std::move(attrs),
                    std::span<Tensor>(&env[s.outputs[0]], 1));
      } else {
        targets.clear();
        for (int v : s.outputs) targets.push_back(env[v]);
        call_op_out(*s.op, std::move(inputs), std::move(attrs), targets);
      }
    } else {
      std::vector<Tensor> outs = call_op(*s.op, std::move(inputs), std::move(attrs));
      if (outs.size() != s.outputs.size()) {
        throw CompileError("[kiln::compiler::interpreter] op '" + s.op->name + "' returned " +
                           std::to_string(outs.size()) + " outputs but the graph records " +
                           std::to_string(s.outputs.size()) +
                           ". This is a capture bug; please report it.");
      }
      for (size_t k = 0; k < outs.size(); ++k) env[s.outputs[k]] = std::move(outs[k]);
    }
    for (int v : s.release) env[v] = Tensor();
  }

  std::vector<Tensor> result;
  result.reserve(p.outputs.size());
  for (int v : p.outputs) result.push_back(env[v]);
  return result;
}

}  // namespace

std::optional<Attr> detail::scalar_in_kind_of(const Attr& example, const Attr& given) {
  if (given.index() == example.index()) return given;
  auto number = [&]() -> std::optional<Scalar> {
    if (auto* s = std::get_if<Scalar>(&given)) return *s;
    if (auto* d = std::get_if<double>(&given)) return Scalar(*d);
    if (auto* i = std::get_if<int64_t>(&given)) return Scalar(*i);
    if (auto* b = std::get_if<bool>(&given)) return Scalar(*b);
    return std::nullopt;
  }();
  if (number) {
    if (std::holds_alternative<Scalar>(example)) return *number;
    if (std::holds_alternative<double>(example)) return number->to_double();
    if (std::holds_alternative<int64_t>(example)) return number->to_int();
    if (std::holds_alternative<bool>(example)) return number->to_bool();
  }
  return std::nullopt;
}

CompiledFn interpreter(Graph graph) {
  std::shared_ptr<Program> program = build(graph);
  return [program](const Arguments& args) { return run(*program, args); };
}

}  // namespace kiln::compiler
