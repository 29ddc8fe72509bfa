// The reduction, softmax and scan generators and launchers (see reduce.h).
#include "kernels/cuda/reduce.h"

#include <algorithm>
#include <limits>
#include <numeric>

#include <fmt/format.h>

#include "kernels/cuda/cuda_runtime.h"
#include "kernels/cuda/elementwise.h"
#include "kernels/cuda/jit.h"
#include "core/tensor_factory.h"

namespace kiln::cuda::detail {

namespace {

// Shared by every generated source: loads in accumulation precision (16-bit floats through
// float, bool as 0/1, anything to bool as != 0), stores as the CPU's store_as, NaN-propagating
// max/min, and warp shuffles of any accumulator field.
constexpr const char* kPreamble = R"(#include "kiln/math/functors.h"
namespace kr {
using kiln::Half;
using kiln::BFloat16;
template <class T> struct is_half { static constexpr bool value = false; };
template <> struct is_half<Half> { static constexpr bool value = true; };
template <> struct is_half<BFloat16> { static constexpr bool value = true; };
template <class A, class T> __forceinline__ __device__ A load(const T* p) {
  T v = *p;
  if constexpr (is_half<T>::value) {
    if constexpr (std::is_same_v<A, bool>) return static_cast<float>(v) != 0.0f;
    else return static_cast<A>(static_cast<float>(v));
  } else if constexpr (std::is_same_v<A, bool>) {
    return v != T(0);
  } else {
    return static_cast<A>(v);
  }
}
template <class O, class V> __forceinline__ __device__ O store(V v) {
  if constexpr (is_half<O>::value) return O(static_cast<float>(v));
  else return static_cast<O>(v);
}
template <class A> __forceinline__ __device__ A nan_max(A a, A b) { return ((a > b) | (a != a)) ? a : b; }
template <class A> __forceinline__ __device__ A nan_min(A a, A b) { return ((a < b) | (a != a)) ? a : b; }
template <class A> __forceinline__ __device__ A shfl_xor(A v, int m) {
  if constexpr (sizeof(A) < 4) return static_cast<A>(__shfl_xor_sync(0xffffffffu, static_cast<int>(v), m));
  else return __shfl_xor_sync(0xffffffffu, v, m);
}
template <class A> __forceinline__ __device__ A shfl_up(A v, int m) {
  if constexpr (sizeof(A) < 4) return static_cast<A>(__shfl_up_sync(0xffffffffu, static_cast<int>(v), m));
  else return __shfl_up_sync(0xffffffffu, v, m);
}
template <class A> __forceinline__ __device__ A wrap_add(A a, A b) {
  if constexpr (std::is_integral_v<A>) return kiln::math::util::wrapping_add(a, b);
  else return a + b;
}
template <class A> __forceinline__ __device__ A wrap_mul(A a, A b) {
  if constexpr (std::is_integral_v<A>) return kiln::math::util::wrapping_mul(a, b);
  else return a * b;
}
}
)";

// The host mirror of the generated `Params` (all fields 8 bytes: one layout on both sides).
struct ReduceParams {
  const void* in = nullptr;
  void* out0 = nullptr;
  void* out1 = nullptr;
  void* partial = nullptr;
  long long outer = 1, R = 1, inner = 1, chunk = 1, tiles = 1, count = 0;
  double p = 0;
};

constexpr const char* kReduceParams = R"(struct Params {
  const char* in; char* out0; char* out1; char* partial;
  long long outer, R, inner, chunk, tiles, count;
  double p;
};
)";

constexpr int kMaxAccBytes = 32;  // partial accumulators' slot size

// Smallest/largest value of a dtype as a C++ literal of its accumulation type.
std::string lowest_literal(DType t) {
  switch (t) {
    case DType::bool_: return "false";
    case DType::uint8: return "0";
    case DType::int8: return "(-128)";
    case DType::int32: return "(-2147483647 - 1)";
    case DType::int64: return "(-9223372036854775807LL - 1)";
    default: return "(-INFINITY)";
  }
}
std::string highest_literal(DType t) {
  switch (t) {
    case DType::bool_: return "true";
    case DType::uint8: return "255";
    case DType::int8: return "127";
    case DType::int32: return "2147483647";
    case DType::int64: return "9223372036854775807LL";
    default: return "INFINITY";
  }
}

bool is_arg(ReduceOp op) {
  return op == ReduceOp::argmax || op == ReduceOp::argmin || op == ReduceOp::max_values_indices ||
         op == ReduceOp::min_values_indices;
}

