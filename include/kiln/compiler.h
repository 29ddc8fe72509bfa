// kiln::compile — capture the tensor work of ordinary C++ code, guard it, and run it through a
// backend; steer it at run time with stances. docs/compiler.md is the user's guide.
//
//   auto opt_foo = kiln::compile(foo);            // any callable
//   auto opt_model = kiln::compile(model);        // a std::shared_ptr to an nn::Module
//   kiln::compiler::set_stance(kiln::Stance::force_eager);
//
// How a call runs (DESIGN §2.3): the frame guards of the arguments and global state pick a cache
// entry before the body runs; the C++ body then runs with a capture context on this thread, so
// op calls return lazy tensors (full metadata, no data) that are recorded into a segment. A host
// read (item, bool conversion, data_ptr, to_vector, printing), a non-capturable op,
// compiler::graph_break(), a call into a compiler::disable()d function, or the end of the call
// flushes the segment: its graph is looked up by structure in the function's cache (compiled by
// the backend on a miss), run, and the lazy tensors become real. Host side effects therefore
// happen on every call, exactly as in eager; `pure = true` lets a stable one-graph frame skip the
// body and replay the compiled graph.
//
// Thread safety: compiled callables may be called from many threads at once. Capture contexts are
// per thread; caches are shared and locked; a new graph compiles once while other callers of the
// same graph wait for it.
#pragma once

#include <concepts>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <source_location>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include "kiln/compiler/graph.h"
#include "kiln/nn/module.h"
#include "kiln/optim.h"
#include "kiln/tensor.h"

namespace kiln {

// ------------------------------------------------------------------------------------------
// Options
// ------------------------------------------------------------------------------------------

enum class Mode { default_, reduce_overhead, max_autotune, max_autotune_no_cudagraphs };

namespace compiler {
// A backend: turns a captured graph and example inputs into a callable.
using BackendFn = std::function<CompiledFn(Graph& graph, const Arguments& example_inputs)>;
using OptionValue = std::variant<bool, int64_t, double, std::string>;
}  // namespace compiler

struct CompileOptions {
  // Throw GraphBreakError at the first graph break instead of splitting the capture.
  bool fullgraph = false;
  // Dynamic shapes (docs/compiler.md, "Dynamic shapes"), as torch.compile's `dynamic=`:
  //   nullopt (default): compile static first; a recompile caused by a size change marks the sizes
  //     that changed dynamic and compiles once more for all of them (automatic dynamic);
  //   true: every size of every tensor argument is dynamic from the first compile;
  //   false: always specialize (one compile per new size, until the recompile limit).
  // Sizes 0 and 1 always specialize: a dynamic size serves every value >= 2.
  std::optional<bool> dynamic;
  // A registered backend name ("eager", "aot_eager", a custom one), or a backend function.
  // Empty: compiler::default_backend().
  std::variant<std::string, compiler::BackendFn> backend;
  // Either a mode or options, not both (like torch.compile). Options (bool values):
  // "fallback_to_eager" (a graph the backend fails to compile runs op by op, with a warning),
  // "layout_optimization" (kiln backend, default true: convolution activations run channels-last).
  std::optional<Mode> mode;
  std::map<std::string, compiler::OptionValue> options;
  // Replay a stable one-graph frame without running the body (see the header comment).
  bool pure = false;
  // Names used in logs, explain() and errors. Default: "fn" (the module's class name for modules)
  // and "arg0", "arg1", ... for the arguments.
  std::string name;
  std::vector<std::string> arg_names;
  // Cache entries per compiled function (per module instance); default compiler::recompile_limit().
  std::optional<int> recompile_limit;
};

enum class Stance {
  default_,                // compile on a cache miss
  force_eager,             // ignore every compile(): run the C++ body eagerly
  eager_on_recompile,      // serve cached entries, run misses eagerly (nothing compiles)
  fail_on_recompile,       // serve cached entries, throw RecompileError on a miss
  eager_then_compile,      // the first miss of a function runs eagerly, later misses compile
  aot_eager_then_compile,  // the first miss compiles with aot_eager, later misses with the backend
};

struct StanceOptions {
  // Check only the guards that have told entries apart (failed at least once). Unsafe: a call
  // that differs in an unchecked property silently runs the wrong entry.
  bool skip_guard_eval_unsafe = false;
  // With Stance::default_ only: compile with this registered backend instead of the function's.
  std::string force_backend;
};

namespace compiler {

// ------------------------------------------------------------------------------------------
// Stances (DESIGN §2.4)
// ------------------------------------------------------------------------------------------

// Process-wide stance, until changed. Throws inside a compiled region.
void set_stance(Stance stance, StanceOptions options = {},
                std::source_location loc = std::source_location::current());
// The string form ("default", "force_eager", ...): validates at once and lists the valid names.
void set_stance(std::string_view stance, StanceOptions options = {},
                std::source_location loc = std::source_location::current());
// The stance in effect on this thread (its innermost StanceGuard, else the process-wide one).
Stance current_stance();
std::string_view stance_name(Stance s);
Stance parse_stance(std::string_view name);

// Sets the stance for this thread until destroyed. Throws inside a compiled region.
class StanceGuard {
 public:
  explicit StanceGuard(Stance stance, StanceOptions options = {},
                       std::source_location loc = std::source_location::current());
  explicit StanceGuard(std::string_view stance, StanceOptions options = {},
                       std::source_location loc = std::source_location::current());
  ~StanceGuard();
  StanceGuard(const StanceGuard&) = delete;
  StanceGuard& operator=(const StanceGuard&) = delete;

