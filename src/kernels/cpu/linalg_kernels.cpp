// CPU kernels for mm, bmm, addmm, addmm_relu and dot.
//
// Operands are handed to GEMM as they are whenever their strides allow it (a transposed or
// row-sliced matrix becomes a transposed/leading-dimension argument, a column-major output is
// computed as C^T = B^T A^T); only layouts GEMM cannot express are copied.
//
// float32 runs on oneDNN's sgemm by default: Debian's OpenBLAS 0.3.21 detects this AVX-512 CPU as
// Haswell and runs at half oneDNN's speed. KILN_GEMM=openblas switches float32 back to
// cblas_sgemm. float64 uses cblas_dgemm; float16/bfloat16 compute in float32; integers use a
// plain loop that wraps around like PyTorch's.
#include <cblas.h>
#include <oneapi/dnnl/dnnl.h>

#include <cstdlib>
#include <cstring>
#include <limits>
#include <optional>
#include <string_view>

#include "kernels/cpu/loops.h"
#include "core/tensor_factory.h"
#include "kiln/op_table.h"
#include "kiln/ops.h"

namespace kiln::cpu {

namespace {

bool float32_gemm_uses_openblas() {
  static const bool openblas = [] {
    const char* v = std::getenv("KILN_GEMM");
    return v != nullptr && std::string_view(v) == "openblas";
  }();
  return openblas;
}

// A matrix operand: element pointer, sizes and element strides.
template <class T>
struct Matrix {
  T* data;
  int64_t rows, cols, row_stride, col_stride;

