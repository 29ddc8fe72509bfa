// torch.optim.SGD. The parameters whose tensors are dense take the fused update
// (kernels/fused_optim.h: one _fused_sgd_ call for all of them, a few kernels, like PyTorch's
// fused=True; compile() captures it as one node); the rest take the update of _single_tensor_sgd
// in Kiln's in-place ops.
#include <utility>

#include "kernels/fused_optim.h"
#include "kiln/autograd.h"
#include "kiln/ops.h"
#include "kiln/optim.h"
#include "optim/util.h"

namespace kiln::optim {

SGD::SGD(std::vector<Tensor> params, const SGDOptions& options) : OptimizerWithOptions(options) {
  std::vector<ParamGroup<SGDOptions>> groups;
  if (!params.empty()) groups.push_back({std::move(params), options});
  init(std::move(groups));
}

SGD::SGD(std::vector<ParamGroup<SGDOptions>> groups, const SGDOptions& defaults)
    : OptimizerWithOptions(defaults) {
  init(std::move(groups));
}

void SGD::validate(const SGDOptions& o) const {
  KILN_CHECK(
      o.lr >= 0.0, ValueError,
      "[kiln::optim::SGD] Invalid learning rate: " + python_float(o.lr) + ". It must be >= 0.");
  KILN_CHECK(o.momentum >= 0.0, ValueError,
             "[kiln::optim::SGD] Invalid momentum value: " + python_float(o.momentum) +
                 ". It must be >= 0.");
  KILN_CHECK(o.weight_decay >= 0.0, ValueError,
             "[kiln::optim::SGD] Invalid weight_decay value: " + python_float(o.weight_decay) +
                 ". It must be >= 0.");
  KILN_CHECK(!o.nesterov || (o.momentum > 0.0 && o.dampening == 0.0), ValueError,
             "[kiln::optim::SGD] Nesterov momentum requires a momentum and zero dampening. Set "
             "momentum > 0 and "
             "dampening = 0, or nesterov = false.");
}

void SGD::check_param_state(const ParamState& state, const Tensor& param,
                            const std::string& where) const {
  check_state_names(state, {"momentum_buffer"}, where);
  check_state_tensor(state, "momentum_buffer", param, where);
}

namespace {

// The per-op update of one parameter.
void sgd_update(Tensor param, const Tensor& grad, const SGDOptions& o, ParamState* state) {
  // `d` is the update direction; `owned` says it is our temporary (free to change in place)
  // rather than the parameter's grad.
  Tensor d = grad;
  bool owned = false;
  if (o.maximize) {
    d = neg(grad);
    owned = true;
  }
  if (o.weight_decay != 0.0) {
    if (owned)
      d.add_(param, o.weight_decay);
    else
      d = add(grad, param, o.weight_decay);
    owned = true;
  }
  if (o.momentum != 0.0) {
    auto it = state->find("momentum_buffer");
    Tensor buf;
    if (it == state->end()) {  // first step: buf = g (a copy unless d is ours and not reused)
      buf = owned && !o.nesterov ? d : d.clone();
      state->emplace("momentum_buffer", buf);
    } else {
      buf = it->second;
      buf.mul_(o.momentum).add_(d, 1.0 - o.dampening);
    }
    if (!o.nesterov)
      d = buf;
    else if (owned)
      d.add_(buf, o.momentum);
    else
      d = add(d, buf, o.momentum);
  }
  param.add_(d, -o.lr);
}

// The parameters of one group that take the fused update, in lists per device and dtype: one
// _fused_sgd_ call each (kernels/fused_optim.h), which compile() captures as one node.
class FusedSgd {
 public:
  // Adds `param` when it, its grad and its momentum buffer (if any) are dense tensors of one
  // floating dtype on a device with a fused kernel; a missing buffer is created here, marked
  // first (the kernel writes it before reading it). False leaves the parameter to sgd_update.
  bool add(const Tensor& param, const Tensor& grad, ParamState* state) {
    if (!kiln::detail::fused_update_takes(kiln::detail::fused_sgd_op(), param) || !fusable_like(grad, param))
      return false;
    Tensor buf;
    bool first = false;
    if (state) {
      auto it = state->find("momentum_buffer");
      if (it == state->end()) {
        buf = empty_like(param);
        first = true;
      } else {
        buf = it->second;
        if (!fusable_like(buf, param)) return false;
      }
    }
    Lists& l = lists_.of(param);
    l.params.push_back(param);
    l.grads.push_back(grad);
    if (state) {
      if (first) l.new_buffers.emplace_back(state, buf);
      l.momentum_buffers.push_back(buf);
      l.first.push_back(first ? 1 : 0);
    }
    return true;
  }

  // One _fused_sgd_ per device and dtype; the dispatcher counts its writes as the in-place ops of
  // the per-op form would. The new momentum buffers join the state only here, written: a step that
  // throws before (fused = true and a parameter that cannot take it) leaves no unwritten buffer.
  void run(const SGDOptions& o) {
    const kiln::detail::SgdHyper h{o.lr, o.momentum, o.dampening, o.weight_decay, o.nesterov, o.maximize};
    for (auto& [key, l] : lists_) {
      call_op(kiln::detail::fused_sgd_op(), concatenated({&l.params, &l.grads, &l.momentum_buffers}),
              h.attrs(l.first));
      for (auto& [state, buf] : l.new_buffers) state->emplace("momentum_buffer", buf);
    }
  }

 private:
  // What kernels/fused_optim.h's SgdLists reads, as lists to append to.
  struct Lists {
    std::vector<Tensor> params, grads, momentum_buffers;
    std::vector<int64_t> first;
    std::vector<std::pair<ParamState*, Tensor>> new_buffers;  // the momentum buffers this step starts
  };
  FusedBatches<Lists> lists_;
};

}  // namespace

void SGD::step() {
  NoGradGuard no_grad;
  for (size_t g = 0; g < groups_.size(); ++g) {
    const SGDOptions o = groups_[g].options;
    const FusedChoice choice = fused_choice(o.fused);
    FusedSgd batch;
    for (size_t i = 0; i < groups_[g].params.size(); ++i) {
      const Tensor& param = groups_[g].params[i];
      const Tensor grad = param.grad();
      if (!grad.defined()) continue;
      ParamState* state = o.momentum != 0.0 ? &mutable_state(param) : nullptr;
      if (choice != FusedChoice::never && batch.add(param, grad, state)) continue;
      if (choice == FusedChoice::always)
        throw_not_fusable("SGD", g, i, "(and its gradient and momentum buffer like it)");
      sgd_update(param, grad, o, state);
    }
    batch.run(o);
  }
}

}  // namespace kiln::optim
