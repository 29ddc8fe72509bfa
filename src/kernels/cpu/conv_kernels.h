// What the CPU convolution kernels (conv_kernels.cpp) decided, for tests.
#pragma once

#include <array>
#include <cstdint>
#include <string>

namespace kiln::cpu {

// How the cached oneDNN backward-weights plan of this float32 configuration reads the activations
// (src and diff_dst): "nhwc", "nchw", "blocked", or "" when no oneDNN plan runs it. channels_last
// picks the NHWC plan, as a channels-last input does. Sizes as conv2d takes them.
std::string onednn_backward_weights_activation_layout(std::array<int64_t, 4> input, std::array<int64_t, 4> weight,
                                                      std::array<int64_t, 2> stride, std::array<int64_t, 2> padding,
                                                      std::array<int64_t, 2> dilation, int64_t groups,
                                                      bool channels_last);

}  // namespace kiln::cpu