 private:
  bool active_ = false;
};

// The decorator form: fn, called with `stance` in effect on the calling thread.
template <class F>
auto with_stance(Stance stance, F fn, StanceOptions options = {},
                 std::source_location loc = std::source_location::current()) {
  return [stance, fn = std::move(fn), options, loc](auto&&... args) mutable -> decltype(auto) {
    StanceGuard guard(stance, options, loc);
    return fn(std::forward<decltype(args)>(args)...);
  };
}

// True while this thread captures for a compiled function (false in force_eager, in eager
// fallbacks and inside compiler::disable()).
bool is_compiling();

// ------------------------------------------------------------------------------------------
// Dynamic shapes (DESIGN §2.6; docs/compiler.md, "Dynamic shapes")
// ------------------------------------------------------------------------------------------

// Inclusive bounds for a dynamic size; unset: from 2 (sizes 0 and 1 always specialize), no upper
// bound.
struct DimRange {
  std::optional<int64_t> min;
  std::optional<int64_t> max;
};

// Marks dimension `dim` of `t` dynamic for the compile that a call with `t` as an argument causes:
// that entry then serves every size of the dimension within `range` without recompiling, whatever
// CompileOptions::dynamic says. Throws ValueError for a bad dim or a range that excludes t's size;
// the call that compiles throws CompileError naming the reason when the dimension is specialized
// anyway (its size is 0 or 1). Throws CompileError inside a compiled region, as torch does.
void mark_dynamic(const Tensor& t, int64_t dim, DimRange range = {});
// As mark_dynamic, without the error: a dimension of size 0 or 1 specializes silently.
void maybe_mark_dynamic(const Tensor& t, int64_t dim);
// Keeps dimension `dim` of `t` (every dimension: nullopt) static in the compile a call with `t`
// causes, even with dynamic = true or after automatic dynamic marked it. Throws ValueError for a
// bad dim, CompileError inside a compiled region (the entry is chosen before the body runs, so a
// mark made there could not apply to it).
void mark_static(const Tensor& t, std::optional<int64_t> dim = std::nullopt);

// ------------------------------------------------------------------------------------------
// Escape hatches (DESIGN §2.3)
// ------------------------------------------------------------------------------------------

// Ends the current graph here (no-op outside compiled code).
void graph_break(std::string_view reason = "", std::source_location loc = std::source_location::current());

// Makes op `name` (an op-table name, e.g. "mul" or a custom op) break the graph at every call:
// compiled code runs it eagerly. Throws ValueError for an unknown op.
void disallow_in_graph(std::string_view op_name);
// Undoes disallow_in_graph.
void allow_in_graph(std::string_view op_name);
bool is_disallowed_in_graph(const OpDef& op);

namespace detail {
// Flushes the capture (a graph break) and suspends it while alive. recursive: compiled
// functions called inside run eagerly too.
class DisabledScope {
 public:
  DisabledScope(bool recursive, std::string_view reason, std::source_location loc);
  ~DisabledScope();
  DisabledScope(const DisabledScope&) = delete;
  DisabledScope& operator=(const DisabledScope&) = delete;

