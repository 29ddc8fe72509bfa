// Functionalization: in-place writes become out-of-place calls plus a final copy into each
// mutated graph input (see passes.h for what stays in place). Also refresh_layouts(), which the
// rewriting passes share.
//
// Why a write may become a value: after `x.add_(y)` every later reader of x reads the result, so
// renaming those readers to a new value `add = add(x, y)` computes the same thing — unless some
// other handle on x's memory, made before the write, is read after it (a view of x, or a
// placeholder overlapping x): that reader would miss the write. Views made after the write are
// made from the new value and see it. So a write is rewritten when its targets are bases and no
// older alias of them is read later; the check runs on the graph as rewritten so far.
#include <algorithm>
#include <limits>
#include <memory>
#include <numeric>
#include <unordered_map>
#include <vector>

#include "compiler/graph/known_ops.h"
#include "compiler/graph/passes.h"
#include "core/shape.h"
#include "core/tensor_factory.h"
#include "kiln/detail/tensor_impl.h"
#include "kiln/error.h"

namespace kiln::compiler::passes {

namespace internal {

Tensor meta_tensor(const ValueInfo& info, std::shared_ptr<kiln::detail::Storage> storage) {
  if (!storage) {
    storage = std::make_shared<kiln::detail::Storage>();
    storage->device = info.device;
  }
  auto impl = std::make_shared<kiln::detail::TensorImpl>();
  impl->sizes = info.sizes;
  impl->strides = info.strides.size() == info.sizes.size()
                      ? info.strides
                      : kiln::detail::contiguous_strides(info.sizes);
  impl->storage_offset = info.storage_offset;
  impl->dtype = info.dtype;
  impl->device = info.device;
  impl->is_wrapped_number = info.is_wrapped_number;
  impl->refresh_metadata();
  const int64_t span = kiln::detail::storage_span(impl->sizes, impl->strides);
  storage->nbytes = std::max(storage->nbytes, (info.storage_offset + span) * itemsize(info.dtype));
  impl->storage = std::move(storage);
  return Tensor(std::move(impl));
}

}  // namespace internal

namespace {

using internal::valid;

std::vector<int64_t> strides_of(const TensorMeta& m) {
  return m.strides.empty() ? kiln::detail::contiguous_strides(m.sizes) : m.strides;
}

// A new value with the metadata meta gives (its alias group is set by refresh_layouts).
int add_result(Graph& g, const TensorMeta& m) {
  ValueInfo v;
  v.sizes = m.sizes;
  v.strides = strides_of(m);
  v.dtype = m.dtype;
  v.device = m.device;
  return g.add_value(std::move(v));
}

}  // namespace

void refresh_layouts(Graph& g) {
  std::vector<Tensor> metas(g.values.size());
  // Placeholders keep their groups (the caller decides which inputs overlap) and share one
  // storage per group, sized to cover every member. Values nothing defines any more (outputs of
  // replaced nodes) leave their group, which a new value may now use.
  for (ValueInfo& info : g.values)
    if (!info.is_input) info.storage = -1;
  int next_group = 0;
  for (int v : g.inputs)
    if (valid(g, v)) next_group = std::max(next_group, g.values[v].storage + 1);
  std::unordered_map<int, std::shared_ptr<kiln::detail::Storage>> group_storage;
  for (int v : g.inputs) {
    if (!valid(g, v)) continue;
    ValueInfo& info = g.values[v];
    if (info.storage < 0) info.storage = next_group++;
    metas[v] = internal::meta_tensor(info);
    auto [it, fresh] = group_storage.try_emplace(info.storage, metas[v].impl_ptr()->storage);
    if (!fresh) {
      it->second->nbytes = std::max(it->second->nbytes, metas[v].impl_ptr()->storage->nbytes);
      metas[v].impl_ptr()->storage = it->second;
    }
  }
  for (const auto& c : g.constants) {
    if (!valid(g, c.first)) continue;
    g.values[c.first].storage = next_group++;
    metas[c.first] = internal::meta_tensor(g.values[c.first]);
  }
  std::vector<Tensor> call_inputs;
  for (const Node& n : g.nodes) {
    if (n.inplace || !n.op) continue;
    bool ready = true;
    call_inputs.clear();
    for (int v : n.inputs) {
      if (v == -1) {
        call_inputs.emplace_back();
        continue;
      }
      ready &= valid(g, v) && metas[v].defined();
      call_inputs.push_back(ready ? metas[v] : Tensor());
    }
    std::vector<TensorMeta> result;
    if (ready) {
      try {
        result = n.op->meta(OpCall(n.op, call_inputs, n.attrs));
      } catch (const std::exception&) {
        result.clear();
      }
    }
    const bool view = n.is_view() && !n.inputs.empty() && valid(g, n.inputs[0]);
    for (size_t k = 0; k < n.outputs.size(); ++k) {
      int v = n.outputs[k];
      if (!valid(g, v)) continue;
      ValueInfo& info = g.values[v];
      if (result.size() != n.outputs.size() || result[k].sizes != info.sizes) {
        // Meta disagrees: keep what was recorded for validate() to report.
        info.storage = next_group++;
        metas[v] = internal::meta_tensor(info);
        continue;
      }
      info.strides = strides_of(result[k]);
      if (view) {
        info.storage_offset = result[k].storage_offset;
        info.storage = g.values[n.inputs[0]].storage;
        metas[v] = kiln::detail::make_view(metas[n.inputs[0]], info.sizes, info.strides,
                                           info.storage_offset);
      } else {
        info.storage_offset = 0;
        info.storage = next_group++;
        metas[v] = internal::meta_tensor(info);
      }
    }
  }
}

void functionalize(Graph& g) {
  const int num_nodes = static_cast<int>(g.nodes.size());
  const size_t num_values = g.values.size();
  constexpr int kAfterGraph = std::numeric_limits<int>::max();

  std::vector<char> placeholder(num_values, 0);
  std::unordered_map<int, int> placeholders_in_group;
  std::unordered_map<int, int> first_in_group;
  for (int v : g.inputs) {
    if (!valid(g, v)) continue;
    placeholder[v] = 1;
    if (g.values[v].storage >= 0) ++placeholders_in_group[g.values[v].storage];
  }
  // as_strided reads raw storage offsets, which a new buffer does not keep.
  std::vector<char> strided_after(num_nodes + 1, 0);
  for (int i = num_nodes - 1; i >= 0; --i)
    strided_after[i] = strided_after[i + 1] || (g.nodes[i].op && g.nodes[i].op == &known_ops().as_strided);

  // Per current value: its alias root (a base: itself), the node index of its last read or
  // write (kAfterGraph for graph outputs), and per root the values defined so far.
  std::vector<int> root(num_values), last_use(num_values, -1);
  std::iota(root.begin(), root.end(), 0);
  for (int v : g.inputs) {
    if (!valid(g, v)) continue;
    int s = g.values[v].storage;
    if (s >= 0) root[v] = first_in_group.try_emplace(s, v).first->second;
  }
  for (int i = 0; i < num_nodes; ++i) {
    for (int v : g.nodes[i].inputs)
      if (valid(g, v)) last_use[v] = i;
    if (g.nodes[i].inplace)
      for (int v : g.nodes[i].outputs)
        if (valid(g, v)) last_use[v] = i;
  }
  for (int v : g.outputs)
    if (valid(g, v)) last_use[v] = kAfterGraph;
  std::unordered_map<int, std::vector<int>> family;
  for (int v : g.inputs)
    if (valid(g, v)) family[root[v]].push_back(v);
  for (const auto& c : g.constants)
    if (valid(g, c.first)) family[c.first].push_back(c.first);

  std::vector<int> current(num_values);  // original value id -> the value that now holds it
  std::iota(current.begin(), current.end(), 0);
  auto now = [&](int v) { return valid(g, v) && static_cast<size_t>(v) < num_values ? current[v] : v; };
  auto define = [&](int v, int r) {
    if (static_cast<size_t>(v) >= root.size()) {
      root.resize(v + 1, -1);
      last_use.resize(v + 1, -1);
    }
    root[v] = r;
    family[r].push_back(v);
  };

  internal::NodeNamer namer(g);
  std::vector<Node> out;
  out.reserve(g.nodes.size());
  std::vector<int> new_index(num_nodes, -1);
  std::vector<Tensor> call_inputs;
  for (int i = 0; i < num_nodes; ++i) {
    Node n = std::move(g.nodes[i]);
    for (int& v : n.inputs) v = now(v);
    std::vector<int> original_targets = n.outputs;
    if (n.inplace) {
      for (int& v : n.outputs) v = now(v);
    } else {
      for (int v : n.outputs)
        if (valid(g, v))
          define(v, n.is_view() && !n.inputs.empty() && valid(g, n.inputs[0]) ? root[n.inputs[0]] : v);
    }
    auto keep = [&] {
      new_index[i] = static_cast<int>(out.size());
      out.push_back(std::move(n));
    };
    if (!n.inplace || !n.op || n.op->may_mutate_inputs() || n.is_view() || strided_after[i + 1] ||
        n.outputs.empty()) {
      keep();
      continue;
    }

    bool functional = true;
    for (size_t k = 0; k < n.outputs.size() && functional; ++k) {
      int t = n.outputs[k];
      if (!valid(g, t) || root[t] != t ||
          std::count(n.outputs.begin(), n.outputs.end(), t) != 1) {
        functional = false;
        break;
      }
      if (static_cast<size_t>(t) < num_values && placeholder[t] && g.values[t].storage >= 0 &&
          placeholders_in_group[g.values[t].storage] != 1) {
        functional = false;
        break;
      }
      for (int m : family[t])
        if (m != t && last_use[m] > i) functional = false;
    }
    std::vector<TensorMeta> result;
    if (functional) {
      call_inputs.clear();
      for (int v : n.inputs) call_inputs.push_back(valid(g, v) ? internal::meta_tensor(g.values[v]) : Tensor());
      try {
        result = n.op->meta(OpCall(n.op, call_inputs, n.attrs));
      } catch (const std::exception&) {
        functional = false;
      }
      functional &= result.size() == n.outputs.size();
      for (size_t k = 0; k < result.size() && functional; ++k)
        functional &= result[k].sizes == g.values[n.outputs[k]].sizes;
    }
    if (!functional) {
      keep();
      continue;
    }

    // The out-of-place call, then a cast where the in-place call would have cast.
    std::vector<int> targets = n.outputs;
    n.inplace = false;
    n.outputs.clear();
    for (const TensorMeta& m : result) n.outputs.push_back(add_result(g, m));
    std::vector<int> results = n.outputs;
    for (int v : results) define(v, v);
    new_index[i] = static_cast<int>(out.size());
    out.push_back(std::move(n));
    for (size_t k = 0; k < targets.size(); ++k) {
      const ValueInfo target = g.values[targets[k]];
      int value = results[k];
      if (result[k].dtype != target.dtype || result[k].device != target.device) {
        Node& cast = out.emplace_back();
        cast.op = &known_ops().copy;
        cast.inputs = {value};
        cast.attrs = {target.dtype, target.device};
        cast.name = namer("copy");
        value = add_result(g, TensorMeta{target.sizes, {}, target.dtype, target.device});
        cast.outputs = {value};
        define(value, value);
      }
      // Later reads of the target read `value` now.
      last_use[value] = last_use[targets[k]];
      last_use[targets[k]] = i;
      current[original_targets[k]] = value;
    }
  }

  // Write the final value of each rewritten placeholder back into it, as copy_ would.
  for (int p : g.inputs) {
    if (!valid(g, p) || current[p] == p) continue;
    Node& back = out.emplace_back();
    back.op = &known_ops().copy;
    back.inputs = {current[p]};
    back.attrs = {g.values[p].dtype, g.values[p].device};
    back.outputs = {p};
    back.inplace = true;
    back.name = namer("copy");
  }
  // A placeholder output holds its final value after the copy back; others read the new value.
  for (int& v : g.outputs)
    if (valid(g, v) && static_cast<size_t>(v) < num_values && !placeholder[v]) v = current[v];
  for (ScalarSlot& s : g.scalars)
    if (s.node >= 0 && s.node < num_nodes) s.node = new_index[s.node];
  g.nodes = std::move(out);
  refresh_layouts(g);
}

}  // namespace kiln::compiler::passes
