// The library-backed CUDA kernels: mm, bmm, addmm, addmm_relu and dot on cuBLASLt (integers on
// an NVRTC kernel), conv2d, conv2d_relu, conv2d_bn and convolution_backward on cuDNN, against
// float64 references computed by the CPU kernels from the same (rounded) inputs, and bitwise
// against the CPU kernels for integers. GPU tests skip when no GPU is visible; the NVRTC and
// registration tests run wherever the toolkit is installed.
//
// Floating results are checked elementwise as |got - want| <= tol * bound, where bound is the
// same product computed on absolute values (|A| |B|, conv(|x|, |w|) + |b|): the rounding error of
// a sum is proportional to the sum of the magnitudes of its terms, not to the result.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>

#include <cmath>
#include <string>
#include <vector>

#include "cuda_test_helpers.h"
#include "kiln/kiln.h"
#include "kiln/op_table.h"
#include "reference.h"

#ifdef KILN_WITH_CUDA
#include "kernels/cuda/gemm_kernels.h"
#ifdef KILN_WITH_CUDNN
#include "kernels/cuda/conv_graph.h"
#include "kernels/cuda/conv_kernels.h"
#endif
#include "kernels/cuda/jit.h"
#include "kernels/cuda/library_handles.h"
#endif

using namespace kiln;
using kiln::testing::op;

#define SKIP_WITHOUT_CUDNN() \
  SKIP_WITHOUT_GPU();        \
  if (!op("conv2d").has_kernel(DeviceType::cuda)) GTEST_SKIP() << "built without cuDNN"

// ---- registration, in any build ----

TEST(CudaLibraryKernels, AreRegisteredForTheGemmAndConvolutionOps) {
#ifndef KILN_WITH_CUDA
  GTEST_SKIP() << "built without CUDA";
#else
  for (const char* name : {"mm", "bmm", "addmm", "addmm_relu", "dot"})
    EXPECT_TRUE(op(name).has_kernel(DeviceType::cuda)) << name;
#ifdef KILN_WITH_CUDNN
  for (const char* name : {"conv2d", "conv2d_relu", "conv2d_bn", "convolution_backward"})
    EXPECT_TRUE(op(name).has_kernel(DeviceType::cuda)) << name;
#endif
#endif
}

#ifdef KILN_WITH_CUDA

namespace {

const std::vector<DType> kFloatDTypes = {kFloat32, kFloat64, kFloat16, kBFloat16};

// Tolerance relative to the magnitude bound, per dtype (float32: exact float32 math).
double tol(DType t) {
  switch (t) {
    case DType::float64:
      return 1e-12;
    case DType::float16:
      return 2e-3;
    case DType::bfloat16:
      return 1e-2;
    default:
      return 1e-5;
  }
}
constexpr double kTf32Tol = 5e-3;

Tensor random64(std::vector<int64_t> sizes, uint64_t seed) {
  manual_seed(seed);
  return randn(sizes, kFloat64);
}

// Integers every integer dtype holds, large enough that products wrap around in 8 bits.
Tensor random_integers(std::vector<int64_t> sizes, DType t, int seed) {
  int64_t n = 1;
  for (int64_t s : sizes) n *= s;
  std::vector<int64_t> v(static_cast<size_t>(n));
  const bool is_unsigned = t == DType::uint8;
  for (int64_t i = 0; i < n; ++i) {
    int64_t x = (i * 7919 + seed * 104729) % 251;
    v[i] = is_unsigned ? x : x - 125;
  }
  return tensor<int64_t>(v, sizes).to(t);
}

// |got - want| <= tol * bound elementwise, with got on the GPU in the expected dtype.
::testing::AssertionResult within(const Tensor& got, const Tensor& want, const Tensor& bound,
                                  double rel) {
  if (!got.is_cuda())
    return ::testing::AssertionFailure() << "the result is on " << got.device().str();
  if (got.sizes() != want.sizes())
    return ::testing::AssertionFailure()
           << "shape " << shape_str(got.sizes()) << " != " << shape_str(want.sizes());
  auto g = got.to_vector<double>(), w = want.to_vector<double>(), b = bound.to_vector<double>();
  for (size_t i = 0; i < g.size(); ++i) {
    if (!(std::abs(g[i] - w[i]) <= rel * b[i] + 1e-300))
      return ::testing::AssertionFailure() << "element " << i << ": got " << g[i] << ", expected "
                                           << w[i] << " (bound " << b[i] << ", rel " << rel << ")";
  }
  return ::testing::AssertionSuccess();
}

// Bitwise equality of values, dtype and shape.
::testing::AssertionResult same(const Tensor& a, const Tensor& b) {
  if (a.dtype() != b.dtype()) return ::testing::AssertionFailure() << "dtypes differ";
  if (a.sizes() != b.sizes()) return ::testing::AssertionFailure() << "shapes differ";
  auto va = a.to_vector<double>(), vb = b.to_vector<double>();
  for (size_t i = 0; i < va.size(); ++i)
    if (va[i] != vb[i])
      return ::testing::AssertionFailure() << "element " << i << ": " << va[i] << " vs " << vb[i];
  return ::testing::AssertionSuccess();
}

Tensor f64(const Tensor& t) {
  return t.to(kCPU).to(kFloat64);
}

// Sets the float32 precision settings for one scope.
struct PrecisionGuard {
  cuda::detail::MatmulPrecision matmul = cuda::detail::float32_matmul_precision();
  bool conv_tf32 = cuda::detail::cudnn_allow_tf32();
  PrecisionGuard(cuda::detail::MatmulPrecision m, bool tf32) {
    cuda::detail::set_float32_matmul_precision(m);
    cuda::detail::set_cudnn_allow_tf32(tf32);
  }
  ~PrecisionGuard() {
    cuda::detail::set_float32_matmul_precision(matmul);
    cuda::detail::set_cudnn_allow_tf32(conv_tf32);
  }
};
constexpr auto kHighest = cuda::detail::MatmulPrecision::highest;

// A view of a (rows x cols) operand made from a tensor of the same dtype and device: the layouts
// the kernels must accept.
enum class Layout { contiguous, transposed, row_sliced, column_strided, expanded };
const std::vector<Layout> kLayouts = {Layout::contiguous, Layout::transposed, Layout::row_sliced,
                                      Layout::column_strided, Layout::expanded};

// The base tensor a layout's view is taken from, as float64 values.
Tensor layout_base(Layout l, int64_t rows, int64_t cols, uint64_t seed) {
  switch (l) {
    case Layout::transposed:
      return random64({cols, rows}, seed);
    case Layout::row_sliced:
      return random64({rows, cols + 3}, seed);
    case Layout::column_strided:
      return random64({rows, 2 * cols}, seed);
    case Layout::expanded:
      return random64({rows, 1}, seed);
    default:
      return random64({rows, cols}, seed);
  }
}

Tensor layout_view(Layout l, const Tensor& base, int64_t rows, int64_t cols) {
  switch (l) {
    case Layout::transposed:
      return base.t();
    case Layout::row_sliced:
      return base.narrow(1, 1, cols);  // ld > cols, pointer off by one element
    case Layout::column_strided:
      return base.slice(1, 0, 2 * cols, 2);
    case Layout::expanded:
      return base.expand({rows, cols});
    default:
      return base;
  }
}

}  // namespace

