// CPU kernels for max_pool2d_with_indices_backward, avg_pool2d_backward and
// adaptive_avg_pool2d_backward.
//
// All three write the input gradient plane by plane (one (n, c) plane per task, split across
// OpenMP threads), so overlapping windows accumulate without races. A channels-last input
// gradient is written in place by loops over channels (one (n, channel block) per task; see
// "channels-last" below). float16/bfloat16 compute
// in float32 and convert once at the end, so overlapping contributions are not rounded one by one.
#include <limits>

#include "kernels/cpu/loops.h"
#include "kernels/cpu/pool_window.h"
#include "core/tensor_factory.h"
#include "kiln/op_table.h"
#include "kiln/ops.h"

namespace kiln::cpu {

namespace {

int64_t pair_at(IntArrayRef v, int d) { return v.size() == 1 ? v[0] : v[d]; }

// grad_output viewed as planes x OH x OW, the input gradient as planes x H x W.
struct PlaneGeometry {
  int64_t planes, h, w, oh, ow;
};

PlaneGeometry plane_geometry(const Tensor& grad, const Tensor& out) {
  const int64_t d = out.dim();
  const int64_t h = out.sizes()[d - 2], w = out.sizes()[d - 1];
  return {h * w == 0 ? 0 : out.numel() / (h * w), h, w, grad.sizes()[d - 2], grad.sizes()[d - 1]};
}

// Runs body(grad, dx) on grad_output and an output of a dtype the loops handle (float32 for
// float16/bfloat16), zeroed unless the body writes every element, then writes the result into
// `out`. Planar: both contiguous. Channels-last: grad_output with adjacent channels (any other
// strides) and a dense channels-last dx.
template <class Body>
void run_backward(const Tensor& grad_output, Tensor& out, Body&& body, bool zero = true, bool channels_last = false) {
  const DType compute = grad_output.dtype() == DType::float16 || grad_output.dtype() == DType::bfloat16
                            ? DType::float32
                            : grad_output.dtype();
  Tensor grad = as_dtype(grad_output, compute);
  if (!channels_last) grad = grad.contiguous();
  else if (!channels_adjacent(grad)) grad = grad.contiguous(kiln::channels_last);
  const bool direct =
      (channels_last ? out.is_contiguous(kiln::channels_last) : out.is_contiguous()) && out.dtype() == compute;
  Tensor dx = out;
  if (!direct && channels_last)
    dx = detail::make_empty_strided(out.sizes().vec(), detail::channels_last_strides(out.sizes()), compute,
                                    out.device());
  else if (!direct)
    dx = detail::make_empty(out.sizes().vec(), compute, out.device());
  if ((zero || grad.numel() == 0) && dx.numel() > 0) {
    char* p = static_cast<char*>(dx.impl().data());
    parallel_for(dx.nbytes(), kGrainSize * 8, [&](int64_t b, int64_t e) { std::fill(p + b, p + e, char(0)); });
  }
  if (grad.numel() > 0) body(grad, dx);
  if (!direct) out.copy_(dx);
}

// ---------------- channels-last ----------------
//
// grad_output (any strides with adjacent channels) scattered into a (zeroed) dense channels-last
// dx. Each task takes an image (and, when there are fewer images than threads, a block of its
// channels), so overlapping windows never race; it walks the image's output pixels with an inner
// loop over contiguous channels.

// dx's sizes and grad_output's spatial size and strides.
struct NhwcGrad {
  int64_t n, c, h, w, oh, ow;
  PixelStrides grad;
};

NhwcGrad nhwc_grad(const Tensor& grad, const Tensor& dx) {
  return {dx.sizes()[0], dx.sizes()[1], dx.sizes()[2], dx.sizes()[3], grad.sizes()[2], grad.sizes()[3],
          pixel_strides(grad)};
}

// Runs f(n, c0, nc) for every (image, channel block), in parallel. Channels are split only as far
// as the threads need (blocks of at least a cache line): whole rows of channels stream best.
template <class T, class F>
void for_each_image_channel_block(const NhwcGrad& g, int64_t work_per_channel, F&& f) {
  constexpr int64_t kLine = 64 / sizeof(T);
  const int64_t splits = std::max<int64_t>(1, (omp_get_max_threads() + g.n - 1) / std::max<int64_t>(1, g.n));
  const int64_t block = std::min(g.c, std::max(kLine, (g.c + splits - 1) / splits));
  const int64_t blocks = (g.c + block - 1) / block;
  parallel_for(g.n * blocks, std::max<int64_t>(1, kGrainSize / std::max<int64_t>(1, work_per_channel * block)),
               [&](int64_t b, int64_t e) {
                 for (int64_t t = b; t < e; ++t) {
                   const int64_t c0 = (t % blocks) * block;
                   f(t / blocks, c0, std::min(block, g.c - c0));
                 }
               });
}

// Adds v[c] / divisor, per channel, to every pixel of the window [h0, h1) x [w0, w1); `share`
// holds nc values of scratch.
template <class T>
inline void spread_nhwc(T* image, const NhwcGrad& g, int64_t c0, int64_t nc, const T* v, T divisor, int64_t h0,
                        int64_t h1, int64_t w0, int64_t w1, T* __restrict share) {
  for (int64_t c = 0; c < nc; ++c) share[c] = v[c] / divisor;
  for (int64_t ih = h0; ih < h1; ++ih) {
    for (int64_t iw = w0; iw < w1; ++iw) {
      T* __restrict dst = image + (ih * g.w + iw) * g.c + c0;
#pragma omp simd
      for (int64_t c = 0; c < nc; ++c) dst[c] += share[c];
    }
  }
}

// Both max-pool backward loops flag an index outside the input plane instead of writing there.
void check_indices_in_range(int bad, int64_t in_plane) {
  KILN_CHECK(bad == 0, IndexError,
             "[kiln::max_pool2d_with_indices_backward] an index is out of range for an input plane of " +
                 std::to_string(in_plane) + " elements. Pass the indices max_pool2d_with_indices returned.");
}

template <class T>
void max_pool_backward_nhwc(const Tensor& grad, const Tensor& indices, Tensor& dx) {
  const NhwcGrad g = nhwc_grad(grad, dx);
  const PixelStrides is = pixel_strides(indices);
  const T* gp = grad.data_ptr<T>();
  const int64_t* ip = indices.data_ptr<int64_t>();
  T* o = dx.data_ptr<T>();
  const int64_t in_plane = g.h * g.w;
  int bad = 0;
  for_each_image_channel_block<T>(g, g.oh * g.ow, [&](int64_t n, int64_t c0, int64_t nc) {
    T* __restrict image = o + n * in_plane * g.c + c0;
    bool out_of_range = false;
    for (int64_t oh = 0; oh < g.oh; ++oh) {
      for (int64_t ow = 0; ow < g.ow; ++ow) {
        const T* __restrict gr = gp + n * g.grad.n + oh * g.grad.h + ow * g.grad.w + c0;
        const int64_t* __restrict ir = ip + n * is.n + oh * is.h + ow * is.w + c0;
        for (int64_t c = 0; c < nc; ++c) {
          const int64_t at = ir[c];
          if (at < 0 || at >= in_plane) {
            out_of_range = true;
            continue;
          }
          image[at * g.c + c] += gr[c];
        }
      }
    }
    if (out_of_range) {
#pragma omp atomic write
      bad = 1;
    }
  });
  check_indices_in_range(bad, in_plane);
}

// ---------------- max_pool2d ----------------

template <class T>
void max_pool_backward_loop(const Tensor& grad, const Tensor& indices, Tensor& dx) {
  const PlaneGeometry g = plane_geometry(grad, dx);
  const T* gp = grad.data_ptr<T>();
  const int64_t* ip = indices.data_ptr<int64_t>();
  T* o = dx.data_ptr<T>();
  const int64_t in_plane = g.h * g.w, out_plane = g.oh * g.ow;
  int bad = 0;
  parallel_for(g.planes, std::max<int64_t>(1, kGrainSize / std::max<int64_t>(1, in_plane + out_plane)),
               [&](int64_t b, int64_t e) {
                 bool out_of_range = false;
                 for (int64_t p = b; p < e; ++p) {
                   const T* gr = gp + p * out_plane;
                   const int64_t* ir = ip + p * out_plane;
                   T* dst = o + p * in_plane;
                   for (int64_t i = 0; i < out_plane; ++i) {
                     const int64_t at = ir[i];
                     if (at < 0 || at >= in_plane) {
                       out_of_range = true;
                       continue;
                     }
                     dst[at] += gr[i];
                   }
                 }
                 if (out_of_range) {
#pragma omp atomic write
                   bad = 1;
                 }
               });
  check_indices_in_range(bad, in_plane);
}

void max_pool2d_backward_kernel(const OpCall& call, std::span<Tensor> outs) {
  const bool channels_last = wants_channels_last(outs[0]);
  const Tensor& index_input = call.input(1);
  const Tensor indices = !channels_last                 ? index_input.contiguous()
                         : channels_adjacent(index_input) ? index_input
                                                          : index_input.contiguous(kiln::channels_last);
  run_backward(
      call.input(0), outs[0],
      [&](const Tensor& grad, Tensor& dx) {
        KILN_DISPATCH_FLOATING(grad.dtype(), "max_pool2d_with_indices_backward", [&] {
          if constexpr (std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, double>) {
            if (channels_last) max_pool_backward_nhwc<scalar_t>(grad, indices, dx);
            else max_pool_backward_loop<scalar_t>(grad, indices, dx);
          }
        });
      },
      /*zero=*/true, channels_last);
}

// ---------------- avg_pool2d ----------------

struct AvgWindow {
  int64_t kernel[2], stride[2], pad[2];
  bool count_include_pad;
  std::optional<int64_t> divisor_override;
};

// Attrs: input_sizes, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override.
AvgWindow avg_window(const OpCall& c) {
  AvgWindow win{};
  for (int d = 0; d < 2; ++d) {
    win.kernel[d] = pair_at(c.ints_attr(1), d);
    win.stride[d] = c.ints_attr(2).empty() ? win.kernel[d] : pair_at(c.ints_attr(2), d);
    win.pad[d] = pair_at(c.ints_attr(3), d);
  }
  win.count_include_pad = c.bool_attr(5);
  if (c.has_attr(6)) win.divisor_override = c.int_attr(6);
  return win;
}

// The same windows and divisors as the forward loop (pool_kernels.cpp avg_pool_loop).
template <class T>
void avg_pool_backward_loop(const Tensor& grad, Tensor& dx, const AvgWindow& win) {
  const PlaneGeometry g = plane_geometry(grad, dx);
  const T* gp = grad.data_ptr<T>();
  T* o = dx.data_ptr<T>();
  parallel_for(g.planes, std::max<int64_t>(1, kGrainSize / std::max<int64_t>(1, g.h * g.w)), [&](int64_t b, int64_t e) {
    for (int64_t p = b; p < e; ++p) {
      const T* gr = gp + p * g.oh * g.ow;
      T* dst = o + p * g.h * g.w;
      for (int64_t oh = 0; oh < g.oh; ++oh) {
        const AvgSpan hs = avg_span(oh, win.kernel[0], win.stride[0], win.pad[0], g.h);
        for (int64_t ow = 0; ow < g.ow; ++ow) {
          const AvgSpan ws = avg_span(ow, win.kernel[1], win.stride[1], win.pad[1], g.w);
          if (hs.start >= hs.end || ws.start >= ws.end) continue;
          const int64_t divisor = avg_divisor(hs, ws, win.count_include_pad, win.divisor_override);
          const T v = gr[oh * g.ow + ow] / static_cast<T>(divisor);
          for (int64_t ih = hs.start; ih < hs.end; ++ih) {
            T* row = dst + ih * g.w;
            for (int64_t iw = ws.start; iw < ws.end; ++iw) row[iw] += v;
          }
        }
      }
    }
  });
}

// What each input element of a full window gets of the window's gradient in the tiled backward
// passes: 1 / window size, or 1 / the divisor override.
template <class T>
T tiled_share(const AvgWindow& win) {
  return T(1) / static_cast<T>(win.divisor_override ? *win.divisor_override : win.kernel[0] * win.kernel[1]);
}

// Non-overlapping full windows (kernel == stride, no padding, none cut by ceil_mode; DenseNet's
// transitions): every input element gets its window's gradient / divisor or, past the last
// window, zero; each is written once, row by row, with no zero fill first.
template <class T>
void avg_pool_backward_tiled(const Tensor& grad, Tensor& dx, const AvgWindow& win) {
  const PlaneGeometry g = plane_geometry(grad, dx);
  const T* gp = grad.data_ptr<T>();
  T* o = dx.data_ptr<T>();
  const int64_t kh = win.kernel[0], kw = win.kernel[1];
  const T inv = tiled_share<T>(win);
  const int64_t covered = g.ow * kw;
  parallel_for(g.planes * g.h, std::max<int64_t>(1, kGrainSize / std::max<int64_t>(1, g.w)), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const int64_t p = r / g.h, ih = r % g.h, oh = ih / kh;
      T* __restrict dst = o + r * g.w;
      if (oh >= g.oh) {
        std::fill(dst, dst + g.w, T(0));
        continue;
      }
      const T* __restrict src = gp + (p * g.oh + oh) * g.ow;
      if (kw == 2) {
#pragma omp simd
        for (int64_t ow = 0; ow < g.ow; ++ow) {
          const T v = src[ow] * inv;
          dst[2 * ow] = v;
          dst[2 * ow + 1] = v;
        }
      } else {
        for (int64_t ow = 0; ow < g.ow; ++ow) {
          const T v = src[ow] * inv;
          for (int64_t j = 0; j < kw; ++j) dst[ow * kw + j] = v;
        }
      }
      std::fill(dst + covered, dst + g.w, T(0));
    }
  });
}

