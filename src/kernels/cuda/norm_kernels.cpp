// Eager CUDA kernels of native_batch_norm, batch_norm_relu, native_layer_norm and
// native_group_norm, as generated CUDA C++ (NVRTC).
//
// The CPU kernels (src/kernels/cpu/norm_kernels.cpp, norm_loops.h) are the reference: the same
// dtype rules (statistics in float for 16-bit inputs, parameters of any floating dtype read in
// opmath precision), the same rounding of the affine maps (the per-channel scale and shift and
// y = x * scale + shift rounded once with an explicit fma where the CPU build has one, so that
// batch_norm_relu_backward_recompute reproduces this forward's relu bit for bit), the unbiased
// variance in the running statistics, and the input's layout kept (channels-last stays).
//
// batch_norm runs three kernels: per-split sums of a channel's values shifted by its first value
// (in double, so no cancellation), reading the input in its own layout (channel rows: a warp
// reads 32 adjacent channels; planes: a block reads one channel's runs); a per-channel finalize
// (mean, 1 / sqrt(var + eps), running statistics, scale and shift), deterministic because splits
// are added in order; and the elementwise apply. layer_norm and group_norm normalize contiguous
// rows (a row of the trailing dims, an (n, group) block): one block per row, two passes (mean,
// then squared deviations) in opmath precision with a fixed-order block reduction.
#include "kernels/cuda/norm_kernels.h"

#include <fmt/format.h>

#include <algorithm>
#include <limits>
#include <optional>
#include <tuple>

#include <cmath>

#include "kernels/cuda/jit.h"
#include "kernels/cuda/kernel_source.h"
#include "core/shape.h"
#include "core/tensor_factory.h"
#include "kiln/op_table.h"
#include "kiln/ops.h"

namespace kiln::cuda::detail {

// ---------------- shared helpers ----------------

std::optional<NcsView> ncs_view(const Tensor& t) {
  if (t.dim() < 2) return std::nullopt;
  NcsView v;
  v.n = t.sizes()[0];
  v.c = t.sizes()[1];
  v.sn = t.strides()[0];
  v.sc = t.strides()[1];
  v.s = 1;
  v.ss = 1;
  bool first = true;
  int64_t expected = 0;
  for (int64_t d = t.dim() - 1; d >= 2; --d) {
    v.s *= t.sizes()[d];
    if (t.sizes()[d] == 1) continue;
    if (first) {
      v.ss = t.strides()[d];
      expected = v.ss;
      first = false;
    }
    if (t.strides()[d] != expected) return std::nullopt;
    expected *= t.sizes()[d];
  }
  return v;
}

namespace {

// norm_loops.h channel_row_stride: channels adjacent and all (n, spatial) positions one uniform
// stride apart.
bool has_channel_rows(const Tensor& t) {
  if (t.dim() < 2 || (t.sizes()[1] > 1 && t.strides()[1] != 1)) return false;
  bool started = false;
  int64_t expected = 0;
  for (int64_t d = t.dim() - 1; d >= 0; --d) {
    if (d == 1 || t.sizes()[d] == 1) continue;
    if (!started) {
      expected = t.strides()[d];
      started = true;
    }
    if (t.strides()[d] != expected) return false;
    expected *= t.sizes()[d];
  }
  return true;
}

}  // namespace

bool batch_norm_reads_rows(const Tensor& x, bool prefer_rows) {
  const bool rows = has_channel_rows(x);
  return prefer_rows ? rows || !x.is_contiguous() : rows && !x.is_contiguous();
}

bool batch_norm_prefers_rows(const Tensor& out) { return has_channel_rows(out) && !out.is_contiguous(); }

bool norm_uses_fma() {
#if defined(__FMA__) || defined(__aarch64__)
  return true;
#else
  return false;
#endif
}

std::string norm_header(DType dtype, bool i32) {
  std::string src = pool_norm_preamble();
  const char* acc = cuda_opmath_type(dtype);
  src += fmt::format(
      "using T = {0};\nusing Acc = kp::opmath<T>;\nusing I = {1};\n"
      "__forceinline__ Acc affine(Acc x, Acc scale, Acc shift) {{ return {2}; }}\n"
      "__forceinline__ Acc affine_shift(Acc mean, Acc scale, Acc bias) {{ return {3}; }}\n",
      cuda_type(dtype), i32 ? "int" : "long long",
      norm_uses_fma() ? fmt::format("{}(x, scale, shift)", std::string(acc) == "float" ? "fmaf" : "fma")
                      : std::string("x * scale + shift"),
      norm_uses_fma() ? fmt::format("{}(-mean, scale, bias)", std::string(acc) == "float" ? "fmaf" : "fma")
                      : std::string("bias - mean * scale"));
  src += R"(
template <class V> __forceinline__ V imin(V a, V b) { return a < b ? a : b; }
// The sum of v over the block, the same bits in every thread (fixed order). `shared` holds 32.
template <class V> __device__ V block_sum(V v, V* shared) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  __syncthreads();
  if (threadIdx.x % 32 == 0) shared[threadIdx.x / 32] = v;
  __syncthreads();
  V t = 0;
  for (int w = 0; w < (int)(blockDim.x / 32); ++w) t += shared[w];
  return t;
}
)";
  return src;
}

