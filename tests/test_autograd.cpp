// The autograd engine: recording, accumulation, retain_graph, hooks, retain_grad, in-place
// rules, version checks, anomaly mode, grad mode guards, autograd::grad and gradcheck.
// (Per-op derivatives are gradchecked in tests/test_gradcheck_*.cpp.)
#include <thread>

#include "reference.h"

using namespace kiln;
using kiln::testing::matches;

TEST(Autograd, ViewChainsPropagateGradientsToTheBase) {
  Tensor x = tensor<double>({1, 2, 3, 4, 5, 6}).requires_grad_();
  Tensor y = x.view({2, 3}).t().slice(0, 1, 3);  // (2, 2): rows 1..2 of the transpose
  EXPECT_TRUE(y.requires_grad());
  EXPECT_FALSE(y.is_leaf());
  EXPECT_EQ(y.grad_fn_name(), "SliceBackward0");
  y.backward(tensor<double>({1, 2, 3, 4}).view({2, 2}));
  // y[i][j] = x.view(2,3)[j][i+1]
  EXPECT_TRUE(matches(x.grad(), {6}, {0, 1, 3, 0, 2, 4}));
}

TEST(Autograd, GradientsAccumulateAcrossBackwardCalls) {
  Tensor x = tensor<double>({1, 2}).requires_grad_();
  x.unsqueeze(0).backward(tensor<double>({1, 1}).view({1, 2}));
  x.unsqueeze(0).backward(tensor<double>({2, 3}).view({1, 2}));
  EXPECT_TRUE(matches(x.grad(), {2}, {3, 4}));
  x.set_grad(Tensor());
  EXPECT_FALSE(x.grad().defined());
}

TEST(Autograd, ExpandSumsGradientBackToTheInputShape) {
  Tensor x = tensor<double>({1, 2}).view({2, 1}).requires_grad_();
  Tensor y = x.expand({2, 3});
  y.backward(ones({2, 3}, kFloat64));
  EXPECT_TRUE(matches(x.grad(), {2, 1}, {3, 3}));
}

TEST(Autograd, SelectAndCopyBackward) {
  Tensor x = tensor<float>({1, 2, 3}).requires_grad_();
  Tensor y = x.select(0, 1).to(kFloat64);
  y.backward();
  EXPECT_EQ(x.grad().dtype(), kFloat32);
  EXPECT_TRUE(matches(x.grad(), {3}, {0, 1, 0}));
}

TEST(Autograd, NoGradGuardStopsRecording) {
  Tensor x = tensor<double>({1, 2}).requires_grad_();
  {
    NoGradGuard g;
    EXPECT_FALSE(is_grad_enabled());
    Tensor y = x.view({2, 1});
    EXPECT_FALSE(y.requires_grad());
    {
      EnableGradGuard e;
      EXPECT_TRUE(x.view({2, 1}).requires_grad());
    }
  }
  EXPECT_TRUE(is_grad_enabled());
  {
    InferenceMode im;
    EXPECT_TRUE(is_inference_mode_enabled());
    EXPECT_FALSE(x.view({2, 1}).requires_grad());
  }
}

TEST(Autograd, DetachCutsHistory) {
  Tensor x = tensor<double>({1, 2}).requires_grad_();
  Tensor d = x.view({2}).detach();
  EXPECT_FALSE(d.requires_grad());
  EXPECT_TRUE(d.is_alias_of(x));
}

TEST(Autograd, HooksSeeAndReplaceGradients) {
  Tensor x = tensor<double>({1, 2}).requires_grad_();
  Tensor seen;
  x.register_hook([&](const Tensor& g) {
    seen = g.clone();
    return Tensor();
  });
  Tensor y = x.view({2, 1});
  y.register_hook([](const Tensor& g) { return g.to(kFloat64).contiguous().view({2, 1}).expand({2, 1}).clone().fill_(7.0); });
  y.backward(ones({2, 1}, kFloat64));
  EXPECT_TRUE(matches(seen, {2}, {7, 7}));
  EXPECT_TRUE(matches(x.grad(), {2}, {7, 7}));
}

TEST(Autograd, RetainGradKeepsNonLeafGradients) {
  Tensor x = tensor<double>({1, 2}).requires_grad_();
  Tensor y = x.view({1, 2});
  y.retain_grad();
  Tensor z = y.t();
  z.backward(tensor<double>({5, 6}).view({2, 1}));
  ASSERT_TRUE(y.grad().defined());
  EXPECT_TRUE(matches(y.grad(), {1, 2}, {5, 6}));
  EXPECT_FALSE(z.grad().defined());
}

TEST(Autograd, InPlaceOnALeafThatRequiresGradThrows) {
  Tensor x = tensor<double>({1, 2}).requires_grad_();
  EXPECT_THROW(x.fill_(1.0), Error);
  NoGradGuard g;
  EXPECT_NO_THROW(x.fill_(1.0));  // optimizers update parameters like this
}

// Issue 18.22: PyTorch's fill_/copy_ derivatives give the overwritten value zeros_like(grad): the
// old history is still reached, so x gets a zero gradient (defined), as in torch.
TEST(Autograd, InPlaceReplacesTheTargetsHistoryWithAZeroGradient) {
  Tensor x = tensor<double>({1, 2}).requires_grad_();
  Tensor y = x.view({2}).clone();
  y.fill_(3.0);  // y's value no longer depends on x
  EXPECT_EQ(y.grad_fn_name(), "FillBackward0");
  y.backward(ones({2}, kFloat64));
  ASSERT_TRUE(x.grad().defined());
  EXPECT_TRUE(matches(x.grad(), {2}, {0, 0}));
}

