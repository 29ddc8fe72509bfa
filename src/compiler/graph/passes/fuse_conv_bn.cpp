// Epilogue fusion into convolutions (DESIGN §2.5): conv2d → native_batch_norm (inference) →
// relu becomes one conv2d_bn node, whose kernel folds the batch norm into the weights and bias
// and runs the relu as a oneDNN post-op. The rewrite applies only where the intermediate values
// are read by nothing else (a training graph whose backward reads them keeps its nodes).
#include "compiler/graph/known_ops.h"
#include "compiler/graph/passes.h"

namespace kiln::compiler::passes {

void fuse_conv_bn(Graph& g) {
  const OpDef& conv2d_bn = known_ops().conv2d_bn;
  std::vector<int> uses = g.use_counts();
  const auto [producer, consumer] = internal::dataflow(g, uses);
  // Values written in place anywhere: folding must not move a read across such a write.
  std::vector<bool> written(g.values.size(), false);
  for (const Node& n : g.nodes) {
    if (n.inplace)
      for (int v : n.outputs) written[v] = true;
    if (!internal::mutates_inputs(g, n)) continue;  // e.g. an inference batch norm
    for (int i : n.op->mutated_input_indices(n.inputs.size(), n.attrs))
      if (i < static_cast<int>(n.inputs.size()) && n.inputs[i] >= 0) written[n.inputs[i]] = true;
  }

  std::vector<bool> erase(g.nodes.size(), false);
  for (size_t b = 0; b < g.nodes.size(); ++b) {
    Node& bn = g.nodes[b];
    if (bn.op != &known_ops().native_batch_norm || bn.inplace || bn.inputs.size() != 5 || bn.outputs.size() != 3) continue;
    if (!std::holds_alternative<bool>(bn.attrs.at(0)) || std::get<bool>(bn.attrs[0])) continue;  // training
    if (uses[bn.outputs[1]] != 0 || uses[bn.outputs[2]] != 0) continue;
    if (bn.inputs[3] < 0 || bn.inputs[4] < 0) continue;
    const int x = bn.inputs[0];
    const int p = producer[x];
    if (p < 0 || uses[x] != 1 || written[x]) continue;
    const Node& conv = g.nodes[p];
    if (conv.op != &known_ops().conv2d || conv.inputs.size() != 3 || erase[p]) continue;
    const ValueInfo& xi = g.values[x];
    if (xi.dtype != DType::float32 || !xi.device.is_cpu()) continue;
    bool params_ok = true;
    for (int i = 1; i < 5; ++i) {
      int v = bn.inputs[i];
      params_ok = params_ok && (v < 0 || (g.values[v].dtype == DType::float32 && !written[v]));
    }
    if (!params_ok) continue;
    // An optional relu reading only the batch norm's output.
    int relu = -1;
    const int y = bn.outputs[0];
    if (int c = consumer[y]; c >= 0 && !g.nodes[c].inplace && g.nodes[c].op == &known_ops().relu && !written[y]) relu = c;

    Node fused;
    fused.op = &conv2d_bn;
    fused.inputs = {conv.inputs[0], conv.inputs[1], conv.inputs[2], bn.inputs[1], bn.inputs[2], bn.inputs[3], bn.inputs[4]};
    fused.attrs = {conv.attrs.at(0), conv.attrs.at(1), conv.attrs.at(2), conv.attrs.at(3), bn.attrs.at(2), relu >= 0};
    fused.outputs = {y};
    fused.name = bn.name.empty() ? "conv2d_bn" : "conv2d_bn_" + bn.name;
    // The batch norm's eps slot (a run-time scalar) moves to the fused node's eps attr; momentum
    // is not read any more.
    for (ScalarSlot& s : g.scalars) {
      if (s.node != static_cast<int>(b)) continue;
      s = s.attr == 2 ? ScalarSlot{static_cast<int>(b), 4} : ScalarSlot{-1, -1};
    }
    erase[p] = true;
    bn = std::move(fused);
    if (relu >= 0) {
      g.replace_all_uses(g.nodes[relu].outputs[0], y);
      erase[relu] = true;
    }
  }
  size_t index = 0;
  g.erase_nodes_if([&](const Node&) { return erase[index++]; });
}

}  // namespace kiln::compiler::passes