template <class T>
void avg_pool_backward_nhwc(const Tensor& grad, Tensor& dx, const AvgWindow& win) {
  const NhwcGrad g = nhwc_grad(grad, dx);
  const T* gp = grad.data_ptr<T>();
  T* o = dx.data_ptr<T>();
  const int64_t window = win.kernel[0] * win.kernel[1];
  for_each_image_channel_block<T>(g, g.oh * g.ow * window, [&](int64_t n, int64_t c0, int64_t nc) {
    T* image = o + n * g.h * g.w * g.c;
    std::vector<T> share(static_cast<size_t>(nc));
    for (int64_t oh = 0; oh < g.oh; ++oh) {
      const AvgSpan hs = avg_span(oh, win.kernel[0], win.stride[0], win.pad[0], g.h);
      for (int64_t ow = 0; ow < g.ow; ++ow) {
        const AvgSpan ws = avg_span(ow, win.kernel[1], win.stride[1], win.pad[1], g.w);
        if (hs.start >= hs.end || ws.start >= ws.end) continue;
        const int64_t divisor = avg_divisor(hs, ws, win.count_include_pad, win.divisor_override);
        spread_nhwc(image, g, c0, nc, gp + n * g.grad.n + oh * g.grad.h + ow * g.grad.w + c0, static_cast<T>(divisor),
                    hs.start, hs.end, ws.start, ws.end, share.data());
      }
    }
  });
}

