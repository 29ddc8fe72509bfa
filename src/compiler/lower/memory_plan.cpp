// Static memory planning for reduce_overhead (see memory_plan.h).
#include "compiler/lower/memory_plan.h"

#include <algorithm>
#include <numeric>

#include "core/shape.h"

namespace kiln::compiler::lower {

namespace {

struct AliasClasses {
  std::vector<int> parent;
  explicit AliasClasses(size_t n) : parent(n) { std::iota(parent.begin(), parent.end(), 0); }
  int find(int v) {
    while (parent[v] != v) v = parent[v] = parent[parent[v]];
    return v;
  }
  void join(int a, int b) { parent[find(a)] = find(b); }
};

// Bytes the value's sizes and strides span from its first element; -1 when it cannot be planned
// (negative strides).
int64_t span_bytes(const ValueInfo& v) {
  if (std::find(v.sizes.begin(), v.sizes.end(), 0) != v.sizes.end()) return 0;
  for (size_t d = 0; d < v.sizes.size(); ++d)
    if (d >= v.strides.size() || v.strides[d] < 0) return -1;
  return kiln::detail::storage_span(v.sizes, v.strides) * static_cast<int64_t>(itemsize(v.dtype));
}

int64_t align(int64_t n) { return (n + MemoryPlan::kAlignment - 1) / MemoryPlan::kAlignment * MemoryPlan::kAlignment; }

bool overlaps_in_time(const MemoryPlan::Entry& a, const MemoryPlan::Entry& b) {
  return a.first <= b.last && b.first <= a.last;
}

}  // namespace

MemoryPlan plan_memory(const Program& p) {
  const Graph& g = p.graph;
  const size_t nv = g.values.size();
  MemoryPlan plan;
  plan.entry_of.assign(nv, -1);
  plan.out_node.assign(g.nodes.size(), false);

  // Alias classes: storage groups, and every view node's output with its base (passes may add
  // views whose storage group was not filled in).
  AliasClasses alias(nv);
  std::vector<int> group_rep;
  for (size_t v = 0; v < nv; ++v) {
    int s = g.values[v].storage;
    if (s < 0) continue;
    if (static_cast<size_t>(s) >= group_rep.size()) group_rep.resize(s + 1, -1);
    if (group_rep[s] < 0) group_rep[s] = static_cast<int>(v);
    else alias.join(static_cast<int>(v), group_rep[s]);
  }
  for (const Node& n : g.nodes)
    if (n.is_view() && !n.inputs.empty() && n.inputs[0] >= 0)
      for (int o : n.outputs) alias.join(o, n.inputs[0]);

  // Classes whose memory the program does not own or must keep past the call.
  std::vector<bool> pinned(nv, false);
  auto pin = [&](int v) {
    if (v >= 0) pinned[alias.find(v)] = true;
  };
  for (int v : g.inputs) pin(v);
  for (int v : g.outputs) pin(v);
  for (const auto& c : g.constants) pin(c.first);
  for (size_t v = 0; v < nv; ++v)
    if (!g.values[v].device.is_cpu() || span_bytes(g.values[v]) < 0) pin(static_cast<int>(v));

  // Last step touching each class.
  std::vector<int> last(nv, -1);
  auto touch = [&](int v, int s) {
    if (v < 0) return;
    int c = alias.find(v);
    last[c] = std::max(last[c], s);
  };
  for (size_t s = 0; s < p.steps.size(); ++s) {
    const Step& st = p.steps[s];
    const int si = static_cast<int>(s);
    if (st.kind == Step::Kind::kernel) {
      for (int v : st.bindings) touch(v, si);
    } else {
      const Node& n = g.nodes[st.node];
      for (int v : n.inputs) touch(v, si);
      for (int v : n.outputs) touch(v, si);
    }
  }

  auto plannable = [&](int v) { return v >= 0 && !pinned[alias.find(v)]; };
  auto add = [&](int v, int step) {
    MemoryPlan::Entry e;
    e.value = v;
    e.nbytes = span_bytes(g.values[v]);
    e.first = step;
    e.last = std::max(step, last[alias.find(v)]);
    plan.entry_of[v] = static_cast<int>(plan.entries.size());
    plan.entries.push_back(e);
  };
  for (size_t s = 0; s < p.steps.size(); ++s) {
    const Step& st = p.steps[s];
    if (st.kind == Step::Kind::kernel) {
      for (int v : st.allocate)
        if (plannable(v)) add(v, static_cast<int>(s));
      continue;
    }
    // A dispatched node writes into the arena when it makes new memory (not a view, not in
    // place) laid out exactly as the recorded metadata, which is what call_op would allocate.
    const Node& n = g.nodes[st.node];
    if (n.inplace || n.is_view() || n.outputs.empty()) continue;
    bool ok = true;
    for (int v : n.outputs) ok = ok && plannable(v) && g.values[v].storage_offset == 0;
    if (!ok) continue;
    for (int v : n.outputs) add(v, static_cast<int>(s));
    plan.out_node[st.node] = true;
  }

  // Greedy best fit: largest first; each takes the smallest gap between the entries already
  // placed that are live at a common step, or goes above them.
  std::vector<int> order(plan.entries.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int a, int b) { return plan.entries[a].nbytes > plan.entries[b].nbytes; });
  std::vector<int> placed;
  for (int i : order) {
    MemoryPlan::Entry& e = plan.entries[i];
    plan.unplanned_bytes += align(e.nbytes);
    std::vector<std::pair<int64_t, int64_t>> busy;  // [offset, end) of live neighbours
    for (int j : placed)
      if (overlaps_in_time(e, plan.entries[j]))
        busy.emplace_back(plan.entries[j].offset, plan.entries[j].offset + align(plan.entries[j].nbytes));
    std::sort(busy.begin(), busy.end());
    const int64_t need = align(e.nbytes);
    int64_t best = -1, best_gap = 0, at = 0;
    for (auto [lo, hi] : busy) {
      if (lo - at >= need && (best < 0 || lo - at < best_gap)) {
        best = at;
        best_gap = lo - at;
      }
      at = std::max(at, hi);
    }
    e.offset = best >= 0 ? best : at;
    plan.arena_bytes = std::max(plan.arena_bytes, e.offset + need);
    placed.push_back(i);
  }
  return plan;
}

