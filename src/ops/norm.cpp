// Normalization. Table ops, as in aten: native_batch_norm, native_layer_norm and
// native_group_norm, each returning (output, mean, inverse std) — the saved statistics backward
// needs. batch_norm, layer_norm and group_norm are front-ends that take output 0.
//
// The statistics outputs are float32 for float16/bfloat16 inputs (the accumulation type) and the
// input's dtype otherwise. native_batch_norm in eval mode returns the running mean and
// 1 / sqrt(running_var + eps) as its statistics (PyTorch returns empty tensors there), so
// backward can read them the same way in both modes.
//
// Layouts (PyTorch's rule): batch_norm's output and grad_input follow the input's
// suggest_memory_format() (channels-last stays channels-last); statistics and parameter
// gradients are 1-D.
//
// batch_norm_relu and batch_norm_relu_backward are the kiln backend's fusions of a batch norm with
// the relu after it (passes/fuse_batch_norm_relu.cpp): native_batch_norm with relu applied to
// output 0, and native_batch_norm_backward whose incoming gradient is first masked by the relu's
// result (where(result <= threshold, fill, grad), the relu derivative; threshold and fill are
// 0-dim tensors, None for 0). One pass over the activations each instead of two.
// batch_norm_relu_backward_recompute is the backward again, recomputing the relu's result from the
// input instead of reading it, where the pass can show that the forward ran with the same operands.
//
// Derivatives go through fused backward table ops with their own kernels (aten's names):
// native_batch_norm_backward, native_layer_norm_backward and native_group_norm_backward, each
// returning (grad_input, grad_weight, grad_bias) for the outputs output_mask asks for; an output
// it does not ask for has shape (0). Only the gradient of output 0 flows back (the statistics are
// treated as non-differentiable, as in PyTorch). The backward ops have no derivative of their own:
// a double backward through a normalization raises "not implemented".
#include "core/shape.h"
#include "kiln/op_table.h"
#include "ops/decompositions.h"
#include "ops/meta_checks.h"
#include "kiln/ops.h"

