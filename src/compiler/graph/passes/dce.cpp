// Dead code elimination: drops nodes whose results nothing reads and that write no existing memory.
#include <vector>

#include "compiler/graph/passes.h"

namespace kiln::compiler::passes {

void eliminate_dead_code(Graph& graph) {
  std::vector<int> uses = graph.use_counts();
  // An in-place target must keep its producer: the node writes into it.
  for (const Node& n : graph.nodes)
    if (n.inplace)
      for (int v : n.outputs)
        if (v >= 0 && static_cast<size_t>(v) < uses.size()) ++uses[v];

  // Readers come after producers, so one backward sweep reaches the fixed point: by the time a
  // node is visited, every node that could read its outputs has been decided.
  std::vector<char> dead(graph.nodes.size(), 0);
  for (size_t i = graph.nodes.size(); i-- > 0;) {
    const Node& n = graph.nodes[i];
    if (n.has_side_effects()) continue;
    bool used = false;
    for (int v : n.outputs) used |= v >= 0 && static_cast<size_t>(v) < uses.size() && uses[v] > 0;
    if (used) continue;
    dead[i] = 1;
    for (int v : n.inputs)
      if (v >= 0 && static_cast<size_t>(v) < uses.size()) --uses[v];
  }
  const Node* first = graph.nodes.data();
  graph.erase_nodes_if([&](const Node& n) { return dead[&n - first] != 0; });
}

}  // namespace kiln::compiler::passes
