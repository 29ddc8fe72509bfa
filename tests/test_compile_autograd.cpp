// kiln::compile and autograd (DESIGN §2.3): a compiled forward whose backward runs outside (the
// backward is captured as a graph too), a whole compiled training step, autograd::grad inside
// compiled code. Gradients and trained parameters are compared with eager ones.
#include <gtest/gtest.h>

#include <memory>
#include <string>
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
