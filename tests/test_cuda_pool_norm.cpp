// Eager CUDA pooling and normalization kernels against the CPU kernels on the same inputs: both
// layouts (planar and channels-last), odd sizes, padding / ceil_mode / dilation / divisor cases,
// training and evaluation, running statistics, every gradient, NaN, empty tensors and bad input.
// GPU tests skip when no GPU is visible; the CudaJit tests compile every generated kernel source
// with NVRTC for sm_90 and run wherever the toolkit is installed.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "cuda_test_helpers.h"
#include "kiln/kiln.h"
#include "kiln/op_table.h"

#ifdef KILN_WITH_CUDA
#include "kernels/cuda/jit.h"
#include "kernels/cuda/norm_kernels.h"
#include "kernels/cuda/pool_kernels.h"
#endif

using namespace kiln;

namespace {

const OpDef& op(const char* name) {
  const OpDef* d = OpTable::instance().find(name);
  if (!d) throw std::runtime_error(std::string(name) + " is not registered");
  return *d;
}

// Reproducible values in [lo, hi), rounded to `dtype`.
Tensor uniform(std::vector<int64_t> sizes, DType dtype, uint32_t seed, double lo = -2, double hi = 2) {
  int64_t n = 1;
  for (int64_t s : sizes) n *= s;
  std::mt19937 gen(seed);
  std::uniform_real_distribution<double> dist(lo, hi);
  std::vector<double> v(static_cast<size_t>(n));
  for (auto& e : v) e = dist(gen);
  if (!is_floating_point(dtype))
    for (auto& e : v) e = std::floor(e * 20);
  return tensor<double>(v, sizes).to(dtype);
}

Tensor channels_last_copy(const Tensor& t) { return t.contiguous(kiln::channels_last); }

// t on the GPU with the same strides (dense layouts).
Tensor to_gpu(const Tensor& t) {
  if (!t.defined()) return t;
  Tensor g = t.to(cuda_device());
  if (t.dim() == 4 && t.is_contiguous(kiln::channels_last) && !t.is_contiguous())
    g = g.contiguous(kiln::channels_last);
  return g;
}

Tensor to_cpu(const Tensor& t) { return t.defined() ? t.to(kCPU) : t; }

std::vector<Tensor> to_gpu(const std::vector<Tensor>& ts) {
  std::vector<Tensor> out;
  for (const Tensor& t : ts) out.push_back(to_gpu(t));
  return out;
}

// Values within atol + rtol * |expected| (NaNs must match), same shape and dtype.
::testing::AssertionResult close(const Tensor& actual, const Tensor& expected, double rtol, double atol) {
  if (actual.dtype() != expected.dtype())
    return ::testing::AssertionFailure() << "dtypes differ: " << dtype_name(actual.dtype()) << " vs "
                                         << dtype_name(expected.dtype());
  if (actual.sizes() != expected.sizes()) return ::testing::AssertionFailure() << "shapes differ";
  auto a = to_cpu(actual).to_vector<double>(), e = to_cpu(expected).to_vector<double>();
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::isnan(a[i]) || std::isnan(e[i])) {
      if (std::isnan(a[i]) && std::isnan(e[i])) continue;
      return ::testing::AssertionFailure() << "element " << i << ": " << a[i] << " vs " << e[i];
    }
    if (a[i] == e[i]) continue;
    if (!(std::abs(a[i] - e[i]) <= atol + rtol * std::abs(e[i])))
      return ::testing::AssertionFailure() << "element " << i << ": " << a[i] << " vs " << e[i] << " (of "
                                           << a.size() << ")";
  }
  return ::testing::AssertionSuccess();
}

::testing::AssertionResult same(const Tensor& actual, const Tensor& expected) { return close(actual, expected, 0, 0); }

// Per-dtype tolerances for results computed in a different order.
double rtol_of(DType t) { return t == kFloat64 ? 1e-10 : t == kFloat32 ? 2e-5 : t == kBFloat16 ? 2e-2 : 4e-3; }
double atol_of(DType t) { return t == kFloat64 ? 1e-10 : t == kFloat32 ? 2e-5 : t == kBFloat16 ? 2e-2 : 4e-3; }

// Whether the GPU output keeps the CPU output's layout.
::testing::AssertionResult same_layout(const Tensor& gpu, const Tensor& cpu) {
  if (gpu.sizes() != cpu.sizes()) return ::testing::AssertionFailure() << "shapes differ";
  if (gpu.numel() > 1 && gpu.suggest_memory_format() != cpu.suggest_memory_format())
    return ::testing::AssertionFailure() << "memory formats differ";
  return ::testing::AssertionSuccess();
}

std::string fmt_shape(const Tensor& x) {
  std::string s = "(";
  for (int64_t d : x.sizes()) s += std::to_string(d) + ",";
  s.back() = ')';
  return s;
}

std::string describe(const Tensor& x) {
  std::string s = std::string(dtype_name(x.dtype())) + " [";
  for (int64_t d : x.sizes()) s += std::to_string(d) + ",";
  s += "]";
  if (x.dim() == 4 && !x.is_contiguous()) s += " channels-last";
  return s;
}