 private:
  void* saved_capture_ = nullptr;
  bool recursive_;
};
}  // namespace detail

// fn wrapped so that it always runs eagerly. Called from compiled code it is a graph break, and
// the capture resumes after it returns. recursive = false: compiled functions that fn calls still
// compile (only fn's own code runs eagerly).
template <class F>
auto disable(F fn, bool recursive = true, std::string_view reason = "",
             std::source_location loc = std::source_location::current()) {
  return [fn = std::move(fn), recursive, reason = std::string(reason), loc](auto&&... args) mutable -> decltype(auto) {
    detail::DisabledScope scope(recursive, reason, loc);
    return fn(std::forward<decltype(args)>(args)...);
  };
}

// A user op captured as one opaque node (the counterpart of allow_in_graph / a custom op):
// meta gives output metadata, kernels compute, derivative (optional) makes it differentiable.
struct CustomOpDef {
  std::string name;    // op-table name; must be new, e.g. "mylib::dct"
  std::string schema;  // shown by `kiln ops`, e.g. "mylib::dct(Tensor x) -> Tensor"
  MetaFn meta;
  Kernel cpu_kernel;
  Kernel cuda_kernel;  // optional
  Derivative derivative;  // optional
};

class CustomOp {
 public:
  explicit CustomOp(const OpDef* op) : op_(op) {}
  std::vector<Tensor> operator()(std::vector<Tensor> inputs, std::vector<Attr> attrs = {}) const;
  Tensor call1(std::vector<Tensor> inputs, std::vector<Attr> attrs = {}) const;
  const OpDef& def() const { return *op_; }

