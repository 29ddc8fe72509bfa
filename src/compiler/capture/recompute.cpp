// The min-cut partition of saved values (DESIGN §2.3, AOTAutograd's partitioner; see segment.h).
//
// When a forward graph runs, autograd holds some of its values for the backward: a mul saves its
// inputs, a sin its input, a relu its result. Saving costs a store in the forward, memory until the
// backward, and a load there. For a value that a few pointwise ops compute from tensors the
// backward holds anyway, recomputing it in the backward is cheaper: the backward's fused kernel
// computes it in registers from what it loads already. So at the flush, a live value is left out of the
// graph's outputs when
//   - only saved tensors of autograd nodes recorded in this segment hold it (no user handle, no
//     view, no other node): counted by references, so anything uncounted keeps it saved;
//   - the op that produced it is fusible (OpDef::is_fusible), deterministic, writes nothing else;
//   - nothing writes the value's memory after its producer ran, nor the memory of what a recipe
//     reads after the node that read it (in-place ops, mutated inputs, through aliases): a recipe
//     replays its node on the values as they are after the graph;
//   - each of that op's inputs is a graph input or a value autograd saved (kept or recomputed
//     itself), or a value nothing holds that a short chain of such ops computes from those (up to
//     kMaxChain ops: relu(x * w + b) saves only x, w and b), so the recipes keep alive nothing the
//     backward would not hold anyway.
// Its saved handles then hold a Recipe. GEMMs, convolutions, reductions, random ops and
// everything else stay saved, as the partitioner never recomputes them.
#include <algorithm>
#include <functional>
#include <unordered_map>
#include <unordered_set>

#include "autograd/node.h"
#include "compiler/capture/runtime.h"
#include "compiler/capture/segment.h"
#include "compiler/graph/passes.h"
#include "core/shape.h"
#include "core/dispatch.h"
#include "kiln/autograd.h"