// avg_pool_backward_tiled for channels-last: each input pixel's C gradients written once.
template <class T>
void avg_pool_backward_tiled_nhwc(const Tensor& grad, Tensor& dx, const AvgWindow& win) {
  const NhwcGrad g = nhwc_grad(grad, dx);
  const T* gp = grad.data_ptr<T>();
  T* o = dx.data_ptr<T>();
  const int64_t kh = win.kernel[0], kw = win.kernel[1];
  const T inv = tiled_share<T>(win);
  const int64_t grain = std::max<int64_t>(1, kGrainSize / std::max<int64_t>(1, g.w * g.c));
  parallel_for(g.n * g.h, grain, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const int64_t n = r / g.h, oh = r % g.h / kh;
      T* row = o + r * g.w * g.c;
      if (oh >= g.oh) {
        std::fill_n(row, g.w * g.c, T(0));
        continue;
      }
      for (int64_t iw = 0; iw < g.w; ++iw) {
        T* __restrict dst = row + iw * g.c;
        const int64_t ow = iw / kw;
        if (ow >= g.ow) {
          std::fill_n(dst, g.c, T(0));
          continue;
        }
        const T* __restrict src = gp + n * g.grad.n + oh * g.grad.h + ow * g.grad.w;
#pragma omp simd
        for (int64_t c = 0; c < g.c; ++c) dst[c] = src[c] * inv;
      }
    }
  });
}

