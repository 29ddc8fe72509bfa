#include "core/profiler.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>
#include <sstream>
#include <vector>

#include <unistd.h>

#include <fstream>
#include <nlohmann/json.hpp>

#include "kiln/error.h"
#include "kiln/threading.h"

namespace kiln {

namespace detail {

namespace {
struct Entry {
  int64_t calls = 0;
  double seconds = 0;
};
std::mutex g_mutex;
std::map<std::string, Entry>& table() {
  static auto* t = new std::map<std::string, Entry>();
  return *t;
}
bool env_enabled() {
  const char* v = std::getenv("KILN_PROFILE");
  return v && std::string(v) == "1";
}
// KILN_PROFILE=<path>.json: the timeline's path.
std::string env_trace_path() {
  const char* v = std::getenv("KILN_PROFILE");
  const std::string s = v ? v : "";
  return s.size() > 5 && s.compare(s.size() - 5, 5, ".json") == 0 ? s : "";
}

struct TraceEvent {
  std::string name;
  const char* category;
  double start_us, duration_us;
  int tid;
};
// A GPU span whose events have not been read yet.
struct PendingDeviceSpan {
  std::string name;
  const char* category;
  int device;
  void* span;
};
struct Trace {
  std::mutex mutex;
  std::string path;
  std::vector<TraceEvent> events;
  std::vector<PendingDeviceSpan> device_spans;
  std::chrono::steady_clock::time_point origin = std::chrono::steady_clock::now();
};
Trace& trace() {
  static auto* t = new Trace;  // leaked: written by a static destructor
  return *t;
}
std::atomic<int> g_next_tid{1};
int thread_number() {
  thread_local const int n = g_next_tid.fetch_add(1);
  return n;
}

// The timeline's track of a GPU: tids from here on (host threads count up from 1).
constexpr int kDeviceTidBase = 1000000;

// Moves finished GPU spans into the events (all of them when `wait`). Caller holds t.mutex.
void read_device_spans(Trace& t, bool wait) {
  if (t.device_spans.empty() || !device_timer_hooks.read) return;
  size_t kept = 0;
  for (size_t i = 0; i < t.device_spans.size(); ++i) {
    PendingDeviceSpan& p = t.device_spans[i];
    std::chrono::steady_clock::time_point start;
    double seconds = 0;
    const auto read = device_timer_hooks.read(p.span, wait, &start, &seconds);
    if (read == DeviceTimerHooks::Read::pending) {
      if (kept != i) t.device_spans[kept] = std::move(p);
      ++kept;
      continue;
    }
    if (read == DeviceTimerHooks::Read::done)
      t.events.push_back({std::move(p.name), p.category,
                          std::chrono::duration<double, std::micro>(start - t.origin).count(), seconds * 1e6,
                          kDeviceTidBase + p.device});
  }
  t.device_spans.resize(kept);
}

}  // namespace

DeviceTimerHooks device_timer_hooks;

std::atomic<bool> g_tracing{false};
std::atomic<bool> g_op_profiling{env_enabled()};

void record_trace(const std::string& name, const char* category, std::chrono::steady_clock::time_point start,
                  double seconds) {
  Trace& t = trace();
  const int tid = thread_number();
  std::lock_guard lock(t.mutex);
  if (!g_tracing.load(std::memory_order_relaxed)) return;
  t.events.push_back({name, category, std::chrono::duration<double, std::micro>(start - t.origin).count(), seconds * 1e6, tid});
}

int traced_device(std::span<const Tensor> inputs, std::span<const Tensor> outputs) {
  if (!g_tracing.load(std::memory_order_relaxed)) return -1;
  for (std::span<const Tensor> list : {inputs, outputs})
    for (const Tensor& t : list)
      if (t.defined() && t.is_cuda()) return t.device().index;
  return -1;
}

void record_device_span(const std::string& name, const char* category, int device, void* span) {
  Trace& t = trace();
  std::lock_guard lock(t.mutex);
  if (!g_tracing.load(std::memory_order_relaxed)) {
    std::chrono::steady_clock::time_point start;
    double seconds;
    device_timer_hooks.read(span, true, &start, &seconds);  // releases it
    return;
  }
  t.device_spans.push_back({name, category, device, span});
  // Each span holds two CUDA events: read the finished ones now and then, not all at the end.
  if (t.device_spans.size() % 4096 == 0) read_device_spans(t, false);
}

void collect_device_spans() {
  Trace& t = trace();
  std::lock_guard lock(t.mutex);
  read_device_spans(t, /*wait=*/true);
}

void start_trace(const std::string& path) {
  Trace& t = trace();
  {
    std::lock_guard lock(t.mutex);
    t.path = path;
    read_device_spans(t, /*wait=*/true);  // a previous trace's, released
    t.events.clear();
    t.origin = std::chrono::steady_clock::now();
  }
  g_tracing.store(true);
  g_op_profiling.store(true);  // OpTimer times ops only while profiling
}

void write_trace() {
  Trace& t = trace();
  std::lock_guard lock(t.mutex);
  if (!g_tracing.exchange(false)) return;
  g_op_profiling.store(env_enabled());
  read_device_spans(t, /*wait=*/true);
  const int pid = static_cast<int>(::getpid());
  nlohmann::json events = nlohmann::json::array();
  std::vector<int> tids;
  for (const TraceEvent& e : t.events) {
    events.push_back({{"name", e.name}, {"cat", e.category}, {"ph", "X"}, {"ts", e.start_us}, {"dur", e.duration_us},
                      {"pid", pid}, {"tid", e.tid}});
    if (std::find(tids.begin(), tids.end(), e.tid) == tids.end()) tids.push_back(e.tid);
  }
  auto thread_name = [](int tid) {
    if (tid >= kDeviceTidBase) return "GPU " + std::to_string(tid - kDeviceTidBase) + ": device time";
    return tid == 1 ? std::string("kiln: first thread") : "kiln: thread " + std::to_string(tid);
  };
  for (int tid : tids)
    events.push_back({{"name", "thread_name"}, {"ph", "M"}, {"pid", pid}, {"tid", tid}, {"args", {{"name", thread_name(tid)}}}});
  nlohmann::json doc = {{"traceEvents", std::move(events)}, {"displayTimeUnit", "ms"}};
  std::ofstream out(t.path);
  out << doc.dump() << "\n";
  if (!out) std::fprintf(stderr, "[kiln] cannot write the trace to %s\n", t.path.c_str());
  t.events.clear();
}

namespace {
[[maybe_unused]] const bool g_trace_from_env = [] {
  if (const std::string path = env_trace_path(); !path.empty()) start_trace(path);
  return true;
}();
}  // namespace

void record_op_time(const std::string& op, double seconds) {
  std::lock_guard lock(g_mutex);
  Entry& e = table()[op];
  e.calls++;
  e.seconds += seconds;
}

namespace {
// Prints the table at exit when the environment variable turned profiling on.
struct ReportAtExit {
  ~ReportAtExit() {
    if (env_enabled()) std::fputs(op_profile_report().c_str(), stderr);
    write_trace();
  }
} g_report_at_exit;
}  // namespace

}  // namespace detail

void set_op_profiling(bool enabled) { detail::g_op_profiling.store(enabled, std::memory_order_relaxed); }

void reset_op_profile() {
  std::lock_guard lock(detail::g_mutex);
  detail::table().clear();
}

std::string op_profile_report() {
  std::vector<std::pair<std::string, detail::Entry>> rows;
  {
    std::lock_guard lock(detail::g_mutex);
    rows.assign(detail::table().begin(), detail::table().end());
  }
  std::sort(rows.begin(), rows.end(), [](auto& a, auto& b) { return a.second.seconds > b.second.seconds; });
  double total = 0;
  for (auto& r : rows) total += r.second.seconds;
  std::ostringstream out;
  char line[160];
  std::snprintf(line, sizeof line, "%-32s %10s %12s %8s\n", "op (eager, incl. nested ops)", "calls", "total ms", "share");
  out << line;
  for (auto& [name, e] : rows) {
    std::snprintf(line, sizeof line, "%-32s %10lld %12.2f %7.1f%%\n", name.c_str(), static_cast<long long>(e.calls),
                  e.seconds * 1e3, total > 0 ? 100.0 * e.seconds / total : 0.0);
    out << line;
  }
  return out.str();
}

}  // namespace kiln
