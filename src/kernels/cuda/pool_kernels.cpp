// Eager CUDA kernels of 2-D pooling: max_pool2d, max_pool2d_with_indices, avg_pool2d,
// adaptive_avg_pool2d and their backward ops, as generated CUDA C++ (NVRTC).
//
// Semantics are the CPU kernels' (src/kernels/cpu/pool_kernels.cpp, pool_backward_kernels.cpp,
// pool_window.h): the same windows (padding, dilation, ceil_mode through the output size),
// divisors (count_include_pad, divisor_override), PyTorch's max tie and NaN rules (windows walked
// row-major, a strictly greater value or a NaN takes over) and flat H * W indices.
//
// Forward: one thread per output element, reading the input in place through its strides (any
// layout); threads walk the output channels fastest when it is channels-last, so neighbouring
// threads read neighbouring channels. Backward: one thread per input-gradient element, gathering
// from the output windows that cover it in (oh, ow) order, which is the order in which the CPU's
// scatter adds them, so the sums round alike; no atomics, no zero fill, float accumulation for
// 16-bit floats. max_pool2d_with_indices_backward first checks on the device that each index lies
// in its own window (indices from max_pool2d_with_indices always do); the host reads that flag,
// raises the CPU's IndexError for an index outside the plane, and takes an atomic scatter for the
// rare in-plane index outside its window.
#include "kernels/cuda/pool_kernels.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <optional>

#include "kernels/cuda/jit.h"
#include "kernels/cuda/kernel_source.h"
#include "core/tensor_factory.h"
#include "kiln/op_table.h"
#include "kiln/ops.h"

