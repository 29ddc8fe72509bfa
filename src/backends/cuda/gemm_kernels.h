// Test hooks of the CUDA GEMM kernels (gemm_kernels.cpp), for machines without a GPU.
#pragma once

#include <string>

#include "kiln/dtype.h"

namespace kiln::cuda::detail {

// The CUDA C++ of the integer GEMM kernel for integer dtype t, as NVRTC compiles it.
std::string integer_gemm_source_for_test(DType t);

}  // namespace kiln::cuda::detail
