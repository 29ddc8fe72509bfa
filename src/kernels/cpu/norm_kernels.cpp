// CPU kernels for native_batch_norm (and batch_norm_relu: the same loops with relu applied as
// the output is written), native_layer_norm and native_group_norm.
//
// All three normalize contiguous runs: batch_norm a channel's N runs of H*W elements (or, for
// channels-last input, N*H*W rows of C channels: see norm_loops.h),
// layer_norm one row of the trailing dims, group_norm one (n, group) block. Statistics use two
// passes (mean, then the sum of squared deviations) over data that stays in cache, in opmath
// precision (float for float16/bfloat16/float32 rows, double for float64); the output pass is a
// vectorized x * scale + shift. Work is split across OpenMP threads by row or block; batch_norm
// reads its input in memory order and merges per-run statistics per channel (Chan's formula).
#include <cmath>

#include "kernels/cpu/loops.h"
#include "kernels/cpu/norm_loops.h"
#include "core/tensor_factory.h"
#include "kiln/op_table.h"
#include "kiln/ops.h"

namespace kiln::cpu {

namespace {

// Values of an optional 1-D parameter in opmath precision (`fill` when undefined).
template <class Acc>
std::vector<Acc> param_values(const Tensor& t, int64_t n, Acc fill) {
  if (!t.defined()) return std::vector<Acc>(static_cast<size_t>(n), fill);
  std::vector<double> v = t.to_vector<double>();
  return std::vector<Acc>(v.begin(), v.end());
}

// Writes `values` into the floating-point tensor t (any strides) in row-major order.
template <class Acc>
void store_values(Tensor& t, const std::vector<Acc>& values) {
  Tensor src = detail::make_empty(t.sizes().vec(), dtype_of_v<Acc>, t.device());
  std::copy(values.begin(), values.end(), src.data_ptr<Acc>());
  if (t.is_contiguous() && t.dtype() == src.dtype()) {
    std::copy(values.begin(), values.end(), t.data_ptr<Acc>());
    return;
  }
  t.copy_(src);
}

// Sum of n contiguous values in opmath precision.
template <class T, class Acc = opmath_t<T>>
inline Acc row_sum(const T* x, int64_t n) {
  Acc s = 0;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += static_cast<Acc>(x[i]);
  return s;
}

// Sum of (x - mean)^2 over n contiguous values.
template <class T, class Acc = opmath_t<T>>
inline Acc row_sq_dev(const T* x, int64_t n, Acc mean) {
  Acc s = 0;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) {
    const Acc d = static_cast<Acc>(x[i]) - mean;
    s += d * d;
  }
  return s;
}

// Runs body(y) with a contiguous output, copying into `out` afterwards when it is not.
template <class Body>
void with_contiguous_output(Tensor& out, Body&& body) {
  Tensor y = out.is_contiguous() ? out : detail::make_empty(out.sizes().vec(), out.dtype(), out.device());
  body(y);
  if (!y.same(out)) out.copy_(y);
}

// ---------------- batch_norm ----------------

// Chan's merge of (count, mean, M2) partial statistics: b into a.
inline void merge_stats(double& count, double& mean, double& m2, double count_b, double mean_b, double m2_b) {
  const double total = count + count_b;
  if (total == 0) return;
  const double delta = mean_b - mean;
  mean += delta * (count_b / total);
  m2 += m2_b + delta * delta * (count * count_b / total);
  count = total;
}


// Per-channel mean and biased variance of an (N, C, plane) input, read in memory order (a
// channel's runs are strided, and streaming through memory is faster than gathering them). Large
// planes: each thread takes a contiguous range of (n, c) runs, computes a run's mean and squared
// deviations while it sits in L1, and merges runs into per-channel statistics with Chan's formula
// in double. Small planes: column sums (two passes: mean, then squared deviations).
template <class T>
void channel_stats(const T* in, int64_t n, int64_t channels, int64_t plane, std::vector<double>& mean,
                   std::vector<double>& var) {
  using Acc = opmath_t<T>;
  const int64_t rows = n * channels;
  if (rows == 0 || plane == 0) return;
  const double count = static_cast<double>(n * plane);
  if (plane < kSmallPlane) {
    const int64_t columns = channels * plane;
    std::vector<double> sums = sum_rows(n, columns, columns, [&](double* __restrict s, int64_t i) {
      const T* __restrict row = in + i * columns;
#pragma omp simd
      for (int64_t k = 0; k < columns; ++k) s[k] += static_cast<double>(static_cast<Acc>(row[k]));
    });
    for (int64_t c = 0; c < channels; ++c) {
      double t = 0;
      for (int64_t j = 0; j < plane; ++j) t += sums[c * plane + j];
      mean[c] = t / count;
    }
    const std::vector<double> column_mean = expand_to_columns(mean, plane);
    std::vector<double> squares = sum_rows(n, columns, columns, [&](double* __restrict q, int64_t i) {
      const T* __restrict row = in + i * columns;
      const double* __restrict m = column_mean.data();
#pragma omp simd
      for (int64_t k = 0; k < columns; ++k) {
        const double d = static_cast<double>(static_cast<Acc>(row[k])) - m[k];
        q[k] += d * d;
      }
    });
    for (int64_t c = 0; c < channels; ++c) {
      double t = 0;
      for (int64_t j = 0; j < plane; ++j) t += squares[c * plane + j];
      var[c] = t / count;
    }
    return;
  }
  const int64_t chunks =
      std::max<int64_t>(1, std::min<int64_t>({omp_get_max_threads(), rows, rows * plane / kGrainSize}));
  const size_t slots = static_cast<size_t>(chunks * channels);
  std::vector<double> counts(slots, 0.0), mu(slots, 0.0), m2(slots, 0.0);
  parallel_for(chunks, 1, [&](int64_t cb, int64_t ce) {
    for (int64_t chunk = cb; chunk < ce; ++chunk) {
      for (int64_t r = rows * chunk / chunks; r < rows * (chunk + 1) / chunks; ++r) {
        const T* x = in + r * plane;
        const Acc row_mean = row_sum(x, plane) / static_cast<Acc>(plane);
        const Acc row_m2 = row_sq_dev(x, plane, row_mean);
        const size_t at = static_cast<size_t>(chunk * channels + r % channels);
        merge_stats(counts[at], mu[at], m2[at], static_cast<double>(plane), static_cast<double>(row_mean),
                    static_cast<double>(row_m2));
      }
    }
  });
  for (int64_t c = 0; c < channels; ++c) {
    for (int64_t chunk = 1; chunk < chunks; ++chunk) {
      const size_t at = static_cast<size_t>(chunk * channels + c);
      merge_stats(counts[c], mu[c], m2[c], counts[at], mu[at], m2[at]);
    }
    mean[c] = mu[c];
    var[c] = counts[c] > 0 ? m2[c] / counts[c] : 0.0;
  }
}

// Reads the input in its own layout (planar or channel rows, see norm_loops.h) and writes the
// output in the same one: directly when the output has it, else through a temporary. Relu:
// batch_norm_relu.
template <class T, bool Relu>
void batch_norm_typed(const OpCall& call, std::span<Tensor> outs) {
  using Acc = opmath_t<T>;
  Tensor& out = outs[0];
  const auto out_row_stride = channel_row_stride(out);
  const ChannelView xv = channel_view(call.input(0), out_row_stride && !out.is_contiguous());
  const Tensor& x = xv.t;
  Tensor running_mean = call.input(3), running_var = call.input(4);
  const bool training = call.bool_attr(0);
  const double momentum = call.double_attr(1), eps = call.double_attr(2);
  const int64_t n = x.sizes()[0], channels = x.sizes()[1];
  const int64_t plane = n * channels == 0 ? 0 : x.numel() / (n * channels);
  const int64_t count = n * plane;  // values per channel, and channel rows
  const T* in = x.data_ptr<T>();

  std::vector<Acc> mean(static_cast<size_t>(channels)), invstd(static_cast<size_t>(channels));
  std::vector<double> var(static_cast<size_t>(channels));
  if (training) {
    std::vector<double> m(static_cast<size_t>(channels));
    if (xv.rows) channel_rows_stats(in, count, channels, xv.row_stride, m, var);
    else channel_stats(in, n, channels, plane, m, var);
    for (int64_t c = 0; c < channels; ++c) {
      mean[c] = static_cast<Acc>(m[c]);
      invstd[c] = static_cast<Acc>(1.0 / std::sqrt(var[c] + eps));
    }
    // Running statistics take the unbiased batch variance, as in PyTorch.
    if (count > 0 && running_mean.defined()) {
      std::vector<double> rm = running_mean.to_vector<double>();
      for (int64_t c = 0; c < channels; ++c) rm[c] = (1 - momentum) * rm[c] + momentum * static_cast<double>(mean[c]);
      store_values(running_mean, rm);
    }
    if (count > 0 && running_var.defined()) {
      std::vector<double> rv = running_var.to_vector<double>();
      const double unbias = count > 1 ? static_cast<double>(count) / static_cast<double>(count - 1) : 1.0;
      for (int64_t c = 0; c < channels; ++c) rv[c] = (1 - momentum) * rv[c] + momentum * var[c] * unbias;
      store_values(running_var, rv);
    }
  } else {
    std::vector<double> rm = running_mean.to_vector<double>(), rv = running_var.to_vector<double>();
    for (int64_t c = 0; c < channels; ++c) {
      mean[c] = static_cast<Acc>(rm[c]);
      invstd[c] = static_cast<Acc>(1.0 / std::sqrt(rv[c] + eps));
    }
  }

  const std::vector<Acc> weight = param_values<Acc>(call.input(1), channels, Acc(1));
  const std::vector<Acc> bias = param_values<Acc>(call.input(2), channels, Acc(0));
  const auto [scale, shift] = batch_norm_affine(mean, invstd, weight, bias);
  if (xv.rows) {
    const bool direct = out_row_stride && (*out_row_stride >= channels || count <= 1);
    Tensor y = direct ? out
                      : detail::make_empty_strided(out.sizes().vec(), channel_rows_strides(out.sizes()), out.dtype(),
                                                   out.device());
    if (count > 0)
      affine_channel_rows<Relu>(in, xv.row_stride, y.data_ptr<T>(), direct ? *out_row_stride : channels, count,
                                channels, scale, shift);
    if (!direct) out.copy_(y);
  } else {
    with_contiguous_output(out, [&](Tensor& y) {
      affine_planar<Relu>(in, y.data_ptr<T>(), n, channels, plane, scale, shift);
    });
  }
  store_values(outs[1], mean);
  store_values(outs[2], invstd);
}

void batch_norm_kernel(const OpCall& call, std::span<Tensor> outs) {
  KILN_DISPATCH_FLOATING(call.input(0).dtype(), "batch_norm", [&] { batch_norm_typed<scalar_t, false>(call, outs); });
}

void batch_norm_relu_kernel(const OpCall& call, std::span<Tensor> outs) {
  KILN_DISPATCH_FLOATING(call.input(0).dtype(), "batch_norm_relu",
                         [&] { batch_norm_typed<scalar_t, true>(call, outs); });
}

// ---------------- layer_norm and group_norm ----------------

// Normalizes `rows` contiguous blocks of `row_size` values. A block's values split into runs of
// `run` elements that share a per-run affine parameter index: run r of block i uses
// param_index(i, r). Writes each block's mean and 1 / sqrt(var + eps).
template <class T, class ParamIndex>
void normalize_blocks(const T* in, T* out, int64_t rows, int64_t row_size, int64_t run, double eps,
                      const std::vector<opmath_t<T>>& weight, const std::vector<opmath_t<T>>& bias, bool per_element,
                      ParamIndex&& param_index, std::vector<opmath_t<T>>& mean_out,
                      std::vector<opmath_t<T>>& rstd_out) {
  using Acc = opmath_t<T>;
  parallel_for(rows, std::max<int64_t>(1, kGrainSize / std::max<int64_t>(1, row_size)), [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const T* x = in + i * row_size;
      T* y = out + i * row_size;
      const Acc mean = row_size > 0 ? static_cast<Acc>(row_sum(x, row_size) / static_cast<Acc>(row_size)) : Acc(0);
      const Acc var = row_size > 0 ? row_sq_dev(x, row_size, mean) / static_cast<Acc>(row_size) : Acc(0);
      const Acc rstd = static_cast<Acc>(1.0 / std::sqrt(static_cast<double>(var) + eps));
      mean_out[i] = mean;
      rstd_out[i] = rstd;
      if (per_element) {  // layer_norm: weight/bias per element of the row
        const Acc* __restrict w = weight.data();
        const Acc* __restrict bb = bias.data();
#pragma omp simd
        for (int64_t j = 0; j < row_size; ++j)
          y[j] = static_cast<T>((static_cast<Acc>(x[j]) - mean) * rstd * w[j] + bb[j]);
      } else {  // group_norm: weight/bias per channel, one channel per run
        for (int64_t r = 0; r * run < row_size; ++r) {
          const int64_t p = param_index(i, r);
          const Acc scale = rstd * weight[p];
          affine_row(x + r * run, y + r * run, run, scale, bias[p] - mean * scale);
        }
      }
    }
  });
}

