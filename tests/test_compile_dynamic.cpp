// Dynamic shapes (docs/compiler.md, "Dynamic shapes"; spec §2.5): the three `dynamic` settings,
// 0/1 specialization, guards and recompile reasons in Dynamo's wording, and compiled results at
// varying sizes against eager — for pointwise chains, reductions over the dynamic dim, softmax,
// matmul/linear, conv2d with a dynamic batch, layer norm, cat, GPT with a growing sequence and a
// training step at varying batch sizes. Every test checks that the kiln backend compiled (graph
// compiles, kernel runs), so a silent fallback to eager fails it.
#include <gtest/gtest.h>

#include <atomic>
#include <functional>
#include <thread>
#include <string>
#include <vector>

#include "compile_helpers.h"
#include "kernel_cache_dir.h"
#include "kiln/compiler.h"
#include "kiln/kiln.h"
#include "kiln/models.h"

namespace {

using namespace kiln;
using namespace kiln::testing;

KILN_TEST_KERNEL_CACHE_DIR("kiln_test_compile_dynamic");

class Dynamic : public CompilerTest {};

CompileOptions with_dynamic(std::optional<bool> dynamic) {
  CompileOptions o;
  o.backend = std::string("kiln");
  o.dynamic = dynamic;
  return o;
}

// Reductions reassociate in generated code: float32 results agree to the partial sums' rounding.
Tolerance reduction_tolerance() { return Tolerance{1e-5, 1e-5}; }

// ---------------------------------------------------------------------------------------------
// The three settings
// ---------------------------------------------------------------------------------------------

// The figure: batch sizes 2..17 with the default `dynamic` compile 2 graphs and run the
// system compiler at most twice; every result equals eager.
TEST_F(Dynamic, AutomaticDynamicCompilesTwoGraphsForBatchSizes2To17) {
  auto f = [](const Tensor& x) { return (sigmoid(x * 1.5) - tanh(x)).sum(1, true) * exp(x) + 0.25; };
  auto compiled = compile(f, with_dynamic(std::nullopt));
  Delta d;
  for (int64_t b = 2; b <= 17; ++b) {
    Tensor x = randn({b, 24});
    EXPECT_TRUE(close(compiled(x), f(x), reduction_tolerance())) << "batch " << b;
  }
  EXPECT_EQ(d.now().graph_compiles, 2);
  EXPECT_EQ(d.now().frame_compiles, 2);
  EXPECT_EQ(d.now().size_specializations, 14);
  EXPECT_LE(d.now().kernel_builds, 2);
  EXPECT_EQ(d.now().graph_runs, 16);
  EXPECT_EQ(d.now().eager_frames, 0);
  EXPECT_GE(d.now().kernel_runs, 16);
}

TEST_F(Dynamic, DynamicTrueCompilesOneGraph) {
  auto f = [](const Tensor& x) { return relu(x - 0.5) * x.mean(1, true); };
  auto compiled = compile(f, with_dynamic(true));
  Delta d;
  for (int64_t b = 2; b <= 17; ++b) {
    Tensor x = randn({b, 10});
    EXPECT_TRUE(close(compiled(x), f(x), reduction_tolerance())) << "batch " << b;
  }
  EXPECT_EQ(d.now().graph_compiles, 1);
  EXPECT_EQ(d.now().frame_compiles, 1);
  EXPECT_EQ(d.now().size_specializations, 15);
  EXPECT_LE(d.now().kernel_builds, 1);
  EXPECT_GE(d.now().kernel_runs, 16);
}

TEST_F(Dynamic, DynamicFalseSpecializesEverySize) {
  auto f = [](const Tensor& x) { return x * 3 + 1; };
  auto compiled = compile(f, with_dynamic(false));
  Delta d;
  for (int64_t b = 2; b <= 5; ++b) {
    Tensor x = randn({b, 3});
    EXPECT_TRUE(close(compiled(x), f(x))) << "batch " << b;
  }
  EXPECT_EQ(d.now().graph_compiles, 4);
  EXPECT_EQ(d.now().frame_compiles, 4);
  EXPECT_EQ(d.now().size_specializations, 0);
}

// A dimension that never changed stays static: a change there later recompiles once more and
// makes that dimension dynamic too.
TEST_F(Dynamic, OnlyTheDimensionsThatChangedBecomeDynamic) {
  auto f = [](const Tensor& x) { return x.sum(0) * 2; };
  auto compiled = compile(f, with_dynamic(std::nullopt));
  Delta d;
  for (auto [b, n] : std::vector<std::pair<int64_t, int64_t>>{{2, 5}, {3, 5}, {4, 5}, {4, 6}, {7, 9}}) {
    Tensor x = randn({b, n});
    EXPECT_TRUE(close(compiled(x), f(x), reduction_tolerance())) << b << "x" << n;
  }
  EXPECT_EQ(d.now().frame_compiles, 3) << "(2,5) static; (3,5) dim 0 dynamic; (4,6) dims 0 and 1 dynamic";
  EXPECT_EQ(d.now().graph_runs, 5);
}

// Sizes 0 and 1 specialize: a dynamic dim serves sizes >= 2, and size 1 compiles its own entry
// with the reason Dynamo gives.
TEST_F(Dynamic, SizesZeroAndOneSpecialize) {
  auto f = [](const Tensor& x) { return x.softmax(0); };
  CompileOptions o = with_dynamic(std::nullopt);
  o.arg_names = {"x"};
  auto compiled = compile(f, o);
  LogCapture logs({.recompiles = true});
  for (int64_t b : {2, 3, 4, 1, 0, 5}) {
    Tensor x = randn({b, 4});
    EXPECT_TRUE(close(compiled(x), f(x), reduction_tolerance())) << "batch " << b;
  }
  EXPECT_EQ(compiler::counters().frame_compiles, 4) << logs.str();  // 2; 3 (dynamic); 1; 0
  EXPECT_TRUE(contains(logs.str(), "2 <= x.size()[0]"));
  EXPECT_TRUE(contains(logs.str(), "tensor 'x' size mismatch at index 0. expected 2, actual 3"));
}

TEST_F(Dynamic, GuardsShowDynamicSizesAsNoneWithTheirRange) {
  auto f = [](const Tensor& x) { return x + 1; };
  CompileOptions o = with_dynamic(true);
  o.arg_names = {"x"};
  auto compiled = compile(f, o);
  LogCapture logs({.guards = true});
  compiled(randn({5, 3}));
  EXPECT_TRUE(contains(logs.str(), "size=[None, None], stride=[None, 1]")) << logs.str();
  EXPECT_TRUE(contains(logs.str(), "SHAPE_ENV: 2 <= x.size()[0]"));
  EXPECT_TRUE(contains(logs.str(), "SHAPE_ENV: 2 <= x.size()[1]"));
}

TEST_F(Dynamic, DynamicLogSaysWhatBecameDynamic) {
  auto f = [](const Tensor& x) { return x.exp(); };
  CompileOptions o = with_dynamic(std::nullopt);
  o.arg_names = {"x"};
  auto compiled = compile(f, o);
  LogCapture logs({.dynamic = true});
  for (int64_t b : {2, 3, 4}) compiled(randn({b, 2}));
  EXPECT_TRUE(contains(logs.str(), "automatic dynamic: x.size()[0] changed (2 -> 3)"));
  EXPECT_TRUE(contains(logs.str(), "dynamic graph of"));
  EXPECT_TRUE(contains(logs.str(), "at new sizes (x[4, 2])"));
}

// A tensor whose dynamic entry expects contiguous memory: a transposed call recompiles.
TEST_F(Dynamic, ADynamicEntryGuardsTheLayout) {
  auto f = [](const Tensor& x) { return x * 2; };
  auto compiled = compile(f, with_dynamic(true));
  Tensor a = randn({4, 6});
  Tensor t = randn({6, 4}).t();
  EXPECT_TRUE(close(compiled(a), f(a)));
  EXPECT_TRUE(close(compiled(t), f(t)));
  EXPECT_EQ(compiler::counters().frame_compiles, 2);
}

// The stance eager_then_compile: the eager first call records the sizes, so a compile at another
// size is already dynamic and later sizes reuse it.
TEST_F(Dynamic, EagerThenCompileCompilesDynamicWhenTheEagerCallsSawAnotherSize) {
  auto f = [](const Tensor& x) { return x.cos() * 3; };
  auto compiled = compile(f, with_dynamic(std::nullopt));
  compiler::StanceGuard stance(Stance::eager_then_compile);
  Delta d;
  for (int64_t b : {2, 3, 4, 5}) {
    Tensor x = randn({b, 7});
    EXPECT_TRUE(close(compiled(x), f(x)));
  }
  EXPECT_EQ(d.now().eager_frames, 1);
  EXPECT_EQ(d.now().graph_compiles, 1);
  EXPECT_EQ(d.now().size_specializations, 2);
}

// Integer attrs that change (a view's sizes) are part of the dynamic graph, not a graph each.
TEST_F(Dynamic, ViewsWithTheBatchSizeStayOneGraph) {
  auto f = [](const Tensor& x) { return x.view({x.size(0), -1}).relu() * 2; };
  auto compiled = compile(f, with_dynamic(std::nullopt));
  Delta d;
  for (int64_t b = 2; b <= 9; ++b) {
    Tensor x = randn({b, 3, 4});
    EXPECT_TRUE(close(compiled(x), f(x))) << "batch " << b;
  }
  EXPECT_EQ(d.now().graph_compiles, 2);
  EXPECT_LE(d.now().kernel_builds, 2);
}

// ---------------------------------------------------------------------------------------------
// Ops at varying sizes: one graph, kernels built once (dynamic = true), results equal eager
// ---------------------------------------------------------------------------------------------

void check_sizes(const std::function<std::vector<Tensor>(int64_t)>& make_inputs,
                 const std::function<Tensor(const std::vector<Tensor>&)>& fn, Tolerance tol,
                 std::vector<int64_t> sizes = {2, 3, 5, 8, 13}) {
  compiler::reset();
  auto compiled = compile(fn, with_dynamic(true));
  Delta d;
  int64_t builds_after_first = -1;
  for (int64_t n : sizes) {
    std::vector<Tensor> in = make_inputs(n);
    EXPECT_TRUE(close(compiled(in), fn(in), tol)) << "size " << n;
    if (builds_after_first < 0) builds_after_first = d.now().kernel_builds;
  }
  EXPECT_EQ(d.now().graph_compiles, 1);
  EXPECT_EQ(d.now().size_specializations, static_cast<int64_t>(sizes.size()) - 1);
  EXPECT_EQ(d.now().kernel_builds, builds_after_first) << "later sizes reuse the first size's kernels";
  EXPECT_GT(d.now().kernel_runs, 0) << "the graph ran generated kernels";
  EXPECT_EQ(d.now().eager_frames, 0);
}

TEST_F(Dynamic, ReductionsOverTheDynamicDim) {
  check_sizes([](int64_t n) { return std::vector<Tensor>{randn({n, 6})}; },
              [](const std::vector<Tensor>& in) {
                const Tensor& x = in[0];
                return x.sum(0) + x.mean(0) * 2 + x.amax(0) - (x * x).sum();
              },
              reduction_tolerance());
}

// A dynamic kernel chooses its OpenMP nest or its one-thread nest at run time (32768 elements):
// sizes on both sides of that line run one source, and both nests compute the same result.
TEST_F(Dynamic, KernelsOnBothSidesOfTheParallelThreshold) {
  check_sizes([](int64_t n) { return std::vector<Tensor>{randn({n, 1000})}; },
              [](const std::vector<Tensor>& in) {
                const Tensor& x = in[0];
                return (gelu(x) * 2).sum(1) + x.mean(1) + x.sum() + (x * x).amax(1);
              },
              reduction_tolerance(), {3, 40, 70, 5, 90});
}

TEST_F(Dynamic, SoftmaxOverAndAlongTheDynamicDim) {
  check_sizes([](int64_t n) { return std::vector<Tensor>{randn({n, 3, n})}; },
              [](const std::vector<Tensor>& in) { return softmax(in[0], -1) + log_softmax(in[0], 0); },
              reduction_tolerance());
}

TEST_F(Dynamic, LinearAndMatmul) {
  Tensor w = randn({16, 12}), b = randn({16}), m = randn({16, 5});
  check_sizes([](int64_t n) { return std::vector<Tensor>{randn({n, 12})}; },
              [=](const std::vector<Tensor>& in) { return matmul(gelu(nn::functional::linear(in[0], w, b)), m) * 0.5; },
              Tolerance{1e-4, 1e-5});
}

TEST_F(Dynamic, Conv2dWithADynamicBatch) {
  Tensor w = randn({4, 3, 3, 3}), b = randn({4});
  check_sizes([](int64_t n) { return std::vector<Tensor>{randn({n, 3, 8, 8})}; },
              [=](const std::vector<Tensor>& in) { return relu(conv2d(in[0], w, b, {1, 1}, {1, 1})) + 1; },
              Tolerance{1e-4, 1e-5}, {2, 3, 5});
}

TEST_F(Dynamic, LayerNorm) {
  Tensor g = randn({10}), beta = randn({10});
  check_sizes([](int64_t n) { return std::vector<Tensor>{randn({n, 4, 10})}; },
              [=](const std::vector<Tensor>& in) { return layer_norm(in[0], {10}, g, beta) * 2; },
              reduction_tolerance());
}

TEST_F(Dynamic, CatAlongAndAcrossTheDynamicDim) {
  check_sizes([](int64_t n) { return std::vector<Tensor>{randn({n, 3}), randn({n, 5}), randn({n + 1, 8})}; },
              [](const std::vector<Tensor>& in) {
                Tensor c = cat({in[0], in[1]}, 1).sigmoid();
                return cat({c, in[2]}, 0) * 3;
              },
              compile_tolerance(kFloat32));
}

// ---------------------------------------------------------------------------------------------
// Models: a GPT with a growing sequence, a training step at varying batch sizes
// ---------------------------------------------------------------------------------------------

TEST_F(Dynamic, GptForwardWithAGrowingSequence) {
  manual_seed(0);
  auto gpt = models::gpt(models::GPTConfig::tiny());
  gpt->eval();
  NoGradGuard no_grad;
  auto compiled = compile(gpt, with_dynamic(std::nullopt));
  Delta d;
  for (int64_t t = 3; t <= 12; ++t) {
    Tensor idx = randint(64, {2, t});
    EXPECT_TRUE(close(compiled(idx), gpt->forward(idx), Tolerance{1e-4, 1e-5})) << "length " << t;
  }
  EXPECT_LE(d.now().graph_compiles, 2);
  EXPECT_GE(d.now().size_specializations, 7);
  EXPECT_GT(d.now().kernel_runs, 0);
  EXPECT_EQ(d.now().eager_frames, 0);
}

TEST_F(Dynamic, TrainingStepAtVaryingBatchSizes) {
  manual_seed(0);
  auto make = [] {
    manual_seed(1);
    return models::mlp({6, 16, 3}, "relu");
  };
  auto model = make(), reference = make();
  auto opt = std::make_shared<optim::SGD>(model->parameters(), optim::SGDOptions{.lr = 0.1, .momentum = 0.9});
  auto ref_opt = std::make_shared<optim::SGD>(reference->parameters(), optim::SGDOptions{.lr = 0.1, .momentum = 0.9});
  auto step = compile(training_step(model, opt), with_dynamic(std::nullopt));
  auto ref_step = training_step(reference, ref_opt);
  Delta d;
  for (int64_t b : {4, 5, 6, 7, 9, 12}) {
    Tensor x = randn({b, 6});
    Tensor y = randint(3, {b});
    EXPECT_TRUE(close(step(x, y), ref_step(x, y), Tolerance{1e-4, 1e-5})) << "batch " << b;
  }
  auto p = model->parameters(), q = reference->parameters();
  for (size_t i = 0; i < p.size(); ++i) EXPECT_TRUE(close(p[i], q[i], Tolerance{1e-4, 1e-5}));
  EXPECT_LE(d.now().graph_compiles, 2);
  EXPECT_GE(d.now().size_specializations, 4);
  EXPECT_EQ(d.now().eager_frames, 0);
}

// A compiled forward whose backward runs after the call: the backward graph is dynamic too.
TEST_F(Dynamic, BackwardOutsideTheCallIsDynamicToo) {
  Tensor w = randn({5, 4}).requires_grad_();
  auto f = [w](const Tensor& x) { return (tanh(matmul(x, w)) * 2).sum(); };
  auto compiled = compile(f, with_dynamic(std::nullopt));
  Delta d;
  for (int64_t b = 2; b <= 7; ++b) {
    Tensor x = randn({b, 5});
    w.set_grad(Tensor());
    compiled(x).backward();
    Tensor g = w.grad().clone();
    w.set_grad(Tensor());
    f(x).backward();
    EXPECT_TRUE(close(g, w.grad(), Tolerance{1e-4, 1e-5})) << "batch " << b;
  }
  EXPECT_LE(d.now().graph_compiles, 4) << "forward and backward: static at 2, dynamic from 3";
  EXPECT_GE(d.now().size_specializations, 8);
}

// pure = true: a dynamic entry keeps a replay plan per size. Once two captures (at this size or
// another) agree on the plan's structure, every size seen once replays without running the body,
// and every result is right.
TEST_F(Dynamic, PureFunctionsReplayAtEverySizeSeen) {
  int body_runs = 0;
  auto f = [&](const Tensor& x, const Tensor& w) {
    ++body_runs;
    return (x.matmul(w) + 1).relu().sum(1) * 0.5;
  };
  auto eager = [](const Tensor& x, const Tensor& w) { return (x.matmul(w) + 1).relu().sum(1) * 0.5; };
  CompileOptions o = with_dynamic(true);
  o.pure = true;
  auto compiled = compile(f, o);
  Tensor w = randn({4, 3});
  // First pass: every size captured once (the second capture confirms both plans).
  for (int64_t b : {2, 3, 5, 7}) {
    Tensor x = randn({b, 4});
    EXPECT_TRUE(close(compiled(x, w), eager(x, w))) << "batch " << b;
  }
  EXPECT_EQ(body_runs, 4);
  Delta d;
  const int runs_before = body_runs;
  // Later passes, sizes in any order: replays only, new inputs each call.
  for (int64_t b : {7, 2, 5, 3, 3, 2, 7}) {
    Tensor x = randn({b, 4});
    EXPECT_TRUE(close(compiled(x, w), eager(x, w))) << "batch " << b;
  }
  EXPECT_EQ(body_runs, runs_before) << "every size seen replays";
  EXPECT_EQ(d.now().replays, 7);
  EXPECT_EQ(d.now().graph_compiles, 0);
  EXPECT_EQ(d.now().size_specializations, 0);
  // A new size runs the body once (its instance and plan), then replays.
  Tensor x = randn({11, 4});
  EXPECT_TRUE(close(compiled(x, w), eager(x, w)));
  EXPECT_TRUE(close(compiled(x, w), eager(x, w)));
  EXPECT_EQ(body_runs, runs_before + 1);
  EXPECT_EQ(d.now().size_specializations, 1);
  // A changed captured tensor is still honoured: w is read by the replay, not baked in.
  w.mul_(2);
  EXPECT_TRUE(close(compiled(x, w), eager(x, w)));
}

// A body whose results differ in structure with the size (odd sizes also return the argument):
// each size replays its own plan, never another size's.
TEST_F(Dynamic, PureReplayUsesEachSizesOwnPlan) {
  int body_runs = 0;
  auto f = [&](const Tensor& x) -> std::vector<Tensor> {
    ++body_runs;
    Tensor y = x.sin() * 2;
    if (x.size(0) % 2 == 0) return {y};
    return {y, x};  // odd sizes also return the argument itself
  };
  CompileOptions o = with_dynamic(true);
  o.pure = true;
  auto compiled = compile(f, o);
  for (int64_t b : {2, 3, 4, 5, 2, 3}) {
    Tensor x = randn({b, 4});
    std::vector<Tensor> out = compiled(x);
    ASSERT_EQ(out.size(), b % 2 == 0 ? 1u : 2u) << "batch " << b;
    EXPECT_TRUE(close(out[0], x.sin() * 2)) << "batch " << b;
    if (b % 2 == 1) {
      EXPECT_TRUE(out[1].same(x)) << "batch " << b;
    }
  }
}

}  // namespace

