// The eager CUDA reductions (sum ... equal, softmax, cumsum) against the CPU kernels on the same
// inputs: every dtype family, contiguous / transposed / strided / channels-last layouts, dims=(),
// several dims, keepdim, empty inputs, long rows and NaNs. The NVRTC tests compile every source
// shape the generators produce, with or without a GPU.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "cuda_test_helpers.h"
#include "kiln/kiln.h"

#ifdef KILN_WITH_CUDA
#include "kernels/cuda/elementwise.h"
#include "kernels/cuda/jit.h"
#include "kernels/cuda/reduce.h"
#endif

using namespace kiln;

namespace {

const std::vector<DType> kFloating = {kFloat16, kBFloat16, kFloat32, kFloat64};
const std::vector<DType> kAll = {kBool, DType::uint8, DType::int8, DType::int32, DType::int64,
                                 kFloat16, kBFloat16, kFloat32, kFloat64};

double eps(DType t) {
  switch (t) {
    case DType::float16: return 9.77e-4;
    case DType::bfloat16: return 7.82e-3;
    case DType::float32: return 1.2e-7;
    case DType::float64: return 2.3e-16;
    default: return 0;
  }
}

// Uniform values in [lo, hi) (integers: rounded; bool: half true), as dtype.
Tensor random(std::vector<int64_t> sizes, DType dtype, unsigned seed, double lo = -3, double hi = 3,
              int64_t nan_every = 0) {
  int64_t n = 1;
  for (int64_t s : sizes) n *= s;
  std::mt19937 gen(seed);
  std::uniform_real_distribution<double> dist(lo, hi);
  std::vector<double> v(static_cast<size_t>(n));
  for (size_t i = 0; i < v.size(); ++i) {
    double& e = v[i];
    e = dist(gen);
    if (nan_every > 0 && is_floating_point(dtype) && i % nan_every == 3) e = std::nan("");
    if (dtype == kBool) e = e > (lo + hi) / 2 ? 1 : 0;
    else if (!is_floating_point(dtype)) e = std::round(dtype == DType::uint8 ? std::fabs(e) : e);
  }
  return tensor<double>(v, sizes).to(dtype);
}

const OpDef& op(const char* name) { return *OpTable::instance().find(name); }

// Values equal up to |a - b| <= atol + rtol * |b| (NaNs equal, infinities equal), same dtype
// and shape.
::testing::AssertionResult close(const Tensor& gpu, const Tensor& cpu, double rtol, double atol) {
  if (gpu.dtype() != cpu.dtype())
    return ::testing::AssertionFailure() << "dtypes differ: " << dtype_name(gpu.dtype()) << " vs " << dtype_name(cpu.dtype());
  if (gpu.sizes() != cpu.sizes()) return ::testing::AssertionFailure() << "shapes differ";
  auto a = gpu.cpu().to_vector<double>(), b = cpu.to_vector<double>();
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::isnan(a[i]) && std::isnan(b[i])) continue;
    if (a[i] == b[i]) continue;
    if (!(std::fabs(a[i] - b[i]) <= atol + rtol * std::fabs(b[i])))
      return ::testing::AssertionFailure() << "element " << i << " of " << a.size() << ": cuda " << a[i] << " vs cpu "
                                           << b[i];
  }
  return ::testing::AssertionSuccess();
}

// Views of a tensor on its own device: the layouts the kernels must read.
struct Layout {
  std::string name;
  std::function<Tensor(const Tensor&)> apply;
};
std::vector<Layout> layouts(int64_t dim) {
  std::vector<Layout> l = {{"contiguous", [](const Tensor& t) { return t; }}};
  if (dim >= 2) {
    l.push_back({"transposed", [](const Tensor& t) { return t.transpose(0, -1).contiguous().transpose(0, -1); }});
    l.push_back({"strided", [](const Tensor& t) {
                   std::vector<int64_t> big = t.sizes().vec();
                   big.push_back(2);
                   Tensor b = t.unsqueeze(-1).expand(big).contiguous();
                   std::vector<int64_t> st(b.strides().begin(), b.strides().end() - 1);
                   return b.as_strided(t.sizes(), st, 0);
                 }});
  }
  if (dim == 4) l.push_back({"channels_last", [](const Tensor& t) { return t.contiguous(MemoryFormat::channels_last); }});
  return l;
}

