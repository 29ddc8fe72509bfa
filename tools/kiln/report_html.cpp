// `kiln report`'s HTML page (report_html.h).
#include "report_html.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <set>
#include <unordered_map>

extern char** environ;

namespace kiln::cli::report {

std::string html_escape(const std::string& s) {
  std::string out;
  out.reserve(s.size());
  for (char c : s) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      case '\'': out += "&#39;"; break;
      default: out += c;
    }
  }
  return out;
}

// ---- highlighting ----

namespace {

bool ident_start(char c) { return std::isalpha(static_cast<unsigned char>(c)) || c == '_'; }
bool ident_char(char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_'; }

const std::set<std::string>& keywords() {
  static const std::set<std::string> k = {
      "auto",     "break",    "case",     "const",     "constexpr", "continue", "default", "do",
      "else",     "extern",   "for",      "if",        "inline",    "namespace", "return", "sizeof",
      "static",   "struct",   "switch",   "template",  "typedef",   "using",    "volatile", "while",
      "__global__", "__device__", "__shared__", "__restrict__", "__forceinline__", "restrict",
      "__launch_bounds__", "__syncthreads", "true", "false", "nullptr"};
  return k;
}

const std::set<std::string>& types() {
  static const std::set<std::string> t = {
      "bool",    "char",     "double",   "float",    "int",      "long",     "short",   "signed",
      "unsigned", "void",    "int8_t",   "int16_t",  "int32_t",  "int64_t",  "uint8_t", "uint16_t",
      "uint32_t", "uint64_t", "size_t",  "__half",   "__nv_bfloat16", "half", "bfloat16", "float4",
      "__m256",  "__m512",   "__m256i",  "__m512i"};
  return t;
}

std::string span(const char* cls, const std::string& text) {
  return std::string("<span class=\"") + cls + "\">" + html_escape(text) + "</span>";
}

}  // namespace

std::string highlight_source(const std::string& s) {
  std::string out;
  size_t i = 0;
  bool line_start = true;  // only whitespace since the last newline
  while (i < s.size()) {
    const char c = s[i];
    if (c == '\n') {
      out += '\n';
      line_start = true;
      ++i;
      continue;
    }
    if (c == ' ' || c == '\t') {
      out += c;
      ++i;
      continue;
    }
    size_t j = i + 1;
    if (line_start && c == '#') {
      while (j < s.size() && s[j] != '\n') ++j;
      out += span("hl-pp", s.substr(i, j - i));
    } else if (c == '/' && i + 1 < s.size() && s[i + 1] == '/') {
      while (j < s.size() && s[j] != '\n') ++j;
      out += span("hl-com", s.substr(i, j - i));
    } else if (c == '/' && i + 1 < s.size() && s[i + 1] == '*') {
      size_t end = s.find("*/", i + 2);
      j = end == std::string::npos ? s.size() : end + 2;
      out += span("hl-com", s.substr(i, j - i));
    } else if (c == '"' || c == '\'') {
      while (j < s.size() && s[j] != c && s[j] != '\n') j += s[j] == '\\' ? 2 : 1;
      j = std::min(j + 1, s.size());
      out += span("hl-str", s.substr(i, j - i));
    } else if (std::isdigit(static_cast<unsigned char>(c)) ||
               (c == '.' && j < s.size() && std::isdigit(static_cast<unsigned char>(s[j])))) {
      while (j < s.size() && (ident_char(s[j]) || s[j] == '.' ||
                              ((s[j] == '+' || s[j] == '-') && std::strchr("eEpP", s[j - 1]) != nullptr)))
        ++j;
      out += span("hl-num", s.substr(i, j - i));
    } else if (ident_start(c)) {
      while (j < s.size() && ident_char(s[j])) ++j;
      const std::string word = s.substr(i, j - i);
      if (keywords().count(word)) out += span("hl-kw", word);
      else if (types().count(word)) out += span("hl-ty", word);
      else out += html_escape(word);
    } else {
      out += html_escape(std::string(1, c));
    }
    line_start = false;
    i = j;
  }
  return out;
}

// ---- Graphviz ----

namespace {

// Whether only root or this user can change `path`: the file and every directory above it.
bool only_trusted_can_write(const std::filesystem::path& path) {
  std::filesystem::path prefix;
  for (const auto& part : path) {
    prefix /= part;
    struct stat st;
    if (::lstat(prefix.c_str(), &st) != 0) return false;
    const bool owner_ok = st.st_uid == 0 || st.st_uid == ::geteuid();
    const bool others_write = (st.st_mode & (S_IWGRP | S_IWOTH)) != 0;
    const bool sticky_dir = S_ISDIR(st.st_mode) && (st.st_mode & S_ISVTX);
    if (!owner_ok || (others_write && !sticky_dir)) return false;
    // A sticky directory (/tmp) protects entries from others, but not a file others may create in it.
    if (others_write && prefix == path) return false;
  }
  return true;
}

}  // namespace

std::string trusted_dot() {
  const char* env = std::getenv("PATH");
  const std::string path = env && *env ? env : "/usr/local/bin:/usr/bin:/bin";
  for (size_t begin = 0; begin <= path.size();) {
    size_t end = path.find(':', begin);
    if (end == std::string::npos) end = path.size();
    const std::string dir = path.substr(begin, end - begin);
    begin = end + 1;
    if (dir.empty() || dir[0] != '/') continue;  // never the working directory
    std::error_code error;
    const std::filesystem::path real = std::filesystem::canonical(dir + "/dot", error);
    if (error) continue;
    struct stat st;
    if (::stat(real.c_str(), &st) != 0 || !S_ISREG(st.st_mode) || ::access(real.c_str(), X_OK) != 0) continue;
    if (only_trusted_can_write(real) && only_trusted_can_write(std::filesystem::path(dir)))
      return (std::filesystem::path(dir) / "dot").string();
  }
  return "";
}

std::string dot_to_svg(const std::string& dot, const std::string& source, double seconds) {
  // The graph goes in through a private temporary file, the picture comes out through a pipe.
  char input_path[] = "/tmp/kiln-report-XXXXXX";
  const int input = ::mkstemp(input_path);
  if (input < 0) return "";
  const std::string input_name = input_path;
  struct Cleanup {
    std::string path;
    ~Cleanup() { ::unlink(path.c_str()); }
  } cleanup{input_name};
  size_t written = 0;
  while (written < source.size()) {
    ssize_t n = ::write(input, source.data() + written, source.size() - written);
    if (n <= 0) {
      ::close(input);
      return "";
    }
    written += static_cast<size_t>(n);
  }
  ::close(input);

  int out[2];
  if (::pipe2(out, O_CLOEXEC) != 0) return "";
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, out[1], 1);
  posix_spawn_file_actions_addopen(&actions, 2, "/dev/null", O_WRONLY, 0);
  posix_spawn_file_actions_addopen(&actions, 0, "/dev/null", O_RDONLY, 0);
  // A fixed environment: no GVBINDIR or similar can make dot load plugins from elsewhere.
  std::string path_var = "PATH=/usr/bin:/bin";
  std::array<char*, 2> env = {path_var.data(), nullptr};
  std::string arg0 = dot, arg1 = "-Tsvg", arg2 = input_name;
  std::array<char*, 4> argv = {arg0.data(), arg1.data(), arg2.data(), nullptr};
  pid_t pid = -1;
  const int spawned = ::posix_spawn(&pid, dot.c_str(), &actions, nullptr, argv.data(), env.data());
  posix_spawn_file_actions_destroy(&actions);
  ::close(out[1]);
  if (spawned != 0) {
    ::close(out[0]);
    return "";
  }
  std::string svg;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  bool timed_out = false;
  char buffer[65536];
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) {
      timed_out = true;
      break;
    }
    pollfd p{out[0], POLLIN, 0};
    const int ready = ::poll(&p, 1, static_cast<int>(std::min<int64_t>(left.count(), 1000)));
    if (ready < 0 && errno != EINTR) break;
    if (ready <= 0) continue;
    const ssize_t n = ::read(out[0], buffer, sizeof buffer);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    svg.append(buffer, static_cast<size_t>(n));
  }
  ::close(out[0]);
  if (timed_out) ::kill(pid, SIGKILL);
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  if (timed_out || !WIFEXITED(status) || WEXITSTATUS(status) != 0) return "";
  const size_t start = svg.find("<svg");
  const size_t stop = svg.rfind("</svg>");
  if (start == std::string::npos || stop == std::string::npos || stop < start) return "";
  return svg.substr(start, stop + 6 - start);
}

