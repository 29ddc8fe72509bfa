// Graph building, rewriting and validation (the printer and interpreter live next door).
#include "kiln/compiler/graph.h"

#include <algorithm>
#include <memory>

#include "compiler/graph/format.h"
#include "compiler/graph/passes.h"
#include "kiln/detail/tensor_impl.h"
#include "kiln/error.h"

namespace kiln::compiler {

namespace {

[[noreturn]] void invalid(const std::string& what) {
  throw CompileError("[kiln::compile] graph validation: " + what +
                     ". This is a capture bug; please report it.");
}

std::string node_label(const Node& n) {
  return "node '" + n.name + "' (" + (n.op ? n.op->name : std::string("null op")) + ")";
}

// Tensors with the recorded metadata but no data (like the capture's pending values): meta
// functions read only sizes, strides, dtype and device. Values of one alias group share a Storage
// so that overlap checks see the aliasing.
std::vector<Tensor> meta_tensors(const Graph& g) {
  std::vector<std::shared_ptr<kiln::detail::Storage>> groups;
  std::vector<Tensor> out(g.values.size());
  for (size_t v = 0; v < g.values.size(); ++v) {
    const ValueInfo& info = g.values[v];
    if (!info.strides.empty() && info.strides.size() != info.sizes.size()) {
      invalid("value " + std::to_string(v) + " has " + std::to_string(info.sizes.size()) +
              " sizes but " + std::to_string(info.strides.size()) + " strides");
    }
    std::shared_ptr<kiln::detail::Storage> storage;
    if (info.storage >= 0) {
      if (groups.size() <= static_cast<size_t>(info.storage)) groups.resize(info.storage + 1);
      storage = groups[info.storage];
    }
    if (!storage) {
      storage = std::make_shared<kiln::detail::Storage>();
      storage->device = info.device;
      if (info.storage >= 0) groups[info.storage] = storage;
    }
    out[v] = passes::internal::meta_tensor(info, std::move(storage));
  }
  return out;
}

}  // namespace

int Graph::add_value(ValueInfo info) {
  values.push_back(std::move(info));
  return static_cast<int>(values.size()) - 1;
}

int Graph::add_input(ValueInfo info) {
  info.is_input = true;
  int id = add_value(std::move(info));
  inputs.push_back(id);
  return id;
}

// Names follow FX: the first "mul", then "mul_1", "mul_2", ... (one past the largest suffix in
// use, also avoiding placeholder names). This scans the graph: O(nodes) per call.
Node& Graph::add_node(const OpDef& op, std::vector<int> node_inputs, std::vector<Attr> attrs) {
  std::string base = detail::identifier_from(op.name);
  int64_t largest = -1;
  for (const Node& n : nodes) largest = std::max(largest, detail::suffix_after(n.name, base));
  for (int v : inputs)
    if (v >= 0 && static_cast<size_t>(v) < values.size())
      largest = std::max(largest, detail::suffix_after(values[v].name, base));
  Node& node = nodes.emplace_back();
  node.op = &op;
  node.inputs = std::move(node_inputs);
  node.attrs = std::move(attrs);
  node.name = largest < 0 ? base : base + "_" + std::to_string(largest + 1);
  return node;
}

void Graph::replace_all_uses(int from, int to) {
  for (Node& n : nodes)
    for (int& v : n.inputs)
      if (v == from) v = to;
  for (int& v : outputs)
    if (v == from) v = to;
}

void Graph::erase_nodes_if(const std::function<bool(const Node&)>& pred) {
  std::vector<int> new_index(nodes.size(), -1);
  size_t kept = 0;
  for (size_t i = 0; i < nodes.size(); ++i) {
    if (pred(nodes[i])) continue;
    new_index[i] = static_cast<int>(kept);
    if (kept != i) nodes[kept] = std::move(nodes[i]);
    ++kept;
  }
  nodes.resize(kept);
  // Slots keep their positions (the runtime passes scalars by index): a slot whose node went is
  // left unused (node = attr = -1).
  for (ScalarSlot& s : scalars) {
    if (s.node < 0 || static_cast<size_t>(s.node) >= new_index.size() || new_index[s.node] < 0) {
      s = ScalarSlot{-1, -1};
    } else {
      s.node = new_index[s.node];
    }
  }
}

std::vector<int> Graph::use_counts() const {
  std::vector<int> counts(values.size(), 0);
  auto count = [&](int v) {
    if (v >= 0 && static_cast<size_t>(v) < counts.size()) ++counts[v];
  };
  for (const Node& n : nodes)
    for (int v : n.inputs) count(v);
  for (int v : outputs) count(v);
  return counts;
}

void Graph::validate() const {
  const int num_values = static_cast<int>(values.size());
  auto in_range = [&](int v) { return v >= 0 && v < num_values; };
  std::vector<char> defined(values.size(), 0);
  for (size_t k = 0; k < inputs.size(); ++k) {
    int v = inputs[k];
    if (!in_range(v))
      invalid("input " + std::to_string(k) + " is value " + std::to_string(v) + ", out of range");
    if (defined[v]) invalid("value " + std::to_string(v) + " is listed twice as an input");
    defined[v] = 1;
  }
  // Constants are defined before the first node, like inputs. They hold a real tensor that every
  // call shares, so no node may write into one.
  std::vector<char> constant(values.size(), 0);
  for (size_t k = 0; k < constants.size(); ++k) {
    const auto& [v, t] = constants[k];
    std::string which = "constant " + std::to_string(k);
    if (!in_range(v))
      invalid(which + " is value " + std::to_string(v) + ", out of range");
    if (defined[v])
      invalid("value " + std::to_string(v) + " is listed twice as an input or a constant");
    if (!t.defined()) invalid(which + " (value " + std::to_string(v) + ") holds no tensor");
    const ValueInfo& rec = values[v];
    if (!(t.sizes() == IntArrayRef(rec.sizes)) || t.dtype() != rec.dtype || t.device() != rec.device)
      invalid(which + " holds a " + detail::type_str(t.dtype(), t.sizes().vec()) + " tensor on " +
              t.device().str() + " but value " + std::to_string(v) + " is recorded as " +
              detail::type_str(rec) + " on " + rec.device.str());
    defined[v] = 1;
    constant[v] = 1;
  }
  for (const ScalarSlot& s : scalars) {
    if (s.node == -1 && s.attr == -1) continue;  // unused slot (its node was erased)
    if (s.node < 0 || static_cast<size_t>(s.node) >= nodes.size())
      invalid("a scalar slot names node " + std::to_string(s.node) + ", out of range");
    if (s.attr < 0 || static_cast<size_t>(s.attr) >= nodes[s.node].attrs.size())
      invalid("a scalar slot names attr " + std::to_string(s.attr) + " of " +
              node_label(nodes[s.node]) + ", out of range");
  }

  std::vector<Tensor> metas = meta_tensors(*this);
  std::vector<Tensor> call_inputs;
  for (const Node& n : nodes) {
    if (!n.op) invalid("node '" + n.name + "' has no op");
    call_inputs.clear();
    for (size_t k = 0; k < n.inputs.size(); ++k) {
      int v = n.inputs[k];
      if (v == -1) {
        call_inputs.emplace_back();
        continue;
      }
      if (!in_range(v))
        invalid(node_label(n) + " input " + std::to_string(k) + " is value " + std::to_string(v) +
                ", out of range");
      if (!defined[v])
        invalid(node_label(n) + " input " + std::to_string(k) + " reads value " +
                std::to_string(v) + " before any node defines it");
      call_inputs.push_back(metas[v]);
    }
    for (size_t k = 0; k < n.outputs.size(); ++k) {
      int v = n.outputs[k];
      if (!in_range(v))
        invalid(node_label(n) + " output " + std::to_string(k) + " is value " + std::to_string(v) +
                ", out of range");
      if (n.inplace && !defined[v])
        invalid(node_label(n) + " writes value " + std::to_string(v) +
                " in place before any node defines it");
      if (n.inplace && constant[v])
        invalid(node_label(n) + " writes constant value " + std::to_string(v) + " in place");
      if (!n.inplace && defined[v])
        invalid(node_label(n) + " output " + std::to_string(k) + " redefines value " +
                std::to_string(v));
    }

    for (int i : n.op->mutated_input_indices(n.inputs.size(), n.attrs))
      if (static_cast<size_t>(i) < n.inputs.size() && n.inputs[i] >= 0 && constant[n.inputs[i]])
        invalid(node_label(n) + " mutates constant value " + std::to_string(n.inputs[i]));

    std::vector<TensorMeta> result;
    try {
      result = n.op->meta(OpCall(n.op, call_inputs, n.attrs));
    } catch (const Error& e) {
      invalid(node_label(n) + ": meta rejects the recorded inputs (" + e.what() + ")");
    }
    if (result.size() != n.outputs.size())
      invalid(node_label(n) + " records " + std::to_string(n.outputs.size()) +
              " outputs but meta gives " + std::to_string(result.size()));
    for (size_t k = 0; k < result.size(); ++k) {
      const ValueInfo& rec = values[n.outputs[k]];
      const TensorMeta& m = result[k];
      std::string where = node_label(n) + " output " + std::to_string(k) + ": recorded ";
      if (n.inplace) {
        // call_op_out: same sizes, result castable to the target.
        if (rec.sizes != m.sizes || !can_cast(m.dtype, rec.dtype))
          invalid(where + detail::type_str(rec) + " is written in place with " +
                  detail::type_str(m.dtype, m.sizes));
        continue;
      }
      if (rec.sizes != m.sizes || rec.dtype != m.dtype)
        invalid(where + detail::type_str(rec) + " but meta gives " +
                detail::type_str(m.dtype, m.sizes));
      if (rec.device != m.device)
        invalid(where + "device " + rec.device.str() + " but meta gives " + m.device.str());
      if (n.is_view() &&
          ((!m.strides.empty() && !rec.strides.empty() && rec.strides != m.strides) ||
           rec.storage_offset != m.storage_offset))
        invalid(where + "a view layout that differs from meta's (strides or storage offset)");
    }
    if (!n.inplace)
      for (int v : n.outputs) defined[v] = 1;
  }

  if (!free_layout_outputs.empty() && free_layout_outputs.size() != outputs.size())
    invalid("free_layout_outputs has " + std::to_string(free_layout_outputs.size()) + " flags for " +
            std::to_string(outputs.size()) + " outputs");
  for (size_t k = 0; k < outputs.size(); ++k) {
    int v = outputs[k];
    if (!in_range(v))
      invalid("output " + std::to_string(k) + " is value " + std::to_string(v) + ", out of range");
    if (!defined[v])
      invalid("output " + std::to_string(k) + " is value " + std::to_string(v) +
              ", which no node defines");
  }
}

std::vector<std::string> Graph::op_names() const {
  std::vector<std::string> names;
  names.reserve(nodes.size());
  for (const Node& n : nodes) names.push_back(n.op ? n.op->name : std::string());
  return names;
}

}  // namespace kiln::compiler
