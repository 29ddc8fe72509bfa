// Kiln's own Winograd F(4x4, 3x3) convolution for channels-last float32 activations: one of the
// algorithms compile()'s max_autotune times against oneDNN's direct and Winograd kernels
// (conv_autotune.h).
//
// Each 4x4 block of outputs ("tile") comes from a 6x6 block of input. The input transform
// (B^T d B), the 36 GEMMs over channels (one per transform point, oneDNN's sgemm) and the output
// transform (A^T m A) run on blocks of 64 tiles per thread, so a block's transformed data stays in
// the core's cache instead of going to memory; NHWC keeps a pixel's channels adjacent, so both
// transforms are vectorized across channels. The multiplications drop 4x (36 per 16 outputs
// instead of 144); the transforms cost about 1e-5 relative error against the direct sum in
// float32 (tests/test_conv_autotune.cpp bounds it).
//
// Backward-data of a stride-1 3x3 convolution is the same computation on the output gradient with
// the kernel rotated 180 degrees, its input and output channels swapped, and padding 2 - pad.
// Backward-weights runs the transforms' adjoints: per point, the transformed input's tiles times
// the output gradient's tiles through A (one GEMM over the tiles), then G^T dU G.
#pragma once

#include <cstdint>

namespace kiln::cpu {

// The convolutions the kernel runs: 3x3, stride 1, dilation 1, one group, padding at most 2 per
// side (backward-data pads by 2 - pad), no bias, at least one output row and column.
bool winograd_nhwc_applies(int64_t kh, int64_t kw, const int64_t stride[2], const int64_t dilation[2], int64_t groups,
                           const int64_t pad[2], bool bias, int64_t oh, int64_t ow);

// y (n, oh, ow, o) = conv(x (n, h, w, c), weight) with padding pad; x and y dense NHWC; weight
// (o, c, 3, 3) row-major (OIHW), or (o, 3, 3, c) when weight_ohwi.
void winograd_nhwc_forward(const float* x, int64_t n, int64_t h, int64_t w, int64_t c, const float* weight,
                           bool weight_ohwi, int64_t o, const int64_t pad[2], float* y, int64_t oh, int64_t ow);

// dx (n, h, w, c) = the input gradient of that convolution for dy (n, oh, ow, o); dense NHWC.
void winograd_nhwc_backward_data(const float* dy, int64_t n, int64_t oh, int64_t ow, int64_t o, const float* weight,
                                 bool weight_ohwi, int64_t c, const int64_t pad[2], float* dx, int64_t h, int64_t w);

// dw (o, c, 3, 3) row-major, or (o, 3, 3, c) when dw_ohwi = the weight gradient of that
// convolution for input x (n, h, w, c) and output gradient dy (n, oh, ow, o); dense NHWC.
void winograd_nhwc_backward_weights(const float* x, int64_t n, int64_t h, int64_t w, int64_t c, const float* dy,
                                    int64_t o, int64_t oh, int64_t ow, const int64_t pad[2], float* dw, bool dw_ohwi);

}  // namespace kiln::cpu
