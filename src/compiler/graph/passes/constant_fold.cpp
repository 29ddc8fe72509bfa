// Constant folding: nodes computable when the graph is compiled run once, and their results
// become Graph::constants (see passes.h for what is never folded).
#include <map>
#include <numeric>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "compiler/capture/capture.h"
#include "compiler/graph/format.h"
#include "compiler/graph/passes.h"
#include "kiln/autograd.h"
#include "kiln/detail/tensor_impl.h"
#include "kiln/error.h"

namespace kiln::compiler::passes {

namespace {

bool valid(const Graph& g, int v) { return v >= 0 && static_cast<size_t>(v) < g.values.size(); }

// Draws fresh numbers per call (as CSE decides it).
bool is_random(const OpDef& op) {
  if (!op.runtime_attrs.empty()) return true;
  for (const kiln::compiler::detail::SchemaParam& p : kiln::compiler::detail::parse_schema_params(op.schema))
    if (p.name == "seed") return true;
  return false;
}

// Values that share memory: the recorded storage groups, joined through view nodes.
class AliasGroups {
 public:
  explicit AliasGroups(const Graph& g) : parent_(g.values.size()) {
    std::iota(parent_.begin(), parent_.end(), 0);
    std::unordered_map<int, int> first_of_storage;
    for (size_t v = 0; v < g.values.size(); ++v) {
      int s = g.values[v].storage;
      if (s < 0) continue;
      auto [it, inserted] = first_of_storage.emplace(s, static_cast<int>(v));
      if (!inserted) join(it->second, static_cast<int>(v));
    }
    for (const Node& n : g.nodes)
      if (n.is_view() && !n.inputs.empty() && valid(g, n.inputs[0]))
        for (int v : n.outputs)
          if (valid(g, v)) join(v, n.inputs[0]);
  }
  int find(int v) {
    while (parent_[v] != v) v = parent_[v] = parent_[parent_[v]];
    return v;
  }

 private:
  void join(int a, int b) { parent_[find(a)] = find(b); }
  std::vector<int> parent_;
};

int64_t numel_of(const ValueInfo& v) {
  int64_t n = 1;
  for (int64_t s : v.sizes) n *= s;
  return n;
}

// Readers of a one-element CPU constant read the first constant with the same bytes, dtype and
// promotion kind instead (decompositions bake the same 0.5 or 1 many times).
void merge_equal_scalars(Graph& g) {
  std::map<std::tuple<DType, bool, std::string>, int> first;
  std::unordered_map<int, int> rename;
  for (const auto& [v, t] : g.constants) {
    if (!valid(g, v) || t.numel() != 1 || t.device() != kCPU || t.impl().lazy) continue;
    const char* data = static_cast<const char*>(t.impl().data());
    std::string bytes(data, data + itemsize(t.dtype()));
    auto [it, fresh] = first.try_emplace({t.dtype(), g.values[v].is_wrapped_number, bytes}, v);
    if (!fresh && g.values[it->second].sizes == g.values[v].sizes) rename[v] = it->second;
  }
  if (rename.empty()) return;
  auto apply = [&](int& v) {
    auto it = rename.find(v);
    if (it != rename.end()) v = it->second;
  };
  for (Node& n : g.nodes)
    for (int& v : n.inputs) apply(v);
  for (int& v : g.outputs) apply(v);
}

}  // namespace

void fold_constants(Graph& g, int64_t max_numel) {
  std::vector<Tensor> known(g.values.size());
  for (const auto& [v, t] : g.constants)
    if (valid(g, v)) known[v] = t;
  std::vector<char> has_slot(g.nodes.size(), 0);
  for (const ScalarSlot& s : g.scalars)
    if (s.node >= 0 && static_cast<size_t>(s.node) < has_slot.size()) has_slot[s.node] = 1;
  // A folded value is shared by every call: memory some node writes cannot be one.
  AliasGroups groups(g);
  std::vector<char> written(g.values.size(), 0);
  for (const Node& n : g.nodes) {
    if (n.inplace)
      for (int v : n.outputs)
        if (valid(g, v)) written[groups.find(v)] = 1;
    if (n.op)
      for (int i : n.op->mutated_inputs)
        if (static_cast<size_t>(i) < n.inputs.size() && valid(g, n.inputs[i]))
          written[groups.find(n.inputs[i])] = 1;
  }

  // Graph outputs get a buffer of their own on every call: a fill costs what a copy would.
  std::vector<char> output(g.values.size(), 0);
  for (int v : g.outputs)
    if (valid(g, v)) output[v] = 1;

  std::vector<char> folded(g.nodes.size(), 0);
  for (size_t i = 0; i < g.nodes.size(); ++i) {
    const Node& n = g.nodes[i];
    if (!n.op || n.has_side_effects() || has_slot[i] || n.outputs.empty() || is_random(*n.op)) continue;
    bool foldable = true;
    for (int v : n.inputs) foldable &= v == -1 || (valid(g, v) && known[v].defined());
    for (int v : n.outputs)
      foldable &= valid(g, v) && !written[groups.find(v)] && !output[v] &&
                  (max_numel < 0 || numel_of(g.values[v]) <= max_numel);
    if (!foldable) continue;

    std::vector<Tensor> inputs;
    for (int v : n.inputs) inputs.push_back(v == -1 ? Tensor() : known[v]);
    std::vector<Tensor> results;
    try {
      kiln::compiler::detail::SuspendCapture no_capture;
      NoGradGuard no_grad;
      results = call_op(*n.op, std::move(inputs), n.attrs);
    } catch (const std::exception&) {
      continue;  // no kernel here, or it rejects the values: the node runs at run time
    }
    if (results.size() != n.outputs.size()) continue;
    bool matches = true;
    for (size_t k = 0; k < results.size(); ++k) {
      const ValueInfo& rec = g.values[n.outputs[k]];
      matches &= results[k].defined() && results[k].sizes() == IntArrayRef(rec.sizes) &&
                 results[k].dtype() == rec.dtype && results[k].device() == rec.device;
    }
    if (!matches) continue;
    for (size_t k = 0; k < results.size(); ++k) {
      known[n.outputs[k]] = results[k];
      g.constants.emplace_back(n.outputs[k], results[k]);
    }
    folded[i] = 1;
  }

  // A folded node's inputs were constants, so folding leaves no other node dead: only the folded
  // nodes go, and constants nothing reads.
  const Node* first = g.nodes.data();
  g.erase_nodes_if([&](const Node& n) { return folded[&n - first] != 0; });
  merge_equal_scalars(g);
  std::vector<int> uses = g.use_counts();
  std::erase_if(g.constants, [&](const auto& c) { return !valid(g, c.first) || uses[c.first] == 0; });
}

}  // namespace kiln::compiler::passes
