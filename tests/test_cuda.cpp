// CUDA devices: the caching allocator, streams and events, transfers, and the eager pointwise
// kernels against the CPU's. GPU tests skip when no GPU is visible; the NVRTC tests run wherever
// the toolkit is installed (they compile the eager kernels' CUDA C++ for sm_90 without a GPU).
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "cuda_test_helpers.h"
#include "kiln/kiln.h"
#include "reference.h"

#ifdef KILN_WITH_CUDA
#include "kernels/cuda/elementwise.h"
#include "kernels/cuda/jit.h"
#include "kernels/fused_optim.h"
#endif

using namespace kiln;

namespace {

const std::vector<DType> kAllDTypes = {kBool,    DType::uint8, DType::int8,   DType::int32,  DType::int64,
                                       kFloat16, kBFloat16,    kFloat32,      kFloat64};

// Values every dtype can hold approximately (small integers and halves, negatives, zero).
Tensor sample(std::vector<int64_t> sizes, DType dtype, int seed = 0) {
  int64_t n = 1;
  for (int64_t s : sizes) n *= s;
  std::vector<double> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[i] = static_cast<double>(((i * 37 + seed * 11) % 23) - 11) * 0.5;
  return tensor<double>(v, sizes).to(dtype);
}

// Bitwise equality of values (NaNs equal), dtype and shape.
::testing::AssertionResult same(const Tensor& a, const Tensor& b) {
  if (a.dtype() != b.dtype()) return ::testing::AssertionFailure() << "dtypes differ";
  if (a.sizes() != b.sizes()) return ::testing::AssertionFailure() << "shapes differ";
  auto va = a.to_vector<double>(), vb = b.to_vector<double>();
  for (size_t i = 0; i < va.size(); ++i) {
    if (std::isnan(va[i]) && std::isnan(vb[i])) continue;
    if (va[i] != vb[i]) return ::testing::AssertionFailure() << "element " << i << ": " << va[i] << " vs " << vb[i];
  }
  return ::testing::AssertionSuccess();
}

// Values within per-dtype tolerances of the CPU's (NaNs and infinities equal): float32 results
// may differ by an ulp where the CPU's compiler contracted a * b + c into an fma or where the
// device's libm differs from glibc (sin, cos, log1p, ...); 16-bit results by one rounding step.
::testing::AssertionResult close(const Tensor& got, const Tensor& want) {
  if (got.dtype() != want.dtype()) return ::testing::AssertionFailure() << "dtypes differ";
  kiln::testing::Tolerance tol{0, 0};
  switch (want.dtype()) {
    case kFloat32: tol = {2e-6, 1e-6}; break;
    case kFloat64: tol = {1e-15, 1e-15}; break;  // erf's cancellation in gelu's tail: absolute
    case kFloat16: tol = {1e-3, 1e-6}; break;
    case kBFloat16: tol = {8e-3, 1e-6}; break;
    default: return same(got, want);
  }
  return kiln::testing::matches(got, want.sizes().vec(), want.to_vector<double>(), tol);
}

// Runs both sides, reporting an exception as a failure of `what` (not of the whole test).
::testing::AssertionResult agree(const char* what, const std::function<Tensor()>& on_gpu,
                                 const std::function<Tensor()>& on_cpu, bool exact = false) {
  try {
    Tensor got = on_gpu();
    if (!got.is_cuda()) return ::testing::AssertionFailure() << what << ": the result is not on the GPU";
    Tensor want = on_cpu();
    auto r = exact ? same(got.cpu(), want) : close(got.cpu(), want);
    if (!r) return ::testing::AssertionFailure() << what << ": " << r.message();
    return ::testing::AssertionSuccess();
  } catch (const std::exception& e) {
    return ::testing::AssertionFailure() << what << " threw: " << e.what();
  }
}

}  // namespace

// ---- without a GPU ----

TEST(CudaApi, ReportsAvailabilityAndThrowsDeviceErrorsWithoutAGpu) {
  if (cuda::is_available()) GTEST_SKIP() << "a GPU is visible";
  EXPECT_EQ(cuda::device_count(), 0);
  EXPECT_THROW(ones({2}, TensorOptions(cuda_device())), DeviceError);
  EXPECT_THROW(ones({2}).to(cuda_device()), DeviceError);
  EXPECT_THROW(cuda::memory_stats(), DeviceError);
  EXPECT_THROW(cuda::Stream::create(), DeviceError);
  cuda::empty_cache();  // nothing to release, and no error
}

#ifdef KILN_WITH_CUDA