// ---- without a GPU ----

TEST(CudaJit, IntegerGemmKernelCompilesForEveryIntegerDType) {
  for (DType t : {DType::uint8, DType::int8, DType::int32, DType::int64}) {
    std::string src = cuda::detail::integer_gemm_source_for_test(t);
    std::string cubin = cuda::detail::compile_cubin(
        src, 90, std::string("gemm_integer_") + std::string(dtype_name(t)));
    EXPECT_GT(cubin.size(), 1000u) << dtype_name(t);
  }
}

#ifdef KILN_WITH_CUDNN
TEST(CudaJit, ConvolutionBiasGradientKernelCompilesForEveryFloatDType) {
  for (DType t : {kFloat16, kBFloat16, kFloat32, kFloat64}) {
    std::string src = cuda::detail::conv_bias_grad_source_for_test(t);
    std::string cubin = cuda::detail::compile_cubin(
        src, 90, std::string("conv_bias_grad_") + std::string(dtype_name(t)));
    EXPECT_GT(cubin.size(), 1000u) << dtype_name(t);
  }
}
#endif

TEST(CudaLibraryKernels, PrecisionSettingsRoundTrip) {
  PrecisionGuard guard(cuda::detail::MatmulPrecision::high, false);
  EXPECT_EQ(cuda::detail::float32_matmul_precision(), cuda::detail::MatmulPrecision::high);
  EXPECT_FALSE(cuda::detail::cudnn_allow_tf32());
  cuda::detail::set_float32_matmul_precision(kHighest);
  cuda::detail::set_cudnn_allow_tf32(true);
  EXPECT_EQ(cuda::detail::float32_matmul_precision(), kHighest);
  EXPECT_TRUE(cuda::detail::cudnn_allow_tf32());
}

// ---- GEMM on a GPU ----

TEST(CudaGemm, MmMatchesTheFloat64ReferenceForEveryFloatDTypeAndLayout) {
  SKIP_WITHOUT_GPU();
  PrecisionGuard exact(kHighest, true);
  const std::vector<std::array<int64_t, 3>> shapes = {{1, 1, 1},      {7, 5, 3},   {33, 17, 65},
                                                      {128, 64, 256}, {1, 300, 1}, {64, 1, 40}};
  for (DType t : kFloatDTypes) {
    for (auto [m, k, n] : shapes) {
      for (Layout la : kLayouts) {
        for (Layout lb :
             {Layout::contiguous, Layout::transposed, Layout::row_sliced, Layout::column_strided}) {
          const std::string label = std::string(dtype_name(t)) + " " + std::to_string(m) + "x" +
                                    std::to_string(k) + "x" + std::to_string(n) + " layouts " +
                                    std::to_string(int(la)) + "," + std::to_string(int(lb));
          Tensor base_a = layout_base(la, m, k, 1).to(t), base_b = layout_base(lb, k, n, 2).to(t);
          Tensor a = layout_view(la, base_a.cuda(), m, k), b = layout_view(lb, base_b.cuda(), k, n);
          Tensor a64 = f64(layout_view(la, base_a, m, k)), b64 = f64(layout_view(lb, base_b, k, n));
          Tensor got = mm(a, b);
          EXPECT_EQ(got.dtype(), t) << label;
          EXPECT_TRUE(within(got, mm(a64, b64), mm(a64.abs(), b64.abs()), tol(t))) << label;
        }
      }
    }
  }
}

