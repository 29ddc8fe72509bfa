// reduce_overhead on the CPU (issue 5): the kiln backend's static memory plan. Results match eager
// (chains, reductions, cat, convolution + pooling, DenseNet-121), a warm call allocates only its
// graph outputs, concurrent calls of one compiled function stay correct, and the planner never
// gives simultaneously live values overlapping bytes.
#include <gtest/gtest.h>
#include <stdlib.h>

#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "compile_helpers.h"
#include "kernel_cache_dir.h"
#include "compiler/lower/loop_ir.h"
#include "compiler/lower/memory_plan.h"
#include "kiln/compiler.h"
#include "kiln/detail/tensor_impl.h"
#include "kiln/kiln.h"
#include "kiln/models.h"
#include "kiln/nn/functional.h"

namespace {

using namespace kiln;
using namespace kiln::testing;  // compile_helpers.h
namespace fs = std::filesystem;
namespace lower = kiln::compiler::lower;

KILN_TEST_KERNEL_CACHE_DIR("kiln_test_kiln_memory_plan");

CompileOptions kiln_options(Mode mode) {
  CompileOptions options;
  options.backend = std::string("kiln");
  options.mode = mode;
  return options;
}

// Reductions reassociate (the generated code accumulates in double, eager pairwise in float).
constexpr Tolerance kReductionTol{1e-5, 1e-5};
// Deep networks: folded batch norms and FMA contraction, amplified over dozens of layers.
constexpr Tolerance kDeepModelTol{1e-4, 1e-5};

class MemoryPlan : public CompilerTest {
 protected:
  void SetUp() override {
    CompilerTest::SetUp();
    manual_seed(0);
  }
};

// ================================ the planner ================================

// A hand-made program of kernel steps: x -> a -> b -> c -> out, plus d read by the last step.
// (The planner reads values, steps and nodes only; the kernels themselves are not needed.)
lower::Program chain_program() {
  lower::Program p;
  compiler::ValueInfo vi;
  vi.sizes = {16, 16};
  vi.strides = {16, 1};
  vi.dtype = kFloat32;
  for (int i = 0; i < 6; ++i) {
    vi.storage = i;
    vi.name = std::string(1, "xabcdo"[i]);
    p.graph.values.push_back(vi);
  }
  p.graph.values[0].is_input = true;
  p.graph.inputs = {0};
  p.graph.outputs = {5};
  auto kernel = [&](std::vector<int> reads, std::vector<int> writes) {
    lower::Step s;
    s.kind = lower::Step::Kind::kernel;
    s.kernel = static_cast<int>(p.steps.size());
    s.bindings = reads;
    s.bindings.insert(s.bindings.end(), writes.begin(), writes.end());
    s.allocate = writes;
    p.steps.push_back(s);
  };
  kernel({0}, {1, 4});  // a, d = f(x)
  kernel({1}, {2});     // b = f(a)
  kernel({2}, {3});     // c = f(b)
  kernel({3, 4}, {5});  // out = f(c, d)
  return p;
}

TEST_F(MemoryPlan, PlannerReusesDeadValuesAndKeepsLiveOnesApart) {
  lower::Program p = chain_program();
  lower::MemoryPlan plan = lower::plan_memory(p);
  EXPECT_EQ(plan.entry_of[0], -1) << "a graph input is the caller's memory";
  EXPECT_EQ(plan.entry_of[5], -1) << "a graph output must outlive the call";
  ASSERT_EQ(plan.entries.size(), 4u);
  EXPECT_EQ(lower::find_overlap(plan), "");
  // a lives over steps 0..1, b 1..2, c 2..3, d 0..3: c takes a's bytes, 3 KiB instead of 4.
  const auto& a = plan.entries[plan.entry_of[1]];
  const auto& c = plan.entries[plan.entry_of[3]];
  EXPECT_EQ(a.first, 0);
  EXPECT_EQ(a.last, 1);
  EXPECT_EQ(c.offset, a.offset);
  EXPECT_EQ(plan.arena_bytes, 3 * 1024);
  EXPECT_EQ(plan.unplanned_bytes, 4 * 1024);
  for (const auto& e : plan.entries) EXPECT_EQ(e.offset % 64, 0);
}

TEST_F(MemoryPlan, PlannerKeepsAValueAliveWhileAViewOfItIsRead) {
  lower::Program p = chain_program();
  // A view of `a` (made at step 1 by a dispatched view node) read by the last step: `a` must
  // stay live to the end, so `c` may no longer take its bytes.
  compiler::ValueInfo view = p.graph.values[1];
  view.sizes = {256};
  view.strides = {1};
  view.storage = 1;
  view.name = "a_view";
  const int v = static_cast<int>(p.graph.values.size());
  p.graph.values.push_back(view);
  compiler::Node n;
  n.op = OpTable::instance().find("view");
  ASSERT_NE(n.op, nullptr);
  n.inputs = {1};
  n.outputs = {v};
  p.graph.nodes.push_back(n);
  lower::Step s;
  s.kind = lower::Step::Kind::node;
  s.node = 0;
  p.steps.insert(p.steps.begin() + 1, s);
  p.steps.back().bindings.push_back(v);
  lower::MemoryPlan plan = lower::plan_memory(p);
  EXPECT_EQ(plan.entry_of[v], -1) << "a view is its base's memory";
  const auto& a = plan.entries[plan.entry_of[1]];
  EXPECT_EQ(a.last, static_cast<int>(p.steps.size()) - 1);
  EXPECT_EQ(lower::find_overlap(plan), "");
  EXPECT_EQ(plan.arena_bytes, 4 * 1024);
  // A view returned from the graph pins its base out of the arena.
  p.graph.outputs.push_back(v);
  EXPECT_EQ(lower::plan_memory(p).entry_of[1], -1);
}

// The graph a backend sees, for planning it directly.
struct GraphRecorder {
  std::vector<compiler::Graph> graphs;
  CompileOptions options() {
    CompileOptions o;
    o.backend = compiler::BackendFn([this](compiler::Graph& g, const compiler::Arguments&) {
      graphs.push_back(g);
      return compiler::interpreter(g);
    });
    return o;
  }
};

// Every captured graph of a DenseNet and a conv net: no two live values overlap, memory is shared,
// and dispatched convolutions and pools write into the arena.
TEST_F(MemoryPlan, PlansOfRealGraphsNeverOverlap) {
  GraphRecorder rec;
  auto net = models::densenet121({.num_classes = 10});
  net->eval();
  NoGradGuard no_grad;
  auto compiled = kiln::compile(net, rec.options());
  compiled(randn({2, 3, 32, 32}));
  ASSERT_EQ(rec.graphs.size(), 1u);
  lower::Program p = lower::schedule(rec.graphs[0]);
  lower::MemoryPlan plan = lower::plan_memory(p);
  ASSERT_FALSE(plan.empty());
  EXPECT_EQ(lower::find_overlap(plan), "");
  EXPECT_LT(plan.arena_bytes, plan.unplanned_bytes / 4) << "DenseNet's intermediates die quickly";
  int convs = 0, planned_convs = 0;
  for (size_t i = 0; i < p.graph.nodes.size(); ++i) {
    if (p.graph.nodes[i].op->name != "conv2d") continue;
    ++convs;
    planned_convs += plan.out_node[i];
  }
  EXPECT_GT(convs, 100);
  EXPECT_EQ(planned_convs, convs) << "every convolution writes into the arena";
  for (int v : p.graph.outputs) EXPECT_EQ(plan.entry_of[v], -1);
  for (int v : p.graph.inputs) EXPECT_EQ(plan.entry_of[v], -1);
}

// ================================ results against eager ================================

template <class F, class... Args>
void expect_matches_eager(F fn, Tolerance tol, const Args&... args) {
  auto want = fn(args...);
  auto compiled = kiln::compile(fn, kiln_options(Mode::reduce_overhead));
  Delta d;
  for (int call = 0; call < 3; ++call) {  // the first call builds the arena, later ones reuse it
    auto got = compiled(args...);
    EXPECT_TRUE(close(got, want, tol)) << "call " << call;
  }
  EXPECT_GT(d.now().kernel_runs, 0) << "the kiln backend ran no kernel";
  EXPECT_EQ(d.now().graph_runs, 3);
}

TEST_F(MemoryPlan, PointwiseChainMatchesEager) {
  auto fn = [](const Tensor& x, const Tensor& y) {
    Tensor a = (x * 2 + y).sin();
    Tensor b = (a * a - x).exp();
    Tensor c = b.transpose(0, 1).contiguous() * 3;  // a copy through a view
    return (c.tanh() + 1) / (a.transpose(0, 1) + 2);
  };
  expect_matches_eager(fn, compile_tolerance(kFloat32), randn({32, 48}), randn({32, 48}));
}

TEST_F(MemoryPlan, ReductionsMatchEager) {
  auto fn = [](const Tensor& x) {
    Tensor c = (x * 2).sin() + x;
    Tensor m = c.mean({1}, true);
    Tensor r = (c - m).exp();
    Tensor s = r.sum({1}, true);
    return r / s + c.amax({1}, true);
  };
  expect_matches_eager(fn, kReductionTol, randn({16, 64}));
}

TEST_F(MemoryPlan, CatMatchesEager) {
  auto fn = [](const Tensor& x, const Tensor& y) {
    Tensor a = x.relu();
    Tensor b = y.exp();
    Tensor c = cat({a, b, a * b}, 1);          // fused
    Tensor d = cat({c, y.to(kFloat64)}, 1);    // mixed dtypes: dispatched
    return d.cos() * 2;
  };
  expect_matches_eager(fn, compile_tolerance(kFloat64), randn({8, 12}), randn({8, 12}));
}

// Convolutions (with and without a folded batch norm), both pools, addmm, mm and a dispatched
// cat: every extern op that writes into the arena through call_op_out.
TEST_F(MemoryPlan, ConvPoolNetworkMatchesEager) {
  Tensor w1 = randn({8, 3, 3, 3}) * 0.2, b1 = randn({8});
  Tensor w2 = randn({8, 8, 3, 3}) * 0.1;
  Tensor mean = randn({8}) * 0.1, var = rand({8}) + 0.5, gamma = randn({8}), beta = randn({8});
  Tensor wl = randn({10, 8 * 4 * 4}) * 0.1, bl = randn({10});
  Tensor wm = randn({10, 6}) * 0.3;
  auto fn = [=](const Tensor& x) {
    Tensor h = conv2d(x, w1, b1, {1, 1}, {1, 1}).relu();
    h = max_pool2d(h, {2, 2});
    Tensor g = conv2d(h, w2, Tensor(), {1, 1}, {1, 1});
    g = batch_norm(g, mean, var, gamma, beta, false).relu();
    g = avg_pool2d(g + h, {2, 2});
    Tensor flat = g.reshape({g.size(0), -1});
    Tensor logits = addmm(bl, flat, wl.t());
    Tensor m = mm(logits.tanh(), wm);
    return cat({logits, m.to(kFloat64)}, 1).sin();
  };
  expect_matches_eager(fn, Tolerance{1e-4, 1e-5}, randn({2, 3, 16, 16}));
}

TEST_F(MemoryPlan, DenseNet121EvalMatchesEager) {
  auto net = models::densenet121({.num_classes = 10});
  net->eval();
  NoGradGuard no_grad;
  Tensor x = randn({2, 3, 32, 32}), x2 = randn({2, 3, 32, 32});
  Tensor want = net->forward(x), want2 = net->forward(x2);
  auto compiled = kiln::compile(net, kiln_options(Mode::reduce_overhead));
  Delta d;
  Tensor got = compiled(x);
  Tensor got2 = compiled(x2);
  Tensor again = compiled(x);
  EXPECT_GT(d.now().kernel_runs, 0);
  EXPECT_TRUE(close(got, want, kDeepModelTol));
  EXPECT_TRUE(close(got2, want2, kDeepModelTol));
  EXPECT_TRUE(close(again, want, kDeepModelTol));
  EXPECT_TRUE(close(got, want, kDeepModelTol)) << "a returned tensor was overwritten by a later call";
}

// ================================ no allocation per call ================================

// CPU allocations of one call, after two warm-up calls.
template <class F>
int64_t allocations_per_call(F& compiled, const Tensor& x) {
  compiled(x);
  compiled(x);
  int64_t before = kiln::detail::cpu_allocation_count();
  Tensor out = compiled(x);
  return kiln::detail::cpu_allocation_count() - before;
}

// The body's host scalar (`x * 2`) is wrapped into a 0-dim tensor whenever the body runs: with
// pure = true a warm call replays the graph without running the body, so every allocation left is
// the executor's.
TEST_F(MemoryPlan, WarmCallAllocatesOnlyItsOutputs) {
  auto fn = [](const Tensor& x) {
    Tensor c = (x * 2).sin() + x;   // stored: read by the reduction's consumer
    Tensor m = c.mean({1}, true);   // stored
    return (c - m).exp();           // the one output
  };
  Tensor x = randn({64, 128});
  CompileOptions plain_options = kiln_options(Mode::default_), planned_options = kiln_options(Mode::reduce_overhead);
  plain_options.pure = planned_options.pure = true;
  auto plain = kiln::compile(fn, plain_options);
  auto planned = kiln::compile(fn, planned_options);
  Delta d;
  const int64_t default_allocs = allocations_per_call(plain, x);
  const int64_t planned_allocs = allocations_per_call(planned, x);
  EXPECT_EQ(d.now().graph_compiles, 2);
  EXPECT_GT(d.now().kernel_runs, 0);
  EXPECT_EQ(planned_allocs, 1) << "reduce_overhead allocates the graph output only";
  EXPECT_EQ(default_allocs, 3) << "the default mode allocates c and m as well";
  EXPECT_TRUE(close(planned(x), fn(x), kReductionTol));
}

// max_autotune takes the static plan too (torch's max-autotune takes CUDA graphs, its CPU
// counterpart here); max_autotune_no_cudagraphs does not.
TEST_F(MemoryPlan, MaxAutotuneTakesTheStaticPlanAndNoCudagraphsDoesNot) {
  auto fn = [](const Tensor& x) {
    Tensor c = x.sin() + x;
    Tensor m = c.mean({1}, true);
    return (c - m).exp();
  };
  Tensor x = randn({64, 128});
  CompileOptions autotune = kiln_options(Mode::max_autotune), no_graphs = kiln_options(Mode::max_autotune_no_cudagraphs);
  autotune.pure = no_graphs.pure = true;
  auto planned = kiln::compile(fn, autotune);
  auto unplanned = kiln::compile(fn, no_graphs);
  Delta d;
  EXPECT_EQ(allocations_per_call(planned, x), 1) << "the output only";
  EXPECT_EQ(allocations_per_call(unplanned, x), 3) << "c and m as well";
  EXPECT_GT(d.now().kernel_runs, 0);
  EXPECT_TRUE(close(planned(x), fn(x), kReductionTol));
  EXPECT_TRUE(close(unplanned(x), fn(x), kReductionTol));
}

// Without host scalars the body allocates nothing either, pure or not; two outputs, two blocks.
TEST_F(MemoryPlan, WarmCallOfTheBodyAllocatesOnlyItsOutputs) {
  auto fn = [](const Tensor& x) {
    Tensor c = x.sin() + x;
    Tensor m = c.mean({1}, true);
    Tensor e = (c - m).exp();
    return std::vector<Tensor>{e.cos(), e.amax({1}, true)};
  };
  Tensor x = randn({64, 128});
  auto planned = kiln::compile(fn, kiln_options(Mode::reduce_overhead));
  planned(x);
  planned(x);
  int64_t before = kiln::detail::cpu_allocation_count();
  std::vector<Tensor> got = planned(x);
  EXPECT_EQ(kiln::detail::cpu_allocation_count() - before, 2);
  std::vector<Tensor> want = fn(x);
  ASSERT_EQ(got.size(), 2u);
  EXPECT_TRUE(close(got[0], want[0], kReductionTol));
  EXPECT_TRUE(close(got[1], want[1], kReductionTol));
}

TEST_F(MemoryPlan, ConvNetworkAllocatesLessThanDefault) {
  Tensor w1 = randn({8, 3, 3, 3}) * 0.2, w2 = randn({8, 8, 3, 3}) * 0.1;
  auto fn = [=](const Tensor& x) {
    Tensor h = max_pool2d(conv2d(x, w1, Tensor(), {1, 1}, {1, 1}).relu(), {2, 2});
    return avg_pool2d(conv2d(h, w2, Tensor(), {1, 1}, {1, 1}).relu() + h, {2, 2});
  };
  Tensor x = randn({2, 3, 16, 16});
  auto plain = kiln::compile(fn, kiln_options(Mode::default_));
  auto planned = kiln::compile(fn, kiln_options(Mode::reduce_overhead));
  const int64_t default_allocs = allocations_per_call(plain, x);
  const int64_t planned_allocs = allocations_per_call(planned, x);
  EXPECT_LT(planned_allocs, default_allocs);
  EXPECT_TRUE(close(planned(x), fn(x), Tolerance{1e-4, 1e-5}));
}

// ================================ concurrency ================================

// Four threads calling one compiled function: one holds the arena, the others allocate; every
// result is right.
TEST_F(MemoryPlan, ConcurrentCallsGetCorrectResults) {
  auto fn = [](const Tensor& x, const Tensor& w) {
    Tensor h = (x * 2).sin() + x;
    Tensor m = mm(h, w).relu();
    return (m - m.mean({1}, true)).exp() + h.sum({1}, true);
  };
  Tensor w = randn({64, 64}) * 0.1;
  auto compiled = kiln::compile(fn, kiln_options(Mode::reduce_overhead));
  compiled(randn({32, 64}), w);  // compile before the threads start
  constexpr int kThreads = 4, kCalls = 25;
  std::vector<Tensor> inputs, wants;
  for (int t = 0; t < kThreads; ++t) {
    inputs.push_back(randn({32, 64}));
    wants.push_back(fn(inputs.back(), w));
  }
  Delta d;
  std::vector<int> failures(kThreads, 0);
  std::vector<std::string> errors(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      try {
        for (int c = 0; c < kCalls; ++c)
          if (!close(compiled(inputs[t], w), wants[t], kReductionTol)) ++failures[t];
      } catch (const std::exception& e) {
        errors[t] = e.what();
      }
    });
  }
  for (auto& th : threads) th.join();
  for (int t = 0; t < kThreads; ++t) {
    EXPECT_EQ(failures[t], 0) << "thread " << t;
    EXPECT_EQ(errors[t], "") << "thread " << t;
  }
  EXPECT_EQ(d.now().graph_runs, kThreads * kCalls);
}

