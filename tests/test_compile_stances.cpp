// Stances (DESIGN §2.4, spec §1.3): every stance on a first call, a cache hit and a cache miss;
// the three ways to set one; force_backend and skip_guard_eval_unsafe; the recompile limit.
#include <gtest/gtest.h>

#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "compile_helpers.h"
#include "kiln/compiler.h"
#include "kiln/kiln.h"

namespace {

using namespace kiln;
using compiler::Arguments;
using compiler::CompiledFn;
using compiler::Graph;

using namespace kiln::testing;  // compile_helpers.h

// ---- helpers ----

// A backend that counts its compiles (to tell which backend compiled a graph).
struct Counting {
  std::shared_ptr<std::atomic<int>> n = std::make_shared<std::atomic<int>>(0);
  compiler::BackendFn fn() const {
    auto count = n;
    return [count](Graph& g, const Arguments&) -> CompiledFn {
      count->fetch_add(1);
      return compiler::interpreter(g);
    };
  }
  int get() const { return n->load(); }
};

std::atomic<int> g_registered_compiles{0};
const char* kCountingName = "kilntest_stances_counting";
void ensure_registered() {
  static std::once_flag once;
  std::call_once(once, [] {
    compiler::register_backend(kCountingName, [](Graph& g, const Arguments&) -> CompiledFn {
      g_registered_compiles.fetch_add(1);
      return compiler::interpreter(g);
    });
  });
}

class Stances : public CompilerTest {};

// A compiled function that records whether its body ran under capture.
struct Probe {
  std::shared_ptr<std::vector<bool>> seen = std::make_shared<std::vector<bool>>();
  decltype(kiln::compile(std::function<Tensor(const Tensor&)>())) fn;