namespace kiln::cuda::detail {

namespace {

constexpr int kBlock = 256;

// ---------------- generated sources ----------------

// The parameter block of every pooling kernel (mirrored by kParamsSource).
struct PoolParams {
  const void* in;       // forward: x; backward: grad_output
  const void* indices;  // max pooling's indices (forward: written)
  void* out;            // forward: y; backward: dx (or the scatter's accumulator)
  int* flag;            // max backward check: bit 0 index outside the plane, bit 1 outside its window
  long long size[6];    // n, c, h, w (the input's), oh, ow (the output's)
  long long in_stride[4], index_stride[4], out_stride[4];  // element strides (n, c, h, w)
  long long kernel[2], stride[2], pad[2], dilation[2];
  long long divisor;  // avg: divisor_override, 0 for none
  long long count_include_pad, tiled, total;
  long long trap;  // max backward scatter inside a CUDA graph: an index outside the plane traps
};

constexpr const char* kParamsSource = R"(
struct Params {
  const char* in;
  const long long* indices;
  char* out;
  int* flag;
  long long size[6];
  long long in_stride[4], index_stride[4], out_stride[4];
  long long kernel[2], stride[2], pad[2], dilation[2];
  long long divisor;
  long long count_include_pad, tiled, total;
  long long trap;
};
template <class I> __forceinline__ I imin(I a, I b) { return a < b ? a : b; }
template <class I> __forceinline__ I imax(I a, I b) { return a > b ? a : b; }
// Splits a flat index into (n, c, h, w) of sizes (N, C, H, W): channels fastest when CL.
template <bool CL, class I> __forceinline__ void split(I i, I C, I H, I W, I& n, I& c, I& h, I& w) {
  I t;
  if constexpr (CL) { c = i % C; t = i / C; w = t % W; t /= W; h = t % H; n = t / H; }
  else { w = i % W; t = i / W; h = t % H; t /= H; c = t % C; n = t / C; }
}
template <class I> __forceinline__ I offset(const long long* s, I n, I c, I h, I w) {
  return n * (I)s[0] + c * (I)s[1] + h * (I)s[2] + w * (I)s[3];
}
// The output positions [lo, hi) along one axis whose max-pool window (of extent k_eff) can cover
// input position i: PyTorch's range.
template <class I> __forceinline__ void covering(I i, I pad, I k_eff, I stride, I out, I& lo, I& hi) {
  lo = i + pad < k_eff ? I(0) : (i + pad - k_eff) / stride + 1;
  hi = imin<I>((i + pad) / stride + 1, out);
}
)";

// The value max pooling starts from: -inf, or the integer type's lowest.
const char* lowest_literal(DType t) {
  switch (t) {
    case DType::uint8: return "0";
    case DType::int8: return "(-128)";
    case DType::int32: return "(-2147483647 - 1)";
    case DType::int64: return "(-9223372036854775807LL - 1)";
    case DType::float64: return "(-static_cast<double>(INFINITY))";
    default: return "(-INFINITY)";
  }
}

std::string header(DType dtype, bool i32, bool channels_last) {
  std::string src = pool_norm_preamble();
  src += kParamsSource;
  src += fmt::format("using T = {};\nusing Acc = kp::opmath<T>;\nusing I = {};\nconstexpr bool kChannelsLast = {};\n",
                     cuda_type(dtype), i32 ? "int" : "long long", channels_last ? "true" : "false");
  return src;
}

constexpr const char* kForwardBody = R"(
extern "C" __global__ void __launch_bounds__(256) kiln_pool2d(Params p) {
  const I C = p.size[1], H = p.size[2], W = p.size[3], OH = p.size[4], OW = p.size[5];
  KP_GRID_LOOP(I, i, (I)p.total) {
    I n, c, oh, ow;
    split<kChannelsLast>(i, C, OH, OW, n, c, oh, ow);
    const T* x = reinterpret_cast<const T*>(p.in) + n * (I)p.in_stride[0] + c * (I)p.in_stride[1];
    const I xh = p.in_stride[2], xw = p.in_stride[3];
    Acc result;
    I arg = 0;
    if constexpr (kKind == 0) {  // max: PyTorch's order, ties and NaNs
      const I dh = p.dilation[0], dw = p.dilation[1];
      I hstart = oh * (I)p.stride[0] - (I)p.pad[0];
      const I hend = imin<I>(hstart + ((I)p.kernel[0] - 1) * dh + 1, H);
      if (hstart < 0) hstart += (-hstart + dh - 1) / dh * dh;
      I wstart = ow * (I)p.stride[1] - (I)p.pad[1];
      const I wend = imin<I>(wstart + ((I)p.kernel[1] - 1) * dw + 1, W);
      if (wstart < 0) wstart += (-wstart + dw - 1) / dw * dw;
      result = kLowest;
      arg = hstart * W + wstart;
      for (I ih = hstart; ih < hend; ih += dh)
        for (I iw = wstart; iw < wend; iw += dw) {
          const Acc v = static_cast<Acc>(x[ih * xh + iw * xw]);
          if (v > result || v != v) {
            result = v;
            arg = ih * W + iw;
          }
        }
    } else if constexpr (kKind == 1) {  // avg
      I hs = oh * (I)p.stride[0] - (I)p.pad[0], he = imin<I>(hs + (I)p.kernel[0], H + (I)p.pad[0]);
      I ws = ow * (I)p.stride[1] - (I)p.pad[1], we = imin<I>(ws + (I)p.kernel[1], W + (I)p.pad[1]);
      const I padded = (he - hs) * (we - ws);
      hs = imax<I>(hs, 0); he = imin<I>(he, H); ws = imax<I>(ws, 0); we = imin<I>(we, W);
      if (hs >= he || ws >= we) {
        result = Acc(0);
      } else {
        Acc sum = 0;
        for (I ih = hs; ih < he; ++ih)
          for (I iw = ws; iw < we; ++iw) sum += static_cast<Acc>(x[ih * xh + iw * xw]);
        const long long divisor = p.divisor ? p.divisor : p.count_include_pad ? (long long)padded
                                                                                 : (long long)((he - hs) * (we - ws));
        result = sum / static_cast<Acc>(divisor);
      }
    } else {  // adaptive avg
      const I hs = oh * H / OH, he = ((oh + 1) * H + OH - 1) / OH;
      const I ws = ow * W / OW, we = ((ow + 1) * W + OW - 1) / OW;
      Acc sum = 0;
      for (I ih = hs; ih < he; ++ih)
        for (I iw = ws; iw < we; ++iw) sum += static_cast<Acc>(x[ih * xh + iw * xw]);
      result = sum / static_cast<Acc>((he - hs) * (we - ws));
    }
    reinterpret_cast<T*>(p.out)[offset<I>(p.out_stride, n, c, oh, ow)] = static_cast<T>(result);
    if constexpr (kIndices) const_cast<long long*>(p.indices)[offset<I>(p.index_stride, n, c, oh, ow)] = arg;
  }
}
)";

