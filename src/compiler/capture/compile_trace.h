// The structured compile trace (KILN_TRACE_DIR=dir, compiler::set_trace_dir; schema in
// docs/compile-trace.md): each process appends one JSON-lines file of compile events, which
// `kiln report` turns into an HTML page (the counterpart of torch's TORCH_TRACE and tlparse).
//
// Each event is one line written with one write(2) as it happens, so a crash keeps every event
// before it. The writer adds to each event "t" (seconds since the trace started), "thread" (a
// small number per thread of the process) and, while this thread compiles or runs a graph,
// "graph" (its id, "0/1"). Events are built only while a trace is on: call sites test
// compile_trace_on() first, which is one relaxed atomic load.
#pragma once

#include <atomic>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "compiler/capture/call_site.h"

namespace kiln::compiler::detail {

// Bumped when an event's fields change meaning or go away (adding fields does not bump it).
inline constexpr int kCompileTraceSchema = 1;

extern std::atomic<bool> g_compile_trace_on;
inline bool compile_trace_on() { return g_compile_trace_on.load(std::memory_order_relaxed); }

// Appends the event `name` with `fields` (an object) to the trace, if one is on. Thread-safe.
// Never throws: an event that cannot be written turns the trace off with one warning.
void trace_event(std::string_view name, nlohmann::json fields);

// While alive, this thread's events carry "graph": `id` (the graph a compile or run is about).
// Worker threads a compile starts take the id with TraceGraphScope(trace_graph_id()).
class TraceGraphScope {
 public:
  explicit TraceGraphScope(std::string id);
  ~TraceGraphScope();
  TraceGraphScope(const TraceGraphScope&) = delete;
  TraceGraphScope& operator=(const TraceGraphScope&) = delete;

 private:
  std::string id_;
  const std::string* outer_;
};
// This thread's current graph id ("" when none).
std::string trace_graph_id();

struct FunctionState;
// What every event about a compiled function says of it: "frame", "function", "function_file"
// and "function_line" (kiln report tells functions apart by all four).
nlohmann::json function_json(const FunctionState& st);

// {"file", "line", "function"} of a call site, or an empty object when it is unknown.
nlohmann::json call_site_json(const CallSite& site);

}  // namespace kiln::compiler::detail
