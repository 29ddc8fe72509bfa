// torch.optim.SGD: the update of _single_tensor_sgd, in Kiln's in-place ops.
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

void SGD::step() {
  NoGradGuard no_grad;
  for (auto& group : groups_) {
    const SGDOptions o = group.options;
    for (Tensor param : group.params) {
      const Tensor grad = param.grad();
      if (!grad.defined()) continue;
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
        ParamState& state = mutable_state(param);
        auto it = state.find("momentum_buffer");
        Tensor buf;
        if (it == state.end()) {  // first step: buf = g (a copy unless d is ours and not reused)
          buf = owned && !o.nesterov ? d : d.clone();
          state.emplace("momentum_buffer", buf);
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
  }
}

}  // namespace kiln::optim
