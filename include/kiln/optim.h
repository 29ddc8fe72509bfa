// Optimizers and learning-rate schedulers (torch.optim in C++).
//
//   optim::Adam opt(model->parameters(), {.lr = 1e-3});
//   optim::CosineAnnealingLR sched(opt, /*T_max=*/100);
//   for (...) { opt.zero_grad(); loss.backward(); opt.step(); sched.step(); }
//
// Update rules, defaults, validation messages and state_dict contents follow PyTorch. All
// optimizer state lives in tensors on the parameter's device (Adam's step count is a 0-dim
// float32 tensor, like PyTorch's state['step']), and step() reads no tensor value on the host,
// so a whole training step can be captured into one compiled graph. Hyperparameters (lr, betas,
// ...) are plain doubles in each parameter group's options; schedulers change them between
// steps. Semantics and examples: docs/optim.md.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "kiln/io.h"
#include "kiln/tensor.h"

namespace kiln::optim {

// ======================= options =======================

struct SGDOptions {
  double lr = 1e-3;
  double momentum = 0.0;
  double dampening = 0.0;
  double weight_decay = 0.0;  // L2 penalty added to the gradient
  bool nesterov = false;      // needs momentum > 0 and dampening == 0
  bool maximize = false;      // ascend instead of descend
  // The update's implementation, as PyTorch's `fused`: unset, the fused update (one _fused_*_ op
  // for all of a group's dense parameters of one device and dtype; docs/optim.md) for every
  // parameter that qualifies and the per-op update for the rest; false, the per-op update; true,
  // the fused update, and step() throws ValueError for a parameter that cannot take it.
  // KILN_FUSED_OPTIM=0 means false everywhere. Not part of state_dict().
  std::optional<bool> fused;
};

struct AdamOptions {
  double lr = 1e-3;
  std::array<double, 2> betas = {0.9, 0.999};  // each in [0, 1)
  double eps = 1e-8;
  double weight_decay = 0.0;  // L2 penalty added to the gradient
  bool amsgrad = false;       // keep the running maximum of the second moment
  bool maximize = false;
  std::optional<bool> fused;  // as SGDOptions::fused
};

struct AdamWOptions {
  double lr = 1e-3;
  std::array<double, 2> betas = {0.9, 0.999};
  double eps = 1e-8;
  double weight_decay = 1e-2;  // decoupled: param *= 1 - lr * weight_decay before the update
  bool amsgrad = false;
  bool maximize = false;
  std::optional<bool> fused;  // as SGDOptions::fused
};

// A parameter group: its parameters and their options (PyTorch's param_groups[i]).
template <class Options>
struct ParamGroup {
  std::vector<Tensor> params;
  Options options;
};

// The state of one parameter ("step", "exp_avg", "momentum_buffer", ...).
using ParamState = std::map<std::string, Tensor>;

// ======================= Optimizer =======================

// The base of every optimizer: parameter groups, per-parameter state, zero_grad and state_dict.
// Not copyable: it owns state keyed by its parameters' identity.
class Optimizer {
 public:
  virtual ~Optimizer() = default;
  Optimizer(const Optimizer&) = delete;
  Optimizer& operator=(const Optimizer&) = delete;

  // One update of every parameter whose grad() is defined (others are skipped), under
  // NoGradGuard. Reads no tensor on the host.
  virtual void step() = 0;

  // Clears the gradients: set_to_none drops them (grad() becomes undefined); otherwise they are
  // detached from any graph and filled with zeros in place.
  void zero_grad(bool set_to_none = true);

  virtual size_t num_param_groups() const = 0;
  // The parameters of group `group`, in order.
  virtual const std::vector<Tensor>& group_params(size_t group) const = 0;
  // The learning rate of group `group` (what schedulers read and write).
  virtual double lr(size_t group) const = 0;
  virtual void set_lr(size_t group, double lr) = 0;

  // The lr group `group` had when the first scheduler was attached (PyTorch's
  // group['initial_lr']); every scheduler uses it as its base lr, so chained schedulers share
  // one base. Unset until a scheduler sets it.
  std::optional<double> initial_lr(size_t group) const;
  void set_initial_lr(size_t group, double lr);

  // Every parameter, groups concatenated in order: the numbering state_dict uses.
  std::vector<Tensor> parameters() const;

  // The state of `param` (empty before its first update). Throws ValueError when `param` is not
  // a parameter of this optimizer. The tensors are the live state, not copies.
  const ParamState& state(const Tensor& param) const;