namespace {

using namespace kiln;
using namespace kiln::testing;

// ---------------------------------------------------------------------------------------------
// Integer arguments, and the marking APIs
// ---------------------------------------------------------------------------------------------

// An integer argument used as a size changes the graph's integer attrs: one dynamic graph serves
// every value instead of a graph per value.
TEST_F(Dynamic, IntegerArgumentsThatChangeDoNotCompileAGraphEach) {
  auto f = [](const Tensor& x, int64_t n) { return x.narrow(1, 0, n).sum(1) * 2; };
  auto compiled = compile(f, with_dynamic(std::nullopt));
  Tensor x = randn({4, 10});
  Delta d;
  for (int64_t n = 2; n <= 7; ++n) EXPECT_TRUE(close(compiled(x, n), f(x, n), reduction_tolerance())) << n;
  EXPECT_EQ(d.now().frame_compiles, 1);
  EXPECT_EQ(d.now().graph_compiles, 2);
  EXPECT_EQ(d.now().size_specializations, 4);
}

TEST_F(Dynamic, MarkDynamicMakesTheFirstCompileDynamicEvenWithDynamicFalse) {
  auto f = [](const Tensor& x) { return x.tanh() + 1; };
  auto compiled = compile(f, with_dynamic(false));
  Tensor x = randn({4, 3});
  compiler::mark_dynamic(x, 0);
  Delta d;
  EXPECT_TRUE(close(compiled(x), f(x)));
  for (int64_t b : {5, 6, 9}) {
    Tensor y = randn({b, 3});
    EXPECT_TRUE(close(compiled(y), f(y))) << "batch " << b;
  }
  EXPECT_EQ(d.now().frame_compiles, 1);
  EXPECT_EQ(d.now().graph_compiles, 1);
  EXPECT_EQ(d.now().size_specializations, 3);
}

TEST_F(Dynamic, MarkDynamicRangeBoundsTheEntry) {
  auto f = [](const Tensor& x) { return x * x; };
  CompileOptions o = with_dynamic(false);
  o.arg_names = {"x"};
  auto compiled = compile(f, o);
  Tensor x = randn({4, 3});
  compiler::mark_dynamic(x, 0, {.min = 3, .max = 8});
  LogCapture logs({.recompiles = true, .guards = true});
  compiled(x);
  compiled(randn({8, 3}));
  EXPECT_EQ(compiler::counters().frame_compiles, 1);
  compiled(randn({9, 3}));
  EXPECT_EQ(compiler::counters().frame_compiles, 2);
  EXPECT_TRUE(contains(logs.str(), "SHAPE_ENV: 3 <= x.size()[0] <= 8"));
  EXPECT_TRUE(contains(logs.str(), "x.size()[0] <= 8  # the call has 9"));
  EXPECT_THROW(compiler::mark_dynamic(randn({9, 3}), 0, {.max = 8}), ValueError);
  EXPECT_THROW(compiler::mark_dynamic(x, 0, {.min = 5, .max = 4}), ValueError);
  EXPECT_THROW(compiler::mark_dynamic(x, 2), ValueError);
}

TEST_F(Dynamic, MarkDynamicOnASizeOneDimThrowsMaybeMarkDynamicSpecializes) {
  auto f = [](const Tensor& x) { return x + 2; };
  CompileOptions o = with_dynamic(std::nullopt);
  o.arg_names = {"x"};
  auto strict = compile(f, o);
  Tensor x = randn({1, 3});
  compiler::mark_dynamic(x, 0);
  try {
    strict(x);
    ADD_FAILURE() << "expected CompileError";
  } catch (const CompileError& e) {
    EXPECT_TRUE(contains(e.what(), "Constraints violated (x.size()[0])! mark_dynamic(x, 0) was called"));
    EXPECT_TRUE(contains(e.what(), "maybe_mark_dynamic"));
  }
  auto lenient = compile(f, o);
  Tensor y = randn({1, 3});
  compiler::maybe_mark_dynamic(y, 0);
  EXPECT_TRUE(close(lenient(y), f(y)));
}

TEST_F(Dynamic, MarkStaticKeepsADimensionStaticUnderDynamicTrue) {
  auto f = [](const Tensor& x) { return x.exp() - 1; };
  CompileOptions o = with_dynamic(true);
  o.arg_names = {"x"};
  auto compiled = compile(f, o);
  Tensor x = randn({4, 3});
  compiler::mark_static(x, 1);
  LogCapture logs({.recompiles = true});
  compiled(x);
  compiled(randn({5, 3}));
  EXPECT_EQ(compiler::counters().frame_compiles, 1);
  compiled(randn({5, 4}));
  EXPECT_EQ(compiler::counters().frame_compiles, 2);
  EXPECT_TRUE(contains(logs.str(), "tensor 'x' size mismatch at index 1. expected 3, actual 4"));
}

TEST_F(Dynamic, MarkingInsideACompiledRegionThrows) {
  auto f = [](const Tensor& x) {
    compiler::mark_dynamic(x, 0);
    return x + 1;
  };
  EXPECT_THROW(compile(f)(randn({3, 2})), CompileError);
  auto g = [](const Tensor& x) {
    compiler::mark_static(x);
    return x + 1;
  };
  EXPECT_THROW(compile(g)(randn({3, 2})), CompileError);
}

}  // namespace

