// The torch.compile FAQ, in C++: training through compiled code, bisecting with backends,
// compile times and the recompile profiler, run-only mode for production, finding graph breaks
// (explain, fullgraph), gradients inside compiled code, and the fine-grained escape hatches:
// disable, disallow_in_graph, custom ops and graph_break.
//
// Sections of the FAQ about distributed training, Inductor, Triton and NumPy have no Kiln
// counterpart yet; the example says so in one line each.
#include <kiln/kiln.h>

#include <iostream>
#include <string>
#include <vector>

#include "example.h"

using namespace kiln;

namespace {

const char* py_bool(bool b) { return b ? "True" : "False"; }

// What the compiler did since the last compiler::reset().
std::string activity() {
  compiler::Counters c = compiler::counters();
  return std::to_string(c.graph_compiles) + " graphs compiled, " + std::to_string(c.graph_runs) + " run, " +
         std::to_string(c.graph_breaks) + " graph breaks, " + std::to_string(c.eager_frames) + " eager calls";
}

// Where toy_example's print("woo") goes: the example's output (Python's print writes to the
// global stdout; this is its counterpart).
std::ostream* g_stdout = &std::cout;

// The FAQ's toy_example.
Tensor toy_example(const Tensor& a, Tensor b) {
  Tensor x = a / (abs(a) + 1);
  *g_stdout << "woo\n";
  if (b.sum() < 0) {
    b = b * -1;
  }
  return x * b;
}

// A custom op: y = x^3 computed by plain C++ on host memory, with its derivative 3 x^2 written
// in Kiln ops. Registered once per process (the op table is global).
const compiler::CustomOp& cube_op() {
  static const compiler::CustomOp op = compiler::custom_op({
      .name = "mylib::cube",
      .schema = "mylib::cube(Tensor x) -> Tensor",
      .meta =
          [](const OpCall& call) {
            const Tensor& x = call.input(0);
            KILN_CHECK(x.dtype() == kFloat32, DTypeError,
                       "[mylib::cube] expected a float32 tensor, got " + std::string(dtype_name(x.dtype())) + ".");
            return std::vector<TensorMeta>{{.sizes = x.sizes().vec(), .dtype = kFloat32, .device = x.device()}};
          },
      .cpu_kernel =
          [](const OpCall& call, std::span<Tensor> outputs) {
            Tensor x = call.input(0).contiguous();
            const float* in = x.data_ptr<float>();
            float* y = outputs[0].data_ptr<float>();
            for (int64_t i = 0; i < x.numel(); ++i) y[i] = in[i] * in[i] * in[i];
          },
      .derivative = {.formula = "x: grad * 3 * x^2",
                     .save_inputs = {0},
                     .fn = [](const BackwardContext& ctx) {
                       const Tensor& x = ctx.input(0);
                       return std::vector<Tensor>{ctx.grad() * 3 * x * x};
                     }},
  });
  return op;
}

}  // namespace

