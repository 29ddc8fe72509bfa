// Eager CUDA kernels of native_batch_norm_backward, batch_norm_relu_backward,
// batch_norm_relu_backward_recompute, native_layer_norm_backward and native_group_norm_backward,
// as generated CUDA C++ (NVRTC).
//
// The CPU kernels (src/kernels/cpu/norm_backward_kernels.cpp) are the reference, formulas (aten's)
// and their groupings included: batch norm's grad_input is dy * a + (x * b + c) when the CPU reads
// channel rows and (dy - mean(dy) - (x - mean) * k) * invstd * w when it reads planes; the relu
// mask is where(r <= threshold, fill, dy) with r read, or recomputed from x with the forward's
// affine map and fma, bit for bit batch_norm_relu's result. Batch norm runs a per-split reduction
// of sum(dy) and sum(dy * (x - mean)) (double accumulation, in x's memory order), a per-channel
// finalize (coefficients, weight and bias gradients; splits added in order, so deterministic) and
// the elementwise grad_input. layer_norm and group_norm take one block per row, as the forward.
#include <fmt/format.h>

#include <algorithm>
#include <limits>
#include <optional>
#include <tuple>

#include "kernels/cuda/jit.h"
#include "kernels/cuda/kernel_source.h"
#include "kernels/cuda/norm_kernels.h"
#include "core/shape.h"
#include "core/tensor_factory.h"
#include "kiln/op_table.h"
#include "kiln/ops.h"