// Every functor of kiln/math/functors.h and the Philox stream, instantiated for each type its ops
// accept, compiled by NVRTC as the eager kernels and generated code compile them.
TEST(CudaJit, KilnMathHeadersCompileWithNvrtc) {
  std::string src = R"(#include "kiln/math/functors.h"
#include "kiln/math/philox.h"
using namespace kiln::math;
template <class T> __device__ void floating(T* o, const T* a) {
  o[0] = Exp{}(a[0]) + Log{}(a[1]) + Log1p{}(a[2]) + Expm1{}(a[3]) + Sin{}(a[4]) + Cos{}(a[5]) + Tan{}(a[6]) +
         Tanh{}(a[7]) + Sigmoid{}(a[8]) + Erf{}(a[9]) + Gelu{}(a[10]) + GeluTanh{}(a[11]) + Silu{}(a[12]) +
         Sqrt{}(a[13]) + Rsqrt{}(a[14]) + Reciprocal{}(a[15]) + Div{}(a[16], a[17]) + Atan2{}(a[18], a[19]) +
         Pow{}(a[20], a[21]) + Lerp{}(a[22], a[23], a[24]) + Addcdiv<T>{a[25]}(a[26], a[27], a[28]);
}
template <class T> __device__ void numeric(T* o, const T* a, bool* b) {
  o[0] = Neg{}(a[0]) + Abs{}(a[1]) + Relu{}(a[2]) + Sign{}(a[3]) + Floor{}(a[4]) + Ceil{}(a[5]) + Round{}(a[6]) +
         Add{}(a[7], a[8]) + Sub{}(a[9], a[10]) + Mul{}(a[11], a[12]) + AddScaled<T>{a[13]}(a[14], a[15]) +
         TruncDiv{}(a[16], a[17]) + FloorDiv{}(a[18], a[19]) + Remainder{}(a[20], a[21]) + Maximum{}(a[22], a[23]) +
         Minimum{}(a[24], a[25]) + Clamp{}(a[26], a[27], a[28]) + ClampMin{}(a[29], a[30]) + ClampMax{}(a[31], a[32]) +
         Addcmul<T>{a[33]}(a[34], a[35], a[36]) + Where{}(b[0], a[37], a[38]) + Square{}(a[39]);
  b[1] = Eq{}(a[0], a[1]) || Ne{}(a[0], a[1]) || Lt{}(a[0], a[1]) || Le{}(a[0], a[1]) || Gt{}(a[0], a[1]) ||
         Ge{}(a[0], a[1]) || LogicalAnd{}(a[0], a[1]) || LogicalOr{}(a[0], a[1]) || LogicalXor{}(a[0], a[1]) ||
         LogicalNot{}(a[2]) || IsNan{}(a[3]) || IsFinite{}(a[4]);
}
template <class T> __device__ void integral(T* o, const T* a) {
  o[0] = BitwiseAnd{}(a[0], a[1]) + BitwiseOr{}(a[2], a[3]) + BitwiseXor{}(a[4], a[5]) + BitwiseNot{}(a[6]) +
         LeftShift{}(a[7], a[8]) + RightShift{}(a[9], a[10]) + Pow{}(a[11], a[12]);
}
extern "C" __global__ void all(float* f, double* d, long long* l, int* i, signed char* c, unsigned char* u,
                               bool* b, unsigned long long seed) {
  floating(f, f + 1); floating(d, d + 1);
  numeric(f, f + 1, b); numeric(d, d + 1, b); numeric(l, l + 1, b); numeric(i, i + 1, b); numeric(c, c + 1, b);
  numeric(u, u + 1, b);
  integral(l, l + 1); integral(i, i + 1); integral(c, c + 1); integral(u, u + 1); integral(b, b + 1);
  kiln::Half h(f[0]); kiln::BFloat16 bf(f[1]); f[2] = static_cast<float>(h) + static_cast<float>(bf);
  PhiloxBlock r = philox_block(seed, 7); u[0] = r.x[0];
}
)";
  std::string cubin = cuda::detail::compile_cubin(src, 90, "functors_test");
  EXPECT_GT(cubin.size(), 1000u);
}

// The fused optimizers' kernels (kernels/fused_optim.h), for every floating dtype.
TEST(CudaJit, FusedOptimizerKernelsCompileForEveryFloatingDType) {
  for (DType t : {kFloat32, kFloat64, kFloat16, kBFloat16}) {
    SCOPED_TRACE(dtype_name(t));
    EXPECT_GT(cuda::detail::compile_cubin(kiln::detail::fused_adam_source(t), 90, "fused_adam").size(), 1000u);
    EXPECT_GT(cuda::detail::compile_cubin(kiln::detail::fused_sgd_source(t), 90, "fused_sgd").size(), 1000u);
  }
}

