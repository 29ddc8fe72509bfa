// conv2d_bn's folded parameters, shared by the CPU and CUDA kernels: the batch norm folded into
// the convolution's weight and bias (per output channel).
#pragma once

#include <utility>

#include "kiln/op_table.h"

namespace kiln::detail {

// conv2d_bn(input, weight, bias?, bn_weight?, bn_bias?, running_mean, running_var, stride,
// padding, dilation, groups, eps, relu): (weight * scale, (bias - mean) * scale + bn_bias) with
// scale = bn_weight / sqrt(var + eps), in the weight's dtype and memory format. Cached by the
// identity, offset and version of every parameter it comes from (and eps), so inference folds
// once and a training step, which bumps the versions, refolds. `use_cache` false computes afresh
// and stores nothing (a CUDA graph being recorded must run the fold inside the graph, so that
// each replay folds the values of its moment). Thread-safe.
std::pair<Tensor, Tensor> fold_batch_norm(const OpCall& call, bool use_cache);

}  // namespace kiln::detail
