// Graph-to-graph passes that keep a graph's meaning (each one in passes/<name>.cpp).
//
// Every pass rewrites the graph in place; afterwards graph.validate() passes and interpreter(graph)
// computes the same outputs and writes the same graph inputs as before, called with the same
// Arguments: passes keep the number and order of Graph::scalars (a slot may move to another node).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "kiln/compiler/graph.h"

namespace kiln::detail {
struct Storage;
}

namespace kiln::compiler::passes {

// Removes the nodes whose outputs nothing reads (no later node, no graph output, no in-place
// write) and that write no existing memory (Node::has_side_effects). Keeps node order.
void eliminate_dead_code(Graph& graph);

// Merges a node into an earlier one with the same op, inputs and attrs: uses of its outputs read
// the earlier node's. Skips random ops, nodes with scalar slots, nodes with side effects or whose
// outputs (or aliases of them) are written in place, and never matches across a node that writes
// existing memory. Merged nodes are erased; their output values stay in `values`, unused.
void eliminate_common_subexpressions(Graph& graph);

// Turns in-place writes into values, so that the code generator sees dataflow instead of memory.
// An in-place node whose every target is a base (a node's fresh result, or a placeholder that
// shares its storage with no other placeholder) and whose targets have no older alias read later
// becomes the out-of-place call of its op (plus a `copy` node casting to the target's dtype when
// the result's dtype differs); later reads of the target read the new value. A placeholder
// rewritten this way gets one in-place `copy` node at the end of the graph (what Tensor::copy_
// records) writing its final value back: the caller sees the same input mutation as before.
// Left in place, and run in order by the code generator: writes into views (and into values with
// a view or an overlapping placeholder still read later), writes followed by an as_strided view,
// and ops with OpDef::mutated_inputs (batch norm's running statistics; their kernel writes the
// input, so they run as extern calls in order). Node outputs' layouts and alias groups are
// re-derived afterwards (refresh_layouts).
void functionalize(Graph& graph);

// Replaces the nodes of ops with a decomposition lowering (lowering::Decomposition in the op's
// entry; the functions are ordinary Kiln code in src/ops/decompositions.cpp) by the graphs traced
// from them. Attrs the
// decomposition reads are baked in, except float run-time scalars (eps, momentum), which stay
// run-time scalars: the slot moves to a node that materializes the value as a 0-dim tensor (or
// becomes unused, {-1, -1}, where the decomposition does not read it).
// A node stays as it is when its op has no decomposition, when the decomposition does not apply
// (its inputs' dtypes or sizes, see src/ops/decompositions.cpp), when it reads a scalar slot it cannot
// keep, or when it is an in-place (out=) call. Decompositions may write inputs in place (the
// batch-norm running statistics), so run functionalize() afterwards; outputs nothing reads
// become dead code, so run eliminate_dead_code() too. Slots never change position.
// `filter`, when given, picks which of those nodes to decompose (the kiln pipeline passes
// decomposition_applies).
void decompose(Graph& graph, const std::function<bool(const Node&)>& filter = {});
// Whether the kiln backend decomposes this node: its decomposition's `applies` accepts its attrs.
bool decomposition_applies(const Node& node);
// The ops with a decomposition, by name.
std::set<std::string> decomposable_ops();

// Evaluates, when the graph is compiled, the nodes whose inputs are all constants (or None), and
// the factories without inputs: their outputs become Graph::constants and the nodes go (no other
// node becomes dead by it); readers of equal one-element constants share one, and constants
// nothing reads are dropped. Never folded: random ops
// (OpDef::runtime_attrs), nodes with scalar slots, nodes with side effects, nodes whose outputs
// (or aliases of them) are written in place, graph outputs (each call returns a buffer of its
// own), and results of more than `max_numel` elements (a large filled tensor is cheaper to
// recompute than to keep; negative: no limit).
void fold_constants(Graph& graph, int64_t max_numel = 1 << 16);

// Epilogue fusion into convolutions: conv2d → native_batch_norm (inference) [→ relu] becomes one
// conv2d_bn node (the batch norm folded into the weights, the relu a oneDNN post-op), where the
// intermediate values are read by nothing else. Run after functionalize() (in-place relu_).
void fuse_conv_bn(Graph& graph);

// Epilogue fusion into GEMMs: addmm → relu becomes one addmm_relu node (the relu applied in place
// to the GEMM's result) producing the relu's value, where the addmm's result is read by the relu
// alone (not a graph output, no view, no in-place write). The fused node takes the addmm's place
// and attrs, so its beta/alpha slots stay valid. Run after functionalize() (in-place relu_).
void fuse_gemm_epilogue(Graph& graph);

// Batch norm + relu fusion: native_batch_norm in training mode whose output 0 only one relu reads
// becomes batch_norm_relu producing the relu's value (inference batch norms are left to
// decompose(), whose pointwise ops fuse with their neighbours); where(le(r, t), v, grad) read
// only as the grad of a native_batch_norm_backward, r a relu's output and t, v 0-dim, becomes
// batch_norm_relu_backward(grad, r, ..., t, v) (the mask applied as the kernel reads grad), or
// batch_norm_relu_backward_recompute(grad, x, ..., bias, t, v) when r is a batch_norm_relu's result
// on the backward's own operands (the mask recomputed from x instead of read).
// Nothing involved may be written in place. Run after functionalize() and fuse_conv_bn().
void fuse_batch_norm_relu(Graph& graph);

// Average pooling moved before a 1x1 convolution (no bias, stride 1, no padding) whose result only
// the pooling reads (no padding, no ceil mode, no divisor override: every window full):
// avg_pool2d(conv2d(x, w)) becomes conv2d(avg_pool2d(x), w), the same linear map on fewer pixels
// (DenseNet's transitions: 4x fewer convolution FLOPs). The matching backward pair in the same
// graph (avg_pool2d_backward read only by convolution_backward of the same x and w, asking for the
// input gradient) becomes convolution_backward on the pooled operand followed by
// avg_pool2d_backward of its input gradient. Equal up to rounding. Returns how many pairs moved.
// Run after functionalize().
int pool_before_pointwise_conv(Graph& graph);

// Layout optimization for convolution networks: the first convolution reading a row-major 4-D
// float32/bfloat16 CPU activation reads a channels-last copy of it instead (a `copy` node), and
// refresh_layouts() carries channels-last through every op whose meta keeps it; repeated until
// every convolution reads channels-last. Graph outputs that were row-major and became
// channels-last are copied back, so callers see eager's layouts. Returns whether it changed the
// graph. Run after fuse_conv_bn().
bool channels_last_convolutions(Graph& graph);

// Concatenation chains into one buffer: where the inputs of two or more `cat`s are prefixes of
// the largest one's (a DenseNet block), every input is copied once into its slice of a buffer laid
// out like the largest cat, right before the first cat that reads it, and each cat becomes a view
// of the buffer's leading slice (no quadratic copying, one buffer alive instead of every
// concatenation). Left alone: groups whose cats only pointwise ops read (those cats fuse into the
// readers' kernels), cats that are graph outputs or written in place, inputs written in place,
// mixed dtypes. Returns how many cats became views. Run last: the in-place copies
// fix the order of the nodes around them.
int cat_into_slices(Graph& graph);

// Re-derives, in node order, every node output's strides, storage offset and alias group from
// its op's meta on the current inputs (as capture records them). Run it after rewrites that give
// a value another producer: a view of a new value has the new value's layout. Node outputs whose
// meta fails keep their recorded layout (validate() then names the node).
void refresh_layouts(Graph& graph);

namespace internal {

// Whether `v` names a value of `g` (not -1, the id of None, and not out of range).
inline bool valid(const Graph& g, int v) { return v >= 0 && static_cast<size_t>(v) < g.values.size(); }

// FX-style names for nodes added by a pass: "mul", then "mul_1", ... one past the largest suffix
// in use by the graph's nodes and placeholders when the namer was made, or handed out since.
class NodeNamer {
 public:
  explicit NodeNamer(const Graph& graph);
  std::string operator()(std::string_view op_name);

