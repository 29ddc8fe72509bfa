// Convolution and pooling. Table ops: conv2d, max_pool2d, max_pool2d_with_indices, avg_pool2d,
// adaptive_avg_pool2d. The string-padding conv2d ("same"/"valid") is a front-end over conv2d.
// Inputs and outputs are plain NCHW tensors; the kernels (oneDNN, with loop fallbacks) choose
// their own internal layouts.
#include <array>

#include "core/shape.h"
#include "kiln/op_table.h"
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

void check_same_device(const std::string& op, std::initializer_list<const Tensor*> tensors) {
  const Tensor* first = nullptr;
  for (const Tensor* t : tensors) {
    if (!t->defined()) continue;
    if (!first) {
      first = t;
      continue;
    }
    KILN_CHECK(t->device() == first->device(), DeviceError,
               "[kiln::" + op + "] expected all tensors to be on the same device, but found at least "
               "two devices, " + first->device().str() + " and " + t->device().str() +
                   ". Move them to one device with .to(...).");
  }
}

// ---------------- conv2d ----------------

// conv2d(input, weight, bias?, stride, padding, dilation, groups): input (N, C, H, W), weight
// (O, C / groups, kH, kW), symmetric zero padding.
const OpDef& kConv2d = register_op({
    .name = "conv2d",
    .schema = "conv2d(Tensor input, Tensor weight, Tensor? bias=None, int[2] stride=1, int[2] padding=0, "
              "int[2] dilation=1, int groups=1) -> Tensor",
    .meta = [](const OpCall& c) -> std::vector<TensorMeta> {
      const Tensor& x = c.input(0);
      const Tensor& w = c.input(1);
      const Tensor& b = c.input(2);
      KILN_CHECK(x.dim() == 4, ShapeError,
                 "[kiln::conv2d] expected 3D (unbatched) or 4D (batched) input to conv2d, but got input of "
                 "size " + shape_str(x.sizes()) + ".");
      KILN_CHECK(w.dim() == 4, ShapeError,
                 "[kiln::conv2d] weight must be 4-D (out_channels, in_channels / groups, kH, kW), but got "
                 "shape " + shape_str(w.sizes()) + ".");
      check_same_device("conv2d", {&x, &w, &b});
      KILN_CHECK(is_floating_point(x.dtype()), DTypeError,
                 "[kiln::conv2d] not implemented for dtype " + dtype_str(x.dtype()) +
                     ". Convert the input to a floating-point dtype.");
      KILN_CHECK(w.dtype() == x.dtype(), DTypeError,
                 "[kiln::conv2d] input type (" + dtype_str(x.dtype()) + ") and weight type (" +
                     dtype_str(w.dtype()) + ") should be the same. Convert one with .to(...).");
      KILN_CHECK(!b.defined() || b.dtype() == x.dtype(), DTypeError,
                 "[kiln::conv2d] input type (" + dtype_str(x.dtype()) + ") and bias type (" +
                     dtype_str(b.dtype()) + ") should be the same. Convert one with .to(...).");
      Pair stride = expand_pair(c.ints_attr(0), "conv2d", "stride");
      Pair padding = expand_pair(c.ints_attr(1), "conv2d", "padding");
      Pair dilation = expand_pair(c.ints_attr(2), "conv2d", "dilation");
      const int64_t groups = c.int_attr(3);
      KILN_CHECK(groups > 0, ValueError, "[kiln::conv2d] non-positive groups is not supported (got " +
                                             std::to_string(groups) + ").");
      KILN_CHECK(stride[0] > 0 && stride[1] > 0, ValueError,
                 "[kiln::conv2d] non-positive stride is not supported (got " + pair_str(stride) + ").");
      KILN_CHECK(padding[0] >= 0 && padding[1] >= 0, ValueError,
                 "[kiln::conv2d] negative padding is not supported (got " + pair_str(padding) + ").");
      KILN_CHECK(dilation[0] > 0 && dilation[1] > 0, ValueError,
                 "[kiln::conv2d] dilation should be greater than zero (got " + pair_str(dilation) + ").");
      const int64_t out_channels = w.sizes()[0];
      KILN_CHECK(w.sizes()[2] > 0 && w.sizes()[3] > 0, ShapeError,
                 "[kiln::conv2d] kernel size must be positive, but weight has shape " + shape_str(w.sizes()) + ".");
      KILN_CHECK(out_channels % groups == 0, ShapeError,
                 "[kiln::conv2d] given groups=" + std::to_string(groups) + ", expected weight to be divisible by " +
                     std::to_string(groups) + " at dimension 0, but got weight of size " + shape_str(w.sizes()) +
                     " instead.");
      KILN_CHECK(x.sizes()[1] == w.sizes()[1] * groups, ShapeError,
                 "[kiln::conv2d] given groups=" + std::to_string(groups) + ", weight of size " +
                     shape_str(w.sizes()) + ", expected input " + shape_str(x.sizes()) + " to have " +
                     std::to_string(w.sizes()[1] * groups) + " channels, but got " +
                     std::to_string(x.sizes()[1]) + " channels instead.");
      KILN_CHECK(!b.defined() || (b.dim() == 1 && b.sizes()[0] == out_channels), ShapeError,
                 "[kiln::conv2d] given weight of size " + shape_str(w.sizes()) +
                     ", expected bias to be 1-dimensional with " + std::to_string(out_channels) +
                     " elements, but got bias of size " + (b.defined() ? shape_str(b.sizes()) : "") + " instead.");
      std::vector<int64_t> sizes{x.sizes()[0], out_channels, 0, 0};
      for (int d = 0; d < 2; ++d) {
        const int64_t padded = x.sizes()[2 + d] + 2 * padding[d];
        const int64_t kernel = dilation[d] * (w.sizes()[2 + d] - 1) + 1;
        KILN_CHECK(padded >= kernel, ShapeError,
                   "[kiln::conv2d] calculated padded input size per channel: (" +
                       std::to_string(x.sizes()[2] + 2 * padding[0]) + " x " +
                       std::to_string(x.sizes()[3] + 2 * padding[1]) + "). Kernel size: (" +
                       std::to_string(dilation[0] * (w.sizes()[2] - 1) + 1) + " x " +
                       std::to_string(dilation[1] * (w.sizes()[3] - 1) + 1) +
                       "). Kernel size can't be greater than actual input size.");
        sizes[2 + d] = (padded - kernel) / stride[d] + 1;
      }
      return {TensorMeta{std::move(sizes), {}, x.dtype(), x.device()}};
    },
    .lowering = "extern",
});

