// Runs a program: its inputs (the same data on every call), its ops, and the loss whose backward
// gives the gradients the harness compares.
#pragma once

#include <vector>

#include "ops.h"
#include "program.h"

namespace kiln::differential {

using Ts = std::vector<Tensor>;

// Fresh inputs, the same data on every call (manual_seed(data_seed) each); make_inputs_cpp()
// prints the same steps. float64_reference: floating inputs are converted to float64 before
// their view is taken, so the reference sees exactly the float32 run's data.
Ts make_inputs(const Program& program, bool float64_reference = false);

// The program's body: eager outside compile(), captured inside it.
Ts run_program(const Program& program, const Ts& inputs, const RunContext& context = {});

// The loss whose backward gives the gradients compared: the sum over the floating outputs that
// require grad of (output * weight).sum(), with fixed random weights in [-1, 1] (float32, drawn
// after manual_seed(weight_seed), one per output); undefined when no output requires grad.
Ts loss_weights(const Program& program, const Ts& outputs);
Tensor weighted_sum(const Ts& outputs, const Ts& weights);
inline Tensor weighted_loss(const Program& program, const Ts& outputs) {
  return weighted_sum(outputs, loss_weights(program, outputs));
}

}  // namespace kiln::differential
