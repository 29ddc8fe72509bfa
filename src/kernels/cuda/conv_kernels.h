// Test hooks of the CUDA convolution kernels (conv_kernels.cpp, built with cuDNN), for machines
// without a GPU.
#pragma once

#include <cstdint>
#include <string>

#include "kiln/dtype.h"

namespace kiln::cuda::detail {

// The CUDA C++ of convolution_backward's bias-gradient kernel for floating dtype t.
std::string conv_bias_grad_source_for_test(DType t);

// Plans whose algorithm was chosen by timing (cudnnFind*: max_autotune) since the process began.
int64_t conv_plans_timed();

}  // namespace kiln::cuda::detail