 private:
  const OpDef* op_;
};

// Registers a custom op in the op table. Throws ValueError for a duplicate name or missing
// meta/kernel.
CustomOp custom_op(CustomOpDef def);

// ------------------------------------------------------------------------------------------
// Backends (DESIGN §2.5)
// ------------------------------------------------------------------------------------------

// Registers `fn` under `name` (throws ValueError if taken). Tags: "debug" backends are hidden by
// list_backends() unless asked for, as in torch._dynamo; "aot_autograd" backends get the
// saved-value partition (a forward whose backward runs later saves only what the backward cannot
// cheaply recompute; aot_eager and kiln carry it, as torch's aot_autograd wrapper adds it).
void register_backend(std::string name, BackendFn fn, std::vector<std::string> tags = {});
// Registered names, sorted, without those tagged with any of `exclude_tags`.
std::vector<std::string> list_backends(const std::vector<std::string>& exclude_tags = {"debug", "experimental"});
// Throws CompileError "Invalid backend: 'x', see kiln::compiler::list_backends() ...".
BackendFn lookup_backend(std::string_view name);
// The backend CompileOptions{} uses: "kiln" (generated C++ kernels), like torch.compile's inductor.
std::string default_backend();
void set_default_backend(std::string name);

// The options of the compile() whose graph a backend is compiling right now (on this thread), or
// nullptr outside a backend call: lets a backend read `mode` and `options`.
const CompileOptions* compiling_options();

// Clears every in-memory compile cache and statistic (never a disk cache), as if the process
// had just started; compiled callables stay usable and recompile on their next call.
void reset();

// ------------------------------------------------------------------------------------------
// Configuration and observability (DESIGN §2.7)
// ------------------------------------------------------------------------------------------

// Entries per compiled function or module instance (default 8); past it, new signatures run
// eagerly after one warning (fullgraph: RecompileError).
int recompile_limit();
void set_recompile_limit(int limit);

// Which logs go to the log stream. KILN_LOGS=graph_breaks,recompiles,guards,graph,output_code,
// perf_hints,passes (or "all") sets the initial value.
struct LogOptions {
  bool graph_breaks = false;
  bool recompiles = false;
  bool guards = false;
  bool graph = false;
  bool output_code = false;
  bool perf_hints = false;
  bool passes = false;  // one line per graph pass a backend runs: name, time, nodes before and after
  bool dynamic = false;  // dynamic shapes: which sizes became dynamic and why, new sizes of a dynamic graph
};
void set_logs(const LogOptions& logs);
LogOptions logs();
// Where logs and warnings go (default std::cerr). Not owned; nullptr restores std::cerr.
void set_log_stream(std::ostream* os);

// The structured compile trace (docs/compile-trace.md): compile events (frames, graphs with each
// op's file:line, breaks, guards, recompiles, passes, generated sources, kernel-cache hits and
// builds, CUDA graph records) appended as JSON lines to a new file in `dir`, which `kiln report`
// turns into an HTML page. `dir` is created (mode 0700) when missing; the file is created 0600
// and never follows a symlink. Returns the file's path; throws kiln::Error when it cannot be
// created. An empty `dir` ends the trace. KILN_TRACE_DIR=dir at start-up does the same.
// While a trace is on, every captured op costs a stack walk (a few microseconds).
std::string set_trace_dir(const std::string& dir);
// The file the trace is being written to, "" when no trace is on.
std::string trace_file();

// Compile-time statistics by phase, Dynamo's compile_times(): "Kiln compilation metrics:" then
// a table of phase | runtimes (s).
std::string compile_times();
struct PhaseTimes {
  std::string phase;
  std::vector<double> seconds;
};
std::vector<PhaseTimes> compile_time_table();

// Counters since the last reset(): frames captured, graphs compiled, cache hits, graph breaks,
// eager fallbacks.
struct Counters {
  int64_t calls = 0;
  int64_t frame_compiles = 0;   // new frame entries (first compiles and recompiles)
  int64_t graph_compiles = 0;   // backend compiles
  int64_t graph_cache_hits = 0;
  int64_t graph_runs = 0;
  int64_t graph_breaks = 0;
  int64_t eager_frames = 0;     // calls whose body ran eagerly (stances, limits)
  int64_t replays = 0;          // pure calls that skipped the body
  int64_t kernel_runs = 0;      // generated kernels run (kiln backend)
  int64_t dispatched_nodes = 0; // graph nodes the kiln backend ran through the eager dispatcher
  int64_t recomputed_values = 0; // saved tensors a forward graph left for its backward to recompute
                                 // (the min-cut partition: aot_eager and kiln backends)
  int64_t cuda_graph_captures = 0; // CUDA graphs recorded (kiln backend, reduce_overhead on a GPU)
  int64_t cuda_graph_replays = 0;  // calls served by replaying one
  int64_t cuda_graph_output_copies = 0; // replayed outputs returned in new memory: the caller still
                                        // held the graph's buffer from an earlier call (or the
                                        // output has gaps); the others are the graph's buffers
  int64_t kernel_builds = 0;    // kernel sources built by the system C++ compiler or NVRTC because the
                                // kernel cache did not have them (generated and eager CUDA kernels)
  int64_t size_specializations = 0;  // a dynamic graph met at a new concrete size: the backend ran
                                     // again for it, its kernels came from the kernel cache (not
                                     // counted in graph_compiles)
  int64_t guided_captures = 0;  // graphs a capture found by following the graph its frame entry
                                // ran before, without building a graph (also cache hits; see
                                // "Guided capture" in docs/compiler.md)
};
Counters counters();

// A graph break as explain() and the logs report it.
struct BreakReason {
  std::string reason;
  std::string file;  // the user's file and line; empty when unknown
  int line = 0;
  std::string function;
  std::string where() const;  // "file:line in function"
};

struct ExplainOutput {
  std::vector<Graph> graphs;
  int graph_count = 0;
  int graph_break_count = 0;
  std::vector<BreakReason> break_reasons;
  int op_count = 0;
  std::vector<std::vector<std::string>> ops_per_graph;
  std::vector<std::string> out_guards;
  std::string compile_times;
  std::string str() const;  // printed like torch._dynamo.explain's output
};
std::ostream& operator<<(std::ostream& os, const ExplainOutput& e);

// Records why compiled functions recompile: which guard failed, how often. Observation-only:
// while alive it receives every recompile of every compiled function; its backend() runs graphs
// op by op and counts them.
class RecompileProfiler {
 public:
  RecompileProfiler();
  ~RecompileProfiler();
  RecompileProfiler(const RecompileProfiler&) = delete;
  RecompileProfiler& operator=(const RecompileProfiler&) = delete;
  BackendFn backend();
  int frame_count() const;
  int op_count() const;
  std::string report() const;

