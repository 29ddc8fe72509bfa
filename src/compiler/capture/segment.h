// A segment: the graph a capture is building, its inputs and the lazy values it will fill
// (context.cpp), and the min-cut partition of what its autograd nodes save (recompute.cpp).
#pragma once

#include <iterator>
#include <memory>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "compiler/capture/capture.h"
#include "kiln/detail/tensor_impl.h"

namespace kiln::autograd {
struct Node;
}

namespace kiln::compiler::detail {

constexpr uint64_t kSegmentHashSeed = 0xcbf29ce484222325ull;

struct CompiledGraph;
struct GraphFamily;

// Guided capture: what the segment a frame entry ran last at one position of its call looks like
// (FrameEntry::guides). A capture following a guide checks each op against the guide's next node
// and collects only the numbers size_signature holds, instead of building a graph; when the call
// ends on the guide's last node, those numbers find the compiled graph to run (an instance of
// `family`, or `graph` itself). The first op that differs turns the segment into an ordinary
// capture (derail in context.cpp), which rebuilds the graph so far from the guide and the numbers.
struct Guide {
  std::shared_ptr<CompiledGraph> graph;   // a compiled graph of the structure to follow
  std::shared_ptr<GraphFamily> family;    // its dynamic graph, when it is one
};

struct Segment {
  enum class State { pending, done, failed };

  Graph graph;  // empty while guided: `guided` says how far the capture has followed the guide
  std::unordered_map<const kiln::detail::TensorImpl*, int> input_ids;
  std::unordered_map<const kiln::detail::Storage*, int> input_groups;
  std::vector<Tensor> inputs;  // strong references, one per graph input
  struct Pending {
    std::weak_ptr<kiln::detail::Storage> storage;
    int value;
  };
  std::vector<Pending> pending;                 // one per buffer a node allocates
  std::vector<std::weak_ptr<kiln::detail::TensorImpl>> lazy;  // every lazy handle created, to clear after a flush
  State state = State::pending;
  std::string failure;
  int next_group = 0;
  std::thread::id thread = std::this_thread::get_id();
  // Autograd nodes recorded while capturing (the partition counts what they save), and the
  // recomputed values already replayed into this segment (by recipe).
  std::vector<std::weak_ptr<autograd::Node>> autograd_nodes;
  std::unordered_map<const Recipe*, int> replayed;
  // While a compile trace is on (compile_trace.h): the call stack of each node's op, by node index
  // (guided or not), for its file:line in the trace. Nodes a capture adds itself have none.
  std::vector<RawStack> node_stacks;
  void record_stack(size_t node) {
    if (node_stacks.size() <= node) node_stacks.resize(node + 1);
    node_stacks[node] = capture_stack();
  }

  // The nodes and values of earlier captures, kept for their allocations: a function captured
  // again and again builds the same graph, and new_node / new_value hand out these in the same
  // order (so each one's vectors already have the capacity the next capture needs).
  std::vector<Node> spare_nodes;        // the next to hand out last
  std::vector<ValueInfo> spare_values;

  // Guided capture (see Guide): the nodes and values followed so far (value ids are handed out as
  // the graph would), size_signature's numbers in two parts (values, then attrs), and the
  // run-time scalar attrs in slot order.
  std::shared_ptr<const Guide> guide;
  struct Guided {
    size_t nodes = 0;
    size_t values = 0;
    std::vector<int64_t> value_numbers;
    std::vector<int64_t> attr_numbers;
    std::vector<Attr> scalars;
  } guided;

  // The id the next value gets.
  int next_value_id() const { return static_cast<int>(guide ? guided.values : graph.values.size()); }
  bool empty() const { return guide ? guided.nodes == 0 : graph.nodes.empty(); }

  template <class T>
  static T& append_recycled(std::vector<T>& to, std::vector<T>& spares) {
    if (spares.empty()) return to.emplace_back();
    T& x = to.emplace_back(std::move(spares.back()));
    spares.pop_back();
    return x;
  }