TEST(Autograd, CopyIntoATensorWithHistoryGivesTheOldHistoryZeros) {
  Tensor x = tensor<double>({1, 2, 3}).requires_grad_();
  Tensor w = tensor<double>({4, 5, 6}).requires_grad_();
  Tensor z = (x * 2).clone();
  z.copy_(w);
  z.sum().backward();
  ASSERT_TRUE(x.grad().defined());
  EXPECT_TRUE(matches(x.grad(), {3}, {0, 0, 0}));
  EXPECT_TRUE(matches(w.grad(), {3}, {1, 1, 1}));
  // As in PyTorch, an old history that saved the overwritten tensor now notices the write.
  Tensor a = tensor<double>({1, 2}).requires_grad_();
  Tensor e = a.exp();  // exp saves its result
  e.copy_(tensor<double>({0, 0}));
  EXPECT_THROW(e.sum().backward(), Error);
}

TEST(Autograd, BackwardTwiceWithoutRetainGraphThrowsOnlyWhenSavedValuesAreNeeded) {
  Tensor x = tensor<double>({1, 2}).requires_grad_();
  Tensor y = x.view({2, 1});
  y.backward(ones({2, 1}, kFloat64));
  EXPECT_NO_THROW(y.backward(ones({2, 1}, kFloat64)));  // view saves nothing
  EXPECT_TRUE(matches(x.grad(), {2}, {2, 2}));
}

TEST(Autograd, ImplicitGradientOnlyForOneElementOutputs) {
  Tensor x = tensor<double>({1, 2}).requires_grad_();
  EXPECT_THROW(x.view({2, 1}).backward(), Error);
  EXPECT_THROW(x.view({2, 1}).backward(ones({2}, kFloat64)), ShapeError);
  EXPECT_THROW(tensor<double>({1}).backward(), Error);  // does not require grad
}

TEST(Autograd, GradReturnsWithoutTouchingDotGrad) {
  Tensor x = tensor<double>({1, 2, 3}).requires_grad_();
  Tensor w = tensor<double>({4}).requires_grad_();
  Tensor y = x.slice(0, 1);
  auto g = autograd::grad({y}, {x}, {ones({2}, kFloat64)});
  EXPECT_TRUE(matches(g[0], {3}, {0, 1, 1}));
  EXPECT_FALSE(x.grad().defined());
  EXPECT_THROW(autograd::grad({y}, {w}, {ones({2}, kFloat64)}, true), Error);
  auto unused = autograd::grad({y}, {w}, {ones({2}, kFloat64)}, true, false, /*allow_unused=*/true);
  EXPECT_FALSE(unused[0].defined());
}

TEST(Autograd, RequiresGradOnlyForFloatingTensors) {
  EXPECT_THROW(arange(3).requires_grad_(), DTypeError);
  EXPECT_NO_THROW(arange(3).requires_grad_(false));
}

TEST(Autograd, GradcheckHandlesOutputsThatViewTheInputs) {
  Tensor x = randn({4, 3}, kFloat64).requires_grad_();
  std::string report;
  EXPECT_TRUE(autograd::gradcheck([](const TensorList& in) { return TensorList{in[0].t().narrow(0, 1, 2)}; },
                                  {x}, 1e-6, 1e-5, 1e-3, &report))
      << report;
}

TEST(Autograd, GradcheckDetectsAWrongDerivative) {
  // A function whose recorded graph (x * 2) disagrees with its values (x * 3 off the graph).
  Tensor x = randn({3}, kFloat64).requires_grad_();
  auto fn = [](const TensorList& in) {
    Tensor off_graph = in[0].detach() * 1.0;
    return TensorList{in[0] * 2.0 + off_graph};
  };
  EXPECT_FALSE(autograd::gradcheck(fn, {x}));
}

TEST(Autograd, AnomalyModeNamesTheForwardOpWhoseDerivativeMadeNaN) {
  Tensor x = tensor<double>({4.0, 0.0}).requires_grad_();
  Tensor y = sqrt(x) * 0.0;  // forward is finite; d sqrt / dx at 0 is inf, times 0 is NaN
  {
    autograd::DetectAnomalyGuard anomaly;
    try {
      y.sum().backward();
      FAIL() << "expected an anomaly error";
    } catch (const Error& e) {
      std::string msg = e.what();
      EXPECT_NE(msg.find("SqrtBackward0"), std::string::npos) << msg;
      EXPECT_NE(msg.find("'sqrt'"), std::string::npos) << msg;
    }
  }
  EXPECT_FALSE(autograd::is_anomaly_enabled());
  x.set_grad(Tensor());
  y = sqrt(x) * 0.0;
  EXPECT_NO_THROW(y.sum().backward());  // without anomaly mode the NaN just propagates
}

// Threads that record forwards on one shared leaf create its gradient accumulator at the same
// moment whenever every graph holding the last one has gone. That creation must be serialized: a
// torn weak_ptr crashed the engine about once in 30 six-thread training runs (session 32).
TEST(Autograd, ThreadsRecordingOnOneSharedLeafAccumulateEveryGradient) {
  Tensor w = tensor<double>({1, 2, 3}).requires_grad_();
  constexpr int kThreads = 6, kSteps = 300;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t)
    threads.emplace_back([&] {
      for (int s = 0; s < kSteps; ++s) (w * 2.0).sum().backward();
    });
  for (auto& thread : threads) thread.join();
  EXPECT_TRUE(matches(w.grad(), {3}, {2.0 * kThreads * kSteps, 2.0 * kThreads * kSteps, 2.0 * kThreads * kSteps}));
}