  T& at(int64_t i, int64_t j) const { return data[i * row_stride + j * col_stride]; }
  Matrix transposed() const { return {data, cols, rows, col_stride, row_stride}; }
};

// How a strided matrix is passed to a row-major GEMM without a copy.
struct BlasLayout {
  bool transposed;  // stored column-major: pass as the transpose of a row-major (cols x rows)
  int64_t ld;
};

std::optional<BlasLayout> blas_layout(int64_t rows, int64_t cols, int64_t rs, int64_t cs) {
  constexpr int64_t kMaxInt = std::numeric_limits<int>::max();  // cblas takes int sizes
  if (rows > kMaxInt || cols > kMaxInt) return std::nullopt;
  auto valid = [&](int64_t ld, int64_t minimum) { return ld >= std::max<int64_t>(1, minimum) && ld <= kMaxInt; };
  if (cs == 1 || cols == 1) {
    int64_t ld = rows == 1 ? std::max<int64_t>(1, cols) : rs;
    if (valid(ld, cols)) return BlasLayout{false, ld};
  }
  if (rs == 1 || rows == 1) {
    int64_t ld = cols == 1 ? std::max<int64_t>(1, rows) : cs;
    if (valid(ld, rows)) return BlasLayout{true, ld};
  }
  return std::nullopt;
}

template <class T>
std::optional<BlasLayout> blas_layout(const Matrix<T>& m) {
  return blas_layout(m.rows, m.cols, m.row_stride, m.col_stride);
}

// Whether oneDNN's sgemm should compute C = A B^T as C^T = B A^T instead. With B transposed (a
// Linear's weight) and A of 16 to 64 rows (a Linear at batch 16 to 64), oneDNN 2.6's AVX-512 sgemm
// runs 2-8x slower than the transposed product and slows down as threads are added: 16x1024 times
// 1024x1000 (DenseNet's classifier) took 397 us on one thread and 800 us on two, against 184 and
// 96 us transposed (kiln_bench_ops Matmul_Classifier). Fewer rows, or small K or N, run as fast
// or faster directly; held to AVX2, both ways take about the same time (0.8-1.3x).
bool gemm_faster_transposed(bool ta, bool tb, int64_t m, int64_t n, int64_t k) {
  return !ta && tb && m >= 16 && m <= 64 && k >= 512 && n >= 256;
}

template <class T>
void raw_gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, T alpha, const T* a, int64_t lda,
              const T* b, int64_t ldb, T beta, T* c, int64_t ldc) {
  const auto cta = ta ? CblasTrans : CblasNoTrans, ctb = tb ? CblasTrans : CblasNoTrans;
  const int im = static_cast<int>(m), in = static_cast<int>(n), ik = static_cast<int>(k);
  if constexpr (std::is_same_v<T, float>) {
    if (!float32_gemm_uses_openblas() && gemm_faster_transposed(ta, tb, m, n, k)) {
      // C^T (n x m, row-major) = B (n x k as stored) times A^T, then transposed into C.
      std::vector<float> ct(static_cast<size_t>(n * m));
      if (beta != 0.0f)
        for (int64_t i = 0; i < m; ++i)
          for (int64_t j = 0; j < n; ++j) ct[static_cast<size_t>(j * m + i)] = c[i * ldc + j];
      if (dnnl_sgemm('N', 'T', n, m, k, alpha, b, ldb, a, lda, beta, ct.data(), m) == dnnl_success) {
        for (int64_t i = 0; i < m; ++i)
          for (int64_t j = 0; j < n; ++j) c[i * ldc + j] = ct[static_cast<size_t>(j * m + i)];
        return;
      }
    }
    if (!float32_gemm_uses_openblas() &&
        dnnl_sgemm(ta ? 'T' : 'N', tb ? 'T' : 'N', m, n, k, alpha, a, lda, b, ldb, beta, c, ldc) ==
            dnnl_success)
      return;
    cblas_sgemm(CblasRowMajor, cta, ctb, im, in, ik, alpha, a, static_cast<int>(lda), b,
                static_cast<int>(ldb), beta, c, static_cast<int>(ldc));
  } else {
    cblas_dgemm(CblasRowMajor, cta, ctb, im, in, ik, alpha, a, static_cast<int>(lda), b,
                static_cast<int>(ldb), beta, c, static_cast<int>(ldc));
  }
}

template <class T>
void scale_matrix(const Matrix<T>& c, T beta) {
  for (int64_t i = 0; i < c.rows; ++i)
    for (int64_t j = 0; j < c.cols; ++j) c.at(i, j) = beta == T(0) ? T(0) : static_cast<T>(beta * c.at(i, j));
}

// Row-major contiguous copy of m.
template <class T>
std::vector<std::remove_const_t<T>> packed(const Matrix<T>& m) {
  std::vector<std::remove_const_t<T>> out(static_cast<size_t>(m.rows * m.cols));
  for (int64_t i = 0; i < m.rows; ++i)
    for (int64_t j = 0; j < m.cols; ++j) out[i * m.cols + j] = m.at(i, j);
  return out;
}

// Whether gemm_blas can run these operands without temporary copies.
template <class T>
bool needs_no_copies(const Matrix<const T>& a, const Matrix<const T>& b, const Matrix<T>& c) {
  return blas_layout(a) && blas_layout(b) && blas_layout(c);
}

// C = alpha * A @ B + beta * C (beta == 0 overwrites C) for float and double.
template <class T>
void gemm_blas(Matrix<const T> a, Matrix<const T> b, Matrix<T> c, T alpha, T beta) {
  if (c.rows == 0 || c.cols == 0) return;
  if (a.cols == 0) return scale_matrix(c, beta);
  auto lc = blas_layout(c);
  if (!lc) {
    std::vector<T> tmp = beta == T(0) ? std::vector<T>(static_cast<size_t>(c.rows * c.cols)) : packed(c);
    gemm_blas(a, b, Matrix<T>{tmp.data(), c.rows, c.cols, c.cols, 1}, alpha, beta);
    for (int64_t i = 0; i < c.rows; ++i)
      for (int64_t j = 0; j < c.cols; ++j) c.at(i, j) = tmp[i * c.cols + j];
    return;
  }
  if (lc->transposed) return gemm_blas(b.transposed(), a.transposed(), c.transposed(), alpha, beta);
  std::vector<T> a_copy, b_copy;
  auto la = blas_layout(a);
  if (!la) {
    a_copy = packed(a);
    a = {a_copy.data(), a.rows, a.cols, a.cols, 1};
    la = BlasLayout{false, std::max<int64_t>(1, a.cols)};
  }
  auto lb = blas_layout(b);
  if (!lb) {
    b_copy = packed(b);
    b = {b_copy.data(), b.rows, b.cols, b.cols, 1};
    lb = BlasLayout{false, std::max<int64_t>(1, b.cols)};
  }
  raw_gemm<T>(la->transposed, lb->transposed, c.rows, c.cols, a.cols, alpha, a.data, la->ld, b.data,
              lb->ld, beta, c.data, lc->ld);
}

// C = alpha * A @ B + beta * C for integers, accumulating in T (wraps on overflow, like PyTorch).
template <class T>
void gemm_loop(Matrix<const T> a, Matrix<const T> b, Matrix<T> c, T alpha, T beta) {
  const int64_t n = c.rows, p = c.cols, k = a.cols;
  if (n == 0 || p == 0) return;
  std::vector<T> acc(static_cast<size_t>(n * p), T(0));
  int64_t grain = std::max<int64_t>(1, kGrainSize / std::max<int64_t>(1, k * p));
  parallel_for(n, grain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      T* __restrict row = acc.data() + i * p;
      for (int64_t kk = 0; kk < k; ++kk) {
        const T aik = a.at(i, kk);
        const T* brow = &b.at(kk, 0);
        const int64_t bs = b.col_stride;
        if (bs == 1) {
#pragma omp simd
          for (int64_t j = 0; j < p; ++j) row[j] = static_cast<T>(row[j] + aik * brow[j]);
        } else {
          for (int64_t j = 0; j < p; ++j) row[j] = static_cast<T>(row[j] + aik * brow[j * bs]);
        }
      }
      for (int64_t j = 0; j < p; ++j)
        c.at(i, j) = static_cast<T>(alpha * row[j] + (beta == T(0) ? T(0) : static_cast<T>(beta * c.at(i, j))));
    }
  });
}

