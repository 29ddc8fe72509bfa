// Decomposition: a node of a composite op becomes the graph traced from its decomposition
// (passes/decompositions.cpp), spliced in its place.
//
// Splicing: the traced graph's placeholders are the node's tensor inputs; its host scalars become
// constants of the graph; its other values are renumbered into new values; uses of the node's
// outputs read the traced outputs. Attrs are baked into the trace, except the float attrs the
// decomposition takes as tensors (Decomposition::scalar_attrs): a run-time scalar slot on one of
// those moves to a node `add(0, 1, alpha=slot)` that makes the value a 0-dim tensor, so the
// compiled graph still follows the value passed at run time; a static one becomes a constant.
#include <algorithm>
#include <cstring>
#include <map>
#include <mutex>
#include <optional>
#include <tuple>
#include <unordered_map>

#include "compiler/capture/capture.h"
#include "compiler/graph/format.h"
#include "compiler/graph/passes.h"
#include "kiln/autograd.h"
#include "kiln/error.h"
#include "kiln/ops.h"

namespace kiln::compiler::passes {

namespace {

using internal::valid;

// A float attr's value (a double, or a Scalar holding a number).
std::optional<double> number_of(const Attr& a) {
  if (auto* d = std::get_if<double>(&a)) return *d;
  if (auto* s = std::get_if<Scalar>(&a)) return s->to_double();
  if (auto* i = std::get_if<int64_t>(&a)) return static_cast<double>(*i);
  return std::nullopt;
}

// A scalar constant's identity: its value's bits (so -0.0 and NaNs stay apart) and its device.
using ConstantKey = std::tuple<uint64_t, int, int>;
ConstantKey constant_key(double value, Device device) {
  uint64_t bits = 0;
  std::memcpy(&bits, &value, sizeof(bits));
  return {bits, static_cast<int>(device.type), device.index};
}

// The 0-dim float64 tensor `value` on `device`, one per value and device for the process: graphs
// compiled side by side share them (nothing writes a constant), so that on a GPU they do not each
// hold allocator blocks of the same 0s and 1s.
Tensor scalar_constant(double value, Device device) {
  const ConstantKey key = constant_key(value, device);
  static std::mutex mutex;
  static auto* shared = new std::map<ConstantKey, Tensor>;  // leaked: may outlive CUDA
  std::lock_guard lock(mutex);
  if (auto it = shared->find(key); it != shared->end()) return it->second;
  kiln::compiler::detail::SuspendCapture no_capture;
  NoGradGuard no_grad;
  Tensor t = kiln::full({}, value, TensorOptions(DType::float64, device));
  if (shared->size() < 4096) shared->emplace(key, t);  // a bound for programs baking many values
  return t;
}

ValueInfo scalar_info(Device device) {
  ValueInfo v;
  v.dtype = DType::float64;
  v.device = device;
  return v;
}

// Splices decompositions into a new node list; see decompose().
class Splicer {
 public:
  Splicer(Graph& g, std::vector<Node>& out) : g_(g), out_(out), namer_(g) {}

