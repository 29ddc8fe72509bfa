// Eager CUDA kernels of the indexing ops: index_select, gather, scatter (src / value),
// scatter_add, index, index_put, embedding, embedding_dense_backward, one_hot. The CPU kernels
// (src/kernels/cpu/index_kernels.cpp, index_backward_kernels.cpp) are the reference.
//
// Index values are data, so every kernel first runs a check kernel over its index tensors (which
// also converts int32 indices to int64 and wraps negatives where the op allows them), reads the
// first bad position back to the host, and throws IndexError with the CPU's message before
// anything is written: one stream synchronization per call, which the semantics demand.
//
// Every move then runs one generated kernel, kiln_index_move, over an iteration shape: each
// position p reads or writes A at (p's offset in A, along the dims A walks) + sum over index
// tensors k of index_k[p] * (A's stride of the dim k indexes), and B at p's offset in B:
//   gather:  B = A[...]        (index_select, gather, index, embedding)
//   scatter: A[...] = B        (scatter, index_put)
//   add:     A[...] += B       (scatter_add, index_put(accumulate=True)), with atomics.
// Moves copy raw bits by item size. Accumulation is in the CPU's dtypes: atomicAdd for float,
// double, int32 and int64, a compare-and-swap on the enclosing 32-bit word for int8, uint8 and
// bool; float16/bfloat16 accumulate into a float32 copy of the target that is rounded once at
// the end (what the CPU's row accumulation does; its serial path rounds after every add, so
// 16-bit sums may differ from the CPU's by rounding). Repeated indices add up (in an unspecified
// order, so float sums may differ from the CPU's in the last bits); scatter and index_put
// without accumulate let one of the repeated writes win, as on the CPU.
#include <algorithm>
#include <limits>

#include <fmt/format.h>

#include "kernels/cuda/cuda_runtime.h"
#include "kernels/cuda/elementwise.h"
#include "kernels/cuda/jit.h"
#include "kernels/cuda/misc_kernels.h"
#include "ops/index_plan.h"
#include "core/shape.h"
#include "core/tensor_factory.h"
#include "kiln/op_table.h"
#include "kiln/ops.h"

namespace kiln::cuda::detail {

// ---------------- shared pieces (misc_kernels.h) ----------------

// The shared preamble (elementwise.h: opmath, convert, load, unpack) plus what these kernels add.
const std::string& misc_preamble() {
  static const std::string text = std::string(device_preamble()) + R"(namespace kj {
template <class T> inline constexpr bool is_half = std::is_same_v<T, Half> || std::is_same_v<T, BFloat16>;
// An integer as the CPU kernels convert one (from_int64): bool is v != 0, 16-bit floats go
// through float.
template <class To> __forceinline__ To from_int(long long v) {
  if constexpr (std::is_same_v<To, bool>) return v != 0;
  else if constexpr (is_half<To>) return To(static_cast<float>(v));
  else return static_cast<To>(v);
}
// Rounds an opmath value to T and back (16-bit float arithmetic rounds after every op).
template <class T> __forceinline__ opmath<T> round_to(opmath<T> v) {
  if constexpr (is_half<T>) return static_cast<float>(T(v));
  else return v;
}
__forceinline__ void atomic_add(float* p, float v) { atomicAdd(p, v); }
__forceinline__ void atomic_add(double* p, double v) { atomicAdd(p, v); }
__forceinline__ void atomic_add(int* p, int v) { atomicAdd(p, v); }
__forceinline__ void atomic_add(long long* p, long long v) {
  atomicAdd(reinterpret_cast<unsigned long long*>(p), static_cast<unsigned long long>(v));  // wraps like the CPU's
}
// One-byte types: compare-and-swap on the aligned 32-bit word holding the byte.
template <class T> __forceinline__ void atomic_add_byte(T* p, T v) {
  const unsigned long long addr = reinterpret_cast<unsigned long long>(p);
  unsigned* word = reinterpret_cast<unsigned*>(addr & ~3ull);
  const unsigned shift = static_cast<unsigned>(addr & 3ull) * 8u;
  unsigned old = *word, assumed;
  do {
    assumed = old;
    unsigned char byte = static_cast<unsigned char>(assumed >> shift);
    T cur;
    memcpy(&cur, &byte, 1);
    T next;
    if constexpr (std::is_same_v<T, bool>) next = cur || v;
    else next = static_cast<T>(cur + v);
    unsigned char out;
    memcpy(&out, &next, 1);
    old = atomicCAS(word, assumed, (assumed & ~(0xffu << shift)) | (static_cast<unsigned>(out) << shift));
  } while (old != assumed);
}
__forceinline__ void atomic_add(signed char* p, signed char v) { atomic_add_byte(p, v); }
__forceinline__ void atomic_add(unsigned char* p, unsigned char v) { atomic_add_byte(p, v); }
__forceinline__ void atomic_add(bool* p, bool v) { atomic_add_byte(p, v); }
}
)";
  return text;
}