// The i-th matrix of a 2-D (one batch) or 3-D (batched) tensor.
template <class T>
Matrix<T> batch_matrix(const Tensor& t, int64_t i) {
  const int64_t d = t.dim();
  T* base = static_cast<T*>(t.impl().data());
  if (d == 3) base += i * t.strides()[0];
  return {base, t.sizes()[d - 2], t.sizes()[d - 1], t.strides()[d - 2], t.strides()[d - 1]};
}

template <class T>
void batched_gemm_typed(const Tensor& a, const Tensor& b, Tensor& out, T alpha, T beta) {
  const int64_t nbatch = out.dim() == 3 ? out.sizes()[0] : 1;
  auto run = [&](int64_t i) {
    Matrix<const T> ma = batch_matrix<const T>(a, i), mb = batch_matrix<const T>(b, i);
    Matrix<T> mc = batch_matrix<T>(out, i);
    if constexpr (std::is_floating_point_v<T>) gemm_blas(ma, mb, mc, alpha, beta);
    else gemm_loop(ma, mb, mc, alpha, beta);
  };
  if constexpr (std::is_floating_point_v<T>) {
    // Many small products: one GEMM per thread beats threading inside each one. Only layouts that
    // need no temporaries run there, so nothing inside the parallel region allocates or throws.
    const int64_t flops = out.sizes()[out.dim() - 2] * out.sizes()[out.dim() - 1] * a.sizes()[a.dim() - 1];
    if (nbatch > 1 && flops < (int64_t{1} << 18) &&
        needs_no_copies(batch_matrix<const T>(a, 0), batch_matrix<const T>(b, 0), batch_matrix<T>(out, 0))) {
      parallel_for(nbatch, std::max<int64_t>(1, (int64_t{1} << 18) / std::max<int64_t>(1, flops)),
                   [&](int64_t begin, int64_t end) {
                     for (int64_t i = begin; i < end; ++i) run(i);
                   });
      return;
    }
  }
  for (int64_t i = 0; i < nbatch; ++i) run(i);
}

// out = alpha * a @ b + beta * out over 2-D or 3-D (batched) operands of out's dtype.
void batched_gemm(const Tensor& a, const Tensor& b, Tensor& out, const Scalar& alpha, const Scalar& beta) {
  const DType t = out.dtype();
  if (t == DType::float16 || t == DType::bfloat16) {
    Tensor a32 = a.to(kFloat32), b32 = b.to(kFloat32);
    Tensor o32 = beta.to_double() == 0.0 ? detail::make_empty(out.sizes().vec(), kFloat32, out.device())
                                         : out.to(kFloat32, /*copy=*/true);
    batched_gemm_typed<float>(a32, b32, o32, alpha.to<float>(), beta.to<float>());
    out.copy_(o32);
    return;
  }
  KILN_DISPATCH_NUMERIC(t, "mm", [&] {
    if constexpr (std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, double> ||
                  std::is_integral_v<scalar_t>) {
      batched_gemm_typed<scalar_t>(a, b, out, alpha.to<scalar_t>(), beta.to<scalar_t>());
    }
  });
}

