// The structured compile trace (KILN_TRACE_DIR, compiler::set_trace_dir; docs/compile-trace.md)
// and `kiln report`, whose page is checked in headless Chromium.
#include <gtest/gtest.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "kernel_cache_dir.h"
#include "kiln/kiln.h"

KILN_TEST_KERNEL_CACHE_DIR("kiln_test_compile_trace");

using namespace kiln;

namespace {

namespace fs = std::filesystem;

// The seed tutorial's bar(): `if (b.sum() < 0)` reads data, so the graph breaks there.
constexpr int kDivLine = __LINE__ + 2;
Tensor bar(const Tensor& a, Tensor b) {
  Tensor x = a / (abs(a) + 1);
  if (b.sum() < 0) {  // kBreakLine
    b = b * -1;       // kNegLine
  }
  return x * b;  // kMulLine
}
constexpr int kBreakLine = kDivLine + 1;
constexpr int kNegLine = kDivLine + 2;
constexpr int kMulLine = kDivLine + 4;

std::string temp_dir(const char* name) {
  std::string dir = (fs::temp_directory_path() / (std::string(name) + "_XXXXXX")).string();
  EXPECT_NE(::mkdtemp(dir.data()), nullptr);
  return dir;
}

std::vector<nlohmann::json> read_events(const std::string& path) {
  std::vector<nlohmann::json> events;
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    nlohmann::json e = nlohmann::json::parse(line, nullptr, false);
    EXPECT_TRUE(e.is_object()) << "not a JSON object: " << line.substr(0, 200);
    events.push_back(std::move(e));
  }
  return events;
}

std::vector<nlohmann::json> of_kind(const std::vector<nlohmann::json>& events, const std::string& kind) {
  std::vector<nlohmann::json> out;
  for (const auto& e : events)
    if (e.value("event", "") == kind) out.push_back(e);
  return out;
}

bool in_this_file(const nlohmann::json& e) { return e.value("file", "").ends_with("test_compile_trace.cpp"); }

// The tutorial's run: bar(a, b) with b's sum positive, then negative. Three graphs (the ops
// before the break; x * b; b * -1 and x * b) and two breaks. Returns the trace file.
std::string trace_bar_run(const std::string& dir) {
  compiler::reset();
  const std::string file = compiler::set_trace_dir(dir);
  auto opt_bar = compile(bar, {.name = "bar", .arg_names = {"a", "b"}});
  Tensor a = randn({10});
  Tensor b = ones({10});
  const int64_t runs = compiler::counters().graph_runs;
  opt_bar(a, b);
  opt_bar(a, -b);
  EXPECT_EQ(compiler::counters().graph_runs - runs, 4) << "bar ran compiled: two graphs per call";
  compiler::set_trace_dir("");
  return file;
}