TEST(CudaGemm, ResultsWrittenIntoTransposedAndStridedOutputs) {
  SKIP_WITHOUT_GPU();
  PrecisionGuard exact(kHighest, true);
  const int64_t m = 9, k = 13, n = 6;
  for (DType t : {kFloat32, kFloat16}) {
    Tensor a = random64({m, k}, 3).to(t), b = random64({k, n}, 4).to(t);
    Tensor want = mm(f64(a), f64(b)), bound = mm(f64(a).abs(), f64(b).abs());
    Tensor column_major = empty({n, m}, TensorOptions(t, cuda_device())).t();
    Tensor strided = empty({m, 2 * n}, TensorOptions(t, cuda_device())).slice(1, 0, 2 * n, 2);
    for (Tensor out : {column_major, strided}) {
      Tensor outs[1] = {out};
      call_op_out(op("mm"), {a.cuda(), b.cuda()}, {}, outs);
      EXPECT_TRUE(within(out, want, bound, tol(t)))
          << dtype_name(t) << " strides " << shape_str(out.strides());
    }
  }
}

TEST(CudaGemm, BmmOverBatchesIncludingBroadcastAndPermutedOnes) {
  SKIP_WITHOUT_GPU();
  PrecisionGuard exact(kHighest, true);
  const int64_t batch = 5, m = 12, k = 7, n = 10;
  for (DType t : kFloatDTypes) {
    Tensor a_base = random64({batch, m, k}, 5).to(t), b_base = random64({batch, k, n}, 6).to(t);
    Tensor a_one = random64({1, m, k}, 7).to(t), b_perm = random64({k, batch, n}, 8).to(t);
    Tensor a_t = random64({batch, k, m}, 9).to(t);
    struct Case {
      std::string name;
      Tensor a, b;
    };
    std::vector<Case> cases = {
        {"contiguous", a_base, b_base},
        {"transposed a", a_t.transpose(1, 2), b_base},
        {"broadcast batch of a", a_one.expand({batch, m, k}), b_base},
        {"permuted b", a_base, b_perm.permute({1, 0, 2})},
    };
    for (const Case& c : cases) {
      Tensor a_dev = c.a.cuda(), b_dev = c.b.cuda();
      // Rebuild the views on the device where the upload made them dense.
      if (c.name == "transposed a") a_dev = a_t.cuda().transpose(1, 2);
      if (c.name == "broadcast batch of a") a_dev = a_one.cuda().expand({batch, m, k});
      if (c.name == "permuted b") b_dev = b_perm.cuda().permute({1, 0, 2});
      Tensor got = bmm(a_dev, b_dev);
      Tensor a64 = f64(c.a), b64 = f64(c.b);
      EXPECT_TRUE(within(got, bmm(a64, b64), bmm(a64.abs(), b64.abs()), tol(t)))
          << dtype_name(t) << " " << c.name;
    }
    // matmul broadcasts batch dims through bmm.
    Tensor x = random64({2, 1, m, k}, 10).to(t), y = random64({3, k, n}, 11).to(t);
    Tensor got = matmul(x.cuda(), y.cuda());
    EXPECT_TRUE(within(got, matmul(f64(x), f64(y)), matmul(f64(x).abs(), f64(y).abs()), tol(t)))
        << dtype_name(t);
  }
}

TEST(CudaGemm, AddmmWithEveryBiasShapeBetaAlphaAndRelu) {
  SKIP_WITHOUT_GPU();
  PrecisionGuard exact(kHighest, true);
  const int64_t m = 17, k = 24, n = 11;
  for (DType t : kFloatDTypes) {
    Tensor a = random64({m, k}, 12).to(t), b = random64({k, n}, 13).to(t);
    Tensor a_col =
        random64({k, m}, 14).to(t);  // a column-major mat1, as linear's weight.t() is for mat2
    for (std::vector<int64_t> self_sizes :
         std::vector<std::vector<int64_t>>{{n}, {1, n}, {m, 1}, {m, n}, {}, {1}}) {
      Tensor self = random64(self_sizes, 15).to(t);
      for (double beta : {1.0, 0.5, 0.0}) {
        for (double alpha : {1.0, -2.0}) {
          for (bool relu : {false, true}) {
            for (bool transposed_mat1 : {false, true}) {
              const std::string label = std::string(dtype_name(t)) + " self " +
                                        shape_str(self_sizes) + " beta " + std::to_string(beta) +
                                        " alpha " + std::to_string(alpha) + (relu ? " relu" : "") +
                                        (transposed_mat1 ? " mat1^T" : "");
              Tensor mat1 = transposed_mat1 ? a_col.t() : a;
              Tensor mat1_dev = transposed_mat1 ? a_col.cuda().t() : a.cuda();
              Tensor got =
                  call_op1(op(relu ? "addmm_relu" : "addmm"), {self.cuda(), mat1_dev, b.cuda()},
                           {Scalar(beta), Scalar(alpha)});
              Tensor prod = mm(f64(mat1), f64(b));
              Tensor prod_bound = mm(f64(mat1).abs(), f64(b).abs());
              Tensor want = prod * alpha, bound = prod_bound * std::abs(alpha);
              if (beta != 0) {
                want = want + f64(self) * beta;
                bound = bound + f64(self).abs() * std::abs(beta);
              }
              if (relu) want = want.relu();
              EXPECT_TRUE(within(got, want, bound, tol(t))) << label;
            }
          }
        }
      }
    }
    // beta == 0 ignores self entirely, NaN included.
    Tensor nan_self = full({m, n}, std::nan(""), TensorOptions(t));
    Tensor got = addmm(nan_self.cuda(), a.cuda(), b.cuda(), 0, 1);
    EXPECT_TRUE(within(got, mm(f64(a), f64(b)), mm(f64(a).abs(), f64(b).abs()), tol(t)))
        << dtype_name(t);
  }
}

