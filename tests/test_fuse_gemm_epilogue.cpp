// GEMM epilogue fusion: the addmm_relu op (relu(addmm(...)) in one call) against relu(addmm(...)),
// the fuse_gemm_epilogue pass on captured graphs (fused where the relu is the addmm result's only
// reader, left alone otherwise, scalar slots kept), and MLPs compiled with the kiln backend, which
// runs the pass, against eager.
#include <gtest/gtest.h>
#include <stdlib.h>

#include <filesystem>
#include <fstream>
#include <limits>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "compile_helpers.h"
#include "kernel_cache_dir.h"
#include "compiler/graph/passes.h"
#include "kiln/autograd.h"
#include "kiln/compiler.h"
#include "kiln/compiler/graph.h"
#include "kiln/kiln.h"
#include "kiln/models.h"

namespace {

using namespace kiln;
using namespace kiln::testing;  // compile_helpers.h
using kiln::compiler::Arguments;
using kiln::compiler::Graph;
using kiln::compiler::Node;
namespace passes = kiln::compiler::passes;
namespace fs = std::filesystem;

KILN_TEST_KERNEL_CACHE_DIR("kiln_test_fuse_gemm_epilogue");

const OpDef& addmm_relu_op() {
  const OpDef* d = OpTable::instance().find("addmm_relu");
  if (!d) throw std::runtime_error("addmm_relu is not registered");
  return *d;
}

Tensor addmm_relu(const Tensor& self, const Tensor& a, const Tensor& b, Scalar beta = 1,
                  Scalar alpha = 1) {
  return call_op1(addmm_relu_op(), {self, a, b}, {beta, alpha});
}

int count_op(const Graph& g, std::string_view name) {
  int n = 0;
  for (const Node& node : g)
    if (node.target() == name) ++n;
  return n;
}

// ================================ the op ================================

struct Bias {
  const char* what;
  std::vector<int64_t> sizes;
};

// The same GEMM kernel runs in both, so results agree exactly.
TEST(AddmmRelu, EqualsReluOfAddmmInFloat32AndFloat64) {
  manual_seed(0);
  const int64_t m = 7, k = 13, n = 5;
  const std::vector<Bias> biases = {{"row vector (linear's bias)", {n}},
                                    {"(1, n)", {1, n}},
                                    {"column (m, 1)", {m, 1}},
                                    {"full (m, n)", {m, n}},
                                    {"0-dim", {}}};
  const std::vector<std::pair<double, double>> scales = {{1, 1}, {0.5, 2}, {-1.5, 0.25}, {1, -1}};
  for (DType t : {kFloat32, kFloat64}) {
    for (const Bias& bias : biases) {
      for (auto [beta, alpha] : scales) {
        SCOPED_TRACE(std::string(dtype_name(t)) + ", bias " + bias.what + ", beta " +
                     std::to_string(beta) + ", alpha " + std::to_string(alpha));
        Tensor self = randn(bias.sizes, t), a = randn({m, k}, t), b = randn({k, n}, t);
        Tensor got = addmm_relu(self, a, b, beta, alpha);
        Tensor want = relu(addmm(self, a, b, beta, alpha));
        EXPECT_TRUE(equal(got, want)) << got << want;
        EXPECT_EQ(got.dtype(), t);
        EXPECT_TRUE(got.is_contiguous());
        EXPECT_GT(sum(eq(got, 0)).item<int64_t>(), 0) << "the relu clamped nothing: a weak test";
      }
    }
  }
}

TEST(AddmmRelu, ReadsTransposedAndSlicedOperandsLikeAddmm) {
  manual_seed(1);
  Tensor x = randn({6, 9}), w = randn({4, 9}), bias = randn({4});
  EXPECT_TRUE(equal(addmm_relu(bias, x, w.t()), relu(addmm(bias, x, w.t()))))
      << "linear's weight.t()";
  Tensor big = randn({10, 12});
  Tensor a = big.slice(0, 2, 8).slice(1, 1, 10);  // (6, 9), row stride 12
  EXPECT_TRUE(equal(addmm_relu(bias, a, w.t()), relu(addmm(bias, a, w.t()))));
}

TEST(AddmmRelu, BetaZeroIgnoresSelfNaNIncluded) {
  Tensor self = full({2, 3}, std::numeric_limits<double>::quiet_NaN(), kFloat32);
  Tensor a = tensor<float>({1, -1, 2, -2}, {2, 2}), b = tensor<float>({1, 0, 3, 0, 1, -3}, {2, 3});
  Tensor got = addmm_relu(self, a, b, 0, 1);
  EXPECT_TRUE(equal(got, tensor<float>({1, 0, 6, 2, 0, 12}, {2, 3}))) << got;
}

TEST(AddmmRelu, WritesOutTargets) {
  manual_seed(2);
  Tensor self = randn({5}), a = randn({4, 3}), b = randn({3, 5});
  Tensor want = relu(addmm(self, a, b, 0.5, 2));
  {
    SCOPED_TRACE("contiguous target");
    Tensor out = full({4, 5}, 7.0, kFloat32);
    std::vector<Tensor> outs{out};
    call_op_out(addmm_relu_op(), {self, a, b}, {Scalar(0.5), Scalar(2)}, outs);
    EXPECT_TRUE(equal(out, want)) << out;
  }
  {
    SCOPED_TRACE("transposed view of a buffer");
    Tensor buffer = full({5, 4}, 7.0, kFloat32);
    Tensor out = buffer.t();
    std::vector<Tensor> outs{out};
    call_op_out(addmm_relu_op(), {self, a, b}, {Scalar(0.5), Scalar(2)}, outs);
    EXPECT_TRUE(equal(out, want)) << out;
    EXPECT_TRUE(equal(buffer, want.t()));
  }
  {
    SCOPED_TRACE("float64 target: the result is cast");
    Tensor out = zeros({4, 5}, kFloat64);
    std::vector<Tensor> outs{out};
    call_op_out(addmm_relu_op(), {self, a, b}, {Scalar(0.5), Scalar(2)}, outs);
    EXPECT_TRUE(equal(out, want.to(kFloat64))) << out;
  }
  {
    SCOPED_TRACE("self is the target (the out= form of addmm_ then relu_)");
    Tensor acc = randn({4, 5});
    Tensor expected = relu(addmm(acc, a, b, 0.5, 2));
    std::vector<Tensor> outs{acc};
    call_op_out(addmm_relu_op(), {acc, a, b}, {Scalar(0.5), Scalar(2)}, outs);
    EXPECT_TRUE(equal(acc, expected)) << acc;
  }
}

TEST(AddmmRelu, RejectsBadOperandsNamingItself) {
  Tensor a = randn({2, 3}), b = randn({4, 5});
  try {
    addmm_relu(randn({5}), a, b);
    FAIL() << "mismatched inner sizes were accepted";
  } catch (const ShapeError& e) {
    EXPECT_TRUE(
        contains(e.what(), "[kiln::addmm_relu] shapes (2, 3) and (4, 5) cannot be multiplied"));
  }
  EXPECT_THROW(addmm_relu(randn({3}), a, randn({3, 2})), ShapeError)
      << "self does not broadcast to (2, 2)";
  EXPECT_THROW(addmm_relu(randn({2}), a, randn({3, 2}, kFloat64)), DTypeError);
  EXPECT_THROW(addmm_relu(randn({2}), randn({2, 3, 1}), randn({3, 2})), ShapeError);
}

TEST(AddmmRelu, GradientsMatchFiniteDifferences) {
  manual_seed(3);
  // Values away from the relu's kink, where finite differences are exact enough.
  Tensor self = randn({4}, kFloat64).requires_grad_(), a = randn({3, 5}, kFloat64).requires_grad_(),
         b = randn({5, 4}, kFloat64).requires_grad_();
  auto fn = [](const TensorList& in) {
    return TensorList{addmm_relu(in[0], in[1], in[2], 0.5, -2)};
  };
  std::string report;
  EXPECT_TRUE(autograd::gradcheck(fn, {self, a, b}, 1e-6, 1e-5, 1e-3, &report)) << report;
  // And the same gradients as relu(addmm(...)).
  Tensor g1 = addmm_relu(self, a, b, 0.5, -2).sum();
  TensorList fused = autograd::grad({g1}, {self, a, b});
  Tensor g2 = relu(addmm(self, a, b, 0.5, -2)).sum();
  TensorList plain = autograd::grad({g2}, {self, a, b});
  for (size_t i = 0; i < 3; ++i)
    EXPECT_TRUE(allclose(fused[i], plain[i], 1e-12, 1e-12)) << "input " << i;
}

// ================================ the pass ================================

using Captured = kiln::testing::CapturedGraph;

// Outputs of `g` on `tensors` (cloned, so that writes into inputs do not leak) and `scalars`.
std::vector<Tensor> run(const Graph& g, const std::vector<Tensor>& tensors,
                        const std::vector<Attr>& scalars) {
  std::vector<Tensor> in;
  for (const Tensor& t : tensors) in.push_back(t.clone());
  return kiln::compiler::interpreter(g)(Arguments{in, scalars});
}

// Runs the pass on a copy of the captured graph; checks that it validates, keeps the calling
// convention and computes what the captured graph computes (with the captured scalars and with
// `other_scalars`, when given). Returns the rewritten graph.
Graph fuse(const Captured& c, const std::vector<Attr>& other_scalars = {}) {
  Graph h = c.graph;
  passes::fuse_gemm_epilogue(h);
  EXPECT_NO_THROW(h.validate()) << h;
  EXPECT_EQ(h.scalars.size(), c.graph.scalars.size()) << "the pass changed the calling convention";
  EXPECT_EQ(h.outputs.size(), c.graph.outputs.size());
  for (const std::vector<Attr>* scalars : {&c.scalars, &other_scalars}) {
    if (scalars->size() != c.scalars.size()) continue;
    std::vector<Tensor> got = run(h, c.tensors, *scalars), want = run(c.graph, c.tensors, *scalars);
    EXPECT_EQ(got.size(), want.size());
    for (size_t i = 0; i < got.size() && i < want.size(); ++i)
      EXPECT_TRUE(close(got[i], want[i], Tolerance{1e-6, 1e-6})) << "output " << i << "\nbefore:\n"
                                                                 << c.graph << "after:\n"
                                                                 << h;
  }
  return h;
}

// Every used slot of `g` names an addmm_relu's beta (attr 0) or alpha (attr 1).
void expect_slots_on_fused_nodes(const Graph& g) {
  for (const auto& s : g.scalars) {
    if (s.node < 0) continue;
    EXPECT_EQ(g.nodes[s.node].target(), "addmm_relu")
        << "slot (" << s.node << ", " << s.attr << ")\n"
        << g;
    EXPECT_TRUE(s.attr == 0 || s.attr == 1);
  }
}

TEST(FuseGemmEpilogue, FusesALinearLayerAndItsRelu) {
  manual_seed(4);
  Tensor w = randn({6, 8}), b = randn({6});
  Captured c =
      capture_graph([&](const Tensor& x) { return relu(addmm(b, x, w.t())) * 2; }, randn({5, 8}));
  ASSERT_EQ(count_op(c.graph, "addmm"), 1) << c.graph;
  Graph h = fuse(c);
  EXPECT_EQ(count_op(h, "addmm_relu"), 1) << h;
  EXPECT_EQ(count_op(h, "addmm"), 0) << h;
  EXPECT_EQ(count_op(h, "relu"), 0) << h;
  EXPECT_EQ(h.nodes.size(), c.graph.nodes.size() - 1);
  expect_slots_on_fused_nodes(h);
}

// beta and alpha are run-time scalars: their slots follow the fused nodes, whose positions shift
// as the relus before them go.
TEST(FuseGemmEpilogue, KeepsBetaAndAlphaSlotsAcrossTwoFusedLayers) {
  manual_seed(5);
  Tensor w1 = randn({6, 8}), b1 = randn({6}), w2 = randn({3, 6}), b2 = randn({3});
  auto fn = [&](const Tensor& x) {
    Tensor h = relu(addmm(b1, x, w1.t(), 0.5, 2.0));
    return relu(addmm(b2, h, w2.t(), -1.0, 1.5));
  };
  Captured c = capture_graph(fn, randn({5, 8}));
  ASSERT_EQ(c.scalars.size(), 4u) << "beta and alpha of both addmms are run-time scalars\n"
                                  << c.graph;
  Graph h = fuse(c, {Scalar(0.25), Scalar(-3.0), Scalar(2.0), Scalar(0.5)});
  EXPECT_EQ(count_op(h, "addmm_relu"), 2) << h;
  EXPECT_EQ(count_op(h, "relu"), 0) << h;
  expect_slots_on_fused_nodes(h);
  for (size_t k = 0; k < c.graph.scalars.size(); ++k) {
    EXPECT_EQ(h.scalars[k].attr, c.graph.scalars[k].attr) << "slot " << k;
    EXPECT_GE(h.scalars[k].node, 0) << "slot " << k << " lost its node";
  }
}

TEST(FuseGemmEpilogue, LeavesAddmmsWhoseResultIsReadElsewhere) {
  manual_seed(6);
  Tensor w = randn({4, 3}), b = randn({4});
  Tensor x = randn({5, 3});
  struct Case {
    const char* what;
    Captured captured;
  };
  auto linear = [&](const Tensor& t) { return addmm(b, t, w.t()); };
  auto also_returned = [&](const Tensor& t) {
    Tensor y = linear(t);
    return std::vector<Tensor>{y, relu(y)};
  };
  auto also_added = [&](const Tensor& t) {
    Tensor y = linear(t);
    return relu(y) + y;
  };
  auto viewed = [&](const Tensor& t) {
    Tensor y = linear(t);
    return relu(y) + y.t().sum(1);
  };
  auto two_relus = [&](const Tensor& t) {
    Tensor y = linear(t);
    return relu(y) * relu(y).sum();
  };
  auto scaled_in_place = [&](const Tensor& t) {
    Tensor y = linear(t);
    y.mul_(-1);
    return relu(y);
  };
  auto overwritten = [&](const Tensor& t) {
    Tensor y = linear(t);
    y.copy_(t.sum(1, true).expand({5, 4}));
    return relu(y);
  };
  auto relu_in_place = [&](const Tensor& t) {
    Tensor y = linear(t);
    y.relu_();
    return y;
  };
  auto mm_relu = [&](const Tensor& t) { return relu(mm(t, w.t())); };
  auto gelu_after = [&](const Tensor& t) { return gelu(linear(t)); };
  std::vector<Case> cases = {
      {"the addmm's result is also returned", capture_graph(also_returned, x)},
      {"another op reads the addmm's result", capture_graph(also_added, x)},
      {"a view of the addmm's result", capture_graph(viewed, x)},
      {"two relus read it", capture_graph(two_relus, x)},
      {"the addmm's result is written in place before the relu", capture_graph(scaled_in_place, x)},
      {"the addmm's result is overwritten (copy_ does not read it)", capture_graph(overwritten, x)},
      {"an in-place relu_ (before functionalize)", capture_graph(relu_in_place, x)},
      {"mm, not addmm", capture_graph(mm_relu, x)},
      {"addmm then another activation", capture_graph(gelu_after, x)},
  };
  for (Case& c : cases) {
    SCOPED_TRACE(c.what);
    Graph h = fuse(c.captured);
    EXPECT_EQ(h.str(), c.captured.graph.str());
    EXPECT_EQ(count_op(h, "addmm_relu"), 0);
  }
}

TEST(FuseGemmEpilogue, FusesAnInPlaceReluAfterFunctionalize) {
  manual_seed(7);
  Tensor w = randn({4, 3}), b = randn({4});
  Captured c = capture_graph(
      [&](const Tensor& t) {
        Tensor y = addmm(b, t, w.t());
        y.relu_();
        return y;
      },
      randn({5, 3}));
  passes::functionalize(c.graph);
  ASSERT_EQ(count_op(c.graph, "relu"), 1) << c.graph;
  Graph h = fuse(c);
  EXPECT_EQ(count_op(h, "addmm_relu"), 1) << h;
  EXPECT_EQ(count_op(h, "relu"), 0) << h;
}

TEST(FuseGemmEpilogue, FusesEveryHiddenLayerOfAnMlpTrainingStep) {
  manual_seed(8);
  auto model = models::mlp({6, 16, 16, 3});
  Tensor target = tensor<int64_t>({0, 1, 2, 1});
  Captured c = capture_graph(
      [&](const Tensor& x) {
        Tensor loss = nn::functional::cross_entropy(model->forward(x), target);
        loss.backward();
        return loss;
      },
      randn({4, 6}));
  passes::functionalize(c.graph);
  ASSERT_EQ(count_op(c.graph, "addmm"), 3) << c.graph;
  Graph h = fuse(c);
  EXPECT_EQ(count_op(h, "addmm_relu"), 2)
      << "relu's backward reads the relu's result, not the addmm's\n"
      << h;
  EXPECT_EQ(count_op(h, "addmm"), 1) << "the output layer has no relu\n" << h;
}

// ================================ compiled with the kiln backend ================================

class KilnGemmEpilogue : public CompilerTest {
 protected:
  void SetUp() override {
    CompilerTest::SetUp();
    manual_seed(0);
  }
};

CompileOptions kiln_backend() {
  CompileOptions options;
  options.backend = std::string("kiln");
  return options;
}

// A backend that runs the kiln backend's passes up to this one and counts the fused nodes (the
// kiln backend itself keeps its graph to itself), then runs the graph op by op.
CompileOptions counting_backend(std::shared_ptr<int> fused) {
  CompileOptions options;
  options.backend = [fused](Graph& g, const Arguments&) {
    passes::functionalize(g);
    passes::fuse_gemm_epilogue(g);
    *fused += count_op(g, "addmm_relu");
    return kiln::compiler::interpreter(g);
  };
  return options;
}


std::string read_file(const fs::path& p) {
  std::ifstream in(p);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

TEST_F(KilnGemmEpilogue, MlpForwardMatchesEagerAndRunsAddmmRelu) {
  auto net = models::mlp({16, 64, 64, 10});
  Tensor x = randn({32, 16});
  Tensor want = net->forward(x);

  // The kiln backend's graph after its passes, from its KILN_COMPILE_DEBUG dump.
  std::string pattern = (fs::temp_directory_path() / "kiln_test_fuse_gemm_debug_XXXXXX").string();
  ASSERT_NE(::mkdtemp(pattern.data()), nullptr);
  const fs::path debug_dir = pattern;
  Tensor got;
  Delta d;
  {
    ScopedEnv debug("KILN_COMPILE_DEBUG", "1");
    ScopedEnv dir("KILN_COMPILE_DEBUG_DIR", debug_dir.string());
    LogCapture logs;  // the dump announces itself on the log stream
    got = kiln::compile(net, kiln_backend())(x);
  }
  EXPECT_EQ(d.now().graph_runs, 1);
  EXPECT_EQ(d.now().kernel_runs, 0) << "every relu rides on a GEMM: nothing is left to generate";
  EXPECT_TRUE(close(got, want, Tolerance{1e-5, 1e-5}));
  std::string after;
  for (const auto& entry : fs::recursive_directory_iterator(debug_dir))
    if (entry.path().filename() == "graph_after_passes.txt") after += read_file(entry.path());
  std::error_code ec;
  fs::remove_all(debug_dir, ec);
  EXPECT_EQ(occurrences(after, "= addmm_relu("), 2) << after;
  EXPECT_EQ(occurrences(after, "= relu("), 0) << after;

  auto fused = std::make_shared<int>(0);
  Tensor counted = kiln::compile(net, counting_backend(fused))(x);
  EXPECT_EQ(*fused, 2);
  EXPECT_TRUE(close(counted, want, Tolerance{1e-6, 1e-6}));
}

// Two SGD steps with momentum, compiled (forward, backward and update in one graph) and eager.
TEST_F(KilnGemmEpilogue, MlpTrainingStepMatchesEager) {
  for (bool kiln : {true, false}) {
    SCOPED_TRACE(kiln ? "kiln backend" : "counting backend");
    manual_seed(3);
    auto model_c = models::mlp({8, 32, 32, 3});
    auto model_e = models::mlp({8, 32, 32, 3});
    model_e->load_state_dict(model_c->state_dict());
    const optim::SGDOptions options{.lr = 0.1, .momentum = 0.9};
    auto opt_c = std::make_shared<optim::SGD>(model_c->parameters(), options);
    auto opt_e = std::make_shared<optim::SGD>(model_e->parameters(), options);
    auto fused = std::make_shared<int>(0);
    auto step_c = kiln::compile(training_step(model_c, opt_c),
                                kiln ? kiln_backend() : counting_backend(fused));
    auto step_e = training_step(model_e, opt_e);
    Tensor x = randn({16, 8});
    Tensor y = tensor<int64_t>({0, 1, 2, 1, 0, 2, 2, 1, 0, 0, 1, 2, 2, 1, 0, 1});
    Delta d;
    for (int i = 0; i < 2; ++i) {
      SCOPED_TRACE("step " + std::to_string(i));
      Tensor lc = step_c(x, y);
      Tensor le = step_e(x, y);
      EXPECT_TRUE(close(lc, le, Tolerance{1e-5, 1e-5}));
    }
    EXPECT_GT(d.now().graph_runs, 0);
    if (kiln) {
      EXPECT_GT(d.now().kernel_runs, 0);
    } else {
      EXPECT_GT(d.now().graph_compiles, 0);
      EXPECT_EQ(*fused, 2 * d.now().graph_compiles) << "both hidden layers in every compiled graph";
    }
    auto pc = model_c->named_parameters();
    auto pe = model_e->named_parameters();
    ASSERT_EQ(pc.size(), pe.size());
    for (size_t i = 0; i < pc.size(); ++i)
      EXPECT_TRUE(close(pc[i].second, pe[i].second, Tolerance{1e-5, 1e-5}))
          << pc[i].first << " after 2 steps";
  }
}

}  // namespace
