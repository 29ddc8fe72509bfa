// The state behind compiled callables: frame entries with their guards, the graph cache, and the
// per-call capture context (DESIGN §2.3, §2.4).
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "compiler/capture/capture.h"

namespace kiln::autograd {
struct Node;
}

namespace kiln::compiler::detail {

// ---- stances ----

struct StanceState {
  Stance stance = Stance::default_;
  StanceOptions options;
};
// This thread's innermost StanceGuard, else the process-wide stance.
StanceState effective_stance();

// ---- guards (guards.cpp) ----

// Global state a frame entry depends on.
struct GlobalState {
  bool grad_mode = true;
  bool inference_mode = false;
  DType default_dtype = DType::float32;
  bool operator==(const GlobalState&) const = default;
};
GlobalState current_global_state();

// What one argument leaf must look like for an entry to serve a call.
struct LeafGuard {
  Leaf::Kind kind = Leaf::none;
  DType dtype = DType::float32;
  Device device;
  bool requires_grad = false;
  std::vector<int64_t> sizes, strides;
  int64_t i = 0;
  double d = 0;
  std::string s;
  const void* object = nullptr;
  uint64_t version = 0;
  // Pure frames (GuardSet::values): the first earlier tensor leaf that is this same tensor, and
  // the first on the same storage (-1: none). The capture bakes this aliasing into its graph (one
  // placeholder per tensor, grouped by storage), so a replay is valid only for calls that repeat it.
  int same_as = -1;
  int shares_storage_with = -1;
  // Dynamic shapes: per dim, whether the size is dynamic (any value >= 2 passes; empty: every dim
  // static). A tensor with a dynamic dim is checked for its stride pattern (contiguous, channels
  // last) rather than exact strides, which change with the sizes.
  std::vector<char> dynamic;
  std::vector<int64_t> min_size, max_size;  // per dim: a dynamic size's bounds (mark_dynamic's range)
  enum class Layout : uint8_t { exact, contiguous, channels_last } layout = Layout::exact;
};

struct GuardSet {
  std::vector<LeafGuard> leaves;
  GlobalState global;
  bool values = false;  // also guard scalar and string values (pure frames)
  std::string backend;  // the backend the entry compiled with (force_backend and *_then_compile)
  // Per leaf (and one for the global state, at the end): how often this check told entries apart.
  std::unique_ptr<std::atomic<int>[]> fail_counts;
};

// dynamic: per leaf, per dim, whether that size is dynamic (may be empty, or shorter than leaves).
GuardSet build_guards(const std::vector<Leaf>& leaves, bool values, std::string backend,
                      const std::vector<std::vector<char>>& dynamic = {});
// Index of the first failing check, or -1 (index leaves.size() is the global state, +1 the
// backend). `only`: check just the indices it marks (skip_guard_eval_unsafe).
int check_guards(const GuardSet& g, const std::vector<Leaf>& leaves, const std::string& backend,
                 const std::vector<char>* only = nullptr);
// Dynamo's wording for failing check `index` ("tensor 'x' size mismatch at index 0. expected 3,
// actual 4").
std::string describe_failure(const GuardSet& g, int index, const std::vector<Leaf>& leaves,
                             const std::vector<std::string>& names);
// Argument leaf k's name in logs and guards: names[k] (CompileOptions::arg_names, a module's
// "self"), else "arg<k>".
std::string leaf_name(const std::vector<std::string>& names, int k);
// The guard list as text (explain()'s "Out Guards", KILN_LOGS=guards).
std::vector<std::string> describe_guards(const GuardSet& g, const std::vector<std::string>& names);

// ---- compiled graphs ----

struct GraphFamily;
struct Guide;  // segment.h

struct CompiledGraph {
  Graph graph;  // the structure it was compiled from (cache keys compare against it)
  uint64_t hash = 0;
  uint64_t family = 0;  // family_hash(graph)
  // An instance of a dynamic graph: size_signature(graph), which with same_family against the
  // family's first graph says what same_structure against `graph` would, from one contiguous array
  // instead of the instance's graph (cold in cache when a function cycles through many sizes).
  // (A static graph keeps its own too: a guided capture compares its numbers with it.)
  std::vector<int64_t> sizes;
  std::weak_ptr<GraphFamily> dynamic_graph;  // the dynamic graph this is an instance of, if any
  CompiledFn fn;
  std::string backend;
  std::string id;  // "0/1": frame id / graph number, for logs
  double compile_seconds = 0;
  // Compile once while other callers of the same graph wait.
  std::mutex mutex;
  std::condition_variable ready_cv;
  bool ready = false;
  std::exception_ptr error;
};

// For export_program (compiler/export): while set on this thread, every flushed segment reports
// the storages its graph outputs were bound to, in graph-output order, after they became real.
using FlushObserver = std::function<void(const std::vector<const kiln::detail::Storage*>& outputs)>;
extern thread_local const FlushObserver* t_flush_observer;

// Makes `options` what compiling_options() returns on this thread while alive (the frame runtime
// sets it around a backend call; export's loader sets it around its own).
class CompilingOptionsScope {
 public:
  explicit CompilingOptionsScope(const CompileOptions* options);
  ~CompilingOptionsScope();
  CompilingOptionsScope(const CompilingOptionsScope&) = delete;
  CompilingOptionsScope& operator=(const CompilingOptionsScope&) = delete;