unsigned misc_grid(int64_t items, int device) {
  const int64_t cap = int64_t{properties(device).multiProcessorCount} * 16;
  return static_cast<unsigned>(std::clamp<int64_t>((items + kMiscBlock - 1) / kMiscBlock, 1, cap));
}

void launch_misc(void* f, int64_t items, int device, MiscParams& params, const char* op) {
  DeviceGuard guard(device);
  void* args[] = {params.data()};
  launch(f, misc_grid(items, device), kMiscBlock, 0, current_stream(device), args);
  check_launch(op);
}

namespace {

std::string check_index_source(DType index_dtype) {
  return misc_preamble() + fmt::format(R"(
typedef {} in_t;
struct Params {{
  const in_t* in;
  long long* out;
  unsigned long long* bad;
  long long n, lo, hi, ignore, has_ignore, trap;
}};
// trap: inside a CUDA graph, where nothing can be read back, a bad value stops the kernel (a
// device-side assert, as PyTorch's CUDA kernels have) instead of being reported to the host.
extern "C" __global__ void __launch_bounds__({}) kiln_check_index(Params p) {{
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < p.n; i += (long long)gridDim.x * blockDim.x) {{
    const long long v = static_cast<long long>(p.in[i]);
    const bool ok = (p.has_ignore && v == p.ignore) || (v >= p.lo && v < p.hi);
    if (!ok && p.trap) {{
      printf("[kiln] index %lld at position %lld is out of bounds [%lld, %lld) (device-side check in a CUDA graph)\n",
             v, i, p.lo, p.hi);
      __trap();
    }}
    if (!ok) atomicMin(p.bad, static_cast<unsigned long long>(i));
    if (p.out) p.out[i] = v < 0 ? v + p.hi : v;
  }}
}}
)",
                                                  cuda_type(index_dtype), kMiscBlock);
}

}  // namespace

int64_t first_bad_index(const Tensor& index, int64_t lo, int64_t hi, const int64_t* ignore, Tensor* wrapped,
                        const char* op) {
  const int64_t n = index.numel();
  if (n == 0) return -1;
  KILN_CHECK(index.is_cuda() && index.is_contiguous() && (index.dtype() == kInt64 || index.dtype() == kInt32), Error,
             std::string("[kiln::") + op + "] the CUDA index check takes a contiguous int32/int64 device tensor. "
             "This is a Kiln bug.");
  const int device = index.device().index;
  // While a CUDA graph records, no value can come back to the host: the check runs on the
  // device and a bad index stops the kernel (then the graph's replay fails with a CUDA error).
  const bool recording = capturing(device);
  Tensor bad = kiln::detail::make_empty({1}, kInt64, index.device());
  {
    DeviceGuard guard(device);
    check(cudaMemsetAsync(bad.impl().data(), 0xff, sizeof(int64_t), current_stream(device)), op);  // -1: none
  }
  const DType t = index.dtype();
  JitFunction f = jit_function(device, cuda_type(t), "kiln_check_index", [&] { return check_index_source(t); });
  MiscParams p;
  p.add(index.impl().data());
  p.add(wrapped ? wrapped->impl().data() : static_cast<void*>(nullptr));
  p.add(bad.impl().data());
  p.add(n);
  p.add(lo);
  p.add(hi);
  p.add(ignore ? *ignore : int64_t{0});
  p.add(int64_t{ignore != nullptr});
  p.add(int64_t{recording});
  launch_misc(f, n, device, p, op);
  if (recording) return -1;
  return bad.to(kCPU).item<int64_t>();
}

Tensor host_element(const Tensor& t, int64_t position) {
  return t.reshape({-1}).narrow(0, position, 1).to(kCPU).reshape({});
}