void mm_kernel(const OpCall& call, std::span<Tensor> outs) {
  batched_gemm(call.input(0), call.input(1), outs[0], 1, 0);
}

// out = self broadcast over out's rows, when self is one contiguous row of out's dtype (a Linear's
// bias): a copy per row. The general broadcasting copy_ costs several times the GEMM of a small
// Linear (measured: a 40x128 @ 128x384 Linear on one thread spent as long in the copy as in sgemm).
bool copy_bias_rows(const Tensor& self, Tensor& out) {
  if (out.dim() != 2 || !out.is_contiguous() || !self.is_contiguous() || self.dtype() != out.dtype()) return false;
  const int64_t rows = out.sizes()[0], cols = out.sizes()[1];
  const bool row = (self.dim() == 1 && self.sizes()[0] == cols) ||
                   (self.dim() == 2 && self.sizes()[0] == 1 && self.sizes()[1] == cols);
  if (!row) return false;
  const size_t bytes = static_cast<size_t>(cols) * static_cast<size_t>(itemsize(out.dtype()));
  const char* src = static_cast<const char*>(self.impl().data());
  char* dst = static_cast<char*>(out.impl().data());
  if (src + bytes > dst && dst + static_cast<size_t>(rows) * bytes > src) return false;  // self overlaps out
  for (int64_t i = 0; i < rows; ++i) std::memcpy(dst + static_cast<size_t>(i) * bytes, src, bytes);
  return true;
}

void addmm_kernel(const OpCall& call, std::span<Tensor> outs) {
  const Scalar& beta = call.scalar_attr(0);
  const Scalar& alpha = call.scalar_attr(1);
  const bool use_self = beta.to_double() != 0.0;
  if (use_self && !copy_bias_rows(call.input(0), outs[0])) outs[0].copy_(call.input(0));  // broadcasts self
  batched_gemm(call.input(1), call.input(2), outs[0], alpha, use_self ? beta : Scalar(0));
}

// The relu runs in place on the GEMM's result while it is still in cache: measured as free next
// to the GEMM (512x1024 @ 1024x1024, 2 threads), where a separate relu op costs ~2.5%. (With
// oneDNN's matmul primitive the relu would be a post-op; the GEMMs here run dnnl_sgemm.)
void addmm_relu_kernel(const OpCall& call, std::span<Tensor> outs) {
  addmm_kernel(call, outs);
  outs[0].relu_();
}

template <class T>
T dot_typed(const Tensor& a, const Tensor& b) {
  const int64_t n = a.numel();
  const int64_t sa = n > 0 ? a.strides()[0] : 1, sb = n > 0 ? b.strides()[0] : 1;
  const T* pa = static_cast<const T*>(a.impl().data());
  const T* pb = static_cast<const T*>(b.impl().data());
  constexpr int64_t kMaxInt = std::numeric_limits<int>::max();
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double>) {
    if (n > 0 && n <= kMaxInt && sa > 0 && sb > 0 && sa <= kMaxInt && sb <= kMaxInt) {
      if constexpr (std::is_same_v<T, float>)
        return cblas_sdot(static_cast<int>(n), pa, static_cast<int>(sa), pb, static_cast<int>(sb));
      else
        return cblas_ddot(static_cast<int>(n), pa, static_cast<int>(sa), pb, static_cast<int>(sb));
    }
  }
  opmath_t<T> acc{0};
  for (int64_t i = 0; i < n; ++i)
    acc = static_cast<opmath_t<T>>(acc + static_cast<opmath_t<T>>(pa[i * sa]) * static_cast<opmath_t<T>>(pb[i * sb]));
  return static_cast<T>(acc);
}

void dot_kernel(const OpCall& call, std::span<Tensor> outs) {
  KILN_DISPATCH_NUMERIC(outs[0].dtype(), "dot", [&] {
    *static_cast<scalar_t*>(outs[0].impl().data()) = dot_typed<scalar_t>(call.input(0), call.input(1));
  });
}

[[maybe_unused]] const bool registered = [] {
  register_kernel("mm", DeviceType::cpu, mm_kernel);
  register_kernel("bmm", DeviceType::cpu, mm_kernel);
  register_kernel("addmm", DeviceType::cpu, addmm_kernel);
  register_kernel("addmm_relu", DeviceType::cpu, addmm_relu_kernel);
  register_kernel("dot", DeviceType::cpu, dot_kernel);
  return true;
}();

}  // namespace

}  // namespace kiln::cpu