  struct Impl;

 private:
  std::shared_ptr<Impl> impl_;
};

// ------------------------------------------------------------------------------------------
// The runtime behind compile() (internal; the templates below call it)
// ------------------------------------------------------------------------------------------

namespace detail {

// One flattened argument or result: a tensor, a number, a string, a module or an optimizer.
struct Leaf {
  enum Kind : uint8_t { tensor, integer, floating, boolean, string, module, optimizer, none };
  Kind kind = none;
  Tensor t;  // a reference, so that a body that moves from its argument leaves this intact
  int64_t i = 0;
  double d = 0;
  const std::string* s = nullptr;
  const void* object = nullptr;
  uint64_t version = 0;  // module structure version
};

// Dotted/indexed names of the leaves ("arg0", "arg1[2]", "arg2.first").
struct LeafPath {
  std::vector<std::string> parts;
  std::string str() const;
};

template <class T> struct always_false : std::false_type {};
template <class T> struct is_optional : std::false_type {};
template <class T> struct is_optional<std::optional<T>> : std::true_type {};
template <class T> struct is_vector : std::false_type {};
template <class T, class A> struct is_vector<std::vector<T, A>> : std::true_type {};
template <class T> struct is_tuple_like : std::false_type {};
template <class... T> struct is_tuple_like<std::tuple<T...>> : std::true_type {};
template <class A, class B> struct is_tuple_like<std::pair<A, B>> : std::true_type {};
template <class T> struct is_shared_ptr : std::false_type {};
template <class T> struct is_shared_ptr<std::shared_ptr<T>> : std::true_type {};

// "[k]" (built with += : GCC 12 warns falsely on `"[" + std::to_string(k) + "]"` here).
inline std::string index_part(size_t k) {
  std::string s = "[";
  s += std::to_string(k);
  s += ']';
  return s;
}

// Visits the leaves of a value. Sink: leaf(const Leaf&), and enter(std::string)/leave() when it
// wants names (Sink::kNames).
template <class Sink, class T>
void flatten(Sink& sink, const T& v) {
  using U = std::remove_cvref_t<T>;
  if constexpr (std::is_same_v<U, Tensor>) {
    Leaf l;
    l.kind = v.defined() ? Leaf::tensor : Leaf::none;
    l.t = v;
    sink.leaf(l);
  } else if constexpr (std::is_same_v<U, bool>) {
    Leaf l;
    l.kind = Leaf::boolean;
    l.i = v;
    sink.leaf(l);
  } else if constexpr (std::is_integral_v<U> || std::is_enum_v<U>) {
    Leaf l;
    l.kind = Leaf::integer;
    l.i = static_cast<int64_t>(v);
    sink.leaf(l);
  } else if constexpr (std::is_floating_point_v<U>) {
    Leaf l;
    l.kind = Leaf::floating;
    l.d = static_cast<double>(v);
    sink.leaf(l);
  } else if constexpr (std::is_same_v<U, std::string>) {
    Leaf l;
    l.kind = Leaf::string;
    l.s = &v;
    sink.leaf(l);
  } else if constexpr (std::is_same_v<U, Scalar>) {
    Leaf l;
    l.kind = v.is_floating_point() ? Leaf::floating : v.is_boolean() ? Leaf::boolean : Leaf::integer;
    l.d = v.to_double();
    l.i = v.is_floating_point() ? 0 : v.to_int();
    sink.leaf(l);
  } else if constexpr (std::is_base_of_v<nn::Module, U>) {
    Leaf l;
    l.kind = Leaf::module;
    l.object = &v;
    l.version = v.structure_version();
    sink.leaf(l);
  } else if constexpr (std::is_base_of_v<optim::Optimizer, U>) {
    Leaf l;
    l.kind = Leaf::optimizer;
    l.object = &v;
    sink.leaf(l);
  } else if constexpr (is_shared_ptr<U>::value) {
    static_assert(std::is_base_of_v<nn::Module, typename U::element_type> ||
                      std::is_base_of_v<optim::Optimizer, typename U::element_type>,
                  "kiln::compile: a std::shared_ptr argument must point to an nn::Module or an "
                  "optim::Optimizer (see the type in this instantiation)");
    if (v) {
      flatten(sink, *v);
    } else {
      sink.leaf(Leaf{});
    }
  } else if constexpr (is_optional<U>::value) {
    if (v) {
      flatten(sink, *v);
    } else {
      sink.leaf(Leaf{});
    }
  } else if constexpr (is_vector<U>::value) {
    Leaf len;
    len.kind = Leaf::integer;
    len.i = static_cast<int64_t>(v.size());  // the length is guarded like any integer
    sink.enter("__len__");
    sink.leaf(len);
    sink.leave();
    for (size_t k = 0; k < v.size(); ++k) {
      sink.enter(index_part(k));
      flatten(sink, v[k]);
      sink.leave();
    }
  } else if constexpr (is_tuple_like<U>::value) {
    std::apply(
        [&](const auto&... e) {
          size_t k = 0;
          ((sink.enter(index_part(k++)), flatten(sink, e), sink.leave()), ...);
        },
        v);
  } else {
    static_assert(always_false<U>::value,
                  "kiln::compile: unsupported argument or result type (named in this instantiation). "
                  "Supported: Tensor, arithmetic types, Scalar, std::string, std::optional, std::vector, "
                  "std::tuple, std::pair of those, and nn::Module / optim::Optimizer by reference or "
                  "std::shared_ptr.");
  }
}

// Collects leaves without names (the per-call path).
struct LeafSink {
  std::vector<Leaf>* out;
  void leaf(const Leaf& l) { out->push_back(l); }
  void enter(const std::string&) {}
  void leave() {}
};

// Rebuilds a result of type R from tensors and constants (pure replay).
struct ResultSource {
  std::vector<Tensor>* tensors;
  std::vector<Leaf>* leaves;
  std::vector<std::string>* strings;
  size_t next = 0;
};

template <class U, size_t... I>
U rebuild_tuple(ResultSource& src, std::index_sequence<I...>);

template <class R>
R rebuild(ResultSource& src) {
  using U = std::remove_cvref_t<R>;
  if constexpr (std::is_same_v<U, Tensor>) {
    const Leaf& l = (*src.leaves)[src.next];
    Tensor t = (*src.tensors)[src.next];
    ++src.next;
    (void)l;
    return t;
  } else if constexpr (std::is_same_v<U, bool>) {
    return (*src.leaves)[src.next++].i != 0;
  } else if constexpr (std::is_integral_v<U> || std::is_enum_v<U>) {
    return static_cast<U>((*src.leaves)[src.next++].i);
  } else if constexpr (std::is_floating_point_v<U>) {
    return static_cast<U>((*src.leaves)[src.next++].d);
  } else if constexpr (std::is_same_v<U, std::string>) {
    return (*src.strings)[src.next++];
  } else if constexpr (std::is_same_v<U, Scalar>) {
    const Leaf& l = (*src.leaves)[src.next++];
    if (l.kind == Leaf::floating) return Scalar(l.d);
    if (l.kind == Leaf::boolean) return Scalar(l.i != 0);
    return Scalar(l.i);
  } else if constexpr (is_optional<U>::value) {
    if ((*src.leaves)[src.next].kind == Leaf::none) {
      ++src.next;
      return std::nullopt;
    }
    return rebuild<typename U::value_type>(src);
  } else if constexpr (is_vector<U>::value) {
    size_t n = static_cast<size_t>((*src.leaves)[src.next++].i);
    U v;
    v.reserve(n);
    for (size_t k = 0; k < n; ++k) v.push_back(rebuild<typename U::value_type>(src));
    return v;
  } else if constexpr (is_tuple_like<U>::value) {
    return rebuild_tuple<U>(src, std::make_index_sequence<std::tuple_size_v<U>>());
  } else {
    static_assert(always_false<U>::value,
                  "kiln::compile: unsupported result type (named in this instantiation). Supported: "
                  "void, Tensor, arithmetic types, Scalar, std::string, std::optional, std::vector, "
                  "std::tuple and std::pair of those.");
  }
}

template <class U, size_t... I>
U rebuild_tuple(ResultSource& src, std::index_sequence<I...>) {
  // Braced initialization evaluates left to right.
  return U{rebuild<std::tuple_element_t<I, U>>(src)...};
}

// Everything compile() knows about one compiled callable; shared by its copies.
struct FunctionState;

// Builds the state for a compiled callable.
// fn_address: the compiled function's address when it is a plain function (its name becomes the
// default name shown in logs and errors), else null.
std::shared_ptr<FunctionState> make_function_state(CompileOptions options, std::string default_name,
                                                   std::source_location loc, const void* fn_address = nullptr);

// One call of a compiled callable, type-erased. `leaves` are the flattened arguments;
// `names(i)` lazily names leaf i. `body` runs the C++ body (capturing or eagerly, as the runtime
// decides) and stores the flattened result through `record_result`; `replay` rebuilds the result
// from a pure entry's outputs.
struct CallHooks {
  std::function<void(std::vector<std::string>&)> leaf_names;
  std::function<void()> body;
  std::function<void(std::vector<Leaf>&)> result_leaves;  // flattens the stored result
  std::function<void(std::vector<Tensor>&, std::vector<Leaf>&, std::vector<std::string>&)> replay;
};
void run_call(FunctionState& state, std::vector<Leaf>& leaves, CallHooks& hooks);
bool pure(const FunctionState& state);

// Names the leaves of an argument pack.
struct NameSink {
  std::vector<std::string>* out;
  std::vector<std::string> stack;
  void leaf(const Leaf&) {
    std::string n;
    for (auto& p : stack) n += p;
    out->push_back(std::move(n));
  }
  void enter(const std::string& s) { stack.push_back(s); }
  void leave() { stack.pop_back(); }
};

// What the guards see of an argument: a C string as the std::string that a plain call would make
// of it for a `const std::string&` parameter; anything else as it is (a reference).
template <class A>
decltype(auto) guard_view(const A& a) {
  using U = std::remove_cvref_t<A>;
  if constexpr (std::is_array_v<U> && std::is_same_v<std::remove_cv_t<std::remove_extent_t<U>>, char>) {
    return std::string(a);
  } else if constexpr (std::is_same_v<U, const char*> || std::is_same_v<U, char*>) {
    KILN_CHECK(a != nullptr, ValueError, "[kiln::compile] a null C string was passed to a compiled function.");
    return std::string(a);
  } else {
    return (a);
  }
}

template <class Fn, class... Args>
decltype(auto) invoke_compiled(FunctionState& state, Fn& fn, const std::vector<std::string>& arg_names,
                               Args&&... args) {
  using R = std::invoke_result_t<Fn&, Args&&...>;
  thread_local std::vector<Leaf> leaves;
  std::vector<Leaf> local;
  local.swap(leaves);  // reentrancy: a nested compiled call gets its own buffer
  local.clear();
  // Leaves point into these, so they live for the whole call.
  const std::tuple<decltype(guard_view(args))...> views{guard_view(args)...};
  LeafSink sink{&local};
  std::apply([&](const auto&... v) { (flatten(sink, v), ...); }, views);

  CallHooks hooks;
  hooks.leaf_names = [&](std::vector<std::string>& names) {
    NameSink ns{&names, {}};
    size_t k = 0;
    auto one = [&](const auto& a) {
      ns.enter(k < arg_names.size() ? arg_names[k] : "arg" + std::to_string(k));
      ++k;
      flatten(ns, a);
      ns.leave();
    };
    std::apply([&](const auto&... v) { (one(v), ...); }, views);
  };
  struct Restore {
    std::vector<Leaf>& tls;
    std::vector<Leaf>& mine;
    ~Restore() {
      mine.clear();  // drop the argument references now, keep the capacity
      mine.swap(tls);
    }
  } restore{leaves, local};

  if constexpr (std::is_void_v<R>) {
    hooks.body = [&] { fn(std::forward<Args>(args)...); };
    run_call(state, local, hooks);
  } else {
    std::optional<std::remove_cvref_t<R>> result;
    hooks.body = [&] { result.emplace(fn(std::forward<Args>(args)...)); };
    hooks.result_leaves = [&](std::vector<Leaf>& out) {
      LeafSink s{&out};
      flatten(s, *result);
    };
    hooks.replay = [&](std::vector<Tensor>& tensors, std::vector<Leaf>& ls, std::vector<std::string>& strs) {
      ResultSource src{&tensors, &ls, &strs};
      result.emplace(rebuild<std::remove_cvref_t<R>>(src));
    };
    run_call(state, local, hooks);
    return std::remove_cvref_t<R>(std::move(*result));
  }
}

}  // namespace detail

// A compiled callable (what compile(fn) returns). Copies share one cache.
template <class F>
class Compiled {
 public:
  Compiled(F fn, std::shared_ptr<detail::FunctionState> state, std::vector<std::string> arg_names)
      : fn_(std::move(fn)), state_(std::move(state)), arg_names_(std::move(arg_names)) {}

