// kiln::compile from many threads (DESIGN §2.9): caches are shared, a signature compiles once
// while other callers wait, capture contexts and StanceGuards are per thread.
#include <gtest/gtest.h>

#include <atomic>
#include <condition_variable>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "compile_helpers.h"
#include "kiln/compiler.h"
#include "kiln/kiln.h"

namespace {

using namespace kiln;

using namespace kiln::testing;  // compile_helpers.h

class CompileThreads : public CompilerTest {};

Tensor body(const Tensor& x, const Tensor& y) {
  Tensor h = sin(x) * y + x.matmul(y.t()).sum({1}, true);
  return h.softmax(1) + h.mean();
}

constexpr int kThreads = 8;
constexpr int kCalls = 50;
const std::vector<std::vector<int64_t>> kShapes = {{2, 3}, {4, 5}, {7, 2}};
const std::vector<DType> kDtypes = {kFloat32, kFloat64};

// The signature of call `i` of thread `t`: 3 shapes x 2 dtypes.
std::pair<std::vector<int64_t>, DType> signature(int t, int i) {
  int k = (t + i) % 6;
  return {kShapes[k % 3], kDtypes[k / 3]};
}

// Thread-safe failure collection (each thread checks its own results).
struct Failures {
  std::mutex mutex;
  std::vector<std::string> list;
  void add(std::string s) {
    std::lock_guard lock(mutex);
    if (list.size() < 20) list.push_back(std::move(s));
  }
};

TEST_F(CompileThreads, ManyThreadsMixedSignaturesCompileEachOnce) {
  // dynamic = false: a compile per shape, whichever thread meets it first (automatic dynamic would
  // make the count depend on the order the threads meet the shapes in).
  auto f = kiln::compile(body, {.dynamic = false});
  Failures failures;
  std::atomic<int> captured{0}, total{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kCalls; ++i) {
        auto [shape, dtype] = signature(t, i);
        Tensor x = randn(shape, dtype), y = randn(shape, dtype);
        try {
          Tensor out = f(x, y);
          Tensor expected = body(x, y);
          if (!close(out, expected))
            failures.add("thread " + std::to_string(t) + " call " + std::to_string(i) + ": " + out.str() +
                         " != " + expected.str());
          ++total;
        } catch (const std::exception& e) {
          failures.add("thread " + std::to_string(t) + " call " + std::to_string(i) + " threw: " + e.what());
        }
      }
      if (compiler::is_compiling()) ++captured;  // never true outside a compiled call
    });
  }
  for (auto& th : threads) th.join();
  for (const auto& s : failures.list) ADD_FAILURE() << s;
  EXPECT_EQ(total.load(), kThreads * kCalls);
  EXPECT_EQ(captured.load(), 0);
  compiler::Counters c = compiler::counters();
  EXPECT_EQ(c.graph_compiles, 6) << "one compile per distinct signature (3 shapes x 2 dtypes)";
  EXPECT_EQ(c.frame_compiles, 6);
  EXPECT_EQ(c.graph_runs, kThreads * kCalls);
  EXPECT_EQ(c.graph_cache_hits, kThreads * kCalls - 6);
  EXPECT_EQ(c.eager_frames, 0);
}