namespace {

constexpr int kBlock = 256;

// ---------------- generated sources ----------------


constexpr const char* kStatsBody = R"(
struct Params {
  const char* x;
  double* partial;  // [split][2][C]: sum(x - k), sum((x - k)^2), k the channel's first value
  long long n, c, s, sn, sc, ss;
  long long per_split;  // rows (or a channel's values) per split
};
// Channel rows: 32 channels x 8 rows per block (threadIdx.x = row * 32 + channel); blockIdx.x
// runs over channel tiles, then splits.
extern "C" __global__ void __launch_bounds__(256) kiln_bn_stats_rows(Params p) {
  __shared__ double s1s[8][33], s2s[8][33];
  const I C = p.c, S = p.s, R = (I)p.n * (I)p.s;
  const I tiles = (C + 31) / 32;
  const I tile = (I)blockIdx.x % tiles, split = (I)blockIdx.x / tiles;
  const int tx = threadIdx.x % 32, ty = threadIdx.x / 32;
  const I c = tile * 32 + tx;
  const I r0 = split * (I)p.per_split, r1 = imin<I>(r0 + (I)p.per_split, R);
  const T* x = reinterpret_cast<const T*>(p.x);
  double s1 = 0, s2 = 0;
  if (c < C) {
    const T* xc = x + c * (I)p.sc;
    const double k = static_cast<double>(static_cast<Acc>(xc[0]));
    const bool uniform = p.sn == p.s * p.ss;
    for (I r = r0 + ty; r < r1; r += 8) {
      I off;
      if (uniform) off = r * (I)p.ss;
      else { const I n = r / S; off = n * (I)p.sn + (r - n * S) * (I)p.ss; }
      const double d = static_cast<double>(static_cast<Acc>(xc[off])) - k;
      s1 += d;
      s2 += d * d;
    }
  }
  s1s[ty][tx] = s1;
  s2s[ty][tx] = s2;
  __syncthreads();
  if (ty == 0 && c < C) {
    for (int j = 1; j < 8; ++j) { s1 += s1s[j][tx]; s2 += s2s[j][tx]; }
    p.partial[split * 2 * C + c] = s1;
    p.partial[(split * 2 + 1) * C + c] = s2;
  }
}
// Planes: blockIdx.x runs over channels, then splits of a channel's N * S values.
extern "C" __global__ void __launch_bounds__(256) kiln_bn_stats_planar(Params p) {
  __shared__ double shared[32];
  const I C = p.c, S = p.s, count = (I)p.n * (I)p.s;
  const I c = (I)blockIdx.x % C, split = (I)blockIdx.x / C;
  const I j0 = split * (I)p.per_split, j1 = imin<I>(j0 + (I)p.per_split, count);
  const T* xc = reinterpret_cast<const T*>(p.x) + c * (I)p.sc;
  const double k = static_cast<double>(static_cast<Acc>(xc[0]));
  double s1 = 0, s2 = 0;
  for (I j = j0 + threadIdx.x; j < j1; j += blockDim.x) {
    const I n = j / S;
    const double d = static_cast<double>(static_cast<Acc>(xc[n * (I)p.sn + (j - n * S) * (I)p.ss])) - k;
    s1 += d;
    s2 += d * d;
  }
  s1 = block_sum(s1, shared);
  s2 = block_sum(s2, shared);
  if (threadIdx.x == 0) {
    p.partial[split * 2 * C + c] = s1;
    p.partial[(split * 2 + 1) * C + c] = s2;
  }
}
)";

