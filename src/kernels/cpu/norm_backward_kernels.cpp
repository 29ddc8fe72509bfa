// CPU kernels for native_batch_norm_backward (and batch_norm_relu_backward[_recompute]: the same
// loops reading the gradient through the relu's mask, read or recomputed),
// native_layer_norm_backward and native_group_norm_backward.
//
// layer_norm and group_norm work block by block (a row, an (n, group) block): one pass computes
// the block's reductions (sum(dy * w), sum(dy * w * x)), the next writes dx while the block is
// still in cache. batch_norm's channel is N strided runs, so it streams through memory order
// twice instead (faster than gathering a channel): pass 1 accumulates per-channel sum(dy) and
// sum(dy * (x - mean)) into one partial row per thread, pass 2 writes dx (channels-last data
// goes the same way, row by row of C channels: norm_loops.h). Inner loops are
// contiguous and vectorized (`omp simd`) in opmath precision (float for float16/bfloat16/float32,
// double for float64); run sums are combined in double. layer_norm's weight and bias gradients
// (column sums over rows) use one accumulator row per thread.
//
// The formulas are aten's (Normalization.cpp batch_norm_backward_cpu_template,
// layer_norm_kernel.cpp, group_norm_kernel.cpp).
#include <cmath>
#include <tuple>

#include "kernels/cpu/loops.h"
#include "kernels/cpu/norm_loops.h"
#include "core/tensor_factory.h"
#include "kiln/op_table.h"
#include "kiln/ops.h"

