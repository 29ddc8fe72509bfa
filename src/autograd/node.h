// The autograd graph: nodes, edges, saved tensors and per-tensor autograd metadata.
//
// Ownership: a tensor owns its grad_fn; a node owns the nodes of its inputs (next_edges) and
// the tensors it saved. Saved OUTPUTS are kept without their grad_fn (which is the node itself)
// to avoid a reference cycle; unpacking re-attaches it.
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "kiln/autograd.h"
#include "kiln/op_table.h"

namespace kiln::autograd {

struct Node;

struct Edge {
  std::shared_ptr<Node> node;  // null: no gradient flows along this edge
  uint32_t input_nr = 0;       // which gradient slot of `node` (= output_nr of the forward tensor)
  bool valid() const { return node != nullptr; }
};

using TensorHook = std::function<Tensor(const Tensor&)>;

// Metadata of a forward tensor that backward needs without keeping the tensor alive.
struct TensorShape {
  std::vector<int64_t> sizes;
  DType dtype = DType::float32;
  Device device;
};

struct AutogradMeta {
  Tensor grad;
  std::shared_ptr<Node> grad_fn;      // null for leaves
  std::weak_ptr<Node> grad_accumulator;  // leaves: the AccumulateGrad node, created on demand
  uint32_t output_nr = 0;
  bool retains_grad = false;
  bool is_view_of_grad_tensor = false;  // a view whose base requires grad (in-place on it is refused)
  std::vector<TensorHook> hooks;        // leaves only; non-leaf hooks live on grad_fn
  std::vector<std::function<void(const Tensor&)>> post_accumulate_hooks;  // leaves only
  std::mutex mutex;                     // guards grad during accumulation
  // Guards grad_accumulator: threads running forwards on one shared leaf create its node at once.
  std::mutex accumulator_mutex;
};

// A tensor saved for backward, with the version it had when saved.
class SavedTensor {
 public:
  SavedTensor() = default;
  SavedTensor(const Tensor& t, bool is_output);
  // The saved value; throws if it was modified in place since it was saved or was released.
  Tensor unpack(const std::shared_ptr<Node>& owner) const;
  // The held value, without the version check (the compiler's partition counts references).
  const Tensor& peek() const { return data_; }
  // Frees the value; a later unpack of a slot that held one throws.
  void release() {
    if (!saved_) return;
    data_ = Tensor();
    released_ = true;
  }

 private:
  Tensor data_;
  uint64_t version_ = 0;
  bool is_output_ = false;
  bool saved_ = false;  // this slot holds a saved value (possibly an undefined optional input)
  bool released_ = false;
  uint32_t output_nr_ = 0;
  bool requires_grad_ = false;
};

// Nodes alive with a compiled_owner: while zero, backward() skips looking for them.
extern std::atomic<int64_t> g_compiled_nodes;

struct Node : std::enable_shared_from_this<Node> {
  virtual ~Node() {
    if (compiled_owner) g_compiled_nodes.fetch_sub(1, std::memory_order_relaxed);
  }
  virtual std::string name() const = 0;
  // Gradients of the forward outputs in, gradients of the forward inputs out (one per edge).
  virtual TensorList apply(TensorList&& grads) = 0;
  virtual void release_saved() {}
  // The forward op, for anomaly reports ("" for AccumulateGrad).
  virtual std::string forward_op() const { return ""; }

  std::vector<Edge> next_edges;            // per forward input
  std::vector<TensorShape> output_shapes;  // per forward output: zero grads for unused outputs
  uint64_t sequence_nr = 0;
  // Per output slot: hooks registered on the non-leaf tensor, and tensors retaining their grad.
  std::vector<std::vector<TensorHook>> pre_hooks;
  std::vector<std::weak_ptr<detail::TensorImpl>> retained;
  // The compiled function that captured this node's forward (a compiler::detail::FunctionState),
  // or null: a backward() run later outside compiled code is captured as that function's graph.
  std::shared_ptr<void> compiled_owner;
};

// The node of one op-table call.
struct OpNode final : Node {
  const OpDef* op = nullptr;
  std::vector<Attr> attrs;
  std::vector<SavedTensor> saved_inputs;   // indexed like the op's inputs; empty where unsaved
  std::vector<SavedTensor> saved_outputs;  // indexed like the op's outputs
  // next_edges[0, num_inputs) are the op's inputs; edges past them lead to the old histories of
  // targets the op overwrote without reading them (OverwrittenValue), which receive zeros.
  size_t num_inputs = 0;
  std::vector<TensorShape> input_shapes;  // per edge
  std::vector<bool> input_defined;
  bool released = false;