std::string describe(const MemoryPlan& plan, const Program& p) {
  if (plan.empty()) return "";
  std::string out = "memory plan (reduce_overhead): arena " + std::to_string(plan.arena_bytes) + " bytes for " +
                    std::to_string(plan.entries.size()) + " values (" + std::to_string(plan.unplanned_bytes) +
                    " bytes unshared)\n";
  for (const auto& e : plan.entries) {
    const ValueInfo& v = p.graph.values[e.value];
    out += "  %";
    if (v.name.empty()) {
      out += 'v';
      out += std::to_string(e.value);
    } else {
      out += v.name;
    }
    out += ": offset " + std::to_string(e.offset) + ", " + std::to_string(e.nbytes) + " bytes, steps " +
           std::to_string(e.first) + ".." + std::to_string(e.last) + "\n";
  }
  int out_nodes = 0;
  for (bool b : plan.out_node) out_nodes += b;
  out += "  dispatched nodes writing into the arena: " + std::to_string(out_nodes) + "\n";
  return out;
}

std::string find_overlap(const MemoryPlan& plan) {
  for (size_t i = 0; i < plan.entries.size(); ++i) {
    const auto& a = plan.entries[i];
    if (a.offset % MemoryPlan::kAlignment != 0 || a.offset + a.nbytes > plan.arena_bytes)
      return "value " + std::to_string(a.value) + " is misaligned or outside the arena";
    for (size_t j = i + 1; j < plan.entries.size(); ++j) {
      const auto& b = plan.entries[j];
      if (!overlaps_in_time(a, b) || a.nbytes == 0 || b.nbytes == 0) continue;
      if (a.offset < b.offset + b.nbytes && b.offset < a.offset + a.nbytes)
        return "values " + std::to_string(a.value) + " and " + std::to_string(b.value) + " share bytes while both live";
    }
  }
  return "";
}

}  // namespace kiln::compiler::lower