  // PyTorch's optimizer.state_dict() as named tensors, with parameters numbered by their order
  // in parameters():
  //   "state.<i>.<name>"          each state tensor of parameter i (live tensors, not copies)
  //   "param_groups.<g>.params"   int64 1-D tensor: the numbers of group g's parameters
  //   "param_groups.<g>.<option>" each option: 0-dim float64 (numbers), 0-dim bool (flags),
  //                               1-D float64 (betas); "initial_lr" too once a scheduler set it
  // It can be written with save_safetensors as is.
  NamedTensors state_dict() const;
  // Restores options and state from state_dict(), matching parameters by position within each
  // group (as PyTorch does); state tensors are copied (never aliased) to the parameter's device
  // and dtype ("step" to float32). Everything is validated before anything changes: a different
  // number of groups or of parameters in a group, an unknown or missing entry, an option of the
  // wrong shape or value, a state tensor of the wrong shape throw ValueError.
  void load_state_dict(const NamedTensors& state_dict);

 protected:
  Optimizer() = default;

  // Checks that `params` can join this optimizer (defined, floating-point, leaf, not already
  // in a group, no duplicates) and registers them.
  void register_params(const std::vector<Tensor>& params);
  ParamState& mutable_state(const Tensor& param) { return state_[param.unsafe_impl()]; }

  // Options of group `group` as named tensors, for state_dict.
  virtual NamedTensors group_options(size_t group) const = 0;
  // Parses and validates every group's options (one NamedTensors per group, names without the
  // "param_groups.<g>." prefix) and, only if all are valid, replaces the groups' options.
  virtual void load_group_options(const std::vector<NamedTensors>& options) = 0;
  // Validates the loaded state of one parameter (names and shapes); throws ValueError.
  virtual void check_param_state(const ParamState& state, const Tensor& param,
                                 const std::string& where) const = 0;

 private:
  std::unordered_map<const detail::TensorImpl*, ParamState> state_;
  std::unordered_set<const detail::TensorImpl*> registered_;
  std::map<size_t, double> initial_lrs_;
};

// An optimizer whose groups hold options of type Options. Instantiated for SGDOptions,
// AdamOptions and AdamWOptions.
template <class Options>
class OptimizerWithOptions : public Optimizer {
 public:
  // The groups; change their options (lr, momentum, ...) freely between steps, but add groups
  // with add_param_group only (it validates and registers the parameters).
  std::vector<ParamGroup<Options>>& param_groups() { return groups_; }
  const std::vector<ParamGroup<Options>>& param_groups() const { return groups_; }
  // The options given to the constructor, used by add_param_group(params).
  const Options& defaults() const { return defaults_; }

  // Adds a group (PyTorch's add_param_group). Its options are validated; its parameters must
  // not belong to another group.
  void add_param_group(ParamGroup<Options> group);
  void add_param_group(std::vector<Tensor> params) {
    add_param_group({std::move(params), defaults_});
  }

  size_t num_param_groups() const override { return groups_.size(); }
  const std::vector<Tensor>& group_params(size_t group) const override;
  double lr(size_t group) const override;
  void set_lr(size_t group, double lr) override;

 protected:
  explicit OptimizerWithOptions(const Options& defaults) : defaults_(defaults) {}
  // Validates both constructor forms; throws ValueError like PyTorch.
  void init(std::vector<ParamGroup<Options>> groups);
  // Throws ValueError for invalid options (PyTorch's messages).
  virtual void validate(const Options& options) const = 0;

  NamedTensors group_options(size_t group) const override;
  void load_group_options(const std::vector<NamedTensors>& options) override;

  std::vector<ParamGroup<Options>> groups_;
  Options defaults_;
};

extern template class OptimizerWithOptions<SGDOptions>;
extern template class OptimizerWithOptions<AdamOptions>;
extern template class OptimizerWithOptions<AdamWOptions>;

// Stochastic gradient descent with optional (Nesterov) momentum, torch.optim.SGD:
//   g = grad (negated if maximize) + weight_decay * param
//   buf = g on the first step, then buf = momentum * buf + (1 - dampening) * g
//   g = nesterov ? g + momentum * buf : buf        (when momentum != 0)
//   param -= lr * g
// State: "momentum_buffer" (only when momentum != 0).
class SGD : public OptimizerWithOptions<SGDOptions> {
 public:
  SGD(std::vector<Tensor> params, const SGDOptions& options = {});
  // Several groups; `defaults` serves later add_param_group(params) calls.
  SGD(std::vector<ParamGroup<SGDOptions>> groups, const SGDOptions& defaults = {});
  void step() override;