// Inputs for the pooling tests: planar and channels-last, odd sizes, a 3-D one.
std::vector<Tensor> pool_inputs(DType dtype) {
  std::vector<Tensor> xs = {uniform({2, 3, 7, 9}, dtype, 1), uniform({3, 5, 6}, dtype, 2),
                            channels_last_copy(uniform({2, 16, 9, 7}, dtype, 3)),
                            channels_last_copy(uniform({1, 5, 8, 8}, dtype, 4)), uniform({2, 4, 11, 10}, dtype, 5)};
  return xs;
}

struct Window {
  std::vector<int64_t> kernel, stride, padding, dilation;
  bool ceil_mode;
};

const std::vector<Window> kMaxWindows = {{{2, 2}, {2, 2}, {0, 0}, {1, 1}, false}, {{3, 3}, {2, 2}, {1, 1}, {1, 1}, false},
                                         {{3, 3}, {2, 2}, {1, 1}, {1, 1}, true},  {{2, 3}, {1, 2}, {1, 0}, {2, 1}, true},
                                         {{3, 2}, {3, 1}, {0, 1}, {1, 2}, false}, {{1, 1}, {1, 1}, {0, 0}, {1, 1}, false}};

}  // namespace

#ifdef KILN_WITH_CUDA

// ============================== NVRTC (no GPU needed) ==============================

TEST(CudaJit, PoolingSourcesCompileForEveryKindAndDType) {
  using namespace cuda::detail;
  int n = 0;
  for (PoolKind kind : {PoolKind::max, PoolKind::max_with_indices, PoolKind::avg, PoolKind::adaptive_avg}) {
    for (bool i32 : {true, false})
      for (bool cl : {true, false}) {
        EXPECT_GT(compile_cubin(pool_forward_source(kind, kFloat32, i32, cl), 90, "pool_fwd").size(), 100u);
        if (kind != PoolKind::max_with_indices) {
          EXPECT_GT(compile_cubin(pool_backward_source(kind, kFloat32, i32, cl), 90, "pool_bwd").size(), 100u);
        }
        n += 2;
      }
    for (DType t : {kFloat16, kBFloat16, kFloat64}) {
      compile_cubin(pool_forward_source(kind, t, true, false), 90, "pool_fwd");
      compile_cubin(pool_backward_source(kind, t, false, true), 90, "pool_bwd");
    }
  }
  for (DType t : {DType::uint8, DType::int8, DType::int32, DType::int64}) {
    compile_cubin(pool_forward_source(PoolKind::max, t, true, false), 90, "pool_fwd");
    compile_cubin(pool_forward_source(PoolKind::max_with_indices, t, false, true), 90, "pool_fwd");
  }
  EXPECT_GT(n, 0);
}

TEST(CudaJit, NormalizationSourcesCompileForEveryVariant) {
  using namespace cuda::detail;
  auto compiles = [](const std::string& src) { EXPECT_GT(compile_cubin(src, 90, "norm").size(), 100u); };
  for (DType t : {kFloat32, kFloat16, kBFloat16, kFloat64}) {
    compiles(batch_norm_stats_source(t, t != kFloat64));
    compiles(batch_norm_finalize_source(t, t, t));
    compiles(row_norm_source(t, false));
    compiles(row_norm_source(t, true));
    compiles(batch_norm_backward_reduce_source(t, true, ReluMask::recompute));
    compiles(batch_norm_backward_finalize_source(t, t));
    compiles(batch_norm_backward_apply_source(t, true, ReluMask::result, true, true, true));
    compiles(layer_norm_backward_source(t, t));
    compiles(group_norm_backward_source(t, t));
  }
  compiles(batch_norm_stats_source(kFloat32, false));
  compiles(batch_norm_finalize_source(kFloat16, kFloat64, std::nullopt));
  compiles(batch_norm_finalize_source(kFloat32, std::nullopt, std::nullopt));
  compiles(batch_norm_finalize_source(kFloat32, kFloat16, kBFloat16));
  for (bool relu : {false, true})
    for (bool rows : {false, true})
      for (bool i32 : {false, true}) compiles(batch_norm_apply_source(kFloat32, i32, relu, rows));
  compiles(batch_norm_apply_source(kFloat16, true, true, true));
  for (ReluMask m : {ReluMask::none, ReluMask::result, ReluMask::recompute}) {
    compiles(batch_norm_backward_reduce_source(kFloat32, false, m));
    for (bool rows_formula : {false, true})
      for (bool train : {false, true})
        for (bool rows_order : {false, true})
          compiles(batch_norm_backward_apply_source(kFloat32, true, m, rows_formula, train, rows_order));
  }
  compiles(batch_norm_backward_finalize_source(kFloat16, kFloat32));
  compiles(layer_norm_backward_source(kBFloat16, kFloat32));
  compiles(group_norm_backward_source(kFloat32, kFloat64));
}

// ============================== pooling ==============================

