// The scheduler: groups graph nodes into kernels (DESIGN §2.5, "fusion").
//
// Walking the nodes in program order, consecutive pointwise nodes with the same output shape form
// one kernel; their inputs from outside the group are loads (broadcast by stride 0), values used
// only inside the group stay in registers, and values used later (or returned) are stored. A
// reduction whose input is produced by the open group takes the group as its prologue: one loop
// nest computes the group's values, stores those needed later, and accumulates. Pointwise nodes
// over the reduction's result shape that read it (x.sum(1) * 2 + 1, a norm's rsqrt(var + eps))
// join as its epilogue, computed once per result element after the reduced loops. Everything else
// (GEMM, convolution, pooling, views, random ops, in-place nodes left by functionalization) runs
// through the dispatcher as a node step.
#include <algorithm>
#include <map>
#include <optional>
#include <set>

#include "compiler/graph/known_ops.h"
#include "compiler/graph/passes.h"
#include "compiler/lower/node_lowering.h"

namespace kiln::compiler::lower {

namespace {

// Strides of value `v` read over an iteration space `sizes` (right-aligned; 0 where broadcast).
std::vector<int64_t> broadcast_strides(const ValueInfo& v, const std::vector<int64_t>& sizes) {
  std::vector<int64_t> s(sizes.size(), 0);
  const size_t rank = v.sizes.size();
  for (size_t i = 0; i < rank; ++i) {
    size_t d = sizes.size() - rank + i;
    s[d] = v.sizes[i] == 1 ? 0 : v.strides[i];
  }
  return s;
}

// A cat the code generator can fuse: one device (CPU or CUDA), one dtype, every input a value of
// the output's rank.
bool is_lowerable_cat(const Graph& g, int node) {
  const Node& n = g.nodes[node];
  if (n.op != &known_ops().cat || n.inplace || n.outputs.size() != 1 || n.inputs.empty()) return false;
  const ValueInfo& out = g.values[n.outputs[0]];
  if (!codegen_dtype(out.dtype) || !(out.device.is_cpu() || out.device.is_cuda())) return false;
  for (int v : n.inputs) {
    if (v < 0) return false;
    const ValueInfo& in = g.values[v];
    if (in.dtype != out.dtype || in.sizes.size() != out.sizes.size() || in.device != out.device) return false;
  }
  return true;
}

struct Builder {
  const Graph& g;
  Program& p;
  std::vector<std::vector<int>> consumers;  // per value: consuming node indices
  std::vector<bool> is_output;

  // The open pointwise group.
  struct Group {
    Kernel kernel;
    std::set<int> nodes;
    std::map<int, int> expr_of;    // value -> expression (produced in the group, or loaded)
    std::map<int, int> buffer_of;  // value -> buffer index
    std::vector<int> bindings;
    std::vector<int> produced;     // values produced in the group, in order
    std::vector<int64_t> cat_bounds;  // segment starts of the group's fused cat (at most one layout)
    int cat_dim = -1;
    // A reduction kept open for its epilogue: its result value, the result's sizes (the
    // epilogue's shape), its keepdim, and the epilogue's values and expressions.
    int reduction_out = -1;
    std::vector<int64_t> epilogue_sizes;
    bool keepdim = false;
    std::map<int, int> epi_expr_of;  // the result, values loaded or computed in the epilogue
    std::vector<int> epi_produced;   // values the epilogue computes
    bool is_reduction() const { return kernel.kind == Kernel::reduction; }
    // The result or a value the epilogue computes (not one it only loads).
    bool result_or_epilogue(int v) const {
      return v == reduction_out || std::find(epi_produced.begin(), epi_produced.end(), v) != epi_produced.end();
    }
    bool produces(int v) const {
      return result_or_epilogue(v) || std::find(produced.begin(), produced.end(), v) != produced.end();
    }
  };
  std::vector<Group> open;  // open groups, oldest first

  int buffer(Group& grp, int v) {
    auto [it, inserted] = grp.buffer_of.try_emplace(v, static_cast<int>(grp.bindings.size()));
    if (inserted) {
      grp.bindings.push_back(v);
      grp.kernel.buffers.push_back(g.values[v].dtype);
      grp.kernel.host_buffers.push_back(g.values[v].device != grp.kernel.device);
    }
    return it->second;
  }