// Backward kinds: 0 max (gather), 1 avg, 2 adaptive avg; the index check and scatter are their
// own kernels in the max source.
constexpr const char* kBackwardBody = R"(
extern "C" __global__ void __launch_bounds__(256) kiln_pool2d_backward(Params p) {
  const I C = p.size[1], H = p.size[2], W = p.size[3], OH = p.size[4], OW = p.size[5];
  const T* g = reinterpret_cast<const T*>(p.in);
  // Window constants, once per thread (the tiled case is bound by these instructions, not memory).
  const I kh = p.kernel[0], kw = p.kernel[1], sh = p.stride[0], sw = p.stride[1], ph = p.pad[0], pw = p.pad[1];
  const Acc inv = kKind == 1 && p.tiled ? Acc(1) / static_cast<Acc>(p.divisor ? p.divisor : (long long)(kh * kw)) : Acc(0);
  KP_GRID_LOOP(I, i, (I)p.total) {
    I n, c, ih, iw;
    split<kChannelsLast>(i, C, H, W, n, c, ih, iw);
    const T* gp = g + n * (I)p.in_stride[0] + c * (I)p.in_stride[1];
    const I gh = p.in_stride[2], gw = p.in_stride[3];
    Acc sum = 0;
    if constexpr (kKind == 0) {  // max: the windows whose index is this position
      const long long* ip = p.indices + n * (I)p.index_stride[0] + c * (I)p.index_stride[1];
      const I qh = p.index_stride[2], qw = p.index_stride[3];
      const long long q = (long long)(ih * W + iw);
      I h0, h1, w0, w1;
      covering<I>(ih, p.pad[0], ((I)p.kernel[0] - 1) * (I)p.dilation[0] + 1, p.stride[0], OH, h0, h1);
      covering<I>(iw, p.pad[1], ((I)p.kernel[1] - 1) * (I)p.dilation[1] + 1, p.stride[1], OW, w0, w1);
      for (I oh = h0; oh < h1; ++oh)
        for (I ow = w0; ow < w1; ++ow)
          if (ip[oh * qh + ow * qw] == q) sum += static_cast<Acc>(gp[oh * gh + ow * gw]);
    } else if constexpr (kKind == 1) {  // avg
      if (p.tiled) {  // kernel == stride, no padding, full windows: the CPU multiplies by 1 / divisor
        const I oh = ih / kh, ow = iw / kw;
        if (oh < OH && ow < OW) sum = static_cast<Acc>(gp[oh * gh + ow * gw]) * inv;
      } else {
        const I h0 = ih + ph < kh ? I(0) : (ih + ph - kh) / sh + 1, h1 = imin<I>((ih + ph) / sh + 1, OH);
        const I w0 = iw + pw < kw ? I(0) : (iw + pw - kw) / sw + 1, w1 = imin<I>((iw + pw) / sw + 1, OW);
        for (I oh = h0; oh < h1; ++oh) {
          I hs = oh * sh - ph, he = imin<I>(hs + kh, H + ph);
          const I hpad = he - hs;
          hs = imax<I>(hs, 0); he = imin<I>(he, H);
          if (ih < hs || ih >= he) continue;
          for (I ow = w0; ow < w1; ++ow) {
            I ws = ow * sw - pw, we = imin<I>(ws + kw, W + pw);
            const I wpad = we - ws;
            ws = imax<I>(ws, 0); we = imin<I>(we, W);
            if (iw < ws || iw >= we) continue;
            const long long divisor = p.divisor ? p.divisor : p.count_include_pad ? (long long)(hpad * wpad)
                                                                                     : (long long)((he - hs) * (we - ws));
            sum += static_cast<Acc>(gp[oh * gh + ow * gw]) / static_cast<Acc>(divisor);
          }
        }
      }
    } else {  // adaptive avg
      const I h0 = ih * OH / H, h1 = imin<I>(((ih + 1) * OH + H - 1) / H, OH);
      const I w0 = iw * OW / W, w1 = imin<I>(((iw + 1) * OW + W - 1) / W, OW);
      for (I oh = h0; oh < h1; ++oh) {
        const I hs = oh * H / OH, he = ((oh + 1) * H + OH - 1) / OH;
        if (ih < hs || ih >= he) continue;
        for (I ow = w0; ow < w1; ++ow) {
          const I ws = ow * W / OW, we = ((ow + 1) * W + OW - 1) / OW;
          if (iw < ws || iw >= we) continue;
          sum += static_cast<Acc>(gp[oh * gh + ow * gw]) / static_cast<Acc>((he - hs) * (we - ws));
        }
      }
    }
    reinterpret_cast<T*>(p.out)[offset<I>(p.out_stride, n, c, ih, iw)] = static_cast<T>(sum);
  }
}
)";