 private:
  const CompileOptions* saved_;
};

}  // namespace kiln::compiler::detail

namespace kiln::compiler {
// A tensor's dimension marks (mark_dynamic, maybe_mark_dynamic, mark_static), per dim.
struct DimMarks {
  enum Kind : uint8_t { none, dynamic, maybe_dynamic, static_ };
  std::vector<Kind> kind;
  std::vector<int64_t> min, max;  // a dynamic mark's range (2 and INT64_MAX when unset)
};
}  // namespace kiln::compiler

namespace kiln::compiler::detail {

// A dynamic graph: graphs that differ only in sizes, strides and integer attrs (family_hash and
// same_family). The first one compiled stands for all; each concrete size met is an instance, its
// graph compiled with Graph::dynamic set, so the kiln backend's kernels take sizes as arguments
// and every instance after the first finds them in the kernel cache.
struct GraphFamily {
  std::string id;                                   // "frame/graph" of the first compile
  std::shared_ptr<CompiledGraph> first;
  std::vector<std::shared_ptr<CompiledGraph>> instances;  // most recently used last
  static constexpr size_t kMaxInstances = 64;       // the least recently used goes beyond that
};

// A frame entry: one guarded signature of a compiled callable.
struct FrameEntry {
  int id = 0;  // compile id within the function ("frame/id")
  GuardSet guards;
  bool backward = false;  // the entry that serves captured backward passes
  bool dynamic = false;   // some argument size is dynamic: its graphs compile dynamic
  // Pure replay (pure = true): a stable one-graph capture. A static entry keeps one plan; a
  // dynamic entry keeps one per concrete size of its arguments (sized_replays, keyed by
  // replay_key: every tensor argument's sizes and strides and every number argument), since each
  // size runs its own instance with its own integer attrs.
  struct Replay;
  std::shared_ptr<Replay> replay;
  std::vector<std::pair<std::vector<int64_t>, std::shared_ptr<Replay>>> sized_replays;  // most recent last
  static constexpr size_t kMaxSizedReplays = 64;  // as GraphFamily::kMaxInstances
  bool hinted = false;  // perf hint about replay given (guarded by replay_mutex, as the plans are)
  std::mutex replay_mutex;
  // Guided capture: per segment position in a call (0 before the first graph break), the compiled
  // graph this entry ran there last (segment.h, Guide). Guarded by FunctionState::mutex.
  std::vector<std::shared_ptr<const Guide>> guides;
};

struct FunctionState : std::enable_shared_from_this<FunctionState> {
  CompileOptions options;
  std::string name;
  std::string file;
  int line = 0;
  int frame_id = 0;
  std::string backend_name;  // registered name, or "<custom>" for a BackendFn
  BackendFn backend_fn;      // set when options.backend holds a function