// ---------------- pooling ----------------

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

void check_pool_input(const Tensor& x, const std::string& op) {
  KILN_CHECK((x.dim() == 3 || x.dim() == 4) && x.sizes()[x.dim() - 1] > 0 && x.sizes()[x.dim() - 2] > 0 &&
                 x.sizes()[x.dim() - 3] > 0,
             ShapeError,
             "[kiln::" + op + "] expected 3D or 4D (batch mode) tensor with optional 0 dim batch size for "
             "input, but got " + shape_str(x.sizes()) + ".");
}

// Validates the window parameters and returns the output sizes (input's leading dims kept).
std::vector<int64_t> pool_output_sizes(const Tensor& x, const PoolParams& p, const std::string& op,
                                       bool is_max) {
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
  const int64_t h = x.sizes()[x.dim() - 2], w = x.sizes()[x.dim() - 1];
  const int64_t oh = pooled_size(h, p.kernel[0], p.padding[0], p.stride[0], p.dilation[0], p.ceil_mode);
  const int64_t ow = pooled_size(w, p.kernel[1], p.padding[1], p.stride[1], p.dilation[1], p.ceil_mode);
  KILN_CHECK(oh >= 1 && ow >= 1, ShapeError,
             "[kiln::" + op + "] given input size " + shape_str(x.sizes()) + ", the calculated output size (" +
                 std::to_string(oh) + " x " + std::to_string(ow) +
                 ") is too small. Use a smaller kernel, more padding or ceil_mode.");
  std::vector<int64_t> sizes(x.sizes().begin(), x.sizes().end() - 2);
  sizes.push_back(oh);
  sizes.push_back(ow);
  return sizes;
}

