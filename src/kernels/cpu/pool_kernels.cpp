// CPU kernels for max_pool2d, max_pool2d_with_indices, avg_pool2d and adaptive_avg_pool2d.
//
// max_pool2d and avg_pool2d run on oneDNN for float32/bfloat16 directly on the plain NCHW data
// (pooling is memory-bound; a layout reorder would cost more than it saves), with a cached
// primitive per configuration. max_pool2d_with_indices runs oneDNN's training-mode pooling and
// turns its workspace (each output's position inside its window) into PyTorch's flat H * W
// indices; inputs with NaN or infinities take the loop, whose tie and NaN rules are PyTorch's.
// The rest use direct loops, parallel over (plane, output row): other dtypes, avg_pool2d cases
// whose divisor oneDNN computes differently (divisor_override, or ceil_mode windows past the
// padding with count_include_pad), and adaptive_avg_pool2d. KILN_ONEDNN=0 sends everything to
// the loops. Channels-last input (or a channels-last output with input of another layout) takes
// the channels-last loops instead, which pool all channels of a pixel at once (pool_window.h).
#include <oneapi/dnnl/dnnl.hpp>

#include <array>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <memory>
#include <mutex>
#include <new>
#include <string_view>
#include <unordered_map>

#include "kernels/cpu/onednn.h"
#include "kernels/cpu/loops.h"
#include "kernels/cpu/pool_window.h"
#include "core/tensor_factory.h"
#include "kiln/op_table.h"
#include "kiln/ops.h"