  std::mutex mutex;
  std::vector<std::shared_ptr<FrameEntry>> entries;
  std::shared_ptr<FrameEntry> backward_entry;
  std::unordered_multimap<uint64_t, std::shared_ptr<CompiledGraph>> graphs;
  int graph_counter = 0;
  // Dynamic graphs (see GraphFamily), by family_hash.
  std::unordered_multimap<uint64_t, std::shared_ptr<GraphFamily>> families;
  // Automatic dynamic (CompileOptions::dynamic unset): per argument leaf, the sizes its first
  // compile (or eager_then_compile's first eager call) saw, and per dim whether a later miss saw
  // another size (then the dim is dynamic in every later entry). Like Dynamo's frame_state.
  std::vector<std::vector<int64_t>> seen_sizes;
  std::vector<std::vector<char>> changed_dims;
  int sightings = 0;  // misses seen (eager_then_compile / aot_eager_then_compile)
  bool limit_warned = false;
  bool graph_limit_warned = false;
  uint64_t reset_epoch = 0;  // compiler::reset() generation these caches belong to

  std::string where() const;  // "'name' (file:line)"
  int limit() const;
};

// ---- the capture context of one compiled call on one thread ----

struct Segment;

struct ExplainRecorder;  // explain.cpp

struct CaptureContext {
  FunctionState* fn = nullptr;
  FrameEntry* entry = nullptr;
  std::string backend;
  StanceState stance;
  const std::vector<Leaf>* leaves = nullptr;        // the frame's arguments (names for inputs)
  std::function<void(std::vector<std::string>&)> leaf_names;
  std::shared_ptr<Segment> segment;                 // the pending segment
  int flushes = 0;       // segments that ran
  int breaks = 0;        // graph breaks
  bool host_reads = false;
  bool autograd = false;  // an op recorded autograd history
  // Every autograd node the call recorded: a pure replay needs each one freed by a backward
  // inside the call (no history left for a backward after it).
  std::vector<std::weak_ptr<autograd::Node>> recorded_nodes;
  bool random = false;    // a random op (fresh counters each call: not replayable)
  bool record_stacks = false;  // remember where breaks happen (explain, logs, fullgraph, trace)
  bool trace_ops = false;      // a compile trace is on: remember where each op was called
  ExplainRecorder* explain = nullptr;
  std::shared_ptr<CompiledGraph> last_graph;        // the graph the last flush ran
  std::vector<Tensor> last_inputs;                  // and its inputs (pure replay analysis)
  std::vector<Attr> last_scalars;                   // and its scalar values
  std::vector<int> last_outputs;
  std::vector<const kiln::detail::Storage*> last_output_storages;

  CaptureContext() = default;
  CaptureContext(const CaptureContext&) = delete;
  CaptureContext& operator=(const CaptureContext&) = delete;
  // Leaves an unused segment to the thread's next compiled call (pending() takes it): its
  // recycled nodes and values save that call's capture most of its allocations.
  ~CaptureContext();

  Segment& pending();
  // Guided capture: a new segment follows the graph this entry ran last at its position in the
  // call; a compiled graph found the ordinary way becomes the guide for that position.
  void take_guide(Segment& seg);
  void remember_guide(const std::shared_ptr<CompiledGraph>& cg);
  // Ends the pending segment: compiles or looks up its graph, runs it, makes its live values
  // real. `end_of_call`: the compiled call returns (not a graph break).
  void flush(bool end_of_call, std::string_view reason, const CallSite* site);
  // Drops the pending segment without running it (an exception unwinds the body).
  void abandon(const std::string& why);
};

// Installs `ctx` as this thread's capture while alive.
class CaptureScope {
 public:
  explicit CaptureScope(CaptureContext* ctx);
  ~CaptureScope();
  CaptureScope(const CaptureScope&) = delete;
  CaptureScope& operator=(const CaptureScope&) = delete;