TEST(CudaPool, MaxPoolValuesAndIndicesMatchTheCpuExactly) {
  SKIP_WITHOUT_GPU();
  for (DType dtype : {kFloat32, kFloat16, kFloat64, DType::int32, DType::int8})
    for (const Tensor& x : pool_inputs(dtype))
      for (const Window& w : kMaxWindows) {
        SCOPED_TRACE(describe(x) + " kernel " + std::to_string(w.kernel[0]) + "x" + std::to_string(w.kernel[1]) +
                     (w.ceil_mode ? " ceil" : ""));
        auto [v, i] = max_pool2d_with_indices(x, w.kernel, w.stride, w.padding, w.dilation, w.ceil_mode);
        auto [gv, gi] = max_pool2d_with_indices(to_gpu(x), w.kernel, w.stride, w.padding, w.dilation, w.ceil_mode);
        EXPECT_TRUE(same(gv, v));
        EXPECT_TRUE(same(gi, i));
        EXPECT_TRUE(same_layout(gv, v));
        Tensor plain = call_op1(op("max_pool2d"), {to_gpu(x)},
                                {w.kernel, w.stride, w.padding, w.dilation, w.ceil_mode});
        EXPECT_TRUE(same(plain, v));
      }
}

TEST(CudaPool, MaxPoolPropagatesNaNAndTakesPyTorchsIndicesForTiesAndInfinities) {
  SKIP_WITHOUT_GPU();
  const double inf = std::numeric_limits<double>::infinity(), nan = std::numeric_limits<double>::quiet_NaN();
  Tensor x = tensor<double>(std::vector<double>{1, 1, 1, 1, -inf, -inf, -inf, -inf, nan, 2, nan, 3, 5, 5, 5, 5}, {1, 1, 4, 4}).to(kFloat32);
  for (const Tensor& in : {x, channels_last_copy(x.expand({2, 3, 4, 4}).contiguous())}) {
    auto [v, i] = max_pool2d_with_indices(in, {2, 2}, {1, 1});
    auto [gv, gi] = max_pool2d_with_indices(to_gpu(in), {2, 2}, {1, 1});
    EXPECT_TRUE(same(gv, v));
    EXPECT_TRUE(same(gi, i));
  }
}

TEST(CudaPool, AvgPoolMatchesTheCpuForPaddingCeilModeAndDivisors) {
  SKIP_WITHOUT_GPU();
  struct AvgCase {
    std::vector<int64_t> kernel, stride, padding;
    bool ceil_mode, count_include_pad;
    std::optional<int64_t> divisor;
  };
  const std::vector<AvgCase> cases = {{{2, 2}, {2, 2}, {0, 0}, false, true, {}},  {{3, 3}, {2, 2}, {1, 1}, false, true, {}},
                                      {{3, 3}, {2, 2}, {1, 1}, true, true, {}},   {{3, 3}, {2, 2}, {1, 1}, true, false, {}},
                                      {{2, 3}, {1, 2}, {1, 1}, false, false, {}}, {{3, 2}, {2, 2}, {1, 0}, true, true, 5},
                                      {{2, 2}, {2, 2}, {0, 0}, false, true, -3}};
  for (DType dtype : {kFloat32, kFloat16, kBFloat16, kFloat64})
    for (const Tensor& x : pool_inputs(dtype))
      for (const AvgCase& c : cases) {
        SCOPED_TRACE(describe(x) + " kernel " + std::to_string(c.kernel[0]) + "x" + std::to_string(c.kernel[1]));
        Tensor y = avg_pool2d(x, c.kernel, c.stride, c.padding, c.ceil_mode, c.count_include_pad, c.divisor);
        Tensor gy = avg_pool2d(to_gpu(x), c.kernel, c.stride, c.padding, c.ceil_mode, c.count_include_pad, c.divisor);
        EXPECT_TRUE(close(gy, y, rtol_of(dtype), atol_of(dtype)));
        EXPECT_TRUE(same_layout(gy, y));
        // The backward op, fed the same gradient.
        Tensor grad = uniform(y.sizes().vec(), dtype, 9);
        if (!y.is_contiguous()) grad = channels_last_copy(grad);
        // Built one push at a time: GCC 12 misreads an initializer list of variants as uninitialized.
        std::vector<Attr> attrs;
        attrs.emplace_back(x.sizes().vec());
        attrs.emplace_back(c.kernel);
        attrs.emplace_back(c.stride);
        attrs.emplace_back(c.padding);
        attrs.emplace_back(c.ceil_mode);
        attrs.emplace_back(c.count_include_pad);
        if (c.divisor) attrs.emplace_back(*c.divisor);
        else attrs.emplace_back();
        Tensor dx = call_op1(op("avg_pool2d_backward"), {grad}, attrs);
        Tensor gdx = call_op1(op("avg_pool2d_backward"), {to_gpu(grad)}, attrs);
        EXPECT_TRUE(close(gdx, dx, rtol_of(dtype), atol_of(dtype)));
        EXPECT_TRUE(same_layout(gdx, dx));
      }
}

TEST(CudaPool, AdaptiveAvgPoolAndItsBackwardMatchTheCpu) {
  SKIP_WITHOUT_GPU();
  const std::vector<std::vector<int64_t>> sizes = {{1, 1}, {3, 5}, {4, 4}, {7, 2}, {2, 9}};
  for (DType dtype : {kFloat32, kFloat16, kFloat64})
    for (const Tensor& x : pool_inputs(dtype))
      for (const auto& out : sizes) {
        SCOPED_TRACE(describe(x) + " to " + std::to_string(out[0]) + "x" + std::to_string(out[1]));
        Tensor y = adaptive_avg_pool2d(x, out);
        Tensor gy = adaptive_avg_pool2d(to_gpu(x), out);
        EXPECT_TRUE(close(gy, y, rtol_of(dtype), atol_of(dtype)));
        EXPECT_TRUE(same_layout(gy, y));
        Tensor grad = uniform(y.sizes().vec(), dtype, 11);
        if (!y.is_contiguous()) grad = channels_last_copy(grad);
        Tensor dx = call_op1(op("adaptive_avg_pool2d_backward"), {grad}, {x.sizes().vec()});
        Tensor gdx = call_op1(op("adaptive_avg_pool2d_backward"), {to_gpu(grad)}, {x.sizes().vec()});
        EXPECT_TRUE(close(gdx, dx, rtol_of(dtype), atol_of(dtype)));
        EXPECT_TRUE(same_layout(gdx, dx));
      }
}

