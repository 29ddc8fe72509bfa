// Observability: logs (KILN_LOGS), compile times, counters, reset(), explain() and the recompile
// profiler (DESIGN §2.7).
#include <algorithm>
#include <cstdlib>
#include <iomanip>
#include <iostream>
#include <map>
#include <mutex>
#include <sstream>

#include "compiler/capture/compile_trace.h"
#include "compiler/capture/runtime.h"
#include "core/profiler.h"
#include "compiler/graph/format.h"
#include "core/layer_hooks.h"

namespace kiln::compiler {

namespace detail {
namespace {

constexpr const char* kLogNames =
    "all, graph_breaks, recompiles, guards, graph (or graph_code), output_code, perf_hints, passes, dynamic";

// KILN_LOGS: comma-separated names ('+' prefixes and spaces ignored, as TORCH_LOGS allows).
// Unknown names go into `unknown`.
LogOptions parse_logs(const char* env, std::vector<std::string>* unknown) {
  LogOptions o;
  if (!env) return o;
  std::string s(env);
  size_t pos = 0;
  while (pos <= s.size()) {
    size_t comma = s.find(',', pos);
    std::string item = s.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos);
    while (!item.empty() && (item.front() == '+' || item.front() == ' ')) item.erase(item.begin());
    while (!item.empty() && item.back() == ' ') item.pop_back();
    bool all = item == "all";
    bool known = all || item.empty();
    auto set = [&](bool& flag, std::initializer_list<const char*> names) {
      for (const char* name : names) {
        if (all || item == name) {
          flag = true;
          known = true;
        }
      }
    };
    set(o.graph_breaks, {"graph_breaks"});
    set(o.recompiles, {"recompiles"});
    set(o.guards, {"guards"});
    set(o.graph, {"graph", "graph_code"});
    set(o.output_code, {"output_code"});
    set(o.perf_hints, {"perf_hints"});
    set(o.passes, {"passes"});
    set(o.dynamic, {"dynamic"});
    if (!known && unknown) unknown->push_back(item);
    if (comma == std::string::npos) break;
    pos = comma + 1;
  }
  return o;
}

// The error for unknown KILN_LOGS names, empty when all are known; "help" lists the names.
std::string check_logs_env(const char* env) {
  std::vector<std::string> unknown;
  parse_logs(env, &unknown);
  if (unknown.empty()) return {};
  std::string names;
  for (const auto& name : unknown) names += (names.empty() ? "'" : ", '") + name + "'";
  const bool help = unknown.size() == 1 && unknown[0] == "help";
  return help ? std::string("[kiln::compile] KILN_LOGS=help: the valid names are ") + kLogNames +
                    " (comma-separated)."
              : "[kiln::compile] Invalid KILN_LOGS setting: unknown name " + names +
                    ". Valid names: " + kLogNames + " (comma-separated).";
}

uint32_t to_bits(const LogOptions& o) {
  return o.graph_breaks | o.recompiles << 1 | o.guards << 2 | o.graph << 3 | o.output_code << 4 | o.perf_hints << 5 |
         o.passes << 6 | o.dynamic << 7;
}
LogOptions from_bits(uint32_t b) {
  return LogOptions{(b & 1) != 0,  (b & 2) != 0,  (b & 4) != 0,  (b & 8) != 0,
                    (b & 16) != 0, (b & 32) != 0, (b & 64) != 0, (b & 128) != 0};
}

struct Observe {
  std::mutex mutex;
  std::atomic<uint32_t> logs{to_bits(parse_logs(std::getenv("KILN_LOGS"), nullptr))};  // read on every call
  std::string logs_error = check_logs_env(std::getenv("KILN_LOGS"));  // reported by compile()
  std::ostream* stream = nullptr;
  std::vector<PhaseTimes> phases;
  std::vector<RecompileProfiler::Impl*> profilers;
};

Observe& observe() {
  static Observe* o = new Observe;  // never destroyed: used from static destructors' compiled calls
  return *o;
}

std::atomic<uint64_t> g_epoch{1};
thread_local ExplainRecorder* t_explain = nullptr;

}  // namespace

std::ostream& log_stream() {
  Observe& o = observe();
  std::lock_guard lock(o.mutex);
  return o.stream ? *o.stream : std::cerr;
}

LogOptions log_options() { return from_bits(observe().logs.load(std::memory_order_relaxed)); }

void check_log_settings() {
  const std::string& error = observe().logs_error;
  KILN_CHECK(error.empty(), ValueError, error);
}

void warn(const std::string& message) { kiln::detail::log_warning(message); }

namespace {
// Where the eager kernels' logs go (core/layer_hooks.h): this file's stream and options.
[[maybe_unused]] const bool g_log_hooks_installed = [] {
  kiln::detail::log_hooks.stream = []() -> std::ostream& { return log_stream(); };
  kiln::detail::log_hooks.perf_hints = [] { return log_options().perf_hints; };
  return true;
}();
}  // namespace

void record_phase(const std::string& phase, double seconds) {
  if (compile_trace_on()) trace_event("phase", {{"name", phase}, {"seconds", seconds}});
  // The timeline (KILN_PROFILE=<path>.json) shows the phase where it ran: it ends now.
  if (kiln::detail::g_tracing.load(std::memory_order_relaxed))
    kiln::detail::record_trace(phase, "compile",
                               std::chrono::steady_clock::now() -
                                   std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                       std::chrono::duration<double>(seconds)),
                               seconds);
  Observe& o = observe();
  std::lock_guard lock(o.mutex);
  for (auto& p : o.phases) {
    if (p.phase == phase) {
      p.seconds.push_back(seconds);
      return;
    }
  }
  o.phases.push_back({phase, {seconds}});
}