TEST(CompileTrace, TheTutorialsBarRunRecordsThreeGraphsTwoBreaksAndEachOpsLine) {
  const std::string dir = temp_dir("kiln_trace");
  const std::string file = trace_bar_run(dir);
  ASSERT_EQ(fs::path(file).parent_path(), fs::path(dir));
  const auto events = read_events(file);
  ASSERT_FALSE(events.empty());
  EXPECT_EQ(events.front().value("event", ""), "trace_start");
  EXPECT_EQ(events.front().value("schema", 0), 1);
  EXPECT_EQ(events.front().value("pid", 0), static_cast<int>(::getpid()));
  double t = 0;
  for (const auto& e : events) {  // "t" never goes back; every event has a thread
    EXPECT_GE(e.value("t", -1.0), t) << e.dump().substr(0, 200);
    t = e.value("t", -1.0);
    EXPECT_TRUE(e.contains("thread"));
  }

  const auto entries = of_kind(events, "frame_entry");
  ASSERT_EQ(entries.size(), 1u);
  EXPECT_EQ(entries[0].value("function", ""), "bar");
  EXPECT_TRUE(entries[0]["recompile_reasons"].empty());
  EXPECT_FALSE(entries[0]["guards"].empty());
  const int frame = entries[0].value("frame", -1);

  const auto breaks = of_kind(events, "graph_break");
  ASSERT_EQ(breaks.size(), 2u);
  for (const auto& b : breaks) {
    EXPECT_TRUE(in_this_file(b)) << b.dump();
    EXPECT_EQ(b.value("line", 0), kBreakLine);
    EXPECT_NE(b.value("reason", "").find("Tensor::operator bool"), std::string::npos) << b.dump();
  }

  const auto graphs = of_kind(events, "graph");
  ASSERT_EQ(graphs.size(), 3u);
  // Per graph, (op, line) of each op in order.
  const std::vector<std::vector<std::pair<std::string, int>>> expected = {
      {{"abs", kDivLine}, {"add", kDivLine}, {"div", kDivLine}, {"sum", kBreakLine}, {"lt", kBreakLine}},
      {{"mul", kMulLine}},
      {{"mul", kNegLine}, {"mul", kMulLine}}};
  for (size_t g = 0; g < graphs.size(); ++g) {
    EXPECT_EQ(graphs[g].value("graph", ""), std::to_string(frame) + "/" + std::to_string(g));
    EXPECT_EQ(graphs[g].value("backend", ""), "kiln");
    std::vector<std::pair<std::string, int>> ops;
    for (const auto& row : graphs[g]["rows"]) {
      if (row.value("opcode", "") != "call_function") continue;
      EXPECT_TRUE(in_this_file(row)) << row.dump();
      ops.emplace_back(row.value("target", ""), row.value("line", 0));
    }
    EXPECT_EQ(ops, expected[g]) << "graph " << g;
    EXPECT_EQ(graphs[g].value("ops", 0), static_cast<int>(expected[g].size()));
  }

  // The compile's own events name its graph.
  std::set<std::string> compiled, with_passes, with_sources, with_kernels;
  for (const auto& e : of_kind(events, "graph_compiled")) {
    EXPECT_TRUE(e.value("ok", false));
    EXPECT_GE(e.value("seconds", -1.0), 0);
    compiled.insert(e.value("graph", ""));
  }
  for (const auto& e : of_kind(events, "pass")) with_passes.insert(e.value("graph", ""));
  for (const auto& e : of_kind(events, "source")) {
    EXPECT_EQ(e.value("language", ""), "c++");
    EXPECT_NE(e.value("text", "").find("extern \"C\""), std::string::npos);
    with_sources.insert(e.value("graph", ""));
  }
  for (const auto& e : of_kind(events, "kernel")) {
    EXPECT_TRUE(std::set<std::string>({"build", "hit", "loaded"}).count(e.value("result", ""))) << e.dump();
    with_kernels.insert(e.value("graph", ""));
  }
  const std::set<std::string> ids = {std::to_string(frame) + "/0", std::to_string(frame) + "/1",
                                     std::to_string(frame) + "/2"};
  EXPECT_EQ(compiled, ids);
  EXPECT_EQ(with_passes, ids);
  EXPECT_EQ(with_sources, ids);
  EXPECT_EQ(with_kernels, ids);
  EXPECT_FALSE(of_kind(events, "phase").empty());
  fs::remove_all(dir);
}

TEST(CompileTrace, ARecompileRecordsTheGuardThatFailed) {
  const std::string dir = temp_dir("kiln_trace");
  compiler::reset();
  const std::string file = compiler::set_trace_dir(dir);
  auto f = compile([](const Tensor& x) { return x * 2; }, {.backend = "eager", .name = "twice"});
  f(ones({4}));
  f(ones({4}, DType::float64));
  compiler::set_trace_dir("");
  const auto entries = of_kind(read_events(file), "frame_entry");
  ASSERT_EQ(entries.size(), 2u);
  EXPECT_TRUE(entries[0]["recompile_reasons"].empty());
  ASSERT_EQ(entries[1]["recompile_reasons"].size(), 1u);
  const std::string reason = entries[1]["recompile_reasons"][0];
  EXPECT_NE(reason.find("float"), std::string::npos) << reason;
  EXPECT_EQ(entries[1].value("entry", -1), 1);
  fs::remove_all(dir);
}