TEST(CudaPool, MaxPoolBackwardMatchesTheCpuAndChecksIndices) {
  SKIP_WITHOUT_GPU();
  for (DType dtype : {kFloat32, kFloat16, kFloat64})
    for (const Tensor& x : pool_inputs(dtype))
      for (const Window& w : kMaxWindows) {
        SCOPED_TRACE(describe(x));
        auto [v, i] = max_pool2d_with_indices(x, w.kernel, w.stride, w.padding, w.dilation, w.ceil_mode);
        Tensor grad = uniform(v.sizes().vec(), dtype, 13);
        if (!v.is_contiguous()) grad = channels_last_copy(grad);
        std::vector<Attr> attrs{x.sizes().vec(), w.kernel, w.stride, w.padding, w.dilation, w.ceil_mode};
        Tensor dx = call_op1(op("max_pool2d_with_indices_backward"), {grad, i}, attrs);
        Tensor gdx = call_op1(op("max_pool2d_with_indices_backward"), {to_gpu(grad), to_gpu(i)}, attrs);
        EXPECT_TRUE(close(gdx, dx, rtol_of(dtype), atol_of(dtype)));
        EXPECT_TRUE(same_layout(gdx, dx));
      }
  // Indices inside the plane but outside their window take the scatter; outside the plane raise.
  Tensor x = uniform({2, 3, 6, 6}, kFloat32, 17);
  Tensor grad = uniform({2, 3, 3, 3}, kFloat32, 18);
  std::vector<Attr> attrs{x.sizes().vec(), std::vector<int64_t>{2, 2}, std::vector<int64_t>{2, 2},
                          std::vector<int64_t>{0, 0}, std::vector<int64_t>{1, 1}, false};
  Tensor anywhere = uniform({2, 3, 3, 3}, kFloat32, 19, 0, 36).to(DType::int64);
  Tensor dx = call_op1(op("max_pool2d_with_indices_backward"), {grad, anywhere}, attrs);
  Tensor gdx = call_op1(op("max_pool2d_with_indices_backward"), {to_gpu(grad), to_gpu(anywhere)}, attrs);
  EXPECT_TRUE(close(gdx, dx, 1e-6, 1e-6));
  Tensor bad = full({2, 3, 3, 3}, 36, TensorOptions(DType::int64));
  EXPECT_THROW(call_op1(op("max_pool2d_with_indices_backward"), {to_gpu(grad), to_gpu(bad)}, attrs), IndexError);
  Tensor negative = full({2, 3, 3, 3}, -1, TensorOptions(DType::int64));
  EXPECT_THROW(call_op1(op("max_pool2d_with_indices_backward"), {to_gpu(grad), to_gpu(negative)}, attrs), IndexError);
}

TEST(CudaPool, StridedInputsEmptyTensorsAndAutograd) {
  SKIP_WITHOUT_GPU();
  // A non-contiguous view (every other column) pools in place.
  Tensor wide = uniform({2, 3, 8, 16}, kFloat32, 21);
  Tensor view = wide.slice(3, 0, 16, 2);
  EXPECT_TRUE(same(max_pool2d(to_gpu(wide).slice(3, 0, 16, 2), {3, 3}, {2, 2}, {1, 1}),
                   max_pool2d(view, {3, 3}, {2, 2}, {1, 1})));
  EXPECT_TRUE(close(avg_pool2d(to_gpu(wide).slice(3, 0, 16, 2), {2, 2}), avg_pool2d(view, {2, 2}), 1e-6, 1e-6));
  // Empty batch.
  Tensor empty = zeros({0, 3, 5, 5}, TensorOptions(cuda_device()));
  EXPECT_EQ(max_pool2d(empty, {2, 2}).numel(), 0);
  EXPECT_EQ(avg_pool2d(empty, {2, 2}).numel(), 0);
  EXPECT_EQ(adaptive_avg_pool2d(empty, {1, 1}).numel(), 0);
  EXPECT_EQ(adaptive_avg_pool2d(to_gpu(uniform({2, 3, 4, 4}, kFloat32, 1)), {0, 2}).numel(), 0);
  // Gradients through autograd (each output's gradient given: no reductions needed on the GPU).
  Tensor x = uniform({2, 4, 9, 9}, kFloat32, 23);
  Tensor gx = to_gpu(x);
  x.requires_grad_(true);
  gx.requires_grad_(true);
  auto run = [](const Tensor& t, bool gpu) {
    std::vector<Tensor> ys = {max_pool2d(t, {3, 3}, {2, 2}, {1, 1}), avg_pool2d(t, {2, 2}, {1, 1}),
                              adaptive_avg_pool2d(t, {3, 3})};
    uint32_t seed = 24;
    for (Tensor& y : ys) {
      Tensor g = uniform(y.sizes().vec(), kFloat32, seed++);
      y.backward(gpu ? to_gpu(g) : g);
    }
  };
  run(x, false);
  run(gx, true);
  EXPECT_TRUE(close(gx.grad(), x.grad(), 1e-5, 1e-5));
  // Bad input: a bool tensor, a CPU index tensor.
  EXPECT_THROW(max_pool2d(to_gpu(zeros({1, 1, 4, 4}, TensorOptions(kBool))), {2, 2}), DTypeError);
}

