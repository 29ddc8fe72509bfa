// The op table: one declaration per op, read by eager dispatch, autograd, capture and codegen.
//
// An OpDef holds the op's schema, its meta function (output sizes/strides/dtype/device plus every
// input check, with its error message), a kernel per device type, and the slots that later
// stages fill (derivative, lowering). Ops register themselves from src/ops/*.cpp; kernels register
// from src/kernels/<device>/. Registration order does not matter: both sides go through
// OpTable::entry(name), which creates the entry on first use.
#pragma once

#include <array>
#include <functional>
#include <initializer_list>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "kiln/lowering.h"
#include "kiln/tensor.h"

namespace kiln {

struct OpDef;

// Typed access to an op's non-tensor arguments.
struct AttrAccess {
  std::span<const Attr> attrs;

  bool has_attr(size_t i) const {
    return i < attrs.size() && !std::holds_alternative<std::monostate>(attrs[i]);
  }
  bool bool_attr(size_t i) const { return std::get<bool>(attrs[i]); }
  int64_t int_attr(size_t i) const { return std::get<int64_t>(attrs[i]); }
  double double_attr(size_t i) const { return std::get<double>(attrs[i]); }
  const Scalar& scalar_attr(size_t i) const { return std::get<Scalar>(attrs[i]); }
  IntArrayRef ints_attr(size_t i) const { return std::get<std::vector<int64_t>>(attrs[i]); }
  const std::string& string_attr(size_t i) const { return std::get<std::string>(attrs[i]); }
  DType dtype_attr(size_t i) const { return std::get<DType>(attrs[i]); }
  Device device_attr(size_t i) const { return std::get<Device>(attrs[i]); }
};

// The arguments of one op invocation.
struct OpCall : AttrAccess {
  const OpDef* op = nullptr;
  std::span<const Tensor> inputs;  // undefined tensors stand for None

  OpCall() = default;
  OpCall(const OpDef* o, std::span<const Tensor> in, std::span<const Attr> at)
      : AttrAccess{at}, op(o), inputs(in) {}
  const Tensor& input(size_t i) const { return inputs[i]; }
  const std::string& name() const;
};

// What a derivative knows about each forward input, saved or not.
struct InputInfo {
  std::vector<int64_t> sizes;
  DType dtype = DType::float32;
  Device device;
  bool defined = false;
};

// The arguments of a derivative: the gradients of the forward outputs, the saved forward
// values, the attrs, and which inputs need a gradient.
struct BackwardContext : AttrAccess {
  const OpDef* op = nullptr;
  std::span<const Tensor> grads;    // per forward output (zeros where none flowed)
  std::span<const Tensor> inputs;   // per forward input; defined only where Derivative saves it
  std::span<const Tensor> outputs;  // per forward output; defined only where Derivative saves it
  std::span<const InputInfo> input_info;
  std::vector<bool> needs_input_grad;
  // Per forward output: whether a gradient flowed into it (grads holds zeros where none did). A
  // formula whose term for an output must vanish when no gradient came (PyTorch passes an
  // undefined tensor there; var_mean's variance with correction >= N is inf * 0) checks has_grad.
  std::vector<bool> grad_defined;