// A recompile limit names its function as the frame entries do, so the report files it under it.
TEST(CompileTrace, ARecompileLimitNamesItsFunctionAsItsEntriesDo) {
  const std::string dir = temp_dir("kiln_trace");
  compiler::reset();
  const std::string file = compiler::set_trace_dir(dir);
  auto f = compile([](const Tensor& x) { return x * 2; }, {.backend = "eager", .name = "once", .recompile_limit = 1});
  f(ones({4}));
  f(ones({4}, DType::float64));  // past the limit: runs eagerly
  compiler::set_trace_dir("");
  const auto events = read_events(file);
  const auto entries = of_kind(events, "frame_entry"), limits = of_kind(events, "recompile_limit");
  ASSERT_EQ(entries.size(), 1u);
  ASSERT_EQ(limits.size(), 1u);
  for (const char* key : {"frame", "function", "function_file", "function_line"})
    EXPECT_EQ(limits[0].value(key, nlohmann::json()), entries[0].value(key, nlohmann::json())) << key;
  EXPECT_EQ(limits[0].value("limit", 0), 1);
  fs::remove_all(dir);
}

TEST(CompileTrace, TheFileIsPrivateNewAndEndsWhenAsked) {
  const std::string parent = temp_dir("kiln_trace");
  const std::string dir = parent + "/made/here";  // created, 0700
  const std::string file = compiler::set_trace_dir(dir);
  EXPECT_EQ(compiler::trace_file(), file);
  struct stat st;
  ASSERT_EQ(::stat(dir.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0700u);
  ASSERT_EQ(::stat(file.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  // A second trace gets a file of its own; nothing is appended to the first after it ends.
  const auto lines_of = [](const std::string& path) { return read_events(path).size(); };
  const std::string second = compiler::set_trace_dir(dir);
  EXPECT_NE(second, file);
  const size_t first_lines = lines_of(file);
  compiler::reset();
  auto f = compile([](const Tensor& x) { return x + 1; }, {.backend = "eager"});
  f(ones({3}));
  EXPECT_EQ(lines_of(file), first_lines);
  EXPECT_GT(lines_of(second), 1u);
  compiler::set_trace_dir("");
  EXPECT_EQ(compiler::trace_file(), "");
  const size_t second_lines = lines_of(second);
  f(ones({5}));  // a recompile, with the trace off
  EXPECT_EQ(lines_of(second), second_lines);
  // A path that is a file is refused with a clear error.
  EXPECT_THROW(
      {
        try {
          compiler::set_trace_dir(file);
        } catch (const Error& e) {
          EXPECT_NE(std::string(e.what()).find("not a directory"), std::string::npos) << e.what();
          throw;
        }
      },
      Error);
  EXPECT_EQ(compiler::trace_file(), "");
  fs::remove_all(parent);
}

TEST(CompileTrace, EventsBeforeACrashAreKept) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  // The threadsafe style runs this test again in the child: it takes the parent's directory.
  const char* inherited = std::getenv("KILN_TEST_CRASH_TRACE_DIR");
  const std::string dir = inherited ? inherited : temp_dir("kiln_trace");
  ::setenv("KILN_TEST_CRASH_TRACE_DIR", dir.c_str(), 1);
  EXPECT_DEATH(
      {
        compiler::set_trace_dir(dir);
        auto f = compile([](const Tensor& x) { return (x * 2).sin(); }, {.backend = "eager", .name = "doomed"});
        f(ones({4}));
        std::abort();
      },
      "");
  ::unsetenv("KILN_TEST_CRASH_TRACE_DIR");
  std::vector<std::string> files;
  for (const auto& e : fs::directory_iterator(dir)) files.push_back(e.path());
  ASSERT_EQ(files.size(), 1u);
  const auto events = read_events(files[0]);
  const auto graphs = of_kind(events, "graph");
  ASSERT_EQ(graphs.size(), 1u);
  EXPECT_EQ(graphs[0].value("function", ""), "doomed");
  EXPECT_EQ(of_kind(events, "graph_compiled").size(), 1u);
  fs::remove_all(dir);
}

TEST(CompileTrace, ThreadsWriteWholeLines) {
  const std::string dir = temp_dir("kiln_trace");
  compiler::reset();
  const std::string file = compiler::set_trace_dir(dir);
  constexpr int kThreads = 4, kSizes = 12;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([t] {
      auto f = compile([](const Tensor& x) { return (x + 1).exp() * x; },
                       {.dynamic = false, .backend = "eager", .name = "worker" + std::to_string(t),
                        .recompile_limit = kSizes + 1});
      for (int n = 1; n <= kSizes; ++n) f(ones({n}));
    });
  }
  for (auto& th : threads) th.join();
  compiler::set_trace_dir("");
  const auto events = read_events(file);  // each line parses (read_events checks)
  EXPECT_EQ(of_kind(events, "graph").size(), static_cast<size_t>(kThreads * kSizes));
  std::set<int> threads_seen;
  for (const auto& e : of_kind(events, "graph")) threads_seen.insert(e.value("thread", -1));
  EXPECT_EQ(threads_seen.size(), static_cast<size_t>(kThreads));
  fs::remove_all(dir);
}

// ---- kiln report ----

struct CommandResult {
  int status = -1;
  std::string output;
};

CommandResult run(const std::string& command) {
  CommandResult r;
  FILE* pipe = ::popen((command + " 2>&1").c_str(), "r");
  if (!pipe) return r;
  char buffer[65536];
  size_t n;
  while ((n = std::fread(buffer, 1, sizeof buffer, pipe)) > 0) r.output.append(buffer, n);
  const int status = ::pclose(pipe);
  r.status = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

const std::string kKiln = std::string(KILN_BINARY_DIR) + "/bin/kiln";

std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

bool has_dot() { return run("command -v dot").status == 0; }

// Generated C++ kernels size their OpenMP team by the work, one thread per 32768 elements as
// eager's loops do, instead of opening the whole pool: the trace's source of a 40,000-element
// kernel asks for kiln_team(40000) threads (2), a 1,000-element one opens no parallel region, and
// both compute x * 2 + 1 at 8 threads.
TEST(CompileTrace, GeneratedKernelsSizeTheirThreadTeamByTheirWork) {
  const std::string dir = temp_dir("kiln_trace_team");
  compiler::reset();
  const int threads = get_num_threads();
  set_num_threads(8);
  const std::string file = compiler::set_trace_dir(dir);
  auto f = compile([](const Tensor& x) { return x * 2 + 1; }, {.dynamic = false, .backend = std::string("kiln")});
  for (int64_t n : {40000, 1000}) {
    Tensor x = randn({n});
    Tensor want = x * 2 + 1;
    const int64_t runs = compiler::counters().kernel_runs;
    Tensor got = f(x);
    EXPECT_GT(compiler::counters().kernel_runs, runs) << "a generated kernel ran";
    EXPECT_TRUE(allclose(got, want)) << n;
  }
  compiler::set_trace_dir("");
  set_num_threads(threads);
  std::vector<std::string> sources;
  for (const auto& e : of_kind(read_events(file), "source"))
    if (e.value("language", "") == "c++") sources.push_back(e.value("text", ""));
  ASSERT_EQ(sources.size(), 2u);
  EXPECT_NE(sources[0].find("#pragma omp parallel for simd num_threads(kiln_team(40000))"), std::string::npos)
      << sources[0];
  EXPECT_NE(sources[0].find("static inline int kiln_team(int64_t n)"), std::string::npos);
  EXPECT_EQ(sources[1].find("#pragma omp parallel"), std::string::npos) << sources[1];
}

TEST(CompileReport, ShowsTheBarRunsGraphsBreaksAndCode) {
  const std::string dir = temp_dir("kiln_report");
  trace_bar_run(dir + "/trace");
  const std::string html = dir + "/report.html";
  const CommandResult r = run(kKiln + " report " + dir + "/trace -o " + html);
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("3 graph compiles, 2 graph breaks"), std::string::npos) << r.output;
  const std::string page = slurp(html);
  EXPECT_NE(page.find("id=\"graph-count\">3<"), std::string::npos);
  EXPECT_NE(page.find("id=\"break-count\">2<"), std::string::npos);
  EXPECT_NE(page.find("id=\"recompile-count\">0<"), std::string::npos);
  const std::string break_site = "test_compile_trace.cpp:" + std::to_string(kBreakLine);
  size_t sites = 0;
  for (size_t at = page.find("<li class=\"break\">"); at != std::string::npos; at = page.find("<li class=\"break\">", at + 1))
    sites += page.substr(at, 400).find(break_site) != std::string::npos;
  EXPECT_EQ(sites, 2u);
  EXPECT_NE(page.find("test_compile_trace.cpp:" + std::to_string(kNegLine)), std::string::npos);
  EXPECT_NE(page.find("<span class=\"hl-kw\">"), std::string::npos) << "generated C++ is highlighted";
  EXPECT_EQ(page.find("<script"), std::string::npos);
  EXPECT_EQ(page.find("http://"), page.find("http://www.w3.org")) << "nothing fetched: only SVG namespaces";
  if (has_dot()) {
    size_t pictures = 0;
    for (size_t at = page.find("<div class=\"picture\"><svg"); at != std::string::npos;
         at = page.find("<div class=\"picture\"><svg", at + 1))
      ++pictures;
    EXPECT_EQ(pictures, 3u);
  } else {
    EXPECT_NE(page.find("Graphviz (dot) not found"), std::string::npos);
  }
  // Without Graphviz: the tables alone.
  const CommandResult plain = run(kKiln + " report " + dir + "/trace -o " + dir + "/plain.html --no-graphviz");
  ASSERT_EQ(plain.status, 0) << plain.output;
  const std::string plain_page = slurp(dir + "/plain.html");
  EXPECT_EQ(plain_page.find("<svg"), std::string::npos);
  EXPECT_NE(plain_page.find("<table class=\"nodes\">"), std::string::npos);
  fs::remove_all(dir);
}

TEST(CompileReport, TrustsNothingInATrace) {
  const std::string dir = temp_dir("kiln_report");
  const std::string evil = "<script>alert(1)</script>";
  nlohmann::json graph = {{"event", "graph"},
                          {"frame", 0},
                          {"function", evil},
                          {"graph", "0/0"},
                          {"ops", 1},
                          {"rows",
                           {{{"opcode", "placeholder"}, {"name", "x"}, {"outputs", {"x"}}, {"type", "f32[2]"}},
                            {{"opcode", "call_function"},
                             {"name", "a\" URL=\"javascript:alert(1)\" label=\"b"},  // DOT attributes, if unescaped
                             {"target", "</td></table><script>"},
                             {"inputs", {"x"}},
                             {"outputs", {"y"}},
                             {"file", evil},
                             {"line", "not a number"}},
                            {{"opcode", "output"}, {"inputs", {"y", 42}}}}}};
  {
    std::ofstream out(dir + "/evil.jsonl");
    out << nlohmann::json({{"event", "trace_start"}, {"schema", 1}, {"host", evil}}).dump() << "\n";
    out << graph.dump() << "\n";
    out << nlohmann::json({{"event", "graph_break"}, {"function", evil}, {"reason", evil}, {"line", 3}}).dump() << "\n";
    out << nlohmann::json({{"event", "from_the_future"}}).dump() << "\n";
    out << nlohmann::json({{"event", "source"}, {"graph", "0/0"}, {"text", "/* " + evil + " */ int x;"}}).dump() << "\n";
    out << "{\"event\": \"graph_compiled\", \"graph\": \"0/0\", \"ok\": tr";  // cut by a crash
  }
  const CommandResult r = run(kKiln + " report " + dir + " -o " + dir + "/report.html");
  ASSERT_EQ(r.status, 0) << r.output;
  const std::string page = slurp(dir + "/report.html");
  EXPECT_EQ(page.find("<script"), std::string::npos);
  EXPECT_NE(page.find("&lt;script&gt;alert(1)&lt;/script&gt;"), std::string::npos);
  EXPECT_EQ(page.find("xlink:href"), std::string::npos) << "a name cannot add DOT attributes (a link)";
  EXPECT_NE(page.find("1 line(s) could not be read"), std::string::npos);
  EXPECT_NE(page.find("did not finish"), std::string::npos);
  fs::remove_all(dir);
}

TEST(CompileReport, RefusesWhatIsNotATrace) {
  const std::string dir = temp_dir("kiln_report");
  {
    std::ofstream out(dir + "/other.jsonl");
    out << "{\"hello\": 1}\n";
  }
  CommandResult r = run(kKiln + " report " + dir + " -o " + dir + "/r.html");
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.output.find("not a Kiln compile trace"), std::string::npos) << r.output;
  r = run(kKiln + " report " + dir + "/missing -o " + dir + "/r.html");
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.output.find("neither a trace file nor a directory"), std::string::npos) << r.output;
  r = run(kKiln + " report " + dir);
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.output.find("usage: kiln report"), std::string::npos) << r.output;
  EXPECT_FALSE(fs::exists(dir + "/r.html"));
  fs::remove_all(dir);
}