// Accumulator, identity, add(element), combine, shuffle and finish of one op, over the typedefs
// T (input storage), A (accumulation), O (out0 storage).
std::string op_code(ReduceOp op, DType acc) {
  std::string s;
  auto scalar_acc = [&](const std::string& identity, const std::string& add, const std::string& combine,
                        const std::string& finish) {
    s += "struct Acc { A v; };\n";
    s += "__device__ __forceinline__ Acc identity() { Acc a; a.v = " + identity + "; return a; }\n";
    s += "__device__ __forceinline__ void add(Acc& a, A x, long long, const Params& p) { " + add + " }\n";
    s += "__device__ __forceinline__ Acc combine(Acc a, Acc b, const Params& p) { " + combine + " return a; }\n";
    s += "__device__ __forceinline__ Acc shfl(Acc a, int m) { a.v = kr::shfl_xor(a.v, m); return a; }\n";
    s += "__device__ __forceinline__ void finish(const Acc& a, long long o, const Params& p) { " + finish + " }\n";
  };
  const std::string store0 = "reinterpret_cast<O*>(p.out0)[o] = kr::store<O>(";
  switch (op) {
    case ReduceOp::sum:
      scalar_acc("A(0)", "a.v = kr::wrap_add(a.v, x);", "a.v = kr::wrap_add(a.v, b.v);", store0 + "a.v);");
      break;
    case ReduceOp::prod:
      scalar_acc("A(1)", "a.v = kr::wrap_mul(a.v, x);", "a.v = kr::wrap_mul(a.v, b.v);", store0 + "a.v);");
      break;
    case ReduceOp::mean:
      scalar_acc("A(0)", "a.v = a.v + x;", "a.v = a.v + b.v;", store0 + "a.v / static_cast<A>(p.count));");
      break;
    case ReduceOp::max:
      scalar_acc(lowest_literal(acc), "a.v = kr::nan_max(a.v, x);", "a.v = kr::nan_max(a.v, b.v);", store0 + "a.v);");
      break;
    case ReduceOp::min:
      scalar_acc(highest_literal(acc), "a.v = kr::nan_min(a.v, x);", "a.v = kr::nan_min(a.v, b.v);", store0 + "a.v);");
      break;
    case ReduceOp::any:
      scalar_acc("false", "a.v = a.v || x;", "a.v = a.v || b.v;", store0 + "a.v);");
      break;
    case ReduceOp::all:
      scalar_acc("true", "a.v = a.v && x;", "a.v = a.v && b.v;", store0 + "a.v);");
      break;
    case ReduceOp::norm2:
      scalar_acc("A(0)", "a.v = a.v + x * x;", "a.v = a.v + b.v;", store0 + "std::sqrt(a.v));");
      break;
    case ReduceOp::norm1:
      scalar_acc("A(0)", "a.v = a.v + std::fabs(x);", "a.v = a.v + b.v;", store0 + "a.v);");
      break;
    case ReduceOp::norm0:
      scalar_acc("A(0)", "a.v = a.v + (x != A(0) ? A(1) : A(0));", "a.v = a.v + b.v;", store0 + "a.v);");
      break;
    case ReduceOp::norm_inf:
      scalar_acc("A(0)", "a.v = kr::nan_max(a.v, std::fabs(x));", "a.v = kr::nan_max(a.v, b.v);", store0 + "a.v);");
      break;
    case ReduceOp::norm_neg_inf:
      scalar_acc("A(INFINITY)", "a.v = kr::nan_min(a.v, std::fabs(x));", "a.v = kr::nan_min(a.v, b.v);",
                 store0 + "a.v);");
      break;
    case ReduceOp::norm_p:
      scalar_acc("A(0)", "a.v = a.v + std::pow(std::fabs(x), static_cast<A>(p.p));", "a.v = a.v + b.v;",
                 store0 + "std::pow(a.v, static_cast<A>(1.0 / p.p)));");
      break;
    case ReduceOp::var:
    case ReduceOp::std:
    case ReduceOp::var_mean: {
      // Welford per thread, Chan et al.'s merge across threads (the CPU's combine).
      s += R"(struct Acc { A mean, m2; long long n; };
__device__ __forceinline__ Acc identity() { Acc a; a.mean = A(0); a.m2 = A(0); a.n = 0; return a; }
__device__ __forceinline__ void add(Acc& a, A x, long long, const Params&) {
  a.n += 1;
  const A d = x - a.mean;
  a.mean = a.mean + d / static_cast<A>(a.n);
  a.m2 = a.m2 + d * (x - a.mean);
}
__device__ __forceinline__ Acc combine(Acc a, Acc b, const Params&) {
  if (a.n == 0) return b;
  if (b.n == 0) return a;
  const long long n = a.n + b.n;
  const A wb = static_cast<A>(b.n) / static_cast<A>(n), d = b.mean - a.mean;
  Acc r; r.mean = a.mean + d * wb; r.m2 = a.m2 + b.m2 + d * d * static_cast<A>(a.n) * wb; r.n = n;
  return r;
}
__device__ __forceinline__ Acc shfl(Acc a, int m) {
  a.mean = kr::shfl_xor(a.mean, m); a.m2 = kr::shfl_xor(a.m2, m); a.n = kr::shfl_xor(a.n, m); return a;
}
)";
      s += "__device__ __forceinline__ void finish(const Acc& a, long long o, const Params& p) {\n";
      s += "  const A var = a.m2 / static_cast<A>(p.count);\n";  // 0 / 0 = nan for an empty reduction
      s += std::string("  ") + store0 + (op == ReduceOp::std ? "std::sqrt(var));\n" : "var);\n");
      if (op == ReduceOp::var_mean)
        s += "  reinterpret_cast<O*>(p.out1)[o] = kr::store<O>(a.n > 0 ? a.mean : static_cast<A>(NAN));\n";
      s += "}\n";
      break;
    }
    case ReduceOp::logsumexp:
      // The CPU's shifted sums: the value is log(sum) + shift, shift the max seen (0 when inf).
      s += R"(struct Acc { A shift, sum; };
__device__ __forceinline__ Acc identity() { Acc a; a.shift = A(0); a.sum = A(0); return a; }
__device__ __forceinline__ Acc combine(Acc a, Acc b, const Params&) {
  if (a.sum == A(0)) return b;
  if (b.sum == A(0)) return a;
  Acc r;
  if (a.sum != a.sum || b.sum != b.sum) { r.shift = A(0); r.sum = static_cast<A>(NAN); return r; }
  if (std::isinf(a.sum) || std::isinf(b.sum)) { r.shift = A(0); r.sum = static_cast<A>(INFINITY); return r; }
  const A m = a.shift > b.shift ? a.shift : b.shift;
  r.shift = m;
  r.sum = a.sum * kiln::math::Exp{}(a.shift - m) + b.sum * kiln::math::Exp{}(b.shift - m);
  return r;
}
__device__ __forceinline__ void add(Acc& a, A x, long long, const Params& p) {
  Acc e; e.shift = std::isinf(x) ? A(0) : x; e.sum = kiln::math::Exp{}(x - e.shift);
  a = combine(a, e, p);
}
__device__ __forceinline__ Acc shfl(Acc a, int m) { a.shift = kr::shfl_xor(a.shift, m); a.sum = kr::shfl_xor(a.sum, m); return a; }
__device__ __forceinline__ void finish(const Acc& a, long long o, const Params& p) {
  reinterpret_cast<O*>(p.out0)[o] = kr::store<O>(kiln::math::Log{}(a.sum) + a.shift);
}
)";
      break;
    case ReduceOp::argmax:
    case ReduceOp::argmin:
    case ReduceOp::max_values_indices:
    case ReduceOp::min_values_indices: {
      const bool is_max = op == ReduceOp::argmax || op == ReduceOp::max_values_indices;
      const bool values = op == ReduceOp::max_values_indices || op == ReduceOp::min_values_indices;
      // NaN wins (the first NaN); ties go to the lowest index, whatever order lanes merge in.
      s += fmt::format(R"(struct Acc {{ A v; long long i; }};
__device__ __forceinline__ bool better(A v, A best) {{ return v {0} best || (v != v && best == best); }}
__device__ __forceinline__ bool beats(const Acc& b, const Acc& a) {{ return better(b.v, a.v) || (!better(a.v, b.v) && b.i < a.i); }}
__device__ __forceinline__ Acc identity() {{ Acc a; a.v = {1}; a.i = 9223372036854775807LL; return a; }}
__device__ __forceinline__ void add(Acc& a, A x, long long r, const Params&) {{
  Acc e; e.v = x; e.i = r;
  if (beats(e, a)) a = e;
}}
__device__ __forceinline__ Acc combine(Acc a, Acc b, const Params&) {{ return beats(b, a) ? b : a; }}
__device__ __forceinline__ Acc shfl(Acc a, int m) {{ a.v = kr::shfl_xor(a.v, m); a.i = kr::shfl_xor(a.i, m); return a; }}
)",
                       is_max ? ">" : "<", is_max ? lowest_literal(acc) : highest_literal(acc));
      if (values)
        s += "__device__ __forceinline__ void finish(const Acc& a, long long o, const Params& p) {\n"
             "  reinterpret_cast<O*>(p.out0)[o] = kr::store<O>(a.v);\n"
             "  reinterpret_cast<long long*>(p.out1)[o] = a.i;\n}\n";
      else
        s += "__device__ __forceinline__ void finish(const Acc& a, long long o, const Params& p) {\n"
             "  reinterpret_cast<long long*>(p.out0)[o] = a.i;\n}\n";
      break;
    }
  }
  return s;
}