KILN_EXAMPLE(compile_faq, 40, "kiln::compile FAQ") {
  g_stdout = &out;
  struct RestoreStdout {
    ~RestoreStdout() { g_stdout = &std::cout; }
  } restore_stdout;
  compiler::reset();
  manual_seed(0);

  out << "--- Does compile() support training? ---\n";
  // The backward of compiled code is captured as a graph too, even when backward() is called
  // after the compiled call returned.
  auto f = [](const Tensor& x, const Tensor& w) { return tanh(matmul(x, w)); };
  Tensor x = randn({8, 4});
  Tensor w = randn({4, 3}).requires_grad_();
  Tensor eager_loss = f(x, w).sum();
  eager_loss.backward();
  Tensor eager_grad = w.grad().clone();
  w.set_grad(Tensor());

  // The loss inside the compiled function: backward() starts at a compiled output.
  auto opt_f_loss = compile([f](const Tensor& x, const Tensor& w) { return f(x, w).sum(); });
  for (int step = 1; step <= 2; ++step) {
    compiler::Counters before = compiler::counters();
    Tensor loss = opt_f_loss(x, w);
    compiler::Counters after_forward = compiler::counters();
    loss.backward();
    compiler::Counters after_backward = compiler::counters();
    out << "loss compiled, step " << step << ": forward " << after_forward.graph_compiles - before.graph_compiles
        << " compiled, " << after_forward.graph_runs - before.graph_runs << " run; backward "
        << after_backward.graph_compiles - after_forward.graph_compiles << " compiled, "
        << after_backward.graph_runs - after_forward.graph_runs << " run\n";
    out << "  loss " << loss << ", equal to eager's: " << py_bool(allclose(loss, eager_loss)) << "\n";
    out << "  grad equal to eager's: " << py_bool(allclose(w.grad(), eager_grad)) << "\n";
    w.set_grad(Tensor());
  }

  // The usual split: a compiled forward, the loss computed eagerly on its output. The compiled
  // part of the backward still runs as a compiled graph.
  auto opt_f = compile(f);
  {
    compiler::Counters before = compiler::counters();
    Tensor pred = opt_f(x, w);
    compiler::Counters after_forward = compiler::counters();
    Tensor loss = pred.sum();
    loss.backward();
    compiler::Counters after_backward = compiler::counters();
    out << "loss eager: forward " << after_forward.graph_compiles - before.graph_compiles << " compiled, "
        << after_forward.graph_runs - before.graph_runs << " run; backward "
        << after_backward.graph_compiles - after_forward.graph_compiles << " compiled, "
        << after_backward.graph_runs - after_forward.graph_runs << " run\n";
    out << "  grad equal to eager's: " << py_bool(allclose(w.grad(), eager_grad)) << "\n";
    w.set_grad(Tensor());
  }

  out << "\n--- Do you support distributed code? ---\n";
  out << "(Kiln has no distributed training yet)\n";

  out << "\n--- Why is my code crashing? ---\n";
  // Bisect: the "eager" backend only captures and runs the graph op by op; "aot_eager" also runs
  // the graph passes (validation, dead-code and common-subexpression elimination); "kiln" (alias
  // "inductor") generates and compiles C++ kernels.
  out << "registered backends:";
  for (const auto& name : compiler::list_backends({})) out << " " << name;
  out << "\n";
  out << "list_backends() without debug backends:";
  for (const auto& name : compiler::list_backends()) out << " " << name;
  out << (compiler::list_backends().empty() ? " (none)\n" : "\n");
  auto g = [](const Tensor& a, const Tensor& b) {
    Tensor s = sin(a) * cos(b);
    Tensor unused = exp(a);  // dead code: aot_eager removes it
    return s + sin(a) * cos(b);  // a common subexpression
  };
  Tensor a = randn({4, 4}), b = randn({4, 4});
  Tensor expected = g(a, b);
  for (const char* backend : {"eager", "aot_eager", "kiln"}) {
    auto opt_g = compile(g, {.backend = backend});
    out << "backend=\"" << backend << "\": same result as eager: " << py_bool(allclose(opt_g(a, b), expected)) << "\n";
  }
  try {
    compile(g, {.backend = "tensorrt"});
  } catch (const CompileError& e) {
    out << e.what() << "\n";
  }

  out << "\n--- Why is compilation slow? ---\n";
  compiler::reset();
  {
    auto opt_g = compile(g, {.backend = "aot_eager"});
    opt_g(a, b);
    compile(g)(a, b);
  }
  out << compiler::compile_times();

  // The recompile profiler: which guards failed, how often.
  auto my_model = [](const Tensor& t) { return relu(t) * 2; };
  {
    compiler::RecompileProfiler prof;
    auto profiler_model = compile(my_model, {.backend = prof.backend(), .name = "my_model", .arg_names = {"t"}});
    for (int64_t n : {2, 3, 4, 3}) profiler_model(randn({n}));
    out << examples::stable_paths(prof.report());
  }

  out << "\n--- Why are you recompiling in production? ---\n";
  // The FAQ's dynamo.run(): cached graphs still run, new inputs run eagerly and nothing compiles.
  compiler::reset();
  auto opt_toy = compile(toy_example);
  {
    Tensor a10 = randn({10}), b10 = randn({10});
    opt_toy(a10, b10);  // warm up: compiles
  }
  auto frozen_toy_example = compiler::with_stance(Stance::eager_on_recompile, opt_toy);
  compiler::Counters before = compiler::counters();
  {
    Tensor a10 = randn({10}), b10 = randn({10});
    frozen_toy_example(a10, b10);
    Tensor a20 = randn({20}), b20 = randn({20});
    frozen_toy_example(a20, b20);
  }
  compiler::Counters after = compiler::counters();
  out << "frozen: " << after.graph_compiles - before.graph_compiles << " graphs compiled, "
      << after.eager_frames - before.eager_frames << " call ran eagerly\n";

  out << "\n--- Identifying the cause of a graph break ---\n";
  out << "(printing is not a graph break in C++: the body runs on every call, so \"woo\" is printed by "
         "plain C++ and only the bool conversion of b.sum() < 0 breaks the graph)\n";
  {
    Tensor a10 = randn({10}), b10 = randn({10});
    compiler::ExplainOutput explanation =
        compiler::explain(toy_example, {.name = "toy_example", .arg_names = {"a", "b"}})(a10, b10);
    out << examples::stable_paths(explanation.str()) << "\n";
  }
  // fullgraph: throw at the first graph break (the FAQ's nopython=True).
  try {
    auto full = compile(toy_example, {.fullgraph = true, .name = "toy_example"});
    Tensor a10 = randn({10}), b10 = randn({10});
    full(a10, b10);
  } catch (const GraphBreakError& e) {
    out << examples::stable_paths(e.what()) << "\n";
  }

  out << "\n--- Why didn't my code recompile when I changed it? ---\n";
  // Dynamic shapes: after the first size change a dimension is dynamic, and later sizes reuse the
  // dynamic graph instead of recompiling (dynamic = true: dynamic from the first call).
  compiler::reset();
  {
    auto opt_model = compile(my_model);
    for (int64_t n : {8, 8, 16, 24, 32}) opt_model(randn({n}));
    out << "sizes 8, 8, 16, 24, 32: " << compiler::counters().graph_compiles
        << " compiles (static for 8, then dynamic from 16 on)\n";
  }
  compiler::reset();
  {
    auto opt_model = compile(my_model, {.dynamic = true});
    for (int64_t n : {8, 8, 16, 24, 32}) opt_model(randn({n}));
    out << "with dynamic = true: " << compiler::counters().graph_compiles << " compile\n";
  }
  compiler::reset();
  {
    auto opt_model = compile(my_model, {.dynamic = false});
    for (int64_t n : {8, 8, 16, 24, 32}) opt_model(randn({n}));
    out << "with dynamic = false: " << compiler::counters().graph_compiles << " compiles (one per size)\n";
  }

  out << "\n--- Does grad work with compile()? ---\n";
  // The FAQ's torch.func.grad inside torch.compile: autograd::grad inside a compiled function is
  // captured with the forward. Kiln has no vmap.
  auto wrapper_fn = [](const Tensor& t) {
    Tensor leaf = t.detach().requires_grad_();
    Tensor y = leaf.sin().sum();
    return autograd::grad({y}, {leaf})[0];
  };
  {
    compiler::reset();
    Tensor t = randn({3, 3, 3});
    Tensor grad_x = compile(wrapper_fn)(t);
    out << "grad of sin(x).sum() equals cos(x): " << py_bool(allclose(grad_x, cos(t))) << " (" << activity()
        << ")\n";
  }

  out << "\n--- Does NumPy work with compile()? ---\n";
  out << "(C++ has no NumPy: host code on data_ptr() is a graph break; see compile_tutorial's f3)\n";

  out << "\n--- Which API to use for fine grain tracing? ---\n";
  // disable: the function runs eagerly, with everything it calls; a graph break around it.
  auto helper = [](const Tensor& t) { return t.cos(); };
  auto eager_helper = compiler::disable(helper);
  auto fn = compile([&eager_helper](const Tensor& t) {
    Tensor y = t.sin();
    y = eager_helper(y);
    return y * 2;
  });
  Tensor t = randn({4});
  compiler::reset();
  out << "disable: same result: " << py_bool(allclose(fn(t), t.sin().cos() * 2)) << " (" << activity() << ")\n";

  // disable(fn, recursive=false): fn's own ops run eagerly, but compiled functions it calls
  // still compile (the FAQ's a_fn calling aa_fn and ab_fn).
  auto aa_fn = compile([](const Tensor& t) { return t * 3; });
  auto a_fn = [&aa_fn](const Tensor& t) { return aa_fn(t + 1); };
  auto outer = [](auto disabled_a_fn) {
    return compile([disabled_a_fn](const Tensor& t) mutable { return disabled_a_fn(t.sin()).cos(); });
  };
  compiler::reset();
  auto opt_recursive = outer(compiler::disable(a_fn));
  opt_recursive(t);
  out << "disable(a_fn): " << activity() << "\n";
  compiler::reset();
  auto opt_non_recursive = outer(compiler::disable(a_fn, /*recursive=*/false));
  opt_non_recursive(t);
  out << "disable(a_fn, recursive=false): " << activity() << " (aa_fn compiled its own graph)\n";

  // disallow_in_graph: an op, wherever it is called, runs eagerly between two graphs. Global:
  // undo it with allow_in_graph.
  auto h = compile([](const Tensor& t) { return (t.sin() * 2).cos(); });
  compiler::reset();
  compiler::disallow_in_graph("mul");
  try {
    Tensor r = h(t);
    compiler::allow_in_graph("mul");
    out << "disallow_in_graph(\"mul\"): same result: " << py_bool(allclose(r, (t.sin() * 2).cos())) << " ("
        << activity() << ")\n";
  } catch (...) {
    compiler::allow_in_graph("mul");
    throw;
  }
  try {
    compiler::disallow_in_graph("fbgemm");
  } catch (const ValueError& e) {
    out << e.what() << "\n";
  }

  // A custom op is one opaque node of the graph (the counterpart of allow_in_graph for code
  // compile() should not look into), and differentiable through its derivative.
  const compiler::CustomOp& cube = cube_op();
  auto print_graph = [&out](compiler::Graph& graph, const compiler::Arguments&) {
    graph.print_tabular(out);
    return compiler::interpreter(graph);
  };
  auto k = compile([&cube](const Tensor& t) { return cube.call1({t.sin()}) + 1; },
                   {.backend = print_graph, .arg_names = {"t"}});
  Tensor y = k(t);  // prints the graph: mylib::cube is one node
  out << "custom op: same result: " << py_bool(allclose(y, t.sin().pow(3) + 1)) << "\n";
  auto k_sum = compile([&cube](const Tensor& t) { return cube.call1({t.sin()}).sum(); });
  compiler::reset();
  Tensor tg = t.detach().requires_grad_();
  k_sum(tg).backward();
  out << "custom op: grad equals 3 sin(t)^2 cos(t): " << py_bool(allclose(tg.grad(), 3 * t.sin().pow(2) * t.cos()))
      << " (" << activity() << ")\n";

  // graph_break(): end the graph here.
  auto m = compile([](const Tensor& t) {
    Tensor y = t.sin();
    compiler::graph_break();
    return y.cos();
  });
  compiler::reset();
  out << "graph_break(): same result: " << py_bool(allclose(m(t), t.sin().cos())) << " (" << activity() << ")\n";
}