  // These tests make new signatures with new sizes: `dynamic` defaults to false here, so that each
  // size is a recompile (automatic dynamic would serve them all from the second size on).
  explicit Probe(CompileOptions options = {})
      : fn(kiln::compile(std::function<Tensor(const Tensor&)>([s = seen](const Tensor& x) {
                           s->push_back(compiler::is_compiling());
                           return relu(x) * 3;
                         }),
                         static_sizes(std::move(options)))) {}
  static CompileOptions static_sizes(CompileOptions o) {
    if (!o.dynamic) o.dynamic = false;
    return o;
  }
  // Calls the function; returns whether its body was capturing. Checks the result.
  bool call(const Tensor& x) {
    size_t before = seen->size();
    Tensor out = fn(x);
    EXPECT_TRUE(close(out, relu(x) * 3));
    EXPECT_EQ(seen->size(), before + 1) << "the body must run exactly once per call (not pure)";
    return seen->back();
  }
};

Tensor t3() { return randn({3}); }
Tensor t4() { return randn({4}); }
Tensor t5() { return randn({5}); }

// ================================ each stance: first call, hit, miss ================================

TEST_F(Stances, Default) {
  Probe p;
  Delta d;
  EXPECT_TRUE(p.call(t3())) << "first call compiles";
  EXPECT_EQ(d.now().graph_compiles, 1);
  EXPECT_TRUE(p.call(t3())) << "a hit runs the cached entry (capturing)";
  EXPECT_EQ(d.now().graph_compiles, 1);
  EXPECT_EQ(d.now().graph_cache_hits, 1);
  EXPECT_TRUE(p.call(t4())) << "a miss compiles";
  EXPECT_EQ(d.now().graph_compiles, 2);
  EXPECT_EQ(d.now().frame_compiles, 2);
  EXPECT_EQ(d.now().graph_runs, 3);
  EXPECT_EQ(d.now().eager_frames, 0);
}

TEST_F(Stances, ForceEager) {
  Probe p;
  {
    compiler::StanceGuard g(Stance::force_eager);
    Delta d;
    EXPECT_FALSE(p.call(t3())) << "first call: eager";
    EXPECT_EQ(d.now().graph_compiles, 0);
    EXPECT_EQ(d.now().graph_runs, 0);
    EXPECT_EQ(d.now().frame_compiles, 0);
    EXPECT_EQ(d.now().eager_frames, 1);
  }
  p.call(t3());  // compiled under default
  compiler::StanceGuard g(Stance::force_eager);
  Delta d;
  EXPECT_FALSE(p.call(t3())) << "force_eager ignores even a cache hit";
  EXPECT_FALSE(p.call(t4())) << "and a miss";
  EXPECT_EQ(d.now().graph_compiles, 0);
  EXPECT_EQ(d.now().graph_runs, 0);
  EXPECT_EQ(d.now().graph_cache_hits, 0);
  EXPECT_EQ(d.now().frame_compiles, 0);
  EXPECT_EQ(d.now().eager_frames, 2);
}

TEST_F(Stances, EagerOnRecompile) {
  Probe p;
  {
    compiler::StanceGuard g(Stance::eager_on_recompile);
    Delta d;
    EXPECT_FALSE(p.call(t3())) << "first call of a never-compiled function: eager";
    EXPECT_EQ(d.now().graph_compiles, 0);
    EXPECT_EQ(d.now().frame_compiles, 0);
  }
  p.call(t3());  // compiled under default
  compiler::StanceGuard g(Stance::eager_on_recompile);
  Delta d;
  EXPECT_TRUE(p.call(t3())) << "a hit runs compiled";
  EXPECT_EQ(d.now().graph_runs, 1);
  EXPECT_EQ(d.now().graph_cache_hits, 1);
  EXPECT_FALSE(p.call(t4())) << "a miss runs eagerly";
  EXPECT_EQ(d.now().graph_compiles, 0);
  EXPECT_EQ(d.now().frame_compiles, 0);
  EXPECT_EQ(d.now().graph_runs, 1);
  EXPECT_FALSE(p.call(t4())) << "and nothing was cached for it";
  EXPECT_EQ(d.now().graph_compiles, 0);
}

TEST_F(Stances, FailOnRecompile) {
  Probe p;
  {
    compiler::StanceGuard g(Stance::fail_on_recompile);
    try {
      p.fn(t3());
      FAIL() << "the first compile of a never-compiled function is a recompile too";
    } catch (const RecompileError& e) {
      std::string m = e.what();
      EXPECT_TRUE(contains(m, "Detected recompile when torch.compile stance is 'fail_on_recompile'. filename: '"));
      EXPECT_TRUE(contains(m, "test_compile_stances.cpp"));
      EXPECT_TRUE(contains(m, "function name: 'fn'"));
      EXPECT_TRUE(contains(m, "line number: "));
      EXPECT_FALSE(contains(m, "triggered by")) << "no entries: no guard list";
    }
    EXPECT_TRUE(p.seen->empty()) << "the body must not run";
  }
  p.call(t3());
  compiler::StanceGuard g(Stance::fail_on_recompile);
  Delta d;
  EXPECT_TRUE(p.call(t3())) << "a hit runs compiled";
  EXPECT_EQ(d.now().graph_cache_hits, 1);
  try {
    p.fn(t4());
    FAIL() << "a miss must throw";
  } catch (const RecompileError& e) {
    std::string m = e.what();
    EXPECT_TRUE(contains(m, "Detected recompile when torch.compile stance is 'fail_on_recompile'"));
    EXPECT_TRUE(contains(m, "\n    triggered by the following guard failure(s):\n    - "));
    EXPECT_TRUE(contains(m, "tensor 'arg0' size mismatch at index 0. expected 3, actual 4"));
  }
  EXPECT_EQ(d.now().graph_compiles, 0);
  EXPECT_EQ(d.now().frame_compiles, 0);
}

TEST_F(Stances, EagerThenCompile) {
  Probe p;
  {
    compiler::StanceGuard g(Stance::eager_then_compile);
    Delta d;
    EXPECT_FALSE(p.call(t3())) << "first sighting: eager";
    EXPECT_EQ(d.now().graph_compiles, 0);
    EXPECT_TRUE(p.call(t3())) << "second: compiles";
    EXPECT_EQ(d.now().graph_compiles, 1);
    EXPECT_TRUE(p.call(t3())) << "then hits";
    EXPECT_EQ(d.now().graph_compiles, 1);
    EXPECT_EQ(d.now().graph_cache_hits, 1);
  }
  // A function compiled under default, then a miss under eager_then_compile.
  Probe q;
  q.call(t3());
  compiler::StanceGuard g(Stance::eager_then_compile);
  Delta d;
  EXPECT_TRUE(q.call(t3())) << "a hit runs compiled";
  EXPECT_FALSE(q.call(t4())) << "the function's first miss under this stance runs eagerly";
  EXPECT_EQ(d.now().graph_compiles, 0);
  EXPECT_TRUE(q.call(t5())) << "a later miss compiles";
  EXPECT_EQ(d.now().graph_compiles, 1);
}

TEST_F(Stances, AotEagerThenCompile) {
  Counting counting;
  Probe p({.backend = counting.fn()});
  {
    compiler::StanceGuard g(Stance::aot_eager_then_compile);
    Delta d;
    EXPECT_TRUE(p.call(t3())) << "first sighting compiles";
    EXPECT_EQ(d.now().graph_compiles, 1);
    EXPECT_EQ(counting.get(), 0) << "with aot_eager, not the function's backend";
    EXPECT_TRUE(compiler::compile_times().find("backend_compile (aot_eager)") != std::string::npos)
        << compiler::compile_times();
    EXPECT_TRUE(p.call(t3())) << "the second call compiles with the function's backend";
    EXPECT_EQ(counting.get(), 1);
    EXPECT_TRUE(p.call(t3()));
    EXPECT_EQ(counting.get(), 1) << "then hits";
  }
  Counting counting2;
  Probe q({.backend = counting2.fn()});
  q.call(t3());  // under default: the function's backend
  EXPECT_EQ(counting2.get(), 1);
  compiler::StanceGuard g(Stance::aot_eager_then_compile);
  EXPECT_TRUE(q.call(t3())) << "a hit runs compiled";
  EXPECT_EQ(counting2.get(), 1);
  Delta d;
  EXPECT_TRUE(q.call(t4())) << "the first miss compiles with aot_eager";
  EXPECT_EQ(d.now().graph_compiles, 1);
  EXPECT_EQ(counting2.get(), 1);
  EXPECT_TRUE(q.call(t5())) << "a later miss compiles with the function's backend";
  EXPECT_EQ(counting2.get(), 2);
}

// ================================ the three forms ================================

TEST_F(Stances, SetStanceIsProcessWide) {
  Probe p;
  p.call(t3());
  compiler::set_stance(Stance::force_eager);
  EXPECT_EQ(compiler::current_stance(), Stance::force_eager);
  bool other_compiling = true;
  Stance other_stance = Stance::default_;
  std::thread t([&] {
    other_stance = compiler::current_stance();
    other_compiling = p.call(t3());
  });
  t.join();
  EXPECT_EQ(other_stance, Stance::force_eager);
  EXPECT_FALSE(other_compiling) << "another thread sees the process-wide stance";
  EXPECT_FALSE(p.call(t3()));
  compiler::set_stance(Stance::default_);
  EXPECT_TRUE(p.call(t3()));
}

TEST_F(Stances, StanceGuardIsThisThreadOnly) {
  Probe p;
  p.call(t3());
  {
    compiler::StanceGuard g(Stance::force_eager);
    EXPECT_EQ(compiler::current_stance(), Stance::force_eager);
    bool other_compiling = false;
    Stance other_stance = Stance::force_eager;
    std::thread t([&] {
      other_stance = compiler::current_stance();
      other_compiling = p.call(t3());
    });
    t.join();
    EXPECT_EQ(other_stance, Stance::default_);
    EXPECT_TRUE(other_compiling) << "another thread still sees the default stance";
    EXPECT_FALSE(p.call(t3()));
    {
      compiler::StanceGuard inner(Stance::default_);  // guards nest
      EXPECT_TRUE(p.call(t3()));
    }
    EXPECT_FALSE(p.call(t3()));
  }
  EXPECT_EQ(compiler::current_stance(), Stance::default_);
  EXPECT_TRUE(p.call(t3()));
}

TEST_F(Stances, WithStanceDecorator) {
  Probe p;
  p.call(t3());
  auto eager_fn = compiler::with_stance(Stance::force_eager, [&](const Tensor& x) {
    EXPECT_EQ(compiler::current_stance(), Stance::force_eager);
    return p.call(x);
  });
  Delta d;
  EXPECT_FALSE(eager_fn(t3()));
  EXPECT_EQ(d.now().graph_runs, 0);
  EXPECT_EQ(compiler::current_stance(), Stance::default_) << "only while the decorated function runs";
  EXPECT_TRUE(p.call(t3()));
  // The decorator wraps a compiled callable as well.
  auto eager_compiled = compiler::with_stance(Stance::force_eager, p.fn);
  Tensor x = t3();
  EXPECT_TRUE(close(eager_compiled(x), relu(x) * 3));
  EXPECT_FALSE(p.seen->back());
}

TEST_F(Stances, StringForm) {
  compiler::set_stance("force_eager");
  EXPECT_EQ(compiler::current_stance(), Stance::force_eager);
  Probe p;
  EXPECT_FALSE(p.call(t3()));
  compiler::set_stance("default");
  EXPECT_EQ(compiler::current_stance(), Stance::default_);
  EXPECT_TRUE(p.call(t3()));
  {
    compiler::StanceGuard g("eager_on_recompile");
    EXPECT_EQ(compiler::current_stance(), Stance::eager_on_recompile);
  }
  try {
    compiler::set_stance("nope");
    FAIL() << "expected ValueError";
  } catch (const ValueError& e) {
    std::string m = e.what();
    EXPECT_TRUE(contains(m, "'nope'"));
    for (const char* name : {"default", "force_eager", "eager_on_recompile", "fail_on_recompile",
                             "eager_then_compile", "aot_eager_then_compile"})
      EXPECT_TRUE(contains(m, name));
  }
  EXPECT_THROW(compiler::StanceGuard("nope"), ValueError);
  EXPECT_EQ(compiler::current_stance(), Stance::default_) << "a rejected stance changes nothing";
  for (Stance s : {Stance::default_, Stance::force_eager, Stance::eager_on_recompile, Stance::fail_on_recompile,
                   Stance::eager_then_compile, Stance::aot_eager_then_compile})
    EXPECT_EQ(compiler::parse_stance(compiler::stance_name(s)), s);
}

// ================================ force_backend ================================

TEST_F(Stances, ForceBackendWithTheDefaultStance) {
  ensure_registered();
  Counting own;
  Probe p({.backend = own.fn()});
  int before = g_registered_compiles.load();
  {
    compiler::StanceGuard g(Stance::default_, {.force_backend = kCountingName});
    EXPECT_TRUE(p.call(t3()));
    EXPECT_EQ(g_registered_compiles.load() - before, 1) << "compiled with the forced backend";
    EXPECT_EQ(own.get(), 0);
  }
  EXPECT_TRUE(p.call(t3()));
  EXPECT_EQ(own.get(), 1) << "without force_backend the function's own backend compiles (BACKEND_MATCH)";
  compiler::set_stance(Stance::default_, {.force_backend = kCountingName});
  EXPECT_TRUE(p.call(t3())) << "the entry the forced backend compiled is served again";
  EXPECT_EQ(g_registered_compiles.load() - before, 1);
}

TEST_F(Stances, ForceBackendNeedsTheDefaultStance) {
  ensure_registered();
  for (Stance s : {Stance::force_eager, Stance::eager_on_recompile, Stance::fail_on_recompile,
                   Stance::eager_then_compile, Stance::aot_eager_then_compile}) {
    try {
      compiler::set_stance(s, {.force_backend = kCountingName});
      FAIL() << "expected an error for " << compiler::stance_name(s);
    } catch (const Error& e) {
      EXPECT_TRUE(contains(e.what(), "non-default stance cannot have force_backend set"));
    }
    EXPECT_THROW(compiler::StanceGuard(s, {.force_backend = kCountingName}), Error);
  }
  EXPECT_EQ(compiler::current_stance(), Stance::default_);
  EXPECT_THROW(compiler::set_stance(Stance::default_, {.force_backend = "nope"}), CompileError);
}

// ================================ skip_guard_eval_unsafe ================================

// With one entry no guard has ever told entries apart, so skip_guard_eval_unsafe checks nothing:
// a call with another size is served by the existing entry. That is the documented unsafe
// behaviour: here relu works on any size, so only the counters show which entry ran.
TEST_F(Stances, SkipGuardEvalUnsafeServesTheExistingEntry) {
  Probe p;
  p.call(t3());
  Delta d;
  {
    compiler::StanceGuard g(Stance::default_, {.skip_guard_eval_unsafe = true});
    EXPECT_TRUE(p.call(t4()));
    EXPECT_EQ(d.now().frame_compiles, 0) << "no new frame entry: the size guard was skipped";
  }
  // With guards evaluated, the same call is a miss.
  EXPECT_TRUE(p.call(t4()));
  EXPECT_EQ(d.now().frame_compiles, 1);
}

// The eager backend runs the recorded ops on whatever it gets, so the wrong entry still computes
// relu; generated kernels have the recorded sizes built in, which is why the stance is unsafe.
TEST_F(Stances, SkipGuardEvalUnsafeReplaysAPureEntryOnTheWrongSize) {
  int count = 0;
  auto f = kiln::compile(
      [&](const Tensor& x) {
        ++count;
        return relu(x);
      },
      {.backend = "eager", .pure = true});
  Tensor a = randn({3});
  f(a);
  f(a);  // confirmed: later calls replay
  ASSERT_EQ(count, 2);
  Delta d;
  Tensor b = randn({4});
  Tensor out;
  {
    compiler::StanceGuard g(Stance::default_, {.skip_guard_eval_unsafe = true});
    out = f(b);
  }
  EXPECT_EQ(count, 2) << "the size-3 entry replayed without its size guard";
  EXPECT_EQ(d.now().replays, 1);
  EXPECT_EQ(d.now().graph_compiles, 0);
  EXPECT_EQ(d.now().frame_compiles, 0);
  EXPECT_TRUE(close(out, relu(b))) << "relu is shape-agnostic, so the wrong entry still computes it";
}

// ================================ set_stance inside compiled code ================================

TEST_F(Stances, ChangingTheStanceInsideACompiledRegionThrows) {
  auto with_set = kiln::compile([](const Tensor& x) {
    compiler::set_stance(Stance::force_eager);
    return x * 2;
  });
  try {
    with_set(t3());
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_TRUE(contains(e.what(), "attempted to set_stance in a torch.compile region"));
  }
  EXPECT_EQ(compiler::current_stance(), Stance::default_);

  auto with_guard = kiln::compile([](const Tensor& x) {
    compiler::StanceGuard g(Stance::force_eager);
    return x * 2;
  });
  try {
    with_guard(t3());
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_TRUE(contains(e.what(), "attempted to set_stance in a torch.compile region"));
  }
  EXPECT_EQ(compiler::current_stance(), Stance::default_);

  // Inside compiler::disable() the code is not compiled, so it may change the stance.
  bool inner_stance_ok = false;
  auto allowed = kiln::compile([&](const Tensor& x) {
    Tensor y = x * 2;
    compiler::disable([&] {
      compiler::StanceGuard g(Stance::force_eager);
      inner_stance_ok = compiler::current_stance() == Stance::force_eager;
      compiler::set_stance(Stance::default_);
    })();
    return y + 1;
  });
  Tensor x = t3();
  EXPECT_NO_THROW({ EXPECT_TRUE(close(allowed(x), x * 2 + 1)); });
  EXPECT_TRUE(inner_stance_ok);
}

TEST_F(Stances, TheStanceIsReadOnEveryCall) {
  Probe p;
  EXPECT_TRUE(p.call(t3()));
  compiler::set_stance(Stance::force_eager);
  EXPECT_FALSE(p.call(t3())) << "a function compiled before set_stance runs eagerly afterwards";
  compiler::set_stance(Stance::default_);
  Delta d;
  EXPECT_TRUE(p.call(t3()));
  EXPECT_EQ(d.now().graph_compiles, 0) << "and its cache is still there";
}

// ================================ recompile limit ================================

TEST_F(Stances, RecompileLimitDefaultEight) {
  EXPECT_EQ(compiler::recompile_limit(), 8);
  Probe p;
  LogCapture log;
  for (int n = 1; n <= 8; ++n) EXPECT_TRUE(p.call(randn({n}))) << "size " << n;
  EXPECT_EQ(compiler::counters().frame_compiles, 8);
  EXPECT_EQ(log.str(), "");
  Delta d;
  EXPECT_FALSE(p.call(randn({9}))) << "the 9th signature runs eagerly";
  EXPECT_EQ(d.now().frame_compiles, 0);
  EXPECT_EQ(d.now().graph_compiles, 0);
  EXPECT_TRUE(contains(log.str(), "hit config.recompile_limit (8)"));
  EXPECT_TRUE(contains(log.str(), "size mismatch"));
  EXPECT_FALSE(p.call(randn({10})));
  EXPECT_FALSE(p.call(randn({11})));
  EXPECT_EQ(occurrences(log.str(), "recompile_limit"), 1) << "warns once:\n" << log.str();
  EXPECT_TRUE(p.call(randn({4}))) << "cached signatures still run compiled";
  EXPECT_EQ(d.now().eager_frames, 3);
}

TEST_F(Stances, RecompileLimitFromCompileOptions) {
  Probe p({.recompile_limit = 2});
  LogCapture log;
  EXPECT_TRUE(p.call(randn({1})));
  EXPECT_TRUE(p.call(randn({2})));
  EXPECT_FALSE(p.call(randn({3})));
  EXPECT_TRUE(contains(log.str(), "hit config.recompile_limit (2)"));
  EXPECT_EQ(compiler::counters().frame_compiles, 2);
  EXPECT_THROW(kiln::compile([](const Tensor& x) { return x; }, {.recompile_limit = 0}), ValueError);
}

TEST_F(Stances, SetRecompileLimit) {
  compiler::set_recompile_limit(3);
  EXPECT_EQ(compiler::recompile_limit(), 3);
  Probe p;
  LogCapture log;
  for (int n = 1; n <= 3; ++n) EXPECT_TRUE(p.call(randn({n})));
  EXPECT_FALSE(p.call(randn({4})));
  EXPECT_TRUE(contains(log.str(), "hit config.recompile_limit (3)"));
  EXPECT_THROW(compiler::set_recompile_limit(0), ValueError);
  EXPECT_EQ(compiler::recompile_limit(), 3);
}

TEST_F(Stances, RecompileLimitWithFullgraphThrows) {
  Probe p({.fullgraph = true, .recompile_limit = 1});
  EXPECT_TRUE(p.call(randn({1})));
  try {
    p.fn(randn({2}));
    FAIL() << "expected RecompileError";
  } catch (const RecompileError& e) {
    EXPECT_TRUE(contains(e.what(), "recompile_limit"));
  }
}

struct Affine : nn::Module {
  std::shared_ptr<nn::Linear> lin;
  Affine() { lin = register_module("lin", std::make_shared<nn::Linear>(3, 3)); }
  Tensor forward(const Tensor& x) override { return lin->forward(x); }
};

TEST_F(Stances, RecompileLimitIsPerModuleInstance) {
  auto a = std::make_shared<Affine>();
  auto b = std::make_shared<Affine>();
  bool compiling = false;
  auto f = kiln::compile(
      [&](const std::shared_ptr<Affine>& m, const Tensor& x) {
        compiling = compiler::is_compiling();
        return m->forward(x);
      },
      {.dynamic = false, .recompile_limit = 2});
  LogCapture log;
  auto run = [&](const std::shared_ptr<Affine>& m, int64_t rows) {
    Tensor x = randn({rows, 3});
    Tensor out = f(m, x);
    EXPECT_TRUE(close(out, m->forward(x)));
    return compiling;
  };
  EXPECT_TRUE(run(a, 1));
  EXPECT_TRUE(run(a, 2));
  EXPECT_TRUE(run(b, 1)) << "the second instance has its own budget";
  EXPECT_TRUE(run(b, 2));
  EXPECT_EQ(compiler::counters().frame_compiles, 4);
  EXPECT_FALSE(run(a, 3)) << "the first instance's budget is spent";
  EXPECT_FALSE(run(b, 3));
  EXPECT_TRUE(contains(log.str(), "hit config.recompile_limit (2)"));
  EXPECT_TRUE(run(a, 2));
  EXPECT_TRUE(run(b, 1));
}

}  // namespace