 private:
  std::vector<std::string> taken_;
  std::unordered_map<std::string, int64_t> largest_;  // base name -> largest suffix (-1: base)
};

// The op table's entry for `name`; throws CompileError when no op has that name.
const OpDef& registered_op(std::string_view name);

// A tensor with `info`'s metadata and no data, for meta functions. It lives in `storage` (grown to
// cover it), so that tensors of one alias group can share one, or else in a storage of its own.
Tensor meta_tensor(const ValueInfo& info, std::shared_ptr<kiln::detail::Storage> storage = {});

// Random ops (run-time attrs, or a seed parameter) draw fresh numbers per call: CSE never merges
// them and constant folding never folds them (this and written_memory: passes/common.cpp).
bool is_random(const OpDef& op);

// Whether node `n` writes its OpDef::mutated_inputs (OpDef::mutates on the node's attrs and its
// inputs' metadata): batch norm writes its running statistics only in training.
bool mutates_inputs(const Graph& graph, const Node& n);

// Per value: 1 when some node writes its memory (an in-place output, or an input the op mutates,
// OpDef::mutated_inputs), directly or through an alias (a shared storage group, or a view).
std::vector<char> written_memory(const Graph& graph);
// Per value: the node creating it (-1 for placeholders, constants and in-place targets), and the
// node reading it when `uses` (Graph::use_counts()) says it has exactly one use (-1 otherwise).
struct Dataflow {
  std::vector<int> producer;
  std::vector<int> consumer;
};
Dataflow dataflow(const Graph& graph, const std::vector<int>& uses);

// A new value like `like` (dtype, device) with `sizes`; its strides are zeros until
// refresh_layouts() derives them (and its alias group).
int new_value(Graph& graph, const ValueInfo& like, std::vector<int64_t> sizes, const std::string& name);

// The nodes that write each value's memory (as written_memory counts them), indexed once so that a
// pass can ask about many node ranges without rescanning the graph.
class WriteIndex {
 public:
  explicit WriteIndex(const Graph& graph);
  // Whether any node writes v's memory.
  bool written(int v) const;
  // Whether a node in [first, last) writes v's memory.
  bool written_between(int v, size_t first, size_t last) const;

 private:
  std::vector<int> group_;                 // value -> its alias group's root
  std::vector<std::vector<int>> writers_;  // root -> the nodes writing the group, ascending
};

}  // namespace internal

}  // namespace kiln::compiler::passes
