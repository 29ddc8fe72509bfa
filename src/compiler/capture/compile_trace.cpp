// The structured compile trace's writer (compile_trace.h, docs/compile-trace.md).
#include "compiler/capture/compile_trace.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <mutex>

#include "compiler/capture/runtime.h"
#include "core/layer_hooks.h"
#include "kiln/compiler.h"
#include "kiln/error.h"

#ifndef KILN_VERSION
#define KILN_VERSION "unknown"
#endif

namespace kiln::compiler {

namespace detail {

std::atomic<bool> g_compile_trace_on{false};

namespace {

using Clock = std::chrono::steady_clock;

struct TraceWriter {
  std::mutex mutex;
  int fd = -1;
  std::string path;
  Clock::time_point start;
};

TraceWriter& writer() {
  static TraceWriter* w = new TraceWriter;  // never destroyed: events may come from static destructors
  return *w;
}

std::atomic<int> g_next_thread{0};
thread_local int t_thread = -1;
thread_local const std::string* t_graph = nullptr;

int thread_number() {
  if (t_thread < 0) t_thread = g_next_thread.fetch_add(1, std::memory_order_relaxed);
  return t_thread;
}

// Writes all of `line` with one write(2) where the kernel allows (O_APPEND: other writers of the
// file cannot interleave inside it).
bool write_all(int fd, const std::string& line) {
  size_t done = 0;
  while (done < line.size()) {
    ssize_t n = ::write(fd, line.data() + done, line.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    done += static_cast<size_t>(n);
  }
  return true;
}

std::string dump(const nlohmann::json& j) {
  // Strings from the user's program (names, messages, sources) need not be UTF-8.
  return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

// Opens a new trace file in `dir`: created (0700) when missing, the file created 0600 with
// O_EXCL | O_NOFOLLOW, so a name planted by someone else is never written through. Throws.
int open_trace_file(const std::string& dir, std::string& path) {
  KILN_CHECK(!dir.empty(), ValueError, "[kiln::compile] the trace directory is empty.");
  std::error_code error;
  if (!std::filesystem::exists(dir, error)) {
    std::filesystem::create_directories(dir, error);
    if (error)
      throw Error("[kiln::compile] cannot create the trace directory '" + dir + "': " + error.message() + ".");
    ::chmod(dir.c_str(), 0700);
  }
  KILN_CHECK(std::filesystem::is_directory(dir, error), ValueError,
             "[kiln::compile] the trace directory '" + dir + "' is not a directory.");
  const auto stamp = std::chrono::duration_cast<std::chrono::milliseconds>(
                         std::chrono::system_clock::now().time_since_epoch())
                         .count();
  for (int attempt = 0; attempt < 100; ++attempt) {
    path = dir;
    path += "/kiln_trace.";
    path += std::to_string(::getpid());
    path += '.';
    path += std::to_string(stamp);
    if (attempt > 0) {
      path += '.';
      path += std::to_string(attempt);
    }
    path += ".jsonl";
    int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_APPEND | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (fd >= 0) return fd;
    if (errno != EEXIST)
      throw Error("[kiln::compile] cannot create the trace file '" + path + "': " + std::strerror(errno) + ".");
  }
  throw Error("[kiln::compile] cannot create a trace file in '" + dir + "': every name is taken.");
}

// Closes the trace (caller holds w.mutex).
void close_locked(TraceWriter& w) {
  g_compile_trace_on.store(false, std::memory_order_relaxed);
  if (w.fd >= 0) ::close(w.fd);
  w.fd = -1;
  w.path.clear();
}

std::string start_locked(TraceWriter& w, const std::string& dir) {
  close_locked(w);
  std::string path;
  const int fd = open_trace_file(dir, path);
  w.fd = fd;
  w.path = path;
  w.start = Clock::now();
  char host[256] = {};
  ::gethostname(host, sizeof host - 1);
  std::error_code error;
  nlohmann::json header = {{"event", "trace_start"},
                           {"t", 0.0},
                           {"thread", thread_number()},
                           {"schema", kCompileTraceSchema},
                           {"kiln_version", KILN_VERSION},
                           {"pid", ::getpid()},
                           {"host", host},
                           {"cwd", std::filesystem::current_path(error).string()},
                           {"started", utc_now()}};
  if (!write_all(fd, dump(header) + "\n")) {
    close_locked(w);
    throw Error("[kiln::compile] cannot write the trace file '" + path + "': " + std::strerror(errno) + ".");
  }
  g_compile_trace_on.store(true, std::memory_order_relaxed);
  return path;
}

// KILN_TRACE_DIR at start-up: a trace that cannot start is a warning, not a failed program.
[[maybe_unused]] const bool g_trace_from_env = [] {
  const char* dir = std::getenv("KILN_TRACE_DIR");
  if (dir == nullptr || *dir == '\0') return false;
  TraceWriter& w = writer();
  std::lock_guard lock(w.mutex);
  try {
    start_locked(w, dir);
  } catch (const std::exception& e) {
    kiln::detail::log_warning(std::string("KILN_TRACE_DIR: no compile trace: ") + e.what());
  }
  return true;
}();

}  // namespace

void trace_event(std::string_view name, nlohmann::json fields) {
  if (!compile_trace_on()) return;
  try {
    TraceWriter& w = writer();
    nlohmann::json event = nlohmann::json::object();
    event["event"] = name;
    event["thread"] = thread_number();
    if (t_graph && !fields.contains("graph")) event["graph"] = *t_graph;
    if (fields.is_object())
      for (auto& [key, value] : fields.items()) event[key] = std::move(value);
    std::lock_guard lock(w.mutex);
    if (w.fd < 0) return;
    event["t"] = std::chrono::duration<double>(Clock::now() - w.start).count();
    if (!write_all(w.fd, dump(event) + "\n")) {
      const std::string path = w.path;
      const int error = errno;
      close_locked(w);
      kiln::detail::log_warning("the compile trace '" + path + "' stopped: " + std::strerror(error) + ".");
    }
  } catch (const std::exception& e) {  // an event must never fail the compile it describes
    kiln::detail::log_warning(std::string("a compile trace event was lost: ") + e.what());
  }
}

TraceGraphScope::TraceGraphScope(std::string id) : id_(std::move(id)), outer_(t_graph) { t_graph = &id_; }
TraceGraphScope::~TraceGraphScope() { t_graph = outer_; }

std::string trace_graph_id() { return t_graph ? *t_graph : std::string(); }

std::string utc_now() {
  std::time_t now = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&now, &tm);
  char text[32];
  std::strftime(text, sizeof text, "%Y-%m-%dT%H:%M:%SZ", &tm);
  return text;
}

nlohmann::json function_json(const FunctionState& st) {
  return {{"frame", st.frame_id}, {"function", st.name}, {"function_file", st.file}, {"function_line", st.line}};
}

const char* mode_name(Mode mode) {
  switch (mode) {
    case Mode::default_: break;
    case Mode::reduce_overhead: return "reduce-overhead";
    case Mode::max_autotune: return "max-autotune";
    case Mode::max_autotune_no_cudagraphs: return "max-autotune-no-cudagraphs";
  }
  return "default";
}

std::optional<Mode> mode_from_name(std::string_view name) {
  for (Mode m : {Mode::default_, Mode::reduce_overhead, Mode::max_autotune, Mode::max_autotune_no_cudagraphs})
    if (name == mode_name(m)) return m;
  return std::nullopt;
}

nlohmann::json call_site_json(const CallSite& site) {
  if (!site.known()) return nlohmann::json::object();
  return {{"file", relative_path(site.file)}, {"line", site.line}, {"function", site.function}};
}

}  // namespace detail

std::string set_trace_dir(const std::string& dir) {
  detail::TraceWriter& w = detail::writer();
  std::lock_guard lock(w.mutex);
  if (dir.empty()) {
    detail::close_locked(w);
    return {};
  }
  return detail::start_locked(w, dir);
}

std::string trace_file() {
  detail::TraceWriter& w = detail::writer();
  std::lock_guard lock(w.mutex);
  return w.path;
}

}  // namespace kiln::compiler
