// The kiln backend's CUDA code generation (src/compiler/codegen/cuda): the scheduler lowers
// pointwise work on CUDA devices into kernels, and every generated source compiles with NVRTC
// (CudaJit.* run without a GPU: they build graphs with CUDA-device values by hand); GPU tests
// compile functions on CUDA tensors and compare with eager, checking that generated kernels ran
// (a silent fallback to the dispatcher fails them).
#include <gtest/gtest.h>

#include <cstdlib>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "ops/pointwise_list.h"
#include "compiler/codegen/cpp/cpp_codegen.h"
#include "compiler/codegen/cuda/cuda_codegen.h"
#include "compiler/lower/loop_ir.h"
#include "compiler/runtime/cuda_launch.h"
#include "kiln/compiler/graph.h"
#include "kiln/detail/tensor_impl.h"
#include "cuda_test_helpers.h"
#include "graph_builders.h"
#include "op_samples.h"
#include "kiln/kiln.h"

#ifdef KILN_WITH_CUDA
#include "kernels/cuda/jit.h"
#endif

using namespace kiln;
using kiln::compiler::Graph;
using kiln::compiler::Node;
using kiln::compiler::ValueInfo;
namespace lower = kiln::compiler::lower;
namespace codegen = kiln::compiler::codegen;

namespace {

const Device kGpu = cuda_device(0);

using kiln::testing::op;

ValueInfo value(std::vector<int64_t> sizes, DType dtype = kFloat32, Device device = kGpu) {
  return kiln::testing::contiguous_value(std::move(sizes), dtype, device);
}

int call(Graph& g, std::string_view name, std::vector<int> inputs, std::vector<Attr> attrs, ValueInfo out) {
  return kiln::testing::add_call(g, name, std::move(inputs), std::move(attrs), {std::move(out)})[0];
}

// A 0-dim CPU host scalar (what `x * 2` wraps 2 into): a graph input, as capture records it.
int host_scalar(Graph& g, DType dtype) {
  ValueInfo v = value({}, dtype, kCPU);
  v.is_wrapped_number = true;
  return g.add_input(std::move(v));
}

// Schedules g; every kernel on the GPU has its source generated and compiled for sm_90. Returns
// the program (and the sources in `sources`).
lower::Program lower_and_compile(Graph g, std::vector<std::string>* sources = nullptr, int expect_cuda_kernels = -1,
                                 bool dynamic_sizes = false) {
  lower::Program p = lower::schedule(std::move(g));
  int cuda_kernels = 0;
  for (const lower::Kernel& k : p.kernels) {
    if (!k.device.is_cuda()) continue;
    ++cuda_kernels;
    codegen::CudaKernelSource src = codegen::generate_cuda(k, dynamic_sizes);
    if (sources) sources->push_back(src.source);
#ifdef KILN_WITH_CUDA
    EXPECT_NO_THROW(cuda::detail::compile_cubin(src.source, 90, k.name)) << src.source;
#endif
  }
  if (expect_cuda_kernels >= 0) {
    EXPECT_EQ(cuda_kernels, expect_cuda_kernels) << lower::describe(p);
  }
  return p;
}

bool contains(const std::string& s, const std::string& what) { return s.find(what) != std::string::npos; }

}  // namespace

// ---- lowering and NVRTC, no GPU needed ----

TEST(CudaJit, SinPlusCosTimesHostScalarIsOneKernel) {
  Graph g;
  int x = g.add_input(value({8, 16}));
  int y = g.add_input(value({8, 16}));
  int two = host_scalar(g, kInt64);
  int s = call(g, "sin", {x}, {}, value({8, 16}));
  int c = call(g, "cos", {y}, {}, value({8, 16}));
  int m = call(g, "mul", {c, two}, {}, value({8, 16}));
  g.outputs = {call(g, "add", {s, m}, {Scalar(1)}, value({8, 16}))};
  std::vector<std::string> src;
  lower::Program p = lower_and_compile(g, &src, 1);
  EXPECT_EQ(p.extern_nodes, 0);
  EXPECT_EQ(p.fused_nodes, 4);
  ASSERT_EQ(src.size(), 1u);
  EXPECT_TRUE(contains(src[0], "kg::unpack<int64_t>"));  // the host scalar travels by value
  EXPECT_TRUE(contains(src[0], "kiln::math::Sin{}"));
  EXPECT_TRUE(contains(src[0], "for (int i = "));        // small: 32-bit index math
  EXPECT_TRUE(p.kernels[0].host_buffers.at(2));
  // No C++ for the system compiler.
  EXPECT_TRUE(codegen::generate_cpp(p).empty());
}