// Attrs: kernel_size, stride (empty: kernel_size), padding, dilation, ceil_mode.
PoolParams max_pool_params(const OpCall& c, const std::string& op) {
  PoolParams p;
  p.kernel = expand_pair(c.ints_attr(0), op, "kernel_size");
  p.stride = c.ints_attr(1).empty() ? p.kernel : expand_pair(c.ints_attr(1), op, "stride");
  p.padding = expand_pair(c.ints_attr(2), op, "padding");
  p.dilation = expand_pair(c.ints_attr(3), op, "dilation");
  p.ceil_mode = c.bool_attr(4);
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

const OpDef& kMaxPool2d = register_op({
    .name = "max_pool2d",
    .schema = "max_pool2d(Tensor self, int[2] kernel_size, int[2] stride=[], int[2] padding=0, "
              "int[2] dilation=1, bool ceil_mode=False) -> Tensor",
    .meta = [](const OpCall& c) -> std::vector<TensorMeta> {
      const Tensor& x = c.input(0);
      check_max_pool_dtype(x, "max_pool2d");
      auto sizes = pool_output_sizes(x, max_pool_params(c, "max_pool2d"), "max_pool2d", true);
      return {TensorMeta{std::move(sizes), {}, x.dtype(), x.device()}};
    },
    .lowering = "extern",
});

// Indices are flat positions in the input's H * W plane (int64), as PyTorch returns them.
const OpDef& kMaxPool2dWithIndices = register_op({
    .name = "max_pool2d_with_indices",
    .schema = "max_pool2d_with_indices(Tensor self, int[2] kernel_size, int[2] stride=[], int[2] padding=0, "
              "int[2] dilation=1, bool ceil_mode=False) -> (Tensor, Tensor)",
    .meta = [](const OpCall& c) -> std::vector<TensorMeta> {
      const Tensor& x = c.input(0);
      check_max_pool_dtype(x, "max_pool2d_with_indices");
      auto sizes = pool_output_sizes(x, max_pool_params(c, "max_pool2d_with_indices"), "max_pool2d_with_indices", true);
      return {TensorMeta{sizes, {}, x.dtype(), x.device()}, TensorMeta{sizes, {}, kInt64, x.device()}};
    },
    .lowering = "extern",
});

// Attrs: kernel_size, stride (empty: kernel_size), padding, ceil_mode, count_include_pad,
// divisor_override (None or a non-zero int).
const OpDef& kAvgPool2d = register_op({
    .name = "avg_pool2d",
    .schema = "avg_pool2d(Tensor self, int[2] kernel_size, int[2] stride=[], int[2] padding=0, "
              "bool ceil_mode=False, bool count_include_pad=True, int? divisor_override=None) -> Tensor",
    .meta = [](const OpCall& c) -> std::vector<TensorMeta> {
      const Tensor& x = c.input(0);
      check_float_pool_dtype(x, "avg_pool2d");
      PoolParams p;
      p.kernel = expand_pair(c.ints_attr(0), "avg_pool2d", "kernel_size");
      p.stride = c.ints_attr(1).empty() ? p.kernel : expand_pair(c.ints_attr(1), "avg_pool2d", "stride");
      p.padding = expand_pair(c.ints_attr(2), "avg_pool2d", "padding");
      p.dilation = {1, 1};
      p.ceil_mode = c.bool_attr(3);
      KILN_CHECK(!c.has_attr(5) || c.int_attr(5) != 0, ValueError,
                 "[kiln::avg_pool2d] divisor must be not zero. Pass divisor_override = None to divide by the "
                 "window size.");
      auto sizes = pool_output_sizes(x, p, "avg_pool2d", false);
      return {TensorMeta{std::move(sizes), {}, x.dtype(), x.device()}};
    },
    .lowering = "extern",
});

const OpDef& kAdaptiveAvgPool2d = register_op({
    .name = "adaptive_avg_pool2d",
    .schema = "adaptive_avg_pool2d(Tensor self, int[2] output_size) -> Tensor",
    .meta = [](const OpCall& c) -> std::vector<TensorMeta> {
      const Tensor& x = c.input(0);
      check_pool_input(x, "adaptive_avg_pool2d");
      check_float_pool_dtype(x, "adaptive_avg_pool2d");
      Pair out = expand_pair(c.ints_attr(0), "adaptive_avg_pool2d", "output_size");
      KILN_CHECK(out[0] >= 0 && out[1] >= 0, ValueError,
                 "[kiln::adaptive_avg_pool2d] elements of output_size must be greater than or equal to 0, but "
                 "got " + pair_str(out) + ".");
      std::vector<int64_t> sizes(x.sizes().begin(), x.sizes().end() - 2);
      sizes.push_back(out[0]);
      sizes.push_back(out[1]);
      return {TensorMeta{std::move(sizes), {}, x.dtype(), x.device()}};
    },
    .lowering = "extern",
});

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
// to the bottom/right (as PyTorch does), which the input gets explicitly before a symmetric conv.
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
    const int64_t hd = x.dim() - 2, wd = x.dim() - 1;
    std::vector<int64_t> sizes = x.sizes().vec();
    sizes[hd] += extra[0];
    sizes[wd] += extra[1];
    Tensor padded = zeros(sizes, TensorOptions(x.dtype(), x.device()));
    padded.narrow(hd, 0, x.sizes()[hd]).narrow(wd, 0, x.sizes()[wd]).copy_(x);
    x = padded;
  }
  return conv2d(x, weight, bias, stride, IntArrayRef({sym[0], sym[1]}), dilation, groups);
}

Tensor max_pool2d(const Tensor& input, IntArrayRef kernel_size, IntArrayRef stride, IntArrayRef padding,
                  IntArrayRef dilation, bool ceil_mode) {
  return call_op1(kMaxPool2d, {input}, max_pool_attrs(kernel_size, stride, padding, dilation, ceil_mode));
}

std::tuple<Tensor, Tensor> max_pool2d_with_indices(const Tensor& input, IntArrayRef kernel_size, IntArrayRef stride,
                                                   IntArrayRef padding, IntArrayRef dilation, bool ceil_mode) {
  auto outs = call_op(kMaxPool2dWithIndices, {input}, max_pool_attrs(kernel_size, stride, padding, dilation, ceil_mode));
  return {std::move(outs[0]), std::move(outs[1])};
}

Tensor avg_pool2d(const Tensor& input, IntArrayRef kernel_size, IntArrayRef stride, IntArrayRef padding,
                  bool ceil_mode, bool count_include_pad, std::optional<int64_t> divisor_override) {
  Attr divisor = divisor_override ? Attr(*divisor_override) : Attr();
  return call_op1(kAvgPool2d, {input},
                  {kernel_size.vec(), stride.vec(), padding.vec(), ceil_mode, count_include_pad, divisor});
}

Tensor adaptive_avg_pool2d(const Tensor& input, IntArrayRef output_size) {
  return call_op1(kAdaptiveAvgPool2d, {input}, {output_size.vec()});
}

}  // namespace kiln