namespace kiln::cpu {

namespace {

// Values of an optional parameter in opmath precision (`fill` when undefined).
template <class Acc>
std::vector<Acc> param_values(const Tensor& t, int64_t n, Acc fill) {
  if (!t.defined()) return std::vector<Acc>(static_cast<size_t>(n), fill);
  if (t.dtype() == dtype_of_v<Acc> && t.is_contiguous()) {
    const Acc* p = t.data_ptr<Acc>();
    return std::vector<Acc>(p, p + n);
  }
  std::vector<double> v = t.to_vector<double>();
  return std::vector<Acc>(v.begin(), v.end());
}

// Writes `values` (row-major) into t, converting to its dtype.
template <class Acc>
void store_values(Tensor& t, const std::vector<Acc>& values) {
  if (t.numel() == 0) return;
  if (t.is_contiguous() && t.dtype() == dtype_of_v<Acc>) {
    std::copy(values.begin(), values.end(), t.data_ptr<Acc>());
    return;
  }
  Tensor src = detail::make_empty(t.sizes().vec(), dtype_of_v<Acc>, t.device());
  std::copy(values.begin(), values.end(), src.data_ptr<Acc>());
  t.copy_(src);
}

// A contiguous tensor of dtype T with t's values.
Tensor contiguous_as(const Tensor& t, DType dtype) { return as_dtype(t, dtype).contiguous(); }

// Runs body(dx) with a contiguous dx, copying into `out` afterwards when it is not.
template <class Body>
void with_contiguous_output(Tensor& out, Body&& body) {
  Tensor y = out.is_contiguous() ? out : detail::make_empty(out.sizes().vec(), out.dtype(), out.device());
  body(y);
  if (!y.same(out)) out.copy_(y);
}

bool mask_at(const OpCall& c, size_t attr, int i) { return c.ints_attr(attr)[i] != 0; }

// ---------------- batch_norm ----------------

// How a batch-norm backward finds the relu mask it reads its gradient through, where(r <= threshold,
// fill, dy), r = relu(batch norm's output): not at all (native_batch_norm_backward), by reading the
// relu's result r (batch_norm_relu_backward), or by recomputing r from x with the forward's
// per-channel affine map and affine_value, bit for bit the forward's r
// (batch_norm_relu_backward_recompute: one stream of activations less in each pass). The loops take
// it as a template parameter and a ReluMask operand, so the plain backward pays nothing for it.
enum class Mask { none, result, recompute };

template <class T>
struct ReluMask {
  using Acc = opmath_t<T>;
  const T* r = nullptr;  // Mask::result: r, laid out like x (channel rows `r_stride` apart)
  int64_t r_stride = 0;
  Acc threshold = Acc(0), fill = Acc(0);
  const Acc* scale = nullptr;  // Mask::recompute: the forward's per-channel affine map
  const Acc* shift = nullptr;
  // r + offset (elements) for Mask::result, else nullptr (the loops then never read it).
  template <Mask M>
  const T* at(int64_t offset) const {
    if constexpr (M == Mask::result) return r + offset;
    return nullptr;
  }
};

// dy[i] in opmath precision, masked by the relu's result when M is Mask::result (NaN in r compares
// false, so the gradient passes, as where(le(r, 0), 0, dy) does). Both values are loaded first: a
// load under the condition would keep the loops from vectorizing.
template <Mask M, class T, class Acc>
inline __attribute__((always_inline)) Acc grad_at(const T* __restrict dy, const T* __restrict r, int64_t i,
                                                  Acc threshold, Acc fill) {
  static_assert(M != Mask::recompute, "recomputed masks go through recomputed_grad");
  const Acc g = static_cast<Acc>(dy[i]);
  if constexpr (M == Mask::result) {
    const Acc result = static_cast<Acc>(r[i]);
    return result <= threshold ? fill : g;
  }
  return g;
}

// dy masked by r = relu(x * scale + shift), recomputed as batch_norm_relu computed it.
template <class T, class Acc>
inline __attribute__((always_inline)) Acc recomputed_grad(T dy, T x, Acc scale, Acc shift, Acc threshold,
                                                          Acc fill) {
  const Acc g = static_cast<Acc>(dy);
  const Acc result = static_cast<Acc>(affine_value<true>(x, scale, shift));
  return result <= threshold ? fill : g;
}

// sum(dy) and sum(dy * (x - mean)) over n contiguous values.
template <Mask M, class T, class Acc = opmath_t<T>>
inline void centered_sums(const T* __restrict x, const T* __restrict dy, const T* __restrict r, int64_t n, Acc mean,
                          Acc threshold, Acc fill, Acc& sum_dy, Acc& dot) {
  Acc s = 0, d = 0;
#pragma omp simd reduction(+ : s, d)
  for (int64_t i = 0; i < n; ++i) {
    const Acc g = grad_at<M>(dy, r, i, threshold, fill);
    s += g;
    d += g * (static_cast<Acc>(x[i]) - mean);
  }
  sum_dy = s;
  dot = d;
}

// Pass 1 on channel rows, for channels [c0, c0 + kWidth) of rows [r0, r1): adds sum(dy) and
// sum(dy * (x - mean)) into s and d. The tile's sums and means (and a recomputed mask's affine
// map) stay in registers while the rows stream by (a row-at-a-time loop over all channels would
// load and store its sums for every row, and that traffic, not memory, would bound it).
template <int64_t kWidth, Mask M, class T, class Acc = opmath_t<T>>
inline void channel_tile_sums(const T* xp, int64_t x_stride, const T* gp, int64_t g_stride, const ReluMask<T>& relu,
                              int64_t c0, int64_t r0, int64_t r1, const Acc* mean, Acc* s_out, Acc* d_out) {
  Acc s[kWidth] = {}, d[kWidth] = {}, m[kWidth], sc[kWidth] = {}, sh[kWidth] = {};
  std::copy_n(mean, kWidth, m);
  if constexpr (M == Mask::recompute) {
    std::copy_n(relu.scale + c0, kWidth, sc);
    std::copy_n(relu.shift + c0, kWidth, sh);
  }
  const Acc th = relu.threshold, fill = relu.fill;
  for (int64_t r = r0; r < r1; ++r) {
    const T* __restrict x = xp + r * x_stride;
    const T* __restrict g = gp + r * g_stride;
    const T* __restrict rr = relu.template at<M>(r * relu.r_stride + c0);
#pragma omp simd
    for (int64_t c = 0; c < kWidth; ++c) {
      Acc gv;
      if constexpr (M == Mask::recompute) gv = recomputed_grad(g[c], x[c], sc[c], sh[c], th, fill);
      else gv = grad_at<M>(g, rr, c, th, fill);
      s[c] += gv;
      d[c] += gv * (static_cast<Acc>(x[c]) - m[c]);
    }
  }
  for (int64_t c = 0; c < kWidth; ++c) {
    s_out[c] += s[c];
    d_out[c] += d[c];
  }
}

// Pass 1 on channel rows: per-channel sum(dy) and sum(dy * (x - mean)) over `rows` rows, in blocks
// of kBlock rows. A block is walked one tile of channels at a time (registers hold a tile's sums:
// channel_tile_sums), summed in opmath precision and added into partial sums in double. The
// blocks are split across threads; where there are fewer blocks than threads (small planes:
// DenseNet's 8x8 and 4x4 layers at batch 16 hold 4 blocks and 1), each block's channels are split
// too, so that those layers use every thread instead of one per block.
template <Mask M, class T, class Acc = opmath_t<T>>
void channel_rows_sums(const T* xp, int64_t x_stride, const T* gp, int64_t g_stride, const ReluMask<T>& relu,
                       int64_t rows, int64_t channels, const std::vector<Acc>& mean, std::vector<double>& sum_dy,
                       std::vector<double>& dot) {
  // 8 vector registers of sums, 8 of differences, 8 of means (and 4 + 4 of the affine map, on half
  // as many channels, when the mask is recomputed).
  constexpr int64_t kTile = (M == Mask::recompute ? 256 : 512) / sizeof(Acc);
  constexpr int64_t kBlock = 256;  // rows summed in opmath precision before double
  // Sums of rows [r0, r1) over channels [c_begin, c_end) into s and d (indexed by channel).
  auto block_sums = [&](int64_t r0, int64_t r1, int64_t c_begin, int64_t c_end, Acc* s, Acc* d) {
    int64_t c0 = c_begin;
    for (; c0 + kTile <= c_end; c0 += kTile)
      channel_tile_sums<kTile, M>(xp + c0, x_stride, gp + c0, g_stride, relu, c0, r0, r1, mean.data() + c0, s + c0,
                                  d + c0);
    for (; c0 + 16 <= c_end; c0 += 16)
      channel_tile_sums<16, M>(xp + c0, x_stride, gp + c0, g_stride, relu, c0, r0, r1, mean.data() + c0, s + c0,
                               d + c0);
    for (; c0 < c_end; ++c0)
      channel_tile_sums<1, M>(xp + c0, x_stride, gp + c0, g_stride, relu, c0, r0, r1, mean.data() + c0, s + c0,
                              d + c0);
  };
  const int64_t blocks = (rows + kBlock - 1) / kBlock;
  const int64_t threads = max_threads();
  // Channel groups per block: enough to give every thread work, each group at least 64 channels
  // (whole 16-channel tiles) and kGrainSize values.
  int64_t groups = 1;
  if (blocks < threads) {
    const int64_t per_block = std::min(rows, kBlock) * channels;
    groups = std::min({(threads + blocks - 1) / blocks, std::max<int64_t>(1, channels / 64),
                       std::max<int64_t>(1, per_block / kGrainSize)});
  }
  if (groups <= 1) {
    std::vector<double> sums = sum_rows(blocks, kBlock * channels, 2 * channels, [&](double* __restrict out, int64_t b) {
      thread_local std::vector<Acc> scratch;
      scratch.assign(static_cast<size_t>(2 * channels), Acc(0));
      block_sums(b * kBlock, std::min(rows, (b + 1) * kBlock), 0, channels, scratch.data(), scratch.data() + channels);
#pragma omp simd
      for (int64_t c = 0; c < 2 * channels; ++c) out[c] += static_cast<double>(scratch[c]);
    });
    std::copy(sums.begin(), sums.begin() + channels, sum_dy.begin());
    std::copy(sums.begin() + channels, sums.end(), dot.begin());
    return;
  }
  // One task per (block, channel group); each writes its own block's slice of `partial`.
  const int64_t group_width = (channels / 16 + groups - 1) / groups * 16;
  std::vector<double> partial(static_cast<size_t>(blocks * 2 * channels), 0.0);
  parallel_for(blocks * groups, 1, [&](int64_t tb, int64_t te) {
    thread_local std::vector<Acc> scratch;
    scratch.assign(static_cast<size_t>(2 * channels), Acc(0));
    for (int64_t task = tb; task < te; ++task) {
      const int64_t b = task / groups, g = task % groups;
      const int64_t c_begin = g * group_width;
      const int64_t c_end = g + 1 == groups ? channels : std::min(channels, c_begin + group_width);
      if (c_begin >= c_end) continue;
      Acc* s = scratch.data();
      Acc* d = s + channels;
      std::fill(s + c_begin, s + c_end, Acc(0));
      std::fill(d + c_begin, d + c_end, Acc(0));
      block_sums(b * kBlock, std::min(rows, (b + 1) * kBlock), c_begin, c_end, s, d);
      double* out = partial.data() + b * 2 * channels;
      for (int64_t c = c_begin; c < c_end; ++c) {
        out[c] = static_cast<double>(s[c]);
        out[channels + c] = static_cast<double>(d[c]);
      }
    }
  });
  for (int64_t c = 0; c < channels; ++c) {
    double sd = 0, dd = 0;
    for (int64_t b = 0; b < blocks; ++b) {
      sd += partial[static_cast<size_t>(b * 2 * channels + c)];
      dd += partial[static_cast<size_t>(b * 2 * channels + channels + c)];
    }
    sum_dy[static_cast<size_t>(c)] = sd;
    dot[static_cast<size_t>(c)] = dd;
  }
}

// Pass 2 on channel rows: dx = dy * a + (x * b + c), per channel. Three per-channel operands
// instead of four keep the loop at streaming speed (their loads compete with the data's); the
// rounding of x * b next to c is the forward's (x * scale + shift). In evaluation the map is
// affine, dx = dy * a, and x is not read for the value (x * 0 would be NaN at +-inf).
template <Mask M, class T, class Acc = opmath_t<T>>
void channel_rows_grad_input(const T* xp, int64_t x_stride, const T* gp, int64_t g_stride, const ReluMask<T>& relu,
                             T* dx, int64_t dx_stride, int64_t rows, int64_t channels, const std::vector<Acc>& a,
                             const std::vector<Acc>& b, const std::vector<Acc>& c, bool train) {
  const int64_t grain = std::max<int64_t>(1, kGrainSize / std::max<int64_t>(1, channels));
  parallel_for(rows, grain, [&](int64_t begin, int64_t end) {
    const Acc* __restrict pa = a.data();
    const Acc* __restrict pb = b.data();
    const Acc* __restrict pc = c.data();
    const Acc* __restrict fs = relu.scale;
    const Acc* __restrict fh = relu.shift;
    const Acc th = relu.threshold, fill = relu.fill;
    for (int64_t r = begin; r < end; ++r) {
      const T* __restrict xr = xp + r * x_stride;
      const T* __restrict gr = gp + r * g_stride;
      const T* __restrict rr = relu.template at<M>(r * relu.r_stride);
      T* __restrict o = dx + r * dx_stride;
      if (!train) {
#pragma omp simd
        for (int64_t k = 0; k < channels; ++k) {
          Acc g;
          if constexpr (M == Mask::recompute) g = recomputed_grad(gr[k], xr[k], fs[k], fh[k], th, fill);
          else g = grad_at<M>(gr, rr, k, th, fill);
          o[k] = static_cast<T>(g * pa[k]);
        }
        continue;
      }
#pragma omp simd
      for (int64_t k = 0; k < channels; ++k) {
        Acc g;
        if constexpr (M == Mask::recompute) g = recomputed_grad(gr[k], xr[k], fs[k], fh[k], th, fill);
        else g = grad_at<M>(gr, rr, k, th, fill);
        o[k] = static_cast<T>(g * pa[k] + (static_cast<Acc>(xr[k]) * pb[k] + pc[k]));
      }
    }
  });
}

// The operands of a batch-norm backward (native_batch_norm_backward, batch_norm_relu_backward,
// batch_norm_relu_backward_recompute).
struct BatchNormBackwardCall {
  const OpCall& call;
  const Tensor& grad;
  const Tensor& x;
  const Tensor& weight;
  const Tensor& mean;
  const Tensor& invstd;
  const Tensor* relu_result = nullptr;  // Mask::result: the relu's output
  const Tensor* threshold = nullptr;    // both relu masks
  const Tensor* fill = nullptr;
  const Tensor* bias = nullptr;  // Mask::recompute: the forward's bias (may be undefined)
};

// The value of an optional 0-dim operand converted to T (0 when undefined), in opmath precision.
template <class T>
opmath_t<T> scalar_operand(const Tensor* t) {
  if (!t || !t->defined()) return opmath_t<T>(0);
  return static_cast<opmath_t<T>>(as_dtype(*t, dtype_of_v<T>).template item<T>());
}

// x and grad_output (and a relu's result) are read in x's layout (planar or channel rows, see
// norm_loops.h; an operand in the other layout is copied), and grad_input is written in it. A
// recomputed mask runs in the channel-rows loops; planar x (not what the compiler's channels-last
// convolution networks produce) gets the relu's result materialized by the forward's own loop
// first and goes the Mask::result way.
template <class T, Mask M>
void batch_norm_backward_typed(const BatchNormBackwardCall& op, std::span<Tensor> outs) {
  using Acc = opmath_t<T>;
  const DType dt = dtype_of_v<T>;
  const OpCall& call = op.call;
  Tensor& dx_out = outs[0];
  const auto dx_row_stride = channel_row_stride(dx_out);
  const ChannelView xv = channel_view(op.x, dx_row_stride && !dx_out.is_contiguous());
  const int64_t channels = xv.t.sizes()[1];
  const std::vector<Acc> weight = param_values<Acc>(op.weight, channels, Acc(1));
  const std::vector<Acc> mean = param_values<Acc>(op.mean, channels, Acc(0));
  const std::vector<Acc> invstd = param_values<Acc>(op.invstd, channels, Acc(1));
  std::vector<Acc> forward_scale, forward_shift;
  if constexpr (M == Mask::recompute) {
    std::tie(forward_scale, forward_shift) =
        batch_norm_affine(mean, invstd, weight, param_values<Acc>(*op.bias, channels, Acc(0)));
    if (!xv.rows) {
      const int64_t n = xv.t.sizes()[0], plane = n * channels == 0 ? 0 : xv.t.numel() / (n * channels);
      Tensor result = detail::make_empty(xv.t.sizes().vec(), dt, xv.t.device());
      affine_planar<true>(xv.t.data_ptr<T>(), result.data_ptr<T>(), n, channels, plane, forward_scale, forward_shift);
      BatchNormBackwardCall with_result = op;
      with_result.relu_result = &result;
      batch_norm_backward_typed<T, Mask::result>(with_result, outs);
      return;
    }
  }
  const ChannelView gv = channel_view_as(as_dtype(op.grad, dt), xv.rows);
  ChannelView rv;
  ReluMask<T> relu;
  if constexpr (M != Mask::none) {
    relu.threshold = scalar_operand<T>(op.threshold);
    relu.fill = scalar_operand<T>(op.fill);
  }
  if constexpr (M == Mask::result) {
    rv = channel_view_as(as_dtype(*op.relu_result, dt), xv.rows);
    relu.r = rv.t.data_ptr<T>();
    relu.r_stride = rv.row_stride;
  }
  if constexpr (M == Mask::recompute) {
    relu.scale = forward_scale.data();
    relu.shift = forward_shift.data();
  }
  // The planar loops never see a recomputed mask (it went the Mask::result way above).
  constexpr Mask PM = M == Mask::recompute ? Mask::none : M;
  const Tensor& x = xv.t;
  const Tensor& dy = gv.t;
  const bool train = call.bool_attr(0);
  const bool need_input = mask_at(call, 1, 0), need_weight = mask_at(call, 1, 1), need_bias = mask_at(call, 1, 2);
  const int64_t n = x.sizes()[0];
  const int64_t plane = n * channels == 0 ? 0 : x.numel() / (n * channels);
  const int64_t rows = n * channels, count = n * plane;
  const T* xp = x.data_ptr<T>();
  const T* gp = dy.data_ptr<T>();
  const Acc th = relu.threshold, fill = relu.fill;

  // Pass 1 (memory order): per-channel sum(dy) and sum(dy * (x - mean)), one partial row of
  // channels (of columns, for small planes) per thread.
  std::vector<double> sum_dy(static_cast<size_t>(channels), 0.0), dot(static_cast<size_t>(channels), 0.0);
  const bool small = plane < kSmallPlane;
  const int64_t columns = channels * plane;
  if ((train || need_weight || need_bias) && rows > 0 && plane > 0) {
    if (xv.rows) {
      channel_rows_sums<M>(xp, xv.row_stride, gp, gv.row_stride, relu, count, channels, mean, sum_dy, dot);
    } else if (small) {
      const std::vector<Acc> column_mean = expand_to_columns(mean, plane);
      std::vector<double> sums = sum_rows(n, columns, 2 * columns, [&](double* __restrict s, int64_t i) {
        const T* __restrict xr = xp + i * columns;
        const T* __restrict gr = gp + i * columns;
        const T* __restrict rr = relu.template at<PM>(i * columns);
        const Acc* __restrict m = column_mean.data();
        double* __restrict d = s + columns;
#pragma omp simd
        for (int64_t k = 0; k < columns; ++k) {
          const Acc g = grad_at<PM>(gr, rr, k, th, fill);
          s[k] += static_cast<double>(g);
          d[k] += static_cast<double>(g * (static_cast<Acc>(xr[k]) - m[k]));
        }
      });
      for (int64_t c = 0; c < channels; ++c)
        for (int64_t j = 0; j < plane; ++j) {
          sum_dy[c] += sums[c * plane + j];
          dot[c] += sums[columns + c * plane + j];
        }
    } else {
      std::vector<double> sums = sum_rows(rows, plane, 2 * channels, [&](double* __restrict s, int64_t r) {
        const int64_t c = r % channels;
        Acc sd, d;
        centered_sums<PM>(xp + r * plane, gp + r * plane, relu.template at<PM>(r * plane), plane, mean[c], th,
                              fill, sd, d);
        s[c] += sd;
        s[channels + c] += d;
      });
      for (int64_t c = 0; c < channels; ++c) {
        sum_dy[c] = sums[c];
        dot[c] = sums[channels + c];
      }
    }
  }

  // Pass 2 (memory order): dx = (dy - mean(dy) - (x - mean) * k) * invstd * w in training, where
  // k = invstd^2 * mean(dy * (x - mean)); dy * invstd * w in evaluation.
  std::vector<Acc> scale(static_cast<size_t>(channels)), shift(static_cast<size_t>(channels)),
      k(static_cast<size_t>(channels));
  for (int64_t c = 0; need_input && c < channels; ++c) {
    scale[c] = invstd[c] * weight[c];
    k[c] = train && count > 0 ? static_cast<Acc>(dot[c] / static_cast<double>(count)) * invstd[c] * invstd[c]
                              : Acc(0);
    shift[c] = train && count > 0 ? static_cast<Acc>(sum_dy[c] / static_cast<double>(count)) : Acc(0);
  }
  if (need_input && xv.rows) {
    const bool direct = dx_row_stride && (*dx_row_stride >= channels || count <= 1);
    Tensor y = direct ? dx_out
                      : detail::make_empty_strided(dx_out.sizes().vec(), channel_rows_strides(dx_out.sizes()),
                                                   dx_out.dtype(), dx_out.device());
    // (dy - shift - (x - mean) * k) * scale, regrouped (in double) as dy * a + (x * b + c).
    std::vector<Acc> a(static_cast<size_t>(channels)), b(static_cast<size_t>(channels)),
        c(static_cast<size_t>(channels));
    for (int64_t ch = 0; ch < channels; ++ch) {
      const double sc = scale[ch], kc = k[ch];
      a[ch] = scale[ch];
      b[ch] = static_cast<Acc>(-kc * sc);
      c[ch] = static_cast<Acc>((static_cast<double>(mean[ch]) * kc - static_cast<double>(shift[ch])) * sc);
    }
    if (count > 0)
      channel_rows_grad_input<M>(xp, xv.row_stride, gp, gv.row_stride, relu, y.data_ptr<T>(),
                                      direct ? *dx_row_stride : channels, count, channels, a, b, c, train);
    if (!direct) dx_out.copy_(y);
  } else if (need_input) {
    with_contiguous_output(dx_out, [&](Tensor& dx_t) {
      T* dx = dx_t.data_ptr<T>();
      if (small) {  // per-column parameters, vectorized across a sample's columns
        const std::vector<Acc> cm = expand_to_columns(mean, plane), ck = expand_to_columns(k, plane),
                               csh = expand_to_columns(shift, plane), csc = expand_to_columns(scale, plane);
        parallel_for(n, std::max<int64_t>(1, kGrainSize / std::max<int64_t>(1, columns)), [&](int64_t b, int64_t e) {
          for (int64_t i = b; i < e; ++i) {
            const T* __restrict xr = xp + i * columns;
            const T* __restrict gr = gp + i * columns;
            const T* __restrict rr = relu.template at<PM>(i * columns);
            T* __restrict o = dx + i * columns;
            const Acc* __restrict m = cm.data();
            const Acc* __restrict kk = ck.data();
            const Acc* __restrict sh = csh.data();
            const Acc* __restrict sc = csc.data();
            if (train) {
#pragma omp simd
              for (int64_t j = 0; j < columns; ++j) {
                const Acc g = grad_at<PM>(gr, rr, j, th, fill);
                o[j] = static_cast<T>((g - sh[j] - (static_cast<Acc>(xr[j]) - m[j]) * kk[j]) * sc[j]);
              }
            } else {  // affine: x is not read (x * 0 would be NaN at +-inf)
#pragma omp simd
              for (int64_t j = 0; j < columns; ++j) o[j] = static_cast<T>(grad_at<PM>(gr, rr, j, th, fill) * sc[j]);
            }
          }
        });
        return;
      }
      parallel_for(rows, std::max<int64_t>(1, kGrainSize / std::max<int64_t>(1, plane)), [&](int64_t b, int64_t e) {
        for (int64_t r = b; r < e; ++r) {
          const int64_t c = r % channels;
          const T* __restrict xr = xp + r * plane;
          const T* __restrict gr = gp + r * plane;
          const T* __restrict rr = relu.template at<PM>(r * plane);
          T* __restrict o = dx + r * plane;
          const Acc m = mean[c], kc = k[c], sh = shift[c], sc = scale[c];
          if (train) {
#pragma omp simd
            for (int64_t j = 0; j < plane; ++j) {
              const Acc g = grad_at<PM>(gr, rr, j, th, fill);
              o[j] = static_cast<T>((g - sh - (static_cast<Acc>(xr[j]) - m) * kc) * sc);
            }
          } else {
#pragma omp simd
            for (int64_t j = 0; j < plane; ++j) o[j] = static_cast<T>(grad_at<PM>(gr, rr, j, th, fill) * sc);
          }
        }
      });
    });
  }
  if (need_weight) {
    std::vector<Acc> gw(static_cast<size_t>(channels));
    for (int64_t c = 0; c < channels; ++c) gw[c] = static_cast<Acc>(dot[c] * static_cast<double>(invstd[c]));
    store_values(outs[1], gw);
  }
  if (need_bias) store_values(outs[2], sum_dy);
}

// native_batch_norm_backward(grad_out, input, weight?, save_mean, save_invstd, train, output_mask).
void batch_norm_backward_kernel(const OpCall& call, std::span<Tensor> outs) {
  const BatchNormBackwardCall op{call, call.input(0), call.input(1), call.input(2), call.input(3), call.input(4)};
  KILN_DISPATCH_FLOATING(call.input(1).dtype(), "native_batch_norm_backward",
                         [&] { batch_norm_backward_typed<scalar_t, Mask::none>(op, outs); });
}

// batch_norm_relu_backward(grad_out, result, input, weight?, save_mean, save_invstd, threshold?,
// fill?, train, output_mask).
void batch_norm_relu_backward_kernel(const OpCall& call, std::span<Tensor> outs) {
  const BatchNormBackwardCall op{call,          call.input(0), call.input(2),  call.input(3),  call.input(4),
                                 call.input(5), &call.input(1), &call.input(6), &call.input(7)};
  KILN_DISPATCH_FLOATING(call.input(2).dtype(), "batch_norm_relu_backward",
                         [&] { batch_norm_backward_typed<scalar_t, Mask::result>(op, outs); });
}

// batch_norm_relu_backward_recompute(grad_out, input, weight?, save_mean, save_invstd, bias?,
// threshold?, fill?, train, output_mask).
void batch_norm_relu_backward_recompute_kernel(const OpCall& call, std::span<Tensor> outs) {
  const BatchNormBackwardCall op{call,          call.input(0), call.input(1),  call.input(2),  call.input(3),
                                 call.input(4), nullptr,       &call.input(6), &call.input(7), &call.input(5)};
  KILN_DISPATCH_FLOATING(call.input(1).dtype(), "batch_norm_relu_backward_recompute",
                         [&] { batch_norm_backward_typed<scalar_t, Mask::recompute>(op, outs); });
}

// ---------------- layer_norm ----------------

template <class T>
void layer_norm_backward_typed(const OpCall& call, std::span<Tensor> outs) {
  using Acc = opmath_t<T>;
  const DType dt = dtype_of_v<T>;
  const Tensor x = call.input(1).contiguous();
  const Tensor dy = contiguous_as(call.input(0), dt);
  int64_t row_size = 1;
  for (int64_t d : call.ints_attr(0)) row_size *= d;
  const int64_t rows = row_size == 0 ? call.input(2).numel() : x.numel() / row_size;
  const bool need_input = mask_at(call, 1, 0), need_weight = mask_at(call, 1, 1), need_bias = mask_at(call, 1, 2);
  const std::vector<Acc> mean = param_values<Acc>(call.input(2), rows, Acc(0));
  const std::vector<Acc> rstd = param_values<Acc>(call.input(3), rows, Acc(1));
  const std::vector<Acc> weight = param_values<Acc>(call.input(4), row_size, Acc(1));
  const T* xp = x.data_ptr<T>();
  const T* gp = dy.data_ptr<T>();
  const bool need_params = need_weight || need_bias;

  // Per-thread accumulators for the weight and bias gradients.
  const int64_t chunks =
      std::max<int64_t>(1, std::min<int64_t>(omp_get_max_threads(), rows * row_size / kGrainSize));
  std::vector<Acc> partial_weight(need_params ? static_cast<size_t>(chunks * row_size) : 0, Acc(0));
  std::vector<Acc> partial_bias(need_params ? static_cast<size_t>(chunks * row_size) : 0, Acc(0));

  auto run = [&](T* dx) {
    parallel_for(chunks, 1, [&](int64_t cb, int64_t ce) {
      for (int64_t chunk = cb; chunk < ce; ++chunk) {
        Acc* __restrict pw = need_params ? partial_weight.data() + chunk * row_size : nullptr;
        Acc* __restrict pb = need_params ? partial_bias.data() + chunk * row_size : nullptr;
        const Acc* __restrict w = weight.data();
        for (int64_t r = rows * chunk / chunks; r < rows * (chunk + 1) / chunks; ++r) {
          const T* __restrict xr = xp + r * row_size;
          const T* __restrict gr = gp + r * row_size;
          const Acc m = mean[r], rs = rstd[r];
          if (need_params) {
#pragma omp simd
            for (int64_t j = 0; j < row_size; ++j) {
              const Acc g = static_cast<Acc>(gr[j]);
              pw[j] += g * (static_cast<Acc>(xr[j]) - m) * rs;
              pb[j] += g;
            }
          }
          if (!dx) continue;
          // ds = sum(dy * w * x), db = sum(dy * w); dx = rs * dy * w + b * x + c.
          Acc ds = 0, db = 0;
#pragma omp simd reduction(+ : ds, db)
          for (int64_t j = 0; j < row_size; ++j) {
            const Acc gw = static_cast<Acc>(gr[j]) * w[j];
            ds += gw * static_cast<Acc>(xr[j]);
            db += gw;
          }
          const Acc scale = Acc(1) / static_cast<Acc>(row_size);
          const Acc b = (db * m - ds) * rs * rs * rs * scale;
          const Acc c = -b * m - db * rs * scale;
          T* __restrict o = dx + r * row_size;
#pragma omp simd
          for (int64_t j = 0; j < row_size; ++j)
            o[j] = static_cast<T>(rs * static_cast<Acc>(gr[j]) * w[j] + b * static_cast<Acc>(xr[j]) + c);
        }
      }
    });
  };
  if (need_input) {
    with_contiguous_output(outs[0], [&](Tensor& dx) { run(dx.data_ptr<T>()); });
  } else if (need_params) {
    run(nullptr);
  }
  if (need_params) {
    std::vector<Acc> gw(static_cast<size_t>(row_size), Acc(0)), gb(static_cast<size_t>(row_size), Acc(0));
    for (int64_t chunk = 0; chunk < chunks; ++chunk)
      for (int64_t j = 0; j < row_size; ++j) {
        gw[j] += partial_weight[chunk * row_size + j];
        gb[j] += partial_bias[chunk * row_size + j];
      }
    if (need_weight) store_values(outs[1], gw);
    if (need_bias) store_values(outs[2], gb);
  }
}

void layer_norm_backward_kernel(const OpCall& call, std::span<Tensor> outs) {
  KILN_DISPATCH_FLOATING(call.input(1).dtype(), "native_layer_norm_backward",
                         [&] { layer_norm_backward_typed<scalar_t>(call, outs); });
}

// ---------------- group_norm ----------------

template <class T>
void group_norm_backward_typed(const OpCall& call, std::span<Tensor> outs) {
  using Acc = opmath_t<T>;
  const DType dt = dtype_of_v<T>;
  const Tensor x = call.input(1).contiguous();
  const Tensor dy = contiguous_as(call.input(0), dt);
  const int64_t groups = call.int_attr(0);
  const bool need_input = mask_at(call, 1, 0), need_weight = mask_at(call, 1, 1), need_bias = mask_at(call, 1, 2);
  const int64_t n = x.sizes()[0], channels = x.sizes()[1];
  const int64_t plane = n * channels == 0 ? 0 : x.numel() / (n * channels);
  const int64_t per_group = channels / groups;
  const std::vector<Acc> mean = param_values<Acc>(call.input(2), n * groups, Acc(0));
  const std::vector<Acc> rstd = param_values<Acc>(call.input(3), n * groups, Acc(1));
  const std::vector<Acc> weight = param_values<Acc>(call.input(4), channels, Acc(1));
  // Per (n, c): sum(dy * x) and sum(dy) over the plane.
  std::vector<Acc> ds(static_cast<size_t>(n * channels)), db(static_cast<size_t>(n * channels));
  const T* xp = x.data_ptr<T>();
  const T* gp = dy.data_ptr<T>();

  auto run = [&](T* dx) {
    const int64_t blocks = n * groups;
    parallel_for(blocks, std::max<int64_t>(1, kGrainSize / std::max<int64_t>(1, per_group * plane)),
                 [&](int64_t b, int64_t e) {
                   for (int64_t block = b; block < e; ++block) {
                     const int64_t i = block / groups, g = block % groups;
                     Acc ds_g = 0, db_g = 0;
                     for (int64_t c = g * per_group; c < (g + 1) * per_group; ++c) {
                       const T* __restrict xr = xp + (i * channels + c) * plane;
                       const T* __restrict gr = gp + (i * channels + c) * plane;
                       Acc s = 0, d = 0;
#pragma omp simd reduction(+ : s, d)
                       for (int64_t j = 0; j < plane; ++j) {
                         const Acc gv = static_cast<Acc>(gr[j]);
                         s += gv * static_cast<Acc>(xr[j]);
                         d += gv;
                       }
                       ds[i * channels + c] = s;
                       db[i * channels + c] = d;
                       ds_g += s * weight[c];
                       db_g += d * weight[c];
                     }
                     if (!dx) continue;
                     const Acc m = mean[block], rs = rstd[block];
                     const Acc scale = Acc(1) / static_cast<Acc>(per_group * plane);
                     const Acc c2 = (db_g * m - ds_g) * rs * rs * rs * scale;
                     const Acc c3 = -c2 * m - db_g * rs * scale;
                     for (int64_t c = g * per_group; c < (g + 1) * per_group; ++c) {
                       const Acc c1 = rs * weight[c];
                       const int64_t at = (i * channels + c) * plane;
                       const T* __restrict xr = xp + at;
                       const T* __restrict gr = gp + at;
                       T* __restrict o = dx + at;
#pragma omp simd
                       for (int64_t j = 0; j < plane; ++j)
                         o[j] = static_cast<T>(c1 * static_cast<Acc>(gr[j]) + c2 * static_cast<Acc>(xr[j]) + c3);
                     }
                   }
                 });
  };
  if (need_input) {
    with_contiguous_output(outs[0], [&](Tensor& dx) { run(dx.data_ptr<T>()); });
  } else if (need_weight || need_bias) {
    run(nullptr);
  }
  if (need_weight || need_bias) {
    std::vector<Acc> gw(static_cast<size_t>(channels), Acc(0)), gb(static_cast<size_t>(channels), Acc(0));
    for (int64_t i = 0; i < n; ++i)
      for (int64_t c = 0; c < channels; ++c) {
        const int64_t block = i * groups + c / per_group;
        gw[c] += (ds[i * channels + c] - db[i * channels + c] * mean[block]) * rstd[block];
        gb[c] += db[i * channels + c];
      }
    if (need_weight) store_values(outs[1], gw);
    if (need_bias) store_values(outs[2], gb);
  }
}

void group_norm_backward_kernel(const OpCall& call, std::span<Tensor> outs) {
  KILN_DISPATCH_FLOATING(call.input(1).dtype(), "native_group_norm_backward",
                         [&] { group_norm_backward_typed<scalar_t>(call, outs); });
}

[[maybe_unused]] const bool registered = [] {
  register_kernel("native_batch_norm_backward", DeviceType::cpu, batch_norm_backward_kernel);
  register_kernel("batch_norm_relu_backward", DeviceType::cpu, batch_norm_relu_backward_kernel);
  register_kernel("batch_norm_relu_backward_recompute", DeviceType::cpu, batch_norm_relu_backward_recompute_kernel);
  register_kernel("native_layer_norm_backward", DeviceType::cpu, layer_norm_backward_kernel);
  register_kernel("native_group_norm_backward", DeviceType::cpu, group_norm_backward_kernel);
  return true;
}();

}  // namespace

}  // namespace kiln::cpu
