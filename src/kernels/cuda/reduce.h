// Generated CUDA reductions: the engine behind the eager reduction kernels (reduce_kernels.cpp).
//
// launch_reduce views its input as (outer, R, inner) — reduced dims moved together, read in
// memory order, with a permuted contiguous copy only when the reduced dims are not adjacent in
// memory — and computes one output per (outer, inner) position:
//   - inner == 1 (rows): a group of lanes per row (4 to 32 lanes of a warp, or a whole block for
//     long rows), combined with warp shuffles and shared memory;
//   - inner > 1 (columns): threads own adjacent inner positions so loads coalesce, and several
//     thread rows split R, combined in shared memory;
//   - few outputs with long reductions split R across blocks that write partial accumulators,
//     combined by a second kernel (a full sum of 10M elements runs on every SM).
// Accumulation follows the CPU kernels (reduce_loops.h): float for float16/bfloat16/float32,
// double for float64, wrapping int64 for integers. Kernels are compiled by NVRTC per
// (op, dtypes, layout class) and cached (jit.h).
#pragma once

#include <span>
#include <string>
#include <vector>

#include "kiln/tensor.h"

namespace kiln::cuda::detail {

enum class ReduceOp {
  sum, prod, mean, max, min, any, all,
  var, std, var_mean,                                        // out1 of var_mean: the mean
  norm2, norm1, norm0, norm_inf, norm_neg_inf, norm_p,       // vector norms; norm_p uses `param`
  logsumexp,
  argmax, argmin, max_values_indices, min_values_indices,    // the last two: out0 values, out1 indices
};

struct ReduceSpec {
  ReduceOp op;
  DType input;  // storage dtype the kernel reads
  DType acc;    // accumulation dtype (float32, float64, int64, bool, or the input's own for max/min)
  DType out;    // out0's dtype (indices are int64)
};

// Reduces `x` (on a CUDA device) over the dims set in `mask` (x.dim() entries) into outs[0]
// (and outs[1]). `count` is the mean's divisor or var's degrees of freedom; `param` the order p
// of norm_p. Outputs may be strided.
void launch_reduce(const std::string& op, const ReduceSpec& spec, const Tensor& x, const std::vector<bool>& mask,
                   std::span<Tensor> outs, int64_t count = 0, double param = 0);

// softmax / log_softmax and their backward over `dim` of contiguous inputs of one floating dtype
// (grad is only read by the backward kinds); out is contiguous, of that dtype.
enum class SoftmaxKind { softmax, log_softmax, softmax_backward, log_softmax_backward };
void launch_softmax(const std::string& op, SoftmaxKind kind, const Tensor& x, const Tensor& grad, Tensor& out,
                    int64_t dim);

// Inclusive sum along `dim`: x contiguous, out contiguous, accumulated in `acc`.
void launch_cumsum(const Tensor& x, Tensor& out, int64_t dim, DType acc);

// The elementwise expression of allclose's isclose(a0, a1) for dtype t (not bool), with the
// tolerances rt and at (host scalars: t's opmath type, float32 for integers).
std::string isclose_expression(DType t, bool equal_nan, bool exact_only, const std::string& rt, const std::string& at);

// Every source shape the generators produce for representative dtypes: for NVRTC compile tests
// on machines without a GPU.
std::vector<std::string> reduce_sources_for_test();

}  // namespace kiln::cuda::detail