namespace {

using kiln::detail::make_empty;

// ---------------- index validation ----------------

// A contiguous int64 device tensor of `index`'s values (index itself when it already is one),
// all in [0, size); negatives in [-size, 0) are wrapped first when `wrap` is set. Throws
// IndexError naming the first bad value, as the CPU's checked_index does.
Tensor checked_index(const Tensor& index, int64_t size, int64_t dim, bool wrap, const std::string& op, Device device) {
  Tensor idx = (index.device() == device ? index : index.to(device)).contiguous();
  const bool convert = wrap || idx.dtype() != kInt64;
  Tensor out = convert ? make_empty(idx.sizes().vec(), kInt64, device) : idx;
  const int64_t bad = first_bad_index(idx, wrap ? -size : 0, size, nullptr, convert ? &out : nullptr, op.c_str());
  if (bad >= 0) {
    const int64_t v = host_element(idx, bad).to(kInt64).item<int64_t>();
    throw IndexError("[kiln::" + op + "] index " + std::to_string(v) + " is out of bounds for dimension " +
                     std::to_string(dim) + " with size " + std::to_string(size) + ".");
  }
  return out;
}

using kiln::detail::IndexPlan;

// plan_index's check on the GPU: bounds-checked int64 indices on `device`, negatives wrapped.
auto cuda_index_check(const std::string& op, Device device) {
  return [op, device](const Tensor& index, int64_t size, int64_t dim) {
    return checked_index(index, size, dim, true, op, device);
  };
}

// ---------------- the move kernel ----------------

constexpr int kMaxDims = 16;

enum class Move { gather, scatter, add };

// An indexed move over an iteration shape (see the file comment). A's strides come from the
// tensor passed at launch, through a_dims; B's are given.
struct Indexed {
  std::vector<int64_t> sizes;                // iteration shape
  std::vector<int64_t> a_dims;               // per iteration dim: the dim of A it walks, or -1
  std::vector<int64_t> b_strides;            // per iteration dim, elements (0: broadcast)
  std::vector<Tensor> idx;                   // contiguous int64 device tensors
  std::vector<std::vector<int64_t>> k_strides;  // per index, per iteration dim, elements
  std::vector<int64_t> idx_dims;             // per index: the dim of A it indexes
};

struct MoveSpec {
  Move mode;
  std::string a_type, b_type;
  int ndim, nidx;
  bool i32;
};

std::string move_source(const MoveSpec& s) {
  const int kslots = std::max(s.nidx, 1);
  std::string statement;
  switch (s.mode) {
    case Move::gather: statement = "reinterpret_cast<b_t*>(p.b)[bo] = reinterpret_cast<const a_t*>(p.a)[ao];"; break;
    case Move::scatter: statement = "reinterpret_cast<a_t*>(p.a)[ao] = reinterpret_cast<const b_t*>(p.b)[bo];"; break;
    case Move::add:
      statement = "kj::atomic_add(reinterpret_cast<a_t*>(p.a) + ao, "
                  "static_cast<a_t>(static_cast<kj::opmath<b_t>>(reinterpret_cast<const b_t*>(p.b)[bo])));";
      break;
  }
  return misc_preamble() + fmt::format(R"(
typedef {idx} idx_t;
typedef {a} a_t;
typedef {b} b_t;
constexpr int kNdim = {ndim};
constexpr int kNidx = {nidx};
struct Params {{
  char* a;
  char* b;
  const long long* idx[{kslots}];
  long long numel;
  long long sizes[kNdim];
  long long a_st[kNdim];
  long long b_st[kNdim];
  long long k_st[{kslots}][kNdim];
  long long a_dim_st[{kslots}];
}};
extern "C" __global__ void __launch_bounds__({block}) kiln_index_move(Params p) {{
  const idx_t numel = static_cast<idx_t>(p.numel);
  for (idx_t i = blockIdx.x * (idx_t)blockDim.x + threadIdx.x; i < numel; i += (idx_t)gridDim.x * blockDim.x) {{
    idx_t rem = i, ao = 0, bo = 0;
    idx_t ko[{kslots}] = {{}};
#pragma unroll
    for (int d = kNdim - 1; d >= 0; --d) {{
      idx_t r = rem;
      if (d > 0) {{
        const idx_t s = static_cast<idx_t>(p.sizes[d]);
        const idx_t q = rem / s;
        r = rem - q * s;
        rem = q;
      }}
      ao += r * static_cast<idx_t>(p.a_st[d]);
      bo += r * static_cast<idx_t>(p.b_st[d]);
#pragma unroll
      for (int k = 0; k < kNidx; ++k) ko[k] += r * static_cast<idx_t>(p.k_st[k][d]);
    }}
#pragma unroll
    for (int k = 0; k < kNidx; ++k) ao += static_cast<idx_t>(p.idx[k][ko[k]]) * static_cast<idx_t>(p.a_dim_st[k]);
    {statement}
  }}
}}
)",
                                                  fmt::arg("idx", s.i32 ? "int" : "long long"), fmt::arg("a", s.a_type),
                                                  fmt::arg("b", s.b_type), fmt::arg("ndim", s.ndim),
                                                  fmt::arg("nidx", s.nidx), fmt::arg("kslots", kslots),
                                                  fmt::arg("block", kMiscBlock), fmt::arg("statement", statement));
}