// A reduction kernel's shape: rows (lanes along R) or columns (lanes along inner), BX x BY
// threads (BX fastest).
struct ReduceShape {
  bool rows = true;
  int bx = 32, by = 8;
};

std::string reduce_source(const ReduceSpec& spec, const ReduceShape& shape) {
  const int threads = shape.bx * shape.by;
  std::string src = kPreamble;
  src += fmt::format("typedef {} T;\ntypedef {} A;\ntypedef {} O;\n", cuda_type(spec.input), cuda_type(spec.acc),
                     cuda_type(spec.out));
  src += kReduceParams;
  src += op_code(spec.op, spec.acc);
  src += fmt::format("static_assert(sizeof(Acc) <= {}, \"accumulator slot\");\n", kMaxAccBytes);
  src += fmt::format("constexpr int BX = {}, BY = {}, THREADS = {};\n", shape.bx, shape.by, threads);
  // Results go to the outputs, or to this split's slot of the partials.
  src += R"(__device__ __forceinline__ void emit(const Acc& a, long long o, const Params& p) {
  if (p.partial) reinterpret_cast<Acc*>(p.partial)[(long long)(blockIdx.x / p.tiles) * (p.outer * p.inner) + o] = a;
  else finish(a, o, p);
}
)";
  src += fmt::format("extern \"C\" __global__ void __launch_bounds__({}) kiln_reduce(Params p) {{\n", threads);
  src += R"(  const int tx = threadIdx.x % BX, ty = threadIdx.x / BX;
  const long long tile = blockIdx.x % p.tiles, split = blockIdx.x / p.tiles;
  const long long r0 = split * p.chunk;
  const long long r1 = p.R - r0 < p.chunk ? p.R : r0 + p.chunk;
  Acc a = identity();
)";
  if (shape.rows) {
    src += R"(  const long long o = tile * BY + ty;
  const bool valid = o < p.outer;
  if (valid) {
    const T* row = reinterpret_cast<const T*>(p.in) + o * p.R;
    for (long long r = r0 + tx; r < r1; r += BX) add(a, kr::load<A>(row + r), r, p);
  }
)";
    if (shape.bx <= 32) {
      src += "  for (int m = BX / 2; m > 0; m >>= 1) a = combine(a, shfl(a, m), p);\n";
    } else {
      src += R"(  __shared__ Acc warps[THREADS / 32];
  for (int m = 16; m > 0; m >>= 1) a = combine(a, shfl(a, m), p);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane == 0) warps[warp] = a;
  __syncthreads();
  if (warp == 0) {
    a = lane < THREADS / 32 ? warps[lane] : identity();
    for (int m = 16; m > 0; m >>= 1) a = combine(a, shfl(a, m), p);
  }
)";
    }
    src += "  if (tx == 0 && valid) emit(a, o, p);\n}\n";
  } else {
    src += R"(  const long long inner_tiles = (p.inner + BX - 1) / BX;
  const long long o = tile / inner_tiles, i = (tile % inner_tiles) * BX + tx;
  const bool valid = i < p.inner;
  if (valid) {
    const T* col = reinterpret_cast<const T*>(p.in) + o * p.R * p.inner + i;
    for (long long r = r0 + ty; r < r1; r += BY) add(a, kr::load<A>(col + r * p.inner), r, p);
  }
)";
    if (shape.by > 1) {
      src += R"(  __shared__ Acc part[THREADS];
  part[threadIdx.x] = a;
  __syncthreads();
  for (int s = BY / 2; s > 0; s >>= 1) {
    if (ty < s) part[threadIdx.x] = combine(part[threadIdx.x], part[threadIdx.x + s * BX], p);
    __syncthreads();
  }
  a = part[tx];
)";
    }
    src += "  if (ty == 0 && valid) emit(a, o * p.inner + i, p);\n}\n";
  }
  // The second pass: one thread per output combines the splits' partials in order.
  src += R"(extern "C" __global__ void __launch_bounds__(256) kiln_reduce_finish(Params p, int splits) {
  const long long n = p.outer * p.inner;
  const long long o = blockIdx.x * 256LL + threadIdx.x;
  if (o >= n) return;
  const Acc* part = reinterpret_cast<const Acc*>(p.partial);
  Acc a = part[o];
  for (int s = 1; s < splits; ++s) a = combine(a, part[s * n + o], p);
  finish(a, o, p);
}
)";
  return src;
}

