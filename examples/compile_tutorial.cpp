// Introduction to kiln::compile, following the torch.compile tutorial: compiling functions and
// modules, timing DenseNet-121 inference and a whole training step eager against compiled,
// data-dependent control flow and non-Kiln code inside compiled functions, and looking at the
// captured graphs with a custom backend, explain() and fullgraph. DenseNet-121's own captured
// graph is printed by examples/compile_tutorial_densenet.cpp (its table is long).
//
// Sizes: DenseNet-121 on batches of 16 images 3x128x128, 10 timed iterations. With
// KILN_EXAMPLE_QUICK=1 (set by the tests) it uses batches of 2 images 3x32x32 and 2 iterations;
// examples/expected/compile_tutorial.txt holds that output, with times as {num}.
//
// The default backend, "kiln", builds fused C++ kernels with the system compiler at the first call
// of each shape (cached on disk for later runs); later calls run the generated code.
#include <kiln/kiln.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <iomanip>
#include <numbers>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "example.h"

using namespace kiln;

namespace {

// Runs fn() and returns its result and the seconds it took (the tutorial times with CUDA events;
// on the CPU a steady clock does).
template <class F>
auto timed(F&& fn) {
  auto start = std::chrono::steady_clock::now();
  auto result = fn();
  double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return std::make_pair(std::move(result), s);
}

std::string num(double v) {
  std::ostringstream os;
  os << std::fixed << std::setprecision(6) << v;
  return os.str();
}

double median(std::vector<double> v) {  // numpy.median: the mean of the middle two when even
  std::sort(v.begin(), v.end());
  size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

const char* py_bool(bool b) { return b ? "True" : "False"; }

// Test that fn1 and fn2 return the same result for the same arguments. Typically fn1 is the
// eager function and fn2 its compiled version.
template <class F1, class F2, class... Args>
bool test_fns(F1& fn1, F2& fn2, const Args&... args) {
  Tensor out1 = fn1(args...);
  Tensor out2 = fn2(args...);
  return allclose(out1, out2);
}

// scipy.fft.dct's default: an unnormalized DCT-II along the last axis,
// y[k] = 2 * sum_n x[n] * cos(pi * k * (2n + 1) / (2N)). Plain C++ on host memory: Kiln cannot
// see into it, so compiled code reaching it breaks the graph around it.
std::vector<float> dct_last_axis(const float* x, int64_t rows, int64_t n) {
  std::vector<float> y(static_cast<size_t>(rows * n));
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t k = 0; k < n; ++k) {
      double sum = 0;
      for (int64_t i = 0; i < n; ++i)
        sum += x[r * n + i] * std::cos(std::numbers::pi * static_cast<double>(k * (2 * i + 1)) / (2.0 * n));
      y[r * n + k] = static_cast<float>(2 * sum);
    }
  }
  return y;
}

// `if (b.sum() < 0)` is data-dependent control flow: the bool conversion reads the sum.
Tensor bar(const Tensor& a, Tensor b) {
  Tensor x = a / (abs(a) + 1);
  if (b.sum() < 0) {
    b = b * -1;
  }
  return x * b;
}

class MyModule : public nn::Module {
 public:
  MyModule() { lin = register_module("lin", std::make_shared<nn::Linear>(100, 10)); }
  Tensor forward(const Tensor& x) override { return nn::functional::relu(lin->forward(x)); }

  std::shared_ptr<nn::Linear> lin;
};

}  // namespace

