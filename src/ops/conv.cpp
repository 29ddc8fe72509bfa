// Convolution and pooling. Table ops: conv2d, max_pool2d, max_pool2d_with_indices, avg_pool2d,
// adaptive_avg_pool2d. The string-padding conv2d ("same"/"valid") is a front-end over conv2d.
// A convolution's result is channels-last when its input or its weight suggests channels_last
// (PyTorch's rule), else contiguous; convolution_backward's input and weight gradients take the
// input's and the weight's layouts. The kernels (oneDNN, with loop fallbacks) accept any strides.
//
// Derivatives (PyTorch's) go through backward table ops with their own kernels:
// convolution_backward (input, weight and bias gradients, as output_mask asks),
// max_pool2d_with_indices_backward, avg_pool2d_backward and adaptive_avg_pool2d_backward. Each
// backward op is linear in its gradient input, and its own derivative is written with the forward
// ops, so double backward works through all of them. The max_pool2d front-end runs
// max_pool2d_with_indices when autograd records (as aten does), so backward reuses the indices.
//
// A backward op's output that output_mask does not ask for has shape (0) and is never returned as
// a gradient (aten returns an undefined tensor there).
#include <array>

#include "kiln/autograd.h"

#include "core/shape.h"
#include "kiln/op_table.h"
#include "ops/decompositions.h"
#include "ops/meta_checks.h"
#include "kiln/ops.h"

