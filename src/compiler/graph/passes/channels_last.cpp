// Layout optimization for convolution networks (DESIGN §2.5): convolutions run on channels-last
// (NHWC) activations, where oneDNN needs no reorders and is about twice as fast on this kind of
// CPU (docs/memory_format.md), and where cuDNN's tensor-core kernels need no transposes on a GPU. The pass converts the input of the first convolution that reads a
// row-major activation into channels-last with a `copy` node; the ops' metas then carry the
// layout on (convolutions, batch norm, pooling, pointwise ops and cat keep channels-last), so one
// conversion usually covers the whole network, forward and backward. Graph outputs keep the
// layout eager gives them: an output that became channels-last is copied back.
#include <algorithm>
#include <string>

#include "compiler/graph/known_ops.h"
#include "compiler/graph/passes.h"
#include "core/shape.h"
#include "kiln/tensor.h"

namespace kiln::compiler::passes {

namespace {

bool is_convolution(const Node& n) {
  if (!n.op || n.inplace || n.inputs.empty()) return false;
  const KnownOps& ops = known_ops();
  return n.op == &ops.conv2d || n.op == &ops.conv2d_relu || n.op == &ops.conv2d_bn;
}

bool is_convolution_backward(const Node& n) {
  return n.op && !n.inplace && n.op == &known_ops().convolution_backward && n.inputs.size() >= 2;
}

// A 4-D activation in a dtype the device's convolutions run fastest channels-last (oneDNN on the
// CPU; cuDNN's NHWC tensor-core kernels on a GPU, which otherwise transpose NCHW operands on
// every call), row-major-like, whose layout channels-last would change (one channel or a 1x1
// image lie the same in both).
bool wants_channels_last(const ValueInfo& x) {
  if (x.sizes.size() != 4) return false;
  if (x.device.is_cpu()) {
    if (x.dtype != DType::float32 && x.dtype != DType::bfloat16) return false;
  } else if (!x.device.is_cuda() ||
             (x.dtype != DType::float32 && x.dtype != DType::float16 && x.dtype != DType::bfloat16)) {
    return false;
  }
  if (x.sizes[0] == 0 || x.sizes[1] <= 1 || x.sizes[2] * x.sizes[3] <= 1) return false;
  return !kiln::detail::strides_like_channels_last(x.sizes, x.strides);
}

bool row_major(const ValueInfo& v) {
  int64_t expected = 1;
  for (size_t d = v.sizes.size(); d-- > 0;) {
    if (v.sizes[d] == 1) continue;
    if (v.strides[d] != expected) return false;
    expected *= v.sizes[d];
  }
  return true;
}

// Inserts `node` before position `at`, keeping the scalar slots on their nodes.
void insert_node(Graph& g, size_t at, Node node) {
  g.nodes.insert(g.nodes.begin() + static_cast<std::ptrdiff_t>(at), std::move(node));
  for (ScalarSlot& s : g.scalars)
    if (s.node >= static_cast<int>(at)) ++s.node;
}

// A copy of value `x` in the given layout (channels_last: NHWC, else row-major), as a new node
// named `name`; returns the node.
Node layout_copy(Graph& g, int x, bool channels_last, std::string name) {
  const ValueInfo& xi = g.values[x];
  ValueInfo info;
  info.sizes = xi.sizes;
  info.strides = channels_last ? kiln::detail::channels_last_strides(xi.sizes) : kiln::detail::contiguous_strides(xi.sizes);
  info.dtype = xi.dtype;
  info.device = xi.device;
  info.name = name;
  Node n;
  n.op = &known_ops().copy;
  n.inputs = {x};
  n.attrs = {xi.dtype, xi.device, channels_last};
  n.name = std::move(name);
  n.outputs = {g.add_value(std::move(info))};
  return n;
}

// A view node whose input's layout the pass changed and whose result the new layout cannot
// give: `view` to sizes the new strides cannot express (a flatten of a channels-last tensor),
// or as_strided, which reads raw storage positions.
bool view_needs_row_major_input(const Graph& g, const Node& n, const std::vector<std::vector<int64_t>>& recorded) {
  if (!n.is_view() || n.inplace || n.inputs.empty() || n.inputs[0] < 0) return false;
  const int x = n.inputs[0];
  if (static_cast<size_t>(x) >= recorded.size() || g.values[x].strides == recorded[x]) return false;
  if (n.op == &known_ops().as_strided) return true;
  std::vector<Tensor> inputs;
  for (int v : n.inputs) inputs.push_back(v < 0 ? Tensor() : internal::meta_tensor(g.values[v]));
  try {
    n.op->meta(OpCall(n.op, inputs, n.attrs));
    return false;
  } catch (const std::exception&) {
    return true;
  }
}

}  // namespace

bool channels_last_convolutions(Graph& g) {
  // Most graphs have no convolution: skip the copy of the graph kept for undoing (a new size of a
  // dynamic graph runs the passes again, and this copy was a tenth of that).
  if (std::none_of(g.nodes.begin(), g.nodes.end(), [](const Node& n) { return is_convolution(n); })) return false;
  const Graph original = g;
  std::vector<std::vector<int64_t>> recorded;  // every value's layout before the pass
  for (const ValueInfo& v : g.values) recorded.push_back(v.strides);
  std::vector<std::vector<int64_t>> output_strides;
  for (int v : g.outputs) output_strides.push_back(v >= 0 ? g.values[v].strides : std::vector<int64_t>{});
  internal::NodeNamer namer(g);
  bool changed = false;
  // One conversion at a time: after each, refresh_layouts() carries the new layout downstream, so
  // convolutions it reaches need none of their own. A network needs one per input that reaches a
  // convolution through ops that drop the layout (reshapes, ops without a channels-last rule).
  for (size_t i = 0; i < g.nodes.size(); ++i) {
    Node& conv = g.nodes[i];
    if (!is_convolution(conv) || conv.inputs[0] < 0 || !wants_channels_last(g.values[conv.inputs[0]])) continue;
    Node to_nhwc = layout_copy(g, conv.inputs[0], /*channels_last=*/true, namer("to_channels_last"));
    const int converted = to_nhwc.outputs[0];
    const int original = g.nodes[i].inputs[0];
    // Every convolution reading this activation takes the converted copy, and so do their
    // backward calls (the weight gradient would otherwise run on a row-major input beside a
    // channels-last gradient: oneDNN's slow mixed-layout path).
    for (size_t j = i; j < g.nodes.size(); ++j) {
      Node& n = g.nodes[j];
      if (is_convolution(n) && n.inputs[0] == original) n.inputs[0] = converted;
      if (is_convolution_backward(n) && n.inputs[1] == original) n.inputs[1] = converted;
    }
    insert_node(g, i, std::move(to_nhwc));
    ++i;
    refresh_layouts(g);
    changed = true;
  }
  if (!changed) return false;
  // Views the new layouts break read a row-major copy instead (what reshape does in eager).
  for (size_t i = 0; i < g.nodes.size(); ++i) {
    if (!view_needs_row_major_input(g, g.nodes[i], recorded)) continue;
    const int x = g.nodes[i].inputs[0];
    ValueInfo row_major_x = g.values[x];
    row_major_x.strides = recorded[x];
    if (!row_major(row_major_x)) {  // a layout `copy` cannot rebuild: keep the graph as captured
      g = original;
      return false;
    }
    Node copy = layout_copy(g, x, /*channels_last=*/false, namer("contiguous"));
    g.nodes[i].inputs[0] = copy.outputs[0];
    insert_node(g, i, std::move(copy));
    ++i;
    refresh_layouts(g);
  }
  // The caller sees eager's layouts: a row-major output that is channels-last now is copied back,
  // unless only autograd's saved tensors hold it (free_layout_outputs): the backward's convolutions
  // want it channels-last.
  for (size_t k = 0; k < g.outputs.size(); ++k) {
    const int v = g.outputs[k];
    if (v < 0 || g.values[v].is_input || g.values[v].strides == output_strides[k] || g.output_layout_free(k)) continue;
    ValueInfo original = g.values[v];
    original.strides = output_strides[k];
    if (!row_major(original)) continue;  // a strided view: eager gives no layout to keep
    Node back = layout_copy(g, v, /*channels_last=*/false, namer("contiguous"));
    g.outputs[k] = back.outputs[0];
    g.nodes.push_back(std::move(back));
  }
  refresh_layouts(g);
  return true;
}

}  // namespace kiln::compiler::passes