  int load(Group& grp, int v) {
    if (auto it = grp.expr_of.find(v); it != grp.expr_of.end()) return it->second;
    if (deferred[v] >= 0) return inline_deferred(grp, v);
    Expr e;
    e.kind = Expr::load;
    e.buffer = buffer(grp, v);
    e.strides = broadcast_strides(g.values[v], grp.kernel.sizes);
    e.dtype = g.values[v].dtype;
    ExprBuilder b(grp.kernel, g);
    int id = b.add(std::move(e));
    grp.expr_of[v] = id;
    return id;
  }

  Group start(const std::vector<int64_t>& sizes, const Device& device) {
    Group grp;
    grp.kernel.sizes = sizes;  // named when emitted
    grp.kernel.device = device;
    return grp;
  }

  void add_pointwise(Group& grp, int node) {
    const Node& n = g.nodes[node];
    std::vector<int> in;
    for (int v : n.inputs) in.push_back(v >= 0 ? load(grp, v) : -1);
    ExprBuilder b(grp.kernel, g);
    int e = lower_pointwise(b, g, node, in);
    grp.expr_of[n.outputs[0]] = e;
    grp.nodes.insert(node);
    grp.produced.push_back(n.outputs[0]);
    grp.kernel.ops.push_back(n.name.empty() ? n.op->name : n.name);
    ++p.fused_nodes;
  }

  // The segment layout a cat node would bring into a group.
  std::pair<int, std::vector<int64_t>> cat_layout(int node) const {
    const Node& n = g.nodes[node];
    const ValueInfo& out = g.values[n.outputs[0]];
    int64_t rank = static_cast<int64_t>(out.sizes.size());
    int64_t dim = std::get<int64_t>(n.attrs.at(0));
    if (dim < 0) dim += rank;
    std::vector<int64_t> starts;
    int64_t at = 0;
    for (int v : n.inputs) {
      starts.push_back(at);
      at += g.values[v].sizes[dim];
    }
    return {static_cast<int>(dim), starts};
  }

  void add_cat(Group& grp, int node) {
    const Node& n = g.nodes[node];
    auto [dim, starts] = cat_layout(node);
    Expr e;
    e.kind = Expr::cat;
    e.dtype = g.values[n.outputs[0]].dtype;
    e.cat_dim = dim;
    for (size_t k = 0; k < n.inputs.size(); ++k) {
      const ValueInfo& in = g.values[n.inputs[k]];
      Expr::Segment seg;
      seg.buffer = buffer(grp, n.inputs[k]);
      seg.strides.assign(in.sizes.size(), 0);
      for (size_t d = 0; d < in.sizes.size(); ++d) seg.strides[d] = in.sizes[d] == 1 ? 0 : in.strides[d];
      seg.start = starts[k];
      seg.end = starts[k] + in.sizes[dim];
      e.segments.push_back(std::move(seg));
    }
    ExprBuilder b(grp.kernel, g);
    grp.expr_of[n.outputs[0]] = b.add(std::move(e));
    grp.cat_dim = dim;
    grp.cat_bounds = starts;
    grp.nodes.insert(node);
    grp.produced.push_back(n.outputs[0]);
    grp.kernel.ops.push_back(n.name.empty() ? n.op->name : n.name);
    ++p.fused_nodes;
  }

  // Values of the group that someone outside it reads.
  bool needed_outside(const Group& grp, int v, int except_node = -1) const {
    if (is_output[v]) return true;
    for (int c : consumers[v])
      if (c != except_node && !grp.nodes.count(c)) return true;
    return false;
  }

  void add_stores(Group& grp, int except_node, Step& step) {
    for (int v : grp.produced) {
      if (!needed_outside(grp, v, except_node)) continue;
      Store s;
      s.buffer = buffer(grp, v);
      s.strides = broadcast_strides(g.values[v], grp.kernel.sizes);
      s.expr = grp.expr_of.at(v);
      grp.kernel.stores.push_back(s);
      step.allocate.push_back(v);
    }
  }