std::string move_key(const MoveSpec& s) {
  return fmt::format("{}|{}|{}|{}|{}|{}", static_cast<int>(s.mode), s.a_type, s.b_type, s.ndim, s.nidx, s.i32 ? 'i' : 'l');
}

// The unsigned type of an item size: moves copy bits.
const char* raw_type(int64_t itemsize) {
  switch (itemsize) {
    case 1: return "uint8_t";
    case 2: return "uint16_t";
    case 4: return "uint32_t";
    default: return "uint64_t";
  }
}

// The largest element offset `t` reaches from its data pointer.
int64_t extent(const Tensor& t) {
  int64_t e = 0;
  for (int64_t d = 0; d < t.dim(); ++d) e += (t.sizes()[d] - 1) * std::abs(t.strides()[d]);
  return e;
}

void run_move(Move mode, const Indexed& ix, const Tensor& a, const Tensor& b, const std::string& op) {
  int64_t numel = 1;
  for (int64_t s : ix.sizes) numel *= s;
  if (numel == 0) return;
  const size_t nidx = ix.idx.size();
  KILN_CHECK(nidx <= static_cast<size_t>(kMaxDims), IndexError,
             "[kiln::" + op + "] CUDA kernels take at most " + std::to_string(kMaxDims) + " index tensors.");
  // Per iteration dim: strides of A, B and each index; size-1 dims dropped, mergeable dims merged.
  struct Dim {
    int64_t size, a, b;
    std::vector<int64_t> k;
  };
  std::vector<Dim> dims;
  for (size_t d = 0; d < ix.sizes.size(); ++d) {
    if (ix.sizes[d] == 1) continue;
    Dim dm{ix.sizes[d], ix.a_dims[d] >= 0 ? a.strides()[ix.a_dims[d]] : 0, ix.b_strides[d], {}};
    for (size_t k = 0; k < nidx; ++k) dm.k.push_back(ix.k_strides[k][d]);
    if (!dims.empty()) {
      Dim& outer = dims.back();
      bool merge = outer.a == dm.a * dm.size && outer.b == dm.b * dm.size;
      for (size_t k = 0; k < nidx && merge; ++k) merge = outer.k[k] == dm.k[k] * dm.size;
      if (merge) {
        outer.size *= dm.size;
        outer.a = dm.a;
        outer.b = dm.b;
        outer.k = dm.k;
        continue;
      }
    }
    dims.push_back(std::move(dm));
  }
  if (dims.empty()) dims.push_back(Dim{1, 0, 0, std::vector<int64_t>(nidx, 0)});
  KILN_CHECK(dims.size() <= static_cast<size_t>(kMaxDims), ShapeError,
             "[kiln::" + op + "] CUDA kernels take at most " + std::to_string(kMaxDims) +
                 " non-mergeable dims. Make the operands contiguous first.");
  constexpr int64_t kMax32 = std::numeric_limits<int32_t>::max() / 2;
  bool i32 = numel <= kMax32 && extent(a) <= kMax32 && extent(b) <= kMax32;
  for (const Tensor& t : ix.idx) i32 = i32 && t.numel() <= kMax32;

  MoveSpec spec{mode, "", "", static_cast<int>(dims.size()), static_cast<int>(nidx), i32};
  if (mode == Move::add) {
    spec.a_type = cuda_type(a.dtype());
    spec.b_type = cuda_type(b.dtype());
  } else {
    KILN_CHECK(a.element_size() == b.element_size(), Error, "[kiln::" + op + "] mismatched item sizes. This is a Kiln bug.");
    spec.a_type = spec.b_type = raw_type(a.element_size());
  }
  const int device = a.device().index;
  JitFunction f = jit_function(device, move_key(spec), "kiln_index_move", [&] { return move_source(spec); });

  const int kslots = std::max<int>(static_cast<int>(nidx), 1);
  MiscParams p;
  p.add(a.impl().data());
  p.add(b.impl().data());
  for (int k = 0; k < kslots; ++k)
    p.add(k < static_cast<int>(nidx) ? static_cast<const void*>(ix.idx[k].impl().data()) : nullptr);
  p.add(numel);
  for (const Dim& d : dims) p.add(d.size);
  for (const Dim& d : dims) p.add(d.a);
  for (const Dim& d : dims) p.add(d.b);
  for (int k = 0; k < kslots; ++k)
    for (const Dim& d : dims) p.add(k < static_cast<int>(nidx) ? d.k[k] : int64_t{0});
  for (int k = 0; k < kslots; ++k)
    p.add(k < static_cast<int>(nidx) ? a.strides()[ix.idx_dims[k]] : int64_t{0});
  launch_misc(f, numel, device, p, op.c_str());
}