  template <class... Args>
  decltype(auto) operator()(Args&&... args) {
    return detail::invoke_compiled(*state_, fn_, arg_names_, std::forward<Args>(args)...);
  }
  template <class... Args>
  decltype(auto) operator()(Args&&... args) const {
    return detail::invoke_compiled(*state_, fn_, arg_names_, std::forward<Args>(args)...);
  }
  const F& original() const { return fn_; }

 private:
  mutable F fn_;
  std::shared_ptr<detail::FunctionState> state_;
  std::vector<std::string> arg_names_;
};

// A compiled module: calls module->forward(args...) with the module guarded by identity and
// structure version. Its parameters and buffers are graph inputs.
template <class M>
class CompiledModule {
 public:
  CompiledModule(std::shared_ptr<M> module, std::shared_ptr<detail::FunctionState> state,
                 std::vector<std::string> arg_names)
      : module_(std::move(module)), state_(std::move(state)), arg_names_(std::move(arg_names)) {
    arg_names_.insert(arg_names_.begin(), "self");
  }

  template <class... Args>
  decltype(auto) operator()(Args&&... args) {
    auto call = [](M& m, auto&&... a) -> decltype(auto) { return m.forward(std::forward<decltype(a)>(a)...); };
    return detail::invoke_compiled(*state_, call, arg_names_, *module_, std::forward<Args>(args)...);
  }
  template <class... Args>
  decltype(auto) forward(Args&&... args) {
    return (*this)(std::forward<Args>(args)...);
  }
  M* operator->() const { return module_.get(); }
  M& module() const { return *module_; }
  const std::shared_ptr<M>& ptr() const { return module_; }