namespace kiln::cuda::detail {

namespace {

constexpr int kBlock = 256;


// ---------------- batch norm ----------------

// The operands both passes read; the mask helpers.
constexpr const char* kBatchNormOperands = R"(
struct Operands {
  const char* x;
  const char* g;
  const char* r;           // the relu's result (kMask == 1)
  const Acc* mean;
  const Acc* invstd;
  const Acc* weight;       // null: 1
  const Acc* bias;         // null: 0 (kMask == 2)
  const T* threshold;      // null: 0
  const T* fill;           // null: 0
  long long n, c, s;
  long long xs[3], gs[3], rs[3];  // element strides of (n, c, s)
};
// The forward's per-channel affine map (batch_norm_relu's finalize computes it the same way).
struct ForwardMap { Acc scale, shift; };
__forceinline__ ForwardMap forward_map(const Operands& o, I c) {
  ForwardMap f;
  f.scale = o.invstd[c] * (o.weight ? o.weight[c] : Acc(1));
  f.shift = affine_shift(o.mean[c], f.scale, o.bias ? o.bias[c] : Acc(0));
  return f;
}
// dy in opmath precision through the relu's mask: where(r <= threshold, fill, dy).
__forceinline__ Acc masked(const Operands& o, I n, I c, I s, T gv, T xv, const ForwardMap& f, Acc th, Acc fill) {
  const Acc g = static_cast<Acc>(gv);
  if constexpr (kMask == 1) {
    const Acc r = static_cast<Acc>(reinterpret_cast<const T*>(o.r)[n * (I)o.rs[0] + c * (I)o.rs[1] + s * (I)o.rs[2]]);
    return r <= th ? fill : g;
  } else if constexpr (kMask == 2) {
    T y = static_cast<T>(affine(static_cast<Acc>(xv), f.scale, f.shift));
    if (static_cast<Acc>(y) < Acc(0)) y = static_cast<T>(Acc(0));
    return static_cast<Acc>(y) <= th ? fill : g;
  }
  return g;
}
__forceinline__ Acc threshold_of(const Operands& o) { return o.threshold ? static_cast<Acc>(*o.threshold) : Acc(0); }
__forceinline__ Acc fill_of(const Operands& o) { return o.fill ? static_cast<Acc>(*o.fill) : Acc(0); }
)";

constexpr const char* kReduceBody = R"(
struct Params {
  Operands o;
  double* partial;  // [split][2][C]: sum(dy), sum(dy * (x - mean))
  long long per_split;
};
__forceinline__ void element(const Operands& o, I n, I c, I s, Acc m, const ForwardMap& f, Acc th, Acc fill,
                             double& s1, double& s2) {
  const T xv = reinterpret_cast<const T*>(o.x)[n * (I)o.xs[0] + c * (I)o.xs[1] + s * (I)o.xs[2]];
  const T gv = reinterpret_cast<const T*>(o.g)[n * (I)o.gs[0] + c * (I)o.gs[1] + s * (I)o.gs[2]];
  const Acc g = masked(o, n, c, s, gv, xv, f, th, fill);
  s1 += static_cast<double>(g);
  s2 += static_cast<double>(g * (static_cast<Acc>(xv) - m));
}
// Channel rows: threadIdx.x = row * 32 + channel; blockIdx.x runs over channel tiles, then splits.
extern "C" __global__ void __launch_bounds__(256) kiln_bnb_reduce_rows(Params p) {
  __shared__ double s1s[8][33], s2s[8][33];
  const Operands& o = p.o;
  const I C = o.c, S = o.s, R = (I)o.n * (I)o.s;
  const I tiles = (C + 31) / 32;
  const I tile = (I)blockIdx.x % tiles, split = (I)blockIdx.x / tiles;
  const int tx = threadIdx.x % 32, ty = threadIdx.x / 32;
  const I c = tile * 32 + tx;
  const I r0 = split * (I)p.per_split, r1 = imin<I>(r0 + (I)p.per_split, R);
  double s1 = 0, s2 = 0;
  if (c < C) {
    const Acc m = o.mean[c], th = threshold_of(o), fill = fill_of(o);
    ForwardMap f{};
    if constexpr (kMask == 2) f = forward_map(o, c);
    for (I r = r0 + ty; r < r1; r += 8) {
      const I n = r / S;
      element(o, n, c, r - n * S, m, f, th, fill, s1, s2);
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
extern "C" __global__ void __launch_bounds__(256) kiln_bnb_reduce_planar(Params p) {
  __shared__ double shared[32];
  const Operands& o = p.o;
  const I C = o.c, S = o.s, count = (I)o.n * (I)o.s;
  const I c = (I)blockIdx.x % C, split = (I)blockIdx.x / C;
  const I j0 = split * (I)p.per_split, j1 = imin<I>(j0 + (I)p.per_split, count);
  const Acc m = o.mean[c], th = threshold_of(o), fill = fill_of(o);
  ForwardMap f{};
  if constexpr (kMask == 2) f = forward_map(o, c);
  double s1 = 0, s2 = 0;
  for (I j = j0 + threadIdx.x; j < j1; j += blockDim.x) {
    const I n = j / S;
    element(o, n, c, j - n * S, m, f, th, fill, s1, s2);
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
  const double* partial;  // null: no sums (evaluation without parameter gradients)
  const Acc* mean;
  const Acc* invstd;
  const Acc* weight;  // null: 1
  Acc* coef;          // [3][C]: a, b, c of the grad_input formula
  char* grad_weight;  // PT, null when not asked
  char* grad_bias;
  long long c, count, splits, train, rows_formula;
};
extern "C" __global__ void __launch_bounds__(256) kiln_bnb_finalize(Params p) {
  const long long C = p.c;
  for (long long c = blockIdx.x * (long long)blockDim.x + threadIdx.x; c < C; c += (long long)gridDim.x * blockDim.x) {
    double sum_dy = 0, dot = 0;
    if (p.partial) {
      for (long long j = 0; j < p.splits; ++j) {
        sum_dy += p.partial[j * 2 * C + c];
        dot += p.partial[(j * 2 + 1) * C + c];
      }
    }
    const Acc invstd = p.invstd[c];
    const Acc scale = invstd * (p.weight ? p.weight[c] : Acc(1));
    const bool centered = p.train && p.count > 0;
    const Acc k = centered ? static_cast<Acc>(dot / static_cast<double>(p.count)) * invstd * invstd : Acc(0);
    const Acc shift = centered ? static_cast<Acc>(sum_dy / static_cast<double>(p.count)) : Acc(0);
    if (p.rows_formula) {  // (dy - shift - (x - mean) * k) * scale regrouped in double as dy * a + (x * b + c)
      const double sc = scale, kc = k;
      p.coef[c] = scale;
      p.coef[C + c] = static_cast<Acc>(-kc * sc);
      p.coef[2 * C + c] = static_cast<Acc>((static_cast<double>(p.mean[c]) * kc - static_cast<double>(shift)) * sc);
    } else {
      p.coef[c] = scale;
      p.coef[C + c] = k;
      p.coef[2 * C + c] = shift;
    }
    if (p.grad_weight) reinterpret_cast<PT*>(p.grad_weight)[c] = kp::convert<PT>(static_cast<Acc>(dot * static_cast<double>(invstd)));
    if (p.grad_bias) reinterpret_cast<PT*>(p.grad_bias)[c] = kp::convert<PT>(sum_dy);
  }
}
)";

constexpr const char* kApplyBody = R"(
struct Params {
  Operands o;
  const Acc* coef;  // [3][C]
  char* dx;
  long long ds[3];
  long long total;
};
extern "C" __global__ void __launch_bounds__(256) kiln_bnb_apply(Params p) {
  const Operands& o = p.o;
  const I C = o.c, S = o.s;
  const Acc th = threshold_of(o), fill = fill_of(o);
  KP_GRID_LOOP(I, i, (I)p.total) {
    I n, c, s;
    if constexpr (kRowsOrder) { c = i % C; const I r = i / C; n = r / S; s = r - n * S; }
    else { s = i % S; const I t = i / S; c = t % C; n = t / C; }
    ForwardMap f{};
    if constexpr (kMask == 2) f = forward_map(o, c);
    const T xv = reinterpret_cast<const T*>(o.x)[n * (I)o.xs[0] + c * (I)o.xs[1] + s * (I)o.xs[2]];
    const T gv = reinterpret_cast<const T*>(o.g)[n * (I)o.gs[0] + c * (I)o.gs[1] + s * (I)o.gs[2]];
    const Acc g = masked(o, n, c, s, gv, xv, f, th, fill);
    const Acc a = p.coef[c], b = p.coef[C + c], cc = p.coef[2 * C + c];
    Acc v;
    if constexpr (kRowsFormula) v = g * a + (static_cast<Acc>(xv) * b + cc);
    else if constexpr (kTrain) v = (g - cc - (static_cast<Acc>(xv) - o.mean[c]) * b) * a;
    else v = g * a;
    reinterpret_cast<T*>(p.dx)[n * (I)p.ds[0] + c * (I)p.ds[1] + s * (I)p.ds[2]] = static_cast<T>(v);
  }
}
)";

// ---------------- layer norm and group norm ----------------

constexpr const char* kLayerNormBody = R"(
struct Params {
  const char* x;
  const char* g;
  const Acc* mean;
  const Acc* rstd;
  const Acc* weight;  // null: 1
  char* dx;
  Acc* partial;       // [split][2][row_size]: weight and bias gradient sums
  char* grad_weight;  // PT
  char* grad_bias;
  long long rows, row_size, per_split, splits;
};
// One block per row: ds = sum(dy * w * x), db = sum(dy * w); dx = rs * dy * w + b * x + c.
extern "C" __global__ void __launch_bounds__(256) kiln_ln_backward(Params p) {
  __shared__ Acc shared[32];
  const long long row = blockIdx.x, size = p.row_size;
  const T* x = reinterpret_cast<const T*>(p.x) + row * size;
  const T* g = reinterpret_cast<const T*>(p.g) + row * size;
  Acc ds = 0, db = 0;
  for (long long j = threadIdx.x; j < size; j += blockDim.x) {
    const Acc gw = static_cast<Acc>(g[j]) * (p.weight ? p.weight[j] : Acc(1));
    ds += gw * static_cast<Acc>(x[j]);
    db += gw;
  }
  ds = block_sum(ds, shared);
  db = block_sum(db, shared);
  const Acc m = p.mean[row], rs = p.rstd[row];
  const Acc scale = Acc(1) / static_cast<Acc>(size);
  const Acc b = (db * m - ds) * rs * rs * rs * scale;
  const Acc c = -b * m - db * rs * scale;
  T* dx = reinterpret_cast<T*>(p.dx) + row * size;
  for (long long j = threadIdx.x; j < size; j += blockDim.x)
    dx[j] = static_cast<T>(rs * static_cast<Acc>(g[j]) * (p.weight ? p.weight[j] : Acc(1)) + b * static_cast<Acc>(x[j]) + c);
}
// Column sums over rows for the weight and bias gradients: threadIdx.x = row * 32 + column;
// blockIdx.x runs over column tiles, then splits of the rows.
extern "C" __global__ void __launch_bounds__(256) kiln_ln_param_partial(Params p) {
  __shared__ Acc sw_s[8][33], sb_s[8][33];
  const long long size = p.row_size;
  const long long tiles = (size + 31) / 32;
  const long long tile = blockIdx.x % tiles, split = blockIdx.x / tiles;
  const int tx = threadIdx.x % 32, ty = threadIdx.x / 32;
  const long long j = tile * 32 + tx;
  const long long r0 = split * p.per_split, r1 = imin<long long>(r0 + p.per_split, p.rows);
  Acc sw = 0, sb = 0;
  if (j < size) {
    for (long long r = r0 + ty; r < r1; r += 8) {
      const Acc g = static_cast<Acc>(reinterpret_cast<const T*>(p.g)[r * size + j]);
      const Acc x = static_cast<Acc>(reinterpret_cast<const T*>(p.x)[r * size + j]);
      sw += g * (x - p.mean[r]) * p.rstd[r];
      sb += g;
    }
  }
  sw_s[ty][tx] = sw;
  sb_s[ty][tx] = sb;
  __syncthreads();
  if (ty == 0 && j < size) {
    for (int k = 1; k < 8; ++k) { sw += sw_s[k][tx]; sb += sb_s[k][tx]; }
    p.partial[split * 2 * size + j] = sw;
    p.partial[(split * 2 + 1) * size + j] = sb;
  }
}
extern "C" __global__ void __launch_bounds__(256) kiln_ln_param_finalize(Params p) {
  const long long size = p.row_size;
  for (long long j = blockIdx.x * (long long)blockDim.x + threadIdx.x; j < size; j += (long long)gridDim.x * blockDim.x) {
    Acc sw = 0, sb = 0;
    for (long long k = 0; k < p.splits; ++k) {
      sw += p.partial[k * 2 * size + j];
      sb += p.partial[(k * 2 + 1) * size + j];
    }
    if (p.grad_weight) reinterpret_cast<PT*>(p.grad_weight)[j] = kp::convert<PT>(sw);
    if (p.grad_bias) reinterpret_cast<PT*>(p.grad_bias)[j] = kp::convert<PT>(sb);
  }
}
)";

constexpr const char* kGroupNormBody = R"(
struct Params {
  const char* x;
  const char* g;
  const Acc* mean;    // per (n, group)
  const Acc* rstd;
  const Acc* weight;  // null: 1
  char* dx;           // null: parameter gradients only
  Acc* ds;            // per (n, c): sum(dy * x)
  Acc* db;            // per (n, c): sum(dy)
  char* grad_weight;  // PT
  char* grad_bias;
  long long n, channels, plane, groups, per_group;
};
// One block per (n, group).
extern "C" __global__ void __launch_bounds__(256) kiln_gn_backward(Params p) {
  __shared__ Acc shared[32];
  const long long block = blockIdx.x;
  const long long i = block / p.groups, first = (block % p.groups) * p.per_group;
  Acc ds_g = 0, db_g = 0;
  for (long long c = first; c < first + p.per_group; ++c) {
    const long long at = (i * p.channels + c) * p.plane;
    const T* x = reinterpret_cast<const T*>(p.x) + at;
    const T* g = reinterpret_cast<const T*>(p.g) + at;
    Acc s = 0, d = 0;
    for (long long j = threadIdx.x; j < p.plane; j += blockDim.x) {
      const Acc gv = static_cast<Acc>(g[j]);
      s += gv * static_cast<Acc>(x[j]);
      d += gv;
    }
    s = block_sum(s, shared);
    d = block_sum(d, shared);
    if (threadIdx.x == 0) {
      p.ds[i * p.channels + c] = s;
      p.db[i * p.channels + c] = d;
    }
    const Acc w = p.weight ? p.weight[c] : Acc(1);
    ds_g += s * w;
    db_g += d * w;
  }
  if (!p.dx) return;
  const Acc m = p.mean[block], rs = p.rstd[block];
  const Acc scale = Acc(1) / static_cast<Acc>(p.per_group * p.plane);
  const Acc c2 = (db_g * m - ds_g) * rs * rs * rs * scale;
  const Acc c3 = -c2 * m - db_g * rs * scale;
  const long long size = p.per_group * p.plane, base = (i * p.channels + first) * p.plane;
  const T* x = reinterpret_cast<const T*>(p.x) + base;
  const T* g = reinterpret_cast<const T*>(p.g) + base;
  T* dx = reinterpret_cast<T*>(p.dx) + base;
  for (long long j = threadIdx.x; j < size; j += blockDim.x) {
    const long long c = first + j / p.plane;
    const Acc c1 = rs * (p.weight ? p.weight[c] : Acc(1));
    dx[j] = static_cast<T>(c1 * static_cast<Acc>(g[j]) + c2 * static_cast<Acc>(x[j]) + c3);
  }
}
// One thread per channel: the weight and bias gradients, summed over the batch in order.
extern "C" __global__ void __launch_bounds__(256) kiln_gn_param(Params p) {
  for (long long c = blockIdx.x * (long long)blockDim.x + threadIdx.x; c < p.channels; c += (long long)gridDim.x * blockDim.x) {
    Acc gw = 0, gb = 0;
    for (long long i = 0; i < p.n; ++i) {
      const long long block = i * p.groups + c / p.per_group;
      gw += (p.ds[i * p.channels + c] - p.db[i * p.channels + c] * p.mean[block]) * p.rstd[block];
      gb += p.db[i * p.channels + c];
    }
    if (p.grad_weight) reinterpret_cast<PT*>(p.grad_weight)[c] = kp::convert<PT>(gw);
    if (p.grad_bias) reinterpret_cast<PT*>(p.grad_bias)[c] = kp::convert<PT>(gb);
  }
}
)";

std::string mask_line(ReluMask mask) { return fmt::format("constexpr int kMask = {};\n", static_cast<int>(mask)); }

}  // namespace