TEST(CudaGemm, EmptySizesGiveZerosOrBetaTimesSelf) {
  SKIP_WITHOUT_GPU();
  for (DType t : {kFloat32, kFloat16, kFloat64, DType::int32}) {
    TensorOptions o(t, cuda_device());
    Tensor z = mm(ones({3, 0}, o), ones({0, 4}, o));
    EXPECT_TRUE(same(z.cpu(), zeros({3, 4}, TensorOptions(t)))) << dtype_name(t);
    Tensor self = full({4}, 3, TensorOptions(t));
    EXPECT_TRUE(same(addmm(self.cuda(), ones({3, 0}, o), ones({0, 4}, o), 2, 5).cpu(),
                     full({3, 4}, 6, TensorOptions(t))))
        << dtype_name(t);
    EXPECT_TRUE(
        same(call_op1(op("addmm_relu"), {full({4}, -1, o), ones({3, 0}, o), ones({0, 4}, o)},
                      {Scalar(2), Scalar(1)})
                 .cpu(),
             zeros({3, 4}, TensorOptions(t))))
        << dtype_name(t);
    EXPECT_EQ(mm(ones({0, 5}, o), ones({5, 4}, o)).sizes().vec(), (std::vector<int64_t>{0, 4}));
    EXPECT_EQ(mm(ones({3, 5}, o), ones({5, 0}, o)).sizes().vec(), (std::vector<int64_t>{3, 0}));
    EXPECT_EQ(bmm(ones({0, 2, 3}, o), ones({0, 3, 4}, o)).sizes().vec(),
              (std::vector<int64_t>{0, 2, 4}));
    EXPECT_TRUE(same(bmm(ones({2, 2, 0}, o), ones({2, 0, 4}, o)).cpu(),
                     zeros({2, 2, 4}, TensorOptions(t))));
    EXPECT_TRUE(same(dot(ones({0}, o), ones({0}, o)).cpu(), zeros({}, TensorOptions(t))));
  }
}

TEST(CudaGemm, IntegerProductsWrapAroundBitwiseLikeTheCpu) {
  SKIP_WITHOUT_GPU();
  for (DType t : {DType::uint8, DType::int8, DType::int32, DType::int64}) {
    const std::string name(dtype_name(t));
    Tensor a = random_integers({19, 37}, t, 1), b = random_integers({37, 23}, t, 2);
    EXPECT_TRUE(same(mm(a.cuda(), b.cuda()).cpu(), mm(a, b))) << name;
    Tensor at = random_integers({37, 19}, t, 3);
    EXPECT_TRUE(same(mm(at.cuda().t(), b.cuda()).cpu(), mm(at.t(), b))) << name << " transposed";
    Tensor ba = random_integers({3, 5, 40}, t, 4), bb = random_integers({3, 40, 6}, t, 5);
    EXPECT_TRUE(same(bmm(ba.cuda(), bb.cuda()).cpu(), bmm(ba, bb))) << name;
    Tensor self = random_integers({23}, t, 6);
    for (auto [beta, alpha] :
         {std::pair{2.0, 3.0}, {0.5, 1.0}, {0.0, 2.0}}) {  // converted to T: 0.5 -> 0
      EXPECT_TRUE(same(addmm(self.cuda(), a.cuda(), b.cuda(), beta, alpha).cpu(),
                       addmm(self, a, b, beta, alpha)))
          << name << " beta " << beta;
    }
    if (t != DType::uint8) {
      EXPECT_TRUE(
          same(call_op1(op("addmm_relu"), {self.cuda(), a.cuda(), b.cuda()}, {Scalar(1), Scalar(1)})
                   .cpu(),
               call_op1(op("addmm_relu"), {self, a, b}, {Scalar(1), Scalar(1)})))
          << name << " relu";
    }
    Tensor u = random_integers({301}, t, 7), v = random_integers({602}, t, 8).slice(0, 0, 602, 2);
    EXPECT_TRUE(same(dot(u.cuda(), random_integers({602}, t, 8).cuda().slice(0, 0, 602, 2)).cpu(),
                     dot(u, v)))
        << name;
  }
}

TEST(CudaGemm, DotOfStridedVectorsMatchesTheReference) {
  SKIP_WITHOUT_GPU();
  PrecisionGuard exact(kHighest, true);
  for (DType t : kFloatDTypes) {
    for (int64_t n : {1, 7, 1000}) {
      Tensor base_a = random64({2 * n}, 16).to(t), b = random64({n}, 17).to(t);
      Tensor a = base_a.slice(0, 0, 2 * n, 2);
      Tensor got = dot(base_a.cuda().slice(0, 0, 2 * n, 2), b.cuda());
      EXPECT_EQ(got.dim(), 0);
      EXPECT_TRUE(within(got, dot(f64(a), f64(b)), dot(f64(a).abs(), f64(b).abs()), tol(t)))
          << dtype_name(t) << " " << n;
    }
  }
}