  // An empty node / value appended to the graph (from the spares when there are any). A recycled
  // node keeps its old attrs for the caller to assign over (a vector attr then reuses its buffer).
  Node& new_node() {
    Node& n = append_recycled(graph.nodes, spare_nodes);
    n.inputs.clear();
    n.outputs.clear();
    n.name.clear();
    n.inplace = false;
    return n;
  }
  ValueInfo& new_value() {
    ValueInfo& v = append_recycled(graph.values, spare_values);
    v.sizes.clear();
    v.strides.clear();
    v.name.clear();
    v.storage_offset = 0;
    v.storage = -1;
    v.is_input = false;
    v.is_wrapped_number = false;
    return v;
  }

  void clear() {
    spare_nodes.insert(spare_nodes.end(), std::make_move_iterator(graph.nodes.rbegin()),
                       std::make_move_iterator(graph.nodes.rend()));
    spare_values.insert(spare_values.end(), std::make_move_iterator(graph.values.rbegin()),
                        std::make_move_iterator(graph.values.rend()));
    std::vector<Node> node_buffer = std::move(graph.nodes);
    std::vector<ValueInfo> value_buffer = std::move(graph.values);
    std::vector<int> input_buffer = std::move(graph.inputs);
    node_buffer.clear();
    value_buffer.clear();
    input_buffer.clear();
    graph = Graph();
    graph.nodes = std::move(node_buffer);  // their capacity too
    graph.values = std::move(value_buffer);
    graph.inputs = std::move(input_buffer);
    guide.reset();
    guided.nodes = guided.values = 0;
    guided.value_numbers.clear();  // (their capacity stays)
    guided.attr_numbers.clear();
    guided.scalars.clear();
    input_ids.clear();
    input_groups.clear();
    inputs.clear();
    pending.clear();
    lazy.clear();
    autograd_nodes.clear();
    replayed.clear();
    node_stacks.clear();
    state = State::pending;
    next_group = 0;
  }
};

// A tensor over `storage` with value `v`'s recorded sizes, strides, offset, dtype and device.
Tensor tensor_on(std::shared_ptr<kiln::detail::Storage> storage, const ValueInfo& v);

// Moves (or copies) `result` into the pending storage of value `v`, graph output `k` (context.cpp).
void bind(kiln::detail::Storage& pending, const ValueInfo& v, const Tensor& result, size_t k);

// ---- the min-cut partition of saved values (recompute.cpp) ----
//
// A forward graph whose backward runs later (outside the compiled call, or after a graph break)
// would save every value autograd holds. Values that only autograd's saved tensors hold and that
// a short chain of pointwise ops computes from tensors the backward has anyway (graph inputs,
// other saved values) are not saved: their saved handles keep a Recipe, and the backward recomputes them
// (fused into its kernels when it is captured). Convolutions, GEMMs, reductions and random ops
// are always saved. Applies to backends registered with the "aot_autograd" tag: aot_eager and kiln
// (`eager` runs the graph as captured).

// A value the forward graph leaves to be recomputed, and the saved handles that will read it (none
// for a dead value on a recomputed chain).
struct RecomputedValue {
  int value = -1;
  int producer = -1;  // the graph node that computes it
  std::shared_ptr<kiln::detail::Storage> storage;
  std::vector<std::shared_ptr<kiln::detail::TensorImpl>> handles;
};

// Picks the values of graph.outputs (kept alive by `live`, index for index) to recompute and
// removes them from both. Marks graph.free_layout_outputs: the kept outputs only saved tensors
// hold, which no recipe reads (their layout is the backend's choice); `free_handles` gets, per
// kept output, those saved tensors' handles (empty for the others).
std::vector<RecomputedValue> split_recomputed(
    Segment& seg, std::vector<std::shared_ptr<kiln::detail::Storage>>& live,
    std::vector<std::vector<std::shared_ptr<kiln::detail::TensorImpl>>>& free_handles);

// After the graph ran and the kept outputs were bound: gives each recomputed value's handles a
// recipe (its op over graph inputs, kept outputs and other recipes).
void attach_recipes(const std::shared_ptr<Segment>& seg, std::vector<RecomputedValue>& values,
                    const std::vector<std::shared_ptr<kiln::detail::Storage>>& live);

// Throws when an input of the recipe changed in place since the forward (the recomputed value
// would differ from the one autograd saved).
void check_recipe_inputs(const Recipe& recipe);

// data() on a recomputed handle: computes the value eagerly, once, into its storage.
void materialize_recipe(const kiln::detail::TensorImpl& impl);

}  // namespace kiln::compiler::detail