// ============================== batch norm ==============================

namespace {

struct BatchNormRun {
  TensorList out;  // (y, save_mean, save_invstd)
  Tensor running_mean, running_var;
};

BatchNormRun run_batch_norm(const char* name, const Tensor& x, const Tensor& weight, const Tensor& bias,
                            const Tensor& rm, const Tensor& rv, bool training, double momentum = 0.1,
                            double eps = 1e-5) {
  BatchNormRun r{{}, rm.defined() ? rm.clone() : rm, rv.defined() ? rv.clone() : rv};
  r.out = call_op(op(name), {x, weight, bias, r.running_mean, r.running_var}, {training, momentum, eps});
  return r;
}

std::vector<Tensor> batch_norm_inputs(DType dtype) {
  return {uniform({4, 6, 5, 7}, dtype, 31, -1, 3),
          channels_last_copy(uniform({4, 32, 8, 8}, dtype, 32, -1, 3)),
          uniform({16, 64, 4, 4}, dtype, 33),
          channels_last_copy(uniform({3, 7, 3, 5}, dtype, 34)),
          uniform({5, 3}, dtype, 35),
          uniform({2, 4, 3, 2, 5}, dtype, 36),
          channels_last_copy(uniform({16, 128, 16, 16}, dtype, 37, 10, 14))};
}

}  // namespace

TEST(CudaBatchNorm, TrainingAndEvaluationMatchTheCpuWithRunningStatistics) {
  SKIP_WITHOUT_GPU();
  for (DType dtype : {kFloat32, kFloat16, kBFloat16, kFloat64})
    for (const Tensor& x : batch_norm_inputs(dtype))
      for (bool training : {true, false})
        for (bool affine : {true, false})
          for (const char* name : {"native_batch_norm", "batch_norm_relu"}) {
            SCOPED_TRACE(describe(x) + (training ? " training " : " eval ") + (affine ? "affine " : "") + name);
            const int64_t c = x.sizes()[1];
            const DType pdt = dtype == kFloat16 ? kFloat32 : dtype;  // parameters of another dtype too
            Tensor weight = affine ? uniform({c}, pdt, 41, 0.5, 1.5) : Tensor();
            Tensor bias = affine ? uniform({c}, pdt, 42) : Tensor();
            Tensor rm = uniform({c}, pdt, 43), rv = uniform({c}, pdt, 44, 0.5, 2);
            BatchNormRun cpu = run_batch_norm(name, x, weight, bias, rm, rv, training, 0.2, 1e-3);
            BatchNormRun gpu = run_batch_norm(name, to_gpu(x), to_gpu(weight), to_gpu(bias), to_gpu(rm),
                                              to_gpu(rv), training, 0.2, 1e-3);
            const double rt = rtol_of(dtype), at = atol_of(dtype);
            EXPECT_TRUE(close(gpu.out[0], cpu.out[0], rt, at));
            EXPECT_TRUE(same_layout(gpu.out[0], cpu.out[0]));
            const DType st = dtype == kFloat64 ? kFloat64 : kFloat32;
            EXPECT_TRUE(close(gpu.out[1], cpu.out[1], rtol_of(st), rtol_of(st)));
            EXPECT_TRUE(close(gpu.out[2], cpu.out[2], rtol_of(st), rtol_of(st)));
            EXPECT_TRUE(close(gpu.running_mean, cpu.running_mean, rtol_of(st), rtol_of(st)));
            EXPECT_TRUE(close(gpu.running_var, cpu.running_var, rtol_of(st), rtol_of(st)));
            if (!training) {  // statistics come from the running ones, computed alike
              EXPECT_TRUE(same(gpu.out[1], cpu.out[1]));
              EXPECT_TRUE(same(gpu.out[2], cpu.out[2]));
            }
          }
}