template <class T>
void layer_norm_typed(const OpCall& call, std::span<Tensor> outs) {
  using Acc = opmath_t<T>;
  const Tensor x = call.input(0).contiguous();
  int64_t row_size = 1;
  for (int64_t d : call.ints_attr(0)) row_size *= d;
  const int64_t rows = outs[1].numel();
  const std::vector<Acc> weight = param_values<Acc>(call.input(1), row_size, Acc(1));
  const std::vector<Acc> bias = param_values<Acc>(call.input(2), row_size, Acc(0));
  std::vector<Acc> mean(static_cast<size_t>(rows)), rstd(static_cast<size_t>(rows));
  with_contiguous_output(outs[0], [&](Tensor& y) {
    normalize_blocks<T>(x.data_ptr<T>(), y.data_ptr<T>(), rows, row_size, row_size, call.double_attr(1), weight, bias,
                        true, [](int64_t, int64_t) { return int64_t{0}; }, mean, rstd);
  });
  store_values(outs[1], mean);
  store_values(outs[2], rstd);
}

template <class T>
void group_norm_typed(const OpCall& call, std::span<Tensor> outs) {
  using Acc = opmath_t<T>;
  const Tensor x = call.input(0).contiguous();
  const int64_t n = x.sizes()[0], channels = x.sizes()[1], groups = call.int_attr(0);
  const int64_t plane = n * channels == 0 ? 0 : x.numel() / (n * channels);
  const int64_t per_group = channels / groups;
  const std::vector<Acc> weight = param_values<Acc>(call.input(1), channels, Acc(1));
  const std::vector<Acc> bias = param_values<Acc>(call.input(2), channels, Acc(0));
  std::vector<Acc> mean(static_cast<size_t>(n * groups)), rstd(static_cast<size_t>(n * groups));
  with_contiguous_output(outs[0], [&](Tensor& y) {
    if (plane == 0 || per_group == 0) {
      for (size_t i = 0; i < mean.size(); ++i) rstd[i] = static_cast<Acc>(1.0 / std::sqrt(call.double_attr(1)));
      return;
    }
    normalize_blocks<T>(x.data_ptr<T>(), y.data_ptr<T>(), n * groups, per_group * plane, plane, call.double_attr(1),
                        weight, bias, false,
                        [&](int64_t block, int64_t r) { return (block % groups) * per_group + r; }, mean, rstd);
  });
  store_values(outs[1], mean);
  store_values(outs[2], rstd);
}

void layer_norm_kernel(const OpCall& call, std::span<Tensor> outs) {
  KILN_DISPATCH_FLOATING(call.input(0).dtype(), "layer_norm", [&] { layer_norm_typed<scalar_t>(call, outs); });
}

void group_norm_kernel(const OpCall& call, std::span<Tensor> outs) {
  KILN_DISPATCH_FLOATING(call.input(0).dtype(), "group_norm", [&] { group_norm_typed<scalar_t>(call, outs); });
}

[[maybe_unused]] const bool registered = [] {
  register_kernel("native_batch_norm", DeviceType::cpu, batch_norm_kernel);
  register_kernel("batch_norm_relu", DeviceType::cpu, batch_norm_relu_kernel);
  register_kernel("native_layer_norm", DeviceType::cpu, layer_norm_kernel);
  register_kernel("native_group_norm", DeviceType::cpu, group_norm_kernel);
  return true;
}();

}  // namespace

}  // namespace kiln::cpu