  // Emits open group `i` as a kernel step (if it stores anything) and forgets it.
  void close(size_t i) {
    Group grp = std::move(open[i]);
    open.erase(open.begin() + static_cast<std::ptrdiff_t>(i));
    Step step;
    step.kind = Step::Kind::kernel;
    add_stores(grp, -1, step);
    if (grp.is_reduction()) {
      // The result is stored when someone outside the kernel reads it; so are epilogue values.
      if (needed_outside(grp, grp.reduction_out)) {
        grp.kernel.result.buffer = buffer(grp, grp.reduction_out);
        step.allocate.push_back(grp.reduction_out);
      }
      for (int v : grp.epi_produced) {
        if (!needed_outside(grp, v)) continue;
        Store st;
        st.buffer = buffer(grp, v);
        st.strides = epilogue_strides(grp, v);
        st.expr = grp.epi_expr_of.at(v);
        grp.kernel.epilogue_stores.push_back(st);
        step.allocate.push_back(v);
      }
    }
    step.kernel = static_cast<int>(p.kernels.size());
    step.bindings = grp.bindings;
    if (!grp.kernel.stores.empty() || grp.is_reduction()) {
      grp.kernel.name = "kiln_kernel_" + std::to_string(p.kernels.size());
      p.kernels.push_back(std::move(grp.kernel));
      p.steps.push_back(std::move(step));
    }
  }
  void close_all() {
    while (!open.empty()) close(0);
  }
  // The open group producing value v, or -1.
  int producer_group(int v) const {
    for (size_t i = 0; i < open.size(); ++i)
      if (open[i].produces(v)) return static_cast<int>(i);
    return -1;
  }

  // Deferred nodes (GPU only): small pointwise nodes whose every reader is a pointwise node over a
  // larger shape it broadcasts into (a batch norm's rsqrt(running_var + eps) per channel, read by
  // the normalization over N x C x H x W). They get no kernel of their own: each group reading
  // the value computes it in place from its inputs. On a GPU a kernel launch costs more than
  // recomputing a few operations per element; on the CPU the separate tiny loop is cheaper.
  std::vector<int> deferred;        // per value: the node computing it where deferred, else -1
  std::vector<bool> deferrable_node;  // per node, decided before scheduling (consumers first)
  std::optional<passes::internal::WriteIndex> writes;  // which nodes write each value's memory
  std::vector<size_t> last_reader_of;  // per deferrable node: the last node that computes it

  // Whether `node` may be deferred: every reader is a pointwise node over a shape at least 16
  // times larger, or a deferrable node itself (rsqrt(var + eps): the add is read by the rsqrt,
  // only the rsqrt by the normalization), and no node up to the last reader writes the memory the
  // node reads (a reader after a fused optimizer step would recompute it from the new parameters).
  bool deferrable(int node) {
    const Node& n = g.nodes[node];
    if (is_lowerable_cat(g, node) || !is_lowerable_pointwise(g, node)) return false;
    if (n.outputs.size() != 1 || n.inplace || n.has_side_effects()) return false;
    const int v = n.outputs[0];
    const ValueInfo& vi = g.values[v];
    if (!vi.device.is_cuda() || is_output[v] || consumers[v].empty()) return false;
    size_t last_reader = 0;  // where the value is computed last: its readers, or theirs when deferred too
    for (int c : consumers[v])
      last_reader = std::max(last_reader, deferrable_node[c] ? last_reader_of[c] : static_cast<size_t>(c));
    for (int u : n.inputs)
      if (u >= 0 && writes->written_between(u, static_cast<size_t>(node) + 1, last_reader)) return false;
    auto numel = [](const ValueInfo& x) {
      int64_t n = 1;
      for (int64_t d : x.sizes) n *= d;
      return n;
    };
    for (int c : consumers[v]) {
      if (is_lowerable_cat(g, c) || !is_lowerable_pointwise(g, c)) return false;
      const ValueInfo& out = g.values[g.nodes[c].outputs[0]];
      if (out.device != vi.device) return false;
      if (numel(out) < 16 * std::max<int64_t>(numel(vi), 1) && !deferrable_node[c]) return false;
    }
    last_reader_of[node] = last_reader;
    return true;
  }

  void defer(int node) {
    const Node& n = g.nodes[node];
    // Its inputs that open groups compute are stored first (a deferred value reads only memory
    // or other deferred values).
    close_producers_of(n);
    deferred[n.outputs[0]] = node;
    ++p.fused_nodes;
  }

