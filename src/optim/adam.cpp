// torch.optim.Adam and AdamW. The parameters whose tensors are dense take the fused update
// (kernels/fused_optim.h: one _fused_adam_ call for all of them, a few kernels, like PyTorch's
// fused=True; compile() captures it as one node); the rest take the update of _single_tensor_adam
// in Kiln's in-place ops, with the bias corrections computed as tensors from the step tensor (no
// host read, so that a captured step needs no graph break either way).
#include <utility>

#include "kernels/fused_optim.h"
#include "kiln/autograd.h"
#include "kiln/ops.h"
#include "kiln/optim.h"
#include "optim/util.h"

namespace kiln::optim {

namespace {

struct AdamConfig {
  double lr, beta1, beta2, eps, weight_decay;
  bool amsgrad, maximize, decoupled_weight_decay;
};

template <class Options>
AdamConfig config_of(const Options& o, bool decoupled) {
  return {o.lr, o.betas[0], o.betas[1], o.eps, o.weight_decay, o.amsgrad, o.maximize, decoupled};
}

template <class Options>
void validate_adam(const Options& o, const char* who) {
  const std::string prefix = std::string("[kiln::optim::") + who + "] ";
  KILN_CHECK(o.lr >= 0.0, ValueError,
             prefix + "Invalid learning rate: " + python_float(o.lr) + ". It must be >= 0.");
  KILN_CHECK(o.eps >= 0.0, ValueError,
             prefix + "Invalid epsilon value: " + python_float(o.eps) + ". It must be >= 0.");
  for (int i = 0; i < 2; ++i)
    KILN_CHECK(o.betas[i] >= 0.0 && o.betas[i] < 1.0, ValueError,
               prefix + "Invalid beta parameter at index " + std::to_string(i) + ": " +
                   python_float(o.betas[i]) + ". Betas must be in [0, 1).");
  KILN_CHECK(o.weight_decay >= 0.0, ValueError,
             prefix + "Invalid weight_decay value: " + python_float(o.weight_decay) +
                 ". It must be >= 0.");
}

void check_adam_state(const ParamState& state, const Tensor& param, const std::string& where) {
  check_state_names(state, {"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"}, where);
  if (state.empty()) return;
  for (const char* name : {"step", "exp_avg", "exp_avg_sq"})
    KILN_CHECK(state.count(name), ValueError,
               "[kiln::optim::load_state_dict] '" + where + "' lacks '" + name +
                   "' (Adam keeps step, exp_avg and exp_avg_sq together).");
  const Tensor& step = state.at("step");
  KILN_CHECK(step.dim() == 0 && step.dtype() != kBool, ValueError,
             "[kiln::optim::load_state_dict] " + where +
                 ".step must be a 0-dim number tensor, got shape " + shape_str(step.sizes()) + ".");
  for (const char* name : {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"})
    check_state_tensor(state, name, param, where);
}

Tensor zeros_of(const Tensor& param) {
  return zeros(param.sizes(), TensorOptions(param.dtype(), param.device()));
}

// The state of a parameter's first step: zeros, and a float32 step counter on its device.
void init_adam_state(const Tensor& param, ParamState& state, bool amsgrad) {
  if (state.empty()) {
    state.emplace("step", zeros({}, TensorOptions(kFloat32, param.device())));
    state.emplace("exp_avg", zeros_of(param));
    state.emplace("exp_avg_sq", zeros_of(param));
  }
  if (amsgrad && !state.count("max_exp_avg_sq")) state.emplace("max_exp_avg_sq", zeros_of(param));
}

// One Adam update of `param`. Full-size temporaries: sqrt(v), plus one for maximize or L2 weight
// decay; everything else is in place or 0-dim.
void adam_update(Tensor param, const Tensor& grad, ParamState& state, const AdamConfig& c) {
  init_adam_state(param, state, c.amsgrad);
  Tensor step = state.at("step");
  Tensor exp_avg = state.at("exp_avg");
  Tensor exp_avg_sq = state.at("exp_avg_sq");
  step.add_(1);

  Tensor g = grad;
  bool owned = false;  // whether g is our temporary rather than the parameter's grad
  if (c.maximize) {
    g = neg(grad);
    owned = true;
  }
  if (c.weight_decay != 0.0) {
    if (c.decoupled_weight_decay)
      param.mul_(1.0 - c.lr * c.weight_decay);
    else if (owned)
      g.add_(param, c.weight_decay);
    else
      g = add(grad, param, c.weight_decay);
  }
  exp_avg.lerp_(g, 1.0 - c.beta1);
  exp_avg_sq.mul_(c.beta2).addcmul_(g, g, 1.0 - c.beta2);

  Tensor v = exp_avg_sq;
  if (c.amsgrad) {
    v = state.at("max_exp_avg_sq");
    v.maximum_(exp_avg_sq);
  }

  // PyTorch:  param -= lr / bc1 * exp_avg / (sqrt(v) / sqrt(bc2) + eps),  bc_i = 1 - beta_i^step.
  // Kiln:     param -= lr * exp_avg / (sqrt(v) * (bc1 / sqrt(bc2)) + eps * bc1),
  // the same value, but lr stays a host scalar and nothing divides by it (lr = 0, the end of a
  // cosine schedule, stays finite). The 0-dim bias corrections are computed in float64, like
  // PyTorch's host floats.
  Tensor step64 = step.to(kFloat64);
  Tensor bc1 = 1.0 - kiln::pow(c.beta1, step64);
  Tensor sqrt_bc2 = (1.0 - kiln::pow(c.beta2, step64)).sqrt_();
  Tensor scale = bc1 / sqrt_bc2;
  Tensor eps_term = bc1.mul_(c.eps);
  Tensor denom = kiln::sqrt(v).mul_(scale).add_(eps_term);
  param.addcdiv_(exp_avg, denom, -c.lr);
}

// The parameters of one group that take the fused update, in lists per device and dtype: one
// _fused_adam_ call each (kernels/fused_optim.h), which compile() captures as one node.
class FusedAdam {
 public:
  // Adds `param` when it and its grad and state are dense tensors of one floating dtype on a
  // device with a fused kernel, with a float32 step counter there; false leaves it to adam_update.
  bool add(const Tensor& param, const Tensor& grad, const ParamState& state, bool amsgrad) {
    if (!kiln::detail::fused_update_takes(kiln::detail::fused_adam_op(), param)) return false;
    auto like_param = [&](const Tensor& x) { return fusable_like(x, param); };
    const Tensor& step = state.at("step");
    if (!like_param(grad) || !like_param(state.at("exp_avg")) ||
        !like_param(state.at("exp_avg_sq")) || (amsgrad && !like_param(state.at("max_exp_avg_sq"))) ||
        step.dim() != 0 || step.dtype() != kFloat32 || step.device() != param.device())
      return false;
    Lists& l = lists_.of(param);
    l.params.push_back(param);
    l.grads.push_back(grad);
    l.exp_avgs.push_back(state.at("exp_avg"));
    l.exp_avg_sqs.push_back(state.at("exp_avg_sq"));
    if (amsgrad) l.max_exp_avg_sqs.push_back(state.at("max_exp_avg_sq"));
    l.steps.push_back(step);
    return true;
  }

  // One _fused_adam_ per device and dtype; the dispatcher counts its writes as the in-place ops
  // of the per-op form would.
  void run(const AdamConfig& c) {
    const kiln::detail::AdamHyper h{c.lr,      c.beta1,    c.beta2, c.eps, c.weight_decay,
                                    c.amsgrad, c.maximize, c.decoupled_weight_decay};
    for (auto& [key, l] : lists_)
      call_op(kiln::detail::fused_adam_op(),
              concatenated({&l.params, &l.grads, &l.exp_avgs, &l.exp_avg_sqs, &l.max_exp_avg_sqs, &l.steps}),
              h.attrs());
  }

 private:
  // What kernels/fused_optim.h's AdamLists reads, as lists to append to.
  struct Lists {
    std::vector<Tensor> params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps;
  };
  FusedBatches<Lists> lists_;
};

template <class Options, class StateOf>
void adam_step(std::vector<ParamGroup<Options>>& groups, bool decoupled, StateOf&& state_of) {
  NoGradGuard no_grad;
  for (size_t g = 0; g < groups.size(); ++g) {
    auto& group = groups[g];
    const AdamConfig c = config_of(group.options, decoupled);
    const FusedChoice choice = fused_choice(group.options.fused);
    FusedAdam batch;
    for (size_t i = 0; i < group.params.size(); ++i) {
      const Tensor& param = group.params[i];
      const Tensor grad = param.grad();
      if (!grad.defined()) continue;
      ParamState& state = state_of(param);
      init_adam_state(param, state, c.amsgrad);
      if (choice != FusedChoice::never && batch.add(param, grad, state, c.amsgrad)) continue;
      if (choice == FusedChoice::always)
        throw_not_fusable(decoupled ? "AdamW" : "Adam", g, i,
                          "(and its gradient, exp_avg and exp_avg_sq like it, with a 0-dim float32 step counter on its device)");
      adam_update(param, grad, state, c);
    }
    batch.run(c);
  }
}

}  // namespace

// ---------------- Adam ----------------

Adam::Adam(std::vector<Tensor> params, const AdamOptions& options) : OptimizerWithOptions(options) {
  std::vector<ParamGroup<AdamOptions>> groups;
  if (!params.empty()) groups.push_back({std::move(params), options});
  init(std::move(groups));
}

Adam::Adam(std::vector<ParamGroup<AdamOptions>> groups, const AdamOptions& defaults)
    : OptimizerWithOptions(defaults) {
  init(std::move(groups));
}

void Adam::validate(const AdamOptions& o) const {
  validate_adam(o, "Adam");
}

void Adam::check_param_state(const ParamState& state, const Tensor& param,
                             const std::string& where) const {
  check_adam_state(state, param, where);
}

void Adam::step() {
  adam_step(groups_, /*decoupled=*/false,
            [this](const Tensor& p) -> ParamState& { return mutable_state(p); });
}

// ---------------- AdamW ----------------

AdamW::AdamW(std::vector<Tensor> params, const AdamWOptions& options)
    : OptimizerWithOptions(options) {
  std::vector<ParamGroup<AdamWOptions>> groups;
  if (!params.empty()) groups.push_back({std::move(params), options});
  init(std::move(groups));
}

AdamW::AdamW(std::vector<ParamGroup<AdamWOptions>> groups, const AdamWOptions& defaults)
    : OptimizerWithOptions(defaults) {
  init(std::move(groups));
}

void AdamW::validate(const AdamWOptions& o) const {
  validate_adam(o, "AdamW");
}

void AdamW::check_param_state(const ParamState& state, const Tensor& param,
                              const std::string& where) const {
  check_adam_state(state, param, where);
}

void AdamW::step() {
  adam_step(groups_, /*decoupled=*/true,
            [this](const Tensor& p) -> ParamState& { return mutable_state(p); });
}

}  // namespace kiln::optim
