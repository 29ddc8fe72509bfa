// Helpers shared by the compile() suites (test_compile*.cpp): compiled-vs-eager comparison,
// text checks, counter differences, log capture, and a fixture that starts every test from a
// fresh compiler.
#pragma once

#include <gtest/gtest.h>

#include <cstdlib>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "kiln/compiler.h"
#include "kiln/compiler/graph.h"
#include "kiln/kiln.h"
#include "reference.h"

namespace kiln::testing {

// Compiled and eager code may fuse or reorder float math, so float results match to a few ulps,
// not bit for bit.
inline Tolerance compile_tolerance(DType t) {
  return t == kFloat64 ? Tolerance{1e-7, 1e-7} : Tolerance{1.3e-6, 1e-5};
}

// Compiled vs eager: same shape and dtype; floats allclose within `tol`, other dtypes equal.
inline ::testing::AssertionResult close(const Tensor& actual, const Tensor& expected, Tolerance tol) {
  if (!actual.defined() || !expected.defined())
    return ::testing::AssertionFailure() << "undefined tensor (actual " << actual.defined() << ", expected "
                                         << expected.defined() << ")";
  if (!(actual.sizes() == expected.sizes()))
    return ::testing::AssertionFailure() << "shape " << shape_str(actual.sizes()) << " != "
                                         << shape_str(expected.sizes());
  if (actual.dtype() != expected.dtype())
    return ::testing::AssertionFailure() << "dtype " << dtype_name(actual.dtype()) << " != "
                                         << dtype_name(expected.dtype());
  bool ok = actual.is_floating_point() ? allclose(actual, expected, tol.rtol, tol.atol) : equal(actual, expected);
  if (!ok) return ::testing::AssertionFailure() << "\nactual:   " << actual << "\nexpected: " << expected;
  return ::testing::AssertionSuccess();
}

// As above with compile_tolerance() for the dtype.
inline ::testing::AssertionResult close(const Tensor& actual, const Tensor& expected) {
  return close(actual, expected, compile_tolerance(actual.dtype()));
}

inline ::testing::AssertionResult contains(const std::string& text, const std::string& needle) {
  if (text.find(needle) != std::string::npos) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "'" << needle << "' not found in:\n" << text;
}

// Occurrences of `needle` in `text`, overlapping ones included.
inline int occurrences(const std::string& text, const std::string& needle) {
  int n = 0;
  for (size_t p = text.find(needle); p != std::string::npos; p = text.find(needle, p + 1)) ++n;
  return n;
}

// Field-by-field difference of two counter snapshots.
inline compiler::Counters operator-(compiler::Counters a, const compiler::Counters& b) {
  a.calls -= b.calls;
  a.frame_compiles -= b.frame_compiles;
  a.graph_compiles -= b.graph_compiles;
  a.graph_cache_hits -= b.graph_cache_hits;
  a.graph_runs -= b.graph_runs;
  a.graph_breaks -= b.graph_breaks;
  a.eager_frames -= b.eager_frames;
  a.replays -= b.replays;
  a.kernel_runs -= b.kernel_runs;
  a.dispatched_nodes -= b.dispatched_nodes;
  a.recomputed_values -= b.recomputed_values;
  a.cuda_graph_captures -= b.cuda_graph_captures;
  a.cuda_graph_replays -= b.cuda_graph_replays;
  a.cuda_graph_output_copies -= b.cuda_graph_output_copies;
  a.kernel_builds -= b.kernel_builds;
  a.size_specializations -= b.size_specializations;
  a.guided_captures -= b.guided_captures;
  return a;
}

// Counter differences since construction.
struct Delta {
  compiler::Counters start = compiler::counters();
  compiler::Counters now() const { return compiler::counters() - start; }
};

// Sends the compiler's logs to a string while alive.
struct LogCapture {
  std::ostringstream os;
  explicit LogCapture(compiler::LogOptions logs = {}) {
    compiler::set_logs(logs);
    compiler::set_log_stream(&os);
  }
  ~LogCapture() {
    compiler::set_log_stream(nullptr);
    compiler::set_logs({});
  }
  std::string str() const { return os.str(); }
};

// Starts each test with empty caches and counters and the default stance; afterwards restores
// the process-wide settings a test may have changed, so a failing test cannot leak them.
class CompilerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    compiler::reset();
    compiler::set_stance(Stance::default_);
  }
  void TearDown() override {
    compiler::set_stance(Stance::default_);
    compiler::set_logs({});
    compiler::set_log_stream(nullptr);
    compiler::set_recompile_limit(8);
  }
};

// Sets an environment variable while alive (restores or unsets it afterwards).
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const std::string& value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    ::setenv(name, value.c_str(), 1);
  }
  ~ScopedEnv() {
    if (old_) {
      ::setenv(name_, old_->c_str(), 1);
    } else {
      ::unsetenv(name_);
    }
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  const char* name_;
  std::optional<std::string> old_;
};

// One training step (zero_grad, forward, cross entropy, backward, optimizer step) as a callable to
// compile, or to run eagerly for the reference.
template <class Model, class Opt>
auto training_step(std::shared_ptr<Model> model, std::shared_ptr<Opt> opt) {
  return [model, opt](const Tensor& x, const Tensor& y) {
    opt->zero_grad();
    Tensor loss = nn::functional::cross_entropy(model->forward(x), y);
    loss.backward();
    opt->step();
    return loss;
  };
}

// The graph compile() captures for fn(args...) before any pass, and the arguments it was called
// with (tensors cloned), for tests of passes: run a pass on a copy and compare interpreters.
struct CapturedGraph {
  compiler::Graph graph;
  std::vector<Tensor> tensors;
  std::vector<Attr> scalars;
};

template <class F, class... Args>
CapturedGraph capture_graph(F fn, const Args&... args) {
  auto captured = std::make_shared<CapturedGraph>();
  auto f = kiln::compile(fn, {.backend = [captured](compiler::Graph& g, const compiler::Arguments& a) {
                                captured->graph = g;
                                for (const Tensor& t : a.tensors) captured->tensors.push_back(t.detach().clone());
                                captured->scalars.assign(a.scalars.begin(), a.scalars.end());
                                return compiler::interpreter(g);
                              }});
  f(args...);
  return *captured;
}

}  // namespace kiln::testing