std::string batch_norm_backward_reduce_source(DType dtype, bool i32, ReluMask mask) {
  return norm_header(dtype, i32) + mask_line(mask) + kBatchNormOperands + kReduceBody;
}

std::string batch_norm_backward_finalize_source(DType dtype, DType param_dtype) {
  return norm_header(dtype, false) + fmt::format("using PT = {};\n", cuda_type(param_dtype)) + kFinalizeBody;
}

std::string batch_norm_backward_apply_source(DType dtype, bool i32, ReluMask mask, bool rows_formula, bool train,
                                             bool rows_order) {
  return norm_header(dtype, i32) + mask_line(mask) +
         fmt::format("constexpr bool kRowsFormula = {};\nconstexpr bool kTrain = {};\nconstexpr bool kRowsOrder = {};\n",
                     rows_formula, train, rows_order) +
         kBatchNormOperands + kApplyBody;
}

std::string layer_norm_backward_source(DType dtype, DType param_dtype) {
  return norm_header(dtype, false) + fmt::format("using PT = {};\n", cuda_type(param_dtype)) + kLayerNormBody;
}

std::string group_norm_backward_source(DType dtype, DType param_dtype) {
  return norm_header(dtype, false) + fmt::format("using PT = {};\n", cuda_type(param_dtype)) + kGroupNormBody;
}