void avg_pool2d_backward_kernel(const OpCall& call, std::span<Tensor> outs) {
  const AvgWindow win = avg_window(call);
  const Tensor& grad_output = call.input(0);
  const int64_t d = grad_output.dim();
  const IntArrayRef in = call.ints_attr(0);
  const bool tiled = win.kernel[0] == win.stride[0] && win.kernel[1] == win.stride[1] && win.pad[0] == 0 &&
                     win.pad[1] == 0 && grad_output.sizes()[d - 2] * win.kernel[0] <= in[d - 2] &&
                     grad_output.sizes()[d - 1] * win.kernel[1] <= in[d - 1];
  const bool channels_last = wants_channels_last(outs[0]);
  run_backward(
      grad_output, outs[0],
      [&](const Tensor& grad, Tensor& dx) {
        KILN_DISPATCH_FLOATING(grad.dtype(), "avg_pool2d_backward", [&] {
          if constexpr (std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, double>) {
            if (channels_last && tiled) avg_pool_backward_tiled_nhwc<scalar_t>(grad, dx, win);
            else if (channels_last) avg_pool_backward_nhwc<scalar_t>(grad, dx, win);
            else if (tiled) avg_pool_backward_tiled<scalar_t>(grad, dx, win);
            else avg_pool_backward_loop<scalar_t>(grad, dx, win);
          }
        });
      },
      /*zero=*/!tiled, channels_last);
}