namespace kiln {

namespace {

using Pair = std::array<int64_t, 2>;

std::string dtype_str(DType t) { return std::string(dtype_name(t)); }
std::string pair_str(const Pair& p) {
  std::string s = "(";
  s += std::to_string(p[0]);
  s += ", ";
  s += std::to_string(p[1]);
  s += ")";
  return s;
}

// A 2-D parameter given as one value (used for both dims) or two.
Pair expand_pair(IntArrayRef v, const std::string& op, const char* name) {
  KILN_CHECK(v.size() == 1 || v.size() == 2, ValueError,
             "[kiln::" + op + "] " + name + " must have 1 or 2 elements, but got " + std::to_string(v.size()) +
                 " (" + shape_str(v) + ").");
  return v.size() == 1 ? Pair{v[0], v[0]} : Pair{v[0], v[1]};
}

using detail::check_same_device;

// ---------------- conv2d ----------------

// conv2d(input, weight, bias?, stride, padding, dilation, groups): input (N, C, H, W), weight
// (O, C / groups, kH, kW), symmetric zero padding.
const OpDef& convolution_backward_op();

// Validates conv2d's operands and parameters (attrs 0-3: stride, padding, dilation, groups) and
// returns the output sizes. `op` names the caller in messages.
std::vector<int64_t> conv2d_output_sizes(const Tensor& x, const Tensor& w, const Tensor& b, const AttrAccess& c,
                                         const std::string& op) {
  const std::string tag = "[kiln::" + op + "] ";
  KILN_CHECK(x.dim() == 4, ShapeError,
             tag + "expected 3D (unbatched) or 4D (batched) input to conv2d, but got input of size " +
                 shape_str(x.sizes()) + ".");
  KILN_CHECK(w.dim() == 4, ShapeError,
             tag + "weight must be 4-D (out_channels, in_channels / groups, kH, kW), but got shape " +
                 shape_str(w.sizes()) + ".");
  check_same_device(op, {&x, &w, &b});
  KILN_CHECK(is_floating_point(x.dtype()), DTypeError,
             tag + "not implemented for dtype " + dtype_str(x.dtype()) + ". Convert the input to a floating-point dtype.");
  KILN_CHECK(w.dtype() == x.dtype(), DTypeError,
             tag + "input type (" + dtype_str(x.dtype()) + ") and weight type (" + dtype_str(w.dtype()) +
                 ") should be the same. Convert one with .to(...).");
  KILN_CHECK(!b.defined() || b.dtype() == x.dtype(), DTypeError,
             tag + "input type (" + dtype_str(x.dtype()) + ") and bias type (" + dtype_str(b.dtype()) +
                 ") should be the same. Convert one with .to(...).");
  Pair stride = expand_pair(c.ints_attr(0), op, "stride");
  Pair padding = expand_pair(c.ints_attr(1), op, "padding");
  Pair dilation = expand_pair(c.ints_attr(2), op, "dilation");
  const int64_t groups = c.int_attr(3);
  KILN_CHECK(groups > 0, ValueError, tag + "non-positive groups is not supported (got " + std::to_string(groups) + ").");
  KILN_CHECK(stride[0] > 0 && stride[1] > 0, ValueError,
             tag + "non-positive stride is not supported (got " + pair_str(stride) + ").");
  KILN_CHECK(padding[0] >= 0 && padding[1] >= 0, ValueError,
             tag + "negative padding is not supported (got " + pair_str(padding) + ").");
  KILN_CHECK(dilation[0] > 0 && dilation[1] > 0, ValueError,
             tag + "dilation should be greater than zero (got " + pair_str(dilation) + ").");
  const int64_t out_channels = w.sizes()[0];
  KILN_CHECK(w.sizes()[2] > 0 && w.sizes()[3] > 0, ShapeError,
             tag + "kernel size must be positive, but weight has shape " + shape_str(w.sizes()) + ".");
  KILN_CHECK(out_channels % groups == 0, ShapeError,
             tag + "given groups=" + std::to_string(groups) + ", expected weight to be divisible by " +
                 std::to_string(groups) + " at dimension 0, but got weight of size " + shape_str(w.sizes()) +
                 " instead.");
  KILN_CHECK(x.sizes()[1] == w.sizes()[1] * groups, ShapeError,
             tag + "given groups=" + std::to_string(groups) + ", weight of size " + shape_str(w.sizes()) +
                 ", expected input " + shape_str(x.sizes()) + " to have " + std::to_string(w.sizes()[1] * groups) +
                 " channels, but got " + std::to_string(x.sizes()[1]) + " channels instead.");
  KILN_CHECK(!b.defined() || (b.dim() == 1 && b.sizes()[0] == out_channels), ShapeError,
             tag + "given weight of size " + shape_str(w.sizes()) + ", expected bias to be 1-dimensional with " +
                 std::to_string(out_channels) + " elements, but got bias of size " +
                 (b.defined() ? shape_str(b.sizes()) : "") + " instead.");
  std::vector<int64_t> sizes{x.sizes()[0], out_channels, 0, 0};
  for (int d = 0; d < 2; ++d) {
    const int64_t padded = x.sizes()[2 + d] + 2 * padding[d];
    const int64_t kernel = dilation[d] * (w.sizes()[2 + d] - 1) + 1;
    KILN_CHECK(padded >= kernel, ShapeError,
               tag + "calculated padded input size per channel: (" + std::to_string(x.sizes()[2] + 2 * padding[0]) +
                   " x " + std::to_string(x.sizes()[3] + 2 * padding[1]) + "). Kernel size: (" +
                   std::to_string(dilation[0] * (w.sizes()[2] - 1) + 1) + " x " +
                   std::to_string(dilation[1] * (w.sizes()[3] - 1) + 1) +
                   "). Kernel size can't be greater than actual input size.");
    sizes[2 + d] = (padded - kernel) / stride[d] + 1;
  }
  return sizes;
}

// The layout of a convolution's result (PyTorch's mkldnn_conv_use_channels_last): channels-last
// when the input or the weight suggests it, so a channels-last network stays NHWC. The CPU kernel
// (kernels/cpu/conv_kernels.cpp) runs in the layout this picks.
TensorMeta conv2d_result(const Tensor& x, const Tensor& w, std::vector<int64_t> sizes) {
  const bool channels_last = x.suggest_memory_format() == MemoryFormat::channels_last ||
                             w.suggest_memory_format() == MemoryFormat::channels_last;
  std::vector<int64_t> strides = detail::format_strides(sizes, channels_last);
  return TensorMeta{std::move(sizes), std::move(strides), x.dtype(), x.device()};
}

// conv2d(input, weight, bias?, stride, padding, dilation, groups): input (N, C, H, W), weight
// (O, C / groups, kH, kW), symmetric zero padding.
const OpDef& kConv2d = register_op({
    .name = "conv2d",
    .schema = "conv2d(Tensor input, Tensor weight, Tensor? bias=None, int[2] stride=1, int[2] padding=0, "
              "int[2] dilation=1, int groups=1) -> Tensor",
    .meta = [](const OpCall& c) -> std::vector<TensorMeta> {
      const Tensor& x = c.input(0);
      return {conv2d_result(x, c.input(1), conv2d_output_sizes(x, c.input(1), c.input(2), c, "conv2d"))};
    },
    .derivative = {.formula = "input, weight, bias: convolution_backward(grad, input, weight, stride, padding, "
                              "dilation, groups, output_mask)",
                   .save_inputs = {0, 1},
                   .fn = [](const BackwardContext& c) -> TensorList {
                     const std::vector<int64_t> mask{c.needs_grad(0), c.needs_grad(1), c.needs_grad(2)};
                     if (!mask[0] && !mask[1] && !mask[2]) return {};
                     TensorList g = call_op(convolution_backward_op(), {c.grad(), c.input(0), c.input(1)},
                                            {c.attrs[0], c.attrs[1], c.attrs[2], c.attrs[3], mask});
                     for (int i = 0; i < 3; ++i)
                       if (!mask[i]) g[i] = Tensor();
                     return g;
                   }},
    .lowering = lowering::Extern{},
});

// conv2d_relu: relu(conv2d(...)) in one call (the relu runs in place on the fresh result). Made
// by the kiln backend's epilogue fusion; it has no derivative because compiled graphs already
// hold their backward.
const OpDef& kConv2dRelu = register_op({
    .name = "conv2d_relu",
    .schema = "conv2d_relu(Tensor input, Tensor weight, Tensor? bias=None, int[2] stride=1, int[2] padding=0, "
              "int[2] dilation=1, int groups=1) -> Tensor",
    .meta = [](const OpCall& c) -> std::vector<TensorMeta> {
      const Tensor& x = c.input(0);
      return {conv2d_result(x, c.input(1), conv2d_output_sizes(x, c.input(1), c.input(2), c, "conv2d_relu"))};
    },
    .lowering = lowering::Extern{},
});

// conv2d_bn: an inference batch norm (and optionally a relu) folded into the convolution before
// it: conv2d(input, weight * s, (bias - running_mean) * s + bn_bias) with
// s = bn_weight / sqrt(running_var + eps), per output channel, then the relu in place if asked.
// Made by the kiln backend's epilogue
// fusion (passes/fuse_conv_bn.cpp); no derivative (compiled graphs hold their backward).
// Inputs: input, weight, bias?, bn_weight?, bn_bias?, running_mean, running_var.
// Attrs: stride, padding, dilation, groups, eps, relu.
const OpDef& kConv2dBn = register_op({
    .name = "conv2d_bn",
    .schema = "conv2d_bn(Tensor input, Tensor weight, Tensor? bias, Tensor? bn_weight, Tensor? bn_bias, "
              "Tensor running_mean, Tensor running_var, int[2] stride, int[2] padding, int[2] dilation, "
              "int groups, float eps, bool relu) -> Tensor",
    .meta = [](const OpCall& c) -> std::vector<TensorMeta> {
      const Tensor& x = c.input(0);
      const int64_t o = c.input(1).sizes()[0];
      for (size_t i = 3; i < 7; ++i) {
        const Tensor& p = c.input(i);
        KILN_CHECK(!p.defined() || (p.dim() == 1 && p.sizes()[0] == o), ShapeError,
                   "[kiln::conv2d_bn] batch-norm parameter " + std::to_string(i) + " must have " +
                       std::to_string(o) + " elements (one per output channel).");
      }
      return {conv2d_result(x, c.input(1), conv2d_output_sizes(x, c.input(1), c.input(2), c, "conv2d_bn"))};
    },
    .lowering = lowering::Extern{},
});

// convolution_backward(grad_output, input, weight, stride, padding, dilation, groups, output_mask)
// -> (grad_input, grad_weight, grad_bias). output_mask holds three 0/1 flags.
const OpDef& kConvolutionBackward = register_op({
    .name = "convolution_backward",
    .schema = "convolution_backward(Tensor grad_output, Tensor input, Tensor weight, int[2] stride, int[2] padding, "
              "int[2] dilation, int groups, bool[3] output_mask) -> (Tensor, Tensor, Tensor)",
    .meta = [](const OpCall& c) -> std::vector<TensorMeta> {
      const Tensor& grad = c.input(0);
      const Tensor& x = c.input(1);
      const Tensor& w = c.input(2);
      auto sizes = conv2d_output_sizes(x, w, Tensor(), c, "convolution_backward");
      check_same_device("convolution_backward", {&grad, &x});
      KILN_CHECK(grad.sizes() == IntArrayRef(sizes), ShapeError,
                 "[kiln::convolution_backward] grad_output has shape " + shape_str(grad.sizes()) +
                     " but the convolution's output has shape " + shape_str(sizes) + ". Pass the gradient of conv2d's "
                     "output.");
      KILN_CHECK(grad.dtype() == x.dtype(), DTypeError,
                 "[kiln::convolution_backward] grad_output type (" + dtype_str(grad.dtype()) +
                     ") and input type (" + dtype_str(x.dtype()) + ") should be the same. Convert one with .to(...).");
      IntArrayRef mask = c.ints_attr(4);
      KILN_CHECK(mask.size() == 3, ValueError,
                 "[kiln::convolution_backward] output_mask must have 3 entries (input, weight, bias), got " +
                     std::to_string(mask.size()) + ".");
      // Each gradient takes the layout of what it is the gradient of; an unasked one is (0).
      auto like = [&](int i, const Tensor& t) {
        if (!mask[i]) return TensorMeta{{0}, {}, x.dtype(), x.device()};
        return TensorMeta{t.sizes().vec(), detail::strides_following(t.sizes(), t.strides(), t.sizes()), x.dtype(),
                          x.device()};
      };
      return {like(0, x), like(1, w),
              TensorMeta{mask[2] ? std::vector<int64_t>{w.sizes()[0]} : std::vector<int64_t>{0}, {}, x.dtype(),
                         x.device()}};
    },
    // Each output is bilinear: grad_input = Bx(grad_output, weight), grad_weight = Bw(grad_output,
    // input), grad_bias = sum(grad_output). The adjoints of Bx and Bw in grad_output are
    // convolutions; in weight and input they are convolution_backward again.
    .derivative = {.formula = "grad_output: conv2d(ggI, weight) + conv2d(input, ggW) + ggb; "
                              "input: convolution_backward(grad_output, input, ggW)[0]; "
                              "weight: convolution_backward(grad_output, ggI, weight)[1]",
                   .save_inputs = {0, 1, 2},
                   .fn = [](const BackwardContext& c) -> TensorList {
                     IntArrayRef mask = c.ints_attr(4);
                     const Tensor& grad_output = c.input(0);
                     const Tensor& x = c.input(1);
                     const Tensor& w = c.input(2);
                     const Tensor& ggi = c.grad(0);
                     const Tensor& ggw = c.grad(1);
                     const Tensor& ggb = c.grad(2);
                     TensorList g(3);
                     if (c.needs_grad(0)) {
                       Tensor go;
                       auto accumulate = [&](const Tensor& t) { go = go.defined() ? add(go, t) : t; };
                       if (mask[0]) accumulate(conv2d(ggi, w, Tensor(), c.ints_attr(0), c.ints_attr(1), c.ints_attr(2),
                                                      c.int_attr(3)));
                       if (mask[1]) accumulate(conv2d(x, ggw, Tensor(), c.ints_attr(0), c.ints_attr(1), c.ints_attr(2),
                                                      c.int_attr(3)));
                       if (mask[2]) {
                         Tensor b = ggb.view({1, ggb.numel(), 1, 1});
                         go = go.defined() ? add(go, b)
                                           : b.expand(grad_output.sizes()).contiguous(
                                                 grad_output.suggest_memory_format());
                       }
                       g[0] = go;
                     }
                     if (c.needs_grad(1) && mask[1])
                       g[1] = call_op(convolution_backward_op(), {grad_output, x, ggw},
                                      {c.attrs[0], c.attrs[1], c.attrs[2], c.attrs[3], std::vector<int64_t>{1, 0, 0}})[0];
                     if (c.needs_grad(2) && mask[0])
                       g[2] = call_op(convolution_backward_op(), {grad_output, ggi, w},
                                      {c.attrs[0], c.attrs[1], c.attrs[2], c.attrs[3], std::vector<int64_t>{0, 1, 0}})[1];
                     return g;
                   }},
    .lowering = lowering::Extern{},
});

const OpDef& convolution_backward_op() { return kConvolutionBackward; }

// ---------------- pooling ----------------

const OpDef& max_pool2d_with_indices_op();
const OpDef& max_pool2d_with_indices_backward_op();
const OpDef& avg_pool2d_op();
const OpDef& avg_pool2d_backward_op();
const OpDef& adaptive_avg_pool2d_op();
const OpDef& adaptive_avg_pool2d_backward_op();

struct PoolParams {
  Pair kernel, stride, padding, dilation;
  bool ceil_mode = false;
};

// PyTorch's pooling_output_shape: floor (or ceil) division, and a ceil-mode window must start
// inside the input or the left padding.
int64_t pooled_size(int64_t in, int64_t kernel, int64_t pad, int64_t stride, int64_t dilation, bool ceil_mode) {
  int64_t num = in + 2 * pad - dilation * (kernel - 1) - 1 + (ceil_mode ? stride - 1 : 0);
  int64_t out = (num >= 0 ? num / stride : -((-num + stride - 1) / stride)) + 1;
  if (ceil_mode && (out - 1) * stride >= in + pad) --out;
  return out;
}

void check_pool_input(IntArrayRef x, const std::string& op, const char* what = "input") {
  const int64_t d = static_cast<int64_t>(x.size());
  KILN_CHECK((d == 3 || d == 4) && x[d - 1] > 0 && x[d - 2] > 0 && x[d - 3] > 0, ShapeError,
             "[kiln::" + op + "] expected 3D or 4D (batch mode) tensor with optional 0 dim batch size for " + what +
                 ", but got " + shape_str(x) + ".");
}

// Validates the window parameters and returns the output sizes (input's leading dims kept).
std::vector<int64_t> pool_output_sizes(IntArrayRef x, const PoolParams& p, const std::string& op, bool is_max) {
  check_pool_input(x, op);
  KILN_CHECK(p.kernel[0] > 0 && p.kernel[1] > 0, ValueError,
             "[kiln::" + op + "] kernel size should be greater than zero, but got " + pair_str(p.kernel) + ".");
  KILN_CHECK(p.stride[0] > 0 && p.stride[1] > 0, ValueError,
             "[kiln::" + op + "] stride should be greater than zero, but got " + pair_str(p.stride) + ".");
  KILN_CHECK(p.dilation[0] > 0 && p.dilation[1] > 0, ValueError,
             "[kiln::" + op + "] dilation should be greater than zero, but got " + pair_str(p.dilation) + ".");
  KILN_CHECK(p.padding[0] >= 0 && p.padding[1] >= 0, ValueError,
             "[kiln::" + op + "] padding must be non-negative, but got " + pair_str(p.padding) + ".");
  for (int d = 0; d < 2; ++d) {
    const int64_t effective = is_max ? (p.kernel[d] - 1) * p.dilation[d] + 1 : p.kernel[d];
    KILN_CHECK(p.padding[d] <= effective / 2, ValueError,
               "[kiln::" + op + "] pad should be at most half of effective kernel size, but got pad=" +
                   pair_str(p.padding) + ", kernel_size=" + pair_str(p.kernel) + " and dilation=" +
                   pair_str(p.dilation) + ".");
  }
  const int64_t h = x[x.size() - 2], w = x[x.size() - 1];
  const int64_t oh = pooled_size(h, p.kernel[0], p.padding[0], p.stride[0], p.dilation[0], p.ceil_mode);
  const int64_t ow = pooled_size(w, p.kernel[1], p.padding[1], p.stride[1], p.dilation[1], p.ceil_mode);
  KILN_CHECK(oh >= 1 && ow >= 1, ShapeError,
             "[kiln::" + op + "] given input size " + shape_str(x) + ", the calculated output size (" +
                 std::to_string(oh) + " x " + std::to_string(ow) +
                 ") is too small. Use a smaller kernel, more padding or ceil_mode.");
  std::vector<int64_t> sizes(x.begin(), x.end() - 2);
  sizes.push_back(oh);
  sizes.push_back(ow);
  return sizes;
}

// Attrs from `first`: kernel_size, stride (empty: kernel_size), padding, dilation, ceil_mode.
PoolParams max_pool_params(const AttrAccess& c, const std::string& op, size_t first = 0) {
  PoolParams p;
  p.kernel = expand_pair(c.ints_attr(first), op, "kernel_size");
  p.stride = c.ints_attr(first + 1).empty() ? p.kernel : expand_pair(c.ints_attr(first + 1), op, "stride");
  p.padding = expand_pair(c.ints_attr(first + 2), op, "padding");
  p.dilation = expand_pair(c.ints_attr(first + 3), op, "dilation");
  p.ceil_mode = c.bool_attr(first + 4);
  return p;
}

// Attrs from `first`: kernel_size, stride (empty: kernel_size), padding, ceil_mode,
// count_include_pad, divisor_override (None or a non-zero int).
PoolParams avg_pool_params(const AttrAccess& c, const std::string& op, size_t first = 0) {
  PoolParams p;
  p.kernel = expand_pair(c.ints_attr(first), op, "kernel_size");
  p.stride = c.ints_attr(first + 1).empty() ? p.kernel : expand_pair(c.ints_attr(first + 1), op, "stride");
  p.padding = expand_pair(c.ints_attr(first + 2), op, "padding");
  p.dilation = {1, 1};
  p.ceil_mode = c.bool_attr(first + 3);
  KILN_CHECK(!c.has_attr(first + 5) || c.int_attr(first + 5) != 0, ValueError,
             "[kiln::" + op + "] divisor must be not zero. Pass divisor_override = None to divide by the window size.");
  return p;
}

void check_max_pool_dtype(const Tensor& x, const std::string& op) {
  KILN_CHECK(x.dtype() != DType::bool_, DTypeError,
             "[kiln::" + op + "] not implemented for dtype bool. Convert the input with .to(...).");
}

void check_float_pool_dtype(const Tensor& x, const std::string& op) {
  KILN_CHECK(is_floating_point(x.dtype()), DTypeError,
             "[kiln::" + op + "] not implemented for dtype " + dtype_str(x.dtype()) +
                 ". Convert the input to a floating-point dtype.");
}

// A pooling backward's grad_output must have the shape the forward produces from input_sizes.
void check_pool_grad(const Tensor& grad, IntArrayRef expected, const std::string& op) {
  KILN_CHECK(grad.sizes() == expected, ShapeError,
             "[kiln::" + op + "] grad_output has shape " + shape_str(grad.sizes()) + " but the pooling's output has "
             "shape " + shape_str(expected) + ". Pass the gradient of the forward's output.");
}

// The gradient of the input of max pooling: grad scattered to the saved argmax positions.
Tensor max_pool_input_grad(const Tensor& grad, const Tensor& indices, const BackwardContext& c) {
  std::vector<Attr> attrs{c.input_info[0].sizes};
  attrs.insert(attrs.end(), c.attrs.begin(), c.attrs.begin() + 5);
  return call_op1(max_pool2d_with_indices_backward_op(), {grad, indices}, std::move(attrs));
}

const OpDef& kMaxPool2d = register_op({
    .name = "max_pool2d",
    .schema = "max_pool2d(Tensor self, int[2] kernel_size, int[2] stride=[], int[2] padding=0, "
              "int[2] dilation=1, bool ceil_mode=False) -> Tensor",
    .meta = [](const OpCall& c) -> std::vector<TensorMeta> {
      const Tensor& x = c.input(0);
      check_max_pool_dtype(x, "max_pool2d");
      auto sizes = pool_output_sizes(x.sizes(), max_pool_params(c, "max_pool2d"), "max_pool2d", true);
      auto strides = detail::strides_following(x.sizes(), x.strides(), sizes);
      return {TensorMeta{std::move(sizes), std::move(strides), x.dtype(), x.device()}};
    },
    // The eager front-end records max_pool2d_with_indices instead; this path (a direct call_op)
    // recomputes the indices.
    .derivative = {.formula = "self: max_pool2d_with_indices_backward(grad, self.sizes(), ..., "
                              "max_pool2d_with_indices(self, ...)[1])",
                   .save_inputs = {0},
                   .fn = [](const BackwardContext& c) -> TensorList {
                     if (!c.needs_grad(0)) return {};
                     Tensor indices;
                     {
                       NoGradGuard no_grad;
                       indices = call_op(max_pool2d_with_indices_op(), {c.input(0)},
                                         std::vector<Attr>(c.attrs.begin(), c.attrs.end()))[1];
                     }
                     return {max_pool_input_grad(c.grad(), indices, c)};
                   }},
    .lowering = lowering::Extern{},
});

// Indices are flat positions in the input's H * W plane (int64), as PyTorch returns them.
const OpDef& kMaxPool2dWithIndices = register_op({
    .name = "max_pool2d_with_indices",
    .schema = "max_pool2d_with_indices(Tensor self, int[2] kernel_size, int[2] stride=[], int[2] padding=0, "
              "int[2] dilation=1, bool ceil_mode=False) -> (Tensor, Tensor)",
    .meta = [](const OpCall& c) -> std::vector<TensorMeta> {
      const Tensor& x = c.input(0);
      check_max_pool_dtype(x, "max_pool2d_with_indices");
      auto sizes = pool_output_sizes(x.sizes(), max_pool_params(c, "max_pool2d_with_indices"),
                                     "max_pool2d_with_indices", true);
      // Indices share the output's layout (their values stay flat h * W + w offsets).
      auto strides = detail::strides_following(x.sizes(), x.strides(), sizes);
      return {TensorMeta{sizes, strides, x.dtype(), x.device()}, TensorMeta{sizes, strides, kInt64, x.device()}};
    },
    .derivative = {.formula = "self: max_pool2d_with_indices_backward(grad, self.sizes(), kernel_size, stride, "
                              "padding, dilation, ceil_mode, indices)",
                   .save_outputs = {1},
                   .fn = [](const BackwardContext& c) -> TensorList {
                     if (!c.needs_grad(0)) return {};
                     return {max_pool_input_grad(c.grad(0), c.output(1), c)};
                   }},
    .lowering = lowering::Extern{},
});

// max_pool2d_with_indices_backward(grad_output, indices, input_sizes, kernel_size, stride, padding,
// dilation, ceil_mode): zeros of input_sizes with grad_output added at each window's argmax (aten
// passes self; Kiln passes its sizes, so the forward node need not keep the input alive).
const OpDef& kMaxPool2dWithIndicesBackward = register_op({
    .name = "max_pool2d_with_indices_backward",
    .schema = "max_pool2d_with_indices_backward(Tensor grad_output, Tensor indices, int[] input_sizes, "
              "int[2] kernel_size, int[2] stride, int[2] padding, int[2] dilation, bool ceil_mode) -> Tensor",
    .meta = [](const OpCall& c) -> std::vector<TensorMeta> {
      const std::string op = "max_pool2d_with_indices_backward";
      const Tensor& grad = c.input(0);
      const Tensor& indices = c.input(1);
      check_float_pool_dtype(grad, op);
      check_same_device(op, {&grad, &indices});
      KILN_CHECK(indices.dtype() == kInt64, DTypeError,
                 "[kiln::" + op + "] indices must be int64, but got " + dtype_str(indices.dtype()) +
                     ". Pass the indices max_pool2d_with_indices returned.");
      IntArrayRef input_sizes = c.ints_attr(0);
      check_pool_grad(grad, pool_output_sizes(input_sizes, max_pool_params(c, op, 1), op, true), op);
      KILN_CHECK(indices.sizes() == grad.sizes(), ShapeError,
                 "[kiln::" + op + "] indices of shape " + shape_str(indices.sizes()) +
                     " do not match grad_output of shape " + shape_str(grad.sizes()) + ".");
      // The indices have the forward input's layout (grad_output may not: mixed layouts).
      return {TensorMeta{input_sizes.vec(), detail::strides_following(indices.sizes(), indices.strides(), input_sizes),
                         grad.dtype(), grad.device()}};
    },
    .derivative = {.formula = "grad_output: ggI.flatten(-2).gather(-1, indices.flatten(-2)).view_as(grad_output)",
                   .save_inputs = {1},
                   .fn = [](const BackwardContext& c) -> TensorList {
                     if (!c.needs_grad(0)) return {};
                     const Tensor& indices = c.input(1);
                     return {c.grad().flatten(-2).gather(-1, indices.flatten(-2)).view(indices.sizes())};
                   }},
    .lowering = lowering::Extern{},
});

const OpDef& kAvgPool2d = register_op({
    .name = "avg_pool2d",
    .schema = "avg_pool2d(Tensor self, int[2] kernel_size, int[2] stride=[], int[2] padding=0, "
              "bool ceil_mode=False, bool count_include_pad=True, int? divisor_override=None) -> Tensor",
    .meta = [](const OpCall& c) -> std::vector<TensorMeta> {
      const Tensor& x = c.input(0);
      check_float_pool_dtype(x, "avg_pool2d");
      auto sizes = pool_output_sizes(x.sizes(), avg_pool_params(c, "avg_pool2d"), "avg_pool2d", false);
      auto strides = detail::strides_following(x.sizes(), x.strides(), sizes);
      return {TensorMeta{std::move(sizes), std::move(strides), x.dtype(), x.device()}};
    },
    .derivative = {.formula = "self: avg_pool2d_backward(grad, self.sizes(), kernel_size, stride, padding, "
                              "ceil_mode, count_include_pad, divisor_override)",
                   .fn = [](const BackwardContext& c) -> TensorList {
                     if (!c.needs_grad(0)) return {};
                     std::vector<Attr> attrs{c.input_info[0].sizes};
                     attrs.insert(attrs.end(), c.attrs.begin(), c.attrs.end());
                     return {call_op1(avg_pool2d_backward_op(), {c.grad()}, std::move(attrs))};
                   }},
    .lowering = lowering::Extern{},
});

// avg_pool2d_backward(grad_output, input_sizes, kernel_size, stride, padding, ceil_mode,
// count_include_pad, divisor_override): each output's gradient spread evenly (by the forward's
// divisor) over the input positions its window covers.
const OpDef& kAvgPool2dBackward = register_op({
    .name = "avg_pool2d_backward",
    .schema = "avg_pool2d_backward(Tensor grad_output, int[] input_sizes, int[2] kernel_size, int[2] stride, "
              "int[2] padding, bool ceil_mode, bool count_include_pad, int? divisor_override) -> Tensor",
    .meta = [](const OpCall& c) -> std::vector<TensorMeta> {
      const std::string op = "avg_pool2d_backward";
      const Tensor& grad = c.input(0);
      check_float_pool_dtype(grad, op);
      IntArrayRef input_sizes = c.ints_attr(0);
      check_pool_grad(grad, pool_output_sizes(input_sizes, avg_pool_params(c, op, 1), op, false), op);
      return {TensorMeta{input_sizes.vec(), detail::strides_following(grad.sizes(), grad.strides(), input_sizes),
                         grad.dtype(), grad.device()}};
    },
    .derivative = {.formula = "grad_output: avg_pool2d(ggI, kernel_size, stride, padding, ceil_mode, "
                              "count_include_pad, divisor_override)",
                   .fn = [](const BackwardContext& c) -> TensorList {
                     if (!c.needs_grad(0)) return {};
                     return {call_op1(avg_pool2d_op(), {c.grad()}, std::vector<Attr>(c.attrs.begin() + 1, c.attrs.end()))};
                   }},
    .lowering = lowering::Extern{},
});

const OpDef& kAdaptiveAvgPool2d = register_op({
    .name = "adaptive_avg_pool2d",
    .schema = "adaptive_avg_pool2d(Tensor self, int[2] output_size) -> Tensor",
    .meta = [](const OpCall& c) -> std::vector<TensorMeta> {
      const Tensor& x = c.input(0);
      check_pool_input(x.sizes(), "adaptive_avg_pool2d");
      check_float_pool_dtype(x, "adaptive_avg_pool2d");
      Pair out = expand_pair(c.ints_attr(0), "adaptive_avg_pool2d", "output_size");
      KILN_CHECK(out[0] >= 0 && out[1] >= 0, ValueError,
                 "[kiln::adaptive_avg_pool2d] elements of output_size must be greater than or equal to 0, but "
                 "got " + pair_str(out) + ".");
      std::vector<int64_t> sizes(x.sizes().begin(), x.sizes().end() - 2);
      sizes.push_back(out[0]);
      sizes.push_back(out[1]);
      auto strides = detail::strides_following(x.sizes(), x.strides(), sizes);
      return {TensorMeta{std::move(sizes), std::move(strides), x.dtype(), x.device()}};
    },
    .derivative = {.formula = "self: adaptive_avg_pool2d_backward(grad, self.sizes())",
                   .fn = [](const BackwardContext& c) -> TensorList {
                     if (!c.needs_grad(0)) return {};
                     return {call_op1(adaptive_avg_pool2d_backward_op(), {c.grad()}, {c.input_info[0].sizes})};
                   }},
    .lowering = detail::adaptive_avg_pool2d_decomposition(),
});

// adaptive_avg_pool2d_backward(grad_output, input_sizes): each output's gradient spread evenly over
// its adaptive window (windows may overlap; contributions add).
const OpDef& kAdaptiveAvgPool2dBackward = register_op({
    .name = "adaptive_avg_pool2d_backward",
    .schema = "adaptive_avg_pool2d_backward(Tensor grad_output, int[] input_sizes) -> Tensor",
    .meta = [](const OpCall& c) -> std::vector<TensorMeta> {
      const std::string op = "adaptive_avg_pool2d_backward";
      const Tensor& grad = c.input(0);
      check_float_pool_dtype(grad, op);
      IntArrayRef input_sizes = c.ints_attr(0);
      check_pool_input(input_sizes, op, "input_sizes");
      KILN_CHECK(grad.dim() == static_cast<int64_t>(input_sizes.size()) &&
                     std::equal(input_sizes.begin(), input_sizes.end() - 2, grad.sizes().begin()),
                 ShapeError,
                 "[kiln::" + op + "] grad_output of shape " + shape_str(grad.sizes()) +
                     " does not match the input's leading dims " + shape_str(input_sizes) + ".");
      return {TensorMeta{input_sizes.vec(), detail::strides_following(grad.sizes(), grad.strides(), input_sizes),
                         grad.dtype(), grad.device()}};
    },
    .derivative = {.formula = "grad_output: adaptive_avg_pool2d(ggI, grad_output.sizes()[-2:])",
                   .fn = [](const BackwardContext& c) -> TensorList {
                     if (!c.needs_grad(0)) return {};
                     const auto& s = c.input_info[0].sizes;
                     return {call_op1(adaptive_avg_pool2d_op(), {c.grad()},
                                      {std::vector<int64_t>{s[s.size() - 2], s[s.size() - 1]}})};
                   }},
    .lowering = lowering::Extern{},
});

const OpDef& max_pool2d_with_indices_op() { return kMaxPool2dWithIndices; }
const OpDef& max_pool2d_with_indices_backward_op() { return kMaxPool2dWithIndicesBackward; }
const OpDef& avg_pool2d_op() { return kAvgPool2d; }
const OpDef& avg_pool2d_backward_op() { return kAvgPool2dBackward; }
const OpDef& adaptive_avg_pool2d_op() { return kAdaptiveAvgPool2d; }
const OpDef& adaptive_avg_pool2d_backward_op() { return kAdaptiveAvgPool2dBackward; }

std::vector<Attr> max_pool_attrs(IntArrayRef kernel_size, IntArrayRef stride, IntArrayRef padding,
                                 IntArrayRef dilation, bool ceil_mode) {
  return {kernel_size.vec(), stride.vec(), padding.vec(), dilation.vec(), ceil_mode};
}

}  // namespace

// ---------------- front-ends ----------------

Tensor conv2d(const Tensor& input, const Tensor& weight, const Tensor& bias, IntArrayRef stride,
              IntArrayRef padding, IntArrayRef dilation, int64_t groups) {
  if (input.dim() == 3) return conv2d(input.unsqueeze(0), weight, bias, stride, padding, dilation, groups).squeeze(0);
  return call_op1(kConv2d, {input, weight, bias}, {stride.vec(), padding.vec(), dilation.vec(), groups});
}

// "same" pads by dilation * (k - 1) in total per dim; when that is odd the extra row/column goes
// to the bottom/right (as PyTorch does), which the input gets through constant_pad_nd (as aten's
// _convolution_mode) before a symmetric conv.
Tensor detail::conv2d_padding_mode(const Tensor& input, const Tensor& weight, const Tensor& bias,
                                   IntArrayRef stride, std::string_view padding, IntArrayRef dilation,
                                   int64_t groups) {
  if (padding == "valid") return conv2d(input, weight, bias, stride, IntArrayRef({0, 0}), dilation, groups);
  KILN_CHECK(padding == "same", ValueError,
             "[kiln::conv2d] invalid padding string '" + std::string(padding) + "'. Use \"same\" or \"valid\".");
  Pair s = expand_pair(stride, "conv2d", "stride");
  KILN_CHECK(s[0] == 1 && s[1] == 1, ValueError,
             "[kiln::conv2d] padding='same' is not supported for strided convolutions (stride " + pair_str(s) +
                 "). Use stride 1 or explicit padding.");
  KILN_CHECK(weight.dim() == 4, ShapeError,
             "[kiln::conv2d] weight must be 4-D (out_channels, in_channels / groups, kH, kW), but got shape " +
                 shape_str(weight.sizes()) + ".");
  KILN_CHECK(input.dim() == 3 || input.dim() == 4, ShapeError,
             "[kiln::conv2d] expected 3D (unbatched) or 4D (batched) input to conv2d, but got input of size " +
                 shape_str(input.sizes()) + ".");
  Pair d = expand_pair(dilation, "conv2d", "dilation");
  Pair sym{0, 0}, extra{0, 0};
  for (int i = 0; i < 2; ++i) {
    const int64_t total = d[i] * (weight.sizes()[2 + i] - 1);
    sym[i] = total / 2;
    extra[i] = total - 2 * sym[i];
  }
  Tensor x = input;
  if (extra[0] != 0 || extra[1] != 0) {
    // Out of place, as aten's _convolution_mode does (constant_pad_nd): autograd reaches the input
    // through the pad's derivative. (An in-place copy into a slice of a zeros tensor recorded its
    // node on the slice only, and the input got no gradient.)
    x = kiln::pad(input, std::vector<int64_t>{0, extra[1], 0, extra[0]});  // right, bottom
    if (input.suggest_memory_format() == MemoryFormat::channels_last)  // keep a channels-last input so
      x = x.contiguous(kiln::channels_last);                          // the convolution stays NHWC
  }
  return conv2d(x, weight, bias, stride, IntArrayRef({sym[0], sym[1]}), dilation, groups);
}

Tensor max_pool2d(const Tensor& input, IntArrayRef kernel_size, IntArrayRef stride, IntArrayRef padding,
                  IntArrayRef dilation, bool ceil_mode) {
  // Training keeps the argmax for backward (as aten does); inference takes the faster kernel.
  if (is_grad_enabled() && input.requires_grad())
    return call_op(kMaxPool2dWithIndices, {input}, max_pool_attrs(kernel_size, stride, padding, dilation, ceil_mode))[0];
  return call_op1(kMaxPool2d, {input}, max_pool_attrs(kernel_size, stride, padding, dilation, ceil_mode));
}

std::tuple<Tensor, Tensor> max_pool2d_with_indices(const Tensor& input, IntArrayRef kernel_size, IntArrayRef stride,
                                                   IntArrayRef padding, IntArrayRef dilation, bool ceil_mode) {
  auto outs = call_op(kMaxPool2dWithIndices, {input}, max_pool_attrs(kernel_size, stride, padding, dilation, ceil_mode));
  return {std::move(outs[0]), std::move(outs[1])};
}

Tensor avg_pool2d(const Tensor& input, IntArrayRef kernel_size, IntArrayRef stride, IntArrayRef padding,
                  bool ceil_mode, bool count_include_pad, std::optional<int64_t> divisor_override) {
  std::vector<Attr> attrs{kernel_size.vec(), stride.vec(), padding.vec(), ceil_mode, count_include_pad};
  attrs.emplace_back();  // divisor_override: None unless given
  if (divisor_override) attrs.back().emplace<int64_t>(*divisor_override);
  return call_op1(kAvgPool2d, {input}, std::move(attrs));
}

Tensor adaptive_avg_pool2d(const Tensor& input, IntArrayRef output_size) {
  return call_op1(kAdaptiveAvgPool2d, {input}, {output_size.vec()});
}

}  // namespace kiln