constexpr const char* kFinalizeBody = R"(
struct Params {
  const char* x;  // the channel's first value is the sums' shift
  const double* partial;
  const Acc* weight;  // null: 1
  const Acc* bias;    // null: 0
  char* running_mean;
  char* running_var;
  Acc* save_mean;
  Acc* save_invstd;
  Acc* coef;  // [2][C]: scale, shift
  long long c, sc, count, splits, training, rm_stride, rv_stride;
  double momentum, eps;
};
extern "C" __global__ void __launch_bounds__(256) kiln_bn_finalize(Params p) {
  const long long C = p.c;
  for (long long c = blockIdx.x * (long long)blockDim.x + threadIdx.x; c < C; c += (long long)gridDim.x * blockDim.x) {
    Acc mean, invstd;
    if (p.training) {
      double m = 0, var = 0;
      if (p.count > 0) {
        double s1 = 0, s2 = 0;
        for (long long j = 0; j < p.splits; ++j) {
          s1 += p.partial[j * 2 * C + c];
          s2 += p.partial[(j * 2 + 1) * C + c];
        }
        const double n = static_cast<double>(p.count);
        const double k = static_cast<double>(static_cast<Acc>(reinterpret_cast<const T*>(p.x)[c * p.sc]));
        m = k + s1 / n;
        var = (s2 - s1 * s1 / n) / n;
        if (var < 0) var = 0;
      }
      mean = static_cast<Acc>(m);
      invstd = static_cast<Acc>(1.0 / sqrt(var + p.eps));
      // Running statistics take the unbiased batch variance, as in PyTorch.
      if constexpr (kRunningMean) {
        if (p.count > 0) {
          RM* rm = reinterpret_cast<RM*>(p.running_mean) + c * p.rm_stride;
          *rm = kp::convert<RM>((1 - p.momentum) * kp::convert<double>(*rm) + p.momentum * static_cast<double>(mean));
        }
      }
      if constexpr (kRunningVar) {
        if (p.count > 0) {
          RV* rv = reinterpret_cast<RV*>(p.running_var) + c * p.rv_stride;
          const double unbias = p.count > 1 ? static_cast<double>(p.count) / static_cast<double>(p.count - 1) : 1.0;
          *rv = kp::convert<RV>((1 - p.momentum) * kp::convert<double>(*rv) + p.momentum * var * unbias);
        }
      }
    } else {
      if constexpr (kRunningMean && kRunningVar) {
        mean = static_cast<Acc>(kp::convert<double>(reinterpret_cast<const RM*>(p.running_mean)[c * p.rm_stride]));
        invstd = static_cast<Acc>(
            1.0 / sqrt(kp::convert<double>(reinterpret_cast<const RV*>(p.running_var)[c * p.rv_stride]) + p.eps));
      } else {
        mean = Acc(0);
        invstd = Acc(1);
      }
    }
    p.save_mean[c] = mean;
    p.save_invstd[c] = invstd;
    const Acc w = p.weight ? p.weight[c] : Acc(1), b = p.bias ? p.bias[c] : Acc(0);
    const Acc scale = invstd * w;
    p.coef[c] = scale;
    p.coef[C + c] = affine_shift(mean, scale, b);
  }
}
)";