TEST(CudaJit, BroadcastingAndNonContiguousInputs) {
  Graph g;
  int a = g.add_input(value({4, 1, 5}));
  ValueInfo bt = value({3, 5});
  bt.strides = {1, 3};  // a transposed view
  int b = g.add_input(bt);
  ValueInfo cl = value({2, 3, 4, 5});
  cl.strides = {60, 1, 15, 3};  // channels-last
  int c = g.add_input(cl);
  int s = call(g, "add", {a, b}, {Scalar(1)}, value({4, 3, 5}));
  int e = call(g, "exp", {s}, {}, value({4, 3, 5}));
  ValueInfo clo = cl;
  int r = call(g, "relu", {c}, {}, clo);
  int t = call(g, "mul", {r, r}, {}, clo);
  g.outputs = {e, t};
  std::vector<std::string> src;
  lower::Program p = lower_and_compile(g, &src, 2);
  EXPECT_EQ(p.extern_nodes, 0);
  if (std::getenv("KILN_TEST_PRINT_SOURCES"))
    for (const auto& s : src) std::cout << s;
}

TEST(CudaJit, MixedDtypeChain) {
  Graph g;
  int x = g.add_input(value({6, 7}, kInt32));
  int y = g.add_input(value({6, 7}, kFloat32));
  int z = g.add_input(value({6, 7}, kFloat64));
  int u = g.add_input(value({6, 7}, DType::uint8));
  int a = call(g, "add", {x, y}, {Scalar(1)}, value({6, 7}, kFloat32));
  int b = call(g, "gt", {a, y}, {}, value({6, 7}, kBool));
  int w = call(g, "where", {b, a, z}, {}, value({6, 7}, kFloat64));
  int c = call(g, "copy", {w}, {}, value({6, 7}, DType::uint8));
  int d = call(g, "add", {c, u}, {Scalar(3)}, value({6, 7}, DType::uint8));
  int n = call(g, "logical_not", {b}, {}, value({6, 7}, kBool));
  int i = call(g, "mul", {x, x}, {}, value({6, 7}, kInt32));
  g.outputs = {w, d, n, i};
  std::vector<std::string> src;
  lower_and_compile(g, &src, 1);
  ASSERT_EQ(src.size(), 1u);
  EXPECT_TRUE(contains(src[0], "kg::convert<uint8_t>"));  // float64 -> uint8 as the CPU converts
}