namespace kiln::compiler::detail {

using kiln::detail::Storage;
using kiln::detail::TensorImpl;

namespace {

bool cheap_to_recompute(const Node& n) {
  const OpDef& op = *n.op;
  return !n.inplace && n.outputs.size() == 1 && op.kind == OpKind::compute && op.is_fusible() &&
         !op.may_mutate_inputs() && op.runtime_attrs.empty();
}

// Ops on the longest chain one recomputed value may replay.
constexpr int kMaxChain = 4;

// An empty storage (no data yet) big enough for value v.
std::shared_ptr<Storage> pending_storage(const ValueInfo& v) {
  auto storage = std::make_shared<Storage>();
  const int64_t span = kiln::detail::storage_span(v.sizes, v.strides);
  storage->nbytes = span == 0 ? 0 : (v.storage_offset + span) * static_cast<int64_t>(itemsize(v.dtype));
  storage->device = v.device;
  return storage;
}

bool same_layout(const TensorImpl& impl, const ValueInfo& v) {
  return impl.sizes == v.sizes && impl.strides == v.strides && impl.storage_offset == v.storage_offset &&
         impl.dtype == v.dtype && impl.device == v.device;
}

}  // namespace

std::vector<RecomputedValue> split_recomputed(Segment& seg, std::vector<std::shared_ptr<Storage>>& live,
                                              std::vector<std::vector<std::shared_ptr<TensorImpl>>>& free_handles) {
  Graph& g = seg.graph;
  // Saved references per handle, over the nodes recorded in this segment (each node once).
  std::vector<std::shared_ptr<autograd::Node>> nodes;  // alive for the count
  std::unordered_set<const autograd::Node*> seen;
  std::unordered_map<const TensorImpl*, long> refs;
  std::unordered_map<const Storage*, std::vector<const Tensor*>> saved_on;  // one entry per distinct handle
  for (const auto& w : seg.autograd_nodes) {
    std::shared_ptr<autograd::Node> n = w.lock();
    if (!n || !seen.insert(n.get()).second) continue;
    auto* op = dynamic_cast<autograd::OpNode*>(n.get());
    if (!op) continue;  // other nodes' references stay uncounted: what they hold stays saved
    for (const auto* list : {&op->saved_inputs, &op->saved_outputs})
      for (const autograd::SavedTensor& s : *list) {
        const Tensor& t = s.peek();
        if (!t.defined()) continue;
        if (refs[&t.impl()]++ == 0) saved_on[t.impl().storage.get()].push_back(&t);
      }
    nodes.push_back(std::move(n));
  }
  if (saved_on.empty()) return {};

  std::vector<int> producer(g.values.size(), -1);
  for (size_t i = 0; i < g.nodes.size(); ++i)
    if (!g.nodes[i].inplace)
      for (int v : g.nodes[i].outputs) producer[v] = static_cast<int>(i);
  std::vector<bool> saved(g.values.size(), false), saved_only(g.values.size(), false);
  for (size_t k = 0; k < g.outputs.size(); ++k) {
    const int v = g.outputs[k];
    auto it = saved_on.find(live[k].get());
    if (it == saved_on.end()) continue;
    saved[v] = true;
    // Every holder of the storage is a handle in the table (live[k] is this function's own
    // reference), and every holder of those handles is a saved tensor.
    bool only = static_cast<size_t>(live[k].use_count() - 1) == it->second.size();
    for (const Tensor* t : it->second)
      only = only && t->impl_ptr().use_count() == refs[&t->impl()] && same_layout(t->impl(), g.values[v]);
    saved_only[v] = only;
  }

  std::vector<bool> alive(g.values.size(), false);
  for (int v : g.outputs) alive[v] = true;
  // Whether the backward can compute value u from what it holds anyway: u is a graph input or a
  // saved value, or nothing holds it and a short chain of cheap ops computes it from such values
  // (relu(x * w + b) saves only x, w and b). The dead values on those chains go to `through`.
  // A recipe replays one node on what the backward holds, i.e. on the values as they are after the
  // graph. That is what the forward computed only when nothing writes the memory afterwards: not
  // the recomputed value after its producer (y = x.clone(); y.add_(100): the write is part of the
  // value), and not a value a recipe reads after the node that read it.
  const passes::internal::WriteIndex writes(g);
  auto unchanged_after = [&](int u, int node) {
    return u < 0 || !writes.written_between(u, static_cast<size_t>(node) + 1, g.nodes.size());
  };
  std::vector<int> through;
  std::function<bool(int, int, int)> computable = [&](int u, int reader, int depth) {
    if (!unchanged_after(u, reader)) return false;
    if (u < 0 || g.values[u].is_input || saved[u]) return true;
    if (alive[u] || depth == 0 || producer[u] < 0 || !cheap_to_recompute(g.nodes[producer[u]]) ||
        !unchanged_after(u, producer[u]))
      return false;
    for (int i : g.nodes[producer[u]].inputs)
      if (!computable(i, producer[u], depth - 1)) return false;
    through.push_back(u);
    return true;
  };

  std::vector<RecomputedValue> out;
  std::vector<bool> drop(g.outputs.size(), false);
  for (size_t k = 0; k < g.outputs.size(); ++k) {
    const int v = g.outputs[k];
    const int p = producer[v];
    if (!saved_only[v] || p < 0 || !cheap_to_recompute(g.nodes[p]) || !unchanged_after(v, p)) continue;
    const size_t mark = through.size();
    bool inputs_held = true;
    for (int u : g.nodes[p].inputs) inputs_held = inputs_held && computable(u, p, kMaxChain - 1);
    if (!inputs_held) {
      through.resize(mark);
      continue;
    }
    RecomputedValue r;
    r.value = v;
    r.producer = producer[v];
    r.storage = live[k];
    for (const Tensor* t : saved_on[live[k].get()]) r.handles.push_back(t->impl_ptr());
    out.push_back(std::move(r));
    drop[k] = true;
  }
  // The outputs that only saved tensors hold and that stay outputs have no layout anyone sees,
  // unless a recipe reads them (it reads the value as the captured graph laid it out).
  std::vector<bool> read_by_recipe(g.values.size(), false);
  for (const RecomputedValue& r : out)
    for (int u : g.nodes[r.producer].inputs)
      if (u >= 0) read_by_recipe[u] = true;
  for (int u : through)
    for (int i : g.nodes[producer[u]].inputs)
      if (i >= 0) read_by_recipe[i] = true;
  std::vector<bool> free_layout(g.outputs.size(), false);
  for (size_t k = 0; k < g.outputs.size(); ++k)
    free_layout[k] = !drop[k] && saved_only[g.outputs[k]] && !read_by_recipe[g.outputs[k]];
  if (std::find(free_layout.begin(), free_layout.end(), true) != free_layout.end()) g.free_layout_outputs = free_layout;
  // The saved handles of each free output: they take the layout the backend returns.
  free_handles.assign(g.outputs.size(), {});
  for (size_t k = 0; k < g.outputs.size(); ++k)
    if (free_layout[k])
      for (const Tensor* t : saved_on[live[k].get()]) free_handles[k].push_back(t->impl_ptr());
  if (out.empty()) return out;
  // The dead values the recipes read, each once, with a storage of their own to fill.
  std::sort(through.begin(), through.end());
  through.erase(std::unique(through.begin(), through.end()), through.end());
  for (int u : through) {
    RecomputedValue r;
    r.value = u;
    r.producer = producer[u];
    r.storage = pending_storage(g.values[u]);
    out.push_back(std::move(r));
  }
  std::vector<int> outputs;
  std::vector<std::shared_ptr<Storage>> kept;
  std::vector<bool> kept_free;
  std::vector<std::vector<std::shared_ptr<TensorImpl>>> kept_handles;
  for (size_t k = 0; k < g.outputs.size(); ++k) {
    if (drop[k]) continue;
    outputs.push_back(g.outputs[k]);
    kept.push_back(std::move(live[k]));
    kept_free.push_back(free_layout[k]);
    kept_handles.push_back(std::move(free_handles[k]));
  }
  free_handles = std::move(kept_handles);
  g.outputs = std::move(outputs);
  if (!g.free_layout_outputs.empty()) g.free_layout_outputs = std::move(kept_free);
  live = std::move(kept);
  return out;
}

void attach_recipes(const std::shared_ptr<Segment>& seg, std::vector<RecomputedValue>& values,
                    const std::vector<std::shared_ptr<Storage>>& live) {
  const Graph& g = seg->graph;
  std::unordered_map<int, Tensor> held;  // value -> a tensor the recipes read it from
  for (size_t k = 0; k < g.inputs.size(); ++k) held[g.inputs[k]] = seg->inputs[k];
  for (size_t k = 0; k < g.outputs.size(); ++k) held[g.outputs[k]] = tensor_on(live[k], g.values[g.outputs[k]]);
  // In node order, so that a recipe reading another recomputed value finds its handle.
  std::sort(values.begin(), values.end(),
            [](const RecomputedValue& a, const RecomputedValue& b) { return a.producer < b.producer; });
  for (RecomputedValue& rv : values) {
    const Node& n = g.nodes[rv.producer];
    auto recipe = std::make_shared<Recipe>();
    recipe->op = n.op;
    recipe->attrs = n.attrs;  // this call's values, scalar slots included
    recipe->info = g.values[rv.value];
    for (int u : n.inputs) {
      Tensor in = u < 0 ? Tensor() : held.at(u);
      recipe->versions.push_back(in.defined() ? in.version() : 0);
      recipe->inputs.push_back(std::move(in));
    }
    auto lazy = std::make_shared<LazyValue>();  // no segment: the forward's graph may go
    lazy->value = rv.value;
    lazy->recipe = recipe;
    for (const auto& h : rv.handles) h->lazy = lazy;
    held[rv.value] = tensor_on(rv.storage, recipe->info);
    held[rv.value].impl().lazy = lazy;
  }
}

void check_recipe_inputs(const Recipe& r) {
  for (size_t i = 0; i < r.inputs.size(); ++i) {
    const Tensor& t = r.inputs[i];
    if (!t.defined() || t.version() == r.versions[i]) continue;
    throw Error("[kiln::compile] a tensor that the compiled forward's '" + r.op->name +
                "' read was modified by an in-place operation before the backward ran: [" +
                std::string(dtype_name(t.dtype())) + " " + shape_str(t.sizes()) + "] is at version " +
                std::to_string(t.version()) + "; expected version " + std::to_string(r.versions[i]) +
                ". The backward needs the value it had in the forward. Clone it before modifying it, or "
                "modify it after backward().");
  }
}

void materialize_recipe(const TensorImpl& impl) {
  std::shared_ptr<Recipe> r = impl.lazy->recipe;
  std::lock_guard lock(r->mutex);
  Storage& storage = *impl.storage;
  if (storage.data) return;
  check_recipe_inputs(*r);
  std::vector<Tensor> result;
  {
    SuspendCapture eager;
    NoGradGuard no_grad;
    result = call_op(*r->op, r->inputs, r->attrs);  // recomputed inputs compute as they are read
  }
  bind(storage, r->info, result.at(0), 0);
}

}  // namespace kiln::compiler::detail