TEST(CudaBatchNorm, WithoutRunningStatisticsEmptyAndNaN) {
  SKIP_WITHOUT_GPU();
  Tensor x = uniform({4, 3, 5, 5}, kFloat32, 51);
  BatchNormRun cpu = run_batch_norm("native_batch_norm", x, Tensor(), Tensor(), Tensor(), Tensor(), true);
  BatchNormRun gpu = run_batch_norm("native_batch_norm", to_gpu(x), Tensor(), Tensor(), Tensor(), Tensor(), true);
  for (int i = 0; i < 3; ++i) EXPECT_TRUE(close(gpu.out[i], cpu.out[i], 2e-5, 2e-5));
  // An empty batch: statistics of nothing, running statistics untouched.
  Tensor empty = zeros({0, 3, 4, 4}, TensorOptions(cuda_device()));
  Tensor rm = to_gpu(ones({3})), rv = to_gpu(ones({3}));
  TensorList out = call_op(op("native_batch_norm"), {empty, Tensor(), Tensor(), rm, rv}, {true, 0.1, 1e-5});
  EXPECT_EQ(out[0].numel(), 0);
  EXPECT_TRUE(same(rm, ones({3})));
  EXPECT_TRUE(close(out[2], full({3}, 1.0 / std::sqrt(1e-5)), 1e-6, 0));
  // NaN in one channel stays in that channel; relu keeps it.
  Tensor withnan = uniform({2, 3, 4, 4}, kFloat32, 52);
  withnan.select(1, 1).select(1, 2).select(1, 3).fill_(std::numeric_limits<double>::quiet_NaN());
  for (const char* name : {"native_batch_norm", "batch_norm_relu"}) {
    BatchNormRun c = run_batch_norm(name, withnan, Tensor(), Tensor(), Tensor(), Tensor(), true);
    BatchNormRun g = run_batch_norm(name, to_gpu(withnan), Tensor(), Tensor(), Tensor(), Tensor(), true);
    EXPECT_TRUE(close(g.out[0], c.out[0], 2e-5, 2e-5));
  }
  // A CPU weight with CUDA input is refused.
  EXPECT_THROW(call_op(op("native_batch_norm"), {to_gpu(x), ones({3}), Tensor(), Tensor(), Tensor()}, {true, 0.1, 1e-5}),
               DeviceError);
}

TEST(CudaBatchNorm, BackwardMatchesTheCpuForEveryMaskAndGradient) {
  SKIP_WITHOUT_GPU();
  for (DType dtype : {kFloat32, kFloat16, kFloat64})
    for (const Tensor& x : batch_norm_inputs(dtype))
      for (bool training : {true, false})
        for (bool affine : {true, false}) {
          SCOPED_TRACE(describe(x) + (training ? " training" : " eval") + (affine ? " affine" : ""));
          const int64_t c = x.sizes()[1];
          Tensor weight = affine ? uniform({c}, dtype, 61, 0.5, 1.5) : Tensor();
          Tensor bias = affine ? uniform({c}, dtype, 62) : Tensor();
          Tensor rm = uniform({c}, dtype, 63), rv = uniform({c}, dtype, 64, 0.5, 2);
          BatchNormRun fwd = run_batch_norm("batch_norm_relu", x, weight, bias, rm, rv, training);
          Tensor grad = uniform(x.sizes().vec(), dtype, 65);
          if (!x.is_contiguous()) grad = channels_last_copy(grad);
          const double rt = rtol_of(dtype) * 10, at = atol_of(dtype) * 10;
          for (std::vector<int64_t> mask : {std::vector<int64_t>{1, 1, 1}, {1, 0, 0}, {0, 1, 1}}) {
            std::vector<Attr> attrs{training, mask};
            auto check = [&](const char* name, const std::vector<Tensor>& inputs) {
              SCOPED_TRACE(name);
              TensorList cpu = call_op(op(name), inputs, attrs);
              TensorList gpu = call_op(op(name), to_gpu(inputs), attrs);
              for (int i = 0; i < 3; ++i) {
                EXPECT_TRUE(close(gpu[i], cpu[i], rt, at)) << "output " << i;
                EXPECT_TRUE(same_layout(gpu[i], cpu[i])) << "output " << i;
              }
            };
            const Tensor& mean = fwd.out[1];
            const Tensor& invstd = fwd.out[2];
            check("native_batch_norm_backward", {grad, x, weight, mean, invstd});
            check("batch_norm_relu_backward", {grad, fwd.out[0], x, weight, mean, invstd, Tensor(), Tensor()});
            check("batch_norm_relu_backward_recompute", {grad, x, weight, mean, invstd, bias, Tensor(), Tensor()});
            Tensor threshold = scalar_tensor(0.25, TensorOptions(dtype)), fill = scalar_tensor(-0.5, TensorOptions(dtype));
            check("batch_norm_relu_backward", {grad, fwd.out[0], x, weight, mean, invstd, threshold, fill});
            check("batch_norm_relu_backward_recompute", {grad, x, weight, mean, invstd, bias, threshold, fill});
          }
        }
}

// The GPU's recomputed relu mask is the GPU forward's, bit for bit: backward with the mask
// recomputed equals backward reading batch_norm_relu's result, exactly.
TEST(CudaBatchNorm, RecomputedReluMaskIsTheForwardsBitForBit) {
  SKIP_WITHOUT_GPU();
  for (DType dtype : {kFloat32, kFloat16})
    for (const Tensor& cpu_x : batch_norm_inputs(dtype))
      for (bool training : {true, false}) {
        SCOPED_TRACE(describe(cpu_x));
        const int64_t c = cpu_x.sizes()[1];
        Tensor x = to_gpu(cpu_x);
        Tensor weight = to_gpu(uniform({c}, dtype, 71, -1, 1.5)), bias = to_gpu(uniform({c}, dtype, 72));
        Tensor rm = to_gpu(uniform({c}, dtype, 73)), rv = to_gpu(uniform({c}, dtype, 74, 0.5, 2));
        TensorList fwd = call_op(op("batch_norm_relu"), {x, weight, bias, rm, rv}, {training, 0.1, 1e-5});
        Tensor grad = to_gpu(ones(cpu_x.sizes(), TensorOptions(dtype)));
        if (!cpu_x.is_contiguous()) grad = grad.contiguous(kiln::channels_last);
        std::vector<Attr> attrs{training, std::vector<int64_t>{1, 1, 1}};
        TensorList read = call_op(op("batch_norm_relu_backward"),
                                  {grad, fwd[0], x, weight, fwd[1], fwd[2], Tensor(), Tensor()}, attrs);
        TensorList recomputed = call_op(op("batch_norm_relu_backward_recompute"),
                                        {grad, x, weight, fwd[1], fwd[2], bias, Tensor(), Tensor()}, attrs);
        for (int i = 0; i < 3; ++i) EXPECT_TRUE(same(recomputed[i], read[i])) << "output " << i;
      }
}

