// Common subexpression elimination: a node that repeats an earlier computation reuses its results.
#include <functional>
#include <numeric>
#include <unordered_map>
#include <vector>

#include "compiler/graph/passes.h"

namespace kiln::compiler::passes {

namespace {

size_t key_hash(const Node& n) {
  size_t h = std::hash<const void*>()(n.op);
  for (int v : n.inputs) h = h * 1000003u ^ std::hash<int>()(v);
  return h * 1000003u ^ n.attrs.size();
}

}  // namespace

void eliminate_common_subexpressions(Graph& graph) {
  const size_t num_values = graph.values.size();
  // Values whose memory some node writes: merging one would make the write hit the other.
  std::vector<char> written = internal::written_memory(graph);
  std::vector<char> has_slot(graph.nodes.size(), 0);
  for (const ScalarSlot& s : graph.scalars)
    if (s.node >= 0 && static_cast<size_t>(s.node) < has_slot.size()) has_slot[s.node] = 1;
  std::unordered_map<const OpDef*, bool> random;

  std::vector<int> replacement(num_values);
  std::iota(replacement.begin(), replacement.end(), 0);
  auto remap = [&](int& v) {
    if (v >= 0 && static_cast<size_t>(v) < num_values) v = replacement[v];
  };
  std::unordered_map<size_t, std::vector<int>> seen;  // key hash -> earlier candidate nodes
  std::vector<char> merged(graph.nodes.size(), 0);
  for (size_t i = 0; i < graph.nodes.size(); ++i) {
    Node& n = graph.nodes[i];
    for (int& v : n.inputs) remap(v);
    if (n.has_side_effects()) {
      seen.clear();  // what was read before may differ after this write
      continue;
    }
    if (has_slot[i] || n.outputs.empty()) continue;
    auto [rit, fresh] = random.emplace(n.op, false);
    if (fresh) rit->second = internal::is_random(*n.op);
    if (rit->second) continue;
    bool eligible = true;
    for (int v : n.outputs)
      eligible &= v >= 0 && static_cast<size_t>(v) < num_values && !written[v];
    if (!eligible) continue;

    std::vector<int>& candidates = seen[key_hash(n)];
    int match = -1;
    for (int j : candidates) {
      const Node& m = graph.nodes[j];
      if (m.op == n.op && m.inputs == n.inputs && m.attrs == n.attrs &&
          m.outputs.size() == n.outputs.size()) {
        match = j;
        break;
      }
    }
    if (match < 0) {
      candidates.push_back(static_cast<int>(i));
      continue;
    }
    for (size_t k = 0; k < n.outputs.size(); ++k)
      replacement[n.outputs[k]] = graph.nodes[match].outputs[k];
    merged[i] = 1;
  }
  for (int& v : graph.outputs) remap(v);
  const Node* first = graph.nodes.data();
  graph.erase_nodes_if([&](const Node& n) { return merged[&n - first] != 0; });
}

}  // namespace kiln::compiler::passes
