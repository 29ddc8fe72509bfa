// Guided capture (docs/compiler.md, "Guided capture"): a call whose body issues the ops its frame
// entry ran before follows that graph instead of building one, and runs the compiled graph its
// sizes name. Every way a call can leave the graph it follows (another op, other attrs, other
// aliasing, other live results, in-place calls, autograd, graph breaks, new sizes) must give what
// eager gives, and the tests count the guided calls, so a guide that is never followed fails them.
#include <gtest/gtest.h>

#include <atomic>
#include <thread>
#include <vector>

#include "compile_helpers.h"
#include "kernel_cache_dir.h"
#include "kiln/compiler.h"
#include "kiln/kiln.h"
#include "kiln/models.h"

namespace {

using namespace kiln;
using namespace kiln::testing;

KILN_TEST_KERNEL_CACHE_DIR("kiln_test_compile_guided");

class Guided : public CompilerTest {};

CompileOptions kiln_options(std::optional<bool> dynamic = std::nullopt) {
  CompileOptions o;
  o.backend = std::string("kiln");
  o.dynamic = dynamic;
  return o;
}

Tolerance reduction_tolerance() { return Tolerance{1e-5, 1e-5}; }

TEST_F(Guided, RepeatedCallsFollowTheGraphTheyRanBefore) {
  auto body = [](const Tensor& x) { return relu(x) * 2 + x.sum(1, true); };
  auto f = compile(body, kiln_options());
  Delta d;
  for (int i = 0; i < 4; ++i) {
    Tensor x = randn({3, 5});
    EXPECT_TRUE(close(f(x), body(x), reduction_tolerance())) << "call " << i;
  }
  EXPECT_EQ(d.now().graph_compiles, 1);
  EXPECT_EQ(d.now().graph_runs, 4);
  EXPECT_EQ(d.now().guided_captures, 3);
  EXPECT_EQ(d.now().graph_cache_hits, 3);
  EXPECT_GE(d.now().kernel_runs, 4);
}

// A dynamic graph: each call's sizes pick the instance; a size met before runs its instance
// without building a graph, a new size leaves the guide and is lowered once.
TEST_F(Guided, SizesOfADynamicGraphPickTheirInstance) {
  auto body = [](const Tensor& x) { return softmax(x * 0.5, 1) + x.mean(0, true); };
  auto f = compile(body, kiln_options());
  Delta d;
  for (int pass = 0; pass < 2; ++pass) {
    for (int64_t b = 2; b <= 7; ++b) {
      Tensor x = randn({b, 6});
      EXPECT_TRUE(close(f(x), body(x), reduction_tolerance())) << "batch " << b << " pass " << pass;
    }
  }
  EXPECT_EQ(d.now().graph_compiles, 2);
  EXPECT_EQ(d.now().size_specializations, 4);  // batch 4..7 (2 static, 3 the dynamic compile)
  EXPECT_EQ(d.now().guided_captures, 6);       // the second pass
  EXPECT_EQ(d.now().eager_frames, 0);
}

// The body changes its ops (a C++ flag it reads): at the first op, in the middle, with an op more
// at the end, and stopping early. Each leaves the guide where it differs and compiles its graph.
TEST_F(Guided, ADifferentOpSequenceLeavesTheGuideWhereItDiffers) {
  int mode = 0;
  auto body = [&mode](const Tensor& x) {
    Tensor y = mode == 1 ? cos(x) : sin(x);  // mode 1: differs at the first op
    y = y * 2;
    if (mode == 2) y = sigmoid(y);           // mode 2: differs in the middle
    if (mode == 3) return exp(y) + 1;        // mode 3: stops early
    Tensor z = tanh(y) + x;
    if (mode == 4) z = z.abs();              // mode 4: one op more at the end
    return z;
  };
  auto f = compile(body, kiln_options(false));
  for (int m : {0, 0, 1, 0, 2, 0, 3, 0, 4, 0, 4, 3, 2, 1}) {
    mode = m;
    Tensor x = randn({4, 3});
    Tensor expected = body(x);
    EXPECT_TRUE(close(f(x), expected)) << "mode " << m;
  }
  EXPECT_EQ(compiler::counters().graph_compiles, 5);
  EXPECT_GE(compiler::counters().guided_captures, 1);  // the second call
}

// Integer arguments flow into attrs (a narrow's length): the attrs are part of the numbers that
// pick an instance, so each length gets its own, and a repeated length finds its own.
TEST_F(Guided, IntegerAttrsPickTheirInstance) {
  auto body = [](const Tensor& x, int64_t n) { return x.narrow(1, 0, n).exp().sum(1); };
  auto f = compile(body, kiln_options());
  Tensor x = randn({3, 9});
  Delta d;
  for (int64_t n : {3, 5, 7, 3, 5, 7, 2, 9}) EXPECT_TRUE(close(f(x, n), body(x, n), reduction_tolerance())) << n;
  EXPECT_EQ(d.now().graph_compiles, 2);
  EXPECT_EQ(d.now().size_specializations, 3);  // 7, 2 and 9 (3 compiled static, 5 dynamic)
  EXPECT_EQ(d.now().guided_captures, 3);       // 3 (the static graph is one of its sizes), 5, 7
}

// A call that keeps an intermediate alive (stored outside the body) has another output list than
// the graph it follows: it leaves the guide at the end and compiles the graph with that output.
TEST_F(Guided, ADifferentSetOfLiveResultsIsAnotherGraph) {
  Tensor kept;
  bool keep = false;
  auto body = [&](const Tensor& x) {
    Tensor h = sigmoid(x) * 4;
    if (keep) kept = h;
    return h.sum();
  };
  auto f = compile(body, kiln_options(false));
  Tensor x = randn({5, 5});
  for (bool k : {false, false, true, false, true}) {
    keep = k;
    kept = Tensor();
    EXPECT_TRUE(close(f(x), (sigmoid(x) * 4).sum(), reduction_tolerance())) << k;
    if (k) {
      ASSERT_TRUE(kept.defined());
      EXPECT_TRUE(close(kept, sigmoid(x) * 4));
    }
  }
  EXPECT_EQ(compiler::counters().graph_compiles, 2);
  EXPECT_GE(compiler::counters().guided_captures, 1);  // the second call
}

// In-place calls are captured the ordinary way: a guided segment that meets one builds its graph
// so far and goes on; the result and the argument's update are eager's.
TEST_F(Guided, InPlaceCallsLeaveTheGuideAndKeepTheirEffects) {
  auto body = [](Tensor x) {
    Tensor y = x * 2;
    x.add_(1);
    return y + x;
  };
  auto f = compile(body, kiln_options());
  for (int i = 0; i < 3; ++i) {
    Tensor a = randn({4, 4});
    Tensor ac = a.clone(), ae = a.clone();
    EXPECT_TRUE(close(f(ac), body(ae))) << i;
    EXPECT_TRUE(close(ac, ae)) << i;
  }
  EXPECT_EQ(compiler::counters().graph_compiles, 1);
}

// Ops that record autograd history are captured the ordinary way (the saved-value partition reads
// the graph): gradients equal eager's.
TEST_F(Guided, AutogradRecordingCapturesTheOrdinaryWay) {
  auto body = [](const Tensor& w, const Tensor& x) { return (tanh(x.matmul(w)) * 3).sum(); };
  auto f = compile(body, kiln_options());
  for (int i = 0; i < 3; ++i) {
    Tensor w = randn({4, 3}).requires_grad_(true);
    Tensor we = w.detach().clone().requires_grad_(true);
    Tensor x = randn({5, 4});
    Tensor loss = f(w, x);
    Tensor expected = body(we, x);
    EXPECT_TRUE(close(loss, expected, reduction_tolerance())) << i;
    loss.backward();
    expected.backward();
    EXPECT_TRUE(close(w.grad(), we.grad(), reduction_tolerance())) << i;
  }
}

// Run-time scalars (a learning rate, a scale) change on every call without leaving the guide.
TEST_F(Guided, ScalarArgumentsTakeEachCallsValue) {
  auto body = [](const Tensor& x, double s) { return x * s + s; };
  auto f = compile(body, kiln_options());
  Tensor x = randn({6});
  Delta d;
  for (double s : {0.5, 2.0, -3.0, 7.25}) EXPECT_TRUE(close(f(x, s), body(x, s))) << s;
  EXPECT_EQ(d.now().graph_compiles, 1);
  EXPECT_EQ(d.now().guided_captures, 3);
}

// The same tensor passed twice is one placeholder: another alias group than two tensors, so the
// call leaves the guide at the second argument.
TEST_F(Guided, ArgumentsThatAliasAreAnotherGraph) {
  auto body = [](const Tensor& x, const Tensor& y) { return x * 2 + y; };
  auto f = compile(body, kiln_options());
  Tensor a = randn({3, 3}), b = randn({3, 3});
  EXPECT_TRUE(close(f(a, b), body(a, b)));
  EXPECT_TRUE(close(f(a, a), body(a, a)));
  EXPECT_TRUE(close(f(a, b), body(a, b)));
  EXPECT_TRUE(close(f(a, a), body(a, a)));
  EXPECT_TRUE(close(f(b, a), body(b, a)));
}

// Each segment between graph breaks follows the graph its position ran last.
TEST_F(Guided, EachSegmentBetweenGraphBreaksHasItsGuide) {
  auto body = [](const Tensor& x) {
    Tensor y = sin(x) * 2;
    compiler::graph_break();
    return cos(y) + x;
  };
  auto f = compile(body, kiln_options());
  Delta d;
  for (int i = 0; i < 3; ++i) {
    Tensor x = randn({4});
    EXPECT_TRUE(close(f(x), body(x))) << i;
  }
  EXPECT_EQ(d.now().graph_compiles, 2);
  EXPECT_EQ(d.now().graph_runs, 6);
  EXPECT_EQ(d.now().guided_captures, 4);
}

// GPT's forward at growing lengths, then again: the second round is guided at every length.
TEST_F(Guided, GptGenerationLengthsAreGuidedOnTheSecondRound) {
  manual_seed(0);
  auto model = models::gpt({64, 32, 2, 2, 24, 0.0, true});
  model->eval();
  NoGradGuard no_grad;
  auto f = compile(model, kiln_options());
  Delta d;
  for (int round = 0; round < 2; ++round) {
    for (int64_t len = 3; len <= 10; ++len) {
      Tensor idx = randint(64, {1, len});
      EXPECT_TRUE(close(f(idx), model->forward(idx), reduction_tolerance())) << "length " << len;
    }
  }
  EXPECT_EQ(d.now().graph_compiles, 2);
  EXPECT_EQ(d.now().guided_captures, 8);
  EXPECT_EQ(d.now().eager_frames, 0);
}

// Threads calling one compiled function at different sizes: each follows its entry's guide or
// leaves it, and every result is its own call's.
TEST_F(Guided, ThreadsAtDifferentSizes) {
  auto body = [](const Tensor& x) { return (x * x).sum(1) + x.select(1, 0); };
  auto f = compile(body, kiln_options());
  f(randn({2, 5}));
  f(randn({3, 5}));  // dynamic from here
  std::atomic<int> wrong{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 20; ++i) {
        Tensor x = randn({2 + (t + i) % 5, 5});
        if (!close(f(x), body(x), reduction_tolerance())) ++wrong;
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(wrong.load(), 0);
  EXPECT_GT(compiler::counters().guided_captures, 0);
}

}  // namespace