// ============================== layer norm and group norm ==============================

TEST(CudaLayerNorm, ForwardAndBackwardMatchTheCpu) {
  SKIP_WITHOUT_GPU();
  struct Case {
    std::vector<int64_t> sizes, normalized;
  };
  const std::vector<Case> cases = {{{4, 7, 33}, {33}}, {{3, 5, 6}, {5, 6}}, {{2, 1000}, {1000}}, {{6, 1}, {1}},
                                   {{0, 8}, {8}}};
  for (DType dtype : {kFloat32, kFloat16, kBFloat16, kFloat64})
    for (const Case& c : cases)
      for (bool affine : {true, false}) {
        Tensor x = uniform(c.sizes, dtype, 81, -1, 3);
        SCOPED_TRACE(describe(x) + (affine ? " affine" : ""));
        Tensor weight = affine ? uniform(c.normalized, dtype, 82, 0.5, 1.5) : Tensor();
        Tensor bias = affine ? uniform(c.normalized, dtype, 83) : Tensor();
        std::vector<Attr> attrs{c.normalized, 1e-5};
        TensorList cpu = call_op(op("native_layer_norm"), {x, weight, bias}, attrs);
        TensorList gpu = call_op(op("native_layer_norm"), to_gpu(std::vector<Tensor>{x, weight, bias}), attrs);
        for (int i = 0; i < 3; ++i) EXPECT_TRUE(close(gpu[i], cpu[i], rtol_of(dtype) * 4, atol_of(dtype) * 4));
        Tensor grad = uniform(c.sizes, dtype, 84);
        for (std::vector<int64_t> mask : {std::vector<int64_t>{1, 1, 1}, {0, 1, 0}, {1, 0, 0}}) {
          std::vector<Attr> battrs{c.normalized, mask};
          std::vector<Tensor> in{grad, x, cpu[1], cpu[2], weight};
          TensorList dc = call_op(op("native_layer_norm_backward"), in, battrs);
          TensorList dg = call_op(op("native_layer_norm_backward"), to_gpu(in), battrs);
          for (int i = 0; i < 3; ++i)
            EXPECT_TRUE(close(dg[i], dc[i], rtol_of(dtype) * 10, atol_of(dtype) * 10)) << "output " << i;
        }
      }
}

TEST(CudaGroupNorm, ForwardAndBackwardMatchTheCpu) {
  SKIP_WITHOUT_GPU();
  struct Case {
    std::vector<int64_t> sizes;
    int64_t groups;
  };
  const std::vector<Case> cases = {{{4, 6, 5, 7}, 3}, {{2, 32, 8, 8}, 8}, {{3, 4, 9}, 1}, {{2, 5}, 5}, {{0, 4, 3}, 2}};
  for (DType dtype : {kFloat32, kFloat16, kFloat64})
    for (const Case& c : cases)
      for (bool affine : {true, false}) {
        Tensor x = uniform(c.sizes, dtype, 91, -1, 3);
        SCOPED_TRACE(describe(x) + (affine ? " affine" : ""));
        const int64_t ch = c.sizes[1];
        Tensor weight = affine ? uniform({ch}, dtype, 92, 0.5, 1.5) : Tensor();
        Tensor bias = affine ? uniform({ch}, dtype, 93) : Tensor();
        std::vector<Attr> attrs{c.groups, 1e-5};
        TensorList cpu = call_op(op("native_group_norm"), {x, weight, bias}, attrs);
        TensorList gpu = call_op(op("native_group_norm"), to_gpu(std::vector<Tensor>{x, weight, bias}), attrs);
        for (int i = 0; i < 3; ++i) EXPECT_TRUE(close(gpu[i], cpu[i], rtol_of(dtype) * 4, atol_of(dtype) * 4));
        Tensor grad = uniform(c.sizes, dtype, 94);
        for (std::vector<int64_t> mask : {std::vector<int64_t>{1, 1, 1}, {0, 0, 1}, {1, 0, 0}}) {
          std::vector<Attr> battrs{c.groups, mask};
          std::vector<Tensor> in{grad, x, cpu[1], cpu[2], weight};
          TensorList dc = call_op(op("native_group_norm_backward"), in, battrs);
          TensorList dg = call_op(op("native_group_norm_backward"), to_gpu(in), battrs);
          for (int i = 0; i < 3; ++i)
            EXPECT_TRUE(close(dg[i], dc[i], rtol_of(dtype) * 10, atol_of(dtype) * 10)) << "output " << i;
        }
      }
}

