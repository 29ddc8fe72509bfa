// Helpers that several passes share (declared in passes.h, namespace internal).
#include <algorithm>
#include <numeric>
#include <unordered_map>
#include <vector>

#include "compiler/graph/format.h"
#include "compiler/graph/passes.h"

namespace kiln::compiler::passes::internal {

namespace {

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

}  // namespace

bool is_random(const OpDef& op) {
  if (!op.runtime_attrs.empty()) return true;
  for (const detail::SchemaParam& p : detail::parse_schema_params(op.schema))
    if (p.name == "seed") return true;
  return false;
}

bool mutates_inputs(const Graph& g, const Node& n) {
  if (!n.op || !n.op->may_mutate_inputs()) return false;
  if (!n.op->writes_mutated_inputs) return true;
  std::vector<Tensor> inputs;
  inputs.reserve(n.inputs.size());
  for (int v : n.inputs) inputs.push_back(valid(g, v) ? meta_tensor(g.values[v]) : Tensor());
  return n.op->mutates(OpCall(n.op, inputs, n.attrs));
}

WriteIndex::WriteIndex(const Graph& g) : group_(g.values.size()), writers_(g.values.size()) {
  AliasGroups groups(g);
  for (size_t v = 0; v < g.values.size(); ++v) group_[v] = groups.find(static_cast<int>(v));
  auto add = [&](int v, size_t node) {
    std::vector<int>& w = writers_[static_cast<size_t>(group_[static_cast<size_t>(v)])];
    if (w.empty() || w.back() != static_cast<int>(node)) w.push_back(static_cast<int>(node));
  };
  for (size_t i = 0; i < g.nodes.size(); ++i) {
    const Node& n = g.nodes[i];
    if (n.inplace)
      for (int v : n.outputs)
        if (valid(g, v)) add(v, i);
    if (mutates_inputs(g, n))
      for (int k : n.op->mutated_input_indices(n.inputs.size(), n.attrs))
        if (static_cast<size_t>(k) < n.inputs.size() && valid(g, n.inputs[k])) add(n.inputs[k], i);
  }
}

bool WriteIndex::written(int v) const { return !writers_[static_cast<size_t>(group_[static_cast<size_t>(v)])].empty(); }

bool WriteIndex::written_between(int v, size_t first, size_t last) const {
  const std::vector<int>& w = writers_[static_cast<size_t>(group_[static_cast<size_t>(v)])];
  auto it = std::lower_bound(w.begin(), w.end(), static_cast<int>(first));
  return it != w.end() && static_cast<size_t>(*it) < last;
}

std::vector<char> written_memory(const Graph& g) {
  const WriteIndex index(g);
  std::vector<char> out(g.values.size(), 0);
  for (size_t v = 0; v < out.size(); ++v) out[v] = index.written(static_cast<int>(v));
  return out;
}

Dataflow dataflow(const Graph& g, const std::vector<int>& uses) {
  Dataflow d{std::vector<int>(g.values.size(), -1), std::vector<int>(g.values.size(), -1)};
  for (size_t i = 0; i < g.nodes.size(); ++i) {
    const Node& n = g.nodes[i];
    if (!n.inplace)
      for (int v : n.outputs) d.producer[v] = static_cast<int>(i);
    for (int v : n.inputs)
      if (v >= 0 && uses[v] == 1) d.consumer[v] = static_cast<int>(i);
  }
  return d;
}

int new_value(Graph& g, const ValueInfo& like, std::vector<int64_t> sizes, const std::string& name) {
  ValueInfo info;
  info.sizes = std::move(sizes);
  info.strides.assign(info.sizes.size(), 0);
  info.dtype = like.dtype;
  info.device = like.device;
  info.name = name;
  return g.add_value(std::move(info));
}

const OpDef& registered_op(std::string_view name) {
  const OpDef* d = OpTable::instance().find(name);
  KILN_CHECK(d != nullptr, CompileError, "[kiln::compile] op '" + std::string(name) + "' is not registered.");
  return *d;
}

}  // namespace kiln::compiler::passes::internal