  int inline_deferred(Group& grp, int v) {
    const int node = deferred[v];
    const Node& n = g.nodes[node];
    std::vector<int> in;
    for (int u : n.inputs) in.push_back(u >= 0 ? load(grp, u) : -1);
    ExprBuilder b(grp.kernel, g);
    const int e = lower_pointwise(b, g, node, in);
    grp.expr_of[v] = e;
    grp.kernel.ops.push_back(n.name.empty() ? n.op->name : n.name);
    return e;
  }

  // Strides of value v (of the epilogue's shape, or broadcast to it) over the reduction kernel's
  // iteration dims: the result's dims map to the kept dims, reduced dims get stride 0.
  std::vector<int64_t> epilogue_strides(const Group& grp, int v) const {
    const std::vector<int64_t> over_result = broadcast_strides(g.values[v], grp.epilogue_sizes);
    std::vector<int64_t> out(grp.kernel.sizes.size(), 0);
    for (size_t d = 0, j = 0; d < out.size(); ++d) {
      if (grp.kernel.reduced[d]) {
        if (grp.keepdim) ++j;
        continue;
      }
      out[d] = over_result[j++];
    }
    return out;
  }

  // The open reduction a pointwise node joins as epilogue: same shape as the result, reading the
  // result or an earlier epilogue value, every other input already in memory. -1 when none.
  int epilogue_group_for(int node) const {
    const Node& n = g.nodes[node];
    const auto& sizes = g.values[n.outputs[0]].sizes;
    for (size_t i = 0; i < open.size(); ++i) {
      const Group& r = open[i];
      if (!r.is_reduction() || full(r) || r.epilogue_sizes != sizes) continue;
      if (r.kernel.device != g.values[n.outputs[0]].device) continue;
      if (std::find(r.kernel.sizes.begin(), r.kernel.sizes.end(), 0) != r.kernel.sizes.end()) continue;
      bool related = false, loadable = true;
      for (int v : n.inputs) {
        if (v < 0) continue;
        if (r.result_or_epilogue(v)) related = true;
        else if (producer_group(v) >= 0 || deferred[v] >= 0) loadable = false;  // not in memory
      }
      if (related && loadable) return static_cast<int>(i);
    }
    return -1;
  }

  void add_epilogue(Group& grp, int node) {
    const Node& n = g.nodes[node];
    Kernel& k = grp.kernel;
    if (k.epilogue_begin < 0) k.epilogue_begin = static_cast<int>(k.exprs.size());
    ExprBuilder b(k, g);
    std::vector<int> in;
    for (int v : n.inputs) {
      if (v < 0) {
        in.push_back(-1);
        continue;
      }
      auto it = grp.epi_expr_of.find(v);
      if (it == grp.epi_expr_of.end()) {
        Expr e;
        e.dtype = g.values[v].dtype;
        if (v == grp.reduction_out) {
          e.kind = Expr::reduced;
        } else {
          e.kind = Expr::load;
          e.buffer = buffer(grp, v);
          e.strides = epilogue_strides(grp, v);
        }
        it = grp.epi_expr_of.emplace(v, b.add(std::move(e))).first;
      }
      in.push_back(it->second);
    }
    grp.epi_expr_of[n.outputs[0]] = lower_pointwise(b, g, node, in);
    grp.epi_produced.push_back(n.outputs[0]);
    grp.nodes.insert(node);
    k.ops.push_back(n.name.empty() ? n.op->name : n.name);
    ++p.fused_nodes;
  }
  // Materializes the inputs of `node` that open groups other than `keep` produce.
  void close_producers_of(const Node& n, int keep = -1) {
    for (int v : n.inputs) {
      if (v < 0) continue;
      int i = producer_group(v);
      if (i >= 0 && i != keep) {
        close(static_cast<size_t>(i));
        return close_producers_of(n, keep < 0 ? -1 : (keep > i ? keep - 1 : keep));
      }
    }
  }

