// `cat` chains into one buffer (DESIGN §2.5, "turns cat into producers writing into slices of
// one buffer").
//
// A DenseNet block concatenates its growing list of features before every layer:
// cat([x0]), cat([x0, x1]), ..., cat([x0 ... xn]). Computed as written, layer k copies every
// earlier feature again (quadratic copying) and, in training, keeps each concatenation alive for
// the backward (quadratic memory). Because every smaller cat is a prefix of the largest one, one
// buffer laid out like the largest cat holds them all: each feature is written once into its
// slice, right before the first cat that reads it, and every cat becomes a view of the buffer's
// leading slice. A view costs nothing, so later layers read the concatenation straight from the
// shared buffer (the kernels take its strides; batch norm and convolutions read channel slices of
// an NHWC buffer in place).
//
// The rewrite, per group of at least two cats whose input lists are prefixes of the largest one:
//   buffer  = permute(empty(sizes in the largest cat's memory order), back to logical order)
//   copy_(slice(buffer, dim, start_i, end_i), x_i)   once per input, before its first cat
//   cat_k   → slice(buffer, dim, 0, end_k)
// Left alone: groups whose cats only pointwise ops read (the scheduler fuses those cats into
// their readers' kernels, which read the inputs in place), cats whose result is a graph output
// (the caller gets eager's dense tensor) or is written in place, cats mixing dtypes (cat
// promotes) or ranks, inputs written in place anywhere (the copy would capture another version
// than the cat read), and layouts that are not a permutation of a dense tensor. Run last, after
// the cleanups: the in-place copies pin their position, so no pass should move nodes across them.
#include <algorithm>
#include <map>
#include <numeric>

#include "compiler/graph/known_ops.h"
#include "compiler/graph/passes.h"

namespace kiln::compiler::passes {

namespace {

using internal::valid;

struct CatInfo {
  int node = -1;
  int64_t dim = 0;
};

// A cat this pass may turn into a view: one output of the inputs' dtype and rank, not a graph
// output and not written in place, inputs that nothing writes in place.
bool eligible(const Graph& g, const Node& n, const std::vector<char>& written, const std::vector<bool>& is_output) {
  if (!n.op || n.op != &known_ops().cat || n.inplace || n.outputs.size() != 1 || n.inputs.empty()) return false;
  const int out = n.outputs[0];
  if (!valid(g, out) || is_output[out] || written[out]) return false;
  const ValueInfo& o = g.values[out];
  for (int v : n.inputs) {
    if (!valid(g, v) || written[v]) return false;
    const ValueInfo& in = g.values[v];
    if (in.dtype != o.dtype || in.device != o.device || in.sizes.size() != o.sizes.size()) return false;
  }
  return !o.sizes.empty() && n.attrs.size() >= 1 && std::holds_alternative<int64_t>(n.attrs[0]);
}

int64_t cat_dim(const Graph& g, const Node& n) {
  int64_t dim = std::get<int64_t>(n.attrs[0]);
  const int64_t rank = static_cast<int64_t>(g.values[n.outputs[0]].sizes.size());
  return dim < 0 ? dim + rank : dim;
}

// The dims of `v` from outermost to innermost in memory, when `v` is dense in that order (the
// layout a fresh buffer can have); empty otherwise.
std::vector<int64_t> memory_order(const ValueInfo& v) {
  const size_t rank = v.sizes.size();
  std::vector<int64_t> order(rank);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return v.strides[a] > v.strides[b]; });
  int64_t expected = 1;
  for (size_t k = rank; k-- > 0;) {
    const int64_t d = order[k];
    if (v.sizes[d] != 1 && v.strides[d] != expected) return {};
    expected *= v.sizes[d];
  }
  return order;
}

Node make_node(const OpDef& op, std::vector<int> inputs, std::vector<Attr> attrs, std::string name) {
  Node n;
  n.op = &op;
  n.inputs = std::move(inputs);
  n.attrs = std::move(attrs);
  n.name = std::move(name);
  return n;
}

// Whether the scheduler would store the cat's result: a cat read only by pointwise ops fuses into
// their kernel (it reads its inputs in place, which beats copying them into a buffer first); any
// other reader (a convolution, batch norm, a reduction, a graph output) needs it in memory.
bool materialized(const Graph& g, int out, const std::vector<std::vector<int>>& consumers) {
  for (int c : consumers[out]) {
    const Node& n = g.nodes[c];
    if (n.inplace || !n.op || !n.op->is_fusible()) return true;
  }
  return false;
}

}  // namespace

