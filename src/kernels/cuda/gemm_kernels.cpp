// Eager CUDA kernels of mm, bmm, addmm, addmm_relu and dot, with the CPU kernels' semantics
// (kernels/cpu/linalg_kernels.cpp):
//   - floating dtypes run cublasLtMatmul: float32 computes in exact float32 unless the float32
//     matmul precision allows TF32 (library_handles.h), float64 in float64, float16/bfloat16 in
//     float32 with one rounding of the result (split-K partial sums stay in float32);
//   - integers run an NVRTC kernel that wraps around like the CPU's loop (all arithmetic modulo
//     2^bits, which gives the CPU's bits whatever the accumulator width);
//   - dot is a 1 x n by n x 1 product of the same kernels.
//
// cuBLASLt is column-major: a row-major output C is computed as C^T = B^T A^T (the operands swap
// and transpose), and each operand whose strides make it row- or column-major (one unit stride,
// a leading dimension that covers the other) is passed as it is, transposed or not; only other
// layouts are copied. An output no library layout fits is computed in a temporary.
// addmm with beta == 1 and self a vector broadcast along the output's library rows (the common
// row-vector bias, linear's) adds it in cuBLASLt's BIAS epilogue, addmm_relu's relu included
// (RELU_BIAS; unlike Kiln's relu functor it may not keep NaN as NaN); otherwise self is copied
// into the output and accumulated with beta (C == D), and addmm_relu's relu runs in place after.
// Heuristic results are cached per configuration (shapes, strides, dtypes, epilogue, operand
// alignment, device). Under compile()'s max_autotune the heuristics' first 8 candidates are timed
// on the real operands into a scratch output (autotune.h) and the fastest is cached instead.
#include <cublasLt.h>
#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>

#include "kernels/autotune_scope.h"
#include "kernels/cuda/autotune.h"
#include "kernels/cuda/cuda_runtime.h"
#include "kernels/cuda/elementwise.h"
#include "kernels/cuda/gemm_kernels.h"
#include "kernels/cuda/jit.h"
#include "kernels/cuda/library_handles.h"
#include "core/shape.h"
#include "core/tensor_factory.h"
#include "kiln/op_table.h"
#include "kiln/ops.h"

