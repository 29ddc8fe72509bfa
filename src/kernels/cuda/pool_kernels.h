// The generated sources of the eager CUDA pooling kernels (pool_kernels.cpp), exposed so that
// tests compile every variant with NVRTC on machines without a GPU.
#pragma once

#include <string>

#include "kiln/tensor.h"

namespace kiln::cuda::detail {

enum class PoolKind { max, max_with_indices, avg, adaptive_avg };

// The forward kernel (kiln_pool2d) of one pooling for `dtype`, with 32- or 64-bit index math,
// walking the output channels fastest when `channels_last`.
std::string pool_forward_source(PoolKind kind, DType dtype, bool i32, bool channels_last);
// The backward kernel (kiln_pool2d_backward; for max pooling also kiln_max_pool2d_check and
// kiln_max_pool2d_scatter). max and max_with_indices share it.
std::string pool_backward_source(PoolKind kind, DType dtype, bool i32, bool channels_last);

}  // namespace kiln::cuda::detail
