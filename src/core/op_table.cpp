// The op table and the eager dispatcher: meta → allocate → kernel.
#include "kiln/op_table.h"

#include <algorithm>
#include <map>
#include <memory>
#include <utility>

#include "core/dispatch.h"
#include "core/layer_hooks.h"
#include "core/profiler.h"
#include "core/schema.h"
#include "core/shape.h"
#include "core/tensor_factory.h"
#include "kiln/autograd.h"  // NoGradGuard: grad mode is core state
#include "kiln/ops.h"

namespace kiln {

const std::string& OpCall::name() const { return op->name; }

const char* lowering_name(const Lowering& l) {
  struct Name {
    const char* operator()(const lowering::Extern&) const { return "extern"; }
    const char* operator()(const lowering::View&) const { return "view"; }
    const char* operator()(const lowering::Buffer&) const { return "buffer"; }
    const char* operator()(const lowering::Pointwise&) const { return "pointwise"; }
    const char* operator()(const lowering::Reduction&) const { return "reduction"; }
    const char* operator()(const lowering::Decomposition&) const { return "decomposition"; }
  };
  return std::visit(Name{}, l);
}

struct OpTable::Impl {
  mutable std::mutex mutex;
  std::map<std::string, std::unique_ptr<OpDef>, std::less<>> ops;
};

OpTable& OpTable::instance() {
  static OpTable table;
  return table;
}

OpTable::Impl& OpTable::impl() const {
  static Impl impl;  // function-local: safe to use from other translation units' static init
  return impl;
}

OpDef& OpTable::entry(std::string_view name) {
  Impl& im = impl();
  std::lock_guard lock(im.mutex);
  auto it = im.ops.find(name);
  if (it == im.ops.end()) {
    auto def = std::make_unique<OpDef>();
    def->name = std::string(name);
    it = im.ops.emplace(std::string(name), std::move(def)).first;
  }
  return *it->second;
}

const OpDef* OpTable::find(std::string_view name) const {
  Impl& im = impl();
  std::lock_guard lock(im.mutex);
  auto it = im.ops.find(name);
  return it == im.ops.end() || !it->second->meta ? nullptr : it->second.get();
}

std::vector<const OpDef*> OpTable::all() const {
  Impl& im = impl();
  std::lock_guard lock(im.mutex);
  std::vector<const OpDef*> out;
  for (auto& [name, def] : im.ops)
    if (def->meta) out.push_back(def.get());
  return out;
}

namespace {

// Counts a schema's parameters: "f(Tensor(a) self, Tensor[] xs, *, int[2] k=1) -> Tensor" has one
// tensor, a tensor list and one attr. Leaves the counts at -1 when the schema does not parse.
void count_params(OpDef& op) {
  const std::vector<detail::SchemaParam> params = detail::parse_schema_params(op.schema);
  if (params.empty() && op.schema.find("()") == std::string::npos) return;
  int tensors = 0, attrs = 0, required_tensors = 0, required_attrs = 0;
  bool list = false;
  for (const detail::SchemaParam& p : params) {
    if (!p.is_tensor()) {
      ++attrs;
      required_attrs += !p.has_default;
    } else if (p.type.find("[]") != std::string::npos) {
      list = true;
    } else {
      ++tensors;
      required_tensors += !p.has_default;
    }
  }
  op.tensor_params = tensors;
  op.required_tensor_params = required_tensors;
  op.tensor_list = list;
  op.attr_params = attrs;
  op.required_attr_params = required_attrs;
}

std::string count_range(int low, int high, bool unbounded) {
  if (unbounded) return "at least " + std::to_string(low);
  return low == high ? std::to_string(low) : std::to_string(low) + " to " + std::to_string(high);
}

}  // namespace

void check_arity(const OpDef& op, size_t inputs, size_t attrs) {
  if (op.tensor_params < 0) return;
  const bool inputs_ok = inputs >= static_cast<size_t>(op.required_tensor_params) &&
                         (op.tensor_list || inputs <= static_cast<size_t>(op.tensor_params));
  KILN_CHECK(inputs_ok, ValueError,
             "[kiln::call_op] op '" + op.name + "' takes " +
                 count_range(op.required_tensor_params, op.tensor_params, op.tensor_list) + " tensor inputs (" +
                 op.schema + "), got " + std::to_string(inputs) + ".");
  const bool attrs_ok =
      attrs >= static_cast<size_t>(op.required_attr_params) && attrs <= static_cast<size_t>(op.attr_params);
  KILN_CHECK(attrs_ok, ValueError,
             "[kiln::call_op] op '" + op.name + "' takes " +
                 count_range(op.required_attr_params, op.attr_params, false) + " non-tensor arguments (" +
                 op.schema + "), got " + std::to_string(attrs) + ".");
}

OpDef& register_op(OpDef def) {
  count_params(def);
  OpDef& e = OpTable::instance().entry(def.name);
  KILN_CHECK(!e.meta, Error, "[kiln::register_op] op '" + def.name + "' is registered twice.");
  auto kernels = e.kernels;  // kernels may have registered first
  e = std::move(def);
  for (int d = 0; d < kNumDeviceTypes; ++d)
    if (!e.kernels[d]) e.kernels[d] = kernels[d];
  return e;
}

void register_kernel(std::string_view name, DeviceType device, Kernel kernel) {
  OpTable::instance().entry(name).kernels[static_cast<int>(device)] = std::move(kernel);
}

void register_kernels(DeviceType device, std::initializer_list<std::pair<std::string_view, Kernel>> kernels) {
  for (const auto& [name, kernel] : kernels) register_kernel(name, device, kernel);
}

namespace {

const Kernel& kernel_for(const OpDef& op, Device device) {
  const Kernel& k = op.kernels[static_cast<int>(device.type)];
  if (!k) {
    throw DeviceError("[kiln::" + op.name + "] has no kernel for " + device.str() +
                      ". Move the inputs to a device that has one (kiln ops lists them).");
  }
  return k;
}

// The device of an op without outputs (the fused optimizers): its first defined input's.
Device first_input_device(std::span<const Tensor> inputs) {
  for (const Tensor& t : inputs)
    if (t.defined()) return t.device();
  return kCPU;
}

Tensor allocate(const TensorMeta& m) {
  if (m.strides.empty()) return detail::make_empty(m.sizes, m.dtype, m.device);
  return detail::make_empty_strided(m.sizes, m.strides, m.dtype, m.device);
}

// Whether writing `out` while reading `in` elementwise is safe: different memory, or the same
// elements at the same positions.
bool same_elementwise_layout(const Tensor& in, const Tensor& out) {
  if (!detail::may_overlap(in, out)) return true;
  if (in.dtype() != out.dtype() || in.storage_offset() != out.storage_offset()) return false;
  auto s = detail::broadcast_strides(in.sizes(), in.strides(), out.sizes());
  for (size_t i = 0; i < s.size(); ++i)
    if (out.sizes()[i] != 1 && s[i] != out.strides()[i]) return false;
  return true;
}

// Kernels may call other ops on their outputs and mutated inputs; those internal calls are never
// recorded, and their writes are not counted: the op counts each tensor it writes once, as
// PyTorch does (batch norm's running statistics are at version 1 after one training call).
void run_kernel(const Kernel& kernel, const OpCall& call, std::span<Tensor> outputs) {
  NoGradGuard no_grad;
  detail::WritesAlreadyCounted counted;
  kernel(call, outputs);
}

// Same memory, element for element.
bool same_layout(const Tensor& a, const Tensor& b) {
  return a.defined() && b.defined() && a.impl().storage == b.impl().storage &&
         a.storage_offset() == b.storage_offset() && a.dtype() == b.dtype() && a.sizes() == b.sizes() &&
         a.strides() == b.strides();
}

thread_local bool t_writes_counted = false;  // inside detail::WritesAlreadyCounted

// A write through the dispatcher, unless a WritesAlreadyCounted scope counted it already.
void count_write(const Tensor& t) {
  if (!t_writes_counted) detail::bump_version(t);
}

}  // namespace


namespace detail {

WritesAlreadyCounted::WritesAlreadyCounted() : saved_(std::exchange(t_writes_counted, true)) {}
WritesAlreadyCounted::~WritesAlreadyCounted() { t_writes_counted = saved_; }

void check_out_targets(const OpDef& op, const std::vector<TensorMeta>& metas, std::span<Tensor> outputs) {
  KILN_CHECK(metas.size() == outputs.size(), Error,
             "[kiln::" + op.name + "] expected " + std::to_string(metas.size()) + " outputs, got " +
                 std::to_string(outputs.size()) + ".");
  for (size_t i = 0; i < metas.size(); ++i) {
    const Tensor& out = outputs[i];
    const TensorMeta& m = metas[i];
    if (!(out.sizes() == IntArrayRef(m.sizes))) {
      throw ShapeError("[kiln::" + op.name + "_] output with shape " + shape_str(out.sizes()) +
                       " doesn't match the broadcast shape " + shape_str(m.sizes) +
                       ". In-place ops cannot change the shape of their target; use the out-of-place form.");
    }
    if (!can_cast(m.dtype, out.dtype())) {
      throw DTypeError("[kiln::" + op.name + "_] result type " + std::string(dtype_name(m.dtype)) +
                       " can't be cast to the desired output type " +
                       std::string(dtype_name(out.dtype())) + ". Use the out-of-place form, or convert first.");
    }
    if (out.device() != m.device) {
      throw DeviceError("[kiln::" + op.name + "_] the output is on " + out.device().str() +
                        " but the inputs are on " + m.device.str() + ". Move them to one device.");
    }
  }
}

}  // namespace detail

std::vector<Tensor> call_op(const OpDef& op, std::vector<Tensor> inputs, std::vector<Attr> attrs) {
  check_arity(op, inputs.size(), attrs.size());
  if (void* cap = detail::active_capture_hook()) [[unlikely]]
    return detail::capture_hooks.run_op(cap, op, inputs, attrs);
  detail::OpTimer timer(op.name);
  detail::DeviceSpan device_time("gpu", op.name, detail::traced_device(inputs));
  OpCall call(&op, inputs, attrs);
  std::vector<TensorMeta> metas = op.meta(call);
  std::vector<Tensor> outputs;
  outputs.reserve(metas.size());
  if (op.kind == OpKind::view) {
    for (auto& m : metas)
      outputs.push_back(detail::make_view(inputs[0], std::move(m.sizes), std::move(m.strides), m.storage_offset));
  } else {
    const Kernel& kernel = kernel_for(op, metas.empty() ? first_input_device(inputs) : metas[0].device);
    for (const auto& m : metas) outputs.push_back(allocate(m));
    run_kernel(kernel, call, outputs);
    if (op.mutates(call))
      for (int i : op.mutated_input_indices(inputs.size(), attrs))
        if (inputs[i].defined()) count_write(inputs[i]);
  }
  const detail::AutogradHooks& autograd = detail::autograd_hooks;
  if (autograd.recording && autograd.recording(inputs)) autograd.record(op, inputs, attrs, outputs);
  return outputs;
}

Tensor call_op1(const OpDef& op, std::vector<Tensor> inputs, std::vector<Attr> attrs) {
  return std::move(call_op(op, std::move(inputs), std::move(attrs))[0]);
}

void call_op_out(const OpDef& op, std::vector<Tensor> inputs, std::vector<Attr> attrs,
                 std::span<Tensor> outputs) {
  check_arity(op, inputs.size(), attrs.size());
  if (!op.overlapping_output_ok) {
    for (const Tensor& out : outputs) {
      KILN_CHECK(!detail::has_internal_overlap(out), Error,
                 "[kiln::" + op.name + "_] unsupported operation: more than one element of the "
                 "written-to tensor refers to a single memory location. Please clone() the tensor "
                 "before performing the operation.");
    }
  }
  if (void* cap = detail::active_capture_hook()) [[unlikely]] {
    detail::capture_hooks.run_op_out(cap, op, inputs, attrs, outputs);
    return;
  }
  detail::OpTimer timer(op.name, /*inplace=*/true);
  const int device = detail::traced_device(inputs, outputs);
  detail::DeviceSpan device_time("gpu", device >= 0 ? op.name + "_" : op.name, device);
  OpCall call(&op, inputs, attrs);
  std::vector<TensorMeta> metas = op.meta(call);
  detail::check_out_targets(op, metas, outputs);
  bool need_temp = false;
  for (size_t i = 0; i < metas.size(); ++i) {
    const Tensor& out = outputs[i];
    if (metas[i].dtype != out.dtype()) need_temp = true;
    for (size_t k = 0; k < inputs.size(); ++k) {
      const Tensor& in = inputs[k];
      if (k == 0 && i == 0 && op.out_may_alias_input0 && same_layout(in, out)) continue;
      if (!op.pointwise ? detail::may_overlap(in, out) : !same_elementwise_layout(in, out)) need_temp = true;
    }
  }
  // Autograd: an in-place op on a tensor with history (or with inputs that require grad)
  // replaces the target's grad_fn with this op's node.
  const detail::AutogradHooks& autograd = detail::autograd_hooks;
  std::shared_ptr<void> recording = autograd.begin_inplace ? autograd.begin_inplace(op, inputs, outputs) : nullptr;

  const Kernel& kernel = kernel_for(op, metas.empty() ? first_input_device(inputs) : metas[0].device);
  if (!need_temp) {
    run_kernel(kernel, call, outputs);
  } else {
    std::vector<Tensor> temps;
    for (const auto& m : metas) temps.push_back(allocate(m));
    run_kernel(kernel, call, temps);
    NoGradGuard no_grad;  // the copy-back is part of this op, not a recorded op of its own
    detail::WritesAlreadyCounted counted;  // nor a write of its own: the op counts it below
    for (size_t i = 0; i < outputs.size(); ++i) outputs[i].copy_(temps[i]);
  }
  for (Tensor& out : outputs) count_write(out);
  if (op.mutates(call))
    for (int i : op.mutated_input_indices(inputs.size(), attrs))
      if (inputs[i].defined()) count_write(inputs[i]);
  if (recording) autograd.finish_inplace(recording, op, attrs, outputs);
}

}  // namespace kiln