bool is_half(DType t) { return t == kFloat16 || t == kBFloat16; }

// target[...] += values through `ix`: 16-bit floats accumulate into a float32 copy (see the file
// comment).
void accumulate(const Indexed& ix, Tensor& target, const Tensor& values, const std::string& op) {
  if (!is_half(target.dtype())) return run_move(Move::add, ix, target, values, op);
  Tensor acc = make_empty(target.sizes().vec(), kFloat32, target.device());
  acc.copy_(target);
  run_move(Move::add, ix, acc, values, op);
  target.copy_(acc);
}

// Views a 0-dim tensor as shape (1,) (PyTorch's ensure_nonempty_dim).
Tensor at_least_1d(const Tensor& t) { return t.dim() == 0 ? t.view({1}) : t; }

std::vector<int64_t> strides_of(const Tensor& t) { return t.strides().vec(); }

// ---------------- kernels ----------------

void index_select_kernel(const OpCall& call, std::span<Tensor> outs) {
  const Tensor& x = call.input(0);
  Tensor& result = outs[0];
  const int64_t dim = kiln::detail::wrap_dim(call.int_attr(0), x.dim(), "index_select");
  const int64_t size = x.dim() == 0 ? 1 : x.sizes()[dim];
  Tensor idx = checked_index(call.input(1).reshape({-1}), size, dim, false, "index_select", x.device());
  if (result.numel() == 0) return;
  if (x.dim() == 0) {
    result.copy_(x);
    return;
  }
  Indexed ix;
  ix.sizes = result.sizes().vec();
  for (int64_t d = 0; d < x.dim(); ++d) ix.a_dims.push_back(d == dim ? -1 : d);
  ix.b_strides = strides_of(result);
  ix.idx = {idx};
  ix.k_strides.assign(1, std::vector<int64_t>(ix.sizes.size(), 0));
  ix.k_strides[0][dim] = 1;
  ix.idx_dims = {dim};
  run_move(Move::gather, ix, x, result, "index_select");
}

void gather_kernel(const OpCall& call, std::span<Tensor> outs) {
  const Tensor x = at_least_1d(call.input(0));
  Tensor& result = outs[0];
  const int64_t dim = kiln::detail::wrap_dim(call.int_attr(0), call.input(0).dim(), "gather");
  Tensor idx = at_least_1d(checked_index(call.input(1), x.sizes()[dim], dim, false, "gather", x.device()));
  if (result.numel() == 0) return;
  Tensor out = at_least_1d(result);
  Indexed ix;
  ix.sizes = idx.sizes().vec();
  for (int64_t d = 0; d < x.dim(); ++d) ix.a_dims.push_back(d == dim ? -1 : d);
  ix.b_strides = strides_of(out);
  ix.idx = {idx};
  ix.k_strides = {strides_of(idx)};
  ix.idx_dims = {dim};
  run_move(Move::gather, ix, x, out, "gather");
}

