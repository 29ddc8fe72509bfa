#include "interpreter.h"

#include <stdexcept>

namespace kiln::differential {

Ts make_inputs(const Program& program, bool float64_reference) {
  Ts inputs;
  for (const InputSpec& in : program.inputs) {
    manual_seed(in.data_seed);
    const std::vector<int64_t> base = base_sizes(in);
    Tensor t;
    if (is_float(in.dtype)) {
      t = in.domain == Domain::positive ? rand(base, kFloat32) * 1.5 + 0.5
                                        : rand(base, kFloat32) * 4 - 2;
      if (in.dtype != kFloat32) t = t.to(in.dtype);
      if (float64_reference) t = t.to(kFloat64);
    } else if (in.dtype == kBool) {
      t = rand(base, kFloat32) < 0.5;
    } else {
      t = randint(-3, 4, base);
      if (in.dtype != kInt64) t = t.to(in.dtype);
    }
    if (in.layout == Layout::permuted) {
      t = t.permute(in.layout_dims);
    } else if (in.layout == Layout::strided) {
      for (int64_t d : in.layout_dims) t = t.slice(d, 1, base[d], 2);
    } else if (in.layout == Layout::expanded) {
      t = t.expand(in.sizes);
    }
    if (in.requires_grad) t.requires_grad_();
    inputs.push_back(t);
  }
  return inputs;
}

Ts run_program(const Program& program, const Ts& inputs, const RunContext& context) {
  if (inputs.size() != program.inputs.size())
    throw std::invalid_argument("run_program: wrong number of inputs");
  Ts values(inputs.begin(), inputs.end());
  for (const Op& op : program.ops) {
    Ts args;
    for (int a : op.args) args.push_back(a >= 0 ? values.at(a) : Tensor());
    Ts results = rule(op.kind).run(op, args, context);
    for (Tensor& r : results) values.push_back(std::move(r));
  }
  Ts outputs;
  for (const Output& out : program.outputs) outputs.push_back(values.at(out.value));
  return outputs;
}

Ts loss_weights(const Program& program, const Ts& outputs) {
  Ts weights;
  for (size_t k = 0; k < outputs.size(); ++k) {
    manual_seed(program.outputs.at(k).weight_seed);
    weights.push_back(rand(outputs[k].sizes(), kFloat32) * 2 - 1);
  }
  return weights;
}

Tensor weighted_sum(const Ts& outputs, const Ts& weights) {
  Tensor loss;
  for (size_t k = 0; k < outputs.size(); ++k) {
    const Tensor& out = outputs[k];
    if (!out.is_floating_point() || !out.requires_grad()) continue;
    Tensor term = (out * weights.at(k).to(out.dtype())).sum();
    loss = loss.defined() ? loss + term : term;
  }
  return loss;
}

}  // namespace kiln::differential
