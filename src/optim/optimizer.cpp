// The Optimizer base (groups, state, zero_grad, state_dict) and OptimizerWithOptions.
#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <concepts>
#include <cstdlib>
#include <cstring>
#include <set>

#include "core/layer_hooks.h"
#include "kiln/autograd.h"
#include "kiln/ops.h"
#include "kiln/optim.h"
#include "optim/util.h"

namespace kiln::optim {

namespace {

const std::string kLoad = "[kiln::optim::load_state_dict] ";

// The options of each optimizer, by name, in PyTorch's param_group order.
template <class F>
void visit_options(SGDOptions& o, F&& f) {
  f("lr", o.lr);
  f("momentum", o.momentum);
  f("dampening", o.dampening);
  f("weight_decay", o.weight_decay);
  f("nesterov", o.nesterov);
  f("maximize", o.maximize);
}
template <class Options, class F>
requires std::same_as<Options, AdamOptions> || std::same_as<Options, AdamWOptions>
void visit_options(Options& o, F&& f) {
  f("lr", o.lr);
  f("betas", o.betas);
  f("eps", o.eps);
  f("weight_decay", o.weight_decay);
  f("amsgrad", o.amsgrad);
  f("maximize", o.maximize);
}

Tensor option_to_tensor(double v) {
  return scalar_tensor(v, kFloat64);
}
Tensor option_to_tensor(bool v) {
  return scalar_tensor(v, kBool);
}
Tensor option_to_tensor(const std::array<double, 2>& v) {
  return tensor<double>({v[0], v[1]});
}

void option_from_tensor(const Tensor& t, double& v, const std::string& name) {
  KILN_CHECK(t.dim() == 0, ValueError,
             kLoad + name + " must be a 0-dim tensor, got shape " + shape_str(t.sizes()) + ".");
  v = t.item<double>();
}
void option_from_tensor(const Tensor& t, bool& v, const std::string& name) {
  KILN_CHECK(t.dim() == 0, ValueError,
             kLoad + name + " must be a 0-dim tensor, got shape " + shape_str(t.sizes()) + ".");
  v = t.item<bool>();
}
void option_from_tensor(const Tensor& t, std::array<double, 2>& v, const std::string& name) {
  KILN_CHECK(
      t.dim() == 1 && t.numel() == 2, ValueError,
      kLoad + name + " must be a 1-D tensor of 2 values, got shape " + shape_str(t.sizes()) + ".");
  auto values = t.to_vector<double>();
  v = {values[0], values[1]};
}

// Parses the decimal number at the start of `s` (advancing it); false when there is none.
bool parse_index(std::string_view& s, int64_t& out) {
  size_t n = 0;
  out = 0;
  while (n < s.size() && std::isdigit(static_cast<unsigned char>(s[n])) && n < 18)
    out = out * 10 + (s[n++] - '0');
  if (n == 0) return false;
  s.remove_prefix(n);
  return true;
}

}  // namespace

// ======================= Optimizer =======================

void Optimizer::zero_grad(bool set_to_none) {
  NoGradGuard no_grad;
  for (size_t g = 0; g < num_param_groups(); ++g) {
    for (const Tensor& param : group_params(g)) {
      Tensor grad = param.grad();
      if (!grad.defined()) continue;
      if (set_to_none) {
        param.set_grad(Tensor());
        continue;
      }
      if (grad.requires_grad()) {  // a create_graph backward left a graph behind the grad
        grad = grad.detach();
        param.set_grad(grad);
      }
      grad.zero_();
    }
  }
}

std::vector<Tensor> Optimizer::parameters() const {
  std::vector<Tensor> all;
  for (size_t g = 0; g < num_param_groups(); ++g) {
    const auto& params = group_params(g);
    all.insert(all.end(), params.begin(), params.end());
  }
  return all;
}

std::optional<double> Optimizer::initial_lr(size_t group) const {
  group_params(group);  // range check
  auto it = initial_lrs_.find(group);
  return it == initial_lrs_.end() ? std::nullopt : std::optional<double>(it->second);
}

void Optimizer::set_initial_lr(size_t group, double lr) {
  group_params(group);
  initial_lrs_[group] = lr;
}

const ParamState& Optimizer::state(const Tensor& param) const {
  static const ParamState kEmpty;
  KILN_CHECK(param.defined() && registered_.count(param.unsafe_impl()), ValueError,
             "[kiln::optim::state] the tensor is not a parameter of this optimizer. Pass one of "
             "optimizer.parameters().");
  auto it = state_.find(param.unsafe_impl());
  return it == state_.end() ? kEmpty : it->second;
}

void Optimizer::register_params(const std::vector<Tensor>& params) {
  std::unordered_set<const detail::TensorImpl*> seen;
  for (size_t i = 0; i < params.size(); ++i) {
    const Tensor& p = params[i];
    const std::string which = "parameter " + std::to_string(i);
    KILN_CHECK(p.defined(), ValueError,
               "[kiln::optim] optimizer can only optimize defined Tensors, but " + which +
                   " is undefined. Pass the model's parameters.");
    KILN_CHECK(p.is_floating_point(), DTypeError,
               "[kiln::optim] optimizer can only optimize floating-point Tensors, but " + which +
                   " has dtype " + std::string(dtype_name(p.dtype())) + ".");
    KILN_CHECK(p.is_leaf(), ValueError,
               "[kiln::optim] can't optimize a non-leaf Tensor (" + which +
                   "). Pass leaf tensors, e.g. x.detach().requires_grad_().");
    KILN_CHECK(seen.insert(p.unsafe_impl()).second, ValueError,
               "[kiln::optim] optimizer contains a parameter group with duplicate parameters (" +
                   which + "). Pass each parameter once.");
    KILN_CHECK(!registered_.count(p.unsafe_impl()), ValueError,
               "[kiln::optim] some parameters appear in more than one parameter group (" + which +
                   "). Put each parameter in one group only.");
  }
  registered_.insert(seen.begin(), seen.end());
}

NamedTensors Optimizer::state_dict() const {
  NamedTensors out;
  std::vector<Tensor> params = parameters();
  for (size_t i = 0; i < params.size(); ++i) {
    auto it = state_.find(params[i].unsafe_impl());
    if (it == state_.end()) continue;
    for (const auto& [name, value] : it->second)
      out.emplace_back("state." + std::to_string(i) + "." + name, value);
  }
  int64_t index = 0;
  for (size_t g = 0; g < num_param_groups(); ++g) {
    const std::string prefix = "param_groups." + std::to_string(g) + ".";
    std::vector<int64_t> ids(group_params(g).size());
    for (auto& id : ids) id = index++;
    out.emplace_back(prefix + "params", tensor<int64_t>(ids));
    for (auto& [name, value] : group_options(g)) out.emplace_back(prefix + name, std::move(value));
    if (auto it = initial_lrs_.find(g); it != initial_lrs_.end())
      out.emplace_back(prefix + "initial_lr", scalar_tensor(it->second, kFloat64));
  }
  return out;
}

void Optimizer::load_state_dict(const NamedTensors& state_dict) {
  NoGradGuard no_grad;
  // 1. Split the entries into group options, group parameter ids and per-id state.
  std::map<int64_t, NamedTensors> group_entries;
  std::map<int64_t, Tensor> group_ids;
  std::map<int64_t, ParamState> saved_state;
  for (const auto& [name, value] : state_dict) {
    KILN_CHECK(value.defined(), ValueError, kLoad + "entry '" + name + "' is an undefined tensor.");
    std::string_view rest = name;
    int64_t index = 0;
    if (rest.starts_with("param_groups.")) {
      rest.remove_prefix(13);
      KILN_CHECK(
          parse_index(rest, index) && rest.size() > 1 && rest[0] == '.', ValueError,
          kLoad + "unexpected key '" + name + "'. Expected 'param_groups.<group>.<option>'.");
      rest.remove_prefix(1);
      if (rest == "params")
        group_ids[index] = value;
      else
        group_entries[index].emplace_back(std::string(rest), value);
    } else if (rest.starts_with("state.")) {
      rest.remove_prefix(6);
      KILN_CHECK(parse_index(rest, index) && rest.size() > 1 && rest[0] == '.', ValueError,
                 kLoad + "unexpected key '" + name + "'. Expected 'state.<parameter>.<name>'.");
      rest.remove_prefix(1);
      KILN_CHECK(saved_state[index].emplace(std::string(rest), value).second, ValueError,
                 kLoad + "duplicate key '" + name + "'.");
    } else {
      KILN_CHECK(
          false, ValueError,
          kLoad + "unexpected key '" + name + "'. Pass the result of an optimizer's state_dict().");
    }
  }

  // 2. Groups: same count, same sizes; map saved parameter ids to this optimizer's parameters.
  const size_t num_groups = num_param_groups();
  std::set<int64_t> saved_groups;
  for (const auto& [g, _] : group_entries) saved_groups.insert(g);
  for (const auto& [g, _] : group_ids) saved_groups.insert(g);
  KILN_CHECK(saved_groups.size() == num_groups &&
                 (num_groups == 0 || *saved_groups.rbegin() == int64_t(num_groups) - 1),
             ValueError,
             kLoad + "loaded state dict has a different number of parameter groups (" +
                 std::to_string(saved_groups.size()) + " saved, the optimizer has " +
                 std::to_string(num_groups) +
                 "). Load a state dict saved from an optimizer built the same way.");
  std::map<int64_t, Tensor> param_of_id;
  std::map<size_t, double> new_initial_lrs;
  std::vector<NamedTensors> options(num_groups);
  for (size_t g = 0; g < num_groups; ++g) {
    const std::string prefix = "param_groups." + std::to_string(g) + ".";
    auto ids_it = group_ids.find(int64_t(g));
    KILN_CHECK(ids_it != group_ids.end(), ValueError, kLoad + "missing '" + prefix + "params'.");
    const Tensor& ids = ids_it->second;
    KILN_CHECK(ids.dim() == 1 && !ids.is_floating_point() && ids.dtype() != kBool, ValueError,
               kLoad + prefix + "params must be a 1-D integer tensor of parameter numbers.");
    const auto& params = group_params(g);
    KILN_CHECK(ids.numel() == int64_t(params.size()), ValueError,
               kLoad +
                   "loaded state dict contains a parameter group that doesn't match the size of "
                   "optimizer's group (group " +
                   std::to_string(g) + ": " + std::to_string(ids.numel()) +
                   " saved parameters, the optimizer has " + std::to_string(params.size()) + ").");
    auto id_values = ids.to_vector<int64_t>();
    for (size_t i = 0; i < params.size(); ++i)
      KILN_CHECK(param_of_id.emplace(id_values[i], params[i]).second, ValueError,
                 kLoad + "parameter number " + std::to_string(id_values[i]) +
                     " appears twice in param_groups.");
    if (auto it = group_entries.find(int64_t(g)); it != group_entries.end())
      options[g] = std::move(it->second);
    auto initial = std::find_if(options[g].begin(), options[g].end(),
                                [](const auto& e) { return e.first == "initial_lr"; });
    if (initial != options[g].end()) {
      double lr = 0;
      option_from_tensor(initial->second, lr, prefix + "initial_lr");
      new_initial_lrs[g] = lr;
      options[g].erase(initial);
    }
  }

  // 3. State: validate and copy to each parameter's device (and dtype, except "step").
  std::unordered_map<const detail::TensorImpl*, ParamState> new_state;
  for (auto& [id, entries] : saved_state) {
    const std::string where = "state." + std::to_string(id);
    auto it = param_of_id.find(id);
    KILN_CHECK(it != param_of_id.end(), ValueError,
               kLoad + "'" + where + "' is the state of parameter " + std::to_string(id) +
                   ", which no parameter group lists.");
    const Tensor& param = it->second;
    check_param_state(entries, param, where);
    ParamState copied;
    for (const auto& [name, value] : entries) {
      DType dtype = name == "step" ? kFloat32 : param.dtype();
      copied.emplace(name, value.detach().to(param.device(), dtype, /*copy=*/true));
    }
    new_state.emplace(param.unsafe_impl(), std::move(copied));
  }

  // 4. Options (validated and replaced only when all are valid), then the state (no throw).
  load_group_options(options);
  state_ = std::move(new_state);
  initial_lrs_ = std::move(new_initial_lrs);
}

// ======================= OptimizerWithOptions =======================

template <class Options>
void OptimizerWithOptions<Options>::init(std::vector<ParamGroup<Options>> groups) {
  validate(defaults_);
  KILN_CHECK(
      !groups.empty(), ValueError,
      "[kiln::optim] optimizer got an empty parameter list. Pass the parameters to optimize, e.g. "
      "model->parameters().");
  bool any_param =
      std::any_of(groups.begin(), groups.end(), [](const auto& g) { return !g.params.empty(); });
  KILN_CHECK(
      any_param, ValueError,
      "[kiln::optim] optimizer got an empty parameter list. Pass the parameters to optimize, e.g. "
      "model->parameters().");
  for (auto& group : groups) add_param_group(std::move(group));
}

template <class Options>
void OptimizerWithOptions<Options>::add_param_group(ParamGroup<Options> group) {
  validate(group.options);
  register_params(group.params);
  groups_.push_back(std::move(group));
}

template <class Options>
const std::vector<Tensor>& OptimizerWithOptions<Options>::group_params(size_t group) const {
  KILN_CHECK(group < groups_.size(), IndexError,
             "[kiln::optim] parameter group " + std::to_string(group) +
                 " is out of range (the optimizer has " + std::to_string(groups_.size()) + ").");
  return groups_[group].params;
}

template <class Options>
double OptimizerWithOptions<Options>::lr(size_t group) const {
  group_params(group);  // range check
  return groups_[group].options.lr;
}

template <class Options>
void OptimizerWithOptions<Options>::set_lr(size_t group, double lr) {
  group_params(group);
  groups_[group].options.lr = lr;
}

template <class Options>
NamedTensors OptimizerWithOptions<Options>::group_options(size_t group) const {
  Options options = groups_.at(group).options;
  NamedTensors out;
  visit_options(options, [&](const char* name, const auto& value) {
    out.emplace_back(name, option_to_tensor(value));
  });
  return out;
}

template <class Options>
void OptimizerWithOptions<Options>::load_group_options(const std::vector<NamedTensors>& options) {
  std::vector<Options> parsed;
  for (size_t g = 0; g < options.size(); ++g) {
    const std::string prefix = "param_groups." + std::to_string(g) + ".";
    Options o = groups_.at(g).options;
    std::set<std::string> known;
    visit_options(o, [&](const char* name, auto&) { known.insert(name); });
    for (const auto& [name, _] : options[g])
      KILN_CHECK(known.count(name), ValueError,
                 kLoad + "unexpected key '" + prefix + name +
                     "': this optimizer has no such option. Load a state dict saved from the same "
                     "kind of optimizer.");
    visit_options(o, [&](const char* name, auto& value) {
      auto it = std::find_if(options[g].begin(), options[g].end(),
                             [&](const auto& e) { return e.first == name; });
      KILN_CHECK(it != options[g].end(), ValueError,
                 kLoad + "missing '" + prefix + name +
                     "'. Load a state dict saved from the same kind of optimizer.");
      option_from_tensor(it->second, value, prefix + name);
    });
    validate(o);
    parsed.push_back(o);
  }
  for (size_t g = 0; g < parsed.size(); ++g) groups_[g].options = parsed[g];
}

template class OptimizerWithOptions<SGDOptions>;
template class OptimizerWithOptions<AdamOptions>;
template class OptimizerWithOptions<AdamWOptions>;

// ======================= shared helpers (optim/util.h) =======================

FusedChoice fused_choice(const std::optional<bool>& fused) {
  static const bool enabled = [] {
    const char* v = std::getenv("KILN_FUSED_OPTIM");
    return !(v && std::strcmp(v, "0") == 0);
  }();
  if (!enabled || fused == false) return FusedChoice::never;
  return fused == true ? FusedChoice::always : FusedChoice::where_possible;
}

void throw_not_fusable(const char* who, size_t group, size_t index, const char* what) {
  throw ValueError(std::string("[kiln::optim::") + who + "] fused = true, but parameter " + std::to_string(index) +
                   " of group " + std::to_string(group) +
                   " cannot take the fused update: it needs a dense (contiguous) tensor of float32, float64, "
                   "float16 or bfloat16 on the CPU or a GPU " +
                   what + ". Leave fused unset to update such parameters op by op.");
}

std::vector<Tensor> concatenated(std::initializer_list<const std::vector<Tensor>*> lists) {
  size_t n = 0;
  for (const auto* l : lists) n += l->size();
  std::vector<Tensor> out;
  out.reserve(n);
  for (const auto* l : lists) out.insert(out.end(), l->begin(), l->end());
  return out;
}

bool fusable_like(const Tensor& x, const Tensor& param) {
  return x.defined() && x.is_contiguous() && x.dtype() == param.dtype() && x.device() == param.device() &&
         x.sizes() == param.sizes();
}

std::string python_float(double v) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  char buf[64];
  auto res = std::to_chars(buf, buf + sizeof(buf), v);
  std::string s(buf, res.ptr);
  if (s.find_first_of(".en") == std::string::npos) s += ".0";
  return s;
}

void check_state_tensor(const ParamState& state, const std::string& name, const Tensor& param,
                        const std::string& where) {
  auto it = state.find(name);
  if (it == state.end()) return;
  KILN_CHECK(it->second.sizes() == param.sizes(), ValueError,
             kLoad + where + "." + name + " has shape " + shape_str(it->second.sizes()) +
                 " but the parameter has shape " + shape_str(param.sizes()) +
                 ". Load a state dict saved for the same model.");
  KILN_CHECK(it->second.is_floating_point(), ValueError,
             kLoad + where + "." + name + " must be a floating-point tensor, got " +
                 std::string(dtype_name(it->second.dtype())) + ".");
}

void check_state_names(const ParamState& state, std::initializer_list<const char*> allowed,
                       const std::string& where) {
  for (const auto& [name, _] : state) {
    bool ok = std::any_of(allowed.begin(), allowed.end(), [&](const char* a) { return name == a; });
    KILN_CHECK(ok, ValueError,
               kLoad + "unexpected key '" + where + "." + name +
                   "': this optimizer keeps no such state. Load a state dict saved from the same "
                   "kind of optimizer.");
  }
}

}  // namespace kiln::optim