// scatter / scatter.value / scatter_add: out = self, then out[... index ...] (+)= src.
void scatter_kernel(const OpCall& call, std::span<Tensor> outs, Move mode, bool value_form) {
  const Tensor& self = call.input(0);
  Tensor& result = outs[0];
  const int64_t dim = kiln::detail::wrap_dim(call.int_attr(0), self.dim(), call.name());
  const std::string op = mode == Move::add ? "scatter_add" : "scatter";
  Tensor idx = at_least_1d(
      checked_index(call.input(1), self.dim() == 0 ? 1 : self.sizes()[dim], dim, false, op, self.device()));
  if (!result.same(self)) result.copy_(self);
  if (idx.numel() == 0) return;
  Tensor out = at_least_1d(result);
  Tensor src;
  if (value_form) {
    src = make_empty({}, self.dtype(), self.device());
    src.copy_(kiln::detail::wrap_scalar(call.scalar_attr(1), self.dtype()));
  } else {
    src = at_least_1d(call.input(2));
  }
  Indexed ix;
  ix.sizes = idx.sizes().vec();
  for (int64_t d = 0; d < out.dim(); ++d) ix.a_dims.push_back(d == dim ? -1 : d);
  ix.b_strides = value_form ? std::vector<int64_t>(ix.sizes.size(), 0) : strides_of(src);
  ix.idx = {idx};
  ix.k_strides = {strides_of(idx)};
  ix.idx_dims = {dim};
  if (mode == Move::add) accumulate(ix, out, src, op);
  else run_move(Move::scatter, ix, out, src, op);
}

// ---------------- index / index_put ----------------

// The move of self[indices] that detail::plan_index (ops/index_plan.h, shared with the CPU) laid out.
Indexed indexed_of(const IndexPlan& plan, std::vector<int64_t> b_strides) {
  Indexed ix;
  ix.sizes = plan.result_sizes;
  ix.a_dims = plan.self_dim_of;
  ix.b_strides = std::move(b_strides);
  ix.idx = plan.idx;
  ix.k_strides = plan.idx_strides;
  ix.idx_dims = plan.dims;
  return ix;
}

void index_kernel(const OpCall& call, std::span<Tensor> outs) {
  const Tensor& self = call.input(0);
  Tensor& result = outs[0];
  kiln::detail::IndexPlan plan = kiln::detail::plan_index(self, call.inputs.subspan(1), "index", cuda_index_check("index", self.device()));
  if (result.numel() == 0) return;
  run_move(Move::gather, indexed_of(plan, strides_of(result)), self, result, "index");
}

void index_put_kernel(const OpCall& call, std::span<Tensor> outs) {
  const Tensor& self = call.input(0);
  const Tensor& values = call.input(1);  // inputs: self, values, indices...
  const bool accumulate_values = call.bool_attr(0);
  Tensor& out = outs[0];
  kiln::detail::IndexPlan plan = kiln::detail::plan_index(self, call.inputs.subspan(2), "index_put", cuda_index_check("index_put", self.device()));
  if (!out.same(self)) out.copy_(self);
  Indexed ix = indexed_of(plan, kiln::detail::broadcast_strides(values.sizes(), values.strides(), plan.result_sizes));
  if (accumulate_values) accumulate(ix, out, values, "index_put");
  else run_move(Move::scatter, ix, out, values, "index_put");
}

// ---------------- embedding / one_hot ----------------

void embedding_kernel(const OpCall& call, std::span<Tensor> outs) {
  const Tensor& weight = call.input(0);
  Tensor& result = outs[0];
  Tensor idx = checked_index(call.input(1).reshape({-1}), weight.sizes()[0], 0, false, "embedding", weight.device());
  if (result.numel() == 0) return;
  Tensor out = result.is_contiguous() ? result : make_empty(result.sizes().vec(), result.dtype(), result.device());
  const int64_t n = idx.numel(), cols = weight.sizes()[1];
  Indexed ix;
  ix.sizes = {n, cols};
  ix.a_dims = {-1, 1};
  ix.b_strides = {cols, 1};
  ix.idx = {idx};
  ix.k_strides = {{1, 0}};
  ix.idx_dims = {0};
  run_move(Move::gather, ix, weight, out, "embedding");
  if (!out.same(result)) result.copy_(out);
}

std::string one_hot_source() {
  return misc_preamble() + fmt::format(R"(
struct Params {{
  const long long* idx;
  long long* out;
  long long numel, classes;
}};
extern "C" __global__ void __launch_bounds__({}) kiln_one_hot(Params p) {{
  for (long long e = blockIdx.x * (long long)blockDim.x + threadIdx.x; e < p.numel; e += (long long)gridDim.x * blockDim.x) {{
    const long long j = e / p.classes;
    p.out[e] = p.idx[j] == e - j * p.classes ? 1 : 0;
  }}
}}
)",
                                                  kMiscBlock);
}