CounterSet& counter_set() {
  static CounterSet* c = new CounterSet;
  return *c;
}

uint64_t reset_epoch() { return g_epoch.load(std::memory_order_acquire); }

ExplainRecorder* active_explain() { return t_explain; }

void name_graph(Graph& g) {
  std::map<std::string, int> used;
  for (const ValueInfo& v : g.values)
    if (v.is_input && !v.name.empty()) used[v.name] = 1;
  for (Node& n : g.nodes) {
    if (n.name.empty()) {
      std::string base = identifier_from(n.op->name);
      int& count = used[base];
      n.name = count == 0 ? base : base + "_" + std::to_string(count);
      ++count;
    }
    if (n.inplace) continue;
    for (size_t k = 0; k < n.outputs.size(); ++k) {
      ValueInfo& v = g.values[n.outputs[k]];
      if (v.name.empty()) v.name = n.outputs.size() == 1 ? n.name : n.name + "[" + std::to_string(k) + "]";
    }
  }
}

}  // namespace detail

// ---- logs ----

void set_logs(const LogOptions& logs) { detail::observe().logs.store(detail::to_bits(logs), std::memory_order_relaxed); }

LogOptions logs() { return detail::log_options(); }

void set_log_stream(std::ostream* os) {
  auto& o = detail::observe();
  std::lock_guard lock(o.mutex);
  o.stream = os;
}

// ---- compile times and counters ----

std::vector<PhaseTimes> compile_time_table() {
  auto& o = detail::observe();
  std::lock_guard lock(o.mutex);
  return o.phases;
}

std::string compile_times() {
  std::vector<PhaseTimes> table = compile_time_table();
  std::vector<std::pair<std::string, std::string>> rows;
  for (const auto& p : table) {
    std::string times;
    for (double s : p.seconds) {
      std::ostringstream os;
      os << std::fixed << std::setprecision(4) << s;
      times += (times.empty() ? "" : ", ") + os.str();
    }
    rows.emplace_back(p.phase, times);
  }
  size_t w1 = std::string("Function").size(), w2 = std::string("Runtimes (s)").size();
  for (auto& [a, b] : rows) {
    w1 = std::max(w1, a.size());
    w2 = std::max(w2, b.size());
  }
  auto pad = [](const std::string& s, size_t w) { return s + std::string(w - s.size(), ' '); };
  std::string out = "Kiln compilation metrics:\n";
  out += pad("Function", w1) + "  " + "Runtimes (s)" + "\n";
  out += std::string(w1, '-') + "  " + std::string(w2, '-') + "\n";
  for (auto& [a, b] : rows) out += pad(a, w1) + "  " + b + "\n";
  return out;
}