 protected:
  void validate(const SGDOptions& options) const override;
  void check_param_state(const ParamState& state, const Tensor& param,
                         const std::string& where) const override;
};

// Adam, torch.optim.Adam (the update of _single_tensor_adam, with tensor bias corrections):
//   step += 1;  g = grad (negated if maximize) + weight_decay * param
//   exp_avg.lerp_(g, 1 - beta1);  exp_avg_sq = beta2 * exp_avg_sq + (1 - beta2) * g * g
//   v = amsgrad ? (max_exp_avg_sq = max(max_exp_avg_sq, exp_avg_sq)) : exp_avg_sq
//   param -= lr / (1 - beta1^step) * exp_avg / (sqrt(v) / sqrt(1 - beta2^step) + eps)
// State: "step" (0-dim float32), "exp_avg", "exp_avg_sq", and "max_exp_avg_sq" with amsgrad.
class Adam : public OptimizerWithOptions<AdamOptions> {
 public:
  Adam(std::vector<Tensor> params, const AdamOptions& options = {});
  Adam(std::vector<ParamGroup<AdamOptions>> groups, const AdamOptions& defaults = {});
  void step() override;

 protected:
  void validate(const AdamOptions& options) const override;
  void check_param_state(const ParamState& state, const Tensor& param,
                         const std::string& where) const override;
};

// AdamW, torch.optim.AdamW: Adam with decoupled weight decay (param *= 1 - lr * weight_decay
// before the Adam update, instead of adding weight_decay * param to the gradient).
class AdamW : public OptimizerWithOptions<AdamWOptions> {
 public:
  AdamW(std::vector<Tensor> params, const AdamWOptions& options = {});
  AdamW(std::vector<ParamGroup<AdamWOptions>> groups, const AdamWOptions& defaults = {});
  void step() override;

 protected:
  void validate(const AdamWOptions& options) const override;
  void check_param_state(const ParamState& state, const Tensor& param,
                         const std::string& where) const override;
};

// ======================= learning-rate schedulers =======================

// The base of the schedulers (torch.optim.lr_scheduler.LRScheduler). Construction takes each
// group's initial_lr as its base lr (setting it to the current lr if no scheduler did before)
// and takes the initial step (epoch 0). Each step() advances the epoch
// and sets every group's lr with PyTorch's recursive (chainable) form, so schedulers compose
// with manual lr changes the way PyTorch's do. The optimizer must outlive the scheduler, and its
// number of groups must not change after the scheduler was created.
class LRScheduler {
 public:
  virtual ~LRScheduler() = default;
  LRScheduler(const LRScheduler&) = delete;
  LRScheduler& operator=(const LRScheduler&) = delete;

  void step();
  // The lr of every group as set by the latest step().
  const std::vector<double>& get_last_lr() const { return last_lr_; }
  const std::vector<double>& base_lrs() const { return base_lrs_; }
  int64_t last_epoch() const { return last_epoch_; }

  // "last_epoch" (0-dim int64), "base_lrs" and "last_lr" (1-D float64). Loading restores them
  // (and not the optimizer's lrs, which its own state_dict carries), so a resumed run continues
  // the schedule.
  NamedTensors state_dict() const;
  void load_state_dict(const NamedTensors& state_dict);

 protected:
  explicit LRScheduler(Optimizer& optimizer);
  // Derived constructors call this once their fields are set (get_lr is virtual).
  void initial_step() { step(); }
  // The lrs for epoch last_epoch_, from the groups' current lrs (PyTorch's get_lr).
  virtual std::vector<double> get_lr() const = 0;
  std::vector<double> current_lrs() const;

  Optimizer& optimizer_;
  int64_t last_epoch_ = -1;
  std::vector<double> base_lrs_;
  std::vector<double> last_lr_;
};

// Multiplies the lr by gamma every step_size epochs: lr = base_lr * gamma^(epoch / step_size).
class StepLR : public LRScheduler {
 public:
  StepLR(Optimizer& optimizer, int64_t step_size, double gamma = 0.1);

 protected:
  std::vector<double> get_lr() const override;

 private:
  int64_t step_size_;
  double gamma_;
};

// Cosine annealing from base_lr to eta_min over T_max epochs (and back, periodically):
// lr = eta_min + (base_lr - eta_min) * (1 + cos(pi * epoch / T_max)) / 2, computed with
// PyTorch's recursive form.
class CosineAnnealingLR : public LRScheduler {
 public:
  CosineAnnealingLR(Optimizer& optimizer, int64_t T_max, double eta_min = 0.0);

 protected:
  std::vector<double> get_lr() const override;

 private:
  int64_t T_max_;
  double eta_min_;
};

// Scales the lr linearly from start_factor * base_lr to end_factor * base_lr over total_iters
// epochs, then keeps it: lr = base_lr * (start + (end - start) * min(epoch, total_iters) /
// total_iters).
class LinearLR : public LRScheduler {
 public:
  LinearLR(Optimizer& optimizer, double start_factor = 1.0 / 3.0, double end_factor = 1.0,
           int64_t total_iters = 5);

 protected:
  std::vector<double> get_lr() const override;

 private:
  double start_factor_;
  double end_factor_;
  int64_t total_iters_;
};

}  // namespace kiln::optim