KILN_EXAMPLE(compile_tutorial, 30, "Introduction to kiln::compile") {
  const bool quick = examples::quick_mode();
  const int64_t batch = quick ? 2 : 16, image = quick ? 32 : 128;
  const int n_iters = quick ? 2 : 10;
  compiler::reset();
  manual_seed(0);

  out << "--- Basic usage ---\n";
  auto foo = [](const Tensor& x, const Tensor& y) {
    Tensor a = sin(x);
    Tensor b = cos(y);
    return a + b;
  };
  auto opt_foo1 = compile(foo);
  {
    Tensor x = randn({10, 10}), y = randn({10, 10});  // named: C++ leaves argument order unspecified
    out << opt_foo1(x, y) << "\n";
  }

  // The decorator form: compile the function where it is defined.
  auto opt_foo2 = compile([](const Tensor& x, const Tensor& y) {
    Tensor a = sin(x);
    Tensor b = cos(y);
    return a + b;
  });
  {
    Tensor x = randn({10, 10}), y = randn({10, 10});
    out << opt_foo2(x, y) << "\n";
  }

  // Modules compile too: compile(std::shared_ptr<Module>) calls its forward.
  auto mod = std::make_shared<MyModule>();
  auto opt_mod = compile(mod);
  out << opt_mod(randn({10, 100})) << "\n";

  out << "\n--- Demonstrating speedups ---\n";
  out << "(the default backend, \"kiln\", builds fused kernels on the first call of each shape; "
         "later calls run them)\n";
  // Random images and labels; b is the batch size.
  auto generate_data = [&](int64_t b) { return std::make_pair(randn({b, 3, image, image}), randint(1000, {b})); };
  auto init_model = [] { return models::densenet121(); };

  std::shared_ptr<models::DenseNet> model = init_model();
  compiler::reset();  // reset since we are using a different mode
  auto model_opt = compile(model, {.mode = Mode::reduce_overhead});

  Tensor inp = generate_data(batch).first;
  {
    NoGradGuard no_grad;
    out << "eager: " << num(timed([&] { return model->forward(inp); }).second) << "\n";
    out << "compile: " << num(timed([&] { return model_opt(inp); }).second) << "\n";
  }

  std::vector<double> eager_times, compile_times;
  for (int i = 0; i < n_iters; ++i) {
    inp = generate_data(batch).first;
    NoGradGuard no_grad;
    double t = timed([&] { return model->forward(inp); }).second;
    eager_times.push_back(t);
    out << "eager eval time " << i << ": " << num(t) << "\n";
  }
  out << std::string(10, '~') << "\n";
  for (int i = 0; i < n_iters; ++i) {
    inp = generate_data(batch).first;
    NoGradGuard no_grad;
    double t = timed([&] { return model_opt(inp); }).second;
    compile_times.push_back(t);
    out << "compile eval time " << i << ": " << num(t) << "\n";
  }
  out << std::string(10, '~') << "\n";
  {
    double eager_med = median(eager_times), compile_med = median(compile_times);
    out << "(eval) eager median: " << num(eager_med) << ", compile median: " << num(compile_med)
        << ", speedup: " << num(eager_med / compile_med) << "x\n";
    out << std::string(10, '~') << "\n";
  }

  // Training: compile the whole step (zero_grad, forward, loss, backward, optimizer step).
  model = init_model();
  auto opt = std::make_unique<optim::Adam>(model->parameters());
  auto train = [&](models::DenseNet& m, const std::pair<Tensor, Tensor>& data) {
    opt->zero_grad(true);
    Tensor pred = m.forward(data.first);
    Tensor loss = nn::functional::cross_entropy(pred, data.second);
    loss.backward();
    opt->step();
  };

  eager_times.clear();
  for (int i = 0; i < n_iters; ++i) {
    auto data = generate_data(batch);
    double t = timed([&] {
                 train(*model, data);
                 return 0;
               }).second;
    eager_times.push_back(t);
    out << "eager train time " << i << ": " << num(t) << "\n";
  }
  out << std::string(10, '~') << "\n";

  model = init_model();
  opt = std::make_unique<optim::Adam>(model->parameters());
  auto train_opt = compile(train, {.mode = Mode::reduce_overhead});

  compile_times.clear();
  int64_t runs_before = compiler::counters().graph_runs;
  for (int i = 0; i < n_iters; ++i) {
    auto data = generate_data(batch);
    double t = timed([&] {
                 train_opt(*model, data);
                 return 0;
               }).second;
    compile_times.push_back(t);
    out << "compile train time " << i << ": " << num(t) << "\n";
  }
  out << std::string(10, '~') << "\n";
  {
    double eager_med = median(eager_times), compile_med = median(compile_times);
    out << "(train) eager median: " << num(eager_med) << ", compile median: " << num(compile_med)
        << ", speedup: " << num(eager_med / compile_med) << "x\n";
    out << std::string(10, '~') << "\n";
  }
  out << "compiled train steps ran " << compiler::counters().graph_runs - runs_before << " graphs in "
      << n_iters << " calls (one per step: forward, backward and Adam in one graph)\n";

  out << "\n--- Comparison to TorchScript and FX tracing ---\n";
  out << "(C++ has no TorchScript or FX tracers to compare with; only the compile() parts are ported)\n";
  auto f1 = [](const Tensor& x, const Tensor& y) {
    if (x.sum() < 0) return -y;
    return y;
  };
  Tensor inp1 = randn({5, 5});
  Tensor inp2 = randn({5, 5});

  compiler::reset();  // reset since we are using a different mode
  auto compile_f1 = compile(f1);
  Tensor neg_inp1 = -inp1;
  out << "compile 1, 1: " << py_bool(test_fns(f1, compile_f1, inp1, inp2)) << "\n";
  out << "compile 1, 2: " << py_bool(test_fns(f1, compile_f1, neg_inp1, inp2)) << "\n";
  out << "(" << compiler::counters().graph_compiles << " graphs compiled, " << compiler::counters().graph_breaks
      << " graph breaks)\n";
  out << std::string(10, '~') << "\n";

  // An int argument needs no type annotation (TorchScript's scripting failed here).
  auto f2 = [](const Tensor& x, int y) { return x + y; };
  inp1 = randn({5, 5});
  int int_inp2 = 3;
  auto compile_f2 = compile(f2);
  out << "compile 2: " << py_bool(test_fns(f2, compile_f2, inp1, int_inp2)) << "\n";
  out << std::string(10, '~') << "\n";

  // A non-Kiln function on raw host memory (the tutorial's scipy.fft.dct on x.numpy()).
  auto f3 = [](const Tensor& x_in) {
    Tensor x = (x_in * 2).contiguous();
    std::vector<float> y = dct_last_axis(x.data_ptr<float>(), x.size(0), x.size(1));  // host read
    x = tensor<float>(y, {x.size(0), x.size(1)});
    x = x * 2;
    return x;
  };
  inp1 = randn({5, 5});
  inp2 = randn({5, 5});
  auto compile_f3 = compile(f3);
  out << "compile 3: " << py_bool(test_fns(f3, compile_f3, inp2)) << "\n";

  out << "\n--- Captured graphs and custom backends ---\n";
  auto custom_backend = [&out](compiler::Graph& graph, const compiler::Arguments&) {
    out << "custom backend called with graph:\n";
    graph.print_tabular(out);
    return compiler::interpreter(graph);
  };

  compiler::reset();  // reset since we are using a different backend
  out << "(DenseNet-121 through this backend: see examples/compile_tutorial_densenet.cpp)\n";

  auto opt_bar = compile(bar, {.backend = custom_backend, .name = "bar", .arg_names = {"a", "b"}});
  inp1 = randn({10});
  inp2 = randn({10});
  opt_bar(inp1, inp2);
  opt_bar(inp1, -inp2);

  compiler::reset();  // reset since we are using a different backend
  {
    Tensor a = randn({10}), b = randn({10});
    compiler::ExplainOutput explain_output = compiler::explain(bar, {.name = "bar", .arg_names = {"a", "b"}})(a, b);
    out << examples::stable_paths(explain_output.str()) << "\n";
  }

  // fullgraph=true: the first graph break throws, naming the reason and the line.
  auto opt_bar_full = compile(bar, {.fullgraph = true, .name = "bar"});
  try {
    Tensor a = randn({10}), b = randn({10});
    opt_bar_full(a, b);
  } catch (const GraphBreakError& e) {
    out << examples::stable_paths(e.what()) << "\n";
  }
}
