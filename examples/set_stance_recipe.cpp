// The torch.compiler.set_stance recipe and API page, in C++: one compiled function whose
// behaviour changes from call to call with the stance (decorator, scope and function forms),
// the errors for changing the stance inside compiled code, fail_on_recompile and
// eager_on_recompile, timing eager against compiled without a second model, and running one
// eager iteration first to find a bug before compiling.
//
// Where Python prints a Dynamo-internal error ("Attempt to trace forbidden callable"), Kiln
// prints its own words; file paths in messages are shown relative to the repository.
#include <kiln/kiln.h>

#include <chrono>
#include <iomanip>
#include <sstream>
#include <string>

#include "example.h"

using namespace kiln;

namespace {

// Seconds `fn()` took (the recipe times with CUDA events; on the CPU a steady clock does).
template <class F>
double timed(F&& fn) {
  auto start = std::chrono::steady_clock::now();
  fn();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

std::string seconds(double s) {
  std::ostringstream os;
  os << std::fixed << std::setprecision(6) << s;
  return os.str();
}

}  // namespace

KILN_EXAMPLE(set_stance_recipe, 20, "Dynamic compilation control with compiler::set_stance") {
  compiler::reset();
  manual_seed(0);

  out << "--- Description ---\n";
  // is_compiling() tells the two paths apart: +1 when compiled, -1 when run eagerly.
  auto foo = compile([](const Tensor& x) {
    if (compiler::is_compiling()) {
      return x + 1;  // compile() is active
    }
    return x - 1;  // compile() is not active
  });

  Tensor inp = zeros({3});
  out << foo(inp) << "\n";  // compiled, prints 1

  // The decorator form: bar always runs with the force_eager stance on this thread.
  auto bar = compiler::with_stance(Stance::force_eager, [&](const Tensor& x) {
    return foo(x);  // force disable the compiler
  });
  out << bar(inp) << "\n";  // not compiled, prints -1

  // The context-manager form: a scope.
  {
    compiler::StanceGuard guard(Stance::force_eager);
    out << foo(inp) << "\n";  // not compiled, prints -1
  }

  // The raw function form: process-wide until changed back.
  compiler::set_stance(Stance::force_eager);
  out << foo(inp) << "\n";  // not compiled, prints -1
  compiler::set_stance(Stance::default_);
  out << foo(inp) << "\n";  // compiled, prints 1

  // The string form of the API page validates the name at once.
  compiler::set_stance("force_eager");
  out << foo(inp) << "\n";  // not compiled, prints -1
  compiler::set_stance("default");
  try {
    compiler::set_stance("eager");
  } catch (const ValueError& e) {
    out << e.what() << "\n";
  }

  out << "\n--- Changing the stance inside a compiled region ---\n";
  auto baz = compile([](const Tensor& x) {
    compiler::StanceGuard guard(Stance::force_eager);  // error!
    return x + 1;
  });
  try {
    baz(inp);
  } catch (const Error& e) {
    out << examples::stable_paths(e.what()) << "\n";
  }

  auto inner = compiler::with_stance(Stance::force_eager, [](const Tensor& x) { return x + 1; });
  auto outer = compile([&](const Tensor& x) {
    return inner(x);  // error!
  });
  try {
    outer(inp);
  } catch (const Error& e) {
    out << examples::stable_paths(e.what()) << "\n";
  }

  out << "\n--- Other stances ---\n";
  for (Stance s : {Stance::default_, Stance::force_eager, Stance::eager_on_recompile, Stance::fail_on_recompile,
                   Stance::eager_then_compile, Stance::aot_eager_then_compile}) {
    out << compiler::stance_name(s) << "\n";
  }
  // force_backend: compile with another registered backend, with the default stance only.
  try {
    compiler::set_stance(Stance::force_eager, {.force_backend = "aot_eager"});
  } catch (const ValueError& e) {
    out << e.what() << "\n";
  }
  {
    compiler::reset();
    compiler::StanceGuard guard(Stance::default_, {.force_backend = "aot_eager"});
    out << foo(inp) << "\n";  // compiled again, by aot_eager this time
    for (const auto& phase : compiler::compile_time_table()) out << "compiled by: " << phase.phase << "\n";
  }

  out << "\n--- Preventing recompilation ---\n";
  auto my_big_model = compile([](const Tensor& x) { return relu(x); },
                              {.name = "my_big_model", .arg_names = {"x"}});
  my_big_model(randn({3}));  // first compilation
  {
    compiler::StanceGuard guard(Stance::fail_on_recompile);
    my_big_model(randn({3}));  // no recompilation - OK
    try {
      my_big_model(randn({4}));  // recompilation - error
    } catch (const RecompileError& e) {
      out << examples::stable_paths(e.what()) << "\n";
    }
  }

  // eager_on_recompile: cached entries still serve their inputs, a miss runs eagerly.
  auto my_huge_model = compile([](const Tensor& x) {
    if (compiler::is_compiling()) return x + 1;
    return x - 1;
  });
  out << my_huge_model(zeros({3})) << "\n";  // 1 (first compilation)
  {
    compiler::StanceGuard guard(Stance::eager_on_recompile);
    out << my_huge_model(zeros({3})) << "\n";  // 1
    out << my_huge_model(zeros({4})) << "\n";  // -1
    out << my_huge_model(zeros({3})) << "\n";  // 1
  }

  // skip_guard_eval_unsafe: once warmed up on every signature it will see, check only the guards
  // that told the entries apart (here the size). Unsafe: a call that differs elsewhere would
  // silently run the wrong entry.
  {
    compiler::StanceGuard guard(Stance::default_, {.skip_guard_eval_unsafe = true});
    out << my_huge_model(zeros({4})) << "\n";  // compiles the second entry: 1
    out << my_huge_model(zeros({3})) << "\n";  // 1
  }

  out << "\n--- Measuring performance gains ---\n";
  auto my_gigantic_model = compile([](const Tensor& x0, const Tensor& y) {
    Tensor x = matmul(x0, y);
    x = matmul(x, y);
    x = matmul(x, y);
    return x;
  });
  Tensor a = randn({5, 5}), b = randn({5, 5});
  {
    compiler::StanceGuard guard(Stance::force_eager);
    out << "eager: " << seconds(timed([&] { my_gigantic_model(a, b); })) << "\n";
  }
  for (int i = 0; i < 3; ++i) my_gigantic_model(a, b);  // warmups
  out << "compiled: " << seconds(timed([&] { my_gigantic_model(a, b); })) << "\n";

  out << "\n--- Crashing sooner ---\n";
  // Python's torch.sin(x, x) fails when called; in C++ that would not compile, so the bug here is
  // a view of 3 elements as 2x2, which fails at run time. The eager iteration finds it at once,
  // before any compile.
  auto my_humongous_model = compile([](const Tensor& x) { return sin(x).view({2, 2}); });
  int64_t compiles_before = compiler::counters().graph_compiles;
  try {
    {
      compiler::StanceGuard guard(Stance::force_eager);
      out << my_humongous_model(randn({3})) << "\n";
    }
    // this call to the compiled model won't run
    out << my_humongous_model(randn({3})) << "\n";
  } catch (const Error& e) {
    out << e.what() << "\n";
  }
  out << "graphs compiled meanwhile: " << compiler::counters().graph_compiles - compiles_before << "\n";
}