// Max-pool backward's index check and its fallback scatter, over grad_output (planar order).
constexpr const char* kMaxBackwardExtras = R"(
extern "C" __global__ void __launch_bounds__(256) kiln_max_pool2d_check(Params p) {
  const I C = p.size[1], H = p.size[2], W = p.size[3], OH = p.size[4], OW = p.size[5];
  KP_GRID_LOOP(I, i, (I)p.total) {
    I n, c, oh, ow;
    split<false>(i, C, OH, OW, n, c, oh, ow);
    const long long q = p.indices[offset<I>(p.index_stride, n, c, oh, ow)];
    int bad = 0;
    if (q < 0 || q >= (long long)(H * W)) {
      bad = 1;
    } else {
      const I ih = (I)q / W, iw = (I)q % W;
      I h0, h1, w0, w1;
      covering<I>(ih, p.pad[0], ((I)p.kernel[0] - 1) * (I)p.dilation[0] + 1, p.stride[0], OH, h0, h1);
      covering<I>(iw, p.pad[1], ((I)p.kernel[1] - 1) * (I)p.dilation[1] + 1, p.stride[1], OW, w0, w1);
      if (oh < h0 || oh >= h1 || ow < w0 || ow >= w1) bad = 2;
    }
    if (bad) atomicOr(p.flag, bad);
  }
}
// Adds each gradient at its index into an Acc accumulator laid out by out_stride.
extern "C" __global__ void __launch_bounds__(256) kiln_max_pool2d_scatter(Params p) {
  const I C = p.size[1], H = p.size[2], W = p.size[3], OH = p.size[4], OW = p.size[5];
  const T* g = reinterpret_cast<const T*>(p.in);
  Acc* acc = reinterpret_cast<Acc*>(p.out);
  KP_GRID_LOOP(I, i, (I)p.total) {
    I n, c, oh, ow;
    split<false>(i, C, OH, OW, n, c, oh, ow);
    const long long q = p.indices[offset<I>(p.index_stride, n, c, oh, ow)];
    if (q < 0 || q >= (long long)(H * W)) {
      if (p.trap) {
        printf("[kiln::max_pool2d_with_indices_backward] index %lld is out of range for an input plane of %lld "
               "elements (device-side check in a CUDA graph)\n", q, (long long)(H * W));
        __trap();
      }
      continue;
    }
    atomicAdd(acc + offset<I>(p.out_stride, n, c, (I)q / W, (I)q % W),
              static_cast<Acc>(g[offset<I>(p.in_stride, n, c, oh, ow)]));
  }
}
)";

}  // namespace

std::string pool_forward_source(PoolKind kind, DType dtype, bool i32, bool channels_last) {
  std::string src = header(dtype, i32, channels_last);
  const int k = kind == PoolKind::avg ? 1 : kind == PoolKind::adaptive_avg ? 2 : 0;
  src += fmt::format("constexpr int kKind = {};\nconstexpr bool kIndices = {};\nconstexpr Acc kLowest = {};\n", k,
                     kind == PoolKind::max_with_indices ? "true" : "false", lowest_literal(dtype));
  src += kForwardBody;
  return src;
}