// ---------------- adaptive_avg_pool2d ----------------

// Windows as the forward computes them: [floor(i * in / out), ceil((i + 1) * in / out)).
template <class T>
void adaptive_avg_pool_backward_loop(const Tensor& grad, Tensor& dx) {
  const PlaneGeometry g = plane_geometry(grad, dx);
  const T* gp = grad.data_ptr<T>();
  T* o = dx.data_ptr<T>();
  const int64_t hw = g.h * g.w;
  parallel_for(g.planes, std::max<int64_t>(1, kGrainSize / std::max<int64_t>(1, hw)), [&](int64_t b, int64_t e) {
    for (int64_t p = b; p < e; ++p) {
      const T* gr = gp + p * g.oh * g.ow;
      T* dst = o + p * hw;
      if (g.oh == 1 && g.ow == 1) {  // global average pooling: a broadcast
        const T v = gr[0] / static_cast<T>(hw);
#pragma omp simd
        for (int64_t i = 0; i < hw; ++i) dst[i] = v;
        continue;
      }
      for (int64_t oh = 0; oh < g.oh; ++oh) {
        const int64_t hstart = oh * g.h / g.oh, hend = ((oh + 1) * g.h + g.oh - 1) / g.oh;
        for (int64_t ow = 0; ow < g.ow; ++ow) {
          const int64_t wstart = ow * g.w / g.ow, wend = ((ow + 1) * g.w + g.ow - 1) / g.ow;
          const T v = gr[oh * g.ow + ow] / static_cast<T>((hend - hstart) * (wend - wstart));
          for (int64_t ih = hstart; ih < hend; ++ih) {
            T* row = dst + ih * g.w;
            for (int64_t iw = wstart; iw < wend; ++iw) row[iw] += v;
          }
        }
      }
    }
  });
}