int cat_into_slices(Graph& g) {
  std::vector<bool> is_output(g.values.size(), false);
  for (int v : g.outputs)
    if (valid(g, v)) is_output[v] = true;
  const std::vector<char> written = internal::written_memory(g);

  // Groups: each led by the cat with the most inputs; a cat joins the first leader whose input
  // list starts with its own (same dim, dtype and device).
  std::vector<CatInfo> cats;
  for (size_t i = 0; i < g.nodes.size(); ++i)
    if (eligible(g, g.nodes[i], written, is_output)) cats.push_back({static_cast<int>(i), cat_dim(g, g.nodes[i])});
  std::stable_sort(cats.begin(), cats.end(), [&](const CatInfo& a, const CatInfo& b) {
    return g.nodes[a.node].inputs.size() > g.nodes[b.node].inputs.size();
  });
  std::vector<std::vector<int>> groups;  // indices into cats; [0] is the leader
  for (size_t c = 0; c < cats.size(); ++c) {
    const Node& n = g.nodes[cats[c].node];
    bool joined = false;
    for (auto& grp : groups) {
      const CatInfo& lead = cats[grp[0]];
      const Node& l = g.nodes[lead.node];
      const ValueInfo& lo = g.values[l.outputs[0]];
      const ValueInfo& no = g.values[n.outputs[0]];
      if (lead.dim != cats[c].dim || lo.dtype != no.dtype || lo.device != no.device) continue;
      if (!std::equal(n.inputs.begin(), n.inputs.end(), l.inputs.begin())) continue;
      grp.push_back(static_cast<int>(c));
      joined = true;
      break;
    }
    if (!joined) groups.push_back({static_cast<int>(c)});
  }

  // Per rewritten cat node: its group. A group is rewritten when one of its cats would be stored.
  std::vector<std::vector<int>> consumers(g.values.size());
  for (size_t i = 0; i < g.nodes.size(); ++i)
    for (int v : g.nodes[i].inputs)
      if (valid(g, v)) consumers[v].push_back(static_cast<int>(i));
  std::map<int, int> group_of_node;
  for (size_t k = 0; k < groups.size(); ++k) {
    if (groups[k].size() < 2) continue;
    const ValueInfo& lead = g.values[g.nodes[cats[groups[k][0]].node].outputs[0]];
    if (memory_order(lead).empty()) continue;
    if (std::none_of(groups[k].begin(), groups[k].end(), [&](int c) {
          return materialized(g, g.nodes[cats[c].node].outputs[0], consumers);
        }))
      continue;
    for (int c : groups[k]) group_of_node[cats[c].node] = static_cast<int>(k);
  }
  if (group_of_node.empty()) return 0;

  const OpDef& empty = internal::registered_op("empty");
  const OpDef& permute = internal::registered_op("permute");
  const OpDef& slice = internal::registered_op("slice");
  const OpDef& copy = known_ops().copy;
  internal::NodeNamer namer(g);
  // The leaders' results, read before the nodes move into `out` (a leader may come first).
  std::vector<int> lead_output(groups.size(), -1);
  for (size_t k = 0; k < groups.size(); ++k) lead_output[k] = g.nodes[cats[groups[k][0]].node].outputs[0];
  std::vector<int> buffer(groups.size(), -1);
  std::vector<int64_t> filled(groups.size(), 0);  // leading inputs of the leader already copied
  std::vector<Node> out;
  std::vector<int> new_index(g.nodes.size(), -1);
  int rewritten = 0;
  for (size_t i = 0; i < g.nodes.size(); ++i) {
    auto it = group_of_node.find(static_cast<int>(i));
    if (it == group_of_node.end()) {
      new_index[i] = static_cast<int>(out.size());
      out.push_back(std::move(g.nodes[i]));
      continue;
    }
    const int k = it->second;
    const int64_t dim = cats[groups[k][0]].dim;
    const int lead_out = lead_output[k];
    if (buffer[k] < 0) {
      // The buffer: a dense empty tensor in the leader's memory order, permuted back.
      const ValueInfo lead = g.values[lead_out];
      const std::vector<int64_t> order = memory_order(lead);
      std::vector<int64_t> physical, inverse(order.size());
      for (size_t d = 0; d < order.size(); ++d) {
        physical.push_back(lead.sizes[order[d]]);
        inverse[order[d]] = static_cast<int64_t>(d);
      }
      Node e = make_node(empty, {}, {physical, lead.dtype, lead.device}, namer("empty"));
      e.outputs = {internal::new_value(g, lead, physical, e.name)};
      Node p = make_node(permute, {e.outputs[0]}, {inverse}, namer("permute"));
      p.outputs = {internal::new_value(g, lead, lead.sizes, p.name)};
      buffer[k] = p.outputs[0];
      out.push_back(std::move(e));
      out.push_back(std::move(p));
    }
    // Copy the inputs this cat adds to those already in the buffer, then view the prefix.
    const Node cat = std::move(g.nodes[i]);
    int64_t start = 0;
    for (size_t j = 0; j < cat.inputs.size(); ++j) {
      const int x = cat.inputs[j];
      const int64_t width = g.values[x].sizes[dim];
      if (static_cast<int64_t>(j) >= filled[k]) {
        std::vector<int64_t> sizes = g.values[buffer[k]].sizes;
        sizes[dim] = width;
        Node s = make_node(slice, {buffer[k]}, {dim, start, start + width, int64_t{1}}, namer("slice"));
        s.outputs = {internal::new_value(g, g.values[x], sizes, s.name)};
        Node c = make_node(copy, {x}, {g.values[x].dtype, g.values[x].device}, namer("copy"));
        c.outputs = {s.outputs[0]};
        c.inplace = true;
        out.push_back(std::move(s));
        out.push_back(std::move(c));
        filled[k] = static_cast<int64_t>(j) + 1;
      }
      start += width;
    }
    Node view = make_node(slice, {buffer[k]}, {dim, int64_t{0}, start, int64_t{1}}, cat.name);
    view.outputs = cat.outputs;  // the cat's value, now a view
    new_index[i] = static_cast<int>(out.size());
    out.push_back(std::move(view));
    ++rewritten;
  }
  for (ScalarSlot& s : g.scalars)
    if (s.node >= 0) s.node = new_index[s.node];
  g.nodes = std::move(out);
  refresh_layouts(g);
  return rewritten;
}

}  // namespace kiln::compiler::passes