TEST(CudaGemm, Float32HighPrecisionStaysWithinTf32Accuracy) {
  SKIP_WITHOUT_GPU();
  PrecisionGuard tf32(cuda::detail::MatmulPrecision::high, true);
  Tensor a = random64({256, 512}, 18).to(kFloat32), b = random64({512, 128}, 19).to(kFloat32);
  Tensor got = mm(a.cuda(), b.cuda());
  EXPECT_TRUE(within(got, mm(f64(a), f64(b)), mm(f64(a).abs(), f64(b).abs()), kTf32Tol));
}

TEST(CudaGemm, BadOperandsThrowTheMetaErrors) {
  SKIP_WITHOUT_GPU();
  TensorOptions o(kFloat32, cuda_device());
  EXPECT_THROW(mm(ones({2, 3}, o), ones({4, 5}, o)), ShapeError);
  EXPECT_THROW(bmm(ones({2, 3, 4}, o), ones({3, 4, 5}, o)), ShapeError);
  EXPECT_THROW(mm(ones({2, 3}, o), ones({3, 5}, TensorOptions(kFloat64, cuda_device()))),
               DTypeError);
  EXPECT_THROW(mm(ones({2, 3}, o), ones({3, 5})), DeviceError);
  EXPECT_THROW(dot(ones({3}, o), ones({4}, o)), ShapeError);
  EXPECT_THROW(addmm(ones({3, 5}, o), ones({2, 3}, o), ones({3, 5}, o)), ShapeError);
}

// ---- convolutions on a GPU ----

namespace {

struct ConvCase {
  int64_t n, c, h, w, o, kh, kw;
  std::vector<int64_t> stride, padding, dilation;
  int64_t groups;
  bool bias;
  std::string str() const {
    return "x (" + std::to_string(n) + "," + std::to_string(c) + "," + std::to_string(h) + "," +
           std::to_string(w) + ") w (" + std::to_string(o) + "," + std::to_string(c / groups) +
           "," + std::to_string(kh) + "," + std::to_string(kw) + ") stride " + shape_str(stride) +
           " padding " + shape_str(padding) + " dilation " + shape_str(dilation) + " groups " +
           std::to_string(groups) + (bias ? " bias" : "");
  }
  std::vector<Attr> attrs() const { return {stride, padding, dilation, groups}; }
};

const std::vector<ConvCase> kConvCases = {
    {2, 3, 9, 8, 4, 3, 3, {1}, {1}, {1}, 1, true},
    {1, 4, 10, 10, 6, 3, 3, {2}, {1}, {1}, 2, true},         // groups, stride 2
    {2, 6, 11, 9, 6, 3, 3, {1}, {2}, {2}, 6, false},         // depthwise, dilation 2
    {1, 8, 7, 7, 16, 1, 1, {1}, {0}, {1}, 1, true},          // 1x1
    {3, 2, 6, 7, 5, 5, 3, {2, 1}, {2, 0}, {1, 2}, 1, true},  // asymmetric everything
};

// Layouts of the operands: NCHW, channels-last input, channels-last weight only, a sliced input.
enum class ConvLayout { nchw, input_channels_last, weight_channels_last, sliced_input };
const std::vector<ConvLayout> kConvLayouts = {ConvLayout::nchw, ConvLayout::input_channels_last,
                                              ConvLayout::weight_channels_last,
                                              ConvLayout::sliced_input};

Tensor arrange_input(ConvLayout l, const Tensor& x) {
  if (l == ConvLayout::input_channels_last) return x.contiguous(kiln::channels_last);
  if (l == ConvLayout::sliced_input) {  // a non-dense view: every other column of a wider tensor
    auto s = x.sizes().vec();
    s[3] *= 2;
    Tensor wide = zeros(s, TensorOptions(x.dtype(), x.device()));
    Tensor view = wide.slice(3, 0, s[3], 2);
    view.copy_(x);
    return view;
  }
  return x;
}

Tensor arrange_weight(ConvLayout l, const Tensor& w) {
  return l == ConvLayout::weight_channels_last ? w.contiguous(kiln::channels_last) : w;
}

struct ConvOperands {
  Tensor x, w, b;  // in the test dtype, on the CPU
};

ConvOperands conv_operands(const ConvCase& c, DType t, uint64_t seed) {
  ConvOperands ops;
  ops.x = random64({c.n, c.c, c.h, c.w}, seed).to(t);
  ops.w = random64({c.o, c.c / c.groups, c.kh, c.kw}, seed + 1).to(t);
  if (c.bias) ops.b = random64({c.o}, seed + 2).to(t);
  return ops;
}

Tensor cuda_or_undefined(const Tensor& t) {
  return t.defined() ? t.cuda() : Tensor();
}
Tensor f64_or_undefined(const Tensor& t) {
  return t.defined() ? f64(t) : Tensor();
}
Tensor abs_or_undefined(const Tensor& t) {
  return t.defined() ? t.abs() : Tensor();
}

void check_conv2d(DType t, double rel) {
  for (const ConvCase& c : kConvCases) {
    for (ConvLayout l : kConvLayouts) {
      const std::string label =
          std::string(dtype_name(t)) + " " + c.str() + " layout " + std::to_string(int(l));
      ConvOperands ops = conv_operands(c, t, 20);
      Tensor x = arrange_input(l, ops.x.cuda()), w = arrange_weight(l, ops.w.cuda());
      Tensor got =
          conv2d(x, w, cuda_or_undefined(ops.b), c.stride, c.padding, c.dilation, c.groups);
      // The CPU's result in the same layout and dtype decides the strides (the meta's rule).
      Tensor cpu = conv2d(arrange_input(l, ops.x), arrange_weight(l, ops.w), ops.b, c.stride,
                          c.padding, c.dilation, c.groups);
      EXPECT_EQ(got.strides().vec(), cpu.strides().vec()) << label;
      EXPECT_EQ(got.dtype(), t) << label;
      Tensor x64 = f64(ops.x), w64 = f64(ops.w), b64 = f64_or_undefined(ops.b);
      Tensor want = conv2d(x64, w64, b64, c.stride, c.padding, c.dilation, c.groups);
      Tensor bound = conv2d(x64.abs(), w64.abs(), abs_or_undefined(b64), c.stride, c.padding,
                            c.dilation, c.groups);
      EXPECT_TRUE(within(got, want, bound, rel)) << label;
    }
  }
}

}  // namespace

