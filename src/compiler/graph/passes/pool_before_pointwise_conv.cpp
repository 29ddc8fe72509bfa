// Average pooling before a 1x1 convolution instead of after it (DESIGN §2.5's algebraic rewrites).
//
// A 1x1 convolution without bias is the same linear map at every pixel, and average pooling over
// full windows is a mean of pixels, so avg_pool2d(conv2d(x, w)) = conv2d(avg_pool2d(x), w): the
// convolution then runs on the pooled pixels, a quarter of them for DenseNet's 2x2 transitions
// (their convolutions' FLOPs drop 4x). In a training graph the backward of the pair is rewritten
// to match: avg_pool2d_backward followed by convolution_backward becomes convolution_backward on the
// pooled operand followed by avg_pool2d_backward of the input gradient; the weight gradient sums
// the same products (each pooled pixel's gradient times the mean of its window).
//
// Applies when: the convolution is 1x1, stride 1, no padding, no bias; the pooling has no padding,
// no ceil mode and no divisor override (every window is full, divided by its size); the
// convolution's result is read only by the pooling; float32/float64/bfloat16/float16 on any
// device. A backward pair is rewritten only when its convolution_backward reads the same input and
// weight, with the same attrs, asks for the input gradient, and nothing writes them in between.
// Results agree with the original order up to rounding (sums taken in another order).
#include <vector>

#include "compiler/graph/known_ops.h"
#include "compiler/graph/passes.h"