// ---- the page ----

namespace {

constexpr const char* kStyle = R"(
body { font-family: system-ui, sans-serif; margin: 24px; color: #1d1d1f; max-width: 1400px; }
h1 { font-size: 1.6em; margin-bottom: 4px; } h2 { border-bottom: 1px solid #ddd; padding-bottom: 4px; }
.meta { color: #666; margin-top: 0; }
table { border-collapse: collapse; margin: 8px 0; font-size: 0.92em; }
th, td { border: 1px solid #ddd; padding: 3px 8px; text-align: left; vertical-align: top; }
th { background: #f5f5f7; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
code, pre, .mono { font-family: ui-monospace, monospace; font-size: 0.9em; }
details { margin: 6px 0 6px 12px; } summary { cursor: pointer; padding: 2px 0; }
details.function > summary { font-weight: 600; font-size: 1.08em; }
.break { color: #9a3412; } .recompile { color: #7c2d12; } .error { color: #b91c1c; font-weight: 600; }
.note { color: #666; font-style: italic; }
.site { font-family: ui-monospace, monospace; background: #f2f2f2; padding: 0 4px; border-radius: 3px; }
.picture { overflow: auto; max-height: 800px; border: 1px solid #eee; margin: 6px 0; }
pre.code { background: #fafafa; border: 1px solid #eee; padding: 8px; overflow: auto; max-height: 600px; }
.hl-kw { color: #7c3aed; font-weight: 600; } .hl-ty { color: #0369a1; } .hl-num { color: #b45309; }
.hl-str { color: #15803d; } .hl-com { color: #6b7280; font-style: italic; } .hl-pp { color: #be185d; }
)";

std::string seconds_text(double s) { return s < 0 ? "?" : fmt::format("{:.3f}", s); }

// "1 graph", "3 graphs".
std::string count_of(size_t n, const char* one, const char* many) {
  return std::to_string(n) + " " + (n == 1 ? one : many);
}

// DOT's quoted strings: quotes and backslashes escaped, line breaks gone, long text cut.
std::string dot_label(std::string s) {
  if (s.size() > 80) s = s.substr(0, 77) + "...";
  std::string out;
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    out += (c == '\n' || c == '\r') ? ' ' : c;
  }
  return out;
}

// The graph's picture source, from the trace's rows: one node per placeholder, op and the output;
// an edge from the row that last wrote each value a row reads.
std::string graph_dot(const nlohmann::json& rows) {
  std::string dot = "digraph g {\n  node [shape=box, fontname=\"monospace\", fontsize=10];\n";
  std::unordered_map<std::string, std::string> writer;  // value name -> node id
  for (size_t k = 0; k < rows.size(); ++k) {
    const nlohmann::json& r = rows[k];
    if (!r.is_object()) continue;
    const std::string id = "r" + std::to_string(k);
    const std::string opcode = text(r, "opcode");
    const std::string name = text(r, "name"), target = text(r, "target"), type = text(r, "type");
    if (opcode == "placeholder" || opcode == "get_attr") {
      dot += "  " + id + " [shape=ellipse, label=\"" + dot_label(name) + "\\n" + dot_label(type) + "\"];\n";
    } else if (opcode == "output") {
      dot += "  " + id + " [shape=ellipse, label=\"output\"];\n";
    } else {
      std::string label = dot_label(name) + (target != name ? "\\n" + dot_label(target) : "") + "\\n" + dot_label(type);
      if (const std::string where = site(r); !where.empty()) label += "\\n" + dot_label(where);
      dot += "  " + id + " [label=\"" + label + "\"];\n";
    }
    std::set<std::string> from;
    auto reads = r.find("inputs");
    if (reads != r.end() && reads->is_array())
      for (const auto& v : *reads)
        if (v.is_string())
          if (auto w = writer.find(v.get<std::string>()); w != writer.end() && from.insert(w->second).second)
            dot += "  " + w->second + " -> " + id + ";\n";
    auto writes = r.find("outputs");
    if (writes != r.end() && writes->is_array())
      for (const auto& v : *writes)
        if (v.is_string()) {
          // An in-place op reads the value it overwrites.
          if (opcode == "call_inplace")
            if (auto w = writer.find(v.get<std::string>()); w != writer.end() && from.insert(w->second).second)
              dot += "  " + w->second + " -> " + id + ";\n";
          writer[v.get<std::string>()] = id;
        }
  }
  return dot + "}\n";
}

std::string site_html(const nlohmann::json& e) {
  const std::string where = site(e);
  return where.empty() ? "<span class=\"note\">unknown</span>" : "<span class=\"site\">" + html_escape(where) + "</span>";
}

std::string function_title(const Function& f) {
  std::string t = "'" + f.name + "'";
  if (!f.file.empty()) t += " (" + f.file + ":" + std::to_string(f.line) + ")";
  return t;
}

std::string string_list(const nlohmann::json& e, const char* key, const char* cls = nullptr) {
  auto it = e.find(key);
  if (it == e.end() || !it->is_array() || it->empty()) return "";
  std::string out = "<ul>";
  for (const auto& item : *it)
    if (item.is_string())
      out += std::string("<li") + (cls ? std::string(" class=\"") + cls + "\"" : "") + "><code>" +
             html_escape(item.get<std::string>()) + "</code></li>";
  return out + "</ul>";
}

struct Totals {
  int64_t graphs = 0, new_sizes = 0, failed = 0, breaks = 0, recompiles = 0, limits = 0;
  int64_t kernel_hits = 0, kernel_builds = 0;
  double compile_seconds = 0;
  std::map<std::string, std::pair<int64_t, double>> phases;  // name -> (count, seconds)
};

Totals totals(const std::vector<Process>& processes) {
  Totals t;
  auto count_kernel = [&](const nlohmann::json& k) {
    const std::string result = text(k, "result");
    if (result == "build") ++t.kernel_builds;
    else if (result == "hit" || result == "loaded" || result == "bundled") ++t.kernel_hits;
  };
  for (const Process& p : processes) {
    for (const Function& f : p.functions) {
      t.breaks += static_cast<int64_t>(f.breaks.size());
      t.recompiles += f.recompiles();
      t.limits += static_cast<int64_t>(f.limits.size());
    }
    for (const GraphCompile& g : p.graphs) {
      if (flag(g.graph, "new_size_of_dynamic_graph")) ++t.new_sizes;
      else ++t.graphs;
      if (g.finished && !g.ok) ++t.failed;
      if (g.seconds > 0) t.compile_seconds += g.seconds;
      for (const auto& k : g.kernels) count_kernel(k);
    }
    for (const auto& k : p.other_kernels) count_kernel(k);
    for (const auto& ph : p.phases) {
      auto& [count, seconds] = t.phases[text(ph, "name", "?")];
      ++count;
      seconds += std::max(0.0, number(ph, "seconds", 0));
    }
  }
  return t;
}

void summary_row(std::string& out, const char* id, const std::string& what, const std::string& value) {
  out += "<tr><th>" + html_escape(what) + "</th><td class=\"num\" id=\"" + id + "\">" + html_escape(value) + "</td></tr>\n";
}

std::string render_summary(const std::vector<Process>& processes) {
  const Totals t = totals(processes);
  std::string out = "<section id=\"summary\"><h2>Summary</h2>\n<table class=\"summary\">\n";
  summary_row(out, "graph-count", "graphs compiled", std::to_string(t.graphs));
  summary_row(out, "new-size-count", "new sizes of dynamic graphs", std::to_string(t.new_sizes));
  summary_row(out, "failed-count", "failed compiles", std::to_string(t.failed));
  summary_row(out, "break-count", "graph breaks", std::to_string(t.breaks));
  summary_row(out, "recompile-count", "recompiles", std::to_string(t.recompiles));
  summary_row(out, "limit-count", "recompile limits hit", std::to_string(t.limits));
  summary_row(out, "compile-seconds", "compile seconds (graphs)", seconds_text(t.compile_seconds));
  const int64_t lookups = t.kernel_hits + t.kernel_builds;
  summary_row(out, "cache-hit-rate", "kernel cache hit rate",
              lookups == 0 ? "no kernels"
                           : fmt::format("{:.0f}% ({} of {} kernels found, {} built)", 100.0 * double(t.kernel_hits) / double(lookups),
                                         t.kernel_hits, lookups, t.kernel_builds));
  out += "</table>\n";
  if (!t.phases.empty()) {
    out += "<h3>Compile seconds by phase</h3>\n<table id=\"phases\"><tr><th>phase</th><th>times</th><th>seconds</th></tr>\n";
    for (const auto& [name, cs] : t.phases)
      out += "<tr><td>" + html_escape(name) + "</td><td class=\"num\">" + std::to_string(cs.first) +
             "</td><td class=\"num\">" + seconds_text(cs.second) + "</td></tr>\n";
    out += "</table>\n";
  }
  return out + "</section>\n";
}

std::string render_rows_table(const nlohmann::json& rows) {
  std::string out =
      "<table class=\"nodes\"><tr><th>opcode</th><th>name</th><th>target</th><th>args</th><th>kwargs</th>"
      "<th>type</th><th>source</th></tr>\n";
  for (const auto& r : rows) {
    if (!r.is_object()) continue;
    const std::string opcode = text(r, "opcode");
    const bool call = opcode == "call_function" || opcode == "call_inplace";
    out += "<tr><td>" + html_escape(opcode) + "</td><td class=\"mono\">" + html_escape(text(r, "name")) +
           "</td><td class=\"mono\">" + html_escape(text(r, "target")) + "</td><td class=\"mono\">" +
           html_escape(text(r, "args")) + "</td><td class=\"mono\">" + html_escape(text(r, "kwargs")) +
           "</td><td class=\"mono\">" + html_escape(text(r, "type")) + "</td><td>" + (call ? site_html(r) : "") +
           "</td></tr>\n";
  }
  return out + "</table>\n";
}

std::string render_graph(const GraphCompile& g, const std::string& anchor, const HtmlOptions& options,
                         const std::string& dot) {
  const nlohmann::json& e = g.graph;
  const int64_t ops = integer(e, "ops");
  std::string status;
  if (!g.finished) status = " — <span class=\"error\">did not finish (the process ended during the compile)</span>";
  else if (!g.ok) status = " — <span class=\"error\">failed</span>";
  else status = " — compiled in " + seconds_text(g.seconds) + " s";
  std::string out = "<details class=\"graph\" id=\"" + anchor + "\"" + (ops <= 40 ? " open" : "") + "><summary>graph <code class=\"graph-id\">" +
                    html_escape(g.id) + "</code>" + (flag(e, "new_size_of_dynamic_graph") ? " (new size of a dynamic graph)" : "") +
                    ": " + std::to_string(ops) + " ops, backend " + html_escape(text(e, "backend", "?")) + ", mode " +
                    html_escape(text(e, "mode", "default")) + (flag(e, "dynamic") ? ", dynamic" : "") + status +
                    "</summary>\n";
  if (g.finished && !g.ok) out += "<pre class=\"error\">" + html_escape(g.error) + "</pre>\n";
  const nlohmann::json rows = e.contains("rows") && e["rows"].is_array() ? e["rows"] : nlohmann::json::array();
  if (options.graphviz && !dot.empty() && static_cast<size_t>(ops) <= options.max_draw_nodes) {
    const std::string svg = dot_to_svg(dot, graph_dot(rows));
    if (!svg.empty()) out += "<div class=\"picture\">" + svg + "</div>\n";
    else out += "<p class=\"note\">Graphviz could not draw this graph; the table follows.</p>\n";
  } else if (options.graphviz && !dot.empty()) {
    out += "<p class=\"note\">" + std::to_string(ops) + " ops: more than --max-draw-nodes " +
           std::to_string(options.max_draw_nodes) + ", so no picture; the table follows.</p>\n";
  }
  out += "<details class=\"node-table\" open><summary>nodes</summary>\n" + render_rows_table(rows) + "</details>\n";
  if (!g.passes.empty()) {
    out += "<details class=\"passes\"><summary>passes (" + std::to_string(g.passes.size()) +
           ")</summary><table><tr><th>pass</th><th>ms</th><th>nodes before</th><th>after</th></tr>\n";
    for (const auto& p : g.passes) {
      if (flag(p, "skipped")) {
        out += "<tr><td>" + html_escape(text(p, "name")) + "</td><td colspan=\"3\" class=\"note\">skipped (KILN_DISABLE_PASSES)</td></tr>\n";
        continue;
      }
      out += "<tr><td>" + html_escape(text(p, "name")) + "</td><td class=\"num\">" + fmt::format("{:.3f}", number(p, "ms", 0)) +
             "</td><td class=\"num\">" + std::to_string(integer(p, "nodes_before")) + "</td><td class=\"num\">" +
             std::to_string(integer(p, "nodes_after")) + "</td></tr>\n";
    }
    out += "</table></details>\n";
  }
  if (!g.kernels.empty()) {
    out += "<details class=\"kernels\"><summary>kernel binaries (" + std::to_string(g.kernels.size()) +
           ")</summary><table><tr><th>kind</th><th>result</th><th>seconds</th><th>for</th><th>key</th></tr>\n";
    for (const auto& k : g.kernels) {
      const double s = number(k, "seconds");
      out += "<tr><td>" + html_escape(text(k, "kind")) + "</td><td>" + html_escape(text(k, "result")) +
             "</td><td class=\"num\">" + (s >= 0 ? seconds_text(s) : "") + "</td><td>" + html_escape(text(k, "label")) +
             "</td><td class=\"mono\">" + html_escape(text(k, "key").substr(0, 16)) + "</td></tr>\n";
    }
    out += "</table></details>\n";
  }
  for (const auto& c : g.cuda_graphs) {
    out += "<p>CUDA graph " + html_escape(text(c, "action")) +
           (text(c, "action") == "recorded" ? ": " + std::to_string(integer(c, "graph_nodes")) + " nodes, " +
                                                   std::to_string(integer(c, "output_copies")) + " output copies"
                                             : ": " + html_escape(text(c, "reason"))) +
           "</p>\n";
  }
  for (size_t i = 0; i < g.sources.size(); ++i) {
    const auto& s = g.sources[i];
    std::string code = text(s, "text");
    std::string note;
    if (code.size() > options.max_source_bytes) {
      note = "<p class=\"note\">" + std::to_string(code.size() >> 10) + " KiB; the first " +
             std::to_string(options.max_source_bytes >> 10) + " KiB are shown (the trace holds all of it).</p>";
      code.resize(options.max_source_bytes);
    }
    const std::string language = text(s, "language", "?");
    const std::string name = language == "cuda" ? "CUDA kernel " + text(s, "kernel") : "C++ unit " + std::to_string(integer(s, "unit"));
    out += "<details class=\"source\"><summary>generated " + html_escape(name) + "</summary>" + note +
           "<pre class=\"code\">" + highlight_source(code) + "</pre></details>\n";
  }
  return out + "</details>\n";
}

std::string render_breaks(const std::vector<const nlohmann::json*>& breaks) {
  if (breaks.empty()) return "";
  std::string out = "<h4>Graph breaks</h4><ol class=\"breaks\">\n";
  for (const nlohmann::json* b : breaks)
    out += "<li class=\"break\">" + site_html(*b) + " " + html_escape(text(*b, "reason")) + "</li>\n";
  return out + "</ol>\n";
}

// A function's tree: its frame entries, each with the guards it checks, the recompile that made
// it, and the graphs and breaks of its calls (backward graphs under the backward entry).
std::string render_function(const Process& p, size_t pi, const Function& f, const HtmlOptions& options,
                            const std::string& dot) {
  std::string out = "<details class=\"function\" open><summary>" + html_escape(function_title(f)) + ": " +
                    count_of(f.entries.size(), "frame entry", "frame entries") + ", " +
                    count_of(f.graphs.size(), "graph", "graphs") + ", " + count_of(f.breaks.size(), "break", "breaks") +
                    ", " + count_of(static_cast<size_t>(f.recompiles()), "recompile", "recompiles") + "</summary>\n";
  for (const auto& l : f.limits)
    out += "<p class=\"error\">recompile limit (" + std::to_string(integer(l, "limit")) +
           ") reached: later signatures run eagerly.</p>" + string_list(l, "reasons", "recompile");
  std::set<int64_t> entry_ids;
  auto graphs_of = [&](int64_t entry, bool orphans) {
    std::string html;
    for (size_t gi : f.graphs) {
      const int64_t e = integer(p.graphs[gi].graph, "entry", -2);
      if (orphans ? entry_ids.count(e) == 0 : e == entry)
        html += render_graph(p.graphs[gi], "graph-" + std::to_string(pi) + "-" + std::to_string(gi), options, dot);
    }
    return html;
  };
  auto breaks_of = [&](int64_t entry, bool orphans) {
    std::vector<const nlohmann::json*> list;
    for (const auto& b : f.breaks) {
      const int64_t e = integer(b, "entry", -2);
      if (orphans ? entry_ids.count(e) == 0 : e == entry) list.push_back(&b);
    }
    return list;
  };
  for (const auto& e : f.entries) entry_ids.insert(integer(e, "entry", -2));
  for (const auto& e : f.entries) {
    const int64_t id = integer(e, "entry", -2);
    const bool backward = flag(e, "backward");
    const std::vector<const nlohmann::json*> breaks = breaks_of(id, false);
    const std::string reasons = string_list(e, "recompile_reasons", "recompile");
    out += "<details class=\"entry\" open><summary>" +
           (backward ? std::string("backward entry") : "frame entry " + std::to_string(id)) + " (backend " +
           html_escape(text(e, "backend", "?")) + (flag(e, "dynamic") ? ", dynamic" : "") + ")" +
           (reasons.empty() ? "" : " <span class=\"recompile\">recompile</span>") + "</summary>\n";
    if (!reasons.empty()) out += "<p>Recompiled because these guards failed:</p>" + reasons;
    const std::string guards = string_list(e, "guards");
    if (!guards.empty()) out += "<details class=\"guards\"><summary>guards</summary>" + guards + "</details>\n";
    out += render_breaks(breaks) + graphs_of(id, false) + "</details>\n";
  }
  // Events whose entry the trace does not hold (a trace started while the function ran).
  out += render_breaks(breaks_of(0, true)) + graphs_of(0, true);
  return out + "</details>\n";
}

}  // namespace

std::string render_html(const std::vector<Process>& processes, const HtmlOptions& options) {
  const std::string dot = options.graphviz ? trusted_dot() : "";
  std::string out =
      "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\n"
      "<meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; style-src 'unsafe-inline'; img-src data:\">\n"
      "<title>Kiln compile report</title>\n<style>" +
      std::string(kStyle) + "</style></head><body>\n<h1>Kiln compile report</h1>\n";
  out += "<p class=\"meta\">" + std::to_string(processes.size()) + " trace file" + (processes.size() == 1 ? "" : "s");
  if (options.graphviz && dot.empty()) out += "; Graphviz (dot) not found, so graphs are shown as tables";
  out += "</p>\n";
  out += render_summary(processes);
  out += "<section id=\"functions\"><h2>Functions</h2>\n";
  for (size_t pi = 0; pi < processes.size(); ++pi) {
    const Process& p = processes[pi];
    const nlohmann::json& h = p.header;
    out += "<div class=\"process\"><h3>Process " + std::to_string(integer(h, "pid")) + " on " + html_escape(text(h, "host", "?")) +
           ", started " + html_escape(text(h, "started", "?")) + " (Kiln " + html_escape(text(h, "kiln_version", "?")) +
           ")</h3>\n<p class=\"meta\">" + html_escape(p.path) + " — working directory " + html_escape(text(h, "cwd", "?")) + "</p>\n";
    if (!p.schema_note.empty()) out += "<p class=\"note\">" + html_escape(p.schema_note) + ".</p>\n";
    if (p.bad_lines > 0)
      out += "<p class=\"note bad-lines\">" + std::to_string(p.bad_lines) +
             " line(s) could not be read (a crash can cut the last one) and were skipped.</p>\n";
    if (p.functions.empty()) out += "<p class=\"note\">No compiled function ran while this trace was on.</p>\n";
    for (const Function& f : p.functions) out += render_function(p, pi, f, options, dot);
    out += "</div>\n";
  }
  out += "</section>\n</body></html>\n";
  return out;
}

}  // namespace kiln::cli::report
