// kiln::export_program — capture a function or module as one whole graph, save it with its weights
// and kernels as a package (one file), and load and run it in another process with no source and
// no compiler. docs/export.md is the user's guide.
//
//   kiln::ExportedProgram p = kiln::export_program(model, x);   // fn: any callable compile() takes
//   p.save("model.kpkg");
//   kiln::ExportedProgram q = kiln::load_program("model.kpkg"); // another process
//   std::vector<kiln::Tensor> out = q.run({x});
//
// What a program is: the graph compile() captures from one call of fn (fullgraph: a graph break is
// an error naming the user's file:line), its tensor arguments as inputs, every other tensor the
// graph reads (a module's parameters and buffers, an optimizer's state, tensors a lambda captured)
// as named weights stored in the package, and the tensors fn returns as outputs. Numbers and
// modules among fn's arguments are fixed at their example values. Dimensions marked with
// compiler::mark_dynamic or ExportOptions::dynamic stay dynamic: the program then runs at every
// size in their range without fn.
//
// Thread safety: a program may be run from many threads at once. Runs of a program that writes
// its weights (a training step) take turns; others run side by side.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <source_location>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "kiln/compiler.h"
#include "kiln/io.h"

namespace kiln {

// A dimension of one of fn's tensor arguments that the program keeps dynamic.
struct ExportDim {
  int arg = 0;        // which argument of fn (of forward's, for a module), counting from 0
  int64_t dim = 0;    // negative counts from the end
  // Dimensions with one name are one size (they must be equal at run time); empty: the name is
  // "<argument name>_dim<dim>", its own size.
  std::string name;
  compiler::DimRange range;  // default: from 2, no upper bound
};

struct ExportOptions {
  // Dynamic dimensions, besides those marked with compiler::mark_dynamic on the arguments.
  std::vector<ExportDim> dynamic;
  // fn runs backward() and an optimizer step itself (a training step): capture with gradients
  // enabled. Otherwise (inference) the capture runs under NoGradGuard.
  bool training = false;
  // The kiln backend's mode and options, as CompileOptions takes them; kept in the package.
  std::optional<Mode> mode;
  std::map<std::string, compiler::OptionValue> options;
  // The program's name (default: "fn", or the module's class name) and its arguments' names
  // (default "arg0", "arg1", ...; "self" is the module itself).
  std::string name;
  std::vector<std::string> arg_names;
};

// One input, output or weight of a program.
struct TensorSpec {
  std::string name;
  DType dtype = DType::float32;
  Device device;
  std::vector<int64_t> sizes;     // at the example (export) sizes
  std::vector<std::string> dims;  // per dimension: its size as text, or a dynamic dimension's name
};

// A dynamic dimension: the values the program accepts.
struct DynamicDimSpec {
  std::string name;
  int64_t min = 2;
  int64_t max = 0;      // inclusive; INT64_MAX: no bound
  int64_t example = 0;  // the size at export
};

// A package file that Kiln refuses: not a package, damaged, from a newer format, or holding
// something this Kiln cannot run (an unknown op, a schema it does not know).
class PackageError : public Error {
  using Error::Error;
};

namespace detail {
struct Program;
}

class ExportedProgram {
 public:
  ExportedProgram() = default;  // an empty program: run() and save() throw ValueError
  explicit ExportedProgram(std::shared_ptr<detail::Program> program) : p_(std::move(program)) {}

  // Runs the program. `inputs`: one tensor per tensor argument of fn, in order. Each is checked
  // against its spec (dtype, device, rank, static sizes, dynamic sizes within their range and
  // equal where they share a name): ValueError names the input and what differs. Inputs with
  // another layout than the program's are copied to it. Returns the tensors fn returned, in order.
  // The first run at new dynamic sizes builds that size's code (its kernels come from the
  // package when they fit this machine).
  std::vector<Tensor> run(const std::vector<Tensor>& inputs) const;
  // A training step with the caller's state: `state` holds a tensor for every weight (by name,
  // as weights() lists them, with their spec's dtype, device and sizes), used instead of the
  // program's own and updated in place, as the step updates parameters and optimizer state.
  std::vector<Tensor> run(const std::vector<Tensor>& inputs, const NamedTensors& state) const;