std::string spec_key(const ReduceSpec& spec, const ReduceShape& shape) {
  return fmt::format("reduce|{}|{}|{}|{}|{}|{}x{}", static_cast<int>(spec.op), static_cast<int>(spec.input),
                     static_cast<int>(spec.acc), static_cast<int>(spec.out), shape.rows ? 'r' : 'c', shape.bx,
                     shape.by);
}

int64_t pow2_ceil(int64_t v) {
  int64_t p = 1;
  while (p < v) p *= 2;
  return p;
}

ReduceShape pick_shape(int64_t R, int64_t inner) {
  ReduceShape s;
  if (inner == 1) {
    s.rows = true;
    if (R <= 32) s.bx = static_cast<int>(std::max<int64_t>(4, pow2_ceil(R)));
    else if (R <= 4096) s.bx = 32;
    else s.bx = 512;
    s.by = std::max(1, 256 / s.bx);
  } else {
    s.rows = false;
    s.bx = static_cast<int>(std::min<int64_t>(32, pow2_ceil(inner)));
    s.by = static_cast<int>(std::min<int64_t>(256 / s.bx, pow2_ceil(std::max<int64_t>(R, 1))));
  }
  return s;
}

// Whether the dims of `t` fill its memory exactly once (strides a permutation of a contiguous
// layout).
bool is_dense(const Tensor& t) {
  std::vector<std::pair<int64_t, int64_t>> dims;
  for (int64_t d = 0; d < t.dim(); ++d)
    if (t.sizes()[d] != 1) dims.emplace_back(t.strides()[d], t.sizes()[d]);
  std::sort(dims.begin(), dims.end());
  int64_t expected = 1;
  for (auto [stride, size] : dims) {
    if (stride != expected) return false;
    expected *= size;
  }
  return true;
}

// The input seen as (outer, R, inner) and the order of its kept dims in the kernel's outputs.
struct ReduceView {
  Tensor input;
  int64_t outer = 1, R = 1, inner = 1;
  std::vector<int64_t> kept;  // kept dims of size > 1, outputs row-major over them
};

ReduceView make_view(const Tensor& x, const std::vector<bool>& mask) {
  ReduceView v;
  std::vector<int64_t> order;
  for (int64_t d = 0; d < x.dim(); ++d)
    if (x.sizes()[d] != 1) order.push_back(d);
  Tensor t = x;
  if (is_dense(x)) {
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return x.strides()[a] > x.strides()[b]; });
  } else {
    t = x.contiguous();
  }
  // kept*, reduced*, kept* in memory order: read in place.
  int phase = 0;
  bool adjacent = true;
  for (int64_t d : order) {
    if (phase == 0 && mask[d]) phase = 1;
    else if (phase == 1 && !mask[d]) phase = 2;
    else if (phase == 2 && mask[d]) adjacent = false;
  }
  if (!adjacent) {
    std::vector<int64_t> perm;
    for (int64_t d : order)
      if (!mask[d]) perm.push_back(d);
    for (int64_t d : order)
      if (mask[d]) perm.push_back(d);
    for (int64_t d = 0; d < x.dim(); ++d)
      if (x.sizes()[d] == 1) perm.push_back(d);
    t = t.permute(perm).contiguous();
    for (int64_t d : order) {
      if (mask[d]) v.R *= x.sizes()[d];
      else {
        v.outer *= x.sizes()[d];
        v.kept.push_back(d);
      }
    }
  } else {
    phase = 0;
    for (int64_t d : order) {
      if (mask[d]) {
        phase = 1;
        v.R *= x.sizes()[d];
      } else {
        (phase == 0 ? v.outer : v.inner) *= x.sizes()[d];
        v.kept.push_back(d);
      }
    }
  }
  v.input = t;
  return v;
}

