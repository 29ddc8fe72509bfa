// kiln::compile and autograd (DESIGN §2.3): a compiled forward whose backward runs outside (the
// backward is captured as a graph too), a whole compiled training step, autograd::grad inside
// compiled code. Gradients and trained parameters are compared with eager ones.
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "compile_helpers.h"
#include "kiln/compiler.h"
#include "kiln/kiln.h"

namespace {

using namespace kiln;
using compiler::Counters;

using namespace kiln::testing;  // compile_helpers.h

class CompileAutograd : public CompilerTest {
 protected:
  void SetUp() override {
    CompilerTest::SetUp();
    manual_seed(0);
  }
};

Tensor leaf_copy(const Tensor& t) { return t.detach().clone().requires_grad_(); }

Tensor loss_fn(const Tensor& x, const Tensor& w, const Tensor& b) {
  return ((x.matmul(w) + b).tanh() * 2).pow(2).mean();
}

// ================================ backward outside the compiled call ================================

TEST_F(CompileAutograd, CompiledForwardBackwardOutsideMatchesEager) {
  Tensor w = randn({4, 3}).requires_grad_(), b = randn({3}).requires_grad_();
  Tensor we = leaf_copy(w), be = leaf_copy(b);
  auto f = kiln::compile(loss_fn);

  for (int it = 0; it < 3; ++it) {
    Tensor x = randn({5, 4});
    w.set_grad(Tensor());
    b.set_grad(Tensor());
    we.set_grad(Tensor());
    be.set_grad(Tensor());
    Delta d;
    Tensor lc = f(x, w, b);
    Counters after_forward = d.now();
    EXPECT_EQ(after_forward.graph_runs, 1) << "iteration " << it;
    EXPECT_TRUE(lc.requires_grad());
    lc.backward();
    Counters after_backward = d.now();
    EXPECT_GT(after_backward.graph_runs, after_forward.graph_runs)
        << "iteration " << it << ": the backward must run as a compiled graph";
    if (it == 0) {
      EXPECT_EQ(after_forward.graph_compiles, 1);
      EXPECT_GT(after_backward.graph_compiles, after_forward.graph_compiles)
          << "the backward is captured and compiled";
    } else {
      EXPECT_EQ(after_backward.graph_compiles, 0) << "iteration " << it << ": forward and backward hit the cache";
      EXPECT_GE(after_backward.graph_cache_hits, 2);
    }
    Tensor le = loss_fn(x, we, be);
    le.backward();
    EXPECT_TRUE(close(lc, le));
    EXPECT_TRUE(close(w.grad(), we.grad())) << "iteration " << it;
    EXPECT_TRUE(close(b.grad(), be.grad())) << "iteration " << it;
    EXPECT_FALSE(w.grad().requires_grad());
  }
}

// The loss is computed eagerly from the compiled module's output, so backward() starts at an eager
// node; the backward of the compiled forward must still run as a captured graph (AOTAutograd).
TEST_F(CompileAutograd, CompiledModuleForwardBackwardOutside) {
  manual_seed(1);
  auto model = std::make_shared<nn::Sequential>(std::make_shared<nn::Linear>(4, 8), std::make_shared<nn::ReLU>(),
                                                std::make_shared<nn::Linear>(8, 3));
  auto eager = std::make_shared<nn::Sequential>(std::make_shared<nn::Linear>(4, 8), std::make_shared<nn::ReLU>(),
                                                std::make_shared<nn::Linear>(8, 3));
  eager->load_state_dict(model->state_dict());
  auto opt_model = kiln::compile(model);
  Tensor x = randn({6, 4});
  Tensor y = tensor<int64_t>({0, 1, 2, 0, 1, 2});
  Delta d;
  Tensor lc = nn::functional::cross_entropy(opt_model(x), y);
  lc.backward();
  Tensor le = nn::functional::cross_entropy(eager->forward(x), y);
  le.backward();
  EXPECT_TRUE(close(lc, le));
  auto pc = model->named_parameters();
  auto pe = eager->named_parameters();
  ASSERT_EQ(pc.size(), pe.size());
  for (size_t i = 0; i < pc.size(); ++i) EXPECT_TRUE(close(pc[i].second.grad(), pe[i].second.grad())) << pc[i].first;
  EXPECT_GE(d.now().graph_compiles, 2) << "the forward graph and the captured backward graph";
}

TEST_F(CompileAutograd, BackwardHonorsForceEager) {
  Tensor w = randn({4, 3}).requires_grad_(), b = randn({3}).requires_grad_();
  Tensor we = leaf_copy(w), be = leaf_copy(b);
  auto f = kiln::compile(loss_fn);
  Tensor x = randn({5, 4});
  Tensor lc = f(x, w, b);
  Delta d;
  {
    compiler::StanceGuard g(Stance::force_eager);
    lc.backward();
  }
  EXPECT_EQ(d.now().graph_runs, 0) << "a backward under force_eager runs eagerly";
  EXPECT_EQ(d.now().graph_compiles, 0);
  loss_fn(x, we, be).backward();
  EXPECT_TRUE(close(w.grad(), we.grad()));
  EXPECT_TRUE(close(b.grad(), be.grad()));
}

// ================================ a whole training step ================================

std::shared_ptr<nn::Sequential> make_mlp() {
  return std::make_shared<nn::Sequential>(std::make_shared<nn::Linear>(4, 16), std::make_shared<nn::ReLU>(),
                                          std::make_shared<nn::Linear>(16, 3));
}

std::shared_ptr<nn::Sequential> copy_of(const std::shared_ptr<nn::Sequential>& m) {
  auto c = make_mlp();
  c->load_state_dict(m->state_dict());
  return c;
}

// Trains a compiled and an eager copy for three steps and compares them after each step.
template <class Opt, class Options>
void check_training_step(const Options& options) {
  manual_seed(3);
  auto model_c = make_mlp();
  auto model_e = copy_of(model_c);
  auto model_x = copy_of(model_c);  // for explain(), which runs the step once more
  auto opt_c = std::make_shared<Opt>(model_c->parameters(), options);
  auto opt_e = std::make_shared<Opt>(model_e->parameters(), options);
  auto opt_x = std::make_shared<Opt>(model_x->parameters(), options);
  auto step_c = kiln::compile(training_step(model_c, opt_c));
  auto step_e = training_step(model_e, opt_e);

  Tensor x = randn({8, 4});
  Tensor y = tensor<int64_t>({0, 1, 2, 1, 0, 2, 2, 1});
  Delta d;
  int64_t compiles_after_step2 = 0;
  for (int step = 0; step < 3; ++step) {
    Tensor xs = x + 0.1 * step;
    Tensor lc = step_c(xs, y);
    Tensor le = step_e(xs, y);
    EXPECT_TRUE(close(lc, le, {1e-5, 1e-6})) << "loss at step " << step;
    auto pc = model_c->named_parameters();
    auto pe = model_e->named_parameters();
    ASSERT_EQ(pc.size(), pe.size());
    for (size_t i = 0; i < pc.size(); ++i)
      EXPECT_TRUE(close(pc[i].second, pe[i].second, {1e-5, 1e-6})) << pc[i].first << " after step " << step;
    if (step == 1) compiles_after_step2 = d.now().graph_compiles;
  }
  EXPECT_GE(d.now().graph_runs, 3);
  EXPECT_EQ(d.now().eager_frames, 0);
  EXPECT_EQ(d.now().graph_compiles, compiles_after_step2) << "the third step hits the cache";

  compiler::ExplainOutput e = compiler::explain(training_step(model_x, opt_x))(x, y);
  std::string reasons;
  for (const auto& br : e.break_reasons) reasons += "\n  " + br.reason + " at " + br.where();
  EXPECT_EQ(e.graph_count, 1) << "forward + backward + optimizer step in one graph; break reasons:" << reasons;
  EXPECT_EQ(e.graph_break_count, 0) << reasons;
}

TEST_F(CompileAutograd, TrainingStepSgdMatchesEager) {
  check_training_step<optim::SGD>(optim::SGDOptions{.lr = 0.1, .momentum = 0.9});
}

TEST_F(CompileAutograd, TrainingStepAdamMatchesEager) {
  check_training_step<optim::Adam>(optim::AdamOptions{.lr = 0.01});
}

TEST_F(CompileAutograd, TrainingStepAdamWWithAmsgradMatchesEager) {
  check_training_step<optim::AdamW>(optim::AdamWOptions{.lr = 0.01, .weight_decay = 0.1, .amsgrad = true});
}

TEST_F(CompileAutograd, TrainingStepNesterovSgdMatchesEager) {
  check_training_step<optim::SGD>(
      optim::SGDOptions{.lr = 0.05, .momentum = 0.8, .weight_decay = 0.01, .nesterov = true});
}

// The ops of the step's graph(s), every graph's in order.
template <class Opt, class Options>
std::vector<std::string> training_step_ops(const Options& options) {
  auto model = make_mlp();
  auto opt = std::make_shared<Opt>(model->parameters(), options);
  Tensor x = randn({8, 4}), y = tensor<int64_t>({0, 1, 2, 1, 0, 2, 2, 1});
  auto step = training_step(model, opt);
  step(x, y);  // the state exists: the graph below is the one every later step runs
  std::vector<std::string> ops;
  for (const auto& g : compiler::explain(step)(x, y).ops_per_graph) ops.insert(ops.end(), g.begin(), g.end());
  return ops;
}

// A captured optimizer step is one fused node for all of a group's dense parameters (the kernel
// eager steps take), not a dozen ops per parameter: the MLP's four parameters update in one
// _fused_adam_ (or _fused_sgd_) node, and none of the per-op form's ops is left.
TEST_F(CompileAutograd, ACapturedOptimizerStepIsOneFusedNodePerParameterGroup) {
  auto count = [](const std::vector<std::string>& ops, const std::string& name) {
    return std::count(ops.begin(), ops.end(), name);
  };
  const std::vector<std::string> adam = training_step_ops<optim::Adam>(optim::AdamOptions{.lr = 0.01});
  EXPECT_EQ(count(adam, "_fused_adam_"), 1);
  for (const char* per_op : {"lerp", "addcdiv", "addcmul", "sqrt", "pow"}) EXPECT_EQ(count(adam, per_op), 0) << per_op;
  const std::vector<std::string> sgd = training_step_ops<optim::SGD>(optim::SGDOptions{.lr = 0.1, .momentum = 0.9});
  EXPECT_EQ(count(sgd, "_fused_sgd_"), 1);
  EXPECT_EQ(count(sgd, "_fused_adam_"), 0);
}

// The fused node writes the parameters in place: a value the body computed from a parameter before
// the step, and read after it, keeps the old parameter, and a read after the step sees the new one,
// in the kiln backend's schedule as eagerly.
TEST_F(CompileAutograd, ValuesComputedBeforeAFusedStepKeepTheOldParameters) {
  auto model_c = make_mlp();
  auto model_e = copy_of(model_c);
  auto opt_c = std::make_shared<optim::Adam>(model_c->parameters(), optim::AdamOptions{.lr = 0.1});
  auto opt_e = std::make_shared<optim::Adam>(model_e->parameters(), optim::AdamOptions{.lr = 0.1});
  auto body = [](std::shared_ptr<nn::Sequential> model, std::shared_ptr<optim::Adam> opt) {
    return [model, opt](const Tensor& x, const Tensor& y) {
      opt->zero_grad();
      const Tensor w = model->parameters()[0];
      Tensor before = w * 2 + 1;  // pointwise over the weight: fusable with the reads after the step
      Tensor loss = nn::functional::cross_entropy(model->forward(x), y);
      loss.backward();
      opt->step();
      return std::vector<Tensor>{loss, before * 3, w * 3 + before};
    };
  };
  auto step_c = kiln::compile(body(model_c, opt_c));
  auto step_e = body(model_e, opt_e);
  Tensor x = randn({8, 4}), y = tensor<int64_t>({0, 1, 2, 1, 0, 2, 2, 1});
  Delta d;
  for (int step = 0; step < 3; ++step) {
    std::vector<Tensor> c = step_c(x, y), e = step_e(x, y);
    for (size_t k = 0; k < c.size(); ++k) EXPECT_TRUE(close(c[k], e[k], {1e-5, 1e-6})) << "result " << k << " at step " << step;
  }
  EXPECT_EQ(d.now().eager_frames, 0);
  EXPECT_GE(d.now().kernel_runs, 3) << "the kiln backend's generated kernels ran";
}

// ================================ the min-cut partition of saved values ================================
//
// A compiled forward whose backward runs later saves only what the backward cannot cheaply
// recompute: a value that only autograd holds and that one pointwise op computes from graph inputs
// or other saved values is recomputed by the backward instead (compiler::counters().recomputed_values).

// mul saves x and w (inputs); sin saves m = x * w, cos saves s = sin(m): both recomputable.
Tensor sin_cos_chain(const Tensor& x, const Tensor& w) { return (x * w).sin().cos().sum(); }

// Runs `fn` compiled (with `backend`) and eagerly on copies of the leaves, backward outside, and
// compares values and gradients. Returns the values the compiled forward left to recompute.
int64_t check_backward_outside(const std::function<Tensor(const Tensor&, const Tensor&)>& fn, const Tensor& x,
                               const Tensor& w, const std::string& backend = "kiln") {
  Tensor xc = leaf_copy(x), wc = leaf_copy(w), xe = leaf_copy(x), we = leaf_copy(w);
  auto f = kiln::compile(fn, {.backend = backend});
  Delta d;
  Tensor lc = f(xc, wc);
  const int64_t recomputed = d.now().recomputed_values;
  EXPECT_EQ(d.now().graph_runs, 1);
  lc.backward();
  EXPECT_EQ(d.now().graph_runs, 2) << "the backward runs as a compiled graph";
  EXPECT_EQ(d.now().eager_frames, 0);
  Tensor le = fn(xe, we);
  le.backward();
  EXPECT_TRUE(close(lc, le));
  EXPECT_TRUE(close(xc.grad(), xe.grad()));
  EXPECT_TRUE(close(wc.grad(), we.grad()));
  return recomputed;
}

TEST_F(CompileAutograd, PartitionRecomputesAPointwiseChainFromTheInputs) {
  EXPECT_EQ(check_backward_outside(sin_cos_chain, randn({4, 5}), randn({5})), 2);
}

TEST_F(CompileAutograd, PartitionRecomputesAChainThroughValuesNothingHolds) {
  // relu saves its result r = relu(x * w + 1); nothing holds x * w or the sum, so r is recomputed
  // from x and w by the chain mul → add → relu.
  auto fn = [](const Tensor& x, const Tensor& w) { return (x * w + 1).relu().pow(2).sum(); };
  EXPECT_EQ(check_backward_outside(fn, randn({4, 5}), randn({5})), 1) << "r, saved by relu and by pow";
  // A chain that reaches a GEMM's result stays saved.
  auto gemm = [](const Tensor& x, const Tensor& w) { return (x.matmul(w.unsqueeze(1)) + 1).relu().sum(); };
  EXPECT_EQ(check_backward_outside(gemm, randn({4, 5}), randn({5})), 0);
}

TEST_F(CompileAutograd, PartitionKeepsWhatTheCallerHolds) {
  // The caller holds m, so m is saved as computed; s = sin(m) is still recomputed from it.
  auto fn = [](const Tensor& x, const Tensor& w) {
    Tensor m = x * w;
    Tensor loss = m.sin().cos().sum();
    return loss + m.detach().sum() * 0;  // m escapes through a detached read: still a held value
  };
  Tensor x = randn({3, 4}), w = randn({4});
  EXPECT_EQ(check_backward_outside(fn, x, w), 2) << "m and s: nothing holds m after the call";
  std::vector<Tensor> held;
  auto holding = [&](const Tensor& a, const Tensor& b) {
    Tensor m = a * b;
    held.push_back(m);  // the caller keeps m alive past the flush
    return m.sin().cos().sum();
  };
  EXPECT_EQ(check_backward_outside(holding, x, w), 1) << "only s = sin(m)";
}

TEST_F(CompileAutograd, PartitionNeverRecomputesGemmsOrReductions) {
  // relu saves its result r = relu(x @ w); x @ w is not saved, so r stays saved.
  auto gemm = [](const Tensor& x, const Tensor& w) { return (x.matmul(w.unsqueeze(1))).relu().sum(); };
  EXPECT_EQ(check_backward_outside(gemm, randn({4, 5}), randn({5})), 0);
  // A pointwise value a GEMM saves is recomputed for the backward's GEMM.
  auto into_gemm = [](const Tensor& x, const Tensor& w) { return x.sin().matmul(w).pow(2).sum(); };
  EXPECT_GE(check_backward_outside(into_gemm, randn({4, 5}), randn({5})), 1);
}

// Issue 18.14: a value written in place after its producer ran is saved as written: recomputing it
// from its producer would give the value before the write (y = x.clone(); y.add_(100); y * w).
TEST_F(CompileAutograd, PartitionNeverRecomputesAValueWrittenInPlace) {
  Tensor x = tensor<float>({1, 2, 3}), w = tensor<float>({1, 1, 1});
  for (const char* backend : {"aot_eager", "kiln"}) {
    SCOPED_TRACE(backend);
    auto add = [](const Tensor& x, const Tensor& w) {
      Tensor y = x.clone();
      y.add_(100.0);
      return (y * w).sum();
    };
    EXPECT_EQ(check_backward_outside(add, x, w, backend), 0) << "y is saved as written";
    auto mul = [](const Tensor& x, const Tensor& w) {
      Tensor y = x.clone();
      y.mul_(3.0);
      return (y * w).sum();
    };
    check_backward_outside(mul, x, w, backend);
    auto copy = [](const Tensor& x, const Tensor& w) {
      Tensor y = x.clone();
      y.copy_(x * 3);
      return (y * w).sum();
    };
    check_backward_outside(copy, x, w, backend);
    auto lerp = [](const Tensor& x, const Tensor& w) {
      Tensor y = x.clone();
      y.lerp_(x * 3, 0.5);
      return (y * w).sum();
    };
    check_backward_outside(lerp, x, w, backend);
    // The convolution's weight gradient reads the input as written.
    auto conv = [](const Tensor& x, const Tensor& w) {
      Tensor xi = x.clone();
      xi.mul_(2.0);
      return conv2d(xi, w).pow(2).sum();
    };
    check_backward_outside(conv, randn({1, 2, 5, 5}), randn({3, 2, 3, 3}), backend);
  }
}

// Issue 18.17: an in-place write after a value's pointwise producer is part of the value, and a
// value a recipe reads must not change after the node that read it.
TEST_F(CompileAutograd, PartitionKeepsValuesWrittenInPlaceAfterTheirProducer) {
  auto sliced = [](const Tensor& x, const Tensor& w) {
    Tensor p = zeros({x.size(0), x.size(1) + 1});
    p.narrow(1, 0, x.size(1)).copy_(x.detach());  // written through a view after fill made p
    return (p * w).pow(2).sum() + (x * x).sum();
  };
  EXPECT_EQ(check_backward_outside(sliced, randn({4, 5}), randn({6})), 1) << "p * w only; p stays saved";
  auto bumped = [](const Tensor& x, const Tensor& w) {
    Tensor t = x.detach() * 2;
    t.add_(1);  // t is not x * 2 any more
    return (t * w).sum() + (x * x).sum();
  };
  EXPECT_EQ(check_backward_outside(bumped, randn({4, 5}), randn({5})), 0);
}

// Issue 18.17: conv2d(padding="same") with an even kernel pads the input on one side only; both
// operands get their gradients through a compiled forward whose backward runs outside.
TEST_F(CompileAutograd, ConvSamePaddingWithAnEvenKernelBackwardOutside) {
  auto fn = [](const Tensor& x, const Tensor& w) { return conv2d(x, w, Tensor(), {1, 1}, "same").pow(2).sum(); };
  check_backward_outside(fn, randn({2, 3, 5, 6}), randn({4, 3, 2, 4}));
}

// Issue 18.15: a graph runs writes its capture already counted (an in-place op on an argument,
// batch norm's running statistics): tensors saved after those writes keep their versions.
TEST_F(CompileAutograd, WritesInsideTheGraphAreCountedOnce) {
  using Ts = std::vector<Tensor>;
  auto scale_then_linear = [](const Ts& a) {
    Tensor s = a[0];
    s.mul_(-1.0);
    return Ts{linear(s, a[1])};
  };
  auto norm_then_clamp = [](const Ts& a) {
    Tensor y = batch_norm(a[0], a[1], a[2], Tensor(), Tensor(), /*training=*/true);
    return Ts{y, clamp(a[3], a[1], a[2])};  // reads the updated running statistics
  };
  for (const char* backend : {"eager", "aot_eager", "kiln"}) {
    SCOPED_TRACE(backend);
    auto f = kiln::compile(scale_then_linear, {.backend = std::string(backend)});
    Tensor x = randn({3, 4}), w = randn({2, 4}), r = randn({3, 2});
    Ts c{x.clone(), leaf_copy(w)}, e{x.clone(), leaf_copy(w)};
    Tensor yc = f(c)[0];
    Tensor ye = scale_then_linear(e)[0];
    EXPECT_EQ(c[0].version(), e[0].version()) << "one mul_, as in eager";
    (yc * r).sum().backward();  // threw "... is at version 2; expected version 1"
    (ye * r).sum().backward();
    EXPECT_TRUE(close(yc, ye));
    EXPECT_TRUE(close(c[0], e[0]));
    EXPECT_TRUE(close(c[1].grad(), e[1].grad()));

    auto g = kiln::compile(norm_then_clamp, {.backend = std::string(backend)});
    Tensor in = randn({2, 3, 4, 4}), v = randn({3}), ry = randn({2, 3, 4, 4}), rz = randn({3});
    Ts gc{leaf_copy(in), zeros({3}), ones({3}), leaf_copy(v)};
    Ts ge{leaf_copy(in), zeros({3}), ones({3}), leaf_copy(v)};
    Ts oc = g(gc), oe = norm_then_clamp(ge);
    EXPECT_EQ(gc[1].version(), ge[1].version());
    ((oc[0] * ry).sum() + (oc[1] * rz).sum()).backward();
    ((oe[0] * ry).sum() + (oe[1] * rz).sum()).backward();
    EXPECT_TRUE(close(gc[1], ge[1]));
    EXPECT_TRUE(close(gc[2], ge[2]));
    EXPECT_TRUE(close(gc[0].grad(), ge[0].grad(), Tolerance{1e-5, 1e-5}));
    EXPECT_TRUE(close(gc[3].grad(), ge[3].grad()));
  }
}

// Issue 18.16: a graph output the backend returns in another layout than captured is copied into
// its lazy value's storage: that creates the value, it does not modify it. Softmax saves its
// output, and with the channels-last pass the decomposed softmax comes back channels-last.
TEST_F(CompileAutograd, AnOutputCopiedIntoItsCapturedLayoutIsNotAnInPlaceWrite) {
  auto fn = [](const Tensor& x, const Tensor& w) { return softmax(conv2d(x, w), 1); };
  Tensor x = randn({2, 3, 6, 6}), w = randn({4, 3, 3, 3}), r = randn({2, 4, 4, 4});
  for (bool layout_optimization : {true, false}) {
    SCOPED_TRACE(layout_optimization ? "channels-last" : "planar");
    CompileOptions options;
    options.backend = std::string("kiln");
    options.options["layout_optimization"] = layout_optimization;
    auto f = kiln::compile(fn, options);
    Tensor xc = leaf_copy(x), wc = leaf_copy(w), xe = leaf_copy(x), we = leaf_copy(w);
    Tensor yc = f(xc, wc);
    EXPECT_EQ(yc.version(), 0u) << "the call wrote nothing into its result";
    EXPECT_TRUE(yc.is_contiguous()) << "eager's layout";
    (yc * r).sum().backward();  // threw "output 0 of SoftmaxBackward0 is at version 1"
    Tensor ye = fn(xe, we);
    (ye * r).sum().backward();
    EXPECT_TRUE(close(yc, ye));
    EXPECT_TRUE(close(xc.grad(), xe.grad(), Tolerance{1e-5, 1e-5}));
    EXPECT_TRUE(close(wc.grad(), we.grad(), Tolerance{1e-5, 1e-5}));
  }
  // The differential test's shrunk form: no convolution needed, a permuted input does it.
  auto permuted = [](const Tensor& x) { return softmax(x.permute({1, 3, 0, 2}), 1); };
  auto g = kiln::compile(permuted);
  Tensor a = leaf_copy(randn({2, 3, 4, 5})), b = leaf_copy(a.detach());
  Tensor rp = randn({3, 5, 2, 4});
  (g(a) * rp).sum().backward();
  (permuted(b) * rp).sum().backward();
  EXPECT_TRUE(close(a.grad(), b.grad()));
}

TEST_F(CompileAutograd, PartitionAppliesToAotEagerAndNotToEager) {
  auto fn = sin_cos_chain;
  Tensor x = randn({4, 5}), w = randn({5});
  EXPECT_EQ(check_backward_outside(fn, x, w, "aot_eager"), 2);
  EXPECT_EQ(check_backward_outside(fn, x, w, "eager"), 0) << "the eager backend runs the graph as captured";
}

// The partition follows the backend's "aot_autograd" tag, so a backend of the user's gets it too.
TEST_F(CompileAutograd, PartitionFollowsTheAotAutogradTag) {
  auto run_graph = [](compiler::Graph& g, const compiler::Arguments&) { return compiler::interpreter(g); };
  compiler::register_backend("partition_test_tagged", run_graph, {"aot_autograd"});
  compiler::register_backend("partition_test_untagged", run_graph);
  Tensor x = randn({4, 5}), w = randn({5});
  EXPECT_EQ(check_backward_outside(sin_cos_chain, x, w, "partition_test_tagged"), 2);
  EXPECT_EQ(check_backward_outside(sin_cos_chain, x, w, "partition_test_untagged"), 0);
}

// A backward that does not capture (force_eager) computes the recomputed values eagerly.
TEST_F(CompileAutograd, PartitionedValuesComputeEagerlyWhenTheBackwardRunsEagerly) {
  auto fn = sin_cos_chain;
  Tensor x = leaf_copy(randn({4, 5})), w = leaf_copy(randn({5}));
  Tensor xe = leaf_copy(x), we = leaf_copy(w);
  auto f = kiln::compile(fn);
  Delta d;
  Tensor lc = f(x, w);
  EXPECT_EQ(d.now().recomputed_values, 2);
  {
    compiler::StanceGuard eager(Stance::force_eager);
    lc.backward();
  }
  EXPECT_EQ(d.now().graph_runs, 1) << "the backward ran op by op";
  fn(xe, we).backward();
  EXPECT_TRUE(close(x.grad(), xe.grad()));
  EXPECT_TRUE(close(w.grad(), we.grad()));
}

TEST_F(CompileAutograd, PartitionedValuesSurviveRetainGraphAndDoubleBackward) {
  auto fn = sin_cos_chain;
  Tensor x = leaf_copy(randn({3, 4})), w = leaf_copy(randn({4}));
  Tensor xe = leaf_copy(x), we = leaf_copy(w);
  auto f = kiln::compile(fn);
  Tensor lc = f(x, w), le = fn(xe, we);
  lc.backward({}, /*retain_graph=*/true);
  lc.backward();
  le.backward({}, true);
  le.backward();
  EXPECT_TRUE(close(w.grad(), we.grad())) << "two backwards through one forward";
  // create_graph: the backward runs eagerly and records a graph of its own.
  Tensor lc2 = f(x, w), le2 = fn(xe, we);
  Tensor gc = autograd::grad({lc2}, {w}, {}, std::nullopt, /*create_graph=*/true)[0];
  Tensor ge = autograd::grad({le2}, {we}, {}, std::nullopt, true)[0];
  EXPECT_TRUE(close(gc, ge));
  Tensor hc = autograd::grad({gc.sum()}, {x})[0], he = autograd::grad({ge.sum()}, {xe})[0];
  EXPECT_TRUE(close(hc, he)) << "second derivatives through recomputed values";
}

// Two forwards before one backward, a graph break inside the forward, and a backward on another
// thread: each forward's recipes read that forward's values.
TEST_F(CompileAutograd, PartitionedValuesBelongToTheirOwnForward) {
  auto fn = sin_cos_chain;
  Tensor w = leaf_copy(randn({4})), we = leaf_copy(w);
  Tensor x1 = randn({3, 4}), x2 = randn({3, 4});
  auto f = kiln::compile(fn);
  Delta d;
  Tensor l1 = f(x1, w), l2 = f(x2, w);
  EXPECT_EQ(d.now().recomputed_values, 4);
  (l1 + l2).backward();
  (fn(x1, we) + fn(x2, we)).backward();
  EXPECT_TRUE(close(w.grad(), we.grad()));
}

TEST_F(CompileAutograd, PartitionAcrossAGraphBreakInTheForward) {
  auto fn = [](const Tensor& x, const Tensor& w) {
    Tensor s = (x * w).sin();
    compiler::graph_break();  // the first graph ends here: only sin's saved m = x * w is left unsaved
    return s.cos().sum();
  };
  Tensor x = leaf_copy(randn({3, 4})), w = leaf_copy(randn({4}));
  Tensor xe = leaf_copy(x), we = leaf_copy(w);
  auto f = kiln::compile(fn);
  Delta d;
  Tensor lc = f(x, w);
  EXPECT_EQ(d.now().graph_breaks, 1);
  EXPECT_EQ(d.now().recomputed_values, 1) << "m in the first graph; s is held at the break, so it is saved";
  lc.backward();
  fn(xe, we).backward();
  EXPECT_TRUE(close(x.grad(), xe.grad()));
  EXPECT_TRUE(close(w.grad(), we.grad()));
}

TEST_F(CompileAutograd, PartitionedBackwardOnAnotherThread) {
  auto fn = sin_cos_chain;
  Tensor x = randn({3, 4}), w = leaf_copy(randn({4})), we = leaf_copy(w);
  auto f = kiln::compile(fn);
  Delta d;
  Tensor lc = f(x, w);
  EXPECT_EQ(d.now().recomputed_values, 2);
  std::thread([&] { lc.backward(); }).join();
  fn(x, we).backward();
  EXPECT_TRUE(close(w.grad(), we.grad()));
}

// A recipe keeps the attrs of its own call: a run-time scalar that changes between two forwards.
TEST_F(CompileAutograd, PartitionedValuesKeepTheirCallsScalars) {
  auto fn = [](const Tensor& x, const Tensor& w, double s) { return (x * w * s).sin().sum(); };
  Tensor x = randn({3, 4}), w = leaf_copy(randn({4})), we = leaf_copy(w);
  auto f = kiln::compile(fn);
  Delta d;
  Tensor l1 = f(x, w, 0.5), l2 = f(x, w, -3.0);
  EXPECT_EQ(d.now().graph_compiles, 1) << "the scalar is a run-time input";
  EXPECT_EQ(d.now().recomputed_values, 4) << "per forward: x * w (the second mul saves it) and sin's input";
  (l1 + l2).backward();
  (fn(x, we, 0.5) + fn(x, we, -3.0)).backward();
  EXPECT_TRUE(close(w.grad(), we.grad()));
}

// A recomputed value's inputs must be what the forward read: an in-place change before the
// backward is an error, as it is in eager (where the mul saved x).
TEST_F(CompileAutograd, PartitionRefusesInputsModifiedBeforeTheBackward) {
  auto fn = sin_cos_chain;
  Tensor x = randn({3, 4}), w = leaf_copy(randn({4}));
  auto f = kiln::compile(fn);
  Tensor lc = f(x, w);
  x.add_(1);
  EXPECT_THROW(lc.backward(), kiln::Error);
  Tensor xe = randn({3, 4});
  Tensor le = fn(xe, leaf_copy(w));
  xe.add_(1);
  EXPECT_THROW(le.backward(), kiln::Error) << "eager refuses it too";
}

// ================================ autograd::grad inside compiled code ================================

TEST_F(CompileAutograd, GradInsideCompiledCode) {
  auto body = [](const Tensor& x) {
    Tensor y = (x * x * x).sum();
    return autograd::grad({y}, {x})[0];
  };
  auto f = kiln::compile(body);
  Tensor x = randn({6}).requires_grad_();
  Delta d;
  Tensor g = f(x);
  EXPECT_TRUE(close(g, body(x)));
  EXPECT_TRUE(close(g, (x * x * 3).detach()));
  EXPECT_FALSE(x.grad().defined()) << "grad() does not touch .grad()";
  EXPECT_GE(d.now().graph_runs, 1);
  EXPECT_EQ(d.now().eager_frames, 0);
}

TEST_F(CompileAutograd, SecondOrderGradInsideCompiledCode) {
  auto body = [](const Tensor& x) {
    Tensor y = (x * x * x).sum();
    Tensor g = autograd::grad({y}, {x}, {}, std::nullopt, /*create_graph=*/true)[0];
    return autograd::grad({g.sum()}, {x})[0];
  };
  auto f = kiln::compile(body);
  Tensor x = randn({6}).requires_grad_();
  Delta d;
  Tensor gg = f(x);
  EXPECT_TRUE(close(gg, body(x)));
  EXPECT_TRUE(close(gg, (x * 6).detach()));
  EXPECT_GE(d.now().graph_runs, 1);
}

}  // namespace
