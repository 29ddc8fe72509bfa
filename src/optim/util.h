// Helpers shared by the optimizers' source files.
#pragma once

#include <initializer_list>
#include <string>

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

}  // namespace kiln::optim
