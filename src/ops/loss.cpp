// Losses. nll_loss_forward is a table op with a kernel, and so is its derivative,
// nll_loss_backward (each is the other's derivative); cross_entropy, mse_loss and
// binary_cross_entropy_with_logits are composites of public ops written with PyTorch's exact
// formulas (aten/src/ATen/native/LossNLL.cpp and Loss.cpp), differentiable through those ops.
//
// Reductions follow PyTorch's enum: 0 none, 1 mean, 2 sum.
#include <cmath>
#include <limits>

#include "core/shape.h"
#include "core/tensor_factory.h"
#include "kiln/op_table.h"
#include "kiln/ops.h"

namespace kiln {

namespace {

std::string name_of(DType t) { return std::string(dtype_name(t)); }

std::string list_str(IntArrayRef v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s + "]";
}

const OpDef& nll_loss_backward_op();

void check_weight(const Tensor& weight, int64_t classes, DType dtype, Device device, const std::string& op) {
  if (!weight.defined()) return;
  KILN_CHECK(weight.dim() == 1 && weight.numel() == classes, ShapeError,
             "[kiln::" + op + "] weight tensor should be defined either for all " + std::to_string(classes) +
                 " classes or no classes but got weight tensor of shape: " + list_str(weight.sizes()) + ".");
  KILN_CHECK(weight.dtype() == dtype, DTypeError,
             "[kiln::" + op + "] expected weight of dtype " + name_of(dtype) + " (the input's) but found " +
                 name_of(weight.dtype()) + ". Convert it with .to(...).");
  KILN_CHECK(weight.device() == device, DeviceError,
             "[kiln::" + op + "] weight is on " + weight.device().str() + " but the input is on " + device.str() +
                 ". Move them to one device.");
}

// nll_loss_forward(self, target, weight, reduction, ignore_index) -> (output, total_weight).
// self is (C), (N, C) or (N, C, d1, ...) (aten splits the last into nll_loss2d/nll_loss_nd);
// target holds class indices of shape (), (N) or (N, d1, ...). total_weight is the sum of the
// weights of the targets that are not ignore_index (their count without weights).
const OpDef& kNllLoss = register_op({
    .name = "nll_loss_forward",
    .schema = "nll_loss_forward(Tensor self, Tensor target, Tensor? weight, int reduction, SymInt ignore_index) "
              "-> (Tensor output, Tensor total_weight)",
    .meta = [](const OpCall& c) -> std::vector<TensorMeta> {
      const Tensor& x = c.input(0);
      const Tensor& target = c.input(1);
      const Tensor& weight = c.input(2);
      int64_t reduction = c.int_attr(0);
      KILN_CHECK(reduction >= 0 && reduction <= 2, ValueError,
                 "[kiln::nll_loss] reduction must be 0 (none), 1 (mean) or 2 (sum), got " + std::to_string(reduction) + ".");
      KILN_CHECK(is_floating_point(x.dtype()), DTypeError,
                 "[kiln::nll_loss] nll_loss is not implemented for input of dtype " + name_of(x.dtype()) +
                     "; it takes floating-point log-probabilities.");
      KILN_CHECK(target.dtype() == kInt64, DTypeError,
                 "[kiln::nll_loss] expected target of dtype int64 (class indices) but found " + name_of(target.dtype()) +
                     ". Convert it with .to(kInt64).");
      KILN_CHECK(target.device() == x.device(), DeviceError,
                 "[kiln::nll_loss] target is on " + target.device().str() + " but the input is on " +
                     x.device().str() + ". Move them to one device.");
      KILN_CHECK(x.dim() >= 1, ShapeError, "[kiln::nll_loss] Expected 1 or more dimensions (got 0).");
      if (x.dim() == 1) {
        KILN_CHECK(target.dim() == 0, ShapeError,
                   "[kiln::nll_loss] a 1D input of class scores (no batch dim) takes a 0D target, got target of shape " +
                       list_str(target.sizes()) + ".");
      } else if (x.dim() == 2) {
        KILN_CHECK(target.dim() == 1, ShapeError,
                   "[kiln::nll_loss] 0D or 1D target tensor expected, multi-target not supported (got target of shape " +
                       list_str(target.sizes()) + " for input " + list_str(x.sizes()) + ").");
      }
      if (x.dim() >= 2) {
        KILN_CHECK(target.dim() >= 1 && target.sizes()[0] == x.sizes()[0], ShapeError,
                   "[kiln::nll_loss] Expected input batch_size (" + std::to_string(x.sizes()[0]) +
                       ") to match target batch_size (" + std::to_string(target.dim() ? target.sizes()[0] : 0) + ").");
        std::vector<int64_t> want{x.sizes()[0]};
        want.insert(want.end(), x.sizes().begin() + 2, x.sizes().end());
        KILN_CHECK(target.sizes() == IntArrayRef(want), ShapeError,
                   "[kiln::nll_loss] Expected target size " + list_str(want) + ", got " + list_str(target.sizes()) + ".");
      }
      int64_t classes = x.dim() == 1 ? x.sizes()[0] : x.sizes()[1];
      check_weight(weight, classes, x.dtype(), x.device(), "nll_loss");
      std::vector<int64_t> out_sizes = reduction == 0 ? target.sizes().vec() : std::vector<int64_t>{};
      return {TensorMeta{std::move(out_sizes), {}, x.dtype(), x.device()}, TensorMeta{{}, {}, x.dtype(), x.device()}};
    },
    .derivative = {.formula = "self: nll_loss_backward(grad, self.sizes(), target, weight, reduction, ignore_index, "
                              "total_weight); total_weight: not differentiable",
                   .save_inputs = {1, 2},
                   .save_outputs = {1},
                   .fn = [](const BackwardContext& c) -> TensorList {
                     KILN_CHECK(!c.needs_grad(2), Error,
                                "[kiln::nll_loss] the derivative for 'weight' is not implemented (as in PyTorch). "
                                "Detach the class weights.");
                     if (!c.needs_grad(0)) return {};
                     return {call_op1(nll_loss_backward_op(), {c.grad(0), c.input(1), c.input(2), c.output(1)},
                                      {c.input_info[0].sizes, c.attrs[0], c.attrs[1]})};
                   }},
    .lowering = lowering::Extern{},
});

// nll_loss_backward(grad_output, target, weight, total_weight, self_size, reduction, ignore_index):
// the gradient of nll_loss_forward's input: -weight[t] * grad_output (divided by total_weight for
// the mean) at each (sample, target class, position) whose target is not ignore_index, zero
// elsewhere. aten passes self; Kiln passes its sizes, so the forward node need not save it.
const OpDef& kNllLossBackward = register_op({
    .name = "nll_loss_backward",
    .schema = "nll_loss_backward(Tensor grad_output, Tensor target, Tensor? weight, Tensor total_weight, "
              "SymInt[] self_size, int reduction, SymInt ignore_index) -> Tensor",
    .meta = [](const OpCall& c) -> std::vector<TensorMeta> {
      const Tensor& grad = c.input(0);
      const Tensor& target = c.input(1);
      const Tensor& weight = c.input(2);
      const Tensor& total_weight = c.input(3);
      IntArrayRef self_size = c.ints_attr(0);
      const int64_t reduction = c.int_attr(1);
      KILN_CHECK(reduction >= 0 && reduction <= 2, ValueError,
                 "[kiln::nll_loss_backward] reduction must be 0 (none), 1 (mean) or 2 (sum), got " +
                     std::to_string(reduction) + ".");
      KILN_CHECK(is_floating_point(grad.dtype()), DTypeError,
                 "[kiln::nll_loss_backward] expected a floating-point grad_output, got " + name_of(grad.dtype()) + ".");
      KILN_CHECK(target.dtype() == kInt64, DTypeError,
                 "[kiln::nll_loss_backward] expected target of dtype int64 (class indices) but found " +
                     name_of(target.dtype()) + ".");
      KILN_CHECK(target.device() == grad.device() && total_weight.device() == grad.device(), DeviceError,
                 "[kiln::nll_loss_backward] expected grad_output, target and total_weight on one device.");
      KILN_CHECK(!self_size.empty(), ShapeError, "[kiln::nll_loss_backward] Expected 1 or more dimensions (got 0).");
      detail::check_sizes_nonnegative(self_size, "nll_loss_backward");
      std::vector<int64_t> want;
      if (self_size.size() >= 2) {
        want.push_back(self_size[0]);
        want.insert(want.end(), self_size.begin() + 2, self_size.end());
      }
      KILN_CHECK(target.sizes() == IntArrayRef(want), ShapeError,
                 "[kiln::nll_loss_backward] Expected target size " + list_str(want) + " for an input of shape " +
                     list_str(self_size) + ", got " + list_str(target.sizes()) + ".");
      KILN_CHECK(total_weight.numel() == 1, ShapeError,
                 "[kiln::nll_loss_backward] expected total_weight to be a single element tensor, got " +
                     list_str(total_weight.sizes()) + ".");
      const IntArrayRef expected = reduction == 0 ? target.sizes() : IntArrayRef{};
      KILN_CHECK(reduction == 0 ? grad.sizes() == expected : grad.numel() == 1, ShapeError,
                 "[kiln::nll_loss_backward] grad_output of shape " + list_str(grad.sizes()) +
                     " does not match the loss's shape " + list_str(expected) + ".");
      const int64_t classes = self_size.size() == 1 ? self_size[0] : self_size[1];
      check_weight(weight, classes, grad.dtype(), grad.device(), "nll_loss_backward");
      return {TensorMeta{self_size.vec(), {}, grad.dtype(), grad.device()}};
    },
    .derivative = {.formula = "grad_output: nll_loss(grad, target, weight, reduction, ignore_index)",
                   .save_inputs = {1, 2},
                   .fn = [](const BackwardContext& c) -> TensorList {
                     TensorList out(4);
                     if (c.needs_grad(0))
                       out[0] = call_op(kNllLoss, {c.grad(), c.input(1), c.input(2)}, {c.attrs[1], c.attrs[2]})[0];
                     return out;
                   }},
    .lowering = lowering::Extern{},
});

const OpDef& nll_loss_backward_op() { return kNllLossBackward; }

Tensor reduce(const Tensor& loss, Reduction reduction) {
  switch (reduction) {
    case Reduction::none: return loss;
    case Reduction::mean: return mean(loss);
    case Reduction::sum: return sum(loss);
  }
  return loss;
}

// weight viewed as (1, C, 1, ...) to broadcast along the class dim of an input of `ndim` dims.
Tensor class_weight_view(const Tensor& weight, int64_t ndim) {
  if (ndim <= 1) return weight;
  std::vector<int64_t> shape(static_cast<size_t>(ndim), 1);
  shape[1] = weight.numel();
  return weight.view(shape);
}

// PyTorch's cross_entropy_loss_prob_target.
Tensor cross_entropy_prob_target(const Tensor& input, const Tensor& target, const Tensor& weight,
                                 Reduction reduction, double label_smoothing) {
  const int64_t class_dim = input.dim() == 1 ? 0 : 1;
  const int64_t classes = input.sizes()[class_dim];
  KILN_CHECK(is_floating_point(target.dtype()), DTypeError,
             "[kiln::cross_entropy] Expected floating point type for target with class probabilities, got " +
                 name_of(target.dtype()) + ".");
  check_weight(weight, classes, input.dtype(), input.device(), "cross_entropy");
  Tensor lsm = log_softmax(input, class_dim);
  Tensor t = label_smoothing > 0 ? target * (1 - label_smoothing) + label_smoothing / static_cast<double>(classes) : target;
  Tensor terms = lsm * t;
  if (weight.defined()) terms = terms * class_weight_view(weight, input.dim());
  switch (reduction) {
    case Reduction::none: return -sum(terms, {class_dim});
    case Reduction::sum: return -sum(terms);
    case Reduction::mean:
      if (input.numel() == 0) return full({}, std::numeric_limits<double>::quiet_NaN(), terms.dtype());
      return -sum(terms) / static_cast<double>(input.numel() / classes);
  }
  return terms;
}

}  // namespace

// ---------------- front-ends ----------------

Tensor nll_loss(const Tensor& input, const Tensor& target, const Tensor& weight, int64_t ignore_index,
                Reduction reduction) {
  return call_op(kNllLoss, {input, target, weight}, {static_cast<int64_t>(reduction), ignore_index})[0];
}

// cross_entropy = nll_loss(log_softmax(input, class_dim)); with label smoothing ε it mixes in the
// mean over classes: (1 - ε) * nll + ε / C * smooth, where smooth = -Σ_c w_c * log_softmax_c
// (0 at ignored targets), reduced like nll (the mean divides by nll's total weight).
Tensor cross_entropy(const Tensor& input, const Tensor& target, const Tensor& weight, int64_t ignore_index,
                     Reduction reduction, double label_smoothing) {
  KILN_CHECK(input.dim() >= 1, ShapeError, "[kiln::cross_entropy] Expected 1 or more dimensions (got 0).");
  KILN_CHECK(is_floating_point(input.dtype()), DTypeError,
             "[kiln::cross_entropy] cross_entropy is not implemented for input of dtype " + name_of(input.dtype()) +
                 "; it takes floating-point scores.");
  KILN_CHECK(label_smoothing >= 0.0 && label_smoothing <= 1.0, ValueError,
             "[kiln::cross_entropy] label_smoothing must be between 0.0 and 1.0. Got: " +
                 std::to_string(label_smoothing) + ".");
  if (input.sizes() == target.sizes()) {
    // Same shapes: class probabilities.
    KILN_CHECK(ignore_index < 0, ValueError,
               "[kiln::cross_entropy] ignore_index is not supported for floating point target.");
    return cross_entropy_prob_target(input, target, weight, reduction, label_smoothing);
  }
  const int64_t class_dim = input.dim() == 1 ? 0 : 1;
  Tensor lsm = log_softmax(input, class_dim);
  auto outs = call_op(kNllLoss, {lsm, target, weight}, {static_cast<int64_t>(reduction), ignore_index});
  if (label_smoothing <= 0.0) return outs[0];
  const Tensor& nll = outs[0];
  const Tensor& total_weight = outs[1];
  const double classes = static_cast<double>(input.sizes()[class_dim]);
  Tensor smooth = weight.defined() ? -sum(lsm * class_weight_view(weight, input.dim()), {class_dim})
                                   : -sum(lsm, {class_dim});
  smooth = masked_fill(smooth, eq(target, ignore_index), 0.0);
  Tensor ret;
  switch (reduction) {
    case Reduction::none: ret = smooth; break;
    case Reduction::sum: ret = sum(smooth); break;
    case Reduction::mean: ret = sum(smooth) / total_weight; break;
  }
  return (1 - label_smoothing) * nll + ret * (label_smoothing / classes);
}

Tensor mse_loss(const Tensor& input, const Tensor& target, Reduction reduction) {
  DType t = promote_types(input.dtype(), target.dtype());
  KILN_CHECK(is_floating_point(t), DTypeError,
             "[kiln::mse_loss] mse_loss is not implemented for dtype " + name_of(t) + ". Convert to a float dtype.");
  // Both operands in the promoted dtype first, as aten's TensorIterator does (sub itself refuses
  // bool operands); to() returns the tensor itself when it has that dtype already.
  Tensor d = input.to(t) - target.to(t);  // broadcasts like PyTorch (which warns when the shapes differ)
  return reduce(d * d, reduction);
}

// PyTorch's loss: (1 - t) * x + log_weight * softplus(-x), log_weight = (pos_weight - 1) * t + 1,
// softplus(-x) = -log_sigmoid(x), written per sign of x with a smooth, overflow-free branch each
// (x >= 0: log1p(exp(-x)); x < 0: log1p(exp(x)) - x). Autograd through those ops gives exactly
// aten's binary_cross_entropy_with_logits_backward, (sigmoid(x) - t) * weight, or
// ((pos_weight * t + 1 - t) * sigmoid(x) - pos_weight * t) * weight, at every x. A min/abs form
// (min(x, 0) - log1p(exp(-|x|))) takes subgradients at 0 and gave -t there instead of 0.5 - t.
Tensor binary_cross_entropy_with_logits(const Tensor& input, const Tensor& target, const Tensor& weight,
                                        const Tensor& pos_weight, Reduction reduction) {
  KILN_CHECK(target.sizes() == input.sizes(), ShapeError,
             "[kiln::binary_cross_entropy_with_logits] Target size (" + shape_str(target.sizes()) +
                 ") must be the same as input size (" + shape_str(input.sizes()) + ").");
  KILN_CHECK(is_floating_point(input.dtype()), DTypeError,
             "[kiln::binary_cross_entropy_with_logits] not implemented for input of dtype " + name_of(input.dtype()) +
                 "; it takes floating-point logits.");
  const Tensor nonneg = ge(input, 0);  // true at -0.0 too
  Tensor softplus_neg = where(nonneg, 0.0, neg(input)) + log1p(exp(where(nonneg, neg(input), input)));
  if (pos_weight.defined()) softplus_neg = softplus_neg * ((pos_weight - 1) * target + 1);
  Tensor loss = (1 - target) * input + softplus_neg;
  if (weight.defined()) loss = loss * weight;
  return reduce(loss, reduction);
}

}  // namespace kiln
