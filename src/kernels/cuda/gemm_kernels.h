// Test hooks of the CUDA GEMM kernels (gemm_kernels.cpp).
#pragma once

#include <string>

#include "kiln/dtype.h"

namespace kiln::cuda::detail {

// The CUDA C++ of the integer GEMM kernel for integer dtype t, as NVRTC compiles it.
std::string integer_gemm_source_for_test(DType t);

// cuBLASLt configurations whose algorithm max_autotune chose by timing the heuristics' candidates
// since the process began (those with a single candidate are not counted).
int64_t gemm_algorithms_timed();

}  // namespace kiln::cuda::detail
