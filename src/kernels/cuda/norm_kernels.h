// The eager CUDA normalization kernels (norm_kernels.cpp: forward; norm_backward_kernels.cpp:
// backward): the helpers both files share and their generated sources, exposed so that tests
// compile every variant with NVRTC on machines without a GPU.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "kiln/tensor.h"

namespace kiln::cuda::detail {

// An (N, C, spatial...) tensor as (N, C, S) with element strides: its spatial dims merge into one
// (any contiguous or channels-last tensor, or a channel slice of one). nullopt when they do not.
struct NcsView {
  int64_t n = 0, c = 0, s = 0;
  int64_t sn = 0, sc = 0, ss = 0;
};
std::optional<NcsView> ncs_view(const Tensor& t);

// Whether batch norm reads `x` as channel rows (channels fastest) rather than planes, decided as
// the CPU kernels decide (norm_loops.h channel_view): x's own layout, the tie of a tensor that is
// both broken by `prefer_rows`.
bool batch_norm_reads_rows(const Tensor& x, bool prefer_rows);
// The CPU's preference: the output (or grad_input) is channel rows and not plainly contiguous.
bool batch_norm_prefers_rows(const Tensor& out);

// Whether the affine maps round once (fma), as the CPU's do (norm_loops.h KILN_NORM_FMA).
bool norm_uses_fma();

// The start of every generated norm source, forward and backward: the preamble, T/Acc/I, the
// affine maps (rounded as norm_uses_fma() says) and the block helpers (imin, block_sum).
std::string norm_header(DType dtype, bool i32);

// How a batch-norm backward reads its gradient: as is, masked by the relu's result, or masked by
// the relu's result recomputed from the input.
enum class ReluMask { none = 0, result = 1, recompute = 2 };

// ---- generated sources (dtype: the input's; i32: 32-bit index math) ----
// kiln_bn_stats_rows, kiln_bn_stats_planar: per-split shifted sums.
std::string batch_norm_stats_source(DType dtype, bool i32);
// kiln_bn_finalize: statistics, running-statistics update, the affine map. Undefined running
// statistics: pass std::nullopt.
std::string batch_norm_finalize_source(DType dtype, std::optional<DType> running_mean,
                                       std::optional<DType> running_var);
// kiln_bn_apply: y = x * scale + shift (relu'd), walking y channels fastest when `rows_order`.
std::string batch_norm_apply_source(DType dtype, bool i32, bool relu, bool rows_order);
// kiln_row_norm: layer_norm (per-element affine) or group_norm (per-channel affine) forward.
std::string row_norm_source(DType dtype, bool group);

// kiln_bnb_reduce_rows, kiln_bnb_reduce_planar: per-split sum(dy) and sum(dy * (x - mean)).
std::string batch_norm_backward_reduce_source(DType dtype, bool i32, ReluMask mask);
// kiln_bnb_finalize: grad_input coefficients and the weight and bias gradients (param_dtype).
std::string batch_norm_backward_finalize_source(DType dtype, DType param_dtype);
// kiln_bnb_apply: grad_input, with the CPU's channel-rows or planar formula.
std::string batch_norm_backward_apply_source(DType dtype, bool i32, ReluMask mask, bool rows_formula, bool train,
                                             bool rows_order);
// kiln_ln_backward, kiln_ln_param_partial, kiln_ln_param_finalize.
std::string layer_norm_backward_source(DType dtype, DType param_dtype);
// kiln_gn_backward, kiln_gn_param.
std::string group_norm_backward_source(DType dtype, DType param_dtype);

}  // namespace kiln::cuda::detail