  void add_reduction(int node, const ReductionInfo& r) {
    const Node& n = g.nodes[node];
    const int x = n.inputs[0];
    const ValueInfo& xi = g.values[x];
    Group grp;
    int i = producer_group(x);
    if (i >= 0 && !open[i].is_reduction() && open[i].kernel.sizes == xi.sizes && open[i].cat_dim < 0 &&
        open[i].kernel.device == xi.device) {
      grp = std::move(open[i]);  // prologue fusion: the group's loop nest also reduces
      open.erase(open.begin() + i);
    } else {
      close_producers_of(n);
      grp = start(xi.sizes, xi.device);
    }
    Kernel& k = grp.kernel;
    k.kind = Kernel::reduction;
    k.reduced = r.reduced;
    k.reduce_op = r.op;
    k.acc_dtype = r.acc;
    int in = load(grp, x);
    ExprBuilder b(k, g);
    k.reduce_expr = b.cast(in, r.acc);
    int64_t count = 1;
    for (size_t d = 0; d < xi.sizes.size(); ++d)
      if (r.reduced[d]) count *= xi.sizes[d];
    if (r.mean) {
      k.scale = count == 0 ? std::numeric_limits<double>::quiet_NaN() : 1.0 / static_cast<double>(count);
      k.mean_count = count;
    }
    const int y = n.outputs[0];
    const ValueInfo& yi = g.values[y];
    k.result.strides.assign(xi.sizes.size(), 0);
    for (size_t d = 0, od = 0; d < xi.sizes.size(); ++d) {
      if (r.reduced[d]) {
        if (r.keepdim) ++od;
        continue;
      }
      k.result.strides[d] = yi.sizes[od] == 1 ? 0 : yi.strides[od];
      ++od;
    }
    grp.nodes.insert(node);
    k.ops.push_back(n.name.empty() ? n.op->name : n.name);
    ++p.fused_nodes;
    // Open until a node needs its values: pointwise work on the result may still join.
    grp.reduction_out = y;
    grp.epilogue_sizes = yi.sizes;
    grp.keepdim = r.keepdim;
    open.push_back(std::move(grp));
  }

  // A group this big stops taking nodes: independent work of one shape (the optimizer update of
  // every same-sized parameter) would otherwise become one loop body of thousands of statements,
  // which the C++ compiler takes tens of seconds to build. Smaller groups cost nothing at run time
  // and identical ones are emitted once.
  static bool full(const Group& grp) { return grp.nodes.size() >= 32 || grp.bindings.size() >= 24; }

  // The open group a pointwise node of these sizes (and cat layout) joins; -1 when none fits.
  int group_for(const std::vector<int64_t>& sizes, const Device& device, int cat_dim,
                const std::vector<int64_t>* bounds) const {
    for (size_t i = 0; i < open.size(); ++i) {
      if (open[i].is_reduction() || open[i].kernel.sizes != sizes || open[i].kernel.device != device || full(open[i]))
        continue;
      if (bounds && open[i].cat_dim >= 0 && (open[i].cat_dim != cat_dim || open[i].cat_bounds != *bounds)) continue;
      return static_cast<int>(i);
    }
    return -1;
  }

  // Several groups (one per iteration space) stay open at once, so independent work of another
  // shape (a batch norm's per-channel scale between a cat and its normalization) does not split a
  // group. A node that reads a value an open group produces closes that group first (the value
  // must be in memory); a node with side effects closes every group (they must not move across
  // the write).
  void run() {
    consumers.assign(g.values.size(), {});
    is_output.assign(g.values.size(), false);
    for (size_t i = 0; i < g.nodes.size(); ++i)
      for (int v : g.nodes[i].inputs)
        if (v >= 0) consumers[v].push_back(static_cast<int>(i));
    for (int v : g.outputs) is_output[v] = true;
    deferred.assign(g.values.size(), -1);
    deferrable_node.assign(g.nodes.size(), false);
    writes.emplace(g);
    last_reader_of.assign(g.nodes.size(), 0);
    for (size_t i = g.nodes.size(); i-- > 0;) deferrable_node[i] = deferrable(static_cast<int>(i));

    for (size_t i = 0; i < g.nodes.size(); ++i) {
      const int node = static_cast<int>(i);
      const Node& n = g.nodes[i];
      const bool cat = is_lowerable_cat(g, node);
      if (deferrable_node[i]) {
        defer(node);
        continue;
      }
      if (!cat && is_lowerable_pointwise(g, node)) {
        if (int r = epilogue_group_for(node); r >= 0) {
          add_epilogue(open[r], node);
          continue;
        }
      }
      if (cat || is_lowerable_pointwise(g, node)) {
        const auto& sizes = g.values[n.outputs[0]].sizes;
        const Device device = g.values[n.outputs[0]].device;
        std::pair<int, std::vector<int64_t>> layout{-1, {}};
        if (cat) layout = cat_layout(node);
        // A cat reads its inputs from memory: those an open group computes are stored first.
        if (cat) close_producers_of(n);
        int gi = group_for(sizes, device, layout.first, cat ? &layout.second : nullptr);
        if (gi < 0) {
          // A cat whose layout differs from the same-sized open group's: that group closes.
          if (cat)
            if (int same = group_for(sizes, device, -1, nullptr); same >= 0) close(static_cast<size_t>(same));
          close_producers_of(n);
          open.push_back(start(sizes, device));
          gi = static_cast<int>(open.size()) - 1;
        } else {
          close_producers_of(n, gi);
          gi = group_for(sizes, device, layout.first, cat ? &layout.second : nullptr);
        }
        if (cat) add_cat(open[gi], node);
        else add_pointwise(open[gi], node);
        continue;
      }
      if (auto r = lowerable_reduction(g, node)) {
        add_reduction(node, *r);
        continue;
      }
      if (n.has_side_effects()) close_all();
      else close_producers_of(n);
      Step step;
      step.kind = Step::Kind::node;
      step.node = node;
      p.steps.push_back(step);
      ++p.extern_nodes;
    }
    close_all();
    compute_releases();
  }

