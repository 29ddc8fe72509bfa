// Batch norm + relu fusion (DESIGN §2.5): a training batch norm whose output only a relu reads
// becomes one batch_norm_relu node, and the relu's backward (where(le(r, t), v, grad), a mask
// pass) folds into the native_batch_norm_backward reading it (batch_norm_relu_backward). Each
// removes one full pass over the activations. The relu backward's threshold and fill are 0-dim
// graph values (host scalars the body wrapped, passed at run time, so their values are not known
// here): the fused node reads them as inputs instead of assuming 0.
//
// The relu's result may also be a graph input: a module's backward captured after its compiled
// forward ran reads the forward's saved result.
//
// When the relu is a batch_norm_relu of this graph that ran on the backward's own input, weight and
// saved statistics (nothing written in between), the fused backward is
// batch_norm_relu_backward_recompute: it recomputes the relu's result from the input, bit for bit,
// instead of reading it, so each of its two passes streams one tensor less.
#include <vector>

#include "compiler/graph/known_ops.h"
#include "compiler/graph/passes.h"

namespace kiln::compiler::passes {

namespace {

bool is(const Node& n, const OpDef& op, size_t inputs, size_t outputs) {
  return !n.inplace && n.op == &op && n.inputs.size() == inputs &&
         n.outputs.size() == outputs;
}

}  // namespace

void fuse_batch_norm_relu(Graph& g) {
  const OpDef& batch_norm_relu = internal::registered_op("batch_norm_relu");
  const OpDef& batch_norm_relu_backward = internal::registered_op("batch_norm_relu_backward");
  const OpDef& batch_norm_relu_backward_recompute = internal::registered_op("batch_norm_relu_backward_recompute");
  const std::vector<int> uses = g.use_counts();
  const internal::WriteIndex writes(g);
  auto [producer, consumer] = internal::dataflow(g, uses);
  internal::NodeNamer namer(g);
  std::vector<bool> erase(g.nodes.size(), false);
  auto same_tensor_type = [&](int a, int b) {
    return g.values[a].sizes == g.values[b].sizes && g.values[a].dtype == g.values[b].dtype;
  };

  // batch norm -> relu: the fused node takes the batch norm's place (inputs and attrs, so its
  // scalar slots stay valid) and produces the relu's value. Training only: an inference batch
  // norm decomposes into pointwise ops that the code generator fuses with the relu and with what
  // comes before (DenseNet's cat), which beats an extern call (measured).
  for (size_t b = 0; b < g.nodes.size(); ++b) {
    Node& bn = g.nodes[b];
    if (!is(bn, known_ops().native_batch_norm, 5, 3) || bn.attrs.size() != 3) continue;
    if (!std::holds_alternative<bool>(bn.attrs[0]) || !std::get<bool>(bn.attrs[0])) continue;
    const int y = bn.outputs[0];
    const int c = consumer[y];
    if (c < 0 || writes.written(y) || !is(g.nodes[c], known_ops().relu, 1, 1)) continue;
    if (!batch_norm_relu.has_kernel(g.values[y].device.type)) continue;
    const int relu_out = g.nodes[c].outputs[0];
    if (!same_tensor_type(y, relu_out)) continue;
    bn.op = &batch_norm_relu;
    bn.name = namer("batch_norm_relu");
    bn.outputs[0] = relu_out;
    producer[relu_out] = static_cast<int>(b);
    erase[c] = true;
  }

  // Whether batch_norm_relu node f's result can be recomputed inside the native_batch_norm_backward
  // node b: b differentiates f (same input, weight, saved statistics and mode) and no node between
  // them writes f's operands, so f's affine map is the one b can derive.
  auto recomputes_mask = [&](int f, size_t b) {
    const Node& fwd = g.nodes[static_cast<size_t>(f)];
    const Node& bwd = g.nodes[b];
    if (fwd.op != &batch_norm_relu || fwd.inputs.size() != 5 || fwd.outputs.size() != 3) return false;
    if (!batch_norm_relu_backward_recompute.has_kernel(g.values[bwd.inputs[1]].device.type)) return false;
    if (bwd.inputs[1] != fwd.inputs[0] || bwd.inputs[2] != fwd.inputs[1] || bwd.inputs[3] != fwd.outputs[1] ||
        bwd.inputs[4] != fwd.outputs[2])
      return false;
    if (fwd.attrs.empty() || !std::holds_alternative<bool>(fwd.attrs[0]) ||
        !std::holds_alternative<bool>(bwd.attrs[0]) || std::get<bool>(fwd.attrs[0]) != std::get<bool>(bwd.attrs[0]))
      return false;
    for (int v : {fwd.inputs[0], fwd.inputs[1], fwd.inputs[2], fwd.outputs[1], fwd.outputs[2]})
      if (internal::valid(g, v) && writes.written_between(v, static_cast<size_t>(f) + 1, b)) return false;
    return true;
  };

  // where(le(r, threshold), fill, grad) -> native_batch_norm_backward, r a relu's output: the
  // fused node takes the backward's place and reads grad, r, threshold and fill there (none of
  // them is written in place, so reading them later reads the same values).
  for (size_t k = 0; k < g.nodes.size(); ++k) {
    Node& bwd = g.nodes[k];
    if (!is(bwd, known_ops().native_batch_norm_backward, 5, 3) || bwd.attrs.size() != 2) continue;
    const int masked = bwd.inputs[0];
    if (masked < 0 || uses[masked] != 1 || writes.written(masked) || producer[masked] < 0) continue;
    const int w = producer[masked];
    const Node& where = g.nodes[w];
    if (erase[w] || !is(where, known_ops().where, 3, 1)) continue;
    const int condition = where.inputs[0], fill = where.inputs[1], grad = where.inputs[2];
    if (condition < 0 || fill < 0 || grad < 0 || uses[condition] != 1 || producer[condition] < 0)
      continue;
    const int l = producer[condition];
    const Node& le = g.nodes[l];
    if (erase[l] || !is(le, known_ops().le, 2, 1)) continue;
    const int r = le.inputs[0], threshold = le.inputs[1];
    if (r < 0 || threshold < 0) continue;
    // r is a relu's result: of this graph, or an input (a backward captured after its forward ran,
    // module style, reads the forward's saved result). The fused node computes exactly
    // where(le(r, threshold), fill, grad) whatever r is; the check only keeps the fusion to the
    // relu backward it was made for.
    const bool from_relu =
        producer[r] < 0 ? g.values[r].is_input
                        : (g.nodes[producer[r]].op == &batch_norm_relu && g.nodes[producer[r]].outputs[0] == r) ||
                              is(g.nodes[producer[r]], known_ops().relu, 1, 1);
    const int x = bwd.inputs[1];
    // No broadcasting: grad, r and the masked gradient have the input's sizes and dtype, so the
    // comparison runs in r's dtype and the fill takes grad's (0-dim operands do not promote).
    if (!from_relu || !same_tensor_type(masked, x) || !same_tensor_type(grad, x) ||
        !same_tensor_type(r, x))
      continue;
    if (!g.values[threshold].sizes.empty() || !g.values[fill].sizes.empty()) continue;
    if (!batch_norm_relu_backward.has_kernel(g.values[x].device.type)) continue;
    if (writes.written(grad) || writes.written(r) || writes.written(threshold) || writes.written(fill) ||
        writes.written(condition))
      continue;
    if (producer[r] >= 0 && recomputes_mask(producer[r], k)) {
      bwd.op = &batch_norm_relu_backward_recompute;
      bwd.inputs = {grad, x, bwd.inputs[2], bwd.inputs[3], bwd.inputs[4], g.nodes[producer[r]].inputs[2], threshold,
                    fill};
      bwd.name = namer("batch_norm_relu_backward_recompute");
    } else {
      bwd.op = &batch_norm_relu_backward;
      bwd.inputs = {grad, r, x, bwd.inputs[2], bwd.inputs[3], bwd.inputs[4], threshold, fill};
      bwd.name = namer("batch_norm_relu_backward");
    }
    erase[w] = true;
    erase[l] = true;
  }

  size_t index = 0;
  g.erase_nodes_if([&](const Node&) { return erase[index++]; });
}

}  // namespace kiln::compiler::passes
