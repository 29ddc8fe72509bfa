// The timeline (KILN_PROFILE=<path>.json, src/core/profiler.h): a Chrome trace of eager ops,
// generated kernels, compiled graph runs and compile phases, checked against the Trace Event
// Format's rules for complete ("X") and metadata ("M") events and against compile_times().
#include <gtest/gtest.h>
#include <stdlib.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <string>

#include "core/profiler.h"
#include "kiln/kiln.h"

using namespace kiln;

namespace {

namespace fs = std::filesystem;

// The Trace Event Format's required fields, per event type (what ui.perfetto.dev and
// chrome://tracing read): a complete event has a name, a category, ts and dur in microseconds
// (dur >= 0), pid and tid; a thread_name metadata event names its tid.
::testing::AssertionResult valid_trace(const nlohmann::json& doc) {
  if (!doc.is_object() || !doc.contains("traceEvents") || !doc["traceEvents"].is_array())
    return ::testing::AssertionFailure() << "no traceEvents array";
  if (doc.value("displayTimeUnit", "") != "ms" && doc.value("displayTimeUnit", "") != "ns")
    return ::testing::AssertionFailure() << "displayTimeUnit must be ms or ns";
  std::set<int> tids, named;
  for (const nlohmann::json& e : doc["traceEvents"]) {
    if (!e.is_object() || !e.contains("ph") || !e["ph"].is_string() || !e.contains("name") || !e["name"].is_string() ||
        !e.contains("pid") || !e["pid"].is_number_integer() || !e.contains("tid") || !e["tid"].is_number_integer())
      return ::testing::AssertionFailure() << "an event lacks ph, name, pid or tid: " << e.dump();
    const std::string ph = e["ph"];
    if (ph == "X") {
      if (!e.contains("ts") || !e["ts"].is_number() || !e.contains("dur") || !e["dur"].is_number() ||
          e["dur"].get<double>() < 0 || !e.contains("cat") || !e["cat"].is_string())
        return ::testing::AssertionFailure() << "a complete event needs ts, dur >= 0 and cat: " << e.dump();
      tids.insert(e["tid"].get<int>());
    } else if (ph == "M") {
      if (e["name"] != "thread_name" || !e.contains("args") || !e["args"].contains("name"))
        return ::testing::AssertionFailure() << "a metadata event must name a thread: " << e.dump();
      named.insert(e["tid"].get<int>());
    } else {
      return ::testing::AssertionFailure() << "unexpected event type " << ph;
    }
  }
  if (tids != named) return ::testing::AssertionFailure() << "every thread with events is named once";
  return ::testing::AssertionSuccess();
}

// The timeline of three inference calls of `compiled` on `x` (the first may compile), with `first`
// run before them inside it; `runs` gets the graph runs the calls made.
template <class Compiled>
nlohmann::json timeline_of_calls(const std::string& path, Compiled& compiled, const Tensor& x, int64_t& runs,
                                 const std::function<void()>& first = {}) {
  kiln::detail::start_trace(path);
  if (first) first();
  const auto before = compiler::counters();
  {
    NoGradGuard no_grad;
    for (int i = 0; i < 3; ++i) compiled(x);
  }
  runs = compiler::counters().graph_runs - before.graph_runs;
  kiln::detail::write_trace();
  std::ifstream in(path);
  return nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
}

// The compile spans' totals per phase (microseconds) against compiler::compile_time_table(): the
// same phases, each with the same seconds.
::testing::AssertionResult phases_match_compile_times(const std::map<std::string, double>& compile_us) {
  const std::vector<compiler::PhaseTimes> table = compiler::compile_time_table();
  if (table.empty()) return ::testing::AssertionFailure() << "compile_times() has no phases";
  for (const compiler::PhaseTimes& row : table) {
    double seconds = 0;
    for (double s : row.seconds) seconds += s;
    auto it = compile_us.find(row.phase);
    const double traced = it == compile_us.end() ? 0 : it->second * 1e-6;
    if (std::abs(traced - seconds) > 1e-5)
      return ::testing::AssertionFailure() << row.phase << ": " << traced << " s traced, " << seconds << " s reported";
  }
  if (compile_us.size() != table.size())
    return ::testing::AssertionFailure() << compile_us.size() << " phases traced, " << table.size() << " reported";
  return ::testing::AssertionSuccess();
}

TEST(Trace, ACompiledModelsTimelineHoldsGraphRunsKernelsOpsAndCompilePhases) {
  std::string dir = "/tmp/kiln-trace-test-XXXXXX";
  ASSERT_NE(mkdtemp(dir.data()), nullptr);
  const std::string path = dir + "/trace.json";
  compiler::reset();
  manual_seed(0);
  auto model = std::make_shared<nn::Sequential>();
  model->push_back(std::make_shared<nn::Conv2d>(nn::Conv2dOptions{.in_channels = 3, .out_channels = 8, .kernel_size = 3, .padding = 1}));
  model->push_back(std::make_shared<nn::ReLU>());
  model->push_back(std::make_shared<nn::Conv2d>(nn::Conv2dOptions{.in_channels = 8, .out_channels = 4, .kernel_size = 3, .padding = 1}));
  model->eval();
  auto compiled = compile(model, {.backend = std::string("kiln")});
  Tensor x = randn({2, 3, 16, 16});
  int64_t runs = 0;
  const nlohmann::json doc = timeline_of_calls(path, compiled, x, runs, [&] {
    Tensor eager = relu(x).sum();  // eager ops are on the timeline too
  });
  ASSERT_TRUE(valid_trace(doc));

  std::map<std::string, int> by_category;
  std::map<std::string, double> compile_us;
  for (const nlohmann::json& e : doc["traceEvents"]) {
    if (e["ph"] != "X") continue;
    by_category[e["cat"]]++;
    if (e["cat"] == "compile") compile_us[e["name"]] += e["dur"].get<double>();
  }
  EXPECT_EQ(by_category["graph"], runs);
  EXPECT_GT(runs, 0);
  EXPECT_GE(by_category["kernel"], runs) << "the generated kernels of each run";
  EXPECT_GE(by_category["op"], 2) << "relu and sum, eagerly";
  // Every compile phase compile_times() reports is on the timeline with the same total.
  EXPECT_TRUE(phases_match_compile_times(compile_us));
  // Writing stops the timeline: nothing more is recorded.
  EXPECT_FALSE(kiln::detail::g_tracing.load());
  std::error_code ec;
  fs::remove_all(dir, ec);
}

// Issue 24's figure: a compiled DenseNet-121 inference's timeline (its compile included) is valid
// Chrome-trace JSON with a span per graph run, and its compile spans total what
// compiler::compile_times() reports, phase by phase.
TEST(Trace, ACompiledDenseNetInferencesTimelineAgreesWithCompileTimes) {
  std::string dir = "/tmp/kiln-trace-test-XXXXXX";
  ASSERT_NE(mkdtemp(dir.data()), nullptr);
  const std::string path = dir + "/densenet.json";
  compiler::reset();
  manual_seed(0);
  auto net = models::densenet121({.num_classes = 10});
  net->eval();
  auto compiled = compile(net, {.backend = std::string("kiln")});
  Tensor x = randn({2, 3, 32, 32});
  int64_t runs = 0;
  const nlohmann::json doc = timeline_of_calls(path, compiled, x, runs);
  ASSERT_TRUE(valid_trace(doc));
  int graph_spans = 0;
  std::map<std::string, double> compile_us;
  for (const nlohmann::json& e : doc["traceEvents"]) {
    if (e["ph"] != "X") continue;
    if (e["cat"] == "graph") ++graph_spans;
    if (e["cat"] == "compile") compile_us[e["name"]] += e["dur"].get<double>();
  }
  EXPECT_GT(runs, 0);
  EXPECT_EQ(graph_spans, runs);
  EXPECT_TRUE(phases_match_compile_times(compile_us)) << "the compile ran inside the timeline";
  std::error_code ec;
  fs::remove_all(dir, ec);
}

}  // namespace
