// Helpers shared by the optimizers' source files.
#pragma once

#include <initializer_list>
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

// Whether step() may take the fused update (kernels/fused_optim.h): always, eagerly and under
// compile() (a captured step records one node per parameter group), but with KILN_FUSED_OPTIM=0
// (the per-op update everywhere).
bool fused_update_allowed();

// The lists one after another: a fused update's tensor list.
std::vector<Tensor> concatenated(std::initializer_list<const std::vector<Tensor>*> lists);

// Whether `x` can stand beside `param` in a fused update: a defined, dense tensor of its dtype,
// device and shape.
bool fusable_like(const Tensor& x, const Tensor& param);

// Whether the fused kernels run `param`: a dense tensor of a floating dtype on a device they have.
bool fused_kernels_take(const Tensor& param);

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
