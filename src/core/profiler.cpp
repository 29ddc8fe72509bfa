#include "core/profiler.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>
#include <sstream>
#include <vector>

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
}  // namespace

std::atomic<bool> g_op_profiling{env_enabled()};

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
