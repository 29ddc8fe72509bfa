// Convolution and pooling layers: Conv2d, MaxPool2d, AvgPool2d, AdaptiveAvgPool2d.
#pragma once

#include <array>
#include <optional>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>

#include "kiln/nn/module.h"

namespace kiln::nn {

// A 2-D size given as one number (kernel_size = 3, used for both dims) or two
// (kernel_size = {3, 2}), like PyTorch's int-or-tuple arguments. It remembers the form it was
// given in, because PyTorch's pooling layers print it back that way.
class Size2 {
 public:
  Size2(int64_t v) : values_{v, v}, single_(true) {}  // NOLINT: implicit on purpose
  Size2(int64_t h, int64_t w) : values_{h, w}, single_(false) {}
  int64_t operator[](size_t i) const { return values_[i]; }
  IntArrayRef ref() const { return IntArrayRef(values_.data(), 2); }
  bool is_single() const { return single_; }
  std::string str() const;        // as given: "3" or "(3, 2)"
  std::string tuple_str() const;  // always a pair: "(3, 3)"

 private:
  std::array<int64_t, 2> values_;
  bool single_;
};

// Conv2d's padding: a number, a pair, or the string "same" / "valid".
class Conv2dPadding {
 public:
  Conv2dPadding(int64_t v) : size_(v) {}  // NOLINT: implicit on purpose
  Conv2dPadding(int64_t h, int64_t w) : size_(h, w) {}
  template <class String,
            std::enable_if_t<std::is_convertible_v<const String&, std::string_view>, int> = 0>
  Conv2dPadding(const String& mode) : size_(0), mode_(std::string_view(mode)) {}  // NOLINT
  bool is_mode() const { return !mode_.empty(); }
  const std::string& mode() const { return mode_; }  // "same", "valid", or "" for sizes
  const Size2& size() const { return size_; }

 private:
  Size2 size_;
  std::string mode_;
};

struct Conv2dOptions {
  int64_t in_channels = 0;
  int64_t out_channels = 0;
  Size2 kernel_size = 0;
  Size2 stride = 1;
  Conv2dPadding padding = 0;
  Size2 dilation = 1;
  int64_t groups = 1;
  bool bias = true;
  std::string padding_mode = "zeros";  // "zeros", "reflect", "replicate" or "circular"
};

// 2-D convolution over (N, C, H, W) or unbatched (C, H, W) input.
// Parameters: weight (out_channels, in_channels / groups, kH, kW), bias (out_channels).
// Init (PyTorch's): weight kaiming_uniform_(a = sqrt(5)), i.e. U(-1/sqrt(fan_in), 1/sqrt(fan_in)),
// and bias U(-1/sqrt(fan_in), 1/sqrt(fan_in)), fan_in = in_channels / groups * kH * kW.
class Conv2d : public Module {
 public:
  explicit Conv2d(const Conv2dOptions& options);
  Conv2d(int64_t in_channels, int64_t out_channels, Size2 kernel_size, Size2 stride = 1,
         Conv2dPadding padding = 0, Size2 dilation = 1, int64_t groups = 1, bool bias = true,
         std::string padding_mode = "zeros");
  Tensor forward(const Tensor& input) override;
  std::string extra_repr() const override;
  void reset_parameters();

  Conv2dOptions options;
  Tensor weight;
  Tensor bias;  // undefined when options.bias is false

 private:
  std::array<int64_t, 4> reversed_padding_;  // (left, right, top, bottom) for padding_mode != zeros
};

struct MaxPool2dOptions {
  Size2 kernel_size = 0;
  std::optional<Size2> stride;  // default: kernel_size
  Size2 padding = 0;
  Size2 dilation = 1;
  bool ceil_mode = false;
};

class MaxPool2d : public Module {
 public:
  explicit MaxPool2d(const MaxPool2dOptions& options);
  MaxPool2d(Size2 kernel_size, std::optional<Size2> stride = std::nullopt, Size2 padding = 0,
            Size2 dilation = 1);
  Tensor forward(const Tensor& input) override;
  // (output, indices into each flattened H * W plane), PyTorch's return_indices=True.
  std::tuple<Tensor, Tensor> forward_with_indices(const Tensor& input);
  std::string extra_repr() const override;

  MaxPool2dOptions options;
};

struct AvgPool2dOptions {
  Size2 kernel_size = 0;
  std::optional<Size2> stride;  // default: kernel_size
  Size2 padding = 0;
  bool ceil_mode = false;
  bool count_include_pad = true;
  std::optional<int64_t> divisor_override;
};

class AvgPool2d : public Module {
 public:
  explicit AvgPool2d(const AvgPool2dOptions& options);
  AvgPool2d(Size2 kernel_size, std::optional<Size2> stride = std::nullopt, Size2 padding = 0);
  Tensor forward(const Tensor& input) override;
  std::string extra_repr() const override;

  AvgPool2dOptions options;
};

class AdaptiveAvgPool2d : public Module {
 public:
  explicit AdaptiveAvgPool2d(Size2 output_size);
  Tensor forward(const Tensor& input) override;
  std::string extra_repr() const override;

  Size2 output_size;
};

}  // namespace kiln::nn