void one_hot_kernel(const OpCall& call, std::span<Tensor> outs) {
  Tensor& result = outs[0];
  Tensor idx = call.input(0).contiguous();
  const int64_t classes = call.int_attr(0);
  const int64_t bad = first_bad_index(idx, 0, classes, nullptr, nullptr, "one_hot");
  if (bad >= 0) {
    const int64_t v = host_element(idx, bad).item<int64_t>();
    KILN_CHECK(v >= 0, IndexError, "[kiln::one_hot] Class values must be non-negative (got " + std::to_string(v) + ").");
    throw IndexError("[kiln::one_hot] Class values must be smaller than num_classes (got " + std::to_string(v) +
                     " for " + std::to_string(classes) + " classes).");
  }
  if (result.numel() == 0) return;
  Tensor out = result.is_contiguous() ? result : make_empty(result.sizes().vec(), kInt64, result.device());
  const int device = out.device().index;
  JitFunction f = jit_function(device, "one_hot", "kiln_one_hot", one_hot_source);
  MiscParams p;
  p.add(idx.impl().data());
  p.add(out.impl().data());
  p.add(out.numel());
  p.add(classes);
  launch_misc(f, out.numel(), device, p, "one_hot");
  if (!out.same(result)) result.copy_(out);
}

// ---------------- embedding_dense_backward ----------------

std::string count_rows_source() {
  return misc_preamble() + fmt::format(R"(
struct Params {{
  const long long* idx;
  unsigned long long* counts;
  long long n, skip;
}};
extern "C" __global__ void __launch_bounds__({}) kiln_count_rows(Params p) {{
  for (long long j = blockIdx.x * (long long)blockDim.x + threadIdx.x; j < p.n; j += (long long)gridDim.x * blockDim.x) {{
    const long long r = p.idx[j];
    if (r != p.skip) atomicAdd(p.counts + r, 1ull);
  }}
}}
)",
                                                  kMiscBlock);
}

// grad_weight[idx[j], c] += grad[j, c] (times 1 / count[idx[j]] with scale_grad_by_freq), in the
// CPU's accumulation type.
std::string embedding_backward_source(DType grad, DType acc) {
  return misc_preamble() + fmt::format(R"(
typedef {} g_t;
typedef {} acc_t;
struct Params {{
  const g_t* grad;
  const long long* idx;
  const unsigned long long* counts;
  acc_t* out;
  long long numel, cols, skip;
}};
extern "C" __global__ void __launch_bounds__({}) kiln_embedding_backward(Params p) {{
  for (long long e = blockIdx.x * (long long)blockDim.x + threadIdx.x; e < p.numel; e += (long long)gridDim.x * blockDim.x) {{
    const long long j = e / p.cols, c = e - j * p.cols;
    const long long r = p.idx[j];
    if (r == p.skip) continue;
    acc_t v = static_cast<acc_t>(static_cast<kj::opmath<g_t>>(p.grad[e]));
    if (p.counts) v = v * (acc_t(1) / static_cast<acc_t>(p.counts[r]));
    kj::atomic_add(p.out + r * p.cols + c, v);
  }}
}}
)",
                                                  cuda_type(grad), cuda_type(acc), kMiscBlock);
}