constexpr const char* kApplyBody = R"(
struct Params {
  const char* x;
  char* y;
  const Acc* coef;  // [2][C]: scale, shift
  long long n, c, s;
  long long xs[3], ys[3];  // element strides of (n, c, s)
  long long total;
};
extern "C" __global__ void __launch_bounds__(256) kiln_bn_apply(Params p) {
  const I C = p.c, S = p.s;
  const T* x = reinterpret_cast<const T*>(p.x);
  T* y = reinterpret_cast<T*>(p.y);
  KP_GRID_LOOP(I, i, (I)p.total) {
    I n, c, s;
    if constexpr (kRowsOrder) { c = i % C; const I r = i / C; n = r / S; s = r - n * S; }
    else { s = i % S; const I t = i / S; c = t % C; n = t / C; }
    const T v = x[n * (I)p.xs[0] + c * (I)p.xs[1] + s * (I)p.xs[2]];
    T out = static_cast<T>(affine(static_cast<Acc>(v), p.coef[c], p.coef[C + c]));
    if constexpr (kRelu) {
      if (static_cast<Acc>(out) < Acc(0)) out = static_cast<T>(Acc(0));  // after rounding; NaN stays NaN
    }
    y[n * (I)p.ys[0] + c * (I)p.ys[1] + s * (I)p.ys[2]] = out;
  }
}
)";

constexpr const char* kRowNormBody = R"(
struct Params {
  const char* x;
  char* y;
  const Acc* weight;  // null: 1 (layer_norm: per element of a row; group_norm: per channel)
  const Acc* bias;    // null: 0
  Acc* mean;
  Acc* rstd;
  long long row_size, plane, per_group, groups;
  double eps;
};
// One block per row of row_size contiguous values.
extern "C" __global__ void __launch_bounds__(256) kiln_row_norm(Params p) {
  __shared__ Acc shared[32];
  const long long row = blockIdx.x;
  const long long size = p.row_size;
  const T* x = reinterpret_cast<const T*>(p.x) + row * size;
  T* y = reinterpret_cast<T*>(p.y) + row * size;
  Acc sum = 0;
  for (long long j = threadIdx.x; j < size; j += blockDim.x) sum += static_cast<Acc>(x[j]);
  sum = block_sum(sum, shared);
  const Acc mean = size > 0 ? static_cast<Acc>(sum / static_cast<Acc>(size)) : Acc(0);
  Acc sq = 0;
  for (long long j = threadIdx.x; j < size; j += blockDim.x) {
    const Acc d = static_cast<Acc>(x[j]) - mean;
    sq += d * d;
  }
  sq = block_sum(sq, shared);
  const Acc var = size > 0 ? sq / static_cast<Acc>(size) : Acc(0);
  const Acc rstd = static_cast<Acc>(1.0 / sqrt(static_cast<double>(var) + p.eps));
  if (threadIdx.x == 0) {
    p.mean[row] = mean;
    p.rstd[row] = rstd;
  }
  if constexpr (!kGroup) {
    for (long long j = threadIdx.x; j < size; j += blockDim.x) {
      const Acc w = p.weight ? p.weight[j] : Acc(1), b = p.bias ? p.bias[j] : Acc(0);
      y[j] = static_cast<T>((static_cast<Acc>(x[j]) - mean) * rstd * w + b);
    }
  } else {
    const long long first = (row % p.groups) * p.per_group;
    for (long long j = threadIdx.x; j < size; j += blockDim.x) {
      const long long ch = first + j / p.plane;
      const Acc scale = rstd * (p.weight ? p.weight[ch] : Acc(1));
      const Acc shift = (p.bias ? p.bias[ch] : Acc(0)) - mean * scale;
      y[j] = static_cast<T>(affine(static_cast<Acc>(x[j]), scale, shift));
    }
  }
}
)";

}  // namespace

std::string batch_norm_stats_source(DType dtype, bool i32) { return norm_header(dtype, i32) + kStatsBody; }

std::string batch_norm_finalize_source(DType dtype, std::optional<DType> running_mean,
                                       std::optional<DType> running_var) {
  std::string src = norm_header(dtype, false);
  src += fmt::format("using RM = {};\nusing RV = {};\nconstexpr bool kRunningMean = {};\nconstexpr bool kRunningVar = {};\n",
                     running_mean ? cuda_type(*running_mean) : "float", running_var ? cuda_type(*running_var) : "float",
                     running_mean ? "true" : "false", running_var ? "true" : "false");
  return src + kFinalizeBody;
}

