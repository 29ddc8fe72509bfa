// The decompositions of composite ops (lowering::Decomposition, kiln/lowering.h): ordinary Kiln
// code over core ops (pointwise math, reductions, views), which compile()'s decompose pass traces
// in the op's place. Each op's entry names its function (norm.cpp, reduce.cpp, conv.cpp).
//
// Each entry computes what the op's CPU kernel computes, in the same precision: statistics of
// float16/bfloat16 inputs in float32, results cast back to the op's output dtype. Every output is
// a new value (never an input or a view of one). An entry returns {} to leave a node whose
// inputs it does not cover (empty tensors, integer inputs, shapes the formula does not fit).
#include <algorithm>
#include <cmath>
#include <limits>
#include <map>

#include "ops/decompositions.h"

#include "kiln/op_table.h"
#include "kiln/ops.h"

namespace kiln::detail {

namespace {

using Tensors = std::vector<Tensor>;
using Scalars = std::span<const Tensor>;

// The dtype the kernels accumulate statistics in.
DType opmath(DType t) { return t == DType::float16 || t == DType::bfloat16 ? DType::float32 : t; }

// Shape that broadcasts a per-channel vector of C elements against an (N, C, ...) input.
std::vector<int64_t> channel_shape(const Tensor& x) {
  std::vector<int64_t> s(x.dim(), 1);
  s[1] = x.size(1);
  return s;
}

int64_t wrap(int64_t dim, int64_t ndim) { return dim < 0 ? dim + ndim : dim; }

// native_batch_norm(input, weight?, bias?, running_mean?, running_var?, training, momentum, eps)
// -> (output, save_mean, save_invstd). Training normalizes with the batch statistics (biased
// variance) and updates the running statistics in place with the unbiased one, as the kernel
// does; functionalize() turns those writes into a copy back. Evaluation returns the running mean
// and 1 / sqrt(running_var + eps) as the statistics, like Kiln's kernel.
Tensors batch_norm(const OpCall& c, Scalars s) {
  const Tensor& x = c.input(0);
  const Tensor& weight = c.input(1);
  const Tensor& bias = c.input(2);
  Tensor running_mean = c.input(3);
  Tensor running_var = c.input(4);
  const bool training = c.bool_attr(0);
  const Tensor& momentum = s[0];
  const Tensor& eps = s[1];
  if (x.numel() == 0 || x.dim() < 2) return {};
  const DType st = opmath(x.dtype());
  const Tensor xs = x.to(st);
  const std::vector<int64_t> shape = channel_shape(x);
  Tensor mean, invstd, centered;
  if (training) {
    std::vector<int64_t> dims{0};
    for (int64_t d = 2; d < x.dim(); ++d) dims.push_back(d);
    mean = kiln::mean(xs, dims);
    centered = xs - mean.view(shape);
    Tensor var = kiln::mean(centered * centered, dims);
    invstd = rsqrt(var + eps);
    const int64_t count = x.numel() / x.size(1);
    const double unbias = count > 1 ? static_cast<double>(count) / static_cast<double>(count - 1) : 1.0;
    if (running_mean.defined()) running_mean.copy_(running_mean * (1 - momentum) + mean * momentum);
    if (running_var.defined()) running_var.copy_(running_var * (1 - momentum) + var * unbias * momentum);
  } else {
    if (!running_mean.defined() || !running_var.defined()) return {};
    // The per-channel math runs on [1, C, 1, ...] views, the normalization's broadcast shape, so
    // that the scheduler can compute it inside the normalization's kernel on a GPU (one kernel
    // instead of a tiny per-channel one before it). The statistics outputs are computed apart
    // (outputs may not be views), and removed as dead code when nothing reads them.
    const Tensor mean_c = running_mean.to(st).view(shape);
    const Tensor invstd_c = rsqrt(running_var.to(st).view(shape) + eps);
    mean = running_mean.to(st, /*copy=*/true);
    invstd = rsqrt(running_var.to(st) + eps);
    centered = xs - mean_c;
    Tensor y = centered * invstd_c;
    if (weight.defined()) y = y * weight.view(shape);
    if (bias.defined()) y = y + bias.view(shape);
    return {y.to(x.dtype()), mean, invstd};
  }
  Tensor y = centered * invstd.view(shape);
  if (weight.defined()) y = y * weight.view(shape);
  if (bias.defined()) y = y + bias.view(shape);
  return {y.to(x.dtype()), mean, invstd};
}

// native_layer_norm(input, normalized_shape, weight?, bias?, eps) -> (output, mean, rstd); the
// statistics keep the normalized dims as size 1.
Tensors layer_norm(const OpCall& c, Scalars s) {
  const Tensor& x = c.input(0);
  const Tensor& weight = c.input(1);
  const Tensor& bias = c.input(2);
  const int64_t axis = x.dim() - static_cast<int64_t>(c.ints_attr(0).size());
  if (x.numel() == 0 || axis < 0) return {};
  std::vector<int64_t> dims;
  for (int64_t d = axis; d < x.dim(); ++d) dims.push_back(d);
  const Tensor xs = x.to(opmath(x.dtype()));
  Tensor mean = kiln::mean(xs, dims, /*keepdim=*/true);
  Tensor centered = xs - mean;
  Tensor rstd = rsqrt(kiln::mean(centered * centered, dims, /*keepdim=*/true) + s[0]);
  Tensor y = centered * rstd;
  if (weight.defined()) y = y * weight;
  if (bias.defined()) y = y + bias;
  return {y.to(x.dtype()), mean, rstd};
}

// native_group_norm(input, weight?, bias?, group, eps) -> (output, mean, rstd), statistics (N, group).
Tensors group_norm(const OpCall& c, Scalars s) {
  const Tensor& x = c.input(0);
  const Tensor& weight = c.input(1);
  const Tensor& bias = c.input(2);
  const int64_t groups = c.int_attr(0);
  if (x.numel() == 0 || x.dim() < 2 || groups <= 0) return {};
  const int64_t n = x.size(0);
  const Tensor xg = x.to(opmath(x.dtype())).reshape({n, groups, -1});
  Tensor mean = kiln::mean(xg, {2});
  Tensor centered = xg - mean.unsqueeze(2);
  Tensor rstd = rsqrt(kiln::mean(centered * centered, {2}) + s[0]);
  Tensor y = (centered * rstd.unsqueeze(2)).view(x.sizes());
  const std::vector<int64_t> shape = channel_shape(x);
  if (weight.defined()) y = y * weight.view(shape);
  if (bias.defined()) y = y + bias.view(shape);
  // Without an affine map y is still a view of the product: return a buffer of its own.
  y = weight.defined() || bias.defined() ? y.to(x.dtype()) : y.to(x.dtype(), /*copy=*/true);
  return {y, mean, rstd};
}

// softmax / log_softmax(self, dim, dtype?): exp(x - max) normalized along dim, in float32 for
// half inputs.
Tensors softmax_like(const OpCall& c, bool log) {
  const Tensor& x = c.input(0);
  if (x.numel() == 0 || x.dim() == 0) return {};
  const DType out = c.has_attr(1) ? c.dtype_attr(1) : x.dtype();
  if (!is_floating_point(out)) return {};
  const int64_t dim = wrap(c.int_attr(0), x.dim());
  const Tensor xs = x.to(opmath(out));
  Tensor shifted = xs - amax(xs, {dim}, /*keepdim=*/true);
  Tensor y = log ? shifted - kiln::log(sum(exp(shifted), {dim}, /*keepdim=*/true))
                 : [&] {
                     Tensor e = exp(shifted);
                     return e / sum(e, {dim}, /*keepdim=*/true);
                   }();
  return {y.to(out)};
}

// logsumexp(self, dim, keepdim): max + log(sum(exp(x - max))), with an infinite max taken as 0
// so that rows of -inf give -inf and rows with +inf give +inf.
Tensors logsumexp(const OpCall& c, Scalars) {
  const Tensor& x = c.input(0);
  if (x.numel() == 0 || x.dim() == 0 || !is_floating_point(x.dtype())) return {};
  std::vector<int64_t> dims;
  for (int64_t d : c.ints_attr(0)) dims.push_back(wrap(d, x.dim()));
  if (dims.empty())  // [] reduces every dim
    for (int64_t d = 0; d < x.dim(); ++d) dims.push_back(d);
  const bool keepdim = c.bool_attr(1);
  const Tensor xs = x.to(opmath(x.dtype()));
  Tensor m = amax(xs, dims, /*keepdim=*/true);
  m = where(isfinite(m), m, 0.0);
  Tensor m_out = m;
  if (!keepdim) {
    std::sort(dims.rbegin(), dims.rend());
    for (int64_t d : dims) m_out = m_out.squeeze(d);
  }
  return {(kiln::log(sum(exp(xs - m), dims, keepdim)) + m_out).to(x.dtype())};
}

// adaptive_avg_pool2d(self, output_size) when the output divides the input: the windows tile the
// plane, so it is a mean over (rows of a window, columns of a window). DenseNet's classifier
// head (output 1x1) is the common case.
Tensors adaptive_avg_pool2d(const OpCall& c, Scalars) {
  const Tensor& x = c.input(0);
  IntArrayRef size = c.ints_attr(0);
  if ((x.dim() != 3 && x.dim() != 4) || x.numel() == 0 || !is_floating_point(x.dtype())) return {};
  if (size.size() != 1 && size.size() != 2) return {};
  const int64_t oh = size[0], ow = size.size() == 2 ? size[1] : size[0];
  const int64_t h = x.size(-2), w = x.size(-1);
  if (oh <= 0 || ow <= 0 || h % oh != 0 || w % ow != 0) return {};
  std::vector<int64_t> tiled(x.sizes().begin(), x.sizes().end() - 2);
  tiled.insert(tiled.end(), {oh, h / oh, ow, w / ow});
  const int64_t d = static_cast<int64_t>(tiled.size());
  return {kiln::mean(x.reshape(tiled), {d - 3, d - 1})};
}

}  // namespace

// Batch norm in training keeps eager's fused kernel (one Welford pass for the statistics, one to
// normalize); its decomposition reads the input three times (measured slower on DenseNet).
lowering::Decomposition batch_norm_decomposition() {
  return {.scalar_attrs = {1, 2}, .fn = batch_norm, .applies = [](std::span<const Attr> attrs) {
            return attrs.empty() || !std::holds_alternative<bool>(attrs[0]) || !std::get<bool>(attrs[0]);
          }};
}
lowering::Decomposition layer_norm_decomposition() { return {.scalar_attrs = {1}, .fn = layer_norm}; }
lowering::Decomposition group_norm_decomposition() { return {.scalar_attrs = {1}, .fn = group_norm}; }
lowering::Decomposition softmax_decomposition(bool log) {
  return {.fn = [log](const OpCall& c, Scalars) { return softmax_like(c, log); }};
}
lowering::Decomposition logsumexp_decomposition() { return {.fn = logsumexp}; }
lowering::Decomposition adaptive_avg_pool2d_decomposition() { return {.fn = adaptive_avg_pool2d}; }

}  // namespace kiln::detail