struct Case {
  std::vector<int64_t> sizes;
  std::vector<std::vector<int64_t>> dims;  // each entry one reduction ({} = all dims)
};
const std::vector<Case> kCases = {
    {{}, {{}}},
    {{7}, {{}, {0}, {-1}}},
    {{1 << 20}, {{}, {0}}},
    {{3, 5}, {{}, {0}, {1}}},
    {{1000, 3}, {{0}, {1}}},
    {{3, 5000}, {{1}, {0}}},
    {{4, 33, 17}, {{}, {1}, {0, 2}, {2}, {0}, {0, 1}}},
    {{2, 3, 4, 5}, {{1}, {2, 3}, {0, 2, 3}, {-1}, {0, 1, 3}}},
    {{0, 4}, {{}, {1}}},
    {{4, 0}, {{1}, {0}}},
    {{1, 6, 1}, {{0}, {1}, {0, 2}}},
};

// Runs f on cpu and cuda copies of x in every layout and compares.
void compare_everywhere(const Tensor& x, const std::function<std::vector<Tensor>(const Tensor&)>& f, double rtol,
                        double atol, const std::string& what) {
  Tensor xg = x.to(cuda_device());
  for (const Layout& l : layouts(x.dim())) {
    std::vector<Tensor> cpu = f(l.apply(x)), gpu = f(l.apply(xg));
    ASSERT_EQ(cpu.size(), gpu.size());
    for (size_t k = 0; k < cpu.size(); ++k) {
      ASSERT_TRUE(gpu[k].is_cuda());
      EXPECT_TRUE(close(gpu[k], cpu[k], rtol, atol)) << what << " layout " << l.name << " output " << k;
    }
  }
}

std::string describe(const Case& c, IntArrayRef dims, DType t, bool keepdim) {
  std::string s = std::string(dtype_name(t)) + " sizes [";
  for (int64_t v : c.sizes) s += std::to_string(v) + ",";
  s += "] dims [";
  for (int64_t v : dims) s += std::to_string(v) + ",";
  return s + "] keepdim " + std::to_string(keepdim);
}

// A sum's error bound for n addends of magnitude <= m accumulated in `acc`'s precision.
double sum_atol(int64_t n, double m, DType acc) { return 8 * eps(acc) * std::sqrt(static_cast<double>(n) + 1) * m * std::sqrt(static_cast<double>(n) + 1); }

int64_t reduced(const Case& c, IntArrayRef dims) {
  if (c.sizes.empty()) return 1;
  int64_t n = 1;
  if (dims.empty()) {
    for (int64_t s : c.sizes) n *= s;
    return n;
  }
  for (int64_t d : dims) n *= c.sizes[d < 0 ? d + c.sizes.size() : d];
  return n;
}

}  // namespace

// ---- without a GPU ----

#ifdef KILN_WITH_CUDA
TEST(CudaJit, GeneratedReductionSoftmaxAndScanKernelsCompile) {
  auto sources = cuda::detail::reduce_sources_for_test();
  EXPECT_GT(sources.size(), 100u);
  for (const std::string& src : sources) {
    SCOPED_TRACE(src);
    ASSERT_NO_THROW(cuda::detail::compile_cubin(src, 90, "reduce_test"));
  }
}

TEST(CudaJit, AllcloseAndEqualExpressionsCompile) {
  for (DType t : {DType::uint8, DType::int8, DType::int32, DType::int64, kFloat16, kBFloat16, kFloat32, kFloat64}) {
    DType tol = is_floating_point(t) ? (t == kFloat64 ? kFloat64 : kFloat32) : kFloat32;
    for (bool nan : {false, true}) {
      std::string expr = cuda::detail::isclose_expression(t, nan, !nan, "c0", "c1");
      std::vector<DType> types = {t, t}, scalars = {tol, tol};
      for (const std::string& src : cuda::detail::elementwise_sources_for_test(expr, kBool, types, types, scalars)) {
        SCOPED_TRACE(src);
        ASSERT_NO_THROW(cuda::detail::compile_cubin(src, 90, "allclose_test"));
      }
    }
  }
}
#endif