std::string pool_backward_source(PoolKind kind, DType dtype, bool i32, bool channels_last) {
  std::string src = header(dtype, i32, channels_last);
  const int k = kind == PoolKind::avg ? 1 : kind == PoolKind::adaptive_avg ? 2 : 0;
  src += fmt::format("constexpr int kKind = {};\n", k);
  src += kBackwardBody;
  if (k == 0) src += kMaxBackwardExtras;
  return src;
}

namespace {

// ---------------- host side ----------------

int64_t pair_at(IntArrayRef v, int d) { return v.size() == 1 ? v[0] : v[d]; }

const char* kind_name(PoolKind k) {
  switch (k) {
    case PoolKind::max: return "max";
    case PoolKind::max_with_indices: return "maxi";
    case PoolKind::avg: return "avg";
    case PoolKind::adaptive_avg: return "adaptive";
  }
  return "?";
}

void put_strides(long long* dst, const Dims4& d) {
  for (int i = 0; i < 4; ++i) dst[i] = d.stride[i];
}

// Window attrs from `first`: kernel_size, stride (empty: kernel_size), padding, then dilation
// when `has_dilation`.
void put_window(PoolParams& p, const AttrAccess& c, size_t first, bool has_dilation) {
  IntArrayRef kernel = c.ints_attr(first), stride = c.ints_attr(first + 1), pad = c.ints_attr(first + 2);
  for (int d = 0; d < 2; ++d) {
    p.kernel[d] = pair_at(kernel, d);
    p.stride[d] = stride.empty() ? p.kernel[d] : pair_at(stride, d);
    p.pad[d] = pair_at(pad, d);
    p.dilation[d] = has_dilation ? pair_at(c.ints_attr(first + 3), d) : 1;
  }
}

// Whether the launch's index arithmetic fits 32 bits: offsets into every operand and the
// products the window formulas form.
bool index_fits_int32(const PoolParams& p, std::initializer_list<const Tensor*> operands) {
  int64_t largest = p.total;
  for (const Tensor* t : operands)
    if (t && t->defined()) largest = std::max(largest, max_offset(*t));
  const int64_t h = p.size[2], w = p.size[3], oh = p.size[4], ow = p.size[5];
  largest = std::max<int64_t>({largest, h * w, (oh + 1) * (h + 1) * 2, (ow + 1) * (w + 1) * 2,
                      (h + 2 * p.pad[0] + 1) * (p.stride[0] + p.kernel[0] * p.dilation[0]),
                      (w + 2 * p.pad[1] + 1) * (p.stride[1] + p.kernel[1] * p.dilation[1])});
  return fits_int32(largest);
}

void launch_pool(const std::string& key, const char* name, const std::function<std::string()>& source, int device,
                 PoolParams& p) {
  JitFunction f = jit_function(device, key, name, source);
  DeviceGuard guard(device);
  void* args[] = {&p};
  launch(f, grid_for(device, p.total, kBlock), kBlock, 0, current_stream(device), args);
}

void pool_forward(const OpCall& call, std::span<Tensor> outs, PoolKind kind) {
  Tensor& y = outs[0];
  if (y.numel() == 0) return;
  const Tensor& x = call.input(0);
  const int device = y.device().index;
  KILN_CHECK(x.device() == y.device(), DeviceError,
             "[kiln::" + call.name() + "] expected the input on " + y.device().str() + ". Move it with .to(...).");
  const Dims4 xd = dims4(x), yd = dims4(y);
  PoolParams p{};
  p.in = x.impl().data();
  p.out = y.impl().data();
  for (int i = 0; i < 4; ++i) p.size[i] = xd.size[i];
  p.size[4] = yd.size[2];
  p.size[5] = yd.size[3];
  put_strides(p.in_stride, xd);
  put_strides(p.out_stride, yd);
  const Tensor* indices = nullptr;
  if (kind == PoolKind::max_with_indices) {
    indices = &outs[1];
    p.indices = indices->impl().data();
    put_strides(p.index_stride, dims4(*indices));
  }
  if (kind == PoolKind::avg) {
    put_window(p, call, 0, false);
    p.count_include_pad = call.bool_attr(4);
    p.divisor = call.has_attr(5) ? call.int_attr(5) : 0;
  } else if (kind != PoolKind::adaptive_avg) {
    put_window(p, call, 0, true);
  } else {
    for (int d = 0; d < 2; ++d) p.kernel[d] = p.stride[d] = p.dilation[d] = 1;
  }
  p.total = y.numel();
  const bool i32 = index_fits_int32(p, {&x, &y, indices});
  const bool cl = walks_channels_last(y);
  const DType t = x.dtype();
  const std::string key =
      fmt::format("pool2d|{}|{}|{}|{}", kind_name(kind), static_cast<int>(t), i32 ? 32 : 64, cl ? "cl" : "nchw");
  launch_pool(key, "kiln_pool2d", [&] { return pool_forward_source(kind, t, i32, cl); }, device, p);
}

void max_pool2d_kernel(const OpCall& c, std::span<Tensor> outs) { pool_forward(c, outs, PoolKind::max); }
void max_pool2d_with_indices_kernel(const OpCall& c, std::span<Tensor> outs) {
  pool_forward(c, outs, PoolKind::max_with_indices);
}
void avg_pool2d_kernel(const OpCall& c, std::span<Tensor> outs) { pool_forward(c, outs, PoolKind::avg); }
void adaptive_avg_pool2d_kernel(const OpCall& c, std::span<Tensor> outs) {
  pool_forward(c, outs, PoolKind::adaptive_avg);
}

// The parameters every backward shares: grad_output (in), dx (out) and their geometry.
PoolParams backward_params(const Tensor& grad, const Tensor& dx) {
  const Dims4 gd = dims4(grad), dd = dims4(dx);
  PoolParams p{};
  p.in = grad.impl().data();
  p.out = dx.impl().data();
  for (int i = 0; i < 4; ++i) p.size[i] = dd.size[i];
  p.size[4] = gd.size[2];
  p.size[5] = gd.size[3];
  put_strides(p.in_stride, gd);
  put_strides(p.out_stride, dd);
  p.total = dx.numel();
  return p;
}

std::string backward_key(PoolKind kind, DType t, bool i32, bool cl) {
  return fmt::format("pool2d_backward|{}|{}|{}|{}", kind_name(kind), static_cast<int>(t), i32 ? 32 : 64,
                     cl ? "cl" : "nchw");
}

void check_devices(const OpCall& call, const Tensor& a, const Tensor& b) {
  KILN_CHECK(a.device() == b.device(), DeviceError,
             "[kiln::" + call.name() + "] expected all tensors on " + b.device().str() + ", but found one on " +
                 a.device().str() + ". Move them with .to(...).");
}

// Attrs: input_sizes, kernel_size, stride, padding, dilation, ceil_mode.
void max_pool2d_backward_kernel(const OpCall& call, std::span<Tensor> outs) {
  Tensor& dx = outs[0];
  if (dx.numel() == 0) return;
  const Tensor& grad = call.input(0);
  const Tensor& indices = call.input(1);
  check_devices(call, grad, dx);
  check_devices(call, indices, dx);
  const int device = dx.device().index;
  const DType t = dx.dtype();
  PoolParams p = backward_params(grad, dx);
  put_window(p, call, 1, true);
  p.indices = indices.impl().data();
  put_strides(p.index_stride, dims4(indices));
  const bool i32 = index_fits_int32(p, {&grad, &indices, &dx});
  const bool cl = walks_channels_last(dx);
  const std::string key = backward_key(PoolKind::max, t, i32, cl);
  auto source = [&] { return pool_backward_source(PoolKind::max, t, i32, cl); };

  // The gather below finds an index only inside its own window: check that they all are. While a
  // CUDA graph records, the flag cannot come back to the host: take the scatter, which is right
  // for any index in the plane, and let it trap on one outside.
  const bool recording = capturing(device);
  int bad = recording ? 2 : 0;  // the check's flag bits: 2 (an index outside its window) takes the scatter
  if (grad.numel() > 0 && !recording) {
    Tensor flag = zeros({1}, TensorOptions{DType::int32, dx.device()});
    PoolParams checker = p;
    checker.flag = static_cast<int*>(flag.impl().data());
    checker.total = grad.numel();
    launch_pool(key, "kiln_max_pool2d_check", source, device, checker);
    DeviceGuard guard(device);
    cudaStream_t stream = current_stream(device);
    check(cudaMemcpyAsync(&bad, checker.flag, sizeof bad, cudaMemcpyDeviceToHost, stream),
                              "max_pool2d_with_indices_backward");
    check(cudaStreamSynchronize(stream), "max_pool2d_with_indices_backward");
  }
  KILN_CHECK((bad & 1) == 0, IndexError,
             "[kiln::max_pool2d_with_indices_backward] an index is out of range for an input plane of " +
                 std::to_string(p.size[2] * p.size[3]) + " elements. Pass the indices max_pool2d_with_indices returned.");
  if (bad == 0) {
    launch_pool(key, "kiln_pool2d_backward", source, device, p);
    return;
  }
  // Indices outside their windows (not from max_pool2d_with_indices): scatter with atomics into a
  // zeroed accumulator in opmath precision, then convert into dx.
  const DType acc_dtype = opmath_dtype(t);
  Tensor acc = zeros(dx.sizes(), TensorOptions{acc_dtype, dx.device()});
  PoolParams scatter = p;
  scatter.out = acc.impl().data();
  put_strides(scatter.out_stride, dims4(acc));
  scatter.total = grad.numel();
  scatter.trap = recording;
  launch_pool(key, "kiln_max_pool2d_scatter", source, device, scatter);
  dx.copy_(acc);
}

// Attrs: input_sizes, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override.
void avg_pool2d_backward_kernel(const OpCall& call, std::span<Tensor> outs) {
  Tensor& dx = outs[0];
  if (dx.numel() == 0) return;
  const Tensor& grad = call.input(0);
  check_devices(call, grad, dx);
  PoolParams p = backward_params(grad, dx);
  put_window(p, call, 1, false);
  p.count_include_pad = call.bool_attr(5);
  p.divisor = call.has_attr(6) ? call.int_attr(6) : 0;
  // The CPU's tiled case: non-overlapping full windows.
  p.tiled = p.kernel[0] == p.stride[0] && p.kernel[1] == p.stride[1] && p.pad[0] == 0 && p.pad[1] == 0 &&
            p.size[4] * p.kernel[0] <= p.size[2] && p.size[5] * p.kernel[1] <= p.size[3];
  const bool i32 = index_fits_int32(p, {&grad, &dx});
  const bool cl = walks_channels_last(dx);
  const DType t = dx.dtype();
  launch_pool(backward_key(PoolKind::avg, t, i32, cl), "kiln_pool2d_backward",
              [&] { return pool_backward_source(PoolKind::avg, t, i32, cl); }, dx.device().index, p);
}

void adaptive_avg_pool2d_backward_kernel(const OpCall& call, std::span<Tensor> outs) {
  Tensor& dx = outs[0];
  if (dx.numel() == 0) return;
  const Tensor& grad = call.input(0);
  check_devices(call, grad, dx);
  PoolParams p = backward_params(grad, dx);
  for (int d = 0; d < 2; ++d) p.kernel[d] = p.stride[d] = p.dilation[d] = 1;
  const bool i32 = index_fits_int32(p, {&grad, &dx});
  const bool cl = walks_channels_last(dx);
  const DType t = dx.dtype();
  launch_pool(backward_key(PoolKind::adaptive_avg, t, i32, cl), "kiln_pool2d_backward",
              [&] { return pool_backward_source(PoolKind::adaptive_avg, t, i32, cl); }, dx.device().index, p);
}

[[maybe_unused]] const bool registered = [] {
  register_kernels(DeviceType::cuda, {
      {"max_pool2d", max_pool2d_kernel},
      {"max_pool2d_with_indices", max_pool2d_with_indices_kernel},
      {"avg_pool2d", avg_pool2d_kernel},
      {"adaptive_avg_pool2d", adaptive_avg_pool2d_kernel},
      {"max_pool2d_with_indices_backward", max_pool2d_backward_kernel},
      {"avg_pool2d_backward", avg_pool2d_backward_kernel},
      {"adaptive_avg_pool2d_backward", adaptive_avg_pool2d_backward_kernel},
  });
  return true;
}();

}  // namespace

}  // namespace kiln::cuda::detail
