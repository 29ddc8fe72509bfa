// Elementwise CUDA kernels generated from one expression: the eager pointwise ops, copy and fill.
//
// launch_elementwise(op, expr, out, inputs, types) computes, for every element of `out`,
//   out = static_cast<out storage type>(EXPR)
// where EXPR is CUDA C++ over a0, a1, ... (input i broadcast to out's shape, converted to
// types[i] as the CPU kernels convert, then to its opmath type: float for float16/bfloat16) and
// c0, c1, ... (host scalars, see Scalars). Inputs that are 0-dim CPU tensors (wrapped numbers)
// travel as kernel arguments. Dims are coalesced as the CPU's StridedLoop does; a fully
// coalesced operation runs a flat loop, anything else an N-d strided loop with 32-bit index
// math when it fits. Kernels are compiled by NVRTC on first use (jit.h) and cached.
#pragma once

#include <span>
#include <string>
#include <vector>

#include "kiln/tensor.h"

namespace kiln::cuda::detail {

// Host scalars of an expression, converted on the host: c<k> has dtype types[k] and the bits
// bits[k]. add() converts a Scalar as the CPU kernels do (Scalar::to<opmath type of `dtype`>) and
// returns its name.
struct Scalars {
  std::vector<DType> types;
  std::vector<unsigned long long> bits;
  std::string add(const Scalar& value, DType dtype);
};
// float32 for float16/bfloat16 (the type they compute in), else `t`.
DType opmath_dtype(DType t);

void launch_elementwise(const std::string& op, const std::string& expr, Tensor& out,
                        std::span<const Tensor> inputs, std::span<const DType> types,
                        const Scalars& scalars = {});

// The start of every generated kernel source: Kiln's functors and namespace kj with opmath<T>
// (float for 16-bit floats), convert<To>(from) (exactly the CPU copy kernel's conversions),
// load<T>(char*) and unpack<T>(bits of a host value).
const char* device_preamble();

// The CUDA C++ type of a dtype's storage ("float", "kiln::Half", "int64_t", ...).
const char* cuda_type(DType t);

// Every source launch_elementwise could generate for one (expr, dtypes) signature in its two
// layouts (flat and 3-d strided): for tests that compile eager kernels with NVRTC on machines
// without a GPU.
std::vector<std::string> elementwise_sources_for_test(const std::string& expr, DType out,
                                                      std::span<const DType> input_storage,
                                                      std::span<const DType> types, std::span<const DType> scalar_types);

}  // namespace kiln::cuda::detail