  // Appends the decomposition of `n` to the node list and records the renaming of its outputs.
  // `slots[a]` is the scalar slot on attr a (-1: none). Returns false (nothing appended) when it
  // does not apply; the caller keeps the node.
  bool splice(const Node& n, const lowering::Decomposition& d, const std::vector<int>& slots) {
    for (size_t a = 0; a < slots.size(); ++a)
      if (slots[a] >= 0 && std::find(d.scalar_attrs.begin(), d.scalar_attrs.end(), a) == d.scalar_attrs.end())
        return false;  // a run-time scalar the decomposition would bake in
    std::vector<double> scalar_values;
    for (int a : d.scalar_attrs) {
      if (a < 0 || static_cast<size_t>(a) >= n.attrs.size()) return false;
      std::optional<double> v = number_of(n.attrs[a]);
      if (!v) return false;
      scalar_values.push_back(*v);
    }
    if (n.outputs.empty() || !valid(g_, n.outputs[0])) return false;
    const Device device = g_.values[n.outputs[0]].device;

    // Trace: the defined tensor inputs, then one 0-dim tensor per scalar attr.
    std::vector<ValueInfo> infos;
    std::vector<int> positions;  // node input index of each traced tensor input
    for (size_t k = 0; k < n.inputs.size(); ++k) {
      int v = n.inputs[k];
      if (v == -1) continue;
      if (!valid(g_, v)) return false;
      ValueInfo info = g_.values[v];
      info.name.clear();
      info.is_input = true;
      infos.push_back(std::move(info));
      positions.push_back(static_cast<int>(k));
    }
    const size_t num_tensors = infos.size();
    for (size_t j = 0; j < scalar_values.size(); ++j) infos.push_back(scalar_info(device));
    bool declined = false;
    Graph t;
    try {
      t = kiln::compiler::detail::trace_graph(infos, [&](const std::vector<Tensor>& args) {
        std::vector<Tensor> inputs(n.inputs.size());
        for (size_t k = 0; k < num_tensors; ++k) inputs[positions[k]] = args[k];
        OpCall call(n.op, inputs, n.attrs);
        std::vector<Tensor> result =
            d.fn(call, std::span<const Tensor>(args.data() + num_tensors, scalar_values.size()));
        declined = result.empty();
        return result;
      });
    } catch (const std::exception&) {
      return false;  // the decomposition rejects these inputs: the op's own kernel handles them
    }
    if (declined || !acceptable(n, t)) return false;

    std::vector<int> map(t.values.size(), -1);
    for (size_t k = 0; k < num_tensors; ++k) map[t.inputs[k]] = n.inputs[positions[k]];
    const std::vector<int> traced_uses = t.use_counts();
    for (size_t j = 0; j < scalar_values.size(); ++j) {
      int slot = slots.size() > static_cast<size_t>(d.scalar_attrs[j]) ? slots[d.scalar_attrs[j]] : -1;
      int traced = t.inputs[num_tensors + j];
      if (traced_uses[traced] == 0) {  // not read here (momentum in evaluation)
        if (slot >= 0) unused_.push_back(slot);
        continue;
      }
      map[traced] = materialize(scalar_values[j], device, slot);
    }
    for (const auto& [v, tensor] : t.constants) {
      map[v] = new_value(t.values[v]);
      g_.constants.emplace_back(map[v], tensor);
    }
    for (const Node& tn : t.nodes) {
      Node& m = out_.emplace_back();
      m.op = tn.op;
      m.attrs = tn.attrs;  // the trace's own scalar slots hold the values it was traced with
      m.inplace = tn.inplace;
      m.name = namer_(tn.op->name);
      for (int v : tn.inputs) m.inputs.push_back(v == -1 ? -1 : map[v]);
      for (int v : tn.outputs) {
        if (!tn.inplace) map[v] = new_value(t.values[v]);
        m.outputs.push_back(map[v]);
      }
    }
    for (size_t k = 0; k < n.outputs.size(); ++k) rename_[n.outputs[k]] = map[t.outputs[k]];
    return true;
  }

  // Applies the output renaming to every node and the graph outputs.
  void finish(std::vector<Node>& nodes) {
    if (rename_.empty()) return;
    auto apply = [&](int& v) {
      auto it = rename_.find(v);
      if (it != rename_.end()) v = it->second;
    };
    for (Node& m : nodes) {
      for (int& v : m.inputs) apply(v);
      if (m.inplace)
        for (int& v : m.outputs) apply(v);
    }
    for (int& v : g_.outputs) apply(v);
  }

  // Scalar slots moved to materializing nodes: (slot index, node index in the new list).
  const std::vector<std::pair<int, int>>& moved_slots() const { return moved_; }
  // Scalar slots of decomposed nodes that their decomposition does not read.
  const std::vector<int>& unused_slots() const { return unused_; }

 private:
  // The traced outputs stand for the node's: one fresh, distinct buffer each, with the recorded
  // metadata; in-place writes only into intermediates or into the inputs the op mutates.
  bool acceptable(const Node& n, const Graph& t) const {
    if (t.outputs.size() != n.outputs.size()) return false;
    std::vector<int> producer(t.values.size(), -1);
    for (size_t i = 0; i < t.nodes.size(); ++i) {
      const Node& tn = t.nodes[i];
      if (tn.inplace) {
        for (int v : tn.outputs) {
          auto in = std::find(t.inputs.begin(), t.inputs.end(), v);
          if (in == t.inputs.end()) continue;
          // Map the placeholder back to the node input it stands for.
          size_t k = in - t.inputs.begin();
          int pos = -1;
          for (size_t j = 0, seen = 0; j < n.inputs.size(); ++j) {
            if (n.inputs[j] == -1) continue;
            if (seen++ == k) pos = static_cast<int>(j);
          }
          const std::vector<int> mutated = n.op->mutated_input_indices(n.inputs.size(), n.attrs);
          if (pos < 0 || std::find(mutated.begin(), mutated.end(), pos) == mutated.end()) return false;
        }
        continue;
      }
      for (int v : tn.outputs)
        if (v >= 0 && static_cast<size_t>(v) < producer.size()) producer[v] = tn.is_view() ? -2 : static_cast<int>(i);
    }
    for (size_t k = 0; k < t.outputs.size(); ++k) {
      int v = t.outputs[k];
      if (v < 0 || static_cast<size_t>(v) >= t.values.size() || producer[v] < 0) return false;
      if (std::count(t.outputs.begin(), t.outputs.end(), v) != 1) return false;
      const ValueInfo& want = g_.values[n.outputs[k]];
      const ValueInfo& got = t.values[v];
      if (got.sizes != want.sizes || got.dtype != want.dtype || got.device != want.device) return false;
    }
    return true;
  }