std::string batch_norm_apply_source(DType dtype, bool i32, bool relu, bool rows_order) {
  std::string src = norm_header(dtype, i32);
  src += fmt::format("constexpr bool kRelu = {};\nconstexpr bool kRowsOrder = {};\n", relu ? "true" : "false",
                     rows_order ? "true" : "false");
  return src + kApplyBody;
}

std::string row_norm_source(DType dtype, bool group) {
  return norm_header(dtype, false) + fmt::format("constexpr bool kGroup = {};\n", group ? "true" : "false") +
         kRowNormBody;
}

namespace {

// ---------------- host side ----------------

std::string dtype_key(DType t) { return std::to_string(static_cast<int>(t)); }

// An optional parameter as a contiguous device tensor of dtype `acc` (undefined stays undefined).
Tensor as_acc(const Tensor& t, DType acc) {
  if (!t.defined()) return t;
  return t.to(acc).contiguous();
}

const void* data_or_null(const Tensor& t) { return t.defined() ? t.impl().data() : nullptr; }

void check_on(const OpCall& call, const Tensor& t, const Tensor& like) {
  KILN_CHECK(!t.defined() || t.device() == like.device(), DeviceError,
             "[kiln::" + call.name() + "] expected all tensors on " + like.device().str() + ", but found one on " +
                 t.device().str() + ". Move them with .to(...).");
}

// A contiguous tensor of `out`'s sizes and dtype to write into when `out` cannot be written
// directly (not contiguous, or another dtype), copied back by finish().
struct Staged {
  Tensor& out;
  Tensor t;
  Staged(Tensor& o, DType dtype) : out(o) {
    t = out.is_contiguous() && out.dtype() == dtype ? out : kiln::detail::make_empty(out.sizes().vec(), dtype, out.device());
  }
  void finish() {
    if (!t.same(out)) out.copy_(t);
  }
};

struct StatsParams {
  const void* x;
  double* partial;
  long long n, c, s, sn, sc, ss;
  long long per_split;
};

struct FinalizeParams {
  const void* x;
  const double* partial;
  const void* weight;
  const void* bias;
  void* running_mean;
  void* running_var;
  void* save_mean;
  void* save_invstd;
  void* coef;
  long long c, sc, count, splits, training, rm_stride, rv_stride;
  double momentum, eps;
};

struct ApplyParams {
  const void* x;
  void* y;
  const void* coef;
  long long n, c, s;
  long long xs[3], ys[3];
  long long total;
};

struct RowNormParams {
  const void* x;
  void* y;
  const void* weight;
  const void* bias;
  void* mean;
  void* rstd;
  long long row_size, plane, per_group, groups;
  double eps;
};

int64_t ncs_extent(const NcsView& v) {
  return std::max<int64_t>({v.n * v.c * v.s, (v.n - 1) * v.sn + (v.c - 1) * v.sc + (v.s - 1) * v.ss + 1});
}

void batch_norm_forward(const OpCall& call, std::span<Tensor> outs, bool relu) {
  Tensor x = call.input(0);
  Tensor& out = outs[0];
  for (size_t i = 1; i < 5; ++i) check_on(call, call.input(i), out);
  check_on(call, x, out);
  const bool training = call.bool_attr(0);
  const double momentum = call.double_attr(1), eps = call.double_attr(2);
  const DType dt = x.dtype(), acc = opmath_dtype(dt);
  const int device = out.device().index;
  auto xv = ncs_view(x);
  if (!xv) {
    x = x.contiguous();
    xv = ncs_view(x);
  }
  const int64_t channels = xv->c;
  const int64_t count = xv->n * xv->s;
  const bool rows = xv->sc < xv->ss || xv->s == 1;  // which stats kernel reads x in memory order
  const bool i32 = fits_int32(std::max(ncs_extent(*xv), max_offset(out)) * 2);
  DeviceGuard guard(device);
  cudaStream_t stream = current_stream(device);
  const cudaDeviceProp& props = properties(device);
  const int64_t target_blocks = int64_t{props.multiProcessorCount} * 4;

  // Pass 1: per-split shifted sums (training only).
  int64_t splits = 0;
  Tensor partial;
  if (training && count > 0 && channels > 0) {
    StatsParams sp{x.impl().data(), nullptr, xv->n, xv->c, xv->s, xv->sn, xv->sc, xv->ss, 0};
    const std::string key = "bn_stats|" + dtype_key(dt) + (i32 ? "|32" : "|64");
    // Blocks: channel tiles (rows) or channels (planes), times splits of the values.
    const int64_t units = rows ? (channels + 31) / 32 : channels;
    const int64_t per_block = rows ? 64 : 1024;  // values a block should at least sum
    splits = std::clamp<int64_t>(target_blocks / units, 1, std::max<int64_t>(1, (count + per_block - 1) / per_block));
    sp.per_split = (count + splits - 1) / splits;
    splits = (count + sp.per_split - 1) / sp.per_split;
    KILN_CHECK(units * splits <= std::numeric_limits<int32_t>::max(), ShapeError,
               "[kiln::" + call.name() + "] too many channels for the CUDA kernel. Split the input.");
    partial = kiln::detail::make_empty({splits * 2 * channels}, DType::float64, out.device());
    sp.partial = static_cast<double*>(partial.impl().data());
    JitFunction f = jit_function(device, key, rows ? "kiln_bn_stats_rows" : "kiln_bn_stats_planar",
                                 [&] { return batch_norm_stats_source(dt, i32); });
    void* args[] = {&sp};
    launch(f, static_cast<unsigned>(units * splits), kBlock, 0, stream, args);
  }

  // Per channel: statistics, running statistics, the affine map.
  const Tensor& running_mean = call.input(3);
  const Tensor& running_var = call.input(4);
  const Tensor weight = as_acc(call.input(1), acc), bias = as_acc(call.input(2), acc);
  Staged mean_out(outs[1], acc), invstd_out(outs[2], acc);
  Tensor coef = kiln::detail::make_empty({2 * std::max<int64_t>(channels, 1)}, acc, out.device());
  if (channels > 0) {
    FinalizeParams fp{};
    fp.x = x.impl().data();
    fp.partial = partial.defined() ? static_cast<const double*>(partial.impl().data()) : nullptr;
    fp.weight = data_or_null(weight);
    fp.bias = data_or_null(bias);
    fp.running_mean = running_mean.defined() ? running_mean.impl().data() : nullptr;
    fp.running_var = running_var.defined() ? running_var.impl().data() : nullptr;
    fp.save_mean = mean_out.t.impl().data();
    fp.save_invstd = invstd_out.t.impl().data();
    fp.coef = coef.impl().data();
    fp.c = channels;
    fp.sc = xv->sc;
    fp.count = training ? (splits > 0 ? count : 0) : count;
    fp.splits = splits;
    fp.training = training;
    fp.rm_stride = running_mean.defined() ? running_mean.strides()[0] : 0;
    fp.rv_stride = running_var.defined() ? running_var.strides()[0] : 0;
    fp.momentum = momentum;
    fp.eps = eps;
    std::optional<DType> rm_t, rv_t;
    if (running_mean.defined()) rm_t = running_mean.dtype();
    if (running_var.defined()) rv_t = running_var.dtype();
    const std::string key = "bn_finalize|" + dtype_key(dt) + "|" + (rm_t ? dtype_key(*rm_t) : "-") + "|" +
                            (rv_t ? dtype_key(*rv_t) : "-");
    JitFunction f = jit_function(device, key, "kiln_bn_finalize",
                                 [&] { return batch_norm_finalize_source(dt, rm_t, rv_t); });
    void* args[] = {&fp};
    launch(f, grid_for(device, channels, kBlock), kBlock, 0, stream, args);
  }
  mean_out.finish();
  invstd_out.finish();

  // Pass 2: the output, in its own layout.
  if (out.numel() == 0) return;
  auto yv = ncs_view(out);
  Tensor y = out;
  if (!yv) {
    y = kiln::detail::make_empty_strided(out.sizes().vec(), kiln::detail::strides_following(x.sizes(), x.strides(), x.sizes()),
                                         dt, out.device());
    yv = ncs_view(y);
  }
  const bool rows_order = yv->sc < yv->ss || yv->s == 1;
  ApplyParams ap{x.impl().data(), y.impl().data(), coef.impl().data(), xv->n, xv->c, xv->s,
                 {xv->sn, xv->sc, xv->ss}, {yv->sn, yv->sc, yv->ss}, out.numel()};
  const std::string key = fmt::format("bn_apply|{}|{}|{}|{}", dtype_key(dt), i32 ? 32 : 64, relu ? "relu" : "-",
                                      rows_order ? "rows" : "planes");
  JitFunction f = jit_function(device, key, "kiln_bn_apply",
                               [&] { return batch_norm_apply_source(dt, i32, relu, rows_order); });
  void* args[] = {&ap};
  launch(f, grid_for(device, ap.total, kBlock), kBlock, 0, stream, args);
  if (!y.same(out)) out.copy_(y);
}

void batch_norm_kernel(const OpCall& call, std::span<Tensor> outs) { batch_norm_forward(call, outs, false); }
void batch_norm_relu_kernel(const OpCall& call, std::span<Tensor> outs) { batch_norm_forward(call, outs, true); }

// layer_norm (group = false) and group_norm: rows of row_size contiguous values.
void row_norm(const OpCall& call, std::span<Tensor> outs, bool group) {
  const Tensor x = call.input(0).contiguous();
  Tensor& out = outs[0];
  check_on(call, call.input(0), out);
  check_on(call, call.input(1), out);
  check_on(call, call.input(2), out);
  const DType dt = x.dtype(), acc = opmath_dtype(dt);
  const int device = out.device().index;
  RowNormParams p{};
  int64_t rows = 0;
  if (group) {
    const int64_t n = x.sizes()[0], channels = x.sizes()[1], groups = call.int_attr(0);
    p.plane = n * channels == 0 ? 0 : x.numel() / (n * channels);
    p.per_group = channels / groups;
    p.groups = groups;
    p.row_size = p.per_group * p.plane;
    rows = n * groups;
    p.eps = call.double_attr(1);
  } else {
    p.row_size = 1;
    for (int64_t d : call.ints_attr(0)) p.row_size *= d;
    rows = outs[1].numel();
    p.plane = 1;
    p.per_group = 1;
    p.groups = 1;
    p.eps = call.double_attr(1);
  }
  const Tensor weight = as_acc(call.input(1), acc), bias = as_acc(call.input(2), acc);
  Staged y(out, dt), mean(outs[1], acc), rstd(outs[2], acc);
  if (rows > 0) {
    p.x = x.impl().data();
    p.y = y.t.impl().data();
    p.weight = data_or_null(weight);
    p.bias = data_or_null(bias);
    p.mean = mean.t.impl().data();
    p.rstd = rstd.t.impl().data();
    const std::string key = std::string("row_norm|") + dtype_key(dt) + (group ? "|group" : "|layer");
    JitFunction f = jit_function(device, key, "kiln_row_norm", [&] { return row_norm_source(dt, group); });
    KILN_CHECK(rows <= std::numeric_limits<int32_t>::max(), ShapeError,
               "[kiln::" + call.name() + "] at most 2^31 - 1 rows on CUDA. Split the input.");
    DeviceGuard guard(device);
    void* args[] = {&p};
    launch(f, static_cast<unsigned>(rows), kBlock, 0, current_stream(device), args);
  }
  y.finish();
  mean.finish();
  rstd.finish();
}

void layer_norm_kernel(const OpCall& call, std::span<Tensor> outs) { row_norm(call, outs, false); }
void group_norm_kernel(const OpCall& call, std::span<Tensor> outs) { row_norm(call, outs, true); }

[[maybe_unused]] const bool registered = [] {
  register_kernel("native_batch_norm", DeviceType::cuda, batch_norm_kernel);
  register_kernel("batch_norm_relu", DeviceType::cuda, batch_norm_relu_kernel);
  register_kernel("native_layer_norm", DeviceType::cuda, layer_norm_kernel);
  register_kernel("native_group_norm", DeviceType::cuda, group_norm_kernel);
  return true;
}();

}  // namespace

}  // namespace kiln::cuda::detail