// ---- with a GPU ----

TEST(CudaReduce, SumMeanProdMatchTheCpu) {
  SKIP_WITHOUT_GPU();
  for (const Case& c : kCases) {
    for (DType t : kAll) {
      Tensor x = random(c.sizes, t, 1);
      for (const auto& dims : c.dims) {
        for (bool keepdim : {false, true}) {
          const std::string what = describe(c, dims, t, keepdim);
          const int64_t n = reduced(c, dims);
          const DType acc = t == kFloat64 ? kFloat64 : kFloat32;
          const double tol_out = 2 * eps(t);
          compare_everywhere(x, [&](const Tensor& v) { return std::vector<Tensor>{v.sum(dims, keepdim)}; }, tol_out,
                             is_floating_point(t) ? sum_atol(n, 3, acc) : 0, "sum " + what);
          if (is_floating_point(t)) {
            compare_everywhere(x, [&](const Tensor& v) { return std::vector<Tensor>{v.mean(dims, keepdim)}; }, tol_out,
                               sum_atol(n, 3, acc) / std::max<int64_t>(n, 1), "mean " + what);
          }
          if (dims.size() == 1 && n <= 5000) {
            Tensor xp = is_floating_point(t) ? random(c.sizes, t, 2, 0.95, 1.05) : x;
            compare_everywhere(xp, [&](const Tensor& v) { return std::vector<Tensor>{v.prod(dims[0], keepdim)}; },
                               tol_out + 4 * n * eps(acc), 0, "prod " + what);
          }
        }
      }
    }
  }
  // dtype= conversions: integers summed into float32, floats into int64, float16 into float32.
  Tensor x = random({5, 7}, kFloat32, 3);
  Tensor xg = x.cuda();
  EXPECT_TRUE(close(xg.sum({1}, false, kInt64), x.sum({1}, false, kInt64), 0, 0));
  EXPECT_TRUE(close(xg.to(kFloat16).sum({0}, false, kFloat32), x.to(kFloat16).sum({0}, false, kFloat32), 1e-6, 1e-6));
  Tensor i = random({5, 7}, DType::int32, 4);
  EXPECT_TRUE(close(i.cuda().sum({}, false, kFloat16), i.sum({}, false, kFloat16), 0, 0));
  EXPECT_TRUE(close(i.cuda().prod(), i.prod(), 0, 0));
}

TEST(CudaReduce, ExtremaAndArgReductionsMatchTheCpuWithNaNsAndTies) {
  SKIP_WITHOUT_GPU();
  for (const Case& c : kCases) {
    for (DType t : kAll) {
      // Few distinct values: many ties.
      Tensor x = random(c.sizes, t, 5, -3, 3, 97);
      bool empty = x.numel() == 0;
      for (const auto& dims : c.dims) {
        bool nonempty = true;
        for (int64_t d = 0; d < x.dim(); ++d) {
          bool reduced_dim = dims.empty();
          for (int64_t e : dims) reduced_dim |= (e < 0 ? e + x.dim() : e) == d;
          if (reduced_dim && x.sizes()[d] == 0) nonempty = false;
        }
        if (!nonempty) continue;
        for (bool keepdim : {false, true}) {
          const std::string what = describe(c, dims, t, keepdim);
          compare_everywhere(x, [&](const Tensor& v) { return std::vector<Tensor>{v.amax(dims, keepdim), v.amin(dims, keepdim)}; },
                             0, 0, "amax/amin " + what);
          if (dims.size() == 1 && t != kBool) {
            compare_everywhere(x, [&](const Tensor& v) {
              return std::vector<Tensor>{v.argmax(dims[0], keepdim), v.argmin(dims[0], keepdim)};
            }, 0, 0, "argmax/argmin " + what);
          }
          if (dims.size() == 1) {
            compare_everywhere(x, [&](const Tensor& v) {
              auto [mv, mi] = v.max(dims[0], keepdim);
              auto [nv, ni] = v.min(dims[0], keepdim);
              return std::vector<Tensor>{mv, mi, nv, ni};
            }, 0, 0, "max/min.dim " + what);
          }
        }
      }
      if (!empty) {
        compare_everywhere(x, [&](const Tensor& v) { return std::vector<Tensor>{v.max(), v.min()}; }, 0, 0,
                           "max/min all " + std::string(dtype_name(t)));
        if (t != kBool)
          compare_everywhere(x, [&](const Tensor& v) { return std::vector<Tensor>{v.argmax(), v.argmin(std::nullopt, true)}; },
                             0, 0, "argmax/argmin all " + std::string(dtype_name(t)));
      }
    }
  }
}