TEST(CudaJit, EveryPointwiseOpCompiles) {
  // The one-functor ops of src/ops/pointwise_list.h that take floats; the integer-only bitwise
  // ops are compiled by the integer case below.
  std::vector<std::string> unary, binary, compare, predicate;
#define KILN_TEST_UNARY(name, Functor, rule, derivative)              \
  if (std::string_view(#rule) == "predicate") predicate.push_back(#name); \
  else if (std::string_view(#rule) != "bitwise") unary.push_back(#name);
  KILN_UNARY_POINTWISE_OPS(KILN_TEST_UNARY)
#undef KILN_TEST_UNARY
#define KILN_TEST_BINARY(name, Functor, rule, derivative)           \
  if (std::string_view(#rule) == "compare") compare.push_back(#name);   \
  else if (std::string_view(#rule) == "keep" || std::string_view(#rule) == "floating") binary.push_back(#name);
  KILN_BINARY_POINTWISE_OPS(KILN_TEST_BINARY)
#undef KILN_TEST_BINARY
  binary.push_back("pow");
  for (DType t : {kFloat32, kFloat64}) {
    Graph g;
    int x = g.add_input(value({33}, t));
    int y = g.add_input(value({33}, t));
    int m = g.add_input(value({33}, kBool));
    std::vector<int> outs;
    for (const auto& n : unary) outs.push_back(call(g, n, {x}, {}, value({33}, t)));
    for (const auto& n : binary) outs.push_back(call(g, n, {x, y}, {}, value({33}, t)));
    for (const auto& n : compare) outs.push_back(call(g, n, {x, y}, {}, value({33}, kBool)));
    for (const auto& n : predicate) outs.push_back(call(g, n, {x}, {}, value({33}, kBool)));
    outs.push_back(call(g, "sub", {x, y}, {Scalar(2)}, value({33}, t)));
    outs.push_back(call(g, "div", {x, y}, {}, value({33}, t)));
    outs.push_back(call(g, "div", {x, y}, {std::string("floor")}, value({33}, t)));
    outs.push_back(call(g, "gelu", {x}, {std::string("tanh")}, value({33}, t)));
    outs.push_back(call(g, "gelu", {x}, {std::string("none")}, value({33}, t)));
    outs.push_back(call(g, "clamp", {x, y, y}, {}, value({33}, t)));
    outs.push_back(call(g, "lerp", {x, y, y}, {}, value({33}, t)));
    outs.push_back(call(g, "addcmul", {x, y, y}, {Scalar(0.5)}, value({33}, t)));
    outs.push_back(call(g, "addcdiv", {x, y, y}, {Scalar(0.5)}, value({33}, t)));
    outs.push_back(call(g, "masked_fill", {x, m, y}, {}, value({33}, t)));
    g.outputs = outs;
    lower::Program p = lower_and_compile(g);
    EXPECT_EQ(p.extern_nodes, 0) << lower::describe(p);
  }
  // The integer-only ops (bitwise, shifts) and remainder, in int64.
  Graph g;
  int x = g.add_input(value({33}, kInt64));
  int y = g.add_input(value({33}, kInt64));
  std::vector<int> outs;
#define KILN_TEST_INTEGER_UNARY(name, Functor, rule, derivative) \
  if (std::string_view(#rule) == "bitwise") outs.push_back(call(g, #name, {x}, {}, value({33}, kInt64)));
  KILN_UNARY_POINTWISE_OPS(KILN_TEST_INTEGER_UNARY)
#undef KILN_TEST_INTEGER_UNARY
#define KILN_TEST_INTEGER_BINARY(name, Functor, rule, derivative)                  \
  if (std::string_view(#rule) == "bitwise" || std::string_view(#rule) == "shift") \
    outs.push_back(call(g, #name, {x, y}, {}, value({33}, kInt64)));
  KILN_BINARY_POINTWISE_OPS(KILN_TEST_INTEGER_BINARY)
#undef KILN_TEST_INTEGER_BINARY
  g.outputs = outs;
  lower::Program p = lower_and_compile(g);
  EXPECT_EQ(p.extern_nodes, 0) << lower::describe(p);
}

TEST(CudaJit, RunTimeScalarsArePassedNotBaked) {
  Graph g;
  int x = g.add_input(value({10}));
  int a = call(g, "add", {x, x}, {Scalar(0.25)}, value({10}));
  int b = call(g, "addcmul", {a, x, x}, {Scalar(int64_t{3})}, value({10}));
  g.outputs = {b};
  g.scalars = {{0, 0}, {1, 0}};  // both alphas are run-time scalars
  std::vector<std::string> src;
  lower::Program p = lower_and_compile(g, &src, 1);
  codegen::CudaKernelSource s = codegen::generate_cuda(p.kernels[0]);
  EXPECT_EQ(s.scalars, (std::vector<int>{0, 1}));
  EXPECT_TRUE(contains(s.source, "p.s[0]"));
  EXPECT_FALSE(contains(s.source, "0.25"));
  EXPECT_EQ(s.buffers, 2u);  // x and the result
  EXPECT_EQ(s.slots(), 2u + 2 * 2 + 1);  // buffers, scalars as double and int64, one (unused) size slot
}

TEST(CudaJit, FusedCatAndLargeIterationSpaces) {
  Graph g;
  int x = g.add_input(value({4, 3}));
  int y = g.add_input(value({4, 5}));
  int c = call(g, "cat", {x, y}, {int64_t{1}}, value({4, 8}));
  g.outputs = {call(g, "mul", {c, c}, {}, value({4, 8}))};
  lower_and_compile(g, nullptr, 1);

  // 2^32 elements: 64-bit index math (nothing is allocated: sources only).
  Graph big;
  int bx = big.add_input(value({int64_t{1} << 16, int64_t{1} << 16}, DType::uint8));
  big.outputs = {call(big, "neg", {bx}, {}, value({int64_t{1} << 16, int64_t{1} << 16}, DType::uint8))};
  std::vector<std::string> src;
  lower_and_compile(big, &src, 1);
  ASSERT_EQ(src.size(), 1u);
  EXPECT_TRUE(contains(src[0], "for (long long i = "));

  // Empty: a kernel with nothing to launch.
  Graph empty;
  int ex = empty.add_input(value({0, 4}));
  empty.outputs = {call(empty, "exp", {ex}, {}, value({0, 4}))};
  lower::Program p = lower_and_compile(empty, nullptr, 1);
  EXPECT_EQ(codegen::generate_cuda(p.kernels[0]).numel, 0);
}

// A dynamic graph's kernels (dynamic shapes): sizes, strides and offsets are Params::z arguments,
// so the same graph at two sizes prints one source, which NVRTC compiles.
TEST(CudaJit, DynamicSizesAreKernelArguments) {
  auto graph_at = [](int64_t n) {
    Graph g;
    int x = g.add_input(value({n, 6}));
    int y = g.add_input(value({n, 4}));
    int c = call(g, "cat", {x, y}, {int64_t{1}}, value({n, 10}));
    int m = call(g, "mul", {c, c}, {}, value({n, 10}));
    int s = call(g, "sum", {m}, {std::vector<int64_t>{1}, true}, value({n, 1}));
    g.outputs = {m, call(g, "add", {s, s}, {Scalar(1)}, value({n, 1}))};
    return g;
  };
  std::vector<std::string> at5, at9;
  lower::Program p5 = lower_and_compile(graph_at(5), &at5, -1, true);
  lower::Program p9 = lower_and_compile(graph_at(9), &at9, -1, true);
  ASSERT_FALSE(at5.empty());
  EXPECT_EQ(at5, at9) << "one source serves both sizes";
  bool divides = false;
  for (const std::string& src : at5) {
    EXPECT_TRUE(contains(src, "long long z[")) << src;
    EXPECT_TRUE(contains(src, "p.z[")) << src;
    divides = divides || contains(src, "kg::div_magic(");
  }
  EXPECT_TRUE(divides) << "the cat's 2-D index divides by a run-time size through its magic number";
  const codegen::CudaKernelSource k5 = codegen::generate_cuda(p5.kernels[0], true);
  const codegen::CudaKernelSource k9 = codegen::generate_cuda(p9.kernels[0], true);
  EXPECT_EQ(k5.size_args.size(), k9.size_args.size());
  EXPECT_NE(k5.size_args, k9.size_args);
  EXPECT_EQ(k5.slots(), k5.buffers + 2 + k5.size_args.size());
}

TEST(CudaJit, KernelsNeverMixDevices) {
  Graph g;
  int xc = g.add_input(value({5, 5}, kFloat32, kCPU));
  int xg = g.add_input(value({5, 5}));
  int a = call(g, "exp", {xc}, {}, value({5, 5}, kFloat32, kCPU));
  int b = call(g, "exp", {xg}, {}, value({5, 5}));
  // A CUDA op reading a CPU tensor that is not 0-dim is not lowered (eager raises its device error).
  int bad = call(g, "mul", {b, a}, {}, value({5, 5}));
  // The sum: a CUDA kernel of its own (the mul read b from memory, which closed b's kernel).
  int r = call(g, "sum", {b}, {std::vector<int64_t>{1}, false}, value({5}));
  g.outputs = {a, b, bad, r};
  lower::Program p = lower_and_compile(g, nullptr, 2);
  int cpu = 0;
  for (const auto& k : p.kernels) {
    if (k.device.is_cpu()) ++cpu;
    for (bool h : k.host_buffers) EXPECT_FALSE(h);
  }
  EXPECT_EQ(cpu, 1);
  EXPECT_EQ(p.extern_nodes, 1) << lower::describe(p);
  EXPECT_EQ(codegen::generate_cpp(p).size(), 1u);
}

TEST(CudaJit, ReductionsWithPrologueAndEpilogue) {
  // x.exp().sum(1) * 2 + 1 over rows, a mean, amax keepdim, a full sum, an int64 sum, a column sum.
  Graph g;
  int x = g.add_input(value({16, 300}));
  int e = call(g, "exp", {x}, {}, value({16, 300}));
  int s = call(g, "sum", {e}, {std::vector<int64_t>{1}, false}, value({16}));
  int m = call(g, "mul", {s, host_scalar(g, kInt64)}, {}, value({16}));
  int a = call(g, "add", {m, g.add_input(value({16}))}, {Scalar(1)}, value({16}));
  int mean = call(g, "mean", {x}, {std::vector<int64_t>{0}, false}, value({300}));
  int mx = call(g, "amax", {x}, {std::vector<int64_t>{1}, true}, value({16, 1}));
  int full = call(g, "sum", {x}, {std::vector<int64_t>{}, false}, value({}));
  int xi = g.add_input(value({7, 9}, kInt32));
  int si = call(g, "sum", {xi}, {std::vector<int64_t>{1}, false}, value({7}, kInt64));
  int mn = call(g, "amin", {xi}, {std::vector<int64_t>{0}, false}, value({9}, kInt32));
  g.outputs = {e, a, mean, mx, full, si, mn};
  std::vector<std::string> src;
  lower::Program p = lower_and_compile(g, &src);
  EXPECT_EQ(p.extern_nodes, 0) << lower::describe(p);
  int reductions = 0;
  for (const auto& k : p.kernels) {
    EXPECT_TRUE(k.device.is_cuda());
    if (k.kind != lower::Kernel::reduction) continue;
    ++reductions;
    EXPECT_TRUE(codegen::generate_cuda(k).per_block);
  }
  EXPECT_EQ(reductions, 6);
  bool has_epilogue = false;
  for (const auto& s : src) has_epilogue |= contains(s, "kiln::math::Mul{}") && contains(s, "__shared__ double");
  EXPECT_TRUE(has_epilogue);
  if (std::getenv("KILN_TEST_PRINT_SOURCES"))
    for (const auto& s : src) std::cout << s;

  // An empty reduced range writes the identity; an empty kept range launches nothing.
  Graph z;
  int zx = z.add_input(value({4, 0}));
  int zs = call(z, "sum", {zx}, {std::vector<int64_t>{1}, false}, value({4}));
  int zm = call(z, "mean", {zx}, {std::vector<int64_t>{1}, false}, value({4}));
  int zk = call(z, "sum", {zx}, {std::vector<int64_t>{0}, false}, value({0}));
  z.outputs = {zs, zm, zk};
  lower::Program zp = lower_and_compile(z, nullptr, 3);
  EXPECT_EQ(codegen::generate_cuda(zp.kernels[0]).numel, 4);
  EXPECT_EQ(codegen::generate_cuda(zp.kernels[2]).numel, 0);
}

// A small pointwise value that only larger pointwise kernels read is deferred on the GPU: each
// reader recomputes it from its inputs instead of a kernel of its own. Not when a node between it
// and a reader writes those inputs (a fused optimizer step writing the parameters): that reader
// would recompute it from the new values.
TEST(CudaJit, AValueIsNotDeferredPastAWriteOfItsInputs) {
  auto program = [](bool written_between) {
    Graph g;
    int w = g.add_input(value({8}));
    int x = g.add_input(value({4, 16, 16, 8}));
    int scale = call(g, "mul", {w, host_scalar(g, kFloat32)}, {}, value({8}));
    int before = call(g, "mul", {x, scale}, {}, value({4, 16, 16, 8}));
    if (written_between) {
      Node& write = g.add_node(op("add"), {w, w}, {Scalar(1)});  // w += w
      write.inplace = true;
      write.outputs = {w};
    }
    int after = call(g, "add", {x, scale}, {Scalar(1)}, value({4, 16, 16, 8}));
    g.outputs = {before, after};
    EXPECT_NO_THROW(g.validate());
    return lower::schedule(std::move(g));
  };
  auto kernel_over = [](const lower::Program& p, int64_t numel) {
    int n = 0;
    for (const lower::Kernel& k : p.kernels) {
      int64_t e = 1;
      for (int64_t d : k.sizes) e *= d;
      n += e == numel;
    }
    return n;
  };
  const lower::Program free = program(false);
  EXPECT_EQ(kernel_over(free, 8), 0) << "deferred into its readers:\n" << lower::describe(free);
  const lower::Program written = program(true);
  EXPECT_GE(kernel_over(written, 8), 1) << "computed once, before the write:\n" << lower::describe(written);
}

// The kiln backend compiles a graph's kernels in batches, one NVRTC program each: kernels with
// the same entry point name and their own Params structs share one translation unit.
TEST(CudaJit, BatchedKernelsShareOneProgram) {
  std::vector<codegen::CudaKernelSource> kernels;
  for (const char* unary : {"sin", "sin", "exp"}) {
    Graph g;
    int x = g.add_input(value({4, 8}));
    int y = g.add_input(value({4, 8}));
    int u = call(g, unary, {x}, {}, value({4, 8}));
    g.outputs = {call(g, "mul", {u, y}, {}, value({4, 8}))};
    lower::Program p = lower::schedule(std::move(g));
    ASSERT_EQ(p.kernels.size(), 1u);
    kernels.push_back(codegen::generate_cuda(p.kernels[0]));
  }
  // A reduction too: its helpers must not clash with the pointwise kernels' definitions.
  {
    Graph g;
    int x = g.add_input(value({16, 32}));
    g.outputs = {call(g, "sum", {x}, {std::vector<int64_t>{1}, false}, value({16}))};
    lower::Program p = lower::schedule(std::move(g));
    ASSERT_EQ(p.kernels.size(), 1u);
    kernels.push_back(codegen::generate_cuda(p.kernels[0]));
  }
  EXPECT_EQ(kernels[0].name, kernels[1].name);
  std::vector<const codegen::CudaKernelSource*> members;
  for (const auto& k : kernels) members.push_back(&k);
  codegen::CudaModuleSource m = codegen::batch_cuda(members);
  ASSERT_EQ(m.names.size(), 4u);
  for (size_t i = 0; i < m.names.size(); ++i) {
    EXPECT_EQ(m.names[i], kernels[i].name + "_" + std::to_string(i));
    EXPECT_TRUE(contains(m.source, " " + m.names[i] + "(Params p)")) << m.names[i];
  }
#ifdef KILN_WITH_CUDA
  EXPECT_NO_THROW(cuda::detail::compile_cubin(m.source, 90, "batch")) << m.source;
#endif
}

TEST(CudaJit, RejectsWhatItDoesNotHandle) {
  lower::Kernel k;
  k.device = kCPU;
  EXPECT_THROW(codegen::generate_cuda(k), CompileError);
  k.device = kGpu;
  k.kind = lower::Kernel::reduction;
  k.acc_dtype = kiln::kBool;  // no accumulator type

  EXPECT_THROW(codegen::generate_cuda(k), CompileError);
}

// ---- on a GPU: compiled against eager ----

namespace {

const CompileOptions kKiln{.backend = std::string("kiln")};
const CompileOptions kReduceOverhead{.backend = std::string("kiln"), .mode = Mode::reduce_overhead};

Tensor gpu_randn(std::vector<int64_t> sizes, DType t = kFloat32) {
  return randn(sizes, TensorOptions(kFloat32, cuda_device())).to(t);
}

::testing::AssertionResult same(const Tensor& got, const Tensor& want, double rtol = 1e-6, double atol = 1e-6) {
  if (!got.is_cuda()) return ::testing::AssertionFailure() << "not on the GPU";
  if (got.dtype() != want.dtype()) return ::testing::AssertionFailure() << "dtype differs";
  if (got.sizes() != want.sizes()) return ::testing::AssertionFailure() << "shape differs";
  Tensor g = got.cpu(), w = want.cpu();
  if (is_floating_point(g.dtype())) {
    if (!allclose(g, w, rtol, atol)) return ::testing::AssertionFailure() << "values differ";
  } else if (!equal(g, w)) {
    return ::testing::AssertionFailure() << "values differ";
  }
  return ::testing::AssertionSuccess();
}

}  // namespace

TEST(CudaCodegen, SinPlusCosTimesTwo) {
  SKIP_WITHOUT_GPU();
  compiler::reset();
  auto f = [](const Tensor& x, const Tensor& y) { return sin(x) + cos(y) * 2; };
  auto compiled = compile(f, kKiln);
  for (auto sizes : std::vector<std::vector<int64_t>>{{1000}, {33, 17}, {0, 5}}) {
    Tensor x = gpu_randn(sizes), y = gpu_randn(sizes);
    EXPECT_TRUE(same(compiled(x, y), f(x, y)));
  }
  auto c = compiler::counters();
  EXPECT_GE(c.kernel_runs, 3);
  EXPECT_EQ(c.dispatched_nodes, 0);
}

// Default mode on a GPU says when a graph launches many steps from the host (reduce_overhead would
// replay them as one CUDA graph); reduce_overhead itself, and a short graph, say nothing.
TEST(CudaCodegen, PerfHintsSuggestReduceOverheadForALaunchBoundGraph) {
  SKIP_WITHOUT_GPU();
  auto chain = [](int links) {
    return [links](const Tensor& x, const Tensor& w) {
      Tensor y = x;
      for (int i = 0; i < links; ++i) y = relu(y.mm(w)) * 0.5;  // a GEMM and a fused kernel per link
      return y;
    };
  };
  Tensor x = gpu_randn({16, 16}), w = gpu_randn({16, 16});
  auto hints = [&](int links, const CompileOptions& options) {
    compiler::reset();
    std::ostringstream os;
    compiler::set_logs({.perf_hints = true});
    compiler::set_log_stream(&os);
    compile(chain(links), options)(x, w);
    compiler::set_log_stream(nullptr);
    compiler::set_logs({});
    return os.str();
  };
  EXPECT_NE(hints(40, kKiln).find("reduce_overhead replays"), std::string::npos);
  EXPECT_EQ(hints(4, kKiln).find("reduce_overhead replays"), std::string::npos);
  EXPECT_EQ(hints(40, kReduceOverhead).find("reduce_overhead replays"), std::string::npos);
}

// The op table on the GPU: every op with a pointwise or reduction lowering that has a CUDA kernel,
// called in one compiled function per float dtype, runs in generated kernels and matches eager.
TEST(CudaCodegen, EveryOpWithAFusedLoweringInTheTableFusesAndMatchesEager) {
  SKIP_WITHOUT_GPU();
  std::vector<const OpDef*> ops;
  for (const OpDef* op : OpTable::instance().all())
    if (kiln::testing::has_fused_lowering(*op) && op->has_kernel(DeviceType::cuda)) ops.push_back(op);
  ASSERT_GE(ops.size(), 60u);
  // Positive (log, sqrt, pow stay finite: the comparison below does not match NaN with NaN).
  auto floats = [](IntArrayRef sizes, DType t, size_t) { return (randint(1, 17, sizes) * 0.25).to(t); };
  for (DType t : {kFloat32, kFloat64}) {
    SCOPED_TRACE(dtype_name(t));
    compiler::reset();
    const kiln::testing::SampleBatch batch = kiln::testing::sample_batch(ops, t, kGpu, floats);
    EXPECT_TRUE(batch.unknown.empty());
    EXPECT_GE(batch.calls.size(), 50u);
    auto compiled = compile([&batch](const std::vector<Tensor>& in) { return batch.run(in); }, kKiln);
    std::vector<Tensor> got = compiled(batch.inputs);
    EXPECT_EQ(compiler::counters().dispatched_nodes, 0) << "every lowered op runs in generated code";
    EXPECT_GT(compiler::counters().kernel_runs, 0);
    ASSERT_EQ(got.size(), batch.eager.size());
    const double tol = t == kFloat64 ? 1e-12 : 1e-5;
    for (size_t i = 0; i < got.size(); ++i) {
      const bool reduction = std::holds_alternative<lowering::Reduction>(batch.producer[i]->lowering);
      EXPECT_TRUE(same(got[i], batch.eager[i], reduction ? 100 * tol : tol, reduction ? 100 * tol : tol))
          << batch.producer[i]->name;
    }
  }
}

TEST(CudaCodegen, BroadcastingAndNonContiguous) {
  SKIP_WITHOUT_GPU();
  compiler::reset();
  auto f = [](const Tensor& a, const Tensor& b) { return (a + b).exp() * b; };
  auto compiled = compile(f, kKiln);
  Tensor a = gpu_randn({4, 1, 5}), b = gpu_randn({5, 3}).t();
  EXPECT_TRUE(same(compiled(a, b), f(a, b)));
  Tensor c = gpu_randn({2, 3, 4, 5}).permute({0, 2, 3, 1}).contiguous().permute({0, 3, 1, 2});  // channels-last
  Tensor d = gpu_randn({2, 3, 4, 5});
  EXPECT_TRUE(same(compiled(c, d), f(c, d)));
  EXPECT_GE(compiler::counters().kernel_runs, 2);
}

// A DenseNet-style growing concatenation feeding a per-channel affine + relu: the cat fuses into
// the pointwise kernel, which picks each element's source by its channel (NCHW and channels-last,
// segments of unequal widths, a cat along the last dim too).
TEST(CudaCodegen, FusedCatPicksEachElementsSegment) {
  SKIP_WITHOUT_GPU();
  compiler::reset();
  auto f = [](const Tensor& a, const Tensor& b, const Tensor& c, const Tensor& scale) {
    return relu(cat({a, b, c}, 1) * scale.view({1, -1, 1, 1}) + 1);
  };
  auto compiled = compile(f, kKiln);
  for (bool channels_last : {false, true}) {
    auto make = [&](int64_t ch) {
      Tensor t = gpu_randn({3, ch, 5, 7});
      return channels_last ? t.contiguous(MemoryFormat::channels_last) : t;
    };
    Tensor a = make(4), b = make(32), c = make(3), scale = gpu_randn({39});
    EXPECT_TRUE(same(compiled(a, b, c, scale), f(a, b, c, scale))) << "channels_last " << channels_last;
  }
  auto g = [](const Tensor& a, const Tensor& b) { return cat({a, b}, -1).exp(); };
  auto compiled_g = compile(g, kKiln);
  Tensor a = gpu_randn({6, 5}), b = gpu_randn({6, 9});
  EXPECT_TRUE(same(compiled_g(a, b), g(a, b)));
  EXPECT_GE(compiler::counters().kernel_runs, 3);
}

TEST(CudaCodegen, MixedDtypeChain) {
  SKIP_WITHOUT_GPU();
  compiler::reset();
  auto f = [](const Tensor& i, const Tensor& x, const Tensor& z) {
    Tensor a = i + x;                  // int32 + float32 -> float32
    Tensor w = where(a > x, a, z);     // float64
    return w.to(DType::uint8) + 3;     // float64 -> uint8 as the CPU converts
  };
  auto compiled = compile(f, kKiln);
  Tensor i = (gpu_randn({64, 3}) * 100).to(kInt32), x = gpu_randn({64, 3}) * 100, z = gpu_randn({64, 3}, kFloat64) * 100;
  EXPECT_TRUE(same(compiled(i, x, z), f(i, x, z)));
  EXPECT_GE(compiler::counters().kernel_runs, 1);
}

TEST(CudaCodegen, InPlaceOp) {
  SKIP_WITHOUT_GPU();
  compiler::reset();
  auto f = [](Tensor x, const Tensor& y) {
    x.mul_(2).add_(y);
    return x.sin();
  };
  auto compiled = compile(f, kKiln);
  Tensor x = gpu_randn({100}), y = gpu_randn({100});
  Tensor xe = x.clone(), xc = x.clone();
  Tensor want = f(xe, y);
  Tensor got = compiled(xc, y);
  EXPECT_TRUE(same(got, want));
  EXPECT_TRUE(same(xc, xe));
  EXPECT_GE(compiler::counters().kernel_runs, 1);
}

TEST(CudaCodegen, RunTimeScalarsAndReduceOverhead) {
  SKIP_WITHOUT_GPU();
  compiler::reset();
  auto f = [](const Tensor& x, double s) { return (x * s).tanh() + s; };
  auto compiled = compile(f, kReduceOverhead);
  Tensor x = gpu_randn({4096});
  for (int k = 0; k < 6; ++k) {
    double s = k < 3 ? 1.5 : 0.25 * k;
    EXPECT_TRUE(same(compiled(x, s), f(x, s))) << "call " << k;
  }
  auto c = compiler::counters();
  EXPECT_GE(c.kernel_runs, 1);
  EXPECT_GE(c.cuda_graph_replays, 1);
}

TEST(CudaCodegen, Reductions) {
  SKIP_WITHOUT_GPU();
  compiler::reset();
  auto f = [](const Tensor& x) {
    return std::vector<Tensor>{x.exp().sum({1}) * 2 + 1, x.mean({0}), x.amax({1}, true), x.sum(), x.amin({0})};
  };
  auto compiled = compile(f, kKiln);
  for (auto sizes : std::vector<std::vector<int64_t>>{{16, 300}, {3, 1}, {1000, 7}}) {
    Tensor x = gpu_randn(sizes);
    auto got = compiled(x);
    auto want = f(x);
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < got.size(); ++i) EXPECT_TRUE(same(got[i], want[i], 1e-5, 1e-5)) << i;
  }
  auto c = compiler::counters();
  EXPECT_GE(c.kernel_runs, 3);
  EXPECT_EQ(c.dispatched_nodes, 0);
  compiler::reset();
  auto g = [](const Tensor& x) { return x.sum({1}); };
  auto ci = compile(g, kKiln);
  Tensor xi = (gpu_randn({9, 40}) * 100).to(kInt32);
  EXPECT_TRUE(same(ci(xi), g(xi)));
  EXPECT_GE(compiler::counters().kernel_runs, 1);
}

// max_autotune may pick any launch shape (cuda_launch.h): each computes what eager does, for
// pointwise kernels and reductions with prologues and epilogues alike.
TEST(CudaCodegen, EveryLaunchShapeComputesTheSameResults) {
  SKIP_WITHOUT_GPU();
  auto f = [](const Tensor& x, const Tensor& y) {
    return std::vector<Tensor>{(x * y).sigmoid() + 1, x.exp().sum({1}) * 2 + 1, (x - y).abs().amax({0}), x.mean()};
  };
  Tensor x = gpu_randn({300, 517}), y = gpu_randn({300, 517});
  const auto want = f(x, y);
  for (auto [block, per_sm] : std::vector<std::pair<int, int>>{{256, 16}, {128, 4}, {64, 0}, {32, 1}, {256, 0}}) {
    SCOPED_TRACE(std::to_string(block) + " threads, " + std::to_string(per_sm) + " blocks per SM");
    compiler::reset();
    compiler::runtime::force_launch_shape_for_test(block, per_sm);
    auto got = compile(f, kKiln)(x, y);
    compiler::runtime::force_launch_shape_for_test(0, 0);
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < got.size(); ++i) EXPECT_TRUE(same(got[i], want[i], 1e-5, 1e-5)) << i;
    EXPECT_GE(compiler::counters().kernel_runs, 3);
    EXPECT_EQ(compiler::counters().dispatched_nodes, 0);
  }
}

// max_autotune times the launch shapes of generated kernels on their first launch, writing copies
// of what they write: an in-place update computes what eager does, once.
TEST(CudaCodegen, MaxAutotuneTimesLaunchShapesAndMatchesEager) {
  SKIP_WITHOUT_GPU();
  for (Mode mode : {Mode::max_autotune_no_cudagraphs, Mode::max_autotune}) {
    compiler::reset();
    compiler::runtime::forget_tuned_launch_shapes_for_test();
    auto f = [](Tensor p, const Tensor& g) {
      p.sub_(g * 0.1);  // read and written by one kernel
      return std::vector<Tensor>{(p * g).relu().sum({0}), p.sigmoid()};
    };
    auto tuned = compile(f, CompileOptions{.backend = std::string("kiln"), .mode = mode});
    Tensor p = gpu_randn({64, 4099}), p_eager = p.clone();
    const int64_t before = compiler::runtime::generated_launches_timed();
    for (int call = 0; call < 3; ++call) {
      Tensor g = gpu_randn({64, 4099});
      auto got = tuned(p, g);
      auto want = f(p_eager, g);
      EXPECT_TRUE(same(p, p_eager, 1e-5, 1e-5)) << "call " << call;
      for (size_t i = 0; i < got.size(); ++i) EXPECT_TRUE(same(got[i], want[i], 1e-5, 1e-5)) << "call " << call << " " << i;
    }
    EXPECT_GE(compiler::runtime::generated_launches_timed() - before, 1);
    EXPECT_GE(compiler::counters().kernel_runs, 3);
  }
}

TEST(CudaCodegen, CpuAndGpuInOneFunction) {
  SKIP_WITHOUT_GPU();
  compiler::reset();
  auto f = [](const Tensor& a, const Tensor& b) { return std::vector<Tensor>{a.exp() + 1, b.exp() + 1}; };
  auto compiled = compile(f, kKiln);
  Tensor a = randn({7}), b = gpu_randn({7});
  auto got = compiled(a, b);
  auto want = f(a, b);
  EXPECT_TRUE(allclose(got[0], want[0]));
  EXPECT_TRUE(same(got[1], want[1]));
  EXPECT_GE(compiler::counters().kernel_runs, 2);
}