namespace kiln::cpu {

namespace {

using dnnl::memory;

struct Window {
  int64_t kernel[2], stride[2], pad[2], dilation[2];
};

// Input viewed as planes x H x W (contiguous), output as planes x OH x OW.
struct PoolGeometry {
  int64_t planes, h, w, oh, ow;
};

PoolGeometry geometry(const Tensor& x, const Tensor& out) {
  const int64_t d = x.dim();
  const int64_t h = x.sizes()[d - 2], w = x.sizes()[d - 1];
  return {h * w == 0 ? 0 : x.numel() / (h * w), h, w, out.sizes()[d - 2], out.sizes()[d - 1]};
}

int64_t pair_at(IntArrayRef v, int d) { return v.size() == 1 ? v[0] : v[d]; }

Window window_from(const OpCall& c, bool has_dilation) {
  Window win{};
  IntArrayRef kernel = c.ints_attr(0), stride = c.ints_attr(1), pad = c.ints_attr(2);
  for (int d = 0; d < 2; ++d) {
    win.kernel[d] = pair_at(kernel, d);
    win.stride[d] = stride.empty() ? win.kernel[d] : pair_at(stride, d);
    win.pad[d] = pair_at(pad, d);
    win.dilation[d] = has_dilation ? pair_at(c.ints_attr(3), d) : 1;
  }
  return win;
}

// Runs f(plane, oh) over all output rows in parallel.
template <class F>
void for_each_output_row(const PoolGeometry& g, int64_t work_per_row, F&& f) {
  const int64_t rows = g.planes * g.oh;
  parallel_for(rows, std::max<int64_t>(1, kGrainSize / std::max<int64_t>(1, work_per_row)),
               [&](int64_t begin, int64_t end) {
                 for (int64_t r = begin; r < end; ++r) f(r / g.oh, r % g.oh);
               });
}

// ---------------- direct loops ----------------

// Walks each output row in tiles of outputs, kernel position by kernel position, so the inner
// loop runs over neighbouring outputs with branch-free selects (random data makes a branch on
// "v > best" mispredict half the time). Per output, positions are visited in PyTorch's order
// (row-major over the window) and only a strictly greater value or a NaN replaces the maximum,
// so indices match PyTorch's, ties included.
// kStrideW > 0 fixes the column stride at compile time (1 and 2 cover nearly every network), so
// the inner loop's strided loads vectorize.
template <class T, int64_t kStrideW>
void max_pool_loop(const Tensor& x, Tensor& out, int64_t* indices, const Window& win) {
  const PoolGeometry g = geometry(x, out);
  const T* in = x.data_ptr<T>();
  T* o = out.data_ptr<T>();
  using Acc = opmath_t<T>;
  const Acc lowest = std::numeric_limits<Acc>::has_infinity ? -std::numeric_limits<Acc>::infinity()
                                                            : std::numeric_limits<Acc>::lowest();
  const int64_t sh = win.stride[0], sw = kStrideW > 0 ? kStrideW : win.stride[1];
  const int64_t dh = win.dilation[0], dw = win.dilation[1];
  for_each_output_row(g, g.ow * win.kernel[0] * win.kernel[1], [&](int64_t p, int64_t oh) {
    constexpr int64_t kTile = 64;
    const T* plane = in + p * g.h * g.w;
    int64_t hstart = oh * sh - win.pad[0];
    const int64_t hend = std::min(hstart + (win.kernel[0] - 1) * dh + 1, g.h);
    while (hstart < 0) hstart += dh;
    for (int64_t ow0 = 0; ow0 < g.ow; ow0 += kTile) {
      const int64_t n = std::min(kTile, g.ow - ow0);
      Acc best[kTile];
      int64_t best_index[kTile];
      for (int64_t i = 0; i < n; ++i) {
        int64_t wstart = (ow0 + i) * sw - win.pad[1];
        while (wstart < 0) wstart += dw;
        best[i] = lowest;
        best_index[i] = hstart * g.w + wstart;
      }
      for (int64_t ih = hstart; ih < hend; ih += dh) {
        const T* row = plane + ih * g.w;
        for (int64_t kj = 0; kj < win.kernel[1]; ++kj) {
          const int64_t offset = kj * dw - win.pad[1];  // input column of output ow: ow * sw + offset
          // Outputs whose column is inside [0, W).
          const int64_t first = offset >= 0 ? 0 : (-offset + sw - 1) / sw;
          const int64_t last = g.w - 1 - offset >= 0 ? (g.w - 1 - offset) / sw + 1 : 0;
          const int64_t lo = std::max(first, ow0) - ow0, hi = std::min(last, ow0 + n) - ow0;
#pragma omp simd
          for (int64_t i = lo; i < hi; ++i) {
            const int64_t iw = (ow0 + i) * sw + offset;
            const Acc v = static_cast<Acc>(row[iw]);
            const bool take = v > best[i] || v != v;  // v != v: NaN propagates
            best[i] = take ? v : best[i];
            best_index[i] = take ? ih * g.w + iw : best_index[i];
          }
        }
      }
      T* dst = o + (p * g.oh + oh) * g.ow + ow0;
      for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<T>(best[i]);
      if (indices) std::copy(best_index, best_index + n, indices + (p * g.oh + oh) * g.ow + ow0);
    }
  });
}

template <class T>
void max_pool_loop(const Tensor& x, Tensor& out, int64_t* indices, const Window& win) {
  switch (win.stride[1]) {
    case 1: return max_pool_loop<T, 1>(x, out, indices, win);
    case 2: return max_pool_loop<T, 2>(x, out, indices, win);
    default: return max_pool_loop<T, 0>(x, out, indices, win);
  }
}

template <class T>
void avg_pool_loop(const Tensor& x, Tensor& out, const Window& win, bool count_include_pad,
                   std::optional<int64_t> divisor_override) {
  const PoolGeometry g = geometry(x, out);
  const T* in = x.data_ptr<T>();
  T* o = out.data_ptr<T>();
  using Acc = opmath_t<T>;
  for_each_output_row(g, g.ow * win.kernel[0] * win.kernel[1], [&](int64_t p, int64_t oh) {
    const T* plane = in + p * g.h * g.w;
    const AvgSpan hs = avg_span(oh, win.kernel[0], win.stride[0], win.pad[0], g.h);
    for (int64_t ow = 0; ow < g.ow; ++ow) {
      const AvgSpan ws = avg_span(ow, win.kernel[1], win.stride[1], win.pad[1], g.w);
      const int64_t at = (p * g.oh + oh) * g.ow + ow;
      if (hs.start >= hs.end || ws.start >= ws.end) {
        o[at] = T(0);
        continue;
      }
      Acc sum = 0;
      for (int64_t ih = hs.start; ih < hs.end; ++ih)
        for (int64_t iw = ws.start; iw < ws.end; ++iw) sum += static_cast<Acc>(plane[ih * g.w + iw]);
      const int64_t divisor = avg_divisor(hs, ws, count_include_pad, divisor_override);
      o[at] = static_cast<T>(sum / static_cast<Acc>(divisor));
    }
  });
}

template <class T>
void adaptive_avg_pool_loop(const Tensor& x, Tensor& out) {
  const PoolGeometry g = geometry(x, out);
  const T* in = x.data_ptr<T>();
  T* o = out.data_ptr<T>();
  using Acc = opmath_t<T>;
  if (g.oh == 1 && g.ow == 1) {  // global average pooling: one vectorized sum per plane
    const int64_t hw = g.h * g.w;
    parallel_for(g.planes, std::max<int64_t>(1, kGrainSize / hw), [&](int64_t begin, int64_t end) {
      for (int64_t p = begin; p < end; ++p) {
        const T* plane = in + p * hw;
        Acc sum = 0;
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < hw; ++i) sum += static_cast<Acc>(plane[i]);
        o[p] = static_cast<T>(sum / static_cast<Acc>(hw));
      }
    });
    return;
  }
  for_each_output_row(g, g.ow * (g.h / std::max<int64_t>(1, g.oh) + 1) * (g.w / std::max<int64_t>(1, g.ow) + 1),
                      [&](int64_t p, int64_t oh) {
                        const T* plane = in + p * g.h * g.w;
                        const int64_t hstart = oh * g.h / g.oh, hend = ((oh + 1) * g.h + g.oh - 1) / g.oh;
                        for (int64_t ow = 0; ow < g.ow; ++ow) {
                          const int64_t wstart = ow * g.w / g.ow, wend = ((ow + 1) * g.w + g.ow - 1) / g.ow;
                          Acc sum = 0;
                          for (int64_t ih = hstart; ih < hend; ++ih)
                            for (int64_t iw = wstart; iw < wend; ++iw) sum += static_cast<Acc>(plane[ih * g.w + iw]);
                          o[(p * g.oh + oh) * g.ow + ow] =
                              static_cast<T>(sum / static_cast<Acc>((hend - hstart) * (wend - wstart)));
                        }
                      });
}

// ---------------- channels-last loops ----------------

// An NHWC pooling's sizes and element strides (channels at stride 1 in every operand).
struct NhwcPool {
  int64_t n, c, h, w, oh, ow;
  PixelStrides in, out, indices;
};

// Channels are pooled in blocks of this many, so a block's running maxima or sums stay in
// registers while the window is walked.
constexpr int64_t kChannelBlock = 64;

// Runs f(n, oh) over all output rows in parallel.
template <class F>
void for_each_nhwc_row(const NhwcPool& g, int64_t work_per_row, F&& f) {
  parallel_for(g.n * g.oh, std::max<int64_t>(1, kGrainSize / std::max<int64_t>(1, work_per_row)),
               [&](int64_t begin, int64_t end) {
                 for (int64_t r = begin; r < end; ++r) f(r / g.oh, r % g.oh);
               });
}

// Max pooling of each output pixel's C channels at once; windows are walked in PyTorch's order
// with its tie and NaN rules, as in max_pool_loop.
template <class T, bool kIndices>
void max_pool_nhwc(const T* in, T* out, int64_t* indices, const NhwcPool& g, const Window& win) {
  using Acc = opmath_t<T>;
  const Acc lowest = std::numeric_limits<Acc>::has_infinity ? -std::numeric_limits<Acc>::infinity()
                                                            : std::numeric_limits<Acc>::lowest();
  const int64_t dh = win.dilation[0], dw = win.dilation[1];
  for_each_nhwc_row(g, g.ow * g.c * win.kernel[0] * win.kernel[1], [&](int64_t n, int64_t oh) {
    int64_t hstart = oh * win.stride[0] - win.pad[0];
    const int64_t hend = std::min(hstart + (win.kernel[0] - 1) * dh + 1, g.h);
    while (hstart < 0) hstart += dh;
    for (int64_t ow = 0; ow < g.ow; ++ow) {
      int64_t wstart = ow * win.stride[1] - win.pad[1];
      const int64_t wend = std::min(wstart + (win.kernel[1] - 1) * dw + 1, g.w);
      while (wstart < 0) wstart += dw;
      T* o = out + n * g.out.n + oh * g.out.h + ow * g.out.w;
      int64_t* io = kIndices ? indices + n * g.indices.n + oh * g.indices.h + ow * g.indices.w : nullptr;
      for (int64_t c0 = 0; c0 < g.c; c0 += kChannelBlock) {
        const int64_t nc = std::min(kChannelBlock, g.c - c0);
        Acc best[kChannelBlock];
        int64_t arg[kChannelBlock];
        std::fill_n(best, nc, lowest);
        if constexpr (kIndices) std::fill_n(arg, nc, hstart * g.w + wstart);
        for (int64_t ih = hstart; ih < hend; ih += dh) {
          for (int64_t iw = wstart; iw < wend; iw += dw) {
            const T* __restrict px = in + n * g.in.n + ih * g.in.h + iw * g.in.w + c0;
            const int64_t pos = ih * g.w + iw;
#pragma omp simd
            for (int64_t c = 0; c < nc; ++c) {
              const Acc v = static_cast<Acc>(px[c]);
              const bool take = v > best[c] || v != v;  // v != v: NaN propagates
              best[c] = take ? v : best[c];
              if constexpr (kIndices) arg[c] = take ? pos : arg[c];
            }
          }
        }
        for (int64_t c = 0; c < nc; ++c) o[c0 + c] = static_cast<T>(best[c]);
        if constexpr (kIndices) std::copy_n(arg, nc, io + c0);
      }
    }
  });
}

template <class T>
void avg_pool_nhwc(const T* in, T* out, const NhwcPool& g, const Window& win, bool count_include_pad,
                   std::optional<int64_t> divisor_override) {
  using Acc = opmath_t<T>;
  for_each_nhwc_row(g, g.ow * g.c * win.kernel[0] * win.kernel[1], [&](int64_t n, int64_t oh) {
    const AvgSpan hs = avg_span(oh, win.kernel[0], win.stride[0], win.pad[0], g.h);
    for (int64_t ow = 0; ow < g.ow; ++ow) {
      const AvgSpan ws = avg_span(ow, win.kernel[1], win.stride[1], win.pad[1], g.w);
      T* o = out + n * g.out.n + oh * g.out.h + ow * g.out.w;
      if (hs.start >= hs.end || ws.start >= ws.end) {
        std::fill_n(o, g.c, T(0));
        continue;
      }
      const Acc divisor = static_cast<Acc>(avg_divisor(hs, ws, count_include_pad, divisor_override));
      for (int64_t c0 = 0; c0 < g.c; c0 += kChannelBlock) {
        const int64_t nc = std::min(kChannelBlock, g.c - c0);
        Acc sum[kChannelBlock] = {};
        for (int64_t ih = hs.start; ih < hs.end; ++ih) {
          for (int64_t iw = ws.start; iw < ws.end; ++iw) {
            const T* __restrict px = in + n * g.in.n + ih * g.in.h + iw * g.in.w + c0;
#pragma omp simd
            for (int64_t c = 0; c < nc; ++c) sum[c] += static_cast<Acc>(px[c]);
          }
        }
        for (int64_t c = 0; c < nc; ++c) o[c0 + c] = static_cast<T>(sum[c] / divisor);
      }
    }
  });
}

template <class T>
void adaptive_avg_pool_nhwc(const T* in, T* out, const NhwcPool& g) {
  using Acc = opmath_t<T>;
  const int64_t window = (g.h / g.oh + 1) * (g.w / g.ow + 1);
  for_each_nhwc_row(g, g.ow * g.c * window, [&](int64_t n, int64_t oh) {
    const int64_t hstart = adaptive_start(oh, g.h, g.oh), hend = adaptive_end(oh, g.h, g.oh);
    for (int64_t ow = 0; ow < g.ow; ++ow) {
      const int64_t wstart = adaptive_start(ow, g.w, g.ow), wend = adaptive_end(ow, g.w, g.ow);
      const Acc count = static_cast<Acc>((hend - hstart) * (wend - wstart));
      T* o = out + n * g.out.n + oh * g.out.h + ow * g.out.w;
      for (int64_t c0 = 0; c0 < g.c; c0 += kChannelBlock) {
        const int64_t nc = std::min(kChannelBlock, g.c - c0);
        Acc sum[kChannelBlock] = {};
        for (int64_t ih = hstart; ih < hend; ++ih) {
          for (int64_t iw = wstart; iw < wend; ++iw) {
            const T* __restrict px = in + n * g.in.n + ih * g.in.h + iw * g.in.w + c0;
#pragma omp simd
            for (int64_t c = 0; c < nc; ++c) sum[c] += static_cast<Acc>(px[c]);
          }
        }
        for (int64_t c = 0; c < nc; ++c) o[c0 + c] = static_cast<T>(sum[c] / count);
      }
    }
  });
}

// Whether a pooling of `input` into `out` runs the channels-last loops: when the input's
// channels are adjacent (read in place), or the output is channels-last (input copied to it).
// Plainly contiguous input keeps the planar (NCHW) path.
bool pool_channels_last(const Tensor& input, const Tensor& out) {
  if (input.dim() != 4 || input.is_contiguous()) return false;
  return (input.sizes()[1] > 1 && input.strides()[1] == 1) || wants_channels_last(out);
}

// Runs body(x, outputs, geometry) for the channels-last loops: the input with adjacent channels
// (copied to channels-last if not), outputs written in place when their channels are adjacent,
// else through channels-last temporaries copied back.
template <class Body>
void with_channels_last(const Tensor& input, std::span<Tensor> outs, Body&& body) {
  const Tensor x = channels_adjacent(input) ? input : input.contiguous(kiln::channels_last);
  std::vector<Tensor> ys;
  for (Tensor& out : outs)
    ys.push_back(channels_adjacent(out) ? out
                                        : detail::make_empty_strided(out.sizes().vec(),
                                                                     detail::channels_last_strides(out.sizes()),
                                                                     out.dtype(), out.device()));
  const Tensor& y = ys[0];
  NhwcPool g{x.sizes()[0], x.sizes()[1], x.sizes()[2], x.sizes()[3], y.sizes()[2], y.sizes()[3],
             pixel_strides(x), pixel_strides(y), ys.size() > 1 ? pixel_strides(ys[1]) : PixelStrides{}};
  body(x, ys, g);
  for (size_t i = 0; i < outs.size(); ++i)
    if (!ys[i].same(outs[i])) outs[i].copy_(ys[i]);
}

// ---------------- oneDNN ----------------

using onednn::cpu_engine;
using onednn::thread_stream;

struct PoolKey {
  std::array<int64_t, 14> dims;
  int algorithm;
  DType dtype;
  bool operator==(const PoolKey&) const = default;
};

struct PoolKeyHash {
  size_t operator()(const PoolKey& k) const {
    size_t h = static_cast<size_t>(k.dtype) * 31u + static_cast<size_t>(k.algorithm);
    for (int64_t v : k.dims) h = h * 1000003u ^ std::hash<int64_t>{}(v);
    return h;
  }
};

struct PoolPlan {
  dnnl::pooling_v2_forward pool;
  memory::desc src, dst, scratchpad, workspace;  // workspace: training (max pooling's argmax) only
};

// Right/bottom padding that makes oneDNN produce `out` windows: the symmetric padding unless
// ceil_mode adds windows that reach past it.
int64_t right_padding(int64_t in, int64_t out, int64_t kernel, int64_t stride, int64_t pad, int64_t dilation) {
  const int64_t needed = (out - 1) * stride + (kernel - 1) * dilation + 1 - in - pad;
  return std::max(needed, pad);
}

// training: forward_training, whose workspace holds each window's argmax (max pooling).
std::shared_ptr<const PoolPlan> find_pool_plan(const PoolGeometry& g, const Window& win, dnnl::algorithm alg,
                                               DType dtype, bool training = false) {
  const int64_t pr_h = right_padding(g.h, g.oh, win.kernel[0], win.stride[0], win.pad[0], win.dilation[0]);
  const int64_t pr_w = right_padding(g.w, g.ow, win.kernel[1], win.stride[1], win.pad[1], win.dilation[1]);
  const PoolKey key{{g.planes, g.h, g.w, g.oh, g.ow, win.kernel[0], win.kernel[1], win.stride[0], win.stride[1],
                     win.pad[0], win.pad[1], win.dilation[0], win.dilation[1], pr_h * 1000003 + pr_w},
                    static_cast<int>(alg) * 2 + (training ? 1 : 0), dtype};
  static std::mutex mutex;
  static std::unordered_map<PoolKey, std::shared_ptr<const PoolPlan>, PoolKeyHash> cache;
  {
    std::lock_guard lock(mutex);
    auto it = cache.find(key);
    if (it != cache.end()) return it->second;
  }
  std::shared_ptr<PoolPlan> plan;
  try {
    const auto dt = dtype == DType::bfloat16 ? memory::data_type::bf16 : memory::data_type::f32;
    // Planes go in the channel dim: pooling treats every (n, c) plane the same way.
    const memory::desc src({1, g.planes, g.h, g.w}, dt, memory::format_tag::nchw);
    const memory::desc dst({1, g.planes, g.oh, g.ow}, dt, memory::format_tag::nchw);
    dnnl::pooling_v2_forward::desc desc(training ? dnnl::prop_kind::forward_training
                                                 : dnnl::prop_kind::forward_inference,
                                        alg, src, dst,
                                        {win.stride[0], win.stride[1]}, {win.kernel[0], win.kernel[1]},
                                        {win.dilation[0] - 1, win.dilation[1] - 1}, {win.pad[0], win.pad[1]},
                                        {pr_h, pr_w});
    dnnl::primitive_attr attr;
    attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
    dnnl::pooling_v2_forward::primitive_desc pd(desc, attr, cpu_engine());
    // oneDNN's reference kernel (e.g. for dilated windows) is no faster than the loops here.
    if (!std::string_view(pd.impl_info_str()).starts_with("ref"))
      plan = std::make_shared<PoolPlan>(
          PoolPlan{dnnl::pooling_v2_forward(pd), src, dst, pd.scratchpad_desc(),
                   training ? pd.workspace_desc() : memory::desc()});
  } catch (const dnnl::error&) {
    plan = nullptr;
  }
  std::lock_guard lock(mutex);
  return cache.emplace(key, std::move(plan)).first->second;
}

// PyTorch's flat H * W argmax positions from oneDNN's workspace, which holds each output's
// position inside its window (ki * kW + kj; u8 or s32).
template <class W>
void indices_from_workspace(const W* ws, int64_t* indices, const PoolGeometry& g, const Window& win) {
  // Flat offset of each window position from the window's top-left corner.
  std::vector<int64_t> offset(static_cast<size_t>(win.kernel[0] * win.kernel[1]));
  for (int64_t ki = 0; ki < win.kernel[0]; ++ki)
    for (int64_t kj = 0; kj < win.kernel[1]; ++kj)
      offset[ki * win.kernel[1] + kj] = ki * win.dilation[0] * g.w + kj * win.dilation[1];
  const int64_t kmax = static_cast<int64_t>(offset.size()) - 1;
  const int64_t* table = offset.data();
  for_each_output_row(g, g.ow, [&](int64_t p, int64_t oh) {
    const int64_t at = (p * g.oh + oh) * g.ow;
    const int64_t corner = (oh * win.stride[0] - win.pad[0]) * g.w - win.pad[1];
    const W* __restrict w = ws + at;
    int64_t* __restrict out = indices + at;
    for (int64_t ow = 0; ow < g.ow; ++ow)
      out[ow] = corner + ow * win.stride[1] + table[std::min<int64_t>(static_cast<int64_t>(w[ow]), kmax)];
  });
}

// Pools with oneDNN; false when oneDNN has no implementation for this configuration. With
// `indices` (max pooling), also writes the argmax positions as PyTorch numbers them.
bool onednn_pool(const Tensor& x, Tensor& out, const Window& win, dnnl::algorithm alg, int64_t* indices = nullptr) {
  const PoolGeometry g = geometry(x, out);
  auto plan = find_pool_plan(g, win, alg, x.dtype(), indices != nullptr);
  if (!plan) return false;
  const auto ws_type = indices ? plan->workspace.data_type() : memory::data_type::u8;
  if (indices && ws_type != memory::data_type::u8 && ws_type != memory::data_type::s32) return false;
  dnnl::engine& engine = cpu_engine();
  dnnl::stream& stream = thread_stream();
  std::vector<char> scratch(plan->scratchpad.get_size());
  memory src(plan->src, engine, x.impl().data());
  memory dst(plan->dst, engine, out.impl().data());
  std::unordered_map<int, memory> args{{DNNL_ARG_SRC, src}, {DNNL_ARG_DST, dst}};
  if (!scratch.empty()) args.emplace(DNNL_ARG_SCRATCHPAD, memory(plan->scratchpad, engine, scratch.data()));
  Tensor workspace;
  if (indices) {
    workspace = detail::make_empty({static_cast<int64_t>(plan->workspace.get_size())}, kUInt8, x.device());
    args.emplace(DNNL_ARG_WORKSPACE, memory(plan->workspace, engine, workspace.impl().data()));
  }
  plan->pool.execute(stream, args);
  stream.wait();
  if (indices) {
    if (ws_type == memory::data_type::u8)
      indices_from_workspace(workspace.data_ptr<uint8_t>(), indices, g, win);
    else
      indices_from_workspace(static_cast<const int32_t*>(workspace.impl().data()), indices, g, win);
  }
  return true;
}

// Whether oneDNN may run this dtype; KILN_ONEDNN=0 turns it off (the loops run instead).
bool onednn_dtype(DType t) {
  static const bool enabled = [] {
    const char* v = std::getenv("KILN_ONEDNN");
    return v == nullptr || std::string_view(v) != "0";
  }();
  return enabled && (t == DType::float32 || t == DType::bfloat16);
}

// Whether a contiguous float32/bfloat16 tensor holds a NaN. oneDNN's max pooling skips NaNs,
// PyTorch's propagates them, so inputs with NaNs take the loop instead.
template <class Bits, Bits kAbsMask, Bits kInfinity>
bool contains_nan_bits(const Bits* p, int64_t n) {
  int found = 0;
  parallel_for(n, kGrainSize * 4, [&](int64_t begin, int64_t end) {
    const Bits* __restrict chunk = p + begin;
    const int64_t count = end - begin;
    Bits worst = 0;  // NaN <=> |bits| > infinity's bits
    for (int64_t i = 0; i < count; ++i) {
      const Bits magnitude = chunk[i] & kAbsMask;
      worst = magnitude > worst ? magnitude : worst;
    }
    if (worst > kInfinity) {
#pragma omp atomic write
      found = 1;
    }
  });
  return found != 0;
}

bool contains_nan(const Tensor& x) {
  if (x.dtype() == DType::float32)
    return contains_nan_bits<uint32_t, 0x7fffffffu, 0x7f800000u>(static_cast<const uint32_t*>(x.impl().data()),
                                                                   x.numel());
  return contains_nan_bits<uint16_t, 0x7fffu, 0x7f80u>(static_cast<const uint16_t*>(x.impl().data()), x.numel());
}

// Whether a contiguous float32/bfloat16 tensor holds a NaN or an infinity. oneDNN's argmax of a
// window of -inf values differs from PyTorch's (the first position), so those take the loop.
bool contains_non_finite(const Tensor& x) {
  if (x.dtype() == DType::float32)
    return contains_nan_bits<uint32_t, 0x7fffffffu, 0x7f7fffffu>(static_cast<const uint32_t*>(x.impl().data()),
                                                                   x.numel());
  return contains_nan_bits<uint16_t, 0x7fffu, 0x7f7fu>(static_cast<const uint16_t*>(x.impl().data()), x.numel());
}

// Runs body(x, y) with a contiguous input and a contiguous output, copying into `out` after.
template <class Body>
void with_contiguous(const Tensor& input, Tensor& out, Body&& body) {
  const Tensor x = input.contiguous();
  Tensor y = out.is_contiguous() ? out : detail::make_empty(out.sizes().vec(), out.dtype(), out.device());
  body(x, y);
  if (!y.same(out)) out.copy_(y);
}

// ---------------- kernels ----------------

void max_pool2d_kernel(const OpCall& call, std::span<Tensor> outs) {
  if (outs[0].numel() == 0) return;
  const Window win = window_from(call, true);
  if (pool_channels_last(call.input(0), outs[0])) {
    with_channels_last(call.input(0), outs, [&](const Tensor& x, std::vector<Tensor>& ys, const NhwcPool& g) {
      KILN_DISPATCH_NUMERIC(x.dtype(), "max_pool2d", [&] {
        max_pool_nhwc<scalar_t, false>(x.data_ptr<scalar_t>(), ys[0].data_ptr<scalar_t>(), nullptr, g, win);
      });
    });
    return;
  }
  with_contiguous(call.input(0), outs[0], [&](const Tensor& x, Tensor& y) {
    if (onednn_dtype(x.dtype()) && !contains_nan(x) && onednn_pool(x, y, win, dnnl::algorithm::pooling_max)) return;
    KILN_DISPATCH_NUMERIC(x.dtype(), "max_pool2d", [&] { max_pool_loop<scalar_t>(x, y, nullptr, win); });
  });
}

void max_pool2d_with_indices_kernel(const OpCall& call, std::span<Tensor> outs) {
  if (outs[0].numel() == 0) return;
  const Window win = window_from(call, true);
  if (pool_channels_last(call.input(0), outs[0])) {
    with_channels_last(call.input(0), outs, [&](const Tensor& x, std::vector<Tensor>& ys, const NhwcPool& g) {
      KILN_DISPATCH_NUMERIC(x.dtype(), "max_pool2d_with_indices", [&] {
        max_pool_nhwc<scalar_t, true>(x.data_ptr<scalar_t>(), ys[0].data_ptr<scalar_t>(), ys[1].data_ptr<int64_t>(),
                                      g, win);
      });
    });
    return;
  }
  Tensor& indices_out = outs[1];
  Tensor indices = indices_out.is_contiguous() ? indices_out
                                               : detail::make_empty(indices_out.sizes().vec(), kInt64, indices_out.device());
  with_contiguous(call.input(0), outs[0], [&](const Tensor& x, Tensor& y) {
    if (onednn_dtype(x.dtype()) && !contains_non_finite(x) &&
        onednn_pool(x, y, win, dnnl::algorithm::pooling_max, indices.data_ptr<int64_t>()))
      return;
    KILN_DISPATCH_NUMERIC(x.dtype(), "max_pool2d_with_indices",
                          [&] { max_pool_loop<scalar_t>(x, y, indices.data_ptr<int64_t>(), win); });
  });
  if (!indices.same(indices_out)) indices_out.copy_(indices);
}

void avg_pool2d_kernel(const OpCall& call, std::span<Tensor> outs) {
  if (outs[0].numel() == 0) return;
  const Window win = window_from(call, false);
  const bool count_include_pad = call.bool_attr(4);
  const std::optional<int64_t> divisor = call.has_attr(5) ? std::optional<int64_t>(call.int_attr(5)) : std::nullopt;
  if (pool_channels_last(call.input(0), outs[0])) {
    with_channels_last(call.input(0), outs, [&](const Tensor& x, std::vector<Tensor>& ys, const NhwcPool& g) {
      KILN_DISPATCH_FLOATING(x.dtype(), "avg_pool2d", [&] {
        avg_pool_nhwc<scalar_t>(x.data_ptr<scalar_t>(), ys[0].data_ptr<scalar_t>(), g, win, count_include_pad, divisor);
      });
    });
    return;
  }
  with_contiguous(call.input(0), outs[0], [&](const Tensor& x, Tensor& y) {
    const PoolGeometry g = geometry(x, y);
    // oneDNN's include-padding divisor is always kH * kW; PyTorch's stops at the padding.
    const bool windows_within_padding =
        right_padding(g.h, g.oh, win.kernel[0], win.stride[0], win.pad[0], 1) == win.pad[0] &&
        right_padding(g.w, g.ow, win.kernel[1], win.stride[1], win.pad[1], 1) == win.pad[1];
    if (onednn_dtype(x.dtype()) && !divisor && (!count_include_pad || windows_within_padding) &&
        onednn_pool(x, y, win,
                    count_include_pad ? dnnl::algorithm::pooling_avg_include_padding
                                      : dnnl::algorithm::pooling_avg_exclude_padding))
      return;
    KILN_DISPATCH_FLOATING(x.dtype(), "avg_pool2d",
                           [&] { avg_pool_loop<scalar_t>(x, y, win, count_include_pad, divisor); });
  });
}

void adaptive_avg_pool2d_kernel(const OpCall& call, std::span<Tensor> outs) {
  if (outs[0].numel() == 0) return;
  if (pool_channels_last(call.input(0), outs[0])) {
    with_channels_last(call.input(0), outs, [&](const Tensor& x, std::vector<Tensor>& ys, const NhwcPool& g) {
      KILN_DISPATCH_FLOATING(x.dtype(), "adaptive_avg_pool2d", [&] {
        adaptive_avg_pool_nhwc<scalar_t>(x.data_ptr<scalar_t>(), ys[0].data_ptr<scalar_t>(), g);
      });
    });
    return;
  }
  with_contiguous(call.input(0), outs[0], [&](const Tensor& x, Tensor& y) {
    KILN_DISPATCH_FLOATING(x.dtype(), "adaptive_avg_pool2d", [&] { adaptive_avg_pool_loop<scalar_t>(x, y); });
  });
}

[[maybe_unused]] const bool registered = [] {
  register_kernel("max_pool2d", DeviceType::cpu, max_pool2d_kernel);
  register_kernel("max_pool2d_with_indices", DeviceType::cpu, max_pool2d_with_indices_kernel);
  register_kernel("avg_pool2d", DeviceType::cpu, avg_pool2d_kernel);
  register_kernel("adaptive_avg_pool2d", DeviceType::cpu, adaptive_avg_pool2d_kernel);
  return true;
}();

}  // namespace

}  // namespace kiln::cpu