TEST(CudaReduce, AnyAllMatchTheCpu) {
  SKIP_WITHOUT_GPU();
  for (const Case& c : kCases) {
    for (DType t : kAll) {
      // Mostly zeros, so any and all both vary.
      Tensor x = random(c.sizes, t, 6, -0.2, 0.6);
      for (const auto& dims : c.dims)
        for (bool keepdim : {false, true})
          compare_everywhere(x, [&](const Tensor& v) {
            return std::vector<Tensor>{call_op1(op("any"), {v}, {dims, keepdim}), call_op1(op("all"), {v}, {dims, keepdim})};
          }, 0, 0, "any/all " + describe(c, dims, t, keepdim));
    }
  }
}

TEST(CudaReduce, MomentsNormsAndLogsumexpMatchTheCpu) {
  SKIP_WITHOUT_GPU();
  for (const Case& c : kCases) {
    for (DType t : kFloating) {
      Tensor x = random(c.sizes, t, 7, -2, 4);  // a mean away from 0
      for (const auto& dims : c.dims) {
        const int64_t n = reduced(c, dims);
        const DType acc = t == kFloat64 ? kFloat64 : kFloat32;
        const double rtol = 4 * eps(t) + 16 * std::sqrt(static_cast<double>(n) + 1) * eps(acc);
        for (bool keepdim : {false, true}) {
          const std::string what = describe(c, dims, t, keepdim);
          for (int64_t correction : {0, 1}) {
            compare_everywhere(x, [&](const Tensor& v) {
              auto [var, mean] = var_mean(v, dims, correction, keepdim);
              return std::vector<Tensor>{v.var(dims, correction, keepdim), v.std(dims, correction, keepdim), var, mean};
            }, rtol, rtol, "var/std " + what);
          }
          for (double p : {2.0, 1.0, 0.0, 3.0, 0.5, double(INFINITY), -double(INFINITY)}) {
            if (n == 0 && (p < 0 || std::isinf(p))) continue;
            compare_everywhere(x, [&](const Tensor& v) { return std::vector<Tensor>{v.norm(p, dims, keepdim)}; },
                               rtol, 1e-30, "norm p=" + std::to_string(p) + " " + what);
          }
          compare_everywhere(x, [&](const Tensor& v) { return std::vector<Tensor>{v.logsumexp(dims, keepdim)}; }, rtol,
                             rtol, "logsumexp " + what);
        }
      }
    }
  }
  // logsumexp of infinities and NaN; of integers (default dtype).
  Tensor special = tensor<float>({-INFINITY, -INFINITY, INFINITY, 1, NAN, 2, -INFINITY, -INFINITY, 3}, {3, 3});
  EXPECT_TRUE(close(special.cuda().logsumexp({1}), special.logsumexp({1}), 1e-6, 0));
  Tensor neg = full({2, 5}, -INFINITY);
  EXPECT_TRUE(close(neg.cuda().logsumexp({1}), neg.logsumexp({1}), 0, 0));
  Tensor ints = random({4, 9}, DType::int32, 8);
  EXPECT_TRUE(close(ints.cuda().logsumexp({0}), ints.logsumexp({0}), 1e-6, 1e-6));
  // var of one element with correction 1: nan; of none: nan.
  Tensor one = random({3, 1}, kFloat32, 9);
  EXPECT_TRUE(close(one.cuda().var({1}), one.var({1}), 0, 0));
}