 private:
  CaptureContext* saved_;
};

// Looks up (or compiles) the graph of a flushed segment. Applies the stance to a miss: may
// return an uncached interpreter (eager_on_recompile, limits) or throw (fail_on_recompile).
// `node_stacks`: each node's call stack, for the compile trace (may be null or short).
std::shared_ptr<CompiledGraph> find_or_compile(CaptureContext& ctx, Graph& graph, uint64_t hash,
                                               const Arguments& example,
                                               const std::vector<RawStack>* node_stacks = nullptr);

// Runs a captured backward pass (engine.cpp): the backward of a graph captured by `owner`.
void run_captured_backward(const std::shared_ptr<void>& owner, const std::function<void()>& run);

// `path` relative to the working directory when it lies below it.
std::string relative_path(const std::string& path);

// The time now in UTC, "2026-11-27T23:02:01Z" (compile traces, exported programs).
std::string utc_now();

// torch.compile's names of the modes ("reduce-overhead"), as traces and exported programs write
// them; mode_from_name gives nullopt for an unknown name.
const char* mode_name(Mode mode);
std::optional<Mode> mode_from_name(std::string_view name);

// Whether the registered backend `name` carries `tag` (false for unknown names, "custom").
bool backend_has_tag(std::string_view name, std::string_view tag);

// Structural equality of two graphs (cache hits compare the new capture with the cached graph).
bool same_structure(const Graph& a, const Graph& b);

// ---- dynamic shapes (dynamic_shapes.cpp) ----

// Per argument leaf, per dim, whether the entry a miss creates treats that size as dynamic
// (build_guards keeps only sizes >= 2): CompileOptions::dynamic, automatic dynamic (the sizes that
// changed since the first miss), then the tensors' marks. Updates the function's automatic-dynamic
// state; called on every miss, eager ones included. Caller holds st.mutex.
std::vector<std::vector<char>> dynamic_dims(FunctionState& st, const std::vector<Leaf>& leaves,
                                            const std::vector<std::string>& names);
// Throws CompileError when a dimension marked with mark_dynamic was specialized in `guards`.
void check_marks_honoured(const GuardSet& guards, const std::vector<Leaf>& leaves, const std::vector<std::string>& names);
// Dynamic shapes: a hash of what same_family compares (no sizes, strides or integer attrs), and
// whether two graphs are the same program at other sizes.
uint64_t family_hash(const Graph& g);
// The graph cache's key: a hash of everything same_structure compares.
uint64_t structure_hash(const Graph& g);
// A guided capture's compiled graph (Guide): when `seg` followed its guide to the last node and
// left `outputs` live as it did, the guide's graph or its dynamic graph's instance with the
// numbers the capture collected, if one is compiled; else null. Counts a cache hit.
std::shared_ptr<CompiledGraph> guided_graph(FunctionState& st, const Segment& seg, const std::vector<int>& outputs);
bool same_family(const Graph& a, const Graph& b);
// The numbers same_family leaves out, in order: every value's sizes, strides and storage offset,
// and every integer attr that is not a run-time slot. Two graphs of one family are the same
// structure exactly when their signatures are equal.
std::vector<int64_t> size_signature(const Graph& g);

// ---- observability (observe.cpp) ----

std::ostream& log_stream();
LogOptions log_options();
// Throws ValueError naming the unknown names when KILN_LOGS (read at start-up) has any.
void check_log_settings();
void record_phase(const std::string& phase, double seconds);
struct CounterSet {
  std::atomic<int64_t> calls{0}, frame_compiles{0}, graph_compiles{0}, graph_cache_hits{0},
      graph_runs{0}, graph_breaks{0}, eager_frames{0}, replays{0}, kernel_runs{0}, dispatched_nodes{0},
      recomputed_values{0}, cuda_graph_captures{0}, cuda_graph_replays{0},
      cuda_graph_output_copies{0}, kernel_builds{0}, size_specializations{0}, guided_captures{0};
};
CounterSet& counter_set();
uint64_t reset_epoch();
void reset_frame_ids();  // compiler::reset(): frame ids in logs start again at 0
// Recompile events go to live RecompileProfilers.
void notify_recompile(const FunctionState& fn, const std::vector<std::string>& reasons);
void warn(const std::string& message);

// explain(): the recorder the explain backend and the capture write into.
struct ExplainRecorder {
  std::mutex mutex;
  ExplainOutput out;
};
ExplainRecorder* active_explain();

// Names nodes and values of a graph that was captured without names (done once per compile).
void name_graph(Graph& graph);

}  // namespace kiln::compiler::detail
