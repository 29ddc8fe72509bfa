// Compiled graphs' linear-layer GEMMs with their weights packed once (src/compiler/runtime/
// packed_gemm.h): which nodes qualify, results against eager's addmm/mm, a weight changed in place
// between calls (packed again), a weight that changes on every call (back to the dispatcher),
// run-time scalars other than 1, and end to end through compile() with the op profiler showing
// that the packed path ran.
#include <gtest/gtest.h>

#include <atomic>
#include <thread>
#include <vector>

#include "compile_helpers.h"
#include "compiler/graph/passes.h"
#include "compiler/runtime/packed_gemm.h"
#include "kernel_cache_dir.h"
#include "kiln/compiler.h"
#include "kiln/kiln.h"
#include "kiln/models.h"
#include "kiln/nn.h"

namespace {

using namespace kiln;
using namespace kiln::testing;
using kiln::compiler::Graph;
using kiln::compiler::ValueInfo;
using kiln::compiler::runtime::plan_packed_gemm;
using kiln::compiler::runtime::run_packed_gemm;

KILN_TEST_KERNEL_CACHE_DIR("kiln_test_packed_gemm");

ValueInfo info_of(const Tensor& t) {
  static int next_group = 0;  // every value its own memory (linear_graph's view shares its base's)
  ValueInfo v;
  v.storage = next_group++;
  v.sizes = t.sizes().vec();
  v.strides = t.strides().vec();
  v.storage_offset = t.storage_offset();
  v.dtype = t.dtype();
  v.device = t.device();
  return v;
}

// The graph of `bias + x @ w.t()` (addmm; mm without a bias) as a Linear layer captures it: w a
// graph input, read through a permute view. Returns the GEMM node's index.
int linear_graph(Graph& g, const Tensor& x, const Tensor& w, const Tensor* bias) {
  using compiler::passes::internal::registered_op;
  const int wv = g.add_input(info_of(w));
  const int xv = g.add_input(info_of(x));
  const int bv = bias ? g.add_input(info_of(*bias)) : -1;
  compiler::Node& permute = g.add_node(registered_op("permute"), {wv}, {std::vector<int64_t>{1, 0}});
  ValueInfo view = info_of(w.t());
  view.storage = g.values[wv].storage;  // a view: the weight's memory
  const int wt = g.add_value(view);
  permute.outputs = {wt};
  const Tensor out = bias ? addmm(*bias, x, w.t()) : mm(x, w.t());
  if (bias) {
    compiler::Node& n = g.add_node(registered_op("addmm"), {bv, xv, wt}, {Scalar(1), Scalar(1)});
    n.outputs = {g.add_value(info_of(out))};
  } else {
    compiler::Node& n = g.add_node(registered_op("mm"), {xv, wt}, {});
    n.outputs = {g.add_value(info_of(out))};
  }
  return static_cast<int>(g.nodes.size()) - 1;
}

Tolerance gemm_tolerance() { return Tolerance{1e-5, 1e-5}; }

TEST(PackedGemm, AddmmAndMmMatchEager) {
  manual_seed(1);
  for (bool with_bias : {true, false}) {
    Tensor x = randn({7, 40}), w = randn({24, 40}), b = randn({24});
    Graph g;
    const int node = linear_graph(g, x, w, with_bias ? &b : nullptr);
    auto p = plan_packed_gemm(g, g.nodes[node], {});
    ASSERT_NE(p, nullptr) << "bias " << with_bias;
    std::vector<Tensor> inputs = with_bias ? std::vector<Tensor>{b, x, w.t()} : std::vector<Tensor>{x, w.t()};
    std::vector<Attr> attrs = with_bias ? std::vector<Attr>{Scalar(1), Scalar(1)} : std::vector<Attr>{};
    Tensor out;
    EXPECT_FALSE(run_packed_gemm(*p, inputs, attrs, out));  // a node's first call: the dispatcher's
    EXPECT_FALSE(out.defined());
    ASSERT_TRUE(run_packed_gemm(*p, inputs, attrs, out));
    EXPECT_TRUE(close(out, with_bias ? addmm(b, x, w.t()) : mm(x, w.t()), gemm_tolerance()));
    // Into a given output (reduce_overhead's arena).
    Tensor given = empty({7, 24});
    ASSERT_TRUE(run_packed_gemm(*p, inputs, attrs, given));
    EXPECT_TRUE(close(given, out, gemm_tolerance()));
  }
}

TEST(PackedGemm, AWeightChangedInPlaceIsPackedAgain) {
  Tensor x = randn({5, 16}), w = randn({8, 16}), b = randn({8});
  Graph g;
  auto p = plan_packed_gemm(g, g.nodes[linear_graph(g, x, w, &b)], {});
  ASSERT_NE(p, nullptr);
  std::vector<Attr> attrs{Scalar(1), Scalar(1)};
  Tensor first;
  EXPECT_FALSE(run_packed_gemm(*p, std::vector<Tensor>{b, x, w.t()}, attrs, first));  // (the first call)
  for (int step = 0; step < 2; ++step) {  // two changes: still under the limit of packs in a row
    Tensor out;
    ASSERT_TRUE(run_packed_gemm(*p, std::vector<Tensor>{b, x, w.t()}, attrs, out)) << step;
    EXPECT_TRUE(close(out, addmm(b, x, w.t()), gemm_tolerance())) << step;
    w.mul_(-0.5);  // bumps the version: the next call must not use the old packed copy
  }
}

TEST(PackedGemm, AWeightThatChangesOnEveryCallGoesBackToTheDispatcher) {
  Tensor x = randn({5, 16}), w = randn({8, 16}), b = randn({8});
  Graph g;
  auto p = plan_packed_gemm(g, g.nodes[linear_graph(g, x, w, &b)], {});
  ASSERT_NE(p, nullptr);
  std::vector<Attr> attrs{Scalar(1), Scalar(1)};
  int packed_runs = 0;
  for (int step = 0; step < 5; ++step) {
    Tensor out;
    if (run_packed_gemm(*p, std::vector<Tensor>{b, x, w.t()}, attrs, out)) {
      ++packed_runs;
      EXPECT_TRUE(close(out, addmm(b, x, w.t()), gemm_tolerance())) << step;
    }
    w.add_(0.25);
  }
  EXPECT_EQ(packed_runs, 3);  // calls 2, 3 and 4: the first goes to the dispatcher, the fifth too
}

TEST(PackedGemm, ScalarsOtherThanOneAndOtherLayoutsDoNotQualify) {
  Tensor x = randn({5, 16}), w = randn({8, 16}), b = randn({8});
  Graph g;
  auto p = plan_packed_gemm(g, g.nodes[linear_graph(g, x, w, &b)], {});
  ASSERT_NE(p, nullptr);
  Tensor out;
  EXPECT_FALSE(run_packed_gemm(*p, std::vector<Tensor>{b, x, w.t()}, std::vector<Attr>{Scalar(2), Scalar(1)}, out));
  EXPECT_FALSE(run_packed_gemm(*p, std::vector<Tensor>{b, x, w.t()}, std::vector<Attr>{Scalar(1), Scalar(0.5)}, out));
  EXPECT_FALSE(out.defined());
  // Another layout at run time than planned (x transposed): not run.
  Tensor xt = randn({16, 5}).t();
  EXPECT_FALSE(run_packed_gemm(*p, std::vector<Tensor>{b, xt, w.t()}, std::vector<Attr>{Scalar(1), Scalar(1)}, out));

  // A weight read row-major (x @ w with w [K, N]), float64, and a weight that is not a graph input
  // do not qualify.
  {
    using compiler::passes::internal::registered_op;
    Graph h;
    Tensor wk = randn({16, 8});
    const int wv = h.add_input(info_of(wk)), xv = h.add_input(info_of(x));
    compiler::Node& n = h.add_node(registered_op("mm"), {xv, wv}, {});
    n.outputs = {h.add_value(info_of(mm(x, wk)))};
    EXPECT_EQ(plan_packed_gemm(h, h.nodes[0], {}), nullptr);
  }
  {
    Graph h;
    Tensor xd = randn({5, 16}, kFloat64), wd = randn({8, 16}, kFloat64), bd = randn({8}, kFloat64);
    EXPECT_EQ(plan_packed_gemm(h, h.nodes[linear_graph(h, xd, wd, &bd)], {}), nullptr);
  }
  {
    using compiler::passes::internal::registered_op;
    Graph h;
    const int xv = h.add_input(info_of(x)), yv = h.add_input(info_of(w));
    compiler::Node& neg = h.add_node(registered_op("neg"), {yv}, {});
    const int nv = h.add_value(info_of(w));
    neg.outputs = {nv};
    compiler::Node& permute = h.add_node(registered_op("permute"), {nv}, {std::vector<int64_t>{1, 0}});
    const int wt = h.add_value(info_of(w.t()));
    permute.outputs = {wt};
    compiler::Node& n = h.add_node(registered_op("mm"), {xv, wt}, {});
    n.outputs = {h.add_value(info_of(mm(x, w.t())))};
    EXPECT_EQ(plan_packed_gemm(h, h.nodes[2], {}), nullptr);  // its weight is computed in the graph
  }
}

TEST(PackedGemm, AWeightTheGraphWritesIsNotPacked) {
  Tensor x = randn({5, 16}), w = randn({8, 16}), b = randn({8});
  Graph g;
  const int node = linear_graph(g, x, w, &b);
  std::vector<char> written(g.values.size(), 0);
  written[g.inputs[0]] = 1;  // the weight placeholder (an optimizer step in the same graph)
  EXPECT_EQ(plan_packed_gemm(g, g.nodes[node], written), nullptr);
  written.assign(g.values.size(), 0);
  written[g.inputs[1]] = 1;  // x: does not matter
  EXPECT_NE(plan_packed_gemm(g, g.nodes[node], written), nullptr);
}

// compile(): a Linear layer runs packed, and follows its weight when it changes between calls.
class PackedGemmCompiled : public CompilerTest {};

TEST_F(PackedGemmCompiled, ALinearLayerRunsPackedAndFollowsItsWeight) {
  manual_seed(2);
  auto lin = std::make_shared<nn::Linear>(32, 48);
  NoGradGuard no_grad;
  auto f = compile([&](const Tensor& x) { return gelu(lin->forward(x)) * 2; }, {.backend = std::string("kiln")});
  reset_op_profile();
  set_op_profiling(true);
  for (int step = 0; step < 3; ++step) {
    Tensor x = randn({6, 32});
    EXPECT_TRUE(close(f(x), gelu(lin->forward(x)) * 2, gemm_tolerance())) << step;
    lin->weight.add_(0.125);  // as an optimizer step would
  }
  set_op_profiling(false);
  EXPECT_NE(op_profile_report().find("addmm (packed weight)"), std::string::npos) << op_profile_report();
  EXPECT_GE(compiler::counters().graph_compiles, 1);
  EXPECT_EQ(compiler::counters().eager_frames, 0);
}

// A pure function replayed without its body updates the weight between calls of another compiled
// graph that packed it: that graph sees each new weight.
TEST_F(PackedGemmCompiled, WritesByAReplayedGraphArePackedAgain) {
  manual_seed(4);
  auto lin = std::make_shared<nn::Linear>(16, 8);
  NoGradGuard no_grad;
  CompileOptions pure;
  pure.backend = std::string("kiln");
  pure.pure = true;
  auto shrink = compile([&](const Tensor& s) { return lin->weight.mul_(s).sum(); }, pure);
  auto forward = compile([&](const Tensor& x) { return lin->forward(x); }, {.backend = std::string("kiln")});
  Tensor x = randn({4, 16});
  Tensor half = full({}, 0.5);
  Delta d;
  for (int step = 0; step < 6; ++step) {
    EXPECT_TRUE(close(forward(x), lin->forward(x), gemm_tolerance())) << step;
    shrink(half);
  }
  EXPECT_GT(d.now().replays, 0);  // the update did replay
}

// A dynamic graph's instances (one per sequence length) share each weight's packed copy, and
// threads run them side by side.
TEST_F(PackedGemmCompiled, GptInstancesAndThreadsMatchEager) {
  manual_seed(3);
  auto model = models::gpt({64, 32, 2, 2, 32, 0.0, true});
  model->eval();
  NoGradGuard no_grad;
  auto f = compile(model, {.backend = std::string("kiln")});
  for (int64_t len = 3; len <= 9; ++len) {
    Tensor idx = randint(64, {1, len});
    EXPECT_TRUE(close(f(idx), model->forward(idx), gemm_tolerance())) << len;
  }
  std::atomic<int> wrong{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 3; ++t) {
    threads.emplace_back([&, t] {
      NoGradGuard inner;
      for (int i = 0; i < 6; ++i) {
        Tensor idx = randint(64, {1, 3 + (t + i) % 7});
        if (!close(f(idx), model->forward(idx), gemm_tolerance())) ++wrong;
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(wrong.load(), 0);
}

}  // namespace
