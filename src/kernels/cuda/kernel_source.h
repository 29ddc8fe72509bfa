// Pieces shared by the generated pooling and normalization kernels (pool_kernels.cpp,
// norm_kernels.cpp, norm_backward_kernels.cpp): the source preamble, index-type choice, launch
// sizing and 4-D (N, C, H, W) views of tensors.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>

#include "kernels/cuda/cuda_runtime.h"
#include "kernels/cuda/elementwise.h"
#include "kiln/tensor.h"

namespace kiln::cuda::detail {

// What every generated pool/norm source starts with: the shared preamble (device_preamble():
// opmath, convert, ...), seen here as namespace kp, and a grid-stride loop macro.
inline std::string pool_norm_preamble() {
  return std::string(device_preamble()) + R"(namespace kp = kj;
#define KP_GRID_LOOP(I, i, n) for (I i = blockIdx.x * (I)blockDim.x + threadIdx.x; i < (n); i += (I)gridDim.x * blockDim.x)
)";
}

// The C++ spelling of a dtype's opmath type in generated code.
inline const char* cuda_opmath_type(DType t) { return cuda_type(opmath_dtype(t)); }

// Whether every index of a launch fits 32-bit math, given the largest value index arithmetic can
// reach (element counts, offsets, products of sizes).
inline bool fits_int32(int64_t largest) { return largest <= std::numeric_limits<int32_t>::max() / 2; }

// The largest element offset a tensor's strides reach (strides here are non-negative).
inline int64_t max_offset(const Tensor& t) {
  int64_t extent = 0;
  for (int64_t d = 0; d < t.dim(); ++d) extent += (t.sizes()[d] - 1) * std::abs(t.strides()[d]);
  return std::max<int64_t>(extent, t.numel());
}

// Blocks for a grid-stride loop over `work` items with `block` threads: enough to fill the device
// several times over, no more.
inline unsigned grid_for(int device, int64_t work, int block = 256) {
  const int64_t cap = int64_t{properties(device).multiProcessorCount} * 16;
  return static_cast<unsigned>(std::clamp<int64_t>((work + block - 1) / block, 1, cap));
}

// A 3-D (C, H, W) or 4-D (N, C, H, W) tensor's sizes and element strides as 4-D (N = 1 for 3-D).
struct Dims4 {
  int64_t size[4];
  int64_t stride[4];
};

inline Dims4 dims4(const Tensor& t) {
  Dims4 d{};
  const int64_t off = 4 - t.dim();
  for (int64_t i = 0; i < 4; ++i) {
    d.size[i] = i < off ? 1 : t.sizes()[i - off];
    d.stride[i] = i < off ? 0 : t.strides()[i - off];
  }
  return d;
}

// Whether a kernel writing the 4-D tensor `t` should walk it channels fastest: its channels are
// adjacent and it is not plainly contiguous (channels-last, or a channel slice of one).
inline bool walks_channels_last(const Tensor& t) {
  return t.dim() == 4 && !t.is_contiguous() && t.sizes()[1] > 1 && t.strides()[1] == 1;
}

}  // namespace kiln::cuda::detail