Counters counters() {
  auto& c = detail::counter_set();
  Counters out;
  out.calls = c.calls.load();
  out.frame_compiles = c.frame_compiles.load();
  out.graph_compiles = c.graph_compiles.load();
  out.graph_cache_hits = c.graph_cache_hits.load();
  out.graph_runs = c.graph_runs.load();
  out.graph_breaks = c.graph_breaks.load();
  out.eager_frames = c.eager_frames.load();
  out.replays = c.replays.load();
  out.kernel_runs = c.kernel_runs.load();
  out.dispatched_nodes = c.dispatched_nodes.load();
  out.recomputed_values = c.recomputed_values.load();
  out.cuda_graph_captures = c.cuda_graph_captures.load();
  out.cuda_graph_replays = c.cuda_graph_replays.load();
  out.cuda_graph_output_copies = c.cuda_graph_output_copies.load();
  out.kernel_builds = c.kernel_builds.load();
  out.size_specializations = c.size_specializations.load();
  out.guided_captures = c.guided_captures.load();
  return out;
}

void reset() {
  detail::g_epoch.fetch_add(1, std::memory_order_acq_rel);
  detail::reset_frame_ids();
  {
    auto& o = detail::observe();
    std::lock_guard lock(o.mutex);
    o.phases.clear();
  }
  auto& c = detail::counter_set();
  for (auto* a : {&c.calls, &c.frame_compiles, &c.graph_compiles, &c.graph_cache_hits, &c.graph_runs, &c.graph_breaks,
                  &c.eager_frames, &c.replays, &c.kernel_runs, &c.dispatched_nodes,
                  &c.recomputed_values, &c.cuda_graph_captures, &c.cuda_graph_replays,
                  &c.cuda_graph_output_copies, &c.kernel_builds, &c.size_specializations, &c.guided_captures})
    a->store(0);
}

// ---- explain ----

std::string BreakReason::where() const {
  if (line <= 0) return function.empty() ? "<unknown>" : "<unknown> in " + function;
  return file + ":" + std::to_string(line) + (function.empty() ? "" : " in " + function);
}

std::string ExplainOutput::str() const {
  std::string o = "Graph Count: " + std::to_string(graph_count) + "\n";
  o += "Graph Break Count: " + std::to_string(graph_break_count) + "\n";
  o += "Op Count: " + std::to_string(op_count) + "\n";
  o += "Break Reasons:\n";
  for (size_t i = 0; i < break_reasons.size(); ++i) {
    o += "  Break Reason " + std::to_string(i + 1) + ":\n";
    o += "    Reason: " + break_reasons[i].reason + "\n";
    o += "    User Stack:\n";
    o += "      " + break_reasons[i].where() + "\n";
  }
  o += "Ops per Graph:\n";
  for (size_t i = 0; i < ops_per_graph.size(); ++i) {
    o += "  Ops " + std::to_string(i + 1) + ":\n";
    for (const auto& op : ops_per_graph[i]) o += "    " + op + "\n";
  }
  o += "Out Guards:\n";
  for (size_t i = 0; i < out_guards.size(); ++i) {
    o += "  Guard " + std::to_string(i + 1) + ":\n";
    o += "    " + out_guards[i] + "\n";
  }
  o += "Compile Times: " + compile_times;
  return o;
}

std::ostream& operator<<(std::ostream& os, const ExplainOutput& e) { return os << e.str(); }

