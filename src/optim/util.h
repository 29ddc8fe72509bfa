// Helpers shared by the optimizers' source files.
#pragma once

#include <initializer_list>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "kiln/optim.h"

namespace kiln::optim {

// A double as Python's repr prints it ("0.001", "-1.0", "1e-05"), for PyTorch-like messages.
std::string python_float(double v);

// load_state_dict checks: state entry `name` (if present) has the parameter's shape and a
// floating dtype; every state name is one of `allowed`.
void check_state_tensor(const ParamState& state, const std::string& name, const Tensor& param,
                        const std::string& where);
void check_state_names(const ParamState& state, std::initializer_list<const char*> allowed,
                       const std::string& where);

// How step() updates a group's parameters (the options' `fused`, kernels/fused_optim.h): the fused
// update where a parameter qualifies (unset), never (false, or KILN_FUSED_OPTIM=0 in the
// environment), or always (true: a parameter that does not qualify throws). Eagerly and under
// compile() alike: a captured step records one node per group and device.
enum class FusedChoice { where_possible, never, always };
FusedChoice fused_choice(const std::optional<bool>& fused);

// Throws the ValueError of a parameter that fused = true cannot update: parameter `index` of group
// `group` of optimizer `who`, which needs `what` besides a dense floating tensor.
[[noreturn]] void throw_not_fusable(const char* who, size_t group, size_t index, const char* what);

// The lists one after another: a fused update's tensor list.
std::vector<Tensor> concatenated(std::initializer_list<const std::vector<Tensor>*> lists);

// Whether `x` can stand beside `param` in a fused update: a defined, dense tensor of its dtype,
// device and shape.
bool fusable_like(const Tensor& x, const Tensor& param);

// The parameters of one group that take a fused update, in parallel lists (Lists), one per device
// and dtype: a fused update takes one of each.
template <class Lists>
class FusedBatches {
 public:
  using Key = std::pair<Device, DType>;
  // The lists `param` belongs in.
  Lists& of(const Tensor& param) {
    for (auto& [key, l] : batches_)
      if (key.first == param.device() && key.second == param.dtype()) return l;
    return batches_.emplace_back(Key{param.device(), param.dtype()}, Lists{}).second;
  }
  auto begin() { return batches_.begin(); }
  auto end() { return batches_.end(); }

 private:
  std::vector<std::pair<Key, Lists>> batches_;
};

}  // namespace kiln::optim