  // Writes the package: one file, replaced atomically. Throws kiln::Error when it cannot.
  void save(const std::string& path) const;

  const std::string& name() const;
  const std::vector<TensorSpec>& inputs() const;
  const std::vector<TensorSpec>& outputs() const;
  const std::vector<TensorSpec>& weights() const;
  const std::vector<DynamicDimSpec>& dynamic_dims() const;
  // The weights the program runs with (its own tensors, not copies: a training step updates them).
  NamedTensors state() const;
  // The graph at the example sizes.
  const compiler::Graph& graph() const;
  // Whether the program writes its weights (a training step).
  bool writes_weights() const;
  // What `kiln export-info` prints: inputs, outputs, dynamic dims, weights, ops, kernels, sizes,
  // and where it was built.
  std::string summary() const;

  bool defined() const { return p_ != nullptr; }

 private:
  const detail::Program& program(const char* api) const;
  std::shared_ptr<detail::Program> p_;
};

// Loads a package written by ExportedProgram::save. Every section's SHA-256 is checked before
// anything in it is used; the graph is validated op by op against this Kiln's op table; bundled
// kernel binaries are used when they were built for this Kiln and this CPU (or GPU), and rebuilt
// from the bundled sources otherwise (which then needs a C++ compiler, or NVRTC for CUDA). Throws
// PackageError naming the file and the problem.
struct LoadOptions {
  // Use the kernel binaries the package carries when they were built for this Kiln and fit this
  // machine (the default). false: build every kernel here from the graph (which needs a C++
  // compiler), so that no code from the package runs; as a package's binaries are code, load
  // packages from people you would take a shared library from, or turn this off.
  bool bundled_binaries = true;
};
ExportedProgram load_program(const std::string& path, const LoadOptions& options = {});

// ------------------------------------------------------------------------------------------
// Repro and minify (docs/export.md, "Repro and minify")
// ------------------------------------------------------------------------------------------
//
// KILN_REPRO=compile: when a backend fails to compile a graph, compile() writes a repro package
// (the graph and its inputs) to $KILN_REPRO_DIR (default ./kiln_repro) and names it in the error.
// KILN_REPRO=accuracy: the first call of each compiled graph is also run op by op on copies of its
// inputs; an output that differs beyond the tolerance (1e-3; 1e-2 for 16-bit floats) writes a
// repro package and logs where. `kiln minify repro.kpkg` then shrinks it.

namespace compiler {

struct MinifyResult {
  std::string kind;     // "compile" or "accuracy"
  Graph graph;          // the smallest graph found that still fails
  std::string failure;  // its error, or the output that differs and by how much
  // The op of the node making the first differing output ("tanh (node %tanh)"); for a compile
  // failure, the ops of the smallest graph.
  std::string failing_op;
  // Passes with which disabled (KILN_DISABLE_PASSES) the smallest graph compiles and is right:
  // the pass that broke it. Empty: no single pass (look at lowering and code generation).
  std::vector<std::string> breaking_passes;
  int original_nodes = 0;
  int tests = 0;                // graphs compiled and run while minifying
  std::string minimized_path;   // where the smallest graph was written as a repro, if asked
  std::string str() const;      // what `kiln minify` prints
};

// Shrinks the repro package at `repro_path` by delta debugging over its nodes to a smallest graph
// that still fails the same way (a compile error, or an output that differs from eager), then
// tries the pipeline with each pass disabled. Writes that graph as a repro package to `out_path`
// when it is not empty. Throws PackageError for a file that is not a repro package, CompileError
// when the graph does not fail here.
MinifyResult minify(const std::string& repro_path, const std::string& out_path = "");

}  // namespace compiler

namespace detail {

// The non-template half of export_program.
struct ExportCall {
  // Per argument of fn: the tensor, or an undefined tensor for other arguments.
  std::vector<Tensor> tensor_args;
  // Calls fn once through compile(options) with tensor argument k replaced by replacement[k]
  // where that is defined; returns the tensors of fn's result, in order.
  std::function<std::vector<Tensor>(CompileOptions options, const std::vector<Tensor>& replacement)> call;
  bool is_module = false;  // fn is a module: its own parameters are "self.*"
  std::string default_name;
};
ExportedProgram export_program_impl(ExportCall call, ExportOptions options, std::source_location loc);

template <class T>
std::vector<Tensor> result_tensors(const T& result) {
  std::vector<compiler::detail::Leaf> leaves;
  compiler::detail::LeafSink sink{&leaves};
  compiler::detail::flatten(sink, result);
  std::vector<Tensor> out;
  for (const auto& l : leaves)
    if (l.kind == compiler::detail::Leaf::tensor) out.push_back(l.t);
  return out;
}

template <class A>
decltype(auto) replaced(A& arg, const std::vector<Tensor>& replacement, size_t k) {
  if constexpr (std::is_same_v<std::remove_cvref_t<A>, Tensor>) {
    return replacement[k].defined() ? replacement[k] : arg;
  } else {
    return (arg);
  }
}

template <class F, class Tuple, size_t... I>
ExportedProgram export_tuple(F fn, const Tuple& args, ExportOptions options, std::source_location loc,
                             std::index_sequence<I...>) {
  ExportCall call;
  call.tensor_args = {[](const auto& a) {
    if constexpr (std::is_same_v<std::remove_cvref_t<decltype(a)>, Tensor>) return Tensor(a);
    else return Tensor();
  }(std::get<I>(args))...};
  call.is_module = compiler::detail::is_shared_ptr<F>::value;
  if constexpr (compiler::detail::is_shared_ptr<F>::value) {
    call.default_name = fn->name();
  } else {
    call.default_name = "fn";
  }
  call.call = [fn, &args, loc](CompileOptions o, const std::vector<Tensor>& replacement) {
    auto compiled = kiln::compile(fn, std::move(o), loc);
    if constexpr (std::is_void_v<decltype(compiled(replaced(std::get<I>(args), replacement, I)...))>) {
      compiled(replaced(std::get<I>(args), replacement, I)...);
      return std::vector<Tensor>{};
    } else {
      return result_tensors(compiled(replaced(std::get<I>(args), replacement, I)...));
    }
  };
  return export_program_impl(std::move(call), std::move(options), loc);
}

template <class T>
inline constexpr bool is_export_options_v = std::is_same_v<std::remove_cvref_t<T>, ExportOptions>;

}  // namespace detail

// Captures fn(args...) as one whole graph (see the header comment) and returns the program, ready
// to run() or save(). The last argument may be ExportOptions. fn runs once per capture: once for
// static programs, and 2^d + 1 times for d dynamic dimensions (at nearby sizes, with generated
// inputs), to learn how each size in the graph depends on them; the user's tensors are never
// written (a training step's updates go to copies). Throws GraphBreakError at a graph break,
// CompileError when the graph depends on a dynamic size in a way a program cannot follow.
template <class F, class... Args>
ExportedProgram export_program(F fn, Args&&... args) {
  const std::source_location loc = std::source_location::current();
  std::tuple<std::remove_reference_t<Args>&...> all(args...);
  constexpr size_t n = sizeof...(Args);
  if constexpr (n > 0 && detail::is_export_options_v<std::tuple_element_t<n - 1, std::tuple<Args...>>>) {
    ExportOptions options = std::get<n - 1>(all);
    return detail::export_tuple(std::move(fn), all, std::move(options), loc, std::make_index_sequence<n - 1>());
  } else {
    return detail::export_tuple(std::move(fn), all, ExportOptions{}, loc, std::make_index_sequence<n>());
  }
}

}  // namespace kiln
