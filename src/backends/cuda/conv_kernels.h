// Test hooks of the CUDA convolution kernels (conv_kernels.cpp, built with cuDNN), for machines
// without a GPU.
#pragma once

#include <string>

#include "kiln/dtype.h"

namespace kiln::cuda::detail {

// The CUDA C++ of convolution_backward's bias-gradient kernel for floating dtype t.
std::string conv_bias_grad_source_for_test(DType t);

}  // namespace kiln::cuda::detail