TEST(CudaNorm, AutogradThroughTheFrontEndsMatchesTheCpu) {
  SKIP_WITHOUT_GPU();
  Tensor x = channels_last_copy(uniform({4, 8, 6, 6}, kFloat32, 101));
  Tensor w = uniform({8}, kFloat32, 102, 0.5, 1.5), b = uniform({8}, kFloat32, 103);
  auto run = [](Tensor x, Tensor w, Tensor b) {
    x.requires_grad_(true);
    w.requires_grad_(true);
    b.requires_grad_(true);
    Tensor y = batch_norm(x, Tensor(), Tensor(), w, b, true) * 1.5;
    Tensor z = group_norm(y, 4, w, b) + layer_norm(y, {6}) * 0.5;
    Tensor g = uniform(z.sizes().vec(), kFloat32, 104);
    z.backward(z.device().is_cpu() ? g : to_gpu(g));
    return std::vector<Tensor>{x.grad(), w.grad(), b.grad()};
  };
  Tensor gx = to_gpu(x), gw = to_gpu(w), gb = to_gpu(b);  // leaves of their own
  auto cpu = run(x, w, b);
  auto gpu = run(gx, gw, gb);
  for (int i = 0; i < 3; ++i) EXPECT_TRUE(close(gpu[i], cpu[i], 1e-4, 1e-4)) << "gradient " << i;
}

#endif  // KILN_WITH_CUDA

#ifdef KILN_WITH_CUDA
// Timings on DenseNet-121 shapes (batch 16, 128x128 images), eager: each op's mean wall time per
// call, launches included, and the bytes it must move per second. Run with
// --gtest_also_run_disabled_tests.
TEST(CudaPoolNormBench, DISABLED_DenseNetShapes) {
  SKIP_WITHOUT_GPU();
  auto time_us = [](const std::function<void()>& f) {
    for (int i = 0; i < 3; ++i) f();
    cuda::synchronize();
    const int iters = 50;
    auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < iters; ++i) f();
    cuda::synchronize();
    return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count() / iters;
  };
  auto report = [](const std::string& what, double us, double bytes) {
    std::printf("%-60s %9.1f us %8.1f GB/s\n", what.c_str(), us, bytes / us / 1e3);
  };
  for (bool cl : {true, false}) {
    const char* layout = cl ? "channels-last" : "planar";
    for (auto [c, hw] : std::vector<std::pair<int64_t, int64_t>>{{64, 64}, {256, 32}, {512, 16}, {1024, 8}, {1024, 4}}) {
      Tensor x = to_gpu(uniform({16, c, hw, hw}, kFloat32, 1));
      if (cl) x = x.contiguous(kiln::channels_last);
      Tensor rm = to_gpu(zeros({c})), rv = to_gpu(ones({c})), w = to_gpu(ones({c})), b = to_gpu(zeros({c}));
      const double bytes = static_cast<double>(x.numel()) * 4;
      const std::string shape = fmt_shape(x) + " " + layout;
      TensorList fwd;
      report("batch_norm_relu train " + shape, time_us([&] {
               fwd = call_op(op("batch_norm_relu"), {x, w, b, rm, rv}, {true, 0.1, 1e-5});
             }), 3 * bytes);
      report("batch_norm eval " + shape, time_us([&] {
               call_op(op("native_batch_norm"), {x, w, b, rm, rv}, {false, 0.1, 1e-5});
             }), 2 * bytes);
      Tensor grad = x.clone(cl ? kiln::channels_last : MemoryFormat::contiguous);
      report("batch_norm_relu_backward_recompute " + shape, time_us([&] {
               call_op(op("batch_norm_relu_backward_recompute"),
                       {grad, x, w, fwd[1], fwd[2], b, Tensor(), Tensor()}, {true, std::vector<int64_t>{1, 1, 1}});
             }), 5 * bytes);
      if (hw >= 8) {
        report("avg_pool2d 2x2 " + shape, time_us([&] { avg_pool2d(x, {2, 2}); }), 1.25 * bytes);
        Tensor y = avg_pool2d(x, {2, 2});
        report("avg_pool2d_backward 2x2 " + shape, time_us([&] {
                 call_op1(op("avg_pool2d_backward"), {y}, {x.sizes().vec(), std::vector<int64_t>{2, 2},
                                                           std::vector<int64_t>{2, 2}, std::vector<int64_t>{0, 0}, false,
                                                           true, Attr()});
               }), 1.25 * bytes);
      }
      if (c == 64) {
        report("max_pool2d_with_indices 3x3/2 " + shape, time_us([&] {
                 max_pool2d_with_indices(x, {3, 3}, {2, 2}, {1, 1});
               }), 1.5 * bytes);
        auto [v, idx] = max_pool2d_with_indices(x, {3, 3}, {2, 2}, {1, 1});
        report("max_pool2d_with_indices_backward 3x3/2 " + shape, time_us([&] {
                 call_op1(op("max_pool2d_with_indices_backward"), {v, idx},
                          {x.sizes().vec(), std::vector<int64_t>{3, 3}, std::vector<int64_t>{2, 2},
                           std::vector<int64_t>{1, 1}, std::vector<int64_t>{1, 1}, false});
               }), 1.75 * bytes);
      }
      if (hw == 4) report("adaptive_avg_pool2d 1x1 " + shape, time_us([&] { adaptive_avg_pool2d(x, {1, 1}); }), bytes);
    }
  }
}
#endif