TEST_F(CompileThreads, ConcurrentFirstCallsOfOneSignatureCompileOnce) {
  // All threads start together on the same new signature: one compiles, the others wait for it.
  auto f = kiln::compile(body);
  std::atomic<int> ready{0};
  std::atomic<int> bad{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&] {
      Tensor x = randn({16, 16}), y = randn({16, 16});
      ++ready;
      while (ready.load() < kThreads) std::this_thread::yield();
      for (int i = 0; i < 5; ++i)
        if (!close(f(x, y), body(x, y))) ++bad;
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(bad.load(), 0);
  compiler::Counters c = compiler::counters();
  EXPECT_EQ(c.graph_compiles, 1);
  EXPECT_EQ(c.frame_compiles, 1);
  EXPECT_EQ(c.graph_runs, kThreads * 5);
}

TEST_F(CompileThreads, OneThreadUnderForceEagerWhileOthersCompile) {
  auto f = kiln::compile(
      [](const Tensor& x, const Tensor& y) {
        Tensor out = body(x, y);
        // Also return what the body saw: compiling or eager on this thread.
        return std::make_pair(out, compiler::is_compiling());
      },
      {.dynamic = false});
  Failures failures;
  std::vector<std::thread> threads;
  const int eager_thread = 3;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::optional<compiler::StanceGuard> guard;
      if (t == eager_thread) guard.emplace(Stance::force_eager);
      for (int i = 0; i < kCalls; ++i) {
        auto [shape, dtype] = signature(t, i);
        Tensor x = randn(shape, dtype), y = randn(shape, dtype);
        try {
          auto [out, compiling] = f(x, y);
          if (!close(out, body(x, y))) failures.add("thread " + std::to_string(t) + ": wrong result");
          if (compiling != (t != eager_thread))
            failures.add("thread " + std::to_string(t) + " call " + std::to_string(i) +
                         ": is_compiling() = " + std::to_string(compiling));
        } catch (const std::exception& e) {
          failures.add("thread " + std::to_string(t) + " threw: " + e.what());
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  for (const auto& s : failures.list) ADD_FAILURE() << s;
  compiler::Counters c = compiler::counters();
  EXPECT_EQ(c.graph_compiles, 6);
  EXPECT_EQ(c.graph_runs, (kThreads - 1) * kCalls) << "the force_eager thread runs no graph";
  EXPECT_EQ(c.eager_frames, kCalls);
  EXPECT_EQ(compiler::current_stance(), Stance::default_);
}

TEST_F(CompileThreads, PureReplaysFromManyThreads) {
  std::atomic<int> body_runs{0};
  auto f = kiln::compile(
      [&](const Tensor& x, const Tensor& y) {
        ++body_runs;
        return sin(x) * y + cos(y);
      },
      {.pure = true});
  std::atomic<int> bad{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < kCalls; ++i) {
        Tensor x = randn({4, 4}), y = randn({4, 4});
        if (!close(f(x, y), sin(x) * y + cos(y))) ++bad;
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(bad.load(), 0);
  EXPECT_LT(body_runs.load(), kThreads * kCalls) << "most calls replay";
  EXPECT_EQ(compiler::counters().graph_compiles, 1);
  EXPECT_EQ(compiler::counters().replays + body_runs.load(), kThreads * kCalls);
}

TEST_F(CompileThreads, ALazyTensorUsedByAnotherThreadThrowsInsteadOfCrashing) {
  Tensor shared;
  std::mutex m;
  std::condition_variable cv;
  int phase = 0;  // 1: A published its lazy tensor; 2: B is done with it
  std::string eager_error, compiled_error;
  auto g = kiln::compile([](const Tensor& t) { return t * 3; });

  auto f = kiln::compile([&](const Tensor& x) {
    Tensor y = x * 2;  // lazy until this call flushes
    {
      std::unique_lock lock(m);
      shared = y;
      phase = 1;
      cv.notify_all();
      cv.wait(lock, [&] { return phase == 2; });
    }
    return y + 1;
  });
  std::thread b([&] {
    Tensor t;
    {
      std::unique_lock lock(m);
      cv.wait(lock, [&] { return phase == 1; });
      t = shared;
    }
    try {
      Tensor r = t + 1;  // eager use of a value another thread is still capturing
      (void)r.sum().item<double>();
    } catch (const Error& e) {
      eager_error = e.what();
    }
    try {
      Tensor r = g(t);
      (void)r.sum().item<double>();
    } catch (const Error& e) {
      compiled_error = e.what();
    }
    std::lock_guard lock(m);
    phase = 2;
    cv.notify_all();
  });
  Tensor x = randn({4});
  Tensor out = f(x);
  b.join();
  EXPECT_TRUE(close(out, x * 2 + 1));
  EXPECT_NE(eager_error.find("another thread"), std::string::npos) << "got: '" << eager_error << "'";
  EXPECT_NE(compiled_error.find("another thread"), std::string::npos) << "got: '" << compiled_error << "'";
  // After the producing call returned the tensor is real and usable everywhere.
  Tensor later;
  std::thread c([&] { later = g(shared); });
  c.join();
  EXPECT_TRUE(close(later, x * 6));
}

// Issue 18.11: threads that backpropagate through one compiled function into shared parameters
// (a model trained from several threads) accumulate into the same .grad. A captured backward
// accumulates the leaves' gradients after its graph ran, so a .grad never holds another thread's
// pending value. Deterministic: thread A pauses between its two leaves' gradients (in a hook)
// while B runs a whole backward.
TEST_F(CompileThreads, ConcurrentBackwardsAccumulateIntoSharedParameters) {
  auto loss = [](const Tensor& x, const Tensor& w, const Tensor& b) { return (x.matmul(w) + b).tanh().pow(2).sum(); };
  auto f = kiln::compile(loss);
  Tensor w = randn({4, 3}).requires_grad_(), b = randn({3}).requires_grad_();
  Tensor we = w.detach().clone().requires_grad_(), be = b.detach().clone().requires_grad_();
  Tensor xa = randn({5, 4}), xb = randn({5, 4});
  std::mutex m;
  std::condition_variable cv;
  int phase = 0;  // 1: A's backward is between its two leaves; 2: B's backward returned
  std::thread::id a_id;
  int a_hooks = 0;
  auto hook = [&](const Tensor&) {
    std::unique_lock lock(m);
    if (std::this_thread::get_id() == a_id && ++a_hooks == 2) {
      phase = 1;
      cv.notify_all();
      cv.wait(lock, [&] { return phase == 2; });
    }
    return Tensor();
  };
  w.register_hook(hook);
  b.register_hook(hook);
  std::string error_a, error_b;
  std::thread a([&] {
    {
      std::lock_guard lock(m);
      a_id = std::this_thread::get_id();
    }
    try {
      f(xa, w, b).backward();
    } catch (const std::exception& e) {
      error_a = e.what();
    }
    std::lock_guard lock(m);
    if (phase == 0) phase = 1;  // A never paused (it failed early): let B run rather than hang
    cv.notify_all();
  });
  std::thread bt([&] {
    {
      std::unique_lock lock(m);
      cv.wait(lock, [&] { return phase >= 1; });
    }
    try {
      f(xb, w, b).backward();
    } catch (const std::exception& e) {
      error_b = e.what();
    }
    std::lock_guard lock(m);
    phase = 2;
    cv.notify_all();
  });
  a.join();
  bt.join();
  EXPECT_EQ(error_a, "");
  EXPECT_EQ(error_b, "") << "B's backward met A's pending gradient in a shared .grad";
  loss(xa, we, be).backward();
  loss(xb, we, be).backward();
  EXPECT_TRUE(close(w.grad(), we.grad()));
  EXPECT_TRUE(close(b.grad(), be.grad()));
}

// The issue's own form: six threads, each running compiled forwards and backwards into one shared
// model, never fail, and the accumulated gradients match eager's.
TEST_F(CompileThreads, SixThreadsTrainingOneSharedModelAccumulateEveryGradient) {
  auto loss = [](const Tensor& x, const Tensor& w, const Tensor& b) { return (x.matmul(w) + b).relu().sum(); };
  auto f = kiln::compile(loss);
  Tensor w = randn({8, 4}).requires_grad_(), b = randn({4}).requires_grad_();
  Tensor we = w.detach().clone().requires_grad_(), be = b.detach().clone().requires_grad_();
  constexpr int kThreads = 6, kSteps = 20;
  std::vector<Tensor> inputs;
  for (int i = 0; i < kThreads * kSteps; ++i) inputs.push_back(randn({3, 8}));
  std::vector<std::string> errors(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      try {
        for (int s = 0; s < kSteps; ++s) f(inputs[t * kSteps + s], w, b).backward();
      } catch (const std::exception& e) {
        errors[t] = e.what();
      }
    });
  }
  for (auto& thread : threads) thread.join();
  for (int t = 0; t < kThreads; ++t) EXPECT_EQ(errors[t], "") << "thread " << t;
  for (const Tensor& x : inputs) loss(x, we, be).backward();
  EXPECT_TRUE(close(w.grad(), we.grad(), Tolerance{1e-5, 1e-4}));
  EXPECT_TRUE(close(b.grad(), be.grad(), Tolerance{1e-5, 1e-4}));
}

}  // namespace