namespace {

// ---------------- host side ----------------

struct Operands {
  const void* x;
  const void* g;
  const void* r;
  const void* mean;
  const void* invstd;
  const void* weight;
  const void* bias;
  const void* threshold;
  const void* fill;
  long long n, c, s;
  long long xs[3], gs[3], rs[3];
};

struct ReduceParams {
  Operands o;
  double* partial;
  long long per_split;
};

struct FinalizeParams {
  const double* partial;
  const void* mean;
  const void* invstd;
  const void* weight;
  void* coef;
  void* grad_weight;
  void* grad_bias;
  long long c, count, splits, train, rows_formula;
};

struct ApplyParams {
  Operands o;
  const void* coef;
  void* dx;
  long long ds[3];
  long long total;
};

struct LayerNormParams {
  const void* x;
  const void* g;
  const void* mean;
  const void* rstd;
  const void* weight;
  void* dx;
  void* partial;
  void* grad_weight;
  void* grad_bias;
  long long rows, row_size, per_split, splits;
};

struct GroupNormParams {
  const void* x;
  const void* g;
  const void* mean;
  const void* rstd;
  const void* weight;
  void* dx;
  void* ds;
  void* db;
  void* grad_weight;
  void* grad_bias;
  long long n, channels, plane, groups, per_group;
};

std::string dtype_key(DType t) { return std::to_string(static_cast<int>(t)); }

const void* data_or_null(const Tensor& t) { return t.defined() ? t.impl().data() : nullptr; }

Tensor as_acc(const Tensor& t, DType acc) { return t.defined() ? t.to(acc).contiguous() : t; }

// 0-dim CPU operands (host scalars: the relu variants' threshold and fill) are read on the host
// or moved; everything else must be on the input's device.
void check_on(const OpCall& call, const Tensor& t, const Tensor& like) {
  KILN_CHECK(!t.defined() || t.device() == like.device() || (t.dim() == 0 && t.is_cpu()), DeviceError,
             "[kiln::" + call.name() + "] expected all tensors on " + like.device().str() + ", but found one on " +
                 t.device().str() + ". Move them with .to(...).");
}

bool mask_at(const OpCall& c, int i) { return c.ints_attr(1)[i] != 0; }

// `t` in dtype `dt` with mergeable spatial dims (a copy only when needed), and its view.
std::pair<Tensor, NcsView> viewable(const Tensor& t, DType dt) {
  Tensor v = t.dtype() == dt ? t : t.to(dt);
  auto view = ncs_view(v);
  if (!view) {
    v = v.contiguous();
    view = ncs_view(v);
  }
  return {v, *view};
}

// A contiguous tensor of out's sizes in `dtype` when out is not one, copied back by finish().
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

int64_t extent(const NcsView& v) {
  return std::max<int64_t>(v.n * v.c * v.s, (v.n - 1) * v.sn + (v.c - 1) * v.sc + (v.s - 1) * v.ss + 1);
}

// Inputs by op: grad_out, [result], input, weight?, save_mean, save_invstd, [bias?], [threshold?, fill?].
void batch_norm_backward(const OpCall& call, std::span<Tensor> outs, ReluMask mask) {
  const size_t x_at = mask == ReluMask::result ? 2 : 1;
  const Tensor& x_in = call.input(x_at);
  Tensor& dx_out = outs[0];
  for (size_t i = 0; i < call.inputs.size(); ++i) check_on(call, call.input(i), x_in);
  const DType dt = x_in.dtype(), acc = opmath_dtype(dt);
  const int device = x_in.device().index;
  const bool train = call.bool_attr(0);
  const bool need_input = mask_at(call, 0), need_weight = mask_at(call, 1), need_bias = mask_at(call, 2);

  auto [x, xv] = viewable(x_in, dt);
  auto [g, gv] = viewable(call.input(0), dt);
  Tensor r;
  NcsView rv{};
  if (mask == ReluMask::result) std::tie(r, rv) = viewable(call.input(1), dt);
  const Tensor weight = as_acc(call.input(x_at + 1), acc);
  const Tensor mean = as_acc(call.input(x_at + 2), acc);
  const Tensor invstd = as_acc(call.input(x_at + 3), acc);
  const Tensor bias = mask == ReluMask::recompute ? as_acc(call.input(5), acc) : Tensor();
  Tensor threshold, fill;
  if (mask != ReluMask::none) {
    // 0-dim operands, possibly host scalars (the kiln backend makes them): read on the device.
    if (call.input(6).defined()) threshold = call.input(6).to(x_in.device(), dt).contiguous();
    if (call.input(7).defined()) fill = call.input(7).to(x_in.device(), dt).contiguous();
  }
  const int64_t channels = xv.c, count = xv.n * xv.s;
  // The regrouped rows formula reads x even where its coefficient is 0 (x * -0 is NaN at +-inf):
  // evaluation takes the plain dy * scale.
  const bool rows_formula = train && batch_norm_reads_rows(x_in, batch_norm_prefers_rows(dx_out));
  const bool rows = xv.sc < xv.ss || xv.s == 1;
  int64_t largest = std::max({extent(xv), extent(gv), mask == ReluMask::result ? extent(rv) : 0, max_offset(dx_out)});
  const bool i32 = fits_int32(largest * 2);

  Operands o{x.impl().data(), g.impl().data(), r.defined() ? r.impl().data() : nullptr, mean.impl().data(),
             invstd.impl().data(), data_or_null(weight), data_or_null(bias), data_or_null(threshold),
             data_or_null(fill), xv.n, xv.c, xv.s, {xv.sn, xv.sc, xv.ss}, {gv.sn, gv.sc, gv.ss},
             {rv.sn, rv.sc, rv.ss}};
  DeviceGuard guard(device);
  cudaStream_t stream = current_stream(device);
  if (channels == 0) return;

  // Pass 1: per-split sum(dy) and sum(dy * (x - mean)).
  const bool has_sums = (train || need_weight || need_bias) && count > 0;
  Tensor partial;
  int64_t splits = 0;
  if (has_sums) {
    const int64_t target_blocks = int64_t{properties(device).multiProcessorCount} * 4;
    const int64_t units = rows ? (channels + 31) / 32 : channels;
    const int64_t per_block = rows ? 64 : 1024;
    splits = std::clamp<int64_t>(target_blocks / units, 1, std::max<int64_t>(1, (count + per_block - 1) / per_block));
    ReduceParams rp{o, nullptr, (count + splits - 1) / splits};
    splits = (count + rp.per_split - 1) / rp.per_split;
    KILN_CHECK(units * splits <= std::numeric_limits<int32_t>::max(), ShapeError,
               "[kiln::" + call.name() + "] too many channels for the CUDA kernel. Split the input.");
    partial = kiln::detail::make_empty({splits * 2 * channels}, DType::float64, x.device());
    rp.partial = static_cast<double*>(partial.impl().data());
    const std::string key =
        fmt::format("bnb_reduce|{}|{}|{}", dtype_key(dt), i32 ? 32 : 64, static_cast<int>(mask));
    JitFunction f = jit_function(device, key, rows ? "kiln_bnb_reduce_rows" : "kiln_bnb_reduce_planar",
                                 [&] { return batch_norm_backward_reduce_source(dt, i32, mask); });
    void* args[] = {&rp};
    launch(f, static_cast<unsigned>(units * splits), kBlock, 0, stream, args);
  }

  // Per channel: the grad_input coefficients and the parameter gradients.
  const DType pt = call.input(x_at + 1).defined() ? call.input(x_at + 1).dtype() : dt;
  std::optional<Staged> gw, gb;
  if (need_weight) gw.emplace(outs[1], pt);
  if (need_bias) gb.emplace(outs[2], pt);
  Tensor coef = kiln::detail::make_empty({3 * channels}, acc, x.device());
  FinalizeParams fp{partial.defined() ? static_cast<const double*>(partial.impl().data()) : nullptr,
                    mean.impl().data(),
                    invstd.impl().data(),
                    data_or_null(weight),
                    coef.impl().data(),
                    gw ? gw->t.impl().data() : nullptr,
                    gb ? gb->t.impl().data() : nullptr,
                    channels,
                    count,
                    splits,
                    train,
                    rows_formula};
  {
    const std::string key = "bnb_finalize|" + dtype_key(dt) + "|" + dtype_key(pt);
    JitFunction f = jit_function(device, key, "kiln_bnb_finalize",
                                 [&] { return batch_norm_backward_finalize_source(dt, pt); });
    void* args[] = {&fp};
    launch(f, grid_for(device, channels, kBlock), kBlock, 0, stream, args);
  }
  if (gw) gw->finish();
  if (gb) gb->finish();

  // Pass 2: grad_input in its own layout.
  if (!need_input || dx_out.numel() == 0) return;
  auto dv = ncs_view(dx_out);
  Tensor dx = dx_out;
  if (!dv) {
    dx = kiln::detail::make_empty_strided(dx_out.sizes().vec(),
                                          kiln::detail::strides_following(x.sizes(), x.strides(), x.sizes()), dt,
                                          dx_out.device());
    dv = ncs_view(dx);
  }
  const bool rows_order = dv->sc < dv->ss || dv->s == 1;
  ApplyParams ap{o, coef.impl().data(), dx.impl().data(), {dv->sn, dv->sc, dv->ss}, dx.numel()};
  const std::string key = fmt::format("bnb_apply|{}|{}|{}|{}|{}|{}", dtype_key(dt), i32 ? 32 : 64,
                                      static_cast<int>(mask), rows_formula, train, rows_order);
  JitFunction f = jit_function(device, key, "kiln_bnb_apply", [&] {
    return batch_norm_backward_apply_source(dt, i32, mask, rows_formula, train, rows_order);
  });
  void* args[] = {&ap};
  launch(f, grid_for(device, ap.total, kBlock), kBlock, 0, stream, args);
  if (!dx.same(dx_out)) dx_out.copy_(dx);
}

void batch_norm_backward_kernel(const OpCall& call, std::span<Tensor> outs) {
  batch_norm_backward(call, outs, ReluMask::none);
}
void batch_norm_relu_backward_kernel(const OpCall& call, std::span<Tensor> outs) {
  batch_norm_backward(call, outs, ReluMask::result);
}
void batch_norm_relu_backward_recompute_kernel(const OpCall& call, std::span<Tensor> outs) {
  batch_norm_backward(call, outs, ReluMask::recompute);
}

// native_layer_norm_backward(grad_out, input, mean, rstd, weight?; normalized_shape, output_mask).
void layer_norm_backward_kernel(const OpCall& call, std::span<Tensor> outs) {
  const Tensor& x_in = call.input(1);
  for (size_t i = 0; i < call.inputs.size(); ++i) check_on(call, call.input(i), x_in);
  const DType dt = x_in.dtype(), acc = opmath_dtype(dt);
  const int device = x_in.device().index;
  const bool need_input = mask_at(call, 0), need_weight = mask_at(call, 1), need_bias = mask_at(call, 2);
  const Tensor x = x_in.contiguous();
  const Tensor g = call.input(0).to(dt).contiguous();
  int64_t row_size = 1;
  for (int64_t d : call.ints_attr(0)) row_size *= d;
  const int64_t rows = row_size == 0 ? call.input(2).numel() : x.numel() / row_size;
  const Tensor mean = as_acc(call.input(2), acc), rstd = as_acc(call.input(3), acc);
  const Tensor weight = as_acc(call.input(4), acc);
  const DType pt = call.input(4).defined() ? call.input(4).dtype() : dt;
  LayerNormParams p{x.impl().data(), g.impl().data(), mean.impl().data(), rstd.impl().data(), data_or_null(weight),
                    nullptr, nullptr, nullptr, nullptr, rows, row_size, 0, 0};
  const std::string key = "ln_backward|" + dtype_key(dt) + "|" + dtype_key(pt);
  auto source = [&] { return layer_norm_backward_source(dt, pt); };
  DeviceGuard guard(device);
  cudaStream_t stream = current_stream(device);
  if (need_input && rows > 0 && row_size > 0) {
    Staged dx(outs[0], dt);
    p.dx = dx.t.impl().data();
    KILN_CHECK(rows <= std::numeric_limits<int32_t>::max(), ShapeError,
               "[kiln::native_layer_norm_backward] at most 2^31 - 1 rows on CUDA. Split the input.");
    JitFunction f = jit_function(device, key, "kiln_ln_backward", source);
    void* args[] = {&p};
    launch(f, static_cast<unsigned>(rows), kBlock, 0, stream, args);
    dx.finish();
  }
  if (!(need_weight || need_bias) || row_size == 0) return;
  std::optional<Staged> gw, gb;
  if (need_weight) gw.emplace(outs[1], pt);
  if (need_bias) gb.emplace(outs[2], pt);
  p.grad_weight = gw ? gw->t.impl().data() : nullptr;
  p.grad_bias = gb ? gb->t.impl().data() : nullptr;
  const int64_t tiles = (row_size + 31) / 32;
  const int64_t target_blocks = int64_t{properties(device).multiProcessorCount} * 4;
  int64_t splits = std::clamp<int64_t>(target_blocks / tiles, 1, std::max<int64_t>(1, (rows + 63) / 64));
  p.per_split = std::max<int64_t>(1, (rows + splits - 1) / splits);
  splits = std::max<int64_t>(1, (rows + p.per_split - 1) / p.per_split);
  p.splits = splits;
  Tensor partial = kiln::detail::make_empty({splits * 2 * row_size}, acc, x.device());
  p.partial = partial.impl().data();
  KILN_CHECK(tiles * splits <= std::numeric_limits<int32_t>::max(), ShapeError,
             "[kiln::native_layer_norm_backward] the normalized shape is too large for the CUDA kernel.");
  void* args[] = {&p};
  launch(jit_function(device, key, "kiln_ln_param_partial", source), static_cast<unsigned>(tiles * splits), kBlock, 0,
         stream, args);
  launch(jit_function(device, key, "kiln_ln_param_finalize", source), grid_for(device, row_size, kBlock), kBlock, 0,
         stream, args);
  if (gw) gw->finish();
  if (gb) gb->finish();
}

// native_group_norm_backward(grad_out, input, mean, rstd, weight?; group, output_mask).
void group_norm_backward_kernel(const OpCall& call, std::span<Tensor> outs) {
  const Tensor& x_in = call.input(1);
  for (size_t i = 0; i < call.inputs.size(); ++i) check_on(call, call.input(i), x_in);
  const DType dt = x_in.dtype(), acc = opmath_dtype(dt);
  const int device = x_in.device().index;
  const bool need_input = mask_at(call, 0), need_weight = mask_at(call, 1), need_bias = mask_at(call, 2);
  if (!need_input && !need_weight && !need_bias) return;
  const Tensor x = x_in.contiguous();
  const Tensor g = call.input(0).to(dt).contiguous();
  const int64_t groups = call.int_attr(0);
  const int64_t n = x.sizes()[0], channels = x.sizes()[1];
  const int64_t plane = n * channels == 0 ? 0 : x.numel() / (n * channels);
  const Tensor mean = as_acc(call.input(2), acc), rstd = as_acc(call.input(3), acc);
  const Tensor weight = as_acc(call.input(4), acc);
  const DType pt = call.input(4).defined() ? call.input(4).dtype() : dt;
  Tensor ds = kiln::detail::make_empty({std::max<int64_t>(1, n * channels)}, acc, x.device());
  Tensor db = kiln::detail::make_empty({std::max<int64_t>(1, n * channels)}, acc, x.device());
  GroupNormParams p{x.impl().data(), g.impl().data(), mean.impl().data(), rstd.impl().data(), data_or_null(weight),
                    nullptr, ds.impl().data(), db.impl().data(), nullptr, nullptr, n, channels, plane, groups,
                    channels / groups};
  const std::string key = "gn_backward|" + dtype_key(dt) + "|" + dtype_key(pt);
  auto source = [&] { return group_norm_backward_source(dt, pt); };
  DeviceGuard guard(device);
  cudaStream_t stream = current_stream(device);
  std::optional<Staged> dx;
  if (need_input && x.numel() > 0) {
    dx.emplace(outs[0], dt);
    p.dx = dx->t.impl().data();
  }
  if (n * groups > 0) {
    KILN_CHECK(n * groups <= std::numeric_limits<int32_t>::max(), ShapeError,
               "[kiln::native_group_norm_backward] at most 2^31 - 1 (n, group) blocks on CUDA. Split the input.");
    void* args[] = {&p};
    launch(jit_function(device, key, "kiln_gn_backward", source), static_cast<unsigned>(n * groups), kBlock, 0,
           stream, args);
  }
  if (dx) dx->finish();
  if (!(need_weight || need_bias) || channels == 0) return;
  std::optional<Staged> gw, gb;
  if (need_weight) gw.emplace(outs[1], pt);
  if (need_bias) gb.emplace(outs[2], pt);
  p.grad_weight = gw ? gw->t.impl().data() : nullptr;
  p.grad_bias = gb ? gb->t.impl().data() : nullptr;
  void* args[] = {&p};
  launch(jit_function(device, key, "kiln_gn_param", source), grid_for(device, channels, kBlock), kBlock, 0, stream,
         args);
  if (gw) gw->finish();
  if (gb) gb->finish();
}

[[maybe_unused]] const bool registered = [] {
  register_kernel("native_batch_norm_backward", DeviceType::cuda, batch_norm_backward_kernel);
  register_kernel("batch_norm_relu_backward", DeviceType::cuda, batch_norm_relu_backward_kernel);
  register_kernel("batch_norm_relu_backward_recompute", DeviceType::cuda, batch_norm_relu_backward_recompute_kernel);
  register_kernel("native_layer_norm_backward", DeviceType::cuda, layer_norm_backward_kernel);
  register_kernel("native_group_norm_backward", DeviceType::cuda, group_norm_backward_kernel);
  return true;
}();

}  // namespace

}  // namespace kiln::cuda::detail