// ================================ KILN_COMPILE_DEBUG ================================

TEST_F(MemoryPlan, LoopIrDumpShowsThePlan) {
  std::string pattern = (fs::temp_directory_path() / "kiln_memory_plan_debug_XXXXXX").string();
  ASSERT_NE(::mkdtemp(pattern.data()), nullptr);
  const fs::path root = pattern;
  ::setenv("KILN_COMPILE_DEBUG", "1", 1);
  ::setenv("KILN_COMPILE_DEBUG_DIR", root.c_str(), 1);
  {
    LogCapture logs;  // the dump's path is logged
    auto compiled = kiln::compile([](const Tensor& x) { return (x.sin() + 1).sum({1}) * x.sum(); },
                                  kiln_options(Mode::reduce_overhead));
    compiled(randn({3, 4}));
  }
  ::unsetenv("KILN_COMPILE_DEBUG");
  ::unsetenv("KILN_COMPILE_DEBUG_DIR");
  std::string text;
  for (const auto& entry : fs::directory_iterator(root)) {
    std::ifstream in(entry.path() / "loop_ir.txt");
    std::stringstream ss;
    ss << in.rdbuf();
    text += ss.str();
  }
  EXPECT_TRUE(contains(text, "memory plan (reduce_overhead): arena "));
  EXPECT_TRUE(contains(text, ": offset 0, "));
  std::error_code ec;
  fs::remove_all(root, ec);
}

}  // namespace