namespace kiln::cuda::detail {

namespace {

// One matrix of a GEMM operand (the first of a batch, `batch_stride` elements apart).
struct Matrix {
  char* data;
  int64_t rows, cols, row_stride, col_stride, batch_stride;
  Matrix transposed() const { return {data, cols, rows, col_stride, row_stride, batch_stride}; }
};

Matrix matrix_of(const Tensor& t) {
  const int64_t d = t.dim();
  return {static_cast<char*>(t.impl().data()),
          t.sizes()[d - 2],
          t.sizes()[d - 1],
          t.strides()[d - 2],
          t.strides()[d - 1],
          d == 3 ? t.strides()[0] : 0};
}

// A matrix as a column-major library takes it: stored rows x cols with leading dimension ld,
// used as is or transposed.
struct LibraryLayout {
  bool transposed;
  int64_t rows, cols, ld;
};

// How `m` is passed without a copy, if it can be: column-major ((i, j) at i + j * ld) as is,
// row-major ((i, j) at i * ld + j) as the transpose of its column-major transpose.
std::optional<LibraryLayout> library_layout(const Matrix& m) {
  if (m.row_stride == 1 || m.rows == 1) {
    const int64_t ld = m.cols == 1 ? std::max<int64_t>(1, m.rows) : m.col_stride;
    if (ld >= std::max<int64_t>(1, m.rows)) return LibraryLayout{false, m.rows, m.cols, ld};
  }
  if (m.col_stride == 1 || m.cols == 1) {
    const int64_t ld = m.rows == 1 ? std::max<int64_t>(1, m.cols) : m.row_stride;
    if (ld >= std::max<int64_t>(1, m.cols)) return LibraryLayout{true, m.cols, m.rows, ld};
  }
  return std::nullopt;
}

// Whether `m` can be a library output (column-major, not transposed).
bool is_library_output(const Matrix& m) {
  auto l = library_layout(m);
  return l && !l->transposed;
}

// ---------------- cuBLASLt ----------------

struct LtTypes {
  cudaDataType_t data, scale;
  cublasComputeType_t compute;
};

LtTypes lt_types(DType t) {
  switch (t) {
    case DType::float64:
      return {CUDA_R_64F, CUDA_R_64F, CUBLAS_COMPUTE_64F};
    case DType::float16:
      return {CUDA_R_16F, CUDA_R_32F, CUBLAS_COMPUTE_32F};
    case DType::bfloat16:
      return {CUDA_R_16BF, CUDA_R_32F, CUBLAS_COMPUTE_32F};
    default:
      return {CUDA_R_32F, CUDA_R_32F,
              float32_matmul_precision() == MatmulPrecision::highest
                  ? CUBLAS_COMPUTE_32F
                  : CUBLAS_COMPUTE_32F_FAST_TF32};
  }
}

struct DescDeleter {
  void operator()(cublasLtMatmulDescOpaque_t* d) const { cublasLtMatmulDescDestroy(d); }
  void operator()(cublasLtMatrixLayoutOpaque_t* l) const { cublasLtMatrixLayoutDestroy(l); }
  void operator()(cublasLtMatmulPreferenceOpaque_t* p) const { cublasLtMatmulPreferenceDestroy(p); }
};
using MatmulDesc = std::unique_ptr<cublasLtMatmulDescOpaque_t, DescDeleter>;
using MatrixLayout = std::unique_ptr<cublasLtMatrixLayoutOpaque_t, DescDeleter>;
using Preference = std::unique_ptr<cublasLtMatmulPreferenceOpaque_t, DescDeleter>;

template <class T>
void set_attr(cublasLtMatmulDesc_t d, cublasLtMatmulDescAttributes_t a, const T& v) {
  check_cublas(cublasLtMatmulDescSetAttribute(d, a, &v, sizeof v), "mm");
}
template <class T>
void set_attr(cublasLtMatrixLayout_t l, cublasLtMatrixLayoutAttribute_t a, const T& v) {
  check_cublas(cublasLtMatrixLayoutSetAttribute(l, a, &v, sizeof v), "mm");
}
template <class T>
void set_attr(cublasLtMatmulPreference_t p, cublasLtMatmulPreferenceAttributes_t a, const T& v) {
  check_cublas(cublasLtMatmulPreferenceSetAttribute(p, a, &v, sizeof v), "mm");
}

// The largest power of two (up to 256) dividing every address the library derives from `p`
// with these element offsets: what the heuristic may assume about alignment.
uint32_t alignment(const void* p, int64_t itemsize, std::initializer_list<int64_t> offsets) {
  uint64_t bits = reinterpret_cast<uintptr_t>(p) | 256u;
  for (int64_t o : offsets) bits |= static_cast<uint64_t>(o * itemsize);
  return static_cast<uint32_t>(bits & (~bits + 1));
}

// c = epilogue(alpha * a @ b + beta * c + bias) for `batch` matrices; c is a library output.
struct LtGemm {
  Matrix a, b, c;
  int64_t batch = 1;
  DType dtype = DType::float32;
  Device device;
  Scalar alpha = 1, beta = 0;
  const void* bias = nullptr;  // c.rows elements, added to every column
  bool relu = false;           // fused after the bias (only with a bias)
};

struct AlgoKey {
  std::array<int64_t, 28> v{};
  bool operator==(const AlgoKey&) const = default;
};
struct AlgoKeyHash {
  size_t operator()(const AlgoKey& k) const {
    uint64_t h = 1469598103934665603ull;
    for (int64_t x : k.v) h = (h ^ static_cast<uint64_t>(x)) * 1099511628211ull;
    return static_cast<size_t>(h);
  }
};
struct CachedAlgo {
  bool found = false;
  cublasLtMatmulHeuristicResult_t result{};
};

std::mutex g_algo_mutex;
std::unordered_map<AlgoKey, CachedAlgo, AlgoKeyHash>& algo_cache() {
  static auto* cache = new std::unordered_map<AlgoKey, CachedAlgo, AlgoKeyHash>;
  return *cache;
}

// max_autotune times this many of the heuristics' candidates.
constexpr int kTimedAlgos = 8;
std::atomic<int64_t> g_timed_gemms{0};  // gemm_algorithms_timed()

// max_autotune: times `count` heuristic results with `run(result, d, workspace)`, which writes a
// scratch output `d` of `c_elements` (c itself may be accumulated into: beta != 0) from the real
// operands, and returns the index of the fastest (time_queued_runs, fastest: autotune.h). A
// result cuBLASLt refuses is not a candidate.
template <class Run>
int time_algorithms(const LtGemm& g, const cublasLtMatmulHeuristicResult_t* results, int count, int64_t c_elements,
                    Run run, const std::string& what) {
  if (count < 2) return 0;
  Tensor scratch = kiln::zeros({c_elements}, TensorOptions(g.dtype, g.device));
  void* d = scratch.impl().data();
  std::vector<float> ms;
  std::vector<std::string> labels;
  for (int i = 0; i < count; ++i) {
    const cublasLtMatmulHeuristicResult_t& r = results[i];
    Tensor ws = workspace(static_cast<int64_t>(r.workspaceSize), g.device);
    void* ws_data = ws.defined() ? ws.impl().data() : nullptr;
    ms.push_back(r.state != CUBLAS_STATUS_SUCCESS
                     ? -1.0f
                     : time_queued_runs(g.device.index, current_stream(g.device.index), [&] { return run(r, d, ws_data); }));
    labels.push_back(fmt::format("heuristic{}", i));
  }
  const int best = fastest(ms);
  log_autotune(what, labels, ms, best);
  g_timed_gemms.fetch_add(1, std::memory_order_relaxed);
  return std::max(best, 0);
}

// Runs g on cuBLASLt. Returns false, having done nothing, when cuBLASLt has no algorithm for it
// (an epilogue it does not support for this dtype, say).
bool run_cublaslt(const LtGemm& g, const char* op) {
  constexpr int64_t kMaxBatch = std::numeric_limits<int32_t>::max();
  KILN_CHECK(g.batch <= kMaxBatch, ShapeError,
             std::string("[kiln::") + op +
                 "] cuBLASLt takes at most 2^31 - 1 matrices per batch. Split the batch.");
  const LibraryLayout la = *library_layout(g.a), lb = *library_layout(g.b),
                      lc = *library_layout(g.c);
  const LtTypes types = lt_types(g.dtype);
  const int64_t itemsize = kiln::itemsize(g.dtype);
  const int device = g.device.index;
  const int64_t m = g.c.rows, n = g.c.cols, k = g.a.cols;

  cublasLtMatmulDesc_t raw_desc = nullptr;
  check_cublas(cublasLtMatmulDescCreate(&raw_desc, types.compute, types.scale), op);
  MatmulDesc desc(raw_desc);
  set_attr(raw_desc, CUBLASLT_MATMUL_DESC_TRANSA, la.transposed ? CUBLAS_OP_T : CUBLAS_OP_N);
  set_attr(raw_desc, CUBLASLT_MATMUL_DESC_TRANSB, lb.transposed ? CUBLAS_OP_T : CUBLAS_OP_N);
  cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_DEFAULT;
  if (g.bias != nullptr) {
    epilogue = g.relu ? CUBLASLT_EPILOGUE_RELU_BIAS : CUBLASLT_EPILOGUE_BIAS;
    set_attr(raw_desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, g.bias);
  }
  set_attr(raw_desc, CUBLASLT_MATMUL_DESC_EPILOGUE, epilogue);

  auto make_layout = [&](const LibraryLayout& l, const Matrix& mat) {
    cublasLtMatrixLayout_t raw = nullptr;
    check_cublas(cublasLtMatrixLayoutCreate(&raw, types.data, static_cast<uint64_t>(l.rows),
                                            static_cast<uint64_t>(l.cols), l.ld),
                 op);
    MatrixLayout layout(raw);
    if (g.batch > 1) {
      set_attr(raw, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, static_cast<int32_t>(g.batch));
      set_attr(raw, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, mat.batch_stride);
    }
    return layout;
  };
  MatrixLayout a_layout = make_layout(la, g.a), b_layout = make_layout(lb, g.b),
               c_layout = make_layout(lc, g.c);

  const int64_t a_batch = g.batch > 1 ? g.a.batch_stride : 0,
                b_batch = g.batch > 1 ? g.b.batch_stride : 0,
                c_batch = g.batch > 1 ? g.c.batch_stride : 0;
  // A leading dimension matters only between stored columns.
  auto ld_offset = [](const LibraryLayout& l) { return l.cols > 1 ? l.ld : 0; };
  const uint32_t align_a = alignment(g.a.data, itemsize, {ld_offset(la), a_batch});
  const uint32_t align_b = alignment(g.b.data, itemsize, {ld_offset(lb), b_batch});
  const uint32_t align_c = alignment(g.c.data, itemsize, {ld_offset(lc), c_batch});
  const uint32_t align_bias = g.bias ? alignment(g.bias, itemsize, {}) : 0;
  const uint64_t max_workspace =
      properties(device).major >= 9 ? (uint64_t{32} << 20) : (uint64_t{4} << 20);
  // float16/bfloat16: partial sums of a split K stay in float32, as the CPU's float32 GEMM keeps
  // them.
  const bool half = g.dtype == DType::float16 || g.dtype == DType::bfloat16;
  const uint32_t reduction_mask =
      half ? (CUBLASLT_REDUCTION_SCHEME_NONE | CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE)
           : CUBLASLT_REDUCTION_SCHEME_MASK;

  AlgoKey key;
  key.v = {device,
           static_cast<int64_t>(g.dtype),
           static_cast<int64_t>(types.compute),
           la.transposed,
           lb.transposed,
           m,
           n,
           k,
           la.ld,
           lb.ld,
           lc.ld,
           g.batch,
           a_batch,
           b_batch,
           c_batch,
           static_cast<int64_t>(epilogue),
           align_a,
           align_b,
           align_c,
           align_bias,
           static_cast<int64_t>(max_workspace),
           reduction_mask};
  union {
    float f;
    double d;
  } alpha{}, beta{};
  if (types.scale == CUDA_R_64F) {
    alpha.d = g.alpha.to<double>();
    beta.d = g.beta.to<double>();
  } else {
    alpha.f = g.alpha.to<float>();
    beta.f = g.beta.to<float>();
  }
  cublasLtHandle_t handle = cublaslt_handle(device);
  // max_autotune times the heuristics' candidates. A CUDA graph recording cannot time (timing
  // synchronizes): it takes what its warm-up run timed, else the heuristics' first pick.
  key.v[22] = kiln::kernels::autotune_active();
  CachedAlgo algo;
  bool cached = false;
  {
    std::lock_guard lock(g_algo_mutex);
    auto it = algo_cache().find(key);
    if (it == algo_cache().end() && key.v[22] && capturing(device)) {
      key.v[22] = 0;
      it = algo_cache().find(key);
    }
    if (it != algo_cache().end()) {
      algo = it->second;
      cached = true;
    }
  }
  if (!cached) {
    cublasLtMatmulPreference_t raw_pref = nullptr;
    check_cublas(cublasLtMatmulPreferenceCreate(&raw_pref), op);
    Preference pref(raw_pref);
    set_attr(raw_pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, max_workspace);
    set_attr(raw_pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, align_a);
    set_attr(raw_pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, align_b);
    set_attr(raw_pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, align_c);
    set_attr(raw_pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, align_c);
    set_attr(raw_pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, reduction_mask);
    const bool timed = key.v[22] != 0;
    std::array<cublasLtMatmulHeuristicResult_t, kTimedAlgos> results{};
    int count = 0;
    cublasStatus_t status = cublasLtMatmulAlgoGetHeuristic(
        handle, raw_desc, a_layout.get(), b_layout.get(), c_layout.get(), c_layout.get(), raw_pref,
        timed ? kTimedAlgos : 1, results.data(), &count);
    if (status != CUBLAS_STATUS_NOT_SUPPORTED) check_cublas(status, op);
    algo.found = status == CUBLAS_STATUS_SUCCESS && count > 0;
    if (algo.found) {
      int best = 0;
      if (timed) {
        auto run = [&](const cublasLtMatmulHeuristicResult_t& r, void* d, void* ws) {
          return cublasLtMatmul(handle, raw_desc, &alpha, g.a.data, a_layout.get(), g.b.data, b_layout.get(), &beta,
                                d, c_layout.get(), d, c_layout.get(), &r.algo, ws, r.workspaceSize,
                                current_stream(device)) == CUBLAS_STATUS_SUCCESS;
        };
        const int64_t c_elements = (g.batch - 1) * c_batch + (lc.cols - 1) * lc.ld + lc.rows;
        best = time_algorithms(g, results.data(), count, c_elements, run,
                               fmt::format("gemm m{} n{} k{} batch{} {}{} epilogue{}", m, n, k, g.batch,
                                           la.transposed ? "T" : "N", lb.transposed ? "T" : "N",
                                           static_cast<int>(epilogue)));
      }
      algo.result = results[best];
    }
    std::lock_guard lock(g_algo_mutex);
    if (algo_cache().size() >= 16384)
      algo_cache().clear();  // shapes of a dynamic workload pile up otherwise
    algo_cache()[key] = algo;
  }
  if (!algo.found) return false;

  Tensor ws = workspace(static_cast<int64_t>(algo.result.workspaceSize), g.device);
  check_cublas(
      cublasLtMatmul(handle, raw_desc, &alpha, g.a.data, a_layout.get(), g.b.data, b_layout.get(),
                     &beta, g.c.data, c_layout.get(), g.c.data, c_layout.get(), &algo.result.algo,
                     ws.defined() ? ws.impl().data() : nullptr, algo.result.workspaceSize,
                     current_stream(device)),
      op);
  return true;
}

// ---------------- integers ----------------

// Mirrors the kernel's Params.
struct IntegerGemmParams {
  const void* a;
  const void* b;
  void* c;
  int64_t m, n, k, batch;
  int64_t a_batch, a_row, a_col, b_batch, b_row, b_col, c_batch, c_row, c_col;
  uint64_t alpha, beta;
  int64_t use_beta;
};

constexpr int kIntegerTile = 16;

// c = alpha * a @ b (+ beta * c) in T, wrapping: every product and sum is taken modulo 2^32 (2^64
// for int64) in unsigned arithmetic, whose low bits are what the CPU's wrapping loop computes.
// 16 x 16 output tiles, operands staged through shared memory; one block strides over tiles.
std::string integer_gemm_source(DType t) {
  const bool wide = t == DType::int64;
  return fmt::format(R"(#include <cstdint>
typedef {0} T;
typedef {1} Acc;
struct Params {{
  const char* a; const char* b; char* c;
  long long m, n, k, batch;
  long long a_batch, a_row, a_col, b_batch, b_row, b_col, c_batch, c_row, c_col;
  unsigned long long alpha, beta;
  long long use_beta;
}};
__device__ __forceinline__ Acc widen(T v) {{ return static_cast<Acc>(static_cast<long long>(v)); }}
extern "C" __global__ void __launch_bounds__({2} * {2}) kiln_gemm_integer(Params p) {{
  __shared__ T as[{2}][{2} + 1];
  __shared__ T bs[{2}][{2} + 1];
  const int tx = threadIdx.x % {2}, ty = threadIdx.x / {2};
  const long long tiles_m = (p.m + {2} - 1) / {2}, tiles_n = (p.n + {2} - 1) / {2};
  const long long per_batch = tiles_m * tiles_n, total = per_batch * p.batch;
  const Acc alpha = static_cast<Acc>(p.alpha), beta = static_cast<Acc>(p.beta);
  for (long long tile = blockIdx.x; tile < total; tile += gridDim.x) {{
    const long long batch = tile / per_batch, r = tile - batch * per_batch;
    const long long i = (r / tiles_n) * {2} + ty, j = (r % tiles_n) * {2} + tx;
    const T* a = reinterpret_cast<const T*>(p.a) + batch * p.a_batch;
    const T* b = reinterpret_cast<const T*>(p.b) + batch * p.b_batch;
    Acc acc = 0;
    for (long long k0 = 0; k0 < p.k; k0 += {2}) {{
      const long long ka = k0 + tx, kb = k0 + ty;
      as[ty][tx] = i < p.m && ka < p.k ? a[i * p.a_row + ka * p.a_col] : T(0);
      bs[ty][tx] = kb < p.k && j < p.n ? b[kb * p.b_row + j * p.b_col] : T(0);
      __syncthreads();
#pragma unroll
      for (int kk = 0; kk < {2}; ++kk) acc += widen(as[ty][kk]) * widen(bs[kk][tx]);
      __syncthreads();
    }}
    if (i < p.m && j < p.n) {{
      T* c = reinterpret_cast<T*>(p.c) + batch * p.c_batch + i * p.c_row + j * p.c_col;
      Acc v = alpha * acc;
      if (p.use_beta) v += beta * widen(*c);
      *c = static_cast<T>(v);
    }}
  }}
}}
)",
                     cuda_type(t), wide ? "unsigned long long" : "unsigned int", kIntegerTile);
}

// A Scalar converted to integer dtype t (as Scalar::to<T> converts), as two's-complement bits.
uint64_t integer_bits(const Scalar& s, DType t) {
  switch (t) {
    case DType::uint8:
      return s.to<uint8_t>();
    case DType::int8:
      return static_cast<uint64_t>(static_cast<int64_t>(s.to<int8_t>()));
    case DType::int32:
      return static_cast<uint64_t>(static_cast<int64_t>(s.to<int32_t>()));
    default:
      return static_cast<uint64_t>(s.to<int64_t>());
  }
}

void integer_gemm(const Tensor& a, const Tensor& b, Tensor& out, const Scalar& alpha,
                  const Scalar& beta) {
  const DType t = out.dtype();
  const Matrix ma = matrix_of(a), mb = matrix_of(b), mc = matrix_of(out);
  const int64_t batch = out.dim() == 3 ? out.sizes()[0] : 1;
  IntegerGemmParams p{ma.data,
                      mb.data,
                      mc.data,
                      mc.rows,
                      mc.cols,
                      ma.cols,
                      batch,
                      ma.batch_stride,
                      ma.row_stride,
                      ma.col_stride,
                      mb.batch_stride,
                      mb.row_stride,
                      mb.col_stride,
                      mc.batch_stride,
                      mc.row_stride,
                      mc.col_stride,
                      integer_bits(alpha, t),
                      integer_bits(beta, t),
                      0};
  p.use_beta = p.beta !=
               0;  // CPU: beta converted to T, and 0 ignores c (NaN-free, but also uninitialized c)
  const int device = out.device().index;
  JitFunction f = jit_function(device, std::string("gemm_integer|") + cuda_type(t),
                               "kiln_gemm_integer", [&] { return integer_gemm_source(t); });
  const int64_t tiles = batch * ((mc.rows + kIntegerTile - 1) / kIntegerTile) *
                        ((mc.cols + kIntegerTile - 1) / kIntegerTile);
  const int64_t blocks =
      std::min<int64_t>(tiles, int64_t{properties(device).multiProcessorCount} * 8);
  void* args[] = {&p};
  launch(f, static_cast<unsigned>(blocks), kIntegerTile * kIntegerTile, 0, current_stream(device),
         args);
  check_launch("mm");
}

// ---------------- the ops ----------------

// out = alpha * a @ b + beta * self (self broadcast to out; ignored when undefined or beta == 0),
// then relu when asked, over 2-D or 3-D (batched) operands of out's dtype on out's device.
void addmm_into(const char* op, Tensor a, Tensor b, Tensor& out, const Scalar& alpha,
                const Scalar& beta, const Tensor& self, bool relu) {
  if (out.numel() == 0) return;
  const bool use_self = self.defined() && beta.to_double() != 0.0;
  const DType t = out.dtype();
  DeviceGuard guard(out.device().index);
  if (!is_floating_point(t)) {
    if (use_self) out.copy_(self);
    integer_gemm(a, b, out, alpha, use_self ? beta : Scalar(0));
    if (relu) out.relu_();
    return;
  }
  if (a.sizes().back() == 0) {  // an empty sum: beta * self, or zeros
    if (!use_self)
      out.zero_();
    else {
      out.copy_(self);
      if (beta.to_double() != 1.0) out.mul_(beta);
    }
    if (relu) out.relu_();
    return;
  }
  if (!library_layout(matrix_of(a))) a = a.contiguous();
  if (!library_layout(matrix_of(b))) b = b.contiguous();
  const Matrix ma = matrix_of(a), mb = matrix_of(b), mc = matrix_of(out);
  const bool as_is = is_library_output(mc), swapped = is_library_output(mc.transposed());
  if (!as_is && !swapped) {  // no library layout for the output: compute into a dense one
    Tensor dense = kiln::detail::make_empty(out.sizes().vec(), t, out.device());
    addmm_into(op, a, b, dense, alpha, beta, self, relu);
    out.copy_(dense);
    return;
  }
  const int64_t batch = out.dim() == 3 ? out.sizes()[0] : 1;
  auto problem = [&](bool swap) {
    LtGemm g;
    if (swap) {  // C^T = B^T A^T: row-major C is a column-major C^T
      g.a = mb.transposed();
      g.b = ma.transposed();
      g.c = mc.transposed();
    } else {
      g.a = ma;
      g.b = mb;
      g.c = mc;
    }
    g.batch = batch;
    g.dtype = t;
    g.device = out.device();
    g.alpha = alpha;
    return g;
  };
  // The bias epilogue: self a vector along the library output's rows (stride 1 there, broadcast
  // along its columns), added with beta == 1.
  if (use_self && beta.to_double() == 1.0 && out.dim() == 2 && self.is_cuda() &&
      self.dtype() == t) {
    const int64_t m = out.sizes()[0], n = out.sizes()[1];
    const std::vector<int64_t> bs =
        kiln::detail::broadcast_strides(self.sizes(), self.strides(), out.sizes());
    const bool row_vector = (m == 1 || bs[0] == 0) && (n == 1 || bs[1] == 1);     // rows of C^T
    const bool column_vector = (n == 1 || bs[1] == 0) && (m == 1 || bs[0] == 1);  // rows of C
    std::optional<bool> swap;
    if (row_vector && swapped)
      swap = true;
    else if (column_vector && as_is)
      swap = false;
    if (swap) {
      LtGemm g = problem(*swap);
      g.bias = self.impl().data();
      g.relu = relu;
      if (run_cublaslt(g, op)) return;
    }
  }
  LtGemm g = problem(!as_is);
  if (use_self) {
    out.copy_(self);
    g.beta = beta;
  }
  KILN_CHECK(run_cublaslt(g, op), Error,
             std::string("[kiln::") + op + "] cuBLASLt found no algorithm for this " +
                 std::string(dtype_name(t)) +
                 " product. This is a Kiln bug: please report the shapes and strides.");
  if (relu) out.relu_();
}

void mm_kernel(const OpCall& call, std::span<Tensor> outs) {
  addmm_into(call.name().c_str(), call.input(0), call.input(1), outs[0], 1, 0, Tensor(), false);
}

template <bool kRelu>
void addmm_kernel(const OpCall& call, std::span<Tensor> outs) {
  addmm_into(call.name().c_str(), call.input(1), call.input(2), outs[0], call.scalar_attr(1),
             call.scalar_attr(0), call.input(0), kRelu);
}

void dot_kernel(const OpCall& call, std::span<Tensor> outs) {
  Tensor out = outs[0].view({1, 1});
  addmm_into("dot", call.input(0).unsqueeze(0), call.input(1).unsqueeze(1), out, 1, 0, Tensor(),
             false);
}

[[maybe_unused]] const bool registered = [] {
  register_kernel("mm", DeviceType::cuda, mm_kernel);
  register_kernel("bmm", DeviceType::cuda, mm_kernel);
  register_kernel("addmm", DeviceType::cuda, addmm_kernel<false>);
  register_kernel("addmm_relu", DeviceType::cuda, addmm_kernel<true>);
  register_kernel("dot", DeviceType::cuda, dot_kernel);
  return true;
}();

}  // namespace

int64_t gemm_algorithms_timed() { return g_timed_gemms.load(std::memory_order_relaxed); }

std::string integer_gemm_source_for_test(DType t) {
  return integer_gemm_source(t);
}

}  // namespace kiln::cuda::detail
