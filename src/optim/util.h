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

// Whether step() may take the fused kernels (kernels/fused_optim.h): not while compile()
// captures the step (the graph records the per-op update, which its backend fuses itself), and
// not with KILN_FUSED_OPTIM=0 (the per-op update everywhere).
bool fused_update_allowed();

// Whether `x` can stand beside `param` in a fused update: a defined, dense tensor of its dtype,
// device and shape.
bool fusable_like(const Tensor& x, const Tensor& param);

// Whether the fused kernels run parameters of `param`'s dtype on its device.
bool fused_kernels_take(const Tensor& param);

}  // namespace kiln::optim