// A view of the dense buffer `tmp` (outputs in the kernel's order) with out's sizes.
Tensor as_output_view(const Tensor& tmp, const Tensor& out, const Tensor& x, const std::vector<bool>& mask,
                      const std::vector<int64_t>& kept) {
  const bool keepdim = out.dim() == x.dim();
  std::vector<int64_t> stride_of_x_dim(x.dim(), 0);
  int64_t s = 1;
  for (size_t k = kept.size(); k-- > 0;) {
    stride_of_x_dim[kept[k]] = s;
    s *= x.sizes()[kept[k]];
  }
  std::vector<int64_t> strides;
  for (int64_t d = 0; d < x.dim(); ++d)
    if (keepdim || !mask[d]) strides.push_back(stride_of_x_dim[d]);
  return tmp.as_strided(out.sizes(), strides, 0);
}

unsigned grid_of(int64_t blocks, const std::string& op) {
  KILN_CHECK(blocks <= std::numeric_limits<int32_t>::max(), ShapeError,
             "[kiln::" + op + "] the tensor is too large for the CUDA reduction kernel. Reduce it in parts.");
  return static_cast<unsigned>(blocks);
}

}  // namespace

void launch_reduce(const std::string& op, const ReduceSpec& spec, const Tensor& x, const std::vector<bool>& mask,
                   std::span<Tensor> outs, int64_t count, double param) {
  const int nouts = is_arg(spec.op) ? (spec.op == ReduceOp::argmax || spec.op == ReduceOp::argmin ? 1 : 2)
                                    : (spec.op == ReduceOp::var_mean ? 2 : 1);
  Tensor& out0 = outs[0];
  if (out0.numel() == 0) return;
  const int device = out0.device().index;
  KILN_CHECK(x.device() == out0.device(), DeviceError,
             "[kiln::" + op + "] expected the input on " + out0.device().str() + ", but it is on " + x.device().str() +
                 ".");
  ReduceView v = make_view(x, mask);
  const bool direct = std::is_sorted(v.kept.begin(), v.kept.end()) &&
                      std::all_of(outs.begin(), outs.begin() + nouts, [](const Tensor& o) { return o.is_contiguous(); });
  std::vector<Tensor> targets;
  for (int k = 0; k < nouts; ++k)
    targets.push_back(direct ? outs[k] : kiln::detail::make_empty({v.outer * v.inner}, outs[k].dtype(), outs[k].device()));

  ReduceShape shape = pick_shape(v.R, v.inner);
  const int threads = shape.bx * shape.by;
  const int64_t tiles = shape.rows ? (v.outer + shape.by - 1) / shape.by : v.outer * ((v.inner + shape.bx - 1) / shape.bx);
  // Split long reductions across blocks when there are too few tiles to fill the GPU.
  const cudaDeviceProp& props = properties(device);
  const int64_t target_blocks = int64_t{props.multiProcessorCount} * (2048 / threads);
  const int64_t min_chunk = int64_t{shape.rows ? shape.bx : shape.by} * 16;
  int64_t splits = 1;
  if (tiles < target_blocks && v.R >= 2 * min_chunk)
    splits = std::min<int64_t>({(target_blocks + tiles - 1) / tiles, v.R / min_chunk, 65535});
  int64_t chunk = std::max<int64_t>(1, (v.R + splits - 1) / splits);
  splits = v.R == 0 ? 1 : (v.R + chunk - 1) / chunk;

  ReduceParams p;
  p.in = v.input.numel() > 0 ? v.input.impl().data() : nullptr;
  p.out0 = targets[0].impl().data();
  p.out1 = nouts > 1 ? targets[1].impl().data() : nullptr;
  p.outer = v.outer;
  p.R = v.R;
  p.inner = v.inner;
  p.chunk = chunk;
  p.tiles = tiles;
  p.count = count;
  p.p = param;
  Tensor partial;
  if (splits > 1) {
    partial = kiln::detail::make_empty({splits * v.outer * v.inner * kMaxAccBytes}, DType::uint8, out0.device());
    p.partial = partial.impl().data();
  }
  const std::string key = spec_key(spec, shape);
  auto source = [&] { return reduce_source(spec, shape); };
  JitFunction f = jit_function(device, key, "kiln_reduce", source);
  DeviceGuard guard(device);
  cudaStream_t stream = current_stream(device);
  void* args[] = {&p};
  launch(f, grid_of(tiles * splits, op), threads, 0, stream, args);
  if (splits > 1) {
    JitFunction finish = jit_function(device, key, "kiln_reduce_finish", source);
    int nsplits = static_cast<int>(splits);
    void* finish_args[] = {&p, &nsplits};
    launch(finish, grid_of((v.outer * v.inner + 255) / 256, op), 256, 0, stream, finish_args);
  }
  if (!direct)
    for (int k = 0; k < nouts; ++k) outs[k].copy_(as_output_view(targets[k], outs[k], x, mask, v.kept));
}

// ---------------------------------------------------------------------------------------------
// softmax, log_softmax and their backward
// ---------------------------------------------------------------------------------------------