namespace kiln {

namespace {

std::string dtype_str(DType t) { return std::string(dtype_name(t)); }

DType stat_dtype(DType input) {
  return input == DType::float16 || input == DType::bfloat16 ? DType::float32 : input;
}

using detail::check_same_device;

void check_floating(const std::string& op, const Tensor& t, const char* what) {
  KILN_CHECK(!t.defined() || is_floating_point(t.dtype()), DTypeError,
             "[kiln::" + op + "] " + what + " must be floating point, but got dtype " + dtype_str(t.dtype()) +
                 ". Convert it with .to(...).");
}

// A per-channel parameter: undefined, or a 1-D tensor of `channels` elements.
const OpDef& batch_norm_backward_op();
const OpDef& batch_norm_relu_backward_op();
const OpDef& layer_norm_backward_op();
const OpDef& group_norm_backward_op();

std::vector<int64_t> output_mask(const BackwardContext& c) {
  return {c.needs_grad(0), c.needs_grad(1), c.needs_grad(2)};
}

// The first three results of a normalization backward, undefined where the mask is off; the
// remaining forward inputs (running stats) get no gradient.
TensorList masked_grads(TensorList g, const std::vector<int64_t>& mask) {
  for (int i = 0; i < 3; ++i)
    if (!mask[i]) g[i] = Tensor();
  return g;
}

// Output metas of a normalization backward: grad_input like the input, grad_weight and grad_bias
// of `param_sizes` in the weight's dtype (the input's without a weight); (0) where masked off.
std::vector<TensorMeta> backward_metas(const OpCall& c, const Tensor& x, const Tensor& weight,
                                       const std::vector<int64_t>& param_sizes, size_t mask_attr,
                                       const std::string& op) {
  IntArrayRef mask = c.ints_attr(mask_attr);
  KILN_CHECK(mask.size() == 3, ValueError,
             "[kiln::" + op + "] output_mask must have 3 entries (input, weight, bias), got " +
                 std::to_string(mask.size()) + ".");
  const DType pt = weight.defined() ? weight.dtype() : x.dtype();
  auto masked = [&](int i, std::vector<int64_t> s) { return mask[i] ? s : std::vector<int64_t>{0}; };
  return {TensorMeta{masked(0, x.sizes().vec()), {}, x.dtype(), x.device()},
          TensorMeta{masked(1, param_sizes), {}, pt, x.device()},
          TensorMeta{masked(2, param_sizes), {}, pt, x.device()}};
}

// Checks grad_output against the input and a statistic against its expected shape.
void check_backward_operands(const std::string& op, const Tensor& grad, const Tensor& x,
                             std::initializer_list<const Tensor*> stats, int64_t stat_numel) {
  check_same_device(op, {&grad, &x});
  for (const Tensor* t : stats) check_same_device(op, {&x, t});
  check_floating(op, grad, "grad_output");
  check_floating(op, x, "input");
  KILN_CHECK(grad.sizes() == x.sizes(), ShapeError,
             "[kiln::" + op + "] grad_output has shape " + shape_str(grad.sizes()) + " but the input has shape " +
                 shape_str(x.sizes()) + ". Pass the gradient of the forward's output.");
  for (const Tensor* t : stats) {
    check_floating(op, *t, "a saved statistic");
    KILN_CHECK(t->numel() == stat_numel, ShapeError,
               "[kiln::" + op + "] expected saved statistics of " + std::to_string(stat_numel) +
                   " elements, but got shape " + shape_str(t->sizes()) + ". Pass the forward's outputs 1 and 2.");
  }
}

void check_channel_vector(const std::string& op, const Tensor& t, const char* what, int64_t channels) {
  if (!t.defined()) return;
  KILN_CHECK(t.dim() == 1 && t.numel() == channels, ShapeError,
             "[kiln::" + op + "] " + what + " should be a 1-D tensor of " + std::to_string(channels) +
                 " elements (one per channel), but got shape " + shape_str(t.sizes()) + ".");
}

// Validates a batch-norm backward's operands (grad_out at input 0; input, weight?, save_mean and
// save_invstd from input `x_at` on; attrs: train, output_mask) and returns its output metas.
std::vector<TensorMeta> batch_norm_backward_metas(const OpCall& c, size_t x_at, const std::string& op) {
  const Tensor& x = c.input(x_at);
  const Tensor& weight = c.input(x_at + 1);
  KILN_CHECK(x.dim() >= 2, ShapeError,
             "[kiln::" + op + "] expected an input of 2 or more dims (N, C, ...), but got shape " +
                 shape_str(x.sizes()) + ".");
  const int64_t channels = x.sizes()[1];
  check_backward_operands(op, c.input(0), x, {&c.input(x_at + 2), &c.input(x_at + 3)}, channels);
  check_floating(op, weight, "weight");
  check_channel_vector(op, weight, "weight", channels);
  std::vector<TensorMeta> metas = backward_metas(c, x, weight, {channels}, 1, op);
  // grad_input takes the input's layout (channels-last stays channels-last, as in PyTorch).
  if (c.ints_attr(1)[0]) metas[0].strides = detail::strides_following(x.sizes(), x.strides(), x.sizes());
  return metas;
}

// Validates a batch norm's operands (inputs: input, weight?, bias?, running_mean?, running_var?;
// attrs: training, momentum, eps) and returns its output metas. `op` names the caller in messages.
std::vector<TensorMeta> batch_norm_metas(const OpCall& c, const std::string& op) {
  const Tensor& x = c.input(0);
  const Tensor& weight = c.input(1);
  const Tensor& bias = c.input(2);
  const Tensor& running_mean = c.input(3);
  const Tensor& running_var = c.input(4);
  const bool training = c.bool_attr(0);
  KILN_CHECK(x.dim() >= 2, ShapeError,
             "[kiln::" + op + "] expected an input of 2 or more dims (N, C, ...), but got shape " +
                 shape_str(x.sizes()) + ".");
  check_same_device(op, {&x, &weight, &bias, &running_mean, &running_var});
  check_floating(op, x, "input");
  check_floating(op, weight, "weight");
  check_floating(op, bias, "bias");
  check_floating(op, running_mean, "running_mean");
  check_floating(op, running_var, "running_var");
  const int64_t channels = x.sizes()[1];
  check_channel_vector(op, weight, "weight", channels);
  check_channel_vector(op, bias, "bias", channels);
  check_channel_vector(op, running_mean, "running_mean", channels);
  check_channel_vector(op, running_var, "running_var", channels);
  KILN_CHECK(training || (running_mean.defined() && running_var.defined()), ValueError,
             "[kiln::" + op + "] running_mean and running_var must be defined in evaluation mode. Pass "
             "them, or use training=true.");
  KILN_CHECK(!training || x.numel() / std::max<int64_t>(channels, 1) != 1 || channels == 0, ValueError,
             "[kiln::" + op + "] expected more than 1 value per channel when training, got input size " +
                 shape_str(x.sizes()) + ".");
  const DType st = stat_dtype(x.dtype());
  // The output keeps a channels-last input's layout (as PyTorch's); statistics are 1-D.
  return {TensorMeta{x.sizes().vec(), detail::strides_following(x.sizes(), x.strides(), x.sizes()), x.dtype(),
                     x.device()},
          TensorMeta{{channels}, {}, st, x.device()}, TensorMeta{{channels}, {}, st, x.device()}};
}

// Inputs: input, weight?, bias?, running_mean?, running_var?. Attrs: training, momentum, eps.
const OpDef& kNativeBatchNorm = register_op({
    .name = "native_batch_norm",
    .schema = "native_batch_norm(Tensor input, Tensor? weight, Tensor? bias, Tensor(a!)? running_mean, "
              "Tensor(b!)? running_var, bool training, float momentum, float eps) -> (Tensor, Tensor, Tensor)",
    .meta = [](const OpCall& c) { return batch_norm_metas(c, "batch_norm"); },
    .mutated_inputs = {3, 4},
    .derivative = {.formula = "input, weight, bias: native_batch_norm_backward(grad, input, weight, save_mean, "
                              "save_invstd, training, output_mask)",
                   .save_inputs = {0, 1},
                   .save_outputs = {1, 2},
                   .fn = [](const BackwardContext& c) -> TensorList {
                     auto mask = output_mask(c);
                     if (!mask[0] && !mask[1] && !mask[2]) return {};
                     return masked_grads(call_op(batch_norm_backward_op(),
                                                 {c.grad(0), c.input(0), c.input(1), c.output(1), c.output(2)},
                                                 {c.attrs[0], mask}),
                                         mask);
                   }},
    .lowering = detail::batch_norm_decomposition(),
    .writes_mutated_inputs = [](const OpCall& c) { return c.bool_attr(0); },  // training only
});

// The relu-mask operands of batch_norm_relu_backward[_recompute], inputs 6 and 7: threshold and
// fill, 0-dim tensors or None.
// A 0-dim CPU threshold or fill (a host scalar, as the kiln backend's passes make them) goes with
// tensors on any device, as wrapped numbers do: the device checks skip it.
const Tensor& device_operand(const Tensor& t) {
  static const Tensor none;
  return t.defined() && t.dim() == 0 && t.is_cpu() ? none : t;
}

void check_mask_scalars(const std::string& op, const OpCall& c) {
  for (size_t i : {size_t{6}, size_t{7}}) {
    const Tensor& t = c.input(i);
    KILN_CHECK(!t.defined() || t.dim() == 0, ShapeError,
               "[kiln::" + op + "] " + (i == 6 ? "threshold" : "fill") + " must be a 0-dim tensor, but got shape " +
                   shape_str(t.sizes()) + ".");
  }
}

// native_batch_norm_backward(grad_out, input, weight?, save_mean, save_invstd, train, output_mask).
// Training differentiates through the batch statistics; evaluation (train=false, save_* holding
// the running mean and 1 / sqrt(running_var + eps)) is a per-channel affine map.
const OpDef& kNativeBatchNormBackward = register_op({
    .name = "native_batch_norm_backward",
    .schema = "native_batch_norm_backward(Tensor grad_out, Tensor input, Tensor? weight, Tensor save_mean, "
              "Tensor save_invstd, bool train, bool[3] output_mask) -> (Tensor, Tensor, Tensor)",
    .meta = [](const OpCall& c) { return batch_norm_backward_metas(c, 1, "native_batch_norm_backward"); },
    .lowering = lowering::Extern{},
});

// batch_norm_relu: native_batch_norm with relu applied to output 0 in the same pass (NaN stays
// NaN, as relu's). Same inputs, attrs, layouts and running-statistics update.
const OpDef& kBatchNormRelu = register_op({
    .name = "batch_norm_relu",
    .schema = "batch_norm_relu(Tensor input, Tensor? weight, Tensor? bias, Tensor(a!)? running_mean, "
              "Tensor(b!)? running_var, bool training, float momentum, float eps) -> (Tensor, Tensor, Tensor)",
    .meta = [](const OpCall& c) { return batch_norm_metas(c, "batch_norm_relu"); },
    .mutated_inputs = {3, 4},
    .derivative = {.formula = "input, weight, bias: batch_norm_relu_backward(grad, result, input, weight, save_mean, "
                              "save_invstd, None, None, training, output_mask)",
                   .save_inputs = {0, 1},
                   .save_outputs = {0, 1, 2},
                   .fn = [](const BackwardContext& c) -> TensorList {
                     auto mask = output_mask(c);
                     if (!mask[0] && !mask[1] && !mask[2]) return {};
                     return masked_grads(call_op(batch_norm_relu_backward_op(),
                                                 {c.grad(0), c.output(0), c.input(0), c.input(1), c.output(1),
                                                  c.output(2), Tensor(), Tensor()},
                                                 {c.attrs[0], mask}),
                                         mask);
                   }},
    .lowering = lowering::Extern{},
    .writes_mutated_inputs = [](const OpCall& c) { return c.bool_attr(0); },  // training only
});

// batch_norm_relu_backward(grad_out, result, input, weight?, save_mean, save_invstd, threshold?,
// fill?, train, output_mask): native_batch_norm_backward(where(result <= threshold, fill,
// grad_out), input, weight, save_mean, save_invstd, train, output_mask), the mask applied as the
// gradient is read. threshold and fill are 0-dim (None: 0); the comparison runs in result's dtype
// and fill takes grad_out's, as le and where would. result is the relu's output (any layout).
const OpDef& kBatchNormReluBackward = register_op({
    .name = "batch_norm_relu_backward",
    .schema = "batch_norm_relu_backward(Tensor grad_out, Tensor result, Tensor input, Tensor? weight, "
              "Tensor save_mean, Tensor save_invstd, Tensor? threshold, Tensor? fill, bool train, "
              "bool[3] output_mask) -> (Tensor, Tensor, Tensor)",
    .meta = [](const OpCall& c) -> std::vector<TensorMeta> {
      const std::string op = "batch_norm_relu_backward";
      std::vector<TensorMeta> metas = batch_norm_backward_metas(c, 2, op);
      const Tensor& grad = c.input(0);
      const Tensor& result = c.input(1);
      const Tensor& x = c.input(2);
      check_same_device(op, {&x, &result, &device_operand(c.input(6)), &device_operand(c.input(7))});
      check_floating(op, result, "result");
      KILN_CHECK(result.sizes() == x.sizes(), ShapeError,
                 "[kiln::" + op + "] result has shape " + shape_str(result.sizes()) + " but the input has shape " +
                     shape_str(x.sizes()) + ". Pass the forward's output 0.");
      KILN_CHECK(result.dtype() == x.dtype() && grad.dtype() == x.dtype(), DTypeError,
                 "[kiln::" + op + "] result (" + dtype_str(result.dtype()) + ") and grad_out (" +
                     dtype_str(grad.dtype()) + ") must have the input's dtype (" + dtype_str(x.dtype()) +
                     "). Convert them with .to(...).");
      check_mask_scalars(op, c);
      return metas;
    },
    .lowering = lowering::Extern{},
});

// batch_norm_relu_backward_recompute(grad_out, input, weight?, save_mean, save_invstd, bias?,
// threshold?, fill?, train, output_mask): batch_norm_relu_backward with the relu's result not read
// but recomputed from the input as batch_norm_relu computed it, relu(input * scale + shift) with
// scale = save_invstd * weight and shift = bias - save_mean * scale, rounded alike (so bit for bit
// the forward's result). It equals batch_norm_relu_backward only for the statistics and parameters
// the forward ran with; the kiln backend's fuse_batch_norm_relu uses it where the graph shows that
// (one stream of activations less in each of the kernel's two passes).
const OpDef& kBatchNormReluBackwardRecompute = register_op({
    .name = "batch_norm_relu_backward_recompute",
    .schema = "batch_norm_relu_backward_recompute(Tensor grad_out, Tensor input, Tensor? weight, Tensor save_mean, "
              "Tensor save_invstd, Tensor? bias, Tensor? threshold, Tensor? fill, bool train, bool[3] output_mask) "
              "-> (Tensor, Tensor, Tensor)",
    .meta = [](const OpCall& c) -> std::vector<TensorMeta> {
      const std::string op = "batch_norm_relu_backward_recompute";
      std::vector<TensorMeta> metas = batch_norm_backward_metas(c, 1, op);
      const Tensor& grad = c.input(0);
      const Tensor& x = c.input(1);
      const Tensor& bias = c.input(5);
      check_same_device(op, {&x, &bias, &device_operand(c.input(6)), &device_operand(c.input(7))});
      check_floating(op, bias, "bias");
      check_channel_vector(op, bias, "bias", x.sizes()[1]);
      KILN_CHECK(grad.dtype() == x.dtype(), DTypeError,
                 "[kiln::" + op + "] grad_out (" + dtype_str(grad.dtype()) + ") must have the input's dtype (" +
                     dtype_str(x.dtype()) + "). Convert it with .to(...).");
      check_mask_scalars(op, c);
      return metas;
    },
    .lowering = lowering::Extern{},
});

// Inputs: input, weight?, bias?. Attrs: normalized_shape, eps.
const OpDef& kNativeLayerNorm = register_op({
    .name = "native_layer_norm",
    .schema = "native_layer_norm(Tensor input, int[] normalized_shape, Tensor? weight, Tensor? bias, float eps) "
              "-> (Tensor, Tensor, Tensor)",
    .meta = [](const OpCall& c) -> std::vector<TensorMeta> {
      const Tensor& x = c.input(0);
      const Tensor& weight = c.input(1);
      const Tensor& bias = c.input(2);
      IntArrayRef shape = c.ints_attr(0);
      KILN_CHECK(!shape.empty(), ShapeError,
                 "[kiln::layer_norm] expected normalized_shape to be at least 1-dimensional, i.e., containing "
                 "at least one element, but got normalized_shape = ().");
      check_same_device("layer_norm", {&x, &weight, &bias});
      check_floating("layer_norm", x, "input");
      check_floating("layer_norm", weight, "weight");
      check_floating("layer_norm", bias, "bias");
      KILN_CHECK(!weight.defined() || weight.sizes() == shape, ShapeError,
                 "[kiln::layer_norm] expected weight to be of same shape as normalized_shape, but got weight of "
                 "shape " + shape_str(weight.sizes()) + " and normalized_shape = " + shape_str(shape) + ".");
      KILN_CHECK(!bias.defined() || bias.sizes() == shape, ShapeError,
                 "[kiln::layer_norm] expected bias to be of same shape as normalized_shape, but got bias of "
                 "shape " + shape_str(bias.sizes()) + " and normalized_shape = " + shape_str(shape) + ".");
      const int64_t axis = x.dim() - static_cast<int64_t>(shape.size());
      KILN_CHECK(axis >= 0 && IntArrayRef(x.sizes().data() + axis, shape.size()) == shape, ShapeError,
                 "[kiln::layer_norm] given normalized_shape=" + shape_str(shape) + ", expected input with shape (*" +
                     [&] {
                       std::string s;
                       for (int64_t d : shape) s += ", " + std::to_string(d);
                       return s;
                     }() + "), but got input of size " + shape_str(x.sizes()) + ".");
      std::vector<int64_t> stat_sizes(x.sizes().begin(), x.sizes().begin() + axis);
      stat_sizes.resize(x.dim(), 1);
      const DType st = stat_dtype(x.dtype());
      return {TensorMeta{x.sizes().vec(), {}, x.dtype(), x.device()}, TensorMeta{stat_sizes, {}, st, x.device()},
              TensorMeta{stat_sizes, {}, st, x.device()}};
    },
    .derivative = {.formula = "input, weight, bias: native_layer_norm_backward(grad, input, normalized_shape, mean, "
                              "rstd, weight, output_mask)",
                   .save_inputs = {0, 1},
                   .save_outputs = {1, 2},
                   .fn = [](const BackwardContext& c) -> TensorList {
                     auto mask = output_mask(c);
                     if (!mask[0] && !mask[1] && !mask[2]) return {};
                     return masked_grads(call_op(layer_norm_backward_op(),
                                                 {c.grad(0), c.input(0), c.output(1), c.output(2), c.input(1)},
                                                 {c.attrs[0], mask}),
                                         mask);
                   }},
    .lowering = detail::layer_norm_decomposition(),
});

// native_layer_norm_backward(grad_out, input, mean, rstd, weight?, normalized_shape, output_mask).
const OpDef& kNativeLayerNormBackward = register_op({
    .name = "native_layer_norm_backward",
    .schema = "native_layer_norm_backward(Tensor grad_out, Tensor input, Tensor mean, Tensor rstd, Tensor? weight, "
              "int[] normalized_shape, bool[3] output_mask) -> (Tensor, Tensor, Tensor)",
    .meta = [](const OpCall& c) -> std::vector<TensorMeta> {
      const std::string op = "native_layer_norm_backward";
      const Tensor& x = c.input(1);
      const Tensor& weight = c.input(4);
      IntArrayRef shape = c.ints_attr(0);
      const int64_t axis = x.dim() - static_cast<int64_t>(shape.size());
      KILN_CHECK(!shape.empty() && axis >= 0 && IntArrayRef(x.sizes().data() + axis, shape.size()) == shape,
                 ShapeError,
                 "[kiln::" + op + "] normalized_shape " + shape_str(shape) + " does not match the trailing dims of "
                 "the input of shape " + shape_str(x.sizes()) + ".");
      int64_t rows = 1;
      for (int64_t d = 0; d < axis; ++d) rows *= x.sizes()[d];
      check_backward_operands(op, c.input(0), x, {&c.input(2), &c.input(3)}, rows);
      check_floating(op, weight, "weight");
      KILN_CHECK(!weight.defined() || weight.sizes() == shape, ShapeError,
                 "[kiln::" + op + "] expected weight of shape " + shape_str(shape) + ", but got " +
                     shape_str(weight.sizes()) + ".");
      return backward_metas(c, x, weight, shape.vec(), 1, op);
    },
    .lowering = lowering::Extern{},
});

// Inputs: input, weight?, bias?. Attrs: group, eps. Statistics are (N, group).
const OpDef& kNativeGroupNorm = register_op({
    .name = "native_group_norm",
    .schema = "native_group_norm(Tensor input, Tensor? weight, Tensor? bias, int group, float eps) "
              "-> (Tensor, Tensor, Tensor)",
    .meta = [](const OpCall& c) -> std::vector<TensorMeta> {
      const Tensor& x = c.input(0);
      const Tensor& weight = c.input(1);
      const Tensor& bias = c.input(2);
      const int64_t groups = c.int_attr(0);
      KILN_CHECK(x.dim() >= 2, ShapeError,
                 "[kiln::group_norm] expected an input of 2 or more dims (N, C, ...), but got shape " +
                     shape_str(x.sizes()) + ".");
      check_same_device("group_norm", {&x, &weight, &bias});
      check_floating("group_norm", x, "input");
      check_floating("group_norm", weight, "weight");
      check_floating("group_norm", bias, "bias");
      KILN_CHECK(groups > 0, ValueError,
                 "[kiln::group_norm] num_groups must be positive, but got " + std::to_string(groups) + ".");
      const int64_t channels = x.sizes()[1];
      KILN_CHECK(channels % groups == 0, ShapeError,
                 "[kiln::group_norm] expected number of channels in input to be divisible by num_groups, but got "
                 "input of shape " + shape_str(x.sizes()) + " and num_groups=" + std::to_string(groups) + ".");
      check_channel_vector("group_norm", weight, "weight", channels);
      check_channel_vector("group_norm", bias, "bias", channels);
      const DType st = stat_dtype(x.dtype());
      const std::vector<int64_t> stat_sizes{x.sizes()[0], groups};
      return {TensorMeta{x.sizes().vec(), {}, x.dtype(), x.device()}, TensorMeta{stat_sizes, {}, st, x.device()},
              TensorMeta{stat_sizes, {}, st, x.device()}};
    },
    .derivative = {.formula = "input, weight, bias: native_group_norm_backward(grad, input, mean, rstd, weight, "
                              "group, output_mask)",
                   .save_inputs = {0, 1},
                   .save_outputs = {1, 2},
                   .fn = [](const BackwardContext& c) -> TensorList {
                     auto mask = output_mask(c);
                     if (!mask[0] && !mask[1] && !mask[2]) return {};
                     return masked_grads(call_op(group_norm_backward_op(),
                                                 {c.grad(0), c.input(0), c.output(1), c.output(2), c.input(1)},
                                                 {c.attrs[0], mask}),
                                         mask);
                   }},
    .lowering = detail::group_norm_decomposition(),
});

// native_group_norm_backward(grad_out, input, mean, rstd, weight?, group, output_mask).
const OpDef& kNativeGroupNormBackward = register_op({
    .name = "native_group_norm_backward",
    .schema = "native_group_norm_backward(Tensor grad_out, Tensor input, Tensor mean, Tensor rstd, Tensor? weight, "
              "int group, bool[3] output_mask) -> (Tensor, Tensor, Tensor)",
    .meta = [](const OpCall& c) -> std::vector<TensorMeta> {
      const std::string op = "native_group_norm_backward";
      const Tensor& x = c.input(1);
      const Tensor& weight = c.input(4);
      const int64_t groups = c.int_attr(0);
      KILN_CHECK(x.dim() >= 2, ShapeError,
                 "[kiln::" + op + "] expected an input of 2 or more dims (N, C, ...), but got shape " +
                     shape_str(x.sizes()) + ".");
      const int64_t channels = x.sizes()[1];
      KILN_CHECK(groups > 0 && channels % groups == 0, ValueError,
                 "[kiln::" + op + "] group=" + std::to_string(groups) + " must be positive and divide the " +
                     std::to_string(channels) + " channels.");
      check_backward_operands(op, c.input(0), x, {&c.input(2), &c.input(3)}, x.sizes()[0] * groups);
      check_floating(op, weight, "weight");
      check_channel_vector(op, weight, "weight", channels);
      return backward_metas(c, x, weight, {channels}, 1, op);
    },
    .lowering = lowering::Extern{},
});

const OpDef& batch_norm_backward_op() { return kNativeBatchNormBackward; }
const OpDef& batch_norm_relu_backward_op() { return kBatchNormReluBackward; }
const OpDef& layer_norm_backward_op() { return kNativeLayerNormBackward; }
const OpDef& group_norm_backward_op() { return kNativeGroupNormBackward; }

}  // namespace

Tensor batch_norm(const Tensor& input, const Tensor& running_mean, const Tensor& running_var, const Tensor& weight,
                  const Tensor& bias, bool training, double momentum, double eps) {
  return call_op(kNativeBatchNorm, {input, weight, bias, running_mean, running_var}, {training, momentum, eps})[0];
}

Tensor layer_norm(const Tensor& input, IntArrayRef normalized_shape, const Tensor& weight, const Tensor& bias,
                  double eps) {
  return call_op(kNativeLayerNorm, {input, weight, bias}, {normalized_shape.vec(), eps})[0];
}

Tensor group_norm(const Tensor& input, int64_t num_groups, const Tensor& weight, const Tensor& bias, double eps) {
  return call_op(kNativeGroupNorm, {input, weight, bias}, {num_groups, eps})[0];
}

}  // namespace kiln
