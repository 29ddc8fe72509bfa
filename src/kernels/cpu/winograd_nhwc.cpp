// Kiln's Winograd F(4x4, 3x3) convolution on channels-last float32 data (winograd_nhwc.h).
//
// The transform matrices are Lavin & Gray's for F(4, 3) (interpolation points 0, 1, -1, 2, -2
// and infinity):
//   B^T = [4 0 -5 0 1 0; 0 -4 -4 1 1 0; 0 4 -4 -1 1 0; 0 -2 -1 2 1 0; 0 2 -1 -2 1 0; 0 4 0 -5 0 1]
//   G   = [1/4 0 0; -1/6 -1/6 -1/6; -1/6 1/6 -1/6; 1/24 1/12 1/6; 1/24 -1/12 1/6; 0 0 1]
//   A^T = [1 1 1 1 1 0; 0 1 -1 2 -2 0; 0 1 1 4 4 0; 0 1 -1 8 -8 1]
// and a 4x4 output tile is A^T [(G g G^T) .* (B^T d B)] A, summed over input channels; the
// elementwise product summed over channels is one GEMM per transform point p (36 of them):
// M[p] (tiles x out channels) = V[p] (tiles x in channels) U[p] (in channels x out channels).
#include "kernels/cpu/winograd_nhwc.h"

#include <oneapi/dnnl/dnnl.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <vector>

#include "kernels/cpu/loops.h"
#include "kiln/error.h"

