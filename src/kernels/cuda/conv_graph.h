// Convolutions through cuDNN's graph (backend) API with cached execution plans.
//
// cuDNN 9 implements its legacy calls (cudnnConvolutionForward, ...) on the graph API and builds
// and finalizes an execution plan inside every call: about 100 µs of host time per convolution
// on the lent H100's host, most of an eager DenseNet step. Here a plan is built once per
// configuration (and cuDNN handle, to which a plan is bound), as cudnn-frontend and PyTorch do,
// and a call only binds its pointers in a variant pack and executes.
#pragma once

#ifdef KILN_WITH_CUDNN

#include <array>
#include <cstddef>
#include <cstdint>

#include "kiln/dtype.h"

namespace kiln::cuda::detail {

enum class ConvDirection { forward, backward_data, backward_filter };

// One convolution configuration: sizes in NCHW order (o output channels, kernel kh x kw), the
// parameters, the dtype, the memory layout of all three operands, the device.
struct ConvShape {
  int64_t n, c, h, w, o, kh, kw, oh, ow;
  int64_t stride[2], pad[2], dilation[2], groups;
  DType dtype;
  bool channels_last;
  int device;
};

// A plan cache's key: the shape's fields (device, dtype, sizes, parameters, layout) followed by
// the cache's own `extra` fields (direction, precision settings, ...).
constexpr size_t kConvShapeFields = 19;
template <size_t Extra>
std::array<int64_t, kConvShapeFields + Extra> conv_plan_key(const ConvShape& s, const std::array<int64_t, Extra>& extra) {
  std::array<int64_t, kConvShapeFields + Extra> k = {
      s.device,   static_cast<int64_t>(s.dtype), s.n,         s.c,         s.h,           s.w,           s.o,
      s.kh,       s.kw,                          s.oh,        s.ow,        s.stride[0],   s.stride[1],   s.pad[0],
      s.pad[1],   s.dilation[0],                 s.dilation[1], s.groups,  s.channels_last};
  for (size_t i = 0; i < Extra; ++i) k[kConvShapeFields + i] = extra[i];
  return k;
}
// FNV-1a over a plan key.
struct PlanKeyHash {
  template <size_t N>
  size_t operator()(const std::array<int64_t, N>& k) const {
    uint64_t h = 1469598103934665603ull;
    for (int64_t x : k) h = (h ^ static_cast<uint64_t>(x)) * 1099511628211ull;
    return static_cast<size_t>(h);
  }
};

// Runs one direction on dense operands in the shape's layout: forward reads x and w and writes y
// (adding to y's values when `accumulate`); backward_data reads w and y (dy) and writes x (dx);
// backward_filter reads x and y (dy) and writes w (dw). float32 uses TF32 tensor cores only when
// allow_tf32; float32 and float64 never down-convert their inputs. Returns false, having run
// nothing, when the graph API has no acceptable plan or refuses it (the caller then takes the
// legacy API), and while a CUDA graph records a configuration that has no plan yet (building one
// is not capturable work). The current device must be the shape's.
bool run_conv_graph(const ConvShape& s, ConvDirection d, bool accumulate, bool allow_tf32, void* x, void* w, void* y);

// Graph plans built since process start (tests check that the graph API served a convolution).
int64_t conv_graph_plans_built();

}  // namespace kiln::cuda::detail

#endif  // KILN_WITH_CUDNN