// The page in a real browser: headless Chromium (Debian's `chromium`, which `scripts/install-deps
// --test` installs) loads it and the rendered DOM holds the bar run's numbers and lines.
TEST(CompileReport, RendersInHeadlessChromium) {
  if (const char* skip = std::getenv("KILN_NO_BROWSER"); skip && std::string(skip) == "1")
    GTEST_SKIP() << "KILN_NO_BROWSER=1 (a machine without a package registry for Chromium)";
  const CommandResult which = run("command -v chromium || command -v chromium-browser");
  ASSERT_EQ(which.status, 0) << "Chromium is not installed: `scripts/install-deps --test` installs it "
                                "(or set KILN_NO_BROWSER=1 where it cannot be installed).";
  std::string browser = which.output.substr(0, which.output.find('\n'));
  const std::string dir = temp_dir("kiln_report");
  trace_bar_run(dir + "/trace");
  ASSERT_EQ(run(kKiln + " report " + dir + "/trace -o " + dir + "/report.html").status, 0);
  // A profile directory of the test's own: Chromium must not touch the user's.
  const CommandResult dom = run("timeout 120 " + browser + " --headless --no-sandbox --disable-gpu --no-first-run --user-data-dir=" +
                      dir + "/profile --dump-dom file://" + dir + "/report.html");
  ASSERT_EQ(dom.status, 0) << dom.output.substr(0, 2000);
  auto cell = [&](const std::string& id) {
    std::smatch m;
    const std::regex re("id=\"" + id + "\">([^<]*)<");
    return std::regex_search(dom.output, m, re) ? m[1].str() : std::string("<missing>");
  };
  EXPECT_EQ(cell("graph-count"), "3");
  EXPECT_EQ(cell("break-count"), "2");
  EXPECT_EQ(cell("recompile-count"), "0");
  const std::regex break_item("<li class=\"break\"><span class=\"site\">[^<]*test_compile_trace\\.cpp:" +
                              std::to_string(kBreakLine) + "</span>");
  EXPECT_EQ(std::distance(std::sregex_iterator(dom.output.begin(), dom.output.end(), break_item), std::sregex_iterator()), 2);
  std::set<std::string> ids;
  const std::regex graph_id("<code class=\"graph-id\">([0-9]+/[0-9]+)</code>");
  for (auto it = std::sregex_iterator(dom.output.begin(), dom.output.end(), graph_id); it != std::sregex_iterator(); ++it)
    ids.insert((*it)[1].str());
  EXPECT_EQ(ids.size(), 3u);
  fs::remove_all(dir);
}

}  // namespace