  int new_value(const ValueInfo& traced) {
    ValueInfo v = traced;
    v.name.clear();
    v.is_input = false;
    v.storage = -1;  // refresh_layouts assigns groups
    return g_.add_value(std::move(v));
  }

  // A 0-dim float64 value holding `value`: a constant, or with a slot a node computing 0 + 1 * s
  // (exact) so that the run-time scalar keeps reaching the graph.
  int materialize(double value, Device device, int slot) {
    if (slot < 0) return constant(value, device);
    const int zero = constant(0.0, device), one = constant(1.0, device);
    static const OpDef* add = OpTable::instance().find("add");
    Node& m = out_.emplace_back();
    m.op = add;
    m.inputs = {zero, one};
    m.attrs = {Scalar(value)};
    m.name = namer_("add");
    int v = g_.add_value(scalar_info(device));
    m.outputs = {v};
    moved_.emplace_back(slot, static_cast<int>(out_.size()) - 1);
    return v;
  }

  // The 0-dim float64 constant `value` on `device`, one per value and device for the whole graph:
  // each is a tensor the compiled graph holds, and on a GPU every one takes an allocator block
  // (DenseNet-121's 121 batch norms made 242 blocks of 512 bytes of 0s and 1s).
  int constant(double value, Device device) {
    auto [it, fresh] = constants_.try_emplace(constant_key(value, device), -1);
    if (fresh) {
      it->second = g_.add_value(scalar_info(device));
      g_.constants.emplace_back(it->second, scalar_constant(value, device));
    }
    return it->second;
  }

  Graph& g_;
  std::vector<Node>& out_;
  std::map<ConstantKey, int> constants_;  // graph value of each constant
  internal::NodeNamer namer_;
  std::unordered_map<int, int> rename_;
  std::vector<std::pair<int, int>> moved_;
  std::vector<int> unused_;
};

}  // namespace

namespace internal {

NodeNamer::NodeNamer(const Graph& g) {
  for (const Node& n : g.nodes) taken_.push_back(n.name);
  for (int v : g.inputs)
    if (valid(g, v)) taken_.push_back(g.values[v].name);
}

std::string NodeNamer::operator()(std::string_view op_name) {
  std::string base = kiln::compiler::detail::identifier_from(op_name);
  auto it = largest_.find(base);
  if (it == largest_.end()) {
    int64_t largest = -1;
    for (const std::string& name : taken_)
      largest = std::max(largest, kiln::compiler::detail::suffix_after(name, base));
    it = largest_.emplace(base, largest).first;
  }
  int64_t k = ++it->second;
  return k == 0 ? base : base + "_" + std::to_string(k);
}

}  // namespace internal

std::set<std::string> decomposable_ops() {
  std::set<std::string> names;
  for (const OpDef* op : OpTable::instance().all())
    if (std::holds_alternative<lowering::Decomposition>(op->lowering)) names.insert(op->name);
  return names;
}

bool decomposition_applies(const Node& n) {
  const auto* d = n.op ? std::get_if<lowering::Decomposition>(&n.op->lowering) : nullptr;
  return d && (!d->applies || d->applies(n.attrs));
}

void decompose(Graph& g, const std::function<bool(const Node&)>& filter) {
  const int num_nodes = static_cast<int>(g.nodes.size());
  std::vector<std::vector<int>> slots(num_nodes);  // per node: slot index per attr, -1 if none
  for (size_t k = 0; k < g.scalars.size(); ++k) {
    const ScalarSlot& s = g.scalars[k];
    if (s.node < 0 || s.node >= num_nodes || s.attr < 0) continue;
    if (slots[s.node].size() <= static_cast<size_t>(s.attr)) slots[s.node].resize(s.attr + 1, -1);
    slots[s.node][s.attr] = static_cast<int>(k);
  }

  std::vector<Node> out;
  out.reserve(g.nodes.size());
  std::vector<int> new_index(num_nodes, -1);
  Splicer splicer(g, out);
  for (int i = 0; i < num_nodes; ++i) {
    Node& n = g.nodes[i];
    const auto* d = n.op && !n.inplace && (!filter || filter(n)) ? std::get_if<lowering::Decomposition>(&n.op->lowering)
                                                                 : nullptr;
    if (d && splicer.splice(n, *d, slots[i])) continue;
    new_index[i] = static_cast<int>(out.size());
    out.push_back(std::move(n));
  }
  splicer.finish(out);
  for (ScalarSlot& s : g.scalars)
    if (s.node >= 0 && s.node < num_nodes) s.node = new_index[s.node];  // spliced: set below
  for (auto [slot, node] : splicer.moved_slots()) g.scalars[slot] = {node, 0};
  for (int slot : splicer.unused_slots()) g.scalars[slot] = {-1, -1};
  g.nodes = std::move(out);
  refresh_layouts(g);
}

}  // namespace kiln::compiler::passes
