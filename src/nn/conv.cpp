// Conv2d and the pooling modules.
#include "kiln/nn/conv.h"

#include <cmath>

#include "kiln/nn/functional.h"
#include "kiln/nn/init.h"
#include "kiln/ops.h"

namespace kiln::nn {

namespace F = functional;

std::string Size2::str() const {
  return single_ ? std::to_string(values_[0]) : tuple_str();
}

std::string Size2::tuple_str() const {
  // Appended piece by piece: GCC 12's -Wrestrict misfires on "(" + to_string(...).
  std::string s = "(";
  s += std::to_string(values_[0]);
  s += ", ";
  s += std::to_string(values_[1]);
  s += ')';
  return s;
}

namespace {
void check_positive(const Size2& v, const char* module, const char* what) {
  KILN_CHECK(v[0] > 0 && v[1] > 0, ValueError,
             std::string("[kiln::nn::") + module + "] " + what + " must be positive, but got " +
                 v.str() + ".");
}
void check_non_negative(const Size2& v, const char* module, const char* what) {
  KILN_CHECK(v[0] >= 0 && v[1] >= 0, ValueError,
             std::string("[kiln::nn::") + module + "] " + what + " must be non-negative, but got " +
                 v.str() + ".");
}
}  // namespace

// ---------------- Conv2d ----------------

Conv2d::Conv2d(const Conv2dOptions& opts) : options(opts), reversed_padding_{0, 0, 0, 0} {
  const std::string tag = "[kiln::nn::Conv2d] ";
  const Conv2dOptions& o = options;
  KILN_CHECK(o.groups > 0, ValueError,
             tag + "groups must be a positive integer, but got " + std::to_string(o.groups) + ".");
  KILN_CHECK(o.in_channels >= 0 && o.out_channels >= 0, ValueError,
             tag + "in_channels and out_channels must be non-negative, but got " +
                 std::to_string(o.in_channels) + " and " + std::to_string(o.out_channels) + ".");
  KILN_CHECK(o.in_channels % o.groups == 0, ValueError,
             tag + "in_channels must be divisible by groups (in_channels=" +
                 std::to_string(o.in_channels) + ", groups=" + std::to_string(o.groups) + ").");
  KILN_CHECK(o.out_channels % o.groups == 0, ValueError,
             tag + "out_channels must be divisible by groups (out_channels=" +
                 std::to_string(o.out_channels) + ", groups=" + std::to_string(o.groups) + ").");
  check_positive(o.kernel_size, "Conv2d", "kernel_size");
  check_positive(o.stride, "Conv2d", "stride");
  check_positive(o.dilation, "Conv2d", "dilation");
  if (o.padding.is_mode()) {
    KILN_CHECK(o.padding.mode() == "same" || o.padding.mode() == "valid", ValueError,
               tag + "Invalid padding string '" + o.padding.mode() +
                   "', should be one of {'valid', 'same'}.");
    KILN_CHECK(o.padding.mode() != "same" || (o.stride[0] == 1 && o.stride[1] == 1), ValueError,
               tag +
                   "padding='same' is not supported for strided convolutions. Use stride 1 or "
                   "explicit padding.");
  } else {
    check_non_negative(o.padding.size(), "Conv2d", "padding");
  }
  KILN_CHECK(o.padding_mode == "zeros" || o.padding_mode == "reflect" ||
                 o.padding_mode == "replicate" || o.padding_mode == "circular",
             ValueError,
             tag +
                 "padding_mode must be one of {'zeros', 'reflect', 'replicate', 'circular'}, but "
                 "got padding_mode='" +
                 o.padding_mode + "'.");
  // (left, right, top, bottom), as F.pad takes them, for the non-zero padding modes.
  if (o.padding.mode() == "same") {
    for (int i = 0; i < 2; ++i) {
      const int64_t total = o.dilation[i] * (o.kernel_size[i] - 1);
      const int64_t left = total / 2;
      const int slot = 2 * (1 - i);
      reversed_padding_[slot] = left;
      reversed_padding_[slot + 1] = total - left;
    }
  } else if (!o.padding.is_mode()) {
    reversed_padding_ = {o.padding.size()[1], o.padding.size()[1], o.padding.size()[0],
                         o.padding.size()[0]};
  }

  weight = register_parameter("weight", empty({o.out_channels, o.in_channels / o.groups,
                                               o.kernel_size[0], o.kernel_size[1]}));
  bias = register_parameter("bias", o.bias ? empty({o.out_channels}) : Tensor());
  reset_parameters();
}

Conv2d::Conv2d(int64_t in_channels, int64_t out_channels, Size2 kernel_size, Size2 stride,
               Conv2dPadding padding, Size2 dilation, int64_t groups, bool bias,
               std::string padding_mode)
    : Conv2d(Conv2dOptions{in_channels, out_channels, kernel_size, stride, std::move(padding),
                           dilation, groups, bias, std::move(padding_mode)}) {}

void Conv2d::reset_parameters() {
  init::kaiming_uniform_(weight, std::sqrt(5.0));
  if (bias.defined()) {
    const int64_t fan_in =
        weight.numel() == 0 ? 0 : init::calculate_fan_in_and_fan_out(weight).first;
    const double bound = fan_in > 0 ? 1.0 / std::sqrt(static_cast<double>(fan_in)) : 0.0;
    init::uniform_(bias, -bound, bound);
  }
}

Tensor Conv2d::forward(const Tensor& input) {
  const Conv2dOptions& o = options;
  if (o.padding_mode != "zeros") {
    Tensor padded = F::pad(input, IntArrayRef(reversed_padding_.data(), 4), o.padding_mode);
    return F::conv2d(padded, weight, bias, o.stride.ref(), IntArrayRef({0, 0}), o.dilation.ref(),
                     o.groups);
  }
  if (o.padding.is_mode())
    return F::conv2d(input, weight, bias, o.stride.ref(), o.padding.mode(), o.dilation.ref(),
                     o.groups);
  return F::conv2d(input, weight, bias, o.stride.ref(), o.padding.size().ref(), o.dilation.ref(),
                   o.groups);
}

std::string Conv2d::extra_repr() const {
  const Conv2dOptions& o = options;
  std::string s = std::to_string(o.in_channels) + ", " + std::to_string(o.out_channels) +
                  ", kernel_size=" + o.kernel_size.tuple_str() + ", stride=" + o.stride.tuple_str();
  if (o.padding.is_mode()) {
    s += ", padding=" + o.padding.mode();
  } else if (o.padding.size()[0] != 0 || o.padding.size()[1] != 0) {
    s += ", padding=" + o.padding.size().tuple_str();
  }
  if (o.dilation[0] != 1 || o.dilation[1] != 1) s += ", dilation=" + o.dilation.tuple_str();
  if (o.groups != 1) s += ", groups=" + std::to_string(o.groups);
  if (!bias.defined()) s += ", bias=False";
  if (o.padding_mode != "zeros") s += ", padding_mode=" + o.padding_mode;
  return s;
}

// ---------------- pooling ----------------

MaxPool2d::MaxPool2d(const MaxPool2dOptions& opts) : options(opts) {
  if (!options.stride) options.stride = options.kernel_size;
  check_positive(options.kernel_size, "MaxPool2d", "kernel_size");
}

MaxPool2d::MaxPool2d(Size2 kernel_size, std::optional<Size2> stride, Size2 padding, Size2 dilation)
    : MaxPool2d(MaxPool2dOptions{kernel_size, stride, padding, dilation}) {}

Tensor MaxPool2d::forward(const Tensor& input) {
  return F::max_pool2d(input, options.kernel_size.ref(), options.stride->ref(),
                       options.padding.ref(), options.dilation.ref(), options.ceil_mode);
}

std::tuple<Tensor, Tensor> MaxPool2d::forward_with_indices(const Tensor& input) {
  return F::max_pool2d_with_indices(input, options.kernel_size.ref(), options.stride->ref(),
                                    options.padding.ref(), options.dilation.ref(),
                                    options.ceil_mode);
}

std::string MaxPool2d::extra_repr() const {
  return "kernel_size=" + options.kernel_size.str() + ", stride=" + options.stride->str() +
         ", padding=" + options.padding.str() + ", dilation=" + options.dilation.str() +
         ", ceil_mode=" + python_bool_repr(options.ceil_mode);
}

AvgPool2d::AvgPool2d(const AvgPool2dOptions& opts) : options(opts) {
  if (!options.stride) options.stride = options.kernel_size;
  check_positive(options.kernel_size, "AvgPool2d", "kernel_size");
}

AvgPool2d::AvgPool2d(Size2 kernel_size, std::optional<Size2> stride, Size2 padding)
    : AvgPool2d(AvgPool2dOptions{kernel_size, stride, padding}) {}

Tensor AvgPool2d::forward(const Tensor& input) {
  return F::avg_pool2d(input, options.kernel_size.ref(), options.stride->ref(),
                       options.padding.ref(), options.ceil_mode, options.count_include_pad,
                       options.divisor_override);
}

std::string AvgPool2d::extra_repr() const {
  return "kernel_size=" + options.kernel_size.str() + ", stride=" + options.stride->str() +
         ", padding=" + options.padding.str();
}

AdaptiveAvgPool2d::AdaptiveAvgPool2d(Size2 size) : output_size(size) {
  check_non_negative(output_size, "AdaptiveAvgPool2d", "output_size");
}

Tensor AdaptiveAvgPool2d::forward(const Tensor& input) {
  return F::adaptive_avg_pool2d(input, output_size.ref());
}

std::string AdaptiveAvgPool2d::extra_repr() const {
  return "output_size=" + output_size.str();
}

}  // namespace kiln::nn
