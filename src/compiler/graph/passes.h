// Graph-to-graph passes that keep a graph's meaning (each one in passes/<name>.cpp).
#pragma once

#include "kiln/compiler/graph.h"

namespace kiln::compiler::passes {

// Removes the nodes whose outputs nothing reads (no later node, no graph output, no in-place
// write) and that write no existing memory (Node::has_side_effects). Keeps node order.
void eliminate_dead_code(Graph& graph);

// Merges a node into an earlier one with the same op, inputs and attrs: uses of its outputs read
// the earlier node's. Skips random ops, nodes with scalar slots, nodes with side effects or whose
// outputs (or aliases of them) are written in place, and never matches across a node that writes
// existing memory. Merged nodes are erased; their output values stay in `values`, unused.
void eliminate_common_subexpressions(Graph& graph);

}  // namespace kiln::compiler::passes