template <class T>
void adaptive_avg_pool_backward_nhwc(const Tensor& grad, Tensor& dx) {
  const NhwcGrad g = nhwc_grad(grad, dx);
  const T* gp = grad.data_ptr<T>();
  T* o = dx.data_ptr<T>();
  if (g.oh == 1 && g.ow == 1) {  // global average pooling: a broadcast, each pixel written once
    const int64_t hw = g.h * g.w;
    const T divisor = static_cast<T>(hw);
    parallel_for(g.n * hw, std::max<int64_t>(1, kGrainSize / std::max<int64_t>(1, g.c)), [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) {
        const T* __restrict src = gp + (r / hw) * g.grad.n;
        T* __restrict dst = o + r * g.c;
#pragma omp simd
        for (int64_t c = 0; c < g.c; ++c) dst[c] = src[c] / divisor;
      }
    });
    return;
  }
  const int64_t window = (g.h / g.oh + 1) * (g.w / g.ow + 1);
  for_each_image_channel_block<T>(g, g.oh * g.ow * window, [&](int64_t n, int64_t c0, int64_t nc) {
    T* image = o + n * g.h * g.w * g.c;
    std::vector<T> share(static_cast<size_t>(nc));
    for (int64_t oh = 0; oh < g.oh; ++oh) {
      const int64_t hstart = adaptive_start(oh, g.h, g.oh), hend = adaptive_end(oh, g.h, g.oh);
      for (int64_t ow = 0; ow < g.ow; ++ow) {
        const int64_t wstart = adaptive_start(ow, g.w, g.ow), wend = adaptive_end(ow, g.w, g.ow);
        spread_nhwc(image, g, c0, nc, gp + n * g.grad.n + oh * g.grad.h + ow * g.grad.w + c0,
                    static_cast<T>((hend - hstart) * (wend - wstart)), hstart, hend, wstart, wend, share.data());
      }
    }
  });
}

void adaptive_avg_pool2d_backward_kernel(const OpCall& call, std::span<Tensor> outs) {
  const bool channels_last = wants_channels_last(outs[0]);
  const Tensor& grad_output = call.input(0);
  const int64_t d = grad_output.dim();
  const bool global = grad_output.sizes()[d - 2] == 1 && grad_output.sizes()[d - 1] == 1;  // written once
  run_backward(
      grad_output, outs[0],
      [&](const Tensor& grad, Tensor& dx) {
        KILN_DISPATCH_FLOATING(grad.dtype(), "adaptive_avg_pool2d_backward", [&] {
          if constexpr (std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, double>) {
            if (channels_last) adaptive_avg_pool_backward_nhwc<scalar_t>(grad, dx);
            else adaptive_avg_pool_backward_loop<scalar_t>(grad, dx);
          }
        });
      },
      /*zero=*/!(channels_last && global), channels_last);
}

[[maybe_unused]] const bool registered = [] {
  register_kernel("max_pool2d_with_indices_backward", DeviceType::cpu, max_pool2d_backward_kernel);
  register_kernel("avg_pool2d_backward", DeviceType::cpu, avg_pool2d_backward_kernel);
  register_kernel("adaptive_avg_pool2d_backward", DeviceType::cpu, adaptive_avg_pool2d_backward_kernel);
  return true;
}();

}  // namespace

}  // namespace kiln::cpu