TEST(CudaReduce, LongRowsSplitAcrossBlocksStayAccurate) {
  SKIP_WITHOUT_GPU();
  // 10M float32 elements in one sum: the two-pass path.
  const int64_t n = 10'000'000;
  Tensor x = random({n}, kFloat32, 10, 0, 1);
  Tensor xg = x.cuda();
  double exact = x.to(kFloat64).sum().item<double>();
  EXPECT_NEAR(xg.sum().item<float>(), exact, exact * 2e-6);
  EXPECT_NEAR(xg.mean().item<float>(), exact / n, exact / n * 2e-6);
  EXPECT_TRUE(close(xg.amax(), x.amax(), 0, 0));
  EXPECT_TRUE(close(xg.argmax(), x.argmax(), 0, 0));
  EXPECT_TRUE(close(xg.var(), x.var(), 1e-5, 0));
  // Few long columns: (1M, 3) over dim 0.
  Tensor cols = random({1 << 20, 3}, kFloat32, 11, 0, 1);
  EXPECT_TRUE(close(cols.cuda().sum({0}), cols.sum({0}), 1e-5, 0));
  EXPECT_TRUE(close(cols.cuda().argmin(0), cols.argmin(0), 0, 0));
}

TEST(CudaReduce, CumsumMatchesTheCpu) {
  SKIP_WITHOUT_GPU();
  const std::vector<std::pair<std::vector<int64_t>, int64_t>> cases = {
      {{}, 0}, {{7}, 0}, {{1 << 20}, 0}, {{3, 5000}, 1}, {{3, 5000}, 0}, {{4, 33, 17}, 1}, {{4, 33, 17}, -1},
      {{2, 3, 4, 5}, 1}, {{0, 4}, 1}, {{100, 70}, 1}};
  for (const auto& [sizes, dim] : cases) {
    for (DType t : kAll) {
      Tensor x = random(sizes, t, 12, -3, 3);
      int64_t n = sizes.empty() ? 1 : sizes[dim < 0 ? dim + sizes.size() : dim];
      const double tol = is_floating_point(t) ? 2 * eps(t) + 8 * std::sqrt(n + 1.0) * eps(t == kFloat64 || t == kFloat32 ? kFloat64 : kFloat32) : 0;
      compare_everywhere(x, [&](const Tensor& v) { return std::vector<Tensor>{cumsum(v, dim)}; }, tol,
                         tol * 3 * std::sqrt(n + 1.0), "cumsum " + std::string(dtype_name(t)));
    }
  }
  Tensor x = random({6, 9}, kFloat32, 13);
  EXPECT_TRUE(close(cumsum(x.cuda(), 1, DType::int32), cumsum(x, 1, DType::int32), 0, 0));
  EXPECT_TRUE(close(cumsum(x.cuda(), 0, kFloat64), cumsum(x, 0, kFloat64), 1e-12, 0));
}

TEST(CudaReduce, SoftmaxLogSoftmaxAndBackwardMatchTheCpu) {
  SKIP_WITHOUT_GPU();
  const std::vector<std::pair<std::vector<int64_t>, std::vector<int64_t>>> cases = {
      {{}, {0}}, {{10}, {0}}, {{64, 10}, {1, 0}}, {{8, 1000}, {1, 0}}, {{2, 5000}, {-1}}, {{3, 1 << 17}, {1}},
      {{4, 33, 17}, {0, 1, 2}}, {{2, 3, 4, 5}, {1, 3}}, {{0, 4}, {1}}};
  for (const auto& [sizes, dims] : cases) {
    for (DType t : kFloating) {
      Tensor x = random(sizes, t, 14, -6, 6);
      Tensor g = random(sizes, t, 15, -1, 1);
      for (int64_t dim : dims) {
        const double tol = 4 * eps(t) + 1e-6;
        const std::string what = std::string(dtype_name(t)) + " dim " + std::to_string(dim);
        compare_everywhere(x, [&](const Tensor& v) {
          return std::vector<Tensor>{softmax(v, dim), log_softmax(v, dim)};
        }, tol, tol, "softmax " + what);
        Tensor y = softmax(x, dim), ly = log_softmax(x, dim);
        Tensor gg = g.cuda(), yg = y.cuda(), lyg = ly.cuda();
        auto backward = [&](const char* name, const Tensor& go, const Tensor& out) {
          return call_op1(op(name), {go, out}, {dim, out.dtype()});
        };
        EXPECT_TRUE(close(backward("_softmax_backward_data", gg, yg), backward("_softmax_backward_data", g, y), tol, tol))
            << what;
        EXPECT_TRUE(close(backward("_log_softmax_backward_data", gg, lyg), backward("_log_softmax_backward_data", g, ly),
                          tol, tol * 10))
            << what;
      }
    }
  }
  // dtype= and NaN rows.
  Tensor h = random({5, 40}, kFloat16, 16);
  EXPECT_TRUE(close(softmax(h.cuda(), 1, kFloat32), softmax(h, 1, kFloat32), 1e-6, 1e-7));
  Tensor nan_row = random({3, 50}, kFloat32, 17, -3, 3, 60);
  EXPECT_TRUE(close(softmax(nan_row.cuda(), 1), softmax(nan_row, 1), 1e-6, 1e-7));
}

