// Reading compile traces for `kiln report` (report_trace.h).
#include "report_trace.h"

#include <algorithm>
#include <filesystem>
#include <fstream>

#include "kiln/error.h"

namespace kiln::cli::report {

namespace {

constexpr int kKnownSchema = 1;                       // compile_trace.h's kCompileTraceSchema
constexpr std::uintmax_t kMaxTraceBytes = 4ull << 30;  // a larger file is not a trace of one run

}  // namespace

std::string text(const nlohmann::json& event, const char* key, const std::string& fallback) {
  auto it = event.find(key);
  return it != event.end() && it->is_string() ? it->get<std::string>() : fallback;
}

int64_t integer(const nlohmann::json& event, const char* key, int64_t fallback) {
  auto it = event.find(key);
  return it != event.end() && it->is_number_integer() ? it->get<int64_t>() : fallback;
}

double number(const nlohmann::json& event, const char* key, double fallback) {
  auto it = event.find(key);
  return it != event.end() && it->is_number() ? it->get<double>() : fallback;
}

bool flag(const nlohmann::json& event, const char* key, bool fallback) {
  auto it = event.find(key);
  return it != event.end() && it->is_boolean() ? it->get<bool>() : fallback;
}

std::string site(const nlohmann::json& event) {
  const std::string file = text(event, "file");
  const int64_t line = integer(event, "line");
  if (file.empty() || line <= 0) return "";
  return file + ":" + std::to_string(line);
}

int64_t Function::recompiles() const {
  return std::count_if(entries.begin(), entries.end(), [](const nlohmann::json& e) {
    auto it = e.find("recompile_reasons");
    return it != e.end() && it->is_array() && !it->empty();
  });
}

namespace {

// The function an event is about (frame, function, function_file, function_line), created at
// its first event. compiler::reset() starts frame ids again, so the name and place count too.
Function& function_of(Process& p, const nlohmann::json& e) {
  const int64_t frame = integer(e, "frame", -1);
  const std::string name = text(e, "function", "?");
  const std::string file = text(e, "function_file");
  const int64_t line = integer(e, "function_line");
  for (auto it = p.functions.rbegin(); it != p.functions.rend(); ++it)
    if (it->frame == frame && it->name == name && it->file == file && it->line == line) return *it;
  Function& f = p.functions.emplace_back();
  f.frame = frame;
  f.name = name;
  f.file = file;
  f.line = line;
  return f;
}

// The latest compile of the graph an event names, or nullptr.
GraphCompile* graph_of(Process& p, const nlohmann::json& e) {
  const std::string id = text(e, "graph");
  if (id.empty()) return nullptr;
  for (auto it = p.graphs.rbegin(); it != p.graphs.rend(); ++it)
    if (it->id == id) return &*it;
  return nullptr;
}

void add_event(Process& p, nlohmann::json e) {
  const std::string kind = text(e, "event");
  if (kind == "trace_start") {
    if (p.header.is_null()) p.header = std::move(e);
  } else if (kind == "frame_entry") {
    function_of(p, e).entries.push_back(std::move(e));
  } else if (kind == "graph_break") {
    function_of(p, e).breaks.push_back(std::move(e));
  } else if (kind == "recompile_limit") {
    function_of(p, e).limits.push_back(std::move(e));
  } else if (kind == "graph") {
    Function& f = function_of(p, e);
    f.graphs.push_back(p.graphs.size());
    GraphCompile& g = p.graphs.emplace_back();
    g.id = text(e, "graph", "?");
    g.graph = std::move(e);
  } else if (kind == "graph_compiled") {
    if (GraphCompile* g = graph_of(p, e)) {
      g->finished = true;
      g->ok = flag(e, "ok");
      g->seconds = number(e, "seconds");
      g->error = text(e, "error");
    }
  } else if (kind == "pass" || kind == "source" || kind == "kernel" || kind == "cuda_graph") {
    GraphCompile* g = graph_of(p, e);
    if (!g) {
      if (kind == "kernel") p.other_kernels.push_back(std::move(e));
      return;
    }
    auto& list = kind == "pass" ? g->passes : kind == "source" ? g->sources : kind == "kernel" ? g->kernels : g->cuda_graphs;
    list.push_back(std::move(e));
  } else if (kind == "phase") {
    p.phases.push_back(std::move(e));
  } else {
    ++p.unknown_events;
  }
}

}  // namespace

Process read_trace(const std::string& path) {
  std::error_code error;
  const auto bytes = std::filesystem::file_size(path, error);
  KILN_CHECK(!error, Error, "cannot read the trace '" + path + "': " + error.message() + ".");
  KILN_CHECK(bytes <= kMaxTraceBytes, ValueError,
             "the trace '" + path + "' is " + std::to_string(bytes >> 20) + " MiB, more than a trace of one run.");
  std::ifstream in(path, std::ios::binary);
  KILN_CHECK(in.good(), Error, "cannot open the trace '" + path + "'.");
  Process p;
  p.path = path;
  std::string line;
  bool first = true;
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    nlohmann::json e = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (!e.is_object()) {
      ++p.bad_lines;
      continue;
    }
    if (first) {
      KILN_CHECK(text(e, "event") == "trace_start", ValueError,
                 "'" + path + "' is not a Kiln compile trace: its first line is not a trace_start event.");
      const int64_t schema = integer(e, "schema", -1);
      if (schema != kKnownSchema)
        p.schema_note = "written with trace schema " + std::to_string(schema) + "; this kiln reads schema " +
                        std::to_string(kKnownSchema) + ", so some events may be missing from the report";
      first = false;
    }
    add_event(p, std::move(e));
  }
  KILN_CHECK(!first, ValueError, "'" + path + "' is not a Kiln compile trace: it holds no events.");
  return p;
}

std::vector<std::string> trace_files(const std::string& path) {
  std::error_code error;
  std::vector<std::string> files;
  if (std::filesystem::is_directory(path, error)) {
    for (const auto& entry : std::filesystem::directory_iterator(path, error))
      if (entry.is_regular_file(error) && entry.path().extension() == ".jsonl") files.push_back(entry.path().string());
    std::sort(files.begin(), files.end());
    KILN_CHECK(!files.empty(), ValueError,
               "no trace files (*.jsonl) in '" + path + "'. Run the program with KILN_TRACE_DIR=" + path + " first.");
  } else {
    KILN_CHECK(std::filesystem::is_regular_file(path, error), ValueError,
               "'" + path + "' is neither a trace file nor a directory of them.");
    files.push_back(path);
  }
  return files;
}

}  // namespace kiln::cli::report