 private:
  std::shared_ptr<M> module_;
  std::shared_ptr<detail::FunctionState> state_;
  std::vector<std::string> arg_names_;
};

// explain(fn)(args...): compiles fn with a recording backend, runs it once, and reports the
// graphs, graph breaks (with the user's file:line), ops, guards and compile times.
namespace detail {
// Runs `call` once with `options` plus a recording backend; collects what explain() reports.
ExplainOutput run_explain(CompileOptions options, const std::function<void(CompileOptions)>& call);
}
template <class F>
auto explain(F fn, CompileOptions options = {}, std::source_location loc = std::source_location::current());

}  // namespace compiler

// ------------------------------------------------------------------------------------------
// compile()
// ------------------------------------------------------------------------------------------

template <class F>
auto compile(F fn, CompileOptions options = {}, std::source_location loc = std::source_location::current()) {
  if constexpr (compiler::detail::is_shared_ptr<F>::value) {
    using M = typename F::element_type;
    static_assert(std::is_base_of_v<nn::Module, M>,
                  "kiln::compile: a std::shared_ptr argument must point to an nn::Module");
    KILN_CHECK(fn != nullptr, ValueError, "[kiln::compile] Model can't be None (the module pointer is null).");
    auto names = options.arg_names;
    auto state = compiler::detail::make_function_state(std::move(options), fn->name(), loc);
    return compiler::CompiledModule<M>(std::move(fn), std::move(state), std::move(names));
  } else {
    auto names = options.arg_names;
    const void* address = nullptr;
    if constexpr (std::is_pointer_v<F> && std::is_function_v<std::remove_pointer_t<F>>)
      address = reinterpret_cast<const void*>(fn);
    auto state = compiler::detail::make_function_state(std::move(options), "fn", loc, address);
    return compiler::Compiled<F>(std::move(fn), std::move(state), std::move(names));
  }
}

template <class F>
auto compiler::explain(F fn, CompileOptions options, std::source_location loc) {
  return [fn = std::move(fn), options = std::move(options), loc](auto&&... args) -> ExplainOutput {
    return detail::run_explain(options, [&](CompileOptions o) {
      auto compiled = kiln::compile(fn, std::move(o), loc);
      compiled(args...);
    });
  };
}

}  // namespace kiln
