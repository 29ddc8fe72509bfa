// The captured graph: what compile() hands to a backend.
//
// A Graph is a list of op-table calls over numbered tensor values, in the order the C++ body
// issued them. It is the counterpart of an FX graph: backends iterate it, rewrite it, print it
// (print_tabular) and run it (interpreter()).
//
//   values   every tensor the graph touches: placeholders (inputs), op results and views.
//            Values that share a `storage` group alias one buffer (a view and its base, or two
//            inputs that overlap).
//   nodes    op calls in program order. A node either creates new values (`outputs`) or, when
//            `inplace` is set (the `add_`/`out=` forms), writes into existing values; ops with
//            `OpDef::mutated_inputs` (batch-norm running stats, the fused optimizers' parameters
//            and state) also write their inputs. Nodes
//            therefore run in order; the kiln backend's functionalization pass (see
//            docs/compiler.md) rewrites mutation away before fusing.
//   inputs   placeholder values, in the order the runtime passes them.
//   scalars  attrs that change from call to call without recompiling: every Scalar/double attr
//            (learning rates, clamp bounds, scales) and the random ops' (seed, offset). The
//            runtime passes their current values; the node's attr holds the example value.
//   outputs  values the program still references after the graph (by liveness), in order.
//   constants values computed when the graph is compiled (decompositions' host scalars, constant
//            folding), held as tensors.
#pragma once

#include <cstdint>
#include <functional>
#include <iosfwd>
#include <span>
#include <string>
#include <vector>

#include "kiln/op_table.h"
#include "kiln/tensor.h"

namespace kiln::compiler {

// Metadata of one tensor value.
struct ValueInfo {
  std::vector<int64_t> sizes;
  std::vector<int64_t> strides;
  int64_t storage_offset = 0;
  DType dtype = DType::float32;
  Device device;
  int storage = -1;        // alias group: values with the same group share memory
  bool is_input = false;   // a placeholder
  bool is_wrapped_number = false;  // a placeholder holding a host scalar (type promotion treats it
                                   // like a Python number)
  std::string name;        // printed name: "x", "sin", "add_1"
};

// An attr slot filled at run time: nodes[node].attrs[attr]. Slots never move (the runtime passes
// scalars by position); a slot whose node was erased is unused: node = attr = -1.
struct ScalarSlot {
  int node = 0;
  int attr = 0;
};

struct Node {
  const OpDef* op = nullptr;
  std::vector<int> inputs;   // value ids; -1 stands for None (an undefined optional tensor)
  std::vector<Attr> attrs;
  std::vector<int> outputs;  // value ids: new values, or the targets of an in-place call
  bool inplace = false;      // call_op_out form: `outputs` are existing values written in place
  std::string name;          // unique within the graph, e.g. "mul_2"

  const std::string& target() const { return op->name; }
  bool is_view() const { return op->kind == OpKind::view; }
  // Writes memory that existed before the node (in-place targets or mutated inputs).
  bool has_side_effects() const { return inplace || op->may_mutate_inputs(); }
};

// What a compiled graph is called with: one tensor per placeholder and one value per scalar slot.
struct Arguments {
  std::span<const Tensor> tensors;
  std::span<const Attr> scalars;
};

// A compiled graph: takes Arguments, returns one tensor per graph output.
using CompiledFn = std::function<std::vector<Tensor>(const Arguments& args)>;

class Graph {
 public:
  std::vector<ValueInfo> values;
  std::vector<Node> nodes;
  std::vector<int> inputs;
  std::vector<ScalarSlot> scalars;
  std::vector<int> outputs;
  // Values known when the graph is compiled (host scalars inside decompositions, folded
  // subgraphs): the value id and its tensor. Never graph inputs.
  std::vector<std::pair<int, Tensor>> constants;
  // A dynamic graph (dynamic shapes, docs/compiler.md): compile() calls the backend again for each
  // new concrete size of it, expecting code that does not bake sizes in. The kiln backend's
  // generated kernels then take every size, stride and offset as a run-time argument, so each
  // size reuses the kernels the first one built. Sizes here are one concrete instance's.
  bool dynamic = false;
  // Per output (empty: none): the caller holds the output only through saved tensors of autograd
  // (a compiled module's activations, for a backward that runs after the compiled call), so its
  // strides are invisible. A backend may return such an output in another layout; compile() then
  // adopts the layout returned (the kiln backend keeps channels-last activations channels-last, as
  // the backward's convolutions want them, instead of copying them back to row-major).
  std::vector<bool> free_layout_outputs;
  bool output_layout_free(size_t k) const { return k < free_layout_outputs.size() && free_layout_outputs[k]; }

  // ---- building and rewriting ----
  int add_value(ValueInfo info);
  int add_input(ValueInfo info);  // appends a placeholder
  // Appends a node; the caller fills its outputs (new values via add_value).
  Node& add_node(const OpDef& op, std::vector<int> inputs, std::vector<Attr> attrs);
  // Replaces every use of value `from` (node inputs, graph outputs) with `to`.
  void replace_all_uses(int from, int to);
  // Removes the nodes for which `pred` is true. Scalar slots follow their nodes; slots of erased
  // nodes become unused ({-1, -1}), keeping every slot's position.
  void erase_nodes_if(const std::function<bool(const Node&)>& pred);
  // Number of uses of each value (node inputs and graph outputs).
  std::vector<int> use_counts() const;
  // Checks ids and re-runs every node's meta on the recorded value metadata; throws
  // CompileError naming the first node whose recorded shape or dtype disagrees.
  void validate() const;

  // ---- iteration ----
  auto begin() { return nodes.begin(); }
  auto end() { return nodes.end(); }
  auto begin() const { return nodes.begin(); }
  auto end() const { return nodes.end(); }
  size_t size() const { return nodes.size(); }
  // Op names in node order (explain()'s "Ops per Graph").
  std::vector<std::string> op_names() const;

  // ---- printing ----
  // The FX-style table: opcode | name | target | args | kwargs.
  void print_tabular(std::ostream& os) const;
  std::string tabular() const;
  // Readable code form: "%add = add(%x, %y, alpha=1)  # f32[3, 3]".
  std::string str() const;
  // Graphviz dot (KILN_COMPILE_DEBUG writes it next to the text form).
  std::string dot() const;
};

std::ostream& operator<<(std::ostream& os, const Graph& g);

// Runs `graph` op by op through the eager dispatcher — the `eager` backend, and what custom
// backends return to keep the default behaviour (FX's gm.forward). Copies the graph.
CompiledFn interpreter(Graph graph);

}  // namespace kiln::compiler