namespace detail {

ExplainOutput run_explain(CompileOptions options, const std::function<void(CompileOptions)>& call) {
  // Shared with the backend: autograd nodes may keep the compiled function (and so the backend)
  // alive after explain() returns.
  auto recorder = std::make_shared<ExplainRecorder>();
  BackendFn inner;
  if (auto* fn = std::get_if<BackendFn>(&options.backend)) {
    inner = *fn;
  } else {
    std::string name = std::get<std::string>(options.backend);
    inner = lookup_backend(name.empty() ? default_backend() : name);
  }
  options.backend = BackendFn([recorder, inner](Graph& g, const Arguments& example) {
    {
      std::lock_guard lock(recorder->mutex);
      recorder->out.graphs.push_back(g);
      recorder->out.ops_per_graph.push_back(g.op_names());
    }
    return inner(g, example);
  });
  ExplainRecorder* saved = std::exchange(t_explain, recorder.get());
  auto t0 = std::chrono::steady_clock::now();
  try {
    call(std::move(options));
  } catch (...) {
    t_explain = saved;
    throw;
  }
  t_explain = saved;
  ExplainOutput out;
  {
    std::lock_guard lock(recorder->mutex);
    out = recorder->out;
  }
  out.graph_count = static_cast<int>(out.graphs.size());
  out.graph_break_count = static_cast<int>(out.break_reasons.size());
  out.op_count = 0;
  for (const auto& ops : out.ops_per_graph) out.op_count += static_cast<int>(ops.size());
  double total = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::ostringstream os;
  os << std::fixed << std::setprecision(4) << total;
  out.compile_times = "Kiln compilation metrics:\ncapture + compile + run (s): " + os.str() + "\n";
  return out;
}

// ---- the recompile profiler ----

namespace {
// "0/1: tensor 'x' size mismatch at index 0. expected 3, actual 4" -> "tensor 'x' size mismatch at index 0"
std::string guard_category(const std::string& reason) {
  std::string r = reason;
  if (size_t colon = r.find(": "); colon != std::string::npos && colon < 12) r = r.substr(colon + 2);
  if (size_t dot = r.find(". expected"); dot != std::string::npos) r = r.substr(0, dot);
  if (size_t eq = r.find(" == "); eq != std::string::npos) r = r.substr(0, eq) + " (value changed)";
  return r;
}
}  // namespace

void notify_recompile(const FunctionState& fn, const std::vector<std::string>& reasons);

}  // namespace detail

struct RecompileProfiler::Impl {
  mutable std::mutex mutex;
  struct Function {
    int recompiles = 0;
    std::map<std::string, int> failures;
  };
  std::map<std::string, Function> functions;  // by where()
  std::vector<std::string> order;
  int frames = 0;
  int ops = 0;
};

namespace detail {

void notify_recompile(const FunctionState& fn, const std::vector<std::string>& reasons) {
  Observe& o = observe();
  std::lock_guard lock(o.mutex);
  for (RecompileProfiler::Impl* p : o.profilers) {
    std::lock_guard plock(p->mutex);
    std::string key = fn.where();
    if (!p->functions.count(key)) p->order.push_back(key);
    auto& f = p->functions[key];
    ++f.recompiles;
    // Only the first reason per miss: the guard of the newest entry that failed.
    if (!reasons.empty()) ++f.failures[guard_category(reasons.back())];
  }
}

}  // namespace detail

RecompileProfiler::RecompileProfiler() : impl_(std::make_shared<Impl>()) {
  auto& o = detail::observe();
  std::lock_guard lock(o.mutex);
  o.profilers.push_back(impl_.get());
}

RecompileProfiler::~RecompileProfiler() {
  auto& o = detail::observe();
  std::lock_guard lock(o.mutex);
  o.profilers.erase(std::remove(o.profilers.begin(), o.profilers.end(), impl_.get()), o.profilers.end());
}

BackendFn RecompileProfiler::backend() {
  std::weak_ptr<Impl> weak = impl_;
  return [weak](Graph& g, const Arguments&) {
    if (auto p = weak.lock()) {
      std::lock_guard lock(p->mutex);
      ++p->frames;
      p->ops += static_cast<int>(g.nodes.size());
    }
    return interpreter(g);
  };
}

int RecompileProfiler::frame_count() const {
  std::lock_guard lock(impl_->mutex);
  return impl_->frames;
}

int RecompileProfiler::op_count() const {
  std::lock_guard lock(impl_->mutex);
  return impl_->ops;
}

std::string RecompileProfiler::report() const {
  std::lock_guard lock(impl_->mutex);
  std::string out = "Recompilation profile (" + std::to_string(impl_->frames) + " graphs compiled, " +
                    std::to_string(impl_->ops) + " ops):\n";
  if (impl_->order.empty()) return out + "  No recompilation detected.\n";
  for (const auto& key : impl_->order) {
    const auto& f = impl_->functions.at(key);
    out += "  function " + key + ": " + std::to_string(f.recompiles) + " recompile" + (f.recompiles == 1 ? "" : "s") + "\n";
    std::vector<std::pair<int, std::string>> sorted;
    for (const auto& [reason, n] : f.failures) sorted.emplace_back(-n, reason);
    std::sort(sorted.begin(), sorted.end());
    for (const auto& [neg, reason] : sorted) out += "    " + std::to_string(-neg) + " x " + reason + "\n";
  }
  return out;
}

}  // namespace kiln::compiler