TEST(CudaConv, Conv2dMatchesTheFloat64ReferenceInEveryLayout) {
  SKIP_WITHOUT_CUDNN();
  PrecisionGuard exact(kHighest, false);
  for (DType t : kFloatDTypes) check_conv2d(t, tol(t));
}

TEST(CudaConv, Float32ConvolutionsWithTf32StayWithinTf32Accuracy) {
  SKIP_WITHOUT_CUDNN();
  PrecisionGuard tf32(kHighest, true);
  check_conv2d(kFloat32, kTf32Tol);
}

TEST(CudaConv, Conv2dReluAndConv2dBnMatchTheCpuOps) {
  SKIP_WITHOUT_CUDNN();
  PrecisionGuard exact(kHighest, false);
  for (DType t : {kFloat32, kFloat16}) {
    for (const ConvCase& c : kConvCases) {
      for (ConvLayout l : {ConvLayout::nchw, ConvLayout::input_channels_last}) {
        const std::string label =
            std::string(dtype_name(t)) + " " + c.str() + " layout " + std::to_string(int(l));
        ConvOperands ops = conv_operands(c, t, 30);
        Tensor x = arrange_input(l, ops.x.cuda()), w = arrange_weight(l, ops.w.cuda()),
               b = cuda_or_undefined(ops.b);
        Tensor x64 = f64(ops.x), w64 = f64(ops.w), b64 = f64_or_undefined(ops.b);
        Tensor got = call_op1(op("conv2d_relu"), {x, w, b}, c.attrs());
        Tensor want = call_op1(op("conv2d_relu"), {x64, w64, b64}, c.attrs());
        Tensor bound = conv2d(x64.abs(), w64.abs(), abs_or_undefined(b64), c.stride, c.padding,
                              c.dilation, c.groups);
        EXPECT_TRUE(within(got, want, bound, tol(t))) << "relu " << label;

        Tensor gamma = random64({c.o}, 31).to(t), beta = random64({c.o}, 32).to(t),
               mean = random64({c.o}, 33).to(t);
        Tensor var = (random64({c.o}, 34).abs() + 0.5).to(t);
        for (bool relu : {false, true}) {
          const std::vector<Attr> attrs{c.stride, c.padding, c.dilation, c.groups, 1e-5, relu};
          Tensor got_bn =
              call_op1(op("conv2d_bn"),
                       {x, w, b, gamma.cuda(), beta.cuda(), mean.cuda(), var.cuda()}, attrs);
          Tensor want_bn = call_op1(
              op("conv2d_bn"), {x64, w64, b64, f64(gamma), f64(beta), f64(mean), f64(var)}, attrs);
          EXPECT_TRUE(::kiln::testing::close_to(got_bn, want_bn, 10 * tol(t)))
              << "bn " << label << (relu ? " relu" : "");
          // Folded parameters are cached: a second call gives the same bits.
          Tensor again =
              call_op1(op("conv2d_bn"),
                       {x, w, b, gamma.cuda(), beta.cuda(), mean.cuda(), var.cuda()}, attrs);
          EXPECT_TRUE(same(again.cpu(), got_bn.cpu())) << "bn cached " << label;
        }
      }
    }
  }
}

TEST(CudaConv, ConvolutionBackwardGivesEveryMaskedGradient) {
  SKIP_WITHOUT_CUDNN();
  PrecisionGuard exact(kHighest, false);
  const std::vector<std::vector<int64_t>> masks = {
      {1, 1, 1}, {1, 0, 0}, {0, 1, 0}, {0, 0, 1}, {1, 1, 0}};
  for (DType t : kFloatDTypes) {
    for (const ConvCase& c : kConvCases) {
      for (ConvLayout l : kConvLayouts) {
        ConvOperands ops = conv_operands(c, t, 40);
        Tensor out_shape =
            conv2d(f64(ops.x), f64(ops.w), Tensor(), c.stride, c.padding, c.dilation, c.groups);
        Tensor dy = random64(out_shape.sizes().vec(), 43).to(t);
        Tensor x = arrange_input(l, ops.x.cuda()), w = arrange_weight(l, ops.w.cuda());
        Tensor dy_dev = l == ConvLayout::input_channels_last
                            ? dy.cuda().contiguous(kiln::channels_last)
                            : dy.cuda();
        Tensor x64 = f64(ops.x), w64 = f64(ops.w), dy64 = f64(dy);
        for (const auto& mask : masks) {
          const std::string label = std::string(dtype_name(t)) + " " + c.str() + " layout " +
                                    std::to_string(int(l)) + " mask " + shape_str(mask);
          if (std::getenv("KILN_TEST_VERBOSE")) std::fprintf(stderr, "convolution_backward %s\n", label.c_str());
          const std::vector<Attr> attrs{c.stride, c.padding, c.dilation, c.groups, mask};
          auto got = call_op(op("convolution_backward"), {dy_dev, x, w}, attrs);
          auto want = call_op(op("convolution_backward"), {dy64, x64, w64}, attrs);
          auto bound =
              call_op(op("convolution_backward"), {dy64.abs(), x64.abs(), w64.abs()}, attrs);
          for (int i = 0; i < 3; ++i) {
            if (!mask[i]) {
              EXPECT_EQ(got[i].sizes().vec(), (std::vector<int64_t>{0}))
                  << label << " output " << i;
              continue;
            }
            EXPECT_TRUE(within(got[i], want[i], bound[i], tol(t))) << label << " output " << i;
          }
        }
      }
    }
  }
}