void embedding_dense_backward_kernel(const OpCall& call, std::span<Tensor> outs) {
  Tensor& result = outs[0];
  const int64_t rows = call.int_attr(0);
  const int64_t padding_idx = call.int_attr(1);
  const bool scale = call.bool_attr(2);
  const Device device = result.device();
  Tensor idx = checked_index(call.input(1).reshape({-1}), rows, 0, false, "embedding_dense_backward", device);
  if (result.numel() == 0) return;
  const DType dt = result.dtype();
  KILN_CHECK(is_floating_point(dt), DTypeError, "[kiln::embedding_dense_backward] expected a floating-point gradient.");
  const DType acc_dt = opmath_dtype(dt);
  const int64_t n = idx.numel(), cols = result.sizes()[1];
  Tensor acc = result.is_contiguous() && acc_dt == dt ? result : make_empty({rows, cols}, acc_dt, device);
  const int dev = device.index;
  {
    DeviceGuard guard(dev);
    check(cudaMemsetAsync(acc.impl().data(), 0, static_cast<size_t>(acc.numel() * acc.element_size()), current_stream(dev)),
          "embedding_dense_backward");
  }
  if (n > 0 && cols > 0) {
    Tensor grad = call.input(0).contiguous();
    Tensor counts;
    if (scale) {
      counts = make_empty({rows}, kInt64, device);
      DeviceGuard guard(dev);
      check(cudaMemsetAsync(counts.impl().data(), 0, static_cast<size_t>(rows) * sizeof(int64_t), current_stream(dev)),
            "embedding_dense_backward");
      JitFunction f = jit_function(dev, "count_rows", "kiln_count_rows", count_rows_source);
      MiscParams p;
      p.add(idx.impl().data());
      p.add(counts.impl().data());
      p.add(n);
      p.add(padding_idx);
      launch_misc(f, n, dev, p, "embedding_dense_backward");
    }
    const DType gt = grad.dtype();
    JitFunction f = jit_function(dev, std::string(cuda_type(gt)) + "|" + cuda_type(acc_dt), "kiln_embedding_backward",
                                 [&] { return embedding_backward_source(gt, acc_dt); });
    MiscParams p;
    p.add(grad.impl().data());
    p.add(idx.impl().data());
    p.add(counts.defined() ? counts.impl().data() : static_cast<void*>(nullptr));
    p.add(acc.impl().data());
    p.add(n * cols);
    p.add(cols);
    p.add(padding_idx);
    launch_misc(f, n * cols, dev, p, "embedding_dense_backward");
  }
  if (!acc.same(result)) result.copy_(acc);
}

[[maybe_unused]] const bool registered = [] {
  register_kernel("index_select", DeviceType::cuda, index_select_kernel);
  register_kernel("gather", DeviceType::cuda, gather_kernel);
  register_kernel("scatter", DeviceType::cuda,
                  [](const OpCall& c, std::span<Tensor> o) { scatter_kernel(c, o, Move::scatter, false); });
  register_kernel("scatter.value", DeviceType::cuda,
                  [](const OpCall& c, std::span<Tensor> o) { scatter_kernel(c, o, Move::scatter, true); });
  register_kernel("scatter_add", DeviceType::cuda,
                  [](const OpCall& c, std::span<Tensor> o) { scatter_kernel(c, o, Move::add, false); });
  register_kernel("index", DeviceType::cuda, index_kernel);
  register_kernel("index_put", DeviceType::cuda, index_put_kernel);
  register_kernel("embedding", DeviceType::cuda, embedding_kernel);
  register_kernel("one_hot", DeviceType::cuda, one_hot_kernel);
  register_kernel("embedding_dense_backward", DeviceType::cuda, embedding_dense_backward_kernel);
  return true;
}();

}  // namespace

std::vector<std::pair<std::string, std::string>> index_sources_for_test() {
  std::vector<std::pair<std::string, std::string>> out;
  out.emplace_back("check_index_int64", check_index_source(kInt64));
  out.emplace_back("check_index_int32", check_index_source(kInt32));
  for (int64_t itemsize : {1, 2, 4, 8}) {
    for (bool i32 : {true, false}) {
      out.emplace_back("gather", move_source({Move::gather, raw_type(itemsize), raw_type(itemsize), 3, 1, i32}));
      out.emplace_back("scatter", move_source({Move::scatter, raw_type(itemsize), raw_type(itemsize), 2, 2, i32}));
    }
  }
  out.emplace_back("index_no_indices", move_source({Move::gather, "uint32_t", "uint32_t", 1, 0, true}));
  out.emplace_back("index_many", move_source({Move::gather, "uint64_t", "uint64_t", kMaxDims, kMaxDims, false}));
  for (DType t : {kFloat32, kFloat64, kInt32, kInt64, DType::int8, DType::uint8, kBool}) {
    out.emplace_back(std::string("add_") + cuda_type(t), move_source({Move::add, cuda_type(t), cuda_type(t), 2, 1, true}));
    out.emplace_back(std::string("add_") + cuda_type(t), move_source({Move::add, cuda_type(t), cuda_type(t), 4, 3, false}));
  }
  out.emplace_back("add_half", move_source({Move::add, "float", "kiln::Half", 2, 1, true}));
  out.emplace_back("add_bfloat16", move_source({Move::add, "float", "kiln::BFloat16", 2, 1, true}));
  out.emplace_back("one_hot", one_hot_source());
  out.emplace_back("count_rows", count_rows_source());
  for (DType t : {kFloat32, kFloat64, kFloat16, kBFloat16})
    out.emplace_back("embedding_backward", embedding_backward_source(t, opmath_dtype(t)));
  return out;
}

}  // namespace kiln::cuda::detail