namespace {

struct SoftmaxParams {
  const void* x = nullptr;  // input (forward) or grad_output (backward)
  const void* y = nullptr;  // the forward output (backward)
  void* out = nullptr;
  long long outer = 1, R = 1, inner = 1, tiles = 1;
};

// Rows: BX lanes per row (a warp, or a block for long rows), BY rows per block. Columns: one
// thread per (outer, inner) position walking R. Two or three passes over the row: the CPU's
// formulas in opmath precision.
std::string softmax_source(SoftmaxKind kind, DType t, bool rows, int bx, int by) {
  const bool backward = kind == SoftmaxKind::softmax_backward || kind == SoftmaxKind::log_softmax_backward;
  const bool log = kind == SoftmaxKind::log_softmax || kind == SoftmaxKind::log_softmax_backward;
  const int threads = bx * by;
  std::string src = kPreamble;
  src += fmt::format("typedef {} T;\ntypedef {} A;\n", cuda_type(t), cuda_type(opmath_dtype(t)));
  src += R"(struct Params { const char* x; const char* y; char* out; long long outer, R, inner, tiles; };
)";
  src += fmt::format("constexpr int BX = {}, BY = {}, THREADS = {};\n", bx, by, threads);
  // Lane reductions across BX lanes (all threads of the block take part).
  if (rows && bx > 32) {
    src += R"(template <bool Max> __device__ __forceinline__ A lanes_reduce(A v, A* scratch) {
  for (int m = 16; m > 0; m >>= 1) { A o = kr::shfl_xor(v, m); v = Max ? kr::nan_max(v, o) : v + o; }
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < THREADS / 32 ? scratch[lane] : (Max ? A(-INFINITY) : A(0));
  for (int m = 16; m > 0; m >>= 1) { A o = kr::shfl_xor(v, m); v = Max ? kr::nan_max(v, o) : v + o; }
  return v;
}
)";
  } else if (rows) {
    src += R"(template <bool Max> __device__ __forceinline__ A lanes_reduce(A v, A*) {
  for (int m = BX / 2; m > 0; m >>= 1) { A o = kr::shfl_xor(v, m); v = Max ? kr::nan_max(v, o) : v + o; }
  return v;
}
)";
  }
  src += fmt::format("extern \"C\" __global__ void __launch_bounds__({}) kiln_softmax(Params p) {{\n", threads);
  if (rows) {
    src += R"(  __shared__ A scratch[32];
  const int tx = threadIdx.x % BX, ty = threadIdx.x / BX;
  const long long o = (long long)blockIdx.x * BY + ty;
  // Rows past the end still take part in the block's lane reductions.
  const long long n = o < p.outer ? p.R : 0;
  const T* x = reinterpret_cast<const T*>(p.x) + (o < p.outer ? o : 0) * p.R;
  const T* y = reinterpret_cast<const T*>(p.y) + (o < p.outer ? o : 0) * p.R;
  T* out = reinterpret_cast<T*>(p.out) + (o < p.outer ? o : 0) * p.R;
  const long long step = BX;
  const long long k0 = tx;
)";
  } else {
    src += R"(  const long long t = (long long)blockIdx.x * THREADS + threadIdx.x;
  if (t >= p.outer * p.inner) return;
  const long long o = t / p.inner, i = t - o * p.inner;
  const long long n = p.R;
  const long long base = o * p.R * p.inner + i;
  const T* x = reinterpret_cast<const T*>(p.x) + base;
  const T* y = reinterpret_cast<const T*>(p.y) + base;
  T* out = reinterpret_cast<T*>(p.out) + base;
  const long long step = p.inner;
  const long long k0 = 0;
  (void)y;
)";
  }
  // k walks the elements this thread owns; e = k * stride-to-element.
  const std::string loop = rows ? "for (long long k = k0; k < n; k += step)" : "for (long long k = 0, e = 0; k < n; ++k, e += step)";
  const std::string at = rows ? "k" : "e";
  const std::string reduce_max = rows ? "  m = lanes_reduce<true>(m, scratch);\n" : "";
  const std::string reduce_sum = rows ? "  s = lanes_reduce<false>(s, scratch);\n" : "";
  if (!backward) {
    src += "  A m = A(-INFINITY);\n  " + loop + " m = kr::nan_max(m, kr::load<A>(x + " + at + "));\n" + reduce_max;
    src += "  A s = A(0);\n  " + loop + " s = s + kiln::math::Exp{}(kr::load<A>(x + " + at + ") - m);\n" + reduce_sum;
    if (log) {
      src += "  const A log_sum = kiln::math::Log{}(s);\n  " + loop + " out[" + at + "] = kr::store<T>((kr::load<A>(x + " +
             at + ") - m) - log_sum);\n";
    } else {
      src += "  const A inv = A(1) / s;\n  " + loop + " out[" + at + "] = kr::store<T>(kiln::math::Exp{}(kr::load<A>(x + " +
             at + ") - m) * inv);\n";
    }
  } else {
    if (log) {
      src += "  A s = A(0);\n  " + loop + " s = s + kr::load<A>(x + " + at + ");\n" + reduce_sum;
      src += "  " + loop + " out[" + at + "] = kr::store<T>(kr::load<A>(x + " + at + ") - kiln::math::Exp{}(kr::load<A>(y + " +
             at + ")) * s);\n";
    } else {
      src += "  A s = A(0);\n  " + loop + " s = s + kr::load<A>(x + " + at + ") * kr::load<A>(y + " + at + ");\n" + reduce_sum;
      src += "  " + loop + " out[" + at + "] = kr::store<T>(kr::load<A>(y + " + at + ") * (kr::load<A>(x + " + at + ") - s));\n";
    }
  }
  src += "}\n";
  return src;
}