#ifdef KILN_WITH_CUDNN
// Convolutions run on execution plans of cuDNN's graph API (conv_graph.h), built once per
// configuration: a second pass over the same shapes builds none, and the results stay the first
// pass's bits.
TEST(CudaConv, ConvolutionsRunOnCachedGraphApiPlans) {
  SKIP_WITHOUT_CUDNN();
  PrecisionGuard exact(kHighest, false);
  const ConvCase c{3, 5, 11, 13, 7, 3, 3, {1}, {1}, {1}, 1, true};  // a configuration no other test runs
  ConvOperands ops = conv_operands(c, kFloat32, 50);
  auto pass = [&](ConvLayout l) {
    Tensor x = arrange_input(l, ops.x.cuda()), w = arrange_weight(l, ops.w.cuda());
    Tensor y = conv2d(x, w, ops.b.cuda(), c.stride, c.padding, c.dilation, c.groups);
    const std::vector<Attr> attrs{c.stride, c.padding, c.dilation, c.groups, std::vector<int64_t>{1, 1, 0}};
    auto grads = call_op(op("convolution_backward"), {y, x, w}, attrs);
    return std::vector<Tensor>{y.cpu(), grads[0].cpu(), grads[1].cpu()};
  };
  for (ConvLayout l : {ConvLayout::nchw, ConvLayout::input_channels_last}) {
    SCOPED_TRACE(int(l));
    const int64_t before = cuda::detail::conv_graph_plans_built();
    const std::vector<Tensor> first = pass(l);
    const int64_t built = cuda::detail::conv_graph_plans_built();
    // NCHW float32 has a graph plan for every direction; channels-last ones may leave a direction
    // to the legacy API (a cached "none" that builds nothing again either).
    EXPECT_GE(built - before, l == ConvLayout::nchw ? 3 : 1) << "forward, backward data and backward filter";
    const std::vector<Tensor> second = pass(l);
    EXPECT_EQ(cuda::detail::conv_graph_plans_built(), built);
    for (size_t i = 0; i < first.size(); ++i) EXPECT_TRUE(same(second[i], first[i])) << i;
  }
}
#endif  // KILN_WITH_CUDNN

TEST(CudaConv, EmptyBatchesAndZeroChannelInputs) {
  SKIP_WITHOUT_CUDNN();
  TensorOptions o(kFloat32, cuda_device());
  Tensor y = conv2d(ones({0, 3, 5, 5}, o), ones({4, 3, 3, 3}, o), ones({4}, o));
  EXPECT_EQ(y.sizes().vec(), (std::vector<int64_t>{0, 4, 3, 3}));
  // No input channels: the result is the bias alone (zeros without one).
  Tensor bias = tensor<float>({1, -2, 3, 4}, {4}).cuda();
  Tensor z = conv2d(ones({2, 0, 5, 5}, o), ones({4, 0, 3, 3}, o), bias);
  EXPECT_TRUE(
      same(z.cpu(), tensor<float>({1, -2, 3, 4}, {1, 4, 1, 1}).expand({2, 4, 3, 3}).contiguous()));
  Tensor zr = call_op1(
      op("conv2d_relu"), {ones({2, 0, 5, 5}, o), ones({4, 0, 3, 3}, o), bias},
      {std::vector<int64_t>{1}, std::vector<int64_t>{0}, std::vector<int64_t>{1}, int64_t{1}});
  EXPECT_TRUE(
      same(zr.cpu(), tensor<float>({1, 0, 3, 4}, {1, 4, 1, 1}).expand({2, 4, 3, 3}).contiguous()));
  // Backward of an empty batch: zero weight and bias gradients.
  std::vector<Attr> attrs{std::vector<int64_t>{1}, std::vector<int64_t>{0}, std::vector<int64_t>{1},
                          int64_t{1}, std::vector<int64_t>{1, 1, 1}};
  auto g = call_op(op("convolution_backward"),
                   {ones({0, 4, 3, 3}, o), ones({0, 3, 5, 5}, o), ones({4, 3, 3, 3}, o)}, attrs);
  EXPECT_EQ(g[0].sizes().vec(), (std::vector<int64_t>{0, 3, 5, 5}));
  EXPECT_TRUE(same(g[1].cpu(), zeros({4, 3, 3, 3})));
  EXPECT_TRUE(same(g[2].cpu(), zeros({4})));
  // Zero input channels: no weight gradient to speak of, but the bias gradient sums grad_output.
  auto g0 = call_op(op("convolution_backward"),
                    {ones({2, 4, 3, 3}, o), ones({2, 0, 5, 5}, o), ones({4, 0, 3, 3}, o)}, attrs);
  EXPECT_TRUE(same(g0[2].cpu(), full({4}, 18.0f)));
}