  const Tensor& grad(size_t i = 0) const { return grads[i]; }
  bool has_grad(size_t i) const { return i < grad_defined.size() && grad_defined[i]; }
  const Tensor& input(size_t i) const { return inputs[i]; }
  const Tensor& output(size_t i = 0) const { return outputs[i]; }
  bool needs_grad(size_t i) const { return i < needs_input_grad.size() && needs_input_grad[i]; }
};

// Gradients of the forward inputs (one per input; undefined for none), written in Kiln ops so
// that a create_graph backward is itself recorded. A result shaped like a broadcast of its
// input is summed back to the input's shape by the engine.
using BackwardFn = std::function<std::vector<Tensor>(const BackwardContext&)>;

struct Derivative {
  std::string formula;            // shown by `kiln ops`: "self: grad * other; other: grad * self"
  std::vector<int> save_inputs;   // forward inputs the formula reads
  std::vector<int> save_outputs;  // forward outputs the formula reads
  BackwardFn fn;
  explicit operator bool() const { return static_cast<bool>(fn); }
};

// What meta returns for each output.
struct TensorMeta {
  std::vector<int64_t> sizes;
  std::vector<int64_t> strides;  // empty: contiguous
  DType dtype = DType::float32;
  Device device;
  int64_t storage_offset = 0;    // view ops only
};

enum class OpKind : uint8_t {
  compute,  // allocates outputs and runs a kernel
  view,     // output 0 aliases input 0 with the sizes/strides/offset meta returns; no kernel
  factory,  // no tensor inputs; the device comes from the attrs
};

using MetaFn = std::function<std::vector<TensorMeta>(const OpCall&)>;
// Writes the op's results into `outputs`, which are allocated (or given, for in-place and out=
// calls) with the sizes and dtypes meta returned.
using Kernel = std::function<void(const OpCall&, std::span<Tensor> outputs)>;

struct OpDef {
  std::string name;
  std::string schema;  // "add(Tensor self, Tensor other, *, Scalar alpha=1) -> Tensor"
  OpKind kind = OpKind::compute;
  MetaFn meta;
  std::array<Kernel, kNumDeviceTypes> kernels{};
  // Elementwise: output i depends only on element i of each (broadcast) input, so a kernel may
  // write into an input that it reads at the same position.
  bool pointwise = false;
  // The kernel is correct when output 0 is input 0 itself (same memory and layout), e.g.
  // scatter_ or index_put_ updating self in place; call_op_out then skips the temporary.
  bool out_may_alias_input0 = false;
  // Writing one location twice is harmless (fill writes one value everywhere), so an output
  // whose elements overlap (an expanded tensor) is allowed, as PyTorch's fill_ allows it. Every
  // other in-place or out= write into such an output throws, as in PyTorch.
  bool overlapping_output_ok = false;
  // Inputs the kernel writes besides its outputs (batch_norm's running stats, in-place ops).
  std::vector<int> mutated_inputs;
  // The derivative (autograd) and how compile() lowers the op (kiln/lowering.h); `kiln ops`
  // shows both.
  Derivative derivative;
  Lowering lowering;
  // int attrs that differ on every call (the random ops' seed and offset): compile() passes them
  // to the graph as run-time scalars instead of specializing on them. Scalar and double attrs are
  // always run-time scalars.
  std::vector<int> runtime_attrs;
  // When set, whether a call writes its mutated_inputs at all (batch norm writes its running
  // statistics only in training); unset: every call writes them. Decides the version bump, which
  // caches keyed on versions (folded conv + batch-norm weights) rely on.
  std::function<bool(const OpCall&)> writes_mutated_inputs;
  // When set, decides the written inputs per call instead of mutated_inputs, from the number of
  // inputs and the attrs: the fused optimizers write every tensor of their list but the gradients.
  // (Last, after the other std::function members: GCC 12 warns of an uninitialized `derivative`
  // in the ops' designated initializers when it stands before them.)
  std::function<std::vector<int>(size_t num_inputs, const AttrAccess& attrs)> mutated_inputs_of;
  // Filled by register_op from the schema: the tensor parameters (a Tensor[] list counts none and
  // sets tensor_list) and the other parameters, all and those without a default (a call may leave
  // trailing defaulted ones out). call_op checks a call's arity against them before the meta
  // reads inputs and attrs by position; -1 when the schema does not parse (no check).
  int tensor_params = -1, required_tensor_params = -1;
  bool tensor_list = false;
  int attr_params = -1, required_attr_params = -1;

  // Whether the op fuses into its neighbours' generated kernel (a pointwise lowering): the
  // scheduler chains such ops into one kernel and into a reduction's prologue or epilogue, reads
  // a concatenation inside them (cat_into_slices), and backward may recompute them instead of
  // saving their result (recompute). A reduction anchors a kernel of its own.
  bool is_fusible() const { return std::holds_alternative<lowering::Pointwise>(lowering); }
  bool has_kernel(DeviceType d) const { return static_cast<bool>(kernels[static_cast<int>(d)]); }
  // Whether some call may write inputs (mutated_inputs or mutated_inputs_of).
  bool may_mutate_inputs() const { return !mutated_inputs.empty() || static_cast<bool>(mutated_inputs_of); }
  // The inputs a call with `num_inputs` inputs and `attrs` may write, ascending.
  std::vector<int> mutated_input_indices(size_t num_inputs, std::span<const Attr> attrs) const {
    return mutated_inputs_of ? mutated_inputs_of(num_inputs, AttrAccess{attrs}) : mutated_inputs;
  }
  // Whether `call` writes its mutated inputs (see writes_mutated_inputs).
  bool mutates(const OpCall& call) const {
    return may_mutate_inputs() && (!writes_mutated_inputs || writes_mutated_inputs(call));
  }
};

class OpTable {
 public:
  static OpTable& instance();
  // The entry for `name`, created empty on first use. The reference stays valid forever.
  OpDef& entry(std::string_view name);
  // The entry for `name`, or nullptr.
  const OpDef* find(std::string_view name) const;
  // All entries with a schema, sorted by name.
  std::vector<const OpDef*> all() const;

 private:
  OpTable() = default;
  struct Impl;
  Impl& impl() const;
};

// Registers an op (schema, kind, meta, flags). Returns the entry, for the op's front-end.
OpDef& register_op(OpDef def);
// Registers the kernel for `device` on op `name`.
void register_kernel(std::string_view name, DeviceType device, Kernel kernel);
// Registers several kernels of one device: {{"uniform", uniform_kernel}, {"normal", normal_kernel}}.
void register_kernels(DeviceType device, std::initializer_list<std::pair<std::string_view, Kernel>> kernels);

// Throws ValueError when a call of `op` has the wrong number of tensor inputs or attrs for its
// schema (call_op and call_op_out check this first).
void check_arity(const OpDef& op, size_t inputs, size_t attrs);

// Runs an op: meta (validation), output allocation, kernel. Returns its outputs.
std::vector<Tensor> call_op(const OpDef& op, std::vector<Tensor> inputs, std::vector<Attr> attrs = {});
// call_op for single-output ops.
Tensor call_op1(const OpDef& op, std::vector<Tensor> inputs, std::vector<Attr> attrs = {});
// Runs an op writing into existing tensors (in-place and out= forms). The result must have the
// outputs' sizes; its dtype must be castable to theirs. Bumps their version counters.
void call_op_out(const OpDef& op, std::vector<Tensor> inputs, std::vector<Attr> attrs,
                 std::span<Tensor> outputs);

}  // namespace kiln