TEST(CudaJit, GeneratedElementwiseKernelsCompileForEveryDTypeFamily) {
  using cuda::detail::elementwise_sources_for_test;
  struct Case {
    std::string expr;
    DType out;
    std::vector<DType> storage, types, scalars;
  };
  std::vector<Case> cases = {
      {"a0", kFloat16, {kFloat64}, {kFloat16}, {}},                        // copy with conversion
      {"a0", kBool, {kBFloat16}, {kBool}, {}},
      {"kiln::math::Exp{}(a0)", kBFloat16, {kBFloat16}, {kBFloat16}, {}},
      {"kiln::math::AddScaled<float>{c0}(a0, a1)", kFloat32, {kFloat32, DType::int64}, {kFloat32, kFloat32}, {kFloat32}},
      {"kiln::math::Lt{}(a0, a1)", kBool, {DType::int8, DType::int32}, {DType::int32, DType::int32}, {}},
      {"kiln::math::Where{}(a0, a1, a2)", kFloat64, {kBool, kFloat64, kFloat32}, {kBool, kFloat64, kFloat64}, {}},
      {"kiln::math::Addcmul<long long>{c0}(a0, a1, a2)", DType::int64, {DType::int64, DType::int64, DType::uint8},
       {DType::int64, DType::int64, DType::int64}, {DType::int64}},
  };
  for (const Case& c : cases) {
    for (const std::string& src : elementwise_sources_for_test(c.expr, c.out, c.storage, c.types, c.scalars)) {
      SCOPED_TRACE(src);
      EXPECT_NO_THROW(cuda::detail::compile_cubin(src, 90, "elementwise_test"));
    }
  }
}

TEST(CudaJit, CompileErrorsCarryTheLogAndTheSource) {
  try {
    cuda::detail::compile_cubin("extern \"C\" __global__ void k() { undefined_thing(); }", 90, "broken");
    FAIL() << "expected a CompileError";
  } catch (const CompileError& e) {
    std::string what = e.what();
    EXPECT_NE(what.find("undefined_thing"), std::string::npos) << what;
    EXPECT_NE(what.find("--- source ---"), std::string::npos) << what;
  }
}

#endif  // KILN_WITH_CUDA

// ---- on a GPU ----

TEST(CudaDevice, PropertiesAndBadOrdinals) {
  SKIP_WITHOUT_GPU();
  auto p = cuda::get_device_properties();
  EXPECT_FALSE(p.name.empty());
  EXPECT_GT(p.multiprocessors, 0);
  EXPECT_GT(p.total_memory, 0);
  int n = cuda::device_count();
  EXPECT_THROW(ones({2}, TensorOptions(cuda_device(n))), DeviceError);
  EXPECT_THROW(ones({2}).to(cuda_device(n + 3)), DeviceError);
  EXPECT_THROW(cuda::set_device(n), DeviceError);
}

TEST(CudaAllocator, StatisticsFollowAllocationsAndTheCacheIsReused) {
  SKIP_WITHOUT_GPU();
  cuda::synchronize();
  cuda::empty_cache();
  cuda::reset_peak_memory_stats();
  const int64_t base = cuda::memory_allocated();
  {
    Tensor a = empty({1000}, TensorOptions(kFloat32, cuda_device()));  // 4000 bytes -> 4096
    EXPECT_EQ(cuda::memory_allocated() - base, 4096);
    Tensor big = empty({64, 1024, 1024}, TensorOptions(kFloat32, cuda_device()));  // 256 MiB
    EXPECT_EQ(cuda::memory_allocated() - base, 4096 + (int64_t{256} << 20));
    EXPECT_GE(cuda::memory_reserved(), cuda::memory_allocated());
  }
  EXPECT_EQ(cuda::memory_allocated(), base);
  EXPECT_GE(cuda::max_memory_allocated() - base, 4096 + (int64_t{256} << 20));
  // Freed blocks stay reserved and serve the next request of the same size without cudaMalloc.
  int64_t mallocs = cuda::memory_stats().device_mallocs;
  int64_t reserved = cuda::memory_reserved();
  { Tensor again = empty({64, 1024, 1024}, TensorOptions(kFloat32, cuda_device())); }
  EXPECT_EQ(cuda::memory_stats().device_mallocs, mallocs);
  EXPECT_EQ(cuda::memory_reserved(), reserved);
  cuda::empty_cache();
  EXPECT_LT(cuda::memory_reserved(), reserved);
  cuda::reset_peak_memory_stats();
  EXPECT_EQ(cuda::max_memory_allocated(), cuda::memory_allocated());
  // Zero-element tensors take no memory.
  Tensor none = empty({0, 5}, TensorOptions(kFloat32, cuda_device()));
  EXPECT_EQ(cuda::memory_allocated(), base);
  EXPECT_EQ(none.cpu().numel(), 0);
}