TEST(CudaConv, BadOperandsThrowTheMetaErrors) {
  SKIP_WITHOUT_CUDNN();
  TensorOptions o(kFloat32, cuda_device());
  EXPECT_THROW(conv2d(ones({1, 3, 5, 5}, o), ones({4, 2, 3, 3}, o)), ShapeError);
  EXPECT_THROW(conv2d(ones({1, 3, 2, 2}, o), ones({4, 3, 3, 3}, o)), ShapeError);
  EXPECT_THROW(
      conv2d(ones({1, 3, 5, 5}, o), ones({4, 3, 3, 3}, TensorOptions(kFloat64, cuda_device()))),
      DTypeError);
  EXPECT_THROW(conv2d(ones({1, 3, 5, 5}, o), ones({4, 3, 3, 3})), DeviceError);
}

// Runs a compiled training step and its eager twin on `x`, each starting from the gradients
// `w0` and `b0` (undefined: none) for the parameters w and b, and expects the losses and the
// gradients of w, b and x to agree. `call` labels the failures.
template <class Compiled, class Step>
void expect_step_matches_eager(Compiled& compiled, Step& step, const Tensor& x, Tensor& w, Tensor& b,
                               const Tensor& w0, const Tensor& b0, int call) {
  auto start = [&] {
    w.set_grad(w0.defined() ? w0.clone() : Tensor());
    b.set_grad(b0.defined() ? b0.clone() : Tensor());
    x.set_grad(Tensor());
  };
  start();
  Tensor loss = compiled(x);
  Tensor gw = w.grad().clone(), gb = b.grad().clone(), gx = x.grad().clone();
  start();
  Tensor expected = step(x);
  EXPECT_TRUE(allclose(loss.cpu(), expected.cpu(), 1e-3, 1e-5)) << "call " << call;
  EXPECT_TRUE(allclose(gw.cpu(), w.grad().cpu(), 1e-3, 1e-4)) << "call " << call;
  EXPECT_TRUE(allclose(gb.cpu(), b.grad().cpu(), 1e-3, 1e-4)) << "call " << call;
  EXPECT_TRUE(allclose(gx.cpu(), x.grad().cpu(), 1e-3, 1e-4)) << "call " << call;
}

#ifdef KILN_WITH_CUDNN
// compile()'s max_autotune times cuDNN's algorithms (cudnnFind*) for each configuration and
// direction at a graph's first run, caches the winners, and the compiled step matches eager.
TEST(CudaConv, MaxAutotuneTimesTheAlgorithmsAndMatchesEager) {
  SKIP_WITHOUT_GPU();
  compiler::reset();
  manual_seed(3);
  const TensorOptions o(kFloat32, cuda_device());
  Tensor w = randn({12, 7, 3, 3}, o).mul_(0.2).requires_grad_(true);
  Tensor b = randn({12}, o).requires_grad_(true);
  auto step = [&](const Tensor& x) {
    Tensor r = relu(conv2d(x, w, b, {1, 1}, {1, 1}));
    Tensor loss = (r * r).mean();
    loss.backward();
    return loss;
  };
  auto tuned = compile(step, CompileOptions{.backend = std::string("kiln"), .mode = Mode::max_autotune});
  const int64_t before = cuda::detail::conv_plans_timed();
  for (int i = 0; i < 3; ++i) {
    Tensor x = randn({3, 7, 11, 13}, o).requires_grad_(true);
    expect_step_matches_eager(tuned, step, x, w, b, Tensor(), Tensor(), i);
  }
  // Forward, backward-data and backward-filter of the configuration were timed.
  EXPECT_GE(cuda::detail::conv_plans_timed() - before, 3);
  EXPECT_GE(compiler::counters().graph_runs, 3);
}

#endif

// max_autotune times cuBLASLt's candidates for the forward and backward GEMMs of a linear layer
// (accumulating ones included: the candidates write scratch, never the accumulated output).
TEST(CudaGemm, MaxAutotuneTimesTheAlgorithmsAndMatchesEager) {
  SKIP_WITHOUT_GPU();
  compiler::reset();
  manual_seed(4);
  const TensorOptions o(kFloat32, cuda_device());
  Tensor w = randn({96, 160}, o).mul_(0.1).requires_grad_(true);
  Tensor b = randn({96}, o).requires_grad_(true);
  auto step = [&](const Tensor& x) {
    Tensor h = relu(linear(x, w, b));
    Tensor loss = (h * h).mean();
    loss.backward();
    return loss;
  };
  auto tuned = compile(step, CompileOptions{.backend = std::string("kiln"), .mode = Mode::max_autotune});
  const int64_t before = cuda::detail::gemm_algorithms_timed();
  for (int i = 0; i < 3; ++i) {
    Tensor x = randn({64, 160}, o).requires_grad_(true);
    // The gradients accumulate into earlier ones: GEMMs with beta == 1 where the backward writes
    // them in place.
    const Tensor gw0 = randn({96, 160}, o), gb0 = randn({96}, o);
    expect_step_matches_eager(tuned, step, x, w, b, gw0, gb0, i);
  }
  // The forward GEMM and the two backward ones were timed, and the compiled code ran.
  EXPECT_GE(cuda::detail::gemm_algorithms_timed() - before, 2);
  EXPECT_GE(compiler::counters().graph_runs, 3);
}

#endif  // KILN_WITH_CUDA
