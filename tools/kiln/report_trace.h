// `kiln report`'s reading of compile traces (KILN_TRACE_DIR, docs/compile-trace.md) into one
// model per process, which report_html.cpp renders. A trace file is data from anywhere: every
// field is read with a default, a line that is not a JSON object is counted and skipped (a crash
// can cut the last line), and nothing in it is ever run.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace kiln::cli::report {

// A field of an event, or `fallback` when it is missing or of another type.
std::string text(const nlohmann::json& event, const char* key, const std::string& fallback = "");
int64_t integer(const nlohmann::json& event, const char* key, int64_t fallback = 0);
double number(const nlohmann::json& event, const char* key, double fallback = -1);
bool flag(const nlohmann::json& event, const char* key, bool fallback = false);
// "file:line" of an event's "file"/"line" fields, "" when it has none.
std::string site(const nlohmann::json& event);

// One compile of a graph: the "graph" event and the events that named it until the next compile
// of the same id.
struct GraphCompile {
  nlohmann::json graph;  // the "graph" event (rows: the captured graph)
  std::string id;
  bool finished = false;  // a "graph_compiled" event came
  bool ok = false;
  double seconds = -1;
  std::string error;
  std::vector<nlohmann::json> passes, sources, kernels, cuda_graphs;
};

// A compiled function (one frame id between compiler::reset() calls).
struct Function {
  int64_t frame = 0;
  std::string name, file;
  int64_t line = 0;
  std::vector<nlohmann::json> entries;         // "frame_entry" events
  std::vector<nlohmann::json> breaks;          // "graph_break" events
  std::vector<nlohmann::json> limits;          // "recompile_limit" events
  std::vector<size_t> graphs;                  // indices into Process::graphs, in compile order
  int64_t recompiles() const;
};

struct Process {
  std::string path;           // the trace file
  nlohmann::json header;      // its "trace_start" event
  std::vector<Function> functions;
  std::vector<GraphCompile> graphs;
  std::vector<nlohmann::json> phases;           // "phase" events
  std::vector<nlohmann::json> other_kernels;    // "kernel" events outside any graph (eager CUDA kernels)
  int64_t bad_lines = 0;      // lines that were not JSON objects
  int64_t unknown_events = 0; // events of kinds this Kiln does not know (a newer writer)
  std::string schema_note;    // set when the file's schema is not the one this reader knows
};

// Reads one trace file. Throws kiln::Error when it cannot be opened or is not a trace.
Process read_trace(const std::string& path);
// The trace files under `path` (a file, or a directory's *.jsonl), sorted. Throws when none.
std::vector<std::string> trace_files(const std::string& path);

}  // namespace kiln::cli::report
