// torch.optim.lr_scheduler: StepLR, CosineAnnealingLR, LinearLR with PyTorch's recursive
// (chainable) get_lr forms, so the values match PyTorch's step by step.
#include <cmath>
#include <numbers>

#include "kiln/ops.h"
#include "kiln/optim.h"
#include "optim/util.h"

namespace kiln::optim {

namespace {

// Python's a % b for b > 0 (never negative).
int64_t python_mod(int64_t a, int64_t b) {
  int64_t r = a % b;
  return r < 0 ? r + b : r;
}

}  // namespace

// ---------------- LRScheduler ----------------

LRScheduler::LRScheduler(Optimizer& optimizer) : optimizer_(optimizer) {
  // Like PyTorch's group.setdefault('initial_lr', group['lr']): the first scheduler fixes the base.
  for (size_t g = 0; g < optimizer_.num_param_groups(); ++g) {
    if (!optimizer_.initial_lr(g)) optimizer_.set_initial_lr(g, optimizer_.lr(g));
    base_lrs_.push_back(*optimizer_.initial_lr(g));
  }
}

std::vector<double> LRScheduler::current_lrs() const {
  std::vector<double> lrs(optimizer_.num_param_groups());
  for (size_t g = 0; g < lrs.size(); ++g) lrs[g] = optimizer_.lr(g);
  return lrs;
}

void LRScheduler::step() {
  KILN_CHECK(optimizer_.num_param_groups() == base_lrs_.size(), ValueError,
             "[kiln::optim::LRScheduler::step] the optimizer has " +
                 std::to_string(optimizer_.num_param_groups()) +
                 " parameter groups but the scheduler was created for " +
                 std::to_string(base_lrs_.size()) +
                 ". Create the scheduler after adding every parameter group.");
  ++last_epoch_;
  std::vector<double> lrs = get_lr();
  for (size_t g = 0; g < lrs.size(); ++g) optimizer_.set_lr(g, lrs[g]);
  last_lr_ = current_lrs();
}

NamedTensors LRScheduler::state_dict() const {
  return {{"last_epoch", scalar_tensor(last_epoch_, kInt64)},
          {"base_lrs", tensor<double>(base_lrs_)},
          {"last_lr", tensor<double>(last_lr_)}};
}

void LRScheduler::load_state_dict(const NamedTensors& state_dict) {
  constexpr const char* kWho = "[kiln::optim::LRScheduler::load_state_dict] ";
  Tensor last_epoch, base_lrs, last_lr;
  for (const auto& [name, value] : state_dict) {
    Tensor* slot = name == "last_epoch" ? &last_epoch
                   : name == "base_lrs" ? &base_lrs
                   : name == "last_lr"  ? &last_lr
                                        : nullptr;
    KILN_CHECK(slot != nullptr, ValueError,
               std::string(kWho) + "unexpected key '" + name +
                   "'. Expected last_epoch, base_lrs and last_lr.");
    KILN_CHECK(value.defined(), ValueError,
               std::string(kWho) + "entry '" + name + "' is an undefined tensor.");
    *slot = value;
  }
  KILN_CHECK(last_epoch.defined() && base_lrs.defined() && last_lr.defined(), ValueError,
             std::string(kWho) + "the state dict must hold last_epoch, base_lrs and last_lr.");
  KILN_CHECK(last_epoch.dim() == 0, ValueError,
             std::string(kWho) + "last_epoch must be a 0-dim tensor.");
  const int64_t groups = static_cast<int64_t>(optimizer_.num_param_groups());
  for (const Tensor* lrs : {&base_lrs, &last_lr})
    KILN_CHECK(lrs->dim() == 1 && lrs->numel() == groups, ValueError,
               std::string(kWho) +
                   "base_lrs and last_lr must be 1-D with one value per parameter group (" +
                   std::to_string(groups) + "), got shape " + shape_str(lrs->sizes()) + ".");
  last_epoch_ = last_epoch.item<int64_t>();
  base_lrs_ = base_lrs.to_vector<double>();
  last_lr_ = last_lr.to_vector<double>();
}

// ---------------- StepLR ----------------

StepLR::StepLR(Optimizer& optimizer, int64_t step_size, double gamma)
    : LRScheduler(optimizer), step_size_(step_size), gamma_(gamma) {
  KILN_CHECK(step_size >= 1, ValueError,
             "[kiln::optim::StepLR] step_size must be a positive integer, got " +
                 std::to_string(step_size) + ".");
  initial_step();
}

std::vector<double> StepLR::get_lr() const {
  std::vector<double> lrs = current_lrs();
  if (last_epoch_ == 0 || last_epoch_ % step_size_ != 0) return lrs;
  for (double& lr : lrs) lr *= gamma_;
  return lrs;
}

// ---------------- CosineAnnealingLR ----------------

CosineAnnealingLR::CosineAnnealingLR(Optimizer& optimizer, int64_t T_max, double eta_min)
    : LRScheduler(optimizer), T_max_(T_max), eta_min_(eta_min) {
  KILN_CHECK(T_max >= 1, ValueError,
             "[kiln::optim::CosineAnnealingLR] T_max must be a positive integer, got " +
                 std::to_string(T_max) + ".");
  initial_step();
}

std::vector<double> CosineAnnealingLR::get_lr() const {
  constexpr double pi = std::numbers::pi;
  std::vector<double> lrs = current_lrs();
  if (last_epoch_ == 0) return lrs;
  const double e = static_cast<double>(last_epoch_), T = static_cast<double>(T_max_);
  if (python_mod(last_epoch_ - 1 - T_max_, 2 * T_max_) == 0) {
    for (size_t g = 0; g < lrs.size(); ++g)
      lrs[g] += (base_lrs_[g] - eta_min_) * (1 - std::cos(pi / T)) / 2;
    return lrs;
  }
  const double ratio = (1 + std::cos(pi * e / T)) / (1 + std::cos(pi * (e - 1) / T));
  for (double& lr : lrs) lr = ratio * (lr - eta_min_) + eta_min_;
  return lrs;
}

// ---------------- LinearLR ----------------

LinearLR::LinearLR(Optimizer& optimizer, double start_factor, double end_factor,
                   int64_t total_iters)
    : LRScheduler(optimizer),
      start_factor_(start_factor),
      end_factor_(end_factor),
      total_iters_(total_iters) {
  KILN_CHECK(start_factor > 0.0 && start_factor <= 1.0, ValueError,
             "[kiln::optim::LinearLR] Starting multiplicative factor expected to be greater than 0 "
             "and less or equal "
             "to 1, got " +
                 python_float(start_factor) + ".");
  KILN_CHECK(
      end_factor >= 0.0 && end_factor <= 1.0, ValueError,
      "[kiln::optim::LinearLR] Ending multiplicative factor expected to be between 0 and 1, got " +
          python_float(end_factor) + ".");
  initial_step();
}

std::vector<double> LinearLR::get_lr() const {
  std::vector<double> lrs = current_lrs();
  if (last_epoch_ == 0) {
    for (double& lr : lrs) lr *= start_factor_;
    return lrs;
  }
  if (last_epoch_ > total_iters_) return lrs;
  const double factor =
      1.0 + (end_factor_ - start_factor_) /
                (static_cast<double>(total_iters_) * start_factor_ +
                 static_cast<double>(last_epoch_ - 1) * (end_factor_ - start_factor_));
  for (double& lr : lrs) lr *= factor;
  return lrs;
}

}  // namespace kiln::optim
