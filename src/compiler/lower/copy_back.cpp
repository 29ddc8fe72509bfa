// Copy-back elision (DESIGN §2.5): a kernel stores a graph input's new value straight into the
// input instead of into a fresh buffer that a `copy_` node then writes back.
//
// functionalize() turns `p.add_(...)` on a graph input into `v = add(p, ...)` plus one in-place
// copy of v into p at the end of the graph, so that the code generator sees dataflow. An
// optimizer step does this for every parameter and every state buffer: without this rewrite each
// update costs a second pass over memory. The store goes into the input when that is invisible:
//   - the kernel that stores v reads p, if at all, only at the element it writes (a pointwise
//     update), and nothing after that kernel reads p's old value or writes p;
//   - v and p have the same sizes, strides and dtype, and p shares its memory with no other input;
//   - v is not a graph output (the caller would get its input back) and nothing else writes v.
#include <algorithm>
#include <unordered_map>

#include "compiler/graph/known_ops.h"
#include "compiler/lower/loop_ir.h"

namespace kiln::compiler::lower {

namespace {

// Per value: the node steps and kernel steps touching it, in step order.
struct Uses {
  std::vector<std::vector<int>> reads, writes;
};

Uses collect_uses(const Program& p) {
  const Graph& g = p.graph;
  Uses u;
  u.reads.assign(g.values.size(), {});
  u.writes.assign(g.values.size(), {});
  for (size_t s = 0; s < p.steps.size(); ++s) {
    const Step& st = p.steps[s];
    const int si = static_cast<int>(s);
    if (st.kind == Step::Kind::kernel) {
      const Kernel& k = p.kernels[st.kernel];
      std::vector<bool> stored(k.buffers.size(), false);
      for (const Store& store : k.stores) stored[store.buffer] = true;
      for (const Store& store : k.epilogue_stores) stored[store.buffer] = true;
      if (k.kind == Kernel::reduction && k.result.buffer >= 0) stored[k.result.buffer] = true;
      for (const Expr& e : k.exprs) {
        if (e.kind == Expr::load) u.reads[st.bindings[e.buffer]].push_back(si);
        for (const Expr::Segment& seg : e.segments) u.reads[st.bindings[seg.buffer]].push_back(si);
      }
      for (size_t b = 0; b < stored.size(); ++b)
        if (stored[b]) u.writes[st.bindings[b]].push_back(si);
    } else {
      const Node& n = g.nodes[st.node];
      for (int v : n.inputs)
        if (v >= 0) u.reads[v].push_back(si);
      if (n.inplace)
        for (int v : n.outputs) u.writes[v].push_back(si);
      for (int i : n.op->mutated_input_indices(n.inputs.size(), n.attrs))
        if (i < static_cast<int>(n.inputs.size()) && n.inputs[i] >= 0) u.writes[n.inputs[i]].push_back(si);
    }
  }
  return u;
}

bool same_layout(const ValueInfo& a, const ValueInfo& b) {
  return a.sizes == b.sizes && a.strides == b.strides && a.dtype == b.dtype && a.device == b.device;
}

// Whether kernel `k` reads buffer `input` only where it stores buffer `value`.
bool reads_only_in_place(const Kernel& k, int input, int value) {
  const Store* store = nullptr;
  for (const Store& s : k.stores)
    if (s.buffer == value) store = &s;
  if (!store || k.kind != Kernel::pointwise) return false;
  for (const Expr& e : k.exprs) {
    if (e.kind == Expr::load && e.buffer == input && (e.strides != store->strides || e.offset != store->offset))
      return false;
    for (const Expr::Segment& seg : e.segments)
      if (seg.buffer == input) return false;
  }
  for (const Store& s : k.stores)
    if (s.buffer == input) return false;
  return true;
}

}  // namespace

int elide_copy_backs(Program& p) {
  const Graph& g = p.graph;
  const Uses uses = collect_uses(p);
  std::vector<int> storer(g.values.size(), -1);  // kernel step allocating each value
  for (size_t s = 0; s < p.steps.size(); ++s)
    if (p.steps[s].kind == Step::Kind::kernel)
      for (int v : p.steps[s].allocate) storer[v] = static_cast<int>(s);
  std::vector<bool> is_output(g.values.size(), false);
  for (int v : g.outputs) is_output[v] = true;
  // Values per alias group, and placeholders per group: another placeholder over the same memory
  // would see the early write.
  std::unordered_map<int, std::vector<int>> members;
  for (size_t a = 0; a < g.values.size(); ++a)
    if (g.values[a].storage >= 0) members[g.values[a].storage].push_back(static_cast<int>(a));
  std::unordered_map<int, int> placeholders;
  for (int in : g.inputs)
    if (g.values[in].storage >= 0) ++placeholders[g.values[in].storage];
  auto shares_storage = [&](int input) {
    const int group = g.values[input].storage;
    return group >= 0 && placeholders[group] > 1;
  };

  std::vector<bool> drop(p.steps.size(), false);
  int elided = 0;
  for (size_t s = 0; s < p.steps.size(); ++s) {
    const Step& st = p.steps[s];
    if (st.kind != Step::Kind::node) continue;
    const Node& n = g.nodes[st.node];
    if (n.op != &known_ops().copy || !n.inplace || n.inputs.size() != 1 || n.outputs.size() != 1) continue;
    const int v = n.inputs[0], input = n.outputs[0];
    if (v < 0 || !g.values[input].is_input || is_output[v] || storer[v] < 0) continue;
    if (!same_layout(g.values[v], g.values[input]) || shares_storage(input)) continue;
    const int k = storer[v];
    // Nothing but this copy touches the input (or a view of it) after the storing kernel, and v
    // is written once.
    auto after_kernel = [&](const std::vector<int>& steps) {
      return std::any_of(steps.begin(), steps.end(), [&](int t) { return t > k && t != static_cast<int>(s); });
    };
    bool touched_later = after_kernel(uses.reads[input]) || after_kernel(uses.writes[input]);
    if (const int group = g.values[input].storage; group >= 0)
      for (int a : members[group])
        touched_later = touched_later || after_kernel(uses.reads[a]) || after_kernel(uses.writes[a]);
    if (touched_later || uses.writes[v].size() != 1) continue;
    Step& ks = p.steps[k];
    const Kernel& kernel = p.kernels[ks.kernel];
    const auto vb = std::find(ks.bindings.begin(), ks.bindings.end(), v);
    const auto ib = std::find(ks.bindings.begin(), ks.bindings.end(), input);
    const int value_buffer = static_cast<int>(vb - ks.bindings.begin());
    if (ib != ks.bindings.end() && !reads_only_in_place(kernel, static_cast<int>(ib - ks.bindings.begin()), value_buffer))
      continue;
    if (ib == ks.bindings.end() && kernel.kind != Kernel::pointwise) continue;
    ks.allocate.erase(std::find(ks.allocate.begin(), ks.allocate.end(), v));
    ks.write_into.emplace_back(v, input);
    drop[s] = true;
    ++elided;
  }
  if (elided == 0) return 0;
  // Remove the dropped copies; what they released, the step before releases.
  std::vector<Step> kept;
  kept.reserve(p.steps.size());
  for (size_t s = 0; s < p.steps.size(); ++s) {
    if (!drop[s]) {
      kept.push_back(std::move(p.steps[s]));
      continue;
    }
    if (!kept.empty())
      kept.back().release.insert(kept.back().release.end(), p.steps[s].release.begin(), p.steps[s].release.end());
  }
  p.steps = std::move(kept);
  p.extern_nodes -= elided;
  return elided;
}

}  // namespace kiln::compiler::lower