  std::string name() const override;
  TensorList apply(TensorList&& grads) override;
  void release_saved() override;
  std::string forward_op() const override { return op->name; }
};

// Stands in for a node whose saved values a backward already freed, on a result that a pure
// replay rebuilds (the captured call's result had that node): the tensor keeps its grad_fn name,
// and a backward through it throws as the freed node would.
struct SpentNode final : Node {
  std::string label;
  std::string name() const override { return label; }
  TensorList apply(TensorList&&) override;
};

// "Trying to backward through the graph a second time ...".
[[noreturn]] void throw_backward_twice();

// Accumulates into a leaf's .grad().
struct AccumulateGrad final : Node {
  std::shared_ptr<detail::TensorImpl> leaf;
  std::string name() const override { return "AccumulateGrad"; }
  TensorList apply(TensorList&& grads) override;

 private:
  static void accumulate_locked(AutogradMeta& m, const Tensor& leaf_t, const Tensor& g);
};

// Runs `hook(leaf)` after each backward accumulated into leaf's .grad() (PyTorch's
// register_post_accumulate_grad_hook; DistributedDataParallel starts its all-reduces there).
void register_post_accumulate_hook(const Tensor& leaf, std::function<void(const Tensor&)> hook);

// The autograd metadata of t, created on first use.
AutogradMeta& meta(const Tensor& t);
AutogradMeta* meta_if_exists(const Tensor& t);
// Where t's gradient goes: its grad_fn, or its leaf accumulator (or nothing).
Edge gradient_edge(const Tensor& t);
uint64_t next_sequence_nr();

// An in-place call's target whose history the op replaces without reading it (copy_, fill_,
// out=): PyTorch's derivative gives that old value a zero gradient, so its history is still
// reached (x in `z = (x * 2).clone(); z.copy_(w)` gets zeros, not nothing).
struct OverwrittenValue {
  Edge edge;
  TensorShape shape;
};
// The targets among `outputs` that have a history and that `inputs` do not include. Call before
// record() replaces their grad_fn.
std::vector<OverwrittenValue> overwritten_history(std::span<const Tensor> inputs, std::span<const Tensor> outputs);

// Called by the dispatcher after an op ran (call_op) and before/after an in-place op
// (call_op_out). `recording()` is the fast check.
bool recording(std::span<const Tensor> inputs);
void record(const OpDef& op, std::span<const Tensor> inputs, std::span<const Attr> attrs,
            std::span<Tensor> outputs, std::span<const OverwrittenValue> overwritten = {});
// For in-place/out= calls: validates the targets and returns the inputs the node must save
// (clones of inputs that alias an output, so their pre-write values survive).
std::vector<Tensor> prepare_inplace(const OpDef& op, std::span<const Tensor> inputs,
                                    std::span<const Tensor> outputs);

// What an in-place/out= call needs for autograd, gathered before its kernel writes: whether it
// records (its inputs have history, or a target requires grad), the inputs its node saves
// (prepare_inplace) and the overwritten histories (overwritten_history). After the write, pass
// them to record().
struct InplaceRecording {
  bool record = false;
  std::vector<Tensor> node_inputs;
  std::vector<OverwrittenValue> overwritten;
};
InplaceRecording begin_inplace_recording(const OpDef& op, std::span<const Tensor> inputs,
                                         std::span<const Tensor> outputs);

// Reduces a broadcast gradient back to `sizes` (sum over expanded dims).
Tensor sum_to(const Tensor& grad, IntArrayRef sizes);

}  // namespace kiln::autograd