// Inclusive scans. Long rows (inner == 1): one block per row, 4 elements a thread, a chunk of
// 1024 at a time with the running total carried. Otherwise one thread per (outer, inner)
// position walking R sequentially (the CPU's order).
constexpr int kScanThreads = 256, kScanItems = 4;

std::string scan_source(DType in, DType acc, DType out, bool rows) {
  std::string src = kPreamble;
  src += fmt::format("typedef {} T;\ntypedef {} A;\ntypedef {} O;\n", cuda_type(in), cuda_type(acc), cuda_type(out));
  src += "struct Params { const char* x; char* out; long long outer, R, inner; };\n";
  src += fmt::format("constexpr int THREADS = {}, ITEMS = {};\n", kScanThreads, kScanItems);
  src += "extern \"C\" __global__ void __launch_bounds__(THREADS) kiln_cumsum(Params p) {\n";
  if (rows) {
    src += R"(  __shared__ A warp_totals[THREADS / 32];
  __shared__ A carry_shared;
  const T* x = reinterpret_cast<const T*>(p.x) + (long long)blockIdx.x * p.R;
  O* out = reinterpret_cast<O*>(p.out) + (long long)blockIdx.x * p.R;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  A carry = A(0);
  for (long long base = 0; base < p.R; base += THREADS * ITEMS) {
    const long long first = base + (long long)threadIdx.x * ITEMS;
    A v[ITEMS];
    A run = A(0);
    for (int k = 0; k < ITEMS; ++k) {
      const long long j = first + k;
      run = kr::wrap_add(run, j < p.R ? kr::load<A>(x + j) : A(0));
      v[k] = run;
    }
    // Inclusive scan of the threads' totals: within warps, then across warp totals.
    A incl = run;
    for (int m = 1; m < 32; m <<= 1) {
      A o = kr::shfl_up(incl, m);
      if (lane >= m) incl = kr::wrap_add(incl, o);
    }
    if (lane == 31) warp_totals[warp] = incl;
    __syncthreads();
    if (warp == 0) {
      A w = lane < THREADS / 32 ? warp_totals[lane] : A(0);
      for (int m = 1; m < 32; m <<= 1) {
        A o = kr::shfl_up(w, m);
        if (lane >= m) w = kr::wrap_add(w, o);
      }
      if (lane < THREADS / 32) warp_totals[lane] = w;
    }
    __syncthreads();
    A excl = kr::shfl_up(incl, 1);
    if (lane == 0) excl = A(0);
    const A before = kr::wrap_add(carry, kr::wrap_add(warp > 0 ? warp_totals[warp - 1] : A(0), excl));
    for (int k = 0; k < ITEMS; ++k) {
      const long long j = first + k;
      if (j < p.R) out[j] = kr::store<O>(kr::wrap_add(before, v[k]));
    }
    if (threadIdx.x == THREADS - 1) carry_shared = kr::wrap_add(before, run);
    __syncthreads();
    carry = carry_shared;
    __syncthreads();
  }
}
)";
  } else {
    src += R"(  const long long t = (long long)blockIdx.x * THREADS + threadIdx.x;
  if (t >= p.outer * p.inner) return;
  const long long o = t / p.inner, i = t - o * p.inner;
  const T* x = reinterpret_cast<const T*>(p.x) + o * p.R * p.inner + i;
  O* out = reinterpret_cast<O*>(p.out) + o * p.R * p.inner + i;
  A acc = A(0);
  for (long long k = 0, e = 0; k < p.R; ++k, e += p.inner) {
    acc = kr::wrap_add(acc, kr::load<A>(x + e));
    out[e] = kr::store<O>(acc);
  }
}
)";
  }
  return src;
}

struct Split {
  int64_t outer = 1, size = 1, inner = 1;
};
Split split_around(const Tensor& x, int64_t dim) {
  Split s;
  for (int64_t d = 0; d < x.dim(); ++d) (d < dim ? s.outer : d == dim ? s.size : s.inner) *= x.sizes()[d];
  return s;
}

}  // namespace

void launch_softmax(const std::string& op, SoftmaxKind kind, const Tensor& x, const Tensor& grad, Tensor& out,
                    int64_t dim) {
  if (out.numel() == 0) return;
  const int device = out.device().index;
  const bool backward = kind == SoftmaxKind::softmax_backward || kind == SoftmaxKind::log_softmax_backward;
  const Split g = split_around(out, dim);
  const bool rows = g.inner == 1;
  int bx = 1, by = 256;
  if (rows) {
    bx = g.size <= 32 ? static_cast<int>(std::max<int64_t>(4, pow2_ceil(g.size))) : g.size <= 2048 ? 32 : 512;
    by = std::max(1, 256 / bx);
  }
  SoftmaxParams p;
  // Backward: x is grad_output, y the forward output.
  p.x = backward ? grad.impl().data() : x.impl().data();
  p.y = backward ? x.impl().data() : nullptr;
  p.out = out.impl().data();
  p.outer = g.outer;
  p.R = g.size;
  p.inner = g.inner;
  const int64_t blocks = rows ? (g.outer + by - 1) / by : (g.outer * g.inner + 255) / 256;
  p.tiles = blocks;
  const DType t = out.dtype();
  const std::string key = fmt::format("softmax|{}|{}|{}|{}x{}", static_cast<int>(kind), static_cast<int>(t), rows, bx, by);
  JitFunction f = jit_function(device, key, "kiln_softmax", [&] { return softmax_source(kind, t, rows, bx, by); });
  DeviceGuard guard(device);
  void* args[] = {&p};
  launch(f, grid_of(blocks, op), bx * by, 0, current_stream(device), args);
}