namespace {

using namespace kiln;
using namespace kiln::testing;

// Threads calling one dynamic function at many sizes at once: each new size is lowered once (the
// other callers of that size wait for it), and every result is right.
TEST_F(Dynamic, ThreadsCallingADynamicGraphAtManySizes) {
  auto f = [](const Tensor& x) { return (x * 2 + 1).sum(1) - x.amax(1); };
  auto compiled = compile(f, with_dynamic(true));
  compiled(randn({2, 5}));
  std::atomic<int> bad{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 24; ++i) {
        Tensor x = randn({2 + (t * 7 + i) % 8, 5});
        if (!close(compiled(x), f(x), reduction_tolerance())) ++bad;
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(bad.load(), 0);
  EXPECT_EQ(compiler::counters().graph_compiles, 1);
  EXPECT_EQ(compiler::counters().size_specializations, 7) << "sizes 3..9, each once";
}

}  // namespace

namespace {

using namespace kiln;
using namespace kiln::testing;

// The model check: a ResNet-18 forward and a whole training step, compiled once for a
// dynamic batch, equal eager at every batch size.
TEST_F(Dynamic, ResNet18ForwardAndTrainingStepWithADynamicBatch) {
  manual_seed(0);
  auto make = [] {
    manual_seed(3);
    return models::resnet18({.num_classes = 5});
  };
  auto model = make(), reference = make();
  {
    model->eval();
    reference->eval();
    NoGradGuard no_grad;
    auto forward = compile(model, with_dynamic(true));
    Delta d;
    for (int64_t b : {2, 3, 5}) {
      Tensor x = randn({b, 3, 32, 32});
      EXPECT_TRUE(close(forward(x), reference->forward(x), Tolerance{1e-3, 1e-4})) << "batch " << b;
    }
    EXPECT_EQ(d.now().graph_compiles, 1);
    EXPECT_EQ(d.now().size_specializations, 2);
    EXPECT_GT(d.now().kernel_runs, 0);
  }
  model->train();
  reference->train();
  auto opt = std::make_shared<optim::SGD>(model->parameters(), optim::SGDOptions{.lr = 0.01});
  auto ref_opt = std::make_shared<optim::SGD>(reference->parameters(), optim::SGDOptions{.lr = 0.01});
  auto step = compile(training_step(model, opt), with_dynamic(true));
  auto ref_step = training_step(reference, ref_opt);
  // Batches of at least 4 at 64x64: a training batch norm over the last stage's 2x2 positions of
  // 2 samples normalizes 8 numbers, where float rounding differences between kernels grow.
  Delta d;
  for (int64_t b : {4, 5, 7}) {
    Tensor x = randn({b, 3, 64, 64});
    Tensor y = randint(5, {b});
    EXPECT_TRUE(close(step(x, y), ref_step(x, y), Tolerance{1e-3, 1e-4})) << "batch " << b;
  }
  auto p = model->parameters(), q = reference->parameters();
  // After three steps through training batch norms, compiled and eager parameters differ by the
  // rounding of differently ordered float sums (a static compile gives the same parameters as this
  // dynamic one, bit for bit); the losses above agree to 1e-3.
  for (size_t i = 0; i < p.size(); ++i) EXPECT_TRUE(close(p[i], q[i], Tolerance{1e-2, 1e-3})) << "parameter " << i;
  EXPECT_EQ(d.now().graph_compiles, 1);
  EXPECT_EQ(d.now().size_specializations, 2);
  EXPECT_EQ(d.now().eager_frames, 0);
}

}  // namespace