TEST(CudaAllocator, SplitBlocksMergeBackAndValuesSurviveReuse) {
  SKIP_WITHOUT_GPU();
  std::vector<Tensor> keep;
  for (int i = 0; i < 64; ++i) keep.push_back(full({1000 + i}, static_cast<double>(i), TensorOptions(kFloat32, cuda_device())));
  for (int i = 0; i < 64; i += 2) keep[i] = Tensor();  // free every other block
  std::vector<Tensor> more;
  for (int i = 0; i < 32; ++i) more.push_back(full({900}, -1.0, TensorOptions(kFloat32, cuda_device())));
  for (int i = 1; i < 64; i += 2) {
    auto v = keep[i].to_vector<float>();
    ASSERT_EQ(v.size(), static_cast<size_t>(1000 + i));
    EXPECT_EQ(v.front(), static_cast<float>(i));
    EXPECT_EQ(v.back(), static_cast<float>(i));
  }
  for (const Tensor& t : more) EXPECT_EQ(t.to_vector<float>()[899], -1.0f);
}

TEST(CudaAllocator, OutOfMemoryThrowsDeviceErrorAndLeavesTheDeviceUsable) {
  SKIP_WITHOUT_GPU();
  int64_t too_much = cuda::get_device_properties().total_memory * 4;
  try {
    Tensor t = empty({too_much / 4}, TensorOptions(kFloat32, cuda_device()));
    FAIL() << "expected a DeviceError";
  } catch (const DeviceError& e) {
    EXPECT_NE(std::string(e.what()).find("out of memory"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(same(ones({3}).cuda().cpu(), ones({3})));
}

TEST(CudaStreams, WorkOnACreatedStreamAndEventTiming) {
  SKIP_WITHOUT_GPU();
  cuda::Stream s = cuda::Stream::create();
  EXPECT_FALSE(s == cuda::Stream::default_stream());
  Tensor x = sample({256, 256}, kFloat32).cuda();
  cuda::Event start, stop;
  Tensor y;
  {
    cuda::StreamGuard guard(s);
    EXPECT_TRUE(cuda::Stream::current() == s);
    start.record();
    y = x * 2 + 1;
    stop.record();
  }
  EXPECT_TRUE(cuda::Stream::current() == cuda::Stream::default_stream());
  stop.synchronize();
  EXPECT_TRUE(stop.query());
  EXPECT_GE(start.elapsed_ms(stop), 0.0f);
  s.synchronize();
  EXPECT_TRUE(s.query());
  EXPECT_TRUE(same(y.cpu(), sample({256, 256}, kFloat32) * 2 + 1));
  cuda::Event unrecorded;
  EXPECT_THROW(unrecorded.elapsed_ms(stop), ValueError);
}

TEST(CudaCopy, RoundTripsEveryDTypeAndLayout) {
  SKIP_WITHOUT_GPU();
  for (DType t : kAllDTypes) {
    SCOPED_TRACE(std::string(dtype_name(t)));
    Tensor x = sample({3, 4, 5, 6}, t);
    Tensor d = x.cuda();
    EXPECT_TRUE(d.is_cuda());
    EXPECT_EQ(d.device(), cuda_device(0));
    EXPECT_TRUE(same(d.cpu(), x));
    // Views: transposed, sliced, expanded, channels-last, 0-dim.
    EXPECT_TRUE(same(x.transpose(1, 3).cuda().cpu(), x.transpose(1, 3)));
    EXPECT_TRUE(same(d.transpose(1, 3).cpu(), x.transpose(1, 3)));
    EXPECT_TRUE(same(d.narrow(2, 1, 3).cpu(), x.narrow(2, 1, 3)));
    EXPECT_TRUE(same(x.narrow(3, 2, 2).cuda().cpu(), x.narrow(3, 2, 2)));
    EXPECT_TRUE(same(d.select(0, 0).unsqueeze(0).expand({4, 4, 5, 6}).contiguous().cpu(),
                     x.select(0, 0).unsqueeze(0).expand({4, 4, 5, 6}).contiguous()));
    Tensor cl = x.contiguous(MemoryFormat::channels_last);
    Tensor dcl = cl.cuda();
    EXPECT_EQ(dcl.strides(), cl.strides());
    EXPECT_TRUE(same(dcl.cpu(), x));
    EXPECT_TRUE(same(d.contiguous(MemoryFormat::channels_last).cpu(), cl));
    Tensor scalar = x.flatten()[5];
    EXPECT_TRUE(same(scalar.cuda().cpu(), scalar));
  }
}

TEST(CudaCopy, ConversionsOnTheDeviceMatchTheCpu) {
  SKIP_WITHOUT_GPU();
  for (DType from : kAllDTypes) {
    Tensor x = sample({7, 9}, from, 3);
    Tensor d = x.cuda();
    for (DType to : kAllDTypes) {
      SCOPED_TRACE(std::string(dtype_name(from)) + " -> " + std::string(dtype_name(to)));
      EXPECT_TRUE(same(d.to(to).cpu(), x.to(to)));                         // on the device
      EXPECT_TRUE(same(x.to(cuda_device(), to).cpu(), x.to(to)));          // during the upload
      EXPECT_TRUE(same(d.t().to(kCPU, to), x.t().to(to)));                 // during the download
    }
  }
}

TEST(CudaCopy, CopyIntoStridedViewsInBothDirections) {
  SKIP_WITHOUT_GPU();
  Tensor host = zeros({6, 8});
  Tensor dev = zeros({6, 8}).cuda();
  Tensor src = sample({3, 8}, kFloat64);
  host.narrow(0, 1, 3).copy_(src);
  dev.narrow(0, 1, 3).copy_(src);             // upload with conversion into a view
  EXPECT_TRUE(same(dev.cpu(), host));
  Tensor back = zeros({8, 6});
  back.t().copy_(dev);                        // download into a transposed view
  EXPECT_TRUE(same(back.t(), host));
  dev.t().narrow(0, 2, 3).copy_(dev.t().narrow(0, 5, 3));  // device to device, strided
  host.t().narrow(0, 2, 3).copy_(host.t().narrow(0, 5, 3).clone());
  EXPECT_TRUE(same(dev.cpu(), host));
  dev.fill_(2.5);
  EXPECT_TRUE(same(dev.cpu(), full({6, 8}, 2.5)));
  dev.t().narrow(0, 1, 2).fill_(0);
  host.fill_(2.5);
  host.t().narrow(0, 1, 2).fill_(0);
  EXPECT_TRUE(same(dev.cpu(), host));
  EXPECT_TRUE(same(zeros({4, 3}, TensorOptions(DType::int64, cuda_device())).cpu(), zeros({4, 3}, DType::int64)));
  EXPECT_TRUE(same(ones({4, 3}, TensorOptions(kFloat16, cuda_device())).cpu(), ones({4, 3}, kFloat16)));
}

// Every unary op, in each float dtype, against the CPU kernel on the same input (the same
// functors; see close() for where the bits may differ).
TEST(CudaPointwise, UnaryOpsMatchTheCpu) {
  SKIP_WITHOUT_GPU();
  using Fn = Tensor (*)(const Tensor&);
  std::vector<std::pair<const char*, Fn>> ops = {
      {"neg", kiln::neg},         {"abs", kiln::abs},       {"exp", kiln::exp},       {"log", kiln::log},
      {"log1p", kiln::log1p},     {"expm1", kiln::expm1},   {"sin", kiln::sin},       {"cos", kiln::cos},
      {"tan", kiln::tan},         {"tanh", kiln::tanh},     {"sigmoid", kiln::sigmoid}, {"relu", kiln::relu},
      {"silu", kiln::silu},       {"sqrt", kiln::sqrt},     {"rsqrt", kiln::rsqrt},   {"reciprocal", kiln::reciprocal},
      {"sign", kiln::sign},       {"floor", kiln::floor},   {"ceil", kiln::ceil},     {"round", kiln::round},
      {"erf", kiln::erf},         {"isnan", kiln::isnan},   {"isfinite", kiln::isfinite}, {"logical_not", kiln::logical_not}};
  std::vector<double> v;
  for (int i = 0; i < 997; ++i) v.push_back(std::sin(i * 0.37) * std::pow(10.0, (i % 9) - 4));
  v.insert(v.end(), {0.0, -0.0, std::numeric_limits<double>::infinity(), -std::numeric_limits<double>::infinity(),
                     std::numeric_limits<double>::quiet_NaN(), 88.5, -88.5, 1e-30});
  for (DType t : {kFloat32, kFloat64, kFloat16, kBFloat16}) {
    Tensor x = tensor<double>(v, {static_cast<int64_t>(v.size())}).to(t);
    Tensor d = x.cuda();
    for (auto [name, f] : ops) {
      SCOPED_TRACE(std::string(name) + " " + std::string(dtype_name(t)));
      Tensor want = f(x), got = f(d).cpu();
      ASSERT_EQ(got.dtype(), want.dtype());
      EXPECT_TRUE(close(got, want));
    }
    Tensor g_want = gelu(x), g_got = gelu(d).cpu();
    EXPECT_TRUE(close(g_got, g_want));
  }
  // Integer inputs keep or promote their dtype as on the CPU.
  Tensor i = sample({40}, DType::int32);
  EXPECT_TRUE(same(kiln::abs(i.cuda()).cpu(), kiln::abs(i)));
  EXPECT_TRUE(same(kiln::exp(i.cuda()).cpu(), kiln::exp(i)));
  EXPECT_TRUE(same(kiln::bitwise_not(i.cuda()).cpu(), kiln::bitwise_not(i)));
}

TEST(CudaPointwise, BinaryOpsBroadcastPromoteAndMatchTheCpu) {
  SKIP_WITHOUT_GPU();
  Tensor a = sample({4, 1, 6}, kFloat32, 1), b = sample({5, 1}, kFloat64, 2);
  Tensor ia = sample({4, 1, 6}, DType::int64, 3), ib = sample({5, 6}, DType::int32, 4) + 20;
  using Fn2 = std::function<Tensor(const Tensor&, const Tensor&)>;
  auto both = [](const char* what, Fn2 f, const Tensor& x, const Tensor& y) {
    return agree(what, [&] { return f(x.cuda(), y.cuda()); }, [&] { return f(x, y); });
  };
  EXPECT_TRUE(both("x + y", [](const Tensor& x, const Tensor& y) { return x + y; }, a, b));
  EXPECT_TRUE(both("x - y", [](const Tensor& x, const Tensor& y) { return x - y; }, ia, ib));
  EXPECT_TRUE(both("add(x, y, 2.5)", [](const Tensor& x, const Tensor& y) { return add(x, y, 2.5); }, a, b));
  EXPECT_TRUE(both("sub(x, y, 3)", [](const Tensor& x, const Tensor& y) { return sub(x, y, 3); }, ia, ib));
  EXPECT_TRUE(both("x * y", [](const Tensor& x, const Tensor& y) { return x * y; }, a, ib));
  EXPECT_TRUE(both("x / y", [](const Tensor& x, const Tensor& y) { return x / y; }, a, b));
  EXPECT_TRUE(both("div(x, y, \"floor\")", [](const Tensor& x, const Tensor& y) { return div(x, y, "floor"); }, ia, ib));
  EXPECT_TRUE(both("div(x, y, \"trunc\")", [](const Tensor& x, const Tensor& y) { return div(x, y, "trunc"); }, a, b));
  EXPECT_TRUE(both("remainder(x, y)", [](const Tensor& x, const Tensor& y) { return remainder(x, y); }, ia, ib));
  EXPECT_TRUE(both("remainder(x, y)", [](const Tensor& x, const Tensor& y) { return remainder(x, y); }, a, b));
  EXPECT_TRUE(both("maximum(x, y)", [](const Tensor& x, const Tensor& y) { return maximum(x, y); }, a, b));
  EXPECT_TRUE(both("minimum(x, y)", [](const Tensor& x, const Tensor& y) { return minimum(x, y); }, ia, ib));
  EXPECT_TRUE(both("pow(x, y)", [](const Tensor& x, const Tensor& y) { return pow(x, y); }, kiln::abs(a), b));
  EXPECT_TRUE(both("x < y", [](const Tensor& x, const Tensor& y) { return x < y; }, a, b));
  EXPECT_TRUE(both("x == y", [](const Tensor& x, const Tensor& y) { return x == y; }, ia, ib));
  EXPECT_TRUE(both("logical_xor(x, y)", [](const Tensor& x, const Tensor& y) { return logical_xor(x, y); }, a, ib));
  EXPECT_TRUE(both("bitwise_and(x, y)", [](const Tensor& x, const Tensor& y) { return bitwise_and(x, y); }, ia, ib));
  EXPECT_TRUE(both("bitwise_left_shift(x, y)", [](const Tensor& x, const Tensor& y) { return bitwise_left_shift(x, y); }, ia, remainder(ib, 5)));
  // Host scalars (wrapped numbers) and 0-dim CPU tensors next to CUDA tensors.
  Tensor h = sample({3, 5}, kFloat16);
  EXPECT_TRUE(agree("h * 0.1", [&] { return (h.cuda() * 0.1); }, [&] { return h * 0.1; }));
  EXPECT_TRUE(agree("2 - h", [&] { return (2 - h.cuda()); }, [&] { return 2 - h; }));
  EXPECT_TRUE(agree("pow(h, 2.7)", [&] { return pow(h.cuda(), 2.7); }, [&] { return pow(h, 2.7); }));
  EXPECT_TRUE(agree("pow(h, 0.5)", [&] { return pow(h.cuda(), 0.5); }, [&] { return pow(h, 0.5); }));
  EXPECT_TRUE(agree("pow(2.0, h)", [&] { return pow(2.0, h.cuda()); }, [&] { return pow(2.0, h); }));
  EXPECT_TRUE(agree("a + 0-dim CPU tensor", [&] { return a.cuda() + full({}, 1.5, TensorOptions(kFloat64)); }, [&] { return a + full({}, 1.5, TensorOptions(kFloat64)); }));
  EXPECT_THROW(div(ia.cuda(), zeros({6}, DType::int64).cuda(), "floor"), ValueError);
  EXPECT_THROW(a.cuda() + a, DeviceError);
}

TEST(CudaPointwise, TernaryOpsAndInPlaceFormsMatchTheCpu) {
  SKIP_WITHOUT_GPU();
  Tensor x = sample({6, 7}, kFloat32, 5), y = sample({7}, kFloat32, 6), w = sample({6, 1}, kFloat32, 7).abs() / 6;
  Tensor c = x > y;
  EXPECT_TRUE(agree("where(c, x, y)", [&] { return where(c.cuda(), x.cuda(), y.cuda()); }, [&] { return where(c, x, y); }));
  EXPECT_TRUE(agree("x.masked_fill(c, -3.0)", [&] { return x.cuda().masked_fill(c.cuda(), -3.0); }, [&] { return x.masked_fill(c, -3.0); }));
  EXPECT_TRUE(agree("clamp(x, -1.0, 2.0)", [&] { return clamp(x.cuda(), -1.0, 2.0); }, [&] { return clamp(x, -1.0, 2.0); }));
  EXPECT_TRUE(agree("clamp(x, y, y + 1)", [&] { return clamp(x.cuda(), y.cuda(), y.cuda() + 1); }, [&] { return clamp(x, y, y + 1); }));
  EXPECT_TRUE(agree("lerp(x, y, w)", [&] { return lerp(x.cuda(), y.cuda(), w.cuda()); }, [&] { return lerp(x, y, w); }));
  EXPECT_TRUE(agree("lerp(x, y, 0.3)", [&] { return lerp(x.cuda(), y.cuda(), 0.3); }, [&] { return lerp(x, y, 0.3); }));
  EXPECT_TRUE(agree("addcmul(x, y, w, 0.5)", [&] { return addcmul(x.cuda(), y.cuda(), w.cuda(), 0.5); }, [&] { return addcmul(x, y, w, 0.5); }));
  EXPECT_TRUE(agree("addcdiv(x, y, w + 1, -2)", [&] { return addcdiv(x.cuda(), y.cuda(), w.cuda() + 1, -2); }, [&] { return addcdiv(x, y, w + 1, -2); }));
  // In place, through views, with version bumps.
  Tensor hx = x.clone(), dx = x.cuda();
  uint64_t v0 = dx.version();
  dx.mul_(2).add_(y.cuda(), 0.5);
  hx.mul_(2).add_(y, 0.5);
  EXPECT_GT(dx.version(), v0);
  EXPECT_TRUE(close(dx.cpu(), hx));
  dx.t().narrow(0, 1, 3).sigmoid_();
  hx.t().narrow(0, 1, 3).sigmoid_();
  EXPECT_TRUE(close(dx.cpu(), hx));
  dx.addcmul_(dx, dx, 0.25);  // reads and writes the same memory
  hx.addcmul_(hx, hx, 0.25);
  EXPECT_TRUE(close(dx.cpu(), hx));
}

namespace {

// Parameters of many sizes (empty, one element, several 65536-element chunks, more than one
// launch's 32 tensors and 256 blocks) of dtype t, on the CPU and the same values on the GPU.
struct TwinParameters {
  std::vector<int64_t> numels = {0, 1, 200000, 65537, 5, 17000000};
  std::vector<Tensor> cpu, gpu;
  DType t;

  explicit TwinParameters(DType dtype) : t(dtype) {
    for (int i = 0; i < 40; ++i) numels.push_back(7 + 3 * i);
    manual_seed(3);
    for (int64_t n : numels) {
      Tensor p = randn({n}).to(t);
      cpu.push_back(p.clone().requires_grad_());
      gpu.push_back(p.to(cuda_device()).requires_grad_());
    }
  }
  // Fresh gradients, the same on both sides.
  void set_grads() {
    for (size_t i = 0; i < numels.size(); ++i) {
      Tensor g = randn({numels[i]}).to(t);
      cpu[i].set_grad(g);
      gpu[i].set_grad(g.to(cuda_device()));
    }
  }
  // Whether tensor `got` (on the GPU) matches `want` (its CPU twin) for parameter i.
  ::testing::AssertionResult same(const Tensor& got, const Tensor& want, size_t i) const {
    const kiln::testing::Tolerance tol = t == kFloat64   ? kiln::testing::Tolerance{1e-12, 1e-12}
                                         : t == kFloat32 ? kiln::testing::Tolerance{2e-5, 1e-6}
                                                         : kiln::testing::Tolerance{2e-2, 1e-2};
    return kiln::testing::matches(got.detach().cpu(), {numels[i]}, want.detach().to_vector<double>(), tol);
  }
};

// The op profiler's table of one opt.step().
std::string profiled_step(optim::Optimizer& opt) {
  reset_op_profile();
  set_op_profiling(true);
  opt.step();
  set_op_profiling(false);
  return op_profile_report();
}

}  // namespace

// The fused Adam/AdamW kernels (kernels/fused_optim.h) against the CPU's fused update: parameters
// of many sizes (TwinParameters), three steps, every floating dtype; the GPU step runs no per-op
// update.
TEST(CudaOptim, FusedAdamOfManyParametersMatchesTheCpu) {
  SKIP_WITHOUT_GPU();
  for (bool adamw : {false, true}) {
    for (DType t : {kFloat32, kFloat64, kBFloat16}) {
      SCOPED_TRACE(std::string(adamw ? "AdamW " : "Adam ") + std::string(dtype_name(t)));
      TwinParameters params(t);
      std::unique_ptr<optim::Optimizer> on_cpu, on_gpu;
      if (adamw) {
        const optim::AdamWOptions o{.lr = 0.01, .weight_decay = 0.05, .amsgrad = true};
        on_cpu = std::make_unique<optim::AdamW>(params.cpu, o);
        on_gpu = std::make_unique<optim::AdamW>(params.gpu, o);
      } else {
        const optim::AdamOptions o{.lr = 0.01, .weight_decay = 0.1, .maximize = true};
        on_cpu = std::make_unique<optim::Adam>(params.cpu, o);
        on_gpu = std::make_unique<optim::Adam>(params.gpu, o);
      }
      for (int k = 0; k < 3; ++k) {
        params.set_grads();
        on_cpu->step();
        const std::string profile = profiled_step(*on_gpu);
        EXPECT_EQ(profile.find("addcdiv"), std::string::npos) << profile;
      }
      for (size_t i = 0; i < params.numels.size(); ++i) {
        EXPECT_TRUE(params.same(params.gpu[i], params.cpu[i], i)) << "parameter " << i;
        EXPECT_TRUE(params.same(on_gpu->state(params.gpu[i]).at("exp_avg"), on_cpu->state(params.cpu[i]).at("exp_avg"), i))
            << "exp_avg " << i;
        EXPECT_EQ(on_gpu->state(params.gpu[i]).at("step").item<float>(), 3.0f);
      }
    }
  }
}

// The fused SGD kernel against the CPU's fused update, as FusedAdamOfManyParametersMatchesTheCpu:
// plain, with momentum, dampening and weight decay, and Nesterov with maximize; three steps.
TEST(CudaOptim, FusedSgdOfManyParametersMatchesTheCpu) {
  SKIP_WITHOUT_GPU();
  const std::vector<optim::SGDOptions> options = {
      {.lr = 0.05},
      {.lr = 0.05, .momentum = 0.9, .dampening = 0.25, .weight_decay = 0.1},
      {.lr = 0.05, .momentum = 0.8, .weight_decay = 0.01, .nesterov = true, .maximize = true}};
  for (size_t oi = 0; oi < options.size(); ++oi) {
    for (DType t : {kFloat32, kFloat64, kBFloat16}) {
      SCOPED_TRACE("options " + std::to_string(oi) + " " + std::string(dtype_name(t)));
      const optim::SGDOptions& o = options[oi];
      TwinParameters params(t);
      optim::SGD on_cpu(params.cpu, o), on_gpu(params.gpu, o);
      for (int k = 0; k < 3; ++k) {
        params.set_grads();
        on_cpu.step();
        const std::string profile = profiled_step(on_gpu);
        EXPECT_NE(profile.find("_fused_sgd_"), std::string::npos) << profile;
        EXPECT_EQ(profile.find("\nadd"), std::string::npos) << profile;
      }
      for (size_t i = 0; i < params.numels.size(); ++i) {
        EXPECT_TRUE(params.same(params.gpu[i], params.cpu[i], i)) << "parameter " << i;
        if (o.momentum != 0) {
          EXPECT_TRUE(params.same(on_gpu.state(params.gpu[i]).at("momentum_buffer"),
                                  on_cpu.state(params.cpu[i]).at("momentum_buffer"), i))
              << "momentum_buffer " << i;
        }
      }
    }
  }
}

TEST(CudaPointwise, PrintingAndItemReadThroughTheHost) {
  SKIP_WITHOUT_GPU();
  Tensor d = tensor<float>({1, 2, 3}, {3}).cuda();
  std::ostringstream os;
  os << d;
  EXPECT_EQ(os.str(), "tensor([1., 2., 3.], device='cuda:0')");
  EXPECT_EQ((d * 2).flatten()[2].item<float>(), 6.0f);
}