namespace kiln::compiler::passes {

namespace {

bool ints_are(const Attr& a, std::initializer_list<int64_t> want) {
  if (!std::holds_alternative<std::vector<int64_t>>(a)) return false;
  const auto& v = std::get<std::vector<int64_t>>(a);
  if (v.size() == 1) {
    for (int64_t w : want)
      if (v[0] != w) return false;
    return true;
  }
  return v == std::vector<int64_t>(want);
}

bool is_false(const Attr& a) { return std::holds_alternative<bool>(a) && !std::get<bool>(a); }

// conv2d(x, w, None, stride 1, padding 0, dilation, groups) with a 1x1 kernel.
bool pointwise_conv(const Graph& g, const Node& n) {
  if (n.inplace || n.op != &known_ops().conv2d || n.inputs.size() != 3 || n.outputs.size() != 1 || n.attrs.size() != 4)
    return false;
  if (n.inputs[2] >= 0 || !internal::valid(g, n.inputs[0]) || !internal::valid(g, n.inputs[1])) return false;
  const std::vector<int64_t>& w = g.values[n.inputs[1]].sizes;
  return w.size() == 4 && w[2] == 1 && w[3] == 1 && ints_are(n.attrs[0], {1, 1}) && ints_are(n.attrs[1], {0, 0});
}

// avg_pool2d(y, kernel, stride, padding 0, ceil_mode false, count_include_pad, divisor None):
// every window full.
bool full_window_pool(const Node& n) {
  return !n.inplace && n.op == &known_ops().avg_pool2d && n.inputs.size() == 1 && n.outputs.size() == 1 &&
         n.attrs.size() == 6 && ints_are(n.attrs[2], {0, 0}) && is_false(n.attrs[3]) &&
         std::holds_alternative<std::monostate>(n.attrs[5]);
}

}  // namespace

int pool_before_pointwise_conv(Graph& g) {
  const OpDef& avg_pool2d = known_ops().avg_pool2d;
  const OpDef& avg_pool2d_backward = internal::registered_op("avg_pool2d_backward");
  const OpDef& conv2d = known_ops().conv2d;
  const OpDef& convolution_backward = known_ops().convolution_backward;
  const std::vector<int> uses = g.use_counts();
  const internal::WriteIndex writes(g);
  const std::vector<int> consumer = internal::dataflow(g, uses).consumer;
  std::vector<bool> scalar_slot(g.nodes.size(), false);  // nodes with run-time attrs stay as they are
  for (const ScalarSlot& s : g.scalars)
    if (s.node >= 0) scalar_slot[static_cast<size_t>(s.node)] = true;
  internal::NodeNamer namer(g);

  std::vector<bool> touched(g.nodes.size(), false);  // rewritten already: never matched again
  int rewritten = 0;
  for (size_t ci = 0; ci < g.nodes.size(); ++ci) {
    if (touched[ci] || scalar_slot[ci] || !pointwise_conv(g, g.nodes[ci])) continue;
    const int y = g.nodes[ci].outputs[0];
    const int pi = consumer[y];
    if (pi < 0 || touched[static_cast<size_t>(pi)] || scalar_slot[static_cast<size_t>(pi)] ||
        !full_window_pool(g.nodes[static_cast<size_t>(pi)]))
      continue;
    if (writes.written(y)) continue;
    const int x = g.nodes[ci].inputs[0], w = g.nodes[ci].inputs[1];
    if (writes.written_between(w, ci, static_cast<size_t>(pi))) continue;  // the weight is read later now
    const std::vector<Attr> conv_attrs = g.nodes[ci].attrs;
    const std::vector<Attr> pool_attrs = g.nodes[static_cast<size_t>(pi)].attrs;
    const int p = g.nodes[static_cast<size_t>(pi)].outputs[0];

    // The backward pair, when this graph has it: avg_pool2d_backward(gp, y's sizes, the pool's attrs)
    // read only by convolution_backward(gy, x, w, the conv's attrs, mask with the input gradient).
    int bi = -1, ki = -1;
    for (size_t j = static_cast<size_t>(pi) + 1; j < g.nodes.size() && ki < 0; ++j) {
      const Node& n = g.nodes[j];
      if (touched[j] || scalar_slot[j] || n.inplace || n.op != &avg_pool2d_backward || n.inputs.size() != 1 ||
          n.attrs.size() != 7)
        continue;
      if (!std::holds_alternative<std::vector<int64_t>>(n.attrs[0]) ||
          std::get<std::vector<int64_t>>(n.attrs[0]) != g.values[y].sizes)
        continue;
      if (!std::equal(pool_attrs.begin(), pool_attrs.end(), n.attrs.begin() + 1)) continue;
      const int gy = n.outputs[0];
      const int k = consumer[gy];
      if (k < 0 || touched[static_cast<size_t>(k)] || scalar_slot[static_cast<size_t>(k)] || writes.written(gy))
        continue;
      const Node& cb = g.nodes[static_cast<size_t>(k)];
      if (cb.inplace || cb.op != &convolution_backward || cb.inputs.size() != 3 || cb.inputs[0] != gy ||
          cb.inputs[1] != x || cb.inputs[2] != w || cb.attrs.size() != 5 || cb.outputs.size() != 3)
        continue;
      if (!std::equal(conv_attrs.begin(), conv_attrs.end(), cb.attrs.begin())) continue;
      if (!std::holds_alternative<std::vector<int64_t>>(cb.attrs[4]) ||
          std::get<std::vector<int64_t>>(cb.attrs[4]).size() != 3 || std::get<std::vector<int64_t>>(cb.attrs[4])[0] == 0)
        continue;
      if (writes.written_between(x, ci, static_cast<size_t>(k)) || writes.written_between(w, ci, static_cast<size_t>(k)))
        continue;
      bi = static_cast<int>(j);
      ki = k;
    }
    // Without its backward pair in this graph, a pair whose backward exists elsewhere still
    // rewrites: that backward reads x and w (what autograd saved), not the pooled values.

    // Forward: the convolution's node pools x; the pooling's node convolves the pooled x into p.
    const ValueInfo xi = g.values[x];
    std::vector<int64_t> pooled = xi.sizes;
    pooled[2] = g.values[p].sizes[2];
    pooled[3] = g.values[p].sizes[3];
    const int px = internal::new_value(g, xi, pooled, namer("avg_pool2d"));
    Node& pool_node = g.nodes[ci];
    pool_node.op = &avg_pool2d;
    pool_node.inputs = {x};
    pool_node.attrs = pool_attrs;
    pool_node.outputs = {px};
    pool_node.name = g.values[px].name;
    Node& conv_node = g.nodes[static_cast<size_t>(pi)];
    conv_node.op = &conv2d;
    conv_node.inputs = {px, w, -1};
    conv_node.attrs = conv_attrs;
    conv_node.outputs = {p};
    conv_node.name = namer("conv2d");
    touched[ci] = touched[static_cast<size_t>(pi)] = true;

    if (ki >= 0) {
      // Backward: convolution_backward on the pooled operand, then the input gradient unpooled.
      Node& pool_backward = g.nodes[static_cast<size_t>(bi)];
      Node& conv_backward = g.nodes[static_cast<size_t>(ki)];
      const int gp = pool_backward.inputs[0];
      const std::vector<int> grads = conv_backward.outputs;  // (gx, gw, gb)
      const int gpx = internal::new_value(g, g.values[grads[0]], pooled, namer("convolution_backward"));
      std::vector<Attr> unpool_attrs{xi.sizes};
      unpool_attrs.insert(unpool_attrs.end(), pool_attrs.begin(), pool_attrs.end());
      pool_backward.op = &convolution_backward;
      pool_backward.inputs = {gp, px, w};
      pool_backward.attrs = conv_backward.attrs;
      pool_backward.outputs = {gpx, grads[1], grads[2]};
      pool_backward.name = g.values[gpx].name;
      conv_backward.op = &avg_pool2d_backward;
      conv_backward.inputs = {gpx};
      conv_backward.attrs = std::move(unpool_attrs);
      conv_backward.outputs = {grads[0]};
      conv_backward.name = namer("avg_pool2d_backward");
      touched[static_cast<size_t>(bi)] = touched[static_cast<size_t>(ki)] = true;
    }
    ++rewritten;
  }
  if (rewritten > 0) refresh_layouts(g);
  return rewritten;
}

}  // namespace kiln::compiler::passes
