// Recording: the dispatcher's hook that turns op calls into graph nodes, and OpNode's backward.
#include <atomic>
#include <cctype>

#include "core/layer_hooks.h"
#include "autograd/node.h"
#include "core/tensor_factory.h"
#include "kiln/ops.h"

namespace kiln::autograd {

namespace {
std::atomic<uint64_t> g_sequence_nr{0};

TensorShape shape_of(const Tensor& t) { return {t.sizes().vec(), t.dtype(), t.device()}; }

bool differentiable(DType t) { return is_floating_point(t); }
}  // namespace

uint64_t next_sequence_nr() { return g_sequence_nr.fetch_add(1, std::memory_order_relaxed); }

// Lazy creation is safe because it happens on the thread that owns the tensor: requires_grad_(true)
// creates a leaf's metadata (the ensure_meta hook) and record() an output's before either is shared.
AutogradMeta& meta(const Tensor& t) {
  auto& impl = t.impl();
  if (!impl.autograd) impl.autograd = std::make_shared<AutogradMeta>();
  return *impl.autograd;
}

AutogradMeta* meta_if_exists(const Tensor& t) { return t.defined() ? t.impl().autograd.get() : nullptr; }

Edge gradient_edge(const Tensor& t) {
  if (!t.defined() || !t.requires_grad()) return {};
  AutogradMeta& m = meta(t);
  if (m.grad_fn) return {m.grad_fn, m.output_nr};
  // A leaf shared between threads: every graph must get the one live accumulator, and the weak_ptr
  // must not be written by two threads at once (a torn control block crashed the engine).
  std::lock_guard lock(m.accumulator_mutex);
  auto acc = m.grad_accumulator.lock();
  if (!acc) {
    auto a = std::make_shared<AccumulateGrad>();
    a->leaf = t.impl_ptr();
    a->sequence_nr = UINT64_MAX;  // leaves run last among ready nodes
    a->output_shapes.push_back(shape_of(t));
    a->pre_hooks.resize(1);
    a->retained.resize(1);
    m.grad_accumulator = a;
    acc = a;
  }
  return {acc, 0};
}

// ---- SavedTensor ----

SavedTensor::SavedTensor(const Tensor& t, bool is_output) : is_output_(is_output), saved_(true) {
  if (!t.defined()) return;
  version_ = t.version();
  if (is_output) {
    // Keep the value without its grad_fn (this node): no reference cycle.
    data_ = t.detach();
    if (auto* m = meta_if_exists(t)) output_nr_ = m->output_nr;
    requires_grad_ = t.requires_grad();
  } else {
    data_ = t;
  }
}

void throw_backward_twice() {
  throw Error(
      "[kiln::autograd] Trying to backward through the graph a second time (or directly access "
      "saved tensors after they have already been freed). Saved intermediate values of the graph "
      "are freed when you call backward() or autograd::grad(). Pass retain_graph=true if you need "
      "to backward through the graph a second time.");
}

TensorList SpentNode::apply(TensorList&&) { throw_backward_twice(); }

Tensor SavedTensor::unpack(const std::shared_ptr<Node>& owner) const {
  if (released_) throw_backward_twice();
  if (!data_.defined()) return data_;
  if (data_.version() != version_) {
    throw Error("[kiln::autograd] one of the tensors needed for gradient computation has been modified by "
                "an in-place operation: [" + std::string(dtype_name(data_.dtype())) + " " +
                shape_str(data_.sizes()) + "], which is " + (is_output_ ? "output " : "an input ") +
                (is_output_ ? std::to_string(output_nr_) + " " : std::string()) + "of " + owner->name() +
                ", is at version " + std::to_string(data_.version()) + "; expected version " +
                std::to_string(version_) + " instead. Clone it before modifying it, or use the "
                "out-of-place op.");
  }
  if (is_output_ && requires_grad_ && is_grad_enabled()) {
    // create_graph: the output must carry its grad_fn so double backward can flow through it.
    Tensor t = data_.detach();
    t.impl().requires_grad = true;
    AutogradMeta& m = meta(t);
    m.grad_fn = owner;
    m.output_nr = output_nr_;
    return t;
  }
  return data_;
}

// ---- OpNode ----

std::string OpNode::name() const {
  std::string out;
  bool upper = true;
  for (char c : op->name) {
    if (c == '_') {
      upper = true;
      continue;
    }
    out += upper ? static_cast<char>(std::toupper(static_cast<unsigned char>(c))) : c;
    upper = false;
  }
  return out + "Backward0";
}

void OpNode::release_saved() {
  for (auto& s : saved_inputs) s.release();
  for (auto& s : saved_outputs) s.release();
  released = true;
}

TensorList OpNode::apply(TensorList&& grads) {
  const Derivative& d = op->derivative;
  if (!d) {
    throw Error("[kiln::autograd] the derivative of '" + op->name +
                "' is not implemented. Detach its inputs, or compute this part under NoGradGuard.");
  }
  auto self = shared_from_this();
  TensorList inputs(saved_inputs.size()), outputs(saved_outputs.size());
  for (size_t i = 0; i < saved_inputs.size(); ++i) inputs[i] = saved_inputs[i].unpack(self);
  for (size_t i = 0; i < saved_outputs.size(); ++i) outputs[i] = saved_outputs[i].unpack(self);
  // Outputs that received no gradient contribute zeros (grad_defined tells formulas which).
  std::vector<bool> grad_defined(grads.size());
  for (size_t i = 0; i < grads.size(); ++i) {
    grad_defined[i] = grads[i].defined();
    if (!grads[i].defined() && differentiable(output_shapes[i].dtype))
      grads[i] = zeros(output_shapes[i].sizes, TensorOptions(output_shapes[i].dtype, output_shapes[i].device));
  }
  std::vector<InputInfo> info(num_inputs);
  std::vector<bool> needs(num_inputs);
  for (size_t i = 0; i < num_inputs; ++i) {
    info[i] = {input_shapes[i].sizes, input_shapes[i].dtype, input_shapes[i].device, input_defined[i]};
    needs[i] = next_edges[i].valid();
  }
  BackwardContext ctx;
  ctx.op = op;
  ctx.attrs = attrs;
  ctx.grads = grads;
  ctx.inputs = inputs;
  ctx.outputs = outputs;
  ctx.input_info = info;
  ctx.needs_input_grad = needs;
  ctx.grad_defined = std::move(grad_defined);
  TensorList result = d.fn(ctx);
  result.resize(next_edges.size());
  for (size_t i = 0; i < result.size(); ++i) {
    if (i >= num_inputs) {  // an overwritten target's old value: zeros_like(grad), as PyTorch's copy_/fill_
      const TensorShape& s = input_shapes[i];
      result[i] = next_edges[i].valid() ? zeros(s.sizes, TensorOptions(s.dtype, s.device)) : Tensor();
      continue;
    }
    if (!needs[i] || !result[i].defined()) {
      result[i] = Tensor();
      continue;
    }
    // Formulas return gradients shaped like their input; broadcast ones are reduced here.
    if (!(result[i].sizes() == IntArrayRef(input_shapes[i].sizes)))
      result[i] = sum_to(result[i], input_shapes[i].sizes);
    if (result[i].dtype() != input_shapes[i].dtype) result[i] = result[i].to(input_shapes[i].dtype);
  }
  return result;
}

// ---- AccumulateGrad ----

TensorList AccumulateGrad::apply(TensorList&& grads) {
  Tensor g = grads[0];
  if (!g.defined()) return {};
  Tensor leaf_t(leaf);
  AutogradMeta& m = meta(leaf_t);
  std::vector<std::function<void(const Tensor&)>> post_hooks;
  {
    std::lock_guard lock(m.mutex);
    accumulate_locked(m, leaf_t, g);
    post_hooks = m.post_accumulate_hooks;
  }
  for (auto& hook : post_hooks) hook(leaf_t);  // outside the lock: hooks read .grad()
  return {};
}

void AccumulateGrad::accumulate_locked(AutogradMeta& m, const Tensor& leaf_t, const Tensor& g) {
  if (!m.grad.defined()) {
    // Own the memory unless the graph is being kept (create_graph): a later in-place
    // accumulation must not write into a tensor the graph still uses. The gradient takes the
    // leaf's memory format (PyTorch's layout contract): a channels-last parameter gets a
    // channels-last .grad().
    const MemoryFormat format = leaf_t.suggest_memory_format();
    m.grad = is_grad_enabled() ? g
                               : (g.is_contiguous(format) && g.impl().storage.use_count() == 1 ? g : g.clone(format));
  } else if (is_grad_enabled()) {
    m.grad = m.grad + g;
  } else {
    m.grad.add_(g);
  }
}

void register_post_accumulate_hook(const Tensor& leaf, std::function<void(const Tensor&)> hook) {
  KILN_CHECK(leaf.requires_grad() && leaf.is_leaf(), Error,
             "[kiln::autograd] only a leaf that requires grad accumulates a gradient; hook a parameter.");
  AutogradMeta& m = meta(leaf);
  std::lock_guard lock(m.mutex);
  m.post_accumulate_hooks.push_back(std::move(hook));
}

// ---- recording ----

bool recording(std::span<const Tensor> inputs) {
  if (!is_grad_enabled()) return false;
  for (const Tensor& t : inputs)
    if (t.defined() && t.impl().requires_grad) return true;
  return false;
}

std::vector<OverwrittenValue> overwritten_history(std::span<const Tensor> inputs, std::span<const Tensor> outputs) {
  std::vector<OverwrittenValue> out;
  for (const Tensor& t : outputs) {
    AutogradMeta* m = meta_if_exists(t);
    if (!t.requires_grad() || !m || !m->grad_fn) continue;  // no history (leaves are refused earlier)
    bool read = false;
    for (const Tensor& in : inputs) read = read || (in.defined() && &in.impl() == &t.impl());
    if (read) continue;  // add_, mul_, ...: the op's own derivative gives self its gradient
    out.push_back({Edge{m->grad_fn, m->output_nr}, shape_of(t)});
  }
  return out;
}

void record(const OpDef& op, std::span<const Tensor> inputs, std::span<const Attr> attrs,
            std::span<Tensor> outputs, std::span<const OverwrittenValue> overwritten) {
  bool any_differentiable = false;
  for (const Tensor& o : outputs) any_differentiable |= differentiable(o.dtype());
  if (!any_differentiable) return;

  auto node = std::make_shared<OpNode>();
  node->op = &op;
  node->sequence_nr = next_sequence_nr();
  node->attrs.assign(attrs.begin(), attrs.end());
  const size_t edges = inputs.size() + overwritten.size();
  node->num_inputs = inputs.size();
  node->next_edges.resize(edges);
  node->input_shapes.resize(edges);
  node->input_defined.resize(edges);
  for (size_t i = 0; i < inputs.size(); ++i) {
    node->input_defined[i] = inputs[i].defined();
    if (!inputs[i].defined()) continue;
    node->input_shapes[i] = shape_of(inputs[i]);
    if (differentiable(inputs[i].dtype())) node->next_edges[i] = gradient_edge(inputs[i]);
  }
  for (size_t k = 0; k < overwritten.size(); ++k) {
    const size_t i = inputs.size() + k;
    node->next_edges[i] = overwritten[k].edge;
    node->input_shapes[i] = overwritten[k].shape;
    node->input_defined[i] = true;
  }
  const Derivative& d = op.derivative;
  node->saved_inputs.resize(inputs.size());
  for (int i : d.save_inputs)
    if (i < static_cast<int>(inputs.size())) node->saved_inputs[i] = SavedTensor(inputs[i], false);

  node->output_shapes.reserve(outputs.size());
  node->pre_hooks.resize(outputs.size());
  node->retained.resize(outputs.size());
  for (size_t j = 0; j < outputs.size(); ++j) {
    Tensor& o = outputs[j];
    node->output_shapes.push_back(shape_of(o));
    if (!differentiable(o.dtype())) continue;
    o.impl().requires_grad = true;
    AutogradMeta& m = meta(o);
    m.grad_fn = node;
    m.output_nr = static_cast<uint32_t>(j);
    if (op.kind == OpKind::view) m.is_view_of_grad_tensor = true;
  }
  node->saved_outputs.resize(outputs.size());
  for (int j : d.save_outputs)
    if (j < static_cast<int>(outputs.size())) node->saved_outputs[j] = SavedTensor(outputs[j], true);
}

std::vector<Tensor> prepare_inplace(const OpDef& op, std::span<const Tensor> inputs,
                                    std::span<const Tensor> outputs) {
  for (const Tensor& out : outputs) {
    AutogradMeta* m = meta_if_exists(out);
    if (out.requires_grad() && (!m || !m->grad_fn)) {
      throw Error("[kiln::" + op.name + "_] a leaf tensor that requires grad is being used in an in-place "
                  "operation. Wrap the update in NoGradGuard (as optimizers do), or clone the tensor first.");
    }
    if (m && m->is_view_of_grad_tensor) {
      throw Error("[kiln::" + op.name + "_] in-place modification of a view of a tensor that requires grad "
                  "is not supported. Use the out-of-place op (e.g. `y = x.clone(); ...`) instead.");
    }
  }
  std::vector<Tensor> saved(inputs.begin(), inputs.end());
  for (int i : op.derivative.save_inputs) {
    if (i >= static_cast<int>(saved.size()) || !saved[i].defined()) continue;
    for (const Tensor& out : outputs)
      if (detail::may_overlap(saved[i], out)) saved[i] = saved[i].clone();
  }
  return saved;
}

InplaceRecording begin_inplace_recording(const OpDef& op, std::span<const Tensor> inputs,
                                         std::span<const Tensor> outputs) {
  InplaceRecording r;
  r.record = recording(inputs);
  if (!r.record && is_grad_enabled())
    for (const Tensor& out : outputs) r.record |= out.requires_grad();
  if (r.record) {
    r.node_inputs = prepare_inplace(op, inputs, outputs);  // may clone inputs that alias a target
    r.overwritten = overwritten_history(inputs, outputs);  // before record() replaces grad_fn
  }
  return r;
}

namespace {

// The dispatcher's calls into autograd (core/layer_hooks.h), installed when the library loads.
[[maybe_unused]] const bool g_autograd_hooks_installed = [] {
  kiln::detail::AutogradHooks& h = kiln::detail::autograd_hooks;
  h.recording = recording;
  h.record = [](const OpDef& op, std::span<const Tensor> inputs, std::span<const Attr> attrs,
                std::span<Tensor> outputs) { record(op, inputs, attrs, outputs); };
  h.begin_inplace = [](const OpDef& op, std::span<const Tensor> inputs,
                       std::span<const Tensor> outputs) -> std::shared_ptr<void> {
    InplaceRecording r = begin_inplace_recording(op, inputs, outputs);
    if (!r.record) return nullptr;
    return std::make_shared<InplaceRecording>(std::move(r));
  };
  h.finish_inplace = [](const std::shared_ptr<void>& state, const OpDef& op, std::span<const Attr> attrs,
                        std::span<Tensor> outputs) {
    const auto& r = *static_cast<const InplaceRecording*>(state.get());
    record(op, r.node_inputs, attrs, outputs, r.overwritten);
  };
  h.ensure_meta = [](const Tensor& t) { meta(t); };
  return true;
}();

}  // namespace

Tensor sum_to(const Tensor& grad, IntArrayRef sizes) {
  if (grad.sizes() == sizes) return grad;
  int64_t lead = grad.dim() - static_cast<int64_t>(sizes.size());
  std::vector<int64_t> dims;
  for (int64_t d = 0; d < grad.dim(); ++d) {
    if (d < lead) dims.push_back(d);
    else if (sizes[d - lead] == 1 && grad.size(d) != 1) dims.push_back(d);
  }
  Tensor r = dims.empty() ? grad : sum(grad, dims, /*keepdim=*/true);
  return r.reshape(sizes);
}

}  // namespace kiln::autograd