namespace kiln::cpu {

namespace {

constexpr int64_t kPoints = 36;
constexpr int64_t kTileBlock = 64;  // tiles per block: 36 x 64 x 128 floats of V = 1.2 MB at 128 channels

// r = B^T d for six vectors of n values (d[k] and r[k] n values each, any stride between them).
inline void input_transform_1d(const float* const d[6], float* const r[6], int64_t n) {
  const float *__restrict d0 = d[0], *__restrict d1 = d[1], *__restrict d2 = d[2], *__restrict d3 = d[3],
              *__restrict d4 = d[4], *__restrict d5 = d[5];
  float *__restrict r0 = r[0], *__restrict r1 = r[1], *__restrict r2 = r[2], *__restrict r3 = r[3],
        *__restrict r4 = r[4], *__restrict r5 = r[5];
#pragma omp simd
  for (int64_t c = 0; c < n; ++c) {
    const float a0 = d0[c], a1 = d1[c], a2 = d2[c], a3 = d3[c], a4 = d4[c], a5 = d5[c];
    r0[c] = 4 * a0 - 5 * a2 + a4;
    r1[c] = -4 * (a1 + a2) + a3 + a4;
    r2[c] = 4 * (a1 - a2) - a3 + a4;
    r3[c] = 2 * (a3 - a1) - a2 + a4;
    r4[c] = 2 * (a1 - a3) - a2 + a4;
    r5[c] = 4 * a1 - 5 * a3 + a5;
  }
}

// r = A^T m for six vectors of n values (four results).
inline void output_transform_1d(const float* const m[6], float* const r[4], int64_t n) {
  const float *__restrict m0 = m[0], *__restrict m1 = m[1], *__restrict m2 = m[2], *__restrict m3 = m[3],
              *__restrict m4 = m[4], *__restrict m5 = m[5];
  float *__restrict r0 = r[0], *__restrict r1 = r[1], *__restrict r2 = r[2], *__restrict r3 = r[3];
#pragma omp simd
  for (int64_t c = 0; c < n; ++c) {
    const float a0 = m0[c], a1 = m1[c], a2 = m2[c], a3 = m3[c], a4 = m4[c], a5 = m5[c];
    const float s12 = a1 + a2, d12 = a1 - a2, s34 = a3 + a4, d34 = a3 - a4;
    r0[c] = a0 + s12 + s34;
    r1[c] = d12 + 2 * d34;
    r2[c] = s12 + 4 * s34;
    r3[c] = d12 + 8 * d34 + a5;
  }
}

// r = A v for four vectors of n values (six results): the adjoint of the output transform.
inline void output_gradient_transform_1d(const float* const v[4], float* const r[6], int64_t n) {
  const float *__restrict v0 = v[0], *__restrict v1 = v[1], *__restrict v2 = v[2], *__restrict v3 = v[3];
  float *__restrict r0 = r[0], *__restrict r1 = r[1], *__restrict r2 = r[2], *__restrict r3 = r[3],
        *__restrict r4 = r[4], *__restrict r5 = r[5];
#pragma omp simd
  for (int64_t c = 0; c < n; ++c) {
    const float a0 = v0[c], a1 = v1[c], a2 = v2[c], a3 = v3[c];
    const float s02 = a0 + a2, s13 = a1 + a3, q02 = a0 + 4 * a2, q13 = 2 * a1 + 8 * a3;
    r0[c] = a0;
    r1[c] = s02 + s13;
    r2[c] = s02 - s13;
    r3[c] = q02 + q13;
    r4[c] = q02 - q13;
    r5[c] = a3;
  }
}

// r = G^T u for six values (three results): the adjoint of the kernel transform.
inline void kernel_gradient_transform_1d(const double u[6], double r[3]) {
  r[0] = u[0] / 4 - (u[1] + u[2]) / 6 + (u[3] + u[4]) / 24;
  r[1] = (u[2] - u[1]) / 6 + (u[3] - u[4]) / 12;
  r[2] = (u[3] + u[4] - u[1] - u[2]) / 6 + u[5];
}

// u = G g for three values (six results).
inline void kernel_transform_1d(const float g[3], float u[6]) {
  u[0] = g[0] * 0.25f;
  u[1] = -(g[0] + g[1] + g[2]) * (1.0f / 6);
  u[2] = -(g[0] - g[1] + g[2]) * (1.0f / 6);
  u[3] = g[0] * (1.0f / 24) + g[1] * (1.0f / 12) + g[2] * (1.0f / 6);
  u[4] = g[0] * (1.0f / 24) - g[1] * (1.0f / 12) + g[2] * (1.0f / 6);
  u[5] = g[2];
}

// U[p][ci][co] = (G g G^T)[p] for the kernel g = weight(co, ci, 0..2, 0..2). One input channel
// at a time is transformed into a row per point, then copied: stores straight into U's 36 rows
// (each ci * co floats apart) measured 1 ms for a 32x128 kernel set, the copies 0.02 ms.
template <class Weight>
std::vector<float> transform_kernels(int64_t out_channels, int64_t in_channels, Weight&& weight) {
  std::vector<float> u(static_cast<size_t>(kPoints * in_channels * out_channels));
  parallel_for(in_channels, std::max<int64_t>(1, 512 / std::max<int64_t>(1, out_channels)), [&](int64_t b, int64_t e) {
    std::vector<float> rows(static_cast<size_t>(kPoints * out_channels));
    for (int64_t ci = b; ci < e; ++ci) {
      for (int64_t co = 0; co < out_channels; ++co) {
        float g[3][3], t[6][3];
        for (int i = 0; i < 3; ++i)
          for (int j = 0; j < 3; ++j) g[i][j] = weight(co, ci, i, j);
        for (int j = 0; j < 3; ++j) {  // t = G g, column by column
          const float column[3] = {g[0][j], g[1][j], g[2][j]};
          float r[6];
          kernel_transform_1d(column, r);
          for (int i = 0; i < 6; ++i) t[i][j] = r[i];
        }
        for (int i = 0; i < 6; ++i) {  // (t G^T) row by row
          float r[6];
          kernel_transform_1d(t[i], r);
          for (int j = 0; j < 6; ++j) rows[static_cast<size_t>((i * 6 + j) * out_channels + co)] = r[j];
        }
      }
      for (int64_t p = 0; p < kPoints; ++p)
        std::copy_n(rows.data() + p * out_channels, out_channels, u.data() + (p * in_channels + ci) * out_channels);
    }
  });
  return u;
}

// V[p] (row k of the block's p-th tiles x ci operand, `v` pointing at row k of point 0) = (B^T d B)[p],
// d the tile's 6x6 input pixels (zero outside the input). d and t: 36 * ci floats of scratch.
void transform_input_tile(const float* x, int64_t h, int64_t w, int64_t ci, int64_t tiles_h, int64_t tiles_w,
                          const int64_t pad[2], int64_t tile, int64_t tile_block, float* v, float* d, float* t) {
  const int64_t img = tile / (tiles_h * tiles_w);
  const int64_t y0 = tile / tiles_w % tiles_h * 4 - pad[0], x0 = tile % tiles_w * 4 - pad[1];
  // The tile's pixels: read in place when all 36 are inside the input, else copied with zeros for
  // the outside ones (the copies measured 16% of a 32x32 layer's time when every tile took them).
  const float* pixel[36];
  if (y0 >= 0 && y0 + 6 <= h && x0 >= 0 && x0 + 6 <= w) {
    for (int64_t i = 0; i < 6; ++i)
      for (int64_t j = 0; j < 6; ++j) pixel[i * 6 + j] = x + ((img * h + y0 + i) * w + x0 + j) * ci;
  } else {
    for (int64_t i = 0; i < 6; ++i)
      for (int64_t j = 0; j < 6; ++j) {
        float* dst = d + (i * 6 + j) * ci;
        const int64_t yy = y0 + i, xx = x0 + j;
        if (yy < 0 || yy >= h || xx < 0 || xx >= w) std::fill_n(dst, ci, 0.0f);
        else std::memcpy(dst, x + ((img * h + yy) * w + xx) * ci, static_cast<size_t>(ci) * sizeof(float));
        pixel[i * 6 + j] = dst;
      }
  }
  for (int64_t j = 0; j < 6; ++j) {  // columns: t = B^T d
    const float* in[6];
    float* out[6];
    for (int64_t i = 0; i < 6; ++i) {
      in[i] = pixel[i * 6 + j];
      out[i] = t + (i * 6 + j) * ci;
    }
    input_transform_1d(in, out, ci);
  }
  for (int64_t i = 0; i < 6; ++i) {  // rows: V = t B, straight into the GEMM operands
    const float* in[6];
    float* out[6];
    for (int64_t j = 0; j < 6; ++j) {
      in[j] = t + (i * 6 + j) * ci;
      out[j] = v + (i * 6 + j) * tile_block * ci;
    }
    input_transform_1d(in, out, ci);
  }
}

// Tiles per block: kTileBlock, or fewer so that every thread gets a block of a small problem
// (DenseNet's 8x8 layers have 64 tiles), and so that a block's transformed operands (36 points x
// tiles x channels, kept per thread across calls) stay within about 2 MB for wide layers.
int64_t tile_block_for(int64_t tiles, int64_t channels) {
  constexpr int64_t kBlockBytes = 2 << 20;
  const int64_t threads = max_threads();
  const int64_t by_size = std::max<int64_t>(4, kBlockBytes / (kPoints * std::max<int64_t>(1, channels) * 4));
  return std::clamp<int64_t>((tiles + threads - 1) / threads, 1, std::min(kTileBlock, by_size));
}

// Per-thread scratch, kept across calls (a fresh megabyte per call would fault in its pages).
// v: a block's transformed input (36 x tile_block x ci); m: its transformed outputs or output
// gradients (36 x tile_block x co); d, t: one tile's pixels and half-transformed values (36 x the
// wider channel count); sink: where outputs past the output's edge go (4 x co).
struct Scratch {
  std::vector<float> v, m, d, t, sink;
};
Scratch& thread_scratch(int64_t tile_block, int64_t ci, int64_t co) {
  thread_local Scratch s;
  s.v.resize(static_cast<size_t>(kPoints * tile_block * ci));
  s.m.resize(static_cast<size_t>(kPoints * tile_block * co));
  s.d.resize(static_cast<size_t>(kPoints * std::max(ci, co)));
  s.t.resize(static_cast<size_t>(kPoints * std::max(ci, co)));
  s.sink.resize(static_cast<size_t>(4 * co));
  return s;
}

// y (n, oh, ow, co) = sum over ci of the F(4x4, 3x3) convolution of x (n, h, w, ci), padded by
// pad, with the transformed kernels u.
void winograd_conv(const float* x, int64_t n, int64_t h, int64_t w, int64_t ci, const float* u, int64_t co,
                   const int64_t pad[2], float* y, int64_t oh, int64_t ow) {
  const int64_t tiles_h = (oh + 3) / 4, tiles_w = (ow + 3) / 4, tiles = n * tiles_h * tiles_w;
  const int64_t tile_block = tile_block_for(tiles, std::max(ci, co));
  const int64_t blocks = (tiles + tile_block - 1) / tile_block;
  std::atomic<bool> failed{false};  // reported after the parallel loop: no exception may leave it
  parallel_for(blocks, 1, [&](int64_t block_begin, int64_t block_end) {
    Scratch& s = thread_scratch(tile_block, ci, co);
    float* v = s.v.data();
    float* m = s.m.data();
    float* d = s.d.data();
    float* t = s.t.data();
    for (int64_t block = block_begin; block < block_end; ++block) {
      const int64_t first = block * tile_block, count = std::min(tile_block, tiles - first);
      for (int64_t k = 0; k < count; ++k)
        transform_input_tile(x, h, w, ci, tiles_h, tiles_w, pad, first + k, tile_block, v + k * ci, d, t);
      // M[p] = V[p] U[p]: single-threaded inside this thread's block.
      for (int64_t p = 0; p < kPoints; ++p) {
        if (dnnl_sgemm('N', 'N', count, co, ci, 1.0f, v + p * tile_block * ci, ci, u + p * ci * co, co, 0.0f,
                       m + p * tile_block * co, co) != dnnl_success)
          failed.store(true, std::memory_order_relaxed);
      }
      // Output transform: the tile's 4x4 outputs = A^T M A, clipped at the output's edge.
      for (int64_t k = 0; k < count; ++k) {
        const int64_t tile = first + k, img = tile / (tiles_h * tiles_w);
        const int64_t ty = tile / tiles_w % tiles_h * 4, tx = tile % tiles_w * 4;
        for (int64_t j = 0; j < 6; ++j) {  // columns: t = A^T M
          const float* in[6];
          float* out[4];
          for (int64_t i = 0; i < 6; ++i) in[i] = m + ((i * 6 + j) * tile_block + k) * co;
          for (int64_t i = 0; i < 4; ++i) out[i] = t + (i * 6 + j) * co;
          output_transform_1d(in, out, co);
        }
        const int64_t cols = std::min<int64_t>(4, ow - tx);
        for (int64_t i = 0; i < 4 && ty + i < oh; ++i) {  // rows: y = t A
          const float* in[6];
          float* out[4];
          float* row = y + ((img * oh + ty + i) * ow + tx) * co;
          for (int64_t j = 0; j < 6; ++j) in[j] = t + (i * 6 + j) * co;
          for (int64_t j = 0; j < 4; ++j) out[j] = j < cols ? row + j * co : s.sink.data() + j * co;  // past the edge
          output_transform_1d(in, out, co);
        }
      }
    }
  });
  KILN_CHECK(!failed, Error, "[kiln::conv2d] oneDNN's sgemm failed in the Winograd convolution.");
}

// dW (co, ci, 3, 3) of the F(4x4, 3x3) convolution of x (n, h, w, ci) padded by pad, for the output
// gradient dy (n, oh, ow, co): dU[p] = sum over tiles of V[p]^T (ci x tiles) Yg[p] (tiles x co),
// Yg the output gradient's tiles through A (zero past the output's edge, where the forward
// computed values nobody read), then dW = G^T dU G (in double). Each thread sums its blocks of
// tiles into its own dU; the threads' sums are added first.
void winograd_weight_grad(const float* x, int64_t n, int64_t h, int64_t w, int64_t ci, const float* dy, int64_t co,
                          const int64_t pad[2], int64_t oh, int64_t ow, float* dw, bool dw_ohwi) {
  const int64_t tiles_h = (oh + 3) / 4, tiles_w = (ow + 3) / 4, tiles = n * tiles_h * tiles_w;
  const int64_t tile_block = tile_block_for(tiles, std::max(ci, co));
  const int64_t blocks = (tiles + tile_block - 1) / tile_block;
  const int64_t threads = max_threads();
  const int64_t parts = std::max<int64_t>(1, std::min(threads, blocks));
  const int64_t u_size = kPoints * ci * co;
  // The caller's buffer, reused (a fresh one faults in its pages), and named through a pointer: a
  // thread_local named inside the parallel loops would be each worker's own.
  thread_local std::vector<float> partial_buffer;
  partial_buffer.assign(static_cast<size_t>(parts * u_size), 0.0f);
  float* const partial = partial_buffer.data();
  std::atomic<bool> failed{false};  // reported after the parallel loop: no exception may leave it
  parallel_for(parts, 1, [&](int64_t part_begin, int64_t part_end) {
    Scratch& s = thread_scratch(tile_block, ci, co);
    float* v = s.v.data();
    float* yg = s.m.data();
    float* d = s.d.data();
    float* t = s.t.data();
    for (int64_t part = part_begin; part < part_end; ++part) {
      float* du = partial + part * u_size;
      for (int64_t block = blocks * part / parts; block < blocks * (part + 1) / parts; ++block) {
        const int64_t first = block * tile_block, count = std::min(tile_block, tiles - first);
        for (int64_t k = 0; k < count; ++k) {
          const int64_t tile = first + k, img = tile / (tiles_h * tiles_w);
          const int64_t ty = tile / tiles_w % tiles_h * 4, tx = tile % tiles_w * 4;
          transform_input_tile(x, h, w, ci, tiles_h, tiles_w, pad, tile, tile_block, v + k * ci, d, t);
          for (int64_t i = 0; i < 4; ++i)  // the tile's 4x4 output gradients, zero past the edge
            for (int64_t j = 0; j < 4; ++j) {
              float* dst = d + (i * 4 + j) * co;
              if (ty + i >= oh || tx + j >= ow) std::fill_n(dst, co, 0.0f);
              else std::memcpy(dst, dy + ((img * oh + ty + i) * ow + tx + j) * co, static_cast<size_t>(co) * sizeof(float));
            }
          for (int64_t j = 0; j < 4; ++j) {  // columns: t (6x4) = A g
            const float* in[4];
            float* out[6];
            for (int64_t i = 0; i < 4; ++i) in[i] = d + (i * 4 + j) * co;
            for (int64_t i = 0; i < 6; ++i) out[i] = t + (i * 4 + j) * co;
            output_gradient_transform_1d(in, out, co);
          }
          for (int64_t i = 0; i < 6; ++i) {  // rows: Yg (6x6) = t A^T
            const float* in[4];
            float* out[6];
            for (int64_t j = 0; j < 4; ++j) in[j] = t + (i * 4 + j) * co;
            for (int64_t j = 0; j < 6; ++j) out[j] = yg + ((i * 6 + j) * tile_block + k) * co;
            output_gradient_transform_1d(in, out, co);
          }
        }
        for (int64_t p = 0; p < kPoints; ++p) {
          if (dnnl_sgemm('T', 'N', ci, co, count, 1.0f, v + p * tile_block * ci, ci, yg + p * tile_block * co, co, 1.0f,
                         du + p * ci * co, co) != dnnl_success)
            failed.store(true, std::memory_order_relaxed);
        }
      }
    }
  });
  KILN_CHECK(!failed, Error, "[kiln::convolution_backward] oneDNN's sgemm failed in the Winograd weight gradient.");
  for (int64_t part = 1; part < parts; ++part) {
    const float* __restrict src = partial + part * u_size;
    float* __restrict dst = partial;
#pragma omp simd
    for (int64_t i = 0; i < u_size; ++i) dst[i] += src[i];
  }
  parallel_for(ci, std::max<int64_t>(1, 256 / std::max<int64_t>(1, co)), [&](int64_t b, int64_t e) {
    std::vector<double> u(static_cast<size_t>(kPoints * co));
    for (int64_t c = b; c < e; ++c) {
      for (int64_t p = 0; p < kPoints; ++p)  // dU[p][c][.], contiguous over output channels
        std::copy_n(partial + (p * ci + c) * co, co, u.data() + p * co);
      for (int64_t o = 0; o < co; ++o) {
        double r[6][3], g[3][3];
        for (int i = 0; i < 6; ++i) {  // rows: dU G
          const double row[6] = {u[static_cast<size_t>((i * 6 + 0) * co + o)], u[static_cast<size_t>((i * 6 + 1) * co + o)],
                                 u[static_cast<size_t>((i * 6 + 2) * co + o)], u[static_cast<size_t>((i * 6 + 3) * co + o)],
                                 u[static_cast<size_t>((i * 6 + 4) * co + o)], u[static_cast<size_t>((i * 6 + 5) * co + o)]};
          kernel_gradient_transform_1d(row, r[i]);
        }
        for (int j = 0; j < 3; ++j) {  // columns: G^T (dU G)
          const double column[6] = {r[0][j], r[1][j], r[2][j], r[3][j], r[4][j], r[5][j]};
          double out[3];
          kernel_gradient_transform_1d(column, out);
          for (int i = 0; i < 3; ++i) g[i][j] = out[i];
        }
        for (int i = 0; i < 3; ++i)
          for (int j = 0; j < 3; ++j)
            dw[dw_ohwi ? ((o * 3 + i) * 3 + j) * ci + c : ((o * ci + c) * 3 + i) * 3 + j] = static_cast<float>(g[i][j]);
      }
    }
  });
}

}  // namespace

bool winograd_nhwc_applies(int64_t kh, int64_t kw, const int64_t stride[2], const int64_t dilation[2], int64_t groups,
                           const int64_t pad[2], bool bias, int64_t oh, int64_t ow) {
  return kh == 3 && kw == 3 && stride[0] == 1 && stride[1] == 1 && dilation[0] == 1 && dilation[1] == 1 &&
         groups == 1 && pad[0] >= 0 && pad[0] <= 2 && pad[1] >= 0 && pad[1] <= 2 && !bias && oh > 0 && ow > 0;
}

void winograd_nhwc_forward(const float* x, int64_t n, int64_t h, int64_t w, int64_t c, const float* weight,
                           bool weight_ohwi, int64_t o, const int64_t pad[2], float* y, int64_t oh, int64_t ow) {
  const std::vector<float> u = transform_kernels(o, c, [&](int64_t co, int64_t ci, int i, int j) {
    return weight_ohwi ? weight[((co * 3 + i) * 3 + j) * c + ci] : weight[((co * c + ci) * 3 + i) * 3 + j];
  });
  winograd_conv(x, n, h, w, c, u.data(), o, pad, y, oh, ow);
}

void winograd_nhwc_backward_data(const float* dy, int64_t n, int64_t oh, int64_t ow, int64_t o, const float* weight,
                                 bool weight_ohwi, int64_t c, const int64_t pad[2], float* dx, int64_t h, int64_t w) {
  // dx = conv(dy, the kernel rotated 180 degrees with in/out channels swapped), padded by 2 - pad.
  const std::vector<float> u = transform_kernels(c, o, [&](int64_t co, int64_t ci, int i, int j) {
    const int64_t ri = 2 - i, rj = 2 - j;  // input channel ci of this convolution is output channel ci of the forward
    return weight_ohwi ? weight[((ci * 3 + ri) * 3 + rj) * c + co] : weight[((ci * c + co) * 3 + ri) * 3 + rj];
  });
  const int64_t data_pad[2] = {2 - pad[0], 2 - pad[1]};
  winograd_conv(dy, n, oh, ow, o, u.data(), c, data_pad, dx, h, w);
}

void winograd_nhwc_backward_weights(const float* x, int64_t n, int64_t h, int64_t w, int64_t c, const float* dy,
                                    int64_t o, int64_t oh, int64_t ow, const int64_t pad[2], float* dw, bool dw_ohwi) {
  winograd_weight_grad(x, n, h, w, c, dy, o, pad, oh, ow, dw, dw_ohwi);
}

}  // namespace kiln::cpu