  // Frees each value after the last step that reads or writes it (outputs and constants live on).
  void compute_releases() {
    std::vector<int> last(g.values.size(), -1);
    auto touch = [&](int v, int s) {
      if (v >= 0) last[v] = s;
    };
    for (size_t s = 0; s < p.steps.size(); ++s) {
      const Step& st = p.steps[s];
      if (st.kind == Step::Kind::kernel) {
        for (int v : st.bindings) touch(v, static_cast<int>(s));
      } else {
        const Node& n = g.nodes[st.node];
        for (int v : n.inputs) touch(v, static_cast<int>(s));
        for (int v : n.outputs) touch(v, static_cast<int>(s));
      }
    }
    for (int v : g.outputs) last[v] = -1;
    for (const auto& c : g.constants) last[c.first] = -1;
    for (int v : g.inputs) last[v] = -1;  // the caller's tensors: nothing to free
    for (size_t v = 0; v < last.size(); ++v)
      if (last[v] >= 0) p.steps[last[v]].release.push_back(static_cast<int>(v));
  }
};

}  // namespace

Program schedule(Graph graph) {
  Program p;
  p.graph = std::move(graph);
  Builder b{p.graph, p, {}, {}, {}};
  b.run();
  return p;
}

namespace {
std::string value_name(const Graph& g, int v) {
  if (!g.values[v].name.empty()) return g.values[v].name;
  std::string s = "v";
  s += std::to_string(v);
  return s;
}
}  // namespace

std::string describe(const Program& p) {
  std::string out;
  for (size_t s = 0; s < p.steps.size(); ++s) {
    const Step& st = p.steps[s];
    if (st.kind == Step::Kind::node) {
      const Node& n = p.graph.nodes[st.node];
      out += "step " + std::to_string(s) + ": dispatch " + (n.name.empty() ? n.op->name : n.name) + " (" +
             n.op->name + ")\n";
      continue;
    }
    const Kernel& k = p.kernels[st.kernel];
    out += "step " + std::to_string(s) + ": " + k.name + " (" +
           (k.kind == Kernel::pointwise ? "pointwise" : std::string("reduction ") + reduce_op_name(k.reduce_op)) + ") over [";
    for (size_t d = 0; d < k.sizes.size(); ++d) out += (d ? ", " : "") + std::to_string(k.sizes[d]);
    out += "]";
    if (!k.device.is_cpu()) out += " on " + k.device.str();
    out += ", fuses";
    for (const auto& op : k.ops) out += " " + op;
    out += "; buffers";
    for (int v : st.bindings) {
      out += " %";
      if (p.graph.values[v].name.empty()) {
        out += 'v';
        out += std::to_string(v);
      } else {
        out += p.graph.values[v].name;
      }
    }
    for (auto [v, input] : st.write_into)
      out += "; stores %" + value_name(p.graph, v) + " into input %" + value_name(p.graph, input);
    out += "\n";
  }
  return out;
}

}  // namespace kiln::compiler::lower