TEST(CudaReduce, AllcloseAndEqualMatchTheCpu) {
  SKIP_WITHOUT_GPU();
  for (DType t : kAll) {
    Tensor a = random({6, 7}, t, 18);
    Tensor b = a.clone();
    EXPECT_EQ(allclose(a.cuda(), b.cuda()), allclose(a, b)) << dtype_name(t);
    EXPECT_EQ(equal(a.cuda(), b.cuda()), equal(a, b)) << dtype_name(t);
    Tensor c = random({6, 7}, t, 19);
    EXPECT_EQ(allclose(a.cuda(), c.cuda(), 0.5, 1.0), allclose(a, c, 0.5, 1.0)) << dtype_name(t);
    EXPECT_EQ(allclose(a.cuda(), c.cuda(), 10, 10), allclose(a, c, 10, 10)) << dtype_name(t);
    EXPECT_EQ(equal(a.cuda(), c.cuda()), equal(a, c)) << dtype_name(t);
    // Broadcasting and a near miss.
    Tensor row = a.flatten().view({6, 7}).transpose(0, 1).contiguous().transpose(0, 1);
    EXPECT_EQ(allclose(row.cuda(), a.cuda()), true) << dtype_name(t);
  }
  Tensor x = tensor<float>({1, NAN, 3});
  EXPECT_FALSE(allclose(x.cuda(), x.cuda()));
  EXPECT_TRUE(allclose(x.cuda(), x.cuda(), 1e-5, 1e-8, true));
  EXPECT_FALSE(equal(x.cuda(), x.cuda()));
  Tensor y = tensor<float>({1, 2, 3.00001f});
  Tensor z = tensor<float>({1, 2, 3});
  EXPECT_EQ(allclose(y.cuda(), z.cuda()), allclose(y, z));
  EXPECT_EQ(allclose(y.cuda(), z.cuda(), 0, 0), allclose(y, z, 0, 0));
  EXPECT_TRUE(allclose(z.cuda(), tensor<float>({1}).cuda().expand({3}) * 0 + z.cuda()));
  EXPECT_FALSE(equal(z.cuda(), tensor<float>({1, 2}).cuda()));
  EXPECT_TRUE(equal(z.cuda(), z.to(kFloat64).cuda()));
  Tensor e = zeros({0, 3});
  EXPECT_TRUE(allclose(e.cuda(), e.cuda()));
  EXPECT_TRUE(equal(e.cuda(), e.cuda()));
}

TEST(CudaReduce, ErrorsMatchTheCpu) {
  SKIP_WITHOUT_GPU();
  Tensor e = zeros({0, 3}).cuda();
  EXPECT_THROW(e.max(), ValueError);
  EXPECT_THROW(e.amax({0}), IndexError);
  EXPECT_THROW(e.argmax(0), IndexError);
  EXPECT_THROW(ones({2}, TensorOptions(DType::int32)).cuda().mean(), DTypeError);
  EXPECT_THROW(ones({2}, TensorOptions(kBool)).cuda().argmax(), DTypeError);
  EXPECT_THROW(ones({2, 3}).cuda().sum({5}), IndexError);
  EXPECT_THROW(allclose(ones({2}).cuda(), ones({2})), DeviceError);
  EXPECT_THROW(allclose(ones({2}).cuda(), ones({3}).cuda()), ShapeError);
}