void launch_cumsum(const Tensor& x, Tensor& out, int64_t dim, DType acc) {
  if (out.numel() == 0) return;
  const int device = out.device().index;
  const Split g = split_around(out, dim);
  const bool rows = g.inner == 1 && g.size > 64;
  struct {
    const void* x;
    void* out;
    long long outer, R, inner;
  } p{x.impl().data(), out.impl().data(), g.outer, g.size, g.inner};
  const int64_t blocks = rows ? g.outer : (g.outer * g.inner + kScanThreads - 1) / kScanThreads;
  const std::string key = fmt::format("cumsum|{}|{}|{}|{}", static_cast<int>(x.dtype()), static_cast<int>(acc),
                                      static_cast<int>(out.dtype()), rows);
  JitFunction f = jit_function(device, key, "kiln_cumsum", [&] { return scan_source(x.dtype(), acc, out.dtype(), rows); });
  DeviceGuard guard(device);
  void* args[] = {&p};
  launch(f, grid_of(blocks, "cumsum"), kScanThreads, 0, current_stream(device), args);
}

std::vector<std::string> reduce_sources_for_test() {
  std::vector<std::string> out;
  const ReduceShape shapes[] = {{true, 4, 64}, {true, 32, 8}, {true, 512, 1}, {false, 32, 8}, {false, 2, 128}, {false, 32, 1}};
  struct Case {
    ReduceOp op;
    DType in, acc, out;
  };
  const Case cases[] = {
      {ReduceOp::sum, DType::float16, DType::float32, DType::float16},
      {ReduceOp::sum, DType::bool_, DType::int64, DType::int64},
      {ReduceOp::sum, DType::float64, DType::float64, DType::float64},
      {ReduceOp::prod, DType::int8, DType::int64, DType::int64},
      {ReduceOp::mean, DType::bfloat16, DType::float32, DType::bfloat16},
      {ReduceOp::max, DType::float32, DType::float32, DType::float32},
      {ReduceOp::min, DType::int8, DType::int8, DType::int8},
      {ReduceOp::max, DType::bool_, DType::bool_, DType::bool_},
      {ReduceOp::min, DType::uint8, DType::uint8, DType::uint8},
      {ReduceOp::max, DType::int64, DType::int64, DType::int64},
      {ReduceOp::any, DType::float16, DType::bool_, DType::bool_},
      {ReduceOp::all, DType::uint8, DType::bool_, DType::uint8},
      {ReduceOp::var, DType::float32, DType::float32, DType::float32},
      {ReduceOp::std, DType::float64, DType::float64, DType::float64},
      {ReduceOp::var_mean, DType::float16, DType::float32, DType::float16},
      {ReduceOp::norm2, DType::float32, DType::float32, DType::float32},
      {ReduceOp::norm1, DType::bfloat16, DType::float32, DType::bfloat16},
      {ReduceOp::norm0, DType::float64, DType::float64, DType::float64},
      {ReduceOp::norm_inf, DType::float32, DType::float32, DType::float32},
      {ReduceOp::norm_neg_inf, DType::float16, DType::float32, DType::float16},
      {ReduceOp::norm_p, DType::float64, DType::float64, DType::float64},
      {ReduceOp::logsumexp, DType::float32, DType::float32, DType::float32},
      {ReduceOp::logsumexp, DType::int64, DType::float32, DType::float32},
      {ReduceOp::argmax, DType::float16, DType::float32, DType::int64},
      {ReduceOp::argmin, DType::int32, DType::int32, DType::int64},
      {ReduceOp::max_values_indices, DType::bfloat16, DType::float32, DType::bfloat16},
      {ReduceOp::min_values_indices, DType::uint8, DType::uint8, DType::uint8},
      {ReduceOp::max_values_indices, DType::bool_, DType::bool_, DType::bool_},
  };
  for (const Case& c : cases)
    for (const ReduceShape& s : shapes) out.push_back(reduce_source({c.op, c.in, c.acc, c.out}, s));
  for (SoftmaxKind k : {SoftmaxKind::softmax, SoftmaxKind::log_softmax, SoftmaxKind::softmax_backward,
                        SoftmaxKind::log_softmax_backward})
    for (DType t : {DType::float16, DType::bfloat16, DType::float32, DType::float64}) {
      out.push_back(softmax_source(k, t, true, 8, 32));
      out.push_back(softmax_source(k, t, true, 32, 8));
      out.push_back(softmax_source(k, t, true, 512, 1));
      out.push_back(softmax_source(k, t, false, 1, 256));
    }
  const DType scans[][3] = {{DType::float32, DType::float64, DType::float32},
                            {DType::float16, DType::float32, DType::float16},
                            {DType::bfloat16, DType::float32, DType::bfloat16},
                            {DType::float64, DType::float64, DType::float64},
                            {DType::bool_, DType::int64, DType::int64},
                            {DType::int8, DType::int64, DType::int64},
                            {DType::int64, DType::int64, DType::int64}};
  for (const auto& s : scans)
    for (bool rows : {true, false}) out.push_back(scan_source(s[0], s[1], s[2], rows));
  return out;
}

}  // namespace kiln::cuda::detail
